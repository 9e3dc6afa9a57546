"""Tokens and dollars per SELECTED caption and per selected QA pair, four ways of sending the captions and QA
recipes, against the OpenAI-compatible test server (test equipment: its replies are hash-made, its token
counts follow the gpt-4o tile rule, a structured-output schema is billed as prompt, its prefix cache follows
OpenAI's: the response schema first, then the messages, a leading match of at least 1,024 tokens, in steps
of 128). The LEVIR-CD sample pairs are upscaled to the paper's 1024 px crops.

(a) ``first``: the recipe as a first implementation sends it: the three images (mask too) at full
    detail, one generation call, then one judge call per candidate (five), json_schema.
(b) ``v0.1``: the request layout of changeforge 0.1 (the v1 templates: per-stage system text and task text
    before the images, the mask at ``low`` for generation, one judge call for all candidates, without
    the mask), json_schema. Real time, no prefix cache.
(c) ``cached``: the job's defaults (the v4 templates, ``--response-format json_object``: one system text,
    then A and B, then the generation's mask and metadata, the stage text, the reply schema last) with
    the server's prefix cache on; cached input tokens are billed at ``cached`` times the input price.
(d) ``batch``: (c)'s requests through the Batch API (``operators.llm.batch``), at ``batch`` times the
    prices (cached tokens at the cached share of that).

The captions are measured first, then the QA job on a fresh server (its prefix cache empty: the QA job
runs apart from the captions job, later than a provider keeps a prefix). The QA context captions are
the same for every shape (the first three of each pair's generated captions). Selection is the jobs'
own (``overall_score`` with ``--overall criteria``; ``select_captions``, ``select_qa``), so acceptance
is what the judge's scores give in each shape; it is printed, and dollars are per selected item. Ends
with one line:
``dollars_per_selected captions a=.. b=.. c=.. d=.. d_over_b=.. d_over_b_equal_acceptance=..
billed_input_b_to_c=..% acceptance=.. per_candidate=.. qa a=.. ...`` (``per_candidate``: dollars per
candidate for a, b, c, d; at equal acceptance the shapes compare as these do).

    python benchmarks/llm_cost.py --pairs 10 --prices in=2.5,out=10,cached=0.5,batch=0.5
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import asyncio
import dataclasses
import json
import tempfile
from pathlib import Path

import cv2

from operators.language import qa_ops
from operators.language.caption_ops import (PERSPECTIVES, CaptionPrompts, PrepareConfig, build_generate_request,
                                            build_judge_request, find_dataset_pairs, prepare_pair)
from operators.language.captions import load_template, overall_score, select_captions
from operators.language.qa import TYPE_KEYS
from operators.llm.batch import BatchAPI, BatchDriver, BatchSettings, BatchState
from operators.llm.client import LLMCaller, LLMConfig, LLMRequest, Secret
from operators.llm.images import image_part
from operators.llm.job_options import LLMJobConfig
from tests.openai_test_server import ServerProcess

REPO = Path(__file__).resolve().parents[1]
KEY = "sk-benchmark-0000000000"
# What the jobs send by default (the cache-shaped templates and response format).
CURRENT = {"caption": (LLMJobConfig.generate_template, LLMJobConfig.judge_template),
           "qa": ("qa_generate.v4", "qa_judge.v4")}
V01 = {"caption": ("caption_generate.v1", "caption_judge.v1"), "qa": ("qa_generate.v1", "qa_judge.v1")}


def parse_prices(text: str) -> dict:
    prices = {"in": 2.5, "out": 10.0, "cached": 0.5, "batch": 0.5}   # gpt-4o list prices, $/Mtok
    for part in filter(None, text.split(",")):
        k, _, v = part.partition("=")
        if k not in prices:
            raise SystemExit(f"--prices: unknown field {k!r} (in, out, cached, batch)")
        prices[k] = float(v)
    return prices


def upscaled_dataset(n: int, side: int, root: Path) -> str:
    """The sample pairs (with masks) at ``side`` px, in the LEVIR-CD layout."""
    src = REPO / "data" / "levir-cd"
    names = sorted(p.name for p in (src / "label").glob("*.png"))[:n]
    for sub in ("A", "B", "label"):
        (root / sub).mkdir(parents=True, exist_ok=True)
        for name in names:
            img = cv2.imread(str(src / sub / name), cv2.IMREAD_UNCHANGED)
            interp = cv2.INTER_NEAREST if sub == "label" else cv2.INTER_CUBIC
            cv2.imwrite(str(root / sub / name), cv2.resize(img, (side, side), interpolation=interp))
    return str(root)


# -- (a): the first implementation, built from the v1 requests -----------------------------------------
def full_detail(request: LLMRequest, record: dict, mask: bool) -> LLMRequest:
    """Every image at ``high`` (the mask too, appended when the request lacks it)."""
    content = [dict(p, image_url=dict(p["image_url"], detail="high")) if p.get("type") == "image_url" else p
               for p in request.messages[1]["content"]]
    if mask and not any(p.get("type") == "image_url" and p["image_url"]["url"] == record["mask_url"] for p in content):
        content.append(image_part(record["mask_url"], "high"))
    request.messages = [request.messages[0], {"role": "user", "content": content}]
    return request


def one_key(request: LLMRequest, key: str) -> LLMRequest:
    """A judge request narrowed to one candidate's entry (one call per candidate)."""
    props = request.schema["properties"]
    request.schema = dict(request.schema, properties={key: props[key]}, required=[key])
    request.cache_parts = dict(request.cache_parts, only=key)
    return request


