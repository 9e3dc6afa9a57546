"""The captions job (JL1-CC recipe, JL1-CC&QA section II-B): change-detection triplets in, judged
change captions out, through any OpenAI-compatible endpoint.

    python -m jobs.caption --input data/levir-cd --output out/captions-run --model <name>

Endpoint and key come from OPENAI_BASE_URL and OPENAI_API_KEY (or --base-url, and --api-key-source
for a secret file or an AWS Secrets Manager secret read on each worker; never a command-line value,
so the key sits in no shell history, process list, actor argument or dashboard). Outputs under --output:
``captions/`` (every candidate with scores and the selection), ``pairs/`` (one row per pair: mask stats
and selected captions), ``usage/`` (tokens and cost per request), ``errors/`` (this run's failures),
``LevirCCcaptions.json`` (LEVIR-CC format) and ``_cache/llm/`` (answers, so reruns pay nothing twice);
while it runs, ``_work/worklist/`` holds the pairs to do, which the workers read a batch at a time.
A rerun skips pairs already in ``pairs/`` and answers the rest from the cache where it can.

Real endpoints (the key is read from the environment only):

    # OpenAI
    export OPENAI_BASE_URL=https://api.openai.com/v1 OPENAI_API_KEY=sk-...
    python -m jobs.caption --input data/levir-cd --output out/levir-cc --model gpt-4o-mini \
        --rpm 500 --tpm 200000 --max-image-side 512 --price-per-mtok-in 0.15 --price-per-mtok-out 0.60

    # Moonshot / Kimi (the paper's generator; a thinking model: leave temperature to the endpoint)
    export OPENAI_BASE_URL=https://api.moonshot.ai/v1 OPENAI_API_KEY=<moonshot key>
    python -m jobs.caption --input s3://bucket/levir-cd --output s3://bucket/levir-cc --model kimi-k2.6 \
        --temperature -1 --max-tokens 8000 --rpm 200 --tpm 1000000

    # local vLLM with a vision model (vllm serve Qwen/Qwen2.5-VL-7B-Instruct --port 8000)
    export OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=EMPTY
    python -m jobs.caption --input data/levir-cd --output out/levir-cc --model Qwen/Qwen2.5-VL-7B-Instruct \
        --rpm 0 --tpm 0 --max-in-flight 64
"""
from __future__ import annotations

import os
import sys

if not __package__:  # run as `python jobs/caption.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import collections
import json
import logging
import threading
from dataclasses import dataclass, fields
from functools import partial

from operators.language.caption_ops import (JOB, TABLE_SCHEMAS, CaptionPrompts, PrepareConfig, build_generate_request,
                                   build_judge_request, find_dataset_pairs, handle_generate_result,
                                   handle_judge_result, prepare_pair)
from operators.language.captions import OVERALL_MODES, load_template, write_levir_cc
from operators.language.validators import RULES, rule_counts
from operators.llm.client import LLMConfig, Secret
from operators.llm.ratelimit import RateLimits
from operators.llm.stage import PoolConfig, StageSpec, apply_llm_stage
from operators.llm.usage import format_summary, summarize_usage
from operators.io.cli import add_deprecated_alias, init_ray, parse_job_args
from operators.io.sources import write_source
from operators.io.storage import Store
from operators.io.work_list import delete_stale_work_lists, delete_work_list, read_work_list, write_work_list
from operators.io.tables import finished_keys, new_run_id, read_table, resolve_errors

log = logging.getLogger("changeforge.caption")

LEVIR_CC_FILE = "LevirCCcaptions.json"


