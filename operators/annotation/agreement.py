"""How far two drawings of a pair agree (the comparison of rule 4 of :mod:`operators.annotation.decisions`):
per class plain IoU and F1, and the tolerant F1 the decision reads (a boundary a pixel or two apart
matches; a class one side drew in fewer than the noise floor's pixels counts as not drawn); the pair's
agreement is its lowest class's.
"""
from __future__ import annotations

import numpy as np


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
