"""The fit's chance model against wrong matches made the way guided matching makes them.

A wrong guided partner is the best (by descriptor) of the 8 post keypoints nearest the prior's
prediction. On real texture those crowd closer than the guided radius, so a wrong match lands
within the RANSAC threshold more often than (threshold / radius)^2. Here every match is wrong by
construction: real LEVIR-CD (0.5 m) and NAIP keypoints are matched by ``guided_match`` under a
prior shifted 3-6 guided radii in a seeded random direction, so no true partner is ever a
candidate; the share landing within the threshold of the shifted model is the chance rate. The
chance rate the fit uses (measured by guided matching under the true prior, carried by the
matches, :func:`slice_chance_rate`) must bound it.
"""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import rasterio

from operators.pairs.regional.regional import (TileFeatures, TileMatches, fit_slice, guided_match_tile,
                                               slice_chance_rate)
from operators.pairs.registration.guided_matching import MatchPrior, chance_rate, guided_match
from operators.pairs.registration.registration import (RegistrationConfig, apply_homography,
                                                       chance_inliers, detect_features, feature_grey,
                                                       fit_homography, translation)

DATA = Path(__file__).resolve().parents[3] / "data"
CFG = RegistrationConfig(crop_size=128, tile_size=512, search_margin_px=128)
T, R = CFG.ransac_threshold_px, CFG.guided_radius_px
ASSUMED = (T / R) ** 2                                  # the disc model: 0.035
DRAWS = 100


def levir(name: str) -> tuple[np.ndarray, np.ndarray]:
    a, b = (cv2.imread(str(DATA / "levir-cd" / d / name), cv2.IMREAD_COLOR) for d in "AB")
    h, w = min(a.shape[0], b.shape[0], 384), min(a.shape[1], b.shape[1], 384)
    return (a[:h, :w, ::-1].transpose(2, 0, 1), b[:h, :w, ::-1].transpose(2, 0, 1))


def naip() -> tuple[np.ndarray, np.ndarray]:
    out = []
    for date in ("20160816", "20200831"):
        with rasterio.open(DATA / "naip" / f"m_4709963_se_14_1_{date}.tif") as src:
            out.append(src.read([1, 2, 3])[:, 100:484, 100:484])
    return out[0], out[1]


SCENES = {"levir test_113": lambda: levir("test_113_0256.png"),
          "levir val_27": lambda: levir("val_27_0000_0256.png"),
          "levir test_55": lambda: levir("test_55_0256_0000.png"),
          "levir train_36": lambda: levir("train_36_0512_0512.png"),
          "naip 2016/2020": naip}


