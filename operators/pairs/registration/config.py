"""Registration settings, one dataclass per concern, composed into :class:`RegistrationConfig`.

Features, matching, the fit and its checks, screening, rescue, the regional method's tiles and
scheduling each have their own dataclass; :class:`RegistrationConfig` holds one of each plus the
method and the crop size. Every setting keeps its flat name as well: ``cfg.max_residual_px`` is
``cfg.screening.max_residual_px``, ``RegistrationConfig(max_residual_px=4)`` and
``dataclasses.replace(cfg, max_residual_px=4)`` set it, and the command line and run files use the
flat names (``--max-residual-px``), so splitting changed no option.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field, fields
from typing import Any

METHODS = ("regional", "per-slice")
ROBUST_METHODS = ("ransac", "usac_fast")
RESAMPLING = ("nearest", "linear", "cubic")


def _opt(default, help: str, choices: tuple | None = None, lo=None, hi=None, **checks):  # noqa: A002 - "help" is the CLI generator's key
    # checks: operators.io.validation's keys (min, range, ...), applied before any work; lo/hi = min/max
    meta: dict = {"help": help, **checks}
    if choices is not None:
        meta["choices"] = choices
    if lo is not None:
        meta["min"] = lo
    if hi is not None:
        meta["max"] = hi
    return field(default=default, metadata=meta)


@dataclass
class FeatureConfig:
    """SIFT features: detection, the per-tile/slice grey image it runs on, FLANN's seed."""

    sift_max_features: int = _opt(0, "SIFT nfeatures cap per image (0 = unlimited); caps do not "
                                     "skip the scale pyramid, so they save matching time only")
    sift_octave_layers: int = _opt(3, "SIFT layers per octave (Lowe: 3)")
    sift_contrast_threshold: float = _opt(0.04, "SIFT contrast threshold (higher = fewer, "
                                                "stronger features)")
    sift_edge_threshold: float = _opt(10.0, "SIFT edge-response threshold")
    sift_sigma: float = _opt(1.6, "SIFT base Gaussian sigma")
    mask_erode_px: int = _opt(8, "erode the valid-data mask by this many px before detection so "
                                 "nodata edges yield no keypoints")
    sift_normalisation: str = _opt("clahe", "feature input normalisation per tile/slice: percentile "
                                            "(robust stretch over valid, non-saturated pixels) or "
                                            "clahe (that stretch, then CLAHE)", choices=("percentile", "clahe"))
    sift_stretch_low: float = _opt(1.0, "lower percentile of the per-tile/slice feature stretch")
    sift_stretch_high: float = _opt(99.0, "upper percentile of the per-tile/slice feature stretch")
    sift_clahe_clip: float = _opt(2.0, "CLAHE clip limit (sift_normalisation=clahe)")
    sift_clahe_tile_px: int = _opt(128, "CLAHE tile side in px (sift_normalisation=clahe)")
    flann_seed: int = _opt(0, "seed of FLANN's randomised kd-trees (deterministic matches)")

    def __post_init__(self):
        if self.sift_normalisation not in ("percentile", "clahe"):
            raise ValueError("sift_normalisation must be 'percentile' or 'clahe'")


