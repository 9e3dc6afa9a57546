"""QA scoring (pure): reading the QA job's references and answer predictions, matching them, and
normalising answers.

References (the QA job's JSON; one file, or a folder/prefix of such files whose images are merged):
``{"images": [{"filename", "split", "qa": [{"type": "YES/NO" | "WHAT" | ..., "question", "answer",
"id"?}]}]}``. A question's id is its ``id`` (or ``qid``) field when present, else
``<file stem>#<index in its image's qa list>``.

Predictions: a list ``[{"filename", "question", "answer"}]`` (matched on file name and question text
after normalisation; a question asked twice for one image matches in order) or ``[{"id", "answer"}]``,
or a mapping ``{id: answer}``.
"""
from __future__ import annotations

import re
import string
from dataclasses import dataclass, field

from operators.scoring.caption_sets import name_key

_PUNCT = re.compile("[" + re.escape(string.punctuation) + "]")


def normalize_answer(text: str) -> str:
    """Lower case, punctuation to spaces, whitespace collapsed ("Yes." -> "yes")."""
    return " ".join(_PUNCT.sub(" ", str(text).lower()).split())


def yes_no(text: str) -> str | None:
    """"yes"/"no" for an answer whose first normalised word is yes or no ("No, nothing changed." -> "no")."""
    words = normalize_answer(text).split()
    return words[0] if words and words[0] in ("yes", "no") else None


@dataclass
class Question:
    qid: str
    filename: str
    split: str
    type: str
    question: str
    answer: str


@dataclass
class MatchedQA:
    questions: list[Question] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)   # qid -> predicted answer
    problems: list[dict] = field(default_factory=list)


def read_qa_references(docs: list[dict], split: str) -> tuple[list[Question], list[dict]]:
    questions, problems, seen, splits = [], [], set(), set()
    for doc in docs:
        if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
            raise SystemExit('jobs.score qa: references must be JSON objects {"images": [{"filename", "split", "qa": [...]}]}')
        for entry in doc["images"]:
            filename = str(entry.get("filename", ""))
            splits.add(str(entry.get("split", "")))
            if split != "all" and entry.get("split") != split:
                continue
            for i, q in enumerate(entry.get("qa") or []):
                qid = str(q.get("id") or q.get("qid") or f"{name_key(filename)}#{i}")
                if qid in seen:
                    problems.append({"item": qid, "error_type": "duplicate_reference", "message": f"question id {qid} occurs twice"})
                    continue
                if not all(isinstance(q.get(k), str) and q.get(k).strip() for k in ("type", "question", "answer")):
                    problems.append({"item": qid, "error_type": "bad_reference",
                                     "message": "a reference question needs non-empty type, question and answer"})
                    continue
                seen.add(qid)
                questions.append(Question(qid, filename, str(entry.get("split", "")), q["type"].strip(),
                                          q["question"], q["answer"]))
    if not questions and not problems:
        raise SystemExit(f"jobs.score qa: no question in split {split!r} (the references hold: "
                         f"{', '.join(sorted(splits)) or 'nothing'}; --split all scores every split)")
    return questions, problems


def match_answers(questions: list[Question], preds) -> MatchedQA:
    m = MatchedQA()
    by_id = {q.qid: q for q in questions}
    by_text: dict[tuple[str, str], list[str]] = {}
    for q in questions:
        by_text.setdefault((name_key(q.filename), normalize_answer(q.question)), []).append(q.qid)

    def take(qid: str | None, answer, item: str) -> None:
        if qid is None or qid not in by_id:
            m.problems.append({"item": item, "error_type": "extra_prediction", "message": f"no reference question for {item}"})
        elif qid in m.answers:
            m.problems.append({"item": item, "error_type": "duplicate_prediction", "message": f"second answer for {qid} ignored"})
        elif not isinstance(answer, str):
            m.problems.append({"item": item, "error_type": "bad_prediction", "message": "answer is not a string"})
        else:
            m.answers[qid] = answer

    if isinstance(preds, dict):
        for qid, answer in preds.items():
            take(str(qid), answer, str(qid))
    elif isinstance(preds, list):
        for i, p in enumerate(preds):
            if not isinstance(p, dict):
                m.problems.append({"item": f"prediction #{i}", "error_type": "bad_prediction", "message": "not an object"})
            elif p.get("id") is not None or p.get("qid") is not None:
                qid = str(p.get("id") if p.get("id") is not None else p.get("qid"))
                take(qid, p.get("answer"), qid)
            elif "filename" in p and "question" in p:
                key = (name_key(p["filename"]), normalize_answer(p["question"]))
                free = [qid for qid in by_text.get(key, []) if qid not in m.answers]
                take(free[0] if free else (by_text.get(key) or [None])[0], p.get("answer"),
                     f"{p['filename']}: {p['question']}")
            else:
                m.problems.append({"item": f"prediction #{i}", "error_type": "bad_prediction",
                                   "message": 'expected {"filename", "question", "answer"} or {"id", "answer"}'})
    else:
        raise SystemExit('jobs.score qa: predictions must be a list [{"filename", "question", "answer"}] or {id: answer}')
    for q in questions:
        if q.qid in m.answers:
            m.questions.append(q)
        else:
            m.problems.append({"item": q.qid, "error_type": "missing_prediction",
                               "message": f"no answer for {q.filename}: {q.question}"})
    return m


def answer_correct(q: Question, answer: str, yes_no_type: bool) -> bool:
    """Yes/no types compare the yes/no word; other types the whole normalised answer."""
    if yes_no_type:
        ref = yes_no(q.answer)
        return ref is not None and yes_no(answer) == ref
    return normalize_answer(answer) == normalize_answer(q.answer)
