"""The pairs job (S2Looking recipe): a satellite archive in, registered and screened 8-bit pairs out.

    python -m jobs.build_pairs --input <folder | s3://prefix | manifest.csv/.parquet> \\
                               --output <folder | s3://prefix> [options]

Stages (Ray Data): catalogue scenes (parallel header reads) -> select pairs (driver, small) ->
cut slices (flat_map, windows only) -> register + screen + write PNGs (CPU map) -> Parquet tables.
Outputs: ``A/ B/ label/ list/`` in the LEVIR-CD layout, and sharded Parquet tables ``metadata/``
(one row per slice), ``pairs/``, ``scenes/``, ``labels/``, ``errors/`` and ``runs/``. Tables
accumulate across runs (every row has its ``run_id``; ``operators.io.tables.read_table`` gives the
current state); a rerun, or a run on another chunk of the archive, into the same output skips
finished slices.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa

if __package__ in (None, ""):  # `python jobs/build_pairs.py` (e.g. under `ray job submit`)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from operators.pairs.catalogue.catalogue import SIDECAR_SUFFIXES, list_scene_inputs  # noqa: E402
from operators.pairs.catalogue.band_scene_ops import (BAND_SCENES_SCHEMA, BandsConfig,  # noqa: E402
                                                      catalogue_band_scenes, is_band_input,
                                                      prepare_band_pairs)
from operators.pairs.imagery.cloud_masks import CloudConfig  # noqa: E402
from operators.io.cli import add_config_args, config_from_args, init_ray, parse_job_args  # noqa: E402
from operators.pairs.labels.labels import LABEL_FOLDERS, LABELS_SCHEMA  # noqa: E402
from operators.pairs.selection.pairing import PAIRS_SCHEMA, PairingConfig, lonely_scenes, select_pairs  # noqa: E402
from operators.pairs.regional.regional_ops import run_regional  # noqa: E402
from operators.pairs.stage.register_stage import METADATA_SCHEMA, registration_stage  # noqa: E402
from operators.pairs.registration.registration import RegistrationConfig  # noqa: E402
from operators.pairs.crops.slice_io import SHIFTS_SCHEMA, settings_key, slice_finished  # noqa: E402
from operators.pairs.screening.rules import screen_rules  # noqa: E402
from operators.pairs.selection.slicing import slice_rows, slice_windows  # noqa: E402
from operators.pairs.selection.splits import SPLITS, assign_splits, list_files, parse_fractions, split_conflicts  # noqa: E402
from operators.io import console  # noqa: E402
from operators.io.storage import Store  # noqa: E402
from operators.io.tables import (ERRORS_SCHEMA, StreamingTableWriter, changed_rows,  # noqa: E402
                                 error_record, keyed, ordered_run_id, read_table, resolve_errors, split_envelopes,
                                 stream_dataset_to_tables, write_table_shard)

log = logging.getLogger("changeforge.build_pairs")
JOB = "build_pairs"


@dataclass
class PairsJobConfig:
    input: str = field(default="", metadata={"holds_except": (SIDECAR_SUFFIXES, "scenes"), "path": "must_exist", "required": True, "help": "scenes: a folder, an s3:// prefix, a manifest .csv/.parquet with uri, acquired[, location][, band], a STAC catalogue/collection root JSON, an items file (.json, .ndjson, stac-geoparquet), or a STAC API URL with --stac-search"})
    output: str = field(default="", metadata={"required": True, "help": "output folder or s3:// prefix"})
    slice_size: int = field(default=3000, metadata={"min": 1, "not_below": "crop_size", "help": "slice side in pixels on the common grid (paper: 3000)"})
    stride: int = field(default=1024, metadata={"min": 1, "help": "step between slices in pixels (paper: 1024)"})
    rgb_bands: tuple[int, ...] = field(default=(), metadata={"min": 1, "help": "1-based bands written as RGB (default: red, green and blue found by the bands' colour interpretation or descriptions, else the first three bands that are not alpha; single-band scenes are written grey)"})
    stretch_percentiles: tuple[int, ...] = field(default=(2, 98), metadata={"range": (0, 100), "length": 2, "increasing": True, "help": "per-scene percentiles mapped to 0 and 255 in the 8-bit conversion"})
    labels: str = field(default="", metadata={"path": "dir", "flag": "label-maps", "old_flags": ("--labels",), "help": "folder or s3:// prefix with label1/<slice_id>.png (new buildings) and label2/<slice_id>.png (demolished); merged by union into label/"})
    split_fractions: str = field(default="0.7,0.1,0.2", metadata={"fractions": 3, "help": "train,val,test fractions of locations, summing to 1 (paper: 70/10/20)"})
    seed: int = field(default=0, metadata={"flag": "split-seed", "old_flags": ("--seed",), "help": "seed of the location-to-split draw (a hash of seed and location)"})
    rows_per_shard: int = field(default=2000, metadata={"min": 1, "help": "rows per Parquet shard of the streamed tables (tasks write small shards that the driver folds into shards of this size)"})
    window_slices: int = field(default=2000, metadata={"min": 1, "help": "regional method: slices (whole pairs) per window of the task graph; two windows are in flight, so driver memory stays flat"})
    num_cpus: int | None = field(default=None, metadata={"min": 1, "help": "CPUs for a local Ray (ignored when RAY_ADDRESS points at a cluster; default: all)"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.build_pairs",
        description="Build S2Looking-style registered bitemporal pairs from a satellite archive. "
                    "S3 endpoints other than AWS come from AWS_ENDPOINT_URL; a cluster from RAY_ADDRESS.",
    )
    add_config_args(parser, PairsJobConfig, "job")
    add_config_args(parser, PairingConfig, "pair selection")
    add_config_args(parser, BandsConfig, "STAC and per-band products")
    add_config_args(parser, CloudConfig, "cloud masks")
    add_config_args(parser, RegistrationConfig, "registration", skip=("method",), tuning=True)
    parser.add_argument("--registration", dest="method", default=RegistrationConfig.method,
                        choices=("regional", "per-slice"),
                        help="regional: features once per region, reused by overlapping slices; "
                             "per-slice: the paper's recipe, SIFT per slice (default: %(default)s)")
    for action in parser._actions:   # the registration settings a user sets; the rest are tuning
        if action.dest in USER_REGISTRATION_OPTIONS:
            action.tuning = False
    parser.presets = PRESETS
    return parser


USER_REGISTRATION_OPTIONS = {"crop_size", "max_residual_px", "max_residual_m", "max_crop_cloud", "tile_size",
                             "search_margin_px", "rescue"}

# --preset: the paper's geometry, and the bundled demo's (its NAIP scenes are 934 x 723 px, so every
# size shrinks; its 2016-2020 dates need a reference date inside the 10-year lookback).
PRESETS = {
    "paper": ("S2Looking's geometry: 3000 px slices at stride 1024, 1024 px crops, 8 px screening limit",
              {"slice_size": 3000, "stride": 1024, "crop_size": 1024, "tile_size": 1024, "search_margin_px": 128,
               "max_residual_px": 8.0}),
    "demo": ("the bundled NAIP demo (data/naip): 512 px slices at stride 128, 256 px crops, 512 px tiles, "
             "reference date 2021-01-01",
             {"slice_size": 512, "stride": 128, "crop_size": 256, "tile_size": 512, "search_margin_px": 64,
              "reference_date": "2021-01-01"}),
}


RUNS_SCHEMA = keyed(pa.schema([
    ("run_id", pa.string()), ("job", pa.string()), ("status", pa.string()),  # started | finished
    ("started", pa.string()), ("finished", pa.string()), ("input", pa.string()),
    ("reference_date", pa.string()), ("seed", pa.int64()), ("split_fractions", pa.string()),
    ("location_cell_deg", pa.float64()), ("method", pa.string()), ("config", pa.string()),
    ("summary", pa.string()),
]), "run_id")
# Settings that decide which split a place lands in: every run into one output must share them.
SPLIT_SETTINGS = ("seed", "split_fractions", "location_cell_deg")


def table_schemas() -> dict[str, pa.Schema]:
    """The pairs job's tables with their keys (the current state is the latest row per key)."""
    return {
        "scenes": keyed(BAND_SCENES_SCHEMA, "scene_id"),  # plain rasters: STAC columns null
        "pairs": keyed(PAIRS_SCHEMA, "pair_id"),
        "metadata": keyed(METADATA_SCHEMA.append(pa.field("reference_date", pa.string())), "slice_id"),
        "shifts": keyed(SHIFTS_SCHEMA, "window_id"),
        "labels": keyed(LABELS_SCHEMA, "slice_id"),
        "errors": ERRORS_SCHEMA,
        "runs": RUNS_SCHEMA,
    }


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _check_split_settings(out: Store, run_row: dict) -> None:
    """Refuse to mix split settings in one output: a place would be drawn into two splits."""
    runs = read_table(out, "runs")
    for prev in ([] if runs is None else runs.to_pylist()):
        diff = [k for k in SPLIT_SETTINGS if prev.get(k) is not None and prev[k] != run_row[k]]
        if diff:
            raise SystemExit(
                f"{out.uri()} was written by run {prev['run_id']} with "
                + ", ".join(f"--{k.replace('_', '-')} {prev[k]}" for k in diff)
                + "; this run has " + ", ".join(f"--{k.replace('_', '-')} {run_row[k]}" for k in diff)
                + ". Locations would land in different splits (train/test leakage): rerun with the "
                "output's settings, or write to a new output")


