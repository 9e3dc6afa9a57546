"""The pass loop of an LLM job: the pipeline over a work list (prepare, every stage, rows streamed to
the tables), once in real time, or with ``--batch-api`` in passes through a provider's Batch API
until every item is finished or failed with a reason; and how a run stops early (the provider's
quota, batches still open, items left over), each with the one line the jobs print before exit 3."""
from __future__ import annotations

import collections
import logging

from operators.io.storage import Store
from operators.io.tables import read_table
from operators.io.work_list import delete_work_list, read_work_list, write_work_list
from operators.llm.batch import BatchAPI, BatchAPIError, BatchDriver, BatchSettings, BatchState
from operators.llm.job_options import LLMJobConfig, pool_config
from operators.llm.job_summary import ProgressReporter
from operators.llm.stage import PoolConfig, StageSpec, apply_llm_stage

log = logging.getLogger("changeforge.llm")


class QuotaStop(Exception):
    """The provider's quota ran out during the run: finished work is kept, the rest waits for a rerun."""


class BatchesOpen(Exception):
    """--batch-api: batches still open after --batch-max-wait-s (a rerun polls them), or lines exported."""


class BatchStopped(BatchesOpen):
    """--batch-api: a ``/files`` or ``/batches`` call refused (a 4xx other than a quota) or unanswered after
    its retries; nothing was submitted twice, and a rerun goes on from the recorded batches. (A
    :class:`BatchesOpen`: the jobs stop on it with its line and exit 3.)"""


class PairsLeftOver(BatchesOpen):
    """--batch-api: pairs neither finished nor failed after the passes (each has an error row saying so);
    the job stops with this line and exits 3, never 0 in silence."""


def stop_line(exc: Exception) -> str:
    """The one line a job prints when it stopped early (it then exits non-zero)."""
    if isinstance(exc, QuotaStop):
        return (f"stopped: the provider's quota is exhausted ({exc}); finished pairs are kept, top the account "
                "up and rerun (nothing answered is paid again)")
    return f"stopped: {exc}"


def configure_pipeline(pool: PoolConfig) -> None:
    """Ray Data settings of the LLM pipelines (captions, QA), set on the driver's DataContext."""
    import ray.data
    ctx = ray.data.DataContext.get_current()
    if pool.max_store_mb:
        # A bound of our own: by default Ray Data may use a share of the whole store, and the work
        # list's reads run as far ahead of a rate-limited endpoint as that allows.
        ctx.execution_options.resource_limits = ctx.execution_options.resource_limits.copy(
            object_store_memory=pool.max_store_mb * 2**20)
    # Start only once the LLM actors are up: a pool that finds no room then fails with a clear
    # timeout, where Ray Data would otherwise wait for ever.
    ctx.wait_for_min_actors_s = int(pool.actor_start_timeout_s)


def run_stages(todo: list[dict], prepare, prepare_kwargs: dict, stages: list[StageSpec], pool: PoolConfig, sink,
               limiter, progress_every_s: float, *, work: Store, job: str, run_id: str, part: str = "") -> dict[str, int]:
    """Prepare every pair, run the LLM stages in order, stream every row to ``sink``; logs progress.
    Returns rows written per table. The work list goes through ``work``
    (the output store), not the object store, and is removed at the end. The rate limiter is left
    running: it is the account's, shared by every job against the same endpoint and key."""
    configure_pipeline(pool)
    # ``part``: a batch pass's own work list (workers keep the parts they read by name).
    name = f"{job}-{run_id}{part}"
    parts = write_work_list(work, name, todo)
    try:
        # Blocks of one LLM batch of work items. The LLM actors prepare each pair themselves and
        # run it through every stage in one coroutine: a prepared pair's images are in the actor's
        # memory only while its requests are in flight, never in the object store (carried there
        # between steps, how many queued was Ray Data's choice, and that was the store's peak).
        # A quarter CPU: the LLM actors hold fractions of CPUs on every node, and a whole-CPU task
        # could find no node with a full CPU left (seen on two 1-CPU nodes: the job stalled).
        ds = read_work_list(work, parts, pool.batch_size, num_cpus=0.25)
        ds = apply_llm_stage(ds, stages, pool, prepare, prepare_kwargs)
        reporter = ProgressReporter(limiter, progress_every_s, len(todo))
        reporter.start()
        try:
            # A quarter CPU: a default write task wants a whole one, which Ray Data's per-operator
            # budget on a small node only frees when the stages are done; every row then waited in
            # the object store until the end instead of streaming to the tables.
            ds.write_datasink(sink, ray_remote_args={"num_cpus": 0.25})
        finally:
            reporter.stop.set()
    finally:
        delete_work_list(work, name)
    return sink.counts


