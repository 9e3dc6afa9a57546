"""Ground windows measured without their leaning roofs (``operators/pairs/screening/roofs.py``),
the lean's direction taken from most of the windows (``lean_cone``), and what both do to a
screened crop. Generated cases with known truth: real NAIP texture as the ground, moved by a
sub-pixel shift; a roof (plain or textured) over part of the window, leaning 3-30 px along a
drawn direction."""
from __future__ import annotations

import cv2
import numpy as np
import pytest
from hypothesis import assume, example, given, settings, strategies as st

from benchmarks._fields import make_case, scene
from operators.pairs.registration.registration import RegistrationConfig
from operators.pairs.screening.roofs import (ROOF_GROW_PX, UNEXPLAINED_FLOOR, masked_shift,
                                            offset_error, roof_pixels)
from operators.pairs.screening.lean import Lean, LeanReading, lean_cone, lean_seen, lean_split, one_roof_share
from operators.pairs.screening.screening import DISPLACED, screen_alignment
from operators.pairs.screening.windows import window_centre
from tests.seeds import quick_first

WIN = 128           # the screening window at the paper's 1024 px crop
PAD = 48


def _shifted(img: np.ndarray, dx: float, dy: float) -> np.ndarray:
    """img's content moved by (dx, dy): out(q) = img(q - d)."""
    M = np.float32([[1, 0, dx], [0, 1, dy]])
    return cv2.warpAffine(img, M, img.shape[::-1], flags=cv2.INTER_LINEAR,
                          borderMode=cv2.BORDER_REFLECT)


