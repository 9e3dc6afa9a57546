"""Windowed raster reads on a common grid (local paths and s3:// through GDAL's /vsis3/).

The pairs job never moves whole scenes: operators carry a URI, a grid (CRS + affine transform of the
*pre* scene) and a pixel window, and read just that window here. The pre scene is read natively; the
post scene is resampled onto the pre scene's grid through a ``WarpedVRT``, so slices of both dates
share pixel coordinates before registration refines them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import rasterio
from affine import Affine
from rasterio.crs import CRS
from rasterio.enums import Resampling
from rasterio.vrt import WarpedVRT
from rasterio.windows import Window

from operators.io.storage import gdal_env, gdal_path


@dataclass(frozen=True)
class Grid:
    """A pixel grid: CRS (as WKT/EPSG string) and the affine transform of its pixel (0, 0)."""

    crs: str
    transform: tuple[float, float, float, float, float, float]

    @property
    def affine(self) -> Affine:
        return Affine(*self.transform)


def _valid_mask(ds, data: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """True where every band holds data (GDAL's dataset mask, else nodata, else all valid)."""
    if mask is not None:
        return mask > 0
    if ds.nodata is not None:
        return np.all(data != ds.nodata, axis=0)
    return np.ones(data.shape[1:], dtype=bool)


def read_window(uri: str, window: Sequence[int], bands: Sequence[int] | None = None,
                grid: Grid | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Read ``window`` = (col_off, row_off, width, height) as (bands, H, W) plus a validity mask.

    With ``grid`` the raster is warped onto that grid first (bilinear), so the window is in the
    grid's pixel coordinates; pixels outside the source come back invalid, never as fake zeros.
    Windows running off the raster are padded and marked invalid (boundless read).
    """
    col, row, width, height = (int(v) for v in window)
    win = Window(col, row, width, height)
    with rasterio.Env(**gdal_env()):
        with rasterio.open(gdal_path(uri)) as src:
            idx = list(bands) if bands else list(range(1, src.count + 1))
            if grid is None:
                data = src.read(idx, window=win, boundless=True, fill_value=0)
                mask = src.dataset_mask(window=win, boundless=True) if src.nodata is not None or \
                    _has_internal_mask(src) else None
                if mask is None:
                    # Boundless reads pad with zeros: mark the padding invalid by geometry.
                    valid = _inside(col, row, width, height, src.width, src.height)
                else:
                    valid = _valid_mask(src, data, mask) & \
                        _inside(col, row, width, height, src.width, src.height)
                return data, valid
            # Warp onto the target grid; a large-enough VRT covers the requested window.
            vrt_width = max(col + width, 1)
            vrt_height = max(row + height, 1)
            with WarpedVRT(src, crs=CRS.from_user_input(grid.crs), transform=grid.affine,
                           width=vrt_width, height=vrt_height, resampling=Resampling.bilinear,
                           src_nodata=src.nodata if src.nodata is not None else None,
                           nodata=src.nodata if src.nodata is not None else 0,
                           add_alpha=src.nodata is None) as vrt:
                data = vrt.read(idx, window=win)
                if src.nodata is None:
                    alpha = vrt.read(vrt.count, window=win)
                    valid = alpha > 0
                else:
                    valid = vrt.dataset_mask(window=win) > 0
                return data, valid


def _has_internal_mask(src) -> bool:
    from rasterio.enums import MaskFlags
    return any(MaskFlags.per_dataset in f or MaskFlags.alpha in f for f in src.mask_flag_enums)


def _inside(col: int, row: int, width: int, height: int, src_w: int, src_h: int) -> np.ndarray:
    rows = np.arange(row, row + height)
    cols = np.arange(col, col + width)
    return ((rows >= 0) & (rows < src_h))[:, None] & ((cols >= 0) & (cols < src_w))[None, :]
