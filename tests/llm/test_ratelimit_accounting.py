"""The limiter's accounting (RateLimiterCore, pure, fake clock) at its edges: the fit rule, the budgets and
their caps, the window's trim, the waits it returns, give-backs, extra tokens, storms against scattered
429s, the probe after a pause, recovery, quota stops. Written against the mutants tools/mutation.py
showed surviving tests/llm/test_llm_ratelimit.py; a new file so it merges beside that one."""
from __future__ import annotations

import pytest

from operators.llm.ratelimit import RateLimiterCore, RateLimits, _fits


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def core_of(**limits):
    clock = Clock()
    return RateLimiterCore(RateLimits(**limits), clock), clock


def test_the_fit_rule_window_and_burst_at_their_boundaries():
    assert _fits(0, 0, 1, 10, 1) and _fits(9, 0.99, 1, 10, 1)          # exactly up to the cap
    assert not _fits(5, 1, 1, 10, 1)                                    # the burst is full
    assert not _fits(10, 0, 1, 10, 1) and not _fits(9.5, 0, 1, 10, 1)   # over the window's cap
    assert _fits(0, 0, 20, 10, 1)                                       # too big: alone in an empty window
    assert not _fits(0.5, 0, 20, 10, 1)


def test_budgets_per_limit_with_safety_factor_and_the_floor_of_one():
    core, clock = core_of(rpm=600, tpm=12000, safety=0.01)
    assert core._budgets(clock.t) == [(0, 0, 0, pytest.approx(594.0), pytest.approx(9.9)),
                                      (1, 0.0, 0.0, pytest.approx(11880.0), pytest.approx(198.0))]
    assert core.lease([10.0, 20.0, -5.0])[0] == 3                       # a negative estimate is charged 0
    assert core.in_log == [3, 30.0] and core.totals["tokens_charged"] == 30.0
    clock.t += 0.5
    assert core._budgets(clock.t) == [(0, 3, 3, pytest.approx(594.0), pytest.approx(9.9)),
                                      (1, 30.0, 30.0, pytest.approx(11880.0), pytest.approx(198.0))]
    clock.t += 0.6                                                      # out of the burst, still in the window
    assert core._budgets(clock.t)[0][1:3] == (3, 0)
    slow, _ = core_of(rpm=0.5, burst_s=2.0)
    assert slow._budgets(1000.0) == [(0, 0, 0, 1.0, 1.0)]              # under one a window: one
    assert core_of(tpm=0, rpm=0)[0]._budgets(1000.0) == []


def test_the_window_forgets_a_grant_exactly_window_s_later_and_grant_ids_keep_counting():
    core, clock = core_of(rpm=60, safety=0.0, max_in_flight=0, permit_ttl_s=1.0)
    assert core.window_s == 61.0
    first = core.lease([0.0])
    assert first == (1, 0.0, 0, 1.0, False, "")
    clock.t += 60.9
    core._trim(clock.t)
    assert core.in_log == [1, 0.0] and core.first_id == 0
    clock.t += 0.1                                                      # 61 s after: out
    assert core.lease([0.0])[:3] == (1, 0.0, 1)
    assert core.first_id == 1 and core.in_log == [1, 0.0] and len(core.log) == 1
    assert core_of(permit_ttl_s=2.0)[0].window_s == 62.0
    assert core_of(storm_window_s=100.0)[0].window_s == 100.0


def test_the_wait_returned_when_nothing_fits():
    core, clock = core_of(rpm=60, safety=0.0, max_in_flight=0)         # a burst of one per second
    assert core.lease([0.0] * 3)[0] == 1
    clock.t += 0.5
    assert core.lease([0.0]) == (0, 0.25, None, 1.0, False, "")        # 0.5 s to room: asks again at 0.25
    clock.t += 0.4
    assert core.lease([0.0])[1] == pytest.approx(0.1)
    clock.t += 0.0999
    assert core.lease([0.0])[1] == 0.005                               # never a busy loop
    empty = core_of()[0].lease([])                                     # nothing asked, empty log
    assert empty[0] == 0 and empty[1] == pytest.approx(0.05)
    full, _ = core_of(max_in_flight=2)
    assert full.lease([0.0] * 3, "a", 0)[0] == 2
    assert full.lease([0.0], "b", 0)[:2] == (0, 0.05)                  # no room in flight