def features(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    valid = np.ones(rgb.shape[1:], bool)
    return detect_features(feature_grey(rgb, valid, CFG), valid, CFG)


@pytest.fixture(scope="module")
def observed() -> dict:
    """Per scene: (chance inliers, wrong matches) pooled over DRAWS wrong priors, and the chance
    rate per match the fit uses for the scene as one slice."""
    out = {}
    for name, load in SCENES.items():
        pre, post = load()
        (pre_xy, pre_desc), (post_xy, post_desc) = features(pre), features(post)
        tile = TileFeatures(pre_xy, pre_desc, post_xy, post_desc)
        # The dates are co-registered: the true prior is the identity.
        matches = guided_match_tile(tile, [tile], 0, 0, MatchPrior(np.eye(2, 3), 100), CFG)
        side = pre.shape[1]
        rate = slice_chance_rate(matches, (0, 0, side, side))
        p = chance_inliers(1, CFG, side, rate=rate)[0]
        rng = np.random.default_rng(48)
        hits = n = 0
        for _ in range(DRAWS):
            ang, dist = rng.uniform(0, 2 * np.pi), rng.uniform(3 * R, 6 * R)
            shift = dist * np.array([np.cos(ang), np.sin(ang)])
            qi, ti, _ = guided_match(pre_xy, pre_desc, post_xy, post_desc,
                                     np.c_[np.eye(2), shift], CFG)
            err = np.hypot(*(post_xy[ti] - (pre_xy[qi] + shift)).T)
            assert np.all(err > 0) and len(qi) > 0
            hits += int(np.sum(err <= T))
            n += len(qi)
        out[name] = (hits, n, p)
    return out


def bound(n: int, p: float) -> float:
    """Chance inliers n wrong matches stay under with rate p: mean plus three standard deviations."""
    return n * p + 3.0 * np.sqrt(n * p * (1.0 - p))


@pytest.mark.parametrize("scene", sorted(SCENES))
def test_the_fits_chance_rate_bounds_wrong_guided_matches_on_real_keypoints(observed, scene):
    hits, n, p = observed[scene]
    assert n > 1000
    assert hits <= bound(n, p), f"{hits}/{n} = {hits / n:.4f} wrong matches within {T:g} px; " \
                                f"the fit assumes {p:.4f}"


def test_the_disc_model_is_beaten_on_real_keypoints(observed):
    """The test has teeth: on the densest scene the disc model (threshold / radius)^2 alone is
    exceeded by many standard deviations, so a fit reverting to it fails the test above."""
    hits, n, _ = observed["levir test_113"]
    assert hits > bound(n, ASSUMED) + 3.0 * np.sqrt(n * ASSUMED)


def test_chance_rate_counts_candidates_within_the_threshold():
    """Hand-made pool: the prediction moved by 4 radii lands among 8 keypoints, 2 within 3 px."""
    cfg = RegistrationConfig()
    pred = np.array([[100.0, 100.0]])
    ring = [(0.5, 0.0), (0.0, 2.5), (5.0, 0.0), (0.0, 6.0), (-7.0, 0.0), (0.0, -8.0), (9.0, 9.0),
            (-9.0, -9.0), (15.0, 0.0)]             # the 9th: not among the 8 nearest
    post = pred[0] + (4.0 * cfg.guided_radius_px, 0.0) + np.array(ring)
    assert chance_rate(pred, post, cfg)[0] == pytest.approx(2 / 8)   # the other three moves: none
    assert np.isnan(chance_rate(pred + 1000.0, post, cfg)[0])       # no candidate anywhere
    assert chance_rate(np.zeros((0, 2)), post, cfg).shape == (0,)


# equivalent mutant: core/ReplaceUnaryOperator_USub_Invert on `post = np.asarray(post_xy, np.float64).reshape(-1, 2)`: numpy reads any negative size as "the rest" (~1 is -2)


def test_chance_inliers_takes_the_larger_rate_as_a_probability():
    cfg = RegistrationConfig(crop_size=1024)          # guided: the disc gives (3 / 16)^2
    assert chance_inliers(100, cfg, 3000, rate=0.5) == pytest.approx((50.0, 5.0))
    assert chance_inliers(100, cfg, 3000, rate=1.5) == pytest.approx((100.0, 0.0))
    for rate in (None, float("nan"), 0.01):
        assert chance_inliers(1024, cfg, 3000, rate=rate) == pytest.approx((36.0, np.sqrt(36.0 * 247 / 256)))


def test_a_measured_rate_above_the_disc_raises_the_bar():
    """1,000 correct inliers among 9,000 wrong matches 4-15 px off: enough against the disc's
    0.035 (bar ~780), not against a measured 0.06 (bar ~1,300); a lower measured rate never
    lowers the bar."""
    rng = np.random.default_rng(5)
    true = translation(2.0, -1.0)
    post = rng.uniform(0, 3000, (10000, 2))
    pre = apply_homography(true, post)
    ang, rad = rng.uniform(0, 2 * np.pi, 9000), np.sqrt(rng.uniform(16, 225, 9000))
    pre[1000:] += np.c_[rad * np.cos(ang), rad * np.sin(ang)]
    cfg = RegistrationConfig(crop_size=1024)
    assert fit_homography(post, pre, cfg, 3000).homography is not None
    assert fit_homography(post, pre, cfg, 3000, chance_rate=0.01).homography is not None
    fit = fit_homography(post, pre, cfg, 3000, chance_rate=0.06)
    assert fit.homography is None and fit.reject_reason.startswith("low fit confidence")
    assert "chance gives 600" in fit.reject_reason


def test_guided_matches_carry_their_rate_to_the_slice_fit():
    parts = [TileMatches(np.array([[10.0, 10.0], [50.0, 50.0]], np.float32), np.zeros((2, 2), np.float32),
                         np.zeros(2, np.float32), np.array([0.04, np.nan], np.float32)),
             TileMatches(np.array([[20.0, 20.0]], np.float32), np.zeros((1, 2), np.float32),
                         np.zeros(1, np.float32), np.array([0.08], np.float32))]
    both = TileMatches.from_bytes(TileMatches.concat(parts).to_bytes())
    assert slice_chance_rate(both, (0, 0, 40, 40)) == pytest.approx(0.06)   # NaN left out
    assert slice_chance_rate(both, (45, 45, 10, 10)) is None                # only NaN
    old = TileMatches(*(getattr(parts[0], f) for f in ("pre_xy", "post_xy", "distance")))
    assert TileMatches.from_bytes(old.to_bytes()).chance is None            # stored before rates
    assert TileMatches.concat([old, parts[1]]).chance is None
    assert fit_slice(both, (0, 0, 40, 40), CFG).reject_reason.startswith("too few matches")
