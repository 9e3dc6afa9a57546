"""The requests of every stage of one pair, laid out for providers' prefix caches: one system text, then
the pair's images in the same order and detail, then (generation) its mask and metadata, and the stage's
own text last, the reply schema after it in JSON mode; the mask always at low detail. With the jobs'
defaults (v4, JSON mode) a provider-style prefix cache (the schema first, then the messages) answers
the pair's later requests from the first's prefix; with json_schema it cannot (the schemas differ)."""
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
from operators.llm.client import LLMCaller, LLMConfig, LLMResult, Secret, prompt_schema
from operators.llm.job_options import LLMJobConfig


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


def stage_requests(item, detail, version="v2"):
    """The four requests of one pair: caption generation and judging, QA generation and judging."""
    config = PrepareConfig(detail=detail)
    cap = CaptionPrompts(generate=load_template(f"caption_generate.{version}"),
                         judge=load_template(f"caption_judge.{version}"), detail=detail)
    qa = QAPrompts(generate=load_template(f"qa_generate.{version}"), judge=load_template(f"qa_judge.{version}"),
                   detail=detail)
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


def sent_bodies(requests, response_format):
    caller = LLMCaller(LLMConfig(model="gpt-4o", base_url="http://127.0.0.1:9/v1", response_format=response_format),
                       Secret("sk-layout"))
    return [caller._body(r, caller.attempts_for(r), frozenset(caller.quirks))[1] for r in requests]


def expanded(stated: dict, closed: bool) -> dict:
    """A schema as the prompt states it, with its ``$ref``s replaced by their ``$defs`` and, when the
    prompt says every object is closed, each object's ``required`` (all its properties) and
    ``additionalProperties: false`` put back: what the model is told, as one schema."""
    defs = stated.get("$defs", {})

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return walk(defs[node["$ref"].rsplit("/", 1)[-1]])
            out = {k: walk(v) for k, v in node.items() if k != "$defs"}
            if closed and out.get("type") == "object":
                out.update(required=list(out["properties"]), additionalProperties=False)
            return out
        return [walk(v) for v in node] if isinstance(node, list) else node
    return walk(stated)


def canonical(schema: dict) -> str:
    def walk(node):   # the order of a 'required' list does not matter
        if isinstance(node, dict):
            return {k: sorted(v) if k == "required" else walk(v) for k, v in node.items()}
        return [walk(v) for v in node] if isinstance(node, list) else node
    return json.dumps(walk(schema), sort_keys=True)


def test_default_requests_as_sent_share_system_a_and_b_and_end_with_their_schema(pair_1024):
    assert LLMJobConfig.response_format == "json_object" and LLMJobConfig.judge_template == "caption_judge.v4"
    requests = stage_requests(pair_1024, "high", "v4")
    bodies = sent_bodies(requests, LLMJobConfig.response_format)
    assert {json.dumps(b["response_format"]) for b in bodies} == {'{"type": "json_object"}'}
    assert len({json.dumps(b["messages"][0]) for b in bodies}) == 1          # one system text, no schema in it
    assert "JSON schema:" not in bodies[0]["messages"][0]["content"]
    users = [b["messages"][1]["content"] for b in bodies]
    assert len({json.dumps(c[:2]) for c in users}) == 1                       # A and B: the same bytes
    assert all(p["image_url"]["detail"] == "high" for c in users for p in c[:2])
    images = [[p for p in c if p["type"] == "image_url"] for c in users]
    # The generations add the mask (low); the judges see the pair only, as the paper's judges do.
    assert [len(i) for i in images] == [3, 2, 3, 2] and images[0][2]["image_url"]["detail"] == "low"
    for request, content in zip(requests, users):
        note = content[-1]["text"]
        assert note.startswith("Reply with one JSON object") and "JSON schema:" in note
        assert "JSON schema:" not in json.dumps(content[:-1])               # stated once, at the end
        # The reply's shape is stated once: the schema, not also the template's reply line.
        assert request.reply_note.startswith("Answer as a JSON object")
        assert request.reply_note not in json.dumps(content) and "Answer as" not in json.dumps(content)
        # Compact, and exactly the schema replies are checked against: every key, type, bound and closure.
        stated = json.loads(note.split("JSON schema:", 1)[1])
        assert "all of its properties and no others" in note and "required" not in json.dumps(stated)
        assert canonical(expanded(stated, closed=True)) == canonical(request.schema)
        assert len(json.dumps(stated, separators=(",", ":"))) < 0.7 * len(json.dumps(request.schema,
                                                                                        separators=(",", ":")))


def test_in_json_schema_mode_the_reply_line_is_sent_instead_of_the_schema(pair_1024):
    """Some servers never show a json_schema to the model (vLLM's guided decoding only constrains the
    tokens): there the template's reply line is its one guide to the keys, so it is sent, last."""
    requests = stage_requests(pair_1024, "high", "v4")
    for request, body in zip(requests, sent_bodies(requests, "json_schema")):
        content = body["messages"][1]["content"]
        assert body["response_format"]["type"] == "json_schema"
        assert content[-1] == {"type": "text", "text": request.reply_note} and "JSON schema:" not in json.dumps(content)
        keys = request.reply_note.split("keys", 1)[1] if "keys" in request.reply_note else request.reply_note
        assert all(k in keys for k in request.schema["properties"]), (request.reply_note, keys)


def test_v3_requests_keep_their_reply_line_in_the_stage_text(pair_1024):
    """An output made with v3 reruns with v3 (prompts.json): its requests are the bytes they were."""
    requests = stage_requests(pair_1024, "high", "v3")     # built once (sent_bodies leaves them as they are)
    for request, body in zip(requests, sent_bodies(requests, "json_object")):
        assert request.reply_note == ""
        assert "Answer as a JSON object" in body["messages"][1]["content"][-2]["text"]


def test_a_schema_with_optional_or_open_objects_is_stated_whole():
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
              "required": ["a"], "additionalProperties": False}
    stated, closed = prompt_schema(schema)
    assert not closed and json.loads(stated) == schema
    nested = {"type": "object", "properties": {k: schema for k in ("x", "y", "z")}, "required": ["x", "y", "z"],
              "additionalProperties": False}
    stated, closed = prompt_schema(nested)
    assert not closed and '"required":["a"]' in stated and canonical(expanded(json.loads(stated), False)) == canonical(nested)


@pytest.mark.parametrize("response_format, hits", [("json_object", True), ("json_schema", False)])
def test_a_pairs_later_requests_hit_a_provider_prefix_cache_only_in_json_mode(pair_1024, openai_server,
                                                                              response_format, hits):
    import asyncio
    openai_server.configure(prefix_cache=True)
    requests = stage_requests(pair_1024, "high", "v4")

    async def go():
        caller = LLMCaller(LLMConfig(model="gpt-4o", base_url=openai_server.base_url, use_cache=False,
                                     response_format=response_format), Secret("sk-layout"))
        try:
            return [await caller.call(r) for r in requests]            # in order: the generation first
        finally:
            await caller.aclose()
    results = asyncio.run(go())
    assert all(r.ok for r in results) and results[0].cached_tokens == 0
    if hits:
        # System text, A and B (two 1024 px images at high detail: 765 tokens each): >= 1,024 tokens shared.
        assert all(r.cached_tokens >= 1664 for r in results[1:]), [r.cached_tokens for r in results]
        assert all(r.cached_tokens < r.prompt_tokens for r in results[1:])
    else:
        assert all(not r.cached_tokens for r in results[1:]), [r.cached_tokens for r in results]
