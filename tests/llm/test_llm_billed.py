"""Money shown as billed: cached prompt tokens at --price-per-mtok-cached (real time and batch, at the
batch discount), and usage the endpoint did not report shown as "+ unknown", never as 0."""
import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from operators.llm.batch import BatchAPI, BatchDriver, BatchSettings, BatchState
from operators.llm.cache import ResponseCache
from operators.llm.usage import Prices, format_summary, summarize_usage
from tests.llm.test_llm_money import KEY, caller_for, requests


def reference_cost(prompt, completion, cached, p_in, p_out, p_cached):
    """As a provider bills: uncached prompt tokens at the input price, cached ones at the cached price
    (the input price when none is given), completion at the output price."""
    if p_in is None and p_out is None:
        return None
    cached = min(cached or 0, prompt) if p_cached is not None else 0
    return ((prompt - cached) * (p_in or 0) + cached * (p_cached if p_cached is not None else 0)
            + completion * (p_out or 0)) / 1e6


price = st.one_of(st.none(), st.floats(0, 100, allow_nan=False))


@given(st.integers(0, 10**7), st.integers(0, 10**6), st.one_of(st.none(), st.integers(0, 10**7)), price, price,
       price, st.floats(0.01, 1))
def test_the_cost_equals_the_reference(prompt, completion, cached, p_in, p_out, p_cached, discount):
    prices = Prices(p_in, p_out, p_cached)
    assert prices.cost(prompt, completion, cached) == pytest.approx(
        reference_cost(prompt, completion, cached, p_in, p_out, p_cached))
    scale = lambda p: None if p is None else p * discount     # noqa: E731
    assert prices.scaled(discount).cost(prompt, completion, cached) == pytest.approx(
        reference_cost(prompt, completion, cached, scale(p_in), scale(p_out), scale(p_cached)))


LONG_PREFIX = " Shared instructions." * 400                    # ~2,000 tokens every request begins with


def test_cached_tokens_are_billed_at_the_cached_price_in_real_time_and_in_batches(openai_server, tmp_path):
    openai_server.configure(prefix_cache=True)
    prices = dict(price_per_mtok_in=2.0, price_per_mtok_out=8.0, price_per_mtok_cached=0.5)

    async def go(**kw):
        caller = caller_for(openai_server, **prices, **kw)
        try:
            return await asyncio.gather(*(caller.call(r) for r in requests(3, tag="cc", prefix=LONG_PREFIX)))
        finally:
            await caller.aclose()
    realtime = asyncio.run(go())
    assert sum(r.cached_tokens or 0 for r in realtime) >= 1024
    for r in realtime:
        assert r.cost_usd == pytest.approx(reference_cost(r.prompt_tokens, r.completion_tokens, r.cached_tokens,
                                                          2.0, 8.0, 0.5))
    # The same through a batch (a fresh server: its prefix cache empty, the batch's lines answered in order).
    openai_server.reset()
    state, cache = BatchState(str(tmp_path), "t"), ResponseCache(str(tmp_path))
    asyncio.run(go(cache=cache, batch=state))
    driver = BatchDriver(state, BatchAPI(openai_server.base_url, KEY, timeout_s=10), BatchSettings(poll_s=0.05))
    driver.submit(), driver.wait()
    answered = asyncio.run(go(cache=cache, batch=state))
    assert all(r.ok and r.batch_id for r in answered) and sum(r.cached_tokens or 0 for r in answered) >= 1024
    for r in answered:
        assert r.cost_usd == pytest.approx(reference_cost(r.prompt_tokens, r.completion_tokens, r.cached_tokens,
                                                          1.0, 4.0, 0.25))


def test_unknown_usage_shows_as_unknown_in_the_totals_and_on_the_progress_line():
    from operators.llm.job_summary import progress_line
    rows = [{"stage": "g", "attempts": 1, "cached": False, "status": "ok", "prompt_tokens": 100,
             "completion_tokens": 10, "cost_usd": 0.001, "usage_complete": True, "batch_id": ""},
            {"stage": "g", "attempts": 2, "cached": False, "status": "ok", "prompt_tokens": None,
             "completion_tokens": None, "cost_usd": None, "usage_complete": False, "batch_id": ""}]
    text = format_summary(summarize_usage(rows))
    assert "tokens: 100 prompt + 10 completion + unknown; cost $0.0010 + unknown (1 requests" in text
    known = format_summary(summarize_usage(rows[:1]))
    assert "unknown" not in known
    stats = {"released": 2, "cached": 0, "failed": 0, "in_flight": 0, "prompt_tokens": 100, "completion_tokens": 10,
             "cost_usd": 0.001, "usage_unknown": 1}
    line = progress_line(stats, 1.0, 5)
    assert "tokens 100+10 + unknown (1 requests), cost $0.0010 + unknown (1 requests)" in line
    assert "unknown" not in progress_line(dict(stats, usage_unknown=0), 1.0, 5)


def test_without_a_cache_a_batch_answer_is_booked_once_in_its_run(openai_server, tmp_path):
    """--no-cache --batch-api: the passes after the one that took an answer from its batch take it again
    (the next stage's pass runs the pair from the start); booked then, not again (once, not per pass)."""
    from operators.llm.client import DEFERRED
    from operators.llm.ratelimit import LeaseClient, RateLimiterCore, RateLimits
    state = BatchState(str(tmp_path), "t", "run1")
    core = RateLimiterCore(RateLimits(max_in_flight=4))

    async def one_pass():
        caller = caller_for(openai_server, batch=state, lease=LeaseClient(core), use_cache=False)
        caller.batch_run_id = "run1"
        try:
            return await asyncio.gather(*(caller.call(r) for r in requests(3, tag="nocache")))
        finally:
            await caller.aclose()
    assert all(r.error_type == DEFERRED for r in asyncio.run(one_pass()))
    driver = BatchDriver(state, BatchAPI(openai_server.base_url, KEY, timeout_s=10), BatchSettings(poll_s=0.05))
    driver.submit(), driver.wait()
    taken = asyncio.run(one_pass())
    assert all(r.ok and r.batch_id and r.cost_usd > 0 and not r.cached for r in taken)
    booked = core.totals["cost_usd"]
    again = asyncio.run(one_pass())
    assert all(r.ok and r.cached and r.cost_usd is None and r.extras["answered_in_run"] == "run1" for r in again)
    assert [r.value for r in again] == [r.value for r in taken]
    assert core.totals["cost_usd"] == pytest.approx(booked) and core.totals.get("cached") == 3
