"""What every LLM job (captions, QA, scoring) runs the same way: the shared options and their parser,
the account's rate limiter, the stages, the pipeline over a work list (in real time, or in passes
through a provider's Batch API), progress, and the end-of-run summaries.

Jobs are wiring: a job names its tables, prompts, request builders and reply handlers, and this runs
them. (It was the captions job's code, imported by the QA job.)
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass, fields
from functools import partial

from operators.io import validation
from operators.io.cli import add_deprecated_alias, init_ray, parse_job_args
from operators.io.storage import Store
from operators.io.tables import read_table
from operators.io.work_list import delete_work_list, read_work_list, write_work_list
from operators.llm.batch import BatchAPI, BatchAPIError, BatchDriver, BatchSettings, BatchState
from operators.llm.client import LLMConfig, Secret
from operators.llm.ratelimit import RateLimits
from operators.llm.stage import PoolConfig, StageSpec, apply_llm_stage
from operators.llm.usage import summarize_usage

log = logging.getLogger("changeforge.llm")


class QuotaStop(Exception):
    """The provider's quota ran out during the run: finished work is kept, the rest waits for a rerun."""


class BatchesOpen(Exception):
    """--batch-api: batches still open after --batch-max-wait-s (a rerun polls them), or lines exported."""


class BatchStopped(BatchesOpen):
    """--batch-api: a ``/files`` or ``/batches`` call refused (a 4xx other than a quota) or unanswered after
    its retries; nothing was submitted twice, and a rerun goes on from the recorded batches. (A
    :class:`BatchesOpen`: the jobs stop on it with its line and exit 3.)"""


def stop_line(exc: Exception) -> str:
    """The one line a job prints when it stopped early (it then exits non-zero)."""
    if isinstance(exc, QuotaStop):
        return (f"stopped: the provider's quota is exhausted ({exc}); finished pairs are kept, top the account "
                "up and rerun (nothing answered is paid again)")
    return f"stopped: {exc}"


@dataclass
class LLMJobConfig:
    """The options every LLM job shares (endpoint, limits, images, retries, cache, pool, batch)."""
    input: str = ""
    output: str = ""
    model: str = ""
    judge_model: str = ""                 # default: --model
    base_url: str = ""                    # default: OPENAI_BASE_URL
    list_file: str = ""
    default_split: str = "train"
    rpm: float = 500.0
    tpm: float = 2_000_000.0
    max_in_flight: int = 64
    max_image_side: int = 1024
    detail: str = "auto"
    image_format: str = "png"
    overall: str = "criteria"
    validators: str = "flag"
    price_per_mtok_in: float | None = None
    price_per_mtok_out: float | None = None
    price_per_mtok_cached: float | None = None
    temperature: float = 0.7
    max_tokens: int = 1500
    max_tokens_field: str = "max_tokens"
    timeout_s: float = 120.0
    max_retries: int = 6
    max_rate_limit_retries: int = 30
    max_reasks: int = 2
    backoff_base_s: float = 1.0
    response_format: str = "json_object"
    strict_schema: bool = True
    image_token_rule: str = ""
    max_request_bytes: int = 20_000_000
    api_key_source: str = "env:OPENAI_API_KEY"
    generate_template: str = "caption_generate.v4"
    judge_template: str = "caption_judge.v4"
    prompts_dir: str = ""
    actors: int = 2
    concurrent_batches: int = 8
    batch_size: int = 8
    max_store_mb: float = 256.0
    actor_start_timeout_s: int = 900
    prepare_threads: int = 2
    num_cpus: int | None = None
    progress_every_s: float = 10.0
    cache: bool = True
    reasoning_effort: str = ""
    max_retry_after_s: float = 300.0
    batch_api: bool = False
    batch_fallback: str = "batch"
    batch_export: str = ""
    batch_import: str = ""
    batch_poll_s: float = 30.0
    batch_max_wait_s: float = 26 * 3600.0
    batch_max_requests: int = 50_000
    batch_max_mb: float = 190.0
    batch_discount: float = 0.5
    batch_max_enqueued_tokens: int = 0
    batch_keep_files: bool = False


