"""Which steps a chain run runs: a step is skipped when it finished before with the same command line
and the same fingerprint of its human input, and nothing before it ran again in this run (a re-run
step's output is every later step's input); ``--from-step`` re-runs that step and every later one."""
from __future__ import annotations


def must_run(prev: dict | None, argv: list[str], fingerprint: str | None, stale: bool) -> tuple[bool, str]:
    """(run it?, why) for one step. ``prev``: its record in the state file (finished ones only)."""
    if prev is None:
        return True, "not finished before"
    if stale:
        return True, "an earlier step ran again"
    if prev.get("argv") != argv:
        return True, "its command line changed"
    if fingerprint is not None and prev.get("fingerprint") != fingerprint:
        return True, "its input changed (new work from people)"
    return False, "finished earlier"
