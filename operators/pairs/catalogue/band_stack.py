"""Per-band products: read a window from each band asset of a scene and stack them.

Archives publish one file per band (Sentinel-2 and Landsat COGs, SAFE/product folders), often at
different resolutions, plus a scene-class or QA layer. A *stack* describes such a scene: its band
assets in output order (href, CRS, transform, size, nodata - from the STAC projection extension or
from each file's header) and an optional cloud layer. The scene's own grid is its **finest** band's
grid; every band is read onto the requested grid, natively when the band already is on it, else
through a ``WarpedVRT``: **bilinear** for data bands (coarser bands are upsampled to the finest
resolution), **nearest** for the cloud layer (class values must not be blended). The CRS and
transform come from the stack, not from the file, so a raster whose georeferencing lives in a
sidecar GDAL does not see (``GDAL_DISABLE_READDIR_ON_OPEN``, S3) is still placed correctly.

A stacked pixel is valid when any band holds data there (not its nodata, inside its file) - GDAL's
dataset mask for a multi-band raster with nodata, so a stack and the same bands in one file agree
(a lone 0 in one band of a lossy product is a dark pixel, not missing data) - and, with a cloud
layer, it is not cloud/shadow/cirrus.
"""
from __future__ import annotations

import functools
import json
import math
import warnings
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np
import rasterio
from affine import Affine
from rasterio.crs import CRS
from rasterio.enums import Resampling
from rasterio.vrt import WarpedVRT

from operators.io.storage import gdal_env, gdal_path
from operators.pairs.imagery.cloud_masks import cloud_pixels
from operators.pairs.imagery.radiometry import DEFAULT_PERCENTILES, band_percentiles, decimated_shape
from operators.pairs.imagery.raster_io import (Grid, common_grid, grid_bbox, holds_data, read_padded,
                                              window_in_raster)
from operators.pairs.registration.registration import crop_offset, crop_positions_on_grid, remap_bands


def raster_path(href: str) -> str:
    """What GDAL opens: ``s3://`` -> ``/vsis3/``, ``http(s)://`` -> ``/vsicurl/``, paths as they are."""
    href = str(href)
    if href.startswith(("http://", "https://")):
        return "/vsicurl/" + href
    return gdal_path(href)


@dataclass(frozen=True)
class BandAsset:
    """One single-band raster of a scene and the grid it lies on."""

    name: str                      # asset key or band name (lineage, error messages)
    href: str
    crs: str
    transform: tuple[float, ...]   # 6 affine coefficients
    width: int
    height: int
    nodata: Optional[float] = None
    dtype: str = "uint16"

    @property
    def grid(self) -> Grid:
        return Grid(self.crs, tuple(float(v) for v in self.transform[:6]))

    @property
    def res(self) -> float:
        return abs(float(self.transform[0]))

    def bounds(self) -> list[float]:
        aff = Affine(*self.transform[:6])
        xs, ys = zip(*[aff @ (c, r) for c in (0, self.width) for r in (0, self.height)])
        return [min(xs), min(ys), max(xs), max(ys)]


@dataclass(frozen=True)
class CloudLayer:
    asset: BandAsset
    kind: str                      # scl | qa_pixel
    values: tuple[int, ...]        # classes (scl) or bits (qa_pixel) that count as cloud
    max_crop_fraction: float = 0.0


@dataclass(frozen=True)
class Stack:
    """The band assets of one scene in output order, plus an optional cloud layer."""

    bands: tuple[BandAsset, ...]
    cloud: Optional[CloudLayer] = None

    def finest(self) -> BandAsset:
        return min(self.bands, key=lambda b: b.res)

    def hrefs(self) -> list[str]:
        return [b.href for b in self.bands] + ([self.cloud.asset.href] if self.cloud else [])

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Stack":
        d = json.loads(text)
        bands = tuple(_band(b) for b in d["bands"])
        cloud = None
        if d.get("cloud"):
            c = d["cloud"]
            cloud = CloudLayer(_band(c["asset"]), c["kind"], tuple(c["values"]),
                               float(c.get("max_crop_fraction", 0.0)))
        return cls(bands, cloud)


def _band(d: dict) -> BandAsset:
    return BandAsset(**{**d, "transform": tuple(d["transform"])})


