"""The annotation history: a Label Studio JSON export as append-only rows (pure: tasks in, rows out).

One row per version of an annotation, keyed by (instance, project, task, annotation id, ``updated_at``,
withdrawn): an annotation edited in Label Studio comes back with a later ``updated_at`` and is a new
row; the same export read again gives the same keys, so it adds nothing. One more row per task
(annotation id -1) records that the task was seen, with its pre-label, so a task nobody annotated yet
is known. An annotation a later full export shows deleted gets a withdrawal row (:func:`withdrawals`);
its versions stay.
"""
from __future__ import annotations

import json
import posixpath

import pyarrow as pa

from operators.annotation.decisions import REVIEW_QUEUE, TASK_ROW, history_key, latest_versions, version_key
from operators.io.tables import keyed

HISTORY_SCHEMA = keyed(pa.schema([
    ("pair_id", pa.string()), ("split", pa.string()),
    ("instance", pa.string()),          # the Label Studio server: --instance, "" for the default one
    ("server", pa.string()),            # its base URL when ingested from the server (checked, not keyed)
    ("project", pa.int64()), ("task_id", pa.int64()),
    ("annotation_id", pa.int64()), ("updated_at", pa.string()), ("created_at", pa.string()),
    ("queue", pa.string()), ("annotator", pa.string()),   # completed_by
    ("updated_by", pa.string()),        # the user who last saved it (another user: an in-place edit)
    ("withdrawn", pa.bool_()),          # deleted in Label Studio, as a full export showed
    ("ground_truth", pa.bool_()),
    ("was_cancelled", pa.bool_()), ("lead_time_s", pa.float64()),
    ("quality", pa.string()),          # JSON list of the `quality` choices
    ("result", pa.string()),           # JSON: the annotation's result (or, on a task row, the pre-label's)
    ("pixels", pa.string()),           # JSON {class: drawn pixels}
    ("prelabel_model", pa.string()), ("prelabel_iou", pa.string()),   # JSON {class: IoU with the pre-label}
    ("run_id", pa.string()),
]), "instance", "project", "task_id", "annotation_id", "updated_at", "withdrawn")


def user_of(who) -> str:
    """A Label Studio user as an export names them: the email of an expanded user, else the id."""
    if isinstance(who, dict):
        return str(who.get("email") or who.get("id") or "")
    return "" if who is None else str(who)


def annotator_of(ann: dict) -> str:
    return user_of(ann.get("completed_by"))


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


def project_of(task: dict, project_id: int = 0) -> int:
    """The same key whichever way the export came (file or server): the task's project, else its
    annotations', else --project-id."""
    anns = task.get("annotations") or []
    return int(task.get("project") or next((a.get("project") for a in anns if a.get("project")), 0)
               or project_id or 0)


def annotation_id(ann: dict) -> int | None:
    """The annotation's id when it is one Label Studio could have given (a positive integer), else None:
    a missing, zero, negative or non-integer id would collide with another version's key or with a task
    row's (:data:`TASK_ROW`), so such an annotation is refused rather than counted."""
    aid = ann.get("id")
    if isinstance(aid, bool) or not isinstance(aid, (int, str)):
        return None
    try:
        aid = int(aid)
    except ValueError:
        return None
    return aid if aid > 0 else None


