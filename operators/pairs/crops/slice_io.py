"""Reading slice windows and finishing a registered crop pair: nodata check, screening, 8-bit
PNGs, and the slice's metadata row. Shared by both registration methods (``per_slice_ops`` and
``regional_ops``)."""
from __future__ import annotations

import functools
import hashlib
import json
import time
from dataclasses import fields, replace
from typing import Any, Optional, Sequence

import cv2
import numpy as np
import pyarrow as pa
from affine import Affine

from operators.io.images import write_png
from operators.io.storage import Store
from operators.io.tables import envelope
from operators.pairs.catalogue.band_stack import crop_clouds, lineage_columns, read_stacked_side
from operators.pairs.imagery.radiometry import to_uint8
from operators.pairs.imagery.raster_io import (common_grid, grid_bbox, grid_to_scene, read_at,
                                               read_at_scene, read_window_anywhere)
from operators.pairs.registration.registration import (HomographyFit, RegistrationConfig, confidence_inliers,
                                                       crop_match_support, crop_offset,
                                                       crop_positions_on_grid, crop_to_grid, feature_grey,
                                                       homography_positions, homography_problem,
                                                       nodata_fraction, remap_bands)
from operators.pairs.registration.config import SchedulingConfig, without_later_defaults
from operators.pairs.screening.rules import screen_rules
from operators.pairs.screening.screening import rescue_field, rescued_homography, screen_alignment

STAGE = "registration"
JOB = "build_pairs"         # the job name error rows carry (jobs.build_pairs.JOB)

METADATA_SCHEMA = pa.schema([
    ("slice_id", pa.string()),
    ("pair_id", pa.string()),
    ("location", pa.string()),
    ("split", pa.string()),
    ("pre_scene", pa.string()),
    ("post_scene", pa.string()),
    ("pre_date", pa.string()),
    ("post_date", pa.string()),
    ("crs", pa.string()),
    ("bounds", pa.list_(pa.float64())),       # left, bottom, right, top of the kept crop (crs units)
    ("window", pa.list_(pa.int64())),         # kept crop on the common grid: col, row, w, h
    ("slice_window", pa.list_(pa.int64())),   # the input slice's window
    ("homography", pa.list_(pa.float64())),   # 9 floats row-major, post-slice px -> pre-slice px
    ("n_matches", pa.int64()),
    ("n_inliers", pa.int64()),
    ("residual_px", pa.float64()),            # screening: largest displacement anywhere in the crop
    ("residual_median_px", pa.float64()),
    ("screen_windows", pa.int64()),           # screening windows measured confidently
    ("screen_assessed_fraction", pa.float64()),  # of the textured windows, the share measured
    ("status", pa.string()),                  # accepted | rejected
    ("reject_reason", pa.string()),           # null when accepted
    ("image_a", pa.string()),                 # A/<slice_id>.png when accepted
    ("image_b", pa.string()),
    ("method", pa.string()),
    ("seconds", pa.float64()),                # wall time of this slice's task
    ("cpu_seconds", pa.float64()),            # its CPU time (excludes the shared tile passes)
    ("run_id", pa.string()),
    # lineage and clouds
    ("pre_stac_id", pa.string()),             # STAC item ids (null for plain rasters)
    ("post_stac_id", pa.string()),
    ("pre_hrefs", pa.list_(pa.string())),     # every file read: band assets, then cloud layer
    ("post_hrefs", pa.list_(pa.string())),
    ("cloud_fraction", pa.float64()),         # kept crop, cloudy in either date (--cloud-mask)
    ("settings_key", pa.string()),            # hash of the settings and inputs that decided it
    ("screen_rules", pa.string()),            # digest of the screening code that judged it
    ("shift_rmse_px", pa.float64()),          # screening: RMS of the kept windows' shifts
    ("pixel_size_m", pa.float64()),           # grid pixel side in metres (null: geographic CRS)
    ("residual_m", pa.float64()),             # residual_px in metres
    ("max_residual_px_used", pa.float64()),   # the screening limit applied (from px or metres)
    ("rescued", pa.bool_()),                  # accepted after a rescue (refit from the shift field)
    ("rescue_px", pa.float64()),              # the rescue's largest correction at a crop corner
    ("rescue_reason", pa.string()),           # why the first screening rejected the crop
    ("nodata_fraction", pa.float64()),        # kept crop lacking data in either date (allowed up
                                              # to --max-nodata-fraction; screened without it)
    ("lean_px", pa.float64()),                # off-nadir lean of elevated objects against the
    ("lean_deg", pa.float64()),               # ground field: median px, direction (0 = +x,
    ("lean_windows", pa.int64()),             # 90 = +y) and leaning windows; null: none found
    ("lean_max_px", pa.float64()),            # the largest leaning window's displacement
    ("lean_share", pa.float64()),             # share of the crop seen moving with the roofs
])

