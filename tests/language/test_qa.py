"""QA logic without Ray or HTTP: the seeded draw of question types, schemas, selection (no top-k), the
judge request carrying all five, the --validators policy, caption context and the VQA document."""
import json
from pathlib import Path

import pytest

from operators.language.qa import (QA_CRITERIA, QUESTION_TYPES, TYPE_KEYS, draw_types, generation_schema,
                                   judge_schema, overall_score, select_qa, vqa_document)
from operators.llm.schema import schema_errors

REPO = Path(__file__).resolve().parents[2]


def test_draw_types_distinct_seeded_recorded_and_covering():
    names = [f"pair_{i}" for i in range(12)]
    draws = [draw_types(n, seed=0) for n in names]
    assert all(len(d) == 5 == len(set(d)) and set(d) <= set(QUESTION_TYPES) for d in draws)
    assert draws == [draw_types(n, seed=0) for n in names]               # same on a rerun
    assert draws != [draw_types(n, seed=1) for n in names]               # the seed matters
    assert len({tuple(d) for d in draws}) > 3                             # not one fixed set
    assert set().union(*map(set, draws)) == set(QUESTION_TYPES)           # all eight over a dataset
    with pytest.raises(ValueError):
        draw_types("p", 0, k=9)


def test_schemas_match_the_drawn_types():
    types = ["YES/NO", "WHERE", "HOW MUCH", "CAUSE", "COMPARE"]
    gen = generation_schema(types)
    assert gen["required"] == ["yes_no", "where", "how_much", "cause", "compare"]
    good = {TYPE_KEYS[t]: {"question": "Is there any change?", "answer": "Yes."} for t in types}
    assert not schema_errors(good, gen)
    assert schema_errors({k: v for k, v in list(good.items())[:4]}, gen)      # one missing
    judge = judge_schema(types)
    entry = {**{c: 8 for c in QA_CRITERIA}, "overall": 8, "reason": "fine"}
    assert not schema_errors({TYPE_KEYS[t]: entry for t in types}, judge)
    assert schema_errors({TYPE_KEYS[t]: dict(entry, redundancy=11) for t in types}, judge)


def test_selection_threshold_without_top_k_and_overall_modes():
    assert [select_qa(s).selected for s in (10, 9, 9, 8, 7)] == [True] * 5      # all five may pass
    assert not select_qa(6.99).selected and "below 7" in select_qa(6.99).reason
    assert select_qa(7).reason is None
    s = {"answer_accuracy": 9, "question_quality": 6, "answer_completeness": 8, "redundancy": 10, "overall": 7}
    assert overall_score(s, "judge") == 7 and overall_score(s, "mean") == 8.25 and overall_score(s, "min") == 6


def _record(tmp_types, facts):
    return {"pair_id": "p1", "split": "test", "filename": "p1.png", "height": 256, "width": 256,
            "car": facts["car"], "changed_pixels": facts["changed_pixels"], "components": facts["components"],
            "change_region": "lower area of the image", "cell_shares": [0.0] * 9, "mask_facts": facts,
            "hashes": {"a_rel": "a", "b_rel": "b", "label_rel": "l"}, "a_url": "data:image/png;base64,AA",
            "b_url": "data:image/png;base64,AA", "mask_url": "data:image/png;base64,AA", "image_tokens": 85,
            "question_types": tmp_types, "seed": 0, "context_captions": ["A large building was built."]}


@pytest.fixture(scope="module")
def facts77():
    import cv2
    from operators.language.mask_analysis import analyze_mask, binarize_mask
    from operators.language.validators import mask_facts
    mask = binarize_mask(cv2.imread(str(REPO / "data/levir-cd/label/test_77_0512_0256.png"), cv2.IMREAD_UNCHANGED))
    return mask_facts(mask, analyze_mask(mask).components)


REPLY = {"yes_no": {"question": "Was anything built in the upper-left corner?", "answer": "Yes, a new house."},
         "where": {"question": "Where is the new building?", "answer": "In the lower part and on the right."},
         # a hedged figure that agrees with the CAR (17.5 %): the paper's rule still forbids it
         "how_much": {"question": "How large is the change?", "answer": "Roughly 18 percent of the image changed."},
         "cause": {"question": "What likely caused the change?", "answer": "Commercial development."},
         "detail": {"question": "What does the new structure look like?", "answer": "A large L-shaped grey roof."}}


