"""The captions job (JL1-CC recipe, JL1-CC&QA section II-B): change-detection triplets in, judged
change captions out, through any OpenAI-compatible endpoint.

    python -m jobs.caption --input data/levir-cd --output out/captions-run --model <name>

Endpoint and key come from OPENAI_BASE_URL and OPENAI_API_KEY (or --base-url, and --api-key-source
for a secret file or an AWS Secrets Manager secret read on each worker; never a command-line value,
so the key sits in no shell history, process list, actor argument or dashboard). Outputs under --output:
``captions/`` (every candidate with scores and the selection), ``pairs/`` (one row per pair: mask stats
and selected captions), ``usage/`` (tokens and cost per request), ``errors/`` (this run's failures),
``LevirCCcaptions.json`` (LEVIR-CC format) and ``_cache/llm/`` (answers, so reruns pay nothing twice);
while it runs, ``_work/worklist/`` holds the pairs to do, which the workers read a batch at a time.
A rerun skips pairs already in ``pairs/`` whose rows were made from today's inputs (images, mask,
templates, models, settings: each row's ``lineage``, operators.io.lineage), redoes the others, and
answers the rest from the cache where it can.

Real endpoints (the key is read from the environment only):

    # OpenAI
    export OPENAI_BASE_URL=https://api.openai.com/v1 OPENAI_API_KEY=sk-...
    python -m jobs.caption --input data/levir-cd --output out/levir-cc --model gpt-4.1-mini \
        --rpm 500 --tpm 200000 --max-image-side 512 --price-per-mtok-in 0.40 --price-per-mtok-out 1.60 \
        --batch-api    # half price through the Batch API (answers within 24 h); per image, gpt-4o-mini
                       # costs more than gpt-4o (docs/llm-endpoints.md)

    # Moonshot / Kimi (the paper's generator; a thinking model: leave temperature to the endpoint)
    export OPENAI_BASE_URL=https://api.moonshot.ai/v1 OPENAI_API_KEY=<moonshot key>
    python -m jobs.caption --input s3://bucket/levir-cd --output s3://bucket/levir-cc --model kimi-k2.6 \
        --temperature -1 --max-tokens 8000 --rpm 200 --tpm 1000000

    # local vLLM with a vision model (vllm serve Qwen/Qwen2.5-VL-7B-Instruct --port 8000)
    export OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=EMPTY
    python -m jobs.caption --input data/levir-cd --output out/levir-cc --model Qwen/Qwen2.5-VL-7B-Instruct \
        --rpm 0 --tpm 0 --max-in-flight 64
"""
from __future__ import annotations

import os
import sys

if not __package__:  # run as `python jobs/caption.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import logging
from dataclasses import dataclass

import pyarrow.compute as pc

from operators.language.caption_ops import (JOB, TABLE_SCHEMAS, PrepareConfig, build_generate_request,
                                   build_judge_request, find_dataset_pairs, handle_generate_result,
                                   handle_judge_result, prepare_pair)
from operators.language.captions import OVERALL_MODES, write_levir_cc
from operators.language.validators import validator_tally
from operators.llm.job_options import (HELP, LLMJobConfig, build_parser as _build_parser, parse_args as _parse_args,
                                       require_endpoint)
from operators.llm.job_passes import BatchesOpen, QuotaStop, run_llm_job, stop_line
from operators.llm.job_runner import account_limiter, ensure_ray, generate_and_judge_stages, set_aside_no_mask
from operators.llm.job_summary import (peak_rss_mb, row_batches, run_on_worker, run_usage, skipped_line,
                                       summary_rows, summary_table)
from operators.llm.usage import format_summary
from operators.io import console
from operators.io.sources import write_source
from operators.io.storage import Store
from operators.io.work_list import delete_stale_work_lists
from operators.io import lineage
from operators.io.tables import current_error_items, ordered_run_id, read_table, resolve_errors
from operators.language.resume import job_lineage, plan as resume_plan, run_prompts

log = logging.getLogger("changeforge.caption")