@dataclass
class MatchingConfig:
    """Matching features between the dates: FLANN 2-NN with the ratio test, and the guided second
    pass (its affine prior, search radius and candidates)."""

    ratio: float = _opt(0.75, "Lowe ratio test threshold for FLANN 2-NN matches")
    flann_trees: int = _opt(4, "FLANN kd-tree count (brute force fails at >= 2^18 descriptors)")
    flann_checks: int = _opt(32, "FLANN leaf checks per query (higher = slower, more exact)")
    guided_matching: bool = _opt(True, "regional: re-match every tile's features near where the "
                                       "pair's first-pass matches predict their partner (ratio "
                                       "test among nearby candidates only); off: first pass only")
    guided_radius_px: float = _opt(16.0, "guided matching: candidates lie within this distance of "
                                         "the prior's prediction")
    guided_ratio: float = _opt(0.8, "guided matching: ratio test threshold among the candidates")
    guided_candidates: int = _opt(8, "guided matching: at most this many candidates (the nearest "
                                     "to the prediction) per feature")
    guided_max_distance: float = _opt(350.0, "guided matching: a lone candidate (no ratio test "
                                             "possible) is kept only within this SIFT descriptor "
                                             "distance (descriptors have norm 512)")
    prior_ransac_px: float = _opt(8.0, "guided matching: RANSAC threshold of the pair/tile affine "
                                       "prior fitted to the first-pass matches")
    prior_min_inliers: int = _opt(12, "guided matching: inliers a pair (or a tile neighbourhood) "
                                      "needs for its own prior")
    prior_features_per_tile: int = _opt(1000, "guided matching: the first pass, which only fits the "
                                              "affine prior, matches at most this many of a tile's "
                                              "pre features (spread evenly over the tile; 0 = all)",
                                        lo=0)
    prior_sample_min_inliers: int = _opt(200, "guided matching: a pair whose sampled first pass "
                                              "gives a prior with fewer pair-level inliers redoes "
                                              "the first pass over every feature",
                                         lo=0)

    def __post_init__(self):
        if self.guided_radius_px <= 0 or self.guided_candidates < 2:
            raise ValueError("guided_radius_px must be positive and guided_candidates >= 2")


@dataclass
class FitConfig:
    """The slice homography: its robust estimator, the checks that reject a fit, and the post warp."""

    ransac_method: str = _opt("usac_fast", "robust estimator of the slice homography: ransac "
                                           "(OpenCV's classic loop, runs to ransac_max_iters when "
                                           "inliers are scarce) or usac_fast (USAC: SPRT early "
                                           "rejection, local optimisation)", choices=("ransac", "usac_fast"))
    ransac_threshold_px: float = _opt(3.0, "RANSAC reprojection threshold in px")
    ransac_max_iters: int = _opt(5000, "RANSAC iteration cap")
    ransac_confidence: float = _opt(0.999, "RANSAC confidence")
    min_inliers: int = _opt(30, "reject a slice with fewer RANSAC inliers (good fits have hundreds)")
    min_inlier_ratio: float = _opt(0.3, "fit confidence floor for small match sets (Brown-Lowe, as "
                                        "OpenCV stitching): a fit needs more than 8 + this x "
                                        "min(matches, fit_floor_matches) inliers")
    fit_floor_matches: int = _opt(200, "match count up to which the Brown-Lowe share applies; "
                                       "beyond it the floor stays at 8 + min_inlier_ratio x this",
                                  lo=0, hi=1_000_000)
    fit_chance_factor: float = _opt(2.0, "a fit needs more inliers than this x the inliers chance "
                                         "gives (matches x p; p is measured for guided matches, "
                                         "at least (RANSAC threshold / match radius)^2) "
                                         "plus fit_chance_sigma standard deviations", lo=1.0, hi=100.0)
    fit_chance_sigma: float = _opt(4.0, "standard deviations of the chance inlier count a fit must "
                                        "exceed (with fit_chance_factor)", lo=0.0, hi=100.0)
    min_inlier_coverage: float = _opt(0.5, "share of the kept crop's 4 x 4 cells holding matches "
                                           "(at least 8) in which the fit's inliers must exceed "
                                           "chance; below: the fit is rejected (self-consistent "
                                           "repeated texture in one part of the crop)",
                                      lo=0.0, hi=1.0)
    min_inlier_spread: float = _opt(0.08, "inliers whose spread (std along their thinnest direction) "
                                          "is below this fraction of the slice side get a "
                                          "similarity instead of a homography (underdetermined)")
    max_scale_change: float = _opt(1.15, "reject if the homography's scale leaves [1/x, x]")
    max_anisotropy: float = _opt(1.05, "reject if the ratio of its singular values exceeds this")
    max_perspective: float = _opt(0.02, "reject if |h20|+|h21| times the slice size exceeds this "
                                        "(relative scale change across the slice)")
    max_shift_px: float = _opt(300.0, "reject if a kept-crop corner moves farther than this "
                                      "(geocoding error is ~40-100 px)")
    max_nodata_fraction: float = _opt(0.0, "reject if more than this fraction of the kept crop "
                                           "lacks data in either date")
    resampling: str = _opt("linear", "interpolation for the post warp: nearest|linear|cubic", choices=("nearest", "linear", "cubic"))

    def __post_init__(self):
        if self.ransac_method not in ROBUST_METHODS:
            raise ValueError(f"ransac_method must be one of {ROBUST_METHODS}")
        if self.resampling not in RESAMPLING:
            raise ValueError(f"resampling must be one of {RESAMPLING}")


