"""QA logic without Ray or HTTP (JL1-QA, paper section II-C): the eight question types, the seeded draw
of five per pair, reply schemas, overall scores, the selection rule and the VQA file.

Selection (II-C3, Stage 2): the judge scores every QA pair 1-10 on answer accuracy, question quality,
answer completeness and redundancy (the redundancy criterion needs all five side by side, so one
judge request carries them all). The overall score is, by ``--overall``,

- ``criteria`` (default, as for captions): the mean of the four criteria, except that an answer
  whose accuracy is in the hallucination band (<= 4) scores its accuracy, so it is never kept,
- ``judge``: the judge's own ``overall`` field,
- ``mean``: the mean of the four criteria,
- ``min``: the lowest criterion.

A QA pair whose overall score is below 7 is discarded; there is no top-k (unlike captions).
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from operators.language import captions

# Table IV, in the paper's order; the key is the JSON property name used in the reply schemas.
QUESTION_TYPES = ("YES/NO", "WHAT", "WHERE", "HOW MUCH", "BEFORE/AFTER", "CAUSE", "DETAIL", "COMPARE")
TYPE_KEYS = {"YES/NO": "yes_no", "WHAT": "what", "WHERE": "where", "HOW MUCH": "how_much",
             "BEFORE/AFTER": "before_after", "CAUSE": "cause", "DETAIL": "detail", "COMPARE": "compare"}
TYPE_GUIDES = {
    "YES/NO": "existence: a yes/no question about whether a change happened (answer starts with Yes or No), "
              "e.g. 'Has the vegetation in the lower half been removed?'",
    "WHAT": "description: what happened, e.g. 'What happened to the farmland in the center?'",
    "WHERE": "location: where the change is, e.g. 'Where did the most significant change occur?'",
    "HOW MUCH": "magnitude: how large or extensive the change is, in words, e.g. 'Is the change large-scale "
                "or localized?'",
    "BEFORE/AFTER": "temporal comparison: what was there before or is there after, e.g. 'What was present in "
                    "the upper-left before the change?'",
    "CAUSE": "causation: what likely caused the change, e.g. 'What type of development likely caused the "
             "changes?'",
    "DETAIL": "visual detail: what the changed objects look like, e.g. 'What do the new structures appear "
              "to be?'",
    "COMPARE": "relative comparison: which area or aspect changed more, e.g. 'Which area shows the most "
               "dramatic change?'",
}
QA_CRITERIA = ("answer_accuracy", "question_quality", "answer_completeness", "redundancy")
OVERALL_MODES = captions.OVERALL_MODES
THRESHOLD = 7.0


def draw_types(pair_id: str, seed: int, k: int = 5) -> list[str]:
    """``k`` distinct question types for one pair, uniformly without replacement, from a generator
    seeded by (seed, pair id): the draw is the same on every rerun and independent of the order in
    which pairs are processed. Returned in the paper's order so the prompt reads the same way."""
    if not 1 <= k <= len(QUESTION_TYPES):
        raise ValueError(f"--qa-per-pair must be between 1 and {len(QUESTION_TYPES)}, got {k}")
    digest = hashlib.sha256(f"{seed}:{pair_id}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    picked = set(rng.sample(QUESTION_TYPES, k))
    return [t for t in QUESTION_TYPES if t in picked]


def generation_schema(types: list[str]) -> dict:
    entry = {"type": "object",
             "properties": {"question": {"type": "string", "minLength": 8},
                            "answer": {"type": "string", "minLength": 2}},
             "required": ["question", "answer"], "additionalProperties": False}
    keys = [TYPE_KEYS[t] for t in types]
    return {"type": "object", "properties": {k: entry for k in keys}, "required": keys,
            "additionalProperties": False}


def judge_schema(types: list[str]) -> dict:
    score = {"type": "integer", "minimum": 1, "maximum": 10}
    entry = {"type": "object",
             "properties": {**{c: score for c in QA_CRITERIA}, "overall": score, "reason": {"type": "string"}},
             "required": [*QA_CRITERIA, "overall", "reason"], "additionalProperties": False}
    keys = [TYPE_KEYS[t] for t in types]
    return {"type": "object", "properties": {k: entry for k in keys}, "required": keys,
            "additionalProperties": False}


def overall_score(scores: dict, mode: str = "criteria") -> float:
    return captions.overall_score(scores, mode, QA_CRITERIA, hallucination=("answer_accuracy",))


@dataclass(frozen=True)
class QASelection:
    selected: bool
    reason: str | None    # None when selected (the table contract: why rejected, null if selected)


def select_qa(overall: float, threshold: float = THRESHOLD) -> QASelection:
    if overall >= threshold:
        return QASelection(True, None)
    return QASelection(False, f"overall {overall:g} below {threshold:g}")


def vqa_rows(pairs, qa):
    """The selected QA rows (Arrow) with their pair's split, filename and CAR, in ``VQA.json`` order:
    what :func:`write_vqa` streams, kept columnar (the driver never holds every row as Python objects)."""
    import pyarrow.compute as pc
    sel = qa.filter(pc.equal(qa["selected"], True)).select(["pair_id", "qa_index", "question_type", "question",
                                                            "answer"])
    # Each row's pair looked up by position, not with Table.join: on 5,500 pairs (5 MB of rows) the
    # hash join took 51 MB of RSS (38 MB single-threaded), this 26 MB.
    at = pc.index_in(sel["pair_id"], value_set=pairs["pair_id"])
    sel = sel.filter(pc.is_valid(at))
    at = at.drop_null()
    for name in ("split", "filename", "car"):
        sel = sel.append_column(name, pairs[name].take(at))
    return sel.sort_by([("split", "ascending"), ("filename", "ascending"), ("pair_id", "ascending"),
                        ("qa_index", "ascending")])


def write_vqa(sorted_batches, f) -> int:
    """:func:`vqa_document` written to ``f`` as it goes, from batches of :func:`vqa_rows` (a pair's rows
    are consecutive). Returns the number of images."""
    def images():
        current, qa = None, []
        for rows in sorted_batches:
            for r in rows:
                if current is not None and r["pair_id"] != current["pair_id"]:
                    yield _vqa_image(current, qa)
                    qa = []
                if not qa:
                    current = r
                qa.append({"type": r["question_type"], "question": r["question"], "answer": r["answer"]})
        if qa:
            yield _vqa_image(current, qa)
    return captions.write_images_document(images(), f)


def _vqa_image(p: dict, qa: list[dict]) -> dict:
    return {"filename": p["filename"], "filepath": p["split"], "split": p["split"], "change_ratio": p.get("car"),
            "qa": qa}


def vqa_document(pairs: list[dict], qa_rows: list[dict]) -> dict:
    """``{"images": [{"filename", "filepath", "split", "change_ratio", "qa": [{"type", "question",
    "answer"}]}]}``: per image the selected QA pairs in generation order. Images without a selected QA
    pair are left out (they stay in the ``pairs`` table)."""
    by_pair: dict[str, list[dict]] = {}
    for r in qa_rows:
        if r.get("selected"):
            by_pair.setdefault(r["pair_id"], []).append(r)
    images = []
    for p in sorted(pairs, key=lambda p: (p["split"], p["filename"])):
        rows = sorted(by_pair.get(p["pair_id"], []), key=lambda r: r["qa_index"])
        if not rows:
            continue
        images.append(_vqa_image(p, [{"type": r["question_type"], "question": r["question"], "answer": r["answer"]}
                                     for r in rows]))
    return {"images": images}
