"""What a report was made from, per pair: a short digest of each pair's rows in the tables the report
reads (its captions, its QA pairs, its review verdicts), recorded in ``stats.json`` as ``made_from``.
``changeforge chain --explain`` compares them with today's tables (operators.io.lineage.keyed_status):
a pair whose captions were redone since the report is stale by ``caption``, by ``QA`` or ``review`` the
same way; a pair the report does not count yet is missing. The report is written whole each run."""
from __future__ import annotations

from typing import TYPE_CHECKING

from operators.io import lineage

if TYPE_CHECKING:   # the frames are the report's; the chain command reads this module without pandas
    import pandas as pd

# table -> (the lineage input name, the columns whose values a pair's figures and tables come from)
SOURCES = {"captions": ("captions", ("candidate_index", "perspective", "caption", "overall", "selected")),
           "qa": ("qa", ("qa_index", "question_type", "question", "answer", "overall", "selected")),
           "review": ("review", ("item_id", "status", "verdict", "error_categories", "corrected_text"))}
DIGEST_CHARS = 16   # per pair and table, in stats.json: short enough for large datasets, ample to tell a change


def _digests(table: pd.DataFrame | None, columns: tuple[str, ...]) -> dict[str, str]:
    if table is None or not len(table) or "pair_id" not in table.columns:
        return {}
    cols = [c for c in columns if c in table.columns]
    rows = table[["pair_id", *cols]].copy()
    out = {}
    for pid, g in rows.groupby(rows["pair_id"].astype(str), sort=True):
        values = sorted(repr([_plain(v) for v in r]) for r in g[cols].itertuples(index=False, name=None))
        out[pid] = lineage.value_digest(values)[:DIGEST_CHARS]
    return out


def _plain(v):
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, float) and v != v:
        return None
    return v


def pair_lineage(data: dict) -> dict[str, dict]:
    """pair id -> {input name: digest} from the report's loaded tables (jobs.report.load_inputs)."""
    tables = {"captions": (data.get("captions") or {}).get("captions"), "qa": (data.get("qa") or {}).get("qa"),
              "review": data.get("review")}
    out: dict[str, dict] = {}
    for table, (name, columns) in SOURCES.items():
        for pid, d in _digests(tables[table], columns).items():
            out.setdefault(pid, {})[name] = d
    return dict(sorted(out.items()))
