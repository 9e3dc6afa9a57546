"""Ray operators of the registration stage: slice rows in, one envelope per slice out.

Row-level functions (plain dict in, envelope out) carry the I/O around the pure cores in
``registration``, ``screening`` and ``regional``; :func:`registration_stage` wires them into Ray
Data. Every slice ends as exactly one envelope: ``metadata`` (status accepted or rejected, with a
reason) or ``errors`` (stage "registration", e.g. an unreadable window).

Outputs per accepted slice, through ``Store(out_root)``: ``A/<slice_id>.png`` (pre crop) and
``B/<slice_id>.png`` (registered post crop), 8-bit RGB by each scene's stretch. Regional matches
are kept under ``_work/matches/<features_key>/<pair_id>/<tile_row>_<tile_col>.npz`` (the key hashes
the feature and matching settings) so a resumed run with the same settings reuses them;
the per-tile features they come from (``_work/features/...``) are deleted once a pair's matches are
complete (``keep_features`` keeps them); ``_work/tile_runs/<run_id>.json`` records the tile passes.
The regional method runs as one Ray task graph (features -> matches -> slices, each task waiting
only for the tasks it needs), not as three Ray Data passes with barriers in between.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any, Optional, Sequence

import cv2
import numpy as np
import pyarrow as pa
from affine import Affine

from operators.images import write_png
from operators.radiometry import to_uint8
from operators.raster_io import Grid, read_window
from operators.regional import (TileFeatures, TileMatches, fit_slice, match_tile,
                                neighbour_tiles, tile_core, tile_features, tile_read_window,
                                tiles_for_window)
from operators.registration import (HomographyFit, RegistrationConfig, crop_offset,
                                    grey_from_bands, nodata_fraction, post_footprint,
                                    register_slice_pair, warp_post_to_crop)
from operators.screening import screen_alignment
from operators.storage import Store
from operators.tables import envelope, error_envelope

STAGE = "registration"
FEATURES_DIR = "_work/features"
MATCHES_DIR = "_work/matches"
TILE_RUNS_DIR = "_work/tile_runs"

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
    ("residual_px", pa.float64()),            # screening: largest local shift in the kept crop
    ("residual_median_px", pa.float64()),
    ("screen_windows", pa.int64()),           # confident phase-correlation windows behind it
    ("status", pa.string()),                  # accepted | rejected
    ("reject_reason", pa.string()),           # null when accepted
    ("image_a", pa.string()),                 # A/<slice_id>.png when accepted
    ("image_b", pa.string()),
    ("method", pa.string()),
    ("seconds", pa.float64()),                # wall time of this slice's task
    ("cpu_seconds", pa.float64()),            # its CPU time (excludes the shared tile passes)
    ("run_id", pa.string()),
])


# ---- reading ----------------------------------------------------------------------------------

def _read(uri: str, window: Sequence[int], bands: Sequence[int], grid: Optional[Grid]):
    """read_window that also tolerates windows starting left of / above the grid origin.

    Tiles and crop footprints near a scene edge reach outside it; the part outside comes back
    invalid.
    """
    col, row, width, height = (int(v) for v in window)
    c0, r0 = max(col, 0), max(row, 0)
    w, h = width - (c0 - col), height - (r0 - row)
    if w <= 0 or h <= 0:
        return (np.zeros((len(bands), height, width), np.uint8), np.zeros((height, width), bool))
    data, valid = read_window(uri, (c0, r0, w, h), bands, grid=grid)
    if (c0, r0) == (col, row):
        return data, valid
    out = np.zeros((data.shape[0], height, width), data.dtype)
    ok = np.zeros((height, width), bool)
    out[:, r0 - row:, c0 - col:] = data
    ok[r0 - row:, c0 - col:] = valid
    return out, ok


def read_pre(row: dict, window: Sequence[int]):
    return _read(row["pre_uri"], window, row["bands_pre"], None)


def read_post(row: dict, window: Sequence[int]):
    """Post scene resampled onto the common (pre) grid."""
    return _read(row["post_uri"], window, row["bands_post"],
                 Grid(str(row["crs"]), tuple(float(v) for v in row["transform"])))


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


def crop_window(row: dict, cfg: RegistrationConfig) -> list[int]:
    col, r, size, _ = (int(v) for v in row["window"])
    off = crop_offset(size, cfg.crop_size)
    return [col + off, r + off, cfg.crop_size, cfg.crop_size]


def _record(row: dict, cfg: RegistrationConfig, run_id: str, clock: Clock, fit: HomographyFit,
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
        "residual_median_px": None if screen is None else screen.residual_median_px,
        "screen_windows": None if screen is None else screen.n_confident,
        "status": status, "reject_reason": reason,
        "image_a": images[0], "image_b": images[1],
        "method": cfg.method, "seconds": clock.wall(), "cpu_seconds": clock.cpu(),
        "run_id": run_id,
    }


def _rgb(image: np.ndarray) -> np.ndarray:
    """(H, W, 1|3|4) uint8 -> (H, W, 3): single-band scenes are written as grey RGB."""
    if image.shape[2] == 1:
        return np.repeat(image, 3, axis=2)
    return image[:, :, :3]


def finish_crop(row: dict, cfg: RegistrationConfig, out_root: str, run_id: str, clock: Clock,
                fit: HomographyFit, pre_crop: np.ndarray, pre_valid: np.ndarray,
                post_crop: np.ndarray, post_valid: np.ndarray) -> dict:
    """Nodata check, screening, PNGs and the metadata envelope for a registered crop pair."""
    frac = nodata_fraction(pre_valid, post_valid)
    if frac > cfg.max_nodata_fraction:
        reason = f"nodata {frac:.1%} of the crop > {cfg.max_nodata_fraction:.1%}"
        return envelope("metadata", _record(row, cfg, run_id, clock, fit, "rejected", reason))
    both = pre_valid & post_valid
    pre_grey = grey_from_bands(pre_crop, row["stretch_pre"], both)
    post_grey = grey_from_bands(post_crop, row["stretch_post"], both)
    screen = screen_alignment(pre_grey, post_grey, both, cfg)
    if screen.reject_reason:
        return envelope("metadata", _record(row, cfg, run_id, clock, fit, "rejected",
                                            screen.reject_reason, screen))
    store = Store(out_root)
    rel_a, rel_b = f"A/{row['slice_id']}.png", f"B/{row['slice_id']}.png"
    write_png(store, rel_a, _rgb(to_uint8(pre_crop, row["stretch_pre"], pre_valid)))
    write_png(store, rel_b, _rgb(to_uint8(post_crop, row["stretch_post"], post_valid)))
    return envelope("metadata", _record(row, cfg, run_id, clock, fit, "accepted", None, screen,
                                        (rel_a, rel_b)))


def _single_thread():
    # One Ray task = one core: OpenCV's own threads would oversubscribe the CPUs Ray hands out
    # and make 1-vs-2-CPU scaling meaningless.
    cv2.setNumThreads(1)


# ---- per-slice recipe -------------------------------------------------------------------------

def register_slice_per_slice(row: dict, cfg: RegistrationConfig, out_root: str,
                             run_id: str = "") -> dict:
    """The paper's recipe on one slice row: whole-slice SIFT both dates, fit, warp, crop, screen."""
    _single_thread()
    clock = Clock()
    try:
        window = [int(v) for v in row["window"]]
        size = window[2]
        pre, pre_valid = read_pre(row, window)
        post, post_valid = read_post(row, window)
        fit = register_slice_pair(grey_from_bands(pre, row["stretch_pre"], pre_valid), pre_valid,
                                  grey_from_bands(post, row["stretch_post"], post_valid),
                                  post_valid, cfg)
        if fit.homography is None:
            return envelope("metadata", _record(row, cfg, run_id, clock, fit, "rejected",
                                                fit.reject_reason))
        off = crop_offset(size, cfg.crop_size)
        sl = np.s_[off:off + cfg.crop_size, off:off + cfg.crop_size]
        post_crop, post_crop_valid = warp_post_to_crop(post, post_valid, fit.homography, (0, 0),
                                                       (off, off), cfg.crop_size, cfg.resampling)
        return finish_crop(row, cfg, out_root, run_id, clock, fit, pre[(slice(None),) + sl],
                           pre_valid[sl], post_crop, post_crop_valid)
    except Exception as exc:  # noqa: BLE001 - every slice must end as one envelope
        return error_envelope(row.get("slice_id", "?"), STAGE, exc, job="pairs", run_id=run_id)


