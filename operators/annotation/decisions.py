"""What a pair's annotation history decides (pure: history rows in, decisions out).

The history is every version of every annotation ever ingested (see :mod:`operators.annotation.history`);
a pair's decision is computed from all of it, never from one export:

1. Versions: an annotation edited in Label Studio comes back with a later ``updated_at``; the latest
   version of each (project, task, annotation id) counts. ``was_cancelled`` ones are skips: counted,
   never drawings.
2. Expert: an annotation with Label Studio's ``ground_truth`` flag, or any annotation of a review-queue
   task (``annotate export --queue review``), is the expert's. The latest expert annotation decides the
   pair whatever the others say: ``expert`` (merged as drawn), or ``unusable`` when the expert marked it so.
3. Unusable: without an expert, one submitted annotation marking the pair unusable (the ``quality``
   choices: unusable, cloud, misregistered, no data) excludes it, with the reasons given.
4. Annotator and checker: the remaining submitted annotations in the order they were made
   (``created_at``, not the id): the first is the annotator's, the second the checker's. Later ones are
   recorded but do not vote (a third opinion is the expert's job). One annotation is merged as it is,
   or waits (``awaiting_check``) under ``require_check``. Two are compared class by class with a
   boundary tolerance (:func:`tolerant_f1`); at ``min_agreement`` or above the *checker's* drawing is
   merged (the mask that passed the check, drawn by the second pair of eyes), below it the pair is a
   ``disagreement`` for the expert, as is a pair either of them flagged ``needs expert``.
5. Batches: a batch is one Label Studio project. Its mean agreement over its checked pairs below
   ``min_agreement`` rejects it: its pairs that would be merged are held as ``disagreement`` (for the
   expert's review queue) until an expert decides them or the batch's agreement recovers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

STATUSES = ("merged", "expert", "awaiting_check", "disagreement", "unusable", "unannotated", "not_exported",
            "unreadable")
DECIDED = ("merged", "expert", "unusable")
WITH_MASK = ("merged", "expert")
UNUSABLE_CHOICES = ("unusable", "cloud", "misregistered", "no data")
FLAG_CHOICE = "needs expert"
QUALITY_CHOICES = (*UNUSABLE_CHOICES, FLAG_CHOICE)
REVIEW_QUEUE = "review"
TASK_ROW = -1   # annotation_id of the row recording that a task was seen (with or without annotations)


@dataclass(frozen=True)
class DecisionConfig:
    min_agreement: float = 0.8
    require_check: bool = False
    tolerance_px: int = 2

    @property
    def metric(self) -> str:
        return f"F1 with a {self.tolerance_px} px boundary tolerance (lowest class)"


@dataclass
class PairDecision:
    pair_id: str
    status: str
    reason: str = ""
    annotations: int = 0           # submitted (latest versions)
    skipped: int = 0
    agreement: float | None = None  # tolerant F1 between annotator and checker, lowest class
    per_class: dict = field(default_factory=dict)   # class -> {"f1", "iou", "f1_tolerant"}
    annotator: str | None = None
    checker: str | None = None
    expert: str | None = None
    merged_from: tuple | None = None   # version key of the annotation whose drawing is the mask
    batch: int | None = None           # project of the check (or of the single annotation)
    masks: dict | None = field(default=None, repr=False)   # {class: bool mask} to write, for WITH_MASK


def version_key(row: dict) -> tuple:
    return (int(row.get("project") or 0), int(row["task_id"]), int(row["annotation_id"]))


def history_key(row: dict) -> tuple:
    return (*version_key(row), str(row.get("updated_at") or ""))


def latest_versions(rows: Iterable[dict]) -> list[dict]:
    """The latest version (by ``updated_at``; the later row on a tie) of each annotation; task rows out."""
    best: dict[tuple, dict] = {}
    for r in rows:
        if int(r["annotation_id"]) == TASK_ROW:
            continue
        k = version_key(r)
        if k not in best or str(r.get("updated_at") or "") >= str(best[k].get("updated_at") or ""):
            best[k] = r
    return list(best.values())


def quality_of(row: dict) -> list[str]:
    q = row.get("quality")
    if isinstance(q, str):
        q = json.loads(q) if q else []
    return [str(x) for x in q or []]


def unusable_reasons(row: dict) -> list[str]:
    return [q for q in quality_of(row) if q in UNUSABLE_CHOICES]


def is_expert(row: dict) -> bool:
    return bool(row.get("ground_truth")) or row.get("queue") == REVIEW_QUEUE


def made_order(row: dict) -> tuple:
    """Who came first: when the annotation was made; the id only breaks ties."""
    return (str(row.get("created_at") or row.get("updated_at") or ""), int(row["annotation_id"]))


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
    sa, sb = int(np.count_nonzero(a)), int(np.count_nonzero(b))
    if sa == 0 and sb == 0:
        return 1.0
    if sa == 0 or sb == 0:
        return 0.0
    precision = np.count_nonzero(a & dilate(b, tolerance_px)) / sa
    recall = np.count_nonzero(b & dilate(a, tolerance_px)) / sb
    return 0.0 if precision + recall == 0 else float(2 * precision * recall / (precision + recall))


def compare(first: dict, second: dict, tolerance_px: int) -> tuple[float, dict]:
    per_class = {}
    for name in first:
        iou, f1 = overlap(first[name], second[name])
        per_class[name] = {"iou": iou, "f1": f1, "f1_tolerant": tolerant_f1(first[name], second[name], tolerance_px)}
    return (min(v["f1_tolerant"] for v in per_class.values()) if per_class else 1.0), per_class


Masks = Callable[[dict], dict]   # a history row -> {class: bool mask}


def decide_pair(pair_id: str, rows: list[dict], masks_of: Masks, cfg: DecisionConfig) -> PairDecision:
    """One pair from all its history rows (any order). ``masks_of`` decodes a row's drawing; it is called
    only for the annotations that matter (the expert's, the annotator's and the checker's)."""
    versions = latest_versions(rows)
    submitted = [v for v in versions if not v.get("was_cancelled")]
    skipped = len(versions) - len(submitted)
    base = dict(pair_id=pair_id, annotations=len(submitted), skipped=skipped)
    experts = sorted((v for v in submitted if is_expert(v)), key=lambda v: (str(v.get("updated_at") or ""), made_order(v)))
    drawings = sorted((v for v in submitted if not is_expert(v)), key=made_order)
    if experts:
        e = experts[-1]
        d = PairDecision(status="expert", reason="decided by the expert", expert=e.get("annotator"), **base)
        if drawings:
            d.annotator, d.batch = drawings[0].get("annotator"), version_key(drawings[0])[0]
        if len(drawings) >= 2:
            # The annotators' agreement is still measured: it is their batch's, whoever decided the pair.
            d.checker, d.batch = drawings[1].get("annotator"), version_key(drawings[1])[0]
            try:
                d.agreement, d.per_class = compare(masks_of(drawings[0]), masks_of(drawings[1]), cfg.tolerance_px)
            except ValueError:
                pass   # an unreadable drawing does not stand in the expert's way
        if unusable_reasons(e):
            d.status, d.reason = "unusable", ", ".join(unusable_reasons(e)) + " (expert)"
        else:
            d.merged_from, d.masks = history_key(e), masks_of(e)
        return d
    marked = [v for v in submitted if unusable_reasons(v)]
    if marked:
        reasons = sorted({r for v in marked for r in unusable_reasons(v)})
        return PairDecision(status="unusable", reason=", ".join(reasons), annotator=marked[0].get("annotator"),
                            batch=version_key(marked[0])[0], **base)
    if not drawings:
        return PairDecision(status="unannotated", reason=(f"{skipped} skipped, none submitted" if skipped
                                                          else "no submitted annotation yet"), **base)
    first = drawings[0]
    flagged = [v for v in drawings[:2] if FLAG_CHOICE in quality_of(v)]
    if len(drawings) == 1:
        d = PairDecision(status="merged", annotator=first.get("annotator"), batch=version_key(first)[0], **base)
        if flagged:
            d.status, d.reason = "disagreement", f"flagged '{FLAG_CHOICE}' by the annotator"
        elif cfg.require_check:
            d.status, d.reason = "awaiting_check", "one annotation; --require-check waits for the checker's"
        else:
            d.reason, d.merged_from, d.masks = "one annotation, merged unchecked", history_key(first), masks_of(first)
        return d
    checker = drawings[1]
    agreement, per_class = compare(masks_of(first), masks_of(checker), cfg.tolerance_px)
    d = PairDecision(status="merged", agreement=agreement, per_class=per_class, annotator=first.get("annotator"),
                     checker=checker.get("annotator"), batch=version_key(checker)[0], **base)
    if flagged:
        who = "checker" if flagged[-1] is checker else "annotator"
        d.status, d.reason = "disagreement", f"flagged '{FLAG_CHOICE}' by the {who}"
    elif agreement < cfg.min_agreement:
        d.status, d.reason = "disagreement", (f"annotator and checker agree at {agreement:.3f} < {cfg.min_agreement} "
                                              f"({cfg.metric}); for the expert")
    else:
        d.reason = f"checked: agreement {agreement:.3f}; the checker's drawing is merged"
        d.merged_from, d.masks = history_key(checker), masks_of(checker)
    return d


def batch_agreements(decisions: Iterable[PairDecision]) -> dict[int, float]:
    """{project: mean agreement of its checked pairs} (experts' pairs included: their check happened)."""
    by: dict[int, list[float]] = {}
    for d in decisions:
        if d.agreement is not None and d.checker is not None and d.batch is not None:
            by.setdefault(d.batch, []).append(d.agreement)
    return {k: float(np.mean(v)) for k, v in sorted(by.items())}


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
                                    skipped=sum(1 for v in versions if v.get("was_cancelled")))
    batches = batch_agreements(out.values())
    for d in out.values():
        mean = batches.get(d.batch)
        if d.status == "merged" and mean is not None and mean < cfg.min_agreement:
            d.status = "disagreement"
            d.reason = (f"batch (project {d.batch}) rejected: mean agreement {mean:.3f} < {cfg.min_agreement}; "
                        "held for the expert")
            d.merged_from, d.masks = None, None
    return out
