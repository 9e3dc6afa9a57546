"""Agreement between two annotators' masks and what a pair's annotations allow (pure numpy).

A pair's agreement is the lowest, over classes, of the F1 (Dice) between the two annotators' masks of
that class (both empty: 1.0, they agree there is none). Below ``min_agreement`` the pair is a
disagreement: its masks are not merged and it is listed for an expert.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def overlap(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(IoU, F1) of two boolean masks; 1.0 each when both are empty."""
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    inter = int(np.count_nonzero(a & b))
    sa, sb = int(np.count_nonzero(a)), int(np.count_nonzero(b))
    union = sa + sb - inter
    if union == 0:
        return 1.0, 1.0
    return inter / union, 2 * inter / (sa + sb)


@dataclass(frozen=True)
class PairDecision:
    status: str                 # merged | disagreement | awaiting_check | unannotated
    agreement: float | None     # lowest per-class F1 between the first two annotations
    per_class: dict             # class -> {"iou", "f1"} between the first two annotations


def decide(masks: list[dict[str, np.ndarray]], min_agreement: float, require_check: bool) -> PairDecision:
    """``masks``: one {class: mask} per annotation, earliest first. One annotation is merged as it is
    (unless ``require_check``); with two or more, the first two are compared and the first is merged
    when they agree."""
    if not masks:
        return PairDecision("unannotated", None, {})
    if len(masks) == 1:
        return PairDecision("awaiting_check" if require_check else "merged", None, {})
    first, second = masks[0], masks[1]
    per_class = {}
    for name in first:
        iou, f1 = overlap(first[name], second[name])
        per_class[name] = {"iou": iou, "f1": f1}
    agreement = min(v["f1"] for v in per_class.values()) if per_class else 1.0
    return PairDecision("merged" if agreement >= min_agreement else "disagreement", agreement, per_class)
