"""The screen's windows: where they lie in the crop, what each measured, and which of them agree
(a displacement counts only when neighbouring windows share it)."""
from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from operators.pairs.registration.config import ScreeningConfig

# The screening settings' defaults, for the pure functions called without a config (one source: the
# settings themselves).
MIN_USABLE = ScreeningConfig.screen_min_usable        # usable fraction a window needs in both dates
AGREE_PX = ScreeningConfig.screen_agree_px            # neighbouring windows agree on a displacement within this
REGION_WINDOWS = ScreeningConfig.screen_region_windows   # windows a displacement above the limit needs


@dataclass
class WindowShift:
    x: float              # window centre in crop pixel coordinates
    y: float
    dx: float             # where the pre window's content sits in the post crop, minus where it should
    dy: float
    ncc: float
    row: int              # grid position
    col: int


def window_centre(start: int, win: int) -> float:
    """The centre of a ``win`` px window starting at pixel ``start`` (pixel centres at integers)."""
    return start + (win - 1) / 2


def window_origin(s: "WindowShift", win: int) -> tuple[int, int]:
    """The first pixel (x, y) of the ``win`` px window centred at (``s.x``, ``s.y``): the inverse
    of :func:`window_centre`."""
    return int(round(s.x - (win - 1) / 2)), int(round(s.y - (win - 1) / 2))


def window_starts(size: int, window: int) -> list[int]:
    """Window starts along a side at half-window steps, the last flush with the far edge."""
    if window > size:
        return []
    step = max(1, window // 2)
    starts = list(range(0, size - window + 1, step))
    if starts[-1] != size - window:
        starts.append(size - window)
    return starts


def quadrants_reached(shifts: list[WindowShift], w: int, h: int) -> int:
    """Quadrants of a ``w`` x ``h`` crop (of 4) holding a window's centre: a scale or rotation
    error grows towards a far corner, and a quadrant no window reaches leaves its corner unseen.
    The screen and the rescue both count them here (the hull's share of the crop, beside it,
    says how far the evidence spreads; the quadrants, which corners it reaches)."""
    return len({(s.x >= w / 2, s.y >= h / 2) for s in shifts})


def supported(shifts: list[WindowShift], agree_px: float = AGREE_PX) -> list[WindowShift]:
    """Windows whose displacement an adjacent, non-overlapping window agrees with (within
    ``AGREE_PX``): two grid steps away, so the two share no pixels.

    One window alone may have latched onto a repeated texture or a change (and its overlapping
    neighbours share half its pixels, so they would agree for the same reason); a region of the
    crop moving as a whole shows in independent windows alike.
    """
    if not shifts:
        return []
    rows = np.array([s.row for s in shifts]) + 2
    cols = np.array([s.col for s in shifts]) + 2
    # The window grid with a 2-window margin of NaN, so every neighbour lookup stays inside it.
    grid = np.full((rows.max() + 3, cols.max() + 3, 2), np.nan)
    d = np.array([[s.dx, s.dy] for s in shifts])
    grid[rows, cols] = d
    ok = np.zeros(len(shifts), bool)
    for dr in (-2, -1, 0, 1, 2):
        for dc in (-2, -1, 0, 1, 2):
            if max(abs(dr), abs(dc)) == 2:
                other = grid[rows + dr, cols + dc]
                with np.errstate(invalid="ignore"):
                    ok |= np.hypot(*(other - d).T) <= agree_px     # NaN (no window): False
    return [s for s, keep in zip(shifts, ok) if keep]


def window_stats(img: np.ndarray, valid: np.ndarray, ys: list[int], xs: list[int],
                 win: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(usable pixel count, mean, std over usable pixels) of every window, by integral images
    (sum and sum of squares in one pass, in float64; a fully valid crop needs no count image)."""
    y0, x0 = np.asarray(ys)[:, None], np.asarray(xs)[None, :]

    def box(ii):
        return ii[y0 + win, x0 + win] - ii[y0, x0 + win] - ii[y0 + win, x0] + ii[y0, x0]

    full = bool(np.all(valid))
    x = img if full else img.astype(np.float64) * valid
    s_i, q_i = cv2.integral2(np.ascontiguousarray(x), sdepth=cv2.CV_64F, sqdepth=cv2.CV_64F)
    n = np.full((len(ys), len(xs)), float(win * win)) if full else \
        box(cv2.integral(valid.astype(np.float64)))
    safe = np.maximum(n, 1.0)
    mean = box(s_i) / safe
    var = np.maximum(box(q_i) / safe - mean * mean, 0.0)
    return n, mean, np.sqrt(var)


def displaced_groups(big: list[WindowShift], agree_px: float = AGREE_PX) -> list[list[WindowShift]]:
    """``big`` split into groups: windows within two grid steps of each other agreeing within
    ``agree_px``, joined transitively."""
    parent = list(range(len(big)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, a in enumerate(big):
        for j in range(i + 1, len(big)):
            b = big[j]
            if max(abs(a.row - b.row), abs(a.col - b.col)) <= 2 and \
                    np.hypot(a.dx - b.dx, a.dy - b.dy) <= agree_px:
                parent[root(i)] = root(j)
    groups: dict[int, list[WindowShift]] = {}
    for i, s in enumerate(big):
        groups.setdefault(root(i), []).append(s)
    return list(groups.values())


def confirmed(shifts: list[WindowShift], limit: float, agree_px: float = AGREE_PX,
              region_windows: int = REGION_WINDOWS) -> list[WindowShift]:
    """``shifts`` without displacements above ``limit`` that fewer than ``REGION_WINDOWS`` windows
    share (:func:`displaced_groups`)."""
    big = [s for s in shifts if np.hypot(s.dx, s.dy) > limit]
    lone = {id(s) for g in displaced_groups(big, agree_px) if len(g) < region_windows for s in g}
    return [s for s in shifts if id(s) not in lone]
