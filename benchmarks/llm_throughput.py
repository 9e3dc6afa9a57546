"""Throughput of the LLM layer against the local OpenAI-compatible test server (50 ms latency).

Three runs in one Ray session on this machine:

1. our pool (operators.llm.stage: async actors, asyncio.gather, pool-wide limiter, no RPM limit);
2. Ray's built-in ``ray.data.llm`` HTTP processor (``build_processor(HttpRequestProcessorConfig(...))``)
   on the same request payloads, same number of actors;
3. our pool under a configured limit of R requests per minute: limit_utilisation is the busiest 60 s
   window at the server as a fraction of R (in --quick mode, shorter than a minute: the steady rate
   after the bucket's initial 1 s burst, as a fraction of R), and every window is checked against the
   limit (60 s windows; 10 s windows against R pro rata plus the burst in --quick mode).

Rates are measured from the server's arrival timestamps (first to last request), so actor start-up is
not counted for either side; wall-clock times including start-up are printed too. The cache is off
(we measure requests, not cache hits). Ends with one line:
``requests_per_s=<n> builtin_requests_per_s=<m> limit_utilisation=<fraction>``.

    python benchmarks/llm_throughput.py            # ~3 minutes
    python benchmarks/llm_throughput.py --quick    # ~1 minute
"""
from __future__ import annotations

import os
import sys

if not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import time

from operators.llm.client import LLMConfig, LLMRequest, Secret
from operators.llm.ratelimit import RateLimits, start_rate_limiter
from operators.llm.stage import PoolConfig, StageSpec, apply_llm_stage
from operators.io.tables import envelope
from tests.openai_test_server import ServerProcess  # the test equipment, started in its own process
SCHEMA = {"type": "object", "required": ["answer"], "additionalProperties": False,
          "properties": {"answer": {"type": "string", "minLength": 1}}}
MODEL = "bench-model"


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Benchmark question {i}: describe the change. region: center"}]


def build_request(record: dict) -> LLMRequest:
    return LLMRequest(item=record["item"], messages=question(record["i"]), schema=SCHEMA, schema_name="answer",
                      cache_parts={"i": record["i"]})


def handle_result(record: dict, result) -> list[dict]:
    return [envelope("answers", {"item": record["item"]})]


