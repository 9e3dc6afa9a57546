"""Displacement fields with ground truth, over real texture: the cases screening is judged on.

One generator for the tests and ``benchmarks/screening_fields.py``. A case is a crop pair (pre,
post) cut from a real image (NAIP 2016 RGB as grey, or Sentinel-2 B08 over Zagreb; both in
``data/``), where the post date is the pre date moved by a known displacement field ``d``:
``post(q) = scene(q - d(q))`` (d on the post grid), so pre content near ``q - d`` sits at ``q``.
Every case knows its true largest ground displacement over the crop, corners included.

Families (``FAMILIES``), each drawn at any magnitude around the limit:

* ``patches``: 1-4 regions moved as a whole (convex, L-shaped, ring, random polygon), each at
  least ``MIN_REGION`` of the crop side across (the scale screening claims to see; smaller than
  that a region is a building), shifted 6-60 px (one direction for all patches half the time:
  what a lean looks like).
* ``smooth``: a tilt (affine), bowl, saddle or local rotation, its largest magnitude anywhere in
  the crop (often exactly at a corner) drawn between 4 and 16 px.
* ``periodic``: a region of repeated real texture (an orchard, a solar farm, a parking lot) of
  period 8-64 px, moved by a whole period together with its edges (or not moved: 0 px).
* ``lean``: registered ground, LEVIR-CD building footprints whose roofs lean one way by 3-30 px
  each (plain or textured roofs; the facade appears between base and roof, in either date).

Any case may carry, on top: clouds (given as unusable, as a cloud mask gives them) or a nodata
edge in either date, and real change (new buildings in the post date).

Truth: the largest |d| over the crop's pixels (smooth fields: every pixel, corners included; moved
regions: the moved pixels usable in both dates, since content no date shows can be no one's
misregistration). A ``lean`` case's ground is exact (truth 0) and its lean is recorded apart.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Optional

import cv2
import numpy as np

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data"
FAMILIES = ("patches", "smooth", "periodic", "lean")
MIN_REGION = 0.2          # a moved region's least extent, as a share of the crop side
SHAPES = ("convex", "L", "ring", "polygon")
SMOOTH_KINDS = ("tilt", "bowl", "saddle", "rotation")


@dataclass
class FieldCase:
    family: str
    kind: str                     # the family's variant (shape, field kind, roof kind)
    crop: int
    pre: np.ndarray               # (crop, crop) float32 grey in [0, 1]
    post: np.ndarray
    valid: np.ndarray             # usable in both dates (clouds and nodata given as unusable)
    truth_px: float               # largest true ground displacement over the crop
    lean_px: Optional[tuple[float, float]] = None   # (median, max) roof lean, lean cases
    lean_deg: Optional[float] = None
    params: dict = field(default_factory=dict)


# --- real texture -------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def texture(name: str) -> np.ndarray:
    """A real grey image in [0, 1] (1st-99th percentile stretch): ``naip`` (NAIP 2016, 934 x 723,
    RGB mean) or ``s2`` (Sentinel-2 B08, 2023-08-15, 915 x 915)."""
    import rasterio
    if name == "naip":
        with rasterio.open(DATA / "naip" / "m_4709963_se_14_1_20160816.tif") as src:
            img = src.read([1, 2, 3]).astype(np.float32).mean(axis=0)
    elif name == "s2":
        with rasterio.open(DATA / "s2-zagreb" / "20230815_B08.tif") as src:
            img = src.read(1).astype(np.float32)
    else:
        raise ValueError(f"unknown texture {name!r}: naip or s2")
    lo, hi = np.percentile(img[img > 0], [1, 99])
    return np.clip((img - lo) / max(hi - lo, 1e-6), 0, 1).astype(np.float32)


@lru_cache(maxsize=8)
def scene(name: str, crop: int) -> np.ndarray:
    """The texture enlarged (cubic) so a crop fits with 200 px to spare each way (room for its
    place to vary and for content moved in from outside), as the real-pair benchmark's 1024 px
    cases are made."""
    img = texture(name)
    f = max(1.0, (crop + 400) / min(img.shape))
    if f > 1.0:
        img = cv2.resize(img, None, fx=f, fy=f, interpolation=cv2.INTER_CUBIC)
    return np.ascontiguousarray(np.clip(img, 0, 1), np.float32)


@lru_cache(maxsize=None)
def footprints_pool() -> tuple:
    """LEVIR-CD building masks (256 px, 0.5 m) with real footprint shapes and spacing."""
    files = sorted((DATA / "levir-cd" / "label").glob("*.png"))
    masks = [cv2.imread(str(f), cv2.IMREAD_GRAYSCALE) > 0 for f in files]
    return tuple(m for m in masks if m.mean() > 0.05)


def footprints(size: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """A mosaic of LEVIR-CD footprint masks (flipped, rotated at random) covering ``size`` px,
    each 256 px mask (0.5 m) shown at ``scale`` x ``size / 1024`` of its size: at 1024 px, the
    paper's 0.5-0.8 m crops, buildings keep their size."""
    pool = footprints_pool()
    n = 2
    tiles = []
    for _ in range(n * n):
        m = np.rot90(pool[int(rng.integers(len(pool)))], int(rng.integers(4)))
        tiles.append(m[:, ::-1] if rng.random() < 0.5 else m)
    mosaic = np.block([[tiles[0], tiles[1]], [tiles[2], tiles[3]]]).astype(np.uint8)
    side = max(8, int(round(512 * scale * size / 1024)))
    out = cv2.resize(mosaic, (side, side), interpolation=cv2.INTER_NEAREST)
    if side < size:
        out = np.tile(out, (size // side + 1, size // side + 1))
    return out[:size, :size] > 0


# --- fields -------------------------------------------------------------------------------------

def _remap(src: np.ndarray, x0: int, y0: int, dx: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """post(q) = src(q + origin - d(q))."""
    h, w = dx.shape
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    return cv2.remap(src, (xx + x0 - dx).astype(np.float32), (yy + y0 - dy).astype(np.float32),
                     cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT)


def region_mask(shape: str, crop: int, rng: np.random.Generator) -> np.ndarray:
    """One region of the crop, at least ``MIN_REGION`` of the side across everywhere."""
    m = np.zeros((crop, crop), np.uint8)
    lo = int(np.ceil(MIN_REGION * crop))
    if shape == "convex":
        a, b = rng.integers(lo, int(0.5 * crop) + 1, size=2)
        cx, cy = rng.integers(a // 2, crop - a // 2), rng.integers(b // 2, crop - b // 2)
        if rng.random() < 0.5:
            m[cy - b // 2:cy + b // 2, cx - a // 2:cx + a // 2] = 1
        else:
            cv2.ellipse(m, (int(cx), int(cy)), (int(a // 2), int(b // 2)),
                        float(rng.uniform(0, 180)), 0, 360, 1, -1)
    elif shape == "L":
        t = int(rng.integers(lo, int(0.3 * crop) + 1))               # arm thickness
        L = int(rng.integers(2 * t, int(0.8 * crop) + 1))            # arm length
        x, y = int(rng.integers(0, crop - L + 1)), int(rng.integers(0, crop - L + 1))
        m[y:y + t, x:x + L] = 1
        m[y:y + L, x:x + t] = 1
        m = np.ascontiguousarray(np.rot90(m, int(rng.integers(4))))
    elif shape == "ring":
        t = int(rng.integers(lo, int(0.25 * crop) + 1))              # ring width
        outer = int(rng.integers(3 * t, int(0.95 * crop) + 1))
        x, y = int(rng.integers(0, crop - outer + 1)), int(rng.integers(0, crop - outer + 1))
        m[y:y + outer, x:x + outer] = 1
        m[y + t:y + outer - t, x + t:x + outer - t] = 0
    elif shape == "polygon":
        # A random star-shaped polygon, then opened by a disc of the least extent so that no
        # part of it is thinner than a region screening is meant to see.
        c = rng.uniform(0.3 * crop, 0.7 * crop, size=2)
        k = int(rng.integers(5, 10))
        ang = np.sort(rng.uniform(0, 2 * np.pi, k))
        rad = rng.uniform(lo * 0.8, 0.45 * crop, k)
        pts = np.stack([c[0] + rad * np.cos(ang), c[1] + rad * np.sin(ang)], 1).astype(np.int32)
        cv2.fillPoly(m, [pts], 1)
        # Opened at a quarter of the resolution (a disc of lo px costs seconds at full size).
        q = max(1, crop // 256)
        small = cv2.resize(m, (crop // q, crop // q), interpolation=cv2.INTER_NEAREST)
        disc = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (max(3, lo // q),) * 2)
        small = cv2.morphologyEx(small, cv2.MORPH_OPEN, disc)
        m = cv2.resize(small, (crop, crop), interpolation=cv2.INTER_NEAREST)
        if not m.any():
            return region_mask("convex", crop, rng)
    else:
        raise ValueError(shape)
    return m.astype(bool)


def _unit(rng: np.random.Generator) -> np.ndarray:
    a = rng.uniform(0, 2 * np.pi)
    return np.array([np.cos(a), np.sin(a)])


def smooth_field(kind: str, crop: int, peak: float, rng: np.random.Generator):
    """(dx, dy) of a smooth field over the crop whose largest |d| over its pixels is ``peak``."""
    yy, xx = np.mgrid[0:crop, 0:crop].astype(np.float64)
    # Where the field is zero (tilt, rotation) or centred (bowl, saddle): anywhere, a corner
    # often (the largest magnitude is then at the opposite corner, or at the corner itself).
    if rng.random() < 0.3:
        c = np.array([[0, 0], [crop - 1, 0], [0, crop - 1], [crop - 1, crop - 1]][rng.integers(4)],
                     float)
    else:
        c = rng.uniform(0, crop - 1, size=2)
    X, Y = (xx - c[0]) / crop, (yy - c[1]) / crop
    if kind == "tilt":
        A = rng.normal(size=(2, 2))
        dx, dy = A[0, 0] * X + A[0, 1] * Y, A[1, 0] * X + A[1, 1] * Y
    elif kind == "bowl":
        u = _unit(rng)
        r2 = X * X + Y * Y
        dx, dy = u[0] * r2, u[1] * r2
    elif kind == "saddle":
        u = _unit(rng)
        s = X * Y + rng.uniform(-0.3, 0.3) * (X * X - Y * Y)
        dx, dy = u[0] * s, u[1] * s
    elif kind == "rotation":
        th = rng.choice([-1, 1]) * 0.01
        dx = (np.cos(th) - 1) * X - np.sin(th) * Y
        dy = np.sin(th) * X + (np.cos(th) - 1) * Y
    else:
        raise ValueError(kind)
    mag = np.hypot(dx, dy)
    top = float(mag.max())
    if top < 1e-9:
        return np.zeros_like(dx, np.float32), np.zeros_like(dy, np.float32)
    s = peak / top
    return (dx * s).astype(np.float32), (dy * s).astype(np.float32)


def _periodic_tile(src: np.ndarray, x0: int, y0: int, px: int, py: int,
                   rng: np.random.Generator) -> np.ndarray:
    """A period cell of real texture with a distinct object in it (a tree, a panel, a car)."""
    cell = src[y0:y0 + py, x0:x0 + px].copy()
    r = max(2, min(px, py) // 3)
    obj = np.zeros_like(cell)
    cv2.circle(obj, (px // 2, py // 2), r, 1.0, -1) if rng.random() < 0.5 else \
        cv2.rectangle(obj, (px // 4, py // 4), (px - px // 4, py - py // 4), 1.0, -1)
    tone = float(rng.choice([0.1, 0.9]))
    return np.where(obj > 0, tone + 0.05 * (cell - cell.mean()), cell).astype(np.float32)


# --- overlays -----------------------------------------------------------------------------------

def _blobs(crop: int, rng: np.random.Generator, n: int, r_lo: float, r_hi: float) -> np.ndarray:
    m = np.zeros((crop, crop), np.uint8)
    for _ in range(n):
        c = rng.integers(0, crop, size=2)
        a, b = rng.uniform(r_lo, r_hi, size=2) * crop
        cv2.ellipse(m, (int(c[0]), int(c[1])), (int(a), int(b)), float(rng.uniform(0, 180)), 0,
                    360, 1, -1)
    return m.astype(bool)


def overlay(pre: np.ndarray, post: np.ndarray, valid: np.ndarray, rng: np.random.Generator,
            clouds: bool, nodata: bool, change: bool) -> dict:
    """Clouds (bright, given as unusable) or a nodata edge (0, unusable) in either date, and new
    buildings in the post date (real change: not misregistration, no mask says so)."""
    crop = pre.shape[0]
    info = {}
    if change:
        new = footprints(crop, rng, scale=float(rng.uniform(0.5, 1.2)))
        keep = _blobs(crop, rng, 1, 0.1, 0.25)
        new &= keep
        tone = float(rng.uniform(0.6, 0.95))
        post[new] = tone + 0.03 * rng.standard_normal(int(new.sum())).astype(np.float32)
        info["change_share"] = float(new.mean())
    if clouds:
        c = _blobs(crop, rng, int(rng.integers(1, 4)), 0.04, 0.15)
        img = pre if rng.random() < 0.5 else post
        img[c] = np.clip(0.95 + 0.02 * rng.standard_normal(int(c.sum())), 0, 1)
        valid &= ~c
        info["cloud_share"] = float(c.mean())
    if nodata:
        k = int(rng.uniform(0.05, 0.25) * crop)
        side = int(rng.integers(4))
        m = np.zeros((crop, crop), bool)
        yy, xx = np.mgrid[0:crop, 0:crop]
        # A wedge from one edge, as another orbit's swath edge leaves it.
        slope = rng.uniform(-0.3, 0.3)
        if side == 0:
            m = xx < k + slope * (yy - crop / 2)
        elif side == 1:
            m = xx > crop - k + slope * (yy - crop / 2)
        elif side == 2:
            m = yy < k + slope * (xx - crop / 2)
        else:
            m = yy > crop - k + slope * (xx - crop / 2)
        img = pre if rng.random() < 0.5 else post
        img[m] = 0.0
        valid &= ~m
        info["nodata_share"] = float(m.mean())
    return info


# --- cases --------------------------------------------------------------------------------------

def magnitude(rng: np.random.Generator, limit: float, lo: float, hi: float,
              regime: int) -> float:
    """A case's magnitude by its regime (drawn once per case, so all of a case's parts share it):
    0 under the limit less 2 px (where a reject is false), 1 within 3 px of the limit (where a
    screen errs), 2 over the limit plus 1 px (where an accept is false)."""
    if regime == 0:
        return float(rng.uniform(lo, max(lo, limit - 2)))
    if regime == 1:
        return float(rng.uniform(max(lo, limit - 3), min(hi, limit + 3)))
    return float(rng.uniform(min(hi, limit + 1), hi))


def make_case(family: str, crop: int, seed: int, limit: float = 8.0,
              source: Optional[str] = None, overlays: Optional[bool] = None,
              magnitude_px: Optional[float] = None, kind: Optional[str] = None) -> FieldCase:
    """One generated case (deterministic in its arguments). ``magnitude_px`` fixes the field's
    largest displacement (patches, smooth; the lean's largest roof for lean; for periodic, the
    period along x, the region moved by one period that way, or not moved with 0) instead of
    drawing it; ``kind`` fixes the family's variant."""
    rng = np.random.default_rng([seed, crop, FAMILIES.index(family)])
    source = source or ("s2" if rng.random() < 0.5 else "naip")
    src = scene(source, crop)
    H, W = src.shape
    x0 = int(rng.integers(70, W - crop - 70 + 1))
    y0 = int(rng.integers(70, H - crop - 70 + 1))
    pre = np.ascontiguousarray(src[y0:y0 + crop, x0:x0 + crop]).copy()
    valid = np.ones((crop, crop), bool)
    params: dict = {"source": source, "x0": x0, "y0": y0}
    regime = int(rng.integers(3))
    lean_px = lean_deg = None
    scale = crop / 1024.0
    if family == "patches":
        k = int(rng.integers(1, 5))
        kind = kind or str(rng.choice(SHAPES))
        same = rng.random() < 0.5
        u = _unit(rng)
        dx = np.zeros((crop, crop), np.float32)
        dy = np.zeros_like(dx)
        mags = []
        taken = np.zeros((crop, crop), np.uint8)
        for i in range(k):
            # Regions apart (a gap of 8 px): one drawn over another would leave it a sliver
            # thinner than the regions screening is meant to see. A region that finds no room
            # in 20 draws is left out.
            for _ in range(20):
                m = region_mask(kind if i == 0 else str(rng.choice(SHAPES)), crop, rng)
                if not (m & (taken > 0)).any():
                    break
            else:
                if i > 0:
                    continue
            taken = cv2.dilate((taken > 0).astype(np.uint8) | m.astype(np.uint8),
                               np.ones((17, 17), np.uint8))
            # At most the region's least extent: a region moved farther than its own width
            # leaves none of its content where it was, and screening, which looks for each pre
            # window in the post date, sees only duplicated ground (docs/registration.md).
            v = magnitude_px if (magnitude_px is not None and i == 0) else \
                magnitude(rng, limit, 6.0, min(60.0, MIN_REGION * crop), regime)
            if magnitude_px is not None and i > 0:
                v = min(v, magnitude_px)       # the fixed magnitude stays the case's largest
            d = u if same else _unit(rng)
            dx[m], dy[m] = v * d[0], v * d[1]
            mags.append(v)
        post = _remap(src, x0, y0, dx, dy)
        moved = np.hypot(dx, dy)
        params.update(k=len(mags), same_direction=bool(same), shifts=[round(v, 2) for v in mags])
        truth_field = moved
        smooth = False
    elif family == "smooth":
        kind = kind or str(rng.choice(SMOOTH_KINDS))
        peak = magnitude_px if magnitude_px is not None else \
            magnitude(rng, limit, 4.0, 16.0, regime)
        dx, dy = smooth_field(kind, crop, peak, rng)
        post = _remap(src, x0, y0, dx, dy)
        truth_field = np.hypot(dx, dy)
        smooth = True
        params.update(peak=round(peak, 2))
    elif family == "periodic":
        kind = kind or str(rng.choice(["orchard", "solar", "parking"]))
        lo, hi = max(8, int(8 * scale)), max(9, int(64 * scale))
        px = int(rng.integers(lo, hi + 1))
        py = px if kind == "orchard" else int(rng.integers(lo, hi + 1))
        if magnitude_px:
            px = int(round(magnitude_px))
            py = px if kind == "orchard" else py
        tile = _periodic_tile(src, x0, y0, px, py, rng)
        reg = region_mask("convex", crop, rng)
        big = np.tile(tile, (crop // py + 3, crop // px + 3))
        # The region's pattern, in scene coordinates (so a shift moves it with its edges).
        world = src.copy()
        sl = (slice(y0, y0 + crop), slice(x0, x0 + crop))
        world[sl] = np.where(reg, big[:crop, :crop], world[sl])
        pre = np.ascontiguousarray(world[sl]).copy()
        moved = rng.random() < 0.75
        axis = int(rng.integers(3)) if kind == "orchard" else int(rng.integers(2))
        v = np.array([px if axis in (0, 2) else 0, py if axis in (1, 2) else 0], float) \
            if moved else np.zeros(2)
        if magnitude_px is not None:
            v = np.array([float(px), 0.0]) if magnitude_px > 0 else np.zeros(2)
        # The region and a margin of ground round it move together (edges included).
        margin = cv2.dilate(reg.astype(np.uint8), np.ones((9, 9), np.uint8)) > 0
        target = np.zeros_like(margin)
        sx, sy = int(round(v[0])), int(round(v[1]))
        target[max(0, sy):crop + min(0, sy), max(0, sx):crop + min(0, sx)] = \
            margin[max(0, -sy):crop - max(0, sy), max(0, -sx):crop - max(0, sx)]
        target |= margin
        dx = np.where(target, v[0], 0).astype(np.float32)
        dy = np.where(target, v[1], 0).astype(np.float32)
        post = _remap(world, x0, y0, dx, dy)
        truth_field = np.hypot(dx, dy)
        smooth = False
        params.update(period=(px, py), shift=[float(v[0]), float(v[1])],
                      region_share=float(reg.mean()))
    elif family == "lean":
        kind = kind or str(rng.choice(["plain", "textured"]))
        mask = footprints(crop, rng, scale=float(rng.uniform(0.8, 1.5)))
        # Each building's box from the components' stats (not a scan of the crop per building).
        n, labels, boxes, _ = cv2.connectedComponentsWithStats(mask.astype(np.uint8), connectivity=8)
        deg = float(rng.uniform(0, 360))
        u = np.array([np.cos(np.radians(deg)), np.sin(np.radians(deg))])
        top = magnitude_px if magnitude_px is not None else float(rng.uniform(3.0, 30.0) * 1.0)
        per = rng.uniform(3.0 * max(scale, 0.4), max(top, 3.0), size=n)
        per[0] = 0.0
        if n > 1:
            per[1 + int(rng.integers(n - 1))] = top        # the tallest building
        facade_tone = float(rng.uniform(0.05, 0.35))
        if kind == "plain":
            roof = np.full_like(pre, float(rng.uniform(0.5, 0.95)))
            roof += 0.01 * rng.standard_normal(roof.shape).astype(np.float32)
        else:
            roof = np.clip(1.4 * np.roll(pre, crop // 3, axis=(0, 1)) - 0.1, 0, 1)
        roof = roof.astype(np.float32)
        nadir = np.where(mask, roof, pre).astype(np.float32)
        leaned = pre.copy()
        # Each building: its facade swept from base to roof, then its roof at base + lean.
        order = np.argsort(per[1:]) + 1                   # taller buildings drawn last (nearer)
        for b in order:
            L = float(per[b])
            if L <= 0:
                continue
            x_lo, y_lo, w, h = (int(v) for v in boxes[b, :4])
            y_hi, x_hi = y_lo + h, x_lo + w
            pad = int(np.ceil(L)) + 2
            ya, yb = max(0, y_lo - pad), min(crop, y_hi + pad)
            xa, xb = max(0, x_lo - pad), min(crop, x_hi + pad)
            own = (labels[ya:yb, xa:xb] == b).astype(np.float32)
            steps = max(2, int(np.ceil(L)))
            swept = np.zeros_like(own)
            for t in np.linspace(0, L, steps + 1):
                M = np.float32([[1, 0, t * u[0]], [0, 1, t * u[1]]])
                swept = np.maximum(swept, cv2.warpAffine(own, M, own.shape[::-1]))
            M = np.float32([[1, 0, L * u[0]], [0, 1, L * u[1]]])
            top_mask = cv2.warpAffine(own, M, own.shape[::-1]) > 0.5
            roof_moved = cv2.warpAffine(roof[ya:yb, xa:xb], M, own.shape[::-1],
                                        borderMode=cv2.BORDER_REFLECT)
            win = leaned[ya:yb, xa:xb]
            win[swept > 0.5] = facade_tone
            win[top_mask] = roof_moved[top_mask]
        if rng.random() < 0.5:
            pre, post = nadir, leaned
        else:                        # the leaning view first: the lean points back
            pre, post = leaned, nadir
            u = -u
            deg = (deg + 180.0) % 360.0
        truth_field = np.zeros((crop, crop), np.float32)
        smooth = False
        mags = per[1:]
        lean_px = (float(np.median(mags)) if mags.size else 0.0, float(mags.max()) if mags.size else 0.0)
        lean_deg = deg
        params.update(buildings=int(n - 1), top=round(top, 2))
    else:
        raise ValueError(f"unknown family {family!r}: one of {FAMILIES}")
    pre = np.asarray(pre, np.float32).copy()
    post = np.asarray(post, np.float32).copy()
    if overlays is None:
        overlays = rng.random() < 0.5
    if overlays:
        params.update(overlay(pre, post, valid, rng, clouds=rng.random() < 0.5,
                              nodata=rng.random() < 0.3, change=rng.random() < 0.5))
    truth = float(truth_field.max()) if smooth else \
        float(truth_field[valid].max()) if valid.any() else 0.0
    return FieldCase(family, str(kind), crop, pre, post, valid, truth, lean_px, lean_deg, params)


def edge_case(seed: int, crop: int, magnitude_px: Optional[float] = None) -> FieldCase:
    """A region at the crop's edge moved out of it (a mosaic seam near the edge, say): a
    rectangle on one side, at least ``MIN_REGION`` of the side deep, its content shown in the
    post date from up to 0.4 rad off the outward direction, 9-39 px (at most its depth) unless
    ``magnitude_px``. The pre windows over it find their content outside the post crop, so only
    the post windows, looked for in pre, show the move. No overlays."""
    rng = np.random.default_rng([seed, crop, 48])
    source = "s2" if rng.random() < 0.5 else "naip"
    src = scene(source, crop)
    H, W = src.shape
    x0, y0 = int(rng.integers(70, W - crop - 70)), int(rng.integers(70, H - crop - 70))
    lo = int(np.ceil(MIN_REGION * crop))
    depth = int(rng.integers(lo, int(0.4 * crop)))
    length = int(rng.integers(2 * lo, crop))
    start, side = int(rng.integers(0, crop - length + 1)), int(rng.integers(4))
    v = float(magnitude_px) if magnitude_px is not None else float(rng.uniform(9.0, min(39.0, depth)))
    a = float(rng.uniform(-0.4, 0.4)) + (np.pi, 0.0, -np.pi / 2, np.pi / 2)[side]
    m = np.zeros((crop, crop), bool)
    along = slice(start, start + length)
    inner = (slice(0, depth), slice(crop - depth, crop))[side % 2]
    m[(along, inner) if side < 2 else (inner, along)] = True
    dx = np.where(m, v * np.cos(a), 0).astype(np.float32)
    dy = np.where(m, v * np.sin(a), 0).astype(np.float32)
    pre = np.ascontiguousarray(src[y0:y0 + crop, x0:x0 + crop]).copy()
    post = _remap(src, x0, y0, dx, dy)
    return FieldCase("patches", "edge", crop, pre, post, np.ones((crop, crop), bool), v,
                     params={"source": source, "x0": x0, "y0": y0, "side": side, "depth": depth,
                             "shift": [float(v * np.cos(a)), float(v * np.sin(a))]})


def cases(n: int, crop: int, seed: int = 0, families=FAMILIES, limit: float = 8.0):
    """``n`` cases, the families in turn, seeds ``seed``, ``seed + 1``, ..."""
    for i in range(n):
        yield make_case(families[i % len(families)], crop, seed + i, limit)
