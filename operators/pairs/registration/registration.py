"""Slice-pair registration (S2Looking step 4): SIFT matches, RANSAC homography, warp, central crop.

Pure numpy/OpenCV functions, no I/O and no Ray: the operators in ``regional_ops`` and ``per_slice_ops`` read windows and
call these.

Conventions used throughout:

* Pixel coordinates are (x, y) = (column, row) with pixel *centres* at integer coordinates, as
  OpenCV uses them. A slice's coordinates have their origin at the centre of the slice window's
  top-left pixel; pre and post slices share the window on the common grid (the pre scene's), so
  slice coordinates = common-grid coordinates - (col_off, row_off) for both dates.
* ``homography`` is a 3x3 matrix ``H`` mapping **post-slice** pixel coordinates to **pre-slice**
  pixel coordinates: ``[x_pre, y_pre, 1] ~ H @ [x_post, y_post, 1]``. The registered post crop is
  ``post`` resampled at ``H^-1(p)`` for every pre pixel ``p`` of the kept crop.
* Grey for features is normalised on the window being processed (a feature tile or a slice), not
  by the scene's stretch: ``radiometry.local_unit`` stretches each band by robust percentiles over
  the valid, non-saturated, unmasked pixels of that window, averages the bands, and by default
  applies CLAHE. A scene-wide stretch of a cloudy date leaves the land in a few grey levels after
  the 8-bit quantisation SIFT needs (OpenCV 5's SIFT takes CV_8U only), which is what made every
  slice of a cloudy Sentinel-2 pair fail. The 8-bit PNGs keep the per-scene stretch.
* The fitted model follows the inliers' support: a full homography (the paper's model) when the
  inliers span the slice in both directions; otherwise a similarity fitted to the same inliers.
  A homography's 8 parameters are not determined by inliers crowded into a strip or a corner (a
  cloud-free band, a nodata edge): RANSAC then returns a matrix that agrees with 164 inliers and
  is mirrored or singular elsewhere in the slice. The plausibility checks are evaluated at the kept
  crop, not at the slice origin.
* Matching is deterministic: FLANN's randomised kd-trees draw from OpenCV's per-thread RNG; it
  is reseeded right before every index build, so the same inputs give the same matches on any
  number of CPUs and in any task order.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import cv2
import numpy as np

from operators.pairs.imagery.radiometry import local_unit, stretch_to_unit
from operators.pairs.registration.config import METHODS, RegistrationConfig  # noqa: F401 - importable from here

_INTERP = {"nearest": cv2.INTER_NEAREST, "linear": cv2.INTER_LINEAR, "cubic": cv2.INTER_CUBIC}
# Same fits on clear slices; on slices with few inliers the classic loop spends its whole
# iteration budget (~20-100 ms a slice) where USAC stops in about one. USAC_ACCURATE's graph-cut
# optimisation runs out of memory (std::bad_alloc) on a 3000 px slice's ~50,000 matches.
_ROBUST = {"ransac": cv2.RANSAC, "usac_fast": cv2.USAC_FAST}


# ---- grey and features -----------------------------------------------------------------------

def grey_from_bands(data: np.ndarray, stretch: Sequence[Sequence[float]],
                    valid: Optional[np.ndarray] = None) -> np.ndarray:
    """(bands, H, W) any dtype -> (H, W) float32 in [0, 1]: mean of the stretched bands.

    Invalid pixels are set to 0 (they are also kept out of detection by the mask).
    """
    grey = stretch_to_unit(data, stretch).mean(axis=0, dtype=np.float32)
    if valid is not None:
        grey[~valid] = 0.0
    return grey


def feature_grey(data: np.ndarray, valid: Optional[np.ndarray], cfg: RegistrationConfig,
                 invalid: Optional[np.ndarray] = None) -> np.ndarray:
    """(bands, H, W) any dtype -> (H, W) float32 in [0, 1] for SIFT, normalised on this window.

    ``invalid``: optional extra per-pixel mask (clouds, shadows) kept out of the statistics; pass
    it to :func:`detect_features` too (``valid & ~invalid``) to keep keypoints out of it.
    """
    return local_unit(data, valid, cfg.sift_normalisation,
                      (cfg.sift_stretch_low, cfg.sift_stretch_high), cfg.sift_clahe_clip,
                      cfg.sift_clahe_tile_px, invalid)


def feature_image(data: np.ndarray, valid: Optional[np.ndarray], cfg: RegistrationConfig,
                  invalid: Optional[np.ndarray] = None) -> np.ndarray:
    """SIFT's 8-bit input: :func:`feature_grey` as :func:`detect_features` quantises it (the same
    values), made without the float image (``local_unit(..., as_uint8=True)``)."""
    return local_unit(data, valid, cfg.sift_normalisation,
                      (cfg.sift_stretch_low, cfg.sift_stretch_high), cfg.sift_clahe_clip,
                      cfg.sift_clahe_tile_px, invalid, as_uint8=True)


def detection_mask(valid: np.ndarray, erode_px: int) -> np.ndarray:
    """uint8 mask (255 = may hold keypoints): valid pixels shrunk by ``erode_px``."""
    mask = valid.astype(np.uint8) * 255
    if erode_px > 0 and not mask.all():
        kernel = cv2.getStructuringElement(cv2.MORPH_RECT, (2 * erode_px + 1, 2 * erode_px + 1))
        # Border pixels count as valid so only real nodata shrinks the mask, not the window edge.
        mask = cv2.erode(mask, kernel, borderType=cv2.BORDER_CONSTANT, borderValue=255)
    return mask


def make_sift(cfg: RegistrationConfig):
    # 8-bit descriptors: OpenCV rounds and saturates them to [0, 255] in either type, so these
    # are the float descriptors' values without the float copy.
    return cv2.SIFT_create(int(cfg.sift_max_features), int(cfg.sift_octave_layers),
                           float(cfg.sift_contrast_threshold), float(cfg.sift_edge_threshold),
                           float(cfg.sift_sigma), cv2.CV_8U)


def detect_features(grey: np.ndarray, valid: Optional[np.ndarray],
                    cfg: RegistrationConfig) -> tuple[np.ndarray, np.ndarray]:
    """SIFT on a float grey image in [0, 1], or its 8-bit form (:func:`feature_image`) ->
    (xy (N, 2) float32, descriptors (N, 128) uint8).

    SIFT descriptors in OpenCV are integer valued in [0, 255], so uint8 storage is lossless and
    a quarter of the size (they travel between regional stages).
    """
    mask = detection_mask(valid, cfg.mask_erode_px) if valid is not None else None
    if mask is not None and not mask.any():
        return np.zeros((0, 2), np.float32), np.zeros((0, 128), np.uint8)
    # SIFT runs on the bounding box of the valid pixels only: no keypoint can lie outside it (the
    # mask), so its scale pyramid there (past a scene's edge, over a nodata band) is wasted work.
    r0 = c0 = 0
    if valid is not None and not np.all(valid):
        rows, cols = np.flatnonzero(valid.any(axis=1)), np.flatnonzero(valid.any(axis=0))
        r0, r1, c0, c1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
        grey, mask = grey[r0:r1, c0:c1], mask[r0:r1, c0:c1]
    image = grey if grey.dtype == np.uint8 else \
        np.rint(np.clip(grey, 0.0, 1.0) * 255.0).astype(np.uint8)
    keypoints, desc = make_sift(cfg).detectAndCompute(np.ascontiguousarray(image), mask)
    if desc is None or not keypoints:
        return np.zeros((0, 2), np.float32), np.zeros((0, 128), np.uint8)
    xy = cv2.KeyPoint_convert(keypoints).astype(np.float32).reshape(-1, 2) + np.float32([c0, r0])
    return xy, np.clip(np.rint(desc), 0, 255).astype(np.uint8) if desc.dtype != np.uint8 else desc


def seed_flann(seed: int) -> None:
    """Seed OpenCV's per-thread RNG, which its bundled FLANN draws from for the kd-trees (split
    dimensions and point order); without it matches depend on what ran before in the thread."""
    cv2.setRNGSeed(int(seed))


def match_descriptors(query: np.ndarray, train: np.ndarray,
                      cfg: RegistrationConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FLANN kd-tree 2-NN with Lowe's ratio test -> (query_idx, train_idx, distance).

    Brute force breaks at 2^18 train descriptors in OpenCV 5; FLANN has no such limit.
    """
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))
    if len(query) < 1 or len(train) < 2:
        return empty
    flann = cv2.FlannBasedMatcher({"algorithm": 1, "trees": int(cfg.flann_trees)},
                                  {"checks": int(cfg.flann_checks)})
    seed_flann(cfg.flann_seed)  # the kd-trees are built inside knnMatch
    pairs = flann.knnMatch(np.ascontiguousarray(query, np.float32),
                           np.ascontiguousarray(train, np.float32), k=2)
    qi, ti, dist = [], [], []
    for pair in pairs:
        if len(pair) == 2 and pair[0].distance < cfg.ratio * pair[1].distance:
            qi.append(pair[0].queryIdx)
            ti.append(pair[0].trainIdx)
            dist.append(pair[0].distance)
    if not qi:
        return empty
    return np.asarray(qi, np.int64), np.asarray(ti, np.int64), np.asarray(dist, np.float32)


