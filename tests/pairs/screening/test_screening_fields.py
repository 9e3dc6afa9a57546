"""Screening against generated displacement fields with ground truth (``benchmarks/_fields.py``),
one family at a time near the 8 px limit (9 px rejected, 7 px accepted and measured). The
benchmark (``python -m benchmarks.screening_fields``) counts thousands; these keep each family's
rule from sliding back. Real texture (NAIP, Sentinel-2) at the paper's 1024 px crop and at the
small 192 px geometry."""
from __future__ import annotations

import cv2
import numpy as np
import pytest

from benchmarks._fields import SHAPES, SMOOTH_KINDS, make_case, smooth_field
from operators.pairs.registration.registration import RegistrationConfig
from operators.pairs.screening.screening import DISPLACED, INSUFFICIENT, REPEATS_MOVED, screen_alignment
from tests.seeds import quick_first


def screened(case, **settings):
    return screen_alignment(case.pre, case.post, case.valid,
                            RegistrationConfig(crop_size=case.crop, **settings))


@pytest.mark.parametrize("seed", quick_first([0, 1]))
@pytest.mark.parametrize("kind", SHAPES)
def test_a_region_moved_9_px_is_rejected_at_the_paper_geometry(kind, seed):
    """Convex, L-shaped, ring and random-polygon regions (one to four, often all one way, what a
    lean looks like) moved 9 px: a displaced region, never taken for a building lean."""
    case = make_case("patches", 1024, seed, kind=kind, magnitude_px=9.0, overlays=False)
    assert case.truth_px == pytest.approx(9.0, abs=0.01)
    r = screened(case)
    assert r.reject_code == DISPLACED, (kind, seed, r.reject_reason, r.lean)


@pytest.mark.parametrize("kind", quick_first(["ring", "convex", "L", "polygon"]))
def test_a_region_moved_6_px_is_accepted_at_the_paper_geometry(kind):
    """The same shapes moved 6 px (the limit less 2 px, where a false reject counts): accepted.
    Fitted over all windows, the corner fields bent between the region and the ground and put a
    corner at 8-15 px (57 of 162 such crops rejected); a consensus's fit now reads the ground
    (:func:`consensus_fit`). The seeds are crops so rejected before (of seeds 0-7: convex 2 and
    6; L 2, 4 and 6; ring 1, 5, 6 and 7; polygon 2)."""
    seed = {"ring": 1}.get(kind, 2)
    case = make_case("patches", 1024, seed, kind=kind, magnitude_px=6.0, overlays=False)
    assert case.truth_px == pytest.approx(6.0, abs=0.01)
    r = screened(case)
    assert r.reject_reason is None, (kind, r.reject_reason)
    assert r.residual_px <= case.truth_px + 1.0


@pytest.mark.slow
@pytest.mark.parametrize("kind", SHAPES)
def test_a_region_moved_20_px_in_any_shape_is_no_lean(kind):
    """The issue's cases: L-shaped, ring, polygon and several patches moved 20 px, one way like a
    lean. What moved is wider than any roof, so no lean explains it. Broken once (every moved
    area taken as roof-sized): L seeds 3, 4, 6, polygon 3 and convex 2 were accepted."""
    for seed in range(7):
        case = make_case("patches", 1024, seed, kind=kind, magnitude_px=20.0, overlays=False)
        r = screened(case)
        assert r.reject_code == DISPLACED, (kind, seed, r.reject_reason, r.lean)


@pytest.mark.parametrize("seeds", quick_first([range(0, 10), range(10, 40)], ids=["0-9", "10-39"]))
def test_no_region_moved_at_the_small_geometry_is_taken_for_a_lean(seeds):
    """At 192 px (24 px windows) what moved is too fragmented to measure its width: 27 of 105
    regions moved 9-60 px were taken for a lean and accepted (seeds 0-199). Lean is not judged
    under LEAN_MIN_WINDOW; drawn regions moved 9-40 px, every shape, none is taken for one."""
    leans = []
    for seed in seeds:
        case = make_case("patches", 192, seed, magnitude_px=9.0 + seed % 32, overlays=False)
        r = screened(case)
        if r.lean is not None:
            leans.append((seed, case.kind, r.reject_reason, r.lean))
    assert not leans, leans


