"""Ray-facing pieces of the captions job: finding pairs, preparing them (read, check, analyse the
mask, encode images), and the two LLM stages (generate, judge) as request builders and handlers for
the generic :mod:`operators.llm.stage`.

Row flow (all rows are envelopes, see :mod:`operators.io.tables`):
``prepare_pair`` -> ``_generate`` rows (or ``errors``) -> generation stage -> ``_judge`` rows (+ ``usage``)
-> judge stage -> ``captions`` x5 and ``pairs`` rows (+ ``usage``) -> TableSink. The jobs run all
three in the LLM actors, one pair per coroutine, so the encoded images never enter the object store.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import cv2
import numpy as np
import pyarrow as pa

from operators.language.captions import (CRITERIA, PERSPECTIVES, PromptTemplate, generation_schema, judge_schema,
                                overall_score, select_captions)
from operators.llm.client import LLMRequest, LLMResult
from operators.llm.images import content_hash, data_url, estimate_image_tokens, fit_max_side, image_part
from operators.llm.usage import USAGE_SCHEMA
from operators.io import lineage
from operators.io.lineage import mask_digest
from operators.language.mask_analysis import MaskAnalysisConfig, analyze_mask, binarize_mask
from operators.language.validators import ValidatorConfig, mask_facts, validate_text, violations_json
from operators.io.layout import (IMAGE_SUFFIXES, NO_MASK_YET, SPLITS, discover_pairs,  # noqa: F401 - re-exported
                                 find_dataset_pairs, is_pairs_output, split_lists)
from operators.io.storage import Store
from operators.io.tables import ERRORS_SCHEMA, envelope, error_envelope, keyed

JOB = "caption"

CAPTIONS_SCHEMA = pa.schema([
    ("pair_id", pa.string()), ("split", pa.string()), ("filename", pa.string()),
    ("candidate_index", pa.int32()), ("perspective", pa.string()), ("caption", pa.string()),
    *[(c, pa.int32()) for c in CRITERIA],
    ("judge_overall", pa.int32()), ("judge_reason", pa.string()),
    ("overall", pa.float64()), ("overall_mode", pa.string()),
    ("selected", pa.bool_()), ("selection_reason", pa.string()),
    ("generate_prompt_version", pa.string()), ("judge_prompt_version", pa.string()),
    ("model", pa.string()), ("judge_model", pa.string()), ("run_id", pa.string()),
    ("validator_ok", pa.bool_()), ("validator_violations", pa.string()), ("validators", pa.string()),
    ("lineage", pa.string()),
])

PAIRS_SCHEMA = pa.schema([
    ("pair_id", pa.string()), ("split", pa.string()), ("filename", pa.string()),
    ("height", pa.int32()), ("width", pa.int32()),
    ("car", pa.float64()), ("changed_pixels", pa.int64()), ("components", pa.int32()),
    ("change_region", pa.string()), ("cell_shares", pa.list_(pa.float64())),
    ("n_candidates", pa.int32()), ("n_selected", pa.int32()),
    ("selected_captions", pa.list_(pa.string())), ("selected_perspectives", pa.list_(pa.string())),
    ("generate_prompt_version", pa.string()), ("judge_prompt_version", pa.string()),
    ("model", pa.string()), ("judge_model", pa.string()), ("run_id", pa.string()),
    ("lineage", pa.string()),   # what the row was made from (operators.io.lineage)
])

# Keyed: a pair redone because its inputs changed supersedes its earlier rows (the history keeps them).
CAPTIONS_SCHEMA = keyed(CAPTIONS_SCHEMA, "pair_id", "candidate_index")
PAIRS_SCHEMA = keyed(PAIRS_SCHEMA, "pair_id")
TABLE_SCHEMAS = {"captions": CAPTIONS_SCHEMA, "pairs": PAIRS_SCHEMA, "usage": USAGE_SCHEMA,
                 "errors": ERRORS_SCHEMA}


# -- finding pairs: moved to operators.io.layout (re-exported: the captions and QA jobs import them here)


# -- preparing a pair --------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrepareConfig:
    max_image_side: int = 1024
    image_format: str = "png"
    detail: str = "auto"
    mask: MaskAnalysisConfig = field(default_factory=MaskAnalysisConfig)


def _decode(data: bytes, what: str) -> np.ndarray:
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    if image is None:
        raise ValueError(f"{what} is not a readable image")
    return image


def _to_rgb8(image: np.ndarray) -> np.ndarray:
    if image.dtype != np.uint8:  # 16-bit or float imagery: stretch to 8 bits for viewing
        lo, hi = np.percentile(image, (1, 99))
        image = np.clip((image.astype(np.float64) - lo) / max(hi - lo, 1e-9) * 255, 0, 255).astype(np.uint8)
    if image.ndim == 2:
        return cv2.cvtColor(image, cv2.COLOR_GRAY2RGB)
    if image.shape[2] == 4:
        return cv2.cvtColor(image, cv2.COLOR_BGRA2RGB)
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def prepare_pair(item: dict, config: PrepareConfig = PrepareConfig(), run_id: str = "") -> list[dict]:
    """One pair -> one ``_generate`` row with mask stats and encoded images, or one ``errors`` row."""
    pair_id = item["pair_id"]
    try:
        store = Store(item["root"])
        raw = {}
        for key, what in (("a_rel", "pre-change image (A)"), ("b_rel", "post-change image (B)"),
                          ("label_rel", "change mask (label)")):
            if not item.get(key):
                raise FileNotFoundError(f"missing {what} for {item['filename']}")
            try:
                raw[key] = store.read_bytes(item[key])
            except (FileNotFoundError, OSError) as exc:
                raise FileNotFoundError(f"cannot read {what} {item[key]}: {type(exc).__name__}") from None
        a = _to_rgb8(_decode(raw["a_rel"], "pre-change image (A)"))
        b = _to_rgb8(_decode(raw["b_rel"], "post-change image (B)"))
        mask = binarize_mask(_decode(raw["label_rel"], "change mask (label)"))
        if not (a.shape[:2] == b.shape[:2] == mask.shape[:2]):
            raise ValueError(f"size mismatch: A {a.shape[1]}x{a.shape[0]}, B {b.shape[1]}x{b.shape[0]}, "
                             f"label {mask.shape[1]}x{mask.shape[0]} (width x height)")
        stats = analyze_mask(mask, config.mask)
        a_s, b_s = fit_max_side(a, config.max_image_side), fit_max_side(b, config.max_image_side)
        m_s = fit_max_side(mask.astype(np.uint8) * 255, config.max_image_side, nearest=True)
        h, w = a_s.shape[:2]
        record = {
            "pair_id": pair_id, "split": item["split"], "filename": item["filename"],
            "height": stats.height, "width": stats.width, "car": stats.car,
            "changed_pixels": stats.changed_pixels, "components": stats.components,
            "change_region": stats.region, "cell_shares": stats.cell_shares,
            "mask_facts": mask_facts(mask, stats.components, config.mask.min_component_px),  # for the validators
            "hashes": {k: content_hash(v) for k, v in raw.items()},
            # What the pair's rows are made from (operators.io.lineage): digests of what was just read,
            # the stamps the driver listed, and the run's templates, models and settings.
            "lineage": {"A": content_hash(raw["a_rel"]), "B": content_hash(raw["b_rel"]), "mask": mask_digest(mask),
                        lineage.STAMPS: lineage.item_stamps(item), **(item.get("lineage_job") or {})},
            "a_url": data_url(a_s, config.image_format), "b_url": data_url(b_s, config.image_format),
            "mask_url": data_url(m_s, "png"),
            "image_tokens": estimate_image_tokens(w, h, config.detail),
            "mask_tokens": estimate_image_tokens(m_s.shape[1], m_s.shape[0], MASK_DETAIL),
        }
        return [envelope("_generate", record)]
    except Exception as exc:  # noqa: BLE001 - every pair ends in a table
        return [error_envelope(pair_id, "prepare", exc, job=JOB, run_id=run_id)]


# -- the two LLM stages --------------------------------------------------------------------------------
# The mask is a coarse binary guide: low detail (one tile's price) is all it needs, in every stage and job.
MASK_DETAIL = "low"


def pair_values(record: dict) -> dict:
    """The template values every stage of a pair shares (its mask metadata)."""
    return {"car_percent": f"{100 * record['car']:.1f}", "region": record["change_region"],
            "components": record["components"]}


def pair_messages(template: PromptTemplate, record: dict, detail: str, stage_text: str, system: str,
                  mask: bool = True) -> list[dict]:
    """A stage's messages, laid out for providers' prefix caches: what every request shares first (the
    system text), then what the pair's requests share (its images, always in the order A, B, mask and at
    the same detail), the stage's own text last (and, in JSON mode, the reply schema after it: see
    ``with_schema_in_prompt``).

    v3 (a template with ``## images``): the images it lists, then its pair text (if any), then the stage
    text. The judges list A and B only, so A and B end the prefix all of a pair's requests share, in both
    jobs. v2 (a pair section, no images section): A, B and the mask in every stage, then the pair text.
    v1 (neither): its text before the images, and the judge without the mask (``mask``)."""
    urls = {"A": (record["a_url"], detail), "B": (record["b_url"], detail), "mask": (record["mask_url"], MASK_DETAIL)}
    if template.images:
        names = template.images
    else:
        names = ("A", "B", "mask") if mask or template.pair else ("A", "B")
    images = [image_part(*urls[n]) for n in names]
    if template.images or template.pair:
        pair = [{"type": "text", "text": template.render_pair(**pair_values(record))}] if template.pair else []
        content = images + pair + [{"type": "text", "text": stage_text}]
    else:
        content = [{"type": "text", "text": stage_text}] + images
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


def sends_mask(template: PromptTemplate, mask: bool = True) -> bool:
    """Whether :func:`pair_messages` sends the mask for ``template``."""
    return "mask" in template.images if template.images else bool(mask or template.pair)


@dataclass(frozen=True)
class CaptionPrompts:
    generate: PromptTemplate
    judge: PromptTemplate
    detail: str = "auto"
    max_image_side: int = 1024
    image_format: str = "png"
    overall_mode: str = "criteria"
    model: str = ""
    judge_model: str = ""
    run_id: str = ""
    validators: str = "flag"        # reject | flag | off: grounded validators before the judge
    validator_config: ValidatorConfig = field(default_factory=ValidatorConfig)


def build_generate_request(prompts: CaptionPrompts, record: dict) -> LLMRequest:
    system, user = prompts.generate.render(**pair_values(record))
    return LLMRequest(reply_note=prompts.generate.render_reply(**pair_values(record)),
        item=record["pair_id"], messages=pair_messages(prompts.generate, record, prompts.detail, user, system),
        schema=generation_schema(), schema_name="change_captions",
        cache_parts={"stage": "caption_generate", "template": prompts.generate.version, "images": record["hashes"],
                     "max_image_side": prompts.max_image_side, "image_format": prompts.image_format,
                     "candidate": "all"})  # image tokens: counted from the images sent, by the model's rule


def handle_generate_result(prompts: CaptionPrompts, record: dict, result: LLMResult) -> list[dict]:
    captions = [result.value[p].strip() for p in PERSPECTIVES]
    verdicts = [check_caption(prompts, record, c) for c in captions]
    record = dict(record, captions=captions, verdicts=verdicts)
    if not _judged(prompts, record):  # every caption rejected by a validator: nothing to pay a judge for
        return handle_judge_result(prompts, record, None)
    return [envelope("_judge", record)]


def check_caption(prompts: CaptionPrompts, record: dict, caption: str) -> list:
    """``[ok, violations json]`` by the grounded validators, ``[None, None]`` with ``--validators off``."""
    if prompts.validators == "off":
        return [None, None]
    ok, violations = validate_text(caption, record["mask_facts"], cfg=prompts.validator_config)
    return [ok, violations_json(violations)]


def _judged(prompts: CaptionPrompts, record: dict) -> list[str]:
    """Perspectives sent to the judge: all, except under ``reject`` those a validator rejected."""
    verdicts = record.get("verdicts") or [[None, None]] * len(PERSPECTIVES)
    return [p for p, v in zip(PERSPECTIVES, verdicts) if prompts.validators != "reject" or v[0] is not False]


def build_judge_request(prompts: CaptionPrompts, record: dict) -> LLMRequest:
    judged = _judged(prompts, record)
    listing = "\n".join(f"{p}: {c}" for p, c in zip(PERSPECTIVES, record["captions"]) if p in judged)
    values = dict(pair_values(record), captions=listing, keys=", ".join(judged))
    system, user = prompts.judge.render(**values)
    return LLMRequest(reply_note=prompts.judge.render_reply(**values),
        item=record["pair_id"],
        messages=pair_messages(prompts.judge, record, prompts.detail, user, system, mask=False),
        schema=judge_schema(tuple(judged)), schema_name="caption_scores",
        cache_parts={"stage": "caption_judge", "template": prompts.judge.version,
                     "images": {k: record["hashes"][k] for k in ("a_rel", "b_rel", "label_rel")},
                     "max_image_side": prompts.max_image_side, "image_format": prompts.image_format,
                     "candidates": [c for p, c in zip(PERSPECTIVES, record["captions"]) if p in judged]})


def handle_judge_result(prompts: CaptionPrompts, record: dict, result: LLMResult | None) -> list[dict]:
    judged = _judged(prompts, record) if result is not None else []
    verdicts = record.get("verdicts") or [[None, None]] * len(PERSPECTIVES)
    scores = {p: result.value[p] for p in judged}
    overall = {p: overall_score(scores[p], prompts.overall_mode) for p in judged}
    selection = dict(zip(judged, select_captions([overall[p] for p in judged])))
    common = {"pair_id": record["pair_id"], "split": record["split"], "filename": record["filename"],
              "generate_prompt_version": prompts.generate.version, "judge_prompt_version": prompts.judge.version,
              "model": prompts.model, "judge_model": prompts.judge_model, "run_id": prompts.run_id,
              "lineage": lineage.dumps(record["lineage"]) if record.get("lineage") else None}
    out = []
    for i, (p, caption, verdict) in enumerate(zip(PERSPECTIVES, record["captions"], verdicts)):
        row = {**common, "candidate_index": i, "perspective": p, "caption": caption, "overall_mode": prompts.overall_mode,
               "validator_ok": verdict[0], "validator_violations": verdict[1], "validators": prompts.validators}
        if p in scores:
            s, sel = scores[p], selection[p]
            row.update({c: int(s[c]) for c in CRITERIA}, judge_overall=int(s["overall"]), judge_reason=s["reason"],
                       overall=overall[p], selected=sel.selected, selection_reason=sel.reason)
        else:  # rejected by a validator (--validators reject): never sent to the judge
            rules = sorted({v["rule"] for v in json.loads(verdict[1] or "[]")})
            row.update(selected=False, selection_reason=f"rejected by validator: {', '.join(rules)}")
        out.append(envelope("captions", row))
    kept = [(p, c) for p, c in zip(PERSPECTIVES, record["captions"]) if p in selection and selection[p].selected]
    out.append(envelope("pairs", {
        **common, **{k: record[k] for k in ("height", "width", "car", "changed_pixels", "components", "cell_shares")},
        "change_region": record["change_region"], "n_candidates": len(PERSPECTIVES), "n_selected": len(kept),
        "selected_captions": [c for _, c in kept], "selected_perspectives": [p for p, _ in kept]}))
    return out
