"""Money in the LLM layer: a request the provider may have billed is never booked as free nor sent more
than twice; a quota stops the pool; a storm's pause ends with one probe; late permits are bounded;
the cache key leaves the completion cap out (and old caches stay readable); provider batches answer
through the cache, and a batch never done stops the job at its maximum wait; the run summary counts
every request that did not succeed as failed. Against the test server (no Ray; the limiter's core in-process)."""
import asyncio
import functools
import time

import pytest

from operators.llm.batch import BatchAPI, BatchDriver, BatchSettings, BatchState, split_files
from operators.llm.cache import ResponseCache
from operators.llm.client import DEFERRED, LLMCaller, LLMConfig, LLMRequest, Secret
from operators.llm.ratelimit import LeaseClient, RateLimiterCore, RateLimits

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["summary", "scores"],
          "properties": {"summary": {"type": "string", "minLength": 5},
                         "scores": {"type": "array", "minItems": 3, "maxItems": 3,
                                    "items": {"type": "integer", "minimum": 1, "maximum": 10}}}}
KEY = "sk-money-test-KEY-0123456789abcdef"


def requests(n, tag="m", prefix=""):
    return [LLMRequest(item=f"{tag}{i}", schema=SCHEMA, schema_name="money", cache_parts={"i": i, "tag": tag},
                       messages=[{"role": "system", "content": "You are terse." + prefix},
                                 {"role": "user", "content": f"Request {tag}{i}. Change region: upper-left"}])
            for i in range(n)]


def caller_for(server, cache=None, lease=None, batch=None, **overrides):
    cfg = dict(model="test-model", base_url=server.base_url, timeout_s=1.0, max_retries=4, max_reasks=2,
               backoff_base_s=0.02, price_per_mtok_in=2.0, price_per_mtok_out=8.0)
    cfg.update(overrides)
    return LLMCaller(LLMConfig(**cfg), Secret(KEY), lease=lease, cache=cache, batch=batch)


def run_all(server, reqs, **kw):
    async def go():
        caller = caller_for(server, **kw)
        try:
            return await asyncio.gather(*(caller.call(r) for r in reqs))
        finally:
            await caller.aclose()
    return asyncio.run(go())


# -- 1. true usage ---------------------------------------------------------------------------------
def test_a_slow_reply_past_the_timeout_is_sent_at_most_twice_and_its_usage_is_unknown(openai_server):
    openai_server.configure(slow_s=2.5, faults=[{"kind": "slow", "rate": 1.0}])
    [result] = run_all(openai_server, requests(1), timeout_s=0.4, max_retries=6)
    assert not result.ok and result.error_type == "TransportError"
    assert openai_server.stats()["total"] == 2                 # the first send and one re-send, not seven
    assert result.attempts == 2
    # Both may be billed: unknown, never a known zero.
    assert result.prompt_tokens is None and result.completion_tokens is None and result.cost_usd is None
    assert result.usage_complete is False


def test_a_re_send_that_is_answered_keeps_the_usage_unknown(openai_server):
    openai_server.configure(slow_s=0.7, faults=[{"kind": "slow", "rate": 1.0}])
    [result] = run_all(openai_server, requests(1), timeout_s=0.4)   # the re-send waits 0.8 s
    assert result.ok and result.attempts == 2
    assert result.prompt_tokens is None and result.cost_usd is None and not result.usage_complete


def test_cached_and_reasoning_tokens_are_recorded_and_reasoning_effort_is_sent(openai_server):
    openai_server.configure(prefix_cache=True, usage_values={"completion_tokens_details": {"reasoning_tokens": 7}})
    long_prefix = " Shared instructions." * 400                     # ~2,000 tokens all requests begin with
    first, second = run_all(openai_server, requests(2, prefix=long_prefix), reasoning_effort="low")
    assert first.cached_tokens == 0 and second.cached_tokens >= 1024
    assert second.reasoning_tokens == 7
    assert all(r.get("reasoning_effort") == "low" for r in openai_server.stats()["requests"])


