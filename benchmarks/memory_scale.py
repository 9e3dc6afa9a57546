"""Driver memory and object-store use while the input grows 1x, 3x, 10x.

Two jobs, each run as a user runs it (``python -m jobs.<name>`` in its own process, connected to one
local Ray that this benchmark starts with ``--num-cpus`` CPUs), three input sizes each:

- the pairs job (regional registration) on ``n`` locations, each a scene pair built by tiling the
  repository's real imagery (``benchmarks/_scenes.py``: a 3 x 3 mosaic of NAIP, Sentinel-2 and
  Landsat cells, the later date warped), placed ``--location-km`` apart so every copy is its own
  location; small geometry (``--scene-px`` scenes, 512 px slices at stride 256, 256 px crops, 512 px
  tiles) and a graph window of one 1x input (``--window-slices``), so the 3x and 10x runs go
  through several windows as an archive run does;
- the captions job on the 12 LEVIR-CD samples repeated under new names (``benchmarks/_levir_repeat.py``)
  against the OpenAI-compatible test server (test equipment; no faults, no rate limit);
- the QA job (``--jobs captions,qa``) on the captions job's output of the same size.

While a job runs, every ``--every-s`` seconds: the resident set of the job's driver process (that
process only: not its Ray workers) and the object store's bytes in use
(``object_store_bytes_used`` of the GCS memory-info reply; ``ray.available_resources()`` does not
move with use in Ray 2.60). Reports each run's peaks, prints a table and ends with one line:
``pairs_rss_growth=<peak 10x / peak 1x> pairs_store_growth=.. captions_rss_growth=.. captions_store_growth=..``
(and for the language jobs ``<job>_end_of_run_worker_rss_growth``: their end of run runs in a worker
process of its own, whose peak RSS they log; and ``<job>_llm_actors_rss_growth``: the LLM pool's
actors prepare each pair's images and hold them while its requests are in flight, so their summed
RSS is where a pair's images are)
(target: at most 1.2 each; object-store peaks under 1 MB count as 1 MB, since a ratio of a few
kilobytes of Ray's own objects is noise). Ray is started as the jobs start it: freed objects deleted
every 100 ms (``--free-period-ms 1000`` for Ray's own default, under which a second of freed blocks
doubles the captions job's store use).

    python -m benchmarks.memory_scale                 # 1x = 4 scene pairs (36 slices) and 200 caption pairs
    python -m benchmarks.memory_scale --pairs-unit 2 --captions-unit 60 --jobs pairs,captions   # quick
    python -m benchmarks.memory_scale --jobs captions --captions-px 1024 --captions-unit 100   # full-size images
"""
from __future__ import annotations

import os
import sys

if not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from operators.io.cli import RAY_SYSTEM_CONFIG
from operators.llm.stage import LLMStageActor

REPO = Path(__file__).resolve().parent.parent
FACTORS = (1, 3, 10)
STORE_FLOOR = 2**20   # object-store peaks under 1 MB count as 1 MB in the growth ratio