# ---- homography fit and its sanity -----------------------------------------------------------

@dataclass
class HomographyFit:
    homography: Optional[np.ndarray]   # 3x3 post-slice -> pre-slice, None when no fit
    n_matches: int
    n_inliers: int
    reject_reason: Optional[str] = None
    # The matches the fit came from, (post_xy, pre_xy) in slice px: what a rescue of the crop is
    # checked against (never stored).
    matches: Optional[tuple] = field(default=None, repr=False, compare=False)


def fit_homography(post_xy: np.ndarray, pre_xy: np.ndarray, cfg: RegistrationConfig,
                   slice_side: Optional[float] = None,
                   chance_rate: Optional[float] = None) -> HomographyFit:
    """RANSAC homography from matched points (post -> pre), with the inlier-count rule applied.

    When the inliers do not span ``slice_side`` (default: the points' own extent) in both
    directions, the homography is replaced by a similarity fitted to the same inliers.
    ``chance_rate``: the slice's measured chance rate per wrong match (:func:`chance_inliers`).
    """
    post_xy = np.asarray(post_xy, np.float64).reshape(-1, 2)
    pre_xy = np.asarray(pre_xy, np.float64).reshape(-1, 2)
    n = int(len(post_xy))
    if n < max(4, cfg.min_inliers):
        return HomographyFit(None, n, 0, f"too few matches ({n} < {max(4, cfg.min_inliers)})")
    seed_flann(cfg.flann_seed)  # RANSAC/LMedS sampling: same inputs, same fit
    H, inliers = cv2.findHomography(post_xy.reshape(-1, 1, 2), pre_xy.reshape(-1, 1, 2),
                                    _ROBUST[cfg.ransac_method], float(cfg.ransac_threshold_px),
                                    maxIters=int(cfg.ransac_max_iters),
                                    confidence=float(cfg.ransac_confidence))
    if H is None or inliers is None:
        return HomographyFit(None, n, 0, "RANSAC found no homography")
    n_in = int(inliers.sum())
    if n_in < cfg.min_inliers:
        return HomographyFit(None, n, n_in, f"too few inliers ({n_in} < {cfg.min_inliers})")
    side = float(slice_side or max(np.ptp(pre_xy[:, 0]), np.ptp(pre_xy[:, 1]), 1.0))
    need = confidence_inliers(n, cfg, side, chance_rate)
    if n_in <= need:
        mu, _ = chance_inliers(n, cfg, side, rate=chance_rate)
        return HomographyFit(None, n, n_in, f"low fit confidence: {n_in} inliers of {n} matches "
                                            f"(<= {need:.0f}: chance gives {mu:.0f} within "
                                            f"{cfg.ransac_threshold_px:g} of {match_radius(cfg, side):g} "
                                            f"px)")
    keep0 = inliers.ravel().astype(bool)
    if slice_side:
        cover = inlier_coverage(pre_xy, keep0, int(slice_side), cfg, chance_rate)
        if cover is not None and cover < cfg.min_inlier_coverage:
            return HomographyFit(None, n, n_in, f"inliers back {cover:.0%} of the crop's cells "
                                                f"with matches (< {cfg.min_inlier_coverage:.0%}: "
                                                f"more inliers than chance)")
    if not np.all(np.isfinite(H)) or abs(H[2, 2]) < 1e-12:
        return HomographyFit(None, n, n_in, "degenerate homography (not finite)")
    keep = keep0
    span = max(float(np.ptp(post_xy[:, 0])), float(np.ptp(post_xy[:, 1])), 1.0)
    if inlier_spread(post_xy[keep]) < cfg.min_inlier_spread * max(slice_side or span, 1.0):
        S = similarity_fit(post_xy[keep], pre_xy[keep], cfg)
        if S is None:
            return HomographyFit(None, n, n_in, "inliers too concentrated for any fit")
        return HomographyFit(S, n, n_in)
    return HomographyFit(H / H[2, 2], n, n_in)