def test_the_run_summary_counts_a_rejected_request_as_failed(openai_server):
    """The line a job prints at its end: a request the endpoint refused (its usage row's status is
    ``error``, not ``failed``) is counted among the failed, not lost between ok and failed."""
    from operators.llm.stage import StageSpec, usage_record
    from operators.llm.usage import format_summary, summarize_usage
    openai_server.configure(faults=[{"kind": "400", "rate": 1.0, "match": "m1"}])
    results = run_all(openai_server, requests(3))
    assert [r.ok for r in results] == [True, False, True] and results[1].error_type == "RequestRejected"
    spec = StageSpec(name="caption_generate", input_table="t", build_request=None, handle_result=None,
                     llm=LLMConfig(model="test-model"))
    rows = [usage_record(spec, r) for r in results]
    assert [u["status"] for u in rows] == ["ok", "error", "ok"]
    summary = summarize_usage(rows)
    first = format_summary(summary).splitlines()[0]
    sent = openai_server.stats()["total"]
    assert first == f"requests: 3 logical, {sent} sent over HTTP, 0 answered from cache, 1 failed"
    assert summary["errors"] == 1


# -- 2. quota --------------------------------------------------------------------------------------
class _RecordedSleeps:
    """``asyncio`` as one module sees it, with every ``sleep`` it asks for recorded (and still slept)."""

    def __init__(self):
        self.delays: list[float] = []

    def __getattr__(self, name):
        return getattr(asyncio, name)

    async def sleep(self, delay, *args, **kwargs):
        self.delays.append(delay)
        return await asyncio.sleep(delay, *args, **kwargs)


def test_insufficient_quota_stops_the_pool_at_once(openai_server, monkeypatch):
    import operators.llm.client as client_module
    openai_server.configure(faults=[{"kind": "quota", "rate": 1.0}])
    core = RateLimiterCore(RateLimits(max_in_flight=2))
    waits = _RecordedSleeps()                                  # the caller's own waits: 429 waits, backoff
    monkeypatch.setattr(client_module, "asyncio", waits)

    async def go():
        caller = caller_for(openai_server, lease=LeaseClient(core), max_rate_limit_retries=30)
        try:
            # Bounded: a quota taken for a rate limit waits through 30 retries per request.
            results = await asyncio.wait_for(asyncio.gather(*(caller.call(r) for r in requests(12))), 20)
            later = await caller.call(requests(1, "later")[0])
            return results, later
        finally:
            await caller.aclose()
    results, later = asyncio.run(go())
    assert all(not r.ok and r.error_type == "QuotaExhausted" and "quota" in r.error for r in results)
    stats = openai_server.stats()
    assert stats["total"] <= 2                                 # what was in flight; nothing retried
    assert set(stats["seen_by_key"].values()) == {1}           # each request that went out, once
    assert later.error_type == "QuotaExhausted" and later.attempts == 0
    assert core.stopped and "insufficient_quota" in core.stopped
    # "At once": nothing waited. No request slept (a rate limit's wait or a backoff) before the pool
    # stopped, and the pool was never paused for a 429; the rest, waiting for a permit, failed on the
    # stop without being sent.
    assert waits.delays == []
    assert core.totals["throttled"] == 0
    core.start_job(core.limits)                                # the next job tries again
    assert core.lease([0.0])[0] == 1


# -- 3. the probe after a pause, late permits ------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_after_a_pool_wide_pause_one_probe_goes_first_and_the_rest_wait_for_its_answer():
    clock = Clock()
    core = RateLimiterCore(RateLimits(rpm=6000, max_in_flight=0, probe_wait_s=30), clock)
    assert core.lease([0.0] * 4)[0] == 4
    core.throttle(2.0)                                         # a storm: the pool pauses 2 s
    assert core.lease([0.0] * 8)[0] == 0
    clock.t += 2.1
    granted, _, probe_id, _, probe, _ = core.lease([0.0] * 8)
    assert granted == 1 and probe                              # the pause is over: one request only ...
    for _ in range(5):
        clock.t += 0.5
        assert core.lease([0.0] * 8)[0] == 0                   # ... and none until it is answered
    core.probe_answered(probe_id)
    assert core.lease([0.0] * 8)[0] > 1
    # A probe refused again starts a new pause and a new probe; one never answered is bounded.
    core.throttle(1.0)
    clock.t += 1.1
    assert core.lease([0.0] * 8)[:1] == (1,)
    clock.t += 31
    assert core.lease([0.0] * 8)[0] == 1                       # the lost probe's wait ran out: another one


