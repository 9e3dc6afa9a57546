"""Finding a window's content in the other date: normalised cross-correlation over a search area,
and the tests a peak must pass to be trusted (one peak, no ridge, above the rest of the surface,
and found again from the other date)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cv2
import numpy as np

from operators.pairs.registration.registration import RegistrationConfig

# A window this flat (grey standard deviation, unit range: a quarter of an 8-bit step) is constant
# to the correlation, which is undefined there.
FLAT_STD = 1e-3


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
