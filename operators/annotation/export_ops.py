"""Export: the pairs that need people, as Label Studio tasks.

``annotate`` queue: every complete pair not decided yet (no mask, never marked unusable, not waiting in
a project for its check or its expert), with a pre-label as a prediction. ``review`` queue: the pairs
the expert must decide (disagreements, pairs flagged ``needs expert``, pairs of a rejected batch), each
carrying the annotator's and the checker's drawings as two predictions. Unusable pairs are never
exported again.
"""
from __future__ import annotations

import json
import posixpath

from operators.annotation.decisions import REVIEW_QUEUE, latest_versions, people, vote_of
from operators.annotation.ingest_ops import EXPORTS_SCHEMA, _changed, exported_pairs, read_history, read_states
from operators.annotation.results import brush_result
from operators.io.tables import error_record, read_table, write_table_shard

INSTRUCTIONS = ("Draw every changed structure with the brush (or a polygon): {parts}. Leave a class empty "
                "when the pair shows none of it; submit to say so. If the pair cannot be annotated, tick "
                "'unusable' and the reason under Pair quality; tick 'needs expert' to hand it to the expert.")
REVIEW_INSTRUCTIONS = ("Expert review: the annotator's and the checker's drawings are the two predictions. "
                       "Draw (or keep) the right masks and submit; your annotation decides the pair. " + INSTRUCTIONS)
ANNOTATE_OPEN = ("awaiting_check", "disagreement")   # waiting in a project: not handed out twice


def stem(pair: dict) -> str:
    return posixpath.basename(pair["pair_id"])


def select_pairs(dataset, pairs: list[dict], queue: str, skip_labelled: bool, resend: bool = False) -> tuple[list[dict], dict]:
    """(pairs to export, {reason left out: count}). A pair an earlier export sent to this queue and still
    open there (not annotated yet, or for the review queue still a disagreement) is ``handed out``: not
    sent twice unless ``resend``."""
    states = read_states(dataset)
    sent = set() if resend else exported_pairs(dataset, queue)
    todo, left = [], {}

    def leave(why):
        left[why] = left.get(why, 0) + 1

    for p in pairs:
        s = (states.get(p["pair_id"]) or {}).get("status")
        if s == "unusable":
            leave("unusable")
        elif queue == REVIEW_QUEUE:
            if s == "disagreement" and p["pair_id"] in sent:
                leave("handed out")
            elif s == "disagreement":
                todo.append(p)
        elif s in ("merged", "expert"):
            leave("decided")
        elif s in ANNOTATE_OPEN:
            leave(s)
        elif skip_labelled and p["label_rel"] and s is None:
            leave("labelled")
        elif s in (None, "unannotated") and p["pair_id"] in sent:
            leave("handed out")
        else:
            todo.append(p)
    return todo, left


def drawings_of(dataset, pair_ids: set[str]) -> dict[str, list[dict]]:
    """{pair_id: [the annotator's vote, the checker's vote]} (as the decisions name them: people, not
    positions) for the review queue, each with ``voter`` set to whom it speaks for."""
    out: dict[str, list[dict]] = {}
    for v in latest_versions(r for r in read_history(dataset) if r["pair_id"] in pair_ids):
        if not v.get("was_cancelled") and v.get("queue") != REVIEW_QUEUE:
            out.setdefault(v["pair_id"], []).append(v)
    return {k: [{**vote_of(who, vs), "voter": who} for who in people(vs)[:2]] for k, vs in out.items()}


def build_task(pair: dict, urls, classes, prelabel: dict | None, score: float | None, model_version: str,
               queue: str = "annotate", drawings: list[dict] | None = None) -> dict:
    """One task: the pair's images, its ids and split; the pre-label (annotate) or the annotator's and
    the checker's drawings (review) as predictions."""
    parts = ", ".join(f"{c.name} on the {'post-change' if c.image == 'post' else 'pre-change'} image" for c in classes)
    text = (REVIEW_INSTRUCTIONS if queue == REVIEW_QUEUE else INSTRUCTIONS).format(parts=parts)
    data = {"pre": urls.url(pair["a_rel"]), "post": urls.url(pair["b_rel"]), "pair_id": stem(pair),
            "split": pair["split"], "item_id": pair["pair_id"], "queue": queue,
            "title": f"{stem(pair)} ({pair['split']}{', expert review' if queue == REVIEW_QUEUE else ''})",
            "instructions": text}
    out = {"data": data}
    if queue == REVIEW_QUEUE:
        preds = []
        for role, d in zip(("annotator", "checker"), drawings or []):
            result = [r for r in json.loads(d.get("result") or "[]")
                      if str(r.get("type", "")).lower() in ("brushlabels", "polygonlabels")]
            who = d.get("voter") or d.get("annotator") or "unknown"
            preds.append({"model_version": f"{role}:{who}", "result": result})
        if preds:
            out["predictions"] = preds
    elif prelabel:
        by_name = {c.name: c for c in classes}
        prediction = {"model_version": model_version,
                      "result": [brush_result(by_name[name], mask) for name, mask in prelabel.items()]}
        if score is not None:
            prediction["score"] = float(score)
        out["predictions"] = [prediction]
    return out


def record_exports(dataset, pair_ids: list[str], queue: str, output: str, run_id: str) -> None:
    rows = [{"pair_id": pid, "queue": queue, "output": output} for pid in pair_ids]
    t = read_table(dataset, "annotation_exports", EXPORTS_SCHEMA)
    before = {r["pair_id"]: r for r in ([] if t is None else t.to_pylist()) if r["queue"] == queue}
    write_table_shard(dataset, "annotation_exports", _changed(rows, before, EXPORTS_SCHEMA), EXPORTS_SCHEMA, run_id)


def missing_image_errors(pairs: list[dict], job: str, run_id: str) -> list[dict]:
    return [error_record(p["pair_id"], "annotate_export", f"{'pre (A)' if not p['a_rel'] else 'post (B)'} image missing",
                         error_type="MissingImage", job=job, run_id=run_id)
            for p in pairs if not (p["a_rel"] and p["b_rel"])]