# ---- regional method --------------------------------------------------------------------------

def matches_rel(cfg: RegistrationConfig, pair_id: str, tile_col: int, tile_row: int) -> str:
    return f"{MATCHES_DIR}/{cfg.features_key()}/{pair_id}/{tile_row:05d}_{tile_col:05d}.npz"


def features_rel(cfg: RegistrationConfig, pair_id: str, tile_col: int, tile_row: int) -> str:
    return f"{FEATURES_DIR}/{cfg.features_key()}/{pair_id}/{tile_row:05d}_{tile_col:05d}.npz"


def plan_tiles(slice_rows: Sequence[dict], cfg: RegistrationConfig) -> list[dict]:
    """One tile row per (pair, tile) that any slice of the pair overlaps.

    Each row lists its planned neighbours (tiles whose post features its matching needs).
    """
    keys = ("pair_id", "pre_uri", "post_uri", "crs", "transform", "bands_pre", "bands_post",
            "stretch_pre", "stretch_post")
    tiles: dict[tuple, dict] = {}
    for r in slice_rows:
        for tc, tr in tiles_for_window(r["window"], cfg.tile_size):
            key = (r["pair_id"], tc, tr)
            if key not in tiles:
                tiles[key] = {**{k: r[k] for k in keys}, "tile_col": tc, "tile_row": tr}
    for (pair, tc, tr), row in tiles.items():
        # Post features outside every slice of the pair can never be used by a slice fit.
        row["neighbours"] = [[c, r] for c, r in neighbour_tiles(tc, tr, cfg)
                             if (pair, c, r) in tiles]
    return [tiles[k] for k in sorted(tiles)]