@dataclass
class CaptionJobConfig:
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
    temperature: float = 0.7
    max_tokens: int = 1500
    max_tokens_field: str = "max_tokens"
    timeout_s: float = 120.0
    max_retries: int = 6
    max_rate_limit_retries: int = 30
    max_reasks: int = 2
    backoff_base_s: float = 1.0
    response_format: str = "json_schema"
    strict_schema: bool = True
    image_token_rule: str = ""
    max_request_bytes: int = 20_000_000
    api_key_source: str = "env:OPENAI_API_KEY"
    generate_template: str = "caption_generate.v1"
    judge_template: str = "caption_judge.v1"
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
    "overall": "how a candidate's overall score is formed: criteria = mean of the five criteria, but a caption "
               "with accuracy <= 4 (hallucinated) scores its accuracy, so it is never selected; judge = the "
               "judge's own overall score; mean = mean of the five criteria; min = lowest criterion; "
               "< 7 is rejected, top 3 kept (ties kept)",
    "validators": "grounded validators on every caption (checked against its mask): reject = a caption that breaks a rule is "
                  "not sent to the judge (recorded with the rule), flag = sent, verdict stored, off = not run",
    "price_per_mtok_in": "USD per million prompt tokens, for the run's cost (optional)",
    "price_per_mtok_out": "USD per million completion tokens, for the run's cost (optional)",
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
    "response_format": "json_schema (falls back to json_object by itself if the endpoint rejects it) or json_object",
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
}


# Options that tune throughput, retries and the endpoint's quirks: --help hides them, --help-all shows them.
TUNING = {"max_in_flight", "image_format", "price_per_mtok_in", "price_per_mtok_out", "max_tokens_field",
          "timeout_s", "max_retries", "max_rate_limit_retries", "max_reasks", "backoff_base_s", "response_format",
          "strict_schema", "image_token_rule", "max_request_bytes", "generate_template", "judge_template",
          "prompts_dir", "actors", "concurrent_batches", "batch_size", "max_store_mb", "actor_start_timeout_s",
          "prepare_threads", "progress_every_s"}


CHOICES = {"overall": OVERALL_MODES, "detail": ("low", "high", "auto"), "validators": ("reject", "flag", "off"),
           "image_format": ("png", "jpeg"), "max_tokens_field": ("max_tokens", "max_completion_tokens"),
           "response_format": ("json_schema", "json_object"), "default_split": ("train", "val", "test")}
# Options whose flag is not the field's name (one name per concept across the jobs), and the spellings
# they replace, which keep working for one release with a deprecation warning.
FLAGS = {"dataset": "--images", "seed": "--type-seed"}
OLD_FLAGS = {"dataset": "--dataset", "seed": "--seed"}


def build_parser(cls: type = None, help_texts: dict | None = None, prog: str = "python -m jobs.caption",
                 description: str = __doc__.split("\n\n")[0]) -> argparse.ArgumentParser:
    """Options from the config dataclass (``cls``, default :class:`CaptionJobConfig`; the QA job passes
    its subclass and help texts)."""
    cls, help_texts = cls or CaptionJobConfig, help_texts or HELP
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
            kwargs.update(type=kind, default=default, choices=CHOICES.get(f.name))
        action = ap.add_argument(flag, **kwargs)
        action.tuning = f.name in TUNING
    for name, old in OLD_FLAGS.items():
        if name in {f.name for f in fields(cls)}:
            add_deprecated_alias(ap, old, FLAGS[name])
    return ap


