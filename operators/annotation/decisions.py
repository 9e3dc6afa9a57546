"""What a pair's annotation history decides (pure: history rows in, decisions out).

The history is every version of every annotation ever ingested (see :mod:`operators.annotation.history`);
a pair's decision is computed from all of it, never from one export. The rules (docs/annotation.md
states them with an example each):

1. Versions: the latest version (``updated_at``) of each (instance, project, task, annotation id) counts;
   an annotation a later full export showed deleted (a withdrawal row) counts no more. ``was_cancelled``
   ones are skips: counted, never drawings.
2. People: a version speaks for the user who made it so: ``updated_by`` when another user edited it in
   place, else its author (``completed_by``). The pair's annotators are the authors of its annotate-queue
   annotations.
3. Expert: a review-queue annotation, a ground-truth star, or (with an experts list) an in-place edit by
   a listed expert, made by someone who is not one of the pair's annotators (and, with a list, is on it),
   is an expert's decision. The latest decides: ``expert`` (merged as drawn), or ``unusable``.
4. Annotator and checker: the first two people to take part in the pair (an author when their annotation
   was made, an editor when they edited); each votes with the latest version that speaks for them (else
   the latest they authored). One person: merged as drawn (or unusable), or ``awaiting_check`` under
   ``require_check``. The checker's vote being the annotator's own annotation edited in place is a check:
   the checker's version is merged. Otherwise both answers are compared: both unusable excludes the pair,
   one unusable is a ``disagreement``, two drawings agree at ``min_agreement`` (:func:`compare`) and the
   checker's is merged. ``needs expert`` from either is a ``disagreement``.
5. Batches: a batch is one Label Studio project (of one instance). Its mean agreement over its checked
   pairs still awaiting a decision (merged or disagreement, not the expert's) below
   ``batch_min_agreement`` holds its merged pairs as ``disagreement`` for the expert.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Callable, Iterable

import numpy as np

STATUSES = ("merged", "expert", "awaiting_check", "disagreement", "unusable", "unannotated", "not_exported",
            "unreadable")
DECIDED = ("merged", "expert", "unusable")
WITH_MASK = ("merged", "expert")
AWAITING = ("merged", "disagreement")   # a batch's mean is over these: decided by no expert yet
UNUSABLE_CHOICES = ("unusable", "cloud", "misregistered", "no data")
FLAG_CHOICE = "needs expert"
QUALITY_CHOICES = (*UNUSABLE_CHOICES, FLAG_CHOICE)
REVIEW_QUEUE = "review"
HELD = "batch ("   # how the reason of a pair held by its rejected batch begins (status tells them apart)
TASK_ROW = -1   # annotation_id of the row recording that a task was seen (with or without annotations)


@dataclass(frozen=True)
class DecisionConfig:
    min_agreement: float = 0.8
    require_check: bool = False
    tolerance_px: int = 2
    noise_px: int = 200                 # a class one side drew smaller than this is noise (validate's floor)
    batch_min_agreement: float = 0.8
    experts: tuple = ()                 # user identities; empty: anyone who is not the pair's annotator

    @property
    def metric(self) -> str:
        return (f"F1 with a {self.tolerance_px} px boundary tolerance, a class under {self.noise_px} px "
                "counted as not drawn (lowest class)")


@dataclass
class PairDecision:
    pair_id: str
    status: str
    reason: str = ""
    annotations: int = 0           # submitted (latest versions)
    skipped: int = 0
    agreement: float | None = None  # tolerant F1 between annotator and checker, lowest class
    per_class: dict = field(default_factory=dict)   # class -> {"f1", "iou", "f1_tolerant", "noise"}
    annotator: str | None = None
    checker: str | None = None
    expert: str | None = None
    merged_from: tuple | None = None   # history key of the annotation version whose drawing is the mask
    batch: int | None = None           # project of the check (or of the single annotation)
    instance: str = ""                 # the Label Studio instance of that project
    withdrawn: int = 0                 # annotations deleted in Label Studio (seen by a full export)
    masks: dict | None = field(default=None, repr=False)   # {class: bool mask} to write, for WITH_MASK


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


def quality_of(row: dict) -> list[str]:
    q = row.get("quality")
    if isinstance(q, str):
        q = json.loads(q) if q else []
    return [str(x) for x in q or []]


def unusable_reasons(row: dict) -> list[str]:
    return [q for q in quality_of(row) if q in UNUSABLE_CHOICES]


def made_order(row: dict) -> tuple:
    """Who came first: when the annotation was made; the id only breaks ties."""
    return (str(row.get("created_at") or row.get("updated_at") or ""), int(row["annotation_id"]))


def edit_order(row: dict) -> tuple:
    return (str(row.get("updated_at") or ""), *made_order(row))


def author(row: dict) -> str:
    return str(row.get("annotator") or "")


def saved_later(row: dict) -> bool:
    """Whether a version was saved after the one that made the annotation: Label Studio stamps
    ``created_at`` and ``updated_at`` in that first save too, microseconds apart, so a second or more."""
    made, saved = str(row.get("created_at") or ""), str(row.get("updated_at") or "")
    try:
        return (datetime.fromisoformat(saved) - datetime.fromisoformat(made)).total_seconds() >= 1
    except (ValueError, TypeError):   # not ISO times (or one without its zone): later is later
        return saved > made


def editor(row: dict) -> str | None:
    """The user who edited the annotation in place after it was made, when that is not its author (the
    one who saved it first, e.g. an admin creating it for its author through the API, is no editor)."""
    e = str(row.get("updated_by") or "")
    return e if e and e != author(row) and saved_later(row) else None


def voice(row: dict) -> str:
    """Whom a version speaks for: the user who made it what it is."""
    return editor(row) or author(row)


def expert_of(row: dict, annotators: set[str], experts: tuple) -> str | None:
    """The expert whose decision ``row`` is (see rule 3), or None."""
    acts = (row.get("queue") == REVIEW_QUEUE or bool(row.get("ground_truth"))
            or (bool(experts) and editor(row) in experts))
    who = voice(row)
    if acts and who not in annotators and (not experts or who in experts):
        return who
    return None


def people(drawings: list[dict]) -> list[str]:
    """The people of a pair's drawings in the order they took part: an author when the annotation was
    made, an editor when the version was edited (ties: annotation id, then name)."""
    first: dict[str, tuple] = {}
    for v in drawings:
        for who, when in ((author(v), made_order(v)), (editor(v), (str(v.get("updated_at") or ""),
                                                                    int(v["annotation_id"])))):
            if who is not None and (who not in first or when < first[who]):
                first[who] = when
    return sorted(first, key=lambda who: (first[who], who))


def vote_of(who: str, drawings: list[dict]) -> dict:
    """A person's vote: the latest version that speaks for them, else the latest they authored."""
    own = [v for v in drawings if voice(v) == who] or [v for v in drawings if author(v) == who]
    return max(own, key=edit_order)


