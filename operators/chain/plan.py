"""Which steps a chain run runs: a step is skipped when it finished before with the same command line
and the same fingerprint of its human input, and nothing before it ran again in this run (a re-run
step's output is every later step's input); ``--from-step`` re-runs that step and every later one. A step
whose job follows lineage (caption, qa, validate, report, score) also runs when its items' inputs changed
since it ran (a redrawn mask changes neither its command line nor a fingerprint: operators.io.lineage)."""
from __future__ import annotations


def must_run(prev: dict | None, argv: list[str], fingerprint: str | None, stale: bool,
             pairs: dict | None = None) -> tuple[bool, str]:
    """(run it?, why) for one step. ``prev``: its record in the state file (finished ones only);
    ``pairs``: the step's pairs by lineage (:func:`operators.io.lineage.status`), for the jobs that have it."""
    if prev is None:
        return True, "not finished before"
    if stale:
        return True, "an earlier step ran again"
    if prev.get("argv") != argv:
        return True, "its command line changed"
    if fingerprint is not None and prev.get("fingerprint") != fingerprint:
        return True, "its input changed (new work from people)"
    if pairs is not None and pairs.get("needs_run"):
        return True, "its pairs' inputs changed since it ran"
    return False, "finished earlier"
