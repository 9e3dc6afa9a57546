"""The chain asks every step that has a ``status`` for its items, commands included (``review export``,
``review ingest``, ``score change``), and a step whose counts only explain (a review: people's work) is
asked only by ``--explain`` (jobs.chain._data_status; issue 44). Reads only; runs no job."""
from __future__ import annotations

import io


from jobs.chain import _data_status, _parser_for
from operators.io import lineage
from operators.io.storage import Store
from operators.io.tables import write_table_shard
from operators.language.caption_ops import TABLE_SCHEMAS
from operators.review.items import review_items


def captions(text: str, run_id: str) -> list[dict]:
    return [{"pair_id": p, "candidate_index": 0, "perspective": "overall", "caption": f"{text} {p}", "overall": 8.0,
             "selected": True, "lineage": lineage.dumps({"mask": p}), "run_id": run_id} for p in ("a", "b")]


def status(step: str, values: dict, explain: bool = True):
    module, command, parser = _parser_for(step)
    return _data_status(module, command, parser, step, values, explain)


def test_the_review_export_step_is_counted_by_its_sample_and_only_to_explain(tmp_path):
    src, review = tmp_path / "captions", tmp_path / "review"
    write_table_shard(Store(str(src)), "captions", captions("old", "20260101T000000-aaaaaa"), TABLE_SCHEMAS["captions"],
                      "20260101T000000-aaaaaa")
    from operators.review.outputs import read_current
    sample = review_items("captions", read_current(Store(str(src)), "captions"), None)
    buf = io.BytesIO()
    sample.to_parquet(buf)
    Store(str(review)).write_bytes("sample.parquet", buf.getvalue())
    values = {"input": str(src), "output": str(review)}
    assert lineage.status_line(status("review export", values)) == "2 current, 0 stale, 0 missing, 0 failed"
    redone = [r for r in captions("new", "20260102T000000-bbbbbb") if r["pair_id"] == "b"]
    write_table_shard(Store(str(src)), "captions", redone, TABLE_SCHEMAS["captions"], "20260102T000000-bbbbbb")
    s = status("review export", values)
    assert lineage.status_line(s) == "1 current, 1 stale (caption 1: b#0), 0 missing, 0 failed"
    assert s["needs_run"] is False
    assert status("review export", values, explain=False) is None      # each chain run does not ask


def test_a_score_command_step_is_asked_on_every_run(tmp_path):
    from tests.conftest import DATA
    values = {"pred": str(DATA / "levir-cd" / "label"), "masks": str(DATA / "levir-cd" / "label"),
              "output": str(tmp_path / "score")}
    s = status("score change", values, explain=False)
    assert (s["current"], s["missing"], s["needs_run"]) == (0, 11, True)