@pytest.mark.parametrize("seed", quick_first([27, 39]))
def test_lean_is_judged_from_64_px_windows(seed):
    """At a 512 px crop (64 px windows, LEAN_MIN_WINDOW: the smallest at which lean is judged)
    generated roofs leaning 19-26 px on exact ground are a lean, accepted on the ground."""
    case = make_case("lean", 512, seed)
    assert case.lean_px[1] > 8.0
    r = screened(case)
    assert r.reject_reason is None and r.lean is not None, (seed, r.reject_reason)


@pytest.mark.parametrize("seed", quick_first([0, 1, 2]))
@pytest.mark.parametrize("kind", ["tilt", "saddle", "rotation"])
def test_a_smooth_field_near_the_limit_at_the_corners(kind, seed):
    """A tilt, a saddle and a local rotation whose largest displacement (often at a crop corner)
    is 9 px are rejected; at 6 px (the limit less 2 px, where a false reject counts) accepted,
    the residual within 1 px of the truth. (At 7 px a corner read from few windows plus twice
    its standard error may pass the limit: rejected, by design, on the safe side.)"""
    over = make_case("smooth", 192, seed, kind=kind, magnitude_px=9.0, overlays=False)
    r = screened(over)
    assert r.reject_reason is not None, (kind, seed, r.residual_px)
    under = make_case("smooth", 192, seed, kind=kind, magnitude_px=6.0, overlays=False)
    r = screened(under)
    assert r.reject_reason is None, (kind, seed, r.reject_reason)
    assert abs(r.residual_px - under.truth_px) <= 1.0


@pytest.mark.parametrize("seed", quick_first([0, 1]))
def test_a_bowl_reaching_9_px_at_a_corner_is_read_from_the_corner_s_neighbourhood(seed):
    """A bowl at the paper's geometry whose 9 px lie at a crop corner: the quadratic read at the
    windows' span said 8.0 px and the crop was accepted (seed 0); read from the windows nearest
    the corner, carried the last half window, it is rejected."""
    case = make_case("smooth", 1024, seed, kind="bowl", magnitude_px=9.0, overlays=False)
    assert screened(case).reject_reason is not None, seed


@pytest.mark.parametrize("crop", quick_first([192, 1024]))
def test_every_bowl_reaching_9_px_at_the_corners_is_rejected(crop):
    """Bowls at both geometries, their 9 px at a corner: rejected (at the corner, or where the
    curvature moved windows off the ground field). At 1024 px seed 0 is also the quick loop's
    (the test above)."""
    for s in range(3):
        case = make_case("smooth", crop, s, kind="bowl", magnitude_px=9.0, overlays=False)
        assert screened(case).reject_reason is not None, (crop, s)


@pytest.mark.slow
def test_generated_bowls_at_the_paper_geometry_near_the_limit():
    """Bowls centred anywhere (a corner often) at 1024 px, their largest displacement 9 px over the
    crop: every one rejected. Their windows show the curvature but the windows nearest a corner
    read it too loosely (standard error over 1 px); the quadratic read at the windows' span, 64
    px inside the corners, said 6.3-7.4 px and accepted 2 of 40 (seeds 25 and 37; 7 of 60): seeds
    0-19 and those two here (the suite's time; the benchmark counts thousands). At 6 px (the limit
    less 2 px) at most the 2 of 40 rejected before (seeds 9 and 17: three windows of repeated
    texture whose outline is not aligned, insufficient evidence)."""
    seeds = [*range(20), 25, 37]
    over = [s for s in seeds if screened(make_case("smooth", 1024, s, kind="bowl",
                                                   magnitude_px=9.0, overlays=False)).reject_reason is None]
    assert over == []
    under = [s for s in seeds if screened(make_case("smooth", 1024, s, kind="bowl",
                                                    magnitude_px=6.0, overlays=False)).reject_reason is not None]
    assert len(under) <= 2, under


