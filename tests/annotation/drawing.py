"""Test equipment: masks of known shapes and the Label Studio brush results that carry them."""
from __future__ import annotations

import numpy as np

from operators.annotation.brush_rle import encode_mask


def rect(shape: tuple[int, int], y0: int, y1: int, x0: int, x1: int) -> np.ndarray:
    m = np.zeros(shape, bool)
    m[y0:y1, x0:x1] = True
    return m


def brush(name: str, image: str, mask: np.ndarray) -> dict:
    """A brush result of class ``name`` on ``image`` (pre | post), as Label Studio stores it."""
    h, w = mask.shape
    return {"type": "brushlabels", "from_name": f"{image}_brush", "to_name": image, "original_width": w,
            "original_height": h, "value": {"format": "rle", "rle": encode_mask(mask), "brushlabels": [name]}}
