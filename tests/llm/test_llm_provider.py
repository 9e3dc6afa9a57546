"""The LLM layer against provider behaviour (issue 11): tokens counted as providers count them, 429s
that slow the whole pool, a cache keyed on the rendered request, transient store errors, non-ASCII ids,
secrets by reference, request size bounds and the 400s / cut-offs / missing usage of real endpoints.
No Ray here: the limiter runs in-process (the same core the Ray actor runs)."""
import asyncio
import json
import pickle
import urllib.error
import urllib.request

import numpy as np
import pytest

from operators.llm.cache import ResponseCache
from operators.llm.client import LLMCaller, LLMConfig, LLMRequest, Secret
from operators.llm.images import data_url, image_part, image_token_rule, request_image_tokens
from operators.llm.ratelimit import LeaseClient, RateLimiterCore, RateLimits
from operators.llm.schema import schema_errors, strict_schema

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["summary", "scores"],
          "properties": {"summary": {"type": "string", "minLength": 5},
                         "scores": {"type": "array", "minItems": 3, "maxItems": 3,
                                    "items": {"type": "integer", "minimum": 1, "maximum": 10}}}}
KEY = "sk-provider-test-KEY-0123456789abcdef"


def ask(i, text="Change region: upper-left area", item=None, images=()):
    content = [{"type": "text", "text": f"Request {i}. {text}"}, *images] if images else f"Request {i}. {text}"
    return LLMRequest(item=item or f"r{i}", schema=SCHEMA, schema_name="test_reply", cache_parts={"i": i},
                      messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": content}])


def run(server, reqs, core=None, cache=None, **overrides):
    cfg = dict(model="test-model", base_url=server.base_url, timeout_s=2.0, max_retries=3, max_reasks=2,
               backoff_base_s=0.02)
    cfg.update(overrides)

    async def go():
        caller = LLMCaller(LLMConfig(**cfg), Secret(KEY), lease=LeaseClient(core), cache=cache)
        try:
            return await asyncio.gather(*(caller.call(r) for r in reqs))
        finally:
            await caller.aclose()
    return asyncio.run(go())


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def busiest_minute(charges):
    """The largest sum over any 60 s window of (time, amount) charges."""
    charges.sort()
    best, j, total = 0.0, 0, 0.0
    for t, n in charges:
        total += n
        while charges[j][0] <= t - 60.0:
            total -= charges[j][1]
            j += 1
        best = max(best, total)
    return best


# -- 1. tokens per minute as providers count them ---------------------------------------------------
def test_tpm_as_the_provider_counts_it_never_overruns_a_minute():
    """Each request is charged prompt + max_tokens on arrival (what the provider counts); replies use
    far less than the cap. A limiter that refunds the unused cap lets the next minute overrun."""
    clock, tpm = Clock(), 200_000
    core = RateLimiterCore(RateLimits(tpm=tpm, max_in_flight=0), clock)
    estimate, used = 500 + 1500, 500 + 200     # prompt + max_tokens; prompt + actual completion
    charges = []
    while clock.t < 1000 + 240:
        granted = core.lease([estimate] * 4)[0]
        charges += [(clock.t, estimate)] * granted
        if granted:    # replies far below the cap: nothing is refunded
            core.report("client", 0, extra_tokens=granted * (used - estimate))
        clock.t += 0.05
    assert busiest_minute(charges) <= tpm
    assert sum(n for _, n in charges) >= 0.95 * tpm * 4     # and the budget is used


def test_each_permit_is_charged_its_own_estimate(openai_server):
    core = RateLimiterCore(RateLimits(tpm=10_000_000, max_in_flight=0))
    small, big = ask(0), ask(1, text="Change region: center. " + "x" * 40_000)   # ~10k more prompt tokens
    run(openai_server, [small, big, ask(2)], core=core, max_tokens=100)
    charged = core.stats()["tokens_charged"]
    served = sum(n for _, n in openai_server.stats()["charges"])
    assert served > 10_000
    assert charged >= served                  # never less than the provider counted
    assert charged < 1.1 * served             # and not every permit at the largest estimate


def test_image_token_rules_per_model_family():
    mini, four_o = image_token_rule("gpt-4o-mini"), image_token_rule("gpt-4o-2024-08-06")
    assert mini.tokens(1024, 1024) == 2833 + 5667 * 4
    assert four_o.tokens(1024, 1024) == 85 + 170 * 4
    assert four_o.tokens(1024, 1024, "low") == 85
    assert image_token_rule("gpt-4.1-mini").tokens(1024, 1024) == int(np.ceil(1024 * 1.62))
    assert image_token_rule("my-model", "tile:100:200").tokens(512, 512) == 300
    assert image_token_rule("my-model", "gpt-4o-mini") == mini
    with pytest.raises(ValueError):
        image_token_rule("m", "tile:x")
    # Counted from the images actually in the request, at their size and detail.
    url = data_url(np.zeros((600, 1000, 3), np.uint8))
    msgs = [{"role": "user", "content": [image_part(url, "high"), image_part(url, "low")]}]
    assert request_image_tokens(msgs, four_o) == (85 + 170 * 4) + 85
    jpeg = data_url(np.zeros((300, 700, 3), np.uint8), "jpeg")
    assert request_image_tokens([{"role": "user", "content": [image_part(jpeg)]}], four_o) == 85 + 170 * 2


def test_caller_charges_images_by_the_model_family(openai_server):
    url = data_url(np.zeros((1024, 1024, 3), np.uint8))
    core = RateLimiterCore(RateLimits(tpm=100_000_000, max_in_flight=0))
    run(openai_server, [ask(0, images=[image_part(url, "high")])], core=core, model="gpt-4o-mini", max_tokens=100)
    assert core.stats()["tokens_charged"] >= 2833 + 5667 * 4 + 100


def _post(server, body):
    req = urllib.request.Request(f"{server.base_url}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers)


def test_test_server_counts_tpm_at_arrival_and_429s_over_the_limit(openai_server):
    openai_server.configure(tpm_limit=1000)
    body = {"model": "m", "max_tokens": 400, "messages": [{"role": "user", "content": "hi"}]}
    assert _post(openai_server, body)[0] == 200
    assert _post(openai_server, body)[0] == 200      # 2 x (400 + a few prompt tokens) < 1000
    status, headers = _post(openai_server, body)     # the cap counts, though the replies were short
    assert status == 429 and float(headers["Retry-After"]) >= 1
    assert len(openai_server.stats()["charges"]) == 2


# -- 2. a 429 slows the whole pool ------------------------------------------------------------------
def test_a_429_slows_the_whole_pool(openai_server):
    """The account allows 20 requests per 2 s; the pool was told twice that. Every request must get
    through, with the pool pausing and slowing down instead of each request retrying on its own."""
    openai_server.configure(rpm_limit=20, limit_window_s=2.0)
    core = RateLimiterCore(RateLimits(rpm=1200, max_in_flight=64, recover_s=30))
    results = run(openai_server, [ask(i) for i in range(80)], core=core, max_retries=3, max_rate_limit_retries=3)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    stats = openai_server.stats()
    assert stats["by_status"].get("429", 0) <= 40          # not a storm: 429s are a small share
    assert core.stats()["factor"] < 1.0                     # the pool learnt a lower rate


def test_throttle_pauses_then_recovers():
    clock = Clock()
    core = RateLimiterCore(RateLimits(rpm=600, max_in_flight=0, recover_s=10, recover_step=0.1), clock)
    assert core.lease([0.0] * 5)[0] == 5
    core.throttle(2.0)
    core.throttle(2.0)                                      # the same storm lowers the rate once
    assert core.factor == pytest.approx(0.7)
    n, wait = core.lease([0.0])[:2]
    assert n == 0 and wait == pytest.approx(2.0)
    clock.t += 2.2
    assert core.lease([0.0] * 20)[0] <= 600 / 60 * 0.7     # resumes at the lower pace, not with a burst
    clock.t += 31
    core.lease([0.0])
    assert core.factor == pytest.approx(1.0)


def test_scattered_429s_do_not_collapse_the_pool_but_a_storm_still_does():
    """10 % of requests refused at random (benchmarks/fault_load.py): each refused request waits its
    own Retry-After; the pool neither pauses nor slows. Pausing and slowing on each one drove the
    pool to its 5 % floor within seconds."""
    clock = Clock()
    core = RateLimiterCore(RateLimits(rpm=2400, max_in_flight=0), clock)   # room for 40/s
    for _ in range(4):                                      # 20 requests/s
        clock.t += 0.5
        assert core.lease([0.0] * 10)[0] == 10
    for _ in range(60):                                     # ... then one in ten refused
        clock.t += 0.5
        assert core.lease([0.0] * 9)[0] == 9
        assert core.throttle(1.0) == pytest.approx(1.0)     # the refused request waits alone
        assert core.lease([0.0])[0] == 1                    # ... and the pool is not paused
    assert core.factor == 1.0
    own_waits = [core.throttle(2.0) for _ in range(60)]     # then 60 refused at once: a storm
    assert own_waits[-1] == 0.0                             # the pool's pause covers the request
    assert core.factor == pytest.approx(0.7)
    n, wait = core.lease([0.0])[:2]
    assert n == 0 and wait == pytest.approx(2.0)


# -- 3. the cache is keyed on the rendered request --------------------------------------------------
def test_cache_key_covers_rendered_messages_and_endpoint(openai_server, tmp_path):
    cache = ResponseCache(str(tmp_path))
    run(openai_server, [ask(0)], cache=cache)
    assert openai_server.stats()["total"] == 1
    run(openai_server, [ask(0)], cache=cache)                               # same request: cached
    assert openai_server.stats()["total"] == 1
    run(openai_server, [ask(0, text="Change region: lower-right area")], cache=cache)  # edited prompt
    assert openai_server.stats()["total"] == 2
    run(openai_server, [ask(0)], cache=cache, base_url=openai_server.base_url.replace("127.0.0.1", "localhost"))
    assert openai_server.stats()["total"] == 3                              # another endpoint
    other = dict(SCHEMA, required=["summary"])
    req = ask(0)
    req.schema = other
    run(openai_server, [req], cache=cache)
    assert openai_server.stats()["total"] == 4                              # another schema
    img_a = image_part(data_url(np.zeros((8, 8, 3), np.uint8)))
    img_b = image_part(data_url(np.full((8, 8, 3), 255, np.uint8)))
    run(openai_server, [ask(5, images=[img_a])], cache=cache)
    run(openai_server, [ask(5, images=[img_b])], cache=cache)
    assert openai_server.stats()["total"] == 6                              # other image content


# -- 5. store errors, non-ASCII ids ----------------------------------------------------------------
class FlakyStore:
    """Raises the given errors on the first reads, then returns ``data``."""

    def __init__(self, errors, data=b'{"value": 2}'):
        self.errors, self.data, self.reads = list(errors), data, 0

    def read_bytes(self, rel):
        self.reads += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.data


def test_transient_store_errors_on_cache_reads_are_misses(tmp_path):
    from botocore.exceptions import ClientError, EndpointConnectionError
    slow_down = ClientError({"Error": {"Code": "SlowDown", "Message": "slow down"}}, "GetObject")
    unreachable = EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
    cache = ResponseCache(str(tmp_path), retry_s=0.001)
    cache.store = FlakyStore([slow_down, unreachable, unreachable])
    assert cache.get("ab" * 32) is None and cache.store.reads == 3      # a miss, not a crash
    cache.store = FlakyStore([slow_down])
    assert cache.get("ab" * 32) == {"value": 2}                          # retried, then read


def test_non_ascii_item_ids_are_sent(openai_server):
    item = "train/Zürich_北京_0001"
    (result,) = run(openai_server, [ask(0, item=item)])
    assert result.ok, result.error
    assert item in openai_server.stats()["items_by_key"].values()


# -- 7. secrets by reference, request size ---------------------------------------------------------
def test_secret_sources_pickle_as_references(tmp_path, monkeypatch):
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    s = Secret.from_source(f"file:{path}")
    assert s.get() == KEY and KEY not in repr(s)
    blob = pickle.dumps(s)
    assert KEY.encode() not in blob and pickle.loads(blob).get() == KEY
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    raw = Secret(KEY)                           # today's API: a raw value equal to the environment's
    blob = pickle.dumps(raw)
    assert KEY.encode() not in blob and pickle.loads(blob).get() == KEY
    with pytest.raises(TypeError):
        pickle.dumps(Secret("sk-some-other-key-12345678"))
    with pytest.raises(ValueError):
        Secret.from_source("http://example.com/key")


def test_secret_from_aws_secrets_manager(s3_endpoint):
    import boto3
    sm = boto3.client("secretsmanager")
    sm.create_secret(Name="changeforge/openai-test", SecretString=json.dumps({"api_key": KEY}))
    sm.create_secret(Name="changeforge/openai-plain", SecretString=KEY)
    assert Secret.from_source("aws-sm:changeforge/openai-test#api_key").get() == KEY
    s = Secret.from_source("aws-sm:changeforge/openai-plain")
    assert s.get() == KEY and KEY.encode() not in pickle.dumps(s)


def test_request_over_the_byte_bound_is_an_error_not_sent(openai_server):
    big = image_part(data_url(np.random.default_rng(0).integers(0, 255, (300, 300, 3), np.uint8)))
    (result,) = run(openai_server, [ask(0, images=[big])], max_request_bytes=100_000)
    assert not result.ok and result.error_type == "RequestTooLarge" and "MB" in result.error
    assert openai_server.stats()["total"] == 0
    (result,) = run(openai_server, [ask(0, images=[big])], max_request_bytes=2_000_000)
    assert result.ok


# -- 8. provider differences -------------------------------------------------------------------------
def test_rejected_max_tokens_and_temperature_are_adapted_once(openai_server):
    openai_server.configure(reject_params=["max_tokens", "temperature"])

    async def go():
        caller = LLMCaller(LLMConfig(model="o-model", base_url=openai_server.base_url, max_retries=1),
                           Secret(KEY))
        first = await caller.call(ask(0))
        rest = await asyncio.gather(*(caller.call(ask(i)) for i in range(1, 4)))
        await caller.aclose()
        return first, rest
    first, rest = asyncio.run(go())
    assert first.ok and first.attempts == 3, first.error            # two adaptations, then the answer
    assert all(r.ok and r.attempts == 1 for r in rest)               # learnt: no more 400s
    assert openai_server.stats()["by_status"]["400"] == 2
    sent = openai_server.stats()["requests"][-1]
    assert "max_completion_tokens" in sent and "temperature" not in sent and "max_tokens" not in sent


def test_cut_off_reply_is_re_asked_with_more_room(openai_server):
    (result,) = run(openai_server, [ask(0)], max_tokens=12, max_reasks=3)
    assert result.ok, result.error
    caps = [r.get("max_tokens") for r in openai_server.stats()["requests"]]
    assert caps[0] == 12 and caps[-1] > 12 and caps == sorted(caps)


def test_missing_usage_is_unknown_not_free(openai_server):
    openai_server.configure(omit_usage=True)
    (result,) = run(openai_server, [ask(0)], price_per_mtok_in=1.0, price_per_mtok_out=2.0)
    assert result.ok and result.prompt_tokens is None and result.cost_usd is None
    from operators.llm.stage import StageSpec, usage_record
    from operators.llm.usage import summarize_usage
    spec = StageSpec(name="s", input_table="t", build_request=None, handle_result=None, llm=LLMConfig())
    row = usage_record(spec, result)
    assert row["total_tokens"] is None and row["cost_usd"] is None
    assert summarize_usage([row])["usage_unknown"] == 1


def test_strict_json_schema_where_supported(openai_server):
    (result,) = run(openai_server, [ask(0)])
    assert result.ok and result.response_format == "json_schema"
    sent = openai_server.stats()["requests"][-1]["response_format"]["json_schema"]
    assert sent["strict"] is True and sent["schema"]["additionalProperties"] is False
    assert not schema_errors({"summary": "abcdef", "scores": [1, 2, 3]}, sent["schema"])
    # An endpoint without strict mode: plain json_schema, still validated here.
    openai_server.configure(reject_strict=True)
    (result,) = run(openai_server, [ask(1)])
    assert result.ok and result.response_format == "json_schema"
    assert openai_server.stats()["requests"][-1]["response_format"]["json_schema"]["strict"] is False


def test_strict_schema_closes_objects_and_makes_optional_fields_nullable():
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string", "minLength": 3}, "b": {"type": "integer"},
        "c": {"type": "object", "properties": {"d": {"type": "number"}}}}}
    s = strict_schema(schema)
    assert s["required"] == ["a", "b", "c"] and s["additionalProperties"] is False
    assert s["properties"]["b"]["type"] == ["integer", "null"] and "minLength" not in s["properties"]["a"]
    assert s["properties"]["c"]["additionalProperties"] is False and s["properties"]["c"]["required"] == ["d"]
    assert strict_schema({"type": "array"}) is None


def test_caption_mask_is_sent_at_low_detail():
    from operators.language.caption_ops import CaptionPrompts, build_generate_request
    from operators.language.captions import load_template
    prompts = CaptionPrompts(generate=load_template("caption_generate.v1"), judge=load_template("caption_judge.v1"),
                             detail="high")
    url = data_url(np.zeros((16, 16, 3), np.uint8))
    record = {"pair_id": "p", "car": 0.1, "change_region": "center", "components": 1, "hashes": {},
              "a_url": url, "b_url": url, "mask_url": url}
    parts = build_generate_request(prompts, record).messages[1]["content"]
    details = [p["image_url"]["detail"] for p in parts if p["type"] == "image_url"]
    assert details == ["high", "high", "low"]
