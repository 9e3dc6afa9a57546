"""LLMCaller against the OpenAI-compatible test server: structured output, faults, re-asks, fallback,
cache. No Ray here: one asyncio loop in the test process."""
import asyncio


from operators.llm.cache import ResponseCache
from operators.llm.client import LLMCaller, LLMConfig, LLMRequest, Secret, redact

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["summary", "scores"],
          "properties": {"summary": {"type": "string", "minLength": 5},
                         "scores": {"type": "array", "minItems": 3, "maxItems": 3,
                                    "items": {"type": "integer", "minimum": 1, "maximum": 10}}}}
FAKE_KEY = "sk-changeforge-FAKE-KEY-0123456789"


def requests(n, tag="r"):
    return [LLMRequest(item=f"{tag}{i}", schema=SCHEMA, schema_name="test_reply", cache_parts={"i": i, "tag": tag},
                       messages=[{"role": "system", "content": "You are terse."},
                                 {"role": "user", "content": f"Request {tag}{i}. Change region: upper-left area"}])
            for i in range(n)]


def run_all(server, reqs, cache=None, **overrides):
    # A generous client timeout: on a loaded machine a reply can take over a second, and a retry would
    # turn `attempts == 1` into 2. Tests of timeouts set a short one (and server-side timeouts).
    cfg = dict(model="test-model", base_url=server.base_url, timeout_s=30.0, max_retries=4, max_reasks=2,
               backoff_base_s=0.02)
    cfg.update(overrides)

    async def go():
        caller = LLMCaller(LLMConfig(**cfg), Secret(FAKE_KEY), cache=cache)
        try:
            return await asyncio.gather(*(caller.call(r) for r in reqs))
        finally:
            await caller.aclose()
    return asyncio.run(go())


def test_replies_conform_to_the_schema_and_depend_on_the_request(openai_server):
    results = run_all(openai_server, requests(6))
    assert all(r.ok and r.attempts == 1 for r in results)
    assert all("upper-left" in r.value["summary"] for r in results)
    assert len({r.value["summary"] for r in results}) > 1
    assert all(r.prompt_tokens > 0 and r.completion_tokens > 0 for r in results)
    assert openai_server.stats()["total"] == 6


def test_429_retried_after_retry_after(openai_server):
    openai_server.configure(retry_after_s=1, faults=[{"kind": "429", "rate": 0.5}])
    results = run_all(openai_server, requests(12))
    assert all(r.ok for r in results)
    stats = openai_server.stats()
    assert stats["by_status"].get("429", 0) > 0
    gaps = [b - a for times in stats["times_by_key"].values() for a, b in zip(times, times[1:])]
    assert gaps and min(gaps) >= 0.95  # every retry waited for Retry-After (server-side clock)


def test_500_and_timeouts_retried(openai_server):
    openai_server.configure(timeout_s=3, faults=[{"kind": "500", "rate": 0.3}, {"kind": "timeout", "rate": 0.2}])
    results = run_all(openai_server, requests(16), timeout_s=0.5, max_retries=8)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    by_status = openai_server.stats()["by_status"]
    assert by_status.get("500", 0) > 0 and by_status.get("timeout", 0) > 0


def test_malformed_and_incomplete_replies_are_re_asked(openai_server):
    openai_server.configure(faults=[{"kind": "malformed", "rate": 0.25}, {"kind": "wrong_count", "rate": 0.25}])
    results = run_all(openai_server, requests(16), max_reasks=8)
    assert all(r.ok for r in results)
    assert any(r.attempts > 1 for r in results)
    # Tokens of the bad replies were paid too, and are counted.
    assert all(r.prompt_tokens > 0 for r in results)


def test_permanent_failures_become_error_results_not_exceptions(openai_server):
    openai_server.configure(faults=[{"kind": "malformed", "rate": 1.0, "match": "bad"},
                                    {"kind": "500", "rate": 1.0, "match": "down"}])
    bad, down = run_all(openai_server, requests(1, "bad") + requests(1, "down"), max_retries=2, max_reasks=2)
    assert not bad.ok and bad.error_type == "InvalidReply" and bad.attempts == 3
    assert not down.ok and down.error_type == "TransportError" and down.attempts == 3
    assert "500" in down.error
    for r in (bad, down):
        assert FAKE_KEY not in r.error


def test_json_schema_rejection_falls_back_to_json_mode(openai_server):
    openai_server.configure(reject_json_schema=True)
    results = run_all(openai_server, requests(4))
    assert all(r.ok and r.response_format == "json_object" for r in results)
    assert openai_server.stats()["by_status"]["400"] >= 1


def test_a_400_for_other_reasons_is_an_error_and_does_not_switch_to_json_mode(openai_server):
    openai_server.configure(faults=[{"kind": "400", "rate": 1.0}])

    async def go():
        caller = LLMCaller(LLMConfig(model="test-model", base_url=openai_server.base_url), Secret(FAKE_KEY))
        result = await caller.call(requests(1)[0])
        await caller.aclose()
        return caller, result
    caller, result = asyncio.run(go())
    assert not result.ok and result.error_type == "RequestRejected" and "HTTP 400" in result.error
    assert result.attempts == 2                                  # json_schema, then JSON mode once
    assert caller.response_format == "json_schema"


def test_cache_answers_without_sending(openai_server, tmp_path):
    cache = ResponseCache(str(tmp_path))
    first = run_all(openai_server, requests(5), cache=cache)
    sent = openai_server.stats()["total"]
    second = run_all(openai_server, requests(5), cache=cache)
    assert openai_server.stats()["total"] == sent == 5
    assert all(r.cached for r in second)
    assert [r.value for r in first] == [r.value for r in second]
    # A different parameter is a different question.
    run_all(openai_server, requests(5), cache=cache, temperature=0.1)
    assert openai_server.stats()["total"] == 10


def test_secret_and_redaction():
    s = Secret(FAKE_KEY)
    assert FAKE_KEY not in repr(s) and FAKE_KEY not in str(s) and FAKE_KEY not in f"{s}"
    text = f"Incorrect API key provided: {FAKE_KEY}; also sk-abc***********wxyz"
    cleaned = redact(text, s)
    assert FAKE_KEY not in cleaned and "sk-abc" not in cleaned
