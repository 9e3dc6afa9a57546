"""operators.chain.plan.must_run: which steps a chain run runs, and the reason it prints (pure, quick)."""
from __future__ import annotations

from operators.chain.plan import must_run

ARGV = ["changeforge", "annotate", "ingest", "--export", "e.json"]
DONE = {"argv": ARGV, "fingerprint": "sha256:aa"}


def test_a_step_never_finished_runs_whatever_else_holds():
    for stale in (False, True):
        assert must_run(None, ARGV, "sha256:aa", stale) == (True, "not finished before")
        assert must_run(None, ARGV, None, stale) == (True, "not finished before")


def test_a_finished_step_is_skipped_only_with_the_same_command_line_input_and_nothing_rerun_before_it():
    assert must_run(DONE, ARGV, "sha256:aa", False) == (False, "finished earlier")
    # A step without a human input (fingerprint None) compares its command line only.
    assert must_run({"argv": ARGV}, ARGV, None, False) == (False, "finished earlier")
    assert must_run(DONE, ARGV, "sha256:aa", True) == (True, "an earlier step ran again")
    assert must_run(DONE, ARGV + ["--partial"], "sha256:aa", False) == (True, "its command line changed")
    assert must_run(DONE, ARGV[:-1], "sha256:aa", False) == (True, "its command line changed")
    assert must_run(DONE, ARGV, "sha256:bb", False) == (True, "its input changed (new work from people)")
    assert must_run(DONE, ARGV, "missing", False) == (True, "its input changed (new work from people)")


def test_the_fingerprint_is_compared_by_value_not_identity():
    # The state file's fingerprint is read back from JSON: equal to the fresh one, never the same object.
    fresh = "".join(["sha256:", "a" * 2])
    assert fresh == DONE["fingerprint"] and fresh is not DONE["fingerprint"]
    assert must_run(DONE, list(ARGV), fresh, False) == (False, "finished earlier")


def test_the_reasons_are_checked_in_order_stale_before_argv_before_input():
    changed_all = (DONE, ARGV + ["--x"], "sha256:bb")
    assert must_run(*changed_all, True) == (True, "an earlier step ran again")
    assert must_run(*changed_all, False) == (True, "its command line changed")


def test_a_finished_step_runs_again_when_its_pairs_inputs_changed_and_only_then():
    current = {"needs_run": False, "current": 11}
    changed = {"needs_run": True, "stale": 2}
    assert must_run(DONE, ARGV, "sha256:aa", False, current) == (False, "finished earlier")
    assert must_run(DONE, ARGV, "sha256:aa", False, changed) == (True, "its pairs' inputs changed since it ran")
    assert must_run(DONE, ARGV, "sha256:aa", False, {"error": "no output yet", "needs_run": False}) == \
        (False, "finished earlier")
    # the other reasons come first; a step never finished runs whatever its pairs say
    assert must_run(DONE, ARGV + ["--x"], "sha256:aa", False, changed) == (True, "its command line changed")
    assert must_run(None, ARGV, None, False, current) == (True, "not finished before")