LEVIR_CC_FILE = "LevirCCcaptions.json"
PROG, DESCRIPTION = "python -m jobs.caption", __doc__.split("\n\n")[0]


@dataclass
class CaptionJobConfig(LLMJobConfig):
    """The shared LLM job options (the captions job's templates are their defaults)."""


def build_parser():
    return _build_parser(CaptionJobConfig, HELP, PROG, DESCRIPTION, {"overall": OVERALL_MODES})


def parse_args(argv: list[str] | None = None) -> CaptionJobConfig:
    return _parse_args(argv, CaptionJobConfig, HELP, PROG, DESCRIPTION, {"overall": OVERALL_MODES})


def plan_run(cfg: CaptionJobConfig, out: Store, run_id: str = "", record: bool = True):
    """(prompts, resume plan, pairs found, pairs skipped by reason) of a run on ``out``: which pairs are
    current, stale (and why) or missing. ``record=False`` writes nothing (``changeforge chain --explain``)."""
    pairs, skipped = find_dataset_pairs(cfg.input, cfg.list_file or None, cfg.default_split)
    prompts = run_prompts(cfg, out, JOB, CaptionJobConfig, TABLE_SCHEMAS["pairs"], run_id, record)
    # Resume by lineage: a finished pair is done again when its images, mask, templates, models or
    # result-changing settings differ from what its rows were made from.
    run_lineage = job_lineage(cfg, prompts)
    return prompts, resume_plan(out, pairs, lambda p: run_lineage, TABLE_SCHEMAS["pairs"]), len(pairs), skipped


def status(cfg: CaptionJobConfig) -> dict:
    """What a run would do (operators.io.lineage.status), reading only: for ``changeforge chain --explain``
    and for the chain's decision to run this step again."""
    out = Store(cfg.output)
    _, resume, _, _ = plan_run(cfg, out, record=False)
    return lineage.status(resume, current_error_items(out))


def run(cfg: CaptionJobConfig) -> dict:
    """Run the job; returns a summary dict (also printed by ``main``)."""
    base_url = require_endpoint(cfg, "caption")
    if cfg.overall not in OVERALL_MODES:
        raise ValueError(f"--overall must be one of {OVERALL_MODES}")
    ensure_ray(cfg)
    from operators.io.tables import TableSink

    out = Store(cfg.output)
    run_id = ordered_run_id(out, TABLE_SCHEMAS)   # after every earlier run's shards
    # Which dataset was captioned, so that the QA job, the review and the report find it from here.
    write_source(out, JOB, input=cfg.input, dataset=cfg.input, list_file=cfg.list_file)
    prompts, resume, n_found, skipped = plan_run(cfg, out, run_id)
    for reason, n in skipped.items():
        log.info("%d pairs skipped: %s", n, reason)
    todo = resume.todo
    n_todo = len(todo)
    # A pair without a mask: recorded once in errors/, sent nowhere, never counted as failed.
    todo, no_mask = set_aside_no_mask(out, todo, JOB, run_id)
    delete_stale_work_lists(out, JOB)   # a killed driver never reached its own cleanup
    log.info("%d pairs found, %d already finished and current, %d without a mask, %d to do (run %s)",
             n_found, n_found - n_todo, len(no_mask), len(todo), run_id)
    if resume.stale:
        log.info("%s", lineage.redo_line(resume))

    limiter, common = account_limiter(cfg, base_url, run_id, JOB, out.uri() if cfg.cache else None, out.uri())
    generate, judge = generate_and_judge_stages(
        cfg, base_url, common, prompts, ("caption_generate", "_generate", build_generate_request,
                                         handle_generate_result),
        ("caption_judge", "_judge", build_judge_request, handle_judge_result))

    counts: dict[str, int] = {}
    stopped = ""
    if todo:
        prep = PrepareConfig(max_image_side=cfg.max_image_side, image_format=cfg.image_format, detail=cfg.detail)
        try:
            counts = run_llm_job(cfg, todo, prepare_pair, {"config": prep, "run_id": run_id}, [generate, judge],
                                 lambda: TableSink(out.uri(), TABLE_SCHEMAS, run_id), limiter, out=out, job=JOB,
                                 run_id=run_id)
        except (QuotaStop, BatchesOpen) as exc:
            stopped = stop_line(exc)   # what finished is in the tables; the end of the run still runs
    # The end of the run (LEVIR-CC file, errors resolved, counts) runs in a worker process of its own:
    # its Arrow reads and sort grow with the archive, and the driver must not (benchmarks/memory_scale.py).
    finished = run_on_worker(finish_captions_run, out.uri(), run_id, cfg.validators)
    log.info("end of run assembled in a worker (peak RSS %.0f MB)", finished.pop("assembly_peak_rss_mb"))
    return {"run_id": run_id, "pairs_found": n_found, "pairs_skipped_finished": n_found - n_todo,
            "lineage": resume.counts(), "redone": lineage.redo_line(resume),
            "unreadable": lineage.unreadable_line(resume), "pairs_no_mask": len(no_mask), "pairs_no_mask_first": no_mask[:5],
            "pairs_skipped": skipped, "rows_written": counts, "stopped": stopped, **finished}


