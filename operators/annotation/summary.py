"""``annotation_summary.json`` and the status a team lead reads (pure: state rows and history in).

Ingest writes the summary after every run; ``annotate status`` computes the same document from the
dataset's tables without ingesting, so both always show the same counts.
"""
from __future__ import annotations

import json
import statistics
from collections import Counter

from operators.annotation.decisions import (AWAITING, DECIDED, HELD, REVIEW_QUEUE, STATUSES, WITH_MASK,
                                            DecisionConfig, batch_name, history_key, latest_versions)

SUMMARY_FILE = "annotation_summary.json"
SUMMARY_VERSION = 1


def read_summary(store) -> dict | None:
    """A dataset's annotation summary (contract version 1, with pair counts), or None when it has none
    or an unreadable one (the chain, the report and the release read it through here)."""
    try:
        if not store.exists(SUMMARY_FILE):
            return None
        doc = json.loads(store.read_bytes(SUMMARY_FILE))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("pairs"), dict) else None


def _median(values):
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def _mean(values):
    values = [v for v in values if v is not None]
    return float(statistics.fmean(values)) if values else None


def _method(models: list[str]) -> str:
    if not models:
        return "none"
    name = Counter(models).most_common(1)[0][0]
    if name.startswith("changeforge:"):   # the classical proposals: cva, irmad, pca-kmeans
        return name.split(":", 1)[1]
    return "folder" if name.startswith("folder:") else name   # onnx:<file name> as it is


