"""Change-mask annotation in Label Studio (S2Looking step 6): pairs out as labelling tasks, with
unsupervised change proposals as pre-labels, and the annotators' masks back into the dataset.

    python -m jobs.annotate export --input <pairs output | LEVIR-CD dataset> --output <folder> \\
        [--classes new:post,demolished:pre] [--prelabel cva|irmad|pca-kmeans|folder:<path>] \\
        [--annotations-per-task 2] [--label-studio-url http://localhost:8080]   # key: LABEL_STUDIO_API_KEY
    python -m jobs.annotate export --input <dataset> --output <folder> --queue review   # the expert's tasks
    python -m jobs.annotate ingest --input <the same dataset> --export <export.json | Label Studio URL> \\
        [--project-id N] [--min-agreement 0.8] [--require-check] [--experts exp@x] [--instance NAME]
    python -m jobs.annotate status --input <dataset>

export writes ``tasks.json`` (Label Studio's import format) and ``label_config.xml``, plus
``export_summary.json``, ``source.json`` and, with a proposal method, ``prelabels/<method>/*.png``;
into the dataset ``label_classes.json`` and ``annotation_exports/``. ingest appends the export to the
dataset's ``annotations/`` history and derives from all of it ``label1/``, ``label2/`` ... (one 0/255
PNG per class of the scheme) and their union ``label/``, ``annotation_state/``, ``annotation_pending/``
and ``annotation_summary.json`` (see :mod:`operators.annotation.ingest_ops`). This module is wiring:
the decisions are :mod:`operators.annotation.decisions`.
"""
from __future__ import annotations

import os
import sys

if not __package__:  # run as `python jobs/annotate.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import logging
import posixpath
from dataclasses import dataclass, field

from operators.annotation import export_ops
from operators.annotation.decisions import REVIEW_QUEUE, DecisionConfig
from operators.annotation.ingest_ops import (PENDING_SCHEMA, check_server, ingest, ordered_run_id, read_history,
                                             resolve_classes, summarise)
from operators.annotation.prelabels import run_prelabels
from operators.annotation.scheme import DEFAULT_CLASSES, labeling_config, parse_classes, read_scheme
from operators.annotation.summary import format_status
from operators.io.cli import add_config_args, config_from_args, parse_job_args
from operators.io.layout import discover_pairs
from operators.io.sources import holds_images, write_source
from operators.io.storage import Store, read_uri
from operators.io.tables import ERRORS_SCHEMA, read_table, write_table_shard
from operators.review.image_urls import ImageUrls

log = logging.getLogger("changeforge.annotate")
JOB = "annotate"



@dataclass
class ExportConfig:
    input: str = field(default="", metadata={"path": "dir", "required": True, "help": "a pairs job output or any LEVIR-CD-layout dataset (A/ B/, folder or s3:// prefix)"})
    output: str = field(default="", metadata={"required": True, "help": "folder or s3:// prefix for tasks.json, label_config.xml and the proposals"})
    classes: str = field(default="", metadata={"help": f"classes to draw, <name>:<pre|post> comma-separated, in label1, label2 ... order (e.g. change:post for a single change map); default: the dataset's label_classes.json, else {DEFAULT_CLASSES}"})
    prelabel: str = field(default="", metadata={"help": "pre-labels shown as Label Studio predictions: cva, irmad or pca-kmeans (computed here), folder:<path> with <pair_id>.png masks (or label1/ label2/ ... per class) from any model, or onnx:<model.onnx> (a change-detection model run here, see docs/annotation.md); default: none"})
    queue: str = field(default="annotate", metadata={"help": "annotate: the pairs not decided yet; review: the expert's tasks for disagreements, flagged pairs and rejected batches (both drawings as predictions; the expert's annotation decides at the next ingest)", "choices": ("annotate", "review")})
    skip_labelled: bool = field(default=True, metadata={"help": "leave out pairs that already have a label/ mask"})
    resend: bool = field(default=False, metadata={"help": "export again the pairs an earlier export sent to this queue that are still open there (not annotated yet; for review: still a disagreement)"})
    annotations_per_task: int = field(default=1, metadata={"help": "annotations each task collects (Label Studio's maximum_annotations of a new project): 2 for an independent second annotation, checked by ingest", "choices": (1, 2)})
    local_files_root: str = field(default="", metadata={"help": "Label Studio's LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT for local images (default: the dataset folder's parent)"})
    url_expiry_s: int = field(default=7 * 24 * 3600, metadata={"range": (1, 7 * 24 * 3600), "help": "lifetime of presigned S3 image URLs (max 7 days)"})
    label_studio_url: str = field(default="", metadata={"url": True, "help": "create (or reuse) the project and import the tasks there (key from LABEL_STUDIO_API_KEY)"})
    project_title: str = field(default="", metadata={"help": "project title (default: from the dataset's name and the classes)"})
    num_cpus: int | None = field(default=None, metadata={"min": 1, "help": "CPUs of the local Ray computing proposals when RAY_ADDRESS is not set (default: all)"})


