"""Annotators' label maps: S2Looking keeps new buildings (``label1``) and demolished buildings
(``label2``) as two maps per slice and combines them into one change map. The paper does not
write the rule down; a pixel is changed when either map marks it (union), which is what its
single-map benchmark implies.

Layout accepted under ``--labels``: ``label1/<slice_id>.png`` and ``label2/<slice_id>.png``
(any non-zero pixel is a building; 0/1, 0/255, RGB or grey). Output: ``label/<slice_id>.png``,
0/255 single band, as LEVIR-CD loaders expect.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

LABEL_FOLDERS = ("label1", "label2")

LABELS_SCHEMA = pa.schema([
    ("slice_id", pa.string()), ("label_uri", pa.string()),
    ("new_pixels", pa.int64()), ("demolished_pixels", pa.int64()), ("changed_pixels", pa.int64()),
])


def binarize(label: np.ndarray) -> np.ndarray:
    """Any non-zero value in any channel is foreground (stray greys from resampling included)."""
    if label.ndim == 3:
        label = label.max(axis=2)
    return label > 0


def merge_label_maps(new_buildings: np.ndarray, demolished: np.ndarray,
                     expected_shape: tuple[int, int] | None = None) -> np.ndarray:
    """Union of the two maps as a 0/255 uint8 change map; raises ValueError on size mismatches."""
    a, b = binarize(new_buildings), binarize(demolished)
    if a.shape != b.shape:
        raise ValueError(f"label maps differ in size: label1 {a.shape[::-1]} vs label2 {b.shape[::-1]} (w x h)")
    if expected_shape is not None and a.shape != tuple(expected_shape):
        raise ValueError(f"label maps are {a.shape[1]}x{a.shape[0]} but the slice crop is "
                         f"{expected_shape[1]}x{expected_shape[0]}")
    return np.where(a | b, 255, 0).astype(np.uint8)
