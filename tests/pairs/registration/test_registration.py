"""Per-slice registration on real imagery warped by a known homography plus radiometric change,
including real cloudy dates (Sentinel-2 L2A over Zagreb, Landsat-8 over Alabama)."""
from __future__ import annotations

import re
from pathlib import Path

import cv2
import numpy as np
import pytest
import rasterio

from operators.pairs.registration.registration import (RegistrationConfig, apply_homography, crop_corners,
                                                       crop_offset, crop_positions_on_grid, detect_features,
                                                       feature_grey, fit_homography, grey_from_bands,
                                                       homography_problem, match_descriptors,
                                                       register_slice_pair, remap_bands, translation)

DATA = Path(__file__).resolve().parents[3] / "data"
NAIP = DATA / "naip" / "m_4709963_se_14_1_20160816.tif"
S2 = DATA / "uint16" / "s2_B8A.jp2"
ZAGREB = DATA / "s2-zagreb"
L8 = DATA / "uint16" / "l8_B4.tif"


# ---- helpers shared with the other registration tests ---------------------------------------

def known_homography(dx=6.3, dy=-4.7, degrees=0.8, scale=1.01, about=(0.0, 0.0)) -> np.ndarray:
    """Post -> pre mapping: rotation + scale about ``about``, then a translation."""
    th = np.deg2rad(degrees)
    rs = np.array([[scale * np.cos(th), -scale * np.sin(th), 0],
                   [scale * np.sin(th), scale * np.cos(th), 0], [0, 0, 1]])
    return translation(dx, dy) @ translation(*about) @ rs @ translation(-about[0], -about[1])


def make_post(pre: np.ndarray, W: np.ndarray, out_shape, gain=1.25, offset=-0.04, gamma=0.8,
              dtype_max=255.0) -> np.ndarray:
    """post(p) = radiometry(pre(W p)) for (bands, H, W) ``pre``; W maps post px to pre px.

    Radiometric change: unit = pre / max; post = gain * unit**gamma + offset (clipped), so
    neither grey levels nor contrast carry over between the dates.
    """
    h, w = out_shape
    out = []
    for band in pre.astype(np.float32):
        warped = cv2.warpPerspective(band, W, (w, h), flags=cv2.INTER_CUBIC | cv2.WARP_INVERSE_MAP,
                                     borderMode=cv2.BORDER_CONSTANT, borderValue=0)
        unit = np.clip(warped / dtype_max, 0, 1)
        out.append(np.clip(gain * unit ** gamma + offset, 0, 1) * dtype_max)
    return np.rint(np.stack(out)).astype(pre.dtype)


def corner_errors(H_est: np.ndarray, W_true: np.ndarray, slice_size: int, crop: int) -> np.ndarray:
    """Distance between estimated and true post positions of the kept crop's four corners."""
    c = crop_corners(crop_offset(slice_size, crop), crop)
    return np.hypot(*(apply_homography(np.linalg.inv(H_est), c) -
                      apply_homography(np.linalg.inv(W_true), c)).T)


def naip_rgb() -> np.ndarray:
    with rasterio.open(NAIP) as src:
        return src.read([1, 2, 3])


def s2_band() -> np.ndarray:
    with rasterio.open(S2) as src:
        return src.read([1])


def unit_stretch(data: np.ndarray) -> list[list[float]]:
    return [[float(np.percentile(b, 2)), float(np.percentile(b, 98))] for b in data]


# ---- tests ------------------------------------------------------------------------------------

CFG = RegistrationConfig(method="per-slice", crop_size=256)


