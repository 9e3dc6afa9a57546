"""Change-mask encodings of a release (numpy in, numpy out).

* ``label``: single channel, 0 = no change, 255 = change (LEVIR-CD, open-cd and torchgeo read this).
* ``label1`` / ``label2``: S2Looking's two maps, new buildings and demolished buildings, 0/255 each.
* ``label_index``: one single-channel index mask, 0 = no change, 1 = new building (label1),
  2 = demolished building (label2). A pixel both maps mark is 1 (the post-date state is a building);
  such pixels are counted (``overlap_pixels``) and stay visible in label1 / label2.
"""
from __future__ import annotations

import numpy as np

from operators.pairs.labels.labels import binarize

CHANGED = 255
INDEX_CLASSES = {0: "no change", 1: "new building", 2: "demolished building"}


def binary_mask(label: np.ndarray) -> np.ndarray:
    """Any non-zero value in any channel -> 255, else 0 (uint8, single channel)."""
    return np.where(binarize(label), CHANGED, 0).astype(np.uint8)


def is_binary_encoded(label: np.ndarray) -> bool:
    """True when ``label`` is already a single-channel uint8 0/255 mask (its file can be copied as is)."""
    if label.ndim != 2 or label.dtype != np.uint8:
        return False
    return bool(np.isin(np.unique(label), (0, CHANGED)).all())


def index_mask(new: np.ndarray, demolished: np.ndarray) -> np.ndarray:
    """0/1/2 index mask from the two S2Looking maps (see the module docstring for overlaps)."""
    a, b = binarize(new), binarize(demolished)
    if a.shape != b.shape:
        raise ValueError(f"label1 is {a.shape[1]}x{a.shape[0]} but label2 is {b.shape[1]}x{b.shape[0]}")
    out = np.zeros(a.shape, np.uint8)
    out[b] = 2
    out[a] = 1
    return out


def mask_stats(mask: np.ndarray, new: np.ndarray | None = None, demolished: np.ndarray | None = None) -> dict:
    """Changed pixels and CAR (changed / all pixels) of a 0/255 mask; per-class counts when the two maps exist."""
    changed = int((mask > 0).sum())
    out = {"changed_pixels": changed, "car": changed / mask.size if mask.size else 0.0}
    if new is not None and demolished is not None:
        a, b = binarize(new), binarize(demolished)
        out.update(new_pixels=int(a.sum()), demolished_pixels=int(b.sum()), overlap_pixels=int((a & b).sum()))
    return out
