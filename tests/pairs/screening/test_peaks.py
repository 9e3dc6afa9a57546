"""A correlation peak judged as the screen's docstrings say (``distinct_peak``, ``peak_half_width``
and their helpers), against references written from those docstrings, over generated surfaces
whose peaks, rivals and ridges sit on either side of each threshold. Every window the screen
searches is judged by these functions; they were reached only through whole crops before. The
first 1,000 surfaces of each test run in the quick loop, all 4,000 in the full suite and in
screening's mutation oracle."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage

from operators.pairs.screening.peaks import PeakTest, _cov_eigvals, _median, distinct_peak, peak_half_width
from tests.seeds import quick_first


def ref_half_width(surface: np.ndarray, px: int, py: int, cap: int) -> int:
    """Docstring: along each axis, as far as the surface stays above half way down from the peak
    to the surface's median, at least 2 and at most ``cap``. The box reaches the first step below
    half (a peak one px wide has the least half-side, 2), or one past the last value a ray has."""
    top = float(surface[py, px])
    half = 0.5 * (top + float(np.median(surface)))
    h, w = surface.shape
    width = 2
    for sx, sy in ((1, 0), (-1, 0), (0, 1), (0, -1)):
        step = 1
        while step <= cap and 0 <= px + sx * step < w and 0 <= py + sy * step < h \
                and float(surface[py + sy * step, px + sx * step]) >= half:
            step += 1
        width = max(width, step)
    return min(width, max(2, cap))


def ref_distinct(surface: np.ndarray, px: int, py: int, margin: float, test: PeakTest) -> tuple[bool, str]:
    """Docstring: no other maximum within ``margin`` of the top (the region above top - margin is
    one 8-connected region), that region no ridge (longer than twice the box and three times as
    long as wide: a uniform segment's length from its covariance), and the top ``sigma`` standard
    deviations above the mean of the surface outside the peak's own box; the lenient form (no
    margin, no sigma) only asks for 8 values outside the box."""
    box = max(1, test.box_px)
    top = float(surface[py, px])
    if margin <= 0 and test.sigma <= 0 and surface.size >= (2 * box + 1) ** 2 + 8:
        return True, "lenient"
    if margin > 0:
        labels, n = ndimage.label(surface > top - margin, structure=np.ones((3, 3)))
        if n > 1:
            return False, "rival"
        ys, xs = np.nonzero(labels == labels[py, px])
        if xs.size >= 5:
            ev = np.linalg.eigvalsh(np.cov(np.stack([xs, ys]).astype(np.float64)))
            if 2 * np.sqrt(3 * max(ev[1], 0)) > 2 * box and ev[1] > 9 * max(ev[0], 1 / 12):
                return False, "ridge"
    rest = outside_box(surface, px, py, box)
    if rest.size < 8:
        return False, "no rest"
    return top >= float(rest.mean()) + test.sigma * float(rest.std()), "sigma"


def outside_box(surface: np.ndarray, px: int, py: int, box: int) -> np.ndarray:
    """The surface's values outside the peak's own box (half-width from ``ref_half_width``)."""
    g = ref_half_width(surface, px, py, box)
    yy, xx = np.mgrid[:surface.shape[0], :surface.shape[1]]
    return surface[(np.abs(yy - py) > g) | (np.abs(xx - px) > g)]


def z_score(surface: np.ndarray, px: int, py: int, box: int) -> float | None:
    """How many standard deviations the top stands above the rest (outside the peak's box)."""
    rest = outside_box(surface, px, py, max(1, box))
    if rest.size < 8 or float(rest.std()) == 0:
        return None
    return (float(surface[py, px]) - float(rest.mean())) / float(rest.std())


def gauss(xx, yy, cx, cy, s_long, s_short=None, angle=0.0):
    s_short = s_long if s_short is None else s_short
    c, s = np.cos(angle), np.sin(angle)
    u, v = (xx - cx) * c + (yy - cy) * s, -(xx - cx) * s + (yy - cy) * c
    return np.exp(-0.5 * ((u / s_long) ** 2 + (v / s_short) ** 2))


KINDS = ("one peak", "rival near the margin", "ridge", "plateau", "peak at the edge", "noise", "thin",
         "small", "constant", "dyadic steps")


def surfaces(n: int, seed: int):
    """Correlation-like surfaces (float32, as matchTemplate gives), each with the judge's settings:
    one peak of any width; a second peak within a few hundredths of the margin below the top; a
    ridge (an elongated peak, any direction, near the length and aspect limits); a plateau; a peak
    on the surface's edge; noise alone; thin (1-4 px: a search at the crop's edge) and small ones
    (5-9 px), where what is left outside the peak's box is a handful of values and the lenient form's
    size test is at its bound; constant ones (a flat search area reads -1 everywhere); values in
    quarters, so that values equal to the half-way level or to the top less the margin occur. A
    third of them get ``sigma`` within 0.5 % of the top's own standard score, either side."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        h, w = (int(v) for v in rng.integers(5, 41, 2))
        if kind == "thin":
            h, w = (int(v) for v in rng.permutation([int(rng.integers(1, 5)), int(rng.integers(5, 40))]))
            if rng.random() < 0.5:      # one row of 11-14: 6-9 values outside a 5 px box
                h, w = (int(v) for v in rng.permutation([1, int(rng.integers(11, 15))]))
        elif kind == "small":
            h, w = (int(v) for v in rng.integers(3, 10, 2))
        yy, xx = np.mgrid[:h, :w].astype(np.float64)
        surf = rng.normal(0.0, float(rng.choice([0.005, 0.03, 0.12])), (h, w))
        margin = float(rng.choice([0.0, 0.01, 0.03, 0.05, 0.1]))
        box = int(rng.integers(0, 9))
        cx, cy = rng.uniform(0, w - 1), rng.uniform(0, h - 1)
        if kind == "peak at the edge":
            cx = float(rng.choice([0, w - 1]))
        width = rng.uniform(0.4, 8.0)
        if kind == "ridge":
            margin = float(rng.choice([0.03, 0.05, 0.1, 0.2]))     # the ridge test needs a margin
            long_ = rng.uniform(0.5, 3.0) * max(1, box)
            surf += 0.9 * gauss(xx, yy, cx, cy, long_, rng.uniform(0.3, 2.0), rng.uniform(0, np.pi))
        elif kind != "noise":
            surf += 0.9 * gauss(xx, yy, cx, cy, width)
        if kind in ("thin", "small"):
            box = int(rng.integers(0, 3))
            if rng.random() < 0.5:
                margin = 0.0
        if kind == "constant":
            surf = np.full((h, w), float(rng.choice([-1.0, 0.0, 0.5])))
        if kind == "dyadic steps":
            surf = np.round(np.clip(surf, -1, 1) * 4) / 4
            margin = float(rng.choice([0.25, 0.5]))
        if kind == "plateau":
            surf = np.minimum(surf, 0.9 - rng.uniform(0.0, 0.2))
        if kind == "rival near the margin":
            ang, dist = rng.uniform(0, 2 * np.pi), rng.uniform(2.0, 4.0) * width + 2
            bump = gauss(xx, yy, cx + dist * np.cos(ang), cy + dist * np.sin(ang), rng.uniform(0.5, 3.0))
            at = np.unravel_index(int(np.argmax(bump)), bump.shape)
            target = float(surf.max()) - (margin or 0.05) + rng.uniform(-0.02, 0.02)
            if bump[at] > 1e-3:                 # the rival's centre on the surface, or near it
                surf += (target - float(surf[at])) * bump / float(bump[at])
        surf = np.clip(surf, -1.0, 1.0).astype(np.float32)
        py, px = (int(v) for v in np.unravel_index(int(np.argmax(surf)), surf.shape))
        sigma = float(rng.choice([0.0, 1.0, 2.0, 3.0]))
        if kind in ("thin", "small", "constant") and rng.random() < 0.5:
            sigma = 0.0
        if i % 3 == 0:
            z = z_score(surf, px, py, box)
            if z is not None and z > 0:
                sigma = z * (1.0 + float(rng.choice([-1, 1])) * rng.uniform(1e-4, 5e-3))
        yield kind, surf, px, py, margin, PeakTest(box, sigma, 3.0)


N = 1000             # surfaces per chunk; the first chunk runs in the quick loop, the others as `seeds`
CHUNKS = quick_first(range(4))


@pytest.mark.parametrize("chunk", CHUNKS)
def test_the_peak_box_reaches_as_far_as_the_surface_stays_above_half_way_down(chunk):
    rng = np.random.default_rng(7 + chunk)
    n = 0
    for kind, surf, px, py, _, _ in surfaces(N, 11 + 100 * chunk):
        for x, y in ((px, py), (int(rng.integers(surf.shape[1])), int(rng.integers(surf.shape[0])))):
            cap = int(rng.integers(0, 12))
            assert peak_half_width(surf, x, y, cap) == ref_half_width(surf, x, y, cap), (kind, x, y, cap)
            n += 1
    assert n == 2 * N


@pytest.mark.parametrize("chunk", CHUNKS)
def test_a_peak_is_distinct_exactly_as_documented_on_either_side_of_every_threshold(chunk):
    """1,000 generated surfaces per chunk (4,000 in the full suite and the mutation oracle): the
    screen's verdict equals the docstring's on each, and each of the rule's decisive tests (a rival
    region, a ridge, the standard score, too little outside the box, the lenient form) decides both
    ways often enough to have been tried at its edge."""
    seen: dict[tuple[str, bool], int] = {}
    near_sigma = 0
    for kind, surf, px, py, margin, test in surfaces(N, 3 + 100 * chunk):
        want, why = ref_distinct(surf, px, py, margin, test)
        assert distinct_peak(surf, px, py, margin, test) == want, (kind, why, margin, test, px, py, surf.shape)
        seen[(why, want)] = seen.get((why, want), 0) + 1
        z = z_score(surf, px, py, test.box_px) if why == "sigma" else None
        near_sigma += z is not None and test.sigma > 0 and abs(test.sigma / z - 1) < 0.006
    assert seen.get(("rival", False), 0) >= 100 and seen.get(("ridge", False), 0) >= 10, seen
    assert seen.get(("no rest", False), 0) >= 15 and seen.get(("lenient", True), 0) >= 25, seen
    assert seen.get(("sigma", True), 0) >= 300 and seen.get(("sigma", False), 0) >= 75, seen
    assert near_sigma >= 150, near_sigma


def test_the_helpers_give_numpy_s_values():
    rng = np.random.default_rng(5)
    for n in range(1, 400):
        a = rng.normal(size=n).astype(np.float32)
        if n % 3 == 0:
            a = np.round(a, 1)                  # ties
        assert _median(a.reshape(1, -1)) == float(np.median(a)), n
    for n in range(2, 300):
        xs, ys = rng.integers(0, 40, n), rng.integers(0, 40, n)
        if n % 4 == 0:
            ys = 2 * xs + 3                     # on a line: one eigenvalue 0
        got = _cov_eigvals(xs, ys)
        want = np.linalg.eigvalsh(np.cov(np.stack([xs, ys]).astype(np.float64)))
        assert got == pytest.approx(tuple(want), abs=1e-9, rel=1e-9), n


# equivalent mutant: core/NumberReplacer on `for ray in (surface[py, px + 1:px + 1 + cap], surface[py, max(0, px - cap):px][::-1],`: (the rays' far ends, px + 0 + cap or max(0, px - cap + 1)) a ray one value shorter at its far end gives the same half-side: its last value can only make the box cap + 1, and the result is capped at max(2, cap) (the rays' starts, px + 1, are killed)
# equivalent mutant: core/NumberReplacer on `surface[py + 1:py + 1 + cap, px], surface[max(0, py - cap):py, px][::-1]):`: as the line above, along y
# equivalent mutant: core/ReplaceComparisonOperator_GtE_Gt on `if peak_margin <= 0 and test.sigma <= 0 and surface.size >= (2 * max(1, test.box_px) + 1) ** 2 + 8:`: at exactly (2b + 1)^2 + 8 values the full test gives True too: the peak's box holds at most (2b + 1)^2 of them when b >= 2, and with b = 1 the size is 17, a 1 x 17 surface, whose box holds at most 5, so at least 8 are left and the top (the maximum) is at least their mean
# equivalent mutant: core/NumberReplacer on `if peak_margin <= 0 and test.sigma <= 0 and surface.size >= (2 * max(1, test.box_px) + 1) ** 2 + 8:`: (+ 8 -> + 9) as the line above: one value more before the shortcut is taken changes nothing at the bound (the others on the line are killed here)
# equivalent mutant: core/ReplaceBinaryOperator_Div_FloorDiv on `if length > 2 * max(1, test.box_px) and ev[1] > 9.0 * max(ev[0], 1.0 / 12):`: (1.0 // 12 = 0) the floor of the smaller eigenvalue matters only where ev[1] <= 9/12 = 0.75, and a region of 5 or more pixels (the test above this one) that is that nearly straight (ev[0] < 1/12) lies along a line with distinct integer steps, whose larger variance is at least 2
# equivalent mutant: core/NumberReplacer on `if length > 2 * max(1, test.box_px) and ev[1] > 9.0 * max(ev[0], 1.0 / 12):`: (the floor 1.0 / 12 made 0, 2/12, 1/11 or 1/13; the box max(1, ...) made max(0, ...) or max(2, ...)) as the line above: where the aspect test holds, ev[1] > 9 x the floor and the region of 5 or more pixels is nearly straight, so ev[1] >= 2 and its length 2 sqrt(3 ev[1]) > 4, past either box (the factors 2 and 9.0 are killed here)
# equivalent mutant: core/NumberReplacer on `g = peak_half_width(surface, px, py, max(1, test.box_px))`: (max(2, ...)) peak_half_width's result is at least 2 and at most max(2, cap): a cap of 1 and of 2 give the same half-side
# equivalent mutant: core/ReplaceBinaryOperator_Add_FloorDiv on `for ray in (surface[py, px + 1:px + 1 + cap], surface[py, max(0, px - cap):px][::-1],`: (px // 1 + cap = px + cap) the ray's far end one value shorter, as NumberReplacer's on this line (the start, px // 1, is killed)
# equivalent mutant: core/ReplaceBinaryOperator_Add_Pow on `for ray in (surface[py, px + 1:px + 1 + cap], surface[py, max(0, px - cap):px][::-1],`: (px ** 1 + cap = px + cap) as the line above
# equivalent mutant: core/ReplaceBinaryOperator_Add_Mul on `for ray in (surface[py, px + 1:px + 1 + cap], surface[py, max(0, px - cap):px][::-1],`: (px * 1 + cap = px + cap) as the line above
# equivalent mutant: core/ReplaceBinaryOperator_Add_FloorDiv on `surface[py + 1:py + 1 + cap, px], surface[max(0, py - cap):py, px][::-1]):`: (py // 1 + cap) as along x
# equivalent mutant: core/ReplaceBinaryOperator_Add_Pow on `surface[py + 1:py + 1 + cap, px], surface[max(0, py - cap):py, px][::-1]):`: (py ** 1 + cap) as along x
# equivalent mutant: core/ReplaceBinaryOperator_Add_Mul on `surface[py + 1:py + 1 + cap, px], surface[max(0, py - cap):py, px][::-1]):`: (py * 1 + cap) as along x
# equivalent mutant: core/ReplaceComparisonOperator_Gt_GtE on `if length > 2 * max(1, test.box_px) and ev[1] > 9.0 * max(ev[0], 1.0 / 12):`: (ev[1] >= 9 x ...) an exact tie of two computed variances: 0.75 is below what a region of 5 or more nearly collinear pixels reaches (2), and a ratio of exactly 9 takes a region no grid gives as a bar (a x b pixels: a² = 9b² - 8 has only a = b = 1); none of the 4,000 generated regions met it (drawn by the sample of seed 4243)
# equivalent mutant: core/ReplaceComparisonOperator_Gt_NotEq on `if n > 2:               # background + the peak's own region: anything more is a rival`: n counts the regions above top - margin plus the background label; the peak's own pixel (top > top - margin, margin > 0; its one caller patches NaNs to -1 first) is always among them, so n >= 2 and `> 2` is `!= 2` (cv2.connectedComponents gives 2 for an all-high surface, 1 only for an all-low one, which the peak's own value rules out)