def leaning_window(seed: int, ground: tuple, lean_px: float, deg: float, plain: bool,
                   share: float):
    """(pre crop, post crop, window centre, the window's pixels that are roof or facade in
    either date): the ground moved by
    ``ground`` px, a roof covering about ``share`` of the window moved ``lean_px`` along
    ``deg`` further (its facade, the swept band, dark)."""
    rng = np.random.default_rng(seed)
    side = WIN + 2 * PAD
    src = scene("naip", 1024)
    y, x = rng.integers(0, src.shape[0] - side), rng.integers(0, src.shape[1] - side)
    world = np.ascontiguousarray(src[y:y + side, x:x + side]).astype(np.float32)
    a = int(round(WIN * np.sqrt(share)))
    r0, c0 = PAD + rng.integers(0, WIN - a + 1), PAD + rng.integers(0, WIN - a + 1)
    roof_mask = np.zeros((side, side), np.float32)
    roof_mask[r0:r0 + a, c0:c0 + a] = 1
    if plain:
        roof = np.full_like(world, rng.uniform(0.5, 0.95))
    else:
        roof = np.clip(1.4 * np.roll(world, side // 3, axis=(0, 1)) - 0.1, 0, 1)
    pre = np.where(roof_mask > 0, roof, world).astype(np.float32)
    u = np.array([np.cos(np.radians(deg)), np.sin(np.radians(deg))])
    post = _shifted(world, *ground)
    d = np.asarray(ground) + lean_px * u
    swept = np.zeros_like(roof_mask)
    for t in np.linspace(0, lean_px, int(np.ceil(lean_px)) + 1):
        swept = np.maximum(swept, _shifted(roof_mask, *(np.asarray(ground) + t * u)))
    post = np.where(swept > 0.5, np.float32(0.2), post)
    top = _shifted(roof_mask, *d) > 0.5
    post = np.where(top, _shifted(roof, *d), post).astype(np.float32)
    c = window_centre(PAD, WIN)
    changed = (roof_mask > 0) | (swept > 0.5) | top     # what the ground does not explain
    return pre, post, (c, c), changed[PAD:PAD + WIN, PAD:PAD + WIN]


def plain_shift(template, post, cx, cy):
    """The window's reading from every pixel, as the screen's search gives it (NCC peak,
    parabolic refinement)."""
    r = 8
    x0, y0 = int(round(cx - (WIN - 1) / 2)), int(round(cy - (WIN - 1) / 2))
    region = post[y0 - r:y0 + WIN + r, x0 - r:x0 + WIN + r]
    s = cv2.matchTemplate(region, template, cv2.TM_CCOEFF_NORMED)
    _, _, _, (px, py) = cv2.minMaxLoc(s)
    fx = fy = 0.0
    if 0 < px < s.shape[1] - 1:
        m, c_, p = s[py, px - 1], s[py, px], s[py, px + 1]
        fx = 0.5 * (m - p) / (m - 2 * c_ + p)
    if 0 < py < s.shape[0] - 1:
        m, c_, p = s[py - 1, px], s[py, px], s[py + 1, px]
        fy = 0.5 * (m - p) / (m - 2 * c_ + p)
    return px + fx - r, py + fy - r


CASES = dict(seed=st.integers(0, 10**6),
             gx=st.floats(-1.5, 1.5), gy=st.floats(-1.5, 1.5),
             lean_px=st.floats(3.0, 30.0), deg=st.floats(0, 360),
             plain=st.booleans(), share=st.floats(0.1, 0.35))


@settings(max_examples=40, deadline=None, derandomize=False)
@given(**CASES)
@example(seed=378, gx=0.0, gy=1.5, lean_px=3.0, deg=0.0, plain=True, share=0.25)        # 0.39 px
@example(seed=541055, gx=1.5, gy=1.5, lean_px=3.23, deg=270.0, plain=True, share=0.181)  # 0.48 px
def test_a_ground_window_is_read_without_its_roof(seed, gx, gy, lean_px, deg, plain, share):
    """The roof's pixels found and the window read on the rest, from the reading the whole
    window gives (pulled by the roof; within 2 px of the ground, as the screen asks), wherever
    the roof leans, how far, plain or textured, and whatever it covers: within 0.6 px of the
    ground's true shift. Counted in scratch over 13,500 windows drawn so (about 8,300 measured
    again): median error 0.005 px, 99th percentile 0.05, the worst 0.27 (a textured roof
    leaning 3-5 px, whose edge the mask misses). The range's corners do worse: CI's moving
    mutation sample, running this test unmutated, drew a window at 0.39 px (the first example:
    ground 1.5 px off, a plain roof leaning 3 px along an axis), and over 4,903 windows drawn at
    the corners (ground 0 or 1.5 px off each way, plain or textured roofs leaning 3-5 px along
    an axis) the median was 0.007 px, the 99th percentile 0.31, the worst 0.48 (the second
    example), 29 over 0.35, every one a plain roof. A window may be left as it read (None: too
    little ground left, or no clear reading on it) only when roof and facade cover over 12 %
    of it (the least so left in that count: 15.5 %). A plain roof's flat inside may stay in:
    it pulls nothing."""
    pre, post, (cx, cy), changed = leaning_window(seed, (gx, gy), lean_px, deg, plain, share)
    template = pre[PAD:PAD + WIN, PAD:PAD + WIN]
    u = np.array([np.cos(np.radians(deg)), np.sin(np.radians(deg))])
    start = plain_shift(template, post, cx, cy)
    base = (gx + 0.1, gy - 0.1)        # the ground field's reading, a little off
    # The screen measures again only a window within screen_agree_px of the ground field (one
    # farther off is a lean or a displacement of its own).
    assume(np.hypot(start[0] - base[0], start[1] - base[1]) <= 2.0)
    roof = roof_pixels(template, post, cx, cy, base, u, lean_px + 2.0)
    got = masked_shift(template, post, cx, cy, start, ~roof,
                       2.0 + float(np.hypot(start[0] - base[0], start[1] - base[1])))
    if got is None:     # too little ground left: the window leaves the evidence
        assert changed.mean() > 0.12, changed.mean()
        return
    assert np.hypot(got[0] - gx, got[1] - gy) <= 0.6, (start, got, (gx, gy))


def test_the_roof_pulls_the_plain_reading():
    """The cases above are ones the whole window misreads (else the masked reading proves
    nothing): over 40 drawn windows the plain reading is off the ground by more than 0.3 px
    in most, by more than 1 px in many."""
    rng = np.random.default_rng(7)
    off = []
    for seed in range(40):
        g = rng.uniform(-1.5, 1.5, 2)
        pre, post, (cx, cy), _ = leaning_window(seed, tuple(g), rng.uniform(3, 30),
                                                rng.uniform(0, 360), bool(seed % 2),
                                                rng.uniform(0.1, 0.35))
        s = plain_shift(pre[PAD:PAD + WIN, PAD:PAD + WIN], post, cx, cy)
        off.append(np.hypot(s[0] - g[0], s[1] - g[1]))
    off = np.array(off)
    assert np.mean(off > 0.3) >= 0.6 and np.mean(off > 1.0) >= 0.25, np.round(off, 2)


def test_a_window_with_too_little_ground_is_not_read():
    pre, post, (cx, cy), roof = leaning_window(1, (0.3, -0.2), 12.0, 40.0, True, 0.3)
    template = pre[PAD:PAD + WIN, PAD:PAD + WIN]
    few = np.zeros_like(roof)
    few[:40, :40] = True
    assert masked_shift(template, post, cx, cy, (0.0, 0.0), few, 3.0) is None


@pytest.mark.parametrize("win, box", [(128, 9), (64, 5), (24, 3), (16, 3)])
def test_a_pixel_s_error_is_its_neighbourhood_s_an_odd_box_of_a_sixteenth_of_the_window(win, box):
    """One differing pixel spreads over the box about it, odd-sided (centred) and at least 3."""
    template = np.zeros((win, win), np.float32)
    template[win // 2, win // 2] = 1.0
    post = np.zeros((4 * win, 4 * win), np.float32)
    err = offset_error(template, post, 2 * win - 0.5, 2 * win - 0.5, (0.0, 0.0))
    ys, xs = np.nonzero(err > 0)
    assert (xs.max() - xs.min() + 1, ys.max() - ys.min() + 1) == (box, box)
    assert (xs.min() + xs.max()) / 2 == (ys.min() + ys.max()) / 2 == win // 2      # centred


@pytest.mark.parametrize("source", ["naip", "s2"])
def test_content_the_ground_leaves_unexplained_is_out_from_a_tenth_of_the_window_s_contrast(source):
    """Noise-free imagery (the ground exact: the window's median error is 0): a patch whose post
    content differs by half the window's contrast is out (with its grown edge); one differing by a
    twentieth, under the floor of a tenth, is not, and nothing else is."""
    win, cx, cy = WIN, 300.0 - 0.5, 400.0 - 0.5        # window centre (pixel-centred grid)
    crop = scene(source, 1024).astype(np.float32)
    template = cv2.getRectSubPix(crop, (win, win), (cx, cy))
    s = float(template.std())
    x0, y0 = int(cx + 0.5) - win // 2, int(cy + 0.5) - win // 2      # the window's first pixel
    for gain, out in ((0.5, True), (0.05, False)):
        post = crop.copy()
        post[y0 + 50:y0 + 70, x0 + 60:x0 + 80] += gain * s
        roof = roof_pixels(template, post, cx, cy, (0.0, 0.0), np.array([1.0, 0.0]), 0.0)
        if out:
            assert roof[55:65, 65:75].all()
            assert not roof[:30].any() and not roof[100:].any()             # only near the patch
            grown = 20 + 2 * (max(3, win // 16) // 2) + 2 * ROOF_GROW_PX
            assert roof.any(axis=1).sum() <= grown
        else:
            assert not roof.any(), (gain, UNEXPLAINED_FLOOR)


@pytest.mark.parametrize("source", ["naip", "s2"])
def test_a_whole_window_moved_under_a_pixel_is_read_to_a_tenth_through_a_gain_and_offset(source):
    """No roof, every pixel used: 20 drawn windows, each moved by a drawn sub-pixel shift, the later
    date brighter by a gain and an offset (each window standardised over its pixels): read within
    0.1 px (0.06 px at most on NAIP; the reference warp is cubic, the reading's bilinear)."""
    crop = scene(source, 1024).astype(np.float32)
    rng = np.random.default_rng(11)
    err = []
    for _ in range(20):
        cx, cy = rng.uniform(200, 800, 2)
        d = rng.uniform(-1.5, 1.5, 2)
        post = cv2.warpAffine(crop, np.float32([[1, 0, d[0]], [0, 1, d[1]]]), crop.shape[::-1],
                              flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REFLECT)
        template = cv2.getRectSubPix(crop, (WIN, WIN), (float(cx), float(cy)))
        got = masked_shift(template, 1.3 * post + 0.1, cx, cy, (0.0, 0.0), np.ones((WIN, WIN), bool), 3.0)
        assert got is not None
        err.append(np.hypot(got[0] - d[0], got[1] - d[1]))
    assert max(err) < 0.1, np.round(err, 3)


def reference_cone(v, u_true, spread_deg):
    ang = np.degrees(np.arctan2(v[:, 1], v[:, 0]) - np.arctan2(u_true[1], u_true[0]))
    return np.abs((ang + 180) % 360 - 180) <= spread_deg


@settings(max_examples=300, deadline=None, derandomize=False)
@given(deg=st.floats(0, 360), n_in=st.integers(1, 40), n_out=st.integers(0, 40),
       seed=st.integers(0, 10**6))
def test_the_lean_is_the_direction_most_windows_share(deg, n_in, n_out, seed):
    """Deviations drawn within 8 deg of a view direction (3-30 px) and others at least 50 deg
    from it (3.5-30 px, any side: beyond ``agree_px`` of its line): the direction is found and exactly the first are within it
    when they are a strict majority; otherwise there is no lean. (Before, one window off the
    direction, a real change or a match on a facade, vetoed the crop's whole lean.)"""
    rng = np.random.default_rng(seed)
    u = np.array([np.cos(np.radians(deg)), np.sin(np.radians(deg))])
    a_in = np.radians(deg + rng.uniform(-8, 8, n_in))
    a_out = np.radians(deg + rng.choice([-1, 1], n_out) * rng.uniform(50, 180, n_out))
    m_in, m_out = rng.uniform(3, 30, n_in), rng.uniform(3.5, 30, n_out)
    v = np.concatenate([np.c_[np.cos(a_in), np.sin(a_in)] * m_in[:, None],
                        np.c_[np.cos(a_out), np.sin(a_out)] * m_out[:, None]])
    order = rng.permutation(len(v))
    v = v[order]
    truth = (order < n_in)
    got = lean_cone(v, 2.0, 20.0)
    if n_in > n_out:
        assert got is not None
        found, within = got
        assert np.degrees(np.arccos(np.clip(found @ u, -1, 1))) <= 8.0
        assert np.array_equal(within, truth)
        assert np.array_equal(within, reference_cone(v, u, 20.0))
    elif got is not None:
        # No majority in the drawn direction: any direction found is another majority's,
        # which the outliers (spread anywhere 50-180 deg off) may happen to form.
        assert 2 * int(got[1].sum()) > len(v) and not got[1][truth].all()


def shares(v, u, agree_px, spread_deg):
    """Which deviations share direction ``u``, as ``lean_cone`` documents it: pointing along it,
    within ``spread_deg`` of it or within ``agree_px`` of its line."""
    along = v @ u
    across = np.abs(v[:, 0] * u[1] - v[:, 1] * u[0])
    return (along > 0) & (across <= np.maximum(agree_px, along * np.sin(np.radians(spread_deg))))


def test_the_lean_is_the_sum_of_the_deviations_that_share_it():
    """The direction returned is the sum of the deviations it names, and they are exactly the
    ones sharing it: a fixed point, over 3,000 generated deviation sets (1-29 windows, directions
    anywhere, around one direction, or Gaussian; 780 with a majority). Refined for 3 rounds, 16
    stopped short of it (up to 6 rounds were needed)."""
    rng = np.random.default_rng(2026)
    found = 0
    for t in range(3000):
        n = int(rng.integers(1, 30))
        if t % 3 == 0:
            v = rng.normal(0, 8, (n, 2))
        else:
            a = rng.uniform(0, 2 * np.pi, n) if t % 3 == 1 else rng.normal(0.3, 0.6, n)
            v = np.c_[np.cos(a), np.sin(a)] * rng.uniform(0.5, 30, n)[:, None]
        got = lean_cone(v, 2.0, 20.0)
        if got is None:
            continue
        found += 1
        u, within = got
        assert np.array_equal(within, shares(v, u, 2.0, 20.0)), t
        total = v[within].sum(axis=0)
        assert np.allclose(u, total / np.hypot(*total)), t
    assert found > 700, found


def test_a_lean_needs_a_majority():
    v = np.array([[5.0, 0.0], [6.0, 0.5], [0.0, 5.0], [-5.0, 0.0]])
    assert lean_cone(v, 2.0, 20.0) is None
    v = np.array([[5.0, 0.0], [6.0, 0.5], [7.0, -0.3], [0.0, 5.0], [-5.0, 0.0]])
    u, within = lean_cone(v, 2.0, 20.0)
    assert within.tolist() == [True, True, True, False, False] and u[0] > 0.99


@pytest.mark.parametrize("seed, lean_over", quick_first([(1, 8.0), (3, 8.0), (5, 8.0), (10, 3.0), (82, 5.0)]))
def test_a_lean_crop_reports_the_ground_s_residual(seed, lean_over):
    """Generated off-nadir crops at 1024 px, ground exact: the reported residual is the
    ground's (within 1 px of 0), the lean its own figure. Read with roofs in the windows, crops
    1, 3 and 5 reported 1.46, 1.33 and 1.18 px; 10 and 82, whose roofs pull a ground window
    past ``screen_agree_px`` (3.6 px), reported that pull until it was read again for the report
    (``ground_as_reported``). The lean's direction is the drawn one (1-2.4 degrees off)."""
    case = make_case("lean", 1024, seed)
    assert case.truth_px == 0.0
    r = screen_alignment(case.pre, case.post, case.valid, RegistrationConfig(crop_size=1024))
    assert r.reject_reason is None and r.lean is not None, r.reject_reason
    assert r.residual_px <= 1.0, r.residual_px
    assert r.lean.max_px > lean_over
    # Its direction, as recorded (``lean_deg``: 0 = +x, 90 = +y, in [0, 360)), the drawn one.
    assert 0.0 <= r.lean.deg < 360.0, r.lean.deg
    assert abs((r.lean.deg - case.lean_deg + 180.0) % 360.0 - 180.0) <= 5.0, (r.lean.deg,
                                                                             case.lean_deg)


@pytest.mark.parametrize("seed", quick_first([7, 88, 114]))
def test_a_window_pulled_across_or_against_the_lean_is_read_for_the_report(seed):
    """Generated lean crops (ground exact) whose largest ground window is pulled 1.1-1.6 px off
    the ground field across or against the lean (a facade or a roof's edge in it, not the roof's
    own pull along the lean): read again without them, the report is the ground's, within 1 px.
    Read along the lean only, they reported 1.09, 1.71 and 1.26 px."""
    case = make_case("lean", 1024, seed)
    assert case.truth_px == 0.0
    r = screen_alignment(case.pre, case.post, case.valid, RegistrationConfig(crop_size=1024))
    assert r.reject_reason is None and r.lean is not None, r.reject_reason
    assert r.residual_px <= 1.0, r.residual_px


@pytest.mark.parametrize("seed", quick_first([9, 12, 29]))
def test_a_lean_under_the_limit_not_set_apart_is_read_for_the_report(seed):
    """Generated lean crops at 1024 px, ground exact, whose leaning windows the screen does not
    set apart (9 and 29: two windows, under ``screen_region_windows``; 12: five windows under the
    limit enclosing no ground): accepted as before, and now the ground's residual reported (3.57,
    3.83 and 6.07 px before: the roofs'). Not recorded as the crop's lean (``lean_seen``)."""
    case = make_case("lean", 1024, seed)
    assert case.truth_px == 0.0
    r = screen_alignment(case.pre, case.post, case.valid, RegistrationConfig(crop_size=1024))
    assert r.reject_reason is None, r.reject_reason
    assert r.residual_px <= 1.0, r.residual_px
    assert r.lean is None


ONE_ROOF = one_roof_share(1024, 1024, RegistrationConfig(crop_size=1024))


@settings(max_examples=600, deadline=None)
@given(off=st.integers(0, 7), lost=st.integers(0, 7), inside=st.integers(0, 6),
       max_px=st.sampled_from([0.5, 2.0, 7.99, 8.0, 8.01, 9.0, 25.0]) | st.floats(0.1, 30.0),
       share=st.sampled_from([0.0, ONE_ROOF, float(np.nextafter(ONE_ROOF, 1.0)), 0.05])
       | st.floats(0.0, 0.1))
@example(off=3, lost=0, inside=3, max_px=2.0, share=0.05)        # interleaved: set apart
@example(off=3, lost=0, inside=2, max_px=8.0, share=0.0)         # one roof at the limit: seen
@example(off=2, lost=0, inside=6, max_px=8.0, share=0.0)         # two windows: seen
@example(off=3, lost=1, inside=6, max_px=8.01, share=0.0)        # two along, over: neither
def test_a_lean_is_set_apart_or_only_reported_as_documented(off, lost, inside, max_px, share):
    """What becomes of a reading of leaning windows (``lean_split``, then ``lean_seen``), against
    a reference written from the documented rules: set apart from the ground when at least
    ``screen_region_windows`` (3) windows lie clearly off the field and as many along the lean,
    and they enclose 3 ground windows or move one roof at most past the limit (8 px); otherwise,
    with a window along the lean and all of them within the limit (the boundary included), read
    for the report only; otherwise neither."""
    cfg = RegistrationConfig(crop_size=1024)
    core = max(0, off - lost)
    lean = Lean(max_px / 2, max_px, 30.0, core, share)
    reading = LeanReading([], lean, off, core, inside)
    split = lean_split(reading, 1024, 1024, cfg)
    seen = lean_seen(reading, cfg) if split is None else None
    want_split = off >= 3 and core >= 3 and (inside >= 3 or (share <= ONE_ROOF and max_px > 8.0))
    want_seen = not want_split and core >= 1 and max_px <= 8.0
    assert (split is not None) == want_split
    assert (seen is not None) == want_seen
    if want_split:
        assert split[1] is lean
    if want_seen:
        assert seen is lean


@pytest.mark.slow
def test_generated_lean_crops_report_the_ground_s_residual():
    """Twenty generated lean crops at 1024 px (seeds 0-19: one lean per crop, 3-30 px per building,
    plain and textured roofs, clouds, nodata and new buildings on half of them), ground exact:
    all accepted, and of those most report the ground's residual within 1 px. Measured: 20
    accepted, 20 within 1 px; 19 when the report read again only windows pulled along the lean
    (seed 7: 1.09 px), 17 when a lean under the limit that the screen does not set apart was
    reported with its roofs (seeds 9 and 12), 15 when the report read the roof-pulled windows as
    they were (seeds 6 and 10 too). Issue 48 asks 90 %: the benchmark's
    figure, docs/benchmarks/screening-fields.md."""
    cfg = RegistrationConfig(crop_size=1024)
    accepted, ground = [], []
    for seed in range(20):
        case = make_case("lean", 1024, seed)
        assert case.truth_px == 0.0
        r = screen_alignment(case.pre, case.post, case.valid, cfg)
        if r.reject_reason is None:
            accepted.append(seed)
            if r.residual_px <= 1.0:
                ground.append(seed)
    assert len(accepted) >= 19, accepted
    assert len(ground) >= 0.9 * len(accepted), sorted(set(accepted) - set(ground))


@pytest.mark.parametrize("seed", quick_first([83, 127, 183, 339]))
def test_one_tall_building_leaning_past_the_limit_is_a_lean(seed):
    """Generated lean crops (ground exact) whose only roof over the limit is one building, read by
    three neighbouring windows that enclose no ground window: accepted, the ground's residual
    within 1 px, the roof's share under one roof's. Stop 56 rejected 13 of 100 such crops as
    displaced regions (16.6-23.1 px)."""
    cfg = RegistrationConfig(crop_size=1024)
    case = make_case("lean", 1024, seed)
    r = screen_alignment(case.pre, case.post, case.valid, cfg)
    assert r.reject_reason is None and r.lean is not None, r.reject_reason
    assert r.residual_px <= 1.0 and r.lean.max_px > 8.0 and r.lean.windows == 3
    assert r.lean.share <= one_roof_share(1024, 1024, cfg)


@pytest.mark.parametrize("seed, truth", quick_first([(700, 9.5), (796, 36.1), (1524, 48.3)]))
def test_ground_moved_as_a_whole_enclosing_no_ground_is_no_lean(seed, truth):
    """Generated convex regions of ground moved one way (9.5 px: next to the limit), mostly flat, so
    the moved layer shows no area wide enough to be ground: their windows (6-18) lean one way and
    enclose no ground, like one roof, but what moved covers more than one roof (3.9-8.5 % of the
    crop against 2 %): displacement, rejected."""
    cfg = RegistrationConfig(crop_size=1024)
    case = make_case("patches", 1024, seed)
    assert case.truth_px == pytest.approx(truth, abs=0.05)
    r = screen_alignment(case.pre, case.post, case.valid, cfg)
    assert r.reject_code == DISPLACED and r.lean is None, r.reject_reason


def with_disc_moved(case, px: float, turn_deg: float) -> np.ndarray:
    """A 1024 px lean case's post date with a disc of ground (radius 200 px, the crop's centre)
    moved ``px`` at ``turn_deg`` from the lean's direction (0: along it, 180: against it)."""
    u = np.radians(case.lean_deg + turn_deg)
    reg = np.zeros_like(case.pre, np.float32)
    cv2.circle(reg, (512, 512), 200, 1.0, -1)
    dx, dy = px * np.cos(u) * reg, px * np.sin(u) * reg
    yy, xx = np.mgrid[0:1024, 0:1024].astype(np.float32)
    return cv2.remap(case.post, (xx - dx).astype(np.float32), (yy - dy).astype(np.float32),
                     cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT)


@pytest.mark.parametrize("seed", quick_first([5, 1, 3]))
def test_a_region_moved_under_the_limit_against_the_lean_is_reported(seed):
    """A lean crop whose ground also has a disc moved 6 px against the lean (under the limit):
    accepted, and the reported residual is the region's, not read down as a roof's pull. The
    report reads windows again across or against the lean only within ``screen_agree_px``;
    reading them as far as along it, seed 5 reported 1.62 px."""
    cfg = RegistrationConfig(crop_size=1024)
    case = make_case("lean", 1024, seed)
    post = with_disc_moved(case, 6.0, 180.0)
    r = screen_alignment(case.pre, post, case.valid, cfg)
    assert r.reject_reason is None, r.reject_reason
    assert 5.5 <= r.residual_px <= 7.0, r.residual_px


def test_one_roof_is_a_disc_as_wide_as_the_widest_roof():
    cfg = RegistrationConfig(crop_size=1024)
    assert one_roof_share(1024, 1024, cfg) == pytest.approx(np.pi / 4 * 0.16 ** 2)
    assert one_roof_share(2048, 1024, cfg) == pytest.approx(np.pi / 4 * 163.84 ** 2 / (2048 * 1024))
    assert one_roof_share(1024, 1024, RegistrationConfig(crop_size=1024, screen_lean_max_roof=0.1)) == \
        pytest.approx(np.pi / 4 * 0.01)


@pytest.mark.parametrize("seed, turn", quick_first([(1, 0.0), (3, 90.0), (5, 180.0), (1, 30.0)]))
def test_a_region_moved_with_the_lean_is_still_displacement(seed, turn):
    """A lean crop whose ground also has a region moved 9 px, along the lean, across it and
    against it: the region is no roof and no ground window's remeasuring hides it (rejected as
    displaced)."""
    case = make_case("lean", 1024, seed)
    post = with_disc_moved(case, 9.0, turn)
    r = screen_alignment(case.pre, post, case.valid, RegistrationConfig(crop_size=1024))
    assert r.reject_code == DISPLACED, (r.reject_reason, r.lean)


# equivalent mutant: core/ReplaceComparisonOperator_Gt_NotEq on `if ROOF_GROW_PX > 0 and roof.any():`: ROOF_GROW_PX is a module constant, 3, never negative; > 0 and != 0 agree on it
# equivalent mutant: core/NumberReplacer on `if ROOF_GROW_PX > 0 and roof.any():`: ROOF_GROW_PX is a module constant, 3; > 0 and > -1 (or > 1) agree on it
# equivalent mutant: core/NumberReplacer on `k = max(3, win // 16) | 1`: for 3 -> 2 only, max(2, n) | 1 == max(3, n) | 1 for every n (2 | 1 == 3 | 1 == 3); 3 -> 4 changes the box and the box test kills it


WIN_GRID = [(63.5 + 128.0 * c, 63.5 + 128.0 * r) for r in range(7) for c in range(7)]


def examined_windows(devs, lean, reach=None, report=False):
    """Which of the windows at ``WIN_GRID`` with displacements ``devs`` (the ground field held at
    exactly zero, so a displacement is its deviation) the roof-less reading examines: roof_pixels
    is recorded and finds no roof, so nothing else happens."""
    import operators.pairs.screening.lean as S
    cfg = RegistrationConfig(crop_size=1024)
    ground = [S.WindowShift(x, y, float(dx), float(dy), 0.9, k // 7, k % 7)
              for k, ((x, y), (dx, dy)) in enumerate(zip(WIN_GRID, devs))]
    seen = []

    def roofs(template, post, cx, cy, field, u, reach_px):
        seen.append((cx, cy))
        return np.zeros(template.shape, bool)
    img = np.zeros((1024, 1024), np.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S, "ground_field", lambda shifts, agree: (np.array([[1.0, 0, 0], [0, 1.0, 0]]), None))
        mp.setattr(S, "roof_pixels", roofs)
        valid = np.ones(img.shape, bool)
        if report:
            S.ground_as_reported(ground, lean, img, img, valid, 128, cfg)
        else:
            S.ground_without_roofs(ground, lean, img, img, valid, 128, cfg, max_dev=reach)
    return [k for k, (x, y) in enumerate(WIN_GRID[:len(devs)]) if (x, y) in seen]


DEV = st.tuples(st.floats(-12, 12, allow_nan=False), st.floats(-12, 12, allow_nan=False))


@settings(max_examples=300, deadline=None)
@given(devs=st.lists(DEV, min_size=1, max_size=40), deg=st.sampled_from([0.0, 90.0, 200.0, 333.0]),
       reach=st.sampled_from([None, 2.0, 3.0, 5.5]))
@example(devs=[(3.0, 0.0), (-1.0, 0.0), (0.0, 1.0), (2.0, 0.0)], deg=0.0, reach=3.0)
@example(devs=[(2.0, 0.0), (2.0, 0.5), (-0.5, 0.0)], deg=0.0, reach=None)
@example(devs=[(0.0, 0.0), (0.0, 1.0), (1.0, 0.0)], deg=0.0, reach=None)   # on the field, across
def test_a_ground_window_is_read_again_when_off_the_field_along_the_lean_within_reach(devs, deg, reach):
    """The rule as documented (``ground_without_roofs``): a window is measured again without its
    roof when it lies off the ground field along the lean (a positive component along it) and
    within ``max_dev`` of the field (``screen_agree_px`` by default), the boundary included.
    Generated deviations against a reference written from that rule."""
    lean = Lean(3.0, 6.0, deg, 3)
    u = np.array([np.cos(np.radians(deg)), np.sin(np.radians(deg))])
    bound = 2.0 if reach is None else reach
    want = [k for k, d in enumerate(devs) if np.array(d) @ u > 0 and np.hypot(*d) <= bound]
    assert examined_windows(devs, lean, reach) == want


@settings(max_examples=100, deadline=None)
@given(devs=st.lists(DEV, min_size=1, max_size=40), reads=st.lists(DEV, min_size=40, max_size=40),
       deg=st.sampled_from([0.0, 90.0, 200.0, 333.0]))
@example(devs=[(3.0, 0.0)], reads=[(0.25, -1.5)] * 40, deg=0.0)          # the axes told apart
@example(devs=[(1.0, 0.0)], reads=[(1.0, 0.0)] * 40, deg=0.0)            # no nearer: kept as measured
def test_a_window_read_again_takes_its_new_reading_only_when_nearer_the_field(devs, reads, deg):
    """``ground_without_roofs`` on windows it reads again (off the ground field along the lean
    within reach, a roof found, ground enough left): each read gives a new displacement (drawn);
    a window whose new reading lies nearer the ground field than its measured one gets it, each
    axis its own, and any other keeps its measured one (not in the result). Against a reference
    of that rule. CI's fixed mutation sample (seed 35) showed `dx=new[0]` -> `dx=new[1]`
    surviving: the generated lean crops' ground is exact, so a re-read came out (0, 0) either
    way."""
    import operators.pairs.screening.lean as S
    cfg = RegistrationConfig(crop_size=1024)
    ground = [S.WindowShift(x, y, float(dx), float(dy), 0.9, k // 7, k % 7)
              for k, ((x, y), (dx, dy)) in enumerate(zip(WIN_GRID, devs))]
    lean = Lean(3.0, 6.0, deg, 3)
    u = np.array([np.cos(np.radians(deg)), np.sin(np.radians(deg))])
    given_reads = iter(reads)

    def roofs(template, post, cx, cy, field, u, reach_px):
        roof = np.zeros(template.shape, bool)
        roof[:8, :8] = True                     # a small roof: the window keeps its ground
        return roof

    img = np.zeros((1024, 1024), np.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S, "ground_field", lambda shifts, agree: (np.array([[1.0, 0, 0], [0, 1.0, 0]]), None))
        mp.setattr(S, "roof_pixels", roofs)
        mp.setattr(S, "masked_shift", lambda *a: next(given_reads))
        got = S.ground_without_roofs(ground, lean, img, img, np.ones(img.shape, bool), 128, cfg,
                                     max_dev=12.0)
    read = iter(reads)
    for s, d in zip(ground, devs):
        if not (np.array(d) @ u > 0 and np.hypot(*d) <= 12.0):
            assert id(s) not in got
            continue
        r = next(read)
        if np.hypot(*r) < np.hypot(*d):
            assert (got[id(s)].dx, got[id(s)].dy) == r and (got[id(s)].x, got[id(s)].y) == (s.x, s.y)
        else:
            assert id(s) not in got


@settings(max_examples=200, deadline=None)
@given(devs=st.lists(DEV, min_size=1, max_size=40), deg=st.sampled_from([0.0, 90.0, 200.0]),
       lean_max=st.sampled_from([1.0, 3.6, 6.0, 17.0]))
@example(devs=[(8.0, 0.0), (8.5, 0.0), (5.0, 0.0)], deg=0.0, lean_max=17.0)
@example(devs=[(-1.5, 0.0), (0.0, 1.2), (0.3, -0.4)], deg=0.0, lean_max=17.0)   # against and across
@example(devs=[(0.3, 0.0), (0.0, -0.29), (-0.3, 0.0), (3.0, 0.0), (3.01, 0.0)], deg=90.0, lean_max=1.0)
@example(devs=[(-2.0, 0.0), (-2.01, 0.0), (0.0, 2.0), (0.0, -2.5), (6.0, 0.0)], deg=0.0, lean_max=6.0)
def test_the_report_reads_again_only_windows_within_the_limit(devs, deg, lean_max):
    """``ground_as_reported``: a window within the limit (8 px, the boundary included), off the
    ground field by at least ``screen_shift_noise_px`` (0.3 px), along the lean by up to the
    lean's largest magnitude plus ``screen_agree_px`` or across or against it by up to
    ``screen_agree_px`` (2 px), is measured again for the report; a window over the limit never
    is (it stays as measured, and the report cannot read it down)."""
    lean = Lean(lean_max / 2, lean_max, deg, 3)
    u = np.array([np.cos(np.radians(deg)), np.sin(np.radians(deg))])
    want = [k for k, d in enumerate(devs)
            if np.hypot(*d) <= 8.0 and 0.3 <= np.hypot(*d)
            and np.hypot(*d) <= (lean_max + 2.0 if np.array(d) @ u > 0 else 2.0)]
    assert examined_windows(devs, lean, report=True) == want


def test_one_leaning_window_is_read_however_few():
    """read_lean reads the windows off the ground field whose moved content is roof-sized
    "however few" (its docstring): lean_split, not the reading, decides whether a lean is set
    apart, and the report reads the lean of one building too. Generated: on real texture at the
    paper's geometry, one roof-sized patch (14-28 px) in one window moved 4-12 px in a random
    direction in the post date, that window's measured shift its roof's, the others on the
    ground (0, 0). Each reading has that one window off, its direction within 10 degrees and
    its magnitude within 0.5 px of the roof's. CI's mutation sample (seed 35, drawn over a
    larger scope) showed `idx.size == 0` -> `== 1` surviving every test: a single window off
    the field returned no reading."""
    from operators.pairs.screening.lean import read_lean
    from operators.pairs.screening.windows import WindowShift, window_starts

    cfg = RegistrationConfig(crop_size=1024)
    win = cfg.screen_window()
    src = scene("naip", 1024)
    rng = np.random.default_rng(5)
    starts = window_starts(1024, win)
    for case in range(12):
        oy, ox = (int(v) for v in rng.integers(0, np.array(src.shape) - 1024))
        pre = np.ascontiguousarray(src[oy:oy + 1024, ox:ox + 1024])
        post = pre.copy()
        r, c = (int(v) for v in rng.integers(2, len(starts) - 2, 2))
        side = int(rng.integers(14, 29))
        mag, ang = float(rng.uniform(4, 12)), float(rng.uniform(0, 2 * np.pi))
        dx, dy = int(round(mag * np.cos(ang))), int(round(mag * np.sin(ang)))
        y0 = starts[r] + win // 2 - side // 2
        x0 = starts[c] + win // 2 - side // 2
        post[y0 + dy:y0 + dy + side, x0 + dx:x0 + dx + side] = pre[y0:y0 + side, x0:x0 + side]
        trusted = [WindowShift(sx + win / 2, sy + win / 2, float(dx) if (i, j) == (r, c) else 0.0,
                               float(dy) if (i, j) == (r, c) else 0.0, 0.9, i, j)
                   for i, sy in enumerate(starts) for j, sx in enumerate(starts)]
        reading = read_lean(trusted, pre, post, np.ones_like(pre, bool), win, cfg)
        assert reading is not None and reading.off == 1 and reading.core == 1, (case, dx, dy)
        want = np.degrees(np.arctan2(dy, dx)) % 360
        assert abs((reading.lean.deg - want + 180) % 360 - 180) < 10, (case, reading.lean, want)
        assert abs(reading.lean.max_px - np.hypot(dx, dy)) < 0.5, (case, reading.lean)


# equivalent mutant: core/NumberReplacer on `if idx.size == 0:`: (== -1, never true) with no window off the field, moved_layer gets no window, no window is narrow, and lean_cone of no deviation returns None, so read_lean returns None as the guard does (the guard only spares that work); == 1 is killed by test_one_leaning_window_is_read_however_few