@dataclass
class IngestConfig:
    input: str = field(default="", metadata={"path": "dir", "required": True, "help": "the dataset the tasks were exported from (label1/ label2/ label/ are written into it)"})
    export: str = field(default="", metadata={"json": "nonempty", "path": "must_exist", "required": True, "help": "Label Studio JSON export file, or the server URL (with --project-id)"})
    project_id: int = field(default=0, metadata={"min": 0, "help": "project to export when --export is a server URL"})
    classes: str = field(default="", metadata={"help": f"the classes of the export; default: the dataset's label_classes.json (which export wrote), else {DEFAULT_CLASSES}; a value contradicting that file is an error"})
    tasks: str = field(default="", metadata={"path": "file", "help": "the tasks.json export wrote: its pre-labels, for the IoU of each final mask against them, when --export is a file that lists only prediction ids (a server URL gives them in full)"})
    min_agreement: float = field(default=0.8, metadata={"range": (0, 1), "help": "lowest per-class F1 (with --tolerance-px) between annotator and checker at which a pair is merged (batches: --batch-min-agreement)"})
    tolerance_px: int = field(default=2, metadata={"min": 0, "max": 16, "help": "boundary tolerance of the agreement: a drawn pixel within this distance of the other drawing matches"})
    require_check: bool = field(default=False, metadata={"help": "merge only pairs with a second, agreeing annotation (a single annotation waits for its check)"})
    noise_px: int = field(default=200, metadata={"min": 0, "help": "a class one side drew in fewer pixels than this counts as not drawn when annotator and checker are compared (a stray dot is noise; default: validate's no-change floor)"})
    batch_min_agreement: float = field(default=0.8, metadata={"range": (0, 1), "help": "mean agreement a batch (a project) must reach over its checked pairs still awaiting a decision; below it its merged pairs are held for the expert"})
    experts: str = field(default="", metadata={"help": "the experts' Label Studio users (emails or ids as the export names them), comma-separated; default: anyone who answers a review task or stars a drawing and is not one of the pair's annotators"})
    instance: str = field(default="", metadata={"help": "a name for the Label Studio server of --export, part of every history key: give each server its own (default: the default instance, whose server URL is recorded and checked)"})




@dataclass
class StatusConfig:
    input: str = field(default="", metadata={"required": True, "help": "the dataset (its annotation tables and label_classes.json)"})


def _dataset(uri: str) -> Store:
    store = Store(uri)
    if not holds_images(store):
        raise ValueError(f"--input {uri}: no pairs there (A/ and B/, at the root or under train/ val/ test/)")
    return store