def _disk(r: int) -> np.ndarray:
    y, x = np.ogrid[-r:r + 1, -r:r + 1]
    return (x * x + y * y <= r * r).astype(np.uint8)


def dilate(mask: np.ndarray, r: int) -> np.ndarray:
    if r <= 0 or not mask.any():
        return mask
    import cv2
    return cv2.dilate(mask.astype(np.uint8), _disk(r)) > 0


def overlap(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(IoU, F1) of two boolean masks; 1.0 each when both are empty."""
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    inter = int(np.count_nonzero(a & b))
    sa, sb = int(np.count_nonzero(a)), int(np.count_nonzero(b))
    union = sa + sb - inter
    if union == 0:
        return 1.0, 1.0
    return inter / union, 2 * inter / (sa + sb)


def tolerant_f1(a: np.ndarray, b: np.ndarray, tolerance_px: int) -> float:
    """F1 where a pixel of one mask counts as matched when the other mask has a pixel within
    ``tolerance_px`` (a disk): precision over ``a``, recall over ``b``. Stray brush pixels and a
    boundary drawn a pixel or two apart do not count as disagreement; a missing building does."""
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    if not (a.any() or b.any()):
        return 1.0
    if not (a.any() and b.any()):
        return 0.0
    # the mean over one mask's pixels of "near the other": boolean indexing, no count to get wrong
    precision = float(dilate(b, tolerance_px)[a].mean())
    recall = float(dilate(a, tolerance_px)[b].mean())
    return 0.0 if precision + recall == 0 else float(2 * precision * recall / (precision + recall))


def class_agreement(a: np.ndarray, b: np.ndarray, tolerance_px: int, noise_px: int) -> dict:
    """One class of two drawings: plain IoU and F1, and the tolerant F1 the decision reads, where a side
    with fewer than ``noise_px`` pixels of the class counts as not having drawn it (a stray dot is noise,
    a missing building is not): neither drew it agrees (1.0, ``noise`` when a dot was there), only one
    did disagrees (0.0)."""
    iou, f1 = overlap(a, b)
    floor = max(1, noise_px)
    drawn_a, drawn_b = int(np.count_nonzero(a)) >= floor, int(np.count_nonzero(b)) >= floor
    if drawn_a and drawn_b:
        tolerant = tolerant_f1(a, b, tolerance_px)
    else:
        tolerant = 0.0 if drawn_a or drawn_b else 1.0
    noise = not (drawn_a or drawn_b) and bool(np.any(a) or np.any(b))
    return {"iou": iou, "f1": f1, "f1_tolerant": tolerant, "noise": noise}


def compare(first: dict, second: dict, tolerance_px: int, noise_px: int = 0) -> tuple[float, dict]:
    """(the pair's agreement: the lowest class's tolerant F1, {class: class_agreement})."""
    per_class = {name: class_agreement(first[name], second[name], tolerance_px, noise_px) for name in first}
    return (min(v["f1_tolerant"] for v in per_class.values()) if per_class else 1.0), per_class


Masks = Callable[[dict], dict]   # a history row -> {class: bool mask}


def _reasons(*versions: dict) -> str:
    return ", ".join(sorted({r for v in versions for r in unusable_reasons(v)}))


def _votes(who: list[str], drawings: list[dict]) -> tuple:
    """(annotator, their vote, checker or None, their vote or None)."""
    va = vote_of(who[0], drawings)
    if len(who) < 2:
        return who[0], va, None, None
    return who[0], va, who[1], vote_of(who[1], drawings)


def _place(d: PairDecision, v: dict) -> None:
    d.instance, d.batch = version_key(v)[:2]


def _merge(d: PairDecision, v: dict, masks_of: Masks, reason: str) -> PairDecision:
    d.status, d.reason, d.merged_from, d.masks = "merged", reason, history_key(v), masks_of(v)
    return d


def decide_pair(pair_id: str, rows: list[dict], masks_of: Masks, cfg: DecisionConfig) -> PairDecision:
    """One pair from all its history rows (any order). ``masks_of`` decodes a row's drawing; it is called
    only for the annotations that matter (the expert's, the annotator's and the checker's votes)."""
    rows = list(rows)
    versions = latest_versions(rows)
    submitted = [v for v in versions if not v.get("was_cancelled")]
    base = dict(pair_id=pair_id, annotations=len(submitted), skipped=len(versions) - len(submitted),
                withdrawn=len(withdrawn_keys(rows)))
    annotators = {author(v) for v in submitted if v.get("queue") != REVIEW_QUEUE}
    acts = sorted(((v, who) for v in submitted if (who := expert_of(v, annotators, cfg.experts))),
                  key=lambda a: (edit_order(a[0]), version_key(a[0])))
    decided = {id(v) for v, _ in acts}
    drawings = [v for v in submitted if v.get("queue") != REVIEW_QUEUE and id(v) not in decided]
    who = people(drawings)
    if acts:
        e, expert = acts[-1]
        d = PairDecision(status="expert", reason="decided by the expert", expert=expert, **base)
        if who:
            # The people's agreement is still measured (reported), though the expert decided the pair.
            d.annotator, va, d.checker, vc = _votes(who, drawings)
            _place(d, vc or va)
            if vc is not None and vc is not va and not (unusable_reasons(va) or unusable_reasons(vc)):
                try:
                    d.agreement, d.per_class = compare(masks_of(va), masks_of(vc), cfg.tolerance_px, cfg.noise_px)
                except ValueError:
                    pass   # an unreadable drawing does not stand in the expert's way
        if unusable_reasons(e):
            d.status, d.reason = "unusable", _reasons(e) + " (expert)"
        else:
            d.merged_from, d.masks = history_key(e), masks_of(e)
        return d
    if not who:
        skipped = base["skipped"]
        return PairDecision(status="unannotated", reason=(f"{skipped} skipped, none submitted" if skipped
                                                          else "no submitted annotation yet"), **base)
    ann, va, chk, vc = _votes(who, drawings)
    d = PairDecision(status="disagreement", annotator=ann, checker=chk, **base)
    _place(d, vc or va)
    if vc is None:
        if FLAG_CHOICE in quality_of(va):
            d.reason = f"flagged '{FLAG_CHOICE}' by the annotator"
        elif cfg.require_check:
            d.status, d.reason = "awaiting_check", "one annotation; --require-check waits for the checker's"
        elif unusable_reasons(va):
            d.status, d.reason = "unusable", _reasons(va)
        else:
            _merge(d, va, masks_of, "one annotation, merged unchecked")
        return d
    if FLAG_CHOICE in quality_of(vc) or FLAG_CHOICE in quality_of(va):
        d.reason = f"flagged '{FLAG_CHOICE}' by the {'checker' if FLAG_CHOICE in quality_of(vc) else 'annotator'}"
    elif version_key(vc) == version_key(va):   # the checker corrected the annotator's own annotation in place
        if unusable_reasons(vc):
            d.status, d.reason = "unusable", _reasons(vc)
        else:
            _merge(d, vc, masks_of, "checked in place: the checker's edit of the annotator's annotation is merged")
    elif unusable_reasons(va) and unusable_reasons(vc):
        d.status, d.reason = "unusable", _reasons(va, vc)
    elif unusable_reasons(va) or unusable_reasons(vc):
        marker, other = ("annotator", "checker") if unusable_reasons(va) else ("checker", "annotator")
        d.reason = f"the {marker} marks the pair unusable ({_reasons(va, vc)}), the {other} drew it; for the expert"
    else:
        d.agreement, d.per_class = compare(masks_of(va), masks_of(vc), cfg.tolerance_px, cfg.noise_px)
        if d.agreement < cfg.min_agreement:
            d.reason = (f"annotator and checker agree at {d.agreement:.3f} < {cfg.min_agreement} ({cfg.metric}); "
                        "for the expert")
        else:
            _merge(d, vc, masks_of, f"checked: agreement {d.agreement:.3f}; the checker's drawing is merged")
    return d


def batch_name(instance: str, project: int) -> str:
    return f"project {project}" + (f" on {instance}" if instance else "")


def batch_agreements(decisions: Iterable[PairDecision]) -> dict[tuple, tuple[float, int]]:
    """{(instance, project): (mean agreement, pairs)} over each batch's checked pairs still awaiting a
    decision (merged or disagreement): a pair the expert decided leaves its batch's mean."""
    by: dict[tuple, list[float]] = {}
    for d in decisions:
        if d.status in AWAITING and d.agreement is not None and d.checker is not None and d.batch is not None:
            by.setdefault((d.instance, d.batch), []).append(d.agreement)
    return {k: (float(np.mean(v)), len(v)) for k, v in sorted(by.items())}


def decide_all(rows: Iterable[dict], masks_of: Masks, cfg: DecisionConfig) -> dict[str, PairDecision]:
    """{pair_id: decision} for every pair the history names, batch acceptance applied."""
    by_pair: dict[str, list[dict]] = {}
    for r in rows:
        by_pair.setdefault(r["pair_id"], []).append(r)
    out = {}
    for pid, rs in sorted(by_pair.items()):
        try:
            out[pid] = decide_pair(pid, rs, masks_of, cfg)
        except ValueError as exc:   # a drawing that cannot be read (wrong size, unknown class): held, named
            versions = latest_versions(rs)
            out[pid] = PairDecision(pid, "unreadable", f"{type(exc).__name__}: {exc}",
                                    annotations=sum(1 for v in versions if not v.get("was_cancelled")),
                                    skipped=sum(1 for v in versions if v.get("was_cancelled")),
                                    withdrawn=len(withdrawn_keys(rs)))
    batches = batch_agreements(out.values())
    for d in out.values():
        mean, n = batches.get((d.instance, d.batch), (None, 0))
        if d.status == "merged" and mean is not None and mean < cfg.batch_min_agreement:
            d.status = "disagreement"
            d.reason = (f"{HELD}{batch_name(d.instance, d.batch)}) rejected: mean agreement {mean:.3f} over {n} "
                        f"pairs awaiting a decision < {cfg.batch_min_agreement}; held for the expert")
            d.merged_from, d.masks = None, None
    return out