def test_held_permits_count_per_client_and_a_report_replaces_them():
    core, clock = core_of(max_in_flight=10)
    assert core.lease([0.0] * 3, "a", 2)[0] == 3
    assert core.held["a"] == (5, clock.t) and core.in_flight(clock.t) == 5
    assert core.lease([0.0] * 9, "b", -4)[0] == 5                      # a negative holding counts as none
    assert core.held["b"] == (5, clock.t)
    core.report("a", -1)
    assert core.in_flight(clock.t) == 5 and "a" not in core.held
    clock.t += 30.0
    assert core.in_flight(clock.t) == 5                                # 30 s silent: still counted ...
    clock.t += 0.01
    assert core.in_flight(clock.t) == 0                                # ... over it, gone


def test_give_back_forgets_exactly_that_grant_and_never_one_already_trimmed():
    core, clock = core_of(max_in_flight=0)
    g1 = core.lease([1.0, 2.0, 3.0])[2]
    clock.t += 1.0
    g2 = core.lease([4.0])[2]
    assert (g1, g2) == (0, 1) and core.in_log == [4, 10.0]
    core.give_back(g1)
    assert core.in_log == [1, 4.0] and core.totals["given_back"] == 3
    core.give_back(g1)                                                 # repeated: nothing more
    core.give_back(7)                                                  # unknown: nothing
    assert core.in_log == [1, 4.0] and core.totals["given_back"] == 3
    clock.t += 61.0
    g3 = core.lease([5.0])[2]                                          # trims both; ids go on
    assert g3 == 2 and core.first_id == 2
    core.give_back(g2)                                                 # trimmed: must not hit g3's entry
    assert core.in_log == [1, 5.0] and core.totals["given_back"] == 3
    core.give_back(g3)
    assert core.in_log == [0, 0.0] and core.totals["given_back"] == 4


def test_give_back_after_a_trim_finds_its_grant_by_its_place_in_the_log():
    """Once the log's head is trimmed, a grant's place is its id less the first id kept (ids 1-3 over
    first id 1: places 0-2), whatever the ids' bits."""
    core, clock = core_of(max_in_flight=0)
    start, ids = clock.t, []
    for tokens in (1.0, 2.0, 4.0, 8.0):
        ids.append(core.lease([tokens])[2])
        clock.t += 10.0
    assert ids == [0, 1, 2, 3]
    clock.t = start + core.window_s + 5.0                              # the first grant (at start) leaves
    core.lease([16.0])
    assert core.first_id == 1 and core.in_log == [4, 30.0]
    core.give_back(ids[2])                                             # the 4-token grant, at place 1
    assert core.in_log == [3, 26.0] and core.totals["given_back"] == 1
    core.give_back(ids[1])
    assert core.in_log == [2, 24.0] and core.totals["given_back"] == 2


def test_extra_tokens_are_booked_in_the_window_and_nothing_else_is():
    core, clock = core_of(tpm=1000, safety=0.0, max_in_flight=0, burst_s=60.0)
    assert core.lease([100.0])[0] == 1
    assert core.report("c", 0, extra_tokens=850.0) == core.epoch
    assert core.in_log == [1, 950.0] and core.totals["tokens_charged"] == 950.0
    assert core.log[-1] == [clock.t, 0, 850.0]
    core.report("c", 0, extra_tokens=-300.0)                           # over-estimates are not refunded
    core.report("c", 0, extra_tokens=0.0)
    assert core.in_log == [1, 950.0] and len(core.log) == 2
    assert core.lease([60.0])[0] == 0 and core.lease([50.0])[0] == 1  # 950 + 50 = the cap
    clock.t += 61.0
    core.report("c", 0, extra_tokens=10.0)                             # trims before booking
    assert core.in_log == [0, 10.0] and len(core.log) == 1


def test_one_storm_pauses_and_slows_once_and_a_pause_is_waited_out():
    core, clock = core_of(rpm=100, pause_s=2.0, backoff_factor=0.5, min_factor=0.3)
    assert core.throttle() == 0.0
    assert core.factor == 0.5 and core.paused_until == clock.t + 2.0 and core.need_probe
    assert core.throttle(5.0) == 0.0                                   # the same storm: slower once only
    assert core.factor == 0.5 and core.paused_until == clock.t + 5.0 and core.totals["throttled"] == 2
    assert core.throttle(1.0) == 0.0 and core.paused_until == clock.t + 5.0   # never shortened
    clock.t += 1.0
    assert core.lease([0.0]) == (0, 4.0, None, 1.0, False, "")
    clock.t += 4.0                                                     # paused_until reached: a new storm
    core.throttle()
    assert core.factor == 0.3                                          # 0.25, floored at min_factor
    assert core.last_storm == clock.t


