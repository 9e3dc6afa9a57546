"""Fixtures of the review and report tests: a real captions output (the captions job run against the
OpenAI-compatible test server on the repository's LEVIR-CD crops), a QA table in the QA job's shape,
a pairs-job table set (the Label Studio server is the session's, in tests/conftest.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
LEVIR = REPO / "data" / "levir-cd"


@pytest.fixture(scope="session")
def captions_output(ray_session, openai_test_server_process, tmp_path_factory):
    """The captions job's output for data/levir-cd (11 pairs captioned, 1 error row: no mask)."""
    import os
    from jobs.caption import CaptionJobConfig, run
    server = openai_test_server_process
    server.configure(latency_ms=0, reject_json_schema=False, faults=[])
    out = tmp_path_factory.mktemp("captions") / "out"
    from tests.conftest import own_llm_namespace
    old = os.environ.get("OPENAI_API_KEY")
    os.environ["OPENAI_API_KEY"] = "test-key"
    try:
        with own_llm_namespace("review-captions"):   # limiters of its own, not the account's default
            run(CaptionJobConfig(input=str(LEVIR), output=str(out), model="test-model", base_url=server.base_url,
                                 timeout_s=5.0, max_retries=2, actors=1, concurrent_batches=4, batch_size=4,
                                 progress_every_s=5.0, price_per_mtok_in=0.5, price_per_mtok_out=1.5))
    finally:
        if old is None:
            os.environ.pop("OPENAI_API_KEY", None)
        else:
            os.environ["OPENAI_API_KEY"] = old
    return out


def reviewer_result(verdict, categories=(), corrected=None):
    """An annotation's ``result`` as Label Studio stores it for the review's labeling config."""
    result = [{"from_name": "verdict", "to_name": "text", "type": "choices", "value": {"choices": [verdict]}}]
    if categories:
        result.append({"from_name": "error_category", "to_name": "text", "type": "choices",
                       "value": {"choices": list(categories)}})
    if corrected:
        result.append({"from_name": "corrected", "to_name": "text", "type": "textarea", "value": {"text": [corrected]}})
    return result


QA_TYPES = ("YES/NO", "WHAT", "WHERE", "HOW MUCH", "BEFORE/AFTER", "CAUSE", "DETAIL", "COMPARE")


def write_parquet_shard(folder: Path, rows: list[dict], name: str = "part-r1-000.parquet") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), folder / name)


def make_qa_output(folder: Path, pair_rows: list[dict], seed: int = 0) -> Path:
    """A QA job output in the announced shape (qa/, pairs/, usage/), five QA pairs per pair, with an
    older duplicate run of one row to check that readers keep the latest."""
    rng = np.random.default_rng(seed)
    qa = []
    for p in pair_rows:
        types = rng.choice(QA_TYPES, size=5, replace=False)
        for i, qt in enumerate(types):
            scores = rng.integers(3, 11, size=4)
            overall = float(rng.integers(3, 11))
            qa.append({"pair_id": p["pair_id"], "filename": p["filename"], "split": p["split"], "qa_index": i,
                       "question_type": str(qt), "question": " ".join(["word"] * int(rng.integers(5, 15))) + "?",
                       "answer": " ".join(["answer"] * int(rng.integers(6, 30))) + ".",
                       "score_answer_accuracy": int(scores[0]), "score_question_quality": int(scores[1]),
                       "score_answer_completeness": int(scores[2]), "score_redundancy": int(scores[3]),
                       "overall": overall, "selected": bool(overall >= 7), "reason": "r",
                       "validator_ok": True, "validator_violations": "[]",
                       "prompt_version_generate": "qa_generate.v1", "prompt_version_judge": "qa_judge.v1",
                       "model": "m", "judge_model": "j", "run_id": "20260101T000002-bbbbbb"})
    # One pair the grounded validators rejected before judging: no score.
    qa[7].update(overall=None, selected=False, validator_ok=False, validator_violations='["copied a percentage"]')
    stale = dict(qa[0], overall=1.0, selected=False, run_id="20260101T000001-aaaaaa")
    write_parquet_shard(folder / "qa", qa)
    write_parquet_shard(folder / "qa", [stale], "part-old-000.parquet")
    write_parquet_shard(folder / "pairs", [{k: p[k] for k in ("pair_id", "filename", "split", "car")} for p in pair_rows])
    write_parquet_shard(folder / "usage", [
        {"run_id": "r", "stage": "qa_generate", "item": p["pair_id"], "model": "m", "cache_key": "k",
         "prompt_tokens": 1000, "completion_tokens": 200, "total_tokens": 1200, "cost_usd": 0.001, "cached": False,
         "attempts": 1, "status": "ok", "response_format": "json_schema", "worker": "w", "time": "t"}
        for p in pair_rows])
    return folder


def make_pairs_job_output(folder: Path) -> Path:
    """A pairs-job metadata/ table (accepted and rejected slices with the job's reasons) and candidate
    pairs/, as the pairs job writes them."""
    from operators.pairs.selection.pairing import PAIRS_SCHEMA
    from operators.pairs.crops.slice_io import METADATA_SCHEMA
    reasons = [None, None, None, "too few inliers (5 < 20)", "residual 9.3 px > 8 px", "too few inliers (2 < 20)",
               None, "nodata 3.0% of the crop > 0.0%", None, "residual 12.0 px > 8 px"]
    residuals = [0.4, 1.1, 0.7, 35.0, 9.3, 60.2, 2.5, None, 5.9, 12.0]
    rows = []
    for i, r in enumerate(reasons):
        rows.append({"slice_id": f"s{i}", "pair_id": "p0", "location": "loc", "split": ("train", "val", "test")[i % 3],
                     "window": [0, 0, 256, 256], "residual_px": residuals[i],
                     "status": "rejected" if r else "accepted", "reject_reason": r, "run_id": "r1"})
    table = pa.Table.from_pylist(rows, schema=pa.schema([f for f in METADATA_SCHEMA if f.name in rows[0]]))
    (folder / "metadata").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / "metadata" / "part-r1-0.parquet")
    (folder / "pairs").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([
        {"pair_id": "p0", "status": "accepted", "reason": None},
        {"pair_id": "p1", "status": "rejected", "reason": "too close in time"}],
        schema=pa.schema([f for f in PAIRS_SCHEMA if f.name in ("pair_id", "status", "reason")])),
        folder / "pairs" / "part-r1-0.parquet")
    return folder


@pytest.fixture(scope="session")
def chromium_path():
    """Debian's Chromium (headless), or a failure naming what to install."""
    from tests.review.browser import chromium
    path = chromium()
    if path is None:
        pytest.fail("chromium is not installed (apt-get install chromium; .ci/run does it)")
    return path
