"""Archive-scale planning benchmark: the pairs job's driver work on a synthetic archive (no pixels).

    python -m benchmarks.archive_scale            # 1k, 10k and 100k scenes (~1M slices at 100k)
    python -m benchmarks.archive_scale --quick    # 1k, 3k and 10k scenes

A synthetic archive plan: scene records as the catalogue returns them (footprints and dates only),
places tiled over three UTM zones with 5 % overlap between neighbouring places, three dates per
place with a few hundred metres of jitter, 10 km scenes at 2 m. Each size runs in a fresh process
so its peak memory (``ru_maxrss``) is the driver's for that archive alone. Stages, as the job runs
them on the driver:

- catalogue: build the scene records and write them to ``scenes/`` (one shard),
- grouping: lon/lat boxes and fixed-cell locations of every scene,
- pairs: candidate generation through the spatial index and the pair rule (``select_pairs``),
- plan: splits, slice windows of every accepted pair, slice rows in windows of whole pairs and the
  regional tile plan of each window (what is submitted to Ray, without submitting it).

Stage times are the driver process's CPU seconds (wall-clock seconds are printed too: on a shared
machine they measure the neighbours). Then the metadata read (wall-clock): a 100k-row ``metadata/`` table written as the job writes it (tasks'
rows folded into shards of ``--rows-per-shard``), read back as the current state with one
``read_table`` call. Prints a table and ends with the line

    scenes_100k_plan_s=<s> driver_peak_mb=<MB> growth_exponent=<slope of log time vs log scenes> metadata_read_100k_s=<s>

Targets: growth exponent at most 1.2; 100k scenes planned in under 60 s with under 2 GB.
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

SCENE_M, RES_M, STEP_M = 10_000.0, 2.0, 9_500.0
ZONES = ("EPSG:32614", "EPSG:32615", "EPSG:32616")


def synthetic_inputs(n_scenes: int, seed: int = 0) -> list[dict]:
    """Catalogue-like scene records: three dates per place, places tiled over three UTM zones
    (eastings 200-770 km, growing north), neighbouring places overlapping by 5 %."""
    rng = np.random.default_rng(seed)
    n_places = max(1, n_scenes // 3)
    per_zone = math.ceil(n_places / len(ZONES))
    side = min(60, math.ceil(math.sqrt(per_zone)))  # 570 km wide: every place inside its zone
    px = int(SCENE_M / RES_M)
    out = []
    for p in range(n_places):
        zone, k = divmod(p, per_zone)
        row, col = divmod(k, side)
        x0, y0 = 200_000.0 + col * STEP_M, 3_500_000.0 + row * STEP_M
        for d in range(3):
            if len(out) == n_scenes:
                break
            jx, jy = rng.uniform(-300, 300, 2)
            left, top = x0 + jx, y0 + jy + SCENE_M
            year = 2015 + 3 * d + int(rng.integers(0, 2))
            uri = f"s3://archive/z{zone}/p{p:06d}/{year}0{1 + d}15.tif"
            out.append({
                "scene_id": f"p{p:06d}-{year}-{d}", "uri": uri, "driver": "GTiff", "crs": ZONES[zone],
                "bounds": [left, top - SCENE_M, left + SCENE_M, top],
                "transform": [RES_M, 0.0, left, 0.0, -RES_M, top], "width": px, "height": px,
                "res": [RES_M, RES_M], "dtype": "uint16", "count": 4, "nodata": 0.0,
                "acquired": f"{year}-0{1 + d}-15", "date_source": "manifest", "location": None,
                "rgb_bands": [1, 2, 3], "stretch": [[100.0, 3000.0]] * 3,
            })
    return out


class _Clock:
    """Driver CPU seconds (all threads of this process) and wall seconds per lap. CPU time is the
    driver's own work whatever else loads the machine; on an idle machine the two agree."""

    def __init__(self):
        self.cpu, self.wall = time.process_time(), time.perf_counter()

    def lap(self) -> tuple[float, float]:
        cpu, wall = time.process_time(), time.perf_counter()
        out = (cpu - self.cpu, wall - self.wall)
        self.cpu, self.wall = cpu, wall
        return out