def parse_args(argv: list[str] | None = None, cls: type = None, help_texts: dict | None = None,
               prog: str = "python -m jobs.caption", description: str = __doc__.split("\n\n")[0]):
    cls = cls or CaptionJobConfig
    args = parse_job_args(build_parser(cls, help_texts, prog, description), argv)
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where the help already states one or the option is required."""

    def _get_help_string(self, action):
        if action.required or "default:" in (action.help or "") or action.default in ("", None):
            return action.help
        return super()._get_help_string(action)


def pool_config(cfg: CaptionJobConfig) -> PoolConfig:
    """The LLM pool's settings from a language job's config. (Shared with the QA job.)"""
    return PoolConfig(actors=cfg.actors, concurrent_batches=cfg.concurrent_batches, batch_size=cfg.batch_size,
                      max_store_mb=cfg.max_store_mb, actor_start_timeout_s=cfg.actor_start_timeout_s,
                      prepare_threads=cfg.prepare_threads)


def require_endpoint(cfg: CaptionJobConfig) -> str:
    base_url = cfg.base_url or os.environ.get("OPENAI_BASE_URL", "")
    if not base_url:
        sys.exit("jobs.caption: no endpoint. Set OPENAI_BASE_URL (e.g. https://api.openai.com/v1, or "
                 "http://localhost:8000/v1 for a local vLLM) and OPENAI_API_KEY, or pass --base-url.")
    return base_url


def _llm_config(cfg: CaptionJobConfig, base_url: str, model: str) -> LLMConfig:
    return LLMConfig(model=model, base_url=base_url, timeout_s=cfg.timeout_s, max_retries=cfg.max_retries,
                     max_rate_limit_retries=cfg.max_rate_limit_retries, strict_schema=cfg.strict_schema,
                     image_token_rule=cfg.image_token_rule, max_request_bytes=cfg.max_request_bytes,
                     max_reasks=cfg.max_reasks, backoff_base_s=cfg.backoff_base_s,
                     temperature=cfg.temperature if cfg.temperature >= 0 else None,
                     max_tokens=cfg.max_tokens, max_tokens_field=cfg.max_tokens_field, response_format=cfg.response_format, detail=cfg.detail,
                     price_per_mtok_in=cfg.price_per_mtok_in, price_per_mtok_out=cfg.price_per_mtok_out,
                     use_cache=cfg.cache)


def _ensure_ray(cfg: CaptionJobConfig) -> None:
    """RAY_ADDRESS (a cluster, or ours under ``ray job submit``) or a local Ray, as every job does.

    Local workers inherit this process's environment but not its ``sys.path``: put the repo on
    PYTHONPATH so that ``python jobs/caption.py`` works from any folder without an install."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
            log.info("llm progress: %d requests done (%.1f/s), %d answered from cache, %d failed, "
                     "%d in flight, tokens %d+%d, cost $%.4f (%d pairs in this run)", s["released"], rate,
                     s.get("cached", 0), s.get("failed", 0), s["in_flight"], s.get("prompt_tokens", 0),
                     s.get("completion_tokens", 0), s.get("cost_usd", 0.0), self.total_pairs)


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
               limiter, progress_every_s: float, *, work: Store, job: str, run_id: str) -> dict[str, int]:
    """Prepare every pair, run the LLM stages in order, stream every row to ``sink``; logs progress.
    Returns rows written per table. (Shared with the QA job.) The work list goes through ``work``
    (the output store), not the object store, and is removed at the end. The rate limiter is left
    running: it is the account's, shared by every job against the same endpoint and key."""
    configure_pipeline(pool)
    name = f"{job}-{run_id}"
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


def account_limiter(cfg: CaptionJobConfig, base_url: str, run_id: str, job: str, cache_root: str | None):
    """The account's rate limiter and the StageSpec settings every LLM stage of a job shares.

    The key is read here only to name the limiter (by a hash of endpoint and key); workers read it
    themselves from ``--api-key-source``. Detached and in a fixed namespace: every job against this
    endpoint and key on the cluster shares it (one account, one budget), and it is left running for
    the next job (it holds no CPU). (Shared with the QA job.)"""
    from operators.llm.ratelimit import limiter_name, limiter_namespace, start_rate_limiter
    api_key = Secret.from_source(cfg.api_key_source)
    name, namespace = limiter_name(base_url, api_key.get()), limiter_namespace()
    limits = RateLimits(rpm=cfg.rpm, tpm=cfg.tpm, max_in_flight=cfg.max_in_flight)
    limiter = start_rate_limiter(name, limits, namespace=namespace, detached=True)
    common = dict(limiter_name=name, limiter_namespace=namespace, cache_root=cache_root, api_key=api_key,
                  run_id=run_id, job=job)
    return limiter, common


