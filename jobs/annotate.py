"""Change-mask annotation in Label Studio (S2Looking step 6): pairs out as labelling tasks, with
unsupervised change proposals as pre-labels, and the annotators' masks back into the dataset.

    python -m jobs.annotate export --input <pairs output | LEVIR-CD dataset> --output <folder> \\
        [--classes new:post,demolished:pre] [--prelabel cva|irmad|pca-kmeans|folder:<path>] \\
        [--annotations-per-task 2] [--label-studio-url http://localhost:8080]   # key: LABEL_STUDIO_API_KEY
    python -m jobs.annotate ingest --input <the same dataset> --export <export.json | Label Studio URL> \\
        [--project-id N] [--min-agreement 0.8] [--require-check]

export writes ``tasks.json`` (Label Studio's import format) and ``label_config.xml``, plus
``export_summary.json``, ``source.json`` and, with a proposal method, ``prelabels/<method>/*.png``.
ingest writes ``label1/``, ``label2/`` ... (one 0/255 PNG per class, in --classes order) and their
union ``label/`` into the dataset, an ``annotations/`` table (one row per annotation and class),
``annotation_pending/`` (pairs not merged, with the reason) and ``annotation_summary.json``.
"""
from __future__ import annotations

import os
import sys

if not __package__:  # run as `python jobs/annotate.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import functools
import json
import logging
import posixpath
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from operators.annotation.agreement import decide, overlap
from operators.annotation.proposals import METHODS, ProposalConfig
from operators.annotation.results import brush_result, class_masks
from operators.annotation.scheme import DEFAULT_CLASSES, labeling_config, parse_classes
from operators.io.cli import add_config_args, config_from_args, init_ray, parse_job_args
from operators.io.images import decode_image, write_png
from operators.io.sources import write_source
from operators.io.storage import Store, read_uri
from operators.io.tables import (ERRORS_SCHEMA, error_record, new_run_id, prune_shards, read_table,
                                 write_table_shard)
from operators.language.caption_ops import discover_pairs, is_pairs_output
from operators.pairs.labels.labels import LABELS_SCHEMA, merge_label_maps
from operators.review.image_urls import ImageUrls

log = logging.getLogger("changeforge.annotate")
JOB = "annotate"
MODEL_VERSION_PREFIX = "changeforge"

ANNOTATIONS_SCHEMA = pa.schema([
    ("pair_id", pa.string()), ("split", pa.string()), ("task_id", pa.int64()), ("annotation_id", pa.int64()),
    ("annotator", pa.string()), ("order", pa.int32()), ("class", pa.string()), ("pixels", pa.int64()),
    ("lead_time_s", pa.float64()), ("agreement_iou", pa.float64()), ("agreement_f1", pa.float64()),
    ("pair_agreement", pa.float64()), ("iou_vs_prelabel", pa.float64()), ("prelabel_model", pa.string()),
    ("status", pa.string()), ("merged", pa.bool_()), ("run_id", pa.string()),
])
PENDING_SCHEMA = pa.schema([
    ("pair_id", pa.string()), ("split", pa.string()), ("task_id", pa.int64()), ("status", pa.string()),
    ("annotations", pa.int32()), ("pair_agreement", pa.float64()), ("reason", pa.string()), ("run_id", pa.string()),
])


@dataclass
class ExportConfig:
    input: str = field(default="", metadata={"path": "dir", "required": True, "help": "a pairs job output or any LEVIR-CD-layout dataset (A/ B/, folder or s3:// prefix)"})
    output: str = field(default="", metadata={"required": True, "help": "folder or s3:// prefix for tasks.json, label_config.xml and the proposals"})
    classes: str = field(default=DEFAULT_CLASSES, metadata={"help": "classes to draw, <name>:<pre|post> comma-separated, in label1, label2 ... order (e.g. change:post for a single change map)"})
    prelabel: str = field(default="", metadata={"help": "pre-labels shown as Label Studio predictions: cva, irmad or pca-kmeans (computed here), or folder:<path> with <pair_id>.png masks (or label1/ label2/ ... per class) from any model; default: none"})
    skip_labelled: bool = field(default=True, metadata={"help": "leave out pairs that already have a label/ mask"})
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
    classes: str = field(default=DEFAULT_CLASSES, metadata={"help": "the classes of the export, as given to export"})
    tasks: str = field(default="", metadata={"path": "file", "help": "the tasks.json export wrote: its pre-labels, for the IoU of each final mask against them, when --export is a file that lists only prediction ids (a server URL gives them in full)"})
    min_agreement: float = field(default=0.8, metadata={"range": (0, 1), "help": "lowest per-class F1 between two annotators at which a pair is merged; also the mean a batch's double-annotated pairs must reach"})
    require_check: bool = field(default=False, metadata={"help": "merge only pairs with a second, agreeing annotation (a single annotation waits for its check)"})


