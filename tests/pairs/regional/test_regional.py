"""Regional registration: tile matches reused by overlapping slices, one homography per slice."""
from __future__ import annotations

import numpy as np
import pytest

from operators.pairs.regional.regional import (TileFeatures, TileMatches, fit_slice, inside, match_tile,
                                               neighbour_tiles, search_window, tile_core, tile_features,
                                               tile_read_window, tiles_for_window)
from operators.pairs.registration.registration import RegistrationConfig, grey_from_bands, register_slice_pair, \
    translation
from tests.pairs.registration.test_registration import corner_errors, known_homography, make_post, naip_rgb

CFG = RegistrationConfig(method="regional", crop_size=256, tile_size=256, search_margin_px=32)
SLICE = 512


def read(arr: np.ndarray, window) -> tuple[np.ndarray, np.ndarray]:
    """Array stand-in for a boundless window read: outside the array is invalid."""
    col, row, w, h = window
    out = np.zeros((arr.shape[0], h, w), arr.dtype)
    ok = np.zeros((h, w), bool)
    r0, c0 = max(row, 0), max(col, 0)
    r1, c1 = min(row + h, arr.shape[1]), min(col + w, arr.shape[2])
    if r1 > r0 and c1 > c0:
        out[:, r0 - row:r1 - row, c0 - col:c1 - col] = arr[:, r0:r1, c0:c1]
        ok[r0 - row:r1 - row, c0 - col:c1 - col] = True
    return out, ok


@pytest.fixture(scope="module")
def scene():
    pre = naip_rgb()
    W = known_homography(dx=-9.2, dy=6.1, degrees=-0.5, scale=1.004, about=(467, 362))
    post = make_post(pre, W, pre.shape[1:])
    # The warp leaves a nodata wedge along the post borders: mark it as such.
    post_valid = make_post(np.full((1,) + pre.shape[1:], 255, np.uint8), W, pre.shape[1:],
                           gain=1, offset=0, gamma=1)[0] == 255
    return pre, post, post_valid, W


def all_tile_features(pre, post, post_valid, windows, cfg) -> dict:
    stretch = [[0, 255]] * 3
    tiles = sorted({t for w in windows for t in tiles_for_window(w, cfg.tile_size)})
    out = {}
    for tc, tr in tiles:
        win = tile_read_window(tc, tr, cfg)
        a, av = read(pre, win)
        b, bv = read(post, win)
        bv &= read(post_valid[None].astype(np.uint8), win)[0][0] > 0
        out[(tc, tr)] = tile_features(grey_from_bands(a, stretch, av), av,
                                      grey_from_bands(b, stretch, bv), bv, win,
                                      tile_core(tc, tr, cfg.tile_size), cfg)
    return out


def all_tile_matches(pre, post, post_valid, windows, cfg) -> dict:
    feats = all_tile_features(pre, post, post_valid, windows, cfg)
    return {(tc, tr): match_tile(f, [feats[n] for n in neighbour_tiles(tc, tr, cfg) if n in feats],
                                 tc, tr, cfg)
            for (tc, tr), f in feats.items()}


def test_regional_fit_matches_per_slice_accuracy(scene):
    pre, post, post_valid, W = scene
    windows = [(0, 0, SLICE, SLICE), (256, 0, SLICE, SLICE), (256, 212, SLICE, SLICE)]
    tiles = all_tile_matches(pre, post, post_valid, windows, CFG)
    stretch = [[0, 255]] * 3
    for window in windows:
        col, row = window[:2]
        W_slice = translation(-col, -row) @ W @ translation(col, row)
        gathered = TileMatches.concat(tiles[t] for t in tiles_for_window(window, CFG.tile_size))
        fit = fit_slice(gathered, window, CFG)
        assert fit.reject_reason is None, fit.reject_reason
        err = corner_errors(fit.homography, W_slice, SLICE, CFG.crop_size)
        # Per-slice reference on the same slice.
        a, av = read(pre, window)
        b, bv = read(post, window)
        bv &= read(post_valid[None].astype(np.uint8), window)[0][0] > 0
        ref = register_slice_pair(grey_from_bands(a, stretch, av), av,
                                  grey_from_bands(b, stretch, bv), bv,
                                  RegistrationConfig(method="per-slice", crop_size=256))
        ref_err = corner_errors(ref.homography, W_slice, SLICE, CFG.crop_size)
        assert np.median(err) < 0.5, err
        assert np.median(err) <= np.median(ref_err) + 0.1, (err, ref_err)


def test_features_belong_to_one_tile_and_matches_cross_tiles(scene):
    pre, post, post_valid, _ = scene
    feats = all_tile_features(pre, post, post_valid, [(0, 0, 512, 512)], CFG)
    for (tc, tr), f in feats.items():
        core = tile_core(tc, tr, CFG.tile_size)
        assert len(f.pre_xy) > 0 and len(f.post_xy) > 0
        assert inside(f.pre_xy, core).all() and inside(f.post_xy, core).all()
        back = TileFeatures.from_bytes(f.to_bytes())
        np.testing.assert_array_equal(back.post_desc, f.post_desc)
    matches = all_tile_matches(pre, post, post_valid, [(0, 0, 512, 512)], CFG)
    for (tc, tr), m in matches.items():
        assert len(m) > 0
        assert inside(m.pre_xy, tile_core(tc, tr, CFG.tile_size)).all()
        assert inside(m.post_xy, search_window(tc, tr, CFG)).all()
    # The scene is shifted by ~9 px: some partners come from a neighbouring tile's features.
    assert any((~inside(m.post_xy, tile_core(tc, tr, CFG.tile_size))).any()
               for (tc, tr), m in matches.items())


def test_slice_with_no_matches_is_rejected_with_reason():
    fit = fit_slice(TileMatches.empty(), (0, 0, 512, 512), CFG)
    assert fit.homography is None and "too few matches" in fit.reject_reason


def test_tile_geometry():
    assert tiles_for_window((0, 0, 512, 512), 256) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert tiles_for_window((100, 0, 300, 10), 256) == [(0, 0), (1, 0)]
    ctx = CFG.tile_context_px
    assert tile_read_window(1, 2, CFG) == (256 - ctx, 512 - ctx, 256 + 2 * ctx, 256 + 2 * ctx)
    # SIFT detects nothing within 5 octave pixels of an image edge (SIFT_IMG_BORDER): 5 x 2^o px
    # at octave o. The context must cover that border at octave 3, else keypoints of octaves
    # >= 3 near a tile core's edge are found by no tile.
    assert RegistrationConfig().tile_context_px >= 5 * 2 ** 3
    assert search_window(1, 2, CFG) == (256 - 32, 512 - 32, 256 + 64, 256 + 64)
    assert neighbour_tiles(1, 1, CFG) == [(c, r) for r in range(3) for c in range(3)]
    xy = np.array([[-0.5, 0], [255.49, 10], [255.5, 10]], np.float32)
    assert inside(xy, (0, 0, 256, 256)).tolist() == [True, True, False]


def test_matches_roundtrip_bytes():
    m = TileMatches(np.random.rand(5, 2).astype(np.float32), np.random.rand(5, 2).astype(np.float32),
                    np.random.rand(5).astype(np.float32))
    back = TileMatches.from_bytes(m.to_bytes())
    np.testing.assert_array_equal(back.pre_xy, m.pre_xy)
    np.testing.assert_array_equal(back.distance, m.distance)
    assert len(TileMatches.concat([m, TileMatches.empty(), m])) == 10
