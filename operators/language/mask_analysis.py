"""Change-mask analysis (pure numpy/OpenCV, no LLM): binarization, change area ratio (CAR), where the
change is on a 3x3 grid in words, and how many separate changed components there are.

The words feed the captioning prompt as spatial metadata (JL1-CC, section II-B2: "a textual
description of the primary change region, e.g. 'upper-left area of the image'").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import cv2
import numpy as np

GRID_NAMES = (("upper-left", "upper", "upper-right"),
              ("left", "center", "right"),
              ("lower-left", "lower", "lower-right"))


@dataclass(frozen=True)
class MaskAnalysisConfig:
    min_component_px: int = 10      # components smaller than this are speckle, not a change
    main_share: float = 0.6         # one cell holding this share of the change is "the" region
    region_share: float = 0.15      # cells holding at least this share are named
    max_named_regions: int = 3      # more significant cells than this reads as "scattered"
    widespread_car: float = 0.6     # CAR above this is "most of the image"


@dataclass
class MaskStats:
    height: int
    width: int
    changed_pixels: int
    car: float                          # changed pixels / all pixels, 0..1
    components: int                     # 8-connected changed regions >= min_component_px
    region: str                         # e.g. "upper-left area of the image"
    cell_shares: list[float] = field(default_factory=list)  # 3x3 row-major share of the change


def binarize_mask(mask: np.ndarray) -> np.ndarray:
    """Boolean change mask from whatever a label PNG holds: 0/1, 0/255, stray greys, RGB(A), 16-bit.

    Colour is converted to grey first; any non-zero grey is change, which is right for 0/1 and 0/255 masks and keeps anti-aliased edges."""
    m = np.asarray(mask)
    if m.ndim == 3:
        # Grey as the brightest colour channel: unlike a weighted sum it cannot round a faint 0/1
        # colour label to 0. Alpha is dropped: it is transparency, not change.
        m = m[:, :, :3].max(axis=2) if m.shape[2] >= 3 else m[:, :, 0]
    if m.ndim != 2:
        raise ValueError(f"mask has unexpected shape {mask.shape}")
    return m > 0


def grid_shares(mask: np.ndarray) -> np.ndarray:
    """3x3 array: fraction of all changed pixels that falls in each cell (zeros when nothing changed)."""
    h, w = mask.shape
    rows = np.linspace(0, h, 4).round().astype(int)
    cols = np.linspace(0, w, 4).round().astype(int)
    counts = np.array([[mask[rows[i]:rows[i + 1], cols[j]:cols[j + 1]].sum() for j in range(3)]
                       for i in range(3)], dtype=np.float64)
    total = counts.sum()
    return counts / total if total else counts


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def describe_region(shares: np.ndarray, car: float, components: int,
                    cfg: MaskAnalysisConfig = MaskAnalysisConfig()) -> str:
    if car == 0 or shares.sum() == 0:
        return "no change"
    if car >= cfg.widespread_car:
        return "most of the image"
    flat = shares.ravel()
    # Largest share first; (near-)equal shares in reading order, so descriptions are stable.
    order = sorted(range(9), key=lambda i: (-round(float(flat[i]), 3), i))
    top = order[0]
    if shares.ravel()[top] >= cfg.main_share:
        return f"{GRID_NAMES[top // 3][top % 3]} area of the image"
    named = [i for i in order if shares.ravel()[i] >= cfg.region_share]
    if len(named) == 1:
        top_name = GRID_NAMES[top // 3][top % 3]
        return f"mainly the {top_name} area of the image, with smaller changes elsewhere"
    if named and len(named) <= cfg.max_named_regions:
        return _join([GRID_NAMES[i // 3][i % 3] for i in named]) + " areas of the image"
    occupied = int((shares > 0.02).sum())
    if components >= 2 and occupied >= 5:
        return "scattered across the image"
    return "spread over several parts of the image"


def analyze_mask(mask: np.ndarray, cfg: MaskAnalysisConfig = MaskAnalysisConfig()) -> MaskStats:
    """Stats of a boolean (or raw) change mask."""
    m = mask if mask.dtype == bool else binarize_mask(mask)
    h, w = m.shape
    changed = int(m.sum())
    car = changed / float(h * w) if h * w else 0.0
    components = 0
    if changed:
        n, _, stats, _ = cv2.connectedComponentsWithStats(m.astype(np.uint8), connectivity=8)
        areas = stats[1:, cv2.CC_STAT_AREA]
        components = int((areas >= cfg.min_component_px).sum())
        if components == 0:  # only speckle: still a change, but tiny
            components = int(len(areas))
    shares = grid_shares(m)
    return MaskStats(height=h, width=w, changed_pixels=changed, car=car, components=components,
                     region=describe_region(shares, car, components, cfg),
                     cell_shares=[round(float(s), 4) for s in shares.ravel()])