def _check_split_conflicts(planned: dict[str, str], recorded: dict[str, str], out: Store) -> None:
    conflicts = split_conflicts(planned, recorded)
    if conflicts:
        sample = ", ".join(f"{loc}: {old} in the output, {new} now"
                           for loc, (old, new) in sorted(conflicts.items())[:5])
        raise SystemExit(f"refusing to write split assignments that contradict {out.uri()}/metadata "
                         f"for {len(conflicts)} location(s) ({sample}). Same --seed, "
                         "--split-fractions and --location-cell-deg as the runs that wrote it, "
                         "or a new output")


def _iter_slices(work: list[tuple[dict, dict, dict, str]], job: "PairsJobConfig", finished: set[str]):
    """Slice rows pair by pair (the regional graph windows by whole pairs), minus finished ones
    (see :func:`_finished`)."""
    for pair, pre, post, split in work:
        for r in slice_rows(pair, pre, post, job.slice_size, job.stride, split):
            if r["slice_id"] not in finished:
                yield r


def _finished(work, job: "PairsJobConfig", reg: RegistrationConfig,
              recorded: dict[str, tuple]) -> tuple[set[str], Counter]:
    """Slices a rerun skips (:func:`slice_finished`: recorded under the settings, inputs and
    screening rules this run would use), and why the others are not (a count per reason)."""
    out, why = set(), Counter()
    rules = screen_rules()
    for pair, pre, post, split in work:
        for r in slice_rows(pair, pre, post, job.slice_size, job.stride, split):
            done, reason = slice_finished(recorded.get(r["slice_id"]), settings_key(r, reg), rules)
            why[reason] += 1
            if done:
                out.add(r["slice_id"])
    return out, why