@pytest.mark.parametrize("source", ["naip", "s2"])
def test_per_slice_recovers_known_homography(source):
    full = naip_rgb() if source == "naip" else s2_band()
    size = 512
    pre = full[:, 100:100 + size, 200:200 + size]
    W = known_homography(dx=7.4, dy=-5.2, degrees=0.6, scale=0.995, about=(256, 256))
    # Warp from the full scene so the post slice has real content at its borders too.
    W_full = translation(200, 100) @ W
    dmax = 255.0 if full.dtype == np.uint8 else float(np.percentile(full, 99.9))
    post = make_post(np.minimum(full, dmax).astype(full.dtype), W_full, (size, size),
                     dtype_max=dmax)
    valid = np.ones((size, size), bool)
    fit = register_slice_pair(grey_from_bands(pre, unit_stretch(pre), valid), valid,
                              grey_from_bands(post, unit_stretch(post), valid), valid, CFG)
    assert fit.reject_reason is None, fit.reject_reason
    assert fit.n_inliers >= CFG.min_inliers
    err = corner_errors(fit.homography, W, size, CFG.crop_size)
    assert np.median(err) < 0.5, err


def zagreb(date: str) -> tuple[np.ndarray, np.ndarray]:
    with rasterio.open(ZAGREB / f"{date}_B08.tif") as src:
        data = src.read([1])
    return data, data[0] > 0


def warped_post(data: np.ndarray, valid: np.ndarray, W: np.ndarray, window):
    """The window of a real later date, further warped by a known post -> pre homography ``W``
    (slice coordinates): post(p) = data(W p + origin)."""
    col, row, size = window
    W_full = translation(col, row) @ W
    band = cv2.warpPerspective(data[0].astype(np.float32), W_full, (size, size),
                               flags=cv2.INTER_CUBIC | cv2.WARP_INVERSE_MAP)
    ok = cv2.warpPerspective(valid.astype(np.uint8), W_full, (size, size),
                             flags=cv2.INTER_NEAREST | cv2.WARP_INVERSE_MAP) > 0
    return np.clip(np.rint(band), 0, 65535).astype(np.uint16)[None], ok


