"""The requests of every stage of one pair, laid out for providers' prefix caches: one system text, then
the pair's images (A, B, mask) in the same order and detail, then its metadata, and the stage's own
text last; the mask always at low detail."""
import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from operators.language.caption_ops import CaptionPrompts, PrepareConfig, prepare_pair
from operators.language.caption_ops import build_generate_request as caption_generate
from operators.language.caption_ops import build_judge_request as caption_judge
from operators.language.caption_ops import handle_generate_result as caption_handle
from operators.language.captions import PERSPECTIVES, load_template
from operators.language.qa import TYPE_KEYS
from operators.language.qa_ops import QAPrompts, prepare_qa_pair
from operators.language.qa_ops import build_generate_request as qa_generate
from operators.language.qa_ops import build_judge_request as qa_judge
from operators.language.qa_ops import handle_generate_result as qa_handle
from operators.llm.client import LLMResult


@pytest.fixture(scope="module")
def pair_1024(tmp_path_factory):
    """One pair at the paper's crop size (1024 px): a new block in the centre."""
    root = tmp_path_factory.mktemp("pair")
    rng = np.random.default_rng(0)
    a = rng.integers(0, 255, (1024, 1024, 3), dtype=np.uint8)
    b = a.copy()
    b[400:620, 400:620] = 200
    mask = np.zeros((1024, 1024), np.uint8)
    mask[400:620, 400:620] = 255
    for folder, image in (("A", a), ("B", b), ("label", mask)):
        (root / folder).mkdir()
        cv2.imwrite(str(root / folder / "p.png"), image)
    return {"pair_id": "p", "split": "test", "filename": "p.png", "root": str(root),
            "a_rel": "A/p.png", "b_rel": "B/p.png", "label_rel": "label/p.png"}


def _record(envs):
    [env] = envs
    return json.loads(env["_record"])


def stage_requests(item, detail):
    """The four requests of one pair: caption generation and judging, QA generation and judging."""
    config = PrepareConfig(detail=detail)
    cap = CaptionPrompts(generate=load_template("caption_generate.v2"), judge=load_template("caption_judge.v2"),
                         detail=detail)
    qa = QAPrompts(generate=load_template("qa_generate.v2"), judge=load_template("qa_judge.v2"), detail=detail)
    record = _record(prepare_pair(item, config))
    gen = caption_generate(cap, record)
    reply = {p: f"A new square building now stands in the centre of the scene ({p})." for p in PERSPECTIVES}
    judge = caption_judge(cap, _record(caption_handle(cap, record, LLMResult(item="p", ok=True, value=reply))))
    qa_record = _record(prepare_qa_pair(dict(item, context_captions=["A new building stands in the centre."]),
                                        config))
    qgen = qa_generate(qa, qa_record)
    answers = {TYPE_KEYS[t]: {"question": f"What changed ({t})?", "answer": "A new building was built in the centre."}
               for t in qa_record["question_types"]}
    qjudge = qa_judge(qa, _record(qa_handle(qa, qa_record, LLMResult(item="p", ok=True, value=answers))))
    return [gen, judge, qgen, qjudge]


@pytest.mark.parametrize("detail", ["high", "auto"])
def test_all_stages_of_a_pair_share_the_prefix_up_to_its_images(pair_1024, detail):
    requests = stage_requests(pair_1024, detail)
    systems = {json.dumps(r.messages[0]) for r in requests}
    assert len(systems) == 1 and requests[0].messages[0]["role"] == "system"
    users = [r.messages[1]["content"] for r in requests]
    for content in users:
        assert [p["type"] for p in content[:3]] == ["image_url"] * 3
        assert [p["image_url"]["detail"] for p in content[:3]] == [detail, detail, "low"]   # the mask: low
    # System text, A, B, mask and the pair's metadata: the same bytes in every stage's request.
    assert len({json.dumps(c[:4]) for c in users}) == 1
    assert "change area ratio" in users[0][3]["text"]
    # The stage's text last, and different per stage.
    assert len({c[-1]["text"] for c in users}) == 4 and all(c[-1]["type"] == "text" for c in users)


def test_the_mask_is_low_detail_everywhere_even_with_v1_templates(pair_1024):
    record = _record(prepare_pair(pair_1024, PrepareConfig(detail="high")))
    qa = QAPrompts(generate=load_template("qa_generate.v1"), judge=load_template("qa_judge.v1"), detail="high")
    qa_record = dict(record, question_types=["YES/NO", "WHERE"], seed=0, context_captions=[])
    parts = [p for p in qa_generate(qa, qa_record).messages[1]["content"] if p["type"] == "image_url"]
    assert [p["image_url"]["detail"] for p in parts] == ["high", "high", "low"]
    assert parts[2]["image_url"]["url"] == record["mask_url"]
