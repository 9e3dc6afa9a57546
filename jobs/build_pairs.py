"""The pairs job (S2Looking recipe): a satellite archive in, registered and screened 8-bit pairs out.

    python -m jobs.build_pairs --input <folder | s3://prefix | manifest.csv/.parquet> \\
                               --output <folder | s3://prefix> [options]

Stages (Ray Data): catalogue scenes (parallel header reads) -> select pairs (driver, small) ->
cut slices (flat_map, windows only) -> register + screen + write PNGs (CPU map) -> Parquet tables.
Outputs: ``A/ B/ label/ list/`` in the LEVIR-CD layout, and sharded Parquet tables ``metadata/``
(one row per slice), ``pairs/``, ``scenes/``, ``labels/`` and ``errors/``. A rerun into the same
output skips finished slices.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field

if __package__ in (None, ""):  # `python jobs/build_pairs.py` (e.g. under `ray job submit`)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from operators.pairs.catalogue import SCENES_SCHEMA, list_scene_inputs  # noqa: E402
from operators.pairs.band_scene_ops import (BAND_SCENES_SCHEMA, BandsConfig,  # noqa: E402
                                            catalogue_band_scenes, is_band_input,
                                            prepare_band_pairs)
from operators.pairs.cloud_masks import CloudConfig  # noqa: E402
from operators.io.cli import add_config_args, config_from_args, init_ray  # noqa: E402
from operators.pairs.labels import LABEL_FOLDERS, LABELS_SCHEMA  # noqa: E402
from operators.pairs.pairing import PAIRS_SCHEMA, PairingConfig, lonely_scenes, select_pairs  # noqa: E402
from operators.pairs.register_stage import METADATA_SCHEMA, registration_stage  # noqa: E402
from operators.pairs.registration import RegistrationConfig  # noqa: E402
from operators.pairs.slicing import slice_windows  # noqa: E402
from operators.pairs.splits import SPLITS, assign_splits, list_files, parse_fractions  # noqa: E402
from operators.io.storage import Store  # noqa: E402
from operators.io.tables import (ERRORS_SCHEMA, TableSink, error_record, new_run_id,  # noqa: E402
                              prune_shards, read_table, split_envelopes, write_table_shard)

log = logging.getLogger("changeforge.build_pairs")
JOB = "build_pairs"


@dataclass
class PairsJobConfig:
    input: str = field(default="", metadata={"required": True, "help": "scenes: a folder, an s3:// prefix, a manifest .csv/.parquet with uri, acquired[, location][, band], a STAC catalogue/collection root JSON, an items file (.json, .ndjson, stac-geoparquet), or a STAC API URL with --stac-search"})
    output: str = field(default="", metadata={"required": True, "help": "output folder or s3:// prefix"})
    slice_size: int = field(default=3000, metadata={"help": "slice side in pixels on the common grid (paper: 3000)"})
    stride: int = field(default=1024, metadata={"help": "step between slices in pixels (paper: 1024)"})
    rgb_bands: tuple[int, ...] = field(default=(), metadata={"help": "1-based bands written as RGB (default: 1,2,3, or 1 for single-band scenes)"})
    stretch_percentiles: tuple[int, ...] = field(default=(2, 98), metadata={"help": "per-scene percentiles mapped to 0 and 255 in the 8-bit conversion"})
    labels: str = field(default="", metadata={"help": "folder or s3:// prefix with label1/<slice_id>.png (new buildings) and label2/<slice_id>.png (demolished); merged by union into label/"})
    split_fractions: str = field(default="0.7,0.1,0.2", metadata={"help": "train,val,test fractions of locations (paper: 70/10/20)"})
    seed: int = field(default=0, metadata={"help": "seed of the location-to-split shuffle"})
    num_cpus: int | None = field(default=None, metadata={"help": "CPUs for a local Ray (ignored when RAY_ADDRESS points at a cluster; default: all)"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.build_pairs",
        description="Build S2Looking-style registered bitemporal pairs from a satellite archive. "
                    "S3 endpoints other than AWS come from AWS_ENDPOINT_URL; a cluster from RAY_ADDRESS.",
    )
    add_config_args(parser, PairsJobConfig, "job")
    add_config_args(parser, PairingConfig, "pair selection")
    add_config_args(parser, BandsConfig, "STAC and per-band products")  # issue 14
    add_config_args(parser, CloudConfig, "cloud masks")  # issue 14
    add_config_args(parser, RegistrationConfig, "registration and screening", skip=("method",))
    parser.add_argument("--registration", dest="method", default=RegistrationConfig.method,
                        choices=("regional", "per-slice"),
                        help="regional: features once per region, reused by overlapping slices; "
                             "per-slice: the paper's recipe, SIFT per slice (default: %(default)s)")
    return parser


def _json_rows(records):
    return [json.dumps(r) for r in records]


def run(job: PairsJobConfig, pairing: PairingConfig, reg: RegistrationConfig,
        bands: BandsConfig | None = None, cloud: CloudConfig | None = None) -> dict:
    """Run the whole job; returns a summary dict (also printed by :func:`main`)."""
    import ray.data
    bands, cloud = bands or BandsConfig(), cloud or CloudConfig()

    if not job.input or not job.output:
        raise SystemExit("--input and --output are required")
    t0 = time.time()
    out = Store(job.output)
    run_id = new_run_id()
    fractions = parse_fractions(job.split_fractions)
    if reg.crop_size > job.slice_size:
        raise SystemExit(f"--crop-size {reg.crop_size} is larger than --slice-size {job.slice_size}")

    # 1. Catalogue: header reads in parallel; small records come back to the driver.
    band_input = is_band_input(job.input, bands.stac_search)  # issue 14: stacked scenes
    if band_input:
        # No pixel read yet: stretches come after pairing, for the scenes accepted pairs use.
        scenes, errors = catalogue_band_scenes(job.input, bands, cloud, run_id)
        print(f"[build_pairs] run {run_id}: {len(scenes)} stacked scene(s) from {job.input}",
              flush=True)
        if not scenes and not errors:
            raise SystemExit(f"no STAC items or band rows found in {job.input}")
    else:
        inputs = list_scene_inputs(job.input)
        print(f"[build_pairs] run {run_id}: {len(inputs)} scene input(s) from {job.input}", flush=True)
        if not inputs:
            raise SystemExit(f"no scenes found under {job.input}")
        cat = ray.data.from_items([dataclasses.asdict(s) for s in inputs])
        env_rows = cat.flat_map(
            _catalogue_fn, fn_kwargs={"rgb_bands": list(job.rgb_bands) or None,
                                      "percentiles": tuple(job.stretch_percentiles), "run_id": run_id},
        ).take_all()
        tables = split_envelopes(env_rows)
        scenes, errors = tables.get("scenes", []), tables.get("errors", [])
        # scenes/ and pairs/ are recomputed by every run: the latest run's shards replace older ones.
        write_table_shard(out, "scenes", scenes, SCENES_SCHEMA, run_id)
        prune_shards(out, "scenes", keep_run_id=run_id)

    # 2. Pair selection (driver: one small record per scene).
    pairs = select_pairs(scenes, pairing)
    if band_input:  # issue 14: --max-cloud-cover, then stretches of the scenes still needed
        errors.extend(prepare_band_pairs(pairs, scenes, cloud, job.stretch_percentiles, run_id))
        write_table_shard(out, "scenes", scenes, BAND_SCENES_SCHEMA, run_id)
        prune_shards(out, "scenes", keep_run_id=run_id)
    for s in lonely_scenes(scenes):
        errors.append(error_record(s["uri"], "pairing", "no other scene of this location overlaps it; "
                                   "it cannot form a pair", error_type="NoPartner", job=JOB, run_id=run_id))
    by_id = {s["scene_id"]: s for s in scenes}
    splits = assign_splits({p["location"] for p in pairs}, fractions, job.seed)
    work = []
    for p in pairs:
        if p["status"] != "accepted":
            continue
        pre, post = by_id[p["pre_scene"]], by_id[p["post_scene"]]
        if not slice_windows(pre, post, job.slice_size, job.stride):
            p["status"] = "rejected"
            p["reason"] = f"footprint intersection is smaller than one {job.slice_size} px slice"
            continue
        work.append({"pair": json.dumps(p), "pre": json.dumps(pre), "post": json.dumps(post),
                     "split": splits[p["location"]]})
    write_table_shard(out, "pairs", pairs, PAIRS_SCHEMA, run_id)
    prune_shards(out, "pairs", keep_run_id=run_id)
    n_acc = sum(p["status"] == "accepted" for p in pairs)
    print(f"[build_pairs] {len(scenes)} scene(s) catalogued, {len(pairs)} candidate pair(s), "
          f"{n_acc} accepted; {len(errors)} error(s) so far", flush=True)

    # 3-5. Slices -> registration -> tables, skipping what an earlier run finished.
    finished = _finished_slices(out)
    counts: dict[str, int] = {}
    if work:
        slices = ray.data.from_items(work).flat_map(
            _cut_fn, fn_kwargs={"slice_size": job.slice_size, "stride": job.stride,
                                "skip": frozenset(finished)})
        results = registration_stage(slices, reg, out.uri(), run_id)
        sink = TableSink(out.uri(), {"metadata": METADATA_SCHEMA}, run_id)
        results.write_datasink(sink)
        counts = sink.counts

    # 6. Labels for accepted slices that do not have a merged map yet.
    meta = read_table(out, "metadata")
    accepted = []
    if meta is not None:
        m = meta.select(["slice_id", "split", "status"]).to_pylist()
        accepted = sorted({(r["slice_id"], r["split"]) for r in m if r["status"] == "accepted"})
    if job.labels:
        errors.extend(_merge_labels(job, reg, out, accepted, run_id, counts))

    # 7. Split lists from every accepted slice so far (idempotent).
    for split, names in list_files(accepted).items():
        out.write_bytes(f"list/{split}.txt", ("\n".join(names) + ("\n" if names else "")).encode())

    write_table_shard(out, "errors", errors, ERRORS_SCHEMA, run_id)
    prune_shards(out, "errors", keep_run_id=run_id)  # errors/ describes the latest run
    return _summary(out, run_id, counts, len(finished), time.time() - t0)


def _catalogue_fn(row, **kw):
    from operators.pairs.pairs_ops import catalogue_scene
    return catalogue_scene(row, **kw)


def _cut_fn(row, **kw):
    from operators.pairs.pairs_ops import cut_pair
    return cut_pair(row, **kw)


def _labels_fn(row, **kw):
    from operators.pairs.pairs_ops import merge_slice_labels
    return merge_slice_labels(row, **kw)


def _finished_slices(out: Store) -> set[str]:
    meta = read_table(out, "metadata")
    if meta is None:
        return set()
    return set(meta.column("slice_id").to_pylist())


def _merge_labels(job, reg, out: Store, accepted, run_id, counts) -> list[dict]:
    import ray.data

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
        sink = TableSink(out.uri(), {"labels": LABELS_SCHEMA}, run_id)
        ds.write_datasink(sink)
        for k, v in sink.counts.items():
            counts[k] = counts.get(k, 0) + v
    return errors


def _summary(out: Store, run_id: str, counts: dict, skipped: int, seconds: float) -> dict:
    meta = read_table(out, "metadata")
    errs = read_table(out, "errors")
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
        "errors_this_run": 0 if errs is None else errs.num_rows, "splits": lists,
    }


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
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
    print(f"[build_pairs] outputs: {summary['output']}/A, /B, /label, /list; tables: metadata/, "
          f"pairs/, scenes/, labels/, errors/ (Parquet)", flush=True)
    return summary


if __name__ == "__main__":
    main()