@pytest.mark.parametrize("pre_date, post_date, window", [
    ("20230813", "20230810", (0, 233, 448)),    # clear (2 %) vs heavy cloud (68 %, SCL)
    ("20230813", "20230815", (300, 300, 448)),  # clear vs clear
])
def test_cloudy_sentinel2_slices_register(pre_date, post_date, window):
    """Real clear and cloudy dates of one place (same grid) plus a known warp. With the scene-wide
    stretch the cloudy date's land texture sat in a few grey levels and these slices failed."""
    pre_all, pre_valid_all = zagreb(pre_date)
    post_all, post_valid_all = zagreb(post_date)
    col, row, size = window
    W = known_homography(dx=6.3, dy=-4.1, degrees=0.3, about=(size / 2, size / 2))
    pre = pre_all[:, row:row + size, col:col + size]
    pre_valid = pre_valid_all[row:row + size, col:col + size]
    post, post_valid = warped_post(post_all, post_valid_all, W, window)
    cfg = RegistrationConfig(method="per-slice", crop_size=size // 2)
    fit = register_slice_pair(feature_grey(pre, pre_valid, cfg), pre_valid,
                              feature_grey(post, post_valid, cfg), post_valid, cfg)
    assert fit.reject_reason is None, fit.reject_reason
    assert np.max(corner_errors(fit.homography, W, size, cfg.crop_size)) < 1.5


def test_cloudy_landsat8_band_registers():
    """The repository's cloudy Landsat-8 red band, a later date derived with a known warp and a
    radiometric change; the clouds take most of the scene stretch."""
    with rasterio.open(L8) as src:
        full = src.read([1])
    valid_all = full[0] > 0
    size = 448
    W = known_homography(dx=-7.7, dy=3.2, degrees=-0.4, scale=1.004, about=(224, 224))
    post, post_valid = warped_post(full, valid_all, W, (100, 100, size))
    post = np.clip(post.astype(np.float32) * 1.3 + 500, 0, 65535).astype(np.uint16)
    pre = full[:, 100:100 + size, 100:100 + size]
    pre_valid = valid_all[100:100 + size, 100:100 + size]
    cfg = RegistrationConfig(method="per-slice", crop_size=224)
    fit = register_slice_pair(feature_grey(pre, pre_valid, cfg), pre_valid,
                              feature_grey(post, post_valid, cfg), post_valid, cfg)
    assert fit.reject_reason is None, fit.reject_reason
    assert np.max(corner_errors(fit.homography, W, size, cfg.crop_size)) < 1.0


@pytest.mark.parametrize("method", ["percentile", "clahe"])
def test_cloud_mask_plugs_into_the_feature_normalisation(method):
    """A per-pixel invalid mask (here the real SCL clouds of the 68 % cloudy date) is kept out of
    the statistics: the land gets the contrast the clouds took."""
    data, valid = zagreb("20230810")
    scl = rasterio.open(ZAGREB / "20230810_SCL.tif").read(1)
    cloud = np.isin(scl, [3, 8, 9, 10])  # SCL shadow, cloud medium/high, cirrus
    land = valid & np.isin(scl, [4, 5])  # SCL vegetation, bare soil
    cfg = RegistrationConfig(sift_normalisation=method)
    plain = feature_grey(data, valid, cfg)
    masked = feature_grey(data, valid, cfg, invalid=cloud)
    assert masked[land].std() >= 1.3 * plain[land].std(), (masked[land].std(), plain[land].std())
    saturated = data.copy()
    saturated[0, :50] = 65535  # saturated rows must not set the stretch either
    np.testing.assert_allclose(feature_grey(saturated, valid, cfg)[300:], plain[300:], atol=0.03)


def test_matching_is_deterministic_whatever_ran_before():
    rng = np.random.default_rng(1)
    query = rng.integers(0, 255, (1500, 128)).astype(np.uint8)
    train = np.concatenate([np.clip(query + rng.integers(-40, 40, query.shape), 0, 255),
                            rng.integers(0, 255, (1500, 128))]).astype(np.uint8)
    first = match_descriptors(query, train, CFG)
    cv2.randu(np.zeros(100), 0, 1)  # other work drawing from OpenCV's RNG in between
    second = match_descriptors(query, train, CFG)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_inliers_in_a_strip_do_not_give_a_degenerate_homography():
    """164 correct matches crowded into a thin strip (a cloud-free band): an unconstrained
    homography fitted to them extrapolates into a mirrored/singular/sheared mapping elsewhere; the
    fit must fall back to a model the strip determines and stay right over the kept crop."""
    rng = np.random.default_rng(0)
    true = known_homography(dx=2.0, dy=-1.0, degrees=0.1, about=(750, 750))
    failures = 0
    for _ in range(20):
        cx, cy = rng.uniform(300, 1200, 2)
        post = np.c_[rng.normal(cx, 250, 164), rng.normal(cy, 6, 164)]
        pre = apply_homography(true, post) + rng.normal(0, 0.4, (164, 2))
        fit = fit_homography(post, pre, CFG, slice_side=1500)
        ok = fit.homography is not None and \
            homography_problem(fit.homography, 1500, 1024, CFG) is None and \
            np.max(corner_errors(fit.homography, true, 1500, 1024)) < 3.0
        failures += not ok
    assert failures == 0


def test_nodata_is_kept_out_of_keypoints():
    data = naip_rgb()[:, :400, :400]
    valid = np.ones((400, 400), bool)
    valid[:, 200:] = False
    grey = grey_from_bands(data, [[0, 255]] * 3, valid)
    xy, _ = detect_features(grey, valid, CFG)
    assert len(xy) > 20
    assert xy[:, 0].max() < 200 - CFG.mask_erode_px + 1


def test_flat_post_is_rejected_with_a_reason():
    pre = naip_rgb()[:, :512, :512]
    valid = np.ones((512, 512), bool)
    flat = np.full((512, 512), 0.5, np.float32)
    fit = register_slice_pair(grey_from_bands(pre, [[0, 255]] * 3), valid, flat, valid, CFG)
    assert fit.homography is None and "too few" in fit.reject_reason


def test_unrelated_post_is_rejected_with_a_reason():
    full = naip_rgb()
    pre = full[:, :512, :512]
    other = s2_band()[:, :512, :512]
    valid = np.ones((512, 512), bool)
    fit = register_slice_pair(grey_from_bands(pre, unit_stretch(pre)), valid,
                              grey_from_bands(other, unit_stretch(other)), valid, CFG)
    assert fit.homography is None
    # Unrelated texture matches somewhere by chance, but no consistent homography holds those matches.
    found = re.fullmatch(r"too few inliers \((\d+) < (\d+)\)", fit.reject_reason or "")
    assert found, fit.reject_reason
    assert int(found[1]) == fit.n_inliers < int(found[2]) == CFG.min_inliers


@pytest.mark.parametrize("H, expect", [
    (np.diag([1.0, -1.0, 1.0]), "mirrored"),
    (np.diag([1.5, 1.5, 1.0]), "scale"),
    (np.array([[1.0, 0.2, 0], [0, 1.0, 0], [0, 0, 1]]), "anisotropy"),
    (np.array([[1.0, 0, 0], [0, 1.0, 0], [1e-4, 0, 1]]), "perspective"),
    (translation(500, 0), "corner moves"),
    (np.zeros((3, 3)), "degenerate"),
])
def test_degenerate_homographies_get_reasons(H, expect):
    reason = homography_problem(H, 512, 256, CFG)
    assert reason is not None and expect in reason


def test_plausible_homography_passes():
    assert homography_problem(known_homography(about=(256, 256)), 512, 256, CFG) is None


def test_crop_positions_use_post_to_pre_convention():
    rng = np.random.default_rng(0)
    post = rng.integers(0, 255, (1, 300, 300), dtype=np.uint8)
    H = translation(5, 3)  # post pixel (x, y) lands on pre pixel (x + 5, y + 3)
    # Slice at grid (10, 20), crop offset 50: crop pixel (0, 0) is grid (60, 70) in pre, so the
    # post pixel it shows is grid (55, 67).
    gx, gy = crop_positions_on_grid(H, (10, 20, 200, 200), 50, 100)
    assert (gx[0, 0], gy[0, 0]) == (55.0, 67.0)
    out, valid = remap_bands(post, np.ones((300, 300), bool), gx.astype(np.float32),
                             gy.astype(np.float32), "nearest")
    assert valid.all()
    np.testing.assert_array_equal(out[0], post[0, 67:167, 55:155])


def test_crop_positions_equal_the_per_point_float64_map_at_paper_geometry():
    """The separable map equals mapping every crop pixel through H^-1 one by one (the old code),
    to far below 0.01 px, for a perspective homography on a slice deep in a 12k px scene."""
    H = np.array([[1.0012, 0.0021, -23.4], [-0.0019, 0.9991, 17.8], [2.1e-6, -1.4e-6, 1.0]])
    window, off, crop = (9216, 8192, 3000, 3000), 988, 1024
    gx, gy = crop_positions_on_grid(H, window, off, crop)
    v, u = np.mgrid[0:crop, 0:crop].astype(np.float64)
    ref = apply_homography(np.linalg.inv(H), np.stack([u.ravel() + off, v.ravel() + off], 1))
    assert gx.shape == gy.shape == (crop, crop)
    assert np.abs(gx - (ref[:, 0].reshape(crop, crop) + window[0])).max() < 0.01
    assert np.abs(gy - (ref[:, 1].reshape(crop, crop) + window[1])).max() < 0.01


def test_config_fields_all_have_help_and_validate():
    helps = RegistrationConfig.field_help()
    assert helps and all(helps.values())
    assert RegistrationConfig().method == "regional"
    assert (RegistrationConfig().crop_size, RegistrationConfig().max_residual_px) == (1024, 8.0)
    with pytest.raises(ValueError):
        RegistrationConfig(method="magic")


def test_features_do_not_depend_on_where_the_data_sits_in_nodata():
    """SIFT runs on the valid pixels' bounding box only: one real image placed at two offsets of
    different parity in a nodata canvas gives the same keypoints (shifted) and descriptors. Run
    over the whole canvas, the octaves' 2x decimation samples the two placements differently."""
    with rasterio.open(NAIP) as src:
        img = src.read([1, 2, 3], window=((100, 300), (150, 390)))
    cfg = RegistrationConfig()
    grey = feature_grey(img, np.ones(img.shape[1:], bool), cfg)
    out = []
    for top, left in ((17, 31), (50, 4)):
        canvas = np.full((300, 320), 0.5, np.float32)
        valid = np.zeros(canvas.shape, bool)
        canvas[top:top + 200, left:left + 240] = grey
        valid[top:top + 200, left:left + 240] = True
        xy, desc = detect_features(canvas, valid, cfg)
        order = np.lexsort((xy[:, 1], xy[:, 0]))
        out.append((xy[order] - np.float32([left, top]), desc[order]))
    assert len(out[0][0]) > 50
    assert np.allclose(out[0][0], out[1][0], atol=1e-3) and np.array_equal(out[0][1], out[1][1])
    inside = (out[0][0] >= -0.5).all() and (out[0][0][:, 0] < 239.5).all()
    assert inside and (out[0][0][:, 1] < 199.5).all()


# ---- the chance-based fit test -----------------------------------------------------------------

def look_alikes(rng, true: np.ndarray, n: int, radius: float, side: float):
    """``n`` wrong matches drawn as guided matching returns them on changed land or water: each
    within ``radius`` px of where the prior (the true mapping) puts its partner."""
    post = rng.uniform(0, side, (n, 2))
    ang, rad = rng.uniform(0, 2 * np.pi, n), radius * np.sqrt(rng.uniform(0, 1, n))
    return post, apply_homography(true, post) + np.c_[rad * np.cos(ang), rad * np.sin(ang)]


GUIDED = RegistrationConfig(crop_size=1024)        # regional, guided radius 16, RANSAC 3 px


def test_thousands_of_correct_inliers_among_look_alikes_are_accepted():
    """Paper geometry: a 3000 px slice with 5,000 correct matches and 25,000 look-alikes within
    the guided radius (changed land, water). The fixed share (8 + 0.3 x 30,000 = 9,008) rejected
    it; chance gives ~1,050 inliers, far below the 5,000 correct ones."""
    rng = np.random.default_rng(0)
    true = known_homography(dx=3.0, dy=-2.0, degrees=0.05, scale=1.0005, about=(1500, 1500))
    good_post = rng.uniform(0, 3000, (5000, 2))
    good_pre = apply_homography(true, good_post) + rng.normal(0, 0.5, (5000, 2))
    bad_post, bad_pre = look_alikes(rng, true, 25000, 16.0, 3000)
    fit = fit_homography(np.r_[good_post, bad_post], np.r_[good_pre, bad_pre], GUIDED, 3000)
    assert fit.homography is not None, fit.reject_reason
    assert np.max(corner_errors(fit.homography, true, 3000, 1024)) < 1.0


def test_self_consistent_repeated_texture_is_not_accepted():
    """Look-alike matches over the whole slice, and 1,500 matches on a repeated texture in one
    part of the crop (field rows) that agree with each other on a wrong shift of one period
    (8 px). Their count beats chance, but the crop's other cells hold only chance inliers."""
    rng = np.random.default_rng(1)
    true = known_homography(dx=3.0, dy=-2.0, degrees=0.0, scale=1.0, about=(1500, 1500))
    bad_post, bad_pre = look_alikes(rng, true, 30000, 16.0, 3000)
    rows_post = rng.uniform(1000, 1400, (1500, 2))
    rows_pre = apply_homography(true, rows_post) + (8.0, 0.0) + rng.normal(0, 0.5, (1500, 2))
    fit = fit_homography(np.r_[bad_post, rows_post], np.r_[bad_pre, rows_pre], GUIDED, 3000)
    assert fit.homography is None
    assert fit.reject_reason.startswith(("low fit confidence", "inliers back"))


def test_a_small_match_set_keeps_the_floor():
    """A handful of matches: the Brown-Lowe floor (8 + 0.3 x matches) still applies."""
    rng = np.random.default_rng(2)
    true = translation(2.0, 1.0)
    post = rng.uniform(0, 512, (60, 2))
    pre = apply_homography(true, post)
    pre[25:] += rng.uniform(-40, 40, (35, 2))          # 25 right, 35 wrong: 25 <= 8 + 18
    fit = fit_homography(post, pre, RegistrationConfig(crop_size=256, min_inliers=10), 512)
    assert fit.homography is None and fit.reject_reason.startswith("low fit confidence")
