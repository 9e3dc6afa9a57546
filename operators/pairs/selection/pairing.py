"""Bitemporal pair selection (S2Looking §2.2): same place, footprint IoU > 0.7, more than a
year apart, both within the last 10 years of a reference date.

Candidates: scenes sharing a manifest location (every pair of them), or, without one, scenes
covering the same place by the pair rule itself (IoU above the threshold), found through a spatial
index so the work grows with the archive, not its square, and nothing chains: a tile never joins
its neighbour's neighbour. Every candidate is returned with a status, so a rejected pair is
recorded with its reason. Footprints are compared in one CRS (the earlier scene's), with bounds
reprojected densely so UTM-to-geographic pairs are measured fairly.

Locations (the unit of the train/val/test split) are a pure function of the place: the manifest
name, else the fixed lon/lat cell holding the earlier scene's centre. Which other scenes a run
sees never renames a location.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import cv2
import numpy as np
import pyarrow as pa
from rasterio.warp import transform, transform_bounds

PAIRS_SCHEMA = pa.schema([
    ("pair_id", pa.string()), ("location", pa.string()),
    ("pre_scene", pa.string()), ("post_scene", pa.string()),
    ("pre_uri", pa.string()), ("post_uri", pa.string()),
    ("pre_date", pa.string()), ("post_date", pa.string()),
    ("gap_days", pa.int64()), ("iou", pa.float64()),
    ("status", pa.string()), ("reason", pa.string()),
    ("reference_date", pa.string()),  # the date the lookback was counted back from in this run
])


@dataclass(frozen=True)
class PairingConfig:
    min_iou: float = field(default=0.7, metadata={"range": (0, 1), "help": "footprint IoU a pair must exceed (paper: 0.7)"})
    min_gap_days: int = field(default=365, metadata={"min": 0, "help": "days the two dates must be more than apart (paper: 1 year)"})
    lookback_years: float = field(default=10.0, metadata={"gt": 0, "help": "both dates within this many years before the reference date (paper: 10)"})
    reference_date: str | None = field(default=None, metadata={"date": True, "help": "ISO date the lookback counts back from (default: today; the date used is recorded in pairs/ and runs/)"})
    location_cell_deg: float = field(default=0.1, metadata={"gt": 0, "help": "scenes without a manifest location are placed in fixed lon/lat cells of this size (degrees); a location, and its split, is the cell of the earlier scene's centre. Use cells larger than your scenes"})

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


def footprint_polygon(scene: dict, crs: str) -> np.ndarray:
    """(N, 2) convex footprint of a scene in ``crs``: the convex hull of its STAC geometry (lon/lat
    GeoJSON; an orbit's sliver of a tile, not the tile) when it has one, else its bounds."""
    geometry = scene.get("geometry")
    if geometry:
        geo = json.loads(geometry) if isinstance(geometry, str) else geometry
        rings = {"Polygon": lambda c: [c[0]],                  # exterior rings only
                 "MultiPolygon": lambda c: [p[0] for p in c]}.get(geo["type"], lambda c: [])(
                     geo["coordinates"])
        pts = [pt[:2] for ring in rings for pt in ring]
        if pts:
            xs, ys = transform("EPSG:4326", crs, [p[0] for p in pts], [p[1] for p in pts])
            hull = cv2.convexHull(np.asarray(list(zip(xs, ys)), np.float32))
            return hull.reshape(-1, 2)
    left, bottom, right, top = footprint(scene, crs)
    return np.array([[left, bottom], [right, bottom], [right, top], [left, top]], np.float32)


def polygon_iou(a: np.ndarray, b: np.ndarray) -> float:
    """IoU of two convex polygons (N, 2)."""
    # Areas in a local frame: float32 loses the metres of UTM eastings/northings otherwise.
    origin = np.minimum(a.min(axis=0), b.min(axis=0)).astype(np.float64)
    a = (a.astype(np.float64) - origin).astype(np.float32)
    b = (b.astype(np.float64) - origin).astype(np.float32)
    inter, _ = cv2.intersectConvexConvex(a, b)
    union = cv2.contourArea(a) + cv2.contourArea(b) - inter
    return float(inter / union) if union > 0 else 0.0


def footprint_iou(a: dict, b: dict) -> float:
    """IoU of two scenes' footprints in the first scene's CRS (0 when reprojection fails): their
    STAC geometries when they have them (two orbits' slivers of one Sentinel-2 tile share the
    tile's bounds, not its pixels), else their bounds."""
    try:
        if a.get("geometry") or b.get("geometry"):
            return polygon_iou(footprint_polygon(a, a["crs"]), footprint_polygon(b, a["crs"]))
        return box_iou(footprint(a, a["crs"]), footprint(b, a["crs"]))
    except Exception:  # noqa: BLE001 - e.g. bounds outside the target CRS's domain
        return 0.0


# -- where scenes are: lon/lat boxes, fixed cells, a spatial index ---------------------------
def lonlat_boxes(scenes: Sequence[dict]) -> np.ndarray:
    """(n, 4) lon/lat boxes (west, south, east, north) of the scenes' footprints, for indexing.

    One vectorised reprojection per CRS of each box's corners and edge midpoints, padded by 1 %
    (edges curve under reprojection): a prefilter only, the pair rule is judged in a scene's CRS.
    Scenes whose bounds cannot be reprojected get NaN and are never candidates.
    """
    out = np.full((len(scenes), 4), np.nan)
    by_crs: dict[str, list[int]] = {}
    for i, s in enumerate(scenes):
        by_crs.setdefault(str(s["crs"]), []).append(i)
    t = np.linspace(0.0, 1.0, 3)
    for crs, idx in by_crs.items():
        b = np.array([scenes[i]["bounds"] for i in idx], float)  # left, bottom, right, top
        fx = np.concatenate([t, t, np.zeros(3), np.ones(3)])
        fy = np.concatenate([np.zeros(3), np.ones(3), t, t])
        xs = b[:, [0]] + fx[None] * (b[:, [2]] - b[:, [0]])
        ys = b[:, [1]] + fy[None] * (b[:, [3]] - b[:, [1]])
        try:
            if crs == "EPSG:4326":
                lon, lat = xs, ys
            else:
                lon, lat = (np.asarray(v).reshape(xs.shape) for v in
                            transform(crs, "EPSG:4326", xs.ravel(), ys.ravel()))
        except Exception:  # noqa: BLE001 - an unusable CRS: these scenes pair with nothing
            continue
        box = np.stack([lon.min(1), lat.min(1), lon.max(1), lat.max(1)], 1)
        pad = 0.01 * np.maximum(box[:, 2] - box[:, 0], box[:, 3] - box[:, 1])[:, None]
        box = np.where(np.isfinite(box), box + pad * np.array([-1, -1, 1, 1]), np.nan)
        out[idx] = box
    return out


def overlapping_pairs(boxes: np.ndarray) -> list[tuple[int, int]]:
    """Index pairs (i < j) whose boxes intersect: a uniform grid hash, O(n x neighbours), not n^2.

    Each box is entered in every cell it touches (cells about twice the median box); a pair is
    reported only by the cell holding the lower-left corner of its intersection, so once.
    """
    ok = np.flatnonzero(np.isfinite(boxes).all(1))
    if len(ok) < 2:
        return []
    b = boxes[ok]
    size = 2.0 * float(np.median(np.maximum(b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]))) or 1e-9
    c0 = np.floor(b[:, :2] / size).astype(np.int64)
    c1 = np.floor(b[:, 2:] / size).astype(np.int64)
    ncell = (c1 - c0 + 1).prod(1)
    member = np.repeat(np.arange(len(b)), ncell)
    cx = np.concatenate([np.repeat(np.arange(c0[i, 0], c1[i, 0] + 1), c1[i, 1] - c0[i, 1] + 1)
                         for i in range(len(b))])
    cy = np.concatenate([np.tile(np.arange(c0[i, 1], c1[i, 1] + 1), c1[i, 0] - c0[i, 0] + 1)
                         for i in range(len(b))])
    order = np.lexsort((member, cy, cx))
    member, cx, cy = member[order], cx[order], cy[order]
    starts = np.flatnonzero(np.r_[True, (np.diff(cx) != 0) | (np.diff(cy) != 0)])
    ends = np.r_[starts[1:], len(member)]
    out: list[tuple[int, int]] = []
    for s, e in zip(starts, ends):
        if e - s < 2:
            continue
        m = member[s:e]
        bb = b[m]
        i, j = np.triu_indices(len(m), 1)
        x0 = np.maximum(bb[i, 0], bb[j, 0])
        y0 = np.maximum(bb[i, 1], bb[j, 1])
        hit = ((x0 < np.minimum(bb[i, 2], bb[j, 2])) & (y0 < np.minimum(bb[i, 3], bb[j, 3]))
               & (np.floor(x0 / size) == cx[s]) & (np.floor(y0 / size) == cy[s]))
        out.extend(zip(ok[m[i[hit]]].tolist(), ok[m[j[hit]]].tolist()))
    return out


