"""A large bitemporal scene pair built from the repo's real imagery, with a known warp.

Pre date: a 3 x 3 mosaic of cells, each a different real image from ``data/`` (NAIP dates and
bands, Sentinel-2 B8A, Landsat-8 RGB), percentile-stretched and upsampled (cubic) to the cell size.
Cells of the same place are mirrored or placed two cells apart so that no 3000 px slice holds two
copies of the same texture (SIFT's ratio test would reject every feature that has a twin; SIFT is
rotation invariant, so rotated copies would be twins too, mirrored ones are not). Written as
single-band uint16 (1000 + 30000 * unit), so the 16-bit path is exercised.

Post date: ``post(p) = radiometry(pre(F(p)))`` with ``F`` (post pixel -> pre pixel) a smooth,
spatially varying warp: a geocoding offset, a small rotation and scale about the scene centre, and
a low-frequency sinusoidal displacement (amplitude ``wave_px`` over ``wave_len_px``), so each slice
needs its own homography; over a 3000 px slice ``F`` departs from the best homography by well under
0.1 px at the kept crop's corners. Radiometry: gain, gamma, offset and independent noise.
Everything outside the pre scene is nodata (0).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import rasterio
from affine import Affine

DATA = Path(__file__).resolve().parent.parent / "data"
NAIP = sorted((DATA / "naip").glob("*.tif"))  # 2009, 2016, 2017, 2020


def _unit(img: np.ndarray) -> np.ndarray:
    lo, hi = np.percentile(img, [1, 99])
    return np.clip((img.astype(np.float32) - lo) / max(hi - lo, 1e-6), 0, 1)


def _naip_grey(i: int) -> np.ndarray:
    with rasterio.open(NAIP[i]) as src:
        return src.read([1, 2, 3]).astype(np.float32).mean(0)


def _naip_nir(i: int) -> np.ndarray:
    with rasterio.open(NAIP[i]) as src:
        return src.read(4).astype(np.float32)


def _band(name: str) -> np.ndarray:
    with rasterio.open(DATA / "uint16" / name) as src:
        return src.read(1).astype(np.float32)


def _landsat_rgb() -> np.ndarray:
    return (_band("l8_B4.tif") + _band("l8_B3.tif") + _band("l8_B2.tif")) / 3


def source_cells() -> list[np.ndarray]:
    """Nine distinct real images in mosaic order (row-major 3 x 3)."""
    mirror = np.fliplr
    return [
        _naip_grey(0), _band("s2_B8A.jp2"), mirror(_naip_grey(1)),
        _landsat_rgb(), _naip_nir(3), mirror(_band("s2_B8A.jp2")),
        mirror(_naip_grey(2)), mirror(_landsat_rgb()), _naip_grey(3),
    ]


def mosaic(size: int) -> np.ndarray:
    """(size, size) float32 in [0, 1] from the nine cells."""
    cell = -(-size // 3)
    out = np.zeros((3 * cell, 3 * cell), np.float32)
    for k, img in enumerate(source_cells()):
        img = _unit(img)
        scale = cell / min(img.shape)
        big = cv2.resize(img, (int(np.ceil(img.shape[1] * scale)), int(np.ceil(img.shape[0] * scale))),
                         interpolation=cv2.INTER_CUBIC)
        y0, x0 = (big.shape[0] - cell) // 2, (big.shape[1] - cell) // 2
        r, c = divmod(k, 3)
        out[r * cell:(r + 1) * cell, c * cell:(c + 1) * cell] = big[y0:y0 + cell, x0:x0 + cell]
    return np.clip(out[:size, :size], 0, 1)


@dataclass(frozen=True)
class KnownWarp:
    """F: post pixel (x, y) -> pre pixel, on the common grid."""

    size: int
    offset: tuple[float, float] = (23.4, -17.8)   # geocoding error between the dates
    degrees: float = 0.15
    scale: float = 1.0015
    wave_px: float = 3.0
    wave_len_px: float = 20000.0

    def __call__(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c = (self.size - 1) / 2.0
        th = np.deg2rad(self.degrees)
        a, b = self.scale * np.cos(th), self.scale * np.sin(th)
        dx, dy = x - c, y - c
        k = 2 * np.pi / self.wave_len_px
        fx = c + a * dx - b * dy + self.offset[0] + self.wave_px * np.sin(k * y + 0.7)
        fy = c + b * dx + a * dy + self.offset[1] + self.wave_px * np.cos(k * x + 1.9)
        return fx, fy


def to_uint16(unit: np.ndarray) -> np.ndarray:
    return np.rint(1000 + 30000 * np.clip(unit, 0, 1)).astype(np.uint16)


def write_pair(out_dir: str | Path, size: int, seed: int = 0) -> tuple[str, str, KnownWarp]:
    """Write pre.tif and post.tif (same CRS and transform) and return their paths and the warp."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    warp = KnownWarp(size)
    pre_path, post_path = out_dir / f"pre_{size}.tif", out_dir / f"post_{size}.tif"
    if pre_path.exists() and post_path.exists():
        return str(pre_path), str(post_path), warp
    rng = np.random.default_rng(seed)
    pre = mosaic(size)
    profile = {"driver": "GTiff", "dtype": "uint16", "count": 1, "width": size, "height": size,
               "crs": "EPSG:32618", "transform": Affine(1.0, 0, 500000.0, 0, -1.0, 4500000.0),
               "nodata": 0, "tiled": True, "blockxsize": 512, "blockysize": 512,
               "compress": "deflate", "predictor": 2}
    tmp_pre, tmp_post = pre_path.with_suffix(".tmp.tif"), post_path.with_suffix(".tmp.tif")
    with rasterio.open(tmp_pre, "w", **profile) as dst:
        dst.write(to_uint16(pre + rng.normal(0, 0.003, pre.shape).astype(np.float32)), 1)
    with rasterio.open(tmp_post, "w", **profile) as dst:
        strip = 512  # remap maps are 8 bytes per pixel: build them a strip at a time
        xs = np.arange(size, dtype=np.float64)
        for y0 in range(0, size, strip):
            ys = np.arange(y0, min(y0 + strip, size), dtype=np.float64)
            gx, gy = np.meshgrid(xs, ys)
            fx, fy = warp(gx, gy)
            sampled = cv2.remap(pre, fx.astype(np.float32), fy.astype(np.float32),
                                interpolation=cv2.INTER_CUBIC, borderMode=cv2.BORDER_CONSTANT,
                                borderValue=-1.0)
            inside = (fx >= 0) & (fx <= size - 1) & (fy >= 0) & (fy <= size - 1)
            unit = np.clip(1.2 * np.clip(sampled, 0, 1) ** 0.85 - 0.03, 0, 1)
            unit += rng.normal(0, 0.003, unit.shape).astype(np.float32)
            block = to_uint16(unit)
            block[~inside] = 0
            dst.write(block, 1, window=rasterio.windows.Window(0, y0, size, len(ys)))
    tmp_pre.replace(pre_path)
    tmp_post.replace(post_path)
    return str(pre_path), str(post_path), warp
