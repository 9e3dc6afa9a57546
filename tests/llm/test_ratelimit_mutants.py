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
