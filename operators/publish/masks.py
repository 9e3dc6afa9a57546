"""Change-mask encodings of a release (numpy in, numpy out).

* ``label``: single channel, 0 = no change, 255 = change (LEVIR-CD, open-cd and torchgeo read this).
* ``label1`` / ``label2`` / ...: one 0/255 map per class of the dataset's scheme (``label_classes.json``);
  without a scheme, S2Looking's two maps, new buildings (label1) and demolished buildings (label2).
* ``label_index``: one single-channel index mask, 0 = no change, *i* = class *i* in the scheme's order
  (S2Looking: 1 = new, 2 = demolished). A pixel several maps mark takes the first of them (S2Looking:
  the post-date state is a building); such pixels are counted (``overlap_pixels``) and stay visible in
  the per-class maps.
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


def index_mask(*maps: np.ndarray, names: tuple[str, ...] = ()) -> np.ndarray:
    """0/1/.../N index mask from the per-class maps in scheme order (see the module docstring for overlaps).
    ``names``: the maps' folders, for the error message."""
    masks = [binarize(m) for m in maps]
    names = names or tuple(f"label{i + 1}" for i in range(len(masks)))
    for name, m in zip(names[1:], masks[1:]):
        if m.shape != masks[0].shape:
            raise ValueError(f"{names[0]} is {masks[0].shape[1]}x{masks[0].shape[0]} but {name} is {m.shape[1]}x{m.shape[0]}")
    out = np.zeros(masks[0].shape, np.uint8)
    for i in range(len(masks), 0, -1):     # the first class is written last: it wins where maps overlap
        out[masks[i - 1]] = i
    return out


def mask_stats(mask: np.ndarray, per_class: dict[str, np.ndarray] | None = None) -> dict:
    """Changed pixels and CAR (changed / all pixels) of a 0/255 mask; per-class pixel counts
    (``class_pixels``) and pixels marked by more than one class when the per-class maps exist."""
    changed = int((mask > 0).sum())
    out = {"changed_pixels": changed, "car": changed / mask.size if mask.size else 0.0}
    if per_class:
        binary = {name: binarize(m) for name, m in per_class.items()}
        out["class_pixels"] = {name: int(m.sum()) for name, m in binary.items()}
        out["overlap_pixels"] = int((np.sum(list(binary.values()), axis=0) > 1).sum())
    return out
