"""The generic LLM stage in a Ray Data async actor pool: several actors share one rate limit.

Rates are measured from the test server's arrival timestamps, against the configured bound (with a
small tolerance for network jitter); nothing here asserts that anything is fast.
"""


import pickle
import threading
import time

import pytest

from operators.llm.client import LLMConfig, LLMRequest, Secret
from operators.llm.ratelimit import RateLimits, limiter_name, limiter_namespace, start_rate_limiter
from operators.llm.stage import PoolConfig, StageSpec, apply_llm_stage
from operators.io.tables import envelope, split_envelopes

SCHEMA = {"type": "object", "required": ["answer"], "additionalProperties": False,
          "properties": {"answer": {"type": "string", "minLength": 1}}}


def build_request(record):
    return LLMRequest(item=record["item"], schema=SCHEMA, schema_name="answer", cache_parts={"item": record["item"]},
                      messages=[{"role": "user", "content": f"Question {record['item']}: what changed? region: center"}])


def handle_result(record, result):
    return [envelope("answers", {"item": record["item"], "answer": result.value["answer"]})]


KEY = "sk-pool-test-key-0123456789"


def pool_spec(server, limiter_name, key_file):
    return StageSpec(name="test_stage", input_table="_ask", build_request=build_request, handle_result=handle_result,
                     llm=LLMConfig(model="test-model", base_url=server.base_url, timeout_s=5, backoff_base_s=0.05),
                     limiter_name=limiter_name, api_key=Secret.from_source(f"file:{key_file}"), run_id="pooltest",
                     limiter_namespace=limiter_namespace())


def run_pool(server, n, limits, limiter_name, key_file, actors=2, on_row=None, bound_s=240.0):
    """The rows out of a pool of ``actors``, and the limiter's stats at the end (``out["_limiter"]``).
    Fails (does not hang) if the rows are not all out within ``bound_s``."""
    import ray
    import ray.data
    # Keep the handle: the actor lives while it does. In this test's namespace (llm_namespace).
    limiter = start_rate_limiter(limiter_name, limits, namespace=limiter_namespace())
    spec = pool_spec(server, limiter_name, key_file)
    rows = [envelope("_ask", {"item": f"q{i}"}) for i in range(n)] + [envelope("other", {"x": 1})]
    pool = PoolConfig(actors=actors, concurrent_batches=4, batch_size=4)
    # As the jobs do (job_passes.configure_pipeline): rows go out once every actor is up, so work is
    # spread over the pool and not taken by whichever actor started first on a loaded machine. Set
    # before the dataset is made (it keeps the context it was made in), restored after the run.
    ctx = ray.data.DataContext.get_current()
    wait_before, ctx.wait_for_min_actors_s = ctx.wait_for_min_actors_s, min(pool.actor_start_timeout_s, int(bound_s))
    taken = []
    try:
        ds = apply_llm_stage(ray.data.from_items(rows, override_num_blocks=16), spec, pool)

        def take():
            for row in ds.iter_rows():
                taken.append(row)
                if on_row:
                    on_row(len(taken), limiter)
        reader = threading.Thread(target=take, daemon=True)
        reader.start()
        reader.join(bound_s)
    finally:
        ctx.wait_for_min_actors_s = wait_before
    assert not reader.is_alive(), f"the pool did not finish within {bound_s} s ({len(taken)} rows out)"
    out = split_envelopes(taken)
    deadline = time.time() + 60
    while True:   # a limiter killed near the end may still be restarting: ask it again, for a bounded time
        try:
            out["_limiter"] = ray.get(limiter.stats.remote(), timeout=60)
            break
        except ray.exceptions.ActorUnavailableError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)
    ray.kill(limiter)
    return out


@pytest.fixture()
def key_file(tmp_path):
    path = tmp_path / "openai-key"
    path.write_text(KEY + "\n")
    return path


def test_pool_answers_every_row_and_passes_others_through(ray_session, openai_server, key_file, llm_namespace):
    out = run_pool(openai_server, 40, RateLimits(max_in_flight=32), "limiter-rows", key_file)
    assert sorted(r["item"] for r in out["answers"]) == sorted(f"q{i}" for i in range(40))
    assert out["other"] == [{"x": 1}]
    assert len(out["usage"]) == 40 and all(u["status"] == "ok" for u in out["usage"])
    assert "errors" not in out


def test_pool_rate_stays_within_rpm_across_actors(ray_session, openai_server, key_file, llm_namespace):
    rpm = 600                                   # 10 requests/s for the whole pool
    limits = RateLimits(rpm=rpm, max_in_flight=64)
    out = run_pool(openai_server, 90, limits, "limiter-rpm", key_file, actors=2)
    assert len(out["answers"]) == 90
    workers = {u["worker"] for u in out["usage"]}
    assert len(workers) >= 2, workers           # the limit held across more than one actor

    times = sorted(openai_server.stats()["timestamps"])
    assert len(times) == 90
    burst = max(1.0, rpm / 60 * limits.burst_s)
    refill = (rpm - burst) / 60
    tolerance = 4                               # arrival jitter between grant and send (~0.4 s here)
    for width in (1.0, 3.0, 5.0):
        worst = max(sum(1 for t in times[i:] if t < t0 + width) for i, t0 in enumerate(times))
        assert worst <= burst + refill * width + tolerance, (width, worst)
    span = times[-1] - times[0]
    assert len(times) <= burst + refill * span + tolerance


