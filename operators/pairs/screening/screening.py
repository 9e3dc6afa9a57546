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
  displacement, and the displacement at the crop's four corners extrapolated from affine and
  bilinear fields fitted to the windows (window centres sit half a window inside the corners,
  where a rotation's error is largest).
* Only displacements a neighbouring window agrees with count (one window alone may have latched
  onto a repeated texture or a change); that is what "confidently measured" means below. A
  displacement above ``max_residual_px`` must be shared by a connected group of at least
  ``REGION_WINDOWS`` windows: on real pairs years apart, two windows now and then latch onto the
  same wrong peak (a new building beside an old one, field rows), while a displaced region of the
  scale screened for (at least 1/8 of the crop, at half-window steps) spans several windows. A
  group that only overlapping windows see is confirmed by one search of the rectangle it
  covers (:func:`joint_regions`).
* Rejections: a displaced region above ``max_residual_px``, a corner above it, or too little
  evidence ("insufficient evidence"): too little of the textured area measured, fewer than
  ``screen_min_windows`` agreeing windows, or agreeing windows in fewer than
  ``screen_min_quadrants`` quadrants of the crop (a scale or rotation error grows towards a far
  corner that no window sees). Nothing passes unchecked.

``invalid`` pixels (nodata, and clouds once a mask is given) are kept out: a window counts only
when at least ``screen_min_usable`` (90 %) of it is usable, and unusable pixels are set to the
window mean. Off-nadir lean (roof windows displaced one way amid registered ground) is set apart
by :func:`lean_split` and recorded, the crop judged on its ground.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

import cv2
import numpy as np

from operators.pairs.registration.registration import RegistrationConfig
from operators.pairs.screening.fields import CornerEstimate, corner_residual, hull_share
from operators.pairs.screening.lean import (LEAN_MIN_WINDOW, Lean, ground_as_reported, ground_without_roofs,
                                            lean_seen, lean_split, read_lean)
from operators.pairs.screening.peaks import FlatMaps, PeakTest, search_window
from operators.pairs.screening.repeats import (MOVED, NONE, REPEAT_MIN_WINDOW, UNKNOWN, RegionShift,
                                               repeat_period, repeated_groups, region_shift)
from operators.pairs.screening.windows import (WindowShift, confirmed, displaced_groups, quadrants_reached,
                                               supported, window_centre, window_origin, window_starts,
                                               window_stats)


@dataclass
class ScreeningResult:
    residual_px: Optional[float]          # largest displacement anywhere in the crop (None: unknown)
    residual_median_px: Optional[float]
    n_windows: int                        # textured windows (both dates)
    n_confident: int                      # windows whose displacement was trusted
    reject_reason: Optional[str] = None
    assessed_fraction: float = 0.0        # n_confident / n_windows
    shifts: list = field(default_factory=list)  # WindowShift per trusted window, for diagnostics
    measured: list = field(default_factory=list)  # every window with a peak (trusted or outlier)
    corner_se_px: Optional[float] = None  # standard error of the corner value
    coverage: float = 0.0                 # share of the crop in the trusted windows' convex hull
    lean: Optional[Lean] = None           # off-nadir lean of elevated objects, when found
    reject_code: Optional[str] = None     # DISPLACED, CORNER or INSUFFICIENT (None: accepted)


# Why a crop was rejected, as code reads it (the reason's text is for people).
DISPLACED = "displaced_region"       # a region of windows displaced beyond the limit
CORNER = "corner"                    # the displacement field beyond the limit at a crop corner
INSUFFICIENT = "insufficient_evidence"   # too little measured to say either way
REPEATS_MOVED = "repeated_texture_moved"   # a region of repeated texture whose outline moved


def far_candidates(missed: dict[tuple[int, int], list[tuple[int, int]]],
                   texture: np.ndarray) -> list[tuple[int, int]]:
    """The windows the far search starts from: one per 2 x 2 cell of windows (a displaced region
    of a quarter of the crop side holds a cell), given the windows of each cell the near search
    missed (``missed``: cell -> (row, col) of its windows, in raster order). The cell's even
    corner when it is one of them (a fixed every-other-window pick); else the most ``texture``d
    of its missed windows that have a missed neighbour (a region spans adjacent windows; a lone
    miss can find no support). Windows count only where both dates are textured, and a
    displaced region takes its texture away from where it was: in a 192 px crop a 56 px patch
    left textured only windows off the cells' even corners, and the every-other-window pick
    alone searched none of them."""
    every = {k for cands in missed.values() for k in cands}
    out = []
    for (ci, cj), cands in missed.items():
        if cands[0] == (2 * ci, 2 * cj):
            out.append(cands[0])
            continue
        near = [(i, j) for i, j in cands
                if any((i + di, j + dj) in every for di in (-1, 0, 1) for dj in (-1, 0, 1)
                       if di or dj)]
        if near:
            out.append(max(near, key=lambda k: texture[k]))
    return sorted(out)


def joint_regions(shifts: list[WindowShift], agreed: list[WindowShift], pre: np.ndarray,
                  post: np.ndarray, win: int, far: int, near: int, cfg: RegistrationConfig,
                  peak: PeakTest) -> list[WindowShift]:
    """Windows of a displaced region too small or too sparsely textured for two of its windows
    to share no pixels (so :func:`supported` gives them no support): at least
    ``screen_region_windows`` windows within two grid steps of each other
    (:func:`displaced_groups`, as :func:`confirmed` groups them) agreeing on one displacement
    above the limit, some without support, confirmed by one search of the rectangle they cover (the region's own texture, from pre,
    with the same peak tests and backward check) landing within ``screen_agree_px`` of their
    median displacement. Overlapping windows agree because they share pixels; the joint
    window does not inherit that agreement, it measures the whole region at once (a look-alike
    two windows latch onto rarely spans the region with its context). Returns those windows."""
    limit, agree = cfg.max_residual_px, cfg.screen_agree_px
    done = {id(s) for s in agreed}
    big = [s for s in shifts if np.hypot(s.dx, s.dy) > limit]
    if len(big) < cfg.screen_region_windows or all(id(s) in done for s in big):
        return []
    out: list[WindowShift] = []
    for group in displaced_groups(big, agree):
        if len(group) < cfg.screen_region_windows or all(id(s) in done for s in group):
            continue
        starts = np.array([window_origin(s, win) for s in group])
        (sx, sy), (ex, ey) = starts.min(axis=0), starts.max(axis=0) + win
        sx, sy = int(sx), int(sy)
        template = np.ascontiguousarray(pre[sy:int(ey), sx:int(ex)])
        if float(template.std()) < cfg.screen_min_texture:
            continue
        hit, _ = search_window(template, post, sx, sy, far, cfg.screen_min_ncc,
                               cfg.screen_peak_margin, pre, peak, near)
        if hit is None or stayed_put(pre, post, sx, sy, template.shape, hit, near, cfg):
            continue
        d = np.median([[s.dx, s.dy] for s in group], axis=0)
        if np.hypot(hit[0] - d[0], hit[1] - d[1]) <= agree:
            out.extend(s for s in group if id(s) not in done)
    return out


def stayed_put(pre: np.ndarray, post: np.ndarray, x: int, y: int, shape: tuple,
               hit: tuple, near: int, cfg: RegistrationConfig) -> bool:
    """The two-sided shift-back test of a far hit (AROSICS-style): the post content where the
    window was found, compared with the pre content at that same place. Moved content left its
    place (the two differ); a look-alike was there all along (a row of similar roofs, terraces,
    one period of an orchard): when they correlate at least as well as the forward match less
    ``screen_peak_margin``, the hit is a look-alike. Hits within ``near`` and flat places are
    left as they are (the near search's own tests judge them; a flat place says nothing)."""
    dx, dy, ncc = hit
    if np.hypot(dx, dy) <= near:
        return False
    wh, ww = shape
    bx, by = x + int(round(dx)), y + int(round(dy))
    h, w = post.shape
    if bx < 0 or by < 0 or bx + ww > w or by + wh > h:
        return False
    a = post[by:by + wh, bx:bx + ww].astype(np.float64)
    b = pre[by:by + wh, bx:bx + ww].astype(np.float64)
    if a.std() < cfg.screen_min_texture or b.std() < cfg.screen_min_texture:
        return False
    a, b = a - a.mean(), b - b.mean()
    same = float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))
    return same >= ncc - cfg.screen_peak_margin


