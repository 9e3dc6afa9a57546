"""Radiometry: per-scene percentile stretch and the 16-bit (or any dtype) to 8-bit conversion, and
the local normalisation of feature-detection input.

The stretch is computed once per *scene* from a decimated read of the whole raster, never per slice,
so every slice of a scene shares one mapping and neighbouring crops do not flicker in brightness.
Default: the 2nd and 98th percentiles of each band's valid pixels map to 0 and 255, linearly, with
values outside clipped (S2Looking does not state its conversion; this is the common choice).

SIFT's input has another need: local texture must survive. A scene-wide stretch of a cloudy date
maps the clouds to most of the range and leaves the land texture in a few grey levels, so features
are computed on a *local* normalisation instead (:func:`local_unit`): per feature tile or slice,
a robust percentile stretch over the pixels that are valid, not saturated and not otherwise masked
(clouds, once a cloud mask is given), optionally followed by CLAHE. The 8-bit PNGs keep the
per-scene stretch.
"""
from __future__ import annotations

from typing import Sequence

import cv2
import numpy as np
import rasterio
from rasterio.enums import Resampling

from operators.io.storage import gdal_env, gdal_path

DEFAULT_PERCENTILES = (2.0, 98.0)


def percentiles_of(values: np.ndarray, percentiles: Sequence[float]) -> np.ndarray:
    """``np.percentile(values, percentiles)`` (linear interpolation), from a histogram for 8- and
    16-bit unsigned data (the imagery's usual types: one counting pass instead of a partial sort
    of a float copy, per band of every crop)."""
    values = np.asarray(values).ravel()
    if values.dtype not in (np.uint8, np.uint16) or values.size == 0:
        return np.percentile(values.astype(np.float64), list(percentiles))
    return _ranked(np.cumsum(np.bincount(values)), percentiles)


def _counts(band: np.ndarray, ok: np.ndarray, all_ok: bool) -> np.ndarray:
    """Histogram of an unsigned integer band's values at ``ok`` (no masked copy when every
    pixel counts)."""
    return np.bincount(band.ravel() if all_ok else band[ok])


def _ranked(cum: np.ndarray, percentiles: Sequence[float]) -> np.ndarray:
    """:func:`percentiles_of` from the cumulative histogram ``cum`` of the values."""
    size = int(cum[-1])
    pos = np.asarray(percentiles, np.float64) / 100.0 * (size - 1)
    lo = np.floor(pos)
    a = np.searchsorted(cum, lo, side="right").astype(np.float64)             # value of rank lo
    b = np.searchsorted(cum, np.minimum(lo + 1, size - 1), side="right")      # rank lo + 1
    return a + (pos - lo) * (b - a)


