"""What an LLM job reports: the progress line while it runs (from the account's rate limiter), and
at the end of a run the tables read back columnar, this run's usage, the skipped line, and the
end-of-run work run in a worker process of its own so the driver does not grow with the archive."""
from __future__ import annotations

import logging
import threading

from operators.io.storage import Store
from operators.io.tables import read_table
from operators.llm.usage import summarize_usage

log = logging.getLogger("changeforge.llm")


class ProgressReporter(threading.Thread):
    """Logs the pool's request/token/cost counters (kept by the rate-limiter actor) periodically."""

    def __init__(self, limiter, every_s: float, total_pairs: int):
        super().__init__(daemon=True)
        self.limiter, self.every_s, self.total_pairs = limiter, every_s, total_pairs
        self.stop = threading.Event()

    def run(self) -> None:
        import ray
        try:   # the limiter may serve other jobs on this account too: report this run's share
            base = ray.get(self.limiter.stats.remote(), timeout=5)
        except Exception:  # noqa: BLE001
            base = {}
        while not self.stop.wait(self.every_s):
            try:
                now = ray.get(self.limiter.stats.remote(), timeout=5)
            except Exception:  # noqa: BLE001 - progress is best effort
                continue
            s = {k: (v - base.get(k, 0) if isinstance(v, (int, float)) and k != "in_flight" else v)
                 for k, v in now.items()} if now.get("epoch") == base.get("epoch") else now
            rate = s["released"] / max(s["elapsed_s"], 1e-9)
            log.info(progress_line(s, rate, self.total_pairs))


def progress_line(s: dict, rate: float, total_pairs: int) -> str:
    """The progress line from the limiter's counters: requests whose usage is unknown (no usage reported,
    or maybe billed after a timeout) show as "+ unknown" after the tokens and the cost, never as 0."""
    unknown = int(s.get("usage_unknown", 0) or 0)
    more = f" + unknown ({unknown} requests)" if unknown else ""
    return (f"llm progress: {s['released']} requests done ({rate:.1f}/s), {s.get('cached', 0)} answered from cache, "
            f"{s.get('failed', 0)} failed, {s['in_flight']} in flight, tokens {s.get('prompt_tokens', 0)}+"
            f"{s.get('completion_tokens', 0)}{more}, cost ${s.get('cost_usd', 0.0):.4f}{more} "
            f"({total_pairs} pairs in this run)")


def summary_table(out: Store, table: str, columns: list[str], run_id: str | None = None, *, schemas: dict):
    """The ``columns`` of a table's current state (only ``run_id``'s rows if given), as an Arrow
    table: the driver reads what the summary and the LEVIR-CC file need, not every column of every
    row, and keeps them columnar (as Python dicts, 5,500 pairs' rows cost the driver ~90 MB).
    ``schemas``: the job's table schemas."""
    import pyarrow.compute as pc
    t = read_table(out, table, schemas[table], columns=list(dict.fromkeys([*columns, "run_id"])))
    if t is None:
        return None
    if run_id is not None:
        t = t.filter(pc.equal(t.column("run_id"), run_id))
    return t.select(columns)


def row_batches(t, rows_per_batch: int = 1024):
    """Lists of row dicts, a batch at a time: only one batch is ever held as Python objects."""
    if t is None:
        return
    for batch in t.to_batches(max_chunksize=rows_per_batch):
        yield batch.to_pylist()


def summary_rows(out: Store, table: str, columns: list[str], run_id: str | None = None, *, schemas: dict):
    """:func:`summary_table`'s rows one at a time."""
    for rows in row_batches(summary_table(out, table, columns, run_id, schemas=schemas)):
        yield from rows


def skipped_line(skipped: dict[str, int]) -> str:
    """The printed line of pairs left out with a reason (empty when none)."""
    return "; ".join(f"{n} pairs skipped: {reason}" for reason, n in skipped.items())


def peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_on_worker(fn, *args):
    """``fn(*args)`` as a Ray task in a worker process that exits after it (``max_calls=1``), so the
    memory it took goes back to the node, not to the driver. Retried if its node is lost (``fn``
    must be idempotent)."""
    import ray
    return ray.get(ray.remote(num_cpus=0.25, max_calls=1, max_retries=3)(fn).remote(*args))


def run_usage(out: Store, run_id: str, schemas: dict) -> dict:
    """This run's LLM usage summary, from the columns of ``usage/`` it needs."""
    return summarize_usage(summary_rows(out, "usage", ["stage", "attempts", "cached", "status", "prompt_tokens",
                                                       "completion_tokens", "cost_usd", "usage_complete",
                                                       "batch_id"], run_id, schemas=schemas))
