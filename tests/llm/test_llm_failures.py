"""The LLM layer when things go wrong: a reasoning model's 400s under load, a limiter that is down,
slow or answers twice, a key that cannot be read, a broken cache entry, odd usage fields. No Ray:
the limiter's core runs behind a stand-in for its actor handle (every call awaits, and can fail the
way Ray's calls fail)."""
import asyncio
import functools
import json

import pytest
from ray.exceptions import ActorUnavailableError

from operators.llm import stage as stage_module
from operators.llm.client import LLMCaller, LLMConfig, LLMRequest, Secret
from operators.llm.ratelimit import LeaseClient, LimiterUnavailable, RateLimiterCore, RateLimits
from operators.llm.stage import LLMStageActor, StageSpec
from operators.io.tables import envelope, split_envelopes

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["summary", "scores"],
          "properties": {"summary": {"type": "string", "minLength": 5},
                         "scores": {"type": "array", "minItems": 3, "maxItems": 3,
                                    "items": {"type": "integer", "minimum": 1, "maximum": 10}}}}
KEY = "sk-failure-test-KEY-0123456789abcdef"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class FakeHandle:
    """Stands in for the limiter's Ray actor handle. ``down``: every call fails as an unreachable actor
    does; ``hang``: calls never return; ``twice``: methods whose next call executes and then fails
    (Ray: "may or may not have been executed"), so the client repeats an executed call."""

    def __init__(self, core):
        self.core, self.down, self.hang, self.twice = core, False, False, set()
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        handle = self

        class Method:
            async def remote(self, *args):
                await asyncio.sleep(0)
                if handle.hang:
                    await asyncio.sleep(3600)
                if handle.down:
                    raise ActorUnavailableError("limiter unreachable (test)", None)
                handle.calls.append(name)
                result = getattr(handle.core, name)(*args)
                if name in handle.twice:
                    handle.twice.discard(name)
                    raise ActorUnavailableError("reply lost (test)", None)
                return result
        return Method()


def ask(i, tag="r"):
    return LLMRequest(item=f"{tag}{i}", schema=SCHEMA, schema_name="test_reply", cache_parts={"i": i, "tag": tag},
                      messages=[{"role": "system", "content": "You are terse."},
                                {"role": "user", "content": f"Request {tag}{i}. Change region: upper-left area"}])


# -- quirks: a reasoning model's 400s, with many requests in flight ---------------------------------
def test_a_reasoning_endpoint_costs_a_few_400s_per_pool_with_64_requests_in_flight(openai_server):
    """400 for max_tokens and for temperature != 1, 64 requests in flight over two callers (two actors)
    sharing one limiter: every request answered in strict json_schema mode, and the pool learns each
    quirk about once (a 400 for a parameter already adapted is simply sent again)."""
    openai_server.configure(reasoning=True, latency_ms=20)
    core = RateLimiterCore(RateLimits(max_in_flight=128))

    async def go():
        callers = [LLMCaller(LLMConfig(model="o-model", base_url=openai_server.base_url, backoff_base_s=0.02,
                                       temperature=0.7), Secret(KEY), lease=LeaseClient(core)) for _ in range(2)]
        try:
            return await asyncio.wait_for(asyncio.gather(*(callers[i % 2].call(ask(i)) for i in range(64))), 60)
        finally:
            for c in callers:
                await c.aclose()
    results = asyncio.run(go())
    assert [r.error for r in results if not r.ok] == []
    assert {r.response_format for r in results} == {"json_schema"}
    stats = openai_server.stats()
    assert stats["by_status"].get("400", 0) <= 4, stats["by_status"]
    last = stats["requests"][-1]
    assert last["response_format"]["json_schema"]["strict"] is True
    assert "max_completion_tokens" in last and "max_tokens" not in last and "temperature" not in last

    async def later_actor():          # an actor that starts later learns from the pool: no 400 at all
        caller = LLMCaller(LLMConfig(model="o-model", base_url=openai_server.base_url, temperature=0.7),
                           Secret(KEY), lease=LeaseClient(core))
        try:
            return await asyncio.wait_for(asyncio.gather(*(caller.call(ask(i, "late")) for i in range(16))), 60)
        finally:
            await caller.aclose()
    late = asyncio.run(later_actor())
    assert all(r.ok and r.attempts == 1 for r in late)
    assert openai_server.stats()["by_status"].get("400", 0) == stats["by_status"].get("400", 0)


