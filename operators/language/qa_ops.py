"""Ray-facing pieces of the QA job: caption context, preparing pairs (the captions job's reader plus the
drawn question types), and the two LLM stages (generate five QA pairs, judge all five in one request)
as request builders and handlers for the generic :mod:`operators.llm.stage`.

Row flow (envelopes, see :mod:`operators.io.tables`):
``prepare_qa_pair`` -> ``_qa_generate`` (or ``errors``) -> generation stage -> validators ->
``_qa_judge`` (+ ``usage``) -> judge stage -> ``qa`` x5 and ``pairs`` (+ ``usage``) -> TableSink.
An answer holding a figure (a percentage or a measured quantity, hedged or not: the paper's numbers rule,
:func:`operators.language.validators.qa_validator_config`) is not sent to the judge under any policy;
with ``--validators reject`` neither is one that breaks any rule. When all five are kept back there is no
judge request and the pair's rows are written straight after generation.
"""
from __future__ import annotations

import json
import pyarrow as pa

from operators.io.storage import Store
from operators.io import lineage
from operators.io.tables import ERRORS_SCHEMA, envelope, keyed, read_table
from operators.language.caption_ops import (CAPTIONS_SCHEMA, CaptionPrompts, PrepareConfig, pair_messages, pair_values,
                                            prepare_pair, sends_mask)
from operators.language.qa import (QA_CRITERIA, TYPE_GUIDES, TYPE_KEYS, draw_types, generation_schema, judge_schema,
                                   overall_score, select_qa)
from operators.language.validators import RULES, qa_validator_config, validate_text, violations_json
from operators.llm.client import LLMRequest, LLMResult
from operators.llm.usage import USAGE_SCHEMA

JOB = "qa"
VALIDATOR_POLICIES = ("reject", "flag", "off")
MAX_CONTEXT_CAPTIONS = 3

QA_SCHEMA = pa.schema([
    ("pair_id", pa.string()), ("filename", pa.string()), ("split", pa.string()),
    ("qa_index", pa.int32()), ("question_type", pa.string()), ("question", pa.string()), ("answer", pa.string()),
    *[(f"score_{c}", pa.int32()) for c in QA_CRITERIA],
    ("judge_overall", pa.int32()), ("judge_reason", pa.string()),
    ("overall", pa.float64()), ("overall_mode", pa.string()),
    ("selected", pa.bool_()), ("selection_reason", pa.string()),
    ("validator_ok", pa.bool_()), ("validator_violations", pa.string()), ("validators", pa.string()),
    ("generate_prompt_version", pa.string()), ("judge_prompt_version", pa.string()),
    ("model", pa.string()), ("judge_model", pa.string()), ("run_id", pa.string()),
    ("lineage", pa.string()),   # what the row was made from (operators.io.lineage)
])

QA_PAIRS_SCHEMA = pa.schema([
    ("pair_id", pa.string()), ("split", pa.string()), ("filename", pa.string()),
    ("height", pa.int32()), ("width", pa.int32()),
    ("car", pa.float64()), ("changed_pixels", pa.int64()), ("components", pa.int32()),
    ("change_region", pa.string()), ("cell_shares", pa.list_(pa.float64())),
    ("question_types", pa.list_(pa.string())), ("seed", pa.int64()),
    ("context_captions", pa.list_(pa.string())),
    ("n_candidates", pa.int32()), ("n_validator_rejected", pa.int32()), ("n_judged", pa.int32()),
    ("n_selected", pa.int32()),
    ("generate_prompt_version", pa.string()), ("judge_prompt_version", pa.string()),
    ("model", pa.string()), ("judge_model", pa.string()), ("run_id", pa.string()),
    ("lineage", pa.string()),   # what the row was made from (operators.io.lineage)
])

# Keyed: a pair redone because its inputs changed supersedes its earlier rows (the history keeps them).
QA_SCHEMA = keyed(QA_SCHEMA, "pair_id", "qa_index")
QA_PAIRS_SCHEMA = keyed(QA_PAIRS_SCHEMA, "pair_id")
TABLE_SCHEMAS = {"qa": QA_SCHEMA, "pairs": QA_PAIRS_SCHEMA, "usage": USAGE_SCHEMA, "errors": ERRORS_SCHEMA}