def _tile_result(row: dict) -> dict:
    return {"pair_id": row["pair_id"], "tile_col": row["tile_col"], "tile_row": row["tile_row"],
            "n": -1, "reused": False, "error": None, "seconds": 0.0, "cpu_seconds": 0.0}


def features_tile_row(row: dict, cfg: RegistrationConfig, out_root: str, run_id: str = "") -> dict:
    """Pass 1: SIFT features of both dates for one tile, stored; skipped if already stored."""
    _single_thread()
    clock = Clock()
    store = Store(out_root)
    out = _tile_result(row)
    pair, tc, tr = row["pair_id"], row["tile_col"], row["tile_row"]
    try:
        # Needed unless stored already, or every tile that matches against it has its matches
        # (neighbourhoods are symmetric, so those are exactly its planned neighbours).
        rel = features_rel(cfg, pair, tc, tr)
        if store.exists(rel) or all(store.exists(matches_rel(cfg, pair, c, r))
                                    for c, r in row["neighbours"]):
            out.update(reused=True)
            return out
        window = tile_read_window(tc, tr, cfg)
        pre, pre_valid = read_pre(row, window)
        post, post_valid = read_post(row, window)
        feats = tile_features(grey_from_bands(pre, row["stretch_pre"], pre_valid), pre_valid,
                              grey_from_bands(post, row["stretch_post"], post_valid), post_valid,
                              window, tile_core(tc, tr, cfg.tile_size), cfg)
        store.write_bytes(rel, feats.to_bytes())
        out.update(n=len(feats.pre_xy) + len(feats.post_xy))
    except Exception as exc:  # noqa: BLE001 - the slices of this tile report it
        out.update(error=f"{type(exc).__name__}: {exc}"[:500])
    out.update(seconds=clock.wall(), cpu_seconds=clock.cpu())
    return out


