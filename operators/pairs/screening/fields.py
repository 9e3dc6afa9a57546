"""The displacement field the windows measure, read where no window is: fits over the crop
(affine, bilinear, quadratic; from a consensus of the windows), their value and standard error at
the crop's corners, and how much of the crop the windows span."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cv2
import numpy as np

from operators.pairs.screening.windows import AGREE_PX, WindowShift

def _field_terms(xy: np.ndarray, w: int, h: int, order: int) -> np.ndarray:
    """Design matrix of a displacement field over the crop: [1, x, y] (order 0: affine), plus
    x*y (1: bilinear), plus x^2, y^2 (2: quadratic); coordinates centred and scaled by the crop
    side, so the fit is well conditioned."""
    x, y = xy[:, 0] / w - 0.5, xy[:, 1] / h - 0.5
    cols = [np.ones_like(x), x, y] + ([x * y] if order >= 1 else []) + \
        ([x * x, y * y] if order >= 2 else [])
    return np.stack(cols, axis=1)


def field_fit(shifts: list[WindowShift], w: int, h: int, order: int = 0,
              agree_px: float = AGREE_PX, start: Optional[np.ndarray] = None
              ) -> Optional[tuple[np.ndarray, np.ndarray, float, np.ndarray]]:
    """Least-squares displacement field d(x, y) = terms(x, y) @ A over the windows (``order`` 0
    affine, 1 bilinear, 2 quadratic: :func:`_field_terms`), refitted three times, each time over
    the windows within ``agree_px`` of the last fit; the first fit over the windows ``start``
    marks (default: all). None with fewer than twice as many agreeing windows as terms, or when
    they span no plane.

    Returns (A, (X'X)^-1 of the kept windows, residual standard deviation per component, the
    kept windows' mask): what the standard error of a prediction needs, and the consensus."""
    k = (3, 4, 6)[int(order)]
    if len(shifts) < 2 * k:
        return None
    X = _field_terms(np.array([[s.x, s.y] for s in shifts]), w, h, order)
    D = np.array([[s.dx, s.dy] for s in shifts])
    keep = np.ones(len(shifts), bool) if start is None else np.asarray(start, bool).copy()
    for _ in range(3):
        if keep.sum() < 2 * k or np.linalg.matrix_rank(X[keep]) < k:
            return None
        A, *_ = np.linalg.lstsq(X[keep], D[keep], rcond=None)
        keep = np.hypot(*(X @ A - D).T) <= agree_px
    m = int(keep.sum())
    if m < 2 * k or np.linalg.matrix_rank(X[keep]) < k:
        return None
    A, *_ = np.linalg.lstsq(X[keep], D[keep], rcond=None)
    rss = float(((X[keep] @ A - D[keep]) ** 2).sum())
    sigma = float(np.sqrt(rss / (2 * (m - k))))
    return A, np.linalg.inv(X[keep].T @ X[keep]), sigma, keep


def shift_mode(shifts: list[WindowShift], agree_px: float) -> np.ndarray:
    """The windows within ``agree_px`` of the displacement the most windows agree with (a
    translation's consensus: where a trimmed fit of a field starts)."""
    D = np.array([[s.dx, s.dy] for s in shifts])
    near = np.hypot(*(D[:, None, :] - D[None, :, :]).transpose(2, 0, 1)) <= agree_px
    return near[int(np.argmax(near.sum(axis=1)))]


def consensus_fit(shifts: list[WindowShift], w: int, h: int, order: int, agree_px: float,
                  lower: Optional[np.ndarray]
                  ) -> Optional[tuple[np.ndarray, np.ndarray, float, np.ndarray]]:
    """The field of ``order`` trimmed from all windows, or from a consensus when that explains
    the windows clearly better. The consensus: for an affine field (order 0) the translation
    most windows agree with (:func:`shift_mode`); for a bilinear or quadratic field the
    consensus ``lower`` of the field one order below. Clearly better: a lower truncated squared
    residual over every window (each window's squared distance from the field, at most half
    ``agree_px``, squared: MSAC's cost) and a scatter under ``CONSENSUS_SIGMA_RATIO`` of the
    other fit's.

    Why: a region moved as a whole pulls a fit over all windows towards itself, and a bilinear
    or quadratic field bends to half-follow it and the ground, its corners far off (regions
    moved 6 px read 10-15 px at a corner: 57 of 162 such crops were rejected). Started from a
    consensus, the fit keeps one of them and leaves the other to the region tests. A homography
    error that moves one corner most is followed from all windows: a consensus that left that
    corner's windows out cannot see it."""
    starts: list[Optional[np.ndarray]] = [None]     # None: all windows
    if order == 0 and shifts:
        starts.append(shift_mode(shifts, agree_px))
    elif lower is not None:
        starts.append(lower)
    full = field_fit(shifts, w, h, order, agree_px)
    alt = field_fit(shifts, w, h, order, agree_px, starts[1]) if len(starts) > 1 else None
    if full is None or alt is None:
        return full if alt is None else alt
    X = _field_terms(np.array([[s.x, s.y] for s in shifts]), w, h, order)
    D = np.array([[s.dx, s.dy] for s in shifts])
    cost = [msac_cost(((X @ f[0] - D) ** 2).sum(axis=1), agree_px) for f in (full, alt)]
    return alt if cost[1] < cost[0] and alt[2] < CONSENSUS_SIGMA_RATIO * full[2] else full


def msac_cost(squared: np.ndarray, agree_px: float) -> float:
    """MSAC's cost of a fit: the windows' squared distances from it, each at most half
    ``agree_px``, squared (a window farther off counts as an outlier, whatever its distance)."""
    return float(np.minimum(squared, (agree_px / 2) ** 2).sum())


# A consensus's fit replaces the fit from all windows only when its scatter is under this share of
# that fit's: a field bent between ground and a moved region scatters its windows (0.48-0.79 px
# against 0.14-0.35 px for either side alone on generated 1024 px crops), while a curved or
# projective field that a consensus merely trims at a corner scatters about as much either way
# (0.55 against 0.57 px; taken on MSAC's cost alone, 31 of 2,000 such corners of 9.5-16 px were
# accepted, against 3 started from all windows).
CONSENSUS_SIGMA_RATIO = 0.7

CORNER_MAX_SE_PX = 1.0   # a quadratic's corner reading with a larger standard error is not used


@dataclass
class CornerEstimate:
    value: float    # largest displacement at the crop's outer corners (px), over the fields
    se: float       # standard error of the corner prediction that bounds it (px)
    bound: float    # largest value + k x se over the corners and fields


def corner_residual(shifts: list[WindowShift], w: int, h: int, k: float = 2.0,
                    noise_px: float = 0.3, agree_px: float = AGREE_PX,
                    overlap: float = 4.0) -> Optional[CornerEstimate]:
    """Displacement at the crop's outer corners extrapolated from the windows, with its
    uncertainty; None when no field can be fitted (no evidence about the corners, never 0 px).

    Two fields, affine and bilinear: a fit wrong by a homography moves one corner most, which an
    affine field spreads over the crop and underestimates; the bilinear term (x*y) follows it. A
    projective field follows it too but extrapolates unstably: its perspective terms, poorly
    constrained by windows 2 px noisy over one crop, put corners of well registered crops tens
    of pixels off. The bilinear field counts (the larger bound wins) when its x*y term is
    significant: larger than ``k`` standard errors in either component; else the affine one
    alone does.

    The standard error of a corner's prediction is sigma * sqrt(x0' (X'X)^-1 x0) (sigma: the
    windows' scatter about the field, at least ``noise_px``) times sqrt(``overlap``): windows at
    half-window steps share their pixels with their neighbours (each pixel lies in 4 windows),
    so their errors are not independent and n windows carry the information of n / 4 (the
    independent ones, as :func:`supported` counts support). Least squares on them as if
    independent put the x*y term of good 1024 px crops at 3.5 standard errors of noise and their
    corners 7 px off (true error under 1 px). Windows bunched near the centre extrapolate far to
    the corners and say little there, which the bound value + k SE shows."""
    xy = np.array([[-0.5, -0.5], [w - 0.5, -0.5], [-0.5, h - 0.5], [w - 0.5, h - 0.5]])
    inflate = float(np.sqrt(max(overlap, 1.0)))
    best: Optional[CornerEstimate] = None
    lower: Optional[np.ndarray] = None
    for order in (0, 1, 2):
        got = consensus_fit(shifts, w, h, order, agree_px, lower)
        if got is None:
            continue
        A, inv, sigma, lower = got
        sig = max(sigma, noise_px) * inflate
        extra = range(3, 4) if order == 1 else range(4, 6)
        if order and best is not None and all(
                np.all(np.abs(A[t]) <= k * sig * np.sqrt(max(inv[t, t], 0.0))) for t in extra):
            continue            # no curvature the windows show beyond their noise
        T = _field_terms(xy, w, h, order)
        value = np.hypot(*(T @ A).T)
        se = sig * np.sqrt(np.maximum(np.einsum("ij,jk,ik->i", T, inv, T), 0))
        if order == 2:
            # Where the windows show curvature, a corner is read from the quadratic at the
            # corner itself when its standard error there is within CORNER_MAX_SE_PX, else at
            # the windows' span: a quadratic carried to a corner the windows do not reach
            # extrapolates unstably (real 192 px crops of under 1 px read 20 px off).
            cx = [min(s.x for s in shifts), max(s.x for s in shifts)]
            cy = [min(s.y for s in shifts), max(s.y for s in shifts)]
            Tb = _field_terms(np.array([[x, y] for y in cy for x in cx]), w, h, order)
            span = np.hypot(*(Tb @ A).T)
            span_se = sig * np.sqrt(np.maximum(np.einsum("ij,jk,ik->i", Tb, inv, Tb), 0))
            loose = se > CORNER_MAX_SE_PX
            value, se = np.where(loose, span, value), np.where(loose, span_se, se)
        bound = value + k * se
        i = int(np.argmax(bound))
        if best is None or bound[i] > best.bound:
            best = CornerEstimate(float(value.max()), float(se[i]), float(bound[i]))
    return best


def hull_share(shifts: list[WindowShift], w: int, h: int) -> float:
    """Share of the crop inside the convex hull of the windows' centres: how far the evidence
    spreads (a full grid of windows of 1/8 of the side: (7/8)^2 = 0.77). Centres in every
    quadrant can still lie within a few windows of the centre; their hull shows it."""
    if len(shifts) < 3:
        return 0.0
    pts = np.array([[s.x, s.y] for s in shifts], np.float32).reshape(-1, 1, 2)
    return float(cv2.contourArea(cv2.convexHull(pts))) / float(w * h)
