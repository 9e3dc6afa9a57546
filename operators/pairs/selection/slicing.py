"""Slicing: cut a pair's footprint intersection into ``slice_size`` windows at ``stride``.

The common grid is the *pre* (earlier) scene's pixel grid; the post scene is read onto it later by a
warped read. Windows are computed in that grid from the geographic intersection, so scenes on
slightly different grids (NAIP's origins differ by metres) still cut at the same places.

Edges: windows start at the intersection's first whole pixel and step by ``stride``; when the last
regular window stops short of the far edge, one more window is placed flush with that edge, so the
whole intersection is covered and no window reaches outside it. An intersection smaller than one
slice gives no slices (the pair is recorded with that reason).
"""
from __future__ import annotations

import math

from operators.pairs.selection.pairing import footprint


def axis_starts(begin: int, end: int, size: int, stride: int) -> list[int]:
    """Start offsets of windows of ``size`` covering [begin, end) at ``stride``, last one flush."""
    if end - begin < size:
        return []
    starts = list(range(begin, end - size + 1, stride))
    if starts[-1] + size < end:
        starts.append(end - size)
    return starts


def intersection_window(pre: dict, post: dict) -> tuple[int, int, int, int]:
    """(col0, row0, col1, row1) of the footprint intersection on the pre grid, whole pixels inside."""
    a = footprint(pre, pre["crs"])
    b = footprint(post, pre["crs"])
    left, bottom = max(a[0], b[0]), max(a[1], b[1])
    right, top = min(a[2], b[2]), min(a[3], b[3])
    if right <= left or top <= bottom:
        return 0, 0, 0, 0
    # The inverse affine by hand: affine.Affine's operators cost more than the rest of the plan.
    a, b, c, d, e, f = (float(v) for v in pre["transform"][:6])
    det = a * e - b * d
    corners = ((left, top), (right, bottom), (left, bottom), (right, top))
    xs = [(e * (x - c) - b * (y - f)) / det for x, y in corners]
    ys = [(a * (y - f) - d * (x - c)) / det for x, y in corners]
    eps = 1e-6  # float noise must not cost a whole pixel on exactly aligned grids
    col0, col1 = math.ceil(min(xs) - eps), math.floor(max(xs) + eps)
    row0, row1 = math.ceil(min(ys) - eps), math.floor(max(ys) + eps)
    col0, row0 = max(col0, 0), max(row0, 0)
    col1, row1 = min(col1, pre["width"]), min(row1, pre["height"])
    return col0, row0, max(col0, col1), max(row0, row1)


def slice_windows(pre: dict, post: dict, slice_size: int, stride: int) -> list[tuple[int, int, int, int]]:
    """[(col_off, row_off, width, height)] of every slice of the pair, row-major."""
    col0, row0, col1, row1 = intersection_window(pre, post)
    cols = axis_starts(col0, col1, slice_size, stride)
    rows = axis_starts(row0, row1, slice_size, stride)
    return [(c, r, slice_size, slice_size) for r in rows for c in cols]


def slice_rows(pair: dict, pre: dict, post: dict, slice_size: int, stride: int,
               split: str) -> list[dict]:
    """The slice rows the registration stage consumes (URIs and windows, never pixels)."""
    # What the pair's slices share is built once (a pair has tens of slices, an archive millions).
    shared = {
        "pair_id": pair["pair_id"], "location": pair["location"], "split": split,
        "pre_uri": pre["uri"], "post_uri": post["uri"],
        "pre_scene": pre["scene_id"], "post_scene": post["scene_id"],
        "pre_date": pre["acquired"], "post_date": post["acquired"],
        "crs": pre["crs"], "transform": list(pre["transform"]),
        "bands_pre": list(pre["rgb_bands"]), "bands_post": list(post["rgb_bands"]),
        "stretch_pre": [list(s) for s in pre["stretch"]],
        "stretch_post": [list(s) for s in post["stretch"]],
        # stacked scenes (STAC items, per-band products); None for plain rasters
        "pre_stack": pre.get("stack"), "post_stack": post.get("stack"),
        "pre_stac_id": pre.get("stac_id"), "post_stac_id": post.get("stac_id"),
    }
    return [{"slice_id": f"{pair['pair_id']}_r{row:05d}_c{col:05d}", **shared, "window": [col, row, w, h]}
            for col, row, w, h in slice_windows(pre, post, slice_size, stride)]
