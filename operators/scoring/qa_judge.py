"""Optional LLM judge for QA answers, through the project's LLM layer (``operators/llm``): one text-only
request per answered question comparing the answer with the reference; answers are cached in the
output store like every other LLM call, so a rerun pays only for new (question, reference, answer)
triples."""
from __future__ import annotations

import pyarrow as pa

from operators.io.tables import envelope
from operators.language.captions import PromptTemplate
from operators.llm.client import LLMRequest, LLMResult
from operators.llm.usage import USAGE_SCHEMA

JOB = "score_qa"
STAGE = "score_qa_judge"
INPUT_TABLE = "_qa_judge"
KEY = "qid"    # names a question in the work list, in judgements/ and in errors/
JUDGEMENTS_SCHEMA = pa.schema([
    ("qid", pa.string()), ("judge_score", pa.int64()), ("judge_correct", pa.bool_()), ("judge_reason", pa.string()),
    ("judge_model", pa.string()), ("prompt_version", pa.string()), ("run_id", pa.string())])
SINK_SCHEMAS = {"judgements": JUDGEMENTS_SCHEMA, "usage": USAGE_SCHEMA}   # errors/: the sink's own


def judge_schema() -> dict:
    return {"type": "object",
            "properties": {"correct": {"type": "boolean"}, "score": {"type": "integer", "minimum": 1, "maximum": 5},
                           "reason": {"type": "string"}},
            "required": ["correct", "score", "reason"], "additionalProperties": False}


def judge_input(row: dict) -> dict:
    """A per-question row -> the envelope the judge stage consumes (``item`` names it in errors/usage)."""
    return envelope(INPUT_TABLE, {"item": row["qid"], "qid": row["qid"], "question": row["question"],
                                  "reference": row["reference"], "prediction": row["prediction"]})


def judge_item(row: dict) -> dict:
    """A per-question row -> its work-list item: what the judge is asked about (``item`` names the
    question in an error row of the pass loop's own, as ``pair_id`` does a pair)."""
    return {"item": row[KEY], **{k: row[k] for k in (KEY, "question", "reference", "prediction")}}


def prepare_judge_item(item: dict) -> list[dict]:
    """The judge's prepare step in the LLM pass loop: a work-list item -> the judge stage's input."""
    return [judge_input(item)]


def build_judge_request(template: PromptTemplate, record: dict) -> LLMRequest:
    system, user = template.render(question=record["question"], reference=record["reference"],
                                   prediction=record["prediction"])
    return LLMRequest(item=record["qid"], messages=[{"role": "system", "content": system},
                                                    {"role": "user", "content": user}],
                      schema=judge_schema(), schema_name="qa_answer_judgement",
                      cache_parts={"stage": STAGE, "template": template.version, "question": record["question"],
                                   "reference": record["reference"], "prediction": record["prediction"]})


def handle_judge_result(template: PromptTemplate, model: str, run_id: str, record: dict,
                        result: LLMResult) -> list[dict]:
    v = result.value
    return [envelope("judgements", {"qid": record["qid"], "judge_score": int(v["score"]),
                                    "judge_correct": bool(v["correct"]), "judge_reason": str(v["reason"]),
                                    "judge_model": model, "prompt_version": template.version, "run_id": run_id})]


def judge_summary(rows: list[dict]) -> dict:
    """Mean judge score and share judged correct, per type and overall, over judged questions."""
    judged = [r for r in rows if r.get("judge_score") is not None]

    def summary(rs):
        return {"n_judged": len(rs), "mean_score": sum(r["judge_score"] for r in rs) / len(rs) if rs else None,
                "correct": sum(bool(r["judge_correct"]) for r in rs) / len(rs) if rs else None}

    return {**summary(judged), "per_type": {t: summary([r for r in judged if r["type"] == t])
                                            for t in sorted({r["type"] for r in rows})}}