# -- running a shape --------------------------------------------------------------------------------
class Tally:
    def __init__(self):
        self.prompt = self.cached = self.completion = 0
        self.candidates = self.selected = 0

    def add(self, result) -> None:
        self.prompt += result.prompt_tokens or 0
        self.cached += result.cached_tokens or 0
        self.completion += result.completion_tokens or 0

    def dollars(self, prices: dict, batch: bool = False) -> float:
        scale = prices["batch"] if batch else 1.0
        uncached = self.prompt - self.cached
        return scale * (uncached * prices["in"] + self.cached * prices["in"] * prices["cached"]
                        + self.completion * prices["out"]) / 1e6

    def billed_input(self, prices: dict) -> float:
        """Input tokens as billed: uncached ones, plus cached ones at their share."""
        return self.prompt - self.cached + self.cached * prices["cached"]


def prompts_for(job: str, shape: str) -> CaptionPrompts:
    generate, judge = CURRENT[job] if shape in ("cached", "batch") else V01[job]
    return CaptionPrompts(generate=load_template(generate), judge=load_template(judge), detail="high",
                          max_image_side=1024, image_format="png", overall_mode="criteria", model="gpt-4o",
                          judge_model="gpt-4o", run_id="bench", validators="off")


async def generate(caller, shape, build, record, tally):
    request = build(record)
    if shape == "first":
        request = full_detail(request, record, mask=True)
    result = await caller.call(request)
    if result.ok:
        tally.add(result)
    return result


async def judge(caller, shape, build, rec, record, keys, tally):
    """The judge's reply for ``keys``: one call, or in (a) one full-detail call per candidate (their
    entries merged into the last reply). A failed call's result as it is."""
    calls = [one_key(full_detail(build(rec), record, mask=True), k) for k in keys] if shape == "first" \
        else [build(rec)]
    value = {}
    for request in calls:
        result = await caller.call(request)
        if not result.ok:
            return result
        tally.add(result)
        value.update(result.value)
    result.value = value
    return result


async def caption_pair(caller, prompts, shape, record, tally, context) -> str:
    g = await generate(caller, shape, lambda r: build_generate_request(prompts, r), record, tally)
    if not g.ok:
        return g.error_type
    captions = [g.value[p] for p in PERSPECTIVES]
    context[record["pair_id"]] = captions[:3]
    j = await judge(caller, shape, lambda r: build_judge_request(prompts, r), dict(record, captions=captions), record,
                    PERSPECTIVES, tally)
    if not j.ok:
        return j.error_type
    overall = [overall_score(j.value[p], "criteria") for p in PERSPECTIVES]
    tally.candidates += len(overall)
    tally.selected += sum(s.selected for s in select_captions(overall))
    return ""


def _records(rows, table):
    return [json.loads(e["_record"]) if isinstance(e["_record"], str) else e["_record"] for e in rows
            if e["_table"] == table]


async def qa_pair(caller, prompts, shape, record, tally, context) -> str:
    g = await generate(caller, shape, lambda r: qa_ops.build_generate_request(prompts, r), record, tally)
    if not g.ok:
        return g.error_type
    rows = qa_ops.handle_generate_result(prompts, record, g)
    for rec in _records(rows, "_qa_judge"):
        keys = [TYPE_KEYS[rec["qa"][i]["type"]] for i in qa_ops.judged_indices(prompts, rec["qa"])]
        j = await judge(caller, shape, lambda r: qa_ops.build_judge_request(prompts, r), rec, record, keys, tally)
        if not j.ok:
            return j.error_type
        rows = qa_ops.handle_judge_result(prompts, rec, j)
    qa = _records(rows, "qa")
    tally.candidates += len(qa)
    tally.selected += sum(bool(q["selected"]) for q in qa)
    return ""


