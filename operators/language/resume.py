"""Which pairs a captions or QA run does: resuming by lineage (operators.io.lineage).

A pair is done again when what its rows were made from changed: its images, its mask, the captions a
QA pair was grounded in, the templates' text, the models, or the settings that change a result. The
driver reads only what it must to tell: the output's ``pairs`` table (two columns), the dataset's
listing (each file's stamp comes with it), and the files whose stamps changed since their row was made.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

import cv2
import numpy as np

from operators.io import lineage
from operators.io.storage import Store
from operators.io.tables import read_table
from operators.language.mask_analysis import binarize_mask

log = logging.getLogger(__name__)

# The job settings that change a result (both jobs): a change redoes every pair. Limits, retries, the
# pool and prices do not change an answer and are left out.
RESULT_OPTIONS = ("overall", "max_image_side", "image_format", "detail", "validators", "temperature")


def run_prompts(cfg: Any, out: Store, job: str, config_cls: type, pairs_schema, run_id: str = "",
                record: bool = True):
    """The run's templates (an existing output goes on with its own unless others are chosen:
    ``output_templates``), loaded, with the models and settings: the prompts both stages build from."""
    from operators.language.caption_ops import CaptionPrompts
    from operators.language.captions import load_template
    from operators.llm.job_runner import output_templates
    gen, judge = output_templates(out, job, (cfg.generate_template, cfg.judge_template),
                                  (config_cls.generate_template, config_cls.judge_template), pairs_schema,
                                  record=record)
    return CaptionPrompts(generate=load_template(gen, cfg.prompts_dir), judge=load_template(judge, cfg.prompts_dir),
                          detail=cfg.detail, max_image_side=cfg.max_image_side, image_format=cfg.image_format,
                          overall_mode=cfg.overall, model=cfg.model, judge_model=cfg.judge_model or cfg.model,
                          run_id=run_id, validators=cfg.validators)


def job_lineage(cfg: Any, prompts: Any, extra: tuple[str, ...] = ()) -> dict:
    """The run-wide part of every row's lineage: templates (their text), models and settings."""
    return {"generate_template": lineage.template_digest(prompts.generate),
            "judge_template": lineage.template_digest(prompts.judge),
            "model": prompts.model, "judge_model": prompts.judge_model,
            "options": lineage.value_digest({k: getattr(cfg, k) for k in (*RESULT_OPTIONS, *extra)})}


def recorded_lineage(out: Store, schema) -> dict[str, dict | None]:
    """pair id -> the lineage its current ``pairs`` row records (None: made before lineage was kept)."""
    t = read_table(out, "pairs", schema, columns=["pair_id", lineage.COLUMN])
    if t is None:
        return {}
    col = t.column(lineage.COLUMN).to_pylist() if lineage.COLUMN in t.column_names else [None] * t.num_rows
    return {pid: lineage.loads(text) for pid, text in zip(t.column("pair_id").to_pylist(), col) if pid is not None}


def file_digest(root: str, role: str, rel: str) -> str:
    """Today's digest of one file: its bytes (images), the binary mask's pixels (masks). A file that
    cannot be read or decoded gives :func:`operators.io.lineage.unreadable` (its path and the reason):
    its pair is then reported as unreadable and counted as failed, not redone on every run."""
    try:
        data = Store(root).read_bytes(rel)
        if role != "mask":
            return lineage.bytes_digest(data)
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
        if img is None:
            return lineage.unreadable(rel, "not a readable image")
        return lineage.mask_digest(binarize_mask(img))
    except Exception as exc:  # noqa: BLE001 - see the docstring
        return lineage.unreadable(rel, f"{type(exc).__name__}: {exc}")


def plan(out: Store, pairs: list[dict], lineage_of: Callable[[dict], dict], schema,
         threads: int = 16) -> lineage.ResumePlan:
    """Split ``pairs`` into current, stale and missing (:func:`operators.io.lineage.plan_resume`);
    ``lineage_of(pair)`` is the pair's run-wide lineage today (:func:`job_lineage`, plus its caption
    set for QA). Files whose stamps changed are read in a thread pool first. Every pair to do carries
    its ``lineage_job`` to the worker that makes its rows."""
    recorded = recorded_lineage(out, schema)
    wanted: dict[tuple[str, str, str], str] = {}
    for p in pairs:
        if recorded.get(p["pair_id"]):
            wanted.update({(p["root"], role, rel): "" for role, rel in lineage.moved_files(p, recorded[p["pair_id"]])})
    if wanted:
        log.info("%d input files changed their stamps since their rows were made: digesting them", len(wanted))
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(wanted)))) as pool:
            keys = list(wanted)
            for k, d in zip(keys, pool.map(lambda k: file_digest(*k), keys)):
                wanted[k] = d

    def today(p: dict, rec: Mapping) -> dict:
        files = lineage.file_lineage(p, rec, lambda role, rel: wanted.get((p["root"], role, rel))
                                     or file_digest(p["root"], role, rel))
        return {**files, **lineage_of(p)}

    result = lineage.plan_resume(pairs, recorded, today)
    for p in result.todo:
        p["lineage_job"] = lineage_of(p)
    return result