@dataclass
class _Run:
    """What every step of one run reads: the settings (reference date fixed), the output, the run."""
    job: PairsJobConfig
    pairing: PairingConfig
    reg: RegistrationConfig
    bands: BandsConfig
    cloud: CloudConfig
    out: Store
    run_id: str
    run_row: dict            # the ``runs`` row written as "started", rewritten as "finished"
    schemas: dict[str, pa.Schema]
    fractions: tuple[float, ...]
    t0: float


def run(job: PairsJobConfig, pairing: PairingConfig, reg: RegistrationConfig,
        bands: BandsConfig | None = None, cloud: CloudConfig | None = None) -> dict:
    """Run the whole job; returns a summary dict (also printed by :func:`main`)."""
    ctx = _start_run(job, pairing, reg, bands or BandsConfig(), cloud or CloudConfig())
    scenes, errors, band_input = _catalogue(ctx)                         # 1. catalogue
    judged = read_table(ctx.out, "pairs", columns=["pair_id"])           # pairs earlier runs judged
    judged = set() if judged is None else set(judged.column("pair_id").to_pylist())
    pairs, by_id = _select_pairs(ctx, scenes, errors, band_input)        # 2. pair selection
    work, finished, n_todo = _plan_slices(ctx, pairs, by_id)             # splits, slice work list
    n_acc = sum(p["status"] == "accepted" for p in pairs)
    n_new = sum(p["pair_id"] not in judged for p in pairs)
    print(f"[build_pairs] {len(scenes)} scene(s) catalogued, {len(pairs)} candidate pair(s) ({n_new} new, "
          f"{len(pairs) - n_new} judged by an earlier run), {n_acc} accepted; {n_todo} slice(s) to register, "
          f"{len(finished)} finished earlier; {len(errors)} error(s) so far", flush=True)
    counts = _register(ctx, work, finished, n_todo)                      # 3-5. slices -> tables
    del work
    accepted = _accepted_slices(ctx)
    if job.labels:                                                       # 6. labels
        errors.extend(_merge_labels(ctx.job, ctx.reg, ctx.out, accepted, ctx.run_id, counts,
                                    ctx.schemas["labels"]))
    return _finish(ctx, accepted, errors, counts, len(finished))        # 7. lists, errors, summary