def build_summary(*, pairs: list[dict], states: dict[str, dict], history: list[dict], exported: set[str],
                  classes, cfg: DecisionConfig, generated_at: str, tools: list[str] | None = None,
                  reviewed: set[str] = frozenset()) -> dict:
    """The summary document. ``pairs``: the dataset's pairs (:func:`operators.io.layout.discover_pairs`);
    ``states``: {pair_id: state row} of the pairs in the annotation loop; ``history``: every history row;
    ``exported``: pair ids an export sent out. A complete pair outside the loop is ``not_exported``
    unless an export sent it (then ``unannotated``: waiting in Label Studio) or it came with a mask (then
    decided: it needs no people). ``reviewed``: pair ids an export sent to the review queue."""
    complete = [p for p in pairs if p["a_rel"] and p["b_rel"]]
    status: dict[str, str] = {}
    given = 0
    for p in complete:
        pid = p["pair_id"]
        if pid in states:
            status[pid] = states[pid]["status"]
        elif pid in exported:
            status[pid] = "unannotated"
        elif p["label_rel"]:
            given += 1
        else:
            status[pid] = "not_exported"
    by_status = {s: 0 for s in STATUSES}
    for s in status.values():
        by_status[s] = by_status.get(s, 0) + 1
    versions = latest_versions(history)
    submitted = [v for v in versions if not v.get("was_cancelled")]
    rows_by_key = {history_key(r): r for r in history}
    with_mask = [s for s in states.values() if s["status"] in WITH_MASK]
    checked = [s for s in states.values() if s.get("agreement") is not None]

    people: dict[str, dict] = {}
    for v in submitted:
        who = v.get("annotator") or "unknown"
        people.setdefault(who, {"lead": [], "n": 0})
        people[who]["n"] += 1
        people[who]["lead"].append(v.get("lead_time_s"))
    per_annotator = []
    for who in sorted(people):
        mine = [s["agreement"] for s in checked if s.get("annotator") == who]
        per_annotator.append({
            "annotator": who, "annotations": people[who]["n"],
            "median_lead_time_s": _median(people[who]["lead"]), "agreement_with_checkers": _mean(mine),
            "as_checker": sum(1 for s in states.values() if s.get("checker") == who),
            "as_expert": sum(1 for s in states.values() if s.get("expert") == who)})

    ious = []
    for s in with_mask:
        row = rows_by_key.get(tuple(json.loads(s["merged_from"]))) if s.get("merged_from") else None
        per_class = json.loads(row["prelabel_iou"]) if row and row.get("prelabel_iou") else {}
        vals = [v for v in per_class.values() if v is not None]
        if vals:
            ious.append(sum(vals) / len(vals))
    models = [r["prelabel_model"] for r in history if r.get("annotation_id") == -1 and r.get("prelabel_model")]
    batches: dict[tuple, list[float]] = {}   # as decisions.batch_agreements: checked pairs awaiting a decision
    for s in checked:
        if s.get("batch") is not None and s.get("checker") and s["status"] in AWAITING:
            batches.setdefault((str(s.get("instance") or ""), int(s["batch"])), []).append(s["agreement"])
    per_class: dict[str, list[float]] = {}
    for s in checked:
        for name, v in json.loads(s.get("per_class") or "{}").items():
            per_class.setdefault(name, []).append(v["f1_tolerant"])
    n_mask = len(with_mask)
    excluded = [{"pair_id": pid, "status": "unusable", "reason": states[pid].get("reason")}
                for pid in sorted(states) if states[pid]["status"] == "unusable"]
    summary = {
        "version": SUMMARY_VERSION, "generated_at": generated_at,
        "classes": [{"name": c.name, "image": c.image, "folder": c.folder} for c in classes],
        "pairs": {"total": len(complete), "decided": sum(by_status[s] for s in DECIDED) + given, "by_status": by_status,
                  "given_masks": given,
                  "held_by_batch": sum(1 for st in states.values() if st["status"] == "disagreement"
                                       and str(st.get("reason") or "").startswith(HELD))},
        "annotations": {"total": len(versions), "submitted": len(submitted), "skipped": len(versions) - len(submitted),
                        "annotators": len({v.get("annotator") for v in submitted if v.get("queue") != REVIEW_QUEUE}),
                        "experts": len({s["expert"] for s in states.values() if s.get("expert")})},
        "double_annotated_share": (sum(1 for s in with_mask if s.get("checker")) / n_mask) if n_mask else 0.0,
        "expert_resolved_share": (sum(1 for s in with_mask if s["status"] == "expert") / n_mask) if n_mask else 0.0,
        "agreement": {"metric": cfg.metric, "median": _median(s["agreement"] for s in checked),
                      "mean": _mean(s["agreement"] for s in checked), "pairs": len(checked),
                      "per_class": {name: {"mean": _mean(v), "median": _median(v), "pairs": len(v)}
                                    for name, v in per_class.items()}},
        "batches": [{"project": k[1], "instance": k[0], "mean_agreement": float(statistics.fmean(v)), "pairs": len(v),
                     "accepted": statistics.fmean(v) >= cfg.batch_min_agreement} for k, v in sorted(batches.items())],
        "per_annotator": per_annotator,
        "prelabel": {"method": _method(models), "median_iou": _median(ious)},
        "timeframe": {"first_annotation": min((v.get("created_at") or v.get("updated_at") for v in submitted), default=None),
                      "last_annotation": max((v.get("updated_at") for v in submitted), default=None)},
        "tools": tools or ["Label Studio"],
        "excluded": excluded,
        "protocol": protocol(cfg),
        "settings": {"min_agreement": cfg.min_agreement, "require_check": cfg.require_check,
                     "tolerance_px": cfg.tolerance_px, "noise_px": cfg.noise_px,
                     "batch_min_agreement": cfg.batch_min_agreement, "experts": list(cfg.experts)},
        "next": next_steps(by_status, sum(1 for pid, st in status.items() if st == "disagreement" and pid in reviewed)),
    }
    return summary


