"""The captions job under LLM fault load, side by side with a fault-free run.

Builds a captions input of ``--pairs`` pairs (the repository's 12 LEVIR-CD samples repeated under new
names, each copy a distinct request: see ``benchmarks/_levir_repeat.py``) in a temp folder, starts the
OpenAI-compatible test server (test equipment) in its own process, and runs the captions job
(``python -m jobs.caption``, its own local Ray, 2 CPUs) twice on the same input into fresh outputs:

1. with faults: 10 % 429 with ``Retry-After``, 5 % 5xx (500 and 503), 2 % malformed JSON, 1 %
   timeouts (the server holds the request past the job's ``--timeout-s``), drawn exclusively per
   request (each kind at exactly its rate) and deterministically from ``--seed``;
2. without faults.

Both runs use one RPM limit, low enough to bind (the job's pool would go faster), and no TPM limit.
The server does not enforce the limit: it records every request's arrival, and the benchmark counts,
the provider's way, the requests that arrived when the trailing 60 s window already held the limit
(``rpm_over``: what a provider would have refused). Every pair must end in ``pairs/`` or ``errors/``
(``lost`` counts those in neither), no key may appear twice (``duplicates``: pairs by pair id, captions
by pair id and candidate, and pairs that are both finished and in the current errors), every error row
needs a type and a message. Ends with one line:
``pairs=<n> lost=<n> duplicates=<n> rpm_over=<n> fault_slowdown=<wall with faults / wall without>``
(lost, duplicates and rpm_over summed over both runs).

    python -m benchmarks.fault_load                 # 2,000 pairs, RPM 900: ~5.5 + 5 minutes
    python -m benchmarks.fault_load --pairs 300 --rpm 600   # a quick look
    python -m benchmarks.fault_load --cpu-hogs 12        # the pool starved of CPU in bursts

``--cpu-hogs N`` runs N busy processes that spin ``--hog-on-s`` and rest ``--hog-off-s``, in step, from
``--hog-delay-s`` on (once the job's Ray is up): the
job's actors stall and then catch up, which is when granted requests go out in a bunch. The test server
then runs at a higher CPU priority (when allowed), so that it timestamps arrivals as promptly as a
provider's front door would, rather than bunching them itself.
"""
from __future__ import annotations

import os
import sys

if not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import collections
import multiprocessing
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks._levir_repeat import build_repeated_levir
from operators.io.storage import Store
from operators.io.tables import read_table
from operators.language.caption_ops import TABLE_SCHEMAS
from tests.openai_test_server import ServerProcess  # test equipment, in its own process

REPO = Path(__file__).resolve().parent.parent
FAULTS = [{"kind": "429", "rate": 0.10}, {"kind": "500", "rate": 0.025}, {"kind": "503", "rate": 0.025},
          {"kind": "malformed", "rate": 0.02}, {"kind": "timeout", "rate": 0.01}]


def requests_over_limit(times: list[float], limit: float, window_s: float = 60.0) -> tuple[int, int]:
    """(requests a provider counting ``limit`` per trailing ``window_s`` would refuse, busiest window).

    Refused requests are not counted against the window, as providers do not count them."""
    counted: collections.deque = collections.deque()
    over = busiest = 0
    for t in sorted(times):
        while counted and counted[0] <= t - window_s:
            counted.popleft()
        if len(counted) + 1 > limit:
            over += 1
            continue
        counted.append(t)
        busiest = max(busiest, len(counted))
    return over, busiest


def _hog(on_s: float, off_s: float, start: float) -> None:
    """Spin ``on_s``, rest ``off_s``, in step with every other hog (all start from ``start``)."""
    period = on_s + off_s
    time.sleep(max(0.0, start - time.time()))
    while True:
        phase = (time.time() - start) % period
        if phase < on_s:
            end = time.time() + (on_s - phase)
            while time.time() < end:
                pass
        else:
            time.sleep(period - phase)


def start_hogs(n: int, on_s: float, off_s: float, delay_s: float = 0.0) -> list:
    start = time.time() + delay_s
    hogs = [multiprocessing.Process(target=_hog, args=(on_s, off_s, start), daemon=True) for _ in range(n)]
    for h in hogs:
        h.start()
    return hogs


