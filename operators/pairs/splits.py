"""Train/val/test assignment by location, never by slice.

Neighbouring crops of one place overlap (3000 px slices at stride 1024) and look alike, so a split
by slice would leak test scenery into training. Locations are shuffled with a seeded RNG and cut by
cumulative fractions (paper: 70/10/20). With very few locations the small splits can be empty; that
is reported, never papered over by splitting a location.
"""
from __future__ import annotations

import hashlib
import random
from typing import Iterable, Sequence

SPLITS = ("train", "val", "test")


def parse_fractions(text: str | Sequence[float]) -> tuple[float, float, float]:
    values = [float(v) for v in (text.split(",") if isinstance(text, str) else text)]
    if len(values) != 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"split fractions must be three non-negative numbers, got {text!r}")
    total = sum(values)
    return tuple(v / total for v in values)  # type: ignore[return-value]


def assign_splits(locations: Iterable[str], fractions: Sequence[float] = (0.7, 0.1, 0.2),
                  seed: int = 0) -> dict[str, str]:
    """Location -> split. Deterministic for a given set of locations, fractions and seed."""
    # Sort by a hash first so the order does not depend on how names happen to sort.
    locs = sorted(set(locations), key=lambda s: hashlib.sha1(s.encode()).hexdigest())
    rng = random.Random(seed)
    rng.shuffle(locs)
    n = len(locs)
    cut_train = round(fractions[0] * n)
    cut_val = cut_train + round(fractions[1] * n)
    out = {}
    for i, loc in enumerate(locs):
        out[loc] = "train" if i < cut_train else "val" if i < cut_val else "test"
    return out


def list_files(accepted: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """{split: sorted ['<slice_id>.png', ...]} as LEVIR-CD-style loaders read ``list/<split>.txt``."""
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for slice_id, split in accepted:
        out.setdefault(split, []).append(f"{slice_id}.png")
    return {k: sorted(v) for k, v in out.items()}
