"""The scoring job: predictions scored against this project's datasets (and any dataset in the
same formats) the way the field's reference code scores them.

    python -m jobs.score change   --pred <folder | s3://prefix> --masks <folder | s3://prefix> --output <folder>
    python -m jobs.score captions --pred <predictions JSON> --refs <LEVIR-CC-style JSON> --output <folder>
    python -m jobs.score qa       --pred <predictions JSON> --refs <QA JSON> --output <folder>

Each writes ``metrics.json``, a ``per_image/`` (or ``per_question/``) Parquet table and an ``errors/``
table under --output (a folder or an s3:// prefix). A rerun recomputes the scores and replaces them.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass, field, replace

if __package__ in (None, ""):  # `python jobs/score.py` (e.g. under `ray job submit`)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from operators.io import console  # noqa: E402
from operators.io.cli import add_config_args, config_from_args, init_ray, parse_job_args  # noqa: E402
from operators.io.storage import Store, read_uri  # noqa: E402
from operators.io.tables import new_run_id, prune_shards  # noqa: E402

log = logging.getLogger("changeforge.score")


@dataclass
class ChangeScoreConfig:
    pred: str = field(default="", metadata={"path": "dir", "holds": ((".png",), "PNG masks"), "required": True, "help": "folder or s3:// prefix of predicted change masks (PNG; any non-zero pixel is change)"})
    label: str = field(default="", metadata={"path": "dir", "holds": ((".png",), "PNG masks"), "flag": "masks", "old_flags": ("--label",), "required": True, "help": "folder or s3:// prefix of reference masks (PNG), matched to predictions by file name"})
    output: str = field(default="", metadata={"required": True, "help": "output folder or s3:// prefix (metrics.json, per_image/, errors/)"})
    masks_per_task: int = field(default=64, metadata={"min": 1, "help": "mask pairs decoded and counted per Ray task"})
    num_cpus: int | None = field(default=None, metadata={"min": 1, "help": "CPUs for a local Ray (ignored when RAY_ADDRESS points at a cluster; default: all)"})


def _ensure_ray(num_cpus: int | None) -> None:
    """Local workers inherit the environment but not sys.path: put the repo on PYTHONPATH so that
    ``python jobs/score.py`` works from any folder without an install (as the other jobs do)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    before = os.environ.get("PYTHONPATH")
    if repo not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([repo] + paths)
    try:
        init_ray(num_cpus)
    finally:   # a local Ray's processes took it at start; the caller's environment is left as it was
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def _change_items(cfg: ChangeScoreConfig):
    """(items to score with their masks' URIs and stamps, matched pairs, matching problems, prediction
    names, label names): one listing of each folder, its stamps with it."""
    from operators.scoring.masks import MASK_SUFFIXES, match_masks

    pred_store, label_store = Store(cfg.pred), Store(cfg.label)
    pred_stamps = pred_store.stamps(suffixes=MASK_SUFFIXES, recursive=False)
    label_stamps = label_store.stamps(suffixes=MASK_SUFFIXES, recursive=False)
    if not label_stamps:
        raise SystemExit(f"jobs.score change: no PNG masks in --label {cfg.label}")
    pairs, problems = match_masks(sorted(pred_stamps), sorted(label_stamps))
    items = [{"name": p["name"], "pred": pred_store.uri(p["pred"]), "label": label_store.uri(p["label"]),
              "pred_stamp": pred_stamps[p["pred"]], "label_stamp": label_stamps[p["label"]],
              "error_type": "", "message": ""} for p in pairs]
    items += [{"name": p["name"], "pred": "", "label": "", "pred_stamp": "", "label_stamp": "",
               **{k: p[k] for k in ("error_type", "message")}} for p in problems]
    return items, pairs, problems, sorted(pred_stamps), sorted(label_stamps)