def header_record(stack: Stack) -> dict:
    """The scene-record fields a stack determines (grid of its finest band)."""
    f = stack.finest()
    return {
        "crs": f.crs, "bounds": f.bounds(), "transform": list(f.transform[:6]),
        "width": f.width, "height": f.height, "res": [f.res, abs(float(f.transform[4]))],
        "dtype": f.dtype, "count": len(stack.bands), "nodata": f.nodata,
        "rgb_bands": list(range(1, min(len(stack.bands), 3) + 1)),
        "stack": stack.to_json(),
    }


# ---- reading -----------------------------------------------------------------------------------

def _same_grid(a: Grid, b: Grid) -> bool:
    if a.crs != b.crs and CRS.from_user_input(a.crs) != CRS.from_user_input(b.crs):
        return False
    tol = 1e-6 * max(abs(a.transform[0]), 1e-9)
    return all(math.isclose(x, y, abs_tol=tol) for x, y in zip(a.transform, b.transform))


def read_band(asset: BandAsset, window: Sequence[int], grid: Grid,
              resampling: Resampling = Resampling.bilinear) -> tuple[np.ndarray, np.ndarray]:
    """(H, W) values of ``asset`` on ``grid`` at ``window`` = (col, row, w, h), and validity.

    Windows may reach outside the raster (or start at negative offsets): those pixels are invalid.
    """
    col, row, width, height = (int(v) for v in window)
    with rasterio.Env(**gdal_env()), warnings.catch_warnings():
        warnings.simplefilter("ignore", rasterio.errors.NotGeoreferencedWarning)
        with rasterio.open(raster_path(asset.href)) as src:
            if _same_grid(asset.grid, grid):
                data = read_padded(src, 1, window, 0 if asset.nodata is None else asset.nodata)
                valid = window_in_raster(window, asset.width, asset.height)
                return data, valid & holds_data(data, asset.nodata)
            # A VRT exactly the size of the window, its origin at the window's corner.
            dst = grid.affine @ Affine.translation(col, row)
            with WarpedVRT(src, src_crs=CRS.from_user_input(asset.crs),
                           src_transform=asset.grid.affine, src_nodata=asset.nodata,
                           crs=CRS.from_user_input(grid.crs), transform=dst, width=width,
                           height=height, resampling=resampling,
                           nodata=asset.nodata if asset.nodata is not None else 0,
                           add_alpha=asset.nodata is None) as vrt:
                data = vrt.read(1)
                if asset.nodata is None:
                    return data, (vrt.read(vrt.count) > 0) & holds_data(data, None)
                return data, holds_data(data, asset.nodata)


@dataclass
class StackRead:
    data: np.ndarray               # (bands, H, W)
    valid: np.ndarray              # some band holds data (clouds not removed)
    cloud: Optional[np.ndarray]    # True on cloud/shadow/cirrus (None without a cloud layer)

    def usable(self) -> np.ndarray:
        """Valid and not cloud: what SIFT, the screening and the stretch may use."""
        return self.valid if self.cloud is None else self.valid & ~self.cloud


def read_stack(stack: Stack, window: Sequence[int], grid: Grid) -> StackRead:
    """Every band's window on ``grid``, stacked in the stack's order (one dtype: the widest)."""
    planes, valid = [], None
    for band in stack.bands:
        data, ok = read_band(band, window, grid, Resampling.bilinear)
        planes.append(data)
        valid = ok if valid is None else valid | ok
    dtype = np.result_type(*planes)
    return StackRead(np.stack([p.astype(dtype, copy=False) for p in planes]), valid,
                     read_cloud(stack, window, grid))


def read_cloud(stack: Stack, window: Sequence[int], grid: Grid) -> Optional[np.ndarray]:
    if stack.cloud is None:
        return None
    return _cloud_window(stack.cloud, tuple(int(v) for v in window), grid).copy()


@functools.lru_cache(maxsize=8)
def _cloud_window(cloud: CloudLayer, window: tuple, grid: Grid) -> np.ndarray:
    # A slice reads the same cloud window twice: with its crop's pixels (the usable mask) and
    # again for the crop's cloud fraction. Kept for one slice only (see forget_reads).
    layer, ok = read_band(cloud.asset, window, grid, Resampling.nearest)
    return cloud_pixels(layer, cloud.kind, cloud.values) & ok


def forget_reads() -> None:
    """Drop remembered cloud windows: called as each slice starts, so a long-lived worker never
    serves a window of a file rewritten since."""
    _cloud_window.cache_clear()