@dataclass
class ScreeningConfig:
    """Screening a registered crop, independent of the SIFT fit: its windows, their correlation and
    the evidence an acceptance needs."""

    max_residual_px: float = _opt(8.0, "reject if screening finds a displacement above this "
                                       "anywhere in the crop, corners included (paper: 8 px)", min=0)
    max_residual_m: float = _opt(0.0, "the screening limit in metres of the grid's CRS (0 = use "
                                      "max_residual_px); converted with each slice's pixel size, "
                                      "ignored for a geographic CRS", min=0)
    screen_window_px: int = _opt(0, "side of the screening windows (0 = crop_size / 8, at least "
                                    "16); they tile the whole crop at half-window steps; at least "
                                    "8 when set", lo=0)
    screen_search_px: int = _opt(128, "largest displacement a window searches for when the "
                                      "nearby search finds no confident match")
    screen_min_ncc: float = _opt(0.3, "normalised cross-correlation a window's match needs (real "
                                      "pairs years apart: median ~0.4 on NAIP farmland)")
    screen_peak_margin: float = _opt(0.05, "a window's correlation peak is trusted when it beats "
                                           "the best peak elsewhere in its search area by this "
                                           "much NCC (repeated texture, aperture problem)")
    screen_min_texture: float = _opt(0.03, "grey standard deviation (unit range, after the "
                                           "crop's percentile stretch) both windows need")
    screen_min_assessed: float = _opt(0.15, "fraction of the textured windows that must be "
                                           "measured confidently; below: insufficient evidence",
                                      lo=0.0, hi=1.0)
    screen_min_windows: int = _opt(6, "agreeing windows screening needs to accept a crop (an "
                                      "affine field over the crop needs 6); fewer: insufficient "
                                      "evidence")
    screen_min_quadrants: int = _opt(3, "crop quadrants (of 4) the agreeing windows must reach; "
                                        "fewer: insufficient evidence (a far corner is unchecked)")
    screen_min_coverage: float = _opt(0.3, "share of the crop the convex hull of the agreeing "
                                           "windows' centres must cover (a full window grid "
                                           "covers about (1 - 1/8)^2 = 0.77); below: "
                                           "insufficient evidence", lo=0.0, hi=1.0)
    screen_corner_k: float = _opt(2.0, "a crop corner is accepted only when its extrapolated "
                                       "displacement plus this many standard errors of the "
                                       "prediction stays within the limit", lo=0.0, hi=10.0)
    screen_shift_noise_px: float = _opt(0.3, "least noise (px) assumed for a window's measured "
                                             "shift: in the corner's standard error (windows that "
                                             "agree perfectly are not exact), and the least "
                                             "deviation from the ground field a lean crop's "
                                             "report reads again without roofs",
                                        lo=0.0, hi=10.0)
    screen_peak_box_px: int = _opt(6, "largest half-side (px) of the box about a window's "
                                      "correlation peak that counts as the peak itself; the "
                                      "rest of the surface must stay screen_peak_margin below "
                                      "it (a second near-equal maximum: untrusted)", lo=1, hi=64)
    screen_peak_sigma: float = _opt(2.0, "a window's peak must exceed the mean of its correlation "
                                         "surface outside the peak box by this many standard "
                                         "deviations (AROSICS: 2)", lo=0.0, hi=20.0)
    screen_confirm_px: float = _opt(3.0, "the post window at the found offset, searched back in "
                                         "the pre crop, must land within this many px of the "
                                         "pre window (0 = no backward check)", lo=0.0, hi=16.0)

    screen_agree_px: float = _opt(2.0, "two screening windows agree on a displacement within "
                                       "this many px (neighbour support, displaced groups, the "
                                       "corner fields' outlier rejection, the rescue's field)",
                                  lo=0.1, hi=64.0)
    screen_region_windows: int = _opt(3, "connected, agreeing windows a displacement above the "
                                         "limit needs to count (fewer: a lone wrong peak)",
                                      lo=1, hi=1000)
    screen_min_usable: float = _opt(0.9, "share of a screening window that must be usable "
                                         "(valid, not cloud) in both dates for it to count",
                                    lo=0.0, hi=1.0)
    screen_near_factor: float = _opt(2.0, "the first (near) search of a window reaches this "
                                          "times max_residual_px; the backward check uses the "
                                          "same radius", lo=0.5, hi=16.0)
    screen_far_fraction: float = _opt(1.0, "the far search reaches at most this share of the "
                                           "crop side (and screen_search_px); a patch displaced "
                                           "within the crop can lie anywhere in it", lo=0.0,
                                      hi=1.0)

    screen_lean: bool = _opt(True, "off-nadir lean: a crop whose windows above the limit all "
                                   "lean one way from a well supported ground field (elevated "
                                   "objects, not one rigid region) is judged on the ground field "
                                   "and its lean recorded (lean_px, lean_deg); off, and in "
                                   "screening windows under 64 px: such windows reject it as a "
                                   "displaced region")
    screen_lean_spread_deg: float = _opt(20.0, "leaning windows' displacements from the ground "
                                               "field must lie within this angle of their mean "
                                               "direction (one view direction)", lo=0.0, hi=90.0)
    screen_lean_max_roof: float = _opt(0.16, "widest roof a lean may move, as a share of the crop "
                                             "side (164 px at 1024: an 80 m building at 0.5 m); "
                                             "content moved together over a wider area is a "
                                             "displaced region of ground, not a lean", lo=0.0,
                                       hi=1.0)
    screen_repeat_ncc: float = _opt(0.8, "a window whose texture matches itself this well one "
                                         "period away (an orchard, a solar farm, a parking lot) "
                                         "cannot measure a shift by whole periods: it is left "
                                         "unmeasured, and a region of such windows is "
                                         "insufficient evidence (1 = off)", lo=0.0, hi=1.0)

    def __post_init__(self):
        if not 1 <= self.screen_min_quadrants <= 4 or self.screen_min_windows < 1:
            raise ValueError("screen_min_quadrants must be within [1, 4] and screen_min_windows >= 1")
        if 0 < self.screen_window_px < 8:
            # A correlation over fewer than 64 pixels measures noise, not a displacement.
            raise ValueError(f"--screen-window-px {self.screen_window_px}: must be 0 (automatic) "
                             "or at least 8")


