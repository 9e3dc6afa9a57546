"""Cloud masks: a scene-class or QA layer -> cloud/shadow/cirrus pixels; the cloud settings; the
pair filter on an item's cloud cover.

Two published layer kinds are understood, with these defaults (override with ``--cloud-classes`` /
``--cloud-bits``):

* ``scl`` - Sentinel-2 L2A Scene Classification (Sen2Cor). Classes: 0 no data, 1 saturated or
  defective, 2 dark area, 3 cloud shadow, 4 vegetation, 5 not vegetated, 6 water, 7 unclassified,
  8 cloud medium probability, 9 cloud high probability, 10 thin cirrus, 11 snow or ice. Cloud =
  **3, 8, 9, 10** (shadow, medium and high probability cloud, cirrus).
* ``qa_pixel`` - Landsat Collection 2 ``QA_PIXEL`` bit flags. Bit 0 fill, 1 dilated cloud,
  2 cirrus, 3 cloud, 4 cloud shadow, 5 snow, 6 clear, 7 water. Cloud = any of bits **1, 2, 3, 4**.

Masked pixels are invalid for SIFT's detection mask, the screening windows and the per-scene
stretch (they are still written in the PNGs: clouds are part of the image). A crop's cloud fraction
(pixels cloudy in either date) is a metadata column; ``--max-crop-cloud`` rejects above it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

KINDS = ("scl", "qa_pixel")
SCL_CLOUD_CLASSES = (3, 8, 9, 10)
QA_PIXEL_CLOUD_BITS = (1, 2, 3, 4)


@dataclass
class CloudConfig:
    """Cloud masking and cloud-cover filters."""

    cloud_mask: str = field(default="", metadata={"help": "asset key / band name of a cloud or scene-class layer (e.g. scl, qa_pixel): its cloud, shadow and cirrus pixels are invalid for SIFT, screening and the stretch"})
    cloud_mask_kind: str = field(default="auto", metadata={"help": "how to read --cloud-mask: scl (Sentinel-2 classes), qa_pixel (Landsat bit flags), auto (from its name)", "choices": ("auto",) + KINDS})
    cloud_classes: tuple[int, ...] = field(default=SCL_CLOUD_CLASSES, metadata={"help": "scl classes that count as cloud (3 shadow, 8/9 cloud medium/high, 10 cirrus)"})
    cloud_bits: tuple[int, ...] = field(default=QA_PIXEL_CLOUD_BITS, metadata={"help": "qa_pixel bits that count as cloud (1 dilated cloud, 2 cirrus, 3 cloud, 4 shadow)"})
    max_cloud_cover: float = field(default=100.0, metadata={"range": (0, 100), "help": "reject pairs with a scene whose catalogued cloud cover (STAC eo:cloud_cover, manifest cloud_cover) is above this percent, before any pixel is read"})
    max_crop_cloud: float = field(default=0.0, metadata={"range": (0, 1), "help": "reject a kept crop whose cloud-masked fraction (either date) is above this (0-1; with --cloud-mask)"})

    def __post_init__(self):
        if self.cloud_mask_kind not in ("auto",) + KINDS:
            raise ValueError(f"cloud_mask_kind must be auto or one of {KINDS}")
        if not 0.0 <= self.max_crop_cloud <= 1.0:
            raise ValueError("max_crop_cloud is a fraction in [0, 1]")

    def kind_for(self, name: str) -> str:
        """The layer kind of ``--cloud-mask`` (``auto``: by its asset key or band name)."""
        if self.cloud_mask_kind != "auto":
            return self.cloud_mask_kind
        low = str(name).lower()
        if "scl" in low or "scene_class" in low:
            return "scl"
        if "qa" in low:
            return "qa_pixel"
        raise ValueError(f"cannot tell what kind of cloud layer {name!r} is: give "
                         f"--cloud-mask-kind {' or '.join(KINDS)}")

    def values_for(self, kind: str) -> list[int]:
        return list(self.cloud_classes if kind == "scl" else self.cloud_bits)


def cloud_pixels(layer: np.ndarray, kind: str, values: Sequence[int]) -> np.ndarray:
    """Boolean cloud mask of a scene-class (``scl``: class values) or QA (``qa_pixel``: bits) layer."""
    layer = np.asarray(layer)
    if kind == "scl":
        return np.isin(layer, np.asarray(list(values), dtype=layer.dtype))
    if kind == "qa_pixel":
        bits = 0
        for b in values:
            bits |= 1 << int(b)
        return (layer.astype(np.uint64) & np.uint64(bits)) != 0
    raise ValueError(f"unknown cloud layer kind {kind!r} (one of {KINDS})")


def cloud_cover_reason(pre: dict, post: dict, max_cloud_cover: float) -> Optional[str]:
    """Why a pair fails ``--max-cloud-cover`` (None: it passes; unknown cover passes)."""
    parts = []
    for side, scene in (("pre", pre), ("post", post)):
        cover = scene.get("cloud_cover")
        if cover is not None and float(cover) > max_cloud_cover:
            parts.append(f"{side} scene cloud cover {float(cover):.1f}% > {max_cloud_cover:g}%")
    return "; ".join(parts) or None


def filter_pairs_by_cloud_cover(pairs: list[dict], scenes_by_id: dict[str, dict],
                                max_cloud_cover: float) -> int:
    """Reject (in place, with the reason) accepted pairs with a scene above the cloud cover limit.

    Runs on catalogue records only, so no pixel of a dropped scene is ever read. Returns how many
    pairs it rejected.
    """
    if max_cloud_cover >= 100.0:
        return 0
    n = 0
    for p in pairs:
        if p["status"] != "accepted":
            continue
        reason = cloud_cover_reason(scenes_by_id[p["pre_scene"]], scenes_by_id[p["post_scene"]],
                                    max_cloud_cover)
        if reason:
            p["status"], p["reason"] = "rejected", reason
            n += 1
    return n
