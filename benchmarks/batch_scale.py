"""The Batch API driver at the papers' scale: its peak RSS while it submits and waits for N generation
lines of 1024 px pairs, against the OpenAI-compatible test server (test equipment).

The lines are the captions job's own: the LEVIR-CD sample pairs upscaled to 1024 px, prepared and built
by the job's code (``prepare_pair``, ``build_generate_request``, PNG, detail high) and deferred by the
LLM caller into the job's batch state (``<out>/_batch/caption/lines/``), one line per pair (pair ``i``
is sample ``i mod 11`` under a key of its own: the lines have the real size and shape; their images
repeat). Then, in a process of its own, the driver submits every line (``BatchDriver.submit``) and waits
for the batches (``wait``); that process's peak RSS is printed, with the lines and files submitted and
how often each line arrived at the server (``batch_submissions``: 1 each, or a line was paid twice).
The server keeps only each data URL's first 200 characters (``batch_strip_images``: its memory, not the
driver's, would otherwise be the limit of this machine).

``--driver old`` runs the driver of ``git show <rev>:operators/llm/batch.py`` (read-only) on the same
lines, for the comparison (it reads and encodes every line before splitting them into files).

    python benchmarks/batch_scale.py --pairs 2000
    python benchmarks/batch_scale.py --pairs 200 --driver old --rev HEAD

Ends with one line: ``batch_scale pairs=.. lines=.. files=.. driver_peak_rss_mb=.. submitted_twice=..
completed=.. seconds=..``.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import resource
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEY = "sk-benchmark-0000000000"


def write_lines(server_url: str, out: str, n: int, work: Path) -> int:
    """Defer ``n`` generation lines through the caller into ``out``'s batch state; returns their mean size."""
    from benchmarks.llm_cost import _records, prompts_for, upscaled_dataset
    from operators.language.caption_ops import PrepareConfig, build_generate_request, find_dataset_pairs, prepare_pair
    from operators.llm.batch import BatchState
    from operators.llm.client import LLMCaller, LLMConfig, Secret
    from operators.llm.job_options import LLMJobConfig
    root = upscaled_dataset(11, 1024, work / "pairs")
    pairs, _ = find_dataset_pairs(root, None, "train")
    prep = PrepareConfig(max_image_side=1024, image_format="png", detail="high")
    records = []
    for p in pairs:
        records += _records(prepare_pair(p, prep), "_generate")
    prompts = prompts_for("caption", "batch")
    state = BatchState(out, "caption", "bench")
    caller = LLMCaller(LLMConfig(model="gpt-4o", base_url=server_url, use_cache=False,
                                 response_format=LLMJobConfig.response_format), Secret(KEY), batch=state)

    async def go():
        for start in range(0, n, 32):
            batch = []
            for i in range(start, min(n, start + 32)):
                request = build_generate_request(prompts, records[i % len(records)])
                request = dataclasses.replace(request, item=f"pair{i:05d}",
                                              cache_parts=dict(request.cache_parts, copy=i))
                batch.append(caller.call(request))
            await asyncio.gather(*batch)
        await caller.aclose()
    asyncio.run(go())
    sizes = [os.path.getsize(p) for p in list(Path(out, "_batch", "caption", "lines").glob("*.json"))[:50]]
    return int(sum(sizes) / max(1, len(sizes)))


def old_driver_module(rev: str):
    text = subprocess.run(["git", "show", f"{rev}:operators/llm/batch.py"], cwd=REPO, check=True,
                          capture_output=True).stdout
    path = Path(tempfile.mkdtemp(prefix="old-batch-")) / "old_batch.py"
    path.write_bytes(text)
    spec = importlib.util.spec_from_file_location("old_batch", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_batch"] = module     # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def child(args) -> None:
    """The driver alone, in this process: submit, wait; prints a JSON line with its peak RSS."""
    if args.driver == "old":
        m = old_driver_module(args.rev)
        driver = m.BatchDriver(m.BatchState(args.out, "caption"), m.BatchAPI(args.base_url, KEY),
                               m.BatchSettings(poll_s=0.5), job="caption")
    else:
        from operators.llm.batch import BatchAPI, BatchDriver, BatchSettings, BatchState
        driver = BatchDriver(BatchState(args.out, "caption", "bench"), BatchAPI(args.base_url, KEY),
                             BatchSettings(poll_s=0.5), job="caption", run_id="bench")
    start = time.monotonic()
    ids = driver.submit()
    submitted = time.monotonic() - start
    counts = driver.wait()
    print(json.dumps({"files": len(ids), "counts": counts, "submit_s": submitted, "seconds": time.monotonic() - start,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--driver", choices=("new", "old"), default="new")
    ap.add_argument("--rev", default="HEAD", help="with --driver old: the revision whose batch.py to run")
    ap.add_argument("--work", default="", help="folder for the lines (default: a temporary one; ~3.3 MB a pair)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--base-url", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from tests.openai_test_server import ServerProcess
    server = ServerProcess()
    work = Path(args.work or tempfile.mkdtemp(prefix="batch-scale-"))
    try:
        server.configure(batch_strip_images=True)
        out = str(work / "out")
        t0 = time.monotonic()
        size = write_lines(server.base_url, out, args.pairs, work)
        print(f"{args.pairs} lines written in {time.monotonic() - t0:.0f} s, {size / 1e6:.2f} MB each", flush=True)
        server.reset()
        run = subprocess.run([sys.executable, __file__, "--child", "--driver", args.driver, "--rev", args.rev,
                              "--out", out, "--base-url", server.base_url], capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"the driver failed:\n{run.stderr[-3000:]}")
        result = json.loads(run.stdout.strip().splitlines()[-1])
        stats = server.stats()
        twice = sum(1 for v in stats["batch_submissions"].values() if v > 1)
        print(f"driver ({args.driver}): {result['files']} files submitted in {result['submit_s']:.0f} s, all done in "
              f"{result['seconds']:.0f} s; {result['counts']}")
        print(f"batch_scale pairs={args.pairs} driver={args.driver} lines={len(stats['batch_submissions'])} "
              f"line_mb={size / 1e6:.2f} files={stats['batches_created']} "
              f"driver_peak_rss_mb={result['peak_rss_mb']:.0f} submitted_twice={twice} "
              f"completed={result['counts']['completed']} seconds={result['seconds']:.0f}")
    finally:
        server.close()
        if not args.work:
            import shutil
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
