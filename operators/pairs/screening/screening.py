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

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Optional

import cv2
import numpy as np

from operators.pairs.registration.config import ScreeningConfig
from operators.pairs.registration.registration import RegistrationConfig
from operators.pairs.screening.roofs import (MIN_GROUND_SHARE, MOVED_GAIN, masked_shift,
                                             offset_error, roof_pixels)
from operators.pairs.screening.repeats import (MOVED, NONE, REPEAT_MIN_WINDOW, UNKNOWN, RegionShift,
                                               repeat_period, repeated_groups, region_shift)

# The screening settings' defaults, for the pure functions called without a config (one source: the
# settings themselves).
MIN_USABLE = ScreeningConfig.screen_min_usable        # usable fraction a window needs in both dates
AGREE_PX = ScreeningConfig.screen_agree_px            # neighbouring windows agree on a displacement within this
REGION_WINDOWS = ScreeningConfig.screen_region_windows   # windows a displacement above the limit needs
# A window this flat (grey standard deviation, unit range: a quarter of an 8-bit step) is constant
# to the correlation, which is undefined there.
FLAT_STD = 1e-3

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
    measured: list = field(default_factory=list)  # every window with a peak (trusted or outlier)
    corner_se_px: Optional[float] = None  # standard error of the corner value
    coverage: float = 0.0                 # share of the crop in the trusted windows' convex hull
    lean: Optional["Lean"] = None         # off-nadir lean of elevated objects, when found
    reject_code: Optional[str] = None     # DISPLACED, CORNER or INSUFFICIENT (None: accepted)


# Why a crop was rejected, as code reads it (the reason's text is for people).
DISPLACED = "displaced_region"       # a region of windows displaced beyond the limit
CORNER = "corner"                    # the displacement field beyond the limit at a crop corner
INSUFFICIENT = "insufficient_evidence"   # too little measured to say either way
REPEATS_MOVED = "repeated_texture_moved"   # a region of repeated texture whose outline moved


@dataclass
class Lean:
    """Elevated objects displaced against the ground field in one direction (off-nadir view)."""
    px: float             # median displacement of the leaning windows from the ground field
    max_px: float         # the largest
    deg: float            # its direction in crop pixels: 0 = +x (east on a north-up grid), 90 = +y
    windows: int          # leaning windows (left out of the ground field's evidence)
    share: float = 0.0    # share of the crop seen moving with the roofs (their moved layer)

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

def _vertex(m: float, c: float, p: float) -> float:
    """Offset of a parabola's vertex through (-1, m), (0, c), (1, p), within +-0.5."""
    d = m - 2.0 * c + p
    return 0.0 if abs(d) < 1e-12 else min(0.5, max(-0.5, 0.5 * (m - p) / d))


def _subpixel(surface: np.ndarray, y: int, x: int) -> tuple[float, float]:
    """Parabolic refinement of a peak at (y, x) of a correlation surface."""
    h, w = surface.shape
    c = float(surface[y, x])
    fx = _vertex(float(surface[y, x - 1]), c, float(surface[y, x + 1])) if 0 < x < w - 1 else 0.0
    fy = _vertex(float(surface[y - 1, x]), c, float(surface[y + 1, x])) if 0 < y < h - 1 else 0.0
    return x + fx, y + fy

def match_window(template: np.ndarray, post: np.ndarray, x0: int, y0: int, radius: int,
                 min_ncc: float, peak_margin: float = 0.05, pre: Optional[np.ndarray] = None,
                 peak: Optional["PeakTest"] = None) -> Optional[tuple[float, float, float]]:
    """Find ``template`` (taken at (x0, y0) of the pre crop) in ``post`` within ``radius`` px.

    Returns (dx, dy, ncc) of a trusted peak, else None. A peak is trusted when its NCC reaches
    ``min_ncc``, it is not on the edge of the search area (the true match may lie beyond), it is
    the surface's only near-equal maximum outside a box about its own width, it stands
    ``PeakTest.sigma`` standard deviations above the rest of the surface, and (with ``pre``) the
    post window at the found offset, searched back in ``pre``, lands on the pre window.
    """
    return search_window(template, post, x0, y0, radius, min_ncc, peak_margin, pre, peak)[0]