HELP = {
    "input": "dataset in LEVIR-CD layout (A/ B/ label/, optionally under train/ val/ test/), e.g. a pairs job output: folder or s3:// prefix",
    "output": "output folder or s3:// prefix (tables, LEVIR-CC json, response cache)",
    "model": "multimodal model name at the endpoint (e.g. gpt-4o-mini, kimi-k2.6, Qwen/Qwen2.5-VL-7B-Instruct)",
    "judge_model": "model for the judging stage, e.g. a different model than the generator (default: --model)",
    "base_url": "OpenAI-compatible endpoint, e.g. https://api.openai.com/v1 (default: $OPENAI_BASE_URL)",
    "list_file": "only the pairs named in this file (one file name per line; relative to --input or a URI)",
    "default_split": "split of pairs without a split folder, a list/{train,val,test}.txt entry or a train_/val_/test_ name prefix",
    "rpm": "requests per minute for the whole pool: all actors, nodes and both stages together (0 = unlimited)",
    "tpm": "tokens per minute (prompt + completion) for the whole pool, both stages together (0 = unlimited)",
    "max_in_flight": "requests outstanding at once across the pool",
    "max_image_side": "images are downscaled so that their longer side is at most this many pixels",
    "detail": "image detail level sent with each image: low, high or auto",
    "image_format": "encoding of the pre/post images in the data URLs: png (lossless) or jpeg",
    "overall": "how a candidate's integer overall score is formed: criteria = mean of the five criteria rounded "
               "half up, but a caption with accuracy <= 4 (hallucinated) scores its accuracy, so it is never "
               "selected; judge = the judge's own overall score; min = lowest criterion; mean = unrounded mean "
               "(a float: ties at the cut become rare, not the paper's); < 7 is rejected, top 3 kept (ties kept)",
    "validators": "grounded validators on every caption (checked against its mask): reject = a caption that breaks a rule is "
                  "not sent to the judge (recorded with the rule), flag = sent, verdict stored, off = not run",
    "price_per_mtok_in": "USD per million prompt tokens, for the run's cost (optional)",
    "price_per_mtok_out": "USD per million completion tokens, for the run's cost (optional)",
    "price_per_mtok_cached": "USD per million prompt tokens the provider served from its prefix cache (e.g. a "
                             "quarter or half of the input price; default: the input price), for the run's cost",
    "temperature": "sampling temperature of both stages; a negative value sends none (the endpoint's default, "
                   "which some reasoning models require)",
    "max_tokens": "completion token cap per request (thinking models spend part of it on reasoning: raise it)",
    "max_tokens_field": "request field carrying the cap: max_tokens, or max_completion_tokens (switched to by "
                        "itself when a model rejects max_tokens)",
    "timeout_s": "per-request timeout in seconds",
    "max_store_mb": "object-store budget of the pipeline in MB (work items and finished rows in flight; a pair's "
                    "images stay in the LLM actor that prepares it); 0 = Ray Data's default share of the store",
    "actor_start_timeout_s": "seconds to wait for the LLM actors to start before the pipeline does (a pool that "
                             "finds no room fails with a timeout instead of waiting for ever); 0 = do not wait",
    "max_retries": "retries on 5xx, timeouts and connection errors (exponential backoff with jitter)",
    "max_rate_limit_retries": "retries of one request on 429 (a scattered 429 makes only its request wait "
                              "its Retry-After; a storm of them pauses the whole pool and lowers its rate, which "
                              "recovers while no storm comes)",
    "max_reasks": "re-asks after a malformed or schema-invalid reply before the pair becomes an error row",
    "backoff_base_s": "first backoff delay in seconds (doubles per retry, capped at 60 s)",
    "response_format": "json_object (JSON mode, the reply schema at the end of the prompt, so that a pair's stages "
                       "share their cached prefix; every reply is checked against the schema here and re-asked) or "
                       "json_schema (the provider's structured outputs; its schema leads the cached prefix, so stages "
                       "with different schemas share none; falls back to json_object by itself if rejected)",
    "strict_schema": "send json_schema in strict mode (dropped by itself where the endpoint rejects it)",
    "image_token_rule": "how the endpoint counts an image's tokens, if the model name does not tell: "
                        "tile:<base>:<per_tile> (e.g. tile:2833:5667 for gpt-4o-mini), "
                        "patch:<patch_px>:<cap>:<multiplier>, or a model name to borrow its rule",
    "max_request_bytes": "requests larger than this are not sent: the pair becomes an error row "
                         "(lower --max-image-side or use --image-format jpeg)",
    "api_key_source": "where each worker reads the API key: env:NAME, file:/path (a secret file on every node) "
                      "or aws-sm:<secret id or ARN>[#json-field] (AWS Secrets Manager)",
    "generate_template": "prompt template (file stem under --prompts-dir) for caption generation",
    "judge_template": "prompt template (file stem under --prompts-dir) for caption judging",
    "prompts_dir": "folder holding the prompt templates (default: the templates shipped with the package)",
    "actors": "LLM actors (async; each prepares its pairs and runs them through both stages, many requests "
              "in flight)",
    "prepare_threads": "threads per LLM actor reading and encoding pairs' images",
    "concurrent_batches": "batches in flight per actor",
    "batch_size": "pairs per batch",
    "num_cpus": "CPUs of the local Ray started when RAY_ADDRESS is not set (default: all)",
    "progress_every_s": "seconds between progress log lines",
    "cache": "read and write the response cache (--no-cache: everything is sent and paid again)",
    "reasoning_effort": "reasoning_effort sent with every request (low, medium, high; reasoning models); empty: none",
    "max_retry_after_s": "longest wait in seconds for one 429's Retry-After (a provider asking for longer is "
                         "asked again after this)",
    "batch_api": "send each stage's requests through the provider's Batch API (/v1/files, /v1/batches; about "
                 "half price, results within 24 h) instead of in real time; the answers land in the response "
                 "cache and the pipeline takes them from there",
    "batch_fallback": "a batch line that failed or expired is retried once: in another batch (batch) or in real "
                      "time (realtime); failing again, it becomes its pair's error row",
    "batch_export": "with --batch-api: write the waiting requests to this JSONL file (batch input format, e.g. for "
                    "vllm run-batch) instead of submitting them, and stop",
    "batch_import": "with --batch-api: take the replies from this JSONL file (batch output format, e.g. vllm "
                    "run-batch -o) before the run",
    "batch_poll_s": "seconds between polls of the open batches",
    "batch_max_wait_s": "longest wait for the open batches; past it the job stops and a rerun polls them again",
    "batch_max_requests": "requests per batch file (the provider's limit)",
    "batch_max_mb": "MB per batch file (the provider's limit, less a margin)",
    "batch_discount": "batch price as a share of the real-time price (--price-per-mtok-*)",
    "batch_max_enqueued_tokens": "the provider's enqueued-token limit per model (e.g. OpenAI's per tier): batch "
                                 "files go in waves whose open batches stay under it (their prompts by our "
                                 "estimate plus the completion cap); 0 = no limit",
    "batch_keep_files": "keep each batch's input, output and error files at the provider (by default they are "
                        "deleted once the batch's results are stored in the output)",
}


