"""A batch job's driver in a process of its own, for the SIGKILL test (tests/llm/test_llm_batch_kill.py):
pass after pass, the callers defer the lines the batches have not answered yet (``BatchState`` in
``--root``), the driver submits them, waits for them and stores what came back, until every request is
answered. What run_llm_job does around the pipeline, without Ray: one request is one "pair".

    python -m tests.llm.batch_driver_process --base-url http://127.0.0.1:PORT/v1 --root DIR --run-id run1

Prints one JSON line at the end: ``{"ok": answered, "requests": n, "passes": passes run}``; exit 0 when
every request was answered, 1 otherwise."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import types

from operators.llm.batch import BatchAPI, BatchDriver, BatchSettings, BatchState
from operators.llm.cache import ResponseCache
from tests.llm.test_llm_money import KEY, caller_for, requests

JOB = "t"


def one_pass(base_url: str, root: str, run_id: str, n: int, tag: str):
    """Every request through a caller with the batch state: answered from a stored result, or deferred."""
    state, cache = BatchState(root, JOB, run_id), ResponseCache(root)

    async def go():
        caller = caller_for(types.SimpleNamespace(base_url=base_url), cache=cache, batch=state)
        try:
            return await asyncio.gather(*(caller.call(r) for r in requests(n, tag=tag)))
        finally:
            await caller.aclose()
    return asyncio.run(go()), state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--per-file", type=int, default=2, help="lines per batch file")
    ap.add_argument("--tag", default="kill")
    ap.add_argument("--max-passes", type=int, default=4)
    args = ap.parse_args(argv)
    results = []
    for n in range(args.max_passes):
        results, state = one_pass(args.base_url, args.root, args.run_id, args.requests, args.tag)
        if all(r.ok for r in results):
            print(json.dumps({"ok": len(results), "requests": args.requests, "passes": n}), flush=True)
            return 0
        driver = BatchDriver(state, BatchAPI(args.base_url, KEY, timeout_s=600),
                             BatchSettings(poll_s=0.05, max_requests_per_file=args.per_file), job=JOB,
                             run_id=args.run_id)
        driver.submit()
        driver.wait()
    print(json.dumps({"ok": sum(r.ok for r in results), "requests": args.requests, "passes": args.max_passes,
                      "errors": sorted({str(r.error)[:200] for r in results if not r.ok})}), flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
