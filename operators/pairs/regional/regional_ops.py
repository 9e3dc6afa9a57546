"""The regional registration method as one Ray task graph: slice rows in, one envelope per slice out.

Row-level functions (plain dict in, envelope out) carry the I/O around the pure cores in
``registration``, ``screening`` and ``regional``; :func:`registration_stage` wires them into Ray
Data. Every slice ends as exactly one envelope: ``metadata`` (status accepted or rejected, with a
reason) or ``errors`` (stage "registration", e.g. an unreadable window).

Outputs per accepted slice, through ``Store(out_root)``: ``A/<slice_id>.png`` (pre crop) and
``B/<slice_id>.png`` (registered post crop), 8-bit RGB by each scene's stretch. Regional matches
are kept under ``_work/matches/<features_key>/<pair_id>-<inputs>/<tile_row>_<tile_col>.npz`` (the
key hashes the feature and matching settings, ``<inputs>`` the bands and stacked assets read) so a resumed run with the same settings reuses them; with guided
matching the pair's prior (``_work/priors/<key>/<pair_id>.json``) and the guided matches
(``_work/guided/<key>/...``, what slices fit) are kept the same way;
the per-tile features they come from (``_work/features/...``) are deleted once a pair's matches are
complete (``keep_features`` keeps them); ``_work/tile_runs/<run_id>.json`` records the tile passes
(of the graph's first window; later windows in ``<run_id>-w<window>.json``).
The regional method runs as one Ray task graph (features -> matches -> pair prior -> guided
matches -> slices, each task waiting only for the tasks it needs), not as three Ray Data passes with barriers in between.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import asdict
from typing import Any, Callable, Iterable, Iterator, Sequence

from operators.io.storage import Store
from operators.io.tables import envelope, error_envelope, persist_envelopes
from operators.pairs.catalogue.band_stack import forget_reads
from operators.pairs.registration.guided_matching import (MatchPrior, first_pass_sampled, fit_match_prior,
                                                          sampled_prior_holds)
from operators.pairs.regional.regional import (TileFeatures, TileMatches, block_features, fit_slice,
                                               guided_match_tile, match_tile, neighbour_tiles)
from operators.pairs.registration.tiles import grow, tile_core, tiles_for_window
from operators.pairs.registration.registration import RegistrationConfig, feature_image
from operators.pairs.crops.slice_io import (JOB, STAGE, Clock, crop_window, finish_crop, inputs_hash,
                                            plain_row, read_post, read_pre, read_registered_post,
                                            single_thread, slice_record, with_shift_envelopes)

FEATURES_DIR = "_work/features"
MATCHES_DIR = "_work/matches"
GUIDED_DIR = "_work/guided"
PRIORS_DIR = "_work/priors"
TILE_RUNS_DIR = "_work/tile_runs"


def work_id(row: dict) -> str:
    """Where a pair's intermediates live: its pair id plus a hash of the inputs its features
    depend on besides the settings in ``features_key`` (bands read, stacked assets and their
    cloud settings), so a rerun with other ``--bands`` or ``--cloud-mask`` recomputes them."""
    return f"{row['pair_id']}-{inputs_hash(row)}"


def matches_rel(cfg: RegistrationConfig, pair_id: str, tile_col: int, tile_row: int) -> str:
    return f"{MATCHES_DIR}/{cfg.features_key()}/{pair_id}/{tile_row:05d}_{tile_col:05d}.npz"


def guided_rel(cfg: RegistrationConfig, pair_id: str, tile_col: int, tile_row: int) -> str:
    return f"{GUIDED_DIR}/{cfg.features_key()}/{pair_id}/{tile_row:05d}_{tile_col:05d}.npz"


def prior_rel(cfg: RegistrationConfig, pair_id: str) -> str:
    return f"{PRIORS_DIR}/{cfg.features_key()}/{pair_id}.json"


def slice_matches_rel(cfg: RegistrationConfig, pair_id: str, tile_col: int, tile_row: int) -> str:
    """The matches slices fit: the guided pass's, or the first pass's without guided matching."""
    rel = guided_rel if cfg.guided_matching else matches_rel
    return rel(cfg, pair_id, tile_col, tile_row)


def features_rel(cfg: RegistrationConfig, pair_id: str, tile_col: int, tile_row: int) -> str:
    return f"{FEATURES_DIR}/{cfg.features_key()}/{pair_id}/{tile_row:05d}_{tile_col:05d}.npz"


def plan_tiles(slice_rows: Sequence[dict], cfg: RegistrationConfig) -> list[dict]:
    """One tile row per (pair, tile) that any slice of the pair overlaps.

    Each row lists its planned neighbours (tiles whose post features its matching needs). Runs on
    the driver for every window of the archive, so it works per pair on integer cells (a tile's
    neighbourhood is the same set of offsets everywhere) rather than per slice and tile.
    """
    keys = ("pair_id", "pre_uri", "post_uri", "crs", "transform", "bands_pre", "bands_post",
            "stretch_pre", "stretch_post", "pre_stack", "post_stack")  # stacks: issue 14
    ts = cfg.tile_size
    ref = 1 << 20   # any tile far from the origin: floor division makes the offsets uniform
    offsets = [(c - ref, r - ref) for c, r in neighbour_tiles(ref, ref, cfg)]
    by_pair: dict[str, tuple[dict, set]] = {}
    for r in slice_rows:
        entry = by_pair.get(r["pair_id"])
        if entry is None:
            entry = by_pair[r["pair_id"]] = ({k: r.get(k) for k in keys}, set())
        entry[1].update(tiles_for_window(r["window"], ts))
    out = []
    for pair in sorted(by_pair):
        shared, cells = by_pair[pair]
        for tc, tr in sorted(cells):
            # Post features outside every slice of the pair can never be used by a slice fit.
            out.append({**shared, "tile_col": tc, "tile_row": tr,
                        "neighbours": [[tc + dc, tr + dr] for dc, dr in offsets
                                       if (tc + dc, tr + dr) in cells]})
    return out


def _tile_result(row: dict) -> dict:
    return {"pair_id": row["pair_id"], "tile_col": row["tile_col"], "tile_row": row["tile_row"],
            "n": -1, "reused": False, "error": None, "seconds": 0.0, "cpu_seconds": 0.0}


def _tile_pass(row: dict, out_root: str, rel: str, reusable, compute) -> dict:
    """One tile pass for one tile: skipped when ``reusable(store)``, else ``compute(store)`` ->
    (bytes to store at ``rel``, count); failures become the tile's ``error``."""
    single_thread()
    clock = Clock()
    store = Store(out_root)
    out = _tile_result(row)
    try:
        if reusable(store):
            out.update(reused=True)
            return out
        data, n = compute(store)
        store.write_bytes(rel, data)
        out.update(n=n)
    except Exception as exc:  # noqa: BLE001 - the slices of this tile report it
        out.update(error=f"{type(exc).__name__}: {exc}"[:500])
    out.update(seconds=clock.wall(), cpu_seconds=clock.cpu())
    return out