def _start_run(job: PairsJobConfig, pairing: PairingConfig, reg: RegistrationConfig,
               bands: BandsConfig, cloud: CloudConfig) -> _Run:
    """Check the settings, fix the reference date, and record the run as started in ``runs``."""
    if not job.input or not job.output:
        raise SystemExit("--input and --output are required")
    t0 = time.time()
    out = Store(job.output)
    fractions = parse_fractions(job.split_fractions)
    if reg.crop_size > job.slice_size:
        raise SystemExit(f"--crop-size {reg.crop_size} is larger than --slice-size {job.slice_size}")
    # Today's date is the paper's meaning, but it is fixed once per run and recorded everywhere.
    pairing = dataclasses.replace(pairing, reference_date=pairing.reference().isoformat())
    schemas = table_schemas()
    # After every run id already in the output (shards are read in run-id order): a rerun in the same
    # second as the last writer, whose random suffix drew smaller, would not supersede its rows.
    run_id = ordered_run_id(out, schemas)
    run_row = {"run_id": run_id, "job": JOB, "status": "started", "started": _now(), "input": job.input,
               "reference_date": pairing.reference_date, "seed": job.seed,
               "split_fractions": ",".join(f"{f:g}" for f in fractions),
               "location_cell_deg": pairing.location_cell_deg, "method": reg.method,
               "config": json.dumps({"job": dataclasses.asdict(job), "pairing": dataclasses.asdict(pairing),
                                     "registration": reg.flat()}, default=str)}
    _check_split_settings(out, run_row)
    write_table_shard(out, "runs", [run_row], schemas["runs"], run_id)
    return _Run(job, pairing, reg, bands, cloud, out, run_id, run_row, schemas, fractions, t0)


def _catalogue(ctx: _Run) -> tuple[list[dict], list[dict], bool]:
    """1. This run's scenes and error rows, and whether the input is STAC items / per-band
    manifests. Header reads run in parallel; small records come back to the driver."""
    job, run_id = ctx.job, ctx.run_id
    band_input = is_band_input(job.input, ctx.bands.stac_search)  # STAC items or per-band manifests
    if band_input:
        # No pixel read yet: stretches come after pairing, for the scenes accepted pairs use.
        scenes, errors = catalogue_band_scenes(job.input, ctx.bands, ctx.cloud, run_id)
        print(f"[build_pairs] run {run_id}: {len(scenes)} stacked scene(s) from {job.input}; "
              f"reference date {ctx.pairing.reference_date}", flush=True)
        if not scenes and not errors:
            raise SystemExit(f"no STAC items or band rows found in {job.input}")
        return scenes, errors, band_input
    import ray.data
    inputs = list_scene_inputs(job.input)
    print(f"[build_pairs] run {run_id}: {len(inputs)} scene input(s) from {job.input}; reference "
          f"date {ctx.pairing.reference_date}", flush=True)
    if not inputs:
        raise SystemExit(f"no scenes found under {job.input}")
    cat = ray.data.from_items([dataclasses.asdict(s) for s in inputs])
    env_rows = cat.flat_map(
        _catalogue_fn, fn_kwargs={"rgb_bands": list(job.rgb_bands) or None,
                                  "percentiles": tuple(job.stretch_percentiles), "run_id": run_id},
    ).take_all()
    tables = split_envelopes(env_rows)
    scenes, errors = tables.get("scenes", []), tables.get("errors", [])
    _write_scenes(ctx, scenes)
    return scenes, errors, band_input


def _write_scenes(ctx: _Run, scenes: list[dict]) -> None:
    """Record the scenes that changed, and close their open catalogue errors."""
    write_table_shard(ctx.out, "scenes", changed_rows(ctx.out, "scenes", scenes, ctx.schemas["scenes"]),
                      ctx.schemas["scenes"], ctx.run_id)
    resolve_errors(ctx.out, [s["uri"] for s in scenes], ctx.run_id, stages=["catalogue"], job=JOB)