async def run_shape(server, job, records, shape: str, context: dict, state: BatchState | None = None) -> tuple:
    tally = Tally()
    prompts = prompts_for(job, shape)
    fmt = LLMJobConfig.response_format if shape in ("cached", "batch") else "json_schema"
    caller = LLMCaller(LLMConfig(model="gpt-4o", base_url=server.base_url, timeout_s=120, use_cache=False,
                                 response_format=fmt), Secret(KEY), batch=state)
    pair = caption_pair if job == "caption" else qa_pair
    try:
        return tally, await asyncio.gather(*(pair(caller, prompts, shape, r, tally, context) for r in records))
    finally:
        await caller.aclose()


def run_batch(server, job, records, work: Path, context: dict) -> Tally:
    """(c)'s requests through the Batch API: pass 1 defers the generations, pass 2 takes them and
    defers the judgements, pass 3 takes those. The provider's prefix cache is taken to have expired
    between the two rounds of batches (they run hours apart; OpenAI keeps a prefix minutes, at most an
    hour): the server's is emptied before each round, so a judge line shares no prefix with its pair's
    generation (lines of one round still share theirs)."""
    state = BatchState(str(work), job)
    driver = BatchDriver(state, BatchAPI(server.base_url, KEY), BatchSettings(poll_s=0.2))
    for _ in range(3):
        tally, outcome = asyncio.run(run_shape(server, job, records, "batch", context, state))
        if all(o == "" for o in outcome):
            return tally
        server.configure(clear_prefix_cache=True)
        driver.submit()
        driver.wait()
    raise RuntimeError("batch passes did not finish")


def measure(server, job, records, work: Path, context: dict) -> dict:
    tallies = {}
    server.configure(prefix_cache=False)
    for shape in ("first", "v0.1"):
        server.reset()
        tallies[shape] = asyncio.run(run_shape(server, job, records, shape, context))[0]
    server.configure(prefix_cache=True)
    server.reset()
    tallies["cached"] = asyncio.run(run_shape(server, job, records, "cached", context))[0]
    server.reset()
    tallies["batch"] = run_batch(server, job, records, work / f"batch-{job}", context)
    return tallies


def summary(job: str, tallies: dict, prices: dict) -> str:
    per = {}
    unit = "caption" if job == "captions" else "QA pair"
    for shape, t in tallies.items():
        dollars = t.dollars(prices, batch=shape == "batch")
        per[shape] = dollars / max(1, t.selected)
        print(f"{job:7s} {shape:7s} prompt {t.prompt:>9,d} (cached {t.cached:>8,d}) completion {t.completion:>7,d} "
              f"tokens; ${dollars:.4f}; {t.selected}/{t.candidates} selected; ${per[shape]:.5f} and "
              f"{t.billed_input(prices) / max(1, t.selected):,.0f} billed input tokens per selected {unit}")
    b, c = tallies["v0.1"], tallies["cached"]
    input_drop = 1 - c.billed_input(prices) / max(1, b.billed_input(prices))
    acceptance = ",".join(f"{t.selected / max(1, t.candidates):.2f}" for t in tallies.values())
    # The test server's scores are hashes of the request, not judgements: acceptance moves with any byte of
    # the prompt. At equal acceptance the dollars per selected item compare as the dollars per candidate.
    per_candidate = {shape: t.dollars(prices, batch=shape == "batch") / max(1, t.candidates)
                     for shape, t in tallies.items()}
    return (f"{job} a={per['first']:.5f} b={per['v0.1']:.5f} c={per['cached']:.5f} d={per['batch']:.5f} "
            f"d_over_b={per['batch'] / per['v0.1']:.2f} "
            f"d_over_b_equal_acceptance={per_candidate['batch'] / per_candidate['v0.1']:.2f} "
            f"billed_input_b_to_c={-100 * input_drop:+.1f}% acceptance={acceptance} per_candidate="
            + ",".join(f"{per_candidate[k]:.5f}" for k in ("first", "v0.1", "cached", "batch")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--prices", default="", help="in=2.5,out=10,cached=0.5,batch=0.5 ($/Mtok; shares)")
    args = ap.parse_args(argv)
    prices = parse_prices(args.prices)
    server = ServerProcess()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = upscaled_dataset(args.pairs, args.side, Path(tmp) / "data")
            pairs, _ = find_dataset_pairs(root, None, "train")
            prep = PrepareConfig(max_image_side=args.side, image_format="png", detail="high")
            records = []
            for p in pairs:
                records += _records(prepare_pair(p, prep), "_generate")
            context: dict = {}
            captions = measure(server, "caption", records, Path(tmp), context)
            qa_records = []
            for p in pairs:
                item = dict(p, context_captions=context.get(p["pair_id"], []))
                qa_records += _records(qa_ops.prepare_qa_pair(item, prep), "_qa_generate")
            qa = measure(server, "qa", qa_records, Path(tmp), {})
    finally:
        server.close()
    print(f"dollars_per_selected {summary('captions', captions, prices)} {summary('qa', qa, prices)} "
          f"side={args.side} pairs={len(records)} prices={','.join(f'{k}={v:g}' for k, v in prices.items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