# One row per screening window with a correlation peak (the shift field of a crop).
SHIFTS_SCHEMA = pa.schema([
    ("window_id", pa.string()),               # <slice_id>_w<grid row>_<grid col>
    ("slice_id", pa.string()),
    ("pair_id", pa.string()),
    ("x_px", pa.float64()),                   # window centre in kept-crop pixels
    ("y_px", pa.float64()),
    ("map_x", pa.float64()),                  # window centre in the grid's CRS
    ("map_y", pa.float64()),
    ("dx_px", pa.float64()),                  # where the pre content sits in the registered post
    ("dy_px", pa.float64()),
    ("shift_px", pa.float64()),
    ("shift_m", pa.float64()),                # null for a geographic CRS
    ("ncc", pa.float64()),                    # reliability: the window's correlation peak
    ("status", pa.string()),                  # kept | outlier
    ("settings_key", pa.string()),
    ("run_id", pa.string()),
])

# Settings that only schedule work: changing them changes no result, so no slice is redone.
SCHEDULING = tuple(f.name for f in fields(SchedulingConfig))   # left out of settings keys
# What a slice row carries that its result depends on besides its slice id.
INPUT_KEYS = ("bands_pre", "bands_post", "pre_stack", "post_stack")
RESULT_KEYS = INPUT_KEYS + ("window", "stretch_pre", "stretch_post", "pre_uri", "post_uri")


def _plain(v):
    """numpy arrays and scalars (Ray rows hold them for list columns) as plain Python values."""
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()] if v.dtype == object else v.tolist()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v.item() if isinstance(v, np.generic) else v


