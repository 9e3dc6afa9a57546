"""Which items people review: a seeded, stratified random sample, and the change-magnitude classes it
can be stratified by.

Allocation is proportional to stratum size (largest remainders, ties broken by the seed), so the sample
is self-weighting: its acceptance rate estimates the population's without weights. Every stratum that
exists gets at least one item while the sample is at least as large as the number of strata (small
strata, e.g. a rare perspective, would otherwise never be seen by a reviewer); each item carries its
stratum's size and sample count so a weighted estimate stays possible.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Change-magnitude classes by change area ratio (CAR, 0..1). The paper reports CAR's long-tailed spread
# (Fig. 2: mean 9.7 %, median 2.9 %) but names no classes; these edges split that tail into readable bins.
CAR_CLASS_EDGES = (0.05, 0.20, 0.50)
CAR_CLASS_NAMES = ("no change", "small (<5%)", "medium (5-20%)", "large (20-50%)", "very large (>=50%)")


def car_class(car: float | None, edges: tuple[float, ...] = CAR_CLASS_EDGES) -> str:
    """Magnitude class of one CAR value; ``unknown`` when there is none."""
    if car is None or car != car:
        return "unknown"
    if car <= 0:
        return CAR_CLASS_NAMES[0]
    names = car_class_names(edges)
    for i, edge in enumerate(edges):
        if car < edge:
            return names[i + 1]
    return names[-1]


def car_class_names(edges: tuple[float, ...] = CAR_CLASS_EDGES) -> tuple[str, ...]:
    if tuple(edges) == CAR_CLASS_EDGES:
        return CAR_CLASS_NAMES
    pct = [f"{100 * e:g}%" for e in edges]
    inner = [f"<{pct[0]}"] + [f"{a}-{b}" for a, b in zip(pct, pct[1:])] + [f">={pct[-1]}"]
    return ("no change",) + tuple(inner)


@dataclass(frozen=True)
class Allocation:
    stratum: tuple
    size: int        # items of this stratum in the population
    sampled: int     # items of it drawn


def allocate(sizes: dict[tuple, int], n: int, rng: np.random.Generator) -> dict[tuple, int]:
    """Proportional allocation of ``n`` over strata (largest remainders), at least one per non-empty
    stratum when ``n`` allows, never more than a stratum holds."""
    strata = sorted(k for k, v in sizes.items() if v > 0)
    total = sum(sizes[k] for k in strata)
    n = min(n, total)
    if n <= 0 or not strata:
        return {k: 0 for k in strata}
    floor_one = n >= len(strata)
    quota = {k: n * sizes[k] / total for k in strata}
    alloc = {k: min(sizes[k], max(int(quota[k]), 1 if floor_one else 0)) for k in strata}
    # Hand out (or take back) the rest by largest remainder; the random key breaks ties reproducibly.
    tiebreak = dict(zip(strata, rng.random(len(strata))))
    while sum(alloc.values()) < n:
        open_ = [k for k in strata if alloc[k] < sizes[k]]
        k = max(open_, key=lambda s: (quota[s] - alloc[s], tiebreak[s]))
        alloc[k] += 1
    while sum(alloc.values()) > n:
        shrink = [k for k in strata if alloc[k] > (1 if floor_one else 0)]
        k = min(shrink, key=lambda s: (quota[s] - alloc[s], tiebreak[s]))
        alloc[k] -= 1
    return alloc


def stratified_sample(strata: list[tuple], n: int, seed: int = 0) -> tuple[np.ndarray, dict[tuple, Allocation]]:
    """Indices (sorted) of ``n`` items drawn without replacement, stratified by ``strata[i]`` (one
    hashable key per item), and the allocation per stratum. The same inputs and seed give the same
    sample."""
    rng = np.random.default_rng(seed)
    members: dict[tuple, list[int]] = {}
    for i, key in enumerate(strata):
        members.setdefault(tuple(key), []).append(i)
    alloc = allocate({k: len(v) for k, v in members.items()}, n, rng)
    chosen: list[int] = []
    for k in sorted(members):
        if alloc.get(k, 0):
            chosen.extend(rng.choice(members[k], size=alloc[k], replace=False).tolist())
    info = {k: Allocation(k, len(members[k]), alloc.get(k, 0)) for k in members}
    return np.array(sorted(chosen), dtype=np.int64), info
