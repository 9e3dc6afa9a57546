"""Per-slice registration on real imagery warped by a known homography plus radiometric change."""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import rasterio

from operators.pairs.registration import (RegistrationConfig, apply_homography, crop_corners,
                                    crop_offset, detect_features, grey_from_bands,
                                    homography_problem, register_slice_pair, translation,
                                    warp_post_to_crop)

DATA = Path(__file__).resolve().parents[2] / "data"
NAIP = DATA / "naip" / "m_4709963_se_14_1_20160816.tif"
S2 = DATA / "uint16" / "s2_B8A.jp2"


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


def test_sift_input_is_documented_8bit_of_float_grey():
    # OpenCV 5 SIFT refuses float input; detect_features quantises the float grey itself.
    grey = grey_from_bands(naip_rgb()[:, :256, :256], [[0, 255]] * 3)
    assert grey.dtype == np.float32 and 0 <= grey.min() and grey.max() <= 1
    with pytest.raises(cv2.error):
        cv2.SIFT_create().detectAndCompute(grey, None)
    xy, desc = detect_features(grey, None, CFG)
    assert len(xy) > 50 and desc.dtype == np.uint8 and desc.shape[1] == 128


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
    assert fit.reject_reason


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


def test_warp_uses_post_to_pre_convention():
    rng = np.random.default_rng(0)
    post = rng.integers(0, 255, (1, 300, 300), dtype=np.uint8)
    H = translation(5, 3)  # post pixel (x, y) lands on pre pixel (x + 5, y + 3)
    out, valid = warp_post_to_crop(post, np.ones((300, 300), bool), H, (0, 0), (50, 50), 100,
                                   "nearest")
    assert valid.all()
    np.testing.assert_array_equal(out[0], post[0, 47:147, 45:145])
    # Same crop from a sub-window of post (the regional method's reads).
    out2, _ = warp_post_to_crop(post[:, 40:160, 30:170], np.ones((120, 140), bool), H, (30, 40),
                                (50, 50), 100, "nearest")
    np.testing.assert_array_equal(out2, out)


def test_config_fields_all_have_help_and_validate():
    helps = RegistrationConfig.field_help()
    assert helps and all(helps.values())
    assert RegistrationConfig().method == "regional"
    assert (RegistrationConfig().crop_size, RegistrationConfig().max_residual_px) == (1024, 8.0)
    with pytest.raises(ValueError):
        RegistrationConfig(method="magic")
