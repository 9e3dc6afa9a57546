"""The limiter's storm accounting at an edge mutation testing (tools/mutation.py) found untested: 429s
older than the storm window are forgotten one by one, oldest first, even while a newer one is still
recent. Pure and quick (fake clock), beside tests/llm/test_ratelimit_accounting.py."""
from __future__ import annotations

from tests.llm.test_ratelimit_accounting import core_of


def test_429s_leave_the_storm_window_oldest_first_while_a_newer_one_stays():
    core, clock = core_of(max_in_flight=0, pause_s=1.5)
    start = clock.t
    assert core.lease([0.0] * 50)[0] == 50
    for _ in range(5):
        assert core.throttle() == 1.5                       # 5 < 0.2 x 50: scattered
    clock.t = start + 6.0
    assert core.throttle() == 1.5                           # 6 of 50: still scattered
    clock.t = start + 11.0                                  # the first 50 grants and five 429s are old
    assert core.lease([0.0] * 30)[0] == 30
    # the one at +6 s is recent, the five at the start are not: 2 of 30 recent grants, scattered (the
    # five kept would make 7, over 0.2 x 30, a storm)
    assert core.throttle() == 1.5
    assert list(core.recent_429) == [start + 6.0, start + 11.0]
    assert core.totals["scattered_429"] == 7 and core.factor == 1.0


def test_a_negative_holding_is_booked_as_none():
    core, _ = core_of(max_in_flight=0)
    # What a client says it holds, plus what this lease grants it: -3 counts as 0, then 1 granted.
    core.lease([0.0], client="actor-1", holding=-3)
    assert core.held["actor-1"][0] == 1
    core.lease([0.0], client="actor-1", holding=2)
    assert core.held["actor-1"][0] == 3
    core.throttle()                                   # a storm: the pool pauses, leases grant nothing
    assert core.lease([0.0], client="actor-1", holding=-3)[0] == 0
    assert core.held["actor-1"][0] == 0


def test_a_storm_s_warning_names_the_new_share_of_the_limits(caplog):
    import logging
    core, _ = core_of(max_in_flight=0, pause_s=1.5)
    assert core.lease([0.0] * 5)[0] == 5
    with caplog.at_level(logging.WARNING, logger="operators.llm.ratelimit"):
        core.throttle()                      # 5 grants < storm_min_requests: every 429 is a storm
    assert core.factor == 0.7
    assert "then at 70% of its limits" in caplog.text, caplog.text


# equivalent mutant: core/ReplaceComparisonOperator_Eq_LtE on `if self.probe is not None and self.probe[0] == grant_id:`: (<=) while a probe is out nothing else is granted, and a probe that went unanswered is replaced by a newer one: the probe is always the newest grant, so no grant id above it can be given back.
# equivalent mutant: core/ReplaceComparisonOperator_Lt_IsNot on `if cap < math.inf and not (self.limits.rpm > 0 or self.limits.tpm > 0):`: (is not) cap is max_in_flight, an int, or math.inf itself when it is 0: no other infinite float reaches the comparison.
# equivalent mutant: core/ReplaceUnaryOperator_USub_Not on `self.factor, self.paused_until = 1.0, -math.inf`: (not math.inf, i.e. 0) paused_until is compared with the clock, time.monotonic(), which is never negative (seconds since boot on Linux), so 0 and -inf both mean "no pause".