def run_llm_job(cfg: LLMJobConfig, todo: list[dict], prepare, prepare_kwargs: dict, stages: list[StageSpec],
                make_sink, limiter, *, out: Store, job: str, run_id: str, key: str = "pair_id",
                done_table: str = "pairs") -> dict[str, int]:
    """The job's pipeline over ``todo``: once in real time; with ``--batch-api`` in passes (each pass
    answers what the cache and the batches can, the requests left wait in batch lines, which are
    submitted and waited for; the next pass takes the pairs that waited). ``make_sink()``: a fresh
    table sink per pass. An item is named by its ``key`` field and is finished when ``done_table`` has
    a row of this run with that key (the captions and QA jobs: ``pairs`` by ``pair_id``; the QA
    judge of ``jobs.score``: ``judgements`` by ``qid``). Raises :class:`QuotaStop` when the
    provider's quota ran out, and :class:`BatchesOpen` when batches are still out, lines were
    exported or items were left over (:class:`PairsLeftOver`)."""
    pool = pool_config(cfg)
    counts: collections.Counter = collections.Counter()
    if not cfg.batch_api:
        counts.update(run_stages(todo, prepare, prepare_kwargs, stages, pool, make_sink(), limiter,
                                 cfg.progress_every_s, work=out, job=job, run_id=run_id))
        check_quota(limiter)
        return dict(counts)
    driver = batch_driver(cfg, out, job, stages, run_id=run_id)
    try:
        return _batch_passes(cfg, driver, todo, prepare, prepare_kwargs, stages, make_sink, limiter, pool, counts,
                             out=out, job=job, run_id=run_id, key=key, done_table=done_table)
    except BatchAPIError as exc:    # read by its code: a quota stops (exit 3); anything else stops with its reason
        if exc.kind == "quota":
            raise QuotaStop(exc.reason) from None
        raise BatchStopped(str(exc)) from None


def _check_batch_quota(driver: BatchDriver) -> None:
    if driver.quota:
        raise QuotaStop(driver.quota)


def _batch_passes(cfg, driver, todo, prepare, prepare_kwargs, stages, make_sink, limiter, pool, counts, *, out, job,
                  run_id, key, done_table) -> dict[str, int]:
    if cfg.batch_import:
        log.info("batch replies imported from %s: %s", cfg.batch_import, driver.import_results(cfg.batch_import))
    waited = driver.wait()          # batches a killed driver left open: polled, never submitted again
    _check_batch_quota(driver)
    if waited["open"]:
        raise BatchesOpen(f"{waited['open']} batches still open after --batch-max-wait-s; rerun to poll them")
    # Passes until every pair has its rows or its error row: per stage its line, a failed line's retry,
    # the re-asks real time would make and a cut-off re-ask, then the pass that takes the last answers.
    max_passes = len(stages) * (cfg.max_reasks + 3) + 1
    n = 0
    while todo:
        counts.update(run_stages(todo, prepare, prepare_kwargs, stages, pool, make_sink(), limiter,
                                 cfg.progress_every_s, work=out, job=job, run_id=run_id, part=f"-pass{n}"))
        check_quota(limiter)
        if cfg.batch_export:
            exported = driver.export_lines(cfg.batch_export)
            if exported:
                raise BatchesOpen(f"{exported} requests written to {cfg.batch_export}: run them (e.g. vllm run-batch -i "
                                  f"{cfg.batch_export} -o replies.jsonl), then rerun with --batch-import replies.jsonl")
            break
        n += 1
        if not driver.submit() and not driver.state.waiting(run_id):
            left_over(out, still_to_do(out, todo, run_id, stages[0], key, done_table), job, run_id, key,
                      stages[0].name, f"no row after pass {n} and no batch line waiting for it")
            break                   # nothing waited in this pass: every pair got its rows
        waited = driver.wait()
        log.info("batches done: %s", waited)
        _check_batch_quota(driver)
        if waited["open"]:
            raise BatchesOpen(f"{waited['open']} batches still open after --batch-max-wait-s; rerun to poll them")
        todo = still_to_do(out, todo, run_id, stages[0], key, done_table)
        if todo and n >= max_passes:
            left_over(out, todo, job, run_id, key, stages[0].name, f"not finished after {n} batch passes")
    return dict(counts)


