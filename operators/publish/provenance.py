"""How a release's change masks were made, from the dataset's ``annotation_summary.json`` (written by
``annotate ingest``): the card's facts, Croissant's Responsible-AI fields, and the pairs the people
excluded (``unusable``, with their reason). Without a summary the release says only that the masks
came with the input: no figure is ever made up. Pure: dicts in, dicts out.
"""
from __future__ import annotations

import json
import posixpath

SUMMARY_FILE = "annotation_summary.json"
WITHOUT_SUMMARY = "as given with the input (no annotation_summary.json: how they were drawn is not recorded)"


def read_summary(store) -> dict | None:
    """The dataset's annotation summary (contract version 1, with pair counts), or None."""
    try:
        if not store.exists(SUMMARY_FILE):
            return None
        doc = json.loads(store.read_bytes(SUMMARY_FILE))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("pairs"), dict) else None


def _share(v) -> str:
    return "not recorded" if v is None else f"{100 * float(v):.1f}%"


def _num(v, digits: int = 3) -> str:
    return "n/a" if v is None else f"{float(v):.{digits}f}"


def agreement_text(s: dict) -> str:
    a = s.get("agreement") or {}
    if not a.get("pairs"):
        return f"no pair was annotated twice ({a.get('metric') or 'agreement'} not measured)"
    return (f"{a.get('metric') or 'agreement'} between annotator and checker: median {_num(a.get('median'))}, "
            f"mean {_num(a.get('mean'))} over {a['pairs']} double-annotated pair(s)")


def prelabel_text(s: dict) -> str | None:
    p = s.get("prelabel") or {}
    method = p.get("method")
    if not method or method == "none":
        return None
    iou = p.get("median_iou")
    return f"{method}" + (f" (median IoU of the final masks against them {_num(iou)})" if iou is not None else "")


def facts(s: dict | None) -> dict[str, str]:
    """The card's lines on the change masks (key -> text)."""
    if s is None:
        return {"change masks": WITHOUT_SUMMARY}
    pairs, anns = s.get("pairs") or {}, s.get("annotations") or {}
    by = pairs.get("by_status") or {}
    out = {"change masks": s.get("protocol") or "annotated in Label Studio (protocol not recorded)"}
    if s.get("classes"):
        out["classes"] = ", ".join(f"{c.get('name')} (on the {c.get('image')}-change image, {c.get('folder')}/)"
                                   for c in s["classes"])
    out["pairs decided"] = (f"{pairs.get('decided')} of {pairs.get('total')} (merged {by.get('merged', 0)}, by an "
                            f"expert {by.get('expert', 0)}, unusable {by.get('unusable', 0)}); the others are not "
                            "in this release")
    out["annotations"] = (f"{anns.get('submitted', 0)} submitted and {anns.get('skipped', 0)} skipped by "
                          f"{anns.get('annotators', 0)} annotator(s) and {anns.get('experts', 0)} expert(s)")
    out["agreement"] = agreement_text(s)
    out["double-annotated share"] = _share(s.get("double_annotated_share"))
    out["resolved by experts"] = _share(s.get("expert_resolved_share"))
    pre = prelabel_text(s)
    out["pre-labels"] = pre or "none"
    t = s.get("timeframe") or {}
    if t.get("first_annotation"):
        out["annotation timeframe"] = f"{t['first_annotation']} to {t.get('last_annotation') or t['first_annotation']}"
    if s.get("tools"):
        out["tools"] = ", ".join(map(str, s["tools"]))
    return out


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