def history_rows(tasks: list[dict], pairs: dict[str, dict], project_id: int = 0, instance: str = "",
                 server: str = "") -> tuple[list[dict], list[dict]]:
    """(history rows, refused: [{task_id, item, error_type, message, stage?}] of tasks naming no pair of
    the dataset, and one per task holding annotations whose id is not a positive integer (the rest of
    such a task is kept))."""
    rows, refused = [], []
    for task in tasks:
        data = task.get("data") or {}
        task_id = int(task.get("id") or 0)
        pair = match_pair(data, pairs)
        if pair is None:
            refused.append({"task_id": task_id, "item": str(data.get("item_id") or data.get("pair_id")),
                            "error_type": "UnknownPair", "message": f"task {task_id} names a pair that is not "
                            "in the dataset"})
            continue
        queue = REVIEW_QUEUE if data.get("queue") == REVIEW_QUEUE else "annotate"
        anns = task.get("annotations") or []
        project = project_of(task, project_id)
        pred = prediction_of(task)
        where = {"pair_id": pair["pair_id"], "split": pair["split"], "instance": instance, "server": server or None}
        rows.append({**where, "project": project, "task_id": task_id, "withdrawn": False,
                     "annotation_id": TASK_ROW, "updated_at": "", "created_at": str(task.get("created_at") or ""),
                     "queue": queue, "annotator": None, "ground_truth": False, "was_cancelled": False,
                     "lead_time_s": None, "quality": "[]",
                     "result": None if pred is None else json.dumps(pred["result"], sort_keys=True),
                     "prelabel_model": None if pred is None else pred.get("model_version")})
        ids = [annotation_id(ann) for ann in anns]
        bad = [ann.get("id") for ann, aid in zip(anns, ids) if aid is None]
        if bad:
            # One row per task (errors/ keeps one current row per item and stage), every bad id named.
            refused.append({"task_id": task_id, "item": pair["pair_id"], "error_type": "BadAnnotationId",
                            "stage": "annotation_ids",
                            "message": f"task {task_id}: annotation id(s) {', '.join(repr(b) for b in bad)} not "
                            "positive integers (Label Studio's are); those annotations are not ingested"})
        for ann, aid in zip(anns, ids):
            if aid is None:
                continue
            result = ann.get("result") or []
            created = str(ann.get("created_at") or "")
            rows.append({
                **where, "project": int(ann.get("project") or project), "task_id": task_id, "withdrawn": False,
                "updated_by": user_of(ann.get("updated_by")) or None,
                "annotation_id": aid, "updated_at": str(ann.get("updated_at") or created),
                "created_at": created, "queue": queue, "annotator": annotator_of(ann),
                "ground_truth": bool(ann.get("ground_truth")), "was_cancelled": bool(ann.get("was_cancelled")),
                "lead_time_s": None if ann.get("lead_time") is None else float(ann["lead_time"]),
                "quality": json.dumps(quality_choices(result)), "result": json.dumps(result, sort_keys=True),
                "prelabel_model": None if pred is None else pred.get("model_version")})
    return rows, refused


def new_rows(rows: list[dict], seen: set[tuple]) -> list[dict]:
    """The rows whose history key is not in ``seen`` (nor earlier in ``rows``): what an ingest appends."""
    out, keys = [], set(seen)
    for r in rows:
        k = history_key(r)
        if k not in keys:
            keys.add(k)
            out.append(r)
    return out


def _complete(task: dict) -> bool:
    """Whether a task's annotation list is all Label Studio holds: its own counts (``total_annotations``,
    ``cancelled_annotations``) match the list (an export filtered by annotator lists fewer), and it has
    its ``updated_at`` (Label Studio moves it on every save or delete of one of its annotations)."""
    anns = task.get("annotations") or []
    cancelled = sum(1 for a in anns if a.get("was_cancelled"))
    return (bool(task.get("updated_at")) and task.get("total_annotations") == len(anns) - cancelled
            and task.get("cancelled_annotations") == cancelled)


def withdrawals(tasks: list[dict], history: list[dict], instance: str = "", project_id: int = 0) -> list[dict]:
    """Withdrawal rows for the annotations this export shows deleted: of a project whose export is full
    (it holds every task of the project the history has seen), a task that is complete (:func:`_complete`)
    and lacks an annotation the history holds, whose latest version is no later than the task's
    ``updated_at`` (an older export never knew it). A partial export withdraws nothing."""
    present: dict[int, dict[int, dict]] = {}
    for t in tasks:
        present.setdefault(project_of(t, project_id), {})[int(t.get("id") or 0)] = t
    known: dict[int, set[int]] = {}
    for r in history:
        if str(r.get("instance") or "") == instance and int(r["annotation_id"]) == TASK_ROW:
            known.setdefault(int(r.get("project") or 0), set()).add(int(r["task_id"]))
    out = []
    for v in latest_versions(r for r in history if str(r.get("instance") or "") == instance):
        inst, project, task_id, aid = version_key(v)
        task = present.get(project, {}).get(task_id)
        if task is None or not known.get(project, set()) <= set(present[project]) or not _complete(task):
            continue
        listed = {annotation_id(a) for a in task.get("annotations") or []}
        if aid not in listed and str(v.get("updated_at") or "") <= str(task["updated_at"]):
            out.append({**v, "updated_at": str(task["updated_at"]), "withdrawn": True, "result": None,
                        "pixels": None, "prelabel_iou": None, "run_id": None})
    return out
