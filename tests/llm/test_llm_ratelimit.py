"""Token-bucket bookkeeping of the pool's rate limiter, with a fake clock."""
import asyncio

import pytest

from operators.llm.ratelimit import LeaseClient, RateLimiterCore, RateLimits


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def drive(core, clock, seconds, step=0.01, ask=8, tokens=0.0):
    grants = []  # (time, n)
    end = clock.t + seconds
    while clock.t < end:
        n, _ = core.acquire(ask, tokens)
        if n:
            grants.append((clock.t, n))
            core.release(n)
        clock.t += step
    return grants


def window_max(grants, width):
    best = 0
    for i, (t0, _) in enumerate(grants):
        best = max(best, sum(n for t, n in grants[i:] if t < t0 + width))
    return best


def test_no_minute_exceeds_rpm_and_utilisation_is_high():
    clock = Clock()
    core = RateLimiterCore(RateLimits(rpm=600, max_in_flight=0), clock)
    grants = drive(core, clock, 130.0, step=0.05)
    assert window_max(grants, 60.0) <= 600
    total = sum(n for _, n in grants)
    assert total >= 0.95 * 600 * 130 / 60


def test_in_flight_cap_holds_until_release():
    clock = Clock()
    core = RateLimiterCore(RateLimits(rpm=0, max_in_flight=5), clock)
    assert core.acquire(8, 0)[0] == 5
    n, wait = core.acquire(1, 0)
    assert n == 0 and wait > 0
    core.release(2)
    assert core.acquire(8, 0)[0] == 2


def test_tokens_per_minute_and_usage_reconciliation():
    clock = Clock()
    core = RateLimiterCore(RateLimits(tpm=6000, max_in_flight=0, safety=0.0), clock)
    first, _ = core.acquire(100, 50)      # burst = 100 tokens: two requests of 50
    assert first == 2
    core.release(2, token_correction=+400)  # they really used 250 each: the bucket owes 400
    n, wait = core.acquire(1, 50)
    assert n == 0 and wait > 3.0           # 400 + 50 tokens at ~98 tokens/s
    clock.t += wait + 0.01
    assert core.acquire(1, 50)[0] == 1


def test_request_bigger_than_bucket_still_passes_when_full():
    clock = Clock()
    core = RateLimiterCore(RateLimits(tpm=600, max_in_flight=0, safety=0.0), clock)   # capacity 10 tokens
    assert core.acquire(3, 5000)[0] == 1


def test_release_books_usage_counters():
    core = RateLimiterCore(RateLimits(), Clock())
    core.acquire(2, 10)
    core.release(2, 0, {"prompt_tokens": 30, "completion_tokens": 7, "cost_usd": 0.5})
    s = core.stats()
    assert s["granted"] == 2 and s["released"] == 2 and s["prompt_tokens"] == 30 and s["in_flight"] == 0
    assert s["cost_usd"] == pytest.approx(0.5)


class _RemoteMethod:
    def __init__(self, handle, name):
        self.handle, self.name = handle, name

    async def remote(self, *args):
        await asyncio.sleep(0.01)          # a round trip: other coroutines run meanwhile
        return getattr(self.handle.core, self.name)(*args)


class FakeLimiterHandle:
    """Stands in for the Ray actor handle: every call awaits, and the core can be replaced (restart)."""

    def __init__(self, core):
        self.core = core

    def __getattr__(self, name):
        return _RemoteMethod(self, name)


def test_restart_hands_over_held_permits_once_even_when_lease_and_settle_both_notice():
    """After a limiter restart, a lease and a settle in flight at once both see the new epoch; the
    permits still held must be adopted once. Adopted twice, the in-flight count never comes back
    down and a pool at its in-flight cap waits forever (a CI hang in test_pool_survives_the_limiter)."""
    limits = RateLimits(rpm=0, max_in_flight=4)
    handle = FakeLimiterHandle(RateLimiterCore(limits))
    client = LeaseClient(handle, release_every_s=0.0)

    async def go():
        for _ in range(4):
            await client.acquire(0.0)                 # 4 permits held: the cap
        handle.core = RateLimiterCore(limits, restarted=True)   # killed and restarted
        client.release()                              # one request finishes: a settle goes out ...
        waiter = asyncio.ensure_future(client.acquire(0.0))   # ... while another asks for a permit
        await asyncio.wait_for(waiter, 5.0)
        await client.flush()
        for _ in range(4):
            client.release()
        await client.flush()
        return handle.core

    core = asyncio.run(go())
    assert core.in_flight == 0
    # The new instance also knows the minute's arrivals: the 4 sent before the restart (handed over)
    # and the one after, with nothing left counted as granted-but-not-yet-sent.
    assert core.window.sent_requests == 5 and core.window.unsent_requests == 0


def test_permits_held_through_a_stall_do_not_overfill_any_minute_of_arrivals():
    """An actor starved of CPU receives its permits late and sends them in a bunch. Grants are paced,
    but the provider counts arrivals: the limiter must cap those too (the sends it is told of, plus
    every permit not yet reported). Without that, the minute after each bunch holds ~640 of 600."""
    clock = Clock()
    rpm = 600
    core = RateLimiterCore(RateLimits(rpm=rpm, max_in_flight=0), clock, wall=clock)
    held, sends = 0, []
    start = clock.t
    while clock.t < start + 200.0:
        stalled = (clock.t - start) % 10.0 < 4.0          # 4 s of every 10 s the actor cannot run
        granted, _, epoch = core.lease([0.0] * 8, core.epoch)   # its lease calls still get answered
        held += granted
        if not stalled and held:
            core.settle(held, 0.0, None, epoch, [(clock.t, 0.0)] * held)   # all go out at once
            sends += [clock.t] * held
            held = 0
        clock.t += 0.01
    assert window_max([(t, 1) for t in sends], 60.0) <= rpm
    assert len(sends) >= 0.9 * rpm * 200 / 60              # and the pool still runs near the limit


def test_permits_of_a_lost_actor_are_let_go_while_the_others_run_on():
    """An actor lost with its node never reports or releases its permits. Its client falls silent; after
    ``client_silence_s`` the limiter lets its permits go (window and in-flight count), even while the
    other actors keep it busy: else every lost node shrinks the pool for good, and enough stop it."""
    clock = Clock()
    core = RateLimiterCore(RateLimits(rpm=60, max_in_flight=64, client_silence_s=600.0), clock)
    dead = 0
    for _ in range(700):                         # a minute's worth, to an actor that then dies
        dead += core.lease([10.0] * 4, core.epoch, "lost")[0]
        clock.t += 0.1
    assert dead == 59 and core.in_flight == 59

    def live_minute():
        got = 0
        for _ in range(600):                     # another actor asks every 0.1 s, and reports at once
            n = core.lease([10.0] * 8, core.epoch, "live")[0]
            core.settle(n, 0.0, None, core.epoch, [(clock.t, 10.0)] * n, (0, 0.0), "live")
            got += n
            clock.t += 0.1
        return got

    assert live_minute() == 0                    # the lost actor's permits still count ...
    for _ in range(10):
        live_minute()
    assert core.in_flight == 0 and core.window.unsent_requests == 0   # ... until its silence is long enough
    assert live_minute() >= 55                   # and the pool has its whole budget again