def cell_location(lon: float, lat: float, cell_deg: float) -> str:
    """The fixed geographic cell holding (lon, lat): a pure function of the place."""
    iy, ix = math.floor(lat / cell_deg), math.floor(lon / cell_deg)
    south, west = round(iy * cell_deg, 6), round(ix * cell_deg, 6)
    return (f"cell{cell_deg:g}-{'N' if south >= 0 else 'S'}{abs(south):07.4f}"
            f"-{'E' if west >= 0 else 'W'}{abs(west):08.4f}")


def scene_locations(scenes: Sequence[dict], cell_deg: float, boxes: np.ndarray | None = None) -> list[str | None]:
    """Each scene's location: its manifest name, else the fixed cell of its footprint's centre.

    Never depends on which other scenes a run sees, so ids (and the splits drawn from them) are
    stable across reruns and chunks. None when the footprint cannot be placed on the globe.
    """
    boxes = lonlat_boxes(scenes) if boxes is None else boxes
    out = []
    for s, b in zip(scenes, boxes):
        if s.get("location"):
            out.append(str(s["location"]))
        elif np.isfinite(b).all():
            out.append(cell_location((b[0] + b[2]) / 2, (b[1] + b[3]) / 2, cell_deg))
        else:
            out.append(None)
    return out