# -- inputs ------------------------------------------------------------------------------------------------
def build_pairs_input(dest: Path, base: Path, n_locations: int, scene_px: int, location_km: float) -> None:
    """``n_locations`` copies of one tiled real-imagery scene pair, each moved to its own place
    (transform shifted; names carry the dates: 2017-06-01 and 2020-06-01)."""
    import rasterio
    from affine import Affine

    from benchmarks._scenes import write_pair
    pre, post, _ = write_pair(base, scene_px)
    dest.mkdir(parents=True, exist_ok=True)
    per_row = 20
    for k in range(n_locations):
        dx, dy = (k % per_row) * location_km * 1000, (k // per_row) * location_km * 1000
        for src, date in ((pre, "2017-06-01"), (post, "2020-06-01")):
            path = dest / f"loc{k:03d}_{date}.tif"
            shutil.copyfile(src, path)
            with rasterio.open(path, "r+") as ds:
                t = ds.transform
                ds.transform = Affine(t.a, t.b, t.c + dx, t.d, t.e, t.f - dy)


# -- sampling ------------------------------------------------------------------------------------------------
ACTOR_TITLE = f"MapBatches({LLMStageActor.__name__})"   # in the process title Ray gives the LLM pool's actors


class Sampler(threading.Thread):
    """Peak RSS of one process, peak object-store bytes in use and the peak summed RSS of the LLM
    pool's actors (where the language jobs hold a pair's images while its requests are in flight),
    sampled until stopped."""

    def __init__(self, pid: int, gcs_address: str, every_s: float):
        super().__init__(daemon=True)
        import psutil
        self.proc = psutil.Process(pid)
        self.gcs_address, self.every_s = gcs_address, every_s
        self.peak_rss = self.peak_store = self.peak_actors = 0
        self.actors: list = []
        self.actors_found_at = 0.0
        self.samples = 0
        self.store_samples: list[int] = []
        self.trace: list[tuple[float, int, int]] = []   # (seconds since start, driver RSS, store bytes)
        self.stop = threading.Event()

    def store_used(self) -> int:
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address
        return int(get_memory_info_reply(get_state_from_address(self.gcs_address)).store_stats.object_store_bytes_used)

    def actors_rss(self) -> int:
        import psutil
        if time.time() - self.actors_found_at > 2:   # a full process scan every 2 s, not every sample
            self.actors_found_at = time.time()
            self.actors = [p for p in psutil.process_iter(["cmdline"])
                           if ACTOR_TITLE in " ".join(p.info["cmdline"] or [])]
        total = 0
        for p in self.actors:
            try:
                total += p.memory_info().rss
            except Exception:  # noqa: BLE001 - an actor that has exited
                pass
        return total

    def run(self) -> None:
        t0 = time.time()
        while not self.stop.is_set():
            try:
                self.peak_actors = max(self.peak_actors, self.actors_rss())
            except Exception:  # noqa: BLE001 - a missed sample, not a wrong one
                pass
            rss = used = -1
            try:
                rss = self.proc.memory_info().rss
                self.peak_rss = max(self.peak_rss, rss)
            except Exception:  # noqa: BLE001 - the process has ended
                pass
            try:
                used = self.store_used()
                self.peak_store = max(self.peak_store, used)
                self.store_samples.append(used)
            except Exception:  # noqa: BLE001 - a missed sample, not a wrong one
                pass
            self.trace.append((time.time() - t0, rss, used))
            self.samples += 1
            self.stop.wait(self.every_s)


def run_sampled(name: str, cmd: list[str], env: dict, gcs_address: str, every_s: float, log_path: Path) -> dict:
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = Sampler(proc.pid, gcs_address, every_s)
        sampler.start()
        last = time.time()
        while proc.poll() is None:
            time.sleep(0.5)
            if time.time() - last >= 30:
                last = time.time()
                print(f"  [{name}] {time.time() - t0:.0f} s, driver peak {sampler.peak_rss / 2**20:.0f} MB, "
                      f"store peak {sampler.peak_store / 2**20:.1f} MB", flush=True)
        sampler.stop.set()
        sampler.join()
    # The samples over time, to see when a peak came (start, steady state, end of run).
    with open(log_path.with_suffix(".samples.csv"), "w") as f:
        f.write("seconds,driver_rss_bytes,store_bytes\n")
        f.writelines(f"{t:.2f},{rss},{used}\n" for t, rss, used in sampler.trace)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}); see {log_path}")
    ordered = sorted(sampler.store_samples) or [0]
    # The language jobs assemble their end of run in a worker process and log its peak RSS.
    assembly = re.findall(r"end of run assembled in a worker \(peak RSS (\d+) MB\)", log_path.read_text())
    return {"wall": time.time() - t0, "rss": sampler.peak_rss, "store": sampler.peak_store,
            "actors": sampler.peak_actors,
            "store_p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
            "samples": sampler.samples, "assembly_mb": float(assembly[-1]) if assembly else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", default="pairs,captions")
    ap.add_argument("--pairs-unit", type=int, default=4, help="scene pairs (locations) of the 1x pairs input")
    ap.add_argument("--scene-px", type=int, default=1024)
    ap.add_argument("--location-km", type=float, default=30.0)
    ap.add_argument("--window-slices", type=int, default=36, help="the pairs job's --window-slices")
    ap.add_argument("--captions-unit", type=int, default=200, help="pairs of the 1x captions input")
    ap.add_argument("--captions-px", type=int, choices=(256, 1024), default=256,
                    help="size of the captions input's images: the 256 px samples, or 1024 px (a full LEVIR-CD "
                         "image's size) as 4 x 4 mosaics of them")
    ap.add_argument("--max-store-mb", type=float, default=256.0, help="the captions job's --max-store-mb")
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--every-s", type=float, default=0.25)
    ap.add_argument("--free-period-ms", type=int, default=RAY_SYSTEM_CONFIG["free_objects_period_milliseconds"],
                    help="Ray's free_objects_period_milliseconds (the jobs start Ray with 100; Ray's own default is 1000)")
    ap.add_argument("--keep", default="", help="keep inputs, outputs, job logs and the sampled series "
                    "(<job>_<f>x.samples.csv) in this folder")
    args = ap.parse_args(argv)
    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]

    import ray
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="memory_scale_"))
    # Started as the jobs start a local Ray (operators/io/cli.py), with --free-period-ms to compare.
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=False,
             _system_config={**RAY_SYSTEM_CONFIG, "free_objects_period_milliseconds": args.free_period_ms})
    gcs = ray.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items()}
    env.update(RAY_ADDRESS=gcs, PYTHONPATH=str(REPO), OPENAI_API_KEY="sk-bench-not-a-key")
    results: dict[tuple[str, int], dict] = {}
    server = None
    try:
        if "captions" in jobs or "qa" in jobs:
            from tests.openai_test_server import ServerProcess  # test equipment, in its own process
            server = ServerProcess(latency_ms=50)
            # The language jobs' shared settings: the test server, no rate limit.
            llm_args = ["--model", "bench-model", "--base-url", server.base_url, "--rpm", "0", "--tpm", "0",
                        "--progress-every-s", "30", "--max-store-mb", str(args.max_store_mb)]
        for job in jobs:
            for f in FACTORS:
                inp, out = tmp / f"{job}_{f}x_input", tmp / f"{job}_{f}x_out"
                shutil.rmtree(out, ignore_errors=True)
                if job == "pairs":
                    n = args.pairs_unit * f
                    build_pairs_input(inp, tmp / "scene", n, args.scene_px, args.location_km)
                    cmd = [sys.executable, "-m", "jobs.build_pairs", "--input", str(inp), "--output", str(out),
                           "--slice-size", "512", "--stride", "256", "--crop-size", "256", "--tile-size", "512",
                           "--reference-date", "2021-01-01", "--window-slices", str(args.window_slices),
                           "--rows-per-shard", "100"]
                    size = f"{n} scene pairs"
                elif job == "qa":
                    # The QA job's input is the captions job's output at the same size.
                    src = tmp / f"captions_{f}x_out"
                    if not src.exists():
                        raise SystemExit("--jobs qa needs the captions runs first (--jobs captions,qa)")
                    n = args.captions_unit * f
                    cmd = [sys.executable, "-m", "jobs.qa", "--input", str(src), "--output", str(out), *llm_args]
                    size = f"{n} captioned pairs"
                else:
                    from benchmarks._levir_repeat import LEVIR, build_levir_mosaics, build_repeated_levir
                    n = args.captions_unit * f
                    if not inp.exists():
                        source = LEVIR if args.captions_px == 256 else tmp / "levir_1024"
                        if args.captions_px == 1024 and not source.exists():
                            build_levir_mosaics(source)
                        build_repeated_levir(inp, n, source=source)
                    cmd = [sys.executable, "-m", "jobs.caption", "--input", str(inp), "--output", str(out), *llm_args]
                    size = f"{n} pairs" + ("" if args.captions_px == 256 else f" of {args.captions_px} px")
                print(f"{job} {f}x ({size}) ...", flush=True)
                r = run_sampled(f"{job} {f}x", cmd, env, gcs, args.every_s, tmp / f"{job}_{f}x.log")
                r["size"] = size
                r["rows"] = _output_rows(job, out)
                results[(job, f)] = r
                print(f"  done in {r['wall']:.1f} s: driver peak {r['rss'] / 2**20:.0f} MB, "
                      f"store peak {r['store'] / 2**20:.1f} MB, {r['rows']}", flush=True)
    finally:
        if server is not None:
            server.close()
        ray.shutdown()

    print()
    print("| job | input | output rows | wall s | driver peak RSS MB | object store peak MB | store p95 MB | samples "
          "| end-of-run worker peak RSS MB | LLM actors peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (job, f), r in results.items():
        assembly = "-" if r["assembly_mb"] is None else f"{r['assembly_mb']:.0f}"
        actors = f"{r['actors'] / 2**20:.0f}" if r["actors"] else "-"
        print(f"| {job} {f}x | {r['size']} | {r['rows']} | {r['wall']:.1f} | {r['rss'] / 2**20:.0f} | "
              f"{r['store'] / 2**20:.2f} | {r['store_p95'] / 2**20:.2f} | {r['samples']} | {assembly} | {actors} |")
    parts = []
    for job in jobs:
        lo, hi = results[(job, FACTORS[0])], results[(job, FACTORS[-1])]
        parts.append(f"{job}_rss_growth={hi['rss'] / max(lo['rss'], 1):.2f}")
        if lo["assembly_mb"] and hi["assembly_mb"]:   # not the driver's, but reported: it grows with the input
            parts.append(f"{job}_end_of_run_worker_rss_growth={hi['assembly_mb'] / lo['assembly_mb']:.2f}")
        if lo["actors"] and hi["actors"]:   # workers, not the driver: bounded by the pool's settings
            parts.append(f"{job}_llm_actors_rss_growth={hi['actors'] / lo['actors']:.2f}")
        # Under 1 MB the store holds only Ray's own small objects: below that a ratio is noise.
        parts.append(f"{job}_store_growth={max(hi['store'], STORE_FLOOR) / max(lo['store'], STORE_FLOOR):.2f}")
        # The peak of a noisy but steady level grows with the run's length; the 95th percentile of the
        # samples does not, so it tells accumulation from a longer run's rarer highs.
        parts.append(f"{job}_store_p95_growth="
                     f"{max(hi['store_p95'], STORE_FLOOR) / max(lo['store_p95'], STORE_FLOOR):.2f}")
    print(" ".join(parts))
    return 0


def _output_rows(job: str, out: Path) -> str:
    from operators.io.storage import Store
    from operators.io.tables import read_table
    store = Store(str(out))
    tables = {"pairs": ("metadata", "errors"), "qa": ("pairs", "qa", "errors")}.get(job, ("pairs", "captions", "errors"))
    counts = []
    for name in tables:
        t = read_table(store, name)
        counts.append(f"{name} {0 if t is None else t.num_rows}")
    return ", ".join(counts)


if __name__ == "__main__":
    sys.exit(main())
