"""The QA job end to end through Ray Data against the OpenAI-compatible test server (test equipment: its
questions and answers are word salad, its scores deterministic): every pair accounted for, five QA
pairs of five distinct types per pair, all eight types over the dataset, nothing selected below 7,
one judge request per pair carrying all five, caption context from a captions output, a rerun that
sends nothing, and the reject policy keeping rejected answers away from the judge."""
import json
from collections import Counter
from pathlib import Path

import pytest

from jobs.qa import SOURCE_FILE, VQA_FILE, QAJobConfig, run
from operators.io.storage import Store
from operators.io.tables import read_table
from operators.language.qa import QUESTION_TYPES
from operators.language.qa_ops import TABLE_SCHEMAS

REPO = Path(__file__).resolve().parents[2]
LEVIR = REPO / "data" / "levir-cd"
ALL_PAIRS = sorted(p.stem for p in (LEVIR / "A").glob("*.png"))

pytestmark = pytest.mark.slow


def config(server, inp, out, **kw):
    base = dict(input=str(inp), output=str(out), model="test-model", base_url=server.base_url, timeout_s=5.0,
                max_retries=4, max_reasks=3, backoff_base_s=0.05, actors=2, concurrent_batches=4, batch_size=4,
                progress_every_s=1.0)
    base.update(kw)
    return QAJobConfig(**base)


def tables(out):
    store = Store(str(out))
    result = {}
    for name, schema in TABLE_SCHEMAS.items():
        t = read_table(store, name, schema)
        result[name] = t.to_pylist() if t is not None else []
    return result


def captions_output(tmp_path):
    """A captions job output as the QA job reads it: source.json and LevirCCcaptions.json."""
    cap = tmp_path / "captions"
    cap.mkdir()
    (cap / SOURCE_FILE).write_text(json.dumps({"input": str(LEVIR)}))
    images = [{"filename": f"{p}.png", "filepath": "test", "sentences": [
        {"raw": f" caption {i} of {p} about buildings"} for i in range(4)]} for p in ALL_PAIRS[:6]]
    (cap / "LevirCCcaptions.json").write_text(json.dumps({"images": images}))
    return cap


def test_qa_job_end_to_end_rerun_sends_nothing(ray_session, openai_server, tmp_path):
    out = tmp_path / "out"
    summary = run(config(openai_server, captions_output(tmp_path), out, validators="flag"))
    t = tables(out)

    # Every pair ends in pairs/qa or errors; the mask-less pair is an error row of this job.
    assert sorted({r["pair_id"] for r in t["pairs"]} | {e["item"] for e in t["errors"]}) == ALL_PAIRS
    assert [(e["item"], e["stage"], e["job"]) for e in t["errors"]] == [("test_113_0256", "prepare", "qa")]
    assert {r["pair_id"] for r in t["qa"]} == {r["pair_id"] for r in t["pairs"]} and len(t["pairs"]) == 11

    # Five QA pairs per image pair, five distinct types, as drawn and recorded; all eight over the dataset.
    by_pair = {}
    for r in t["qa"]:
        by_pair.setdefault(r["pair_id"], []).append(r)
    pairs = {p["pair_id"]: p for p in t["pairs"]}
    for pid, rows in by_pair.items():
        rows.sort(key=lambda r: r["qa_index"])
        assert [r["question_type"] for r in rows] == list(pairs[pid]["question_types"])
        assert len({r["question_type"] for r in rows}) == 5 == len(rows)
    assert {r["question_type"] for r in t["qa"]} == set(QUESTION_TYPES)

    # Judged: four criteria and the overall; nothing below 7 selected, everything at or above 7 kept.
    # Default overall (criteria): the rounded mean of the four, but a hallucinated answer (accuracy <= 4)
    # scores its accuracy.
    crit = ("score_answer_accuracy", "score_question_quality", "score_answer_completeness", "score_redundancy")
    # The test server's word salad draws from the prompt's words, which include number words and "percent":
    # an answer that reads "... two percent ..." is a figure, kept from the judge under flag too.
    figures = [r for r in t["qa"] if r["overall"] is None]
    assert all(r["selection_reason"] == "validator: numbers" and not r["selected"] and r["validator_ok"] is False
               and "numbers" in r["validator_violations"] for r in figures)
    for r in (r for r in t["qa"] if r["overall"] is not None):
        expected = (r["score_answer_accuracy"] if r["score_answer_accuracy"] <= 4
                    else int(sum(r[c] for c in crit) / len(crit) + 0.5))   # an integer, rounded half up
        assert r["score_redundancy"] is not None and r["overall"] == expected
        assert (r["overall"] >= 7) == r["selected"]
    assert any(not r["selected"] for r in t["qa"]) and any(r["selected"] for r in t["qa"])
    assert all(r["selection_reason"] is None for r in t["qa"] if r["selected"])
    # Flag policy: every answer checked, verdict stored; all but the figures sent to the judge.
    assert all(r["validator_ok"] is not None and r["validators"] == "flag" for r in t["qa"])
    assert sum(p["n_judged"] for p in t["pairs"]) == len(t["qa"]) - len(figures)

    # One generation and one judge request per pair; the judge request scored all five of its pair.
    stages = Counter((u["stage"], u["item"]) for u in t["usage"])
    assert set(stages.values()) == {1} and len(stages) == 22
    assert summary["usage"]["http_requests"] == 22 and openai_server.stats()["total"] == 22

    # Context: the first three captions of the captions output, for the pairs that had some.
    assert list(pairs[ALL_PAIRS[0]]["context_captions"]) == [f"caption {i} of {ALL_PAIRS[0]} about buildings"
                                                             for i in range(3)]
    assert list(pairs["val_27_0000_0256"]["context_captions"]) == []

    # The VQA file holds the selected QA pairs per image.
    doc = json.loads((out / VQA_FILE).read_text())
    selected = Counter(r["pair_id"] for r in t["qa"] if r["selected"])
    assert {img["filename"][:-4]: len(img["qa"]) for img in doc["images"]} == dict(selected)
    img = doc["images"][0]
    assert set(img) == {"filename", "filepath", "split", "change_ratio", "qa"}
    assert set(img["qa"][0]) == {"type", "question", "answer"}

    # A rerun sends nothing. The pair without a mask is set aside again (it does not make the rerun a failed
    # one: operators.io.console.llm_run_shortfall), and its error row is the first run's, not a second one.
    second = run(config(openai_server, tmp_path / "captions", out))
    assert openai_server.stats()["total"] == 22
    assert second["pairs_skipped_finished"] == 11 and second["usage"]["logical_requests"] == 0
    assert (second["pairs_no_mask"], second["pairs_no_mask_first"], second["errors"]) == (1, ["test_113_0256"], 0)
    history = read_table(Store(str(out)), "errors", TABLE_SCHEMAS["errors"], current=False).to_pylist()
    assert [(e["item"], e["error_type"], e["run_id"]) for e in history] == [
        ("test_113_0256", "NoMask", summary["run_id"])]


