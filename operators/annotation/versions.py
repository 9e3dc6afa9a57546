"""Which versions of a pair's annotations count (rule 1 of :mod:`operators.annotation.decisions`).

A history row is one version of one annotation, keyed by (instance, project, task, annotation id); the
latest version (``updated_at``) of each counts, and an annotation a later full export showed deleted
(a withdrawal row) counts no more. Task rows (annotation id :data:`TASK_ROW`) record that a task was
seen and are never versions.
"""
from __future__ import annotations

from typing import Iterable

TASK_ROW = -1   # annotation_id of the row recording that a task was seen (with or without annotations)


def version_key(row: dict) -> tuple:
    return (str(row.get("instance") or ""), int(row.get("project") or 0), int(row["task_id"]),
            int(row["annotation_id"]))


def history_key(row: dict) -> tuple:
    return (*version_key(row), str(row.get("updated_at") or ""), bool(row.get("withdrawn")))


def latest_versions(rows: Iterable[dict]) -> list[dict]:
    """The latest version (by ``updated_at``; the later row on a tie) of each annotation not withdrawn;
    task rows out. Label Studio never reuses an annotation id, so a withdrawal is final."""
    best: dict[tuple, dict] = {}
    gone = set()
    for r in rows:
        if int(r["annotation_id"]) == TASK_ROW:
            continue
        k = version_key(r)
        if r.get("withdrawn"):
            gone.add(k)
        elif k not in best or str(r.get("updated_at") or "") >= str(best[k].get("updated_at") or ""):
            best[k] = r
    return [v for k, v in best.items() if k not in gone]


def withdrawn_keys(rows: Iterable[dict]) -> set[tuple]:
    return {version_key(r) for r in rows if r.get("withdrawn")}
