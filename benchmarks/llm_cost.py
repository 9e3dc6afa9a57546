"""Tokens and dollars per SELECTED caption, four ways of sending the captions recipe, against the
OpenAI-compatible test server (test equipment: its replies are hash-made, its token counts follow the
gpt-4o tile rule, its prefix cache follows OpenAI's: a leading match of at least 1,024 tokens, in steps
of 128). The LEVIR-CD sample pairs are upscaled to the paper's 1024 px crops.

(a) ``first``: the recipe as a first implementation sends it: the three images (mask too) at full
    detail, one generation call, then one judge call per candidate (five).
(b) ``v0.1``: the request layout of changeforge 0.1 (copied here, since the real builders are being
    reordered for prefix caching): per-stage system text and pair text before the images, the mask at
    ``low`` for generation, one judge call for all candidates. Real time, no prefix cache.
(c) ``cached``: the real builders (``operators.language.caption_ops``) with the server's prefix cache on;
    cached input tokens are billed at ``cached`` times the input price.
(d) ``batch``: (c)'s requests through the Batch API (``operators.llm.batch``), at ``batch`` times the
    prices (cached tokens at the cached share of that).

Selection is the job's own (``overall_score`` with ``--overall criteria``, ``select_captions``) on the
judge's scores, so acceptance is what the scores give in each shape; it is printed, and dollars are
per selected caption. Ends with one line:
``dollars_per_caption a=.. b=.. c=.. d=.. d_over_b=.. billed_input_b_to_c=-..% acceptance=..``.

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

from operators.language.caption_ops import (CaptionPrompts, PrepareConfig, build_generate_request,
                                            build_judge_request, find_dataset_pairs, prepare_pair)
from operators.language.captions import load_template, overall_score, select_captions
from operators.llm.job_runner import LLMJobConfig

# The templates the captions job sends by default (the cache-shaped ones).
CURRENT = {"generate": LLMJobConfig.generate_template, "judge": LLMJobConfig.judge_template}
from operators.llm.batch import BatchAPI, BatchDriver, BatchSettings, BatchState
from operators.llm.client import LLMCaller, LLMConfig, LLMRequest, Secret
from operators.llm.images import image_part
from tests.openai_test_server import ServerProcess

REPO = Path(__file__).resolve().parents[1]
PERSPECTIVES = None   # set from the builders' schema at run time


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


# -- (a) and (b): request shapes built here --------------------------------------------------------
def v01_generate(prompts: CaptionPrompts, record: dict, mask_detail: str = "low") -> LLMRequest:
    """changeforge 0.1's generation layout: [system] [user: pair text, A, B, mask]."""
    request = build_generate_request(prompts, record)
    system, user = prompts.generate.render(car_percent=f"{100 * record['car']:.1f}",
                                           region=record["change_region"], components=record["components"])
    content = [{"type": "text", "text": user}, image_part(record["a_url"], prompts.detail),
               image_part(record["b_url"], prompts.detail), image_part(record["mask_url"], mask_detail)]
    request.messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    return request


def v01_judge(prompts: CaptionPrompts, record: dict, captions: list[str], only: str | None = None,
              mask: bool = False) -> LLMRequest:
    """0.1's judge layout: [system] [user: text with the candidates, A, B]; ``only``: one candidate
    (the first implementation's one call per candidate, which also sent the mask)."""
    rec = dict(record, captions=captions)
    request = build_judge_request(prompts, rec)
    keys = [only] if only else list(PERSPECTIVES)
    listing = "\n".join(f"{p}: {c}" for p, c in zip(PERSPECTIVES, captions) if p in keys)
    system, user = prompts.judge.render(region=record["change_region"], captions=listing, keys=", ".join(keys))
    content = [{"type": "text", "text": user}] + [image_part(record[k], prompts.detail) for k in ("a_url", "b_url")]
    if mask:
        content.append(image_part(record["mask_url"], prompts.detail))
    request.messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    if only:
        props = request.schema["properties"]
        request.schema = dict(request.schema, properties={only: props[only]}, required=[only])
        request.cache_parts = dict(request.cache_parts, only=only)
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


def select(tally: Tally, scores: dict) -> None:
    overall = [overall_score(scores[p], "criteria") for p in PERSPECTIVES]
    tally.candidates += len(overall)
    tally.selected += sum(s.selected for s in select_captions(overall))


