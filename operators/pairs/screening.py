"""Screening of a registered crop pair (S2Looking step 5), independent of the SIFT fit.

The paper screens out a slice whose misregistration exceeds 8 px *anywhere*. The check here uses
the pixels themselves (pre crop vs registered post crop), not the matches the homography came from:

* The whole crop is tiled by windows of at most 1/8 of its side, at half-window steps, flush with
  its edges (so a strip or a patch of that scale cannot fall between windows).
* Each window that is valid and textured in both dates is matched by normalised cross-correlation
  (pre window as template in the post crop), first within ``2 x max_residual_px`` of where it
  should be, then, if that gives no confident peak, within ``screen_search_px``, so a region
  displaced by tens of pixels is found rather than just failing to correlate. A peak is trusted
  when its correlation reaches ``screen_min_ncc`` and it stands out from the rest of the search area.
* ``residual_px`` is the largest displacement anywhere in the crop: the largest trusted window
  displacement, and the displacement at the crop's four corners extrapolated from an affine field
  fitted to the windows (window centres sit half a window inside the corners, where a rotation's
  error is largest).
* Only displacements a neighbouring window agrees with count (one window alone may have latched
  onto a repeated texture or a change); that is what "confidently measured" means below.
* Rejections: a displaced region above ``max_residual_px``, a corner above it, or too little of
  the textured area measured ("insufficient evidence", with the fraction): nothing passes
  unchecked.

``invalid`` pixels (nodata, and clouds once a mask is given) are kept out: a window counts only
when at least 90 % of it is usable, and unusable pixels are set to the window mean.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import cv2
import numpy as np

from operators.pairs.registration import RegistrationConfig

MIN_USABLE = 0.9          # usable fraction a window needs in both dates
PEAK_MARGIN = 0.1         # a trusted peak beats the best one away from it by this much NCC
AGREE_PX = 2.0            # neighbouring windows agree on a displacement within this

@dataclass
class WindowShift:
    x: float              # window centre in crop pixel coordinates
    y: float
    dx: float             # where the pre window's content sits in the post crop, minus where it should
    dy: float
    ncc: float
    row: int              # grid position
    col: int

@dataclass
class ScreeningResult:
    residual_px: Optional[float]          # largest displacement anywhere in the crop (None: unknown)
    residual_median_px: Optional[float]
    n_windows: int                        # textured windows (both dates)
    n_confident: int                      # windows whose displacement was trusted
    reject_reason: Optional[str] = None
    assessed_fraction: float = 0.0        # n_confident / n_windows
    shifts: list = field(default_factory=list)  # WindowShift per trusted window, for diagnostics

def window_starts(size: int, window: int) -> list[int]:
    """Window starts along a side at half-window steps, the last flush with the far edge."""
    if window > size:
        return []
    step = max(1, window // 2)
    starts = list(range(0, size - window + 1, step))
    if starts[-1] != size - window:
        starts.append(size - window)
    return starts

def _subpixel(surface: np.ndarray, y: int, x: int) -> tuple[float, float]:
    """Parabolic refinement of a peak at (y, x) of a correlation surface."""
    def vertex(m, c, p):
        d = m - 2 * c + p
        return 0.0 if abs(d) < 1e-12 else float(np.clip(0.5 * (m - p) / d, -0.5, 0.5))
    h, w = surface.shape
    fx = vertex(surface[y, x - 1], surface[y, x], surface[y, x + 1]) if 0 < x < w - 1 else 0.0
    fy = vertex(surface[y - 1, x], surface[y, x], surface[y + 1, x]) if 0 < y < h - 1 else 0.0
    return x + fx, y + fy

def match_window(template: np.ndarray, post: np.ndarray, x0: int, y0: int, radius: int,
                 min_ncc: float) -> Optional[tuple[float, float, float]]:
    """Find ``template`` (taken at (x0, y0) of the pre crop) in ``post`` within ``radius`` px.

    Returns (dx, dy, ncc) of a trusted peak, else None. A peak is trusted when its NCC reaches
    ``min_ncc``, it is not on the edge of the search area (the true match may lie beyond), and the
    best NCC farther than a quarter window from it is at least ``PEAK_MARGIN`` lower.
    """
    win = template.shape[0]
    h, w = post.shape
    sx0, sy0 = max(0, x0 - radius), max(0, y0 - radius)
    sx1, sy1 = min(w, x0 + win + radius), min(h, y0 + win + radius)
    region = post[sy0:sy1, sx0:sx1]
    if region.shape[0] < win or region.shape[1] < win:
        return None
    surface = cv2.matchTemplate(region, template, cv2.TM_CCOEFF_NORMED)
    surface = np.nan_to_num(surface, nan=-1.0)
    _, peak, _, (px, py) = cv2.minMaxLoc(surface)
    if peak < min_ncc:
        return None
    sh, sw = surface.shape
    # On the search area's edge the peak may be cut off; unless that edge is the crop's edge.
    if (px == 0 and sx0 > 0) or (py == 0 and sy0 > 0) or \
            (px == sw - 1 and sx1 < w) or (py == sh - 1 and sy1 < h):
        return None
    guard = max(2, win // 4)
    rest = surface.copy()
    rest[max(0, py - guard):py + guard + 1, max(0, px - guard):px + guard + 1] = -1.0
    if rest.size and rest.max() > peak - PEAK_MARGIN:
        return None
    fx, fy = _subpixel(surface, py, px)
    return sx0 + fx - x0, sy0 + fy - y0, float(peak)

def affine_field(shifts: list[WindowShift]) -> Optional[np.ndarray]:
    """(3, 2) least-squares affine displacement field d(x, y) = [1, x, y] @ A over the windows,
    refitted once without windows more than 2 px off; None with fewer than 6 windows."""
    if len(shifts) < 6:
        return None
    X = np.array([[1.0, s.x, s.y] for s in shifts])
    D = np.array([[s.dx, s.dy] for s in shifts])
    keep = np.ones(len(shifts), bool)
    for _ in range(2):
        if keep.sum() < 6:
            return None
        A, *_ = np.linalg.lstsq(X[keep], D[keep], rcond=None)
        keep = np.hypot(*(X @ A - D).T) <= AGREE_PX
    if keep.sum() < 6 or np.linalg.matrix_rank(X[keep]) < 3:
        return None
    A, *_ = np.linalg.lstsq(X[keep], D[keep], rcond=None)
    return A

def supported(shifts: list[WindowShift]) -> list[WindowShift]:
    """Windows whose displacement an adjacent, non-overlapping window agrees with (within
    ``AGREE_PX``): two grid steps away, so the two share no pixels.

    One window alone may have latched onto a repeated texture or a change (and its overlapping
    neighbours share half its pixels, so they would agree for the same reason); a region of the
    crop moving as a whole shows in independent windows alike.
    """
    by_pos = {(s.row, s.col): s for s in shifts}
    out = []
    for s in shifts:
        for dr in (-2, -1, 0, 1, 2):
            for dc in (-2, -1, 0, 1, 2):
                if max(abs(dr), abs(dc)) != 2:
                    continue
                t = by_pos.get((s.row + dr, s.col + dc))
                if t is not None and t is not s and np.hypot(t.dx - s.dx, t.dy - s.dy) <= AGREE_PX:
                    out.append(s)
                    break
            else:
                continue
            break
    return out


def screen_alignment(pre_grey: np.ndarray, post_grey: np.ndarray, valid: np.ndarray,
                     cfg: RegistrationConfig) -> ScreeningResult:
    """Measure the residual misregistration of a crop pair over the whole crop.

    ``pre_grey`` / ``post_grey``: (H, W) float grey of the kept crop (post already registered), each
    normalised on the crop; ``valid``: pixels usable in both dates (nodata, clouds excluded).
    """
    h, w = pre_grey.shape
    win = int(min(cfg.screen_window(), h, w))
    valid = np.asarray(valid, bool)
    pre = np.where(valid, pre_grey, 0).astype(np.float32)
    post = np.where(valid, post_grey, 0).astype(np.float32)
    near = int(np.ceil(2 * cfg.max_residual_px))
    far = max(near, int(cfg.screen_search_px))
    shifts: list[WindowShift] = []
    n_textured = 0
    for i, y in enumerate(window_starts(h, win)):
        for j, x in enumerate(window_starts(w, win)):
            ok = valid[y:y + win, x:x + win]
            if ok.mean() < MIN_USABLE:
                continue
            a = pre[y:y + win, x:x + win].copy()
            b = post[y:y + win, x:x + win]
            if a[ok].std() < cfg.screen_min_texture or b[ok].std() < cfg.screen_min_texture:
                continue
            n_textured += 1
            a[~ok] = a[ok].mean()
            found = match_window(a, post, x, y, near, cfg.screen_min_ncc)
            if found is None and far > near:
                found = match_window(a, post, x, y, far, cfg.screen_min_ncc)
            if found is not None:
                dx, dy, ncc = found
                shifts.append(WindowShift(x + (win - 1) / 2, y + (win - 1) / 2, dx, dy, ncc, i, j))
    trusted = supported(shifts)
    n = len(trusted)
    fraction = n / n_textured if n_textured else 0.0
    if n_textured == 0 or fraction < cfg.screen_min_assessed or n == 0:
        return ScreeningResult(None, None, n_textured, n,
                               f"insufficient evidence: {fraction:.0%} of the textured area "
                               f"assessed (< {cfg.screen_min_assessed:.0%}; {n} of "
                               f"{n_textured} windows)", fraction, trusted)
    mags = np.hypot([s.dx for s in trusted], [s.dy for s in trusted])
    worst = trusted[int(np.argmax(mags))]
    residual, median = float(mags.max()), float(np.median(mags))
    A = affine_field(trusted)
    corner = 0.0
    if A is not None:
        corners = np.array([[1.0, -0.5, -0.5], [1.0, w - 0.5, -0.5], [1.0, -0.5, h - 0.5],
                            [1.0, w - 0.5, h - 0.5]])
        corner = float(np.hypot(*(corners @ A).T).max())
    reason = None
    if residual > cfg.max_residual_px:
        reason = (f"displaced region: {residual:.1f} px > {cfg.max_residual_px:g} px near "
                  f"({worst.x:.0f}, {worst.y:.0f}) of the crop")
    elif corner > cfg.max_residual_px:
        reason = f"residual {corner:.1f} px at a crop corner > {cfg.max_residual_px:g} px"
    return ScreeningResult(max(residual, corner), median, n_textured, n, reason, fraction,
                           trusted)
