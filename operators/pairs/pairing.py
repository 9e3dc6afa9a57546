"""Bitemporal pair selection (S2Looking §2.2): same location, footprint IoU > 0.7, more than a
year apart, both within the last 10 years of a reference date.

Every candidate pair within a location is returned with a status, so a rejected pair is recorded
with its reason rather than silently dropped. Footprints are compared in one CRS (the earlier
scene's), with bounds reprojected densely so UTM-to-geographic pairs are measured fairly.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import itertools
from dataclasses import dataclass, field

import pyarrow as pa
from rasterio.warp import transform_bounds

PAIRS_SCHEMA = pa.schema([
    ("pair_id", pa.string()), ("location", pa.string()),
    ("pre_scene", pa.string()), ("post_scene", pa.string()),
    ("pre_uri", pa.string()), ("post_uri", pa.string()),
    ("pre_date", pa.string()), ("post_date", pa.string()),
    ("gap_days", pa.int64()), ("iou", pa.float64()),
    ("status", pa.string()), ("reason", pa.string()),
])


@dataclass(frozen=True)
class PairingConfig:
    min_iou: float = field(default=0.7, metadata={"help": "footprint IoU a pair must exceed (paper: 0.7)"})
    min_gap_days: int = field(default=365, metadata={"help": "days the two dates must be more than apart (paper: 1 year)"})
    lookback_years: float = field(default=10.0, metadata={"help": "both dates within this many years before the reference date (paper: 10)"})
    reference_date: str | None = field(default=None, metadata={"help": "ISO date the lookback counts back from (default: today)"})

    def reference(self) -> dt.date:
        return dt.date.fromisoformat(self.reference_date) if self.reference_date else dt.date.today()


def footprint(scene: dict, crs: str) -> tuple[float, float, float, float]:
    left, bottom, right, top = scene["bounds"]
    if scene["crs"] == crs:
        return left, bottom, right, top
    return tuple(transform_bounds(scene["crs"], crs, left, bottom, right, top, densify_pts=21))


def box_iou(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def footprint_iou(a: dict, b: dict) -> float:
    """IoU of two scenes' footprints in the first scene's CRS (0 when reprojection fails)."""
    try:
        return box_iou(footprint(a, a["crs"]), footprint(b, a["crs"]))
    except Exception:  # noqa: BLE001 - e.g. bounds outside the target CRS's domain
        return 0.0


def group_by_location(scenes: list[dict]) -> dict[str, list[dict]]:
    """Manifest locations where given; the rest grouped by overlapping footprints (union-find).

    A group without a manifest name is named after its earliest scene, which is stable across reruns.
    """
    groups: dict[str, list[dict]] = {}
    unnamed = [s for s in scenes if not s.get("location")]
    for s in scenes:
        if s.get("location"):
            groups.setdefault(str(s["location"]), []).append(s)
    parent = list(range(len(unnamed)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in itertools.combinations(range(len(unnamed)), 2):
        if footprint_iou(unnamed[i], unnamed[j]) > 0.0:
            parent[find(i)] = find(j)
    clusters: dict[int, list[dict]] = {}
    for i, s in enumerate(unnamed):
        clusters.setdefault(find(i), []).append(s)
    for members in clusters.values():
        first = min(members, key=lambda s: (s["acquired"], s["scene_id"]))
        groups[f"loc-{first['scene_id']}"] = members
    return groups


def pair_id_for(location: str, pre: dict, post: dict) -> str:
    digest = hashlib.sha1(f"{pre['uri']}|{post['uri']}".encode()).hexdigest()[:8]
    return f"{pre['acquired'].replace('-', '')}_{post['acquired'].replace('-', '')}_{digest}"


def judge_pair(pre: dict, post: dict, cfg: PairingConfig) -> tuple[str, str | None, int, float]:
    """(status, reason, gap_days, iou) for one candidate; ``pre`` is the earlier scene."""
    reference = cfg.reference()
    earliest = reference - dt.timedelta(days=round(cfg.lookback_years * 365.25))
    d0, d1 = dt.date.fromisoformat(pre["acquired"]), dt.date.fromisoformat(post["acquired"])
    gap = (d1 - d0).days
    iou = footprint_iou(pre, post)
    if d1 > reference:
        return "rejected", f"post date {d1} is after the reference date {reference}", gap, iou
    if d0 < earliest:
        return "rejected", (f"pre date {d0} is older than {cfg.lookback_years:g} years before "
                            f"{reference} (earliest {earliest})"), gap, iou
    if gap <= cfg.min_gap_days:
        return "rejected", f"dates only {gap} days apart (need more than {cfg.min_gap_days})", gap, iou
    if iou <= cfg.min_iou:
        extra = "" if pre["crs"] == post["crs"] else f" (CRS {pre['crs']} vs {post['crs']})"
        return "rejected", f"footprint IoU {iou:.3f} not above {cfg.min_iou}{extra}", gap, iou
    return "accepted", None, gap, iou


def select_pairs(scenes: list[dict], cfg: PairingConfig) -> list[dict]:
    """All candidate pairs per location, each accepted or rejected with its reason."""
    out = []
    for location, members in sorted(group_by_location(scenes).items()):
        members = sorted(members, key=lambda s: (s["acquired"], s["scene_id"]))
        for pre, post in itertools.combinations(members, 2):
            status, reason, gap, iou = judge_pair(pre, post, cfg)
            out.append({
                "pair_id": pair_id_for(location, pre, post), "location": location,
                "pre_scene": pre["scene_id"], "post_scene": post["scene_id"],
                "pre_uri": pre["uri"], "post_uri": post["uri"],
                "pre_date": pre["acquired"], "post_date": post["acquired"],
                "gap_days": gap, "iou": round(iou, 6), "status": status, "reason": reason,
            })
    return out


def lonely_scenes(scenes: list[dict]) -> list[dict]:
    """Scenes that share their location with no other scene: they can never form a pair."""
    return [m[0] for m in group_by_location(scenes).values() if len(m) == 1]
