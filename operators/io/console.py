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


def error_tally(out: Store, run_id: str | None) -> tuple[dict[str, int], dict[str, list[str]]]:
    """This run's ``errors/`` rows by error type and stage (their messages name each item's detail)."""
    rows = run_rows(out, "errors", run_id, ["item", "stage", "error_type", "message"])
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


def print_errors(prefix: str, out: Store, run_id: str | None) -> int:
    """Print this run's ``errors/`` rows summarised by reason with the first items; returns their number."""
    counts, examples = error_tally(out, run_id)
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


def explain_llm_run(prefix: str, output: str, summary: dict) -> None:
    """The end of a captions or QA run: its error rows by reason; exit 3 when it found no pair, or
    had pairs to do and finished none (an endpoint that never answered turns every pair into an error
    row: that is not a success). A rerun with nothing left to do is one."""
    out = Store(output)
    print_errors(prefix, out, summary["run_id"])
    todo = summary["pairs_found"] - summary["pairs_skipped_finished"]
    done = (summary.get("rows_written") or {}).get("pairs", 0)
    skipped = {f"skipped: {k}": v for k, v in (summary.get("pairs_skipped") or {}).items()}
    if not summary["pairs_found"]:
        stop_if_nothing(prefix, False, "no pair to work on in --input", skipped)
    counts, examples = merge((skipped, {}), error_tally(out, summary["run_id"]))
    stop_if_nothing(prefix, todo == 0 or done > 0, f"none of the {todo} pair(s) to do finished", counts, examples)
