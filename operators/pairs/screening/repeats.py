"""Repeated texture (an orchard, a solar farm, a parking lot) in screening.

Inside repeated texture a shift by whole periods matches as well as none, so its windows cannot
measure a displacement. The region's *outline* can: where the texture repeats is a shape (not
periodic itself), and that shape moves with the region. So each region of repeated windows is
delineated in both dates by where the image matches itself one period away (a per-pixel
periodicity map), and the two outlines are aligned: the region stayed, moved (by how much), or
cannot be told (the outline is hidden, or the texture fills the crop).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cv2
import numpy as np

# Windows under this side hold too few pixels for the repeated-texture test: natural texture in
# 16-24 px windows matches itself at 0.8 somewhere near by chance (real NAIP crops were lost).
REPEAT_MIN_WINDOW = 64
REPEAT_TWIN_SLACK = 0.1   # a rival's twin one period the other way may match this much less
# A pixel repeats when its neighbourhood's squared difference with the image one period away is
# under this share of their variance (0: identical; unrelated texture: about 1).
PERIODIC_RATIO = 0.3
# Outline alignment, in the share of the region's pixels on which the two outlines disagree: one
# side of the limit wins when its best offset disagrees on at most OUTLINE_RATIO of the other
# side's best, and by OUTLINE_FLOOR at least. Relative, because at the limit the two sides' best
# offsets are 1 px apart (8 and 9 px): a 1 px strip of the outline, a fraction of a percent of a
# large region, against a floor of mask noise that varies with the texture.
OUTLINE_RATIO = 0.7
OUTLINE_FLOOR = 0.002
REFINE_PIXELS = 20000     # pixels a period is refined on
# An outline is read to about a pixel: where the texture's phase meets its edge, the edge shows
# up to a pixel off (an orchard of period 22 px moved 9 px aligned best at 8 px, 0.0057 against
# 0.011). A best offset within this of the limit cannot say which side it is on.
OUTLINE_PRECISION_PX = 1.0
OUTLINE_SCALE = 2         # outlines are aligned at half resolution (a 2 px step; they are blurred)


def repeat_period(pre: np.ndarray, x: int, y: int, win: int, reach: int,
                  ncc: float) -> Optional[tuple[int, int]]:
    """The period (dx, dy) of the pre window at (x, y), when its texture repeats: the nearest
    place within ``reach`` px, apart from its own peak, where the window matches its surroundings
    as well as ``ncc`` and whose twin the other way matches too (a period repeats both ways;
    smooth texture enlarged 4.5x can hold a lone second match). None when nothing repeats. At half
    resolution for windows of 64 px and more (periods of 8 px and up stay resolved), so the period
    is known to 2 px there (:func:`refine_period`)."""
    h, w = pre.shape
    sx0, sy0 = max(0, x - reach), max(0, y - reach)
    sx1, sy1 = min(w, x + win + reach), min(h, y + win + reach)
    region = pre[sy0:sy1, sx0:sx1]
    tmpl = pre[y:y + win, x:x + win]
    f = 2 if win >= 64 else 1
    if f == 2:
        region = cv2.resize(region, (region.shape[1] // 2, region.shape[0] // 2),
                            interpolation=cv2.INTER_AREA)
        tmpl = cv2.resize(tmpl, (win // 2, win // 2), interpolation=cv2.INTER_AREA)
    surface = cv2.matchTemplate(region, tmpl, cv2.TM_CCOEFF_NORMED)
    cv2.patchNaNs(surface, -1.0)
    high = (surface >= ncc).astype(np.uint8)
    n, labels = cv2.connectedComponents(high, connectivity=8)
    if n <= 2:               # background + the window's own peak: nothing else matches
        return None
    sh, sw = surface.shape
    # The window lies inside the region, so its own place is a cell of the surface at either
    # scale (floor(a/2) + floor(b/2) <= floor((a+b)/2)): no clamp needed.
    cx, cy = (x - sx0) // f, (y - sy0) // f
    own = labels[cy, cx]
    best: Optional[tuple[int, int]] = None
    for k in range(1, n):
        if k == own:
            continue
        py, px = np.unravel_index(int(np.argmax(np.where(labels == k, surface, -2.0))),
                                  surface.shape)
        ty, tx = 2 * cy - py, 2 * cx - px
        if 0 <= ty < sh and 0 <= tx < sw and surface[ty, tx] >= ncc - REPEAT_TWIN_SLACK:
            t = (int(px - cx) * f, int(py - cy) * f)
            if best is None or np.hypot(*t) < np.hypot(*best):
                best = t
    return None if best is None else canonical(best)


def repeats_itself(pre: np.ndarray, x: int, y: int, win: int, reach: int, ncc: float) -> bool:
    """Whether the pre window at (x, y) is repeated texture (:func:`repeat_period`)."""
    return repeat_period(pre, x, y, win, reach, ncc) is not None


def canonical(t: tuple[int, int]) -> tuple[int, int]:
    """One of a period's two signs (+t and -t are the same period): dy > 0, or dy = 0 and dx > 0."""
    tx, ty = int(t[0]), int(t[1])
    return (tx, ty) if (ty > 0 or (ty == 0 and tx > 0)) else (-tx, -ty)


