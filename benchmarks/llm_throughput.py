"""Throughput of the LLM layer against the local OpenAI-compatible test server (50 ms latency), side by
side in one Ray session on this machine:

1. our pool (operators.llm.stage: async actors, asyncio.gather, pool-wide limiter, no limits);
2. Ray's built-in ``ray.data.llm`` HTTP processor on the same payloads, configured as well as we could:
   a fixed pool of the same number of actors at the same CPU share (``concurrency=(n, n)``,
   ``num_cpus``), warmed up, over a grid of batch sizes, rows per block and concurrent async batches
   per task (``RAY_DATA_DEFAULT_ASYNC_BATCH_UDF_MAX_CONCURRENCY``; its requests inside one batch go
   out one by one, so concurrent batches are its concurrency); the best configuration is reported;
3. a plain asyncio client (one process, a semaphore, aiohttp; and the same with the openai SDK) at the
   same number of requests in flight as our pool had: the physical limit of one process on this box;
   the faster of the two is reported;
4. our pool under an RPM limit R and a TPM limit T = R x the tokens of one request, with the test
   server enforcing both the provider's way (charged at arrival: prompt + max_tokens; 429 over the
   limit). Utilisation = the busiest window at the server over the limit; every window is checked.

Rates are measured from the server's arrival timestamps (first to last request), so start-up is not
counted for either side; requests in flight are measured at the server (mean and max). The cache is
off. Ends with one line:
``requests_per_s=<n> builtin_requests_per_s=<best> limit_utilisation=<rpm fraction>
asyncio_requests_per_s=<n> tpm_utilisation=<tpm fraction>``.

    python benchmarks/llm_throughput.py            # ~6 minutes (the limited run covers whole minutes)
    python benchmarks/llm_throughput.py --quick    # ~2 minutes
"""
from __future__ import annotations

import os
import sys

if not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import asyncio
import itertools
import time

from operators.llm.client import LLMConfig, LLMRequest, Secret
from operators.llm.ratelimit import RateLimits, start_rate_limiter
from operators.llm.stage import PoolConfig, StageSpec, apply_llm_stage
from operators.io.tables import envelope
from tests.openai_test_server import ServerProcess  # the test equipment, started in its own process

SCHEMA = {"type": "object", "required": ["answer"], "additionalProperties": False,
          "properties": {"answer": {"type": "string", "minLength": 1}}}
MODEL = "bench-model"
MAX_TOKENS = 64


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Benchmark question {i:06d}: describe the change. region: center"}]


def build_request(record: dict) -> LLMRequest:
    return LLMRequest(item=record["item"], messages=question(record["i"]), schema=SCHEMA, schema_name="answer",
                      cache_parts={"i": record["i"]})


def handle_result(record: dict, result) -> list[dict]:
    return [envelope("answers", {"item": record["item"]})]


def payload(i: int) -> dict:
    return {"model": MODEL, "messages": question(i), "max_tokens": MAX_TOKENS,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}