def far_search(queue: list[tuple[int, int]], templates: dict, target: np.ndarray,
               source: np.ndarray, found: dict, far: int, near: int, cfg: RegistrationConfig,
               peak: PeakTest, flats: Optional[FlatMaps] = None) -> None:
    """The far search from ``queue`` (one window per cell, :func:`far_candidates`), then around
    every window it finds displaced, step by step, until no new window shows the region; hits
    into ``found``. ``templates`` are windows of ``source`` looked for in ``target``."""
    searched: set[tuple[int, int]] = set()
    while queue:
        key = queue.pop()
        if key in searched or key in found:
            continue
        searched.add(key)
        a, x, y = templates[key]
        hit, _ = search_window(a, target, x, y, far, cfg.screen_min_ncc, cfg.screen_peak_margin,
                               source, peak, near, flats)
        if hit is None or stayed_put(source, target, x, y, a.shape, hit, near, cfg):
            continue
        found[key] = hit
        if np.hypot(hit[0], hit[1]) > cfg.max_residual_px:
            queue.extend((key[0] + di, key[1] + dj) for di in (-1, 0, 1) for dj in (-1, 0, 1)
                         if (key[0] + di, key[1] + dj) in templates)


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
    near = int(np.ceil(cfg.screen_near_factor * cfg.max_residual_px))
    peak = PeakTest.of(cfg)
    # The far search reaches screen_search_px within the crop: a patch displaced inside a small
    # crop (56 px in 192) lies beyond a quarter of its side, where the old bound stopped.
    far = max(near, min(int(cfg.screen_search_px), int(cfg.screen_far_fraction * min(h, w))))
    # Pass 1, every window: the near search (displacements up to twice the limit).
    flats = FlatMaps()
    templates: dict[tuple[int, int], tuple[np.ndarray, int, int]] = {}
    found: dict[tuple[int, int], tuple[float, float, float]] = {}
    far_cells: dict[tuple[int, int], list[tuple[int, int]]] = {}
    ys, xs = window_starts(h, win), window_starts(w, win)
    count, pre_mean, pre_std = window_stats(pre, valid, ys, xs, win)
    _, _, post_std = window_stats(post, valid, ys, xs, win)
    usable = (count >= cfg.screen_min_usable * win * win) & (pre_std >= cfg.screen_min_texture) & \
        (post_std >= cfg.screen_min_texture)
    repeated: dict[tuple[int, int], tuple[int, int]] = {}     # cell -> its texture's period
    reach = max(near, win // 2)
    for i, j in zip(*np.nonzero(usable)):
        i, j, y, x = int(i), int(j), ys[i], xs[j]
        period = repeat_period(pre, x, y, win, reach, cfg.screen_repeat_ncc) \
            if win >= REPEAT_MIN_WINDOW and cfg.screen_repeat_ncc < 1.0 else None
        if period is not None:
            repeated[(i, j)] = period     # a shift by whole periods would look like none
            continue
        a = pre[y:y + win, x:x + win]
        if count[i, j] < win * win:     # unusable pixels take the window's mean
            a = np.where(valid[y:y + win, x:x + win], a, np.float32(pre_mean[i, j]))
        templates[(i, j)] = (a, x, y)
        hit, _ = search_window(a, post, x, y, near, cfg.screen_min_ncc,
                               cfg.screen_peak_margin, pre, peak, near, flats)
        if hit is not None:
            found[(i, j)] = hit
        elif far > near:
            far_cells.setdefault((i // 2, j // 2), []).append((i, j))
    # Pass 2, the far search (the cost of screening).
    far_search(far_candidates(far_cells, pre_std), templates, post, pre, found, far, near, cfg,
               peak, flats)
    n_textured = len(templates)
    shifts = [WindowShift(window_centre(x, win), window_centre(y, win), dx, dy, ncc, i, j)
              for (i, j), (dx, dy, ncc) in sorted(found.items())
              for (_, x, y) in [templates[(i, j)]]]
    agreed = supported(shifts, cfg.screen_agree_px)
    agreed += joint_regions(shifts, agreed, pre, post, win, far, near, cfg, peak)
    trusted = confirmed(agreed, cfg.max_residual_px, cfg.screen_agree_px,
                        cfg.screen_region_windows)
    reading = read_lean(trusted, pre, post, valid, win, cfg) \
        if cfg.screen_lean and win >= LEAN_MIN_WINDOW else None
    lean = lean_split(reading, w, h, cfg)
    if lean is not None:
        # Judged on the ground alone: the leaning windows leave the evidence, the displaced-
        # region test and the corner fields.
        leaning = {id(s) for s in trusted} - {id(s) for s in lean[0]}
        remeasured = ground_without_roofs(lean[0], lean[1], pre, post, valid, win, cfg)
        trusted = [remeasured.get(id(s), s) for s in lean[0]]
        trusted = [s for s in trusted if s is not None]
        agreed = [remeasured.get(id(s), s) for s in agreed if id(s) not in leaning]
        agreed = [s for s in agreed if s is not None]
    found_lean = lean[1] if lean is not None else None
    read_as = found_lean if found_lean is not None else lean_seen(reading, cfg)
    reported = ground_as_reported(trusted, read_as, pre, post, valid, win, cfg) \
        if read_as is not None else None
    # Repeated texture is read by its outline instead (:mod:`.repeats`), as far as a region's
    # content could have moved.
    outlines = [(g, region_shift(pre, post, valid, g, repeated, ys, xs, win, far,
                                 cfg.max_residual_px)) for g in repeated_groups(repeated)]
    ev = Evidence(w, h, win, trusted, agreed, shifts, n_textured, outlines, ys, xs, found_lean,
                  cfg, reported)
    for k, test in enumerate(SCREEN_TESTS):
        verdict = test(ev)
        if verdict is not None:
            return ev.result(*verdict, measured=k >= MEASURED_FROM)
    return ev.result(None, None, measured=True)


@dataclass
class Evidence:
    """What the windows measured, as the screen's tests read it."""
    w: int
    h: int
    win: int
    trusted: list            # windows whose displacement counts (the ground, when lean was set apart)
    agreed: list             # windows with a neighbour's support (the corner fields read them)
    shifts: list             # every window with a peak
    n_textured: int
    outlines: list           # (cells, RegionShift) per region of repeated-texture windows
    ys: list
    xs: list
    lean: Optional[Lean]
    cfg: RegistrationConfig
    reported: Optional[list] = None   # the ground's windows as its residual reads them (a lean crop)

    @property
    def fraction(self) -> float:
        return len(self.trusted) / self.n_textured if self.n_textured else 0.0

    @cached_property
    def mags(self) -> np.ndarray:
        return np.hypot([s.dx for s in self.trusted], [s.dy for s in self.trusted])

    @cached_property
    def moved_outline(self) -> Optional[RegionShift]:
        """The region of repeated texture that moved farthest beyond the limit, if any."""
        moved = [r for _, r in self.outlines if r.verdict == MOVED]
        return max(moved, key=lambda r: r.px) if moved else None

    @cached_property
    def coverage(self) -> float:
        return hull_share(self.trusted, self.w, self.h)

    @cached_property
    def corner(self) -> Optional[CornerEstimate]:
        # Every agreed window: the fits' own outlier rejection keeps spurious ones out, and near
        # a corner a real error may show in too few windows to form a region.
        step = max(1, self.win // 2)
        return corner_residual(self.agreed, self.w, self.h, self.cfg.screen_corner_k,
                               self.cfg.screen_shift_noise_px, self.cfg.screen_agree_px,
                               (self.win / step) ** 2)

    def result(self, code: Optional[str], reason: Optional[str],
               measured: bool) -> ScreeningResult:
        """The screening's result; ``measured``: the residual was measured (a rejection by the
        evidence tests leaves it, and the corner fields, unknown)."""
        n = len(self.trusted)
        if not measured:
            return ScreeningResult(None, None, self.n_textured, n, reason, self.fraction,
                                   self.trusted, self.shifts, reject_code=code)
        mags = self.mags if not self.reported else \
            np.hypot([s.dx for s in self.reported], [s.dy for s in self.reported])
        residual, median = float(mags.max()), float(np.median(mags))
        if self.moved_outline is not None:
            residual = max(residual, self.moved_outline.px)
        coverage = self.coverage
        corner = self.corner
        if corner is None:
            return ScreeningResult(None if code == INSUFFICIENT else residual, median,
                                   self.n_textured, n, reason, self.fraction, self.trusted,
                                   self.shifts, None, coverage, self.lean, code)
        return ScreeningResult(max(residual, corner.value), median, self.n_textured, n, reason,
                               self.fraction, self.trusted, self.shifts, corner.se, coverage,
                               self.lean, code)


# The screen's tests, in order: each returns None (passes) or (code, reason) (rejects).

def repeated_texture(ev: Evidence) -> Optional[tuple[str, str]]:
    """Repeated texture whose move cannot be read: an outline found but not aligned (hidden by
    cloud or the crop's edge, or texture everywhere), or a region of windows
    (``screen_region_windows`` or more) with no outline at all. A shift by whole periods is
    unseen inside it. (A window or two repeating with no outline is natural texture by chance.)"""
    need = ev.cfg.screen_region_windows
    unknown = [(g, r) for g, r in ev.outlines
               if r.verdict == UNKNOWN or (r.verdict == NONE and len(g) >= need)]
    if not unknown:
        return None
    g, r = unknown[0]
    return INSUFFICIENT, (f"insufficient evidence: repeated texture over {len(g)} windows near "
                          f"({r.x:.0f}, {r.y:.0f}) of the crop, its outline not aligned in both "
                          f"dates (a shift by whole periods cannot be seen)")


def too_little_assessed(ev: Evidence) -> Optional[tuple[str, str]]:
    """Too little of the textured area measured confidently."""
    n, cfg = len(ev.trusted), ev.cfg
    if ev.n_textured and n and ev.fraction >= cfg.screen_min_assessed:
        return None
    return INSUFFICIENT, (f"insufficient evidence: {ev.fraction:.0%} of the textured area "
                          f"assessed (< {cfg.screen_min_assessed:.0%}; {n} of {ev.n_textured} "
                          f"windows)")


def too_little_spread(ev: Evidence) -> Optional[tuple[str, str]]:
    """Too few agreeing windows, or windows that leave a quadrant or most of the crop unseen (a
    scale or rotation error grows towards a far corner no window sees)."""
    n, cfg = len(ev.trusted), ev.cfg
    quadrants = quadrants_reached(ev.trusted, ev.w, ev.h)
    coverage = ev.coverage
    if n >= cfg.screen_min_windows and quadrants >= cfg.screen_min_quadrants and \
            coverage >= cfg.screen_min_coverage:
        return None
    return INSUFFICIENT, (f"insufficient evidence: {n} agreeing windows in {quadrants} "
                          f"quadrant(s) covering {coverage:.0%} of the crop (needs "
                          f"{cfg.screen_min_windows} in {cfg.screen_min_quadrants}, covering "
                          f"{cfg.screen_min_coverage:.0%})")


def displaced_region(ev: Evidence) -> Optional[tuple[str, str]]:
    """A confirmed window (a region of them) displaced beyond the limit."""
    limit = ev.cfg.max_residual_px
    if float(ev.mags.max()) <= limit:
        return None
    worst = ev.trusted[int(np.argmax(ev.mags))]
    return DISPLACED, (f"displaced region: {float(ev.mags.max()):.1f} px > {limit:g} px near "
                       f"({worst.x:.0f}, {worst.y:.0f}) of the crop")


def repeated_texture_moved(ev: Evidence) -> Optional[tuple[str, str]]:
    """A region of repeated texture whose outline moved beyond the limit (a whole period, say:
    its windows match as well as none)."""
    moved = ev.moved_outline
    if moved is None:
        return None
    return REPEATS_MOVED, (f"displaced region: repeated texture moved {moved.px:.1f} px > "
                       f"{ev.cfg.max_residual_px:g} px near ({moved.x:.0f}, {moved.y:.0f}) of the "
                       f"crop (its outline; period {moved.period[0]}, {moved.period[1]} px)")


def corner_beyond(ev: Evidence) -> Optional[tuple[str, str]]:
    """The displacement field beyond the limit at a crop corner (value plus k standard errors),
    or no field to say."""
    corner, cfg = ev.corner, ev.cfg
    if corner is None:
        return INSUFFICIENT, (f"insufficient evidence: no displacement field fits the "
                              f"{len(ev.agreed)} agreeing windows (the crop's corners are "
                              f"unknown)")
    if corner.bound <= cfg.max_residual_px:
        return None
    return CORNER, (f"residual {corner.value:.1f} px at a crop corner (standard error "
                    f"{corner.se:.1f} px; {corner.value:.1f} + {cfg.screen_corner_k:g} x "
                    f"{corner.se:.1f} > {cfg.max_residual_px:g} px)")


SCREEN_TESTS = (repeated_texture, too_little_assessed, too_little_spread, displaced_region,
                repeated_texture_moved, corner_beyond)
MEASURED_FROM = SCREEN_TESTS.index(displaced_region)   # the tests before it judge evidence only


RESCUABLE = (DISPLACED, CORNER)   # rejections a smooth field can explain (a region of repeated
                                  # texture moved against its windows is no field)


def rescue_field(result: ScreeningResult, w: int, h: int,
                 cfg: RegistrationConfig) -> Optional[tuple[np.ndarray, float]]:
    """The crop's correction from a rejected screening: a projective field fitted to the
    agreeing windows (crop px -> where their content sits in the post crop), when the field is
    smooth and well supported, else None. Returns (3x3 field, largest correction at the crop's
    corners in px).

    Smooth and well supported: at least ``rescue_min_windows`` agreeing windows reaching
    ``screen_min_quadrants`` quadrants, of which ``rescue_min_agreement`` lie within ``AGREE_PX``
    of the one field. A displaced region (a building, a landslide, a wrong peak group) leaves
    windows the field cannot explain and is not rescued.
    """
    if not cfg.rescue or result.reject_code not in RESCUABLE:
        return None
    trusted = result.shifts
    quadrants = quadrants_reached(trusted, w, h)
    if len(trusted) < cfg.rescue_min_windows or quadrants < cfg.screen_min_quadrants or \
            hull_share(trusted, w, h) < cfg.screen_min_coverage:
        return None
    src = np.array([[s.x, s.y] for s in trusted], np.float64)
    dst = src + np.array([[s.dx, s.dy] for s in trusted])
    # The simplest field that explains the windows: affine (exact for a shift, rotation or
    # scale error, and stable when extrapolated to the corners), else projective.
    G = None
    for fit in ("affine", "projective"):
        cv2.setRNGSeed(0)
        if fit == "affine":
            A, inl = cv2.estimateAffine2D(src.reshape(-1, 1, 2), dst.reshape(-1, 1, 2),
                                          method=cv2.RANSAC,
                                          ransacReprojThreshold=cfg.screen_agree_px)
            M = None if A is None else np.vstack([A, [0.0, 0.0, 1.0]])
        else:
            M, inl = cv2.findHomography(src.reshape(-1, 1, 2), dst.reshape(-1, 1, 2),
                                        cv2.RANSAC, cfg.screen_agree_px)
        if M is not None and inl is not None and np.all(np.isfinite(M)) and \
                inl.sum() >= cfg.rescue_min_agreement * len(trusted):
            G = M
            break
    if G is None:
        return None
    corners = np.array([[-0.5, -0.5], [w - 0.5, -0.5], [-0.5, h - 0.5], [w - 0.5, h - 0.5]])
    moved = cv2.perspectiveTransform(corners.reshape(-1, 1, 2), G).reshape(-1, 2)
    shift = float(np.hypot(*(moved - corners).T).max())
    if not np.isfinite(shift) or shift > cfg.screen_search_px:
        return None
    return G / G[2, 2], shift


def rescued_homography(H: np.ndarray, field: np.ndarray, offset: int) -> np.ndarray:
    """The slice homography corrected by a crop's screening field.

    Pre content at crop pixel p sits in the post crop at G(p); the post crop's pixel q shows the
    post slice at H^-1(q + offset). So the post slice point showing pre crop pixel p is
    H^-1(G(p) + offset), and the corrected mapping (post slice -> pre slice) is
    H' = T(offset) G^-1 T(-offset) H.
    """
    T = np.array([[1, 0, offset], [0, 1, offset], [0, 0, 1]], np.float64)
    Ti = np.array([[1, 0, -offset], [0, 1, -offset], [0, 0, 1]], np.float64)
    out = T @ np.linalg.inv(np.asarray(field, np.float64)) @ Ti @ np.asarray(H, np.float64)
    return out / out[2, 2]