# Options that tune throughput, retries and the endpoint's quirks: --help hides them, --help-all shows them.
TUNING = {"max_in_flight", "image_format", "price_per_mtok_in", "price_per_mtok_out", "price_per_mtok_cached", "max_tokens_field",
          "timeout_s", "max_retries", "max_rate_limit_retries", "max_reasks", "backoff_base_s", "response_format",
          "strict_schema", "image_token_rule", "max_request_bytes", "generate_template", "judge_template",
          "prompts_dir", "actors", "concurrent_batches", "batch_size", "max_store_mb", "actor_start_timeout_s",
          "prepare_threads", "progress_every_s", "max_retry_after_s", "batch_poll_s", "batch_max_wait_s",
          "batch_max_requests", "batch_max_mb", "batch_discount", "batch_max_enqueued_tokens",
          "batch_keep_files"}


CHOICES = {"detail": ("low", "high", "auto"), "validators": ("reject", "flag", "off"),
           "image_format": ("png", "jpeg"), "max_tokens_field": ("max_tokens", "max_completion_tokens"),
           "response_format": ("json_schema", "json_object"), "default_split": ("train", "val", "test"),
           "batch_fallback": ("batch", "realtime")}
# Options whose flag is not the field's name (one name per concept across the jobs), and the spellings
# they replace, which keep working for one release with a deprecation warning.
FLAGS = {"dataset": "--images", "seed": "--type-seed"}
# Checked before any work (operators.io.validation's keys); the last three are the QA job's.
CHECKS = {"input": {"path": "dir"}, "base_url": {"url": True}, "prompts_dir": {"path": "dir"},
          **{k: {"min": 0} for k in ("rpm", "tpm", "price_per_mtok_in", "price_per_mtok_out", "price_per_mtok_cached",
                                     "max_retries",
                                     "max_rate_limit_retries", "max_reasks", "backoff_base_s", "max_store_mb",
                                     "actor_start_timeout_s", "max_retry_after_s", "batch_max_wait_s",
                                     "batch_max_enqueued_tokens")},
          **{k: {"min": 1} for k in ("max_in_flight", "max_image_side", "max_tokens", "max_request_bytes", "actors",
                                     "concurrent_batches", "batch_size", "prepare_threads", "num_cpus",
                                     "batch_max_requests")},
          "timeout_s": {"gt": 0}, "progress_every_s": {"gt": 0}, "batch_poll_s": {"gt": 0},
          "batch_max_mb": {"gt": 0}, "batch_discount": {"gt": 0, "max": 1},
          "dataset": {"path": "dir"}, "captions": {"path": "must_exist"}, "qa_per_pair": {"range": (1, 8)}}
