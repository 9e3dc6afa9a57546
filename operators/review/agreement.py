"""Interval and agreement statistics for the human review (plain numbers in, plain numbers out)."""
from __future__ import annotations

import math

import numpy as np


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927). Unlike the normal approximation it
    stays inside [0, 1] and is sensible at 0 or n successes and for small n, which is exactly the
    situation of a review sample. ``(nan, nan)`` for n = 0."""
    if n <= 0:
        return (math.nan, math.nan)
    if not 0 <= successes <= n:
        raise ValueError(f"successes {successes} outside 0..{n}")
    z = _z(confidence)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # At 0 or n successes the bound is exactly 0 or 1; rounding would leave 1e-17 there.
    lower = 0.0 if successes == 0 else max(0.0, centre - half)
    upper = 1.0 if successes == n else min(1.0, centre + half)
    return (lower, upper)


def _z(confidence: float) -> float:
    """Two-sided standard normal quantile (1.959964 for 95 %), via the inverse error function."""
    from statistics import NormalDist
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def cohens_kappa(a, b) -> float:
    """Cohen's kappa between two raters' labels for the same items (any hashable labels).

    ``nan`` when there are no items or chance agreement is 1 (both raters used one and the same label
    throughout: agreement is then undefined, not perfect)."""
    a, b = np.asarray(list(a), dtype=object), np.asarray(list(b), dtype=object)
    if a.shape != b.shape:
        raise ValueError("both raters must label the same items")
    n = len(a)
    if n == 0:
        return math.nan
    labels = sorted(set(a.tolist()) | set(b.tolist()), key=str)
    observed = float(np.mean(a == b))
    expected = sum(float(np.mean(a == lab)) * float(np.mean(b == lab)) for lab in labels)
    if expected >= 1.0:
        return math.nan
    return (observed - expected) / (1.0 - expected)