def test_the_client_sends_one_probe_then_the_rest(openai_server):
    """Through the client: after a storm's pause exactly one request reaches the server before the
    probe's answer comes back."""
    core = RateLimiterCore(RateLimits(max_in_flight=64, probe_wait_s=30))
    core.throttle(0.5)                                         # paused from now for 0.5 s
    openai_server.configure(latency_ms=300)
    answered = []                                              # when the probe's answer reached the limiter
    probe_answered = core.probe_answered

    def record_answer(grant_id):
        answered.append(time.time())
        probe_answered(grant_id)
    core.probe_answered = record_answer

    async def go():
        caller = caller_for(openai_server, lease=LeaseClient(core))
        caller.confirmed = True                                # the quirks probe is not what is tested here
        try:
            return await asyncio.gather(*(caller.call(r) for r in requests(6)))
        finally:
            await caller.aclose()
    results = asyncio.run(go())
    assert all(r.ok for r in results)
    arrivals = openai_server.timestamps()                      # the server's time.time(): the same clock
    assert len(arrivals) == 6 and answered
    assert sum(a < answered[0] for a in arrivals) == 1         # the rest waited for the probe's reply
    assert len(answered) == 1 and core.totals["probes"] == 1


async def until(condition, timeout_s: float) -> None:
    """Until ``condition()`` holds, checked at each turn of the event loop; TimeoutError after ``timeout_s``."""
    async def poll():
        while not condition():
            await asyncio.sleep(0.001)
    await asyncio.wait_for(poll(), timeout_s)


class _SlowHandle:
    """A limiter handle whose every lease reply comes ``delay`` s late (later than the permit TTL)."""

    def __init__(self, core, delay):
        self.core, self.delay = core, delay

    def __getattr__(self, name):
        handle = self

        class Method:
            async def remote(self, *args):
                if name == "lease":
                    await asyncio.sleep(handle.delay)
                return getattr(handle.core, name)(*args)
        return Method()


def test_late_permits_are_given_back_a_bounded_number_of_times_then_used():
    core = RateLimiterCore(RateLimits(rpm=6000, max_in_flight=8, permit_ttl_s=0.1))
    client = LeaseClient(_SlowHandle(core, 0.15), actor_wait_s=5.0, max_give_backs=3)

    async def go():
        await asyncio.wait_for(client.acquire(0.0), 10)
        # The give-backs are sent in the background: until each has reached the limiter (bounded).
        await until(lambda: core.totals["given_back"] >= client.stale, 10)
    asyncio.run(go())
    assert client.stale == 3 and core.totals["given_back"] == 3 and client.holding == 1


# -- 4. the cache key ------------------------------------------------------------------------------
def test_raising_max_tokens_pays_nothing_again_and_an_old_cache_is_read(openai_server, tmp_path):
    cache = ResponseCache(str(tmp_path))
    run_all(openai_server, requests(3), cache=cache, max_tokens=1500)
    again = run_all(openai_server, requests(3), cache=cache, max_tokens=4000)
    assert all(r.cached for r in again) and openai_server.stats()["total"] == 3
    # An entry under the key of changeforge 0.1 (with the cap) is found and not paid again.
    old = ResponseCache(str(tmp_path / "old"))
    caller = caller_for(openai_server)
    for r, answer in zip(requests(3, "legacy"), again):
        old.put(caller.legacy_key_for(r), {"value": answer.value, "response_format": "json_schema"})
    asyncio.run(caller.aclose())
    legacy = run_all(openai_server, requests(3, "legacy"), cache=old)
    assert all(r.cached for r in legacy) and openai_server.stats()["total"] == 3


# -- 5. provider batches ---------------------------------------------------------------------------
def batch_pass(server, reqs, state, cache, **kw):
    return run_all(server, reqs, cache=cache, batch=state, **kw)