def texts(request) -> str:
    return "\n".join(p["text"] for p in request.messages[1]["content"] if p.get("type") == "text")


@pytest.mark.parametrize("policy", ["reject", "flag", "off"])
def test_one_judge_request_with_all_five_and_validator_policy(facts77, policy):
    from operators.language.captions import load_template
    from operators.language.qa_ops import (QAPrompts, build_generate_request, build_judge_request,
                                           handle_generate_result, handle_judge_result)
    from operators.llm.client import LLMResult
    types = ["YES/NO", "WHERE", "HOW MUCH", "CAUSE", "DETAIL"]
    prompts = QAPrompts(generate=load_template("qa_generate.v2"), judge=load_template("qa_judge.v2"), validators=policy)
    record = _record(types, facts77)
    gen = build_generate_request(prompts, record)
    text = texts(gen)
    assert "A large building was built." in text and "yes_no (YES/NO)" in text and "percentages" in text
    assert gen.schema["required"] == [TYPE_KEYS[t] for t in types]
    [env] = handle_generate_result(prompts, record, LLMResult(item="p1", ok=True, value=REPLY))
    assert env["_table"] == "_qa_judge"
    judged = json.loads(env["_record"])
    request = build_judge_request(prompts, judged)
    listing = texts(request)
    # The hedged figure never reaches the judge (the numbers rule, under every policy); the answer the
    # mask contradicts (yes_no) is kept back only under reject.
    kept_back = {"reject": {"yes_no", "how_much"}, "flag": {"how_much"}, "off": {"how_much"}}[policy]
    sent = set(request.schema["required"])
    assert sent == set(REPLY) - kept_back
    assert all((REPLY[k]["answer"] in listing) == (k in sent) for k in REPLY)
    # The default overall is the criteria's (the judge's own "overall" of 9 is not what decides).
    scores = {k: {**{c: 6 if k == "cause" else 8 for c in QA_CRITERIA}, "overall": 9, "reason": "r"}
              for k in sent}
    rows = [json.loads(e["_record"]) for e in handle_judge_result(prompts, judged, LLMResult(item="p1", ok=True,
                                                                                            value=scores))]
    qa = {r["question_type"]: r for r in rows if "question_type" in r}
    [pair] = [r for r in rows if "n_candidates" in r]
    flagged = {"reject": {"YES/NO", "HOW MUCH"}, "flag": {"YES/NO", "HOW MUCH"}, "off": {"HOW MUCH"}}[policy]
    assert {t for t, r in qa.items() if r["validator_ok"] is False} == flagged
    assert not qa["CAUSE"]["selected"] and qa["CAUSE"]["selection_reason"] == "overall 6 below 7"
    assert qa["DETAIL"]["selected"] and qa["DETAIL"]["selection_reason"] is None and qa["DETAIL"]["overall"] == 8
    assert qa["HOW MUCH"]["selection_reason"] == "validator: numbers" and qa["HOW MUCH"].get("overall") is None
    assert not qa["HOW MUCH"]["selected"]
    if policy == "reject":
        assert pair["n_validator_rejected"] == 2 and pair["n_judged"] == 3 and pair["n_selected"] == 2
    else:
        assert qa["YES/NO"]["selected"] and pair["n_validator_rejected"] == 1
        assert pair["n_judged"] == 4 and pair["n_selected"] == 3


def test_all_rejected_means_no_judge_request(facts77):
    from operators.language.captions import load_template
    from operators.language.qa_ops import QAPrompts, handle_generate_result
    from operators.llm.client import LLMResult
    types = ["YES/NO", "HOW MUCH"]
    prompts = QAPrompts(generate=load_template("qa_generate.v2"), judge=load_template("qa_judge.v2"),
                        validators="reject")
    envs = handle_generate_result(prompts, _record(types, facts77), LLMResult(item="p1", ok=True, value={
        k: REPLY[k] for k in ("yes_no", "how_much")}))
    assert sorted(e["_table"] for e in envs) == ["pairs", "qa", "qa"]


