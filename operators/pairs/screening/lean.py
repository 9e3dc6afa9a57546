"""Off-nadir lean: roofs displaced one way against the ground field, told apart from ground moved
as a whole (by the width of what moved, and by ground between the roofs), and the ground's own
residual read without the roofs' pull."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import cv2
import numpy as np

from operators.pairs.registration.registration import RegistrationConfig
from operators.pairs.screening.roofs import MIN_GROUND_SHARE, MOVED_GAIN, masked_shift, offset_error, roof_pixels
from operators.pairs.screening.windows import WindowShift, window_origin

@dataclass
class Lean:
    """Elevated objects displaced against the ground field in one direction (off-nadir view)."""
    px: float             # median displacement of the leaning windows from the ground field
    max_px: float         # the largest
    deg: float            # its direction in crop pixels: 0 = +x (east on a north-up grid), 90 = +y
    windows: int          # leaning windows (left out of the ground field's evidence)
    share: float = 0.0    # share of the crop seen moving with the roofs (their moved layer)


# Windows the ground field needs: twice the 3 an affine field fits exactly, so RANSAC's consensus
# can leave some out (roofs, a moved region) and still be checked by others.
GROUND_MIN_WINDOWS = 6


def ground_field(shifts: list[WindowShift], agree_px: float) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """The crop's ground field: the affine field (crop px -> where the content sits in the post
    crop) most windows agree with within ``agree_px`` (RANSAC, seeded), and which windows do.
    Robust where a least-squares fit is pulled by roofs or a moved region."""
    if len(shifts) < GROUND_MIN_WINDOWS:
        return None
    src = np.array([[s.x, s.y] for s in shifts], np.float64)
    dst = src + np.array([[s.dx, s.dy] for s in shifts])
    cv2.setRNGSeed(0)
    M, inl = cv2.estimateAffine2D(src.reshape(-1, 1, 2), dst.reshape(-1, 1, 2), method=cv2.RANSAC,
                                  ransacReprojThreshold=agree_px, maxIters=2000,
                                  confidence=0.999)
    if M is None or inl is None or not np.all(np.isfinite(M)):
        return None
    return M, inl.ravel().astype(bool)


def moved_layer(pre: np.ndarray, post: np.ndarray, valid: np.ndarray, win: int,
                windows: list[tuple[WindowShift, np.ndarray]]) -> np.ndarray:
    """Pixels of the pre crop that sit where their window's displacement says rather than where
    the ground field says: within each window, the pre content compared with the post content at
    both offsets (absolute differences averaged over a small box), a pixel counted as moved when
    the window's own offset explains it clearly better (error under ``MOVED_GAIN`` of the
    ground's). A roof that leans is such a layer within its window; a displaced region of ground
    is one across windows."""
    h, w = pre.shape
    out = np.zeros((h, w), bool)
    for s, g in windows:
        x0, y0 = window_origin(s, win)
        a = pre[y0:y0 + win, x0:x0 + win]
        own = offset_error(a, post, s.x, s.y, (s.dx, s.dy))
        ground = offset_error(a, post, s.x, s.y, (g[0], g[1]))
        out[y0:y0 + win, x0:x0 + win] |= (own < MOVED_GAIN * ground) & valid[y0:y0 + win, x0:x0 + win]
    return out




def wide_areas(moved: np.ndarray, width_px: float) -> np.ndarray:
    """The parts of ``moved`` (speckle opened away) belonging to an area no roof makes: one that
    holds a disc of ``width_px`` diameter, or one the crop's edge cuts that reaches farther than
    twice that along a row or a column (a region mostly outside the crop shows as a sliver whose
    width cannot be seen). Roofs are narrower; ground moved as a whole is not."""
    k = max(3, int(width_px) // 12) | 1
    disc = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (k, k))
    clean = cv2.morphologyEx(moved.astype(np.uint8), cv2.MORPH_OPEN, disc)
    if not clean.any():
        return clean.astype(bool)
    dist = cv2.distanceTransform(clean, cv2.DIST_L2, 5)
    n, labels, stats, _ = cv2.connectedComponentsWithStats(clean, connectivity=8)
    x, y = stats[:, cv2.CC_STAT_LEFT], stats[:, cv2.CC_STAT_TOP]
    bw, bh = stats[:, cv2.CC_STAT_WIDTH], stats[:, cv2.CC_STAT_HEIGHT]
    H, W = moved.shape
    cut = (x == 0) | (y == 0) | (x + bw == W) | (y + bh == H)    # its width may lie outside
    long = np.flatnonzero(cut & (np.maximum(bw, bh) > 2 * width_px))
    wide = np.union1d(np.unique(labels[dist >= width_px / 2]), long)
    wide = wide[wide > 0]
    return np.isin(labels, wide)


@dataclass
class LeanReading:
    """The windows off the ground field leaning one way, before :func:`lean_split` decides
    whether they are a lean (:func:`read_lean`)."""
    ground: list          # the other windows
    lean: Lean
    off: int              # narrow windows clearly off the ground field (any direction)
    core: int             # those of them along the lean
    inside: int           # ground windows inside the hull of the core's grid cells


def read_lean(trusted: list[WindowShift], pre: np.ndarray, post: np.ndarray, valid: np.ndarray,
              win: int, cfg: RegistrationConfig) -> Optional[LeanReading]:
    """The windows off the ground field (:func:`ground_field`) whose moved content is roof-sized
    (:func:`moved_layer`, :func:`wide_areas`) and which share one direction (:func:`lean_cone`),
    however few: what :func:`lean_split` judges, and what the report reads under the limit."""
    got = ground_field(trusted, cfg.screen_agree_px)
    if got is None:
        return None
    M, _ = got
    h, w = pre.shape
    xy = np.array([[s.x, s.y] for s in trusted])
    field = xy @ M[:, :2].T + M[:, 2] - xy
    dev = np.array([[s.dx, s.dy] for s in trusted]) - field
    size = np.hypot(*dev.T)
    # Off the ground field by more than half the agreement: a roof's pull on a window mostly of
    # ground is often 1-2 px, and left with the ground it would be reported as the ground's.
    idx = np.flatnonzero(size > 0.5 * cfg.screen_agree_px)
    if idx.size == 0:
        return None
    moved = moved_layer(pre, post, valid, win, [(trusted[i], field[i]) for i in idx])
    wide = wide_areas(moved, cfg.screen_lean_max_roof * min(w, h))
    narrow = []
    for i in idx:
        x0, y0 = window_origin(trusted[i], win)
        if not wide[y0:y0 + win, x0:x0 + win].any():
            narrow.append(i)
    # The lean is judged on the windows clearly off the ground field (a smaller deviation's
    # direction is the windows' noise); those nearer follow when they lean the same way.
    off = [i for i in narrow if size[i] > cfg.screen_agree_px]
    cone = lean_cone(dev[off], cfg.screen_agree_px, cfg.screen_lean_spread_deg)
    if cone is None:
        return None
    u, within = cone
    # Windows off the view direction (a real change, a match on a facade, a patch of ground
    # moved another way) are no lean: they stay with the ground and face its tests.
    core = [i for i, k in zip(off, within) if k]
    along = dev[core] @ u
    leaning = set(core) | {i for i in narrow if size[i] <= cfg.screen_agree_px and dev[i] @ u > 0}
    ground = [s for i, s in enumerate(trusted) if i not in leaning]
    # Interleaved with the ground: roofs stand between streets and yards that stay registered;
    # ground windows strictly inside the hull of the leaning windows' grid cells show it (a
    # periodic region's moved rim, thin like roofs, encloses no such ground of its own).
    cells = np.array([[trusted[i].col, trusted[i].row] for i in core], np.float32)
    hull = cv2.convexHull(cells.reshape(-1, 1, 2))
    inside = sum(cv2.pointPolygonTest(hull, (float(s.col), float(s.row)), False) > 0
                 for s in ground)
    roof_share = float((moved & ~wide).mean())
    deg = float(np.degrees(np.arctan2(u[1], u[0])) % 360.0)
    lean = Lean(float(np.median(along)), float(along.max()), deg, len(leaning), roof_share)
    return LeanReading(ground, lean, len(off), len(core), int(inside))


def lean_split(reading: Optional[LeanReading], w: int, h: int,
               cfg: RegistrationConfig) -> Optional[tuple[list[WindowShift], Lean]]:
    """Separate the ground from elevated objects leaning one way (off-nadir), at any magnitude.

    Between two views a tall building's roof moves against the ground along the view direction,
    by an amount that grows with its height: its windows disagree with the ground field, in one
    direction. The windows off the ground field (:func:`ground_field`, by more than
    ``screen_agree_px``; :func:`read_lean`) are taken as leaning when

    * what moved in them is roof-sized: the content their offset explains (:func:`moved_layer`)
      belongs to no area wider than ``screen_lean_max_roof`` of the crop side
      (:func:`wide_areas`); a region of ground moved as a whole, convex, L-shaped, a ring or two
      patches, is wider and stays evidence of displacement;
    * at least ``screen_region_windows`` of them remain, the ground keeps at least as many;
    * their displacements from the ground field lie within ``screen_lean_spread_deg`` of their
      mean direction (one view direction);
    * they are interleaved with the ground (at least ``screen_region_windows`` ground windows
      lie inside the hull of their grid cells), or what moved is one roof at most
      (:func:`one_roof_share`) leaning past ``max_residual_px``: one tall building read by a few
      neighbouring windows.

    Returns (the crop's other windows: the ground, and any displaced region, which face every
    check of an acceptance; the lean), else None."""
    # The core windows are those of ``off`` along the lean: enough of them means enough of both.
    if reading is None or reading.core < cfg.screen_region_windows:
        return None
    inside, roof_share, lean = reading.inside, reading.lean.share, reading.lean
    # One roof with no ground around it is a lean only where it matters: over the limit (a roof
    # under it stays with the ground, which it cannot fail).
    if inside < cfg.screen_region_windows and (roof_share > one_roof_share(w, h, cfg) or
                                               lean.max_px <= cfg.max_residual_px):
        return None
    return reading.ground, lean


def lean_seen(reading: Optional[LeanReading], cfg: RegistrationConfig) -> Optional[Lean]:
    """A lean :func:`lean_split` did not set apart, read for the report only: windows off the
    ground field one way, over roof-sized content, none along the lean past the limit (fewer
    than ``screen_region_windows``, or a roof with no ground around it). They stay in the
    screen's evidence, where under the limit they cannot fail the crop; the reported residual
    reads the ground without their pull (:func:`ground_as_reported`, which never reads a window
    over the limit again). Not recorded as the crop's lean: a smooth field's curvature, which the
    ground field does not fit, reads the same way (2-3 px one way in 46 of 100 generated
    smooth-field crops at 1024 px)."""
    if reading is None or reading.core == 0 or reading.lean.max_px > cfg.max_residual_px:
        return None
    return reading.lean


def one_roof_share(w: int, h: int, cfg: RegistrationConfig) -> float:
    """The largest share of the crop one roof covers: a disc as wide as the widest roof a lean
    may move (``screen_lean_max_roof`` of the crop side; 2 % of the crop at the default). A lean
    whose windows enclose no ground must move no more: a patch of ground moved as a whole whose
    width the moved layer misses (mostly flat) moves more (3.9-8.5 % of the crop in the
    generated cases that showed it)."""
    side = cfg.screen_lean_max_roof * min(w, h)
    return float(np.pi / 4 * side * side / (w * h))


def lean_cone(v: np.ndarray, agree_px: float,
              spread_deg: float) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """The view direction most of the deviations ``v`` (n, 2) share, and which do: a deviation
    shares a direction when it points along it and lies within ``spread_deg`` of it or, a small
    one whose direction the windows' noise turns, within ``agree_px`` of the line. Each
    deviation's own direction is a candidate; the one most share is refined as the sum of
    those sharing it (the taller the roof, the surer its direction) until the deviations that
    share the sum are those summed. None unless a strict majority shares it.

    The refinement stops at that fixed point, not after a set number of rounds: 3 rounds left
    51 of 20,000 generated deviation sets (1-29 windows) short of it (up to 6 were needed; a
    set of windows seen again, a cycle, ends it too, and none of the 20,000 cycled). Screening
    generated crops needed at most one round (162 leans read over 524 crops)."""
    n = len(v)
    if n == 0:
        return None
    sin = np.sin(np.radians(spread_deg))

    def sharing(u: np.ndarray) -> np.ndarray:
        along = v @ u
        across = np.abs(v @ np.array([-u[1], u[0]]))
        return (along > 0) & (across <= np.maximum(agree_px, along * sin))

    norms = np.hypot(*v.T)
    best, within = None, np.zeros(n, bool)
    for k in np.flatnonzero(norms > 1e-9):
        got = sharing(v[k] / norms[k])
        if got.sum() > within.sum():
            best, within = v[k] / norms[k], got
    if best is None:
        return None
    u, seen = best, set()
    while within.tobytes() not in seen:
        seen.add(within.tobytes())
        mean = v[within].sum(axis=0)
        u = mean / np.hypot(*mean)
        within = sharing(u)
    if 2 * int(within.sum()) <= n:
        return None
    return u, within


def ground_without_roofs(ground: list[WindowShift], lean: Lean, pre: np.ndarray,
                        post: np.ndarray, valid: np.ndarray, win: int,
                        cfg: RegistrationConfig,
                        max_dev: Optional[float] = None,
                        across_px: float = 0.0,
                        min_dev: float = 0.0) -> dict[int, Optional[WindowShift]]:
    """The ground windows a leaning roof pulls, measured again without it (:mod:`.roofs`):
    ``id(window)`` -> the window with its new displacement, or None for a window mostly roof
    (no ground to measure there; it leaves the evidence).

    Only a window within ``max_dev`` (default ``screen_agree_px``) of the ground field and off it
    along the lean (the way a roof pulls), or off it across or against the lean by at most
    ``across_px`` (default: never), is measured again, and its new reading is taken only when its
    ground pixels put it nearer the ground field: at the default nothing here moves a window by
    more than a roof's pull, so no displacement past the limit can be hidden. A window nearer the
    field than ``min_dev`` is left as it is (within a reading's noise there is no pull to tell)."""
    got = ground_field(ground, cfg.screen_agree_px)
    if got is None:
        return {}
    M = got[0]
    u = np.array([np.cos(np.radians(lean.deg)), np.sin(np.radians(lean.deg))])
    reach = cfg.screen_agree_px if max_dev is None else max_dev
    out: dict[int, Optional[WindowShift]] = {}
    for s in ground:
        f = np.array([s.x, s.y]) @ M[:, :2].T + M[:, 2] - np.array([s.x, s.y])
        dev = np.array([s.dx, s.dy]) - f
        bound = reach if dev @ u > 0 else across_px
        if bound <= 0 or not min_dev <= np.hypot(*dev) <= bound:
            continue
        x0, y0 = window_origin(s, win)
        template = pre[y0:y0 + win, x0:x0 + win]     # whole: windows lie inside the crop
        roof = roof_pixels(template, post, s.x, s.y, (float(f[0]), float(f[1])), u,
                           lean.max_px + cfg.screen_agree_px)
        if not roof.any():
            continue
        use = ~roof & valid[y0:y0 + win, x0:x0 + win]
        if use.sum() < MIN_GROUND_SHARE * win * win:
            out[id(s)] = None
            continue
        new = masked_shift(template, post, s.x, s.y, (s.dx, s.dy), use,
                           cfg.screen_agree_px + float(np.hypot(*dev)))
        if new is not None and np.hypot(*(np.array(new) - f)) < np.hypot(*dev):
            out[id(s)] = replace(s, dx=new[0], dy=new[1])
    return out


def ground_as_reported(ground: list[WindowShift], lean: Lean, pre: np.ndarray, post: np.ndarray,
                       valid: np.ndarray, win: int, cfg: RegistrationConfig) -> list[WindowShift]:
    """The ground's windows as the reported residual reads them: those within the limit that lie
    off the ground field along the lean by up to the lean's largest magnitude plus
    ``screen_agree_px``, or across or against it by up to ``screen_agree_px`` (a facade or a roof's
    edge in a window pulls it sideways too, 1.0-1.6 px in generated crops; farther off that way is
    the ground's own displacement, which the report must not read down), and by at least
    ``screen_shift_noise_px`` (nearer, there is no pull to tell from a reading's noise), measured
    again without their roof pixels (:func:`ground_without_roofs`, the field fitted to those
    windows). The screen's tests have them read again only within
    ``screen_agree_px`` of the field, where no reading can cross the limit; a roof pulls a window
    further (3.8 px on exact ground in a generated crop), and that pull is the roof's, not the
    ground's. Report only: windows over the limit are left as they are, and no test of the screen
    reads these readings, so no verdict changes."""
    within = [s for s in ground if np.hypot(s.dx, s.dy) <= cfg.max_residual_px]
    again = ground_without_roofs(within, lean, pre, post, valid, win, cfg,
                                 max_dev=lean.max_px + cfg.screen_agree_px,
                                 across_px=cfg.screen_agree_px, min_dev=cfg.screen_shift_noise_px)
    read = [again.get(id(s), s) for s in ground]
    return [s for s in read if s is not None]


# Lean is told from ground moved as a whole by the width of what moved (:func:`wide_areas`); in
# smaller windows that layer is too fragmented to measure one, and a lean is displacement there.
LEAN_MIN_WINDOW = 64