# -- export ------------------------------------------------------------------------------------------
def _stem(pair: dict) -> str:
    return posixpath.basename(pair["pair_id"])


def _folder_prelabels(path: str, pairs: list[dict], classes) -> dict[str, dict[str, np.ndarray]]:
    """{pair_id: {class: mask}} from a folder of masks: ``label1/ label2/ ...`` per class, else
    ``<stem>.png`` at its root for the first class."""
    store = Store(path)
    per_class = any(store.list(c.folder, suffixes=(".png",), recursive=False) for c in classes)
    out: dict[str, dict[str, np.ndarray]] = {}
    for p in pairs:
        masks = {}
        for i, c in enumerate(classes):
            rel = f"{c.folder}/{_stem(p)}.png" if per_class else (f"{_stem(p)}.png" if i == 0 else None)
            if rel and store.exists(rel):
                masks[c.name] = decode_image(store.read_bytes(rel), grey=True) > 0
        if masks:
            out[p["pair_id"]] = masks
    return out


def _prelabels(cfg: ExportConfig, pairs: list[dict], classes, run_id: str) -> tuple[dict, dict, list[dict], str]:
    """({pair_id: {class: mask}}, {pair_id: score}, error rows, model_version) of --prelabel."""
    if not cfg.prelabel:
        return {}, {}, [], ""
    if cfg.prelabel.startswith("folder:"):
        path = cfg.prelabel.split(":", 1)[1]
        return _folder_prelabels(path, pairs, classes), {}, [], f"folder:{posixpath.basename(path.rstrip('/'))}"
    if cfg.prelabel not in METHODS:
        raise SystemExit(f"jobs.annotate: --prelabel {cfg.prelabel!r}: one of {', '.join(METHODS)} or folder:<path>")
    from operators.annotation.proposal_ops import run_proposals
    init_ray(cfg.num_cpus)
    out = Store(cfg.output)
    rows = [{"pair_id": _stem(p), "root": p["root"], "a_rel": p["a_rel"], "b_rel": p["b_rel"]} for p in pairs]
    found, errors = run_proposals(rows, cfg.prelabel, out.uri(), ProposalConfig(), run_id)
    by_stem = {_stem(p): p["pair_id"] for p in pairs}
    masks = {by_stem[r["pair_id"]]: {classes[0].name: decode_image(out.read_bytes(r["mask_rel"]), grey=True) > 0}
             for r in found}
    scores = {by_stem[r["pair_id"]]: r["score"] for r in found}
    return masks, scores, errors, f"{MODEL_VERSION_PREFIX}:{cfg.prelabel}"


INSTRUCTIONS = ("Draw every changed structure with the brush (or a polygon): {parts}. Leave a class empty "
                "when the pair shows none of it; submit to say so.")


def build_task(pair: dict, urls: ImageUrls, classes, prelabel: dict | None, score: float | None,
               model_version: str) -> dict:
    """One task: the pair's images, its ids and split, and the pre-label as a prediction."""
    stem = _stem(pair)
    parts = ", ".join(f"{c.name} on the {'post-change' if c.image == 'post' else 'pre-change'} image" for c in classes)
    data = {"pre": urls.url(pair["a_rel"]), "post": urls.url(pair["b_rel"]), "pair_id": stem,
            "split": pair["split"], "item_id": pair["pair_id"],
            "title": f"{stem} ({pair['split']})", "instructions": INSTRUCTIONS.format(parts=parts)}
    out = {"data": data}
    if prelabel:
        by_name = {c.name: c for c in classes}
        prediction = {"model_version": model_version,
                      "result": [brush_result(by_name[name], mask) for name, mask in prelabel.items()]}
        if score is not None:
            prediction["score"] = float(score)
        out["predictions"] = [prediction]
    return out


