"""The pool's rate limiter: a rolling log of grants, with a fake clock."""
import asyncio

import pytest

from operators.llm.ratelimit import LeaseClient, RateLimiterCore, RateLimits


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def window_max(times, width):
    """The most events in any window of ``width`` seconds (an independent count over sorted times)."""
    times, best, j = sorted(times), 0, 0
    for i, t in enumerate(times):
        while times[j] <= t - width:
            j += 1
        best = max(best, i - j + 1)
    return best


def test_no_minute_exceeds_rpm_and_utilisation_is_high():
    clock = Clock()
    core = RateLimiterCore(RateLimits(rpm=600, max_in_flight=0), clock)
    grants = []
    while clock.t < 1130.0:
        grants += [clock.t] * core.lease([0.0] * 8)[0]
        clock.t += 0.05
    assert window_max(grants, 60.0) <= 600
    assert len(grants) >= 0.95 * 600 * 130 / 60
    assert window_max(grants, 1.0) <= 600 / 60 + 1          # paced: a second holds its share


def test_in_flight_cap_counts_what_each_client_says_it_holds():
    clock = Clock()
    core = RateLimiterCore(RateLimits(max_in_flight=5), clock)
    assert core.lease([0.0] * 8, "a", 0)[0] == 5
    assert core.lease([0.0], "b", 0)[:2] == (0, 0.05)
    core.report("a", 3)                                     # two of a's requests finished
    assert core.lease([0.0] * 8, "b", 0)[0] == 2
    core.report("a", 3)                                     # said again: nothing changes
    assert core.lease([0.0] * 8, "b", 2)[0] == 0


def test_a_silent_client_stops_counting():
    """An actor lost with its node never reports again: after ``client_silence_s`` its permits stop
    counting, even while other clients keep the limiter busy."""
    clock = Clock()
    core = RateLimiterCore(RateLimits(max_in_flight=4, client_silence_s=30.0), clock)
    assert core.lease([0.0] * 4, "lost", 0)[0] == 4
    for _ in range(29):
        clock.t += 1.0
        assert core.lease([0.0], "live", 0)[0] == 0
    clock.t += 1.5
    assert core.lease([0.0] * 8, "live", 0)[0] == 4


def test_tokens_per_minute_and_under_estimates():
    clock = Clock()
    core = RateLimiterCore(RateLimits(tpm=6000, max_in_flight=0, safety=0.0), clock)
    assert core.lease([2000.0] * 4)[0] == 1                 # the burst (100 tokens) is crossed by one
    core.report("c", 0, extra_tokens=3000.0)                # it used 3,000 more than estimated
    clock.t += 2.0
    assert core.lease([600.0])[0] == 1                      # 5,600 of 6,000 in the window
    clock.t += 2.0
    assert core.lease([600.0])[0] == 0                      # 6,200: over, until the window moves on
    clock.t += 58.0
    assert core.lease([600.0])[0] == 1


def test_request_bigger_than_the_limit_goes_alone_into_an_empty_window():
    clock = Clock()
    core = RateLimiterCore(RateLimits(tpm=600, max_in_flight=0, safety=0.0), clock)
    assert core.lease([5000.0] * 3)[0] == 1
    clock.t += 30.0
    assert core.lease([5000.0])[0] == 0


def test_report_books_usage_counters():
    core = RateLimiterCore(RateLimits(), Clock())
    core.lease([10.0, 10.0], "c", 0)
    core.report("c", 0, 0.0, {"released": 2, "prompt_tokens": 30, "completion_tokens": 7, "cost_usd": 0.5})
    s = core.stats()
    assert s["granted"] == 2 and s["released"] == 2 and s["prompt_tokens"] == 30 and s["in_flight"] == 0
    assert s["cost_usd"] == pytest.approx(0.5)


def test_permits_that_reach_a_starved_actor_late_are_given_back_and_no_minute_of_arrivals_overflows():
    """An actor starved of CPU 4 s of every 10 s: the grant it asked for just before a stall reaches
    it after the stall. Sent then, several such grants would arrive together; given back (the log
    forgets them) and asked again, the arrivals of any 60 s stay within the limit."""
    clock, rpm, ttl = Clock(), 600, 1.0
    core = RateLimiterCore(RateLimits(rpm=rpm, max_in_flight=0, permit_ttl_s=ttl), clock)
    sends, ask, stall_end, next_stall = [], None, 0.0, clock.t + 6.0
    start = clock.t
    while clock.t < start + 200.0:
        if clock.t >= stall_end:
            if ask is not None:
                asked, (granted, _, grant_id, *_) = ask
                if granted and clock.t - asked > ttl:
                    core.give_back(grant_id)
                else:
                    sends += [clock.t] * granted
            ask = (clock.t, core.lease([0.0] * 8))            # answered at once: the limiter is not starved
            if clock.t >= next_stall and ask[1][0]:           # the reply reaches the actor 4 s late
                stall_end, next_stall = clock.t + 4.0, clock.t + 10.0
        clock.t += 0.05
    assert core.totals["given_back"] > 0
    assert window_max(sends, 60.0) <= rpm
    assert len(sends) >= 0.5 * rpm * 200 / 60                 # 6 s of every 10 s running


async def until(condition, timeout_s: float) -> None:
    """Until ``condition()`` holds, checked at each turn of the event loop; TimeoutError after ``timeout_s``."""
    async def poll():
        while not condition():
            await asyncio.sleep(0.001)
    await asyncio.wait_for(poll(), timeout_s)


class _Handle:
    """A Ray actor handle stand-in whose lease replies take ``delay`` seconds the first ``slow`` times."""

    def __init__(self, core, slow, delay):
        self.core, self.slow, self.delay = core, slow, delay

    def __getattr__(self, name):
        handle = self

        class Method:
            async def remote(self, *args):
                if name == "lease" and handle.slow:
                    handle.slow -= 1
                    await asyncio.sleep(handle.delay)
                return getattr(handle.core, name)(*args)
        return Method()


def test_the_client_gives_late_grants_back_and_asks_again():
    core = RateLimiterCore(RateLimits(rpm=6000, max_in_flight=8, permit_ttl_s=0.2))
    client = LeaseClient(_Handle(core, slow=2, delay=0.3), actor_wait_s=5.0)

    async def go():
        await asyncio.wait_for(asyncio.gather(*(client.acquire(0.0) for _ in range(3))), 10)
        # The give-backs are sent in the background: until each has reached the limiter (bounded).
        await until(lambda: core.totals["given_back"] >= client.stale, 10)
    asyncio.run(go())
    assert client.stale == 6 and core.totals["given_back"] == 6
    assert core.totals["granted"] == 9 and core.in_log[0] == 3   # only the grants used still count