def match_tile_row(row: dict, cfg: RegistrationConfig, out_root: str, run_id: str = "") -> dict:
    """Pass 2: match one tile's pre features against its neighbourhood's post features."""
    _single_thread()
    clock = Clock()
    store = Store(out_root)
    out = _tile_result(row)
    pair, tc, tr = row["pair_id"], row["tile_col"], row["tile_row"]
    try:
        rel = matches_rel(cfg, pair, tc, tr)
        if store.exists(rel):
            out.update(reused=True)
            return out
        feats = {}
        for c, r in row["neighbours"]:
            try:
                data = store.read_bytes(features_rel(cfg, pair, c, r))
                feats[(c, r)] = TileFeatures.from_bytes(data)
            except (FileNotFoundError, OSError) as exc:
                raise OSError(f"features of tile r{r} c{c} missing (tile failed?)") from exc
        matches = match_tile(feats[(tc, tr)], feats.values(), tc, tr, cfg)
        store.write_bytes(rel, matches.to_bytes())
        out.update(n=len(matches))
    except Exception as exc:  # noqa: BLE001 - the slices of this tile report it
        out.update(error=f"{type(exc).__name__}: {exc}"[:500])
    out.update(seconds=clock.wall(), cpu_seconds=clock.cpu())
    return out


def drop_features(tile_rows: Sequence[dict], results: Sequence[dict], out_root: str,
                  cfg: RegistrationConfig) -> None:
    """Delete the features of pairs whose every tile has its matches stored."""
    failed = {r["pair_id"] for r in results if r["error"]}
    store = Store(out_root)
    for row in tile_rows:
        if row["pair_id"] not in failed:
            store.delete(features_rel(cfg, row["pair_id"], row["tile_col"], row["tile_row"]))


def load_slice_matches(row: dict, cfg: RegistrationConfig, store: Store) -> TileMatches:
    parts = []
    for tc, tr in tiles_for_window(row["window"], cfg.tile_size):
        rel = matches_rel(cfg, row["pair_id"], tc, tr)
        try:
            parts.append(TileMatches.from_bytes(store.read_bytes(rel)))
        except (FileNotFoundError, OSError) as exc:
            raise OSError(f"matches of tile r{tr} c{tc} missing (tile failed?): {rel}") from exc
    return TileMatches.concat(parts)


def register_slice_regional(row: dict, cfg: RegistrationConfig, out_root: str,
                            run_id: str = "") -> dict:
    """Fit one slice from its tiles' matches; read only the crop and its post footprint."""
    _single_thread()
    clock = Clock()
    try:
        window = [int(v) for v in row["window"]]
        matches = load_slice_matches(row, cfg, Store(out_root))
        fit = fit_slice(matches, window, cfg)
        if fit.homography is None:
            return envelope("metadata", _record(row, cfg, run_id, clock, fit, "rejected",
                                                fit.reject_reason))
        off = crop_offset(window[2], cfg.crop_size)
        kept = crop_window(row, cfg)
        pre_crop, pre_valid = read_pre(row, kept)
        fx, fy, fw, fh = post_footprint(fit.homography, (off, off), cfg.crop_size,
                                        cfg.crop_read_margin_px)
        post, post_valid = read_post(row, (window[0] + fx, window[1] + fy, fw, fh))
        post_crop, post_crop_valid = warp_post_to_crop(post, post_valid, fit.homography, (fx, fy),
                                                       (off, off), cfg.crop_size, cfg.resampling)
        return finish_crop(row, cfg, out_root, run_id, clock, fit, pre_crop, pre_valid, post_crop,
                           post_crop_valid)
    except Exception as exc:  # noqa: BLE001 - every slice must end as one envelope
        return error_envelope(row.get("slice_id", "?"), STAGE, exc, job="pairs", run_id=run_id)


def register_slice_row(row: dict, cfg: RegistrationConfig, out_root: str, run_id: str = "") -> dict:
    """Dispatch on ``cfg.method`` (regional assumes its tiles' matches are stored)."""
    if cfg.method == "per-slice":
        return register_slice_per_slice(row, cfg, out_root, run_id)
    return register_slice_regional(row, cfg, out_root, run_id)


# ---- Ray Data ---------------------------------------------------------------------------------

