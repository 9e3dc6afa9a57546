"""The generic LLM stage in a Ray Data async actor pool: several actors share one rate limit.

Rates are measured from the test server's arrival timestamps, against the configured bound (with a
small tolerance for network jitter); nothing here asserts that anything is fast.
"""


from operators.llm.client import LLMConfig, LLMRequest, Secret
from operators.llm.ratelimit import RateLimits, start_rate_limiter
from operators.llm.stage import PoolConfig, StageSpec, apply_llm_stage
from operators.io.tables import envelope, split_envelopes

SCHEMA = {"type": "object", "required": ["answer"], "additionalProperties": False,
          "properties": {"answer": {"type": "string", "minLength": 1}}}


def build_request(record):
    return LLMRequest(item=record["item"], schema=SCHEMA, schema_name="answer", cache_parts={"item": record["item"]},
                      messages=[{"role": "user", "content": f"Question {record['item']}: what changed? region: center"}])


def handle_result(record, result):
    return [envelope("answers", {"item": record["item"], "answer": result.value["answer"]})]


def run_pool(server, n, limits, limiter_name, actors=2):
    import ray
    import ray.data
    limiter = start_rate_limiter(limiter_name, limits)  # keep the handle: the actor lives while it does
    spec = StageSpec(name="test_stage", input_table="_ask", build_request=build_request, handle_result=handle_result,
                     llm=LLMConfig(model="test-model", base_url=server.base_url, timeout_s=5, backoff_base_s=0.05),
                     limiter_name=limiter_name, api_key=Secret("sk-pool-test-key"), run_id="pooltest")
    rows = [envelope("_ask", {"item": f"q{i}"}) for i in range(n)] + [envelope("other", {"x": 1})]
    ds = ray.data.from_items(rows, override_num_blocks=16)
    ds = apply_llm_stage(ds, spec, PoolConfig(actors=actors, concurrent_batches=4, batch_size=4))
    out = split_envelopes(ds.take_all())
    ray.kill(limiter)
    return out


def test_pool_answers_every_row_and_passes_others_through(ray_session, openai_server):
    out = run_pool(openai_server, 40, RateLimits(max_in_flight=32), "limiter-rows")
    assert sorted(r["item"] for r in out["answers"]) == sorted(f"q{i}" for i in range(40))
    assert out["other"] == [{"x": 1}]
    assert len(out["usage"]) == 40 and all(u["status"] == "ok" for u in out["usage"])
    assert "errors" not in out


def test_pool_rate_stays_within_rpm_across_actors(ray_session, openai_server):
    rpm = 600                                   # 10 requests/s for the whole pool
    limits = RateLimits(rpm=rpm, max_in_flight=64)
    out = run_pool(openai_server, 90, limits, "limiter-rpm", actors=2)
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
