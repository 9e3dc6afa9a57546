"""Screening of a registered crop pair (S2Looking step 5), independent of the SIFT fit.

The paper has experts check that the largest misregistration stays under 8 px. Here the check is
phase correlation on a grid of sub-windows of the kept crop (pre vs registered post): it uses the
pixels themselves, not the matches the homography came from, so a fit that RANSAC liked for the
wrong reason is still caught. Only windows that are fully valid, textured in both dates and give a
confident correlation peak count; the residual is the largest shift among them. Too few confident
windows means the two dates share no usable texture, which is a rejection too ("inconclusive"):
nothing may pass unchecked.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import cv2
import numpy as np

from operators.pairs.registration import RegistrationConfig


@dataclass
class ScreeningResult:
    residual_px: Optional[float]          # largest shift among confident windows (None: none)
    residual_median_px: Optional[float]
    n_windows: int                        # windows examined (fully valid)
    n_confident: int                      # windows whose peak was trusted
    reject_reason: Optional[str] = None
    shifts: list = field(default_factory=list)  # (dx, dy) per confident window, for diagnostics


def window_origins(size: int, window: int, grid: int) -> list[int]:
    """``grid`` evenly spread window starts along a side of ``size`` (fewer if they do not fit)."""
    if window > size:
        return []
    if grid <= 1:
        return [(size - window) // 2]
    starts = np.linspace(0, size - window, grid)
    return sorted(set(int(round(s)) for s in starts))


def local_shift(pre: np.ndarray, post: np.ndarray, hann: np.ndarray) -> tuple[float, float, float]:
    """(dx, dy, response) of post against pre by phase correlation.

    cv2.phaseCorrelate multiplies its inputs by the window *in place* in OpenCV 5, so it gets
    private copies; a second call on the same arrays would otherwise see pre-windowed data.
    """
    a = np.array(pre, dtype=np.float32, copy=True)
    b = np.array(post, dtype=np.float32, copy=True)
    a -= a.mean()
    b -= b.mean()
    (dx, dy), response = cv2.phaseCorrelate(a, b, hann.copy())
    return float(dx), float(dy), float(response)


def screen_alignment(pre_grey: np.ndarray, post_grey: np.ndarray, valid: np.ndarray,
                     cfg: RegistrationConfig) -> ScreeningResult:
    """Measure the residual misregistration of a crop pair; reject above ``max_residual_px``.

    ``pre_grey`` / ``post_grey``: (H, W) float grey of the kept crop (post already registered);
    ``valid``: pixels valid in both dates.
    """
    h, w = pre_grey.shape
    win = int(min(cfg.screen_window_px, h, w))
    hann = cv2.createHanningWindow((win, win), cv2.CV_32F)
    shifts, n_windows = [], 0
    for y in window_origins(h, win, cfg.screen_grid):
        for x in window_origins(w, win, cfg.screen_grid):
            if not valid[y:y + win, x:x + win].all():
                continue
            n_windows += 1
            a = pre_grey[y:y + win, x:x + win]
            b = post_grey[y:y + win, x:x + win]
            if a.std() < cfg.screen_min_texture or b.std() < cfg.screen_min_texture:
                continue
            dx, dy, response = local_shift(a, b, hann)
            if response >= cfg.screen_min_response and np.isfinite(dx) and np.isfinite(dy):
                shifts.append((dx, dy))
    n = len(shifts)
    if n < cfg.screen_min_windows:
        return ScreeningResult(None, None, n_windows, n,
                               f"screening inconclusive: no common texture ({n} confident "
                               f"windows < {cfg.screen_min_windows})", shifts)
    mags = np.hypot(*np.asarray(shifts).T)
    residual, median = float(mags.max()), float(np.median(mags))
    reason = None
    if residual > cfg.max_residual_px:
        reason = f"residual {residual:.1f} px > {cfg.max_residual_px:g} px"
    return ScreeningResult(residual, median, n_windows, n, reason, shifts)