def test_scattered_429s_do_not_pause_until_they_are_a_fifth_of_the_recent_grants():
    core, clock = core_of(max_in_flight=0, pause_s=1.5)
    assert core.lease([0.0] * 50)[0] == 50
    for i in range(9):
        assert core.throttle() == 1.5, i                                # 9 < 0.2 x 50: the request waits alone
    assert core.throttle(3.0) == 0.0                                   # the 10th: a storm
    assert core.totals["scattered_429"] == 9 and core.factor == pytest.approx(0.7) and core.need_probe
    few, _ = core_of(max_in_flight=0)
    assert few.lease([0.0] * 19)[0] == 19
    assert few.throttle() == 0.0                                       # under 20 grants every 429 is a storm
    more, mclock = core_of(max_in_flight=0, pause_s=2.0)
    assert more.lease([0.0] * 20)[0] == 20
    assert more.throttle() == 2.0                                      # 20 grants: enough to tell
    mclock.t += 10.5                                                   # grants and 429s leave the window
    assert more.lease([0.0] * 20)[0] == 20
    for _ in range(3):
        assert more.throttle() == 2.0
    assert len(more.recent_429) == 3


def test_after_a_pause_one_probe_goes_and_the_rest_wait_for_its_answer():
    core, clock = core_of(max_in_flight=0, pause_s=1.0, probe_wait_s=130.0)
    core.throttle()
    clock.t += 1.0
    granted, wait, probe_id, _, probing, _ = core.lease([0.0] * 4)
    assert (granted, wait, probing) == (1, 0.0, True) and core.totals["probes"] == 1
    assert core.lease([0.0] * 4) == (0, 0.05, None, 1.0, False, "")    # its answer is awaited
    core.probe_answered(probe_id + 1)                                  # another grant's answer: no
    assert core.lease([0.0] * 4)[0] == 0
    clock.t += 130.0                                                   # unanswered that long: another goes
    again = core.lease([0.0] * 4)
    assert again[0] == 1 and again[4] is True and core.totals["probes"] == 2
    core.give_back(again[2])                                           # not sent: the next grant probes
    nxt = core.lease([0.0] * 4)
    assert nxt[0] == 1 and nxt[4] is True
    core.probe_answered(nxt[2])
    assert not core.need_probe and core.probe is None
    assert core.lease([0.0] * 4)[:2] == (4, 0.0)


def test_the_in_flight_cap_is_the_lever_without_rates_and_the_factor_recovers_step_by_step():
    core, clock = core_of(max_in_flight=10, pause_s=1.0, recover_s=10.0, recover_step=0.1)
    core.throttle()
    clock.t += 1.0
    probe = core.lease([0.0])
    core.probe_answered(probe[2])
    assert core.lease([0.0] * 10)[0] == 7                              # floor(10 x 0.7), the probe not held
    clock.t += 8.99                                                    # 9.99 s after the storm
    core.lease([])
    assert core.factor == pytest.approx(0.7)
    clock.t += 0.01
    core.lease([])
    assert core.factor == pytest.approx(0.8)
    clock.t += 25.0
    core.lease([])
    assert core.factor == pytest.approx(1.0) and core.stats()["factor"] == pytest.approx(1.0)
    clock.t += 100.0
    core.lease([])
    assert core.factor == 1.0                                          # never above
    rated, rclock = core_of(rpm=6000, max_in_flight=10, pause_s=1.0)
    rated.throttle()
    rclock.t += 1.0
    rated.probe_answered(rated.lease([0.0])[2])
    rclock.t += 1.0
    assert rated.lease([0.0] * 20)[0] == 10                            # with a rate, the rate is lowered


