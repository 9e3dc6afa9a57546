"""Train/val/test assignment by location, never by slice.

Neighbouring crops of one place overlap (3000 px slices at stride 1024) and look alike, so a split
by slice would leak test scenery into training. A location's split is drawn from a hash of its id
and the seed, cut by cumulative fractions (paper: 70/10/20): stable when a rerun or a later chunk
adds locations. With very few locations the small splits can be empty; that is reported, never
papered over by splitting a location.
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Sequence

from operators.io.validation import fractions_problem

SPLITS = ("train", "val", "test")


def parse_fractions(text: str | Sequence[float]) -> tuple[float, float, float]:
    """train,val,test fractions: three non-negative numbers summing to 1 (within 1e-6), else ValueError.
    The command line refuses the same values before any work (the same rule, ``"fractions": 3``)."""
    problem = fractions_problem(text, 3)
    if problem:
        raise ValueError(f"split fractions {text!r}: {problem}")
    values = [float(v) for v in (text.split(",") if isinstance(text, str) else text)]
    total = sum(values)
    # Only rounding is left to divide out, so the recorded fractions and the draw are as before.
    return tuple(v / total for v in values)  # type: ignore[return-value]


def split_of(location: str, fractions: Sequence[float] = (0.7, 0.1, 0.2), seed: int = 0) -> str:
    """A location's split: a pure function of its id, the fractions and the seed.

    A hash of (seed, location) is read as a number u in [0, 1) and cut by cumulative fractions, so
    a location keeps its split whatever other locations a run sees (fractions hold in expectation;
    with few locations the realised shares can differ, and a lone location can be in any split).
    """
    digest = hashlib.sha256(f"{seed}\x00{location}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2 ** 64
    total = sum(fractions)
    edge = 0.0
    for split, f in zip(SPLITS, fractions):
        edge += f / total
        if u < edge:
            return split
    return SPLITS[-1]


def assign_splits(locations: Iterable[str], fractions: Sequence[float] = (0.7, 0.1, 0.2),
                  seed: int = 0) -> dict[str, str]:
    """Location -> split, each by :func:`split_of` (independent of the other locations)."""
    return {loc: split_of(loc, fractions, seed) for loc in set(locations)}


def split_conflicts(planned: dict[str, str], recorded: dict[str, str]) -> dict[str, tuple[str, str]]:
    """{location: (recorded split, planned split)} where this run would contradict the output."""
    return {loc: (recorded[loc], s) for loc, s in planned.items()
            if loc in recorded and recorded[loc] != s}


def list_files(accepted: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """{split: sorted ['<slice_id>.png', ...]} as LEVIR-CD-style loaders read ``list/<split>.txt``."""
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for slice_id, split in accepted:
        out.setdefault(split, []).append(f"{slice_id}.png")
    return {k: sorted(v) for k, v in out.items()}