@dataclass(frozen=True)
class PeakTest:
    """How a correlation peak is judged (the screening settings of the same names)."""
    box_px: int = 6           # largest half-side of the box that counts as the peak itself
    sigma: float = 2.0        # peak vs mean + sigma x std of the surface outside the box
    confirm_px: float = 3.0   # backward check tolerance (0: none)

    @classmethod
    def of(cls, cfg: RegistrationConfig) -> "PeakTest":
        return cls(int(cfg.screen_peak_box_px), float(cfg.screen_peak_sigma),
                   float(cfg.screen_confirm_px))


def peak_half_width(surface: np.ndarray, px: int, py: int, cap: int) -> int:
    """Half-side of the box that holds the peak at (px, py) itself: along each axis, as far as
    the surface stays above half way down from the peak to the surface's median (the peak's own
    width, whatever the window size), at least 2 and at most ``cap``."""
    top = float(surface[py, px])
    half = 0.5 * (top + _median(surface))
    width = 2
    # The four rays from the peak, at most ``cap`` px each (the surface's edge ends them).
    for ray in (surface[py, px + 1:px + 1 + cap], surface[py, max(0, px - cap):px][::-1],
                surface[py + 1:py + 1 + cap, px], surface[max(0, py - cap):py, px][::-1]):
        below = ray < np.float64(half)   # compared in float64, as the surface values were
        k = int(np.argmax(below)) if below.any() else ray.size
        width = max(width, k + 1)
    return min(width, max(2, cap))


def _median(a: np.ndarray) -> float:
    """``np.median`` of an array (the same value), without its generic machinery: a correlation
    surface's median is taken once per window searched."""
    flat = a.ravel()
    n = flat.size
    k = n // 2
    if n % 2:
        return float(np.partition(flat, k)[k])
    part = np.partition(flat, (k - 1, k))
    return float(np.mean(part[k - 1:k + 1]))


def _cov_eigvals(xs: np.ndarray, ys: np.ndarray) -> tuple[float, float]:
    """Eigenvalues (ascending) of the sample covariance of the points (xs, ys), as
    ``np.linalg.eigvalsh(np.cov(...))`` gives them, in closed form (a 2 x 2 symmetric matrix):
    a peak's region is measured once per window searched, and numpy's generic machinery cost
    more than the correlation."""
    x = xs.astype(np.float64)
    y = ys.astype(np.float64)
    x -= x.mean()
    y -= y.mean()
    f = 1.0 / (xs.size - 1)
    a, b, d = float(x @ x) * f, float(x @ y) * f, float(y @ y) * f
    m, r = 0.5 * (a + d), float(np.hypot(0.5 * (a - d), b))
    return m - r, m + r


def distinct_peak(surface: np.ndarray, px: int, py: int, peak_margin: float,
                  test: PeakTest) -> bool:
    """Whether the maximum at (px, py) is the surface's only peak, whatever its width:

    * no other maximum comes within ``peak_margin`` of it: the part of the surface within
      ``peak_margin`` of the top is one connected region, the peak's own (a periodic texture or
      stripes: one region per near-equal maximum);
    * that region is no ridge (the aperture problem: a line or an edge matches all along
      itself): not longer than twice the peak box (``test.box_px``) and three times its width;
    * the peak stands ``test.sigma`` standard deviations above the mean of the surface outside
      a box about the peak's own width (:func:`peak_half_width`, AROSICS's test).

    The peak's own width varies with the imagery, not with the window: smooth texture (an
    enlarged scene, soft land cover at 1024 px crops) gives peaks 10-20 px wide, whose flanks a
    fixed box of a few px took for rival maxima; a rival here must be a separate region."""
    top = float(surface[py, px])
    if peak_margin <= 0 and test.sigma <= 0 and surface.size >= (2 * max(1, test.box_px) + 1) ** 2 + 8:
        # The backward check's lenient test: the maximum is never below the mean of the rest,
        # and the box leaves at least 8 values; only where the peak lies counts (no need to
        # measure its width).
        return True
    if peak_margin > 0:
        high = (surface > top - peak_margin).astype(np.uint8)
        n, labels = cv2.connectedComponents(high, connectivity=8)
        if n > 2:               # background + the peak's own region: anything more is a rival
            return False
        ys, xs = np.nonzero(labels == labels[py, px])
        if xs.size >= 5:
            ev = _cov_eigvals(xs, ys)
            length = 2.0 * np.sqrt(3.0 * max(ev[1], 0.0))   # a uniform segment's length
            if length > 2 * max(1, test.box_px) and ev[1] > 9.0 * max(ev[0], 1.0 / 12):
                return False
    g = peak_half_width(surface, px, py, max(1, test.box_px))
    outside = np.ones(surface.shape, bool)
    outside[max(0, py - g):py + g + 1, max(0, px - g):px + g + 1] = False
    rest = surface[outside]
    if rest.size < 8:           # nothing left to compare with: no evidence the peak is unique
        return False
    mean = rest.mean()
    return top >= float(mean) + test.sigma * float(rest.std(mean=mean))


