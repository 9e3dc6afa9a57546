"""Test equipment: a small Label Studio as its users drive it (two instances, annotate and review projects,
annotations created, edited in place by their author or another user, starred, deleted, skipped; tasks
re-imported; drafts) and its JSON exports (full, partial, filtered by annotator), with drawings from a
fixed palette of masks.

Label Studio's own behaviour modelled here: annotation and task ids are the instance's own (both
instances count from 1); saving or deleting an annotation saves its task after it (the task's
``updated_at`` moves); a save records the user in ``updated_by``; an export lists each task's
``total_annotations`` and ``cancelled_annotations`` as the database holds them, even when the export
was filtered."""
from __future__ import annotations

import copy
import json
from datetime import datetime, timedelta
from dataclasses import dataclass, field

import numpy as np

from tests.annotation.drawing import brush

PAIRS = ("p0", "p1")
USERS = ("u1", "u2", "u3", "boss")
# (instance, project) -> queue; task ids per instance: both instances hold task 1 and 2 (the collision).
PROJECTS = {("", 1): "annotate", ("", 2): "review", ("lab-b", 1): "annotate"}
TASKS = {("", 1): {1: "p0", 2: "p1"}, ("", 2): {3: "p0", 4: "p1"}, ("lab-b", 1): {1: "p0", 2: "p1"}}
NEW = ("house", "near", "half", "other", "shed", "dot", "empty")     # what an annotator draws as "new"
GONE = ("empty", "empty", "dot", "house")                           # ... and as "demolished"
TICKS = ((), (), (), (), ("cloud",), ("needs expert",))     # mostly plain drawings


