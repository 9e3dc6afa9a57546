"""The QA scoring run: accuracy for yes/no question types (per type and overall), normalised exact-match
accuracy for every type, and the caption metrics per open type (one reference answer per question)."""
from __future__ import annotations

import pyarrow as pa

from operators.io import lineage
from operators.scoring.caption_metrics import METRIC_KEYS, score_tokenized, tokenize
from operators.scoring.qa import MatchedQA, answer_correct

PER_QUESTION_SCHEMA = pa.schema(
    [("qid", pa.string()), ("filename", pa.string()), ("split", pa.string()), ("type", pa.string()),
     ("kind", pa.string()), ("question", pa.string()), ("reference", pa.string()), ("prediction", pa.string()),
     ("correct", pa.bool_())] + [(k, pa.float64()) for k in METRIC_KEYS]
    + [("judge_score", pa.int64()), ("judge_correct", pa.bool_()), ("judge_reason", pa.string()),
       ("lineage", pa.string())])   # the reference QA pair and the prediction scored (operators.io.lineage)


def row_lineage(q, answer) -> dict:
    """What a question's row was scored from: the reference QA pair and the predicted answer."""
    return {"reference": lineage.value_digest([q.question, q.answer]), "prediction": lineage.value_digest(answer)}


def score_qa(m: MatchedQA, yes_no_types: tuple[str, ...], caption_metrics: bool = True) -> tuple[dict, list[dict]]:
    closed = {t.lower() for t in yes_no_types}
    rows = []
    for q in m.questions:
        yn = q.type.lower() in closed
        rows.append({"qid": q.qid, "filename": q.filename, "split": q.split, "type": q.type,
                     "kind": "yes_no" if yn else "open", "question": q.question, "reference": q.answer,
                     "prediction": m.answers[q.qid], "correct": answer_correct(q, m.answers[q.qid], yn),
                     "lineage": lineage.dumps(row_lineage(q, m.answers[q.qid]))})
    per_type: dict[str, dict] = {}
    for t in sorted({r["type"] for r in rows}):
        these = [r for r in rows if r["type"] == t]
        per_type[t] = {"kind": these[0]["kind"], "n": len(these),
                       "accuracy": sum(r["correct"] for r in these) / len(these)}
    open_ids = {t: [r["qid"] for r in rows if r["type"] == t] for t, v in per_type.items() if v["kind"] == "open"}
    if caption_metrics and open_ids:
        ids = [i for v in open_ids.values() for i in v]
        ref = {r["qid"]: r for r in rows}
        gts = tokenize({i: [ref[i]["reference"]] for i in ids})
        res = tokenize({i: [ref[i]["prediction"]] for i in ids})
        scored = score_tokenized(gts, res, open_ids)
        for t, (corpus, per_id) in scored.items():
            per_type[t].update(corpus)
            for i, s in per_id.items():
                ref[i].update(s)
    yn_rows = [r for r in rows if r["kind"] == "yes_no"]
    doc = {"accuracy": (sum(r["correct"] for r in rows) / len(rows)) if rows else None,
           "yes_no_accuracy": (sum(r["correct"] for r in yn_rows) / len(yn_rows)) if yn_rows else None,
           "per_type": per_type, "n_questions": len(rows), "n_yes_no": len(yn_rows),
           "normalisation": "lower case, punctuation removed, whitespace collapsed; yes/no types compare the "
                            "answer's first word (yes or no)"}
    return doc, rows
