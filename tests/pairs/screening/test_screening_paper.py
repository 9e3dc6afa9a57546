"""Screening's safeguards at the paper's 1024 px crop (128 px windows) and at the benchmark's small
crops (24 px windows): smooth texture whose correlation peaks are wider than the peak box, a
ridge, noisy windows that do not cover the crop, a curved residual, off-nadir lean of real
building footprints (LEVIR-CD masks) on registered ground, and a patch displaced within a small
crop. The planted pairs are the benchmark's (``benchmarks.registration_real.planted_pair``)."""
from __future__ import annotations

import cv2
import numpy as np
import pytest

from benchmarks.registration_real import planted_pair
from operators.pairs.registration.registration import RegistrationConfig, grey_from_bands
from operators.pairs.screening.fields import corner_residual
from operators.pairs.screening.lean import LEAN_MIN_WINDOW
from operators.pairs.screening.peaks import match_window
from operators.pairs.screening.screening import DISPLACED, screen_alignment
from operators.pairs.screening.windows import WindowShift
from tests.conftest import DATA
from tests.pairs.registration.test_registration import naip_rgb

LEVIR = DATA / "levir-cd" / "label"
SIZES = [1024, 192]            # 128 px and 24 px windows


@pytest.fixture(scope="module")
def grey():
    return grey_from_bands(naip_rgb(), [[0, 255]] * 3)


def scene_for(grey, crop: int, factor: float = 1.0) -> np.ndarray:
    f = max(factor, 1.6 if crop > 700 else 1.0)
    return np.ascontiguousarray(cv2.resize(grey, None, fx=f, fy=f, interpolation=cv2.INTER_CUBIC),
                                np.float32)


def planted(grey, case: str, crop: int, seed: int = 0, factor: float = 1.0) -> dict:
    scene = scene_for(grey, crop, factor)
    return planted_pair(case, scene, crop, 192, 288, seed, LEVIR) if crop < 700 else \
        planted_pair(case, scene, crop, 40, 30, seed, LEVIR)


def screened(pair: dict, crop: int, **settings):
    return screen_alignment(pair["pre"], pair["post"], pair["valid"],
                            RegistrationConfig(crop_size=crop, **settings))


@pytest.mark.parametrize("win", [128, 24])
def test_a_ridge_is_never_trusted(win):
    """Stripes along one axis only (a field edge, a road): the template matches all along the
    stripes' direction, a ridge of the surface that is one connected region. Not trusted."""
    c = 8 * win
    rng = np.random.default_rng(2)
    profile = cv2.GaussianBlur(rng.random((c + 40, 1)).astype(np.float32), (0, 0), 2.0)[:, 0]
    img = np.tile(profile[:, None], (1, c + 40)) + 0.002 * rng.standard_normal((c + 40, c + 40))
    img = img.astype(np.float32)
    pre, post = np.ascontiguousarray(img[:c, :c]), np.ascontiguousarray(img[:c, 7:7 + c])
    x0 = y0 = c // 2
    assert match_window(pre[y0:y0 + win, x0:x0 + win], post, x0, y0, 16, 0.3, 0.05) is None


