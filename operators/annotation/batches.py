"""Batch acceptance (rule 5 of :mod:`operators.annotation.decisions`): a batch is one Label Studio project
of one instance; its mean agreement over its checked pairs still awaiting a decision (merged or
disagreement, not the expert's) below ``batch_min_agreement`` holds its merged pairs as
``disagreement`` for the expert. A pair the expert decides leaves the mean, so the batch recovers.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

AWAITING = ("merged", "disagreement")   # a batch's mean is over these: decided by no expert yet
HELD = "batch ("   # how the reason of a pair held by its rejected batch begins (status tells them apart)


def batch_name(instance: str, project: int) -> str:
    return f"project {project}" + (f" on {instance}" if instance else "")


def batch_agreements(decisions: Iterable) -> dict[tuple, tuple[float, int]]:
    """{(instance, project): (mean agreement, pairs)} over each batch's checked pairs (the pair decisions,
    :class:`operators.annotation.decisions.PairDecision`) still awaiting a
    decision (merged or disagreement): a pair the expert decided leaves its batch's mean."""
    by: dict[tuple, list[float]] = {}
    for d in decisions:
        if d.status in AWAITING and d.agreement is not None and d.checker is not None and d.batch is not None:
            by.setdefault((d.instance, d.batch), []).append(d.agreement)
    return {k: (float(np.mean(v)), len(v)) for k, v in sorted(by.items())}


def hold_rejected(decisions: dict, batch_min_agreement: float) -> None:
    """Hold as ``disagreement``, for the expert, the merged pairs of every batch whose mean agreement
    (:func:`batch_agreements`) is below ``batch_min_agreement`` (in place)."""
    batches = batch_agreements(decisions.values())
    for d in decisions.values():
        if d.status != "merged" or (d.instance, d.batch) not in batches:
            continue
        mean, n = batches[(d.instance, d.batch)]
        if mean < batch_min_agreement:
            d.status = "disagreement"
            d.reason = (f"{HELD}{batch_name(d.instance, d.batch)}) rejected: mean agreement {mean:.3f} over {n} "
                        f"pairs awaiting a decision < {batch_min_agreement}; held for the expert")
            d.merged_from, d.masks = None, None