def run_export(cfg: ExportConfig) -> dict:
    classes = parse_classes(cfg.classes)
    dataset, out = Store(cfg.input), Store(cfg.output)
    run_id = new_run_id()
    pairs = discover_pairs(dataset.uri())
    errors = [error_record(p["pair_id"], "annotate_export", f"{'pre (A)' if not p['a_rel'] else 'post (B)'} image missing",
                           error_type="MissingImage", job=JOB, run_id=run_id)
              for p in pairs if not (p["a_rel"] and p["b_rel"])]
    complete = [p for p in pairs if p["a_rel"] and p["b_rel"]]
    todo = [p for p in complete if not (cfg.skip_labelled and p["label_rel"])]
    masks, scores, prop_errors, model_version = _prelabels(cfg, todo, classes, run_id)
    errors += prop_errors
    urls = ImageUrls(dataset, cfg.local_files_root, cfg.url_expiry_s)
    tasks = [build_task(p, urls, classes, masks.get(p["pair_id"]), scores.get(p["pair_id"]), model_version)
             for p in todo]
    config = labeling_config(classes)
    out.write_bytes("tasks.json", json.dumps(tasks, indent=1).encode())
    out.write_bytes("label_config.xml", config.encode())
    write_table_shard(out, "errors", errors, ERRORS_SCHEMA, run_id)
    prune_shards(out, "errors", run_id)
    summary = {"input": dataset.uri(), "pairs": len(pairs), "tasks": len(tasks),
               "skipped_labelled": len(complete) - len(todo), "missing_images": len(pairs) - len(complete),
               "prelabel": model_version or None, "prelabelled": sum(1 for p in todo if p["pair_id"] in masks),
               "prelabel_errors": len(prop_errors), "classes": [c.__dict__ for c in classes],
               "annotations_per_task": cfg.annotations_per_task, "image_urls": urls.mode,
               "local_files_root": urls.local_files_root or None,
               "splits": {s: sum(1 for p in todo if p["split"] == s) for s in sorted({p["split"] for p in todo})}}
    if cfg.label_studio_url:
        from operators.review.studio_client import call
        title = cfg.project_title or (f"changeforge change masks: {posixpath.basename(dataset.uri().rstrip('/'))} "
                                      f"({', '.join(c.name for c in classes)})")
        summary["label_studio"] = call("create_project_with_tasks", url=cfg.label_studio_url, title=title,
                                       label_config=config, tasks=tasks, storage_path=urls.storage_path(),
                                       settings={"maximum_annotations": cfg.annotations_per_task})
    out.write_bytes("export_summary.json", json.dumps(summary, indent=1).encode())
    write_source(out, "annotate_export", input=dataset.uri(), dataset=dataset.uri(), classes=cfg.classes)
    return summary


# -- ingest ------------------------------------------------------------------------------------------
def load_export(export: str, project_id: int) -> list[dict]:
    if export.startswith(("http://", "https://")):
        if not project_id:
            raise SystemExit("jobs.annotate ingest: --export is a server URL; pass --project-id")
        from operators.review.studio_client import call
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


def _annotator(ann: dict) -> str:
    who = ann.get("completed_by")
    if isinstance(who, dict):
        return str(who.get("email") or who.get("id") or "")
    return "" if who is None else str(who)


def _annotations(task: dict) -> list[dict]:
    """The task's submitted annotations (skipped ones left out), earliest first."""
    anns = [a for a in task.get("annotations") or [] if not a.get("was_cancelled")]
    return sorted(anns, key=lambda a: (str(a.get("created_at") or ""), int(a.get("id") or 0)))


def _prelabel(task: dict, classes, width: int, height: int) -> tuple[dict | None, str | None]:
    preds = [p for p in task.get("predictions") or [] if isinstance(p, dict) and p.get("result") is not None]
    if not preds:
        return None, None
    return class_masks(preds[0]["result"], classes, width, height), preds[0].get("model_version")


def _write_maps(dataset: Store, pair: dict, classes, masks: dict[str, np.ndarray]) -> dict:
    """label<i>/ per class and their union label/ (through the pairs job's merge); a labels/ row."""
    base = posixpath.dirname(posixpath.dirname(pair["a_rel"]))
    prefix = f"{base}/" if base else ""
    stem = _stem(pair)
    maps = [np.where(masks[c.name], 255, 0).astype(np.uint8) for c in classes]
    for c, m in zip(classes, maps):
        write_png(dataset, f"{prefix}{c.folder}/{stem}.png", m)
    merged = functools.reduce(lambda x, y: merge_label_maps(x, y), maps[1:], merge_label_maps(maps[0], np.zeros_like(maps[0])))
    uri = write_png(dataset, f"{prefix}label/{stem}.png", merged)
    return {"slice_id": stem, "label_uri": uri, "new_pixels": int((maps[0] > 0).sum()),
            "demolished_pixels": int((maps[1] > 0).sum()) if len(maps) > 1 else 0,
            "changed_pixels": int((merged > 0).sum())}