OLD_FLAGS = {"dataset": "--dataset", "seed": "--seed"}


def build_parser(cls: type, help_texts: dict, prog: str, description: str,
                 choices: dict | None = None) -> argparse.ArgumentParser:
    """Options from a job's config dataclass (a subclass of :class:`LLMJobConfig`), its help texts and
    the choices of its own options (``choices``, besides the shared ones)."""
    all_choices = {**CHOICES, **(choices or {})}
    ap = argparse.ArgumentParser(
        prog=prog, description=description,
        epilog="Environment: OPENAI_BASE_URL (endpoint), OPENAI_API_KEY (key; never logged or stored), "
               "RAY_ADDRESS (connect to a running Ray cluster instead of starting one).",
        formatter_class=_HelpFormatter)
    defaults = cls()
    for f in fields(cls):
        flag = FLAGS.get(f.name, "--" + f.name.replace("_", "-"))
        default = getattr(defaults, f.name)
        kwargs = {"help": help_texts[f.name], "dest": f.name}
        if f.name in ("input", "output", "model"):
            kwargs["required"] = True
        elif isinstance(default, bool):
            kwargs.update(action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
            kwargs.update(type=kind, default=default, choices=all_choices.get(f.name))
        action = validation.attach(ap.add_argument(flag, **kwargs), CHECKS.get(f.name, {}))
        action.tuning = f.name in TUNING
    for name, old in OLD_FLAGS.items():
        if name in {f.name for f in fields(cls)}:
            add_deprecated_alias(ap, old, FLAGS[name])
    return ap


def parse_args(argv: list[str] | None, cls: type, help_texts: dict, prog: str, description: str,
               choices: dict | None = None):
    parser = build_parser(cls, help_texts, prog, description, choices)
    args = parse_job_args(parser, argv)
    for name in ("generate_template", "judge_template"):
        problem = template_problem(getattr(args, name), args.prompts_dir)
        if problem:
            parser.error(f"{FLAGS.get(name, '--' + name.replace('_', '-'))}: {problem}")
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def template_problem(name: str, prompts_dir: str = "") -> str | None:
    """Why ``name`` names no template in ``prompts_dir`` (default: the packaged ones), or None: a
    mistyped template fails before any work, not at the first pair."""
    import importlib.resources
    folder = prompts_dir or str(importlib.resources.files("prompts"))
    if os.path.isfile(os.path.join(folder, f"{name}.txt")):
        return None
    there = sorted(f[:-4] for f in os.listdir(folder) if f.endswith(".txt")) if os.path.isdir(folder) else []
    close = [t for t in there if t.split(".")[0] == name.split(".")[0]]
    return f"{name!r}: no such template in {folder}" + (f" (there: {', '.join(close)})" if close else "")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where the help already states one or the option is required."""

    def _get_help_string(self, action):
        if action.required or "default:" in (action.help or "") or action.default in ("", None):
            return action.help
        return super()._get_help_string(action)


def pool_config(cfg: LLMJobConfig) -> PoolConfig:
    """The LLM pool's settings from a language job's config."""
    return PoolConfig(actors=cfg.actors, concurrent_batches=cfg.concurrent_batches, batch_size=cfg.batch_size,
                      max_store_mb=cfg.max_store_mb, actor_start_timeout_s=cfg.actor_start_timeout_s,
                      prepare_threads=cfg.prepare_threads)


def require_endpoint(cfg: LLMJobConfig, job: str) -> str:
    base_url = cfg.base_url or os.environ.get("OPENAI_BASE_URL", "")
    if not base_url:
        sys.exit(f"jobs.{job}: no endpoint. Set OPENAI_BASE_URL (e.g. https://api.openai.com/v1, or "
                 "http://localhost:8000/v1 for a local vLLM) and OPENAI_API_KEY, or pass --base-url.")
    return base_url


def llm_config(cfg: LLMJobConfig, base_url: str, model: str) -> LLMConfig:
    return LLMConfig(model=model, base_url=base_url, timeout_s=cfg.timeout_s, max_retries=cfg.max_retries,
                     max_rate_limit_retries=cfg.max_rate_limit_retries, strict_schema=cfg.strict_schema,
                     image_token_rule=cfg.image_token_rule, max_request_bytes=cfg.max_request_bytes,
                     max_reasks=cfg.max_reasks, backoff_base_s=cfg.backoff_base_s,
                     temperature=cfg.temperature if cfg.temperature >= 0 else None,
                     max_tokens=cfg.max_tokens, max_tokens_field=cfg.max_tokens_field, response_format=cfg.response_format, detail=cfg.detail,
                     price_per_mtok_in=cfg.price_per_mtok_in, price_per_mtok_out=cfg.price_per_mtok_out,
                     price_per_mtok_cached=cfg.price_per_mtok_cached, use_cache=cfg.cache, reasoning_effort=cfg.reasoning_effort,
                     max_retry_after_s=cfg.max_retry_after_s, batch_discount=cfg.batch_discount)


def ensure_ray(cfg: LLMJobConfig) -> None:
    """RAY_ADDRESS (a cluster, or ours under ``ray job submit``) or a local Ray, as every job does.

    Local workers inherit this process's environment but not its ``sys.path``: put the repo on
    PYTHONPATH so that ``python jobs/caption.py`` works from any folder without an install."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    before = os.environ.get("PYTHONPATH")
    if repo not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([repo] + paths)
    try:
        init_ray(cfg.num_cpus)
    finally:   # a local Ray's processes took it at start; the caller's environment is left as it was
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


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
                make_sink, limiter, *, out: Store, job: str, run_id: str, key: str = "pair_id") -> dict[str, int]:
    """The job's pipeline over ``todo``: once in real time; with ``--batch-api`` in passes (each pass
    answers what the cache and the batches can, the requests left wait in batch lines, which are
    submitted and waited for; the next pass takes the pairs that waited). ``make_sink()``: a fresh
    table sink per pass. Raises :class:`QuotaStop` when the provider's quota ran out, and
    :class:`BatchesOpen` when batches are still out or lines were exported."""
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
                             out=out, job=job, run_id=run_id, key=key)
    except BatchAPIError as exc:    # read by its code: a quota stops (exit 3); anything else stops with its reason
        if exc.kind == "quota":
            raise QuotaStop(exc.reason) from None
        raise BatchStopped(str(exc)) from None


