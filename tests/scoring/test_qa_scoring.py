"""QA scoring: answer normalisation, matching of every accepted prediction shape, yes/no accuracy per
type, caption metrics for open types, and the optional LLM judge (against the OpenAI-compatible test
server, which is test equipment: its verdicts are deterministic filler) with its cache."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from operators.scoring.qa import match_answers, normalize_answer, read_qa_references, yes_no
from operators.scoring.qa_scoring import score_qa

REFS = {"images": [
    {"filename": "test_102_0512_0000.png", "split": "test", "qa": [
        {"type": "YES/NO", "question": "Has any building been constructed?", "answer": "Yes"},
        {"type": "WHAT", "question": "What has changed?", "answer": "a large warehouse with a parking lot was built on bare land"}]},
    {"filename": "train_386_0512_0768.png", "split": "test", "qa": [
        {"type": "YES/NO", "question": "Has any building been constructed?", "answer": "No."},
        {"type": "YES/NO", "question": "Is there a new road?", "answer": "no"},
        {"type": "WHAT", "question": "What has changed?", "answer": "nothing has changed"}]},
    {"filename": "train_1.png", "split": "train", "qa": [
        {"type": "YES/NO", "question": "Is there a new road?", "answer": "yes"}]},
]}
PREDS = [
    {"filename": "test_102_0512_0000.png", "question": "has any building been constructed", "answer": "YES, a warehouse."},
    {"filename": "test_102_0512_0000.png", "question": "What has changed?", "answer": "a warehouse was built on bare land"},
    {"filename": "train_386_0512_0768", "question": "Has any building been constructed?", "answer": "yes"},
    {"filename": "train_386_0512_0768.png", "question": "Is there a new road?", "answer": "No"},
    {"filename": "train_386_0512_0768.png", "question": "What has changed?", "answer": "Nothing has changed."},
    {"filename": "x.png", "question": "?", "answer": "no"},
]


def test_normalisation():
    assert normalize_answer("  Yes, it DID! ") == "yes it did"
    assert (yes_no("No."), yes_no("YES, a warehouse."), yes_no("maybe"), yes_no("")) == ("no", "yes", None, None)


def test_matching_shapes_and_yes_no_accuracy():
    questions, problems = read_qa_references([REFS], "test")
    assert len(questions) == 5 and not problems
    assert questions[0].qid == "test_102_0512_0000#0"
    m = match_answers(questions, PREDS)
    assert len(m.questions) == 5
    assert [(p["item"], p["error_type"]) for p in m.problems] == [("x.png: ?", "extra_prediction")]
    doc, rows = score_qa(m, ("YES/NO",), caption_metrics=False)
    assert doc["per_type"]["YES/NO"] == {"kind": "yes_no", "n": 3, "accuracy": pytest.approx(2 / 3)}
    assert doc["yes_no_accuracy"] == pytest.approx(2 / 3)
    assert doc["per_type"]["WHAT"]["accuracy"] == 0.5  # normalised exact match: "Nothing has changed."
    assert doc["accuracy"] == pytest.approx(3 / 5)
    by_id = match_answers(questions, {"test_102_0512_0000#0": "no", "nope#1": "x"})
    assert list(by_id.answers) == ["test_102_0512_0000#0"]
    assert sorted(p["error_type"] for p in by_id.problems).count("missing_prediction") == 4
    listed = match_answers(questions, [{"id": "train_386_0512_0768#1", "answer": "no"}])
    assert listed.answers == {"train_386_0512_0768#1": "no"}


@pytest.mark.slow
def test_qa_job_with_judge_and_cache(tmp_path, ray_session, openai_server, monkeypatch):
    from jobs.score import QAScoreConfig, run_qa

    (tmp_path / "refs.json").write_text(json.dumps(REFS))
    (tmp_path / "pred.json").write_text(json.dumps(PREDS))
    monkeypatch.setenv("OPENAI_BASE_URL", openai_server.base_url)
    monkeypatch.setenv("OPENAI_API_KEY", "test-key-not-secret")
    cfg = QAScoreConfig(pred=str(tmp_path / "pred.json"), refs=str(tmp_path / "refs.json"),
                        output=str(tmp_path / "out"), judge_model="test-equipment")
    doc = run_qa(cfg)
    assert doc["yes_no_accuracy"] == pytest.approx(2 / 3) and doc["n_errors"] == 1
    what = doc["per_type"]["WHAT"]
    assert what["n"] == 2 and 0 < what["Bleu_1"] <= 1 and what["CIDEr"] is not None
    assert doc["judge"]["n_judged"] == 5 and 1 <= doc["judge"]["mean_score"] <= 5
    rows = pq.read_table(tmp_path / "out" / "per_question").to_pylist()
    assert len(rows) == 5 and all(r["judge_score"] is not None for r in rows)
    assert all(r["Bleu_1"] is None for r in rows if r["kind"] == "yes_no")
    sent = openai_server.stats()["total"]
    assert sent == 5
    doc2 = run_qa(cfg)  # answered from the cache: nothing sent, same verdicts, tables replaced
    assert openai_server.stats()["total"] == sent
    assert doc2["judge"] == doc["judge"]
    assert pq.read_table(tmp_path / "out" / "per_question").num_rows == 5
    assert pq.read_table(tmp_path / "out" / "errors").num_rows == 1