def finish_captions_run(output: str, run_id: str, validators: str) -> dict:
    """The end of a captions run: this run's successes resolve their earlier errors, the LEVIR-CC
    file is written from the ``pairs`` table (read columnar, streamed out), and this run's rows are
    counted. Idempotent. Returns the summary's counts and this process's peak RSS."""
    out = Store(output)
    pair_table = summary_table(out, "pairs", ["pair_id", "split", "filename", "selected_captions", "car"],
                               schemas=TABLE_SCHEMAS)
    finished = 0 if pair_table is None else pair_table.num_rows
    # errors/ accumulates across runs; a pair's errors leave its current state once it succeeds.
    if pair_table is not None:
        resolve_errors(out, pair_table.column("pair_id").to_pylist(), run_id, job=JOB)
        pair_table = pair_table.sort_by([("split", "ascending"), ("filename", "ascending")])
    with out.open_output(LEVIR_CC_FILE) as f:
        write_levir_cc(row_batches(pair_table), f)
    del pair_table
    # This run's rows in the current state (a rerun's pair without a mask keeps its earlier run's row).
    errors_table = read_table(out, "errors", TABLE_SCHEMAS["errors"], columns=["run_id"])
    tally = validator_tally(summary_rows(out, "captions", ["validator_ok", "validator_violations"], run_id,
                                         schemas=TABLE_SCHEMAS), validators)
    return {**tally, "pairs_finished_total": finished,
            "errors": 0 if errors_table is None else pc.sum(pc.equal(errors_table["run_id"], run_id)).as_py() or 0,
            "usage": run_usage(out, run_id, TABLE_SCHEMAS),
            "assembly_peak_rss_mb": peak_rss_mb()}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_args(argv)
    summary = run(cfg)
    print(f"run {summary['run_id']}: {summary['pairs_found']} pairs, {summary['pairs_skipped_finished']} already "
          f"finished, {summary['pairs_finished_total']} finished in total, {summary['errors']} errors in this run")
    if summary["redone"]:
        print(summary["redone"])
    if summary["unreadable"]:
        print(summary["unreadable"])
    if summary["pairs_skipped"]:
        print(skipped_line(summary["pairs_skipped"]))
    print(f"validators ({summary['validators']}) caught per rule: "
          + ", ".join(f"{k}={v}" for k, v in summary["validator_caught"].items())
          + (f"; {summary['validator_rejected']} captions not sent to the judge" if cfg.validators == "reject" else ""))
    print(format_summary(summary["usage"]))
    print(f"outputs: {cfg.output}/{{captions,pairs,usage,errors}}/ and {cfg.output}/{LEVIR_CC_FILE}")
    if summary["stopped"]:
        print(summary["stopped"])
        return 3
    console.explain_llm_run("caption:", cfg.output, summary)   # errors by reason; exit 3 if nothing finished
    return 0


if __name__ == "__main__":
    from operators.process_exit import run as run_process    # this module may have its own run
    run_process(main)