def _check_batch_quota(driver: BatchDriver) -> None:
    if driver.quota:
        raise QuotaStop(driver.quota)


def _batch_passes(cfg, driver, todo, prepare, prepare_kwargs, stages, make_sink, limiter, pool, counts, *, out, job,
                  run_id, key) -> dict[str, int]:
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
            left_over(out, still_to_do(out, todo, run_id, stages[0], key), job, run_id, key, stages[0].name,
                      f"no row after pass {n} and no batch line waiting for it")
            break                   # nothing waited in this pass: every pair got its rows
        waited = driver.wait()
        log.info("batches done: %s", waited)
        _check_batch_quota(driver)
        if waited["open"]:
            raise BatchesOpen(f"{waited['open']} batches still open after --batch-max-wait-s; rerun to poll them")
        todo = still_to_do(out, todo, run_id, stages[0], key)
        if todo and n >= max_passes:
            left_over(out, todo, job, run_id, key, stages[0].name, f"not finished after {n} batch passes")
    return dict(counts)


class PairsLeftOver(BatchesOpen):
    """--batch-api: pairs neither finished nor failed after the passes (each has an error row saying so);
    the job stops with this line and exits 3, never 0 in silence."""


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


def still_to_do(out: Store, todo: list[dict], run_id: str, spec: StageSpec, key: str) -> list[dict]:
    """The pairs of ``todo`` with neither a ``pairs`` row nor an error row of this run (those waited
    for a batch). A row of an earlier run does not count: a pair redone because its inputs changed
    (operators.io.lineage) has one, made from the old inputs."""
    from operators.io.tables import ERRORS_SCHEMA
    pairs = read_table(out, "pairs", columns=[key, "run_id"])
    done = set() if pairs is None else {r[key] for r in pairs.to_pylist() if r["run_id"] == run_id}
    errors = read_table(out, "errors", ERRORS_SCHEMA, columns=["item", "run_id"])
    failed = set() if errors is None else {r["item"] for r in errors.to_pylist() if r["run_id"] == run_id}
    return [p for p in todo if p[key] not in done and p[key] not in failed]