@pytest.mark.parametrize("kind", quick_first(["orchard", "solar", "parking"]))
def test_repeated_texture_moved_by_one_period_of_9_px_is_rejected(kind):
    """An orchard, a solar farm or a parking lot of period 9 px moved by one period with its edges
    (1 px over the limit): inside, its windows match as well as none, so only its outline can
    tell. Every crop is rejected, most as a displaced region read from the outline (9 px); one
    whose outline is too noisy to tell 9 px from 8 is insufficient evidence, never accepted.
    With the repeated-texture test off (1.0) the orchard (9 x 9 px) is accepted: no window sees
    it move (solar farms and parking lots, periodic along one axis only, show it at their ends)."""
    codes = []
    for seed in range(3):
        case = make_case("periodic", 1024, seed, kind=kind, magnitude_px=9.0, overlays=False)
        assert case.truth_px == pytest.approx(9.0)
        r = screened(case)
        assert r.reject_code in (REPEATS_MOVED, DISPLACED, INSUFFICIENT), (seed, case.params)
        codes.append(r.reject_code)
    assert codes.count(REPEATS_MOVED) + codes.count(DISPLACED) >= 2, codes
    if kind == "orchard":
        assert screened(case, screen_repeat_ncc=1.0).reject_reason is None


@pytest.mark.parametrize("seed", quick_first([0, 1, 2]))
@pytest.mark.parametrize("kind", quick_first(["parking", "orchard", "solar"]))
def test_registered_repeated_texture_is_accepted_and_measured(kind, seed):
    """The same regions not moved (0 px; periods 8-64 px): their outline stays, and the crop is
    judged on its other windows (it was insufficient evidence, 99.6 % of such crops, when any
    region of repeated texture rejected the crop)."""
    case = make_case("periodic", 1024, seed, kind=kind, magnitude_px=0.0, overlays=False)
    assert case.truth_px == 0.0
    r = screened(case)
    assert r.reject_reason is None, (seed, case.params, r.reject_reason)
    assert r.residual_px < 1.0


@pytest.mark.parametrize("kind", SMOOTH_KINDS)
def test_the_generator_s_truth_is_the_field_s_largest_displacement(kind):
    """Truth the benchmark relies on: a smooth field's largest |d| over the crop's pixels is the
    magnitude asked for, wherever it lies (corners included)."""
    rng = np.random.default_rng(0)
    for peak in (4.0, 9.0, 16.0):
        dx, dy = smooth_field(kind, 96, peak, rng)
        mag = np.hypot(dx, dy)
        assert float(mag.max()) == pytest.approx(peak, rel=1e-4)
    case = make_case("lean", 192, 0)
    assert case.truth_px == 0.0 and case.lean_px[1] >= case.lean_px[0] > 0


def test_a_look_alike_far_away_is_not_a_displaced_region():
    """The documented Landsat false reject, generated: a block of the pre date has a twin 60 px
    away (a row of similar roofs, terraces); in the post date the block itself changed (a
    demolition) and the twin stayed. Searched far, the block's windows find the twin: a
    'displaced region' of 60 px. The twin's post content matches the pre content at its own
    place as well as the block does: it stayed put, a look-alike. Accepted (the change is no
    misregistration); a region really moved 60 px is still rejected."""
    from benchmarks._fields import scene
    src = scene("naip", 192)
    pre = np.ascontiguousarray(src[100:292, 100:292]).copy()
    pre[60:108, 40:88] = pre[60:108, 100:148]                 # the twin, 60 px to the right
    post = pre.copy()
    rng = np.random.default_rng(3)
    post[60:108, 40:88] = np.clip(0.5 + 0.2 * rng.standard_normal((48, 48)), 0, 1)   # changed
    valid = np.ones_like(pre, bool)
    cfg = RegistrationConfig(crop_size=192)
    r = screen_alignment(pre, post.astype(np.float32), valid, cfg)
    assert r.reject_reason is None, r.reject_reason
    moved = make_case("patches", 192, 0, kind="convex", magnitude_px=30.0, overlays=False)
    assert screened(moved).reject_code == DISPLACED