def measure(n_scenes: int, slice_size: int, stride: int, window_slices: int) -> dict:
    """Every driver stage on one archive size (run in its own process)."""
    from jobs.build_pairs import table_schemas
    from operators.io.storage import Store
    from operators.io.tables import write_table_shard
    from operators.pairs.selection.pairing import PairingConfig, lonlat_boxes, scene_locations, select_pairs
    from operators.pairs.regional.regional_ops import pair_windows, plan_tiles
    from operators.pairs.registration.registration import RegistrationConfig
    from operators.pairs.selection.slicing import slice_rows, slice_windows
    from operators.pairs.selection.splits import assign_splits

    pairing = PairingConfig(reference_date="2026-01-01")
    reg = RegistrationConfig()
    times, walls = {}, {}
    clock = _Clock()
    with tempfile.TemporaryDirectory() as tmp:
        scenes = synthetic_inputs(n_scenes)
        write_table_shard(Store(tmp), "scenes", scenes, table_schemas()["scenes"], "bench")
        times["catalogue"], walls["catalogue"] = clock.lap()

    locations = scene_locations(scenes, pairing.location_cell_deg, lonlat_boxes(scenes))
    times["grouping"], walls["grouping"] = clock.lap()

    pairs = select_pairs(scenes, pairing)
    times["pairs"], walls["pairs"] = clock.lap()

    by_id = {s["scene_id"]: s for s in scenes}
    accepted = [p for p in pairs if p["status"] == "accepted"]
    splits = assign_splits({p["location"] for p in accepted}, (0.7, 0.1, 0.2), 0)
    work = [(p, by_id[p["pre_scene"]], by_id[p["post_scene"]]) for p in accepted
            if slice_windows(by_id[p["pre_scene"]], by_id[p["post_scene"]], slice_size, stride)]

    def rows():
        for p, pre, post in work:
            yield from slice_rows(p, pre, post, slice_size, stride, splits[p["location"]])

    n_slices = n_tiles = n_windows = 0
    for window in pair_windows(rows(), window_slices):
        n_slices += len(window)
        n_tiles += len(plan_tiles(window, reg))
        n_windows += 1
    times["plan"], walls["plan"] = clock.lap()
    return {"scenes": n_scenes, "locations": len(set(locations)), "pairs": len(pairs),
            "accepted": len(accepted), "slices": n_slices, "tiles": n_tiles, "windows": n_windows,
            **{f"{k}_s": round(v, 3) for k, v in times.items()},
            "total_s": round(sum(times.values()), 3), "wall_s": round(sum(walls.values()), 3),
            "peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def metadata_read(n_rows: int, rows_per_shard: int) -> dict:
    """Write ``n_rows`` metadata rows the way the job does, then time the current-state read."""
    from jobs.build_pairs import table_schemas
    from operators.io.storage import Store
    from operators.io.tables import StreamingTableWriter, envelope, read_table

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(tmp)
        writer = StreamingTableWriter(store, {"metadata": table_schemas()["metadata"]}, "bench",
                                      rows_per_shard=rows_per_shard, flush_s=1e9,
                                      constants={"reference_date": "2026-01-01"})
        for i in range(n_rows):
            accepted = rng.random() < 0.6
            writer.add([envelope("metadata", {
                "slice_id": f"20160115_20220115_{i // 9:08x}_r{(i % 3) * 1024:05d}_c{(i // 3 % 3) * 1024:05d}",
                "pair_id": f"20160115_20220115_{i // 9:08x}", "location": f"cell0.1-N{i // 900:07.4f}-W099.0000",
                "split": ("train", "val", "test")[i % 3], "pre_scene": "a", "post_scene": "b",
                "pre_date": "2016-01-15", "post_date": "2022-01-15", "crs": "EPSG:32614",
                "bounds": [1.0, 2.0, 3.0, 4.0], "window": [1, 2, 1024, 1024],
                "slice_window": [0, 0, 3000, 3000], "homography": [1.0, 0, 0, 0, 1, 0, 0, 0, 1],
                "n_matches": 900, "n_inliers": 700, "residual_px": 0.4, "residual_median_px": 0.2,
                "screen_windows": 30, "status": "accepted" if accepted else "rejected",
                "reject_reason": None if accepted else "too few inliers (12 < 30)",
                "image_a": f"A/{i}.png", "image_b": f"B/{i}.png", "method": "regional",
                "seconds": 1.5, "cpu_seconds": 1.4, "run_id": "bench"})])
        writer.flush()
        shards = len(store.list("metadata"))
        t = time.perf_counter()
        table = read_table(store, "metadata")
        full = time.perf_counter() - t
        t = time.perf_counter()
        read_table(store, "metadata", columns=["slice_id", "split", "status"])
        cols = time.perf_counter() - t
    assert table.num_rows == n_rows
    return {"rows": n_rows, "shards": shards, "read_s": round(full, 3), "read_cols_s": round(cols, 3)}


def _child(args) -> None:
    if args.child == "metadata":
        print(json.dumps(metadata_read(args.rows, args.rows_per_shard)))
    else:
        print(json.dumps(measure(int(args.child), args.slice_size, args.stride, args.window_slices)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1k, 3k, 10k scenes and a 20k-row table")
    ap.add_argument("--sizes", default="", help="comma-separated scene counts (default 1000,10000,100000)")
    ap.add_argument("--slice-size", type=int, default=3000)
    ap.add_argument("--stride", type=int, default=1024)
    ap.add_argument("--window-slices", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=100_000, help="metadata rows to read back")
    ap.add_argument("--rows-per-shard", type=int, default=2000)
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)
    sizes = [int(v) for v in args.sizes.split(",")] if args.sizes else (
        [1000, 3000, 10000] if args.quick else [1000, 10000, 100000])
    rows = 20_000 if args.quick and args.rows == 100_000 else args.rows
    common = ["--slice-size", str(args.slice_size), "--stride", str(args.stride),
              "--window-slices", str(args.window_slices), "--rows", str(rows),
              "--rows-per-shard", str(args.rows_per_shard)]

    def child(what: str) -> dict:
        res = subprocess.run([sys.executable, "-m", "benchmarks.archive_scale", "--child", what, *common],
                             capture_output=True, text=True, check=True)
        return json.loads(res.stdout.strip().splitlines()[-1])

    results = []
    cols = ["scenes", "locations", "pairs", "slices", "tiles", "windows", "catalogue_s", "grouping_s",
            "pairs_s", "plan_s", "total_s", "wall_s", "peak_mb"]
    print(" | ".join(f"{c:>10}" for c in cols), flush=True)
    for n in sizes:
        r = child(str(n))
        results.append(r)
        print(" | ".join(f"{r[c]:>10}" for c in cols), flush=True)
    x = np.log([r["scenes"] for r in results])
    y = np.log([max(r["total_s"], 1e-6) for r in results])
    slope = float(np.polyfit(x, y, 1)[0]) if len(results) > 1 else float("nan")
    meta = child("metadata")
    print("(stage columns and total_s: driver CPU seconds; wall_s: wall-clock seconds, inflated "
          "by whatever else runs on the machine)")
    print(f"metadata/: {meta['rows']} rows in {meta['shards']} shards; current state read in "
          f"{meta['read_s']} s (all columns), {meta['read_cols_s']} s (slice_id, split, status)")
    last = results[-1]
    print(f"scenes_{last['scenes'] // 1000}k_plan_s={last['total_s']:.1f} driver_peak_mb={last['peak_mb']:.0f} "
          f"growth_exponent={slope:.2f} metadata_read_{meta['rows'] // 1000}k_s={meta['read_s']:.2f}")


if __name__ == "__main__":
    main()