# -- export ------------------------------------------------------------------------------------------
def run_export(cfg: ExportConfig) -> dict:
    dataset, out = _dataset(cfg.input), Store(cfg.output)
    classes = resolve_classes(dataset, cfg.classes)
    run_id = ordered_run_id(dataset)
    pairs = discover_pairs(dataset.uri())
    errors = export_ops.missing_image_errors(pairs, JOB, run_id)
    complete = [p for p in pairs if p["a_rel"] and p["b_rel"]]
    todo, left_out = export_ops.select_pairs(dataset, complete, cfg.queue, cfg.skip_labelled, cfg.resend)
    masks, scores, bad, prop_errors, model_version = ({}, {}, {}, [], "")
    drawings = {}
    if cfg.queue == REVIEW_QUEUE:
        drawings = export_ops.drawings_of(dataset, {p["pair_id"] for p in todo})
    else:
        masks, scores, bad, prop_errors, model_version = run_prelabels(cfg.prelabel, dataset, out, todo, classes,
                                                                       run_id, cfg.num_cpus)
    errors += prop_errors + [export_ops.error_record(pid, "annotate_export", why, error_type="BadPrelabel", job=JOB,
                                                     run_id=run_id) for pid, why in sorted(bad.items())]
    todo = [p for p in todo if p["pair_id"] not in bad]
    urls = ImageUrls(dataset, cfg.local_files_root, cfg.url_expiry_s)
    tasks = [export_ops.build_task(p, urls, classes, masks.get(p["pair_id"]), scores.get(p["pair_id"]), model_version,
                                   cfg.queue, drawings.get(p["pair_id"])) for p in todo]
    config = labeling_config(classes)
    out.write_bytes("tasks.json", json.dumps(tasks, indent=1).encode())
    out.write_bytes("label_config.xml", config.encode())
    write_table_shard(out, "errors", errors, ERRORS_SCHEMA, run_id)
    summary = {"input": dataset.uri(), "queue": cfg.queue, "pairs": len(pairs), "tasks": len(tasks),
               "left_out": left_out, "skipped_labelled": left_out.get("labelled", 0),
               "missing_images": len(pairs) - len(complete),
               "prelabel": model_version or None, "prelabelled": sum(1 for p in todo if p["pair_id"] in masks),
               "prelabel_errors": len(prop_errors) + len(bad), "classes": [c.__dict__ for c in classes],
               "annotations_per_task": cfg.annotations_per_task, "image_urls": urls.mode,
               "local_files_root": urls.local_files_root or None,
               "splits": {s: sum(1 for p in todo if p["split"] == s) for s in sorted({p["split"] for p in todo})}}
    if cfg.label_studio_url:
        from operators.labelstudio.client import call
        title = cfg.project_title or (f"changeforge {'expert review' if cfg.queue == REVIEW_QUEUE else 'change masks'}: "
                                      f"{posixpath.basename(dataset.uri().rstrip('/'))} ({', '.join(c.name for c in classes)})")
        settings = {"maximum_annotations": 1 if cfg.queue == REVIEW_QUEUE else cfg.annotations_per_task}
        summary["label_studio"] = call("create_project_with_tasks", url=cfg.label_studio_url, title=title,
                                       label_config=config, tasks=tasks, storage_path=urls.storage_path(),
                                       settings=settings)
    export_ops.record_exports(dataset, [p["pair_id"] for p in todo], cfg.queue, out.uri(), run_id)
    out.write_bytes("export_summary.json", json.dumps(summary, indent=1).encode())
    write_source(out, "annotate_export", input=dataset.uri(), dataset=dataset.uri(),
                 classes=",".join(f"{c.name}:{c.image}" for c in classes), queue=cfg.queue)
    return summary


# -- ingest ------------------------------------------------------------------------------------------
def load_export(export: str, project_id: int) -> list[dict]:
    if export.startswith(("http://", "https://")):
        if not project_id:
            raise SystemExit("jobs.annotate ingest: --export is a server URL; pass --project-id")
        from operators.labelstudio.client import call
        return call("export_json_with_predictions", url=export, project_id=project_id)
    return json.loads(read_uri(export))


def _attach_prelabels(tasks: list[dict], tasks_file: str) -> None:
    """Predictions from the export's own ``tasks.json`` for tasks whose export lists only prediction ids
    (a JSON export downloaded from the UI), matched by the pair's ``item_id``."""
    try:
        exported = json.loads(read_uri(tasks_file))
    except FileNotFoundError:
        log.warning("no %s: the IoU against the pre-labels is left empty where the export lacks them", tasks_file)
        return
    by_item = {t["data"].get("item_id"): t.get("predictions") or [] for t in exported}
    for t in tasks:
        if not any(isinstance(p, dict) and p.get("result") is not None for p in t.get("predictions") or []):
            t["predictions"] = by_item.get((t.get("data") or {}).get("item_id"), [])


def experts_list(value: str) -> tuple:
    return tuple(sorted({e.strip() for e in str(value or "").split(",") if e.strip()}))


def _decision_config(cfg) -> DecisionConfig:
    return DecisionConfig(min_agreement=cfg.min_agreement, require_check=cfg.require_check, tolerance_px=cfg.tolerance_px,
                          noise_px=cfg.noise_px, batch_min_agreement=cfg.batch_min_agreement,
                          experts=experts_list(cfg.experts))