def test_caption_context_from_levir_cc_json_and_vqa_document(tmp_path):
    from operators.language.qa_ops import context_for, load_caption_context
    doc = {"images": [{"filename": "a.png", "filepath": "test", "sentences": [{"raw": f" cap {i}"} for i in range(5)]}]}
    (tmp_path / "LevirCCcaptions.json").write_text(json.dumps(doc))
    ctx = load_caption_context(str(tmp_path))
    assert context_for({"pair_id": "test/a", "filename": "a.png"}, ctx) == ["cap 0", "cap 1", "cap 2"]
    assert context_for({"pair_id": "b", "filename": "b.png"}, ctx) == []
    pairs = [{"pair_id": "a", "filename": "a.png", "split": "test", "car": 0.2},
             {"pair_id": "b", "filename": "b.png", "split": "train", "car": 0.0}]
    qa = [{"pair_id": "a", "qa_index": 1, "question_type": "WHERE", "question": "q1", "answer": "a1", "selected": True},
          {"pair_id": "a", "qa_index": 0, "question_type": "WHAT", "question": "q0", "answer": "a0", "selected": True},
          {"pair_id": "a", "qa_index": 2, "question_type": "CAUSE", "question": "q2", "answer": "a2", "selected": False},
          {"pair_id": "b", "qa_index": 0, "question_type": "WHAT", "question": "q", "answer": "a", "selected": False}]
    vqa = vqa_document(pairs, qa)
    assert vqa == {"images": [{"filename": "a.png", "filepath": "test", "split": "test", "change_ratio": 0.2,
                               "qa": [{"type": "WHAT", "question": "q0", "answer": "a0"},
                                      {"type": "WHERE", "question": "q1", "answer": "a1"}]}]}


@pytest.mark.parametrize("n_pairs", [0, 1, 9])
def test_vqa_file_written_as_it_goes_is_the_document_byte_for_byte(n_pairs):
    import io
    import pyarrow as pa
    from operators.language.qa import vqa_rows, write_vqa
    pairs = [{"pair_id": f"p{i}", "filename": f"f_{(7 * i) % 10}.png", "split": ("test", "train")[i % 2],
              "car": 0.05 * i} for i in range(n_pairs)]
    qa = [{"pair_id": f"p{i}", "qa_index": k, "question_type": "WHAT", "question": f"q{i}.{k} \u00e9",
           "answer": f"a{i}.{k}", "selected": (i + k) % 3 != 0} for i in range(n_pairs) for k in (3, 0, 2, 1)]
    table = vqa_rows(pa.Table.from_pylist(pairs, schema=pa.schema([("pair_id", pa.string()), ("filename", pa.string()),
                                                                   ("split", pa.string()), ("car", pa.float64())])),
                     pa.Table.from_pylist(qa, schema=pa.schema([("pair_id", pa.string()), ("qa_index", pa.int64()),
                                                                ("question_type", pa.string()), ("question", pa.string()),
                                                                ("answer", pa.string()), ("selected", pa.bool_())])))
    f = io.BytesIO()
    written = write_vqa((b.to_pylist() for b in table.to_batches(max_chunksize=4)), f)
    doc = vqa_document(pairs, qa)
    assert f.getvalue() == json.dumps(doc, indent=1).encode() and written == len(doc["images"])


def test_caption_context_from_a_captions_table_best_selected_first(tmp_path):
    from operators.io.storage import Store
    from operators.io.tables import write_table_shard
    from operators.language.caption_ops import CAPTIONS_SCHEMA
    from operators.language.qa_ops import load_caption_context

    def row(pid, k, overall, selected):
        return {"pair_id": pid, "candidate_index": k, "caption": f"{pid} c{k}", "overall": overall,
                "selected": selected}
    rows = [row("p1", 0, 7.5, True), row("p1", 1, 9.0, True), row("p1", 2, 9.0, True), row("p1", 3, 8.0, True),
            row("p1", 4, 9.5, False), row("p2", 0, None, True), row("p2", 1, 6.0, False), row("p3", 0, 8.0, False)]
    write_table_shard(Store(str(tmp_path)), "captions", rows, CAPTIONS_SCHEMA, "run1")
    ctx = load_caption_context(str(tmp_path))
    # best overall first, ties in candidate order, at most 3; unselected never; a pair with none absent
    assert ctx == {"p1": ["p1 c1", "p1 c2", "p1 c3"], "p2": ["p2 c0"]}