def set_aside_no_mask(out: Store, todo: list[dict], job: str, run_id: str) -> tuple[list[dict], list[str]]:
    """(the pairs of ``todo`` that have a mask, the ids of those that have none).

    A pair without a mask (:func:`operators.io.layout.lacks_mask`) is an input condition, not work:
    it goes to no worker and asks the endpoint nothing. It is recorded in ``errors/`` once: a row
    (stage ``prepare``, error type ``NoMask``) is written only when the pair's current error is not
    already that row, so a rerun adds no duplicate. When its mask arrives, the pair is done like any
    other and its success resolves the row. Run in the driver, before the work list is written."""
    from operators.io.layout import NO_MASK_ERROR, lacks_mask, no_mask_message
    from operators.io.tables import ERRORS_SCHEMA, error_record, write_table_shard
    missing = [p for p in todo if lacks_mask(p)]
    if not missing:
        return todo, []
    errors = read_table(out, "errors", ERRORS_SCHEMA, columns=["item", "stage", "error_type"])
    recorded = set() if errors is None else {r["item"] for r in errors.to_pylist()
                                             if r["stage"] == "prepare" and r["error_type"] == NO_MASK_ERROR}
    rows = [error_record(p["pair_id"], "prepare", no_mask_message(p), error_type=NO_MASK_ERROR, job=job,
                         run_id=run_id) for p in missing if p["pair_id"] not in recorded]
    write_table_shard(out, "errors", rows, ERRORS_SCHEMA, run_id)
    log.info("%d pairs without a mask set aside (%d newly recorded in errors/)", len(missing), len(rows))
    return [p for p in todo if not lacks_mask(p)], [p["pair_id"] for p in missing]


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


def account_limiter(cfg: LLMJobConfig, base_url: str, run_id: str, job: str, cache_root: str | None,
                    batch_root: str | None = None):
    """The account's rate limiter and the StageSpec settings every LLM stage of a job shares.

    The key is read here only to name the limiter (by a hash of endpoint and key); workers read it
    themselves from ``--api-key-source``. Detached and in a fixed namespace: every job against this
    endpoint and key on the cluster shares it (one account, one budget), and it is left running for
    the next job (it holds no CPU)."""
    from operators.llm.ratelimit import limiter_name, limiter_namespace, start_rate_limiter
    api_key = Secret.from_source(cfg.api_key_source)
    name, namespace = limiter_name(base_url, api_key.get()), limiter_namespace()
    limits = RateLimits(rpm=cfg.rpm, tpm=cfg.tpm, max_in_flight=cfg.max_in_flight)
    limiter = start_rate_limiter(name, limits, namespace=namespace, detached=True)
    common = dict(limiter_name=name, limiter_namespace=namespace, cache_root=cache_root, api_key=api_key,
                  run_id=run_id, job=job, batch_root=batch_root if cfg.batch_api else None)
    return limiter, common