def generate_and_judge_stages(cfg: CaptionJobConfig, base_url: str, common: dict, prompts,
                              generate: tuple, judge: tuple) -> tuple[StageSpec, StageSpec]:
    """The two LLM stages of a job, each given as (name, input table, request builder, reply
    handler): generation with ``--model``, judging with ``--judge-model`` (default: the same).
    (Shared with the QA job.)"""
    def stage(spec: tuple, model: str) -> StageSpec:
        name, table, build, handle = spec
        return StageSpec(name=name, input_table=table, build_request=partial(build, prompts),
                         handle_result=partial(handle, prompts), llm=_llm_config(cfg, base_url, model),
                         **common)
    return stage(generate, cfg.model), stage(judge, cfg.judge_model or cfg.model)


def summary_table(out: Store, table: str, columns: list[str], run_id: str | None = None, schemas: dict | None = None):
    """The ``columns`` of a table's current state (only ``run_id``'s rows if given), as an Arrow
    table: the driver reads what the summary and the LEVIR-CC file need, not every column of every
    row, and keeps them columnar (as Python dicts, 5,500 pairs' rows cost the driver ~90 MB).
    ``schemas``: the job's table schemas (default: this job's)."""
    import pyarrow.compute as pc
    t = read_table(out, table, (schemas or TABLE_SCHEMAS)[table], columns=list(dict.fromkeys([*columns, "run_id"])))
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


def summary_rows(out: Store, table: str, columns: list[str], run_id: str | None = None, schemas: dict | None = None):
    """:func:`summary_table`'s rows one at a time."""
    for rows in row_batches(summary_table(out, table, columns, run_id, schemas)):
        yield from rows


def run(cfg: CaptionJobConfig) -> dict:
    """Run the job; returns a summary dict (also printed by ``main``)."""
    base_url = require_endpoint(cfg)
    if cfg.overall not in OVERALL_MODES:
        raise ValueError(f"--overall must be one of {OVERALL_MODES}")
    _ensure_ray(cfg)
    from operators.io.tables import TableSink

    out = Store(cfg.output)
    run_id = new_run_id()
    # Which dataset was captioned, so that the QA job, the review and the report find it from here.
    write_source(out, JOB, input=cfg.input, dataset=cfg.input, list_file=cfg.list_file)
    pairs, skipped = find_dataset_pairs(cfg.input, cfg.list_file or None, cfg.default_split)
    for reason, n in skipped.items():
        log.info("%d pairs skipped: %s", n, reason)
    done = finished_keys(out, "pairs", "pair_id")
    todo = [p for p in pairs if p["pair_id"] not in done]
    n_found, n_todo = len(pairs), len(todo)
    del pairs, done   # the driver keeps only what is still to do (it goes to the work list)
    delete_stale_work_lists(out, JOB)   # a killed driver never reached its own cleanup
    log.info("%d pairs found, %d already finished, %d to do (run %s)", n_found, n_found - n_todo, n_todo, run_id)

    judge_model = cfg.judge_model or cfg.model
    prompts = CaptionPrompts(generate=load_template(cfg.generate_template, cfg.prompts_dir),
                             judge=load_template(cfg.judge_template, cfg.prompts_dir), detail=cfg.detail,
                             max_image_side=cfg.max_image_side, image_format=cfg.image_format,
                             overall_mode=cfg.overall, model=cfg.model,
                             judge_model=judge_model, run_id=run_id, validators=cfg.validators)
    limiter, common = account_limiter(cfg, base_url, run_id, JOB, out.uri() if cfg.cache else None)
    generate, judge = generate_and_judge_stages(
        cfg, base_url, common, prompts, ("caption_generate", "_generate", build_generate_request,
                                         handle_generate_result),
        ("caption_judge", "_judge", build_judge_request, handle_judge_result))
    pool = pool_config(cfg)

    counts: dict[str, int] = {}
    if todo:
        prep = PrepareConfig(max_image_side=cfg.max_image_side, image_format=cfg.image_format, detail=cfg.detail)
        counts = run_stages(todo, prepare_pair, {"config": prep, "run_id": run_id}, [generate, judge], pool,
                            TableSink(out.uri(), TABLE_SCHEMAS, run_id), limiter, cfg.progress_every_s,
                            work=out, job=JOB, run_id=run_id)
    # The end of the run (LEVIR-CC file, errors resolved, counts) runs in a worker process of its own:
    # its Arrow reads and sort grow with the archive, and the driver must not (benchmarks/memory_scale.py).
    finished = run_on_worker(finish_captions_run, out.uri(), run_id, cfg.validators)
    log.info("end of run assembled in a worker (peak RSS %.0f MB)", finished.pop("assembly_peak_rss_mb"))
    return {"run_id": run_id, "pairs_found": n_found, "pairs_skipped_finished": n_found - n_todo,
            "pairs_skipped": skipped, "rows_written": counts, **finished}


