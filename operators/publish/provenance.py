"""How a release's change masks were made, from the dataset's ``annotation_summary.json`` (written by
``annotate ingest``; the card's lines are :func:`operators.report.annotation.facts`): Croissant's
Responsible-AI fields, and the pairs the people excluded (``unusable``, with their reason). Without a
summary the release says only that the masks came with the input: no figure is ever made up.
"""
from __future__ import annotations

import posixpath

from operators.report.annotation import (SUMMARY_FILE, WITHOUT_SUMMARY, facts, prelabel_text,  # noqa: F401
                                         read_summary)

def rai(s: dict | None) -> dict:
    """Croissant RAI fields on the change masks (merged with the captions' and QA's by the caller)."""
    if s is None:
        return {"rai:dataAnnotationProtocol": f"Change masks: {WITHOUT_SUMMARY}."}
    f = facts(s)
    out = {
        "rai:dataAnnotationProtocol": f"Change masks: {f['change masks']} Pairs decided: {f['pairs decided']}.",
        "rai:dataAnnotationAnalysis": (f"Change masks: {f['agreement']}; double-annotated share "
                                       f"{f['double-annotated share']}; share resolved by experts "
                                       f"{f['resolved by experts']}; {f['annotations']}."),
    }
    pre = prelabel_text(s)
    if pre:
        out["rai:machineAnnotationTools"] = [f"change-mask pre-labels: {pre}"]
    t = s.get("timeframe") or {}
    if t.get("first_annotation"):
        out["rai:dataCollectionTimeframe"] = [t["first_annotation"], t.get("last_annotation") or t["first_annotation"]]
    ex = s.get("excluded") or []
    out["rai:dataPreprocessingProtocol"] = (
        "Each pair's change mask is decided from its whole annotation history (annotate ingest); pairs not decided "
        "are left out" + (f"; {len(ex)} pair(s) the annotators marked unusable are excluded with their reason "
                          "(excluded.json)" if ex else "") + ".")
    return out


def full_id(pair) -> str:
    """A dataset pair's id as annotation writes it: ``<split folder>/<stem>`` for split folders, else the stem."""
    a = pair.files.get("A", "")
    base = posixpath.dirname(posixpath.dirname(a))
    return f"{base}/{pair.pair_id}" if base else pair.pair_id


def excluded(s: dict | None, pairs: list) -> tuple[set[str], list[dict]]:
    """(dataset pair ids the people excluded, their excluded.json rows with the reason)."""
    if not s:
        return set(), []
    by_full = {full_id(p): p.pair_id for p in pairs}
    stems: dict[str, list[str]] = {}
    for p in pairs:
        stems.setdefault(p.pair_id, []).append(p.pair_id)
    ids, rows = set(), []
    for e in s.get("excluded") or []:
        pid = str(e.get("pair_id") or "")
        found = by_full.get(pid) or (pid if len(stems.get(pid, [])) == 1 else None)
        status, reason = str(e.get("status") or "unusable"), e.get("reason") or "no reason given"
        rows.append({"item": found or pid, "stage": "annotation", "message": f"{status}: {reason}",
                     "status": status, "reason": reason})
        if found:
            ids.add(found)
    return ids, rows