def server_of(export: str) -> str:
    """The base URL of a server export (scheme, host and port), "" for a file."""
    if not export.startswith(("http://", "https://")):
        return ""
    from urllib.parse import urlsplit
    u = urlsplit(export)
    return f"{u.scheme}://{u.netloc.lower()}"


def run_ingest(cfg: IngestConfig) -> dict:
    dataset = _dataset(cfg.input)
    classes = resolve_classes(dataset, cfg.classes)
    check_server(read_history(dataset), cfg.instance.strip(), server_of(cfg.export))   # before the download
    tasks = load_export(cfg.export, cfg.project_id)
    if not isinstance(tasks, list):
        raise ValueError(f"--export {cfg.export}: not a Label Studio JSON export (a list of tasks)")
    if cfg.tasks:
        _attach_prelabels(tasks, cfg.tasks)
    decisions = _decision_config(cfg)
    summary = ingest(dataset, tasks, classes, decisions, ordered_run_id(dataset), cfg.project_id,
                     instance=cfg.instance.strip(), server=server_of(cfg.export))
    by = summary["pairs"]["by_status"]
    held = read_table(dataset, "annotation_pending", PENDING_SCHEMA)
    disagreements = sorted(r["pair_id"] for r in ([] if held is None else held.to_pylist()) if r["status"] == "disagreement")
    return {**summary, "tasks": len(tasks), "input": dataset.uri(), "merged": by["merged"] + by["expert"],
            "disagreements": disagreements}


def run_status(cfg: StatusConfig) -> dict:
    """The summary from the dataset's tables, with the settings of the last ingest."""
    dataset = _dataset(cfg.input)
    classes = read_scheme(dataset) or parse_classes(DEFAULT_CLASSES)   # status only reads
    try:
        settings = json.loads(dataset.read_bytes("annotation_summary.json")).get("settings") or {}
    except (OSError, ValueError):
        settings = {}
    known = {k: v for k, v in settings.items() if k in DecisionConfig.__dataclass_fields__}
    return summarise(dataset, classes, DecisionConfig(**{**known, "experts": tuple(known.get("experts") or ())}))


# -- command line ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jobs.annotate", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    add_config_args(sub.add_parser("export", help="pairs out as Label Studio change-mask tasks"), ExportConfig, "export")
    add_config_args(sub.add_parser("ingest", help="a Label Studio export into the history, and the masks it decides"),
                    IngestConfig, "ingest")
    add_config_args(sub.add_parser("status", help="pairs by status, per annotator, and what to export next"),
                    StatusConfig, "status")
    return ap


def _print_export(cfg: ExportConfig, s: dict) -> None:
    print(f"{s['tasks']} {s['queue']} tasks of {s['pairs']} pairs (left out: {s['left_out'] or 'none'}; "
          f"{s['missing_images']} without both images); pre-labels: {s['prelabel'] or 'none'} "
          f"({s['prelabelled']} pairs, {s['prelabel_errors']} errors); splits {s['splits']}")
    if "label_studio" in s:
        print(f"Label Studio project: {s['label_studio']['project_url']} ({s['label_studio']['imported']} imported)")
    print(f"outputs: {cfg.output}/tasks.json and {cfg.output}/label_config.xml")


def _print_ingest(cfg: IngestConfig, s: dict) -> None:
    print(f"{s['tasks']} tasks: {s['new_rows']} new history rows; {s['errors']} errors")
    print(format_status(s))
    print(f"outputs: {cfg.input}/label1/ ... label/, annotations/, annotation_state/, annotation_pending/, "
          "annotation_summary.json")


def _print_status(cfg: StatusConfig, s: dict) -> None:
    print(format_status(s))


COMMANDS = {"export": (ExportConfig, run_export, _print_export), "ingest": (IngestConfig, run_ingest, _print_ingest),
            "status": (StatusConfig, run_status, _print_status)}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_job_args(build_parser(), argv)
    cls, runner, show = COMMANDS[args.command]
    cfg = config_from_args(cls, args)
    from operators.labelstudio.client import StudioError
    try:
        summary = runner(cfg)
    except (ValueError, StudioError) as exc:   # a malformed option, a contradicting label_classes.json, no SDK
        raise SystemExit(f"jobs.annotate {args.command}: {exc}") from None
    show(cfg, summary)
    return 0


if __name__ == "__main__":
    from operators.process_exit import run as run_process    # this module may have its own run
    run_process(main)