# -- caption context -----------------------------------------------------------------------------------
def load_caption_context(uri: str, limit: int | None = MAX_CONTEXT_CAPTIONS) -> dict[str, list[str]]:
    """Up to ``limit`` selected captions per pair from a captions job output (``captions/`` table: the
    selected ones, best overall first), else from a LEVIR-CC JSON file (or ``LevirCCcaptions.json``
    inside the folder). Keys are pair ids for the table and file-name stems for the JSON. ``limit=None``:
    every selected caption (the caption set a QA pair's lineage digests)."""
    store = Store(uri)
    if uri.endswith(".json"):
        from operators.io.storage import read_uri
        return _from_levir_cc(json.loads(read_uri(uri)), limit)
    # Only the columns and rows the context needs, ordered in Arrow: as Python dicts, every candidate
    # row with its judge's reply cost the QA driver more than the rest of its run.
    table = read_table(store, "captions", CAPTIONS_SCHEMA,
                       columns=["pair_id", "caption", "selected", "overall", "candidate_index"])
    if table is not None:
        import pyarrow.compute as pc
        table = table.filter(pc.fill_null(table["selected"], False))
        table = table.set_column(table.schema.get_field_index("overall"), "overall",
                                 pc.fill_null(table["overall"], 0.0))
        table = table.sort_by([("pair_id", "ascending"), ("overall", "descending"), ("candidate_index", "ascending")])
        by_pair: dict[str, list[str]] = {}
        for pid, caption in zip(table["pair_id"].to_pylist(), table["caption"].to_pylist()):
            kept = by_pair.setdefault(pid, [])
            if limit is None or len(kept) < limit:
                kept.append(caption)
        return by_pair
    if store.exists("LevirCCcaptions.json"):
        return _from_levir_cc(json.loads(store.read_bytes("LevirCCcaptions.json")), limit)
    raise FileNotFoundError(f"{uri}: neither a captions/ table nor LevirCCcaptions.json (a captions job output)")


def _from_levir_cc(doc: dict, limit: int) -> dict[str, list[str]]:
    out = {}
    for img in doc.get("images", []):
        stem = str(img.get("filename", "")).rsplit(".", 1)[0]
        out[stem] = [s.get("raw", "").strip() for s in img.get("sentences", []) if s.get("raw", "").strip()][:limit]
    return out


def context_for(pair: dict, context: dict[str, list[str]]) -> list[str]:
    stem = pair["filename"].rsplit(".", 1)[0]
    return list(context.get(pair["pair_id"]) or context.get(stem) or [])


# -- preparing a pair ----------------------------------------------------------------------------------
def prepare_qa_pair(item: dict, config: PrepareConfig = PrepareConfig(), run_id: str = "", seed: int = 0,
                    qa_per_pair: int = 5) -> list[dict]:
    """The captions job's reader and mask analysis, plus this pair's drawn question types and context."""
    out = []
    for env in prepare_pair(item, config, run_id):
        record = json.loads(env["_record"])
        if env["_table"] == "errors":
            out.append(envelope("errors", dict(record, job=JOB)))
            continue
        record.update(question_types=draw_types(item["pair_id"], seed, qa_per_pair), seed=seed,
                      context_captions=item.get("context_captions") or [])
        out.append(envelope("_qa_generate", record))
    return out


# -- the two LLM stages --------------------------------------------------------------------------------
QAPrompts = CaptionPrompts  # the same settings (templates, image encoding, overall mode, models, validators)


def _captions_block(captions: list[str], template=None) -> str:
    if not captions:
        return ""
    if template is not None and (template.pair or template.images):  # after the pair's metadata, before the task
        return "Change captions of this pair (verified):\n" + "\n".join(f"- {c}" for c in captions)
    return "- change captions (verified):\n" + "\n".join(f"  - {c}" for c in captions)


def _image_tokens(record: dict) -> int:
    """A's and B's tokens at the run's detail plus the mask's at low (older records: three at the detail)."""
    return 2 * int(record["image_tokens"]) + int(record.get("mask_tokens", record["image_tokens"]))


def build_generate_request(prompts: QAPrompts, record: dict) -> LLMRequest:
    types = record["question_types"]
    keys = [TYPE_KEYS[t] for t in types]
    values = dict(pair_values(record), captions_block=_captions_block(record["context_captions"], prompts.generate),
                  n_questions=len(types), keys=", ".join(keys),
                  type_list="\n".join(f"- {k} ({t}): {TYPE_GUIDES[t]}" for k, t in zip(keys, types)))
    system, user = prompts.generate.render(**values)
    return LLMRequest(reply_note=prompts.generate.render_reply(**values),
        item=record["pair_id"], messages=pair_messages(prompts.generate, record, prompts.detail, user, system),
        schema=generation_schema(types), schema_name="change_qa",
        cache_parts={"stage": "qa_generate", "template": prompts.generate.version, "images": record["hashes"],
                     "max_image_side": prompts.max_image_side, "image_format": prompts.image_format,
                     "types": types, "context": record["context_captions"]},
        image_tokens=_image_tokens(record))


def _common(prompts: QAPrompts, record: dict) -> dict:
    return {"pair_id": record["pair_id"], "split": record["split"], "filename": record["filename"],
            "generate_prompt_version": prompts.generate.version, "judge_prompt_version": prompts.judge.version,
            "model": prompts.model, "judge_model": prompts.judge_model, "run_id": prompts.run_id,
            "lineage": lineage.dumps(record["lineage"]) if record.get("lineage") else None}


