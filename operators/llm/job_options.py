"""The options every LLM job (captions, QA) shares: the config dataclass, the help texts, which
options are tuning (hidden from ``--help``), their choices, checks and old spellings, the parser
built from them, and the settings the pool and the caller take from them."""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, fields

from operators.io import validation
from operators.io.cli import add_deprecated_alias, parse_job_args
from operators.llm.client import LLMConfig
from operators.llm.stage import PoolConfig


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