def band_percentiles(data: np.ndarray, valid: np.ndarray | None,
                     percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> list[list[float]]:
    """[[lo, hi], ...] per band of a (bands, H, W) array, over valid pixels only (non-finite
    values of a float band are never data, whatever the mask says: a float scene without a
    nodata tag marks its gaps with NaN)."""
    out = []
    for band in data:
        values = band[valid] if valid is not None else band.ravel()
        if np.issubdtype(values.dtype, np.floating):
            values = values[np.isfinite(values)]
        if values.size == 0:
            out.append([0.0, 1.0])
            continue
        lo, hi = percentiles_of(values, percentiles)
        if hi <= lo:  # a flat band: keep the mapping defined
            hi = lo + 1.0
        out.append([float(lo), float(hi)])
    return out


def decimated_shape(width: int, height: int, max_side: int) -> tuple[int, int]:
    """(rows, cols) of a whole-scene read at most ``max_side`` pixels a side (never upsampled):
    what a scene's stretch is measured on."""
    scale = max(max(width, height) / max_side, 1)
    return max(1, int(round(height / scale))), max(1, int(round(width / scale)))


def scene_stretch(uri: str, bands: Sequence[int] | None = None, max_side: int = 1024,
                  percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> list[list[float]]:
    """Per-band stretch of a whole scene from a decimated read (overviews used when present)."""
    with rasterio.Env(**gdal_env()):
        with rasterio.open(gdal_path(uri)) as src:
            idx = list(bands) if bands else list(range(1, src.count + 1))
            shape = (len(idx), *decimated_shape(src.width, src.height, max_side))
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


def usable_pixels(data: np.ndarray, valid: np.ndarray | None,
                  invalid: np.ndarray | None = None) -> np.ndarray:
    """Pixels a local statistic may use: valid in every band, not saturated (integer data at its
    type's maximum in any band), and not flagged by ``invalid`` (e.g. a cloud mask)."""
    ok = np.ones(data.shape[1:], bool) if valid is None else np.asarray(valid, bool).copy()
    if np.issubdtype(data.dtype, np.integer):
        ok &= ~np.any(data >= np.iinfo(data.dtype).max, axis=0)
    if invalid is not None:
        ok &= ~np.asarray(invalid, bool)
    return ok


def local_unit(data: np.ndarray, valid: np.ndarray | None, method: str = "clahe",
               percentiles: Sequence[float] = (1.0, 99.0), clahe_clip: float = 2.0,
               clahe_tile_px: int = 128, invalid: np.ndarray | None = None,
               min_pixels: int = 64, as_uint8: bool = False) -> np.ndarray:
    """(bands, H, W) any dtype -> (H, W) float32 grey in [0, 1] normalised on this window alone.

    Each band is stretched by its own ``percentiles`` over :func:`usable_pixels` and the bands are
    averaged; ``method="clahe"`` then equalises contrast locally (CLAHE on a 16-bit copy, tiles of
    about ``clahe_tile_px``, clip limit ``clahe_clip``), which lifts land texture next to bright
    clouds or in haze. Unusable pixels are filled with the median grey so they draw no edge
    (keypoints there are also kept out by the detection mask).

    ``as_uint8``: SIFT's 8-bit input instead, ``rint(clip(grey, 0, 1) * 255)``, the same values
    without the float image. 8- and 16-bit bands take table lookups (the per-pixel arithmetic of
    the float path applied once per possible value, so the result is the same to the bit) and
    single-band medians come from the histogram; :func:`_local_unit_float` is the plain path.
    """
    if method not in ("percentile", "clahe"):
        raise ValueError(f"normalisation must be 'percentile' or 'clahe', got {method!r}")
    if data.dtype not in (np.uint8, np.uint16):
        grey = _local_unit_float(data, valid, method, percentiles, clahe_clip, clahe_tile_px,
                                 invalid, min_pixels)
        return _to_u8(grey) if as_uint8 else grey
    ok = usable_pixels(data, valid, invalid)
    h, w = data.shape[1:]
    n_ok = int(np.count_nonzero(ok))
    if n_ok < min_pixels:
        return np.zeros((h, w), np.uint8 if as_uint8 else np.float32)
    all_ok = n_ok == ok.size
    levels = np.arange(np.iinfo(data.dtype).max + 1, dtype=data.dtype)
    grey = None
    single = None
    for band in data:
        cum = np.cumsum(_counts(band, ok, all_ok))
        lo, hi = _ranked(cum, percentiles)
        # The float path's arithmetic on every possible value (float64, as there; the sum of
        # the bands is taken in float64 and stored in float32 after each band, as there).
        lut = np.clip((levels.astype(np.float32) - lo) / max(float(hi - lo), 1e-6), 0.0, 1.0)
        if len(data) == 1:
            single = (lut.astype(np.float32), cum)
            break
        if grey is None:
            grey = np.zeros((h, w), np.float32)
        grey += lut[band]
    if single is not None:
        lut, cum = single
        # The median of lut[band] over ``ok``: lut is non-decreasing, so the middle ranks of the
        # band's values give it; even counts average the two as np.median does (float32 mean).
        n = int(cum[-1])
        ranks = [n // 2] if n % 2 else [n // 2 - 1, n // 2]
        mid = lut[np.searchsorted(cum, ranks, side="right")]
        fill = float(np.mean(mid))
        if method == "percentile":
            if as_uint8:
                out = _to_u8(lut)[data[0]]
                if not all_ok:
                    out[~ok] = _to_u8(np.float32([fill]))[0]
                return out
            grey = lut[data[0]]
            if not all_ok:
                grey[~ok] = fill
            return grey
        u16 = _to_u16(lut)[data[0]]
    else:
        grey /= len(data)
        fill = float(np.median(grey[ok]))
        if not all_ok:
            grey[~ok] = fill
        if method == "percentile":
            return _to_u8(grey) if as_uint8 else grey
        u16 = _to_u16(grey)
    if not all_ok:
        u16[~ok] = _to_u16(np.float32([fill]))[0]
    eq = _clahe(u16, w, h, clahe_clip, clahe_tile_px)
    eq_fill = float(_ranked(np.cumsum(_counts(eq, ok, all_ok)), [50.0])[0]) / 65535.0
    if as_uint8:
        out = _u16_to_u8()[eq]
        if not all_ok:
            out[~ok] = _to_u8(np.float32([eq_fill]))[0]
        return out
    grey = eq.astype(np.float32) / 65535.0
    grey[~ok] = eq_fill
    return grey


def _to_u16(grey: np.ndarray) -> np.ndarray:
    return np.rint(grey * 65535.0).astype(np.uint16)


def _to_u8(grey: np.ndarray) -> np.ndarray:
    """SIFT's 8-bit input from a unit grey (what ``registration.detect_features`` does)."""
    return np.rint(np.clip(grey, 0.0, 1.0) * 255.0).astype(np.uint8)


_U16_TO_U8: list = []


def _u16_to_u8() -> np.ndarray:
    """CLAHE's 16-bit output -> SIFT's 8-bit input, as the float path computes it."""
    if not _U16_TO_U8:
        _U16_TO_U8.append(_to_u8(np.arange(65536, dtype=np.uint16).astype(np.float32) / 65535.0))
    return _U16_TO_U8[0]


def _clahe(u16: np.ndarray, w: int, h: int, clip: float, tile_px: int) -> np.ndarray:
    grid = (max(1, int(round(w / tile_px))), max(1, int(round(h / tile_px))))
    return cv2.createCLAHE(clipLimit=float(clip), tileGridSize=grid).apply(u16)


def _local_unit_float(data: np.ndarray, valid: np.ndarray | None, method: str,
                      percentiles: Sequence[float], clahe_clip: float, clahe_tile_px: int,
                      invalid: np.ndarray | None, min_pixels: int) -> np.ndarray:
    """:func:`local_unit` on float images per pixel (any dtype; the reference the table path
    of 8- and 16-bit bands reproduces to the bit)."""
    ok = usable_pixels(data, valid, invalid)
    h, w = data.shape[1:]
    if ok.sum() < min_pixels:
        return np.zeros((h, w), np.float32)
    grey = np.zeros((h, w), np.float32)
    for band in data:
        lo, hi = percentiles_of(band[ok], percentiles)
        grey += np.clip((band.astype(np.float32) - lo) / max(float(hi - lo), 1e-6), 0.0, 1.0)
    grey /= len(data)
    fill = float(np.median(grey[ok]))
    grey[~ok] = fill
    if method == "clahe":
        eq = _clahe(_to_u16(grey), w, h, clahe_clip, clahe_tile_px)
        grey = eq.astype(np.float32) / 65535.0
        grey[~ok] = float(percentiles_of(eq[ok], [50.0])[0]) / 65535.0
    return grey