def driver_for(server, state, **settings):
    return BatchDriver(state, BatchAPI(server.base_url, KEY, timeout_s=10), BatchSettings(poll_s=0.05, **settings))


def test_split_files_respects_requests_and_bytes():
    lines = [b"x" * 40] * 10
    assert [len(f) for f in split_files(lines, 4, 10_000)] == [4, 4, 2]
    assert [len(f) for f in split_files(lines, 100, 100)] == [2] * 5
    with pytest.raises(ValueError, match="file limit"):
        split_files([b"x" * 200], 10, 100)


def test_batch_answers_equal_real_time_at_the_batch_price_and_a_rerun_sends_nothing(openai_server, tmp_path):
    realtime = run_all(openai_server, requests(5))
    openai_server.reset()
    state, cache = BatchState(str(tmp_path), "test"), ResponseCache(str(tmp_path))
    first = batch_pass(openai_server, requests(5), state, cache)
    assert all(r.error_type == DEFERRED for r in first) and openai_server.stats()["total"] == 0
    driver = driver_for(openai_server, state, max_requests_per_file=2)
    assert len(driver.submit()) == 3                           # 5 lines in files of at most 2
    assert driver.wait() == {"completed": 5, "failed": 0, "retried": 0, "open": 0}
    answered = batch_pass(openai_server, requests(5), state, cache)
    assert [r.value for r in answered] == [r.value for r in realtime]
    assert all(r.ok and r.batch_id.startswith("batch_") and not r.cached for r in answered)
    assert [r.cost_usd for r in answered] == pytest.approx([r.cost_usd / 2 for r in realtime])
    assert openai_server.stats()["total"] == 0                 # nothing went in real time
    rerun = batch_pass(openai_server, requests(5), state, cache)
    assert all(r.cached for r in rerun) and driver.submit() == []
    assert set(openai_server.stats()["batch_submissions"].values()) == {1}


def test_a_killed_driver_resumes_its_batches_without_submitting_them_again(openai_server, tmp_path):
    openai_server.configure(batch_delay_s=0.5)
    state, cache = BatchState(str(tmp_path), "test"), ResponseCache(str(tmp_path))
    batch_pass(openai_server, requests(4), state, cache)
    driver_for(openai_server, state).submit()                  # ... and the driver is killed here
    # The rerun: a new driver, new callers; the lines are deferred again and nothing is resubmitted.
    state2 = BatchState(str(tmp_path), "test")
    again = batch_pass(openai_server, requests(4), state2, cache)
    assert all(r.error_type == DEFERRED for r in again)
    resumed = driver_for(openai_server, state2)
    assert resumed.submit() == []                              # every line is in an open batch
    assert resumed.wait()["completed"] == 4
    done = batch_pass(openai_server, requests(4), state2, cache)
    assert all(r.ok for r in done)
    assert set(openai_server.stats()["batch_submissions"].values()) == {1}


def test_failed_lines_are_retried_once_then_error_rows_with_the_reason(openai_server, tmp_path):
    openai_server.configure(batch_fail_rate=1.0, batch_fail_code="server_error")
    state, cache = BatchState(str(tmp_path), "test"), ResponseCache(str(tmp_path))
    driver = driver_for(openai_server, state)
    batch_pass(openai_server, requests(3), state, cache)
    driver.submit()
    assert driver.wait()["retried"] == 3
    assert all(r.error_type == DEFERRED for r in batch_pass(openai_server, requests(3), state, cache))
    driver.submit()
    assert driver.wait()["failed"] == 3
    final = batch_pass(openai_server, requests(3), state, cache)
    assert all(r.error_type == "BatchFailed" and "server_error" in r.error for r in final)
    assert set(openai_server.stats()["batch_submissions"].values()) == {2}
    assert driver.submit() == [] and openai_server.stats()["total"] == 0   # a rerun sends nothing


