"""The corner fields fitted over a consensus of the windows (``consensus_fit``): generated window
grids of the paper's 1024 px crop whose truth is known, a ground field (affine, or projective: one
corner moved, as a homography error moves it) and, on top, a region of windows moved as a
whole. The reference is the documented rule: the corners' displacement is the ground's; a region
moved within the limit is no evidence of a corner beyond it."""
from __future__ import annotations

import cv2
import numpy as np
import pytest

from operators.pairs.screening.fields import corner_residual, msac_cost
from operators.pairs.screening.windows import WindowShift
from tests.seeds import quick_first

C, STEP, N = 1024, 64, 15           # 128 px windows at half-window steps: a 15 x 15 grid
LIMIT = 8.0


def grid_of(field, region: np.ndarray, t: np.ndarray, noise: float, rng) -> list[WindowShift]:
    """Windows at the grid's centres reading ``field`` (x, y -> d) plus ``t`` inside ``region``
    (N x N bool), with Gaussian noise of ``noise`` px."""
    out = []
    for r in range(N):
        for c in range(N):
            x, y = c * STEP + 63.5, r * STEP + 63.5
            d = np.asarray(field(x, y), float) + (t if region[r, c] else 0.0)
            d = d + rng.normal(0, noise, 2)
            out.append(WindowShift(x, y, float(d[0]), float(d[1]), 0.7, r, c))
    return out


def blob(rng, share: float) -> np.ndarray:
    """A connected region of about ``share`` of the grid's cells, grown from a random cell (the
    shapes a region moved as a whole takes: compact, elongated, touching an edge or not)."""
    m = np.zeros((N, N), bool)
    m[rng.integers(N), rng.integers(N)] = True
    want = max(4, int(share * N * N))
    while m.sum() < want:
        r, c = np.argwhere(m)[rng.integers(m.sum())]
        dr, dc = ((0, 1), (1, 0), (0, -1), (-1, 0))[rng.integers(4)]
        if 0 <= r + dr < N and 0 <= c + dc < N:
            m[r + dr, c + dc] = True
    return m


def affine_ground(rng, corner_px: float):
    """An affine field whose largest |d| over the crop's corners is ``corner_px``."""
    A = rng.normal(0, 1, (2, 3))
    corners = np.array([[0, 0, 1], [C, 0, 1], [0, C, 1], [C, C, 1]], float)
    A *= corner_px / np.hypot(*(corners @ A.T).T).max()
    return lambda x, y: A @ np.array([x, y, 1.0])


def region_case(i: int) -> list[WindowShift]:
    """Case ``i``: an affine ground of up to 1.5 px anywhere (corners included), a region of 10-60 %
    of the windows moved 0.5-6 px any way, 0.05-0.4 px of noise: every true displacement within
    the limit less 2 px."""
    r = np.random.default_rng([i, 8])
    share, t, angle = r.uniform(0.1, 0.6), r.uniform(0.5, LIMIT - 2), r.uniform(0, 2 * np.pi)
    ground, noise = r.uniform(0, 1.5), r.uniform(0.05, 0.4)
    rng = np.random.default_rng(r.integers(2**31))
    region = blob(rng, share)
    return grid_of(affine_ground(rng, ground), region, t * np.array([np.cos(angle), np.sin(angle)]),
                   noise, rng)


CASES = 150     # per test: about 1.5 s each (the known cases and the breaks below lie among them); the quick loop
                # runs the first half of them, the full suite all