def _withdraw(dataset: Store, pair: dict, classes) -> None:
    """Remove the maps an earlier ingest merged for a pair that is no longer merged."""
    base = posixpath.dirname(posixpath.dirname(pair["a_rel"]))
    prefix = f"{base}/" if base else ""
    for folder in [c.folder for c in classes] + ["label"]:
        rel = f"{prefix}{folder}/{_stem(pair)}.png"
        if dataset.exists(rel):
            dataset.delete(rel)


def run_ingest(cfg: IngestConfig) -> dict:
    classes = parse_classes(cfg.classes)
    dataset = Store(cfg.input)
    run_id = new_run_id()
    tasks = load_export(cfg.export, cfg.project_id)
    if cfg.tasks:
        _attach_prelabels(tasks, cfg.tasks)
    pairs = {p["pair_id"]: p for p in discover_pairs(dataset.uri())}
    by_stem = {}
    for p in pairs.values():
        by_stem.setdefault(_stem(p), []).append(p)
    previous = read_table(dataset, "annotations", ANNOTATIONS_SCHEMA, current=False, columns=["pair_id", "merged"])
    merged_before = set() if previous is None else {
        pid for pid, m in zip(previous["pair_id"].to_pylist(), previous["merged"].to_pylist()) if m}

    rows, pending, errors, labels, decisions = [], [], [], [], {}
    for task in tasks:
        data = task.get("data") or {}
        pair = pairs.get(data.get("item_id")) or (by_stem.get(str(data.get("pair_id")), [None])[0]
                                                  if len(by_stem.get(str(data.get("pair_id")), [])) == 1 else None)
        task_id = int(task.get("id") or 0)
        if pair is None:
            errors.append(error_record(str(data.get("item_id") or data.get("pair_id")), "annotate_ingest",
                                       f"task {task_id} names a pair that is not in {dataset.uri()}",
                                       error_type="UnknownPair", job=JOB, run_id=run_id))
            continue
        anns = _annotations(task)
        try:
            height, width = decode_image(dataset.read_bytes(pair["a_rel"]), grey=True).shape
            drawn = [class_masks(a.get("result") or [], classes, width, height) for a in anns]
            prelabel, model = _prelabel(task, classes, width, height)
        except Exception as exc:  # noqa: BLE001 - one unreadable task must not stop the batch
            errors.append(error_record(pair["pair_id"], "annotate_ingest", exc, job=JOB, run_id=run_id))
            pending.append({"pair_id": pair["pair_id"], "split": pair["split"], "task_id": task_id,
                            "status": "unreadable", "annotations": len(anns), "pair_agreement": None,
                            "reason": f"{type(exc).__name__}: {exc}"})
            decisions[pair["pair_id"]] = "unreadable"
            continue
        d = decide(drawn, cfg.min_agreement, cfg.require_check)
        decisions[pair["pair_id"]] = d.status
        if d.status == "merged":
            labels.append(_write_maps(dataset, pair, classes, drawn[0]))
        else:
            reason = (f"annotators agree at F1 {d.agreement:.3f} < {cfg.min_agreement} (lowest class); for expert "
                      "review" if d.status == "disagreement" else {
                          "unannotated": "no submitted annotation yet",
                          "awaiting_check": "one annotation; --require-check waits for a second"}[d.status])
            pending.append({"pair_id": pair["pair_id"], "split": pair["split"], "task_id": task_id,
                            "status": d.status, "annotations": len(anns), "pair_agreement": d.agreement,
                            "reason": reason})
        for order, (ann, masks) in enumerate(zip(anns, drawn)):
            for c in classes:
                rows.append({
                    "pair_id": pair["pair_id"], "split": pair["split"], "task_id": task_id,
                    "annotation_id": int(ann.get("id") or 0), "annotator": _annotator(ann), "order": order,
                    "class": c.name, "pixels": int(masks[c.name].sum()),
                    "lead_time_s": None if ann.get("lead_time") is None else float(ann["lead_time"]),
                    "agreement_iou": d.per_class.get(c.name, {}).get("iou") if order < 2 else None,
                    "agreement_f1": d.per_class.get(c.name, {}).get("f1") if order < 2 else None,
                    "pair_agreement": d.agreement,
                    "iou_vs_prelabel": None if prelabel is None else overlap(
                        masks[c.name], prelabel.get(c.name, np.zeros_like(masks[c.name])))[0],
                    "prelabel_model": model, "status": d.status, "merged": d.status == "merged" and order == 0})
    for pid in merged_before:
        if decisions.get(pid, "merged") != "merged" and pid in pairs:
            _withdraw(dataset, pairs[pid], classes)
    # Pairs of the dataset no task names and no mask covers: never silently labelled.
    for p in pairs.values():
        if p["pair_id"] not in decisions and not p["label_rel"] and p["a_rel"] and p["b_rel"]:
            pending.append({"pair_id": p["pair_id"], "split": p["split"], "task_id": None, "status": "not_exported",
                            "annotations": 0, "pair_agreement": None, "reason": "no task in this export"})

    # One table per ingest: the export is the whole truth at that time (later rounds re-export all).
    for table, records, schema in (("annotations", rows, ANNOTATIONS_SCHEMA), ("annotation_pending", pending, PENDING_SCHEMA)):
        write_table_shard(dataset, table, records, schema, run_id)
        prune_shards(dataset, table, run_id)
    if labels and is_pairs_output(dataset):   # the pairs job's labels/ table: the report's CAR reads it
        from jobs.build_pairs import table_schemas
        write_table_shard(dataset, "labels", labels, table_schemas()["labels"], run_id)
    elif labels:
        write_table_shard(dataset, "labels", labels, LABELS_SCHEMA, run_id)
    write_table_shard(dataset, "errors", errors, ERRORS_SCHEMA, run_id)
    doubled = [v for v in {r["pair_id"]: r["pair_agreement"] for r in rows}.values() if v is not None]
    counts = {s: sum(1 for v in decisions.values() if v == s) for s in sorted(set(decisions.values()))}
    summary = {"input": dataset.uri(), "run_id": run_id, "tasks": len(tasks), "merged": len(labels),
               "by_status": counts, "not_exported": sum(1 for p in pending if p["status"] == "not_exported"),
               "errors": len(errors), "double_annotated": len(doubled),
               "batch_agreement": float(np.mean(doubled)) if doubled else None, "min_agreement": cfg.min_agreement,
               "batch_accepted": (float(np.mean(doubled)) >= cfg.min_agreement) if doubled else None,
               "disagreements": sorted(p["pair_id"] for p in pending if p["status"] == "disagreement")}
    dataset.write_bytes("annotation_summary.json", json.dumps(summary, indent=1).encode())
    return summary