def protocol(cfg: DecisionConfig) -> str:
    return ("Each pair is drawn by an annotator in Label Studio; a second person's annotation, or their "
            "correction of the first in place, is the check (people are Label Studio users: two annotations by "
            "one user are one person's). Annotator and checker are compared class by class by " + cfg.metric +
            f"; at {cfg.min_agreement} or above the checker's drawing is the mask, below it the pair goes to an "
            "expert. An expert (" + (", ".join(cfg.experts) if cfg.experts else "anyone who is not one of the "
            "pair's annotators") + ") decides a pair by answering its review task or starring a drawing as "
            "ground truth, whatever the others drew. A Label Studio project is a batch; a batch whose mean "
            f"agreement over its pairs awaiting a decision is below {cfg.batch_min_agreement} is held for the "
            "expert. Annotations deleted in Label Studio are withdrawn. " +
            ("A single annotation waits for its check. " if cfg.require_check else
             "A pair with a single annotation is merged unchecked. ") +
            "Pairs marked unusable (cloud, misregistration, no data) are excluded with the reason.")


def next_steps(by_status: dict, with_the_expert: int = 0) -> list[str]:
    """What the team lead does next; ``with_the_expert``: disagreements a review export already sent out."""
    out = []
    if by_status.get("not_exported"):
        out.append(f"{by_status['not_exported']} pairs not exported yet: changeforge annotate export --input <dataset> ...")
    if by_status.get("disagreement", 0) > with_the_expert:
        out.append(f"{by_status['disagreement'] - with_the_expert} disagreements for the expert: changeforge annotate "
                   "export --input <dataset> --queue review ...")
    if with_the_expert:
        out.append(f"{with_the_expert} disagreements wait in the expert's review project: ingest it when reviewed")
    if by_status.get("awaiting_check"):
        out.append(f"{by_status['awaiting_check']} pairs wait for the checker's annotation in their project")
    if by_status.get("unannotated"):
        out.append(f"{by_status['unannotated']} pairs exported but not annotated (or skipped): in Label Studio, "
                   "or export them again with --resend")
    if by_status.get("unreadable"):
        out.append(f"{by_status['unreadable']} pairs whose annotation cannot be read: see errors/")
    return out or ["nothing to export: every pair is decided"]


def format_status(s: dict) -> str:
    """The summary as the lines ``annotate status`` and ingest print."""
    p = s["pairs"]
    lines = [f"pairs: {p['total']} ({p['decided']} decided, {p.get('given_masks', 0)} with masks from the input)",
             "  " + ", ".join(f"{k} {v}" for k, v in p["by_status"].items())
             + (f" ({p['held_by_batch']} of the disagreements held by a rejected batch, not drawn apart)"
                if p.get("held_by_batch") else "")]
    a = s["annotations"]
    lines.append(f"annotations: {a['submitted']} submitted, {a['skipped']} skipped, by {a['annotators']} annotators "
                 f"and {a['experts']} experts")
    ag = s["agreement"]
    if ag["pairs"]:
        lines.append(f"agreement ({ag['metric']}): median {ag['median']:.3f}, mean {ag['mean']:.3f} over {ag['pairs']} "
                     f"checked pairs; double-annotated {s['double_annotated_share']:.0%} and expert-resolved "
                     f"{s['expert_resolved_share']:.0%} of the masks")
    for b in s.get("batches", []):
        lines.append(f"  batch {batch_name(b.get('instance') or '', b['project'])}: mean {b['mean_agreement']:.3f} over "
                     f"{b['pairs']} pairs, "
                     f"{'accepted' if b['accepted'] else 'REJECTED'}")
    if ag.get("per_class"):
        lines.append("  per class: " + ", ".join(f"{k} {v['mean']:.3f} ({v['pairs']} pairs)"
                                                 for k, v in ag["per_class"].items()))
    for r in s["per_annotator"]:
        lead = "-" if r["median_lead_time_s"] is None else f"{r['median_lead_time_s']:.0f} s"
        agr = "-" if r["agreement_with_checkers"] is None else f"{r['agreement_with_checkers']:.3f}"
        lines.append(f"  {r['annotator']}: {r['annotations']} annotations, median {lead}, agreement with checkers "
                     f"{agr}, {r['as_checker']} checks, {r['as_expert']} expert decisions")
    for e in s["excluded"]:
        lines.append(f"  excluded {e['pair_id']}: {e['reason']}")
    lines.append("next: " + "; ".join(s["next"]))
    return "\n".join(lines)
