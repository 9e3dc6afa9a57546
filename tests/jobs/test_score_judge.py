"""The QA scoring job's LLM judge through the LLM jobs' pass loop (Ray Data + the OpenAI-compatible test
server, which is test equipment: its verdicts are deterministic filler), as the captions and QA jobs
run it: a quota stops the judge with exit 3 in real time and at the Batch API, batches still open
after --batch-max-wait-s stop it with exit 3 and the rerun polls them (each line submitted once),
and a question left with neither a verdict nor an error is an error row and exit 3, never silence."""
from __future__ import annotations

import json

import pytest

from jobs.score import main
from tests.llm.test_llm_errors import PROVIDERS

pytestmark = pytest.mark.slow

BODY = {name: body for name, _, body, _, _ in PROVIDERS}
# Yes/no questions only: scored without Java (the open types' caption metrics need it).
REFS = {"images": [
    {"filename": "a.png", "split": "test", "qa": [
        {"type": "YES/NO", "question": "Has any building been constructed?", "answer": "Yes"},
        {"type": "YES/NO", "question": "Is there a new road?", "answer": "no"}]},
    {"filename": "b.png", "split": "test", "qa": [
        {"type": "YES/NO", "question": "Has any building been constructed?", "answer": "No"}]},
]}
PREDS = [{"filename": "a.png", "question": "Has any building been constructed?", "answer": "yes"},
         {"filename": "a.png", "question": "Is there a new road?", "answer": "yes"},
         {"filename": "b.png", "question": "Has any building been constructed?", "answer": "no"}]
QIDS = ["a#0", "a#1", "b#0"]


@pytest.fixture()
def score_qa(tmp_path, ray_session, openai_server, monkeypatch, capsys):
    """``score_qa(*extra)``: (exit status, printed lines, metrics.json) of ``jobs.score qa`` with the
    judge on the test server, on the same output each time."""
    (tmp_path / "refs.json").write_text(json.dumps(REFS))
    (tmp_path / "pred.json").write_text(json.dumps(PREDS))
    monkeypatch.setenv("OPENAI_API_KEY", "test-key-not-secret")

    def run(*extra: str):
        capsys.readouterr()
        try:
            code = main(["qa", "--pred", str(tmp_path / "pred.json"), "--refs", str(tmp_path / "refs.json"),
                         "--output", str(tmp_path / "out"), "--judge-model", "test-equipment",
                         "--base-url", openai_server.base_url, *extra])
        except SystemExit as exc:    # the old judge loop stopped with SystemExit (exit 1)
            code = exc.code
        lines = capsys.readouterr().out.strip().splitlines()
        return code, lines, json.loads((tmp_path / "out" / "metrics.json").read_text())
    return run


def errors(tmp_path) -> list[dict]:
    """The errors/ of the output (the last run's rows: the job replaces the table)."""
    from operators.io.storage import Store
    from operators.io.tables import ERRORS_SCHEMA, read_table
    t = read_table(Store(str(tmp_path / "out")), "errors", ERRORS_SCHEMA)
    return [] if t is None else t.to_pylist()


@pytest.mark.timeout(600)
def test_a_quota_in_real_time_stops_the_judge_with_exit_3_and_the_rerun_judges(score_qa, openai_server, tmp_path):
    openai_server.configure(faults=[{"kind": "quota", "rate": 1.0}])
    code, lines, doc = score_qa()
    assert code == 3 and "quota" in lines[-1], lines[-5:]
    assert doc["judge"]["n_judged"] == 0 and "quota" in doc["judge"]["stopped"]
    assert doc["yes_no_accuracy"] == pytest.approx(2 / 3)      # the scores are written all the same
    assert {e["item"] for e in errors(tmp_path)} == set(QIDS)
    openai_server.restore_defaults()
    code, lines, doc = score_qa()
    assert code == 0 and doc["judge"]["n_judged"] == 3 and doc["judge"]["stopped"] == "", lines[-5:]
    assert errors(tmp_path) == []