# -- test server -----------------------------------------------------------------------------------------
def rate_of(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def max_in_window(times: list[float], width: float) -> int:
    best, j = 0, 0
    for i in range(len(times)):
        while times[i] - times[j] >= width:
            j += 1
        best = max(best, i - j + 1)
    return best


# -- the runs --------------------------------------------------------------------------------------------
def run_ours(server: Server, n: int, limits: RateLimits, pool: PoolConfig, name: str) -> tuple[float, list[float]]:
    import ray
    import ray.data
    limiter = start_rate_limiter(name, limits)
    spec = StageSpec(name="bench", input_table="_ask", build_request=build_request, handle_result=handle_result,
                     llm=LLMConfig(model=MODEL, base_url=server.base_url, timeout_s=60, use_cache=False,
                                   temperature=None, max_tokens=64),
                     limiter_name=name, api_key=Secret("sk-bench"))
    rows = [envelope("_ask", {"item": f"q{i}", "i": i}) for i in range(n)]
    server.reset()
    t0 = time.time()
    ds = apply_llm_stage(ray.data.from_items(rows, override_num_blocks=max(8, n // pool.batch_size // 4)), spec, pool)
    answered = sum(1 for r in ds.iter_rows() if r["_table"] == "answers")
    wall = time.time() - t0
    ray.kill(limiter)
    if answered != n:
        raise RuntimeError(f"our pool answered {answered} of {n}")
    return wall, server.timestamps()


def run_builtin(server: Server, n: int, actors: int, batch_size: int) -> tuple[float, list[float]]:
    import ray.data
    from ray.data.llm import HttpRequestProcessorConfig, build_processor
    config = HttpRequestProcessorConfig(url=f"{server.base_url}/chat/completions",
                                        headers={"Authorization": "Bearer sk-bench"},
                                        batch_size=batch_size, concurrency=actors)
    processor = build_processor(
        config,
        preprocess=lambda row: {"payload": {
            "model": MODEL, "messages": question(row["i"]), "max_tokens": 64,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}},
        postprocess=lambda row: {"ok": bool(row["http_response"]["choices"])})
    server.reset()
    t0 = time.time()
    ds = processor(ray.data.from_items([{"i": i} for i in range(n)], override_num_blocks=max(8, n // batch_size)))
    answered = sum(1 for r in ds.iter_rows() if r["ok"])
    wall = time.time() - t0
    if answered != n:
        raise RuntimeError(f"built-in processor answered {answered} of {n}")
    return wall, server.timestamps()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and a shorter limit run")
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--rpm", type=float, default=0, help="limit R for the utilisation run (default: 9000, quick 6000)")
    args = ap.parse_args(argv)
    n_ours = 2000 if args.quick else 6000
    n_builtin = 400 if args.quick else 1200
    rpm = args.rpm or (6000 if args.quick else 9000)
    limit_seconds = 20 if args.quick else 75          # the full run covers whole 60 s windows
    n_limited = int(rpm / 60 * limit_seconds)

    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    server = ServerProcess(args.latency_ms)
    try:
        pool = PoolConfig(actors=args.actors, concurrent_batches=8, batch_size=32, num_cpus=0.5)
        run_ours(server, 200, RateLimits(max_in_flight=512), pool, "bench-warmup")   # imports, connections
        wall, times = run_ours(server, n_ours, RateLimits(max_in_flight=512), pool, "bench-ours")
        ours = rate_of(times)
        print(f"ours:    {n_ours} requests, {ours:.1f} req/s at the server, {n_ours / wall:.1f} req/s wall "
              f"incl. start-up ({wall:.1f} s)", flush=True)

        wall, times = run_builtin(server, n_builtin, args.actors, 32)
        builtin = rate_of(times)
        print(f"builtin: {n_builtin} requests, {builtin:.1f} req/s at the server, {n_builtin / wall:.1f} req/s "
              f"wall incl. start-up ({wall:.1f} s)", flush=True)

        limits = RateLimits(rpm=rpm, max_in_flight=512)
        wall, times = run_ours(server, n_limited, limits, pool, "bench-limited")
        # The limit is per minute: the full run checks every 60 s window. The quick run is shorter than a
        # minute, so it checks 10 s windows against the pro-rata share plus the bucket's 1 s burst.
        width = 60.0 if times[-1] - times[0] >= 60.0 else 10.0
        worst = max_in_window(times, width)
        share = rpm * width / 60
        allowed = share if width == 60.0 else share + max(1.0, rpm / 60 * limits.burst_s)
        if width == 60.0:
            utilisation = worst / share
        else:  # steady rate after the bucket's initial burst, as a fraction of R
            burst = int(max(1.0, rpm / 60 * limits.burst_s))
            utilisation = rate_of(times[burst:]) * 60 / rpm
        print(f"limited: R={rpm:.0f}/min, {n_limited} requests over {times[-1] - times[0]:.1f} s; busiest {width:g} s "
              f"window: {worst} requests (R pro rata {share:.0f}, allowed {allowed:.0f}) -> "
              f"{'OVER THE LIMIT' if worst > allowed else 'no window over the limit'}; "
              f"overall {rate_of(times) * 60:.0f}/min", flush=True)
        print(f"load average during run: {os.getloadavg()[0]:.1f} (2 cores)")
        print(f"requests_per_s={ours:.1f} builtin_requests_per_s={builtin:.1f} limit_utilisation={utilisation:.3f}")
    finally:
        server.close()
        ray.shutdown()


if __name__ == "__main__":
    main()