def features_tile_row(row: dict, cfg: RegistrationConfig, out_root: str, run_id: str = "") -> dict:
    """Pass 1: SIFT features of both dates for one tile, stored; skipped if already stored."""
    return features_block_rows([row], cfg, out_root, run_id)[0]


def feature_blocks(tile_rows: Sequence[dict], cfg: RegistrationConfig) -> list[list[dict]]:
    """Tile rows grouped into blocks of at most ``tile_block`` x ``tile_block`` tiles of one
    pair (the unit of one feature task), in plan order."""
    k = max(1, int(cfg.tile_block))
    blocks: dict[tuple, list[dict]] = {}
    for r in tile_rows:
        blocks.setdefault((r["pair_id"], int(r["tile_col"]) // k, int(r["tile_row"]) // k),
                          []).append(r)
    return list(blocks.values())


def features_block_rows(rows: Sequence[dict], cfg: RegistrationConfig, out_root: str,
                        run_id: str = "") -> list[dict]:
    """Pass 1 for a block of tiles of one pair (:func:`feature_blocks`): one SIFT run per date
    over the tiles still needed plus ``tile_context_px``, each tile's keypoints stored apart.
    A tile is skipped when its features are stored, or every tile that matches against it has
    its final matches (neighbourhoods are symmetric: exactly its planned neighbours)."""
    single_thread()
    forget_reads()
    clock = Clock()
    store = Store(out_root)
    outs = [_tile_result(r) for r in rows]
    pair = work_id(rows[0])
    rels = [features_rel(cfg, pair, r["tile_col"], r["tile_row"]) for r in rows]
    need = []
    for i, (r, rel) in enumerate(zip(rows, rels)):
        if store.exists(rel) or all(store.exists(slice_matches_rel(cfg, pair, c, t))
                                    for c, t in r["neighbours"]):
            outs[i].update(reused=True)
        else:
            need.append(i)
    if not need:
        return outs
    try:
        cores = [tile_core(rows[i]["tile_col"], rows[i]["tile_row"], cfg.tile_size) for i in need]
        c0, r0 = min(c[0] for c in cores), min(c[1] for c in cores)
        c1, r1 = max(c[0] + c[2] for c in cores), max(c[1] + c[3] for c in cores)
        window = grow((c0, r0, c1 - c0, r1 - r0), cfg.tile_context_px)
        pre, pre_valid = read_pre(rows[need[0]], window)
        post, post_valid = read_post(rows[need[0]], window)
        feats = block_features(feature_image(pre, pre_valid, cfg), pre_valid,
                               feature_image(post, post_valid, cfg), post_valid, window, cores,
                               cfg)
        for i, f in zip(need, feats):
            store.write_bytes(rels[i], f.to_bytes())
            outs[i].update(n=len(f.pre_xy) + len(f.post_xy))
    except Exception as exc:  # noqa: BLE001 - the slices of these tiles report it
        for i in need:
            outs[i].update(error=f"{type(exc).__name__}: {exc}"[:500])
    # The block's time, shared evenly by the tiles it computed (sums stay right).
    for i in need:
        outs[i].update(seconds=round(clock.wall() / len(need), 4),
                       cpu_seconds=round(clock.cpu() / len(need), 4))
    return outs


def _read_once(store: Store, rel: str, parse, memo: dict | None):
    """``parse(store.read_bytes(rel))``, once per ``memo`` (one task's batch of tiles or
    slices: neighbouring tiles share most of their neighbours, slices their tiles; stored
    intermediates do not change within a run)."""
    if memo is None:
        return parse(store.read_bytes(rel))
    if rel not in memo:
        memo[rel] = parse(store.read_bytes(rel))
    return memo[rel]


def _neighbour_features(row: dict, cfg: RegistrationConfig, store: Store,
                        memo: dict | None = None) -> dict:
    feats = {}
    for c, r in row["neighbours"]:
        try:
            feats[(c, r)] = _read_once(store, features_rel(cfg, work_id(row), c, r),
                                       TileFeatures.from_bytes, memo)
        except (FileNotFoundError, OSError) as exc:
            raise OSError(f"features of tile r{r} c{c} missing (tile failed?)") from exc
    return feats


def match_tile_row(row: dict, cfg: RegistrationConfig, out_root: str, run_id: str = "",
                   memo: dict | None = None) -> dict:
    """Pass 2: match one tile's pre features against its neighbourhood's post features."""
    pair, tc, tr = work_id(row), row["tile_col"], row["tile_row"]
    rel = matches_rel(cfg, pair, tc, tr)

    def reusable(store: Store) -> bool:
        return store.exists(rel) or (cfg.guided_matching and store.exists(prior_rel(cfg, pair))
                                     and store.exists(guided_rel(cfg, pair, tc, tr)))

    def compute(store: Store):
        feats = _neighbour_features(row, cfg, store, memo)
        matches = match_tile(feats[(tc, tr)], feats.values(), tc, tr, cfg, sample=True)
        return matches.to_bytes(), len(matches)

    return _tile_pass(row, out_root, rel, reusable, compute)


def prior_pair_rows(rows: Sequence[dict], cfg: RegistrationConfig, out_root: str,
                    run_id: str = "") -> dict:
    """Pass 3 (guided matching): one pair's affine prior from the first-pass matches of all its
    planned tiles (``rows``). ``n`` = the pair-level inliers (0: no prior, first pass reused);
    ``full_first_pass``: the sampled pass's prior did not hold, the pass was redone in full."""
    single_thread()
    clock = Clock()
    store = Store(out_root)
    pair = work_id(rows[0])
    out = {"pair_id": rows[0]["pair_id"], "n": -1, "local_tiles": 0, "reused": False, "error": None,
           "seconds": 0.0, "cpu_seconds": 0.0}
    try:
        rel = prior_rel(cfg, pair)
        if store.exists(rel):
            out.update(reused=True)
            return out
        parts = []
        for row in rows:
            try:
                data = store.read_bytes(matches_rel(cfg, pair, row["tile_col"], row["tile_row"]))
            except (FileNotFoundError, OSError) as exc:
                raise OSError(f"matches of tile r{row['tile_row']} c{row['tile_col']} missing "
                              "(tile failed?)") from exc
            parts.append(TileMatches.from_bytes(data))
        m = TileMatches.concat(parts)
        cells = [(int(r["tile_col"]), int(r["tile_row"])) for r in rows]
        prior = fit_match_prior(m.pre_xy, m.post_xy, cells, cfg)
        full = first_pass_sampled(cfg) and not sampled_prior_holds(prior, cfg)
        if full:
            # A pair with few tiles, or a hard one (dates years apart keep ~5 % of ratio
            # matches): its sample's prior is weak or wrong, so it is fitted as before, from
            # the first pass over every feature (the features are stored until the guided pass).
            memo: dict = {}
            m = TileMatches.concat(
                match_tile(f[(r["tile_col"], r["tile_row"])], f.values(), r["tile_col"],
                           r["tile_row"], cfg)
                for r in rows for f in [_neighbour_features(r, cfg, store, memo)])
            prior = fit_match_prior(m.pre_xy, m.post_xy, cells, cfg)
        store.write_bytes(rel, prior.to_bytes())
        out.update(n=prior.pair_inliers if prior.pair is not None else 0,
                   local_tiles=len(prior.tiles), full_first_pass=full)
    except Exception as exc:  # noqa: BLE001 - the slices of this pair report it
        out.update(error=f"{type(exc).__name__}: {exc}"[:500])
    out.update(seconds=clock.wall(), cpu_seconds=clock.cpu())
    return out


def guided_tile_row(row: dict, cfg: RegistrationConfig, out_root: str, run_id: str = "",
                    memo: dict | None = None) -> dict:
    """Pass 4 (guided matching): re-match one tile's pre features near their predicted partner."""
    pair, tc, tr = work_id(row), row["tile_col"], row["tile_row"]
    rel = guided_rel(cfg, pair, tc, tr)

    def compute(store: Store):
        try:
            prior = MatchPrior.from_bytes(store.read_bytes(prior_rel(cfg, pair)))
        except (FileNotFoundError, OSError) as exc:
            raise OSError(f"prior of pair {row['pair_id']} missing (its tiles failed?)") from exc
        if prior.for_tile(tc, tr) is None and not first_pass_sampled(cfg):
            # No prior for this pair: the first pass's matches are the final ones (stored already).
            data = store.read_bytes(matches_rel(cfg, pair, tc, tr))
            return data, len(TileMatches.from_bytes(data))
        # (A sampled first pass is redone on every feature when there is no prior.)
        feats = _neighbour_features(row, cfg, store, memo)
        matches = guided_match_tile(feats[(tc, tr)], feats.values(), tc, tr, prior, cfg)
        return matches.to_bytes(), len(matches)

    return _tile_pass(row, out_root, rel, lambda store: store.exists(rel), compute)


def tile_passes_in_process(tile_rows: list[dict], cfg: RegistrationConfig,
                           out_root: str) -> dict[str, list[dict]]:
    """Every tile pass serially in this process (no Ray): what the task graph runs, for
    benchmarks and debugging. Returns the per-pass results; features are dropped as in a run."""
    out = {"features": [res for block in feature_blocks(tile_rows, cfg)
                        for res in features_block_rows(block, cfg, out_root)],
           "matches": [match_tile_row(t, cfg, out_root) for t in tile_rows]}
    final = out["matches"]
    if cfg.guided_matching:
        out["priors"] = [prior_pair_rows(list(g), cfg, out_root)
                         for _, g in itertools.groupby(tile_rows, key=lambda t: t["pair_id"])]
        out["guided"] = final = [guided_tile_row(t, cfg, out_root) for t in tile_rows]
    if not cfg.keep_features:
        drop_features(tile_rows, final, out_root, cfg)
    return out


def drop_features(tile_rows: Sequence[dict], results: Sequence[dict], out_root: str,
                  cfg: RegistrationConfig) -> None:
    """Delete the features of pairs whose every tile has its final matches stored."""
    failed = {r["pair_id"] for r in results if r["error"]}
    store = Store(out_root)
    for row in tile_rows:
        if row["pair_id"] not in failed:
            store.delete(features_rel(cfg, work_id(row), row["tile_col"], row["tile_row"]))


def load_slice_matches(row: dict, cfg: RegistrationConfig, store: Store,
                       memo: dict | None = None) -> TileMatches:
    parts = []
    for tc, tr in tiles_for_window(row["window"], cfg.tile_size):
        rel = slice_matches_rel(cfg, work_id(row), tc, tr)
        try:
            parts.append(_read_once(store, rel, TileMatches.from_bytes, memo))
        except (FileNotFoundError, OSError) as exc:
            raise OSError(f"matches of tile r{tr} c{tc} missing (tile failed?): {rel}") from exc
    return TileMatches.concat(parts)


def register_slice_regional(row: dict, cfg: RegistrationConfig, out_root: str,
                            run_id: str = "", memo: dict | None = None) -> dict:
    """Fit one slice from its tiles' matches; read only the crop and its post footprint.
    ``memo``: shared by the slices of one task, so each tile's matches are read once."""
    single_thread()
    forget_reads()
    clock = Clock()
    try:
        window = [int(v) for v in row["window"]]
        matches = load_slice_matches(row, cfg, Store(out_root), memo)
        fit = fit_slice(matches, window, cfg)
        if fit.homography is None:
            return envelope("metadata", slice_record(row, cfg, run_id, clock, fit, "rejected",
                                                fit.reject_reason))
        pre_crop, pre_valid = read_pre(row, crop_window(row, cfg))
        post_crop, post_crop_valid = read_registered_post(row, fit.homography, cfg)
        return finish_crop(row, cfg, out_root, run_id, clock, fit, pre_crop, pre_valid, post_crop,
                           post_crop_valid)
    except Exception as exc:  # noqa: BLE001 - every slice must end as one envelope
        return error_envelope(row.get("slice_id", "?"), STAGE, exc, job=JOB, run_id=run_id)


# The task graph: the three passes are Ray tasks without a barrier (and a Ray Data start-up)
# between each: a matching task depends on the feature tasks of
# its neighbourhood and a slice task on the matching tasks of its tiles, so Ray starts each piece
# of work as soon as what it needs exists and no core waits for a whole pass to finish. What
# travels between tasks are the small per-tile result dicts (dependencies, and the audit trail);
# features and matches go through the store as before (resume; memory stays bounded because no
# features, matches or pixels pile up in the object store or on the driver).

def _features_task(rows: list[dict], cfg_dict: dict, out_root: str, run_id: str) -> list[dict]:
    return features_block_rows(rows, RegistrationConfig(**cfg_dict), out_root, run_id)


def _matches_task(rows: list[dict], cfg_dict: dict, out_root: str, run_id: str,
                  *needs: list[dict]) -> list[dict]:
    cfg = RegistrationConfig(**cfg_dict)
    memo: dict = {}
    return [match_tile_row(r, cfg, out_root, run_id, memo) for r in rows]


def _prior_task(rows: list[dict], cfg_dict: dict, out_root: str, run_id: str,
                *needs: list[dict]) -> list[dict]:
    return [prior_pair_rows(rows, RegistrationConfig(**cfg_dict), out_root, run_id)]


def _guided_task(rows: list[dict], cfg_dict: dict, out_root: str, run_id: str,
                 *needs: list[dict]) -> list[dict]:
    cfg = RegistrationConfig(**cfg_dict)
    memo: dict = {}
    return [guided_tile_row(r, cfg, out_root, run_id, memo) for r in rows]


def _slices_task(rows: list[dict], cfg_dict: dict, out_root: str, run_id: str,
                 persist: dict | None, *needs: list[dict]) -> tuple[list[dict], list[str]]:
    """Fit a chunk of slices; with ``persist`` (a table writer's spec) the rows are written to a
    small shard right here, so they survive whatever happens to the driver next."""
    cfg = RegistrationConfig(**cfg_dict)
    memo: dict = {}
    envs = with_shift_envelopes([register_slice_regional(r, cfg, out_root, run_id, memo)
                                 for r in rows])
    return envs, (persist_envelopes(envs, persist) if persist else [])


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


def _failed_prior(row: dict, exc: BaseException) -> dict:
    return {"pair_id": row["pair_id"], "n": -1, "local_tiles": 0, "reused": False,
            "error": f"{type(exc).__name__}: {exc}"[:500], "seconds": 0.0, "cpu_seconds": 0.0}


class _TileGraph:
    """Feature and matching tasks of a tile plan, submitted without waiting for either."""

    def __init__(self, tile_rows: list[dict], cfg: RegistrationConfig, out_root: str,
                 run_id: str, cfg_ref, audit_name: str | None = None):
        self.tile_rows, self.cfg, self.out_root, self.run_id = tile_rows, cfg, out_root, run_id
        self.audit_name = audit_name or run_id
        self.clock = Clock()
        args = (cfg_ref, out_root, run_id)
        # Features (seconds per tile) get a task per block of tiles (``tile_block``).
        self.feature_tasks = [(rows, _remote(_features_task).remote(rows, *args))
                              for rows in feature_blocks(tile_rows, cfg)]
        feature_ref = {_tile_key(r): ref for rows, ref in self.feature_tasks for r in rows}
        # Matching is ~10x cheaper: tiles are batched; a batch waits for the features of its
        # tiles' neighbourhoods only.
        self.match_tasks, match_ref = self._batched(_matches_task, lambda r: [
            feature_ref[(r["pair_id"], int(c), int(t))] for c, t in r["neighbours"]], args)
        self.match_ref = match_ref          # what slice tasks wait for
        self.prior_tasks, self.guided_tasks = [], []
        if cfg.guided_matching:
            # One prior per pair, once all its first-pass matches exist; then the guided pass,
            # whose batches wait for their pairs' priors (the features exist by then).
            prior_ref = {}
            for pair, group in itertools.groupby(tile_rows, key=lambda r: r["pair_id"]):
                rows = list(group)
                needs = {match_ref[_tile_key(r)]: None for r in rows}
                ref = _remote(_prior_task).remote(rows, *args, *needs)
                self.prior_tasks.append((rows, ref))
                prior_ref[pair] = ref
            self.guided_tasks, self.match_ref = self._batched(
                _guided_task, lambda r: [prior_ref[r["pair_id"]]], args)

    def _batched(self, fn, needs_of, args) -> tuple[list, dict]:
        tasks, by_tile = [], {}
        for rows in _chunks(self.tile_rows, self.cfg.match_tiles_per_task):
            needs = {ref: None for r in rows for ref in needs_of(r)}
            ref = _remote(fn).remote(rows, *args, *needs)
            tasks.append((rows, ref))
            by_tile.update({_tile_key(r): ref for r in rows})
        return tasks, by_tile

    def finish(self) -> list[dict]:
        """Wait for the tile tasks; drop spent features, write the audit trail; the final
        matching results per tile (``n`` = matches, ``reused``, ``error``)."""
        features = [res for rows, ref in self.feature_tasks
                    for res in _get_results(ref, rows, _failed_tile)]
        features_wall = self.clock.wall()
        results = [res for rows, ref in self.match_tasks
                   for res in _get_results(ref, rows, _failed_tile)]
        priors = [res for rows, ref in self.prior_tasks
                  for res in _get_results(ref, [rows[0]], _failed_prior)]
        guided = [res for rows, ref in self.guided_tasks
                  for res in _get_results(ref, rows, _failed_tile)]
        matches_wall = round(self.clock.wall() - features_wall, 4)
        final = guided if self.cfg.guided_matching else results
        if not self.cfg.keep_features:
            drop_features(self.tile_rows, final, self.out_root, self.cfg)
        # An audit trail of the tile work (failures otherwise show only as slice errors). The
        # passes overlap now: features_wall_s is until the last feature task, matches_wall_s the
        # rest until the last (guided) matching task.
        summary = {"run_id": self.run_id, "features_wall_s": features_wall,
                   "matches_wall_s": matches_wall, "features": features, "matches": results,
                   "priors": priors, "guided": guided}
        Store(self.out_root).write_bytes(f"{TILE_RUNS_DIR}/{self.audit_name}.json",
                                         json.dumps(summary).encode())
        return final


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


def pair_windows(rows: Iterable[dict], window_slices: int) -> Iterator[list[dict]]:
    """Slice rows (grouped by pair, as the cut yields them) in windows of about ``window_slices``,
    never splitting a pair (its tiles are shared by its slices)."""
    window: list[dict] = []
    for pair_id, group in itertools.groupby(rows, key=lambda r: r["pair_id"]):
        group = list(group)
        if window and len(window) + len(group) > window_slices:
            yield window
            window = []
        window.extend(group)
    if window:
        yield window


class _Window:
    """One window of the regional graph in flight: its tile graph and its slice tasks."""

    def __init__(self, index: int, rows: list[dict], cfg: RegistrationConfig, out_root: str,
                 run_id: str, cfg_ref, persist: dict | None):
        self.index = index
        self.graph = _TileGraph(plan_tiles(rows, cfg), cfg, out_root, run_id, cfg_ref,
                                audit_name=run_id if index == 0 else f"{run_id}-w{index:05d}")
        # A slice task waits for the matching tasks of its slices' tiles only.
        self.tasks: dict[Any, list[dict]] = {}
        for chunk in _chunks(rows, cfg.slices_per_task):
            needs = {self.graph.match_ref[(r["pair_id"], tc, tr)]: None for r in chunk
                     for tc, tr in tiles_for_window(r["window"], cfg.tile_size)}
            ref = _remote(_slices_task).remote(chunk, cfg_ref, out_root, run_id, persist, *needs)
            self.tasks[ref] = chunk


def _wait_with_progress(windows: list, on_done, poll_s: float = 0.5, every_s: float = 10.0,
                        total: int | None = None, clock: Clock | None = None) -> int:
    """Wait for every slice task of ``windows`` (a list that may grow while we wait, see
    ``on_done``), calling ``on_done(window, ref)`` as each finishes; prints progress.

    One ``ray.wait`` over the in-flight tasks per poll interval, collecting everything ready,
    instead of one call per completion: the cost is O(in flight) per poll, not O(n) per task.
    """
    import ray
    done = 0
    clock = clock or Clock()
    last = -every_s
    while any(w.tasks for w in windows):
        pending = [ref for w in windows for ref in w.tasks]
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
        for ref in ready:
            window = next(w for w in windows if ref in w.tasks)
            done += len(window.tasks[ref])
            on_done(window, ref)
        if clock.wall() - last >= every_s or not any(w.tasks for w in windows):
            print(f"[registration] {done}{'' if total is None else f'/{total}'} slices registered "
                  f"({clock.wall():.0f} s)", flush=True)
            last = clock.wall()
    return done


def run_regional(rows: Iterable[dict], cfg: RegistrationConfig, out_root: str, run_id: str,
                 emit: Callable[[list[dict], list[str]], None] | None = None,
                 persist: dict | None = None, window_slices: int = 2000,
                 windows_in_flight: int = 2, total: int | None = None) -> list[dict] | None:
    """The regional method as a task graph submitted in windows of whole pairs.

    ``emit(envelopes, persisted_shards)`` is called as each slice task finishes (with ``persist``,
    a table writer's spec, the task has already written its rows); without ``emit`` the
    envelopes are collected and returned. The driver holds only the windows in flight, so memory
    and scheduling stay flat as the archive grows; a window's tile audit is written when it ends.
    If the driver is interrupted, tasks not yet finished are cancelled.
    """
    import ray
    collected: list[dict] = []
    returns = emit is None
    emit = emit or (lambda envs, shards: collected.extend(envs))
    cfg_ref = ray.put(asdict(cfg))
    windows: list[_Window] = []
    source = enumerate(pair_windows(rows, window_slices))

    def failed(row, exc):
        return error_envelope(row.get("slice_id", "?"), STAGE, exc, job=JOB, run_id=run_id)

    def submit_next() -> None:
        item = next(source, None)
        if item is not None:
            windows.append(_Window(item[0], item[1], cfg, out_root, run_id, cfg_ref, persist))

    def on_done(window: _Window, ref) -> None:
        chunk = window.tasks.pop(ref)
        try:
            envs, shards = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - a lost task: every slice still reports
            envs, shards = [failed(r, exc) for r in chunk], []
        emit(envs, shards)
        if not window.tasks:
            window.graph.finish()
            windows.remove(window)
            submit_next()

    for _ in range(max(1, windows_in_flight)):
        submit_next()
    try:
        _wait_with_progress(windows, on_done, total=total)
    except BaseException:
        for w in windows:
            for ref in w.tasks:
                ray.cancel(ref, force=True)
        raise
    return collected if returns else None


def regional_stage(slices, cfg: RegistrationConfig, out_root: str, run_id: str):
    """Ray Data in, Ray Data out (for callers that want a dataset): the slice rows are collected
    on the driver and run by :func:`run_regional`; the returned dataset holds the envelopes. The
    pairs job streams instead (``run_regional`` with ``emit``)."""
    import ray.data
    rows = [plain_row(r) for r in slices.iter_rows()]
    if not rows:
        return ray.data.from_items([])
    rows.sort(key=lambda r: r["pair_id"])
    return ray.data.from_items(run_regional(rows, cfg, out_root, run_id))