@pytest.mark.timeout(600)
def test_the_batch_judge_submits_each_line_once_and_judges_every_question(score_qa, openai_server, tmp_path):
    code, lines, doc = score_qa("--batch-api", "--batch-poll-s", "0.05")
    assert code == 0 and doc["judge"]["n_judged"] == 3 and doc["judge"]["stopped"] == "", lines[-5:]
    stats = openai_server.stats()
    assert len(stats["batch_submissions"]) == 3 and set(stats["batch_submissions"].values()) == {1}
    assert stats["total"] == 0                                   # nothing in real time
    from operators.io.storage import Store
    from operators.io.tables import read_table
    from operators.llm.usage import USAGE_SCHEMA
    usage = read_table(Store(str(tmp_path / "out")), "usage", USAGE_SCHEMA).to_pylist()
    assert len(usage) == 3 and all(u["batch_id"] for u in usage)


@pytest.mark.timeout(600)
def test_a_quota_at_the_batch_api_stops_the_judge_with_exit_3_and_nothing_submitted(score_qa, openai_server,
                                                                                     tmp_path):
    openai_server.configure(error_reply={"status": 429, "body": BODY["openai TPD"], "times": 1, "paths": ["files"]})
    code, lines, doc = score_qa("--batch-api", "--batch-poll-s", "0.05")
    assert code == 3 and "quota" in lines[-1] and "per day" in lines[-1], lines[-5:]
    assert doc["judge"]["n_judged"] == 0
    assert openai_server.stats()["batch_submissions"] == {} and openai_server.stats()["total"] == 0


@pytest.mark.timeout(600)
def test_batches_still_open_stop_the_judge_with_exit_3_and_the_rerun_polls_them(score_qa, openai_server, tmp_path):
    openai_server.configure(batch_hold=True)                     # the provider does not finish the batch
    code, lines, doc = score_qa("--batch-api", "--batch-poll-s", "0.05", "--batch-max-wait-s", "0.3")
    assert code == 3 and lines[-1] == "stopped: 1 batches still open after --batch-max-wait-s; rerun to poll them"
    assert doc["judge"]["n_judged"] == 0
    submitted = openai_server.stats()["batch_submissions"]
    assert len(submitted) == 3 and set(submitted.values()) == {1}
    openai_server.configure(batch_hold=False)
    code, lines, doc = score_qa("--batch-api", "--batch-poll-s", "0.05")
    assert code == 0 and doc["judge"]["n_judged"] == 3 and doc["judge"]["stopped"] == "", lines[-5:]
    stats = openai_server.stats()
    assert stats["batch_submissions"] == submitted and stats["total"] == 0   # polled, not submitted again
    assert errors(tmp_path) == []


@pytest.mark.timeout(600)
def test_a_question_left_with_neither_verdict_nor_error_is_an_error_row_and_exit_3(score_qa, openai_server,
                                                                                     tmp_path, monkeypatch):
    """The pass's pipeline replaced (as in tests/llm/test_llm_batch_submission.py): one question judged,
    one failed, one with no row and no batch line waiting for it."""
    from operators.io.storage import Store
    from operators.io.tables import ERRORS_SCHEMA, error_record, write_table_shard
    from operators.llm import job_passes
    from operators.scoring.qa_judge import JUDGEMENTS_SCHEMA

    def one_pass(todo, *args, run_id, **kwargs):
        out = Store(str(tmp_path / "out"))
        assert sorted(t["qid"] for t in todo) == QIDS
        write_table_shard(out, "judgements", [{"qid": "a#0", "judge_score": 5, "judge_correct": True,
                                               "judge_reason": "r", "judge_model": "m", "prompt_version": "v",
                                               "run_id": run_id}], JUDGEMENTS_SCHEMA, run_id)
        write_table_shard(out, "errors", [error_record("a#1", "score_qa_judge", "a reason", run_id=run_id)],
                          ERRORS_SCHEMA, run_id)
        return {}
    monkeypatch.setattr(job_passes, "run_stages", one_pass)
    code, lines, doc = score_qa("--batch-api", "--batch-poll-s", "0.05")
    assert code == 3 and lines[-1].startswith("stopped: 1 pairs no row after pass 1 and no batch line waiting"), lines
    assert lines[-1].endswith(": b#0")
    assert sorted((e["item"], e["error_type"]) for e in errors(tmp_path)) == [("a#1", "error"), ("b#0", "LeftOver")]
    assert doc["judge"]["n_judged"] == 1