def noisy_partial_grid(seed: int, noise: float = 1.0):
    """A clean 1024 crop's windows (no displacement) measured with ``noise`` px of error shared
    by each 2 x 2 block of overlapping windows, on the lower two thirds of the grid only (the
    top untextured) and with 45 % of them unmeasured: what real NAIP crops at 4.2x looked like."""
    rng = np.random.default_rng(seed)
    coarse = rng.normal(0, noise, (9, 9, 2))            # one value per 2 x 2 block of windows
    out = []
    for r in range(5, 15):
        for c in range(15):
            if rng.random() < 0.45:
                continue                                 # unmeasured (changed land)
            d = coarse[r // 2, c // 2]
            out.append(WindowShift(c * 64 + 63.5, r * 64 + 63.5, float(d[0]), float(d[1]), 0.6,
                                   r, c))
    return out


def test_the_corner_standard_error_counts_shared_pixels():
    """Windows at half-window steps share pixels, so neighbouring windows share their errors.
    On a clean crop (no displacement) whose windows carry such errors, the extrapolated corner
    value should rarely exceed 3 of its standard errors; computed as if the windows were
    independent, it did in a third of the trials (real NAIP 1024 crops at 4.2x: corners 6.6-8.0
    px at 1.7-2.3 px standard error, true error under 1 px)."""
    def share_over(overlap):
        z = [e.value / e.se for e in (corner_residual(noisy_partial_grid(s, 0.5), 1024, 1024,
                                                      overlap=overlap) for s in range(200))]
        return float(np.mean(np.array(z) > 3.0))
    assert share_over(4.0) <= 0.02
    assert share_over(1.0) > 0.2            # the independent-window error, for contrast


@pytest.mark.parametrize("crop", SIZES)
def test_a_curved_residual_is_not_extrapolated_as_a_plane(grey, crop):
    """A smooth bowl, 0 px at the centre and 12 px at the corners: the windows nearest the
    corners see 9 px, alone, and an affine or bilinear field trims them as outliers. The
    quadratic field follows the curve to the corners: rejected."""
    r = screened(planted(grey, "curved-12px", crop, seed=1), crop)
    assert r.reject_reason is not None and "corner" in r.reject_reason, r.reject_reason
    # The same bowl at 4 px is accepted (curvature within the limit).
    assert screened(planted(grey, "curved-4px", crop, seed=1), crop).reject_reason is None


@pytest.mark.parametrize("crop", SIZES)
def test_off_nadir_lean_is_measured_on_registered_ground(grey, crop):
    """LEVIR-CD building footprints raised and leaned (10-25 px at 1024, 10-14 px at 192) on
    registered ground: the roofs' windows disagree with the ground in one direction. Accepted on
    the ground field, the lean measured within 2 px and its direction within 10 degrees; with
    lean modelling off, the same crop is a displaced region. At 192 px (24 px windows, under
    LEAN_MIN_WINDOW) no lean is told from ground moved as a whole: the roofs are displacement."""
    pair = planted(grey, "off-nadir-lean", crop, seed=0)
    lean_px, deg = pair["lean"]
    r = screened(pair, crop)
    if RegistrationConfig(crop_size=crop).screen_window() < LEAN_MIN_WINDOW:
        assert r.reject_code == DISPLACED and r.lean is None, (r.reject_reason, r.lean)
        return
    assert r.reject_reason is None, r.reject_reason
    assert r.lean is not None and abs(r.lean.px - lean_px) < 2.0, (r.lean, lean_px)
    assert abs((r.lean.deg - deg + 180) % 360 - 180) < 10
    assert r.residual_px < 8.0               # the ground's residual, not the roofs'
    off = screened(pair, crop, screen_lean=False)
    assert off.reject_reason is not None and off.reject_reason.startswith("displaced region")


@pytest.mark.parametrize("crop", SIZES)
def test_a_displaced_patch_is_no_lean(grey, crop):
    """A region of 0.3 of the side whose content moved 56 px as a whole: one direction, like a
    lean, but no registered ground inside it. A displaced region at both sizes (at 192 px the
    far search used to stop at a quarter of the side, 48 px, and the patch's windows found
    nothing: accepted)."""
    r = screened(planted(grey, "displaced-patch-56px", crop), crop)
    assert r.reject_reason is not None and r.reject_reason.startswith("displaced region"), \
        r.reject_reason
    assert r.lean is None


def test_the_hidden_constants_are_settings(grey):
    """screen_agree_px, screen_region_windows, screen_min_usable, screen_near_factor and
    screen_far_fraction steer screening: the 56 px patch in a 192 crop is found only when the
    far search reaches it."""
    pair = planted(grey, "displaced-patch-56px", 192)
    assert screened(pair, 192).reject_reason.startswith("displaced region")
    assert screened(pair, 192, screen_far_fraction=0.25).reject_reason is None
    clean = planted(grey, "clean-3px", 192)
    assert screened(clean, 192).reject_reason is None
    # Within 0.01 px few windows have a neighbour that agrees: most lose their support (the
    # corner field then rests on the few left, with a larger standard error).
    loose, tight = screened(clean, 192), screened(clean, 192, screen_agree_px=0.01)
    assert tight.n_confident < loose.n_confident / 2
    assert tight.corner_se_px > loose.corner_se_px