def match_radius(cfg: RegistrationConfig, slice_side: float) -> float:
    """How far from its true partner a wrong match can lie: guided matches within the guided
    radius of the prior's prediction; otherwise anywhere in the slice (half its side)."""
    if cfg.method == "regional" and cfg.guided_matching:
        return float(cfg.guided_radius_px)
    return max(float(slice_side) / 2.0, float(cfg.ransac_threshold_px))


def chance_inliers(n_matches: int, cfg: RegistrationConfig, slice_side: float,
                   radius: Optional[float] = None,
                   rate: Optional[float] = None) -> tuple[float, float]:
    """(mean, standard deviation) of the RANSAC inliers ``n_matches`` wrong matches give by
    chance: each lies within the threshold of a model near the truth with probability p.

    p is at least (threshold / radius)^2, a wrong partner spread evenly over the disc it is
    drawn from (:func:`match_radius`). ``rate``, when given, is p as measured on the slice's
    own keypoints (``guided_matching.chance_rate``; NaN or None: not measured); the larger of the
    two is used. Guided matching picks among the 8 keypoints nearest the prediction, and on real
    texture those crowd closer than the radius: measured rates exceed the disc's."""
    r = match_radius(cfg, slice_side) if radius is None else float(radius)
    p = min(1.0, (float(cfg.ransac_threshold_px) / max(r, 1e-9)) ** 2)
    if rate is not None and np.isfinite(rate):
        p = min(1.0, max(p, float(rate)))
    return n_matches * p, float(np.sqrt(n_matches * p * (1.0 - p)))


