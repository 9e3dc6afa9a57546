"""Guided matching on a real pair years apart: NAIP 2016 and 2020 of one quarter-quad (fields
re-ploughed, crops changed), the later date offset by a known shift on top of the archive's own
sub-pixel misregistration."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import cv2
import numpy as np
import pytest
import rasterio
from rasterio.vrt import WarpedVRT

from operators.pairs.registration.guided_matching import (MatchPrior, fit_match_prior, guided_match,
                                                          prior_sample)
from operators.pairs.regional.regional import (TileMatches, fit_slice, guided_match_tile, match_tile,
                                               neighbour_tiles, tile_core, tile_features, tile_read_window,
                                               tiles_for_window)
from operators.pairs.registration.registration import RegistrationConfig, apply_homography, feature_grey

DATA = Path(__file__).resolve().parents[3] / "data" / "naip"
D = np.array([37.0, -23.0])          # pre pixel p shows what post shows at p - D
SLICE, STRIDE = 384, 160
CFG = RegistrationConfig(crop_size=192, tile_size=256, search_margin_px=64)


@pytest.fixture(scope="module")
def pair():
    with rasterio.open(DATA / "m_4709963_se_14_1_20160816.tif") as src:
        a = src.read([1, 2, 3])
        grid = dict(crs=src.crs, transform=src.transform, width=src.width, height=src.height)
    with rasterio.open(DATA / "m_4709963_se_14_1_20200831.tif") as src:
        with WarpedVRT(src, **grid) as vrt:
            b = vrt.read([1, 2, 3])
    r0, c0, h, w = 40, 50, 640, 840
    pre = a[:, r0:r0 + h, c0:c0 + w]
    post = b[:, r0 + int(D[1]):r0 + int(D[1]) + h, c0 + int(D[0]):c0 + int(D[0]) + w]
    return pre, post


def passes(pre, post, cfg, sample=False):
    """Features per tile, first-pass matches (of a sample of the pre features with ``sample``),
    the prior, guided matches (common-grid coords)."""
    ok = np.ones(pre.shape[1:], bool)
    h, w = ok.shape
    cells = [(c, r) for r in range((h + cfg.tile_size - 1) // cfg.tile_size)
             for c in range((w + cfg.tile_size - 1) // cfg.tile_size)]
    feats = {}
    for c, r in cells:
        x, y, ww, hh = tile_read_window(c, r, cfg)
        sl = np.s_[:, max(y, 0):y + hh, max(x, 0):x + ww]
        ax, bx = pre[sl], post[sl]
        v = np.ones(ax.shape[1:], bool)
        read = (max(x, 0), max(y, 0), ax.shape[2], ax.shape[1])
        feats[(c, r)] = tile_features(feature_grey(ax, v, cfg), v, feature_grey(bx, v, cfg), v,
                                      read, tile_core(c, r, cfg.tile_size), cfg)

    def nbrs(c, r):
        return [feats[n] for n in neighbour_tiles(c, r, cfg) if n in feats]

    first = {k: match_tile(feats[k], nbrs(*k), *k, cfg, sample=sample) for k in cells}
    both = TileMatches.concat(first.values())
    prior = fit_match_prior(both.pre_xy, both.post_xy, cells, cfg)
    guided = {k: guided_match_tile(feats[k], nbrs(*k), *k, prior, cfg) for k in cells}
    return first, prior, guided


def slice_windows(shape):
    h, w = shape
    return [(c, r, SLICE, SLICE) for r in range(0, h - SLICE + 1, STRIDE)
            for c in range(0, w - SLICE + 1, STRIDE)]


def correct_in(matches: dict, window) -> int:
    m = TileMatches.concat(matches[t] for t in tiles_for_window(window, CFG.tile_size))
    col, row, size, _ = window
    pre_in = (m.pre_xy[:, 0] >= col) & (m.pre_xy[:, 0] < col + size) & \
        (m.pre_xy[:, 1] >= row) & (m.pre_xy[:, 1] < row + size)
    return int((pre_in & (np.hypot(*(m.post_xy - (m.pre_xy - D)).T) < 3.0)).sum())


def corner_error(fit, window) -> float:
    off = (SLICE - CFG.crop_size) // 2
    corners = np.array([[off, off], [off + 191, off], [off, off + 191], [off + 191, off + 191]],
                       np.float64)
    return float(np.abs(apply_homography(fit.homography, corners - D) - corners).max())


def test_guided_matching_keeps_many_more_correct_matches_on_a_real_pair(pair):
    pre, post = pair
    first, prior, guided = passes(pre, post, CFG)
    # The prior recovers the known shift from a few dozen first-pass matches.
    assert prior.pair is not None
    moved = prior.pair @ np.array([400.0, 300.0, 1.0]) - np.array([400.0, 300.0])
    assert np.allclose(moved, -D, atol=2.0), moved
    windows = slice_windows(pre.shape[1:])
    n_first = np.array([correct_in(first, w) for w in windows])
    n_guided = np.array([correct_in(guided, w) for w in windows])
    assert np.median(n_guided) >= 4 * max(np.median(n_first), 1), (n_first, n_guided)
    # Enough for a homography on every slice, each within 2 px of the truth at the crop corners.
    fits = [fit_slice(TileMatches.concat(guided[t] for t in tiles_for_window(w, CFG.tile_size)),
                      w, CFG) for w in windows]
    assert all(f.homography is not None for f in fits), [f.reject_reason for f in fits]
    assert max(corner_error(f, w) for f, w in zip(fits, windows)) < 2.0


def test_guided_match_looks_only_near_the_prediction_and_pairs_one_to_one():
    rng = np.random.default_rng(0)
    desc = rng.integers(0, 255, (6, 128)).astype(np.uint8)
    pre_xy = np.array([[10, 10], [50, 50], [90, 90], [130, 130], [170, 170], [210, 210]], np.float32)
    shift = np.array([[1, 0, 5.0], [0, 1, -3.0]])
    post_xy = pre_xy + np.float32([5, -3])
    post_xy[2] += 40                       # its partner lies far from the prediction
    post_desc = desc.copy()
    # A seventh pre feature beside feature 3, looking almost like it: both want post feature 3 ...
    twin = desc[3].astype(np.int16)
    twin[0] = min(255, twin[0] + 9)
    pre_desc = np.vstack([desc, twin.astype(np.uint8)])
    pre_xy = np.vstack([pre_xy, [[133, 131]]]).astype(np.float32)
    qi, ti, _ = guided_match(pre_xy, pre_desc, post_xy, post_desc, shift, CFG)
    pairs = dict(zip(qi.tolist(), ti.tolist()))
    assert 2 not in pairs                  # nothing within the radius looks like it
    assert pairs[0] == 0 and pairs[1] == 1 and pairs[5] == 5
    assert len(set(ti.tolist())) == len(ti)   # ... but each post feature serves one pre feature,
    assert pairs.get(3) == 3 and 6 not in pairs   # the one it is closest to


def test_without_a_prior_the_first_pass_is_used_and_the_prior_round_trips():
    few = np.zeros((3, 2), np.float32)
    prior = fit_match_prior(few, few, [(0, 0)], CFG)
    assert prior.pair is None and prior.for_tile(0, 0) is None
    back = MatchPrior.from_bytes(MatchPrior(np.eye(2, 3), 40, {(1, 2): np.eye(2, 3) * 2}).to_bytes())
    assert back.pair_inliers == 40 and np.allclose(back.for_tile(1, 2), np.eye(2, 3) * 2)
    assert np.allclose(back.for_tile(0, 0), np.eye(2, 3))


def test_all_wrong_matches_near_the_prior_give_no_fit():
    """3,000 look-alike partners, each 4-15 px from where its pre feature really is (repeated
    texture, a changed scene): guided matching keeps them all (they sit within the radius of an
    identity prior) and RANSAC finds a hundred-odd chance inliers; the fit's confidence (inliers
    relative to matches) must reject it."""
    rng = np.random.default_rng(3)
    n, side = 3000, 512
    pre_xy = rng.uniform(0, side - 1, (n, 2)).astype(np.float32)
    ang, rad = rng.uniform(0, 2 * np.pi, n), np.sqrt(rng.uniform(16, 225, n))
    post_xy = (pre_xy + np.stack([rad * np.cos(ang), rad * np.sin(ang)], 1)).astype(np.float32)
    desc = rng.integers(0, 255, (n, 128)).astype(np.uint8)
    cfg = RegistrationConfig(crop_size=256)
    qi, ti, _ = guided_match(pre_xy, desc, post_xy, desc, np.eye(2, 3), cfg)
    assert len(qi) > 2500                                 # the prior lets them all through
    # Independent oracle: none of them is within 3 px of its pre feature.
    assert np.all(np.hypot(*(post_xy[ti] - pre_xy[qi]).T) > 3.0)
    fit = fit_slice(TileMatches(pre_xy[qi], post_xy[ti], np.zeros(len(qi), np.float32)),
                    (0, 0, side, side), cfg)
    assert fit.homography is None, (fit.n_matches, fit.n_inliers)
    assert fit.n_inliers >= 30 and "confidence" in fit.reject_reason


def test_guided_matches_are_mutual_and_lone_candidates_need_a_close_descriptor():
    rng = np.random.default_rng(1)
    base = rng.integers(60, 190, 128).astype(np.int16)

    def like(delta):                                   # base, the first dims moved by delta
        d = base.copy()
        d[:len(delta)] += np.asarray(delta, np.int16)
        return d.astype(np.uint8)

    # Pre 1 looks most like post 0 (distance 10) but also like post 1 (12): no ratio-test pass.
    # Pre 0's lone candidate is post 0, at distance 50. Not mutual: post 0 is closest to pre 1.
    pre_desc = np.stack([like([50]), like([])])
    post_desc = np.stack([like([0, 10]), like([0, 0, 12])])
    pre_xy = np.array([[90, 100], [106, 100]], np.float32)     # pre 0 sees post 0 only
    post_xy = np.array([[104, 100], [110, 100]], np.float32)
    qi, ti, _ = guided_match(pre_xy, pre_desc, post_xy, post_desc, np.eye(2, 3), CFG)
    assert qi.tolist() == [] and ti.tolist() == []
    # Alone, pre 0 and post 0 are mutual (distance 50 < the cap) ...
    qi, ti, d = guided_match(pre_xy[:1], pre_desc[:1], post_xy[:1], post_desc[:1], np.eye(2, 3),
                             CFG)
    assert qi.tolist() == [0] and ti.tolist() == [0] and abs(d[0] - np.hypot(50, 10)) < 1e-3
    # ... but a lone candidate far away in descriptor space is no match.
    other = rng.integers(0, 255, (1, 128)).astype(np.uint8)
    qi, _, _ = guided_match(pre_xy[:1], pre_desc[:1], post_xy[:1], other, np.eye(2, 3), CFG)
    assert len(qi) == 0


def test_tile_prior_takes_the_tile_and_its_ring_of_tiles():
    """A tile's own prior is fitted to the matches of the 3 x 3 tiles around it, edges exact."""
    cfg = RegistrationConfig(tile_size=100, search_margin_px=50, prior_min_inliers=12)
    xs, ys = np.meshgrid([20.0, 120.0, 200.0], [30.0, 110.0, 190.0, 260.0])
    pre = np.c_[xs.ravel(), ys.ravel()]
    pre[-1] = [299.4, 260.0]               # in the last pixel column of tile (1, 1)'s ring
    prior = fit_match_prior(pre, pre + [3.0, -2.0], [(1, 1), (3, 3)], cfg)
    assert prior.pair is not None and sorted(prior.tiles) == [(1, 1)]
    np.testing.assert_allclose(prior.tiles[(1, 1)], [[1, 0, 3], [0, 1, -2]], atol=1e-6)
    pre[-1] = [299.6, 260.0]               # one pixel further: outside the ring, 11 matches left
    prior = fit_match_prior(pre, pre + [3.0, -2.0], [(1, 1)], cfg)
    assert prior.pair is not None and prior.tiles == {}


