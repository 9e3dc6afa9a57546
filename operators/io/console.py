"""What a job says at its end: the ``errors/`` rows of the run by reason with their first items, the
reasons a run produced nothing, and the exit status that tells a script or the chain to stop
(:data:`operators.io.validation.NOTHING_DONE`, 3: the run ran, but every item failed or there was
nothing it could do; 2 is a bad option, caught before any work)."""
from __future__ import annotations

import posixpath
import sys

from operators.io.storage import Store
from operators.io.tables import read_table
from operators.io.validation import NOTHING_DONE, reason_lines


def _name(item) -> str:
    text = str(item or "").rstrip("/")
    return posixpath.basename(text) or text or "?"


def run_rows(out: Store, table: str, run_id: str | None, columns: list[str]) -> list[dict]:
    """The rows of ``table`` this run wrote (every row when ``run_id`` is None; only ``columns`` that
    exist), [] when there are none."""
    t = read_table(out, table)
    if t is None or (run_id is not None and "run_id" not in t.column_names):
        return []
    cols = [c for c in columns + ["run_id"] if c in t.column_names]
    return [r for r in t.select(cols).to_pylist() if run_id is None or r["run_id"] == run_id]


def tally(rows: list[dict], item: str, reason: str, label: str = "") -> tuple[dict[str, int], dict[str, list[str]]]:
    """(count per reason, first items per reason) of ``rows``; a reason is cut at its first detail."""
    counts: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    for r in rows:
        text = " ".join(str(r.get(reason) or "no reason recorded").split())
        key = (label + ": " if label else "") + (text if len(text) <= 110 else text[:107] + "...")
        counts[key] = counts.get(key, 0) + 1
        examples.setdefault(key, []).append(_name(r.get(item)))
    return counts, examples


def error_tally(out: Store, run_id: str | None, skip_types: tuple[str, ...] = ()) -> tuple[dict[str, int],
                                                                                          dict[str, list[str]]]:
    """This run's ``errors/`` rows by error type and stage (their messages name each item's detail),
    without the rows whose error type is one of ``skip_types``."""
    rows = [r for r in run_rows(out, "errors", run_id, ["item", "stage", "error_type", "message"])
            if r.get("error_type") not in skip_types]
    for r in rows:
        r["reason"] = f"{r.get('error_type') or 'error'} in {r.get('stage') or 'the run'}"
    counts, examples = tally(rows, "item", "reason")
    if rows:   # the first message says what the reason means
        first = {}
        for r in rows:
            first.setdefault(f"{r.get('error_type') or 'error'} in {r.get('stage') or 'the run'}",
                             " ".join(str(r.get("message") or "").split())[:100])
        counts = {f"{k} ({first[k]})" if first.get(k) else k: v for k, v in counts.items()}
        examples = {f"{k} ({first[k]})" if first.get(k) else k: v for k, v in examples.items()}
    return counts, examples


def print_errors(prefix: str, out: Store, run_id: str | None, skip_types: tuple[str, ...] = ()) -> int:
    """Print this run's ``errors/`` rows summarised by reason with the first items (those of
    ``skip_types`` left to their own line); returns their number."""
    counts, examples = error_tally(out, run_id, skip_types)
    n = sum(counts.values())
    if n:
        print(f"{prefix} {n} error row(s) in {out.uri('errors')}/ by reason:", flush=True)
        for line in reason_lines(counts, examples):
            print(f"{prefix}   {line}", flush=True)
    return n


def stop_if_nothing(prefix: str, produced: bool, what: str, reasons: dict[str, int] | None = None,
                    examples: dict[str, list[str]] | None = None) -> None:
    """When the run ``produced`` nothing: say ``what`` with the top reasons and their first items (on
    stderr) and exit with :data:`NOTHING_DONE`."""
    if produced:
        return
    print(f"{prefix} {what}" + (":" if reasons else ""), file=sys.stderr, flush=True)
    for line in reason_lines(reasons or {}, examples or {}):
        print(f"{prefix}   {line}", file=sys.stderr, flush=True)
    raise SystemExit(NOTHING_DONE)


def merge(*tallies: tuple[dict, dict]) -> tuple[dict[str, int], dict[str, list[str]]]:
    counts: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    for c, e in tallies:
        for k, v in c.items():
            counts[k] = counts.get(k, 0) + v
            examples.setdefault(k, []).extend(e.get(k, []))
    return counts, examples


def llm_run_shortfall(found: int, finished_before: int, no_mask: int, done: int) -> str:
    """Whether a captions or QA run counts as failed: ``""`` when it does not, else what to say before
    exiting with :data:`NOTHING_DONE`.

    ``found``: pairs in --input; ``finished_before``: of those, already finished by an earlier run;
    ``no_mask``: of the others, pairs without a change mask (an input condition: set aside, never
    sent); ``done``: pairs this run finished. The run failed when it found no pair, when every pair
    with a mask it had to do failed (none finished), or when every pair it found lacks a mask (nothing
    could be done). A pair without a mask never makes a run failed otherwise: a rerun whose only
    unfinished pairs lack a mask had nothing left to do, which is a success."""
    to_do = found - finished_before - no_mask      # the pairs with a mask this run had to do
    if found <= 0:
        return "no pair to work on in --input"
    if to_do > 0:
        return "" if done > 0 else f"none of the {to_do} pair(s) with a mask to do finished"
    if finished_before > 0:
        return ""
    return f"none of the {found} pair(s) in --input has a change mask (label/): nothing could be done"


def explain_llm_run(prefix: str, output: str, summary: dict) -> None:
    """The end of a captions or QA run: its error rows by reason, its pairs without a mask on one line
    (once per run, whether their ``errors/`` rows were written now or by an earlier run), and exit 3
    when :func:`llm_run_shortfall` says the run failed (an endpoint that never answered turns every
    pair into an error row: that is not a success). A rerun with nothing left to do is one."""
    from operators.io.layout import NO_MASK, NO_MASK_ERROR
    out = Store(output)
    print_errors(prefix, out, summary["run_id"], skip_types=(NO_MASK_ERROR,))
    no_mask = int(summary.get("pairs_no_mask") or 0)
    first = list(summary.get("pairs_no_mask_first") or [])
    done = (summary.get("rows_written") or {}).get("pairs", 0)
    skipped = {f"skipped: {k}": v for k, v in (summary.get("pairs_skipped") or {}).items()}
    what = llm_run_shortfall(summary["pairs_found"], summary["pairs_skipped_finished"], no_mask, done)
    only_no_mask = bool(what) and no_mask > 0 and summary["pairs_found"] == no_mask
    if no_mask and not only_no_mask:   # the failed run says it in its reasons instead
        print(f"{prefix} {no_mask} pair(s) without a change mask (label/) set aside, nothing asked about them "
              f"(one {NO_MASK_ERROR} row each in {out.uri('errors')}/): {', '.join(first[:3])}"
              + (", ..." if no_mask > 3 else ""), flush=True)
    if not what:
        return
    if not summary["pairs_found"]:
        stop_if_nothing(prefix, False, what, skipped)
    if only_no_mask:
        stop_if_nothing(prefix, False, what, {NO_MASK: no_mask}, {NO_MASK: first})
    counts, examples = merge((skipped, {}), error_tally(out, summary["run_id"], (NO_MASK_ERROR,)))
    stop_if_nothing(prefix, False, what, counts, examples)
