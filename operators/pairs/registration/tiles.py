"""Tile geometry on a pair's common grid: feature tiles anchored at the grid origin, windows
around them and the points that fall in a window. Pure integer/numpy helpers shared by the
regional graph and the guided-matching prior.

Windows are (col_off, row_off, width, height) in common-grid pixels; point coordinates are pixel
centres at integers.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def tile_core(tile_col: int, tile_row: int, tile_size: int) -> tuple[int, int, int, int]:
    """Core window (col_off, row_off, width, height) of tile (tile_col, tile_row)."""
    return tile_col * tile_size, tile_row * tile_size, tile_size, tile_size


def tiles_for_window(window: Sequence[int], tile_size: int) -> list[tuple[int, int]]:
    """(tile_col, tile_row) of every tile whose core intersects ``window``."""
    col, row, width, height = (int(v) for v in window)
    c0, c1 = col // tile_size, (col + width - 1) // tile_size
    r0, r1 = row // tile_size, (row + height - 1) // tile_size
    return [(tc, tr) for tr in range(r0, r1 + 1) for tc in range(c0, c1 + 1)]


def grow(window: Sequence[int], margin: int) -> tuple[int, int, int, int]:
    """``window`` widened by ``margin`` pixels on every side."""
    col, row, width, height = (int(v) for v in window)
    return col - margin, row - margin, width + 2 * margin, height + 2 * margin


def inside(xy: np.ndarray, window: Sequence[int]) -> np.ndarray:
    """Points (pixel-centre coordinates) that fall in a pixel of ``window``."""
    col, row, width, height = window
    x, y = xy[:, 0], xy[:, 1]
    return (x >= col - 0.5) & (x < col + width - 0.5) & (y >= row - 0.5) & (y < row + height - 0.5)