def run_job(name: str, inp: Path, out: Path, server: ServerProcess, args) -> float:
    """``python -m jobs.caption`` as a user runs it; its progress lines are passed through."""
    cmd = [sys.executable, "-m", "jobs.caption", "--input", str(inp), "--output", str(out), "--model", "bench-model",
           "--base-url", server.base_url, "--rpm", str(args.rpm), "--tpm", "0", "--timeout-s", str(args.timeout_s),
           "--backoff-base-s", "0.5", "--num-cpus", str(args.num_cpus), "--progress-every-s", "15"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(OPENAI_API_KEY="sk-bench-not-a-key", PYTHONPATH=str(REPO))
    log_path = out.parent / f"{name}.log"
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            if "llm progress" in line or "pairs found" in line or line.startswith("run "):
                print(f"  [{name}] {line.strip()[:200]}", flush=True)
        rc = proc.wait()
    wall = time.time() - t0
    if rc != 0:
        raise RuntimeError(f"{name} run failed (exit {rc}); see {log_path}")
    return wall


def check_outputs(out: Path, ids: list[str]) -> dict:
    store = Store(str(out))

    def rows(table: str, current: bool = False) -> list[dict]:
        t = read_table(store, table, TABLE_SCHEMAS[table], current=current)
        return t.to_pylist() if t is not None else []

    pairs, captions, errors = rows("pairs"), rows("captions"), rows("errors", current=True)
    finished = collections.Counter(r["pair_id"] for r in pairs)
    candidates = collections.Counter((r["pair_id"], r["candidate_index"]) for r in captions)
    error_items = {r["item"] for r in errors}
    lost = set(ids) - set(finished) - error_items
    dup = (sum(n - 1 for n in finished.values()) + sum(n - 1 for n in candidates.values())
           + len(set(finished) & error_items))
    no_reason = sum(1 for r in errors if not (r.get("error_type") and (r.get("message") or "").strip()))
    reasons = collections.Counter(f"{r['stage']}:{r['error_type']}" for r in errors)
    return {"finished": set(finished), "lost": len(lost), "lost_ids": sorted(lost)[:5], "duplicates": dup,
            "errors": len(errors), "no_reason": no_reason, "reasons": dict(reasons)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--rpm", type=float, default=900, help="the job's --rpm (binding: the pool would go faster)")
    ap.add_argument("--timeout-s", type=float, default=4.0, help="the job's per-request timeout")
    ap.add_argument("--server-timeout-s", type=float, default=10.0, help="how long an injected timeout holds")
    ap.add_argument("--latency-ms", type=float, default=100.0, help="the test server's reply latency")
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", default="", help="keep inputs and outputs in this folder")
    ap.add_argument("--cpu-hogs", type=int, default=0, help="busy processes that starve the job in bursts")
    ap.add_argument("--hog-on-s", type=float, default=4.0)
    ap.add_argument("--hog-off-s", type=float, default=3.0)
    ap.add_argument("--hog-delay-s", type=float, default=60.0,
                    help="the hogs start this late (Ray's start-up on a busy machine times out under them)")
    ap.add_argument("--runs", default="faults,no_faults", help="which runs, comma-separated")
    args = ap.parse_args(argv)

    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="fault_load_"))
    t0 = time.time()
    ids = build_repeated_levir(tmp / "input", args.pairs)
    print(f"input: {len(ids)} pairs in {tmp / 'input'} ({time.time() - t0:.1f} s)", flush=True)

    server = ServerProcess(latency_ms=args.latency_ms)
    hogs = []
    if args.cpu_hogs:
        try:
            os.setpriority(os.PRIO_PROCESS, server.proc.pid, -10)
        except OSError as exc:
            print(f"test server priority unchanged ({exc}): arrival times may bunch with the job's", flush=True)
        hogs = start_hogs(args.cpu_hogs, args.hog_on_s, args.hog_off_s, args.hog_delay_s)
        print(f"{args.cpu_hogs} CPU hogs: {args.hog_on_s:g} s on, {args.hog_off_s:g} s off, from "
              f"{args.hog_delay_s:g} s on", flush=True)
    runs = [r for r in (("faults", FAULTS), ("no_faults", [])) if r[0] in args.runs.split(",")]
    results = {}
    try:
        for name, faults in runs:
            server.restore_defaults()
            server.configure(latency_ms=args.latency_ms, faults=faults, fault_draw="exclusive", fault_seed=args.seed,
                             retry_after_s=1, timeout_s=args.server_timeout_s)
            server.reset()
            print(f"{name}: running the captions job ...", flush=True)
            wall = run_job(name, tmp / "input", tmp / name, server, args)
            stats = server.stats()
            over, busiest = requests_over_limit(stats["timestamps"], args.rpm)
            results[name] = dict(check_outputs(tmp / name, ids), wall=wall, requests=stats["total"],
                                 by_status=stats["by_status"], rpm_over=over, busiest=busiest)
    finally:
        server.close()
        for h in hogs:
            h.terminate()

    print()
    print("| run | wall s | requests | by status at the server | busiest 60 s | rpm_over | finished | errors "
          "(stage:type) | lost | duplicates | errors without reason |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        status = ", ".join(f"{k}: {v}" for k, v in sorted(r["by_status"].items()))
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items()))
        print(f"| {name} | {r['wall']:.1f} | {r['requests']} | {status} | {r['busiest']} / {args.rpm:.0f} | "
              f"{r['rpm_over']} | {len(r['finished'])} | {r['errors']} ({reasons}) | {r['lost']} | "
              f"{r['duplicates']} | {r['no_reason']} |")
    if len(results) < 2:
        (r,) = results.values()
        print(f"pairs={len(ids)} lost={r['lost']} duplicates={r['duplicates']} rpm_over={r['rpm_over']}")
        return 0 if not (r["lost"] or r["duplicates"] or r["no_reason"]) else 1
    f, c = results["faults"], results["no_faults"]
    if f["finished"] != c["finished"]:
        print(f"finished pairs differ: {len(f['finished'] - c['finished'])} only with faults, "
              f"{len(c['finished'] - f['finished'])} only without")
    for name, r in results.items():
        if r["lost"]:
            print(f"{name}: lost pairs, e.g. {r['lost_ids']}")
    lost = f["lost"] + c["lost"]
    dup = f["duplicates"] + c["duplicates"]
    over = f["rpm_over"] + c["rpm_over"]
    print(f"pairs={len(ids)} lost={lost} duplicates={dup} rpm_over={over} "
          f"fault_slowdown={f['wall'] / c['wall']:.2f}")
    return 0 if not (lost or dup or f["no_reason"] or c["no_reason"]) else 1


if __name__ == "__main__":
    sys.exit(main())
