"""The dataset's statistics from the jobs' tables (pandas in, JSON-ready dicts and tables out), as the
JL1-CC&QA paper reports them: Table III (captions), Table V (QA), the CAR distribution (Fig. 2), plus
the pairs job's accept/reject picture, tokens and cost, and the human review.

Definitions follow the paper: *pass rate* = selected / generated; *avg selected / pair* = selected /
image pairs; caption, question and answer lengths are words (white-space split) of **selected** items;
*vocabulary* = distinct LEVIR-CC tokens (lower case, punctuation removed) of selected captions; judge
score mean / median over **all** generated items (the distribution the threshold cuts).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from operators.language.captions import tokenize
from operators.review.sampling import CAR_CLASS_EDGES, car_class, car_class_names

if TYPE_CHECKING:   # pandas (about 0.2 s) where a function is given a frame: the chain command reads
    import pandas as pd   # annotation summaries through this module and never needs it

SPLIT_ORDER = ("train", "val", "test")


@dataclass
class Table:
    """A result table: rendered as Markdown and HTML by the same data."""
    key: str
    title: str
    columns: list[str]
    rows: list[list] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"title": self.title, "columns": self.columns, "rows": self.rows}


def _splits(df: pd.DataFrame) -> list[str]:
    present = [s for s in df["split"].dropna().unique().tolist()]
    return [s for s in SPLIT_ORDER if s in present] + sorted(s for s in present if s not in SPLIT_ORDER)


def _words(series: pd.Series) -> pd.Series:
    return series.fillna("").map(lambda s: len(str(s).split()))


def _score_bands(overall: pd.Series, pass_score: float) -> dict:
    n = int(overall.notna().sum())
    if not n:
        return {}
    o = overall.dropna()
    return {"9-10": float((o >= 9).mean()), f"{pass_score:g}-8": float(((o >= pass_score) & (o < 9)).mean()),
            f"<{pass_score:g}": float((o < pass_score).mean())}


def caption_stats(captions: pd.DataFrame, pairs: pd.DataFrame | None, pass_score: float = 7.0) -> dict:
    """Table III per split and in total."""
    out = {}
    groups = [(s, captions[captions["split"] == s]) for s in _splits(captions)] + [("total", captions)]
    for name, c in groups:
        sel = c[c["selected"].fillna(False).astype(bool)]
        if pairs is not None:
            n_pairs = int(len(pairs) if name == "total" else (pairs["split"] == name).sum())
        else:
            n_pairs = int(c["pair_id"].nunique())
        vocab = set()
        for text in sel["caption"].fillna(""):
            vocab.update(tokenize(text))
        out[name] = {
            "image_pairs": n_pairs, "generated": int(len(c)), "selected": int(len(sel)),
            "pass_rate": float(len(sel) / len(c)) if len(c) else None,
            "selected_per_pair": float(len(sel) / n_pairs) if n_pairs else None,
            "caption_words_mean": float(_words(sel["caption"]).mean()) if len(sel) else None,
            "vocabulary": len(vocab),
            "judge_score_mean": float(c["overall"].mean()) if len(c) else None,
            "judge_score_median": float(c["overall"].median()) if len(c) else None,
            "score_bands": _score_bands(c["overall"], pass_score),
            "selected_by_perspective": {str(k): int(v) for k, v in sel["perspective"].value_counts().sort_index().items()},
        }
    return out


def qa_stats(qa: pd.DataFrame, pass_score: float = 7.0) -> dict:
    """Table V per split and in total, and the question-type distribution of selected pairs (Fig. 8)."""
    out = {}
    groups = [(s, qa[qa["split"] == s]) for s in _splits(qa)] + [("total", qa)]
    for name, q in groups:
        sel = q[q["selected"].fillna(False).astype(bool)]
        n_pairs = int(q["pair_id"].nunique())
        out[name] = {
            "image_pairs": n_pairs, "generated": int(len(q)), "selected": int(len(sel)),
            "pass_rate": float(len(sel) / len(q)) if len(q) else None,
            "selected_per_pair": float(len(sel) / n_pairs) if n_pairs else None,
            "question_words_mean": float(_words(sel["question"]).mean()) if len(sel) else None,
            "answer_words_mean": float(_words(sel["answer"]).mean()) if len(sel) else None,
            # Pairs the grounded validators rejected before judging have no score (null overall).
            "judged": int(q["overall"].notna().sum()),
            "judge_score_mean": float(q["overall"].mean()) if q["overall"].notna().any() else None,
            "judge_score_median": float(q["overall"].median()) if q["overall"].notna().any() else None,
            "score_bands": _score_bands(q["overall"], pass_score),
            "selected_by_question_type": {str(k): int(v) for k, v in
                                          sel["question_type"].value_counts().sort_index().items()},
        }
    return out


def car_stats(car: pd.Series, edges: tuple[float, ...] = CAR_CLASS_EDGES) -> dict:
    """CAR summary (Fig. 2's numbers) and counts per change-magnitude class."""
    import pandas as pd

    c = car.dropna().astype(float)
    classes = pd.Series([car_class(v, edges) for v in c], dtype="object")
    return {"n": int(len(c)), "mean": float(c.mean()) if len(c) else None,
            "median": float(c.median()) if len(c) else None,
            "no_change": int((c <= 0).sum()),
            "classes": {name: int((classes == name).sum()) for name in car_class_names(edges)}}


def reason_class(reason: str | None) -> str:
    """``too few inliers (5 < 20)`` -> ``too few inliers``: a reason without its numbers."""
    if not reason:
        return "accepted"
    head = re.split(r"[\d(:]", str(reason), maxsplit=1)[0].strip(" ,;-")
    return head or str(reason)


def pairs_job_stats(metadata: pd.DataFrame, candidate_pairs: pd.DataFrame | None,
                    labels: pd.DataFrame | None) -> dict:
    """Slices accepted/rejected per split, reject reasons, residuals; candidate pairs by status."""
    acc = metadata[metadata["status"] == "accepted"]
    rej = metadata[metadata["status"] != "accepted"]
    by_split = {}
    for s in _splits(metadata) if metadata["split"].notna().any() else []:
        m = metadata[metadata["split"] == s]
        by_split[s] = {"accepted": int((m["status"] == "accepted").sum()), "rejected": int((m["status"] != "accepted").sum())}
    res = metadata["residual_px"].dropna().astype(float)
    out = {
        "slices": int(len(metadata)), "accepted": int(len(acc)), "rejected": int(len(rej)),
        "by_split": by_split,
        "reject_reasons": {str(k): int(v) for k, v in
                           rej["reject_reason"].map(reason_class).value_counts().sort_index().items()},
        "residual_px": {"n": int(len(res)), "mean": float(res.mean()) if len(res) else None,
                        "median": float(res.median()) if len(res) else None,
                        "p95": float(res.quantile(0.95)) if len(res) else None},
        "residual_px_accepted_median": float(acc["residual_px"].dropna().median()) if acc["residual_px"].notna().any() else None,
    }
    if "lean_px" in metadata:
        # Off-nadir lean, apart from the ground's residual (outputs before it have no column).
        lean = acc["lean_px"].dropna().astype(float)
        top = acc["lean_max_px"].dropna().astype(float) if "lean_max_px" in acc else lean
        out["lean"] = {"accepted_with_lean": int(len(lean)),
                       "median_px": float(lean.median()) if len(lean) else None,
                       "max_px": float(top.max()) if len(top) else None}
    if candidate_pairs is not None:
        out["candidate_pairs"] = {str(k): int(v) for k, v in candidate_pairs["status"].value_counts().sort_index().items()}
    if labels is not None and len(labels):
        out["car"] = car_stats(pairs_job_car(metadata, labels))
    return out


def pairs_job_car(metadata: pd.DataFrame, labels: pd.DataFrame) -> pd.Series:
    """CAR of labelled slices from the tables: changed pixels / crop area (window width x height)."""
    area = metadata.set_index("slice_id")["window"].map(lambda w: float(w[2]) * float(w[3]) if w is not None else np.nan)
    lab = labels.drop_duplicates("slice_id").set_index("slice_id")
    return (lab["changed_pixels"].astype(float) / area.reindex(lab.index)).dropna()


def usage_stats(usage: pd.DataFrame) -> dict:
    """Tokens and cost over every run of the job (all were paid), by stage."""
    from operators.llm.usage import summarize_usage
    rows = usage.replace({np.nan: None}).to_dict("records")
    s = summarize_usage(rows)
    return {k: s[k] for k in ("logical_requests", "http_requests", "cached", "errors", "prompt_tokens",
                              "completion_tokens", "cost_usd", "cost_known", "by_stage")}


# -- tables like the paper's -------------------------------------------------------------------------
def _fmt(v, kind: str = "int") -> str:
    if v is None:
        return "—"
    if kind == "int":
        return f"{int(v):,}"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    return f"{v:.2f}" if kind == "f2" else f"{v:.1f}"


def caption_table(stats: dict) -> Table:
    cols = [k for k in stats if k != "total"] + ["total"]
    spec = [("Image pairs", "image_pairs", "int"), ("Generated captions", "generated", "int"),
            ("Selected captions", "selected", "int"), ("Pass rate", "pass_rate", "pct"),
            ("Avg. selected / pair", "selected_per_pair", "f2"),
            ("Avg. caption length (words)", "caption_words_mean", "f1"), ("Vocabulary size", "vocabulary", "int")]
    rows = [[label] + [_fmt(stats[c][key], kind) for c in cols] for label, key, kind in spec]
    rows.append(["Judge score (mean / median)"] + [
        f"{_fmt(stats[c]['judge_score_mean'], 'f1')} / {_fmt(stats[c]['judge_score_median'], 'f1')}" for c in cols])
    return Table("captions", "Captions (as the paper's Table III)", ["Statistic"] + [c.capitalize() for c in cols], rows)


def qa_table(stats: dict) -> Table:
    cols = [k for k in stats if k != "total"] + ["total"]
    spec = [("Image pairs", "image_pairs", "int"), ("Generated QA pairs", "generated", "int"),
            ("Selected QA pairs", "selected", "int"), ("Pass rate", "pass_rate", "pct"),
            ("Avg. selected / pair", "selected_per_pair", "f2"),
            ("Avg. question length (words)", "question_words_mean", "f1"),
            ("Avg. answer length (words)", "answer_words_mean", "f1")]
    rows = [[label] + [_fmt(stats[c][key], kind) for c in cols] for label, key, kind in spec]
    rows.append(["Judge score (mean / median)"] + [
        f"{_fmt(stats[c]['judge_score_mean'], 'f1')} / {_fmt(stats[c]['judge_score_median'], 'f1')}" for c in cols])
    return Table("qa", "QA pairs (as the paper's Table V)", ["Statistic"] + [c.capitalize() for c in cols], rows)


def pairs_job_table(stats: dict) -> Table:
    rows = [[s, _fmt(v["accepted"]), _fmt(v["rejected"])] for s, v in stats["by_split"].items()]
    rows.append(["total", _fmt(stats["accepted"]), _fmt(stats["rejected"])])
    return Table("pairs_job", "Bitemporal slices (pairs job)", ["Split", "Accepted", "Rejected"], rows)


def reject_reason_table(stats: dict) -> Table:
    total = max(stats["rejected"], 1)
    rows = [[k, _fmt(v), _fmt(v / total, "pct")] for k, v in sorted(stats["reject_reasons"].items(), key=lambda kv: -kv[1])]
    return Table("reject_reasons", "Reject reasons (pairs job)", ["Reason", "Slices", "Share of rejected"], rows)


def usage_table(by_job: dict) -> Table:
    rows = []
    for job, s in by_job.items():
        cost = f"${s['cost_usd']:.4f}" if s["cost_known"] else "—"
        rows.append([job, _fmt(s["logical_requests"]), _fmt(s["cached"]), _fmt(s["prompt_tokens"]),
                     _fmt(s["completion_tokens"]), cost])
    return Table("usage", "Tokens and cost (all runs)", ["Job", "Requests", "From cache", "Prompt tokens",
                                                          "Completion tokens", "Cost"], rows)


def car_table(stats: dict) -> Table:
    n = max(stats["n"], 1)
    rows = [[name, _fmt(k), _fmt(k / n, "pct")] for name, k in stats["classes"].items()]
    return Table("magnitude", f"Change-magnitude classes (CAR mean {_fmt(stats['mean'], 'pct')}, "
                              f"median {_fmt(stats['median'], 'pct')}, {stats['n']} pairs)",
                 ["Class", "Pairs", "Share"], rows)
