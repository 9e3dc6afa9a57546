"""Label Studio annotation results -> one mask per class (brush RLE and polygons), and proposals ->
Label Studio prediction results."""
from __future__ import annotations

import uuid

import numpy as np

from operators.annotation.brush_rle import decode_mask, encode_mask
from operators.annotation.scheme import ChangeClass, control_name


def _class_of(item: dict) -> str | None:
    value = item.get("value") or {}
    names = value.get("brushlabels") or value.get("polygonlabels") or value.get("labels") or []
    return names[0] if names else None


def polygon_mask(points_pct: list, width: int, height: int) -> np.ndarray:
    """A polygon in Label Studio's percent coordinates (0-100 of the image's width and height, edges
    of the image at 0 and 100) on a ``height x width`` grid: a pixel is inside when its centre is
    (even-odd rule)."""
    mask = np.zeros((height, width), bool)
    pts = np.array([[x / 100.0 * width, y / 100.0 * height] for x, y in points_pct], np.float64)
    if len(pts) < 3:
        return mask
    x0, y0 = np.clip(np.floor(pts.min(axis=0)).astype(int), 0, [width, height])
    x1, y1 = np.clip(np.ceil(pts.max(axis=0)).astype(int), 0, [width, height])
    if x1 <= x0 or y1 <= y0:
        return mask
    py, px = np.mgrid[y0:y1, x0:x1] + 0.5
    inside = np.zeros(px.shape, bool)
    for (xa, ya), (xb, yb) in zip(pts, np.roll(pts, -1, axis=0)):
        if ya == yb:
            continue
        crosses = (ya > py) != (yb > py)
        inside ^= crosses & (px < (xb - xa) * (py - ya) / (yb - ya) + xa)
    mask[y0:y1, x0:x1] = inside
    return mask


def class_masks(result: list[dict], classes: list[ChangeClass], width: int, height: int) -> dict[str, np.ndarray]:
    """Per class the union of everything drawn for it (brush strokes and polygons) in one annotation's
    ``result``; a class nothing was drawn for is an empty mask (the annotator saw no change of it).
    Raises ValueError on a result whose size is not the image's or whose class is unknown."""
    known = {c.name for c in classes}
    out = {c.name: np.zeros((height, width), bool) for c in classes}
    for item in result or []:
        kind = str(item.get("type", "")).lower()
        if kind not in ("brushlabels", "polygonlabels"):
            continue
        name = _class_of(item)
        if name not in known:
            raise ValueError(f"a {kind} result of class {name!r}, which the scheme ({', '.join(sorted(known))}) does not have")
        w, h = int(item.get("original_width") or width), int(item.get("original_height") or height)
        if (w, h) != (width, height):
            raise ValueError(f"a {name} result drawn on a {w}x{h} image; the pair is {width}x{height}")
        value = item.get("value") or {}
        if kind == "brushlabels":
            rle = value.get("rle") if value.get("rle") is not None else item.get("rle")
            out[name] |= decode_mask(rle, width, height)
        else:
            out[name] |= polygon_mask(value.get("points") or [], width, height)
    return out


def brush_result(cls: ChangeClass, mask: np.ndarray) -> dict:
    """One brush result of ``cls`` holding ``mask``, as Label Studio stores it."""
    h, w = mask.shape
    return {"id": uuid.uuid4().hex[:10], "type": "brushlabels", "from_name": control_name(cls.image, "brush"),
            "to_name": cls.image, "original_width": int(w), "original_height": int(h), "image_rotation": 0,
            "value": {"format": "rle", "rle": encode_mask(mask), "brushlabels": [cls.name]}}