def confidence_inliers(n_matches: int, cfg: RegistrationConfig,
                       slice_side: Optional[float] = None,
                       chance_rate: Optional[float] = None) -> float:
    """Inliers a fit must exceed: more than chance gives (``fit_chance_factor`` x its mean plus
    ``fit_chance_sigma`` standard deviations, :func:`chance_inliers`), and for small match sets
    the Brown-Lowe share (OpenCV stitching's ``inliers / (8 + 0.3 matches) > 1``) up to
    ``fit_floor_matches`` matches. A fixed share of all matches rejected slices with thousands
    of correct inliers whenever changed land or water added look-alike matches; chance is what
    wrong matches drawn near a prior can give."""
    n = int(n_matches)
    floor = 8.0 + float(cfg.min_inlier_ratio) * min(n, int(cfg.fit_floor_matches))
    if slice_side is None:
        return floor
    mu, sd = chance_inliers(n, cfg, slice_side, rate=chance_rate)
    return max(floor, cfg.fit_chance_factor * mu + cfg.fit_chance_sigma * sd)


COVERAGE_CELLS = 4      # the kept crop's cells per side in which inliers are counted against chance
COVERAGE_MATCHES = 8    # matches a cell needs to count (fewer: water, cloud, nodata; no evidence)
COVERAGE_MIN_CELLS = 4  # cells that count before a share means anything (fewer: no verdict)


