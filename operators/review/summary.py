"""What the reviewers said, in numbers: human acceptance with its Wilson interval, agreement with the
judge (Cohen's kappa), verdicts and error categories by perspective or question type, and corrections.

Definitions (also in the README):

- A task's verdict is its latest submitted annotation's (several reviewers on one task: the last word).
- *Acceptance* is measured on reviewed items the pipeline **selected**: it estimates the precision of
  the published dataset. ``correct`` counts as accepted; with ``accept_partly`` also ``partly correct``
  (both rates are always reported). Items sampled with ``--include-rejected`` do not enter it.
- *Agreement* compares, over every reviewed item (selected and rejected), the human's accept/reject with
  the judge's: the judge accepts when its overall score reaches the pass score (7, the paper's
  threshold), whatever the top-3 quota later did.
"""
from __future__ import annotations

import math

import pandas as pd

from operators.review.agreement import cohens_kappa, wilson_interval
from operators.review.label_studio import ERROR_CATEGORIES, VERDICTS


def latest_verdicts(reviews: pd.DataFrame) -> pd.DataFrame:
    """One row per task with a verdict: its latest annotation."""
    r = reviews[reviews["status"] == "reviewed"].copy()
    r["_when"] = r["annotated_at"].fillna("")
    r = r.sort_values(["task_id", "_when", "annotation_id"]).drop_duplicates("task_id", keep="last")
    return r.drop(columns="_when").reset_index(drop=True)


def _rate(k: int, n: int) -> dict:
    lo, hi = wilson_interval(k, n)
    return {"accepted": int(k), "n": int(n), "rate": (k / n) if n else None,
            "wilson95": [_num(lo), _num(hi)]}


def _num(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _bool(series: pd.Series) -> pd.Series:
    return series.map(lambda v: bool(v) if v is not None and v == v else False)


def summarize_reviews(reviews: pd.DataFrame, accept_partly: bool = False) -> dict:
    """The review summary (JSON-ready) from review rows (:func:`label_studio.review_rows`)."""
    tasks = reviews.drop_duplicates("task_id")
    v = latest_verdicts(reviews)
    human_ok = v["verdict"].isin(("correct", "partly correct") if accept_partly else ("correct",))
    selected = _bool(v["selected"])
    sel = v[selected]
    strict_k = int((sel["verdict"] == "correct").sum())
    lenient_k = int(sel["verdict"].isin(("correct", "partly correct")).sum())
    judge_ok = _bool(v["judge_accept"])
    out = {
        "tasks": int(len(tasks)), "reviewed": int(len(v)), "unreviewed": int(len(tasks) - len(v)),
        "annotations": int((reviews["status"] == "reviewed").sum()),
        "accept_partly": bool(accept_partly),
        "acceptance": _rate(lenient_k if accept_partly else strict_k, len(sel)),
        "acceptance_strict": _rate(strict_k, len(sel)),
        "acceptance_lenient": _rate(lenient_k, len(sel)),
        "acceptance_weighted": _weighted_acceptance(sel, accept_partly),
        "verdicts": {k: int((v["verdict"] == k).sum()) for k in VERDICTS},
        "judge_agreement": {
            "n": int(len(v)), "cohens_kappa": _num(cohens_kappa(human_ok.tolist(), judge_ok.tolist())),
            "both_accept": int((human_ok & judge_ok).sum()), "both_reject": int((~human_ok & ~judge_ok).sum()),
            "human_only_accept": int((human_ok & ~judge_ok).sum()),
            "judge_only_accept": int((~human_ok & judge_ok).sum()),
        },
        "by_facet": {}, "corrections": [],
    }
    for facet, g in v.groupby(v["facet"].fillna(""), sort=True):
        g_sel = g[_bool(g["selected"])]
        cats = {c: 0 for c in ERROR_CATEGORIES}
        for lst in g["error_categories"]:
            for c in (list(lst) if lst is not None else []):
                cats[c] = cats.get(c, 0) + 1
        ok = g_sel["verdict"].isin(("correct", "partly correct") if accept_partly else ("correct",))
        out["by_facet"][facet] = {"reviewed": int(len(g)),
                                  "verdicts": {k: int((g["verdict"] == k).sum()) for k in VERDICTS},
                                  "acceptance": _rate(int(ok.sum()), len(g_sel)), "error_categories": cats}
    fixed = v[v["corrected_text"].notna() & (v["corrected_text"].fillna("").str.strip() != "")]
    out["corrections"] = [{"item_id": r.item_id, "pair_id": r.pair_id, "facet": r.facet, "verdict": r.verdict,
                           "text": r.text, "corrected_text": r.corrected_text} for r in fixed.itertuples()]
    return out


def _weighted_acceptance(sel: pd.DataFrame, accept_partly: bool) -> float | None:
    """Stratum-weighted acceptance (each stratum's rate times its population share): equal to the plain
    rate under exact proportional allocation, and the right estimate when rounding or missing reviews
    bend the sample away from it."""
    if sel.empty or "stratum_size" not in sel or sel["stratum_size"].isna().all():
        return None
    ok_values = ("correct", "partly correct") if accept_partly else ("correct",)
    parts = sel.groupby("stratum").agg(size=("stratum_size", "first"),
                                       rate=("verdict", lambda s: float(s.isin(ok_values).mean())))
    return float((parts["rate"] * parts["size"]).sum() / parts["size"].sum())
