"""Registration benchmark: the per-slice recipe vs the regional method on one large scene pair.

    python -m benchmarks.registration            # paper geometry: 6144 px scene, 3000/1024/1024
    python -m benchmarks.registration --quick    # 2560 px scene, 1536/512/512 (paper ratios at half scale), under two minutes

Builds a real-imagery scene pair with a known, spatially varying warp and radiometric change
(``benchmarks/_scenes.py``), cuts slices, and registers the same slices with both methods through
the Ray Data stage the pairs job uses. Reports seconds, slices per core-second, median and max
corner error of the kept crops against the known warp, accepted counts; then the regional method
with 1 and 2 CPUs given to Ray, and Ray Data's overhead against the same work in a plain loop
(one process, one OpenCV thread, same functions). Ends with the line

    speedup=<regional vs per-slice throughput> median_corner_error_px=<regional> per_slice_median_corner_error_px=<per-slice>
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import replace

import numpy as np

from benchmarks._scenes import KnownWarp, write_pair
from operators.pairs.imagery.radiometry import scene_stretch
from operators.pairs.regional.regional_ops import (TILE_RUNS_DIR, plan_tiles, register_slice_regional,
                                                   tile_passes_in_process)
from operators.pairs.stage.register_stage import registration_stage
from operators.pairs.registration.registration import (RegistrationConfig, apply_homography, crop_corners,
                                                       crop_offset)
from operators.io.storage import Store
from operators.io.tables import split_envelopes


def slice_rows(pre: str, post: str, size: int, slice_size: int, stride: int) -> list[dict]:
    import rasterio
    with rasterio.open(pre) as src:
        crs, transform = src.crs.to_wkt(), list(src.transform)[:6]
    stretch_pre, stretch_post = scene_stretch(pre, [1]), scene_stretch(post, [1])
    starts = list(range(0, size - slice_size + 1, stride))
    return [{
        "slice_id": f"bench_r{r:05d}_c{c:05d}", "pair_id": "bench", "location": "bench",
        "split": "test", "pre_uri": pre, "post_uri": post, "pre_scene": "pre", "post_scene": "post",
        "pre_date": "2020-01-01", "post_date": "2022-01-01", "crs": crs, "transform": transform,
        "window": [c, r, slice_size, slice_size], "bands_pre": [1], "bands_post": [1],
        "stretch_pre": stretch_pre, "stretch_post": stretch_post,
    } for r in starts for c in starts]


def corner_errors(rec: dict, warp: KnownWarp, crop: int) -> np.ndarray:
    """Kept-crop corners: |F(H^-1(c) + o) - (c + o)| in px, F the known post -> pre warp."""
    H = np.asarray(rec["homography"], np.float64).reshape(3, 3)
    col, row, size, _ = rec["slice_window"]
    c = crop_corners(crop_offset(size, crop), crop)
    q = apply_homography(np.linalg.inv(H), c) + (col, row)
    fx, fy = warp(q[:, 0], q[:, 1])
    return np.hypot(fx - (c[:, 0] + col), fy - (c[:, 1] + row))


def summarize(name: str, records: list[dict], errors: list[dict], seconds: float, cpus: int,
              warp: KnownWarp, crop: int, load: float = float("nan"), tile_cpu: float = 0.0) -> dict:
    accepted = [r for r in records if r["status"] == "accepted"]
    errs = np.concatenate([corner_errors(r, warp, crop) for r in accepted]) if accepted else \
        np.array([np.nan])
    n = len(records) + len(errors)
    return {"method": name, "slices": n, "accepted": len(accepted), "errors": len(errors),
            "cpus": cpus, "seconds": seconds, "per_core_s": n / (seconds * cpus),
            "median_err": float(np.median(errs)), "max_err": float(np.max(errs)),
            "cpu_s": tile_cpu + sum(r.get("cpu_seconds") or 0.0 for r in records),
            "load": load, "reasons": sorted({r["reject_reason"] for r in records if r["reject_reason"]})}


def tile_cpu_seconds(results) -> float:
    return sum(r.get("cpu_seconds") or 0.0 for r in results)


def run_stage(rows: list[dict], cfg: RegistrationConfig, out_root: str):
    """The job's stage, timed; returns (seconds, metadata, errors, CPU seconds of tile passes)."""
    import ray.data
    shutil.rmtree(out_root, ignore_errors=True)
    t0 = time.perf_counter()
    ds = registration_stage(ray.data.from_items(rows), cfg, out_root, run_id="bench")
    tables = split_envelopes(ds.take_all())
    seconds = time.perf_counter() - t0
    tile_cpu = 0.0
    store = Store(out_root)
    if store.exists(f"{TILE_RUNS_DIR}/bench.json"):
        runs = json.loads(store.read_bytes(f"{TILE_RUNS_DIR}/bench.json"))
        tile_cpu = sum(tile_cpu_seconds(runs.get(k) or [])
                       for k in ("features", "matches", "priors", "guided"))
    return seconds, tables.get("metadata", []), tables.get("errors", []), tile_cpu


def run_plain_loop(rows: list[dict], cfg: RegistrationConfig, out_root: str):
    """The regional method's exact work, serially in this process (no Ray)."""
    shutil.rmtree(out_root, ignore_errors=True)
    t0 = time.perf_counter()
    passes = tile_passes_in_process(plan_tiles(rows, cfg), cfg, out_root)
    tables = split_envelopes(register_slice_regional(r, cfg, out_root) for r in rows)
    return (time.perf_counter() - t0, tables.get("metadata", []), tables.get("errors", []),
            sum(tile_cpu_seconds(results) for results in passes.values()))


