"""The reference oracle: docs/annotation.md's rules (history, deletions, people, expert, agreement,
batches) written again from the page alone, on what the exports showed, with its own agreement
(Euclidean distance transform, not dilation) and none of the code under test."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
from scipy.ndimage import distance_transform_edt

UNUSABLE = {"unusable", "cloud", "misregistered", "no data"}
FLAG = "needs expert"


@dataclass(frozen=True)
class Rules:
    min_agreement: float = 0.8
    batch_min_agreement: float = 0.9
    tolerance_px: int = 2
    noise_px: int = 8
    require_check: bool = False
    experts: tuple = ()

    def metric(self):
        return (f"F1 with a {self.tolerance_px} px boundary tolerance, a class under {self.noise_px} px "
                "counted as not drawn (lowest class)")


# -- History: what the exports showed ------------------------------------------------------------------
@dataclass
class Known:
    versions: dict = field(default_factory=dict)   # (instance, project, task, aid) -> the latest annotation seen
    gone: set = field(default_factory=set)         # withdrawn keys
    tasks: dict = field(default_factory=dict)      # (instance, project) -> task ids seen
    queue: dict = field(default_factory=dict)      # (instance, project, task) -> (pair, queue)

    def ingest(self, instance: str, export: list[dict]) -> None:
        present: dict = {}
        for t in export:
            present.setdefault(t["project"], {})[t["id"]] = t
        for key, v in self.versions.items():
            inst, project, task, aid = key
            t = present.get(project, {}).get(task)
            if inst != instance or key in self.gone or t is None:
                continue
            whole = self.tasks.get((inst, project), set()) <= set(present[project])   # not a partial export
            listed = [a["id"] for a in t["annotations"]]
            counts = (t.get("total_annotations"), t.get("cancelled_annotations")) == (
                sum(1 for a in t["annotations"] if not a["was_cancelled"]),
                sum(1 for a in t["annotations"] if a["was_cancelled"]))
            if whole and counts and t.get("updated_at") and aid not in listed and v["updated_at"] <= t["updated_at"]:
                self.gone.add(key)
        for t in export:
            self.tasks.setdefault((instance, t["project"]), set()).add(t["id"])
            self.queue[(instance, t["project"], t["id"])] = (t["data"]["item_id"], t["data"].get("queue"))
            for a in t["annotations"]:
                key = (instance, t["project"], t["id"], a["id"])
                if key not in self.versions or a["updated_at"] >= self.versions[key]["updated_at"]:
                    self.versions[key] = {**a, "key": key, "pair": t["data"]["item_id"],
                                          "queue": t["data"].get("queue") or "annotate"}

    def current(self, pair: str) -> list[dict]:
        return [v for k, v in self.versions.items() if k not in self.gone and v["pair"] == pair]


# -- Agreement -----------------------------------------------------------------------------------------
def tolerant_f1(a: np.ndarray, b: np.ndarray, tol: int) -> float:
    near_b = distance_transform_edt(~b) <= tol      # pixels within tol of b
    near_a = distance_transform_edt(~a) <= tol
    p, r = near_b[a].mean(), near_a[b].mean()
    return 0.0 if p + r == 0 else float(2 * p * r / (p + r))


def class_f1(a: np.ndarray, b: np.ndarray, rules: Rules) -> float:
    drawn_a, drawn_b = a.sum() >= max(1, rules.noise_px), b.sum() >= max(1, rules.noise_px)
    if drawn_a and drawn_b:
        return tolerant_f1(a, b, rules.tolerance_px)
    return 0.0 if drawn_a or drawn_b else 1.0


# -- Decisions -----------------------------------------------------------------------------------------
def ticks(v):
    return {c for item in v["result"] if item.get("from_name") == "quality" for c in item["value"]["choices"]}


def unusable(v):
    return sorted(ticks(v) & UNUSABLE)


def voice(v):
    """updated_by when another user saved it a second or more after it was made, else its author."""
    later = (datetime.fromisoformat(v["updated_at"]) - datetime.fromisoformat(v["created_at"])).total_seconds() >= 1
    edited = v["updated_by"] and v["updated_by"] != v["completed_by"] and later
    return v["updated_by"] if edited else v["completed_by"]


def decide(known: Known, pair: str, masks_of, rules: Rules, cache: dict | None = None) -> dict:
    """{status, reason, annotator, checker, expert, agreement, merged, batch} of one pair."""
    cur = [v for v in known.current(pair) if not v["was_cancelled"]]
    skipped = len(known.current(pair)) - len(cur)
    annotators = {v["completed_by"] for v in cur if v["queue"] != "review"}

    def acting_expert(v):
        edited_by_listed = rules.experts and voice(v) != v["completed_by"] and voice(v) in rules.experts
        if (v["queue"] == "review" or v["ground_truth"] or edited_by_listed) and voice(v) not in annotators \
                and (not rules.experts or voice(v) in rules.experts):
            return voice(v)
        return None

    acts = [v for v in cur if acting_expert(v)]
    drawings = [v for v in cur if v["queue"] != "review" and not acting_expert(v)]
    first = {}
    for v in drawings:
        took = [(v["completed_by"], (v["created_at"], v["id"]))]
        if voice(v) != v["completed_by"]:
            took.append((voice(v), (v["updated_at"], v["id"])))
        for who, when in took:
            first[who] = min(first.get(who, when), when)
    people = sorted(first, key=lambda w: (first[w], w))

    def vote(who):
        own = [v for v in drawings if voice(v) == who] or [v for v in drawings if v["completed_by"] == who]
        return max(own, key=lambda v: (v["updated_at"], v["created_at"], v["id"]))

    out = dict(status=None, reason="", annotator=None, checker=None, expert=None, agreement=None, merged=None,
               batch=None)
    va = vote(people[0]) if people else None
    vc = vote(people[1]) if len(people) > 1 else None
    if people:
        out.update(annotator=people[0], checker=people[1] if len(people) > 1 else None, batch=(vc or va)["key"][:2])

    def compare():   # masks_of: {class: (palette name, mask)}; the agreement of two names is computed once
        ma, mc = masks_of(va), masks_of(vc)
        memo = {} if cache is None else cache
        for c in ma:
            if (ma[c][0], mc[c][0]) not in memo:
                memo[(ma[c][0], mc[c][0])] = class_f1(ma[c][1], mc[c][1], rules)
        out["agreement"] = min(memo[(ma[c][0], mc[c][0])] for c in ma)

    if acts:
        e = max(acts, key=lambda v: (v["updated_at"], v["created_at"], v["id"], v["key"]))
        out.update(status="expert", reason="decided by the expert", expert=acting_expert(e))
        if vc is not None and vc is not va and not unusable(va) and not unusable(vc):
            compare()
        if unusable(e):
            out.update(status="unusable", reason=", ".join(unusable(e)) + " (expert)")
        else:
            out["merged"] = e
        return out
    if not people:
        return {**out, "status": "unannotated",
                "reason": f"{skipped} skipped, none submitted" if skipped else "no submitted annotation yet"}
    if vc is None:
        if FLAG in ticks(va):
            return {**out, "status": "disagreement", "reason": "flagged 'needs expert' by the annotator"}
        if rules.require_check:
            return {**out, "status": "awaiting_check", "reason": "one annotation; --require-check waits for the checker's"}
        if unusable(va):
            return {**out, "status": "unusable", "reason": ", ".join(unusable(va))}
        return {**out, "status": "merged", "reason": "one annotation, merged unchecked", "merged": va}
    if FLAG in ticks(vc) or FLAG in ticks(va):
        who = "checker" if FLAG in ticks(vc) else "annotator"
        return {**out, "status": "disagreement", "reason": f"flagged 'needs expert' by the {who}"}
    if vc is va:
        if unusable(vc):
            return {**out, "status": "unusable", "reason": ", ".join(unusable(vc))}
        return {**out, "status": "merged", "merged": vc,
                "reason": "checked in place: the checker's edit of the annotator's annotation is merged"}
    if unusable(va) and unusable(vc):
        return {**out, "status": "unusable", "reason": ", ".join(sorted(set(unusable(va)) | set(unusable(vc))))}
    if unusable(va) or unusable(vc):
        marker, other = ("annotator", "checker") if unusable(va) else ("checker", "annotator")
        both = ", ".join(sorted(set(unusable(va)) | set(unusable(vc))))
        return {**out, "status": "disagreement",
                "reason": f"the {marker} marks the pair unusable ({both}), the {other} drew it; for the expert"}
    compare()
    if out["agreement"] < rules.min_agreement:
        return {**out, "status": "disagreement", "reason": f"annotator and checker agree at {out['agreement']:.3f} < "
                f"{rules.min_agreement} ({rules.metric()}); for the expert"}
    return {**out, "status": "merged", "merged": vc,
            "reason": f"checked: agreement {out['agreement']:.3f}; the checker's drawing is merged"}


def decide_everything(known: Known, masks_of, rules: Rules, cache: dict | None = None) -> dict:
    """{pair: decision} for every pair a task of an export named, batches applied."""
    out = {p: decide(known, p, masks_of, rules, cache) for p in sorted({p for p, _ in known.queue.values()})}
    batches: dict = {}
    for d in out.values():
        if d["status"] in ("merged", "disagreement") and d["agreement"] is not None and d["checker"]:
            batches.setdefault(d["batch"], []).append(d["agreement"])
    for d in out.values():
        scores = batches.get(d["batch"])
        if d["status"] == "merged" and scores and np.mean(scores) < rules.batch_min_agreement:
            inst, project = d["batch"]
            name = f"project {project}" + (f" on {inst}" if inst else "")
            d.update(status="disagreement", merged=None,
                     reason=f"batch ({name}) rejected: mean agreement {np.mean(scores):.3f} over {len(scores)} pairs "
                            f"awaiting a decision < {rules.batch_min_agreement}; held for the expert")
    return out