# -- the limiter down, slow, or answering twice -----------------------------------------------------
def test_limiter_unreachable_past_its_wait_then_back_loses_no_capacity():
    clock = Clock()
    core = RateLimiterCore(RateLimits(rpm=6000, max_in_flight=4), clock)
    handle = FakeHandle(core)
    client = LeaseClient(handle, actor_wait_s=0.3)

    async def go():
        for _ in range(4):
            await asyncio.wait_for(client.acquire(0.0), 5)       # the in-flight cap, held
        handle.down = True
        for _ in range(4):
            client.release()                                     # they finish during the outage
        await asyncio.wait_for(client.flush(), 5)               # never raises: unsent counters are kept
        with pytest.raises(LimiterUnavailable):                  # a request asking now fails in bounded time
            await asyncio.wait_for(client.acquire(0.0), 5)
        handle.down = False
        clock.t += 61.0
        await asyncio.wait_for(client.acquire(0.0), 5)           # back: nothing held against the cap
        client.release()
        await asyncio.wait_for(client.flush(), 5)
    asyncio.run(go())
    granted = 0
    for _ in range(6000):                                        # the next minute reaches the limit
        clock.t += 0.01
        granted += core.lease([0.0] * 4)[0]
    assert granted >= 0.95 * 6000


def test_a_hung_limiter_fails_requests_in_bounded_time():
    handle = FakeHandle(RateLimiterCore(RateLimits(rpm=600)))
    handle.hang = True
    client = LeaseClient(handle, actor_wait_s=0.3)

    async def go():
        with pytest.raises(LimiterUnavailable):                  # not wait_for's TimeoutError: bounded by the client
            await asyncio.wait_for(client.acquire(0.0), 10)
    asyncio.run(go())


def test_repeated_lease_and_settle_calls_are_harmless():
    """A call that executed but whose reply was lost is repeated: a lease granted twice, a settle
    booked twice. Neither may shrink the pool for good nor let it over-grant to others."""
    clock = Clock()
    core = RateLimiterCore(RateLimits(rpm=6000, max_in_flight=4), clock)
    a_handle, b_handle = FakeHandle(core), FakeHandle(core)
    a, b = LeaseClient(a_handle, actor_wait_s=2.0), LeaseClient(b_handle, actor_wait_s=2.0)

    async def go():
        for _ in range(2):
            await asyncio.wait_for(b.acquire(0.0), 5)             # b holds 2
        a_handle.twice = {"lease", "settle", "report"}            # a's next calls run twice
        for _ in range(2):
            await asyncio.wait_for(a.acquire(0.0), 5)             # a holds 2: the cap is reached
        for _ in range(2):
            a.release()
        await asyncio.wait_for(a.flush(), 5)                      # a holds none, b still 2
    asyncio.run(go())
    clock.t += 0.1
    assert core.lease([0.0] * 8)[0] <= 2                           # b's 2 still count
    clock.t += 61.0
    b_release = [b.release() for _ in range(2)]
    asyncio.run(asyncio.wait_for(b.flush(), 5))
    assert len(b_release) == 2 and core.lease([0.0] * 8)[0] == 4   # and nothing leaked for good


def test_limiter_memory_stays_flat_over_a_long_run_without_429s():
    clock = Clock()
    core = RateLimiterCore(RateLimits(rpm=600_000, max_in_flight=64), clock)
    client = LeaseClient(FakeHandle(core), actor_wait_s=2.0)

    def size(obj, depth=0):
        if depth > 3:
            return 0
        if isinstance(obj, dict):
            return len(obj) + sum(size(v, depth + 1) for v in obj.values())
        if isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
            return len(obj) + sum(size(v, depth + 1) for v in list(obj)[:1000])
        if hasattr(obj, "__dict__") and not callable(obj):
            return size(vars(obj), depth + 1)
        return 0

    async def go():
        sizes = []
        for i in range(8_000):
            await client.acquire(10.0)
            client.release()
            await client.flush()
            clock.t += 0.05                                        # 20 requests/s for ~7 minutes
            if i in (2_000, 7_999):                                # both past the first 60 s window
                sizes.append(size(vars(core)))
        return sizes
    at_2k, at_8k = asyncio.run(go())
    assert at_8k <= at_2k + 50, (at_2k, at_8k)   # 6,000 more requests leave nothing behind


def test_rpm_of_one_grants_once_a_minute():
    clock = Clock()
    core = RateLimiterCore(RateLimits(rpm=1, max_in_flight=0), clock)
    grants = []
    for _ in range(200):
        if core.lease([0.0])[0]:
            grants.append(clock.t)
        clock.t += 1.0
    assert len(grants) >= 3, grants                                # about once a minute ...
    assert all(60.0 <= b - a <= 65.0 for a, b in zip(grants, grants[1:])), grants   # ... never twice in one


# -- no exception leaves a batch ---------------------------------------------------------------------
def build_request(record):
    return ask(record["i"], tag=record["tag"])


def handle_result(record, result):
    return [envelope("answers", {"item": record["tag"] + str(record["i"]), "summary": result.value["summary"]})]


