"""What a report was made from, per pair (operators.report.made_from), and the report step's status against
today's tables (jobs.report.status): a pair whose captions were redone since the report is stale by
caption, one the report does not count yet missing; a report written before it was recorded counts its
pairs as without lineage and does not make the step run (issue 44)."""
from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa

from operators.io import lineage
from operators.io.storage import Store
from operators.io.tables import write_table_shard
from operators.report.made_from import pair_lineage

CAPTIONS = pa.schema([("pair_id", pa.string()), ("candidate_index", pa.int64()), ("perspective", pa.string()),
                      ("caption", pa.string()), ("overall", pa.float64()), ("selected", pa.bool_()),
                      ("run_id", pa.string())])


def caps(rows):
    return pd.DataFrame([{"pair_id": p, "candidate_index": i, "perspective": "overall", "caption": c, "overall": 8.0,
                          "selected": True} for p, i, c in rows])


def test_a_pair_s_digest_changes_with_its_rows_and_only_its_rows():
    a = pair_lineage({"captions": {"captions": caps([("p", 0, "x"), ("p", 1, "y"), ("q", 0, "z")])}})
    b = pair_lineage({"captions": {"captions": caps([("p", 1, "y"), ("p", 0, "x"), ("q", 0, "z2")])}})
    assert set(a) == {"p", "q"} and a["p"] == b["p"] and a["q"] != b["q"]     # row order aside
    assert set(a["p"]) == {"captions"} and len(a["p"]["captions"]) == 16
    reviewed = pair_lineage({"review": pd.DataFrame([{"pair_id": "p", "item_id": "p#0", "status": "reviewed",
                                                      "verdict": "correct"}])})
    assert set(reviewed["p"]) == {"review"}
    assert lineage.CAUSES["review"] == "review" and lineage.CAUSES["captions"] == "caption"


def test_the_report_status_counts_pairs_redone_since_the_report(tmp_path):
    from jobs.report import load_inputs, parse_args, status
    src, out = tmp_path / "captions", tmp_path / "report"
    write_table_shard(Store(str(src)), "captions", caps([("p", 0, "x"), ("q", 0, "z")]).to_dict("records"),
                      CAPTIONS, "20260101T000000-aaaaaa")
    cfg = parse_args(["--input", str(src), "--output", str(out)])
    assert lineage.status_line(status(cfg)) == "0 current, 0 stale, 2 missing (p, q), 0 failed"
    out.mkdir()
    (out / "stats.json").write_text(json.dumps({"inputs": {}}))                # a report made before lineage
    s = status(cfg)
    assert (s["unrecorded"], s["needs_run"]) == (2, False)
    (out / "stats.json").write_text(json.dumps({"made_from": pair_lineage(load_inputs([str(src)]))}))
    assert lineage.status_line(status(cfg)) == "2 current, 0 stale, 0 missing, 0 failed"
    write_table_shard(Store(str(src)), "captions", caps([("q", 0, "z redone"), ("r", 0, "new")]).to_dict("records"),
                      CAPTIONS, "20260102T000000-bbbbbb")
    s = status(cfg)
    assert lineage.status_line(s) == "1 current, 1 stale (caption 1: q), 1 missing (r), 0 failed"
    assert s["needs_run"] is True