def test_failed_lines_fall_back_to_real_time_once(openai_server, tmp_path):
    """--batch-fallback realtime: a line its batch failed is submitted in a batch once and then sent once
    in real time (booked at the real-time price), never a second batch nor a second real-time send."""
    openai_server.configure(batch_fail_rate=1.0)
    state, cache = BatchState(str(tmp_path), "test"), ResponseCache(str(tmp_path))
    driver = driver_for(openai_server, state, fallback="realtime")
    batch_pass(openai_server, requests(3), state, cache)
    assert len(driver.submit()) == 1
    assert driver.wait() == {"completed": 0, "failed": 0, "retried": 3, "open": 0}
    results = batch_pass(openai_server, requests(3), state, cache)
    assert all(r.ok and not r.batch_id for r in results)
    stats = openai_server.stats()
    assert stats["total"] == 3 and sorted(stats["seen_by_key"].values()) == [1, 1, 1]
    assert len(stats["batch_submissions"]) == 3 and set(stats["batch_submissions"].values()) == {1}
    assert [r.cost_usd for r in results] == pytest.approx(                       # the real-time price, not half
        [(r.prompt_tokens * 2.0 + r.completion_tokens * 8.0) / 1e6 for r in results])
    assert driver.submit() == [] and driver.wait()["open"] == 0
    again = batch_pass(openai_server, requests(3), state, cache)
    assert all(r.cached for r in again) and openai_server.stats()["total"] == 3


class _FakeTime:
    """The batch driver's clock and sleep: a sleep moves the clock, nothing waits. A wait past
    ``ceiling`` is refused at once (a runaway wait fails the test instead of polling for weeks)."""

    def __init__(self, ceiling: float):
        self.t, self.ceiling = 0.0, ceiling

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        assert self.t + s <= self.ceiling, f"still waiting at {self.t + s:.0f} s (--batch-max-wait-s was exceeded)"
        self.t += s


def test_a_batch_never_done_stops_the_job_at_its_maximum_wait(openai_server, tmp_path, monkeypatch):
    """--batch-max-wait-s 600 with polls every 30 s: a batch the provider never finishes ends the
    wait after 600 s (at most one poll more), as BatchesOpen with the rerun hint, its lines kept."""
    from operators.io.storage import Store
    from operators.llm import job_passes
    from operators.llm.job_options import LLMJobConfig
    from operators.llm.job_passes import BatchesOpen, run_llm_job, stop_line
    from operators.llm.stage import StageSpec
    openai_server.configure(batch_hold=True)                   # the batch stays in progress
    state, cache = BatchState(str(tmp_path), "caption"), ResponseCache(str(tmp_path))
    batch_pass(openai_server, requests(2, tag="never"), state, cache)
    assert len(driver_for(openai_server, state).submit()) == 1   # ... and the driver is killed here
    max_wait, poll = 600.0, 30.0
    fake = _FakeTime(ceiling=10 * max_wait)
    monkeypatch.setattr(job_passes, "BatchDriver", functools.partial(BatchDriver, sleep=fake.sleep, clock=fake))
    cfg = LLMJobConfig(output=str(tmp_path), model="test-model", base_url=openai_server.base_url, batch_api=True,
                       batch_poll_s=poll, batch_max_wait_s=max_wait)
    spec = StageSpec(name="caption_generate", input_table="pairs", build_request=None, handle_result=None,
                     llm=LLMConfig(model="test-model", base_url=openai_server.base_url), api_key=Secret(KEY))
    with pytest.raises(BatchesOpen) as stopped:
        run_llm_job(cfg, [{"pair_id": "never0"}], None, {}, [spec], None, None, out=Store(str(tmp_path)),
                    job="caption", run_id="r1")
    assert max_wait <= fake.t <= max_wait + poll, fake.t
    assert stop_line(stopped.value) == "stopped: 1 batches still open after --batch-max-wait-s; rerun to poll them"
    assert [b["done"] for b in state.batches()] == [False] and len(state.keys("lines")) == 2   # a rerun polls it
    assert set(openai_server.stats()["batch_submissions"].values()) == {1} and openai_server.stats()["total"] == 0


