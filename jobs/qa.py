"""The QA job (JL1-QA recipe, JL1-CC&QA section II-C): change-detection triplets (with the captions
job's selected captions as context, when there are any) in, judged change question-answer pairs out.

    python -m jobs.qa --input <captions job output | dataset> --output <folder | s3://prefix> --model <name>

``--input`` is either a captions job output (its dataset is read from the ``source.json`` the captions
job writes, or given with ``--images``; up to three selected captions per pair go into the prompt) or
a dataset in the LEVIR-CD layout (no captions, unless ``--captions`` names a captions output or a
LEVIR-CC JSON). Per pair one request generates ``--qa-per-pair`` QA pairs of distinct question types
drawn (seeded by ``--seed`` and the pair id, recorded) from the paper's eight; the grounded validators
check every answer against the mask (``--validators``); one request judges all of them together.
Outputs under --output: ``qa/`` (every candidate), ``pairs/``, ``usage/``, ``errors/``, ``VQA.json``
and ``_cache/llm/``. Endpoint, key, limits, cache and resume work as in the captions job.
"""
from __future__ import annotations

import os
import sys

if not __package__:  # run as `python jobs/qa.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import logging
from collections import Counter

import pyarrow.compute as pc
from dataclasses import dataclass

from operators.language.validators import validator_tally
from operators.llm.job_options import HELP as LLM_HELP
from operators.llm.job_options import (LLMJobConfig, build_parser as _build_parser, parse_args as _parse_args,
                                       require_endpoint)
from operators.llm.job_passes import BatchesOpen, QuotaStop, run_llm_job, stop_line
from operators.llm.job_runner import account_limiter, ensure_ray, generate_and_judge_stages, set_aside_no_mask
from operators.llm.job_summary import peak_rss_mb, row_batches, run_on_worker, run_usage, skipped_line, summary_table
from operators.io import console
from operators.io.sources import SOURCE_FILE, read_source, write_source
from operators.io import lineage
from operators.io.storage import Store
from operators.io.tables import current_error_items, ordered_run_id, read_table, resolve_errors
from operators.io.work_list import delete_stale_work_lists
from operators.language.caption_ops import PrepareConfig, find_dataset_pairs
from operators.language.qa import OVERALL_MODES, QUESTION_TYPES, vqa_rows, write_vqa
from operators.language.qa_ops import (JOB, MAX_CONTEXT_CAPTIONS, TABLE_SCHEMAS, VALIDATOR_POLICIES, build_generate_request,
                                       build_judge_request, context_for, handle_generate_result, handle_judge_result,
                                       load_caption_context, prepare_qa_pair)
from operators.language.resume import job_lineage, plan as resume_plan, run_prompts
from operators.llm.usage import format_summary

log = logging.getLogger("changeforge.qa")

VQA_FILE = "VQA.json"


@dataclass
class QAJobConfig(LLMJobConfig):
    """The LLM jobs' options (endpoint, limits, images, retries, cache, pool) plus the QA ones."""
    max_tokens: int = 2000                # five QA pairs are longer than five captions
    generate_template: str = "qa_generate.v4"
    judge_template: str = "qa_judge.v4"
    dataset: str = ""
    captions: str = ""
    qa_per_pair: int = 5
    seed: int = 0


HELP = {
    **LLM_HELP,
    "input": "a captions job output (folder or s3:// prefix; its captions become context) or a dataset in the "
             "LEVIR-CD layout (A/ B/ label/, optionally under train/ val/ test/)",
    "output": "output folder or s3:// prefix (tables, VQA json, response cache)",
    "dataset": "the dataset of a captions job output given as --input (default: the one recorded in its source.json)",
    "captions": "captions for the context when --input is a dataset: a captions job output or a LEVIR-CC JSON file",
    "qa_per_pair": "QA pairs generated per image pair, each of a different question type (of the paper's 8)",
    "seed": "seed of the per-pair draw of question types (with the pair id; recorded in pairs/)",
    "validators": "grounded validators on every answer: reject = a QA pair that breaks a rule is not sent to the "
                  "judge (recorded with the rule), flag = sent, verdict stored, off = not run. Under every policy "
                  "an answer with a figure (a percentage or a measured quantity, hedged or not: the paper's "
                  "numbers rule) is not sent to the judge",
    "overall": "how a QA pair's integer overall score is formed: criteria = mean of the four criteria rounded "
               "half up, but a QA pair with answer accuracy <= 4 (hallucinated) scores its accuracy; judge = the "
               "judge's own overall score; min = lowest criterion; mean = unrounded mean (a float, not the "
               "paper's); below 7 is discarded (no top-k)",
    "generate_template": "prompt template (file stem under --prompts-dir) for QA generation",
    "judge_template": "prompt template (file stem under --prompts-dir) for QA judging",
    "max_tokens": "completion token cap per request (thinking models spend part of it on reasoning: raise it)",
}
PROG, DESCRIPTION = "python -m jobs.qa", __doc__.split("\n\n")[0]


def build_parser():
    return _build_parser(QAJobConfig, HELP, PROG, DESCRIPTION, {"overall": OVERALL_MODES})