def handle_generate_result(prompts: QAPrompts, record: dict, result: LLMResult) -> list[dict]:
    qa = []
    for t in record["question_types"]:
        entry = result.value[TYPE_KEYS[t]]
        qa.append({"type": t, "question": entry["question"].strip(), "answer": entry["answer"].strip()})
    cfg = qa_validator_config(prompts.validator_config)
    for item in qa:
        # The numbers rule is the paper's selection rule, not a grounded check: it runs under every policy
        # (alone under "off") and keeps an answer with a figure from the judge.
        rules = ("numbers",) if prompts.validators == "off" else RULES
        ok, violations = validate_text(item["answer"], record["mask_facts"], item["question"], item["type"], cfg,
                                       rules=rules)
        if prompts.validators == "off" and ok:
            item["validator_ok"], item["violations"] = None, None
        else:
            item["validator_ok"], item["violations"] = ok, violations_json(violations)
    record = dict(record, qa=qa)
    if not judged_indices(prompts, qa):
        return finish_pair(prompts, record, {})
    return [envelope("_qa_judge", record)]


def rejected_before_judge(prompts: QAPrompts, q: dict) -> bool:
    """An answer with a figure (the numbers rule, under every policy), or under ``reject`` one that breaks
    any rule."""
    if q["validator_ok"] is not False:
        return False
    return prompts.validators == "reject" or any(v["rule"] == "numbers" for v in json.loads(q["violations"] or "[]"))


def judged_indices(prompts: QAPrompts, qa: list[dict]) -> list[int]:
    """Which QA pairs go to the judge: all but those :func:`rejected_before_judge`."""
    return [i for i, q in enumerate(qa) if not rejected_before_judge(prompts, q)]


def build_judge_request(prompts: QAPrompts, record: dict) -> LLMRequest:
    qa = record["qa"]
    idx = judged_indices(prompts, qa)
    types = [qa[i]["type"] for i in idx]
    listing = "\n".join(f"{TYPE_KEYS[qa[i]['type']]} ({qa[i]['type']}):\n  Q: {qa[i]['question']}\n  A: {qa[i]['answer']}"
                        for i in idx)
    values = dict(pair_values(record), qa_listing=listing, keys=", ".join(TYPE_KEYS[t] for t in types))
    system, user = prompts.judge.render(**values)
    return LLMRequest(reply_note=prompts.judge.render_reply(**values),
        item=record["pair_id"],
        messages=pair_messages(prompts.judge, record, prompts.detail, user, system, mask=False),
        schema=judge_schema(types), schema_name="qa_scores",
        cache_parts={"stage": "qa_judge", "template": prompts.judge.version,
                     "images": {k: record["hashes"][k] for k in ("a_rel", "b_rel", "label_rel")},
                     "max_image_side": prompts.max_image_side, "image_format": prompts.image_format,
                     "candidates": [[qa[i]["type"], qa[i]["question"], qa[i]["answer"]] for i in idx]},
        image_tokens=_image_tokens(record) if sends_mask(prompts.judge, mask=False) else 2 * int(record["image_tokens"]))


def handle_judge_result(prompts: QAPrompts, record: dict, result: LLMResult) -> list[dict]:
    return finish_pair(prompts, record, {t: result.value[TYPE_KEYS[t]] for t in
                                         (record["qa"][i]["type"] for i in judged_indices(prompts, record["qa"]))})


def finish_pair(prompts: QAPrompts, record: dict, scores_by_type: dict[str, dict]) -> list[dict]:
    """Every candidate as a ``qa`` row (scored, or rejected by a validator) and one ``pairs`` row."""
    common = _common(prompts, record)
    out, n_selected, n_rejected = [], 0, 0
    for i, q in enumerate(record["qa"]):
        scores = scores_by_type.get(q["type"])
        row = {**common, "qa_index": i, "question_type": q["type"], "question": q["question"], "answer": q["answer"],
               "validator_ok": q["validator_ok"], "validator_violations": q["violations"],
               "validators": prompts.validators, "overall_mode": prompts.overall_mode}
        if scores is None:  # rejected before the judge: a figure in the answer, or any rule under reject
            rules = sorted({v["rule"] for v in json.loads(q["violations"] or "[]")})
            if prompts.validators != "reject":
                rules = ["numbers"]
            row.update(selected=False, selection_reason=f"validator: {', '.join(rules)}")
            n_rejected += 1
        else:
            overall = overall_score(scores, prompts.overall_mode)
            sel = select_qa(overall)
            row.update({f"score_{c}": int(scores[c]) for c in QA_CRITERIA})
            row.update(judge_overall=int(scores["overall"]), judge_reason=scores["reason"], overall=overall,
                       selected=sel.selected, selection_reason=sel.reason)
            n_selected += sel.selected
        out.append(envelope("qa", row))
    out.append(envelope("pairs", {
        **common, **{k: record[k] for k in ("height", "width", "car", "changed_pixels", "components", "cell_shares",
                                            "question_types", "seed", "context_captions")},
        "change_region": record["change_region"], "n_candidates": len(record["qa"]),
        "n_validator_rejected": n_rejected, "n_judged": len(record["qa"]) - n_rejected, "n_selected": n_selected}))
    return out
