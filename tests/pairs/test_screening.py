"""Screening by phase correlation, independent of the SIFT fit."""
from __future__ import annotations

import numpy as np

from operators.pairs.registration import RegistrationConfig, grey_from_bands
from operators.pairs.screening import local_shift, screen_alignment
from tests.pairs.test_registration import naip_rgb

import cv2

CFG = RegistrationConfig(crop_size=256, screen_window_px=64)


def crop_pair():
    full = naip_rgb()
    grey = grey_from_bands(full, [[0, 255]] * 3)
    return grey, grey[200:456, 300:556]


def test_aligned_pair_passes_with_small_residual():
    full, pre = crop_pair()
    # Same scene with a gamma/gain change: radiometry must not register as misalignment.
    post = np.clip(1.2 * pre ** 0.8 - 0.05, 0, 1).astype(np.float32)
    r = screen_alignment(pre, post, np.ones(pre.shape, bool), CFG)
    assert r.reject_reason is None
    assert r.residual_px < 1.0 and r.n_confident >= CFG.screen_min_windows


def test_shift_beyond_8px_is_rejected():
    full, pre = crop_pair()
    post = full[200 + 7:456 + 7, 300 + 9:556 + 9]  # 11.4 px misregistration
    r = screen_alignment(pre, post, np.ones(pre.shape, bool), CFG)
    assert r.reject_reason is not None and "residual" in r.reject_reason
    assert 10.0 < r.residual_px < 13.0


def test_shift_below_8px_is_measured_and_accepted():
    full, pre = crop_pair()
    post = full[200 + 3:456 + 3, 300 + 4:556 + 4]
    r = screen_alignment(pre, post, np.ones(pre.shape, bool), CFG)
    assert r.reject_reason is None
    assert abs(r.residual_px - 5.0) < 1.0


def test_no_common_texture_is_inconclusive():
    _, pre = crop_pair()
    valid = np.ones(pre.shape, bool)
    flat = np.full(pre.shape, 0.4, np.float32)
    noise = np.random.default_rng(1).random(pre.shape).astype(np.float32)
    for post in (flat, noise):
        r = screen_alignment(pre, post, valid, CFG)
        assert r.reject_reason is not None and "inconclusive" in r.reject_reason


def test_nodata_windows_are_not_used():
    _, pre = crop_pair()
    valid = np.zeros(pre.shape, bool)  # nothing valid: nothing to screen
    r = screen_alignment(pre, pre.copy(), valid, CFG)
    assert r.n_windows == 0 and "inconclusive" in r.reject_reason


def test_phase_correlation_inputs_are_not_modified():
    _, pre = crop_pair()
    a, b = pre[:64, :64].copy(), pre[3:67, 2:66].copy()
    a0, b0 = a.copy(), b.copy()
    hann = cv2.createHanningWindow((64, 64), cv2.CV_32F)
    first = local_shift(a, b, hann)
    second = local_shift(a, b, hann)
    np.testing.assert_array_equal(a, a0)
    np.testing.assert_array_equal(b, b0)
    assert first == second
    assert abs(abs(first[0]) - 2) < 0.5 and abs(abs(first[1]) - 3) < 0.5