def stack_stretch(stack: Stack, percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                  max_side: int = 1024) -> list[list[float]]:
    """Per-band [lo, hi] of a stacked scene from a decimated read, clouds excluded.

    Same recipe as :func:`operators.pairs.imagery.radiometry.scene_stretch` for one multi-band file: the
    scene (finest grid) is read at most ``max_side`` pixels a side, nearest neighbour, and the
    percentiles are taken over pixels where some band is valid.
    """
    f = stack.finest()
    shape = decimated_shape(f.width, f.height, max_side)
    planes, valid, clear = [], np.zeros(shape, bool), np.ones(shape, bool)
    layers = list(stack.bands) + ([stack.cloud.asset] if stack.cloud else [])
    for i, band in enumerate(layers):
        with rasterio.Env(**gdal_env()), warnings.catch_warnings():
            warnings.simplefilter("ignore", rasterio.errors.NotGeoreferencedWarning)
            with rasterio.open(raster_path(band.href)) as src:
                data = src.read(1, out_shape=shape, resampling=Resampling.nearest)
        if i < len(stack.bands):
            planes.append(data)
            valid |= holds_data(data, band.nodata)
        else:
            clear = ~cloud_pixels(data, stack.cloud.kind, stack.cloud.values)
    return band_percentiles(np.stack(planes), valid & clear, percentiles)


# ---- hooks for slice rows ---------------------------------------------------------------------

def row_stack(row: dict, side: str) -> Optional[Stack]:
    """The stack of a slice row's ``pre``/``post`` scene (None: an ordinary multi-band raster)."""
    text = row.get(f"{side}_stack")
    return Stack.from_json(text) if text else None


def read_stacked_side(row: dict, side: str, window: Sequence[int], grid: Grid):
    """(data, usable) of one date's stacked window, the shape ``slice_io`` reads return."""
    got = read_stack(row_stack(row, side), window, grid)
    return got.data, got.usable()


def lineage_columns(row: dict) -> dict:
    """Where a slice came from: STAC ids (when catalogued from STAC) and every href read."""
    out = {"cloud_fraction": row.get("cloud_fraction")}
    for side in ("pre", "post"):
        stack = row_stack(row, side)
        out[f"{side}_stac_id"] = row.get(f"{side}_stac_id")
        out[f"{side}_hrefs"] = stack.hrefs() if stack else [row.get(f"{side}_uri")]
    return out


@dataclass
class CropClouds:
    pre: np.ndarray                # cloud on the kept crop, pre date
    post: np.ndarray               # cloud on the kept crop, registered post date
    max_fraction: float

    @property
    def fraction(self) -> float:
        return float(np.mean(self.pre | self.post))


def crop_clouds(row: dict, kept: Sequence[int], homography, crop_size: int) -> Optional[CropClouds]:
    """Cloud masks of a kept crop in both dates (post sampled like the post crop), or None.

    The post layer is sampled at the common-grid positions the registered post crop takes its
    pixels from (``registration.crop_positions_on_grid``): a crop pixel is cloud when any pixel
    its value is interpolated from is.
    """
    pre_stack, post_stack = row_stack(row, "pre"), row_stack(row, "post")
    if (pre_stack is None or pre_stack.cloud is None) and \
            (post_stack is None or post_stack.cloud is None):
        return None
    grid = common_grid(row)
    pre = np.zeros((crop_size, crop_size), bool)
    if pre_stack is not None and pre_stack.cloud is not None:
        pre = read_cloud(pre_stack, kept, grid)
    post = np.zeros_like(pre)
    limit = max(s.cloud.max_crop_fraction for s in (pre_stack, post_stack)
                if s is not None and s.cloud is not None)
    if post_stack is not None and post_stack.cloud is not None and homography is not None:
        H = np.asarray(homography, dtype=np.float64).reshape(3, 3)
        win = [int(v) for v in row["window"]]
        gx, gy = crop_positions_on_grid(H, win, crop_offset(win[2], crop_size), crop_size)
        box = grid_bbox(gx, gy)
        layer = read_cloud(post_stack, box, grid)
        # Linear, and cloud where any source pixel is: the post crop's validity mask (also
        # linear, valid only where every source pixel is usable) then has no ring of "nodata"
        # around each cloud that neither mask claims.
        sampled, _ = remap_bands(layer[None].astype(np.uint8) * 255, np.ones(layer.shape, bool),
                                 (gx - box[0]).astype(np.float32), (gy - box[1]).astype(np.float32),
                                 "linear")
        post = sampled[0] > 0
    return CropClouds(pre, post, limit)