def generate_and_judge_stages(cfg: LLMJobConfig, base_url: str, common: dict, prompts,
                              generate: tuple, judge: tuple) -> tuple[StageSpec, StageSpec]:
    """The two LLM stages of a job, each given as (name, input table, request builder, reply
    handler): generation with ``--model``, judging with ``--judge-model`` (default: the same).
   """
    def stage(spec: tuple, model: str) -> StageSpec:
        name, table, build, handle = spec
        return StageSpec(name=name, input_table=table, build_request=partial(build, prompts),
                         handle_result=partial(handle, prompts), llm=llm_config(cfg, base_url, model),
                         **common)
    return stage(generate, cfg.model), stage(judge, cfg.judge_model or cfg.model)


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


def validator_tally(rows, validators: str) -> dict:
    """(The rule names are the validators'.) Per-rule counts of the validators' findings over rows carrying ``validator_ok`` and
    ``validator_violations``, and how many were not sent to the judge (policy ``reject``)."""
    from operators.language.validators import RULES, rule_counts
    caught: collections.Counter = collections.Counter()
    rejected = 0
    for r in rows:
        if r["validator_violations"]:
            caught.update(rule_counts([json.loads(r["validator_violations"])]))
        rejected += r["validator_ok"] is False and validators == "reject"
    return {"validators": validators, "validator_caught": {k: caught[k] for k in RULES} | dict(caught),
            "validator_rejected": rejected}




# -- the prompt templates an output was made with ----------------------------------------------------
PROMPTS_FILE = "prompts.json"   # {job: {"generate": stem, "judge": stem}}


def output_templates(out: Store, job: str, chosen: tuple[str, str], defaults: tuple[str, str],
                     pairs_schema=None, record: bool = True) -> tuple[str, str]:
    """The (generate, judge) templates of this run. Left at the defaults, a run on an existing output goes
    on with the templates that output was made with (``prompts.json``, or for an output made before it was
    written, the versions its ``pairs`` table records): a new release's templates would change every
    request's cache key, so the answers of the old version (a pair generated but not judged yet) would be
    paid for again. A choice of the user's is used as given. Recorded for the next run either way (unless
    ``record`` is False: a plan that changes nothing)."""
    try:
        recorded = json.loads(out.read_bytes(PROMPTS_FILE))
    except (FileNotFoundError, ValueError):
        recorded = {}
    mine = recorded.get(job) or {}
    templates = (mine.get("generate"), mine.get("judge")) if mine.get("generate") and mine.get("judge") else None
    if templates is None and pairs_schema is not None:
        table = read_table(out, "pairs", pairs_schema, columns=["generate_prompt_version", "judge_prompt_version"])
        if table is not None and table.num_rows:
            seen = collections.Counter(zip(table["generate_prompt_version"].to_pylist(),
                                           table["judge_prompt_version"].to_pylist()))
            (gen, judge), _ = seen.most_common(1)[0]
            templates = (gen, judge) if gen and judge else None
    if tuple(chosen) != tuple(defaults) or templates is None:
        templates = tuple(chosen)
    elif templates != tuple(defaults):
        log.info("this output was made with the templates %s and %s: the run goes on with them (its answers are "
                 "cached under them; --generate-template/--judge-template choose others)", *templates)
    if record and mine != {"generate": templates[0], "judge": templates[1]}:
        recorded[job] = {"generate": templates[0], "judge": templates[1]}
        out.write_bytes(PROMPTS_FILE, json.dumps(recorded, indent=1, sort_keys=True).encode())
    return templates[0], templates[1]