# The share of a window that must lie inside the crop, shifted by its offset, for the round trip
# to search it back: half a window still holds the texture the forward search matched on.
ROUND_TRIP_MIN_SHARE = 0.5


def round_trip(pre: np.ndarray, post: np.ndarray, x0: int, y0: int, win, dx: float,
               dy: float, radius: int, min_ncc: float, peak_margin: float,
               test: PeakTest, flats: Optional["FlatMaps"] = None) -> bool:
    """The window shifted by the found offset: the post window there, searched back in ``pre``
    within ``radius`` of the pre window, must give a trusted peak of its own (the same tests)
    within ``test.confirm_px`` of where the offset says its content came from. NCC is symmetric,
    so this adds what the other date holds: a post object that has a better (or an equal) twin
    near the pre window, as when one of a row of look-alike roofs is matched, does not return.

    Where the shifted window reaches past the crop's edge, the part of it inside the crop is
    searched back (from where that part's content sat in pre); with less than
    ``ROUND_TRIP_MIN_SHARE`` of the window inside, the offset is not confirmed (too little to
    search back: the window gives no evidence, rather than unchecked evidence)."""
    h, w = post.shape
    bx, by = x0 + int(round(dx)), y0 + int(round(dy))
    wh, ww = (win, win) if np.isscalar(win) else win      # a region's joint window: (h, w)
    cx0, cy0, cx1, cy1 = max(bx, 0), max(by, 0), min(bx + ww, w), min(by + wh, h)
    if cx1 <= cx0 or cy1 <= cy0 or (cx1 - cx0) * (cy1 - cy0) < ROUND_TRIP_MIN_SHARE * wh * ww:
        return False
    clipped = (cx0, cy0, cx1, cy1) != (bx, by, bx + ww, by + wh)
    back = np.ascontiguousarray(post[cy0:cy1, cx0:cx1])
    # Where the post window's best match lies is what counts here, not how unique it is (the
    # forward search judged that): no margin, no sigma test.
    lenient = PeakTest(test.box_px, 0.0, 0.0)
    # Searched around where the (clipped) window's content sat in pre; the flat maps are kept
    # per template size, so a clipped window (a size of its own) is judged on its own region.
    px0, py0 = x0 + cx0 - bx, y0 + cy0 - by
    hit, _ = search_window(back, pre, px0, py0, radius, min_ncc, 0.0, None, lenient,
                           flats=None if clipped else flats)
    if hit is None:
        return False
    # The post content at bx sits in pre at bx - dx, i.e. at x0 + (round(dx) - dx).
    return float(np.hypot(hit[0] - (bx - x0 - dx), hit[1] - (by - y0 - dy))) <= test.confirm_px


def flat_positions(region: np.ndarray, th: int, tw: int) -> np.ndarray:
    """Where a (th, tw) window of ``region`` is flat (grey standard deviation under
    ``FLAT_STD``), as a mask over matchTemplate's surface: there the normalised correlation is
    undefined, and OpenCV reads anything up to 1.0 for it from rounding in its running sums (a
    constant window: nodata, which the screen sets to 0, or saturation). A far search over a crop
    with a nodata edge met dozens of such perfect "rivals" and trusted no window of a region
    moved 33 px."""
    h, w = region.shape[0] - th + 1, region.shape[1] - tw + 1
    mean = cv2.boxFilter(region, cv2.CV_64F, (tw, th), anchor=(0, 0),
                         borderType=cv2.BORDER_CONSTANT)[:h, :w]
    mean2 = cv2.sqrBoxFilter(region, cv2.CV_64F, (tw, th), anchor=(0, 0),
                             borderType=cv2.BORDER_CONSTANT)[:h, :w]
    return mean2 - mean * mean < FLAT_STD * FLAT_STD