def inlier_coverage(pre_xy: np.ndarray, inliers: np.ndarray, slice_side: int,
                    cfg: RegistrationConfig, chance_rate: Optional[float] = None) -> Optional[float]:
    """How much of the kept crop backs the fit: the crop is cut into ``COVERAGE_CELLS`` x
    ``COVERAGE_CELLS`` cells; of the cells holding at least ``COVERAGE_MATCHES`` matches, the
    share whose inliers exceed what chance gives their matches (its mean plus two standard
    deviations, and at least 2). Repeated texture agreeing with itself in one part of the crop, amid
    look-alike matches everywhere, backs the fit in that part only; a cloud-free band backs it
    wherever it has matches. None (no verdict: the count and screening decide) when fewer than
    ``COVERAGE_MIN_CELLS`` cells hold enough matches, or the crop does not fit."""
    if cfg.crop_size > slice_side:
        return None
    off = crop_offset(slice_side, cfg.crop_size)
    cell = cfg.crop_size / COVERAGE_CELLS
    rel = (np.asarray(pre_xy, np.float64) - off) / cell
    inside = np.all((rel >= 0) & (rel < COVERAGE_CELLS), axis=1)
    idx = np.floor(rel[inside]).astype(int)
    flat = idx[:, 1] * COVERAGE_CELLS + idx[:, 0]
    k = COVERAGE_CELLS * COVERAGE_CELLS
    n_cell = np.bincount(flat, minlength=k)
    in_cell = np.bincount(flat, weights=np.asarray(inliers, bool)[inside].astype(float),
                          minlength=k)
    p = chance_inliers(1, cfg, slice_side, rate=chance_rate)[0]     # per match
    # Per cell, a looser bar than the slice's (a cell is a small sample, and the slice's count
    # already beat chance): more than the chance mean plus two standard deviations.
    need = np.maximum(2.0, n_cell * p + 2.0 * np.sqrt(n_cell * p * (1 - p)))
    counted = n_cell >= COVERAGE_MATCHES
    if counted.sum() < COVERAGE_MIN_CELLS:
        return None
    return float(np.mean(in_cell[counted] > need[counted]))


def inlier_spread(xy: np.ndarray) -> float:
    """Standard deviation of points along their thinnest direction (0 for fewer than 3)."""
    xy = np.asarray(xy, np.float64).reshape(-1, 2)
    if len(xy) < 3:
        return 0.0
    return float(np.sqrt(max(np.linalg.eigvalsh(np.cov(xy.T))[0], 0.0)))


def similarity_fit(post_xy: np.ndarray, pre_xy: np.ndarray,
                   cfg: RegistrationConfig) -> Optional[np.ndarray]:
    """Rotation + uniform scale + shift (post -> pre) by least squares on given inliers, as 3x3."""
    M, _ = cv2.estimateAffinePartial2D(np.asarray(post_xy, np.float64).reshape(-1, 1, 2),
                                       np.asarray(pre_xy, np.float64).reshape(-1, 1, 2),
                                       method=cv2.LMEDS)
    if M is None or not np.all(np.isfinite(M)):
        return None
    return np.vstack([M, [0.0, 0.0, 1.0]])


def apply_homography(H: np.ndarray, xy: np.ndarray) -> np.ndarray:
    xy = np.asarray(xy, np.float64).reshape(-1, 2)
    p = np.hstack([xy, np.ones((len(xy), 1))]) @ np.asarray(H, np.float64).T
    with np.errstate(divide="ignore", invalid="ignore"):
        return p[:, :2] / p[:, 2:3]


def crop_offset(slice_size: int, crop_size: int) -> int:
    """Offset of the central crop inside a slice (the paper keeps the central 1024 x 1024)."""
    if crop_size > slice_size:
        raise ValueError(f"crop_size {crop_size} exceeds slice size {slice_size}")
    return (slice_size - crop_size) // 2


def crop_corners(offset: int, crop_size: int) -> np.ndarray:
    """Outer corners of the crop's pixels (pixel-centre coordinates, hence the -0.5)."""
    lo, hi = offset - 0.5, offset + crop_size - 0.5
    return np.array([[lo, lo], [hi, lo], [hi, hi], [lo, hi]], np.float64)


def homography_jacobian(H: np.ndarray, x: float, y: float) -> np.ndarray:
    """2x2 derivative of the homography mapping at (x, y)."""
    H = np.asarray(H, np.float64)
    w = H[2, 0] * x + H[2, 1] * y + H[2, 2]
    u = (H[0, 0] * x + H[0, 1] * y + H[0, 2]) / w
    v = (H[1, 0] * x + H[1, 1] * y + H[1, 2]) / w
    return (H[:2, :2] - np.outer([u, v], H[2, :2])) / w