def _plain(row: dict) -> dict:
    """Ray rows hold numpy arrays for list columns; the cores want plain lists."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, np.ndarray):
            v = v.tolist()
        out[k] = v
    return out


def _register_map(row: dict, cfg_dict: dict, out_root: str, run_id: str) -> dict:
    return register_slice_row(_plain(row), RegistrationConfig(**cfg_dict), out_root, run_id)


# The regional method runs as one Ray core task graph rather than three Ray Data passes with a
# barrier (and a Ray Data start-up) between each: a matching task depends on the feature tasks of
# its neighbourhood and a slice task on the matching tasks of its tiles, so Ray starts each piece
# of work as soon as what it needs exists and no core waits for a whole pass to finish. What
# travels between tasks are the small per-tile result dicts (dependencies, and the audit trail);
# features and matches go through the store as before (resume; memory stays bounded because no
# features, matches or pixels pile up in the object store or on the driver).

def _features_task(rows: list[dict], cfg_dict: dict, out_root: str, run_id: str) -> list[dict]:
    cfg = RegistrationConfig(**cfg_dict)
    return [features_tile_row(r, cfg, out_root, run_id) for r in rows]


def _matches_task(rows: list[dict], cfg_dict: dict, out_root: str, run_id: str,
                  *needs: list[dict]) -> list[dict]:
    cfg = RegistrationConfig(**cfg_dict)
    return [match_tile_row(r, cfg, out_root, run_id) for r in rows]


def _slices_task(rows: list[dict], cfg_dict: dict, out_root: str, run_id: str,
                 *needs: list[dict]) -> list[dict]:
    cfg = RegistrationConfig(**cfg_dict)
    return [register_slice_row(r, cfg, out_root, run_id) for r in rows]


_REMOTE: dict[str, Any] = {}


def _remote(fn):
    """``fn`` as a Ray task taking one CPU (wrapped once per process)."""
    import ray
    if fn.__name__ not in _REMOTE:
        _REMOTE[fn.__name__] = ray.remote(num_cpus=1)(fn)
    return _REMOTE[fn.__name__]


def _chunks(items: Sequence, size: int) -> list:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _tile_key(row: dict) -> tuple:
    return row["pair_id"], int(row["tile_col"]), int(row["tile_row"])


def _get_results(ref, rows: Sequence[dict], failed) -> list:
    """ray.get of a task's per-row list; a task that died (worker lost, ...) gives ``failed(row,
    exc)`` for each of its rows, so every tile and slice still reports."""
    import ray
    try:
        return ray.get(ref)
    except Exception as exc:  # noqa: BLE001
        return [failed(r, exc) for r in rows]


def _failed_tile(row: dict, exc: BaseException) -> dict:
    out = _tile_result(row)
    out.update(error=f"{type(exc).__name__}: {exc}"[:500])
    return out


class _TileGraph:
    """Feature and matching tasks of a tile plan, submitted without waiting for either."""

    def __init__(self, tile_rows: list[dict], cfg: RegistrationConfig, out_root: str,
                 run_id: str, cfg_ref):
        self.tile_rows, self.cfg, self.out_root, self.run_id = tile_rows, cfg, out_root, run_id
        self.clock = Clock()
        args = (cfg_ref, out_root, run_id)
        # Features (seconds per tile) get a task each.
        self.feature_tasks = [(rows, _remote(_features_task).remote(rows, *args))
                              for rows in _chunks(tile_rows, 1)]
        feature_ref = {_tile_key(rows[0]): ref for rows, ref in self.feature_tasks}
        # Matching is ~10x cheaper: tiles are batched; a batch waits for the features of its
        # tiles' neighbourhoods only.
        self.match_tasks, self.match_ref = [], {}
        for rows in _chunks(tile_rows, self.cfg.match_tiles_per_task):
            needs = {feature_ref[(r["pair_id"], int(c), int(t))]: None
                     for r in rows for c, t in r["neighbours"]}
            ref = _remote(_matches_task).remote(rows, *args, *needs)
            self.match_tasks.append((rows, ref))
            self.match_ref.update({_tile_key(r): ref for r in rows})

    def finish(self) -> list[dict]:
        """Wait for the tile tasks; drop spent features, write the audit trail; the matching
        results per tile (``n`` = matches, ``reused``, ``error``)."""
        features = [res for rows, ref in self.feature_tasks
                    for res in _get_results(ref, rows, _failed_tile)]
        features_wall = self.clock.wall()
        results = [res for rows, ref in self.match_tasks
                   for res in _get_results(ref, rows, _failed_tile)]
        matches_wall = round(self.clock.wall() - features_wall, 4)
        if not self.cfg.keep_features:
            drop_features(self.tile_rows, results, self.out_root, self.cfg)
        # An audit trail of the tile work (failures otherwise show only as slice errors). The
        # passes overlap now: features_wall_s is until the last feature task, matches_wall_s the
        # rest until the last matching task.
        summary = {"run_id": self.run_id, "features_wall_s": features_wall,
                   "matches_wall_s": matches_wall, "features": features, "matches": results}
        Store(self.out_root).write_bytes(f"{TILE_RUNS_DIR}/{self.run_id}.json",
                                         json.dumps(summary).encode())
        return results


def run_tile_stage(tile_rows: list[dict], cfg: RegistrationConfig, out_root: str,
                   run_id: str) -> list[dict]:
    """Both tile passes as Ray tasks (rows are tiny; pixels never travel).

    Returns the matching pass's per-tile results (``n`` = matches, ``reused``, ``error``); a
    feature failure shows up there as missing features of the tiles that needed them.
    """
    import ray
    if not tile_rows:
        return []
    return _TileGraph(tile_rows, cfg, out_root, run_id, ray.put(asdict(cfg))).finish()


def _wait_with_progress(sizes: dict, every_s: float = 10.0) -> None:
    """Block until every slice task is done, printing progress: the task graph runs outside Ray
    Data, so its progress bars do not see this work."""
    import ray
    pending, total, done = list(sizes), sum(sizes.values()), 0
    t0 = last = time.time()
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=every_s)
        done += sum(sizes[r] for r in ready)
        now = time.time()
        if now - last >= every_s or not pending:
            print(f"[registration] {done}/{total} slices registered ({now - t0:.0f} s)", flush=True)
            last = now


def run_regional(rows: list[dict], cfg: RegistrationConfig, out_root: str,
                 run_id: str) -> list[dict]:
    """The whole regional method on slice rows as one task graph; one envelope per slice."""
    import ray
    cfg_ref = ray.put(asdict(cfg))
    tiles = plan_tiles(rows, cfg)
    graph = _TileGraph(tiles, cfg, out_root, run_id, cfg_ref)
    # A slice task waits for the matching tasks of its slices' tiles only.
    slice_tasks = []
    for chunk in _chunks(rows, cfg.slices_per_task):
        needs = {graph.match_ref[(r["pair_id"], tc, tr)]: None for r in chunk
                 for tc, tr in tiles_for_window(r["window"], cfg.tile_size)}
        slice_tasks.append((chunk, _remote(_slices_task).remote(chunk, cfg_ref, out_root, run_id,
                                                                 *needs)))
    _wait_with_progress({ref: len(chunk) for chunk, ref in slice_tasks})
    graph.finish()

    def failed(row, exc):
        return error_envelope(row.get("slice_id", "?"), STAGE, exc, job="pairs", run_id=run_id)

    return [env for chunk, ref in slice_tasks for env in _get_results(ref, chunk, failed)]


def registration_stage(slices, cfg: RegistrationConfig, out_root: str, run_id: str):
    """Slice rows -> one ``metadata`` or ``errors`` envelope per slice (columns _table, _record).

    per-slice: a lazy map, one task per slice. regional: the slice rows (small metadata) are
    collected on the driver to plan the feature tiles; the feature, matching and slice tasks then
    run here as one Ray task graph (no barrier between passes: each task starts when the tasks it
    needs are done); the returned dataset holds the envelopes (small records).
    """
    import ray.data
    kwargs = {"cfg_dict": asdict(cfg), "out_root": out_root, "run_id": run_id}
    if cfg.method == "per-slice":
        # One slice per task (tens of core-seconds each) so both cores and every node get work.
        return slices.repartition(target_num_rows_per_block=1).map(
            _register_map, fn_kwargs=kwargs, num_cpus=1)
    rows = [_plain(r) for r in slices.iter_rows()]
    if not rows:
        return slices.map(_register_map, fn_kwargs=kwargs, num_cpus=1)
    return ray.data.from_items(run_regional(rows, cfg, out_root, run_id))