@dataclass
class RescueConfig:
    """Rescue of a crop screening rejected: refit from its screening shift field, then screen again."""

    rescue: bool = _opt(True, "refit a crop rejected for a displaced region or corner from its "
                              "screening shift field when that field is smooth and well "
                              "supported, then screen the re-warped crop again from scratch")
    rescue_min_windows: int = _opt(12, "agreeing screening windows a rescue needs (at least 8: twice the "
                                       "4 a projective field fits exactly, so the field can disagree with "
                                       "some and its smoothness is tested, not given)", lo=8)
    rescue_min_agreement: float = _opt(0.9, "share of those windows one affine (else projective) "
                                            "field must explain within 2 px (smoothness) for a "
                                            "rescue")


@dataclass
class TilingConfig:
    """The regional method's feature tiles: their size, the context read around them and how far
    post partners are searched."""

    tile_size: int = _opt(1024, "core side of a feature tile (regional method)", min=1)
    tile_context_px: int = _opt(40, "extra pixels read around a tile so SIFT sees past its edges "
                                    "(at least SIFT's detection border at octave 3: 5 x 2^3 px)")
    tile_block: int = _opt(2, "feature tiles per side whose SIFT runs as one image in one task "
                              "(shared tile edges need no context of their own: less pyramid "
                              "work per tile, larger images per task)")
    search_margin_px: int = _opt(128, "post partners are searched this far beyond a tile's core: "
                                      "must cover the geocoding error between dates (<= tile_size)", min=0)

    def __post_init__(self):
        if self.tile_size <= 0:
            raise ValueError("tile_size must be positive")
        if self.tile_block < 1:
            raise ValueError("tile_block must be >= 1")
        if not 0 <= self.search_margin_px <= self.tile_size:
            raise ValueError("search_margin_px must be within [0, tile_size]")