def skipped_line(skipped: dict[str, int]) -> str:
    """The printed line of pairs left out with a reason (empty when none). (Shared with the QA job.)"""
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


def finish_captions_run(output: str, run_id: str, validators: str) -> dict:
    """The end of a captions run: this run's successes resolve their earlier errors, the LEVIR-CC
    file is written from the ``pairs`` table (read columnar, streamed out), and this run's rows are
    counted. Idempotent. Returns the summary's counts and this process's peak RSS."""
    out = Store(output)
    pair_table = summary_table(out, "pairs", ["pair_id", "split", "filename", "selected_captions", "car"])
    finished = 0 if pair_table is None else pair_table.num_rows
    # errors/ accumulates across runs; a pair's errors leave its current state once it succeeds.
    if pair_table is not None:
        resolve_errors(out, pair_table.column("pair_id").to_pylist(), run_id, job=JOB)
        pair_table = pair_table.sort_by([("split", "ascending"), ("filename", "ascending")])
    with out.open_output(LEVIR_CC_FILE) as f:
        write_levir_cc(row_batches(pair_table), f)
    del pair_table
    errors_table = read_table(out, "errors", TABLE_SCHEMAS["errors"], columns=["item"])  # current state
    tally = validator_tally(summary_rows(out, "captions", ["validator_ok", "validator_violations"], run_id),
                            validators)
    return {**tally, "pairs_finished_total": finished,
            "errors": 0 if errors_table is None else errors_table.num_rows, "usage": run_usage(out, run_id),
            "assembly_peak_rss_mb": peak_rss_mb()}


def run_usage(out: Store, run_id: str, schemas: dict | None = None) -> dict:
    """This run's LLM usage summary, from the columns of ``usage/`` it needs (shared with the QA job)."""
    return summarize_usage(summary_rows(out, "usage", ["stage", "attempts", "cached", "status", "prompt_tokens",
                                                       "completion_tokens", "cost_usd"], run_id, schemas))


def validator_tally(rows, validators: str) -> dict:
    """Per-rule counts of the validators' findings over rows carrying ``validator_ok`` and
    ``validator_violations``, and how many were not sent to the judge (policy ``reject``)."""
    caught: collections.Counter = collections.Counter()
    rejected = 0
    for r in rows:
        if r["validator_violations"]:
            caught.update(rule_counts([json.loads(r["validator_violations"])]))
        rejected += r["validator_ok"] is False and validators == "reject"
    return {"validators": validators, "validator_caught": {k: caught[k] for k in RULES} | dict(caught),
            "validator_rejected": rejected}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_args(argv)
    summary = run(cfg)
    print(f"run {summary['run_id']}: {summary['pairs_found']} pairs, {summary['pairs_skipped_finished']} already "
          f"finished, {summary['pairs_finished_total']} finished in total, {summary['errors']} errors in this run")
    if summary["pairs_skipped"]:
        print(skipped_line(summary["pairs_skipped"]))
    print(f"validators ({summary['validators']}) caught per rule: "
          + ", ".join(f"{k}={v}" for k, v in summary["validator_caught"].items())
          + (f"; {summary['validator_rejected']} captions not sent to the judge" if cfg.validators == "reject" else ""))
    print(format_summary(summary["usage"]))
    print(f"outputs: {cfg.output}/{{captions,pairs,usage,errors}}/ and {cfg.output}/{LEVIR_CC_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