@pytest.mark.slow   # 5-12 s of SIFT on a real pair: the full suite's, not the quick loop's
def test_prior_from_a_sample_of_features_equals_the_full_prior_on_a_real_pair(pair):
    """The first pass only feeds the prior: matching a sample of each tile's pre features
    (``prior_features_per_tile``) gives the pair's affine within 1 px of the prior from every
    feature (both within ~2 px of the known shift; guided matching searches 16 px about it),
    and the guided pass that follows keeps as many matches. The real pair upsampled 2x, so its
    512 px tiles hold a few thousand features each, as a paper-scale tile does."""
    pre, post = (np.stack([cv2.resize(b, None, fx=2, fy=2, interpolation=cv2.INTER_CUBIC)
                           for b in img]) for img in pair)
    cfg = RegistrationConfig(crop_size=512, tile_size=512, search_margin_px=128)
    full_first, full, full_guided = passes(pre, post, replace(cfg, prior_features_per_tile=0))
    first, sampled, guided = passes(pre, post, replace(cfg, prior_features_per_tile=1000),
                                    sample=True)
    n_full = sum(len(m) for m in full_first.values())
    n_sampled = sum(len(m) for m in first.values())
    assert n_sampled < 0.6 * n_full, (n_sampled, n_full)          # the sample was taken ...
    assert sampled.pair is not None and full.pair is not None
    h, w = pre.shape[1:]
    grid = np.array([[x, y, 1.0] for x in (0, w - 1) for y in (0, h - 1)] + [[w / 2, h / 2, 1.0]])
    diff = np.hypot(*((grid @ sampled.pair.T) - (grid @ full.pair.T)).T)
    assert diff.max() < 1.0, diff                                  # ... and the prior held
    truth = np.hypot(*((grid @ sampled.pair.T) - (grid[:, :2] - 2 * D)).T)
    assert truth.max() < 2.5, truth
    n_g = sum(len(m) for m in guided.values())
    n_g_full = sum(len(m) for m in full_guided.values())
    assert abs(n_g - n_g_full) <= 0.02 * n_g_full, (n_g, n_g_full)


def test_prior_sample_spans_the_tile_and_is_off_without_guided_matching():
    cfg = RegistrationConfig(prior_features_per_tile=100)
    pick = prior_sample(1000, cfg)
    assert len(pick) == 100 and pick[0] == 0 and pick[-1] == 999
    assert np.all(np.diff(pick) >= 9) and np.all(np.diff(pick) <= 11)      # even steps
    assert prior_sample(100, cfg) is None                                    # few: all of them
    assert prior_sample(1000, replace(cfg, prior_features_per_tile=0)) is None
    assert prior_sample(1000, replace(cfg, guided_matching=False)) is None  # first pass is final