def _hash(doc) -> str:
    text = json.dumps(_plain(doc), sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def inputs_hash(row: dict) -> str:
    """Hash of what a pair's features are computed from besides the settings: the bands read
    and the stacked assets (their cloud layer and cloud settings included)."""
    return _hash({k: row.get(k) for k in INPUT_KEYS})


def settings_key(row: dict, cfg: RegistrationConfig) -> str:
    """Hash of every setting and input a slice's verdict depends on. A rerun treats a slice as
    finished only when its recorded key is this one, so changed settings re-evaluate rejected
    slices (and accepted ones) instead of keeping a verdict made under other settings."""
    settings = without_later_defaults({k: v for k, v in cfg.flat().items() if k not in SCHEDULING})
    return _hash({"settings": settings, **{k: row.get(k) for k in RESULT_KEYS}})


def slice_finished(recorded: Optional[tuple[Optional[str], Optional[str]]], key: str,
                   rules: str) -> tuple[bool, str]:
    """Whether a rerun skips a slice, datatrove's ``(keep, reason)`` shape: ``recorded`` is the
    ``(settings_key, screen_rules)`` of its metadata row (None: never recorded), ``key`` and
    ``rules`` what this run would record. Finished only under the same settings and inputs and
    the same screening rules. A row without ``settings_key`` (written before it existed) is not
    judged by its key, which it lacks; a row without ``screen_rules`` was judged by a screen
    before that column, so it is judged again (and so is every row older than both). Reasons:
    ``finished``, ``new``, ``settings``, ``screen_rules``."""
    if recorded is None:
        return False, "new"
    recorded_key, recorded_rules = recorded
    if recorded_key is not None and recorded_key != key:
        return False, "settings"
    if recorded_rules != rules:
        return False, "screen_rules"
    return True, "finished"


# ---- reading ----------------------------------------------------------------------------------

def read_pre(row: dict, window: Sequence[int]):
    if row.get("pre_stack"):  # per-band assets (STAC items, band manifests), stacked; clouds invalid
        return read_stacked_side(row, "pre", window, common_grid(row))
    return read_window_anywhere(row["pre_uri"], window, row["bands_pre"], None)


def read_post(row: dict, window: Sequence[int]):
    """Post scene resampled onto the common (pre) grid: for feature detection only."""
    if row.get("post_stack"):
        return read_stacked_side(row, "post", window, common_grid(row))
    return read_window_anywhere(row["post_uri"], window, row["bands_post"], common_grid(row))


def read_registered_post(row: dict, H: np.ndarray, cfg: RegistrationConfig):
    """The registered post crop, made from the post scene's own pixels by one resampling.

    Crop pixel -> pre slice (+ crop offset) -> post slice (``H^-1``) -> common grid (+ slice
    offset) -> post scene pixel (its own CRS and transform), composed per pixel and sampled once.
    Stacked scenes (one file per band) are the exception: their bands are first put on the common
    grid (bands of several resolutions), then warped by the homography, so they are resampled twice.
    """
    window = [int(v) for v in row["window"]]
    off = crop_offset(window[2], cfg.crop_size)
    resample = lambda data, valid, mx, my: remap_bands(data, valid, mx, my, cfg.resampling)  # noqa: E731
    if not row.get("post_stack"):
        to_scene = grid_to_scene(row["post_uri"], common_grid(row))
        if to_scene is not None:
            # Same CRS: crop pixel -> scene pixel is one homography, evaluated once.
            px, py = homography_positions(to_scene @ crop_to_grid(H, window, off), cfg.crop_size)
            return read_at_scene(row["post_uri"], row["bands_post"], px, py, resample)
    gx, gy = crop_positions_on_grid(H, window, off, cfg.crop_size)
    if row.get("post_stack"):
        box = grid_bbox(gx, gy)
        data, valid = read_stacked_side(row, "post", box, common_grid(row))
        return remap_bands(data, valid, (gx - box[0]).astype(np.float32),
                           (gy - box[1]).astype(np.float32), cfg.resampling)
    return read_at(row["post_uri"], row["bands_post"], common_grid(row), gx, gy, resample)


# ---- records ----------------------------------------------------------------------------------

class Clock:
    """Wall time and this thread's CPU time since creation.

    CPU time is what the work cost regardless of other load on the machine (OpenCV runs
    single-threaded in these tasks, so the thread's time is the task's).
    """

    def __init__(self):
        self.wall0, self.cpu0 = time.perf_counter(), time.thread_time()

    def wall(self) -> float:
        return round(time.perf_counter() - self.wall0, 4)

    def cpu(self) -> float:
        return round(time.thread_time() - self.cpu0, 4)


def window_bounds(transform: Sequence[float], window: Sequence[int]) -> list[float]:
    """(left, bottom, right, top) of a pixel window under an affine transform."""
    aff = Affine(*transform)
    col, row, width, height = window
    xs, ys = zip(*[aff * (c, r) for c in (col, col + width) for r in (row, row + height)])
    return [min(xs), min(ys), max(xs), max(ys)]


def pixel_size_m(row: dict) -> Optional[float]:
    """Side of a grid pixel in metres (the square root of its area), None for a geographic CRS."""
    return _pixel_size_m(str(row["crs"]), tuple(float(v) for v in row["transform"][:6]))


@functools.lru_cache(maxsize=64)
def _pixel_size_m(crs_text: str, transform: tuple) -> Optional[float]:
    # Parsing a CRS costs milliseconds; every record of a pair asks for the same one.
    from rasterio.crs import CRS
    try:
        crs = CRS.from_user_input(crs_text)
        if crs.is_geographic:
            return None
        factor = crs.linear_units_factor[1]
    except Exception:  # noqa: BLE001 - an unknown CRS: no metres
        return None
    a, b, _, d, e, _ = transform
    return float(np.sqrt(abs(a * e - b * d)) * factor)


def screening_limit(row: dict, cfg: RegistrationConfig) -> float:
    """The screening limit in grid pixels: ``max_residual_m`` over the pixel size when set (and
    the CRS is projected), else ``max_residual_px``."""
    size = pixel_size_m(row)
    if cfg.max_residual_m > 0 and size:
        return float(cfg.max_residual_m) / size
    return float(cfg.max_residual_px)


def shift_rows(row: dict, cfg: RegistrationConfig, screen, run_id: str) -> list[dict]:
    """The screening's shift field as table rows: every window with a peak, kept or outlier."""
    if screen is None:
        return []
    kept = {(s.row, s.col) for s in screen.shifts}
    size = pixel_size_m(row)
    aff = Affine(*[float(v) for v in row["transform"][:6]])
    col0, row0 = crop_window(row, cfg)[:2]
    key = settings_key(row, cfg)
    out = []
    for s in screen.measured:
        mx, my = aff @ (col0 + s.x + 0.5, row0 + s.y + 0.5)
        mag = float(np.hypot(s.dx, s.dy))
        out.append({"window_id": f"{row['slice_id']}_w{s.row:03d}_{s.col:03d}",
                    "slice_id": row["slice_id"], "pair_id": row.get("pair_id"),
                    "x_px": float(s.x), "y_px": float(s.y), "map_x": mx, "map_y": my,
                    "dx_px": float(s.dx), "dy_px": float(s.dy), "shift_px": mag,
                    "shift_m": None if size is None else mag * size, "ncc": float(s.ncc),
                    "status": "kept" if (s.row, s.col) in kept else "outlier",
                    "settings_key": key, "run_id": run_id})
    return out


def with_shift_envelopes(envs: list[dict]) -> list[dict]:
    """Each metadata envelope followed by its ``shifts`` envelopes (carried in the record's
    ``_shifts`` until here, so a slice function still returns one envelope)."""
    out = []
    for env in envs:
        if env.get("_table") != "metadata":
            out.append(env)
            continue
        rec = json.loads(env["_record"])
        shifts = rec.pop("_shifts", None) or []
        out.append(envelope("metadata", rec) if shifts else env)
        out.extend(envelope("shifts", s) for s in shifts)
    return out


def crop_window(row: dict, cfg: RegistrationConfig) -> list[int]:
    col, r, size, _ = (int(v) for v in row["window"])
    off = crop_offset(size, cfg.crop_size)
    return [col + off, r + off, cfg.crop_size, cfg.crop_size]


def slice_record(row: dict, cfg: RegistrationConfig, run_id: str, clock: Clock, fit: HomographyFit,
            status: str, reason: Optional[str], screen=None, images=(None, None)) -> dict:
    kept = crop_window(row, cfg)
    return {
        "slice_id": row["slice_id"], "pair_id": row.get("pair_id"), "location": row.get("location"),
        "split": row.get("split"), "pre_scene": row.get("pre_scene"),
        "post_scene": row.get("post_scene"), "pre_date": row.get("pre_date"),
        "post_date": row.get("post_date"), "crs": str(row["crs"]),
        "bounds": window_bounds(row["transform"], kept), "window": kept,
        "slice_window": [int(v) for v in row["window"]],
        "homography": None if fit.homography is None else
        [float(v) for v in np.asarray(fit.homography).ravel()],
        "n_matches": fit.n_matches, "n_inliers": fit.n_inliers,
        "residual_px": None if screen is None else screen.residual_px,
        "shift_rmse_px": None if screen is None or not screen.shifts else float(np.sqrt(np.mean(
            [sh.dx ** 2 + sh.dy ** 2 for sh in screen.shifts]))),
        "pixel_size_m": pixel_size_m(row),
        "residual_m": None if screen is None or screen.residual_px is None or
        pixel_size_m(row) is None else screen.residual_px * pixel_size_m(row),
        "max_residual_px_used": screening_limit(row, cfg),
        "_shifts": shift_rows(row, cfg, screen, run_id),
        "rescued": False, "rescue_px": None, "rescue_reason": None,
        "nodata_fraction": row.get("nodata_fraction"),
        **lean_columns(screen),
        "residual_median_px": None if screen is None else screen.residual_median_px,
        "screen_windows": None if screen is None else screen.n_confident,
        "screen_assessed_fraction": None if screen is None else screen.assessed_fraction,
        "status": status, "reject_reason": reason,
        "image_a": images[0], "image_b": images[1],
        "method": cfg.method, "seconds": clock.wall(), "cpu_seconds": clock.cpu(),
        "run_id": run_id,
        **lineage_columns(row),
        "settings_key": settings_key(row, cfg),
        "screen_rules": screen_rules(),
    }


def lean_columns(screen) -> dict:
    """The off-nadir lean screening found (``ScreeningResult.lean``), else nulls."""
    lean = None if screen is None else screen.lean
    return {"lean_px": None if lean is None else lean.px,
            "lean_deg": None if lean is None else lean.deg,
            "lean_windows": None if lean is None else lean.windows,
            "lean_max_px": None if lean is None else lean.max_px,
            "lean_share": None if lean is None else lean.share}


def _rgb(image: np.ndarray) -> np.ndarray:
    """(H, W, 1|3|4) uint8 -> (H, W, 3): single-band scenes are written as grey RGB."""
    if image.shape[2] == 1:
        return np.repeat(image, 3, axis=2)
    return image[:, :, :3]


def _crop_checks(row: dict, cfg: RegistrationConfig, fit: HomographyFit, pre_valid: np.ndarray,
                 post_valid: np.ndarray):
    """Nodata and cloud checks of a warped crop pair -> (row with its cloud fraction, data masks
    of both dates, reject reason or None)."""
    clouds = crop_clouds(row, crop_window(row, cfg), fit.homography, cfg.crop_size)
    data_pre, data_post = pre_valid, post_valid
    if clouds is not None:
        data_pre, data_post = pre_valid | clouds.pre, post_valid | clouds.post
        row = {**row, "cloud_fraction": clouds.fraction}
    frac = nodata_fraction(data_pre, data_post)
    row = {**row, "nodata_fraction": frac}
    reason = None
    if frac > cfg.max_nodata_fraction:
        reason = f"nodata {frac:.1%} of the crop > {cfg.max_nodata_fraction:.1%}"
    elif clouds is not None and clouds.fraction > clouds.max_fraction:
        reason = f"cloud {clouds.fraction:.1%} of the crop > {clouds.max_fraction:.1%}"
    return row, data_pre, data_post, reason


def _screen(row: dict, cfg: RegistrationConfig, pre_crop, post_crop, both):
    """Screening of a crop pair at the slice's limit; the reason states the limit in metres."""
    # Screening's grey: each crop stretched on its own usable pixels (gain/offset do not matter
    # to the correlation; a cloud-dominated scene stretch would flatten the land's texture).
    unit = replace(cfg, sift_normalisation="percentile")
    limit = screening_limit(row, cfg)
    screen = screen_alignment(feature_grey(pre_crop, both, unit),
                              feature_grey(post_crop, both, unit), both,
                              replace(cfg, max_residual_px=limit))
    size = pixel_size_m(row)
    if screen.reject_reason and size is not None:
        screen.reject_reason = (f"{screen.reject_reason} [limit {limit:.2f} px = "
                                f"{limit * size:.1f} m at {size:g} m/px]")
    return screen, limit


def finish_crop(row: dict, cfg: RegistrationConfig, out_root: str, run_id: str, clock: Clock,
                fit: HomographyFit, pre_crop: np.ndarray, pre_valid: np.ndarray,
                post_crop: np.ndarray, post_valid: np.ndarray,
                invalid: Optional[np.ndarray] = None) -> dict:
    """Nodata check, cloud check, screening (and rescue), PNGs and the metadata envelope for a
    registered crop pair.

    ``invalid``: optional per-pixel mask of the crop kept out of screening. With a cloud layer
    (stacked scenes) the valid masks already exclude clouds (so SIFT and the screening skip them);
    cloud pixels still hold data for the nodata check and the PNGs.

    Rescue: when screening rejects for a displaced region or a corner and its shift field is
    smooth and well supported (``screening.rescue_field``), the slice homography is corrected by
    that field, the post crop is warped again from the scene's pixels, and the new crop pair goes
    through the nodata, cloud and screening checks again from scratch; it is accepted only if that
    second screening accepts it on its own measurements.
    """
    row0 = row
    row, data_pre, data_post, reason = _crop_checks(row0, cfg, fit, pre_valid, post_valid)
    if reason:
        return envelope("metadata", slice_record(row, cfg, run_id, clock, fit, "rejected", reason))
    extra = ~invalid if invalid is not None else True
    screen, limit = _screen(row, cfg, pre_crop, post_crop, pre_valid & post_valid & extra)
    rescue = None
    if screen.reject_reason:
        h, w = pre_crop.shape[1:]
        field = rescue_field(screen, w, h, replace(cfg, max_residual_px=limit))
        size = int(row["window"][2])
        H2 = None if field is None else rescued_homography(fit.homography, field[0],
                                                            crop_offset(size, cfg.crop_size))
        if H2 is not None and homography_problem(H2, size, cfg.crop_size, cfg) is None and \
                rescue_backed(fit, H2, size, cfg):
            # The rescue's own evidence: the crop's matches and those within the threshold of H2.
            fit2 = HomographyFit(H2, *crop_match_support(fit.matches, H2, size, cfg),
                                 matches=fit.matches)
            post2, post_valid2 = read_registered_post(row0, H2, cfg)
            row2, dpre2, dpost2, reason2 = _crop_checks(row0, cfg, fit2, pre_valid, post_valid2)
            if reason2 is None:
                screen2, _ = _screen(row2, cfg, pre_crop, post2, pre_valid & post_valid2 & extra)
                if not screen2.reject_reason:
                    rescue = {"rescued": True, "rescue_px": field[1],
                              "rescue_reason": screen.reject_reason}
                    fit, screen, post_crop, row = fit2, screen2, post2, row2
                    data_pre, data_post = dpre2, dpost2
    if screen.reject_reason:
        return envelope("metadata", slice_record(row, cfg, run_id, clock, fit, "rejected",
                                                 screen.reject_reason, screen))
    store = Store(out_root)
    rel_a, rel_b = f"A/{row['slice_id']}.png", f"B/{row['slice_id']}.png"
    write_png(store, rel_a, _rgb(to_uint8(pre_crop, row["stretch_pre"], data_pre)))
    write_png(store, rel_b, _rgb(to_uint8(post_crop, row["stretch_post"], data_post)))
    rec = slice_record(row, cfg, run_id, clock, fit, "accepted", None, screen, (rel_a, rel_b))
    return envelope("metadata", {**rec, **(rescue or {})})


def rescue_backed(fit: HomographyFit, H2, slice_size: int, cfg: RegistrationConfig) -> bool:
    """Whether the slice's own SIFT matches inside the crop back a rescued homography: more of
    them within the RANSAC threshold of ``H2`` than chance gives (:func:`confidence_inliers`),
    and at least ``rescue_min_agreement`` as many as under the first fit. A wrong-peak field
    the screening windows agree on (periodic texture, roofs of an off-nadir view) moves the crop
    away from where its matches put it, and is not taken; without matches, no rescue."""
    n, under_rescue = crop_match_support(fit.matches, H2, slice_size, cfg)
    _, under_fit = crop_match_support(fit.matches, fit.homography, slice_size, cfg)
    return n > 0 and under_rescue > confidence_inliers(n, cfg, slice_size) and \
        under_rescue >= cfg.rescue_min_agreement * under_fit


def single_thread():
    # One Ray task = one core: OpenCV's own threads would oversubscribe the CPUs Ray hands out
    # and make 1-vs-2-CPU scaling meaningless.
    cv2.setNumThreads(1)



def plain_row(row: dict) -> dict:
    """Ray rows hold numpy arrays for list columns; the cores want plain lists."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, np.ndarray):
            v = v.tolist()
        out[k] = v
    return out