def test_a_quota_stop_holds_until_a_job_starts_and_keeps_its_first_reason():
    core, clock = core_of()
    core.stop("insufficient_quota " + "x" * 600)
    core.stop("another")
    assert core.stopped.startswith("insufficient_quota") and len(core.stopped) == 500
    assert core.lease([0.0], "a", 3) == (0, 0.0, None, 1.0, False, core.stopped)
    assert core.held["a"] == (3, clock.t)                              # the holding is still recorded
    core.start_job(RateLimits())
    assert core.stopped == "" and core.lease([0.0])[0] == 1


def test_new_limits_reset_the_pause_and_factor_the_same_ones_do_not():
    core, clock = core_of(rpm=100)
    core.throttle()
    core.update_limits(RateLimits(rpm=100))
    assert core.factor == pytest.approx(0.7) and core.need_probe and core.paused_until > clock.t
    core.update_limits(RateLimits(rpm=200))
    assert core.factor == 1.0 and not core.need_probe and core.probe is None
    assert core.lease([0.0])[:2] == (1, 0.0)
    assert core.in_log == [1, 0.0]                                     # what was granted still counts


def test_quirks_are_shared_and_the_confirmed_set_is_the_last_answered_one():
    core, _ = core_of()
    assert core.quirks("m") == ([], None)
    assert core.quirks("m", ["seed"]) == (["seed"], None)
    assert core.quirks("m", ["temperature"], confirmed=True) == (["seed", "temperature"], ["temperature"])
    assert core.quirks("m") == (["seed", "temperature"], ["temperature"])
    assert core.quirks("other") == ([], None)


def test_stats_report_the_totals_and_the_state():
    core, clock = core_of(max_in_flight=0)
    core.lease([2.0, 3.0], "a", 1)
    s = core.stats()
    assert (s["granted"], s["tokens_charged"], s["in_flight"], s["log_entries"], s["stopped"]) == (2, 5.0, 3, 1, "")
    assert s["factor"] == 1.0 and s["epoch"] == core.epoch and s["elapsed_s"] >= 0


def test_a_429_during_a_pause_belongs_to_the_storm_even_when_the_recent_share_is_low():
    # Requests sent before the pause answer 429 while it lasts: they extend it, never count as scattered.
    core, clock = core_of(max_in_flight=0, pause_s=1.5)
    assert core.lease([0.0] * 50)[0] == 50
    core.paused_until = clock.t + 30.0
    assert core.throttle(2.0) == 0.0 and core.need_probe
    assert core.factor == 1.0 and core.paused_until == clock.t + 30.0 and "scattered_429" not in core.totals


def test_the_wait_in_a_pause_is_the_time_left_whatever_the_clock_reads():
    clock = Clock()
    clock.t = 1.0                                                      # a monotonic clock soon after boot
    core = RateLimiterCore(RateLimits(pause_s=5.0), clock)
    core.throttle()
    clock.t = 2.0
    assert core.lease([0.0])[:2] == (0, 4.0)


def test_the_quota_stop_is_logged_once(caplog):
    core, _ = core_of()
    with caplog.at_level("ERROR", logger="operators.llm.ratelimit"):
        core.stop("insufficient_quota")
        core.stop("billing_hard_limit_reached")                        # a later reply: not logged again
    assert [r.getMessage() for r in caplog.records] == ["LLM account stopped: insufficient_quota"]


def test_when_the_window_is_full_the_wait_counts_only_grants_inside_the_burst():
    # rpm 2: the window's cap, not the burst, refuses the third; the grant exactly burst_s old is out of
    # the burst, so no room opens within it: ask again at the 0.25 s ceiling, not at once.
    core, clock = core_of(rpm=2, safety=0.0, max_in_flight=0)
    assert core.lease([0.0])[0] == 1
    clock.t += 1.0
    assert core.lease([0.0])[0] == 1
    clock.t += 1.0
    assert core.lease([0.0])[:2] == (0, 0.25)


def test_grant_ids_stay_sequential_while_the_window_trims():
    core, clock = core_of(max_in_flight=0)
    ids = []
    for _ in range(12):
        ids.append(core.lease([0.0])[2])
        clock.t += 20.0                                                # every third grant leaves the window
    assert ids == list(range(12)) and core.first_id == 8


# equivalent mutant: core/ReplaceBreakWithContinue on `break`: in _since and _next_change the log is in time order (each grant appended at the clock's now), so every entry after the first one at or before the start is also before it: continuing the scan changes nothing (in lease's loop the mutant never ends: a timeout, not a survivor)