def group_by_location(scenes: list[dict], cell_deg: float = 0.1) -> dict[str, list[dict]]:
    """Scenes by location (manifest name, else fixed geographic cell); never chains."""
    groups: dict[str, list[dict]] = {}
    for s, loc in zip(scenes, scene_locations(scenes, cell_deg)):
        groups.setdefault(loc or f"unplaced-{s['scene_id']}", []).append(s)
    return groups


def candidate_pairs(scenes: Sequence[dict], cfg: "PairingConfig") -> list[tuple[int, int]]:
    """Index pairs (earlier, later) that are candidates for the pair rule.

    Scenes with a manifest location: every pair within that location (rejections recorded with
    their reason, as the user grouped them). Other scenes: pairs that cover the same place by the
    pair rule itself (footprint IoU above ``min_iou``), found through a spatial index, so a tile
    never joins its neighbour, let alone its neighbour's neighbour.
    """
    order = sorted(range(len(scenes)), key=lambda i: (scenes[i]["acquired"], scenes[i]["scene_id"]))
    rank = {i: r for r, i in enumerate(order)}
    out: list[tuple[int, int]] = []
    named: dict[str, list[int]] = {}
    unnamed = []
    for i, s in enumerate(scenes):
        (named.setdefault(str(s["location"]), []) if s.get("location") else unnamed).append(i)
    for members in named.values():
        members.sort(key=rank.get)
        out.extend(itertools.combinations(members, 2))
    sub = [scenes[i] for i in unnamed]
    boxes = lonlat_boxes(sub)
    cache: dict[tuple[int, str], tuple] = {}

    def in_crs(i: int, crs: str):  # a scene meets many candidates in one other CRS: reproject once
        if (i, crs) not in cache:
            cache[(i, crs)] = footprint(scenes[i], crs)
        return cache[(i, crs)]

    for a, b in overlapping_pairs(boxes):
        # Boxes overlapping by little (neighbouring tiles) are not the same place in any CRS: the
        # exact test (a reprojection when CRSs differ) is kept for plausible candidates.
        if box_iou(boxes[a], boxes[b]) <= cfg.min_iou / 2:
            continue
        i, j = sorted((unnamed[a], unnamed[b]), key=rank.get)
        crs = scenes[i]["crs"]
        if scenes[i].get("geometry") or scenes[j].get("geometry"):
            iou = footprint_iou(scenes[i], scenes[j])
        else:
            try:
                iou = box_iou(in_crs(i, crs), in_crs(j, crs))
            except Exception:  # noqa: BLE001 - as footprint_iou: bounds outside the CRS's domain
                iou = 0.0
        if iou > cfg.min_iou:
            out.append((i, j))
    return sorted(out, key=lambda p: (rank[p[0]], rank[p[1]]))


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


def select_pairs(scenes: list[dict], cfg: PairingConfig, new: Iterable[str] | None = None) -> list[dict]:
    """Every candidate pair, accepted or rejected with its reason.

    A pair's location is its earlier scene's (see :func:`scene_locations`). With ``new`` (scene
    ids), only pairs involving at least one of those scenes are returned: an incremental run pairs
    its scenes with scenes an earlier run catalogued without judging old pairs again.
    """
    boxes = lonlat_boxes(scenes)
    locs = scene_locations(scenes, cfg.location_cell_deg, boxes)
    new = set(new) if new is not None else None
    reference = cfg.reference().isoformat()
    out = []
    for i, j in candidate_pairs(scenes, cfg):
        pre, post = scenes[i], scenes[j]
        if new is not None and pre["scene_id"] not in new and post["scene_id"] not in new:
            continue
        status, reason, gap, iou = judge_pair(pre, post, cfg)
        location = locs[i] or f"unplaced-{pre['scene_id']}"
        out.append({
            "pair_id": pair_id_for(location, pre, post), "location": location,
            "pre_scene": pre["scene_id"], "post_scene": post["scene_id"],
            "pre_uri": pre["uri"], "post_uri": post["uri"],
            "pre_date": pre["acquired"], "post_date": post["acquired"],
            "gap_days": gap, "iou": round(iou, 6), "status": status, "reason": reason,
            "reference_date": reference,
        })
    return out


def lonely_scenes(scenes: list[dict], pairs: list[dict]) -> list[dict]:
    """Scenes that are in no candidate pair: nothing else covers their place, they cannot pair."""
    paired = {p["pre_scene"] for p in pairs} | {p["post_scene"] for p in pairs}
    return [s for s in scenes if s["scene_id"] not in paired]
