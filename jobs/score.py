"""The scoring job (issue 9): predictions scored against this project's datasets (and any dataset in the
same formats) the way the field's reference code scores them.

    python -m jobs.score change   --pred <folder | s3://prefix> --label <folder | s3://prefix> --output <folder>
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
from dataclasses import dataclass, field

if __package__ in (None, ""):  # `python jobs/score.py` (e.g. under `ray job submit`)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from operators.io.cli import add_config_args, config_from_args, init_ray  # noqa: E402
from operators.io.storage import Store  # noqa: E402
from operators.io.tables import new_run_id, prune_shards  # noqa: E402

log = logging.getLogger("changeforge.score")


@dataclass
class ChangeScoreConfig:
    pred: str = field(default="", metadata={"required": True, "help": "folder or s3:// prefix of predicted change masks (PNG; any non-zero pixel is change)"})
    label: str = field(default="", metadata={"required": True, "help": "folder or s3:// prefix of reference masks (PNG), matched to predictions by file name"})
    output: str = field(default="", metadata={"required": True, "help": "output folder or s3:// prefix (metrics.json, per_image/, errors/)"})
    masks_per_task: int = field(default=64, metadata={"help": "mask pairs decoded and counted per Ray task"})
    num_cpus: int | None = field(default=None, metadata={"help": "CPUs for a local Ray (ignored when RAY_ADDRESS points at a cluster; default: all)"})


def _ensure_ray(num_cpus: int | None) -> None:
    """Local workers inherit the environment but not sys.path: put the repo on PYTHONPATH so that
    ``python jobs/score.py`` works from any folder without an install (as the other jobs do)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if repo not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([repo] + paths)
    init_ray(num_cpus)


def run_change(cfg: ChangeScoreConfig) -> dict:
    """Score change masks; returns the metrics document (also written to ``metrics.json``)."""
    from operators.scoring.change_ops import (JOB, TABLE_SCHEMAS, aggregations, dumps, metrics_document,
                                              score_batch, to_envelopes)
    from operators.scoring.masks import MASK_SUFFIXES, match_masks

    pred_store, label_store, out = Store(cfg.pred), Store(cfg.label), Store(cfg.output)
    pred_names = pred_store.list(suffixes=MASK_SUFFIXES, recursive=False)
    label_names = label_store.list(suffixes=MASK_SUFFIXES, recursive=False)
    if not label_names:
        raise SystemExit(f"jobs.score change: no PNG masks in --label {cfg.label}")
    pairs, problems = match_masks(pred_names, label_names)
    items = [{"name": p["name"], "pred": pred_store.uri(p["pred"]), "label": label_store.uri(p["label"]),
              "error_type": "", "message": ""} for p in pairs]
    items += [{"name": p["name"], "pred": "", "label": "", **{k: p[k] for k in ("error_type", "message")}}
              for p in problems]
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
    agg = scored.aggregate(*aggregations())
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
    pred: str = field(default="", metadata={"required": True, "help": 'predictions JSON: [{"filename": ..., "caption": ...}] or {filename: caption} (file or s3:// URI)'})
    refs: str = field(default="", metadata={"required": True, "help": "references: LEVIR-CC-style JSON (images[].filename, split, sentences[].raw, optional changeflag)"})
    output: str = field(default="", metadata={"required": True, "help": "output folder or s3:// prefix (metrics.json, per_image/, errors/)"})
    split: str = field(default="test", metadata={"help": "split of the references to score; all = every split"})
    masks: str = field(default="", metadata={"help": "folder or s3:// prefix of the pairs' change masks (PNG, matched by file name): an empty mask makes a pair no-change (default: the references' changeflag field)"})


def _write_tables(out: Store, tables: dict, run_id: str) -> dict[str, int]:
    """Small tables written from the driver with pyarrow, one shard each; older runs' shards removed."""
    from operators.io.tables import write_table_shard

    counts = {}
    for name, (records, schema) in tables.items():
        write_table_shard(out, name, records, schema, run_id)
        prune_shards(out, name, run_id)
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
    from operators.scoring.caption_sets import (load_json, match_captions, read_caption_predictions,
                                                read_references)
    from operators.scoring.change_ops import dumps

    require_java()  # before any work: a missing Java is the commonest failure
    out, run_id = Store(cfg.output), new_run_id()
    images, problems = read_references(load_json(cfg.refs), cfg.split)
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


COMMANDS = {
    "change": (ChangeScoreConfig, run_change, "change-detection masks: precision, recall, F1, IoU, OA, kappa, mF1, mIoU"),
    "captions": (CaptionScoreConfig, run_captions, "change captions: BLEU-1..4, METEOR, ROUGE-L, CIDEr-D (pycocoevalcap)"),
}


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python -m jobs.score", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name, (cls, _, help_text) in COMMANDS.items():
        add_config_args(sub.add_parser(name, help=help_text, description=help_text), cls, "options")
    args = ap.parse_args(argv)
    cls, runner, _ = COMMANDS[args.command]
    return args.command, config_from_args(cls, args), runner


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command, cfg, runner = parse_args(argv)
    doc = runner(cfg)
    top = {k: v for k, v in doc.items() if isinstance(v, (int, float)) or v is None}
    print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in top.items()))
    print(f"outputs: {cfg.output}/metrics.json and {cfg.output}/{{per_image,errors}}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