def homography_problem(H: np.ndarray, slice_size: int, crop_size: int,
                       cfg: RegistrationConfig) -> Optional[str]:
    """Why ``H`` is not a plausible between-dates mapping of this slice, or None when it is.

    Scale, anisotropy and orientation are judged on the Jacobian at the kept crop's centre (where
    the mapping is used), not on ``H[:2, :2]``, which is the Jacobian at the slice origin only.
    """
    H = np.asarray(H, np.float64)
    if not np.all(np.isfinite(H)) or abs(H[2, 2]) < 1e-12:
        return "degenerate homography (not finite)"
    H = H / H[2, 2]
    centre = (slice_size - 1) / 2.0
    A = homography_jacobian(H, centre, centre)
    try:
        s = np.linalg.svd(A, compute_uv=False)
    except np.linalg.LinAlgError:
        return "degenerate homography (SVD failed)"
    if np.linalg.det(A) <= 0:
        return "degenerate homography (mirrored or singular)"
    if s[0] > cfg.max_scale_change or s[1] < 1.0 / cfg.max_scale_change:
        return f"degenerate homography (scale {s[1]:.3f}..{s[0]:.3f})"
    if s[0] / s[1] > cfg.max_anisotropy:
        return f"degenerate homography (anisotropy {s[0] / s[1]:.3f})"
    persp = (abs(H[2, 0]) + abs(H[2, 1])) * slice_size
    if persp > cfg.max_perspective:
        return f"degenerate homography (perspective {persp:.4f})"
    corners = crop_corners(crop_offset(slice_size, crop_size), crop_size)
    moved = apply_homography(np.linalg.inv(H), corners)
    shift = float(np.max(np.hypot(*(moved - corners).T)))
    if not np.isfinite(shift) or shift > cfg.max_shift_px:
        return f"degenerate homography (crop corner moves {shift:.0f} px > {cfg.max_shift_px:.0f})"
    return None


# ---- warping -----------------------------------------------------------------------------------

def translation(dx: float, dy: float) -> np.ndarray:
    return np.array([[1, 0, dx], [0, 1, dy], [0, 0, 1]], np.float64)


def crop_to_grid(H: np.ndarray, window: Sequence[int], offset: int) -> np.ndarray:
    """The homography taking a kept-crop pixel to the common-grid position of the post pixel it
    takes its value from: crop pixel -> pre slice (+ ``offset``) -> post slice (``H^-1``) ->
    grid (+ slice origin)."""
    return translation(window[0], window[1]) @ np.linalg.inv(np.asarray(H, np.float64)) @ \
        translation(offset, offset)