def run_change(cfg: ChangeScoreConfig) -> dict:
    """Score change masks; returns the metrics document (also written to ``metrics.json``)."""
    from operators.scoring.change_ops import (JOB, TABLE_SCHEMAS, aggregate, dumps, metrics_document,
                                              score_batch, to_envelopes)

    out = Store(cfg.output)
    items, pairs, problems, pred_names, label_names = _change_items(cfg)
    run_id = new_run_id()
    log.info("%d labels, %d predictions: %d pairs to score, %d matching problems (run %s)",
             len(label_names), len(pred_names), len(pairs), len(problems), run_id)

    _ensure_ray(cfg.num_cpus)
    import ray.data
    from operators.io.tables import TableSink

    t0 = time.time()
    blocks = max(1, -(-len(items) // max(1, cfg.masks_per_task)))
    scored = ray.data.from_items(items, override_num_blocks=blocks).map_batches(
        score_batch, batch_size=None, batch_format="numpy").materialize()  # rows of counts: small
    agg = aggregate(ray.get(scored.to_arrow_refs()))
    sink = TableSink(out.uri(), TABLE_SCHEMAS, run_id)
    scored.map_batches(to_envelopes, fn_kwargs={"run_id": run_id}, batch_format="numpy").write_datasink(sink)
    for table in ("per_image", "errors"):  # this run's shards replace the previous run's
        prune_shards(out, table, run_id)
    doc = metrics_document(agg, sink.counts.get("errors", 0))
    out.write_bytes("metrics.json", dumps(doc))
    log.info("scored %d masks in %.1f s (%d errors)", doc["n_images"], time.time() - t0, doc["n_errors"])
    return doc


@dataclass
class CaptionScoreConfig:
    pred: str = field(default="", metadata={"path": "file", "required": True, "help": 'predictions JSON: [{"filename": ..., "caption": ...}] or {filename: caption} (file or s3:// URI)'})
    refs: str = field(default="", metadata={"path": "file", "required": True, "help": "references: LEVIR-CC-style JSON (images[].filename, split, sentences[].raw, optional changeflag)"})
    output: str = field(default="", metadata={"required": True, "help": "output folder or s3:// prefix (metrics.json, per_image/, errors/)"})
    split: str = field(default="auto", metadata={"choices": ("auto", "all", "train", "val", "test"), "help": "split of the references to score; all = every split; auto = the first of test, val, train the references hold"})
    masks: str = field(default="", metadata={"path": "dir", "help": "folder or s3:// prefix of the pairs' change masks (PNG, matched by file name): an empty mask makes a pair no-change (default: the references' changeflag field)"})


def _write_tables(out: Store, tables: dict, run_id: str) -> dict[str, int]:
    """Small tables written from the driver with pyarrow, one shard each, replacing every earlier shard
    (the new one is written first, so a crash never leaves a table empty)."""
    from operators.io.tables import write_table_shard

    counts = {}
    for name, (records, schema) in tables.items():
        old = out.list(name, suffixes=(".parquet",))
        new = write_table_shard(out, name, records, schema, run_id)
        for rel in old:
            if rel != new:
                out.delete(rel)
        counts[name] = len(records)
    return counts


def _error_rows(problems: list[dict], stage: str, job: str, run_id: str) -> list[dict]:
    from operators.io.tables import error_record

    return [error_record(p["item"], stage, p["message"], error_type=p["error_type"], job=job, run_id=run_id)
            for p in problems]


def run_captions(cfg: CaptionScoreConfig) -> dict:
    """Score change captions; returns the metrics document (also written to ``metrics.json``)."""
    from operators.io.tables import ERRORS_SCHEMA
    from operators.scoring.caption_metrics import require_java
    from operators.scoring.caption_scoring import (PER_IMAGE_SCHEMA, caption_metrics_document,
                                                   change_flags_from_masks, score_caption_set)
    from operators.scoring.caption_sets import (load_json, match_captions, pick_split, read_caption_predictions,
                                                read_references)
    from operators.scoring.change_ops import dumps

    require_java()  # before any work: a missing Java is the commonest failure
    out, run_id = Store(cfg.output), new_run_id()
    refs = load_json(cfg.refs)
    cfg = replace(cfg, split=pick_split([refs], cfg.split))
    images, problems = read_references(refs, cfg.split)
    preds, pred_problems = read_caption_predictions(load_json(cfg.pred))
    matched = match_captions(images, preds, cfg.split)
    problems += pred_problems + matched.problems
    if cfg.masks:
        flags, mask_problems = change_flags_from_masks(matched.images, cfg.masks)
        problems += mask_problems
        source = "masks"
    elif any(img.changeflag is not None for img in matched.images):
        flags, source = {img.key: img.changeflag for img in matched.images}, "changeflag"
    else:
        flags, source = {}, None
        log.warning("no --masks and no changeflag in the references: change/no_change subsets are empty")
    log.info("%d images to score in split %s, %d problems", len(matched.images), cfg.split, len(problems))
    if not matched.images:
        raise SystemExit("jobs.score captions: no prediction matches a reference image (see the names)")
    scores, rows = score_caption_set(matched.images, matched.predictions, flags)
    errors = _error_rows(problems, "score_captions", "score_captions", run_id)
    _write_tables(out, {"per_image": (rows, PER_IMAGE_SCHEMA), "errors": (errors, ERRORS_SCHEMA)}, run_id)
    doc = caption_metrics_document(scores, len(errors), cfg.split, source)
    out.write_bytes("metrics.json", dumps(doc))
    return doc


@dataclass
class QAScoreConfig:
    pred: str = field(default="", metadata={"path": "file", "required": True, "help": 'predictions JSON: [{"filename", "question", "answer"}], [{"id", "answer"}] or {id: answer}'})
    refs: str = field(default="", metadata={"path": "must_exist", "required": True, "help": 'the QA job\'s JSON ({"images": [{"filename", "split", "qa": [{"type", "question", "answer"}]}]}), or a folder/s3:// prefix of such files'})
    output: str = field(default="", metadata={"required": True, "help": "output folder or s3:// prefix (metrics.json, per_question/, errors/, judge tables and cache)"})
    split: str = field(default="auto", metadata={"choices": ("auto", "all", "train", "val", "test"), "help": "split of the references to score; all = every split; auto = the first of test, val, train the references hold"})
    yes_no_types: str = field(default="YES/NO", metadata={"help": "comma-separated question types scored by yes/no accuracy; every other type is open (caption metrics)"})
    judge_model: str = field(default="", metadata={"help": "model name for an LLM judge score per answer (default: no judge); endpoint from OPENAI_BASE_URL or --base-url, key from OPENAI_API_KEY"})
    base_url: str = field(default="", metadata={"url": True, "requires": ("judge_model",), "help": "OpenAI-compatible endpoint of the judge (default: $OPENAI_BASE_URL)"})
    judge_template: str = field(default="score_qa_judge.v1", metadata={"help": "judge prompt template (file stem under prompts/)"})
    rpm: float = field(default=500.0, metadata={"min": 0, "help": "judge requests per minute for the whole pool (0 = unlimited)"})
    tpm: float = field(default=2_000_000.0, metadata={"min": 0, "help": "judge tokens per minute for the whole pool (0 = unlimited)"})
    max_in_flight: int = field(default=64, metadata={"min": 1, "help": "judge requests outstanding at once"})
    temperature: float = field(default=0.0, metadata={"help": "judge sampling temperature (negative: the endpoint's default)"})
    max_tokens: int = field(default=300, metadata={"min": 1, "help": "completion token cap per judge request"})
    price_per_mtok_in: float | None = field(default=None, metadata={"min": 0, "help": "USD per million prompt tokens (optional)"})
    price_per_mtok_out: float | None = field(default=None, metadata={"min": 0, "help": "USD per million completion tokens (optional)"})
    cache: bool = field(default=True, metadata={"help": "read and write the judge's response cache (--no-cache: everything is sent and paid again)"})
    batch_api: bool = field(default=False, metadata={"help": "send the judge's requests through the provider's Batch API (about half price, answers within 24 h; batches recorded in the output, a rerun polls them)"})
    batch_poll_s: float = field(default=30.0, metadata={"gt": 0, "help": "with --batch-api: seconds between polls of the open batches"})
    batch_max_wait_s: float = field(default=26 * 3600.0, metadata={"min": 0, "help": "with --batch-api: longest wait for the open batches; past it the job stops (exit 3) and a rerun polls them again"})
    num_cpus: int | None = field(default=None, metadata={"min": 1, "help": "CPUs for a local Ray when judging (ignored when RAY_ADDRESS is set; default: all)"})


def _load_qa_refs(uri: str) -> list:
    from operators.scoring.caption_sets import load_json

    if uri.lower().endswith(".json"):
        return [load_json(uri)]
    store = Store(uri)
    names = store.list(suffixes=(".json",))
    if not names:
        raise SystemExit(f"jobs.score qa: no .json file at {uri}")
    return [load_json(store.uri(n)) for n in names]


def _run_qa_judge(cfg: QAScoreConfig, rows: list[dict], out: Store, run_id: str) -> tuple[dict[str, dict], str]:
    """LLM judge over the answered questions, through the LLM jobs' pass loop (in real time, or in batch
    passes with --batch-api); returns ({qid: judge fields}, the line saying why the judge stopped early,
    or ""). Failures are error rows, and so is a question left with neither a verdict nor a failure."""
    from functools import partial

    from operators.language.captions import load_template
    from operators.llm.client import LLMConfig, Secret
    from operators.llm.job_options import LLMJobConfig
    from operators.llm.job_passes import BatchesOpen, QuotaStop, run_llm_job, stop_line
    from operators.llm.ratelimit import RateLimits, start_rate_limiter
    from operators.llm.stage import StageSpec
    from operators.io.tables import TableSink, read_table
    from operators.scoring.qa_judge import (JOB, JUDGEMENTS_SCHEMA, INPUT_TABLE, KEY, SINK_SCHEMAS, STAGE,
                                            build_judge_request, handle_judge_result, judge_item,
                                            prepare_judge_item)

    base_url = cfg.base_url or os.environ.get("OPENAI_BASE_URL", "")
    if not base_url:
        raise SystemExit("jobs.score qa: --judge-model needs an endpoint: set OPENAI_BASE_URL (and OPENAI_API_KEY) or pass --base-url")
    template = load_template(cfg.judge_template)
    _ensure_ray(cfg.num_cpus)
    import ray

    limiter_name = f"changeforge-llm-{run_id}"
    limiter = start_rate_limiter(limiter_name, RateLimits(rpm=cfg.rpm, tpm=cfg.tpm, max_in_flight=cfg.max_in_flight))
    llm = LLMConfig(model=cfg.judge_model, base_url=base_url, temperature=cfg.temperature if cfg.temperature >= 0 else None,
                    max_tokens=cfg.max_tokens, price_per_mtok_in=cfg.price_per_mtok_in,
                    price_per_mtok_out=cfg.price_per_mtok_out, use_cache=cfg.cache)
    spec = StageSpec(name=STAGE, input_table=INPUT_TABLE, build_request=partial(build_judge_request, template),
                     handle_result=partial(handle_judge_result, template, cfg.judge_model, run_id), llm=llm,
                     limiter_name=limiter_name, cache_root=out.uri() if cfg.cache else None,
                     api_key=Secret(os.environ.get("OPENAI_API_KEY")), run_id=run_id, job=JOB,
                     batch_root=out.uri() if cfg.batch_api else None)
    # The pass loop's settings: the judge's own, the LLM jobs' defaults for the rest (pool, batch files).
    runner = LLMJobConfig(output=cfg.output, model=cfg.judge_model, base_url=base_url, batch_api=cfg.batch_api,
                          batch_poll_s=cfg.batch_poll_s, batch_max_wait_s=cfg.batch_max_wait_s,
                          max_reasks=llm.max_reasks)
    stopped = ""
    try:
        run_llm_job(runner, [judge_item(r) for r in rows], prepare_judge_item, {}, [spec],
                    lambda: TableSink(out.uri(), SINK_SCHEMAS, run_id), limiter, out=out, job=JOB, run_id=run_id,
                    key=KEY, done_table="judgements")
    except (QuotaStop, BatchesOpen) as exc:
        stopped = stop_line(exc)   # the verdicts so far are kept; the rerun judges the rest
    finally:
        ray.kill(limiter)
    table = read_table(out, "judgements", JUDGEMENTS_SCHEMA)
    return {r["qid"]: r for r in (table.to_pylist() if table is not None else []) if r["run_id"] == run_id}, stopped


def run_qa(cfg: QAScoreConfig) -> dict:
    """Score QA answers; returns the metrics document (also written to ``metrics.json``)."""
    from operators.io.tables import ERRORS_SCHEMA, read_table
    from operators.scoring.caption_metrics import require_java
    from operators.scoring.caption_sets import load_json, pick_split
    from operators.scoring.change_ops import dumps
    from operators.scoring.qa import match_answers, read_qa_references
    from operators.scoring.qa_judge import judge_summary
    from operators.scoring.qa_scoring import PER_QUESTION_SCHEMA, score_qa

    out, run_id = Store(cfg.output), new_run_id()
    yes_no_types = tuple(t.strip() for t in cfg.yes_no_types.split(",") if t.strip())
    refs = _load_qa_refs(cfg.refs)
    cfg = replace(cfg, split=pick_split(refs, cfg.split))
    questions, problems = read_qa_references(refs, cfg.split)
    matched = match_answers(questions, load_json(cfg.pred))
    if any(q.type.lower() not in {t.lower() for t in yes_no_types} for q in matched.questions):
        require_java()  # open types are scored with the caption metrics
    doc, rows = score_qa(matched, yes_no_types)
    judge = None
    if cfg.judge_model and rows:
        judged, stopped = _run_qa_judge(cfg, rows, out, run_id)
        for r in rows:
            j = judged.get(r["qid"], {})
            r.update({k: j.get(k) for k in ("judge_score", "judge_correct", "judge_reason")})
        judge = {"model": cfg.judge_model, **judge_summary(rows), "stopped": stopped}
    errors = _error_rows(problems + matched.problems, "score_qa", "score_qa", run_id)
    if cfg.judge_model:  # the judge's own failures, written by the LLM stage into errors/ for this run
        t = read_table(out, "errors", ERRORS_SCHEMA)
        errors += [r for r in (t.to_pylist() if t is not None else []) if r["run_id"] == run_id]
    _write_tables(out, {"per_question": (rows, PER_QUESTION_SCHEMA), "errors": (errors, ERRORS_SCHEMA)}, run_id)
    if cfg.judge_model:
        prune_shards(out, "judgements", run_id)  # judgements describe the latest run (answers stay cached)
    doc.update(n_errors=len(errors), split=cfg.split, judge=judge)
    out.write_bytes("metrics.json", dumps(doc))
    return doc


def _mask_digest(uri: str) -> str:
    from operators.io import lineage
    from operators.scoring.masks import decode_mask
    try:
        return lineage.mask_digest(decode_mask(read_uri(uri)))
    except Exception as exc:  # noqa: BLE001 - said with its file and reason, counted as failed
        return lineage.unreadable(uri, f"{type(exc).__name__}: {exc}")


def _today(command: str, cfg) -> tuple[dict[str, dict], str, str]:
    """(item -> its lineage from today's inputs, the table its rows are in, that table's key column)."""
    from operators.scoring.caption_sets import load_json, pick_split
    if command == "change":
        from operators.scoring.change_ops import today_lineage
        items = [i for i in _change_items(cfg)[0] if not i["error_type"]]
        return today_lineage(items, _recorded(Store(cfg.output), "per_image", "name"), _mask_digest), "per_image", "name"
    if command == "captions":
        from operators.scoring.caption_scoring import row_lineage
        from operators.scoring.caption_sets import match_captions, read_caption_predictions, read_references
        refs = load_json(cfg.refs)
        images, _ = read_references(refs, pick_split([refs], cfg.split))
        matched = match_captions(images, read_caption_predictions(load_json(cfg.pred))[0], pick_split([refs], cfg.split))
        return ({img.filename: row_lineage(img, matched.predictions[img.key]) for img in matched.images},
                "per_image", "filename")
    from operators.scoring.qa import match_answers, read_qa_references
    from operators.scoring.qa_scoring import row_lineage
    refs = _load_qa_refs(cfg.refs)
    questions, _ = read_qa_references(refs, pick_split(refs, cfg.split))
    matched = match_answers(questions, load_json(cfg.pred))
    return {q.qid: row_lineage(q, matched.answers[q.qid]) for q in matched.questions}, "per_question", "qid"


def _recorded(out: Store, table: str, key: str) -> dict[str, dict | None]:
    from operators.io import lineage
    from operators.io.tables import read_table
    t = read_table(out, table, columns=[key, "lineage"], key=(key,))
    if t is None:
        return {}
    col = t.column("lineage").to_pylist() if "lineage" in t.column_names else [None] * t.num_rows
    return {k: lineage.loads(v) for k, v in zip(t.column(key).to_pylist(), col) if k is not None}


def status(parsed) -> dict:
    """The scored items (images, questions) by lineage against today's references, predictions and masks
    (operators.io.lineage.keyed_status), reading only: an item whose reference, prediction or mask changed
    since it was scored is stale, one not scored yet missing (failed, when the last run could not score
    it). A run scores the whole set again (corpus metrics), so any of them makes the step run."""
    from operators.io import lineage
    from operators.io.tables import current_error_items
    command, cfg, _ = parsed
    out = Store(cfg.output)
    today, table, key = _today(command, cfg)
    return lineage.keyed_status(_recorded(out, table, key), today, current_error_items(out))


COMMANDS = {
    "change": (ChangeScoreConfig, run_change, "change-detection masks: precision, recall, F1, IoU, OA, kappa, mF1, mIoU"),
    "captions": (CaptionScoreConfig, run_captions, "change captions: BLEU-1..4, METEOR, ROUGE-L, CIDEr-D (pycocoevalcap)"),
    "qa": (QAScoreConfig, run_qa, "QA answers: yes/no accuracy per type and overall, caption metrics per open type, optional LLM judge"),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jobs.score", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name, (cls, _, help_text) in COMMANDS.items():
        add_config_args(sub.add_parser(name, help=help_text, description=help_text), cls, "options")
    return ap


def parse_args(argv: list[str] | None = None):
    args = parse_job_args(build_parser(), argv)
    cls, runner, _ = COMMANDS[args.command]
    return args.command, config_from_args(cls, args), runner


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command, cfg, runner = parse_args(argv)
    doc = runner(cfg)
    top = {k: v for k, v in doc.items() if isinstance(v, (int, float)) or v is None}
    print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in top.items()))
    table = "per_question" if command == "qa" else "per_image"
    print(f"outputs: {cfg.output}/metrics.json and {cfg.output}/{{{table},errors}}/")
    console.print_errors("score:", Store(cfg.output), None)   # errors/ holds the last run's rows only
    stopped = (doc.get("judge") or {}).get("stopped")
    if stopped:   # the LLM judge stopped early (quota, batches still open, questions left over)
        print(stopped)
        return 3
    console.stop_if_nothing("score:", doc.get("n_images", 1) > 0, "no mask pair could be scored")
    return 0


if __name__ == "__main__":
    from operators.process_exit import run as run_process    # this module may have its own run
    run_process(main)
