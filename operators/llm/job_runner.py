"""What every LLM job (captions, QA) sets up the same way before its passes: Ray, the account's rate
limiter, the generate and judge stages, the pairs set aside for lack of a mask, and the prompt
templates an output was made with.

The runner is layered: the options and their parser are in :mod:`operators.llm.job_options`, the pass
loop (real time, or batch passes) and its stops in :mod:`operators.llm.job_passes`, the progress line
and the end-of-run summaries in :mod:`operators.llm.job_summary`. Jobs are wiring: a job names its
tables, prompts, request builders and reply handlers, and these run them.
"""
from __future__ import annotations

import collections
import json
import logging
import os
from functools import partial

from operators.io.cli import init_ray
from operators.io.storage import Store
from operators.io.tables import read_table
from operators.llm.client import Secret
from operators.llm.job_options import LLMJobConfig, llm_config
from operators.llm.ratelimit import RateLimits
from operators.llm.stage import StageSpec

log = logging.getLogger("changeforge.llm")


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