class FlatMaps:
    """:func:`flat_positions` of whole images, worked out once per image and window size and
    sliced for each search (one crop's screening searches the same two images hundreds of times).
    Keyed by the image's identity: an instance lives for one crop, while its images do."""

    def __init__(self):
        self._maps: dict[tuple[int, int, int], np.ndarray] = {}

    def of(self, image: np.ndarray, sx: int, sy: int, sh: int, sw: int, th: int,
           tw: int) -> np.ndarray:
        key = (id(image), th, tw)
        full = self._maps.get(key)
        if full is None:
            full = self._maps[key] = flat_positions(image, th, tw)
        return full[sy:sy + sh, sx:sx + sw]


def search_window(template: np.ndarray, post: np.ndarray, x0: int, y0: int, radius: int,
                  min_ncc: float, peak_margin: float, pre: Optional[np.ndarray] = None,
                  peak: Optional[PeakTest] = None,
                  back_radius: int = 16, flats: Optional[FlatMaps] = None) -> tuple[Optional[tuple], bool]:
    """:func:`match_window`, plus whether the best peak lay on the search area's edge (a hint
    that the content sits farther away). The backward check searches ``back_radius`` px at
    most (the near search's radius)."""
    test = peak or PeakTest()
    th, tw = template.shape
    h, w = post.shape
    sx0, sy0 = max(0, x0 - radius), max(0, y0 - radius)
    sx1, sy1 = min(w, x0 + tw + radius), min(h, y0 + th + radius)
    region = post[sy0:sy1, sx0:sx1]
    if region.shape[0] < th or region.shape[1] < tw:
        return None, False
    surface = cv2.matchTemplate(region, template, cv2.TM_CCOEFF_NORMED)
    cv2.patchNaNs(surface, -1.0)  # flat windows; np.nan_to_num costs more than the match
    sh, sw = surface.shape
    surface[flat_positions(region, th, tw) if flats is None else
            flats.of(post, sx0, sy0, sh, sw, th, tw)] = -1.0
    _, top, _, (px, py) = cv2.minMaxLoc(surface)
    # On the search area's edge the peak may be cut off; unless that edge is the crop's edge.
    if (px == 0 and sx0 > 0) or (py == 0 and sy0 > 0) or \
            (px == sw - 1 and sx1 < w) or (py == sh - 1 and sy1 < h):
        return None, True
    if top < min_ncc or not distinct_peak(surface, px, py, peak_margin, test):
        return None, False
    fx, fy = _subpixel(surface, py, px)
    dx, dy = sx0 + fx - x0, sy0 + fy - y0
    if pre is not None and test.confirm_px > 0 and \
            not round_trip(pre, post, x0, y0, (th, tw), dx, dy, min(radius, back_radius), min_ncc,
                           peak_margin, test, flats):
        return None, False
    return (dx, dy, float(top)), False


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


def ground_field(shifts: list[WindowShift], agree_px: float) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """The crop's ground field: the affine field (crop px -> where the content sits in the post
    crop) most windows agree with within ``agree_px`` (RANSAC, seeded), and which windows do.
    Robust where a least-squares fit is pulled by roofs or a moved region."""
    if len(shifts) < 6:
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


def lean_cone(v: np.ndarray, agree_px: float, spread_deg: float,
              rounds: int = 3) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """The view direction most of the deviations ``v`` (n, 2) share, and which do: a deviation
    shares a direction when it points along it and lies within ``spread_deg`` of it or, a small
    one whose direction the windows' noise turns, within ``agree_px`` of the line. Each
    deviation's own direction is a candidate; the one most share is refined as the sum of
    those sharing it (the taller the roof, the surer its direction). None unless a strict
    majority shares it."""
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
    u = best
    for _ in range(rounds):
        mean = v[within].sum(axis=0)
        u = mean / np.hypot(*mean)
        now = sharing(u)
        if np.array_equal(now, within):
            break
        within = now
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
    quadrants = len({(s.x >= ev.w / 2, s.y >= ev.h / 2) for s in ev.trusted})
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
    quadrants = len({(s.x >= w / 2, s.y >= h / 2) for s in trusted})
    if len(trusted) < max(cfg.rescue_min_windows, 8) or quadrants < cfg.screen_min_quadrants or \
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