def test_what_moved_is_ground_when_wider_than_a_roof_or_cut_by_the_crop_edge():
    """``wide_areas``: a roof-sized blob is not ground; a disc as wide as the widest roof is; a
    thin strip inside the crop is a row of roofs' size (not ground) unless the crop's edge cuts
    it, where its width may lie outside (a region mostly beyond the crop shows as a sliver)."""
    from operators.pairs.screening.lean import wide_areas
    width = 30.0
    for edge in ("top", "left", "bottom", "right", None):
        m = np.zeros((192, 192), bool)
        m[90:110, 100:120] = True                        # a roof: 20 x 20
        if edge == "top":
            m[0:8, 20:100] = True                        # an 8 px sliver 80 px long at the edge
        elif edge == "left":
            m[20:100, 0:8] = True
        elif edge == "bottom":
            m[184:192, 20:100] = True
        elif edge == "right":
            m[20:100, 184:192] = True
        else:
            m[40:48, 20:100] = True                      # the same strip inside the crop
        wide = wide_areas(m, width)
        assert not wide[90:110, 100:120].any(), edge
        assert wide.any() == (edge is not None), edge
    disc = np.zeros((192, 192), np.uint8)
    cv2.circle(disc, (96, 96), 17, 1, -1)                # 34 px across
    assert wide_areas(disc.astype(bool), width).sum() > 0.9 * disc.sum()


def test_smooth_enlarged_texture_is_not_taken_for_repeated_texture():
    """Real texture enlarged 4.5x (as the archive-scale scene is made) can hold a lone second
    region that matches a window at 0.8; a period repeats both ways. Of 675 windows of 128 px in
    three 1024 px crops of NAIP so enlarged, at most 1 % may read as repeated (with the twin asked
    for: 6 of 2,700 over nine crops; without it: 35)."""
    from benchmarks._fields import texture
    from operators.pairs.screening.repeats import repeats_itself
    big = cv2.resize(texture("naip"), None, fx=4.5, fy=4.5, interpolation=cv2.INTER_CUBIC)
    seen = []
    for y, x in ((200, 2300), (900, 200), (900, 2300)):
        crop = np.ascontiguousarray(big[y:y + 1024, x:x + 1024])
        seen += [repeats_itself(crop, wx, wy, 128, 64, 0.8)
                 for wy in range(0, 897, 64) for wx in range(0, 897, 64)]
    assert sum(seen) <= 0.01 * len(seen), sum(seen)


def test_a_registered_crop_whose_texture_repeats_beyond_half_a_window_is_accepted():
    """The repeated-texture test looks for a window's rivals within half a window (or the near search):
    a period longer than that (1.5 windows here: a 192 px tile at the paper's 128 px windows) is the
    far search's to measure, and a registered crop of it is no insufficient evidence. (Searching four
    windows out, the moving mutation sample's survivor, read this crop as an orchard and rejected it.)"""
    from benchmarks._fields import texture
    tile = np.ascontiguousarray(texture("naip")[:192, :192])
    crop = np.tile(tile, (6, 6))[:1024, :1024].astype(np.float32)
    r = screen_alignment(crop, crop.copy(), np.ones(crop.shape, bool), RegistrationConfig(crop_size=1024))
    assert r.reject_reason is None, r.reject_reason
