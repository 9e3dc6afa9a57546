"""Radiometry: per-scene percentile stretch and the 16-bit (or any dtype) to 8-bit conversion.

The stretch is computed once per *scene* from a decimated read of the whole raster, never per slice,
so every slice of a scene shares one mapping and neighbouring crops do not flicker in brightness.
Default: the 2nd and 98th percentiles of each band's valid pixels map to 0 and 255, linearly, with
values outside clipped (S2Looking does not state its conversion; this is the common choice).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import rasterio
from rasterio.enums import Resampling

from operators.io.storage import gdal_env, gdal_path

DEFAULT_PERCENTILES = (2.0, 98.0)


def band_percentiles(data: np.ndarray, valid: np.ndarray | None,
                     percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> list[list[float]]:
    """[[lo, hi], ...] per band of a (bands, H, W) array, over valid pixels only."""
    out = []
    for band in data:
        values = band[valid] if valid is not None else band.ravel()
        if values.size == 0:
            out.append([0.0, 1.0])
            continue
        lo, hi = np.percentile(values.astype(np.float64), list(percentiles))
        if hi <= lo:  # a flat band: keep the mapping defined
            hi = lo + 1.0
        out.append([float(lo), float(hi)])
    return out


def scene_stretch(uri: str, bands: Sequence[int] | None = None, max_side: int = 1024,
                  percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> list[list[float]]:
    """Per-band stretch of a whole scene from a decimated read (overviews used when present)."""
    with rasterio.Env(**gdal_env()):
        with rasterio.open(gdal_path(uri)) as src:
            idx = list(bands) if bands else list(range(1, src.count + 1))
            scale = max(src.width, src.height) / max_side
            shape = (len(idx), max(1, int(round(src.height / max(scale, 1)))),
                     max(1, int(round(src.width / max(scale, 1)))))
            data = src.read(idx, out_shape=shape, resampling=Resampling.nearest)
            mask = src.dataset_mask(out_shape=shape[1:], resampling=Resampling.nearest) > 0
    return band_percentiles(data, mask, percentiles)


def stretch_to_unit(data: np.ndarray, stretch: Sequence[Sequence[float]]) -> np.ndarray:
    """(bands, H, W) of any dtype -> float32 in [0, 1] by the per-band [lo, hi] stretch."""
    lo = np.asarray([s[0] for s in stretch], dtype=np.float32)[:, None, None]
    hi = np.asarray([s[1] for s in stretch], dtype=np.float32)[:, None, None]
    out = (data.astype(np.float32) - lo) / (hi - lo)
    return np.clip(out, 0.0, 1.0, out=out)


def to_uint8(data: np.ndarray, stretch: Sequence[Sequence[float]],
             valid: np.ndarray | None = None) -> np.ndarray:
    """(bands, H, W) -> (H, W, bands) uint8 with the scene's stretch; invalid pixels become 0."""
    unit = stretch_to_unit(data, stretch)
    out = np.rint(unit * 255.0).astype(np.uint8)
    if valid is not None:
        out[:, ~valid] = 0
    return np.moveaxis(out, 0, -1)