def _select_pairs(ctx: _Run, scenes: list[dict], errors: list[dict],
                  band_input: bool) -> tuple[list[dict], dict[str, dict]]:
    """2. Candidate pairs (driver: one small record per scene) and every known scene by id;
    appends a NoPartner error per lonely scene to ``errors``.

    This run's scenes pair with each other and with scenes earlier runs catalogued (chunks of one
    archive pair across chunks); pairs of two earlier scenes were judged by the run that saw them."""
    out, run_id = ctx.out, ctx.run_id
    known_table = read_table(out, "scenes")   # None when no scene was ever catalogued
    known = known_table.to_pylist() if known_table is not None else []
    new_ids = {s["scene_id"] for s in scenes}
    if band_input:  # this run's stacked scenes are not written yet (no stretch so far)
        known = [k for k in known if k["scene_id"] not in new_ids] + scenes
    pairs = select_pairs(known, ctx.pairing, new=new_ids)
    if band_input:  # --max-cloud-cover, then the stretches of the scenes accepted pairs use
        errors.extend(prepare_band_pairs(pairs, known, ctx.cloud, ctx.job.stretch_percentiles, run_id))
        _write_scenes(ctx, scenes)
    for s in lonely_scenes(scenes, pairs):
        errors.append(error_record(s["uri"], "pairing", "no other scene covers the same place (footprint "
                                   f"IoU above {ctx.pairing.min_iou}); it cannot form a pair",
                                   error_type="NoPartner", job=JOB, run_id=run_id))
    by_id = {s["scene_id"]: s for s in known}
    resolve_errors(out, {by_id[p[k]]["uri"] for p in pairs for k in ("pre_scene", "post_scene")},
                   run_id, stages=["pairing"], job=JOB)
    return pairs, by_id


def _plan_slices(ctx: _Run, pairs: list[dict], by_id: dict[str, dict]) -> tuple[list, set[str], int]:
    """The work list ``(pair, pre, post, split)`` of accepted pairs, the slices finished earlier and
    the number left to register; writes the ``pairs`` table.

    Splits are a pure function of the location and the seed; refuses to contradict the output.
    An accepted pair whose overlap holds no slice is rejected here, before ``pairs`` is written."""
    job, out = ctx.job, ctx.out
    meta = read_table(out, "metadata", columns=["slice_id", "location", "split", "settings_key", "screen_rules"])
    recorded = {} if meta is None else dict(zip(meta.column("location").to_pylist(),
                                                meta.column("split").to_pylist()))
    judged = {} if meta is None else dict(zip(meta.column("slice_id").to_pylist(), zip(
        *[meta.column(c).to_pylist() if c in meta.column_names else [None] * meta.num_rows
          for c in ("settings_key", "screen_rules")])))
    del meta
    splits = assign_splits({p["location"] for p in pairs if p["status"] == "accepted"}, ctx.fractions, job.seed)
    _check_split_conflicts(splits, recorded, out)
    work = []
    for p in pairs:
        if p["status"] != "accepted":
            continue
        pre, post = by_id[p["pre_scene"]], by_id[p["post_scene"]]
        windows = slice_windows(pre, post, job.slice_size, job.stride)
        if not windows:
            p["status"] = "rejected"
            p["reason"] = f"footprint intersection is smaller than one {job.slice_size} px slice"
            continue
        work.append((p, pre, post, splits[p["location"]]))
    finished, why = _finished(work, job, ctx.reg, judged)
    if why["screen_rules"]:
        print(f"[build_pairs] {why['screen_rules']} slice(s) recorded by other screening rules than this "
              f"installation's ({screen_rules()}): judged again", flush=True)
    n_todo = sum(1 for _ in _iter_slices(work, job, finished))
    write_table_shard(out, "pairs", changed_rows(out, "pairs", pairs, ctx.schemas["pairs"]),
                      ctx.schemas["pairs"], ctx.run_id)
    return work, finished, n_todo