# -- command line ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jobs.annotate", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    add_config_args(sub.add_parser("export", help="pairs out as Label Studio change-mask tasks"), ExportConfig, "export")
    add_config_args(sub.add_parser("ingest", help="a Label Studio export back into label1/ label2/ label/"),
                    IngestConfig, "ingest")
    return ap


def _print_export(cfg: ExportConfig, s: dict) -> None:
    print(f"{s['tasks']} tasks of {s['pairs']} pairs ({s['skipped_labelled']} already labelled, "
          f"{s['missing_images']} without both images); pre-labels: {s['prelabel'] or 'none'} "
          f"({s['prelabelled']} pairs); splits {s['splits']}")
    if "label_studio" in s:
        print(f"Label Studio project: {s['label_studio']['project_url']} ({s['label_studio']['imported']} imported)")
    print(f"outputs: {cfg.output}/tasks.json and {cfg.output}/label_config.xml")


def _print_ingest(cfg: IngestConfig, s: dict) -> None:
    print(f"{s['tasks']} tasks: {s['merged']} pairs merged into label/; by status {s['by_status']}; "
          f"{s['not_exported']} pairs without a task; {s['errors']} errors")
    if s["double_annotated"]:
        print(f"agreement over {s['double_annotated']} double-annotated pairs: {s['batch_agreement']:.3f} "
              f"(batch {'accepted' if s['batch_accepted'] else 'NOT accepted'} at {s['min_agreement']}); "
              f"disagreements: {', '.join(s['disagreements']) or 'none'}")
    print(f"outputs: {cfg.input}/label1/ ... label/, annotations/, annotation_pending/, annotation_summary.json")


COMMANDS = {"export": (ExportConfig, run_export, _print_export), "ingest": (IngestConfig, run_ingest, _print_ingest)}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_job_args(build_parser(), argv)
    cls, runner, show = COMMANDS[args.command]
    cfg = config_from_args(cls, args)
    try:
        summary = runner(cfg)
    except ValueError as exc:   # a malformed --classes, or a task drawn in another scheme
        raise SystemExit(f"jobs.annotate {args.command}: {exc}") from None
    show(cfg, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