def test_export_and_import_through_files(openai_server, tmp_path):
    """The offline path (vllm run-batch): the waiting lines out to a file, the replies in from one."""
    import json
    state, cache = BatchState(str(tmp_path), "test"), ResponseCache(str(tmp_path))
    batch_pass(openai_server, requests(2), state, cache)
    driver = BatchDriver(state, None, BatchSettings())
    path = tmp_path / "in.jsonl"
    assert driver.export_lines(str(path)) == 2
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert {line["url"] for line in lines} == {"/v1/chat/completions"}
    # What an offline runner writes back (answered here by the test server in real time).
    import urllib.request
    out = []
    for line in lines:
        req = urllib.request.Request(openai_server.base_url + "/chat/completions", json.dumps(line["body"]).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            out.append({"id": "x", "custom_id": line["custom_id"], "error": None,
                        "response": {"status_code": 200, "body": json.loads(resp.read())}})
    (tmp_path / "out.jsonl").write_text("".join(json.dumps(o) + "\n" for o in out))
    assert driver.import_results(str(tmp_path / "out.jsonl"))["completed"] == 2
    results = batch_pass(openai_server, requests(2), state, cache)
    assert all(r.ok and r.batch_id.startswith("import:") for r in results)


def test_a_batch_file_holds_one_model(openai_server, tmp_path):
    state, cache = BatchState(str(tmp_path), "test"), ResponseCache(str(tmp_path))
    batch_pass(openai_server, requests(2, "gen"), state, cache, model="generator")
    batch_pass(openai_server, requests(2, "judge"), state, cache, model="judge")
    driver = driver_for(openai_server, state)
    assert len(driver.submit()) == 2
    for b in state.batches():
        models = {state.read("lines", k)["body"]["model"] for k in b["custom_ids"]}
        assert len(models) == 1


def test_a_cut_off_batch_reply_is_asked_again_once_with_more_room_then_booked_with_it(openai_server, tmp_path):
    # max_tokens 24: every reply is cut off at its cap; its re-ask with 48 fits.
    state, cache = BatchState(str(tmp_path), "test"), ResponseCache(str(tmp_path))
    reqs = lambda: requests(3, tag="cut")                      # noqa: E731
    driver = driver_for(openai_server, state)
    assert all(r.error_type == DEFERRED for r in batch_pass(openai_server, reqs(), state, cache, max_tokens=24))
    driver.submit(), driver.wait()
    first_keys = set(openai_server.stats()["batch_submissions"])
    second = batch_pass(openai_server, reqs(), state, cache, max_tokens=24)
    assert all(r.error_type == DEFERRED for r in second)       # the re-asks wait for their own batch
    assert len(driver.submit()) == 1 and driver.wait()["completed"] == 3
    submitted = openai_server.stats()["batch_submissions"]
    assert len(submitted) == 6 and set(submitted.values()) == {1}   # three lines, three re-asks: each once
    reask_keys = set(submitted) - first_keys
    bodies = [state.read("results", k)["body"] for k in reask_keys]
    assert {b["choices"][0]["finish_reason"] for b in bodies} == {"stop"}
    done = batch_pass(openai_server, reqs(), state, cache, max_tokens=24)
    assert all(r.ok and r.attempts == 2 for r in done)
    # Both lines were billed: the usage is the sum of the cut-off reply's and the re-ask's, at the batch price.
    cut_usage = [state.read("results", k)["body"]["usage"] for k in first_keys]
    reask_usage = [b["usage"] for b in bodies]
    assert sum(r.prompt_tokens for r in done) == sum(u["prompt_tokens"] for u in cut_usage + reask_usage)
    assert sum(r.completion_tokens for r in done) == 3 * 24 + sum(u["completion_tokens"] for u in reask_usage)
    assert [r.cost_usd for r in done] == pytest.approx(
        [(r.prompt_tokens * 2.0 + r.completion_tokens * 8.0) / 1e6 / 2 for r in done])
    again = batch_pass(openai_server, reqs(), state, cache, max_tokens=24)
    assert all(r.cached for r in again) and driver.submit() == [] and openai_server.stats()["total"] == 0


def test_a_batch_reply_cut_off_again_after_its_re_asks_is_an_error_with_the_reason(openai_server, tmp_path):
    """As real time: cut off at 4, asked again with 8, then 16 (the ceiling, 4x --max-tokens; --max-reasks
    2), each a line of its own; cut off every time, the pair's error row says so, all three billed."""
    state, cache = BatchState(str(tmp_path), "test"), ResponseCache(str(tmp_path))
    driver = driver_for(openai_server, state)
    for _ in range(3):
        assert all(r.error_type == DEFERRED for r in batch_pass(openai_server, requests(2, tag="tiny"), state, cache,
                                                                 max_tokens=4))
        driver.submit(), driver.wait()
    final = batch_pass(openai_server, requests(2, tag="tiny"), state, cache, max_tokens=4)
    assert all(not r.ok and r.error_type == "InvalidReply" for r in final)
    assert all("cut off at 16 tokens after a re-ask with more room" in r.error for r in final)
    assert all(r.attempts == 3 and r.completion_tokens == 4 + 8 + 16 and r.cost_usd > 0 for r in final)
    assert set(openai_server.stats()["batch_submissions"].values()) == {1} and driver.submit() == []


def test_a_cut_off_batch_reply_whose_re_ask_fails_goes_on_in_real_time_and_both_are_booked(openai_server, tmp_path):
    """--batch-fallback realtime on a re-ask: the cut-off line (billed at the batch price) and the real-time
    re-ask with twice the room (billed at the real-time price) are one logical request, sent once each."""
    state, cache = BatchState(str(tmp_path), "test"), ResponseCache(str(tmp_path))
    reqs = lambda: requests(2, tag="cutrt")                    # noqa: E731
    driver = driver_for(openai_server, state, fallback="realtime")
    assert all(r.error_type == DEFERRED for r in batch_pass(openai_server, reqs(), state, cache, max_tokens=24))
    driver.submit(), driver.wait()                             # answered, cut off at 24
    first_keys = set(openai_server.stats()["batch_submissions"])
    assert all(r.error_type == DEFERRED for r in batch_pass(openai_server, reqs(), state, cache, max_tokens=24))
    openai_server.configure(batch_fail_rate=1.0)               # the re-asks' batch fails every line once
    driver.submit()
    assert driver.wait()["retried"] == 2
    assert openai_server.stats()["total"] == 0
    openai_server.configure(batch_fail_rate=0.0)
    done = batch_pass(openai_server, reqs(), state, cache, max_tokens=24)
    assert all(r.ok and r.batch_id for r in done), [(r.error_type, r.error) for r in done]
    assert openai_server.stats()["total"] == 2                 # each re-ask once in real time
    cut_usage = [state.read("results", k)["body"]["usage"] for k in first_keys]
    cut_prompt = sum(u["prompt_tokens"] for u in cut_usage)
    assert sum(r.completion_tokens for r in done) > 2 * 24 and all(r.attempts == 2 for r in done)
    # The cut-off replies at the batch price (half), the rest at real time's: more than all at the batch price,
    # less than all at real time's.
    realtime_part = sum((r.prompt_tokens * 2.0 + r.completion_tokens * 8.0) / 1e6 for r in done) - \
        (cut_prompt * 2.0 + 2 * 24 * 8.0) / 1e6
    assert sum(r.cost_usd for r in done) == pytest.approx((cut_prompt * 2.0 + 2 * 24 * 8.0) / 1e6 / 2 + realtime_part)
    again = batch_pass(openai_server, reqs(), state, cache, max_tokens=24)
    assert all(r.cached for r in again) and driver.submit() == [] and openai_server.stats()["total"] == 2


def test_a_batch_reply_without_usage_is_booked_unknown_not_free(openai_server, tmp_path):
    openai_server.configure(omit_usage=True)
    state, cache = BatchState(str(tmp_path), "test"), ResponseCache(str(tmp_path))
    driver = driver_for(openai_server, state)
    batch_pass(openai_server, requests(2, tag="nousage"), state, cache)
    driver.submit(), driver.wait()
    core = RateLimiterCore(RateLimits(max_in_flight=4))
    done = batch_pass(openai_server, requests(2, tag="nousage"), state, cache, lease=LeaseClient(core))
    assert all(r.ok and r.batch_id and r.prompt_tokens is None and r.cost_usd is None for r in done)
    assert core.totals.get("usage_unknown") == 2 and core.totals.get("cost_usd") == 0.0   # the progress line's
