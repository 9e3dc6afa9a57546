"""A window's ground displacement with the leaning roofs in it left out.

Once a crop's lean is known (its view direction and largest magnitude, :func:`.screening.lean_split`),
a ground window that holds part of a roof is pulled towards the lean by that part: on generated
off-nadir crops (ground exact) such windows read 1-1.5 px and the crop's ground residual with
them. Here the roof pixels are found (content that one of the lean's offsets explains clearly
better than the ground's) and the window's displacement is measured again on the rest
(Lucas-Kanade, from the window's own reading). Pure numpy / OpenCV: windows in, offsets out.
"""
from __future__ import annotations

from typing import Optional

import cv2
import numpy as np

MOVED_GAIN = 0.6        # a pixel moved (a roof) when another offset leaves under 60 % of the ground's error
UNEXPLAINED = 3.0       # a pixel the ground leaves with 3 x the window's median error is out
UNEXPLAINED_FLOOR = 0.1  # ... and at least a tenth of the window's contrast (noise-free imagery)
ROOF_GROW_PX = 3        # roofs grown by this much: facades and edges that appear or vanish
MIN_GROUND_SHARE = 0.5  # a window with less ground than this is not measured again
LK_ITERATIONS = 8
MIN_CONDITION = 1e-6    # least ratio of the gradients' two eigenvalues (1 / condition number)
LK_STEP_PX = 0.01       # an update this small ends the iterations


def _sample(img: np.ndarray, win: int, cx: float, cy: float) -> np.ndarray:
    return cv2.getRectSubPix(img, (win, win), (float(cx), float(cy)))


def offset_error(template: np.ndarray, post: np.ndarray, cx: float, cy: float,
                 d: tuple[float, float]) -> np.ndarray:
    """Per pixel of the pre window ``template`` (centred at (cx, cy) of the crop): how far the
    post content at offset ``d`` is from it (absolute differences averaged over a box of about
    a sixteenth of the window, so a pixel's verdict is its neighbourhood's)."""
    win = template.shape[0]
    k = max(3, win // 16) | 1
    return cv2.blur(np.abs(template - _sample(post, win, cx + d[0], cy + d[1])), (k, k))


def roof_pixels(template: np.ndarray, post: np.ndarray, cx: float, cy: float,
                base: tuple[float, float], along: np.ndarray, max_px: float) -> np.ndarray:
    """Pixels of the pre window ``template`` (centred at (cx, cy) of the crop) whose content a
    lean explains: the post content at the ground's offset ``base`` plus ``t`` px along the
    unit view direction ``along`` (t = 1 .. ``max_px``) matches them with under ``MOVED_GAIN`` of
    the error at ``base`` (absolute differences averaged over a small box); and those the
    ground leaves with ``UNEXPLAINED`` times the window's median error (and at least
    ``UNEXPLAINED_FLOOR`` of its contrast); grown by
    ``ROOF_GROW_PX``."""
    ground = offset_error(template, post, cx, cy, base)
    best = np.full_like(ground, np.inf)
    for t in range(1, int(np.ceil(max_px)) + 1):
        np.minimum(best, offset_error(template, post, cx, cy, np.asarray(base) + t * along),
                   out=best)
    # What neither the ground nor a lean explains (a facade that appears, a roof's edge drawn
    # over the ground) pulls as much: out too, by its error against the window's typical one.
    roof = ((best < MOVED_GAIN * ground) |
            (ground > max(UNEXPLAINED * float(np.median(ground)),
                          UNEXPLAINED_FLOOR * float(template.std())))).astype(np.uint8)
    if ROOF_GROW_PX > 0 and roof.any():
        roof = cv2.dilate(roof, np.ones((2 * ROOF_GROW_PX + 1,) * 2, np.uint8))
    return roof.astype(bool)


def masked_shift(template: np.ndarray, post: np.ndarray, cx: float, cy: float,
                 start: tuple[float, float], use: np.ndarray,
                 max_move_px: float) -> Optional[tuple[float, float]]:
    """Where the pixels ``use`` of the pre window ``template`` (centred at (cx, cy)) sit in the
    post crop, from ``start``: Gauss-Newton on the squared difference of the two windows, each
    standardised over those pixels (a radiometric change between dates is a gain and an
    offset). None when too few pixels, a singular system (no texture in them) or a result
    farther than ``max_move_px`` from ``start`` (another minimum, not this window's reading)."""
    win = template.shape[0]
    if use.sum() < MIN_GROUND_SHARE * win * win:
        return None
    a = template[use].astype(np.float64)
    sa = a.std()
    if sa <= 0:
        return None
    a = (a - a.mean()) / sa
    d = np.array(start, np.float64)
    for _ in range(LK_ITERATIONS):
        b_img = _sample(post, win, cx + d[0], cy + d[1])
        gy, gx = np.gradient(b_img.astype(np.float64))
        b = b_img[use].astype(np.float64)
        sb = b.std()
        if sb <= 0:
            return None
        b = (b - b.mean()) / sb
        gx, gy = gx[use] / sb, gy[use] / sb
        r = a - b
        # The 2 x 2 normal equations in closed form: numpy's dot products and solvers call
        # OpenBLAS, whose threads spin on arrays this size (twice the CPU for nothing).
        a11, a12, a22 = float((gx * gx).sum()), float((gx * gy).sum()), float((gy * gy).sum())
        b1, b2 = float((gx * r).sum()), float((gy * r).sum())
        half_gap = float(np.hypot(0.5 * (a11 - a22), a12))
        low, high = 0.5 * (a11 + a22) - half_gap, 0.5 * (a11 + a22) + half_gap
        if low <= MIN_CONDITION * high:     # texture along one direction only (an edge)
            return None
        det = a11 * a22 - a12 * a12
        step = np.array([(a22 * b1 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det])
        d += step
        if np.hypot(*(d - start)) > max_move_px:
            return None
        if np.hypot(*step) < LK_STEP_PX:
            break
    return float(d[0]), float(d[1])