def repeated_groups(cells: dict | set) -> list[list[tuple[int, int]]]:
    """Grid-adjacent groups (8-connected) of the window cells ``cells``, largest first."""
    left, groups = set(cells), []
    while left:
        stack, group = [left.pop()], []
        while stack:
            i, j = stack.pop()
            group.append((i, j))
            for di in (-1, 0, 1):
                for dj in (-1, 0, 1):
                    if (i + di, j + dj) in left:
                        left.discard((i + di, j + dj))
                        stack.append((i + di, j + dj))
        groups.append(sorted(group))
    return sorted(groups, key=len, reverse=True)


def _shifted(a: np.ndarray, tx: int, ty: int, fill) -> np.ndarray:
    """``a`` read one period on: out[y, x] = a[y + ty, x + tx] (``fill`` beyond the edge)."""
    h, w = a.shape
    out = np.full_like(a, fill)
    ys, yd = slice(max(0, ty), h + min(0, ty)), slice(max(0, -ty), h + min(0, -ty))
    xs, xd = slice(max(0, tx), w + min(0, tx)), slice(max(0, -tx), w + min(0, -tx))
    out[yd, xd] = a[ys, xs]
    return out


def periodic_mask(img: np.ndarray, valid: np.ndarray, period: tuple[int, int]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(repeats, known): where ``img`` matches itself one ``period`` away (over a box of about a
    period, opened by it so specks of matching ground drop out), and where that is known (both
    places valid and inside the image)."""
    tx, ty = int(period[0]), int(period[1])
    k = max(9, int(np.hypot(tx, ty)) | 1)
    a = img.astype(np.float32)
    b = _shifted(a, tx, ty, np.float32(0))
    known = valid & _shifted(valid, tx, ty, False)
    ma, mb = cv2.blur(a, (k, k)), cv2.blur(b, (k, k))
    var = cv2.blur((a - ma) ** 2, (k, k)) + cv2.blur((b - mb) ** 2, (k, k))
    ratio = cv2.blur((a - b) ** 2, (k, k)) / (var + 1e-4)
    m = ((ratio < PERIODIC_RATIO) & known).astype(np.uint8)
    m = cv2.morphologyEx(m, cv2.MORPH_OPEN, cv2.getStructuringElement(cv2.MORPH_RECT, (k, k)))
    return m > 0, known


# The steps refine_period tries, nearest first: of periods that fit equally (stripes repeat along
# themselves), the one nearest the period found is kept.
REFINE_STEPS = sorted(((ddx, ddy) for ddy in range(-2, 3) for ddx in range(-2, 3)),
                      key=lambda d: d[0] * d[0] + d[1] * d[1])


def refine_period(img: np.ndarray, seeds: np.ndarray, period: tuple[int, int]) -> tuple[int, int]:
    """The period to the pixel: of ``period`` and its neighbours within 2 px, the one whose
    squared difference over the ``seeds`` pixels is least, the nearest of equals (a
    half-resolution period is known to 2 px, and a periodicity map one pixel off does not
    repeat)."""
    ys, xs = np.nonzero(seeds)
    if ys.size > REFINE_PIXELS:   # a fixed random subset: a regular grid aliases with the period
        pick = np.random.default_rng(0).choice(ys.size, REFINE_PIXELS, replace=False)
        ys, xs = ys[pick], xs[pick]
    h, w = img.shape
    best = (np.inf, canonical(period))
    for ddx, ddy in REFINE_STEPS:
        tx, ty = period[0] + ddx, period[1] + ddy
        if (tx, ty) == (0, 0):
            continue
        yb, xb = ys + ty, xs + tx
        ok = (yb >= 0) & (yb < h) & (xb >= 0) & (xb < w)
        if not ok.any():
            continue
        e = float(np.mean((img[ys[ok], xs[ok]] - img[yb[ok], xb[ok]]) ** 2))
        if e < best[0]:
            best = (e, canonical((tx, ty)))
    return best[1]


def _touching(mask: np.ndarray, seeds: np.ndarray, min_area: int) -> np.ndarray:
    """The connected parts of ``mask`` that touch ``seeds`` and hold ``min_area`` pixels."""
    n, lab, stats, _ = cv2.connectedComponentsWithStats(mask.astype(np.uint8), connectivity=8)
    keep = np.zeros(n, bool)
    for c in np.unique(lab[seeds & mask]):
        if c and stats[c, cv2.CC_STAT_AREA] >= min_area:
            keep[c] = True
    return keep[lab]


@dataclass(frozen=True)
class RegionShift:
    """How a region of repeated texture moved between the dates, read from its outline."""
    verdict: str                    # STAYED, MOVED, UNKNOWN or NONE
    dx: float = 0.0                 # the outline's best offset (post minus pre), px
    dy: float = 0.0
    within: float = 1.0             # least outline disagreement at offsets within the limit
    beyond: float = 1.0             # least at offsets beyond it
    x: float = 0.0                  # the region's centre in the crop
    y: float = 0.0
    period: tuple = (0, 0)

    @property
    def px(self) -> float:
        return float(np.hypot(self.dx, self.dy))


STAYED, MOVED, UNKNOWN = "stayed", "moved", "unknown"
NONE = "no outline"   # no region of repeating pixels holds the windows (texture repeating by chance)


def coarse_outline(v: np.ndarray) -> np.ndarray:
    """An outline (or its known pixels) at the scale outlines are aligned at
    (:data:`OUTLINE_SCALE`), area-averaged: fractional along its edges."""
    f = OUTLINE_SCALE
    return cv2.resize(v, (v.shape[1] // f, v.shape[0] // f), interpolation=cv2.INTER_AREA)


def outline_disagreement(a: np.ndarray, ka: np.ndarray, b: np.ndarray, kb: np.ndarray
                         ) -> np.ndarray:
    """For every offset of ``a`` (template, with its known pixels ``ka``) over ``b`` (with
    ``kb``): the pixels where the two disagree, among those known in both, as a share of a's
    region seen there (inf where under half of it is: an offset that pushes the region out of
    sight cannot win by hiding it). Sums by correlation:
    sum ka kb (a - b)^2 = sum (ka a^2) kb + ka (kb b^2) - 2 (ka a)(kb b)."""
    a, ka, b, kb = (np.ascontiguousarray(v, np.float32) for v in (a, ka, b, kb))
    corr = lambda img, tm: cv2.matchTemplate(img, tm, cv2.TM_CCORR)  # noqa: E731
    sq = corr(kb, ka * a * a) + corr(kb * b * b, ka) - 2.0 * corr(kb * b, ka * a)
    seen = corr(kb, ka * a)
    out = np.maximum(sq, 0.0) / np.maximum(seen, 1.0)
    out[seen < 0.5 * float((ka * a).sum()) - 1e-3] = np.inf    # sums by FFT: round-off
    return out


def _beats(x: float, y: float) -> bool:
    """Disagreement ``x`` clearly under ``y`` (:data:`OUTLINE_RATIO`, :data:`OUTLINE_FLOOR`)."""
    return bool(np.isfinite(x) and x <= OUTLINE_RATIO * y and x + OUTLINE_FLOOR <= y)


def disagreement_at(a: np.ndarray, ka: np.ndarray, b: np.ndarray, kb: np.ndarray,
                    ox: int, oy: int) -> float:
    """:func:`outline_disagreement` at one offset (``a`` over ``b`` at column ``ox``, row ``oy``)."""
    h, w = a.shape
    bb, kk = b[oy:oy + h, ox:ox + w], kb[oy:oy + h, ox:ox + w]
    if bb.shape != a.shape:
        return float("inf")
    both = ka * kk
    seen = float((both * a).sum())
    if seen < 0.5 * float((ka * a).sum()) - 1e-3:
        return float("inf")
    return float((both * (a - bb) ** 2).sum()) / max(seen, 1.0)


def window_centres(group: list[tuple[int, int]], ys: list[int], xs: list[int], win: int,
                   shape: tuple[int, int]) -> np.ndarray:
    """The central half (each way) of every window of ``group``: where a region's windows are
    surely on it (their edges may hold the ground around it)."""
    seeds = np.zeros(shape, bool)
    q = win // 4
    for i, j in group:
        seeds[ys[i] + q:ys[i] + win - q, xs[j] + q:xs[j] + win - q] = True
    return seeds


def reach_box(seeds: np.ndarray, reach: int) -> np.ndarray:
    """The seeds' bounding box grown by ``reach`` px each way (within the crop): where the post
    date's outline of a region the seeds lie on can be, if it moved at most ``reach`` px."""
    box = np.zeros_like(seeds, dtype=bool)
    sy, sx = np.nonzero(seeds)
    box[max(0, sy.min() - reach):sy.max() + reach + 1,
        max(0, sx.min() - reach):sx.max() + reach + 1] = True
    return box


def region_shift(pre: np.ndarray, post: np.ndarray, valid: np.ndarray,
                 group: list[tuple[int, int]], periods: dict, ys: list[int], xs: list[int],
                 win: int, reach: int, limit: float) -> RegionShift:
    """How the region of repeated windows ``group`` moved: its outline in the pre date (where
    the texture repeats, the part that holds the windows' centres) aligned with the post date's
    within ``reach`` px. STAYED when the best offset within ``limit`` clearly beats every offset
    beyond it (``OUTLINE_RATIO``, ``OUTLINE_FLOOR``), MOVED when one beyond clearly beats every
    one within, else UNKNOWN (an outline hidden by cloud or the crop's edge, or texture
    everywhere). NONE when no region of repeating pixels holds the windows in either date."""
    h, w = pre.shape
    seeds = window_centres(group, ys, xs, win, (h, w))
    cy = float(np.mean([ys[i] for i, _ in group])) + (win - 1) / 2
    cx = float(np.mean([xs[j] for _, j in group])) + (win - 1) / 2
    votes = [periods[c] for c in group]
    period = refine_period(pre, seeds, max(set(votes), key=votes.count))
    rep_pre, ka_full = periodic_mask(pre, valid, period)
    rep_post, kb_full = periodic_mask(post, valid, period)
    least = (win // 2) ** 2
    a_full = _touching(rep_pre, seeds, least)
    b_full = _touching(rep_post, reach_box(seeds, reach), least)
    if not a_full.any() or not b_full.any():
        return RegionShift(NONE, x=cx, y=cy, period=period)
    yy, xx = np.nonzero(a_full)
    pad = 16
    y0, y1 = max(0, int(yy.min()) - pad), min(h, int(yy.max()) + pad + 1)
    x0, x1 = max(0, int(xx.min()) - pad), min(w, int(xx.max()) + pad + 1)
    r = reach
    # The post date beyond the crop is unknown, not empty: padded with known = 0.
    b = np.pad(b_full.astype(np.float32), r)[y0:y1 + 2 * r, x0:x1 + 2 * r]
    kb = np.pad(kb_full.astype(np.float32), r)[y0:y1 + 2 * r, x0:x1 + 2 * r]
    a = a_full[y0:y1, x0:x1].astype(np.float32)
    ka = ka_full[y0:y1, x0:x1].astype(np.float32)
    # Coarse at half resolution over the whole reach, then each side's best to the pixel.
    f = OUTLINE_SCALE
    coarse = outline_disagreement(
        coarse_outline(a), (coarse_outline(ka) > 0.999).astype(np.float32),
        coarse_outline(b), (coarse_outline(kb) > 0.999).astype(np.float32))
    c = r // f
    gy, gx = np.mgrid[0:coarse.shape[0], 0:coarse.shape[1]]
    dist = np.hypot(gy - c, gx - c) * f
    # Each side's best to the pixel, around both sides' coarse bests: the true offset lies within
    # a coarse step of the best coarse offset of either side, and when that is the other side's
    # (a move of 9 px whose coarse best is 8 px, inside the limit) the pixels next to it across
    # the limit are this side's candidates (the coarse best beyond, at (2, 8), had missed (0, 9)).
    centres = []
    for inside in (True, False):
        masked = np.where((dist <= limit) == inside, coarse, np.inf)
        iy, ix = np.unravel_index(int(np.argmin(masked)), masked.shape)
        if np.isfinite(masked[iy, ix]):
            centres.append(((iy - c) * f, (ix - c) * f))     # the coarse best, in full pixels
    candidates = {(ox, oy) for cy_, cx_ in centres
                  for oy in range(cy_ - f + 1, cy_ + f) for ox in range(cx_ - f + 1, cx_ + f)}
    sides = []
    for inside in (True, False):
        best = (np.inf, 0, 0)
        for ox, oy in sorted(candidates):
            if (np.hypot(ox, oy) <= limit) == inside:
                best = min(best, (disagreement_at(a, ka, b, kb, ox + r, oy + r), ox, oy))
        sides.append(best)
    (within, wx, wy), (beyond, bx, by) = sides
    dx, dy = (wx, wy) if within <= beyond else (bx, by)
    verdict = STAYED if _beats(within, beyond) else MOVED if _beats(beyond, within) else UNKNOWN
    if verdict == STAYED and np.hypot(wx, wy) > limit - OUTLINE_PRECISION_PX:
        verdict = UNKNOWN      # at the limit, to the outline's precision: either side
    return RegionShift(verdict, float(dx), float(dy), within, beyond, cx, cy, period)
