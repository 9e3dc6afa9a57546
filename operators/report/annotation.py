"""How a dataset's change masks were made, read from its ``annotation_summary.json`` (written by
``annotate ingest``) and its ``label_classes.json``: the lines the report and the release card show.
Without a summary they say only that the masks came with the input: no figure is ever made up. Pure:
dicts in, text out (reading the two files aside).
"""
from __future__ import annotations

from operators.annotation.summary import SUMMARY_FILE, read_summary  # noqa: F401 - the file's one reader
from operators.report.stats import Table

WITHOUT_SUMMARY = "as given with the input (it has no annotation_summary.json, so how they were drawn is unknown)"


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




def mask_table(classes: list[dict] | None, summary: dict | None) -> Table:
    """The report's "Change masks" table: the class scheme and :func:`facts`."""
    rows = [["classes", ", ".join(f"{c['name']} (on the {c['image']}-change image, {c['folder']}/)" for c in classes)
             if classes else "not recorded (no label_classes.json)"]]
    rows += [[k, v] for k, v in facts(summary).items() if k != "classes"]
    for e in (summary or {}).get("excluded") or []:
        rows.append(["excluded", f"{e.get('pair_id')}: {e.get('status', 'unusable')} ({e.get('reason') or 'no reason given'})"])
    return Table("masks", "Change masks", ["Measure", "Value"], rows)


def read_classes(store) -> list[dict] | None:
    """The dataset's ``label_classes.json`` classes as dicts, or None (a malformed file is reported
    by the jobs that rely on it)."""
    from operators.annotation.scheme import read_scheme, scheme_document
    try:
        scheme = read_scheme(store)
    except (OSError, ValueError):
        return None
    return None if scheme is None else scheme_document(scheme)["classes"]