def test_pool_survives_the_limiter_actor_dying(ray_session, openai_server, key_file, llm_namespace):
    """Killing the limiter mid-run: Ray restarts it, callers wait and carry on through the new
    instance, no row is lost, nothing hangs."""
    import ray
    openai_server.configure(latency_ms=30)
    killed = []

    def kill_once(n, limiter):
        if n == 10 and not killed:
            killed.append(ray.get(limiter.stats.remote(), timeout=30))
            ray.kill(limiter, no_restart=False)
    out = run_pool(openai_server, 200, RateLimits(rpm=6000, max_in_flight=16), "limiter-restart", key_file,
                   on_row=kill_once)
    assert killed
    assert sorted(r["item"] for r in out["answers"]) == sorted(f"q{i}" for i in range(200))
    assert "errors" not in out
    after = out["_limiter"]
    assert after["epoch"] != killed[0]["epoch"]                 # a new instance ...
    assert after["granted"] > 0 and after["released"] > 0, (killed, after)   # ... through which requests went


def test_limiter_name_and_spec_carry_no_key(openai_server, key_file):
    name = limiter_name(openai_server.base_url, KEY)
    assert KEY not in name and "127.0.0.1" in name
    assert name == limiter_name(openai_server.base_url + "/", KEY)        # one account, one budget
    assert name != limiter_name(openai_server.base_url, KEY + "x")
    assert name != limiter_name("https://api.openai.com/v1", KEY)
    # What an actor receives: the key's source, never its value (the object store may spill it).
    blob = pickle.dumps(pool_spec(openai_server, name, key_file))
    assert KEY.encode() not in blob
    assert pickle.loads(blob).api_key.get() == KEY


def prepare_question(item: dict) -> list[dict]:
    if item["item"] == "broken":
        raise ValueError("unreadable pair")
    if item["item"] == "no-mask":   # a prepare step's own error row: passed on untouched
        return [envelope("errors", {"item": "no-mask", "stage": "prepare", "message": "missing mask"})]
    return [envelope("_ask", item)]


def ask_again(record, result):
    return [envelope("_again", dict(record, first=result.value["answer"]))]


def test_chained_stages_in_one_actor_after_prepare(openai_server, key_file):
    # The captions/QA shape without Ray: work-list items are prepared in the actor, go through two
    # stages in one coroutine, and every item ends in exactly one table (a raising prepare included).
    import asyncio
    import json

    from operators.llm.stage import LLMStageActor
    first = pool_spec(openai_server, None, key_file)
    first.handle_result = ask_again
    second = StageSpec(**{**first.__dict__, "name": "again", "input_table": "_again",
                          "handle_result": handle_result})
    items = [{"item": f"q{i}"} for i in range(6)] + [{"item": "broken"}, {"item": "no-mask"}]
    actor = LLMStageActor([first, second], prepare_question, {})
    out = asyncio.run(actor({"item": [json.dumps(i) for i in items]}))
    tables = split_envelopes([{"_table": t, "_record": r} for t, r in zip(out["_table"], out["_record"])])
    assert sorted(r["item"] for r in tables["answers"]) == [f"q{i}" for i in range(6)]
    assert sorted((r["item"], r["stage"]) for r in tables["errors"]) == [("broken", "prepare"), ("no-mask", "prepare")]
    broken = next(r for r in tables["errors"] if r["item"] == "broken")
    assert "unreadable pair" in broken["message"] and broken["run_id"] == "pooltest"
    assert sorted(r["stage"] for r in tables["usage"]) == ["again"] * 6 + ["test_stage"] * 6
    assert set(tables) == {"answers", "errors", "usage"}   # no _ask/_again row left unanswered


def test_the_actor_closes_its_http_sessions_when_deleted():
    """Ray Data deletes the callable at a graceful shutdown: the sessions close on their own loop."""
    import asyncio
    import threading

    from operators.llm.stage import LLMStageActor

    closed = []

    class Caller:
        async def aclose(self):
            closed.append(threading.get_ident())

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        actor = LLMStageActor.__new__(LLMStageActor)
        actor.runners = [type("Runner", (), {"caller": Caller()})(), type("Runner", (), {"caller": None})()]
        actor._loop = loop
        actor.__del__()
        assert closed == [thread.ident]
        actor.__del__()                  # again (the collector after an explicit call): nothing to close
        assert closed == [thread.ident]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def test_the_actor_closes_its_http_sessions_on_a_stopped_loop():
    """At shutdown the actor's loop may have stopped without closing: nothing runs there, so the
    sessions are closed by running that loop here, not by waiting on it (a wait that only times out)."""
    import asyncio
    import threading

    from operators.llm.stage import LLMStageActor

    closed = []

    class Caller:
        async def aclose(self):
            closed.append(threading.get_ident())

    loop = asyncio.new_event_loop()
    try:
        actor = LLMStageActor.__new__(LLMStageActor)
        actor.runners = [type("Runner", (), {"caller": Caller()})()]
        actor._loop = loop
        actor.__del__()
        assert closed == [threading.get_ident()]
    finally:
        loop.close()


def test_a_test_s_detached_limiters_are_stopped_with_its_namespace(ray_session, llm_namespace):
    """The jobs start account limiters detached; the tests' namespace fixtures stop them when the
    test ends (``tests.conftest.stop_limiters``), so idle limiters do not pile up over a run."""
    import ray
    from tests.conftest import stop_limiters

    def here():
        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["namespace"] == llm_namespace)
    for name in ("acct-a", "acct-b"):
        start_rate_limiter(name, RateLimits(rpm=60), namespace=llm_namespace, detached=True)
    assert here() == ["acct-a", "acct-b"]
    assert stop_limiters(llm_namespace) == 2
    deadline = time.monotonic() + 30      # ray.kill returns before the GCS has the actors dead
    while here() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert here() == []
    assert stop_limiters(llm_namespace) == 0