async def run_shape(server, records, prompts, shape: str, state: BatchState | None = None,
                    tally: Tally | None = None) -> Tally:
    tally = tally or Tally()
    caller = LLMCaller(LLMConfig(model="gpt-4o", base_url=server.base_url, timeout_s=120, use_cache=False),
                       Secret("sk-benchmark-0000000000"), batch=state)
    try:
        async def pair(record):
            gen = v01_generate(prompts, record, "high" if shape == "first" else "low") \
                if shape in ("first", "v0.1") else build_generate_request(prompts, record)
            g = await caller.call(gen)
            if not g.ok:
                return g.error_type
            tally.add(g)
            captions = [g.value[p] for p in PERSPECTIVES]
            if shape == "first":
                scores = {}
                for p in PERSPECTIVES:
                    j = await caller.call(v01_judge(prompts, record, captions, only=p, mask=True))
                    tally.add(j)
                    scores[p] = j.value[p]
            else:
                judge = v01_judge(prompts, record, captions) if shape == "v0.1" else \
                    build_judge_request(prompts, dict(record, captions=captions))
                j = await caller.call(judge)
                if not j.ok:
                    return j.error_type
                tally.add(j)
                scores = j.value
            select(tally, scores)
            return ""
        return tally, await asyncio.gather(*(pair(r) for r in records))
    finally:
        await caller.aclose()


def run_batch(server, records, prompts, work: Path) -> Tally:
    """(c)'s requests through the Batch API: pass 1 defers the generations, pass 2 takes them and
    defers the judgements, pass 3 takes those."""
    state = BatchState(str(work), "bench")
    driver = BatchDriver(state, BatchAPI(server.base_url, "sk-benchmark-0000000000"), BatchSettings(poll_s=0.2))
    for _ in range(3):
        tally, outcome = asyncio.run(run_shape(server, records, prompts, "batch", state))
        if all(o == "" for o in outcome):
            return tally
        driver.submit()
        driver.wait()
    raise RuntimeError("batch passes did not finish")


def main(argv=None) -> int:
    global PERSPECTIVES
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--prices", default="", help="in=2.5,out=10,cached=0.5,batch=0.5 ($/Mtok; shares)")
    args = ap.parse_args(argv)
    prices = parse_prices(args.prices)
    from operators.language.caption_ops import PERSPECTIVES as P
    PERSPECTIVES = tuple(P)
    server = ServerProcess()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = upscaled_dataset(args.pairs, args.side, Path(tmp) / "data")
            pairs, _ = find_dataset_pairs(root, None, "train")
            prep = PrepareConfig(max_image_side=args.side, image_format="png", detail="high")
            records = []
            for p in pairs:
                env = prepare_pair(p, prep)
                records += [json.loads(e["_record"]) if isinstance(e["_record"], str) else e["_record"]
                            for e in env if e["_table"] == "_generate"]
            prompts = CaptionPrompts(generate=load_template("caption_generate.v1"),
                                     judge=load_template("caption_judge.v1"), detail="high",
                                     max_image_side=args.side, image_format="png", overall_mode="criteria",
                                     model="gpt-4o", judge_model="gpt-4o", run_id="bench", validators="off")
            tallies = {}
            server.configure(prefix_cache=False)
            for shape in ("first", "v0.1"):
                server.reset()
                tallies[shape] = asyncio.run(run_shape(server, records, prompts, shape))[0]
            server.configure(prefix_cache=True)
            server.reset()
            # (c) and (d): the real builders with the current (cache-shaped) templates.
            shaped = dataclasses.replace(prompts, generate=load_template(CURRENT["generate"]),
                                         judge=load_template(CURRENT["judge"]))
            tallies["cached"] = asyncio.run(run_shape(server, records, shaped, "cached"))[0]
            server.reset()
            tallies["batch"] = run_batch(server, records, shaped, Path(tmp) / "batch")
    finally:
        server.close()
    per = {}
    for shape, t in tallies.items():
        dollars = t.dollars(prices, batch=shape == "batch")
        per[shape] = dollars / max(1, t.selected)
        print(f"{shape:7s} prompt {t.prompt:>9,d} (cached {t.cached:>8,d}) completion {t.completion:>7,d} tokens; "
              f"${dollars:.4f}; {t.selected}/{t.candidates} captions selected; "
              f"${per[shape]:.5f} and {t.billed_input(prices) / max(1, t.selected):,.0f} billed input tokens "
              "per selected caption")
    b, c = tallies["v0.1"], tallies["cached"]
    input_drop = 1 - c.billed_input(prices) / max(1, b.billed_input(prices))
    acceptance = ",".join(f"{t.selected / max(1, t.candidates):.2f}" for t in tallies.values())
    print(f"dollars_per_caption a={per['first']:.5f} b={per['v0.1']:.5f} c={per['cached']:.5f} d={per['batch']:.5f} "
          f"d_over_b={per['batch'] / per['v0.1']:.2f} billed_input_b_to_c={-100 * input_drop:+.0f}% "
          f"acceptance={acceptance} side={args.side} pairs={len(records)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