@pytest.mark.parametrize("cases", quick_first([range(CASES // 2), range(CASES)], ids=["half", "all"]))
def test_a_region_moved_within_the_limit_puts_no_corner_beyond_it(cases):
    """Every true displacement within the limit less 2 px: the corner bound stays within the limit
    in all but 1 of 150 cases (measured: 2 of 3,000, a region of half the windows moved 3-3.5 px,
    which the fit from all windows blends with the ground and the consensus does not clearly
    beat). Fitted over all windows only, a bilinear or quadratic field bent between region and
    ground put corners of such crops at 8-15 px: 589 of 3,000 (57 of 162 generated crops with
    regions moved 6 px or less were rejected). The quick loop counts the first half of the cases,
    the full suite all of them."""
    over = [i for i in cases
            if (lambda e: e is None or e.bound > LIMIT)(corner_residual(region_case(i), C, C))]
    assert len(over) <= 1, over


CORNERS = np.float32([[0, 0], [C, 0], [0, C], [C, C]])


def projective_ground(rng, k: int, corner_px: float):
    """A homography that moves crop corner ``k`` by ``corner_px`` and keeps the other three."""
    dst = CORNERS.copy()
    u = rng.normal(0, 1, 2)
    dst[k] += (corner_px * u / np.hypot(*u)).astype(np.float32)
    H = cv2.getPerspectiveTransform(CORNERS, dst)

    def field(x, y):
        p = H @ np.array([x, y, 1.0])
        return p[:2] / p[2] - np.array([x, y])
    return field


def corner_case(i: int) -> tuple[list[WindowShift], float]:
    """Case ``i``: the ground (most windows) reaching 9.5-16 px at a crop corner the region does not
    cover, affinely (a tilt, a scale) or projectively (one corner moved, the others kept: a
    homography error), a sinusoid of up to 3 px on top (a real scene's terrain or lens); a region
    of up to 35 % of the windows moved within the limit beside it. Returns the windows and the
    true largest corner displacement."""
    r = np.random.default_rng([i, 7])
    share, t, angle = r.uniform(0, 0.35), r.uniform(0.5, LIMIT - 2), r.uniform(0, 2 * np.pi)
    corner, projective = r.uniform(LIMIT + 1.5, 16.0), bool(r.integers(2))
    wave, noise = r.uniform(0, 3.0), r.uniform(0.05, 0.4)
    rng = np.random.default_rng(r.integers(2**31))
    region = blob(rng, share) if share > 0.02 else np.zeros((N, N), bool)
    k = int(rng.integers(4))                             # the corner that moves most
    rows = slice(N - 3, N) if CORNERS[k, 1] else slice(0, 3)
    cols = slice(N - 3, N) if CORNERS[k, 0] else slice(0, 3)
    region[rows, cols] = False                           # the region leaves that corner
    base = projective_ground(rng, k, corner) if projective else affine_ground(rng, corner)
    period, phase = rng.uniform(300, 1000), rng.uniform(0, 2 * np.pi, 2)

    def field(x, y):
        return base(x, y) + wave * np.sin(2 * np.pi * np.array([x, y]) / period + phase)
    true = max(np.hypot(*field(x, y)) for x, y in CORNERS)
    return grid_of(field, region, t * np.array([np.cos(angle), np.sin(angle)]), noise, rng), true


# Cases whose corner is read under the limit by this rule and by the fits from all windows alone
# alike (2 of these 150): a projective error whose 3 x 3 corner windows read 6-8 px against 10.4 px
# at the corner (case 4), trimmed as outliers by every field, the nearest 12 windows' included.
# An open false accept (docs/registration.md, limits), kept here so that a fix shows.
UNDER_READ = {4, 128}


@pytest.mark.parametrize("cases", quick_first([range(CASES // 2), range(CASES // 2, CASES)],
                                               ids=["first-half", "second-half"]))
def test_a_ground_field_beyond_the_limit_at_a_corner_is_seen_beside_a_region(cases):
    """The ground beyond the limit at a corner: the corner bound is beyond the limit in every case
    but the known under-read ones (``UNDER_READ``). The consensus a field starts from never hides
    the ground's corner: taken on MSAC's cost alone, without the scatter test, 31 of 2,000 such
    corners were accepted, and of these 150 cases 4 (99 and 106 besides the two)."""
    under = set()
    for i in cases:
        shifts, true = corner_case(i)
        assert true >= LIMIT + 1.5 - 3.0 * np.sqrt(2) - 1e-3
        est = corner_residual(shifts, C, C)
        if est is None or est.bound <= LIMIT:
            under.add(i)
    assert under <= UNDER_READ, sorted(under - UNDER_READ)


def test_msac_cost_caps_each_window_at_half_the_agreement_squared():
    """A window within half ``agree_px`` of the fit costs its squared distance; one farther costs the
    cap, (agree_px / 2)^2, however far (an outlier)."""
    sq = np.array([0.0, 1.0, 4.0, 100.0])
    assert msac_cost(sq, 3.0) == 0.0 + 1.0 + 2.25 + 2.25
    assert msac_cost(sq, 6.0) == 0.0 + 1.0 + 4.0 + 9.0
    assert msac_cost(sq, 1.0) == 0.0 + 0.25 * 3
    assert msac_cost(np.array([]), 3.0) == 0.0


def test_a_corner_far_from_every_window_is_read_at_their_span_with_the_span_s_standard_error():
    """Bowls of 15-30 px at the corners, windows over the crop's central half only: the quadratic is
    loose at the true corners (over CORNER_MAX_SE_PX), so it is read at the windows' span, which lies
    on the windows. A prediction there is surer than one window: its standard error is under the
    windows' noise floor inflated for their overlap (2 x 0.3 px). Of 40 such bowls the span reading
    decides six (seeds 1, 9, 14, 27, 31, 37: the field's value at the span's farthest corner, to
    within 0.3 px); in the others an affine field's looser bound at the true corners is larger and
    wins. (With the span's standard error computed as sigma / sqrt(...) it read 1.09 px.)"""
    from operators.pairs.screening.fields import corner_residual
    from operators.pairs.screening.windows import WindowShift
    decided = []
    for seed in range(40):
        rng = np.random.default_rng(seed)
        lo, hi = int(rng.integers(256, 384)), int(rng.integers(640, 768))
        u = rng.normal(size=2)
        u /= np.hypot(*u)
        a, noise = rng.uniform(15, 30), rng.uniform(0.05, 0.4)
        steps = np.arange(lo, hi + 1, 64.0)
        shifts = []
        for i, (x, y) in enumerate((x, y) for y in steps for x in steps):
            d = a * (((x - 512) / 512) ** 2 + ((y - 512) / 512) ** 2) * u + rng.normal(0, noise, 2)
            shifts.append(WindowShift(x, y, float(d[0]), float(d[1]), 0.9, i // 16, i % 16))
        at_span = a * 2 * (max(512 - steps[0], steps[-1] - 512) / 512) ** 2   # the span's farthest corner
        est = corner_residual(shifts, 1024, 1024, 2.0, 0.3, 2.0, 4.0)
        if est.se <= 1.0:
            decided.append(seed)
            assert abs(est.value - at_span) < 0.3 and est.se <= 2 * 0.3, (seed, at_span, est)
    assert decided == [1, 9, 14, 27, 31, 37]
