"""What a pair's annotation history decides (pure: history rows in, decisions out).

The history is every version of every annotation ever ingested (see :mod:`operators.annotation.history`);
a pair's decision is computed from all of it, never from one export. The rules (docs/annotation.md
states them with an example each):

1. Versions: the latest version (``updated_at``) of each (instance, project, task, annotation id) counts;
   an annotation a later full export showed deleted (a withdrawal row) counts no more. ``was_cancelled``
   ones are skips: counted, never drawings.
2. People: a version speaks for the user who made it so: ``updated_by`` when another user edited it in
   place, else its author (``completed_by``). The pair's annotators are the authors of its annotate-queue
   annotations.
3. Expert: a review-queue annotation, a ground-truth star, or (with an experts list) an in-place edit by
   a listed expert, made by someone who is not one of the pair's annotators (and, with a list, is on it),
   is an expert's decision. The latest decides: ``expert`` (merged as drawn), or ``unusable``.
4. Annotator and checker: the first two people to take part in the pair (an author when their annotation
   was made, an editor when they edited); each votes with the latest version that speaks for them (else
   the latest they authored). One person: merged as drawn (or unusable), or ``awaiting_check`` under
   ``require_check``. The checker's vote being the annotator's own annotation edited in place is a check:
   the checker's version is merged. Otherwise both answers are compared: both unusable excludes the pair,
   one unusable is a ``disagreement``, two drawings agree at ``min_agreement`` (:func:`compare`) and the
   checker's is merged. ``needs expert`` from either is a ``disagreement``.
5. Batches: a batch is one Label Studio project (of one instance). Its mean agreement over its checked
   pairs still awaiting a decision (merged or disagreement, not the expert's) below
   ``batch_min_agreement`` holds its merged pairs as ``disagreement`` for the expert.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Iterable

from operators.annotation.agreement import class_agreement, compare, dilate, overlap, tolerant_f1
from operators.annotation.batches import AWAITING, HELD, batch_agreements, batch_name, hold_rejected
from operators.annotation.roles import (REVIEW_QUEUE, author, edit_order, editor, expert_of, made_order, people,
                                        saved_later, voice, vote_of)
from operators.annotation.versions import TASK_ROW, history_key, latest_versions, version_key, withdrawn_keys

# The rules' parts live in a module each (versions, roles, agreement, batches); this module decides a pair
# with them and names them all, so callers import the decision rules from one place.
__all__ = ["STATUSES", "DECIDED", "WITH_MASK", "AWAITING", "HELD", "UNUSABLE_CHOICES", "FLAG_CHOICE",
           "QUALITY_CHOICES", "REVIEW_QUEUE", "TASK_ROW", "DecisionConfig", "PairDecision", "Masks",
           "version_key", "history_key", "latest_versions", "withdrawn_keys", "quality_of", "unusable_reasons",
           "made_order", "edit_order", "author", "saved_later", "editor", "voice", "expert_of", "people", "vote_of",
           "dilate", "overlap", "tolerant_f1", "class_agreement", "compare", "batch_name", "batch_agreements",
           "hold_rejected", "decide_pair", "decide_all"]

STATUSES = ("merged", "expert", "awaiting_check", "disagreement", "unusable", "unannotated", "not_exported",
            "unreadable")
DECIDED = ("merged", "expert", "unusable")
WITH_MASK = ("merged", "expert")
UNUSABLE_CHOICES = ("unusable", "cloud", "misregistered", "no data")
FLAG_CHOICE = "needs expert"
QUALITY_CHOICES = (*UNUSABLE_CHOICES, FLAG_CHOICE)


@dataclass(frozen=True)
class DecisionConfig:
    min_agreement: float = 0.8
    require_check: bool = False
    tolerance_px: int = 2
    noise_px: int = 200                 # a class one side drew smaller than this is noise (validate's floor)
    batch_min_agreement: float = 0.8
    experts: tuple = ()                 # user identities; empty: anyone who is not the pair's annotator

    @property
    def metric(self) -> str:
        return (f"F1 with a {self.tolerance_px} px boundary tolerance, a class under {self.noise_px} px "
                "counted as not drawn (lowest class)")


@dataclass
class PairDecision:
    pair_id: str
    status: str
    reason: str = ""
    annotations: int = 0           # submitted (latest versions)
    skipped: int = 0
    agreement: float | None = None  # tolerant F1 between annotator and checker, lowest class
    per_class: dict = field(default_factory=dict)   # class -> {"f1", "iou", "f1_tolerant", "noise"}
    annotator: str | None = None
    checker: str | None = None
    expert: str | None = None
    merged_from: tuple | None = None   # history key of the annotation version whose drawing is the mask
    batch: int | None = None           # project of the check (or of the single annotation)
    instance: str = ""                 # the Label Studio instance of that project
    withdrawn: int = 0                 # annotations deleted in Label Studio (seen by a full export)
    masks: dict | None = field(default=None, repr=False)   # {class: bool mask} to write, for WITH_MASK


def quality_of(row: dict) -> list[str]:
    q = row.get("quality")
    if isinstance(q, str):
        q = json.loads(q) if q else []
    return [str(x) for x in q or []]


def unusable_reasons(row: dict) -> list[str]:
    return [q for q in quality_of(row) if q in UNUSABLE_CHOICES]


Masks = Callable[[dict], dict]   # a history row -> {class: bool mask}


def _reasons(*versions: dict) -> str:
    return ", ".join(sorted({r for v in versions for r in unusable_reasons(v)}))


def _votes(who: list[str], drawings: list[dict]) -> tuple:
    """(annotator, their vote, checker or None, their vote or None)."""
    va = vote_of(who[0], drawings)
    if len(who) < 2:
        return who[0], va, None, None
    return who[0], va, who[1], vote_of(who[1], drawings)


def _place(d: PairDecision, v: dict) -> None:
    d.instance, d.batch = version_key(v)[:2]


def _merge(d: PairDecision, v: dict, masks_of: Masks, reason: str) -> PairDecision:
    d.status, d.reason, d.merged_from, d.masks = "merged", reason, history_key(v), masks_of(v)
    return d


def decide_pair(pair_id: str, rows: list[dict], masks_of: Masks, cfg: DecisionConfig) -> PairDecision:
    """One pair from all its history rows (any order). ``masks_of`` decodes a row's drawing; it is called
    only for the annotations that matter (the expert's, the annotator's and the checker's votes)."""
    rows = list(rows)
    versions = latest_versions(rows)
    submitted = [v for v in versions if not v.get("was_cancelled")]
    base = dict(pair_id=pair_id, annotations=len(submitted), skipped=len(versions) - len(submitted),
                withdrawn=len(withdrawn_keys(rows)))
    annotators = {author(v) for v in submitted if v.get("queue") != REVIEW_QUEUE}
    acts = sorted(((v, who) for v in submitted if (who := expert_of(v, annotators, cfg.experts))),
                  key=lambda a: (edit_order(a[0]), version_key(a[0])))
    decided = {id(v) for v, _ in acts}
    drawings = [v for v in submitted if v.get("queue") != REVIEW_QUEUE and id(v) not in decided]
    who = people(drawings)
    if acts:
        e, expert = acts[-1]
        d = PairDecision(status="expert", reason="decided by the expert", expert=expert, **base)
        if who:
            # The people's agreement is still measured (reported), though the expert decided the pair.
            d.annotator, va, d.checker, vc = _votes(who, drawings)
            _place(d, vc or va)
            if vc is not None and vc is not va and not (unusable_reasons(va) or unusable_reasons(vc)):
                try:
                    d.agreement, d.per_class = compare(masks_of(va), masks_of(vc), cfg.tolerance_px, cfg.noise_px)
                except ValueError:
                    pass   # an unreadable drawing does not stand in the expert's way
        if unusable_reasons(e):
            d.status, d.reason = "unusable", _reasons(e) + " (expert)"
        else:
            d.merged_from, d.masks = history_key(e), masks_of(e)
        return d
    if not who:
        skipped = base["skipped"]
        return PairDecision(status="unannotated", reason=(f"{skipped} skipped, none submitted" if skipped
                                                          else "no submitted annotation yet"), **base)
    ann, va, chk, vc = _votes(who, drawings)
    d = PairDecision(status="disagreement", annotator=ann, checker=chk, **base)
    _place(d, vc or va)
    if vc is None:
        if FLAG_CHOICE in quality_of(va):
            d.reason = f"flagged '{FLAG_CHOICE}' by the annotator"
        elif cfg.require_check:
            d.status, d.reason = "awaiting_check", "one annotation; --require-check waits for the checker's"
        elif unusable_reasons(va):
            d.status, d.reason = "unusable", _reasons(va)
        else:
            _merge(d, va, masks_of, "one annotation, merged unchecked")
        return d
    if FLAG_CHOICE in quality_of(vc) or FLAG_CHOICE in quality_of(va):
        d.reason = f"flagged '{FLAG_CHOICE}' by the {'checker' if FLAG_CHOICE in quality_of(vc) else 'annotator'}"
    elif version_key(vc) == version_key(va):   # the checker corrected the annotator's own annotation in place
        if unusable_reasons(vc):
            d.status, d.reason = "unusable", _reasons(vc)
        else:
            _merge(d, vc, masks_of, "checked in place: the checker's edit of the annotator's annotation is merged")
    elif unusable_reasons(va) and unusable_reasons(vc):
        d.status, d.reason = "unusable", _reasons(va, vc)
    elif unusable_reasons(va) or unusable_reasons(vc):
        marker, other = ("annotator", "checker") if unusable_reasons(va) else ("checker", "annotator")
        d.reason = f"the {marker} marks the pair unusable ({_reasons(va, vc)}), the {other} drew it; for the expert"
    else:
        d.agreement, d.per_class = compare(masks_of(va), masks_of(vc), cfg.tolerance_px, cfg.noise_px)
        if d.agreement < cfg.min_agreement:
            d.reason = (f"annotator and checker agree at {d.agreement:.3f} < {cfg.min_agreement} ({cfg.metric}); "
                        "for the expert")
        else:
            _merge(d, vc, masks_of, f"checked: agreement {d.agreement:.3f}; the checker's drawing is merged")
    return d


def decide_all(rows: Iterable[dict], masks_of: Masks, cfg: DecisionConfig) -> dict[str, PairDecision]:
    """{pair_id: decision} for every pair the history names, batch acceptance applied."""
    by_pair: dict[str, list[dict]] = {}
    for r in rows:
        by_pair.setdefault(r["pair_id"], []).append(r)
    out = {}
    for pid, rs in sorted(by_pair.items()):
        try:
            out[pid] = decide_pair(pid, rs, masks_of, cfg)
        except ValueError as exc:   # a drawing that cannot be read (wrong size, unknown class): held, named
            versions = latest_versions(rs)
            out[pid] = PairDecision(pid, "unreadable", f"{type(exc).__name__}: {exc}",
                                    annotations=sum(1 for v in versions if not v.get("was_cancelled")),
                                    skipped=sum(1 for v in versions if v.get("was_cancelled")),
                                    withdrawn=len(withdrawn_keys(rs)))
    hold_rejected(out, cfg.batch_min_agreement)
    return out