# -- measuring at the server -------------------------------------------------------------------------------
def rate_of(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def max_in_window(times: list[float], width: float, weights: list[float] | None = None) -> float:
    best, j, total = 0.0, 0, 0.0
    weights = weights or [1.0] * len(times)
    for i in range(len(times)):
        total += weights[i]
        while times[i] - times[j] >= width:
            total -= weights[j]
            j += 1
        best = max(best, total)
    return best


def in_flight(stats: dict) -> tuple[float, int]:
    """Mean and max requests in flight at the server while it was busy."""
    spans = stats["spans"]
    if not spans:
        return 0.0, 0
    busy = max(e for _, e in spans) - min(s for s, _ in spans)
    return sum(e - s for s, e in spans) / max(busy, 1e-9), stats["max_in_flight"]


# -- the runs --------------------------------------------------------------------------------------------
def run_ours(server, n: int, limits: RateLimits, pool: PoolConfig, name: str, offset: int = 0):
    import ray
    import ray.data
    limiter = start_rate_limiter(name, limits)
    spec = StageSpec(name="bench", input_table="_ask", build_request=build_request, handle_result=handle_result,
                     llm=LLMConfig(model=MODEL, base_url=server.base_url, timeout_s=60, use_cache=False,
                                   temperature=None, max_tokens=MAX_TOKENS),
                     limiter_name=name, api_key=Secret.from_source("env:CHANGEFORGE_BENCH_KEY"))
    rows = [envelope("_ask", {"item": f"q{i}", "i": i}) for i in range(offset, offset + n)]
    server.reset()
    t0 = time.time()
    ds = apply_llm_stage(ray.data.from_items(rows, override_num_blocks=max(8, n // pool.batch_size // 4)), spec, pool)
    answered = sum(1 for r in ds.iter_rows() if r["_table"] == "answers")
    wall = time.time() - t0
    ray.kill(limiter)
    if answered != n:
        raise RuntimeError(f"our pool answered {answered} of {n}")
    return wall, server.stats()


def run_builtin(server, n: int, actors: int, num_cpus: float, batch_size: int, block_rows: int,
                async_batches: int, offset: int = 0):
    import ray.data
    from ray.data._internal.planner import plan_udf_map_op
    from ray.data.llm import HttpRequestProcessorConfig, build_processor
    # Read when the plan is built, on the driver: concurrent async batches per task.
    plan_udf_map_op.DEFAULT_ASYNC_BATCH_UDF_MAX_CONCURRENCY = async_batches
    config = HttpRequestProcessorConfig(
        url=f"{server.base_url}/chat/completions", headers={"Authorization": "Bearer sk-bench"},
        batch_size=batch_size, concurrency=(actors, actors),
        http_request_stage={"concurrency": (actors, actors), "num_cpus": num_cpus, "batch_size": batch_size})
    processor = build_processor(config, preprocess=lambda row: {"payload": payload(row["i"])},
                                postprocess=lambda row: {"ok": bool(row["http_response"]["choices"])})
    server.reset()
    t0 = time.time()
    items = [{"i": i} for i in range(offset, offset + n)]
    ds = processor(ray.data.from_items(items, override_num_blocks=max(2, n // block_rows)))
    answered = sum(1 for r in ds.iter_rows() if r["ok"])
    wall = time.time() - t0
    if answered != n:
        raise RuntimeError(f"built-in processor answered {answered} of {n}")
    return wall, server.stats()


def run_asyncio(server, n: int, concurrency: int, offset: int = 0, client: str = "aiohttp"):
    """A plain asyncio client in this process, a semaphore and nothing else: with aiohttp (what the
    built-in processor sends with, and our transport) or with the openai SDK."""
    import json as _json

    async def go():
        gate = asyncio.Semaphore(concurrency)
        if client == "sdk":
            import httpx2
            import openai
            limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
            sdk = openai.AsyncOpenAI(api_key="sk-bench", base_url=server.base_url, max_retries=0,
                                     http_client=httpx2.AsyncClient(limits=limits, timeout=60))

            async def one(i):
                async with gate:
                    p = payload(i)
                    reply = await sdk.chat.completions.create(model=p["model"], messages=p["messages"],
                                                              max_tokens=MAX_TOKENS,
                                                              response_format=p["response_format"])
                    return bool(reply.choices)
            done = await asyncio.gather(*(one(i) for i in range(offset, offset + n)))
            await sdk.close()
            return sum(done)
        import aiohttp
        headers = {"Authorization": "Bearer sk-bench", "Content-Type": "application/json"}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
            async def one(i):
                async with gate:
                    async with session.post(f"{server.base_url}/chat/completions", headers=headers,
                                            data=_json.dumps(payload(i)).encode()) as resp:
                        return bool(_json.loads(await resp.read())["choices"])
            return sum(await asyncio.gather(*(one(i) for i in range(offset, offset + n))))
    server.reset()
    t0 = time.time()
    answered = asyncio.run(go())
    wall = time.time() - t0
    if answered != n:
        raise RuntimeError(f"asyncio client ({client}) answered {answered} of {n}")
    return wall, server.stats()


def report(label: str, n: int, wall: float, stats: dict) -> float:
    times = sorted(stats["timestamps"])
    rate = rate_of(times)
    mean_if, max_if = in_flight(stats)
    print(f"{label}: {n} requests, {rate:.1f} req/s at the server, {n / wall:.1f} req/s wall incl. start-up "
          f"({wall:.1f} s); in flight at the server: mean {mean_if:.1f}, max {max_if}", flush=True)
    return rate


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests, a smaller grid and a shorter limit run")
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--num-cpus", type=float, default=0.5, help="CPU share per actor, both sides")
    ap.add_argument("--rpm", type=float, default=0, help="limit R for the utilisation run (default: 9000, quick 6000)")
    args = ap.parse_args(argv)
    n_ours = 2000 if args.quick else 6000
    n_builtin = 800 if args.quick else 2000
    rpm = args.rpm or (6000 if args.quick else 9000)
    limit_seconds = 25 if args.quick else 130          # the full run covers two whole 60 s windows
    n_limited = int(rpm / 60 * limit_seconds)
    grid = list(itertools.product((8, 32), (128,), (16,))) if args.quick else \
        list(itertools.product((8, 16, 32), (32, 128), (16, 64)))

    os.environ["CHANGEFORGE_BENCH_KEY"] = "sk-bench"   # the workers read the key from their environment
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    server = ServerProcess(args.latency_ms)
    offset = itertools.count(0, 1_000_000)   # fresh questions for every run
    try:
        pool = PoolConfig(actors=args.actors, concurrent_batches=8, batch_size=32, num_cpus=args.num_cpus)
        print(f"load average at start: {os.getloadavg()[0]:.1f} (2 cores; other work may share the machine)")
        run_ours(server, 400, RateLimits(max_in_flight=512), pool, "bench-warmup", next(offset))
        wall, stats = run_ours(server, n_ours, RateLimits(max_in_flight=512), pool, "bench-ours", next(offset))
        ours = report("ours", n_ours, wall, stats)
        ours_in_flight = in_flight(stats)[0]

        builtin, best_cfg = 0.0, None
        run_builtin(server, 200, args.actors, args.num_cpus, 8, 32, 16, next(offset))   # warm-up
        for batch_size, block_rows, async_batches in grid:
            wall, stats = run_builtin(server, n_builtin, args.actors, args.num_cpus, batch_size, block_rows,
                                      async_batches, next(offset))
            rate = report(f"builtin batch={batch_size} block={block_rows} rows async_batches={async_batches}",
                          n_builtin, wall, stats)
            if rate > builtin:
                builtin, best_cfg = rate, (batch_size, block_rows, async_batches)
        print(f"best built-in: batch={best_cfg[0]} block={best_cfg[1]} rows async_batches={best_cfg[2]} "
              f"-> {builtin:.1f} req/s", flush=True)

        concurrency = max(16, round(ours_in_flight))
        plain = 0.0
        for client in ("aiohttp", "sdk"):
            run_asyncio(server, 200, concurrency, next(offset), client)   # warm-up
            wall, stats = run_asyncio(server, n_ours, concurrency, next(offset), client)
            plain = max(plain, report(f"asyncio {client} (concurrency {concurrency})", n_ours, wall, stats))

        # Tokens of one request as the server counts them (prompt + max_tokens), for a TPM that binds too.
        server.reset()
        run_asyncio(server, 20, 4, next(offset))
        charges = [n for _, n in server.stats()["charges"]]
        tpm = rpm * max(charges)
        server.configure(rpm_limit=rpm, tpm_limit=tpm, limit_window_s=60.0)
        limits = RateLimits(rpm=rpm, tpm=tpm, max_in_flight=512)
        wall, stats = run_ours(server, n_limited, limits, pool, "bench-limited", next(offset))
        server.configure(rpm_limit=0, tpm_limit=0)
        times = sorted(stats["timestamps"])
        charged = sorted(stats["charges"])
        refused = stats["by_status"].get("429", 0)
        span = times[-1] - times[0]
        width = 60.0 if span >= 60.0 else 10.0
        share_r, share_t = rpm * width / 60, tpm * width / 60
        worst_r = max_in_window([t for t, _ in charged], width)
        worst_t = max_in_window([t for t, _ in charged], width, [float(n) for _, n in charged])
        if width == 60.0:
            util_r, util_t = worst_r / share_r, worst_t / share_t
            over = worst_r > share_r or worst_t > share_t
        else:   # shorter than a minute: steady rate after the 1 s burst, as a fraction of the limits
            burst = int(max(1.0, rpm / 60 * limits.burst_s))
            steady = [t for t, _ in charged][burst:]
            util_r = rate_of(steady) * 60 / rpm
            util_t = util_r * (sum(n for _, n in charged) / len(charged)) / (tpm / rpm)
            over = worst_r > share_r + burst or worst_t > share_t + tpm / 60 * limits.burst_s
        print(f"limited: R={rpm:.0f}/min, T={tpm:.0f} tokens/min ({max(charges)} per request as the server counts), "
              f"{n_limited} requests over {span:.1f} s; busiest {width:g} s window: {worst_r:.0f} requests "
              f"({util_r:.3f} of R), {worst_t:.0f} tokens ({util_t:.3f} of T); 429s from the server: {refused}; "
              f"{'OVER A LIMIT' if over or refused else 'no window over either limit'}", flush=True)
        print(f"ratios: ours/best built-in {ours / builtin:.2f}x, ours/asyncio {ours / plain:.2f}x")
        print(f"load average at the end: {os.getloadavg()[0]:.1f} (2 cores)")
        print(f"requests_per_s={ours:.1f} builtin_requests_per_s={builtin:.1f} limit_utilisation={util_r:.3f} "
              f"asyncio_requests_per_s={plain:.1f} tpm_utilisation={util_t:.3f}")
    finally:
        server.close()
        ray.shutdown()


if __name__ == "__main__":
    main()