@dataclass
class SchedulingConfig:
    """How the work is cut into Ray tasks and which intermediates are kept; no result depends on
    these (they are left out of every settings key)."""

    keep_features: bool = _opt(False, "keep per-tile SIFT features under _work/features after "
                                      "their pair's matches are complete")
    match_tiles_per_task: int = _opt(4, "tiles per task in the (cheap) matching pass: amortises "
                                        "Ray's per-task overhead")
    slices_per_task: int = _opt(4, "slices per task for the regional method's (cheap) slice fits; "
                                   "the per-slice recipe always uses 1")

    def __post_init__(self):
        if self.match_tiles_per_task < 1 or self.slices_per_task < 1:
            raise ValueError("match_tiles_per_task and slices_per_task must be >= 1")


# Settings added after outputs were written: at these values they are left out of every key, so an
# output written before them keeps its keys (and resumes) as long as they stay at the default.
LATER_DEFAULTS = {"tile_block": 1, "prior_features_per_tile": 0, "prior_sample_min_inliers": 200,
                  "fit_floor_matches": 200,
                  "fit_chance_factor": 2.0, "fit_chance_sigma": 4.0, "min_inlier_coverage": 0.5,
                  "screen_min_coverage": 0.3, "screen_corner_k": 2.0,
                  "screen_shift_noise_px": 0.3, "screen_peak_box_px": 6,
                  "screen_peak_sigma": 2.0, "screen_confirm_px": 3.0,
                  "screen_agree_px": 2.0, "screen_region_windows": 3, "screen_min_usable": 0.9,
                  "screen_near_factor": 2.0, "screen_far_fraction": 1.0,
                  "screen_lean": True, "screen_lean_spread_deg": 20.0,
                  "screen_lean_max_roof": 0.16, "screen_repeat_ncc": 0.8}


# Later settings only the regional method reads: a per-slice run's keys leave them out whatever
# their values, so a new default for them (tile_block 2, a sampled first pass) re-runs no
# per-slice output, the method that pays tens of CPU seconds a slice.
REGIONAL_ONLY = ("tile_block", "prior_features_per_tile", "prior_sample_min_inliers")


def without_later_defaults(settings: dict) -> dict:
    """``settings`` sorted by name, less the later-added settings that hold their default (and,
    for ``method`` per-slice, the later settings only the regional method reads)."""
    per_slice = settings.get("method") == "per-slice"
    return {n: settings[n] for n in sorted(settings)
            if not (n in LATER_DEFAULTS and settings[n] == LATER_DEFAULTS[n])
            and not (per_slice and n in REGIONAL_ONLY)}


def _group(cls: type, title: str):
    return field(default_factory=cls, metadata={"title": title})


