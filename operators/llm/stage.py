"""The generic LLM stage: rows in, structured LLM replies out, inside a Ray Data async actor pool.

A stage is described by a :class:`StageSpec`: which envelope rows it consumes (``input_table``), a
request builder (record -> :class:`LLMRequest`: messages, JSON schema, cache key parts) and a result
handler (record, parsed reply -> envelopes). Rows of other tables pass through untouched, so stages
chain (generate -> judge -> sink) and every row still ends in exactly one table. Stages chain within
one actor (an item goes through all of them in one coroutine, after an optional prepare step) or as
pools of their own. Each actor runs ``asyncio.gather`` over its batch and several batches at once;
the pool shares one rate limiter.

Every logical request also yields one ``usage`` row; a request that fails for good yields an ``errors``
row for its item (the handler is not called), so no row is ever lost or crashes the pipeline. Nothing
raises out of a batch: a limiter that cannot be found or reached, a key that cannot be read, a broken
cache entry each become the error rows of the items they concern, and the batch's other rows are
returned as usual.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

from operators.llm.cache import ResponseCache
from operators.llm.batch import BatchState
from operators.llm.client import DEFERRED, LLMCaller, LLMConfig, LLMRequest, LLMResult, Secret, redact
from operators.llm.ratelimit import LeaseClient
from operators.io.tables import envelope, error_envelope
from operators.io.work_list import ITEM_COLUMN

log = logging.getLogger(__name__)


@dataclass
class PoolConfig:
    actors: int = 2                    # LLM actors (async; a 2-core node sustains ~2 busy ones)
    concurrent_batches: int = 8        # async calls in flight per actor
    batch_size: int = 16               # rows gathered per call
    num_cpus: float = 0.25             # per actor: they mostly wait on the network
    max_store_mb: float = 0.0          # Ray Data's object-store budget for the pipeline (0: Ray's default share)
    actor_start_timeout_s: int = 900   # the pipeline starts once every stage's actors are up (0: at once)
    prepare_threads: int = 2           # per actor, preparing items (reading and encoding images)


@dataclass
class StageSpec:
    name: str
    input_table: str
    build_request: Callable[[dict], LLMRequest]
    handle_result: Callable[[dict, LLMResult], list[dict]]
    llm: LLMConfig
    limiter_name: str | None = None
    cache_root: str | None = None
    # Where the worker reads the key (env:/file:/aws-sm:); the spec carries the source, never the value.
    api_key: Secret = field(default_factory=Secret.from_source)
    run_id: str = ""
    job: str = ""
    limiter_namespace: str | None = None   # the limiter's Ray namespace (None: the job's own)
    batch_root: str | None = None          # --batch-api: the output store holding the job's batch lines


def usage_record(spec: StageSpec, result: LLMResult) -> dict:
    return {
        "run_id": spec.run_id, "stage": spec.name, "item": result.item, "model": spec.llm.model,
        "cache_key": result.cache_key, "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": None if result.prompt_tokens is None or result.completion_tokens is None
        else result.prompt_tokens + result.completion_tokens,
        "cost_usd": None if result.cached else result.cost_usd, "cached": result.cached,
        "attempts": result.attempts, "status": "ok" if result.ok else "error",
        "usage_complete": True if result.cached else result.usage_complete,
        "cached_tokens": result.cached_tokens, "reasoning_tokens": result.reasoning_tokens,
        "batch_id": result.batch_id,
        "response_format": result.response_format, "worker": result.extras.get("worker", ""),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def item_name(record: dict) -> str:
    """What an error row names: the pair, or the generic item."""
    return str(record.get("pair_id") or record.get("item") or "?")


class StageRunner:
    """One stage's requests inside an actor: builds each request, calls the model through the pool's
    rate limiter and cache, and turns the reply (or the failure) into envelopes."""

    def __init__(self, spec: StageSpec):
        self.spec = spec
        self.caller: LLMCaller | None = None

    def _caller(self) -> LLMCaller:
        """Built inside the actor's event loop, at the first request; if that fails (the limiter not
        found, the key unreadable) the request's row is an error row and the next request tries again."""
        if self.caller is None:
            import ray
            limiter = ray.get_actor(self.spec.limiter_name, namespace=self.spec.limiter_namespace) \
                if self.spec.limiter_name else None
            cache = ResponseCache(self.spec.cache_root) if self.spec.cache_root else None
            batch = BatchState(self.spec.batch_root, self.spec.job, self.spec.run_id) if self.spec.batch_root else None
            self.caller = LLMCaller(self.spec.llm, self.spec.api_key, LeaseClient(limiter), cache, batch=batch)
            self.caller.batch_run_id = self.spec.run_id
        return self.caller

    async def one(self, record: dict) -> list[dict]:
        spec = self.spec
        item = item_name(record)
        try:
            request = spec.build_request(record)
            item = request.item
            caller = self._caller()
            result = await caller.call(request)
        except Exception as exc:  # noqa: BLE001 - this row's failure is this row's error row
            return [error_envelope(item, spec.name, redact(str(exc) or repr(exc)), error_type=type(exc).__name__,
                                   job=spec.job, run_id=spec.run_id)]
        result.extras["worker"] = caller.worker
        if result.error_type == DEFERRED:
            return []    # waits for its batch: the item's rows come from a later pass
        # A hit on an answer this run took from a batch was booked then (with its batch id and price).
        booked = result.cached and spec.run_id and result.extras.get("answered_in_run") == spec.run_id
        out = [] if booked else [envelope("usage", usage_record(spec, result))]
        if not result.ok:
            out.append(envelope("errors", {
                "item": request.item, "stage": spec.name, "error_type": result.error_type,
                "message": redact(result.error, spec.api_key)[:2000], "job": spec.job, "run_id": spec.run_id,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
            return out
        try:
            out.extend(spec.handle_result(record, result))
        except Exception as exc:  # noqa: BLE001
            out.append(error_envelope(request.item, spec.name, exc, job=spec.job, run_id=spec.run_id))
        return out

    async def flush(self) -> None:
        if self.caller is not None:
            await self.caller.lease.flush()


async def run_chain(rows: list[dict], runners: Sequence[StageRunner]) -> list[dict]:
    """One item's envelopes through the stages in order: each stage answers the rows of its input
    table (at once) and passes the others on, so every row still ends in exactly one table."""
    for runner in runners:
        mine = [env["_record"] for env in rows if env["_table"] == runner.spec.input_table]
        rows = [env for env in rows if env["_table"] != runner.spec.input_table]
        # Parsed, the JSON text is dropped before the requests go out: with a pair's images in it,
        # each copy kept through a request's latency is megabytes per pair in flight.
        records = [json.loads(text) for text in mine]
        del mine
        answered = await asyncio.gather(*(runner.one(record) for record in records))
        del records
        rows += [env for group in answered for env in group]
    return rows


def prepared_rows(item: dict, prepare: Callable, prepare_kwargs: dict, job: str = "", run_id: str = "") -> list[dict]:
    """``prepare(item)``'s envelopes; a prepare step that raises gives an ``errors`` row, not a lost item."""
    try:
        return prepare(item, **prepare_kwargs)
    except Exception as exc:  # noqa: BLE001
        return [error_envelope(item_name(item), "prepare", exc,
                               job=job, run_id=run_id)]


class LLMStageActor:
    """Ray Data callable class (async ``__call__``) running one or more chained stages' requests.

    Given a ``prepare`` step, its input is work-list rows (one JSON item each) and each item is
    prepared here, in a thread, just before its requests. An item's images (read, decoded, encoded
    for the model) then live in this actor's memory only while its requests are in flight, and are
    dropped after its last stage: they never enter the object store. Carried there from a separate
    prepare step to the first stage, and from each stage to the next, they were the store's peak, and
    that peak was set by how many blocks Ray Data let queue, not by our settings. Here it is bounded
    by ``actors x concurrent_batches x batch_size`` items at any input size."""

    def __init__(self, specs: StageSpec | Sequence[StageSpec], prepare: Callable | None = None,
                 prepare_kwargs: dict | None = None, prepare_threads: int = 2):
        specs = [specs] if isinstance(specs, StageSpec) else list(specs)
        self.runners = [StageRunner(s) for s in specs]
        self.prepare, self.prepare_kwargs = prepare, dict(prepare_kwargs or {})
        # A few threads (OpenCV releases the GIL): more would only hold more decoded images at once
        # and starve the event loop that sends the requests of the pairs already prepared.
        self.prepare_threads = ThreadPoolExecutor(max(1, prepare_threads), thread_name_prefix="prepare") \
            if prepare is not None else None

    async def _prepared(self, item_json: str) -> list[dict]:
        loop = asyncio.get_running_loop()
        spec = self.runners[0].spec   # the job and run its error rows belong to
        return await loop.run_in_executor(self.prepare_threads, prepared_rows, json.loads(item_json),
                                          self.prepare, self.prepare_kwargs, spec.job, spec.run_id)

    def _stopped(self) -> str:
        """Why the account cannot be used (its quota exhausted), as one of this actor's callers learnt."""
        return next((r.caller.lease.stopped for r in self.runners if r.caller is not None and r.caller.lease.stopped), "")

    async def _item(self, item_json: str) -> list[dict]:
        stopped = self._stopped()
        if stopped:
            # The quota is gone: the pair's row says so at once, without reading its images (the job
            # ends within seconds; the rerun picks the pair up).
            spec = self.runners[0].spec
            item = json.loads(item_json)
            return [error_envelope(item_name(item), self.runners[0].spec.name, stopped, error_type="QuotaExhausted",
                                   job=spec.job, run_id=spec.run_id)]
        # Handed straight over, not kept in this frame: run_chain drops each row's JSON once parsed.
        return await run_chain(await self._prepared(item_json), self.runners)

    async def __call__(self, batch: dict) -> dict:
        self._loop = asyncio.get_running_loop()   # the actor's loop, where its HTTP sessions live
        if self.prepare is not None:
            work = [self._item(s) for s in batch[ITEM_COLUMN]]
        else:
            work = [run_chain([{"_table": t, "_record": r}], self.runners)
                    for t, r in zip(batch["_table"], batch["_record"])]
        results = await asyncio.gather(*work)
        for runner in self.runners:
            await runner.flush()
        rows = [env for group in results for env in group]
        return {"_table": [r["_table"] for r in rows], "_record": [r["_record"] for r in rows]}


    def __del__(self):
        """Ray Data deletes the callable when it shuts the pool down gracefully: close the HTTP
        sessions on the loop they belong to (unclosed, aiohttp warns about each at exit). Once only
        (a second call finds no loop), and never by waiting on a loop that is not running (nothing
        would run the close: the wait would only time out)."""
        loop, self._loop = getattr(self, "_loop", None), None
        if loop is None or loop.is_closed():
            return
        try:
            in_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            in_loop = False
        for runner in self.runners:
            if runner.caller is None:
                continue
            closing = runner.caller.aclose()
            try:
                if in_loop:
                    loop.create_task(closing)
                elif loop.is_running():
                    asyncio.run_coroutine_threadsafe(closing, loop).result(timeout=5)
                else:   # stopped, not closed: run the close on it here
                    loop.run_until_complete(closing)
            except Exception:  # noqa: BLE001 - closing is best effort at exit
                pass


def apply_llm_stage(ds, specs: StageSpec | Sequence[StageSpec], pool: PoolConfig, prepare: Callable | None = None,
                    prepare_kwargs: dict | None = None):
    """``ds.map_batches`` with an async actor pool running ``specs`` (one stage, or several chained
    in each actor), after ``prepare`` if given (then ``ds`` holds work-list rows)."""
    import ray.data

    return ds.map_batches(
        LLMStageActor, fn_constructor_args=(specs, prepare, prepare_kwargs, pool.prepare_threads),
        batch_size=pool.batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=pool.actors, max_concurrent_calls_per_actor=pool.concurrent_batches,
                                           max_tasks_in_flight_per_actor=pool.concurrent_batches * 2),
        num_cpus=pool.num_cpus)