def palette(size: int, floor: int) -> dict[str, np.ndarray]:
    """Masks at ``size`` px: a house, the same a pixel lower (agrees within the tolerance), its left half,
    another place, a shed of exactly ``floor`` px (the noise floor: an object), a 2 x 2 dot (under it),
    nothing."""
    k = size // 16

    def box(y0, y1, x0, x1):
        m = np.zeros((size, size), bool)
        m[y0 * k:y1 * k, x0 * k:x1 * k] = True
        return m

    dot = np.zeros((size, size), bool)
    dot[size - 2:, :2] = True
    shed = np.zeros((size, size), bool)
    shed[:floor // 2, size - 4:size - 2] = True          # floor // 2 rows x 2 columns, top right (floor even)
    return {"house": box(2, 10, 2, 10), "near": np.roll(box(2, 10, 2, 10), 1, axis=0), "half": box(2, 10, 2, 6),
            "other": box(11, 16, 10, 16), "shed": shed, "dot": dot, "empty": np.zeros((size, size), bool)}


@dataclass
class Ann:
    instance: str
    project: int
    task: int
    aid: int
    author: str
    by: str | None
    created: str
    updated: str
    drawing: tuple            # (new, demolished) palette names
    ticks: tuple = ()
    star: bool = False
    cancelled: bool = False


@dataclass
class LabelStudio:
    size: int
    floor: int
    clock: int = 0
    anns: dict = field(default_factory=dict)          # (instance, aid) -> Ann
    task_updated: dict = field(default_factory=dict)  # (instance, task) -> updated_at
    next_aid: dict = field(default_factory=lambda: {"": 1, "lab-b": 1})
    tasks: dict = field(default_factory=lambda: copy.deepcopy(TASKS))   # re-imports add tasks
    drafts: dict = field(default_factory=dict)        # (instance, task) -> [draft]: never annotations

    def __post_init__(self):
        self.masks = palette(self.size, self.floor)
        self._results: dict = {}
        self._drawings: dict = {}

    def drawing_of(self, result: list[dict]) -> tuple:
        """The palette names an exported result was drawn with (for the oracle, which decodes nothing)."""
        return self._drawings[json.dumps([r for r in result if r.get("type") == "brushlabels"], sort_keys=True)]

    def tick(self) -> str:
        self.clock += 1
        return (datetime(2026, 1, 1) + timedelta(seconds=self.clock)).isoformat() + "Z"

    def _save(self, a: Ann) -> None:
        self.task_updated[(a.instance, a.task)] = self.tick()     # the task is saved after its annotation

    def create(self, instance, project, pair, user, drawing, ticks, cancelled, saved_by=None) -> Ann:
        """``saved_by``: who saved it, when not ``user`` (an admin creating it for them through the API)."""
        task = max(t for t, p in self.tasks[(instance, project)].items() if p == pair)   # the latest import
        now = self.tick()
        a = Ann(instance, project, task, self.next_aid[instance], user, saved_by or user, now, now, drawing, ticks,
                cancelled=cancelled)
        self.next_aid[instance] += 1
        self.anns[(instance, a.aid)] = a
        self._save(a)
        return a

    def update(self, a: Ann, user, drawing, ticks) -> None:
        a.by, a.updated, a.drawing, a.ticks, a.cancelled = user, self.tick(), drawing, ticks, False
        self._save(a)

    def star(self, a: Ann, user) -> None:
        a.by, a.updated, a.star = user, self.tick(), True
        self._save(a)

    def delete(self, a: Ann) -> None:
        del self.anns[(a.instance, a.aid)]
        self.tick()
        self._save(a)

    def reimport(self, instance: str, project: int, pair: str) -> None:
        """The pair's task imported again into the project: a new task id (the old task stays)."""
        task = 1 + max(t for (inst, _), ts in self.tasks.items() if inst == instance for t in ts)
        self.tasks[(instance, project)][task] = pair
        self.task_updated[(instance, task)] = self.tick()

    def draft(self, instance: str, project: int, pair: str, user: str, drawing: tuple) -> None:
        """Unsubmitted work Label Studio keeps and exports beside the annotations."""
        task = max(t for t, p in self.tasks[(instance, project)].items() if p == pair)
        self.drafts.setdefault((instance, task), []).append(
            {"id": len(self.drafts) + 1, "user": user, "created_at": self.tick(), "result": self.result(drawing, ())})

    def result(self, drawing: tuple, ticks: tuple) -> list[dict]:
        if drawing not in self._results:
            new, gone = drawing
            self._results[drawing] = ([brush("new", "post", self.masks[new])] if new != "empty" else []) + \
                ([brush("demolished", "pre", self.masks[gone])] if gone != "empty" else [])
            self._drawings[json.dumps(self._results[drawing], sort_keys=True)] = drawing
        quality = [{"type": "choices", "from_name": "quality", "to_name": "post", "value": {"choices": list(ticks)}}]
        return self._results[drawing] + (quality if ticks else [])

    def export(self, instance: str, project: int, drop_task: int | None = None, drop_ann: int | None = None) -> list[dict]:
        """The project's JSON export; ``drop_task``: a partial export without the task at that index;
        ``drop_ann``: an export filtered by annotator, without the annotation at that index (counts kept)."""
        out = []
        for task, pair in self.tasks[(instance, project)].items():
            anns = sorted((a for a in self.anns.values() if (a.instance, a.task) == (instance, task)), key=lambda a: a.aid)
            out.append({
                "id": task, "project": project, "data": {"item_id": pair, "pair_id": pair,
                                                         "queue": PROJECTS[(instance, project)]},
                "updated_at": self.task_updated.get((instance, task), "2026-01-01T00:00:00Z"),
                "total_annotations": sum(1 for a in anns if not a.cancelled),
                "cancelled_annotations": sum(1 for a in anns if a.cancelled),
                "drafts": self.drafts.get((instance, task), []),
                "annotations": [{"id": a.aid, "project": project, "completed_by": a.author, "updated_by": a.by,
                                 "created_at": a.created, "updated_at": a.updated, "was_cancelled": a.cancelled,
                                 "ground_truth": a.star, "lead_time": 1.0,
                                 "result": [] if a.cancelled else self.result(a.drawing, a.ticks)} for a in anns]})
        if drop_task is not None:
            del out[drop_task % len(out)]
        if drop_ann is not None:
            listed = [(t, i) for t in out for i in range(len(t["annotations"]))]
            if listed:
                t, i = listed[drop_ann % len(listed)]
                del t["annotations"][i]
        return copy.deepcopy(out)
