"""The generic LLM stage: rows in, structured LLM replies out, inside a Ray Data async actor pool.

A stage is described by a :class:`StageSpec`: which envelope rows it consumes (``input_table``), a
request builder (record -> :class:`LLMRequest`: messages, JSON schema, cache key parts) and a result
handler (record, parsed reply -> envelopes). Rows of other tables pass through untouched, so stages
chain (generate -> judge -> sink) and every row still ends in exactly one table. Each actor runs
``asyncio.gather`` over its batch and several batches at once; the pool shares one rate limiter.

Every logical request also yields one ``usage`` row; a request that fails for good yields an ``errors``
row for its item (the handler is not called), so no row is ever lost or crashes the pipeline.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from operators.llm.cache import ResponseCache
from operators.llm.client import LLMCaller, LLMConfig, LLMRequest, LLMResult, Secret, redact
from operators.llm.ratelimit import LeaseClient
from operators.io.tables import envelope, error_envelope

log = logging.getLogger(__name__)


@dataclass
class PoolConfig:
    actors: int = 2                    # LLM actors (async; a 2-core node sustains ~2 busy ones)
    concurrent_batches: int = 8        # async calls in flight per actor
    batch_size: int = 16               # rows gathered per call
    num_cpus: float = 0.25             # per actor: they mostly wait on the network
    max_store_mb: float = 0.0          # Ray Data's object-store budget for the pipeline (0: Ray's default share)
    actor_start_timeout_s: int = 900   # the pipeline starts once every stage's actors are up (0: at once)


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


def usage_record(spec: StageSpec, result: LLMResult) -> dict:
    return {
        "run_id": spec.run_id, "stage": spec.name, "item": result.item, "model": spec.llm.model,
        "cache_key": result.cache_key, "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": None if result.prompt_tokens is None or result.completion_tokens is None
        else result.prompt_tokens + result.completion_tokens,
        "cost_usd": None if result.cached else result.cost_usd, "cached": result.cached,
        "attempts": result.attempts, "status": "ok" if result.ok else "error",
        "response_format": result.response_format, "worker": result.extras.get("worker", ""),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


class LLMStageActor:
    """Ray Data callable class (async ``__call__``) running one stage's requests."""

    def __init__(self, spec: StageSpec):
        self.spec = spec
        self.caller: LLMCaller | None = None

    def _caller(self) -> LLMCaller:
        if self.caller is None:  # built inside the actor's event loop
            import ray
            limiter = ray.get_actor(self.spec.limiter_name, namespace=self.spec.limiter_namespace) \
                if self.spec.limiter_name else None
            cache = ResponseCache(self.spec.cache_root) if self.spec.cache_root else None
            self.caller = LLMCaller(self.spec.llm, self.spec.api_key, LeaseClient(limiter), cache)
        return self.caller

    async def _one(self, record: dict) -> list[dict]:
        spec = self.spec
        item = str(record.get("pair_id") or record.get("item") or "?")
        try:
            request = spec.build_request(record)
        except Exception as exc:  # noqa: BLE001
            return [error_envelope(item, spec.name, exc, job=spec.job, run_id=spec.run_id)]
        caller = self._caller()
        result = await caller.call(request)
        result.extras["worker"] = caller.worker
        out = [envelope("usage", usage_record(spec, result))]
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

    async def __call__(self, batch: dict) -> dict:
        tables, records = list(batch["_table"]), list(batch["_record"])
        passthrough, work = [], []
        for t, r in zip(tables, records):
            if t == self.spec.input_table:
                work.append(json.loads(r))
            else:
                passthrough.append({"_table": t, "_record": r})
        results = await asyncio.gather(*(self._one(rec) for rec in work))
        if self.caller is not None:
            await self.caller.lease.flush()
        rows = passthrough + [env for group in results for env in group]
        return {"_table": [r["_table"] for r in rows], "_record": [r["_record"] for r in rows]}


def apply_llm_stage(ds, spec: StageSpec, pool: PoolConfig):
    """``ds.map_batches`` with an async actor pool for ``spec``."""
    import ray.data

    return ds.map_batches(
        LLMStageActor, fn_constructor_args=(spec,), batch_size=pool.batch_size, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=pool.actors, max_concurrent_calls_per_actor=pool.concurrent_batches,
                                           max_tasks_in_flight_per_actor=pool.concurrent_batches * 2),
        num_cpus=pool.num_cpus)
