"""The annotation history: a Label Studio JSON export as append-only rows (pure: tasks in, rows out).

One row per version of an annotation, keyed by (project, task, annotation id, ``updated_at``): an
annotation edited in Label Studio comes back with a later ``updated_at`` and is a new row; the same
export read again gives the same keys, so it adds nothing. One more row per task (annotation id -1)
records that the task was seen, with its pre-label, so a task nobody annotated yet is known.
"""
from __future__ import annotations

import json
import posixpath

import pyarrow as pa

from operators.annotation.decisions import REVIEW_QUEUE, TASK_ROW, history_key
from operators.io.tables import keyed

HISTORY_SCHEMA = keyed(pa.schema([
    ("pair_id", pa.string()), ("split", pa.string()), ("project", pa.int64()), ("task_id", pa.int64()),
    ("annotation_id", pa.int64()), ("updated_at", pa.string()), ("created_at", pa.string()),
    ("queue", pa.string()), ("annotator", pa.string()), ("ground_truth", pa.bool_()),
    ("was_cancelled", pa.bool_()), ("lead_time_s", pa.float64()),
    ("quality", pa.string()),          # JSON list of the `quality` choices
    ("result", pa.string()),           # JSON: the annotation's result (or, on a task row, the pre-label's)
    ("pixels", pa.string()),           # JSON {class: drawn pixels}
    ("prelabel_model", pa.string()), ("prelabel_iou", pa.string()),   # JSON {class: IoU with the pre-label}
    ("run_id", pa.string()),
]), "project", "task_id", "annotation_id", "updated_at")


def annotator_of(ann: dict) -> str:
    who = ann.get("completed_by")
    if isinstance(who, dict):
        return str(who.get("email") or who.get("id") or "")
    return "" if who is None else str(who)


def quality_choices(result: list[dict]) -> list[str]:
    out: list[str] = []
    for item in result or []:
        if item.get("from_name") == "quality" and str(item.get("type", "")).lower() == "choices":
            out += [str(c) for c in (item.get("value") or {}).get("choices") or []]
    return sorted(set(out))


def prediction_of(task: dict) -> dict | None:
    preds = [p for p in task.get("predictions") or [] if isinstance(p, dict) and p.get("result") is not None]
    return preds[0] if preds else None


def match_pair(data: dict, pairs: dict[str, dict]) -> dict | None:
    """The dataset pair a task names: its ``item_id`` (the full pair id), else its ``pair_id`` when that
    stem is unique in the dataset (a split-folder dataset may hold train/A/1.png and test/A/1.png)."""
    pair = pairs.get(str(data.get("item_id")))
    if pair is not None:
        return pair
    stem = str(data.get("pair_id"))
    same = [p for p in pairs.values() if posixpath.basename(p["pair_id"]) == stem]
    return same[0] if len(same) == 1 else None


def history_rows(tasks: list[dict], pairs: dict[str, dict], project_id: int = 0) -> tuple[list[dict], list[dict]]:
    """(history rows, [{task_id, item}] of tasks naming no pair of the dataset)."""
    rows, unknown = [], []
    for task in tasks:
        data = task.get("data") or {}
        task_id = int(task.get("id") or 0)
        pair = match_pair(data, pairs)
        if pair is None:
            unknown.append({"task_id": task_id, "item": str(data.get("item_id") or data.get("pair_id"))})
            continue
        queue = REVIEW_QUEUE if data.get("queue") == REVIEW_QUEUE else "annotate"
        anns = task.get("annotations") or []
        # The same key whichever way the export came (file or server): the task's project, else its
        # annotations', else --project-id.
        project = int(task.get("project") or next((a.get("project") for a in anns if a.get("project")), 0)
                      or project_id or 0)
        pred = prediction_of(task)
        rows.append({"pair_id": pair["pair_id"], "split": pair["split"], "project": project, "task_id": task_id,
                     "annotation_id": TASK_ROW, "updated_at": "", "created_at": str(task.get("created_at") or ""),
                     "queue": queue, "annotator": None, "ground_truth": False, "was_cancelled": False,
                     "lead_time_s": None, "quality": "[]",
                     "result": None if pred is None else json.dumps(pred["result"], sort_keys=True),
                     "prelabel_model": None if pred is None else pred.get("model_version")})
        for ann in anns:
            result = ann.get("result") or []
            created = str(ann.get("created_at") or "")
            rows.append({
                "pair_id": pair["pair_id"], "split": pair["split"],
                "project": int(ann.get("project") or project), "task_id": task_id,
                "annotation_id": int(ann.get("id") or 0), "updated_at": str(ann.get("updated_at") or created),
                "created_at": created, "queue": queue, "annotator": annotator_of(ann),
                "ground_truth": bool(ann.get("ground_truth")), "was_cancelled": bool(ann.get("was_cancelled")),
                "lead_time_s": None if ann.get("lead_time") is None else float(ann["lead_time"]),
                "quality": json.dumps(quality_choices(result)), "result": json.dumps(result, sort_keys=True),
                "prelabel_model": None if pred is None else pred.get("model_version")})
    return rows, unknown


def new_rows(rows: list[dict], seen: set[tuple]) -> list[dict]:
    """The rows whose history key is not in ``seen`` (nor earlier in ``rows``): what an ingest appends."""
    out, keys = [], set(seen)
    for r in rows:
        k = history_key(r)
        if k not in keys:
            keys.add(k)
            out.append(r)
    return out
