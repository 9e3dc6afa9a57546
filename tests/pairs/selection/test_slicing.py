"""Slice windows: starts along an axis, windows on the pre grid, slice rows."""
from __future__ import annotations

import numpy as np

from operators.pairs.selection.slicing import axis_starts, intersection_window, slice_rows, slice_windows
from tests.pairs._scenes import scene


def test_axis_starts_cover_edges_flush():
    assert axis_starts(0, 3000, 3000, 1024) == [0]
    assert axis_starts(0, 5000, 3000, 1024) == [0, 1024, 2000]
    assert axis_starts(0, 5048, 3000, 1024) == [0, 1024, 2048]
    assert axis_starts(10, 2999, 3000, 1024) == []
    starts = axis_starts(0, 10000, 3000, 1024)
    assert starts[-1] + 3000 == 10000 and all(b - a <= 1024 for a, b in zip(starts, starts[1:]))


def test_windows_on_pre_grid_from_geographic_intersection():
    pre = scene("pre", bounds=(0, 0, 6000, 6000))
    post = scene("post", bounds=(500.4, -100, 6500, 5900), res=0.5)
    assert intersection_window(pre, post) == (501, 100, 6000, 6000)
    wins = slice_windows(pre, post, 3000, 1024)
    cols = sorted({w[0] for w in wins})
    rows = sorted({w[1] for w in wins})
    assert cols == [501, 1525, 2549, 3000] and rows == [100, 1124, 2148, 3000]
    assert all(c + 3000 <= 6000 and r + 3000 <= 6000 for c, r, _, _ in wins)


def test_slice_rows_carry_uris_and_windows_only():
    pre, post = scene("pre", bounds=(0, 0, 2000, 2000)), scene("post", "2022-01-01", bounds=(0, 0, 2000, 2000))
    pair = {"pair_id": "p1", "location": "x"}
    rows = slice_rows(pair, pre, post, 1000, 500, "train")
    assert len(rows) == 9 and rows[0]["slice_id"] == "p1_r00000_c00000"
    assert rows[-1]["window"] == [1000, 1000, 1000, 1000]
    assert not any(isinstance(v, np.ndarray) for r in rows for v in r.values())
