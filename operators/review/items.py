"""Reviewable items from the captions job's ``captions/`` or the QA job's ``qa/`` table, in one shape:
``item_id, kind, pair_id, filename, split, index, facet, text, car, car_class, overall, judge_accept,
selected, judge_reason, judge_model, run_id, lineage`` (what the item was made from, with its text's digest:
a verdict applies to that text only). ``facet`` is the caption's perspective or the QA pair's
question type (what error categories are broken down by)."""
from __future__ import annotations

import pandas as pd

from operators.io import lineage
from operators.review.sampling import CAR_CLASS_EDGES, car_class

ITEM_COLUMNS = ("item_id", "kind", "pair_id", "filename", "split", "index", "facet", "text", "car", "car_class",
                "overall", "judge_accept", "selected", "judge_reason", "judge_model", "run_id", "lineage")

# Stratification names a user may give, per kind, mapped to item columns.
STRATUM_ALIASES = {"perspective": "facet", "question_type": "facet", "facet": "facet",
                   "car_class": "car_class", "split": "split"}


def review_items(kind: str, table: pd.DataFrame, pairs: pd.DataFrame | None, pass_score: float = 7.0,
                 car_edges: tuple[float, ...] = CAR_CLASS_EDGES) -> pd.DataFrame:
    """Items of a captions (``kind='captions'``) or QA (``kind='qa'``) table; CAR comes from the job's
    ``pairs/`` table (per pair) when there is one."""
    t = table.copy()
    if kind == "captions":
        index = t["candidate_index"]
        facet, text = t["perspective"], t["caption"]
        reason = t.get("judge_reason")
    elif kind == "qa":
        index = t["qa_index"]
        facet = t["question_type"]
        text = "Q: " + t["question"].fillna("") + "\nA: " + t["answer"].fillna("")
        reason = t["judge_reason"] if "judge_reason" in t.columns else t.get("reason")  # reason = selection's
    else:
        raise ValueError(f"unknown kind {kind!r}")
    car = pd.Series([None] * len(t), index=t.index, dtype="float64")
    if pairs is not None and "car" in pairs.columns:
        car = t["pair_id"].map(pairs.drop_duplicates("pair_id").set_index("pair_id")["car"]).astype("float64")
    items = pd.DataFrame({
        "item_id": t["pair_id"].astype(str) + "#" + index.astype(int).astype(str),
        "kind": kind, "pair_id": t["pair_id"], "filename": t.get("filename"), "split": t.get("split"),
        "index": index.astype(int), "facet": facet, "text": text, "car": car,
        "car_class": [car_class(c, car_edges) for c in car], "overall": t["overall"].astype("float64"),
        "judge_accept": t["overall"].astype("float64") >= pass_score,
        "selected": t["selected"].fillna(False).astype(bool),
        "judge_reason": reason if reason is not None else None,
        "judge_model": t.get("judge_model"), "run_id": t.get("run_id"),
        # what the reviewer is shown: the item's text, and what its row was made from (mask, captions)
        "lineage": [lineage.dumps({**{k: v for k, v in (lineage.loads(made) or {}).items() if k != lineage.STAMPS},
                                   "text": lineage.value_digest(str(x))})
                    for made, x in zip(t["lineage"] if "lineage" in t.columns else [None] * len(t), text)],
    })
    return items[list(ITEM_COLUMNS)].reset_index(drop=True)


def reviewed_on_other_text(reviews: pd.DataFrame, current: pd.DataFrame) -> list[str]:
    """Item ids of ``reviews`` (a review table) whose text, when reviewed, is not the item's text now
    (``current``: :func:`review_items` of today's table): the item was redone since, and its verdict
    describes earlier text. Reviews recorded without lineage are not judged."""
    now = {i: (lineage.loads(m) or {}).get("text") for i, m in zip(current["item_id"], current["lineage"])}
    out = set()
    for item_id, made in zip(reviews["item_id"], reviews.get("lineage", [None] * len(reviews))):
        then = (lineage.loads(made) or {}).get("text")
        if then is not None and now.get(item_id) != then:
            out.add(str(item_id))
    return sorted(out)


def stratum_columns(spec: str) -> list[str]:
    """``perspective,car_class,split`` -> item columns; unknown names are an error."""
    cols = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        if name not in STRATUM_ALIASES:
            raise ValueError(f"cannot stratify by {name!r}; use any of {sorted(STRATUM_ALIASES)}")
        cols.append(STRATUM_ALIASES[name])
    return cols


# The cause a reviewed item is stale by, when the text the reviewer judged was redone: the step's input.
TEXT_CAUSE = {"captions": "caption", "qa": "QA"}
REDONE = "unreviewed since redone"   # a review row's status once its item's text was redone


def review_status(reviewed: pd.DataFrame, current: dict[str, pd.DataFrame]) -> dict:
    """The review step's items by lineage (:func:`operators.io.lineage.status`'s shape), reading only:
    ``reviewed`` holds the sampled items (``item_id``, ``kind``, ``lineage``; with the review table's
    ``status``, an item no annotation gave a verdict yet is missing: its reviewers' work), ``current``
    each kind's :func:`review_items` today. A reviewed item is stale when the text the reviewer saw was
    redone (cause ``caption`` or ``QA``; also when the item is gone), or, its text the same, when what it
    was made from changed (``mask``: the verdict was about another mask). An item recorded without lineage
    is counted apart. Reviews are people's work: stale items never make the step run by themselves
    (``needs_run`` is False); a new sample is a review you ask for."""
    plan = lineage.ResumePlan()
    now = {kind: dict(zip(t["item_id"], t["lineage"])) for kind, t in current.items() if t is not None}
    if reviewed is None or not len(reviewed):
        return {**lineage.status(plan), "needs_run": False}
    has_status = "status" in reviewed.columns
    for item_id, rows in reviewed.groupby("item_id", sort=True):
        first = rows.iloc[-1]
        rec = lineage.loads(first.get("lineage"))
        if rec is None:
            plan.unrecorded.append(str(item_id))
            continue
        kind = str(first.get("kind") or "captions")
        today = lineage.loads(now.get(kind, {}).get(item_id))
        changed = lineage.changed_inputs(rec, today or {})
        if today is None or "text" in changed:
            plan.stale[str(item_id)] = [TEXT_CAUSE.get(kind, kind)]
        elif changed:
            plan.stale[str(item_id)] = lineage.causes(rec, today)
        elif has_status and not (rows["status"] == "reviewed").any():
            plan.missing.append(str(item_id))
        else:
            plan.current.append(str(item_id))
    return {**lineage.status(plan), "needs_run": False}


def set_aside_redone(reviews: pd.DataFrame, redone: list[str]) -> pd.DataFrame:
    """``reviews`` with the rows of the ``redone`` items (their text changed since the review:
    :func:`reviewed_on_other_text`) marked ``unreviewed since redone``: their verdicts describe earlier
    text, so they count as sampled tasks but enter no acceptance, agreement or correction."""
    out = reviews.copy()
    hit = out["item_id"].astype(str).isin(set(redone))
    out.loc[hit, "status"] = REDONE
    return out