def parse_args(argv: list[str] | None = None) -> QAJobConfig:
    return _parse_args(argv, QAJobConfig, HELP, PROG, DESCRIPTION, {"overall": OVERALL_MODES})


def resolve_inputs(cfg: QAJobConfig) -> tuple[str, str | None]:
    """(dataset URI, captions source or None) from --input / --images / --captions."""
    store = Store(cfg.input)
    is_captions_output = store.exists(SOURCE_FILE) or bool(store.list("captions", suffixes=(".parquet",)))
    if not is_captions_output:
        return cfg.input, (cfg.captions or None)
    dataset = cfg.dataset
    if not dataset:
        doc = read_source(store)
        dataset = doc.get("dataset") or doc.get("input", "")
    if not dataset:
        raise SystemExit(f"jobs.qa: {cfg.input} is a captions job output without {SOURCE_FILE}; name its dataset "
                         "with --images")
    return dataset, cfg.captions or cfg.input


def plan_run(cfg: QAJobConfig, out: Store, dataset: str, captions_source: str | None, run_id: str = "",
             record: bool = True):
    """(prompts, resume plan, pairs found, pairs with caption context, pairs skipped by reason) of a run on
    ``out``. A QA pair's lineage adds the caption set it was grounded in: a pair whose selected captions
    changed is asked again. ``record=False`` writes nothing (``changeforge chain --explain``)."""
    context = load_caption_context(captions_source, limit=None) if captions_source else {}
    pairs, skipped = find_dataset_pairs(dataset, cfg.list_file or None, cfg.default_split)
    for p in pairs:
        kept = context_for(p, context)
        p["context_captions"] = kept[:MAX_CONTEXT_CAPTIONS]
        p["captions_digest"] = lineage.caption_set_digest(kept) if captions_source else None
    del context
    prompts = run_prompts(cfg, out, JOB, QAJobConfig, TABLE_SCHEMAS["pairs"], run_id, record)
    run_lineage = job_lineage(cfg, prompts, extra=("seed", "qa_per_pair"))

    def lineage_of(p: dict) -> dict:
        return {**run_lineage, **({"captions": p["captions_digest"]} if p.get("captions_digest") else {})}

    resume = resume_plan(out, pairs, lineage_of, TABLE_SCHEMAS["pairs"])
    return prompts, resume, len(pairs), sum(1 for p in pairs if p["context_captions"]), skipped


def status(cfg: QAJobConfig) -> dict:
    """What a run would do (operators.io.lineage.status), reading only: for ``changeforge chain --explain``
    and for the chain's decision to run this step again."""
    out = Store(cfg.output)
    dataset, captions_source = resolve_inputs(cfg)
    _, resume, _, _, _ = plan_run(cfg, out, dataset, captions_source, record=False)
    return lineage.status(resume, current_error_items(out))


def run(cfg: QAJobConfig) -> dict:
    """Run the job; returns a summary dict (also printed by ``main``)."""
    base_url = require_endpoint(cfg, "qa")
    if cfg.overall not in OVERALL_MODES or cfg.validators not in VALIDATOR_POLICIES:
        raise ValueError(f"--overall must be one of {OVERALL_MODES}, --validators one of {VALIDATOR_POLICIES}")
    if not 1 <= cfg.qa_per_pair <= len(QUESTION_TYPES):
        raise ValueError(f"--qa-per-pair must be between 1 and {len(QUESTION_TYPES)}")
    dataset, captions_source = resolve_inputs(cfg)
    ensure_ray(cfg)
    from operators.io.tables import TableSink

    out = Store(cfg.output)
    run_id = ordered_run_id(out, TABLE_SCHEMAS)   # after every earlier run's shards
    write_source(out, JOB, input=cfg.input, dataset=dataset, captions=captions_source, list_file=cfg.list_file)
    prompts, resume, n_found, n_context, skipped = plan_run(cfg, out, dataset, captions_source, run_id)
    for reason, n in skipped.items():
        log.info("%d pairs skipped: %s", n, reason)
    todo = resume.todo
    n_todo = len(todo)
    # A pair without a mask: recorded once in errors/, sent nowhere, never counted as failed.
    todo, no_mask = set_aside_no_mask(out, todo, JOB, run_id)
    delete_stale_work_lists(out, JOB)   # a killed driver never reached its own cleanup
    log.info("%d pairs found (%d with caption context), %d already finished and current, %d without a mask, "
             "%d to do (run %s)", n_found, n_context, n_found - n_todo, len(no_mask), len(todo), run_id)
    if resume.stale:
        log.info("%s", lineage.redo_line(resume))
    counts: dict[str, int] = {}
    stopped = ""
    if todo:
        limiter, common = account_limiter(cfg, base_url, run_id, JOB, out.uri() if cfg.cache else None, out.uri())
        generate, judge = generate_and_judge_stages(
            cfg, base_url, common, prompts, ("qa_generate", "_qa_generate", build_generate_request,
                                             handle_generate_result),
            ("qa_judge", "_qa_judge", build_judge_request, handle_judge_result))
        prep = PrepareConfig(max_image_side=cfg.max_image_side, image_format=cfg.image_format, detail=cfg.detail)
        try:
            counts = run_llm_job(cfg, todo, prepare_qa_pair, {"config": prep, "run_id": run_id, "seed": cfg.seed,
                                                              "qa_per_pair": cfg.qa_per_pair},
                                 [generate, judge], lambda: TableSink(out.uri(), TABLE_SCHEMAS, run_id), limiter,
                                 out=out, job=JOB, run_id=run_id)
        except (QuotaStop, BatchesOpen) as exc:
            stopped = stop_line(exc)   # what finished is in the tables; the end of the run still runs

    # The end of the run in a worker process of its own, as in the captions job: it reads the tables
    # back (columnar; read whole, the qa table grew the driver 1.47x from 1x to 10x input) and the
    # driver must not grow with the archive.
    finished = run_on_worker(finish_qa_run, out.uri(), run_id, cfg.validators)
    log.info("end of run assembled in a worker (peak RSS %.0f MB)", finished.pop("assembly_peak_rss_mb"))
    return {"run_id": run_id, "pairs_found": n_found, "pairs_skipped_finished": n_found - n_todo,
            "lineage": resume.counts(), "redone": lineage.redo_line(resume),
            "unreadable": lineage.unreadable_line(resume), "pairs_no_mask": len(no_mask), "pairs_no_mask_first": no_mask[:5],
            "pairs_skipped": skipped, "rows_written": counts, "stopped": stopped, **finished}