def measured(name: str, run, rows, cfg, out_root, cpus: int, warp: KnownWarp, crop: int) -> dict:
    """Run and summarise; the 1-minute load average after the run shows foreign CPU load
    (on a shared machine a load above the CPUs in use means the timing is contended)."""
    secs, recs, errs, tile_cpu = run(rows, cfg, out_root)
    return summarize(name, recs, errs, secs, cpus, warp, crop, os.getloadavg()[0], tile_cpu)


def start_ray(cpus: int):
    import ray
    import ray.data
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    # Warm the workers (imports of OpenCV, rasterio, the operators) outside the timed runs: a
    # plain loop pays those once at process start too, and a long-running cluster has them.
    ray.data.range(4 * cpus, override_num_blocks=4 * cpus).map(_warm, num_cpus=1).take_all()


def _warm(row):
    import operators.pairs.stage.register_stage  # noqa: F401
    time.sleep(0.2)
    return row


def print_table(rows: list[dict]) -> None:
    head = f"{'method':<22}{'cpus':>5}{'slices':>7}{'accepted':>9}{'errors':>7}{'seconds':>9}" \
           f"{'slices/core-s':>14}{'task_cpu_s':>11}{'median_err_px':>14}{'max_err_px':>11}" \
           f"{'load1':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['method']:<22}{r['cpus']:>5}{r['slices']:>7}{r['accepted']:>9}{r['errors']:>7}"
              f"{r['seconds']:>9.1f}{r['per_core_s']:>14.4f}{r['cpu_s']:>11.1f}{r['median_err']:>14.3f}"
              f"{r['max_err']:>11.3f}{r['load']:>7.1f}")
    for r in rows:
        if r["reasons"]:
            print(f"  {r['method']} reject reasons: {r['reasons'][:5]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2560 px scene, 1536/512/512 (paper ratios at half scale) geometry")
    p.add_argument("--size", type=int, default=6144, help="scene side in px (>= 6000 for the paper's geometry)")
    p.add_argument("--slice-size", type=int, default=3000)
    p.add_argument("--stride", type=int, default=1024)
    p.add_argument("--crop-size", type=int, default=1024)
    p.add_argument("--workdir", default=None, help="where scenes and outputs go (default: temp)")
    p.add_argument("--no-scaling", action="store_true", help="skip the 1-CPU and plain-loop runs")
    p.add_argument("--no-per-slice", action="store_true",
                   help="skip the per-slice reference (no speedup line; for tuning runs)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a RegistrationConfig field for both methods (repeatable)")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.slice_size, args.stride, args.crop_size = 2560, 1536, 512, 512

    overrides = {}
    for item in args.set:
        key, value = item.split("=", 1)
        kind = type(getattr(RegistrationConfig(), key))
        overrides[key] = kind(value)
    base = RegistrationConfig(crop_size=args.crop_size, **overrides)
    if args.quick:
        base = replace(base, tile_size=min(base.tile_size, 512))
    per_slice = replace(base, method="per-slice")
    regional = replace(base, method="regional")

    work = args.workdir or tempfile.mkdtemp(prefix="regbench-")
    os.makedirs(work, exist_ok=True)
    t0 = time.perf_counter()
    pre, post, warp = write_pair(os.path.join(work, "scenes"), args.size)
    rows = slice_rows(pre, post, args.size, args.slice_size, args.stride)
    print(f"load average before: {os.getloadavg()[0]:.1f} (2 CPUs; foreign load skews timings)")
    print(f"scene {args.size}x{args.size} uint16 (real imagery mosaic, known warp) in "
          f"{time.perf_counter() - t0:.1f}s; {len(rows)} slices of {args.slice_size} at stride "
          f"{args.stride}, crop {args.crop_size}; work dir {work}")
    print("config:", {k: v for k, v in regional.flat().items() if k != "method"})

    results = []
    start_ray(2)
    if not args.no_per_slice:
        results.append(measured("per-slice (ray)", run_stage, rows, per_slice,
                                os.path.join(work, "out-per-slice"), 2, warp, args.crop_size))
    results.append(measured("regional (ray)", run_stage, rows, regional,
                            os.path.join(work, "out-regional"), 2, warp, args.crop_size))
    if not args.no_scaling:
        start_ray(1)
        results.append(measured("regional (ray, 1 cpu)", run_stage, rows, regional,
                                os.path.join(work, "out-regional-1cpu"), 1, warp, args.crop_size))
        import ray
        ray.shutdown()
        results.append(measured("regional (plain loop)", run_plain_loop, rows, regional,
                                os.path.join(work, "out-plain"), 1, warp, args.crop_size))
    print()
    print_table(results)
    by = {r["method"]: r for r in results}
    rg = by["regional (ray)"]
    if not args.no_scaling:
        one, plain = by["regional (ray, 1 cpu)"], by["regional (plain loop)"]
        print(f"\nscaling: 2 CPUs give {one['seconds'] / rg['seconds']:.2f}x the throughput of 1 CPU")
        print(f"ray data overhead vs plain loop (1 CPU each): "
              f"{(one['seconds'] / plain['seconds'] - 1) * 100:+.1f}%")
    if "per-slice (ray)" in by:
        ps = by["per-slice (ray)"]
        speedup = rg["per_core_s"] / ps["per_core_s"]
        # Contention-proof cross-check: CPU seconds the tasks themselves used, whatever else ran.
        print(f"cpu-time ratio per-slice/regional: {ps['cpu_s'] / rg['cpu_s']:.2f}x")
        print(f"speedup={speedup:.2f} median_corner_error_px={rg['median_err']:.3f} "
              f"per_slice_median_corner_error_px={ps['median_err']:.3f}")

if __name__ == "__main__":
    main()