def chain(server, key_source, cache_root=None, limiter_name=None):
    first = StageSpec(name="first", input_table="_ask", build_request=build_request,
                      handle_result=lambda rec, res: [envelope("_again", rec)],
                      llm=LLMConfig(model="test-model", base_url=server.base_url, timeout_s=2.0, backoff_base_s=0.02),
                      api_key=Secret(KEY), cache_root=cache_root, run_id="fail-run", job="failtest")
    second = StageSpec(**{**first.__dict__, "name": "second", "input_table": "_again", "handle_result": handle_result,
                          "build_request": lambda rec: ask(rec["i"], tag=rec["tag"] + "-again"),
                          "api_key": Secret.from_source(key_source), "limiter_name": limiter_name})
    return [first, second]


def run_batch(specs, n=4, tag="q"):
    actor = LLMStageActor(specs)
    rows = [envelope("_ask", {"i": i, "tag": tag}) for i in range(n)]
    out = asyncio.run(actor({"_table": [r["_table"] for r in rows], "_record": [r["_record"] for r in rows]}))
    return split_envelopes([{"_table": t, "_record": r} for t, r in zip(out["_table"], out["_record"])])


def test_an_unreadable_key_gives_error_rows_and_keeps_the_answers(openai_server, tmp_path):
    out = run_batch(chain(openai_server, f"file:{tmp_path / 'no-such-key'}"))
    assert sorted(u["stage"] for u in out["usage"]) == ["first"] * 4        # the first stage's answers are kept
    assert sorted(e["item"] for e in out["errors"]) == [f"q-again{i}" for i in range(4)]
    assert {e["stage"] for e in out["errors"]} == {"second"}
    assert all(e["error_type"] == "FileNotFoundError" and e["run_id"] == "fail-run" for e in out["errors"])


def test_a_limiter_that_cannot_be_found_or_reached_gives_error_rows(openai_server, tmp_path, monkeypatch):
    import ray

    def missing(name, namespace=None):
        raise ValueError(f"Failed to look up actor with name '{name}'")
    monkeypatch.setattr(ray, "get_actor", missing)
    key = tmp_path / "key"
    key.write_text(KEY)
    out = run_batch(chain(openai_server, f"file:{key}", limiter_name="changeforge-llm-missing"))
    assert sorted(u["stage"] for u in out["usage"]) == ["first"] * 4
    assert sorted(e["item"] for e in out["errors"]) == [f"q-again{i}" for i in range(4)]

    down = FakeHandle(RateLimiterCore(RateLimits(rpm=600)))
    down.down = True
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: down)
    monkeypatch.setattr(stage_module, "LeaseClient", functools.partial(LeaseClient, actor_wait_s=0.3))
    out = run_batch(chain(openai_server, f"file:{key}", limiter_name="changeforge-llm-down"))
    assert sorted(u["stage"] for u in out["usage"]) == ["first"] * 4 + ["second"] * 4
    assert sorted(e["item"] for e in out["errors"]) == [f"q-again{i}" for i in range(4)]
    assert "answers" not in out


def test_malformed_cache_entries_are_misses(openai_server, tmp_path):
    key = tmp_path / "key"
    key.write_text(KEY)
    specs = chain(openai_server, f"file:{key}", cache_root=str(tmp_path / "out"))
    assert len(run_batch(specs)["answers"]) == 4
    entries = sorted((tmp_path / "out").rglob("*.json"))
    assert len(entries) == 8
    for path, junk in zip(entries, ["[1, 2]", '"text"', "null", "3", '{"value": 1}', "{", "", '{"other": 1}']):
        path.write_text(junk)
    sent = openai_server.stats()["total"]
    out = run_batch(specs)
    assert sorted(a["item"] for a in out["answers"]) == [f"q{i}" for i in range(4)]
    assert "errors" not in out
    assert openai_server.stats()["total"] == sent + 8                          # every broken entry asked again


def test_non_numeric_usage_is_unknown_and_the_answer_is_kept(openai_server, tmp_path):
    openai_server.configure(usage_values={"prompt_tokens": "n/a", "completion_tokens": {"text": 3}})
    core = RateLimiterCore(RateLimits(rpm=6000, tpm=10_000_000, max_in_flight=8))

    async def go():
        caller = LLMCaller(LLMConfig(model="test-model", base_url=openai_server.base_url), Secret(KEY),
                           lease=LeaseClient(core))
        try:
            return await asyncio.wait_for(asyncio.gather(*(caller.call(ask(i)) for i in range(12))), 30)
        finally:
            await caller.aclose()
    results = asyncio.run(go())
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert all(r.prompt_tokens is None and r.cost_usd is None for r in results)
    assert core.lease([0.0] * 16)[0] == 8                                      # no permit left held
    json.dumps([r.value for r in results])