def homography_positions(T: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(size, size) positions T(u, v) of the pixels of a square: each row of ``T`` is linear in
    the column u and row v, so it is an outer sum of two 1-D vectors and the only per-pixel work
    is two adds and a divide (float64, ~20x cheaper than mapping every point through
    ``apply_homography``)."""
    u = np.arange(size, dtype=np.float64)
    x, y, w = ((T[i, 0] * u)[None, :] + (T[i, 1] * u + T[i, 2])[:, None] for i in range(3))
    with np.errstate(divide="ignore", invalid="ignore"):
        return x / w, y / w


def crop_positions_on_grid(H: np.ndarray, window: Sequence[int], offset: int,
                           crop_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(H, W) common-grid positions of the post pixels each kept-crop pixel takes its value from
    (:func:`crop_to_grid`, evaluated by :func:`homography_positions`)."""
    return homography_positions(crop_to_grid(H, window, offset), crop_size)


def remap_bands(data: np.ndarray, valid: np.ndarray, map_x: np.ndarray, map_y: np.ndarray,
                resampling: str = "linear") -> tuple[np.ndarray, np.ndarray]:
    """Sample (bands, h, w) at float positions (map_x, map_y) (pixel centres at integers).

    Returns (bands, H, W) in the input dtype and a validity mask (False where any interpolation
    source was invalid or outside the array).
    """
    flags = _INTERP[resampling]
    out = np.stack([cv2.remap(np.ascontiguousarray(b), map_x, map_y, flags,
                              borderMode=cv2.BORDER_CONSTANT, borderValue=0) for b in data])
    # Valid only where every interpolation source was valid: remap the mask linearly, keep full
    # weight (cubic support is wider; its extra ring is covered by the nodata rule's margin).
    vm = cv2.remap(np.asarray(valid, np.uint8) * 255, map_x, map_y, cv2.INTER_LINEAR,
                   borderMode=cv2.BORDER_CONSTANT, borderValue=0)
    return out, vm >= 255


# ---- the per-slice recipe ----------------------------------------------------------------------

def register_slice_pair(pre_grey: np.ndarray, pre_valid: np.ndarray, post_grey: np.ndarray,
                        post_valid: np.ndarray, cfg: RegistrationConfig) -> HomographyFit:
    """The paper's step 4 on one slice pair: SIFT both, FLANN ratio matches, RANSAC homography.

    Returns the fit (post-slice -> pre-slice) or a reject reason; never raises on bad imagery.
    """
    pre_xy, pre_desc = detect_features(pre_grey, pre_valid, cfg)
    post_xy, post_desc = detect_features(post_grey, post_valid, cfg)
    qi, ti, _ = match_descriptors(post_desc, pre_desc, cfg)
    return checked_fit(post_xy[qi], pre_xy[ti], pre_grey.shape[0], cfg)


def checked_fit(post_xy: np.ndarray, pre_xy: np.ndarray, slice_size: int,
                cfg: RegistrationConfig, chance_rate: Optional[float] = None) -> HomographyFit:
    """:func:`fit_homography` plus the plausibility checks. A homography that fails them (few or
    noisy inliers make its perspective terms wild) is replaced by a similarity fitted to the same
    inliers when that passes; screening then judges the result on the pixels. The fit carries
    its matches (``matches``) for the rescue's check."""
    matches = (np.asarray(post_xy, np.float64).reshape(-1, 2),
               np.asarray(pre_xy, np.float64).reshape(-1, 2))
    return replace(_checked_fit(post_xy, pre_xy, slice_size, cfg, chance_rate), matches=matches)


def _checked_fit(post_xy: np.ndarray, pre_xy: np.ndarray, slice_size: int,
                 cfg: RegistrationConfig, chance_rate: Optional[float] = None) -> HomographyFit:
    fit = fit_homography(post_xy, pre_xy, cfg, slice_side=slice_size, chance_rate=chance_rate)
    if fit.homography is None:
        return fit
    reason = homography_problem(fit.homography, slice_size, cfg.crop_size, cfg)
    if reason is None:
        return fit
    H = fit.homography
    inl = np.hypot(*(apply_homography(H, post_xy) - np.asarray(pre_xy, np.float64)).T) \
        <= cfg.ransac_threshold_px
    S = similarity_fit(np.asarray(post_xy)[inl], np.asarray(pre_xy)[inl], cfg) \
        if inl.sum() >= cfg.min_inliers else None
    if S is not None and homography_problem(S, slice_size, cfg.crop_size, cfg) is None:
        return HomographyFit(S, fit.n_matches, fit.n_inliers)
    return HomographyFit(None, fit.n_matches, fit.n_inliers, reason)


def crop_match_support(matches: Optional[tuple], H: np.ndarray, slice_size: int,
                       cfg: RegistrationConfig) -> tuple[int, int]:
    """(matches whose pre point lies in the kept crop, those within the RANSAC threshold of
    ``H``): the slice's own SIFT evidence about a homography over the crop."""
    if matches is None or H is None:
        return 0, 0
    post_xy, pre_xy = matches
    off = crop_offset(slice_size, cfg.crop_size)
    inside = np.all((pre_xy >= off - 0.5) & (pre_xy < off + cfg.crop_size - 0.5), axis=1)
    if not inside.any():
        return 0, 0
    err = np.hypot(*(apply_homography(H, post_xy[inside]) - pre_xy[inside]).T)
    return int(inside.sum()), int(np.sum(err <= cfg.ransac_threshold_px))


def nodata_fraction(*valids: np.ndarray) -> float:
    """Fraction of pixels invalid in any of the given masks."""
    ok = np.logical_and.reduce([np.asarray(v, bool) for v in valids])
    return float(1.0 - ok.mean()) if ok.size else 1.0