@dataclass(init=False)
class RegistrationConfig:
    """Everything that steers registration and screening; defaults follow S2Looking where it says.

    Built from flat settings (``RegistrationConfig(tile_size=512, rescue=False)``), from the
    concern dataclasses (``RegistrationConfig(screening=ScreeningConfig(...))``, dicts as
    ``dataclasses.asdict`` gives them included), or both: flat settings win.
    """

    method: str = _opt("regional", "regional: features once per tile, reused by every slice; "
                                   "per-slice: the paper's recipe, SIFT on each whole slice pair")
    crop_size: int = _opt(1024, "side of the central crop kept from each slice (paper: 1024)", min=1)
    features: FeatureConfig = _group(FeatureConfig, "registration: features")
    matching: MatchingConfig = _group(MatchingConfig, "registration: matching")
    fit: FitConfig = _group(FitConfig, "registration: fit and its checks")
    screening: ScreeningConfig = _group(ScreeningConfig, "screening")
    rescuing: RescueConfig = _group(RescueConfig, "screening: rescue")
    tiling: TilingConfig = _group(TilingConfig, "regional method: tiles")
    scheduling: SchedulingConfig = _group(SchedulingConfig, "registration: scheduling")

    def __init__(self, method: str = "regional", crop_size: int = 1024, **settings: Any):
        self.method, self.crop_size = method, crop_size
        for name, cls in GROUPS.items():
            part = settings.pop(name, None)
            part = cls(**part) if isinstance(part, dict) else (part if part is not None else cls())
            own = {k: settings.pop(k) for k in [f.name for f in fields(cls)] if k in settings}
            setattr(self, name, dataclasses.replace(part, **own))   # a copy: no part is shared
        if settings:
            raise TypeError(f"RegistrationConfig got unknown settings: {sorted(settings)}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.crop_size <= 0:
            raise ValueError("crop_size must be positive")

    def flat(self) -> dict[str, Any]:
        """Every setting under its flat name (the command line's), method and crop size first."""
        out = {"method": self.method, "crop_size": self.crop_size}
        for name in GROUPS:
            out.update(_settings(getattr(self, name)))
        return out

    def screen_window(self) -> int:
        """Screening window side: at most 1/8 of the crop side."""
        auto = max(16, self.crop_size // 8)
        return min(self.screen_window_px, auto) if self.screen_window_px > 0 else auto

    def features_key(self) -> str:
        """Short hash of every setting that changes tile features or matches: the features,
        matching and tiling settings, plus the scale and anisotropy bounds the matching prior
        checks.

        Stored matches live under this key, so a resumed run with other settings recomputes
        them instead of silently reusing stale ones.
        """
        doc = {**_settings(self.features), **_settings(self.matching), **_settings(self.tiling),
               "max_scale_change": self.max_scale_change, "max_anisotropy": self.max_anisotropy}
        text = json.dumps(without_later_defaults(doc), sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:10]

    @classmethod
    def field_help(cls) -> dict[str, str]:
        """Help text of every setting, by flat name."""
        out = {f.name: f.metadata.get("help", "") for f in fields(cls) if f.name not in GROUPS}
        for part in GROUPS.values():
            out.update({f.name: f.metadata.get("help", "") for f in fields(part)})
        return out


def _settings(group) -> dict[str, Any]:
    """A settings group's fields by name (its values are scalars and tuples: no deep copy, which
    ``dataclasses.asdict`` makes at a cost paid per slice)."""
    return {f.name: getattr(group, f.name) for f in fields(group)}


GROUPS: dict[str, type] = {f.name: f.default_factory for f in fields(RegistrationConfig)
                           if f.default_factory is not dataclasses.MISSING}


def _flat_setting(group: str, name: str, doc: str) -> property:
    def get(self):
        return getattr(getattr(self, group), name)

    def set_(self, value):
        setattr(getattr(self, group), name, value)

    return property(get, set_, doc=doc)


for _group_name, _cls in GROUPS.items():
    for _f in fields(_cls):
        setattr(RegistrationConfig, _f.name, _flat_setting(_group_name, _f.name, _f.metadata.get("help", "")))