def finish_qa_run(output: str, run_id: str, validators: str) -> dict:
    """The end of a QA run: this run's successes resolve their earlier errors, ``VQA.json`` is written
    from the ``qa`` and ``pairs`` tables (only the columns it needs, streamed out), and this run's
    rows are counted. Idempotent. Returns the summary's counts and this process's peak RSS."""
    out = Store(output)
    pair_table = summary_table(out, "pairs", ["pair_id", "split", "filename", "car"], schemas=TABLE_SCHEMAS)
    finished = 0 if pair_table is None else pair_table.num_rows
    # errors/ accumulates across runs; a pair's errors leave its current state once it succeeds.
    if pair_table is not None:
        resolve_errors(out, pair_table.column("pair_id").to_pylist(), run_id, job=JOB)
    # One read of qa/ serves the VQA file and this run's counts.
    qa_table = summary_table(out, "qa", ["pair_id", "qa_index", "question_type", "question", "answer", "selected",
                                         "validator_ok", "validator_violations", "run_id"], schemas=TABLE_SCHEMAS)
    with out.open_output(VQA_FILE) as f:
        write_vqa(row_batches(None if pair_table is None or qa_table is None else vqa_rows(pair_table, qa_table)), f)
    this_run = None if qa_table is None else qa_table.filter(pc.equal(qa_table["run_id"], run_id))
    del pair_table, qa_table
    tally = validator_tally((r for rows in row_batches(None if this_run is None else this_run.select(
        ["validator_ok", "validator_violations"])) for r in rows), validators)
    errors = read_table(out, "errors", TABLE_SCHEMAS["errors"], columns=["run_id"])
    return {**tally, "pairs_finished_total": finished,
            "errors": 0 if errors is None else pc.sum(pc.equal(errors["run_id"], run_id)).as_py() or 0,
            "qa_candidates": 0 if this_run is None else this_run.num_rows,
            "qa_selected": 0 if this_run is None else sum(bool(v) for v in this_run["selected"].to_pylist()),
            "question_types": {} if this_run is None else dict(Counter(this_run["question_type"].to_pylist())),
            "usage": run_usage(out, run_id, TABLE_SCHEMAS), "assembly_peak_rss_mb": peak_rss_mb()}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_args(argv)
    s = run(cfg)
    print(f"run {s['run_id']}: {s['pairs_found']} pairs, {s['pairs_skipped_finished']} already finished, "
          f"{s['pairs_finished_total']} finished in total, {s['errors']} errors in this run")
    if s["redone"]:
        print(s["redone"])
    if s["unreadable"]:
        print(s["unreadable"])
    if s["pairs_skipped"]:
        print(skipped_line(s["pairs_skipped"]))
    print(f"QA pairs in this run: {s['qa_candidates']} generated, {s['qa_selected']} selected; validators "
          f"({s['validators']}) caught per rule: " + ", ".join(f"{k}={v}" for k, v in s["validator_caught"].items())
          + (f"; {s['validator_rejected']} not sent to the judge" if s["validators"] == "reject" else ""))
    print(format_summary(s["usage"]))
    print(f"outputs: {cfg.output}/{{qa,pairs,usage,errors}}/ and {cfg.output}/{VQA_FILE}")
    if s["stopped"]:
        print(s["stopped"])
        return 3
    console.explain_llm_run("qa:", cfg.output, s)   # errors by reason; exit 3 if nothing finished
    return 0


if __name__ == "__main__":
    from operators.process_exit import run as run_process    # this module may have its own run
    run_process(main)