def left_over(out: Store, todo: list[dict], job: str, run_id: str, key: str, stage: str, why: str) -> None:
    """An error row for each pair of ``todo`` (none: nothing), then :class:`PairsLeftOver`."""
    if not todo:
        return
    from operators.io.tables import ERRORS_SCHEMA, error_record, write_table_shard
    write_table_shard(out, "errors", [error_record(p[key], stage, why, error_type="LeftOver", job=job, run_id=run_id)
                                      for p in todo], ERRORS_SCHEMA, run_id)
    raise PairsLeftOver(f"{len(todo)} pairs {why} (error rows written; rerun to try them again): "
                        + ", ".join(str(p[key]) for p in todo[:5]) + (", ..." if len(todo) > 5 else ""))


def batch_driver(cfg: LLMJobConfig, out: Store, job: str, stages: list[StageSpec], run_id: str = "") -> BatchDriver:
    settings = BatchSettings(max_requests_per_file=cfg.batch_max_requests,
                             max_bytes_per_file=int(cfg.batch_max_mb * 1e6), poll_s=cfg.batch_poll_s,
                             max_wait_s=cfg.batch_max_wait_s, fallback=cfg.batch_fallback,
                             max_enqueued_tokens=cfg.batch_max_enqueued_tokens, keep_files=cfg.batch_keep_files)
    api = None if cfg.batch_export else BatchAPI(stages[0].llm.base_url or "", stages[0].api_key.get())
    return BatchDriver(BatchState(out.uri(), job), api, settings, job=job, run_id=run_id)


def still_to_do(out: Store, todo: list[dict], run_id: str, spec: StageSpec, key: str,
                done_table: str = "pairs") -> list[dict]:
    """The pairs of ``todo`` with neither a row in ``done_table`` nor an error row of this run (those
    waited for a batch). A row of an earlier run does not count: a pair redone because its inputs
    changed (operators.io.lineage) has one, made from the old inputs."""
    from operators.io.tables import ERRORS_SCHEMA
    pairs = read_table(out, done_table, columns=[key, "run_id"])
    done = set() if pairs is None else {r[key] for r in pairs.to_pylist() if r["run_id"] == run_id}
    errors = read_table(out, "errors", ERRORS_SCHEMA, columns=["item", "run_id"])
    failed = set() if errors is None else {r["item"] for r in errors.to_pylist() if r["run_id"] == run_id}
    return [p for p in todo if p[key] not in done and p[key] not in failed]


def check_quota(limiter) -> None:
    """Raise :class:`QuotaStop` if a request of this run found the account's quota exhausted."""
    if limiter is None:
        return
    import ray
    try:
        stopped = ray.get(limiter.stats.remote(), timeout=30).get("stopped")
    except Exception:  # noqa: BLE001 - the error rows still say it
        return
    if stopped:
        raise QuotaStop(stopped)