def test_reject_policy_on_a_plain_dataset(ray_session, openai_server, tmp_path):
    out = tmp_path / "out"
    summary = run(config(openai_server, LEVIR, out, validators="reject", overall="min", seed=7))
    t = tables(out)
    assert len(t["pairs"]) == 11 and all(not p["context_captions"] for p in t["pairs"])
    rejected = [r for r in t["qa"] if r["validator_ok"] is False]
    # The test server's word salad repeats the region words of the prompt, so some answers break rules.
    assert rejected, "expected the validators to reject some of the test server's answers"
    assert all(r["selection_reason"].startswith("validator: ") and r["overall"] is None and not r["selected"] for r in rejected)
    assert summary["validator_rejected"] == len(rejected)
    assert sum(summary["validator_caught"].values()) >= len(rejected)
    for p in t["pairs"]:
        assert p["n_judged"] + p["n_validator_rejected"] == 5
    judge_requests = Counter(u["item"] for u in t["usage"] if u["stage"] == "qa_judge")
    assert set(judge_requests) == {p["pair_id"] for p in t["pairs"] if p["n_judged"]}
    assert set(judge_requests.values()) <= {1}
    criteria = ("score_answer_accuracy", "score_question_quality", "score_answer_completeness", "score_redundancy")
    for r in t["qa"]:
        if r["overall"] is not None:
            assert r["overall"] == min(r[c] for c in criteria)


def test_an_answer_with_a_hedged_figure_costs_no_judge_call(ray_session, openai_server, tmp_path):
    """The paper's numbers rule under the default policy (flag): the test server writes the prompt's region
    line into every string it returns, so a template whose region line reads "roughly two percent" makes every
    answer state a hedged figure. None reaches the judge: the server sees the generation requests only."""
    import shutil
    from prompts import __file__ as prompts_init
    prompts = tmp_path / "prompts"
    shutil.copytree(Path(prompts_init).parent, prompts, ignore=shutil.ignore_patterns("__*"))
    text = (prompts / "qa_generate.v2.txt").read_text().replace("@language_pair.v2", "- change region: roughly two percent")
    (prompts / "qa_generate.figures.txt").write_text(text)
    (tmp_path / "list.txt").write_text("test_102_0512_0000.png\ntest_77_0512_0256.png\nval_27_0000_0256.png\n")
    out = tmp_path / "out"
    run(config(openai_server, LEVIR, out, prompts_dir=str(prompts), generate_template="qa_generate.figures",
               list_file=str(tmp_path / "list.txt")))
    t = tables(out)
    assert len(t["pairs"]) == 3 and len(t["qa"]) == 15
    assert all("two percent" in r["answer"] for r in t["qa"])
    assert all(r["selection_reason"] == "validator: numbers" and r["overall"] is None and not r["selected"]
               and r["validators"] == "flag" for r in t["qa"])
    assert [u["stage"] for u in t["usage"]] == ["qa_generate"] * 3
    assert openai_server.stats()["total"] == 3            # three generation requests, no judge request
    assert all(p["n_judged"] == 0 and p["n_validator_rejected"] == 5 for p in t["pairs"])