def _register(ctx: _Run, work: list, finished: set[str], n_todo: int) -> dict[str, int]:
    """3-5. Slices -> registration -> tables, streamed: rows are persisted as slices finish.
    Returns the rows written per table."""
    import ray.data
    job, reg, out, run_id = ctx.job, ctx.reg, ctx.out, ctx.run_id
    writer = StreamingTableWriter(out, {"metadata": ctx.schemas["metadata"], "shifts": ctx.schemas["shifts"],
                                        "errors": ctx.schemas["errors"]},
                                  run_id, rows_per_shard=job.rows_per_shard,
                                  constants={"reference_date": ctx.pairing.reference_date})
    if n_todo:
        if reg.method == "regional":
            run_regional(_iter_slices(work, job, finished), reg, out.uri(), run_id, emit=writer.add,
                         persist=writer.spec(), window_slices=job.window_slices, total=n_todo)
        else:
            items = [{"pair": json.dumps(p), "pre": json.dumps(a), "post": json.dumps(b), "split": sp}
                     for p, a, b, sp in work]
            slices = ray.data.from_items(items).flat_map(
                _cut_fn, fn_kwargs={"slice_size": job.slice_size, "stride": job.stride,
                                    "skip": frozenset(finished)})
            stream_dataset_to_tables(registration_stage(slices, reg, out.uri(), run_id), writer)
        writer.flush()
    return dict(writer.counts)


def _accepted_slices(ctx: _Run) -> list[tuple[str, str]]:
    """``(slice_id, split)`` of every accepted slice in the output so far; closes the open
    registration errors of slices that now have a row."""
    meta = read_table(ctx.out, "metadata", columns=["slice_id", "split", "status"])
    if meta is None:
        return []
    resolve_errors(ctx.out, meta.column("slice_id").to_pylist(), ctx.run_id, stages=["registration"], job=JOB)
    m = meta.to_pylist()
    return sorted({(r["slice_id"], r["split"]) for r in m if r["status"] == "accepted"})


def _finish(ctx: _Run, accepted: list[tuple[str, str]], errors: list[dict], counts: dict,
            skipped: int) -> dict:
    """7. Split lists from every accepted slice so far (idempotent), this run's error rows, and
    the run recorded as finished with its summary (returned)."""
    out = ctx.out
    for split, names in list_files(accepted).items():
        out.write_bytes(f"list/{split}.txt", ("\n".join(names) + ("\n" if names else "")).encode())

    write_table_shard(out, "errors", errors, ctx.schemas["errors"], ctx.run_id)
    summary = _summary(out, ctx.run_id, counts, skipped, time.time() - ctx.t0, ctx.pairing.reference_date)
    write_table_shard(out, "runs", [{**ctx.run_row, "status": "finished", "finished": _now(),
                                     "summary": json.dumps(summary)}], ctx.schemas["runs"], ctx.run_id)
    return summary


def _catalogue_fn(row, **kw):
    from operators.pairs.stage.pairs_ops import catalogue_scene
    return catalogue_scene(row, **kw)


def _cut_fn(row, **kw):
    from operators.pairs.stage.pairs_ops import cut_pair
    return cut_pair(row, **kw)


def _labels_fn(row, **kw):
    from operators.pairs.stage.pairs_ops import merge_slice_labels
    return merge_slice_labels(row, **kw)


def _merge_labels(job, reg, out: Store, accepted, run_id, counts, schema) -> list[dict]:
    import ray.data

    from operators.io.tables import TableSink

    labels = Store(job.labels)
    errors = []
    given = {}
    for folder in LABEL_FOLDERS:
        for rel in labels.list(folder, suffixes=(".png",)):
            given.setdefault(rel.rsplit("/", 1)[-1][:-4], set()).add(folder)
    accepted_ids = {s for s, _ in accepted}
    for slice_id in sorted(set(given) - accepted_ids):
        errors.append(error_record(slice_id, "labels", "label maps given for a slice that is not an "
                                   "accepted slice of this output", error_type="UnknownSlice",
                                   job=JOB, run_id=run_id))
    done = {r.rsplit("/", 1)[-1][:-4] for r in out.list("label", suffixes=(".png",))}
    todo = [{"slice_id": s} for s in sorted(accepted_ids & set(given)) if s not in done]
    if todo:
        ds = ray.data.from_items(todo).flat_map(
            _labels_fn, fn_kwargs={"labels_root": labels.uri(), "out_root": out.uri(),
                                   "crop_size": reg.crop_size, "run_id": run_id})
        sink = TableSink(out.uri(), {"labels": schema}, run_id, rows_per_shard=job.rows_per_shard)
        ds.write_datasink(sink)
        for k, v in sink.counts.items():
            counts[k] = counts.get(k, 0) + v
        merged = read_table(out, "labels", columns=["slice_id"])   # None while no label merged yet
        if merged is not None:
            resolve_errors(out, merged.column("slice_id").to_pylist(), run_id, stages=["labels"], job=JOB)
    return errors


def _summary(out: Store, run_id: str, counts: dict, skipped: int, seconds: float,
             reference_date: str) -> dict:
    meta = read_table(out, "metadata", columns=["status", "reject_reason"])
    errs = read_table(out, "errors", columns=["run_id"])
    status, reasons = {}, {}
    if meta is not None:
        for r in meta.select(["status", "reject_reason"]).to_pylist():
            status[r["status"]] = status.get(r["status"], 0) + 1
            if r["reject_reason"]:
                key = r["reject_reason"].split("(")[0].split(":")[0].strip()
                reasons[key] = reasons.get(key, 0) + 1
    lists = {s: len([l for l in out.read_bytes(f"list/{s}.txt").decode().splitlines() if l])
             for s in SPLITS if out.exists(f"list/{s}.txt")}
    return {
        "output": out.uri(), "run_id": run_id, "seconds": round(seconds, 1),
        "slices_this_run": counts.get("metadata", 0), "slices_skipped_as_finished": skipped,
        "accepted_total": status.get("accepted", 0), "rejected_total": status.get("rejected", 0),
        "reject_reasons": reasons, "labels_merged_this_run": counts.get("labels", 0),
        "errors_this_run": 0 if errs is None else errs.column("run_id").to_pylist().count(run_id),
        "errors_open": 0 if errs is None else errs.num_rows, "splits": lists,
        "reference_date": reference_date,
    }


def _explain(out: Store, summary: dict) -> None:
    """This run's error rows by reason; when the output holds no accepted slice, why (the rejected
    pairs and slices and the errors, top reasons first, with their first items), and exit 3."""
    console.print_errors("[build_pairs]", out, summary["run_id"])
    if summary["accepted_total"]:
        return
    pairs = read_table(out, "pairs", columns=["pair_id", "status", "reason"])
    meta = read_table(out, "metadata", columns=["slice_id", "status", "reject_reason"])
    rejected = [r for r in ([] if pairs is None else pairs.to_pylist()) if r["status"] != "accepted"]
    slices = [r for r in ([] if meta is None else meta.to_pylist()) if r["status"] != "accepted"]
    console.stop_if_nothing("[build_pairs]", False, f"no slice accepted in {out.uri()}", *console.merge(
        console.tally(rejected, "pair_id", "reason", "pair rejected"),
        console.tally(slices, "slice_id", "reject_reason", "slice rejected"),
        console.error_tally(out, summary["run_id"])))


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_job_args(build_parser(), argv)
    job = config_from_args(PairsJobConfig, args)
    pairing = config_from_args(PairingConfig, args)
    reg = config_from_args(RegistrationConfig, args)
    bands = config_from_args(BandsConfig, args)
    cloud = config_from_args(CloudConfig, args)
    init_ray(job.num_cpus)
    summary = run(job, pairing, reg, bands, cloud)
    print("[build_pairs] done in {seconds}s: {accepted_total} accepted, {rejected_total} rejected slices "
          "in total ({slices_this_run} registered this run, {slices_skipped_as_finished} already "
          "finished); {errors_this_run} error row(s)".format(**summary), flush=True)
    if summary["reject_reasons"]:
        print("[build_pairs] reject reasons: " + ", ".join(
            f"{k}: {v}" for k, v in sorted(summary["reject_reasons"].items())), flush=True)
    print(f"[build_pairs] splits (accepted slices): {summary['splits']}", flush=True)
    out = Store(summary["output"])
    _explain(out, summary)
    folders = [f for f in ("A", "B", "label", "list") if out.list(f)]
    tables = [t for t in ("metadata", "pairs", "scenes", "shifts", "labels", "errors", "runs") if out.list(t)]
    print(f"[build_pairs] outputs in {summary['output']}: {', '.join(f + '/' for f in folders)}; tables: "
          f"{', '.join(t + '/' for t in tables)} (Parquet)", flush=True)
    return summary


if __name__ == "__main__":
    from operators.process_exit import run as run_process    # this module may have its own run
    run_process(main)
