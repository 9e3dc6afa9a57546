"""Windowed raster reads on a common grid (local paths and s3:// through GDAL's /vsis3/).

The pairs job never moves whole scenes: operators carry a URI, a grid (CRS + affine transform of the
*pre* scene) and a pixel window, and read just that window here. The pre scene is read natively; for
feature detection the post scene is resampled onto the pre scene's grid through a ``WarpedVRT``, so
slices of both dates share pixel coordinates before registration refines them. The registered
post crop is *not* made from that resampled copy: :func:`read_at` reads the post scene's own pixels
and resamples them once, at positions that compose the grid-to-scene mapping with the homography.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import cv2
import numpy as np
import rasterio
from affine import Affine
from rasterio.crs import CRS
from rasterio.enums import ColorInterp, Resampling
from rasterio.vrt import WarpedVRT
from rasterio.warp import transform as transform_points
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


def common_grid(row: dict) -> Grid:
    """The common (pre-date) grid of a pair or slice row: its ``crs`` and ``transform`` columns."""
    return Grid(str(row["crs"]), tuple(float(v) for v in row["transform"]))


def holds_data(data: np.ndarray, nodata: float | None) -> np.ndarray:
    """True where a value is data: not ``nodata`` (a NaN nodata included, which ``!=`` misses)
    and, for floating-point rasters, finite."""
    data = np.asarray(data)
    if not np.issubdtype(data.dtype, np.floating):
        return np.ones(data.shape, bool) if nodata is None else data != nodata
    ok = np.isfinite(data)
    if nodata is not None and not np.isnan(nodata):
        ok &= data != nodata
    return ok


def _valid_mask(ds, data: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """True where every band holds data (GDAL's dataset mask, else nodata, else all valid);
    non-finite values of a float raster are never data."""
    valid = mask > 0 if mask is not None else np.ones(data.shape[1:], dtype=bool)
    if mask is None and ds.nodata is not None or np.issubdtype(data.dtype, np.floating):
        valid = valid & np.all(holds_data(data, ds.nodata), axis=0)
    return valid


def read_padded(src, indexes, window: Sequence[int], fill) -> np.ndarray:
    """Bands ``indexes`` (a list: (bands, H, W); an int: (H, W)) of an open raster at ``window`` =
    (col, row, w, h), which may run off the raster: the part inside is read directly and the rest
    filled with ``fill`` (rasterio serves boundless reads through a VRT, several times slower)."""
    col, row, width, height = (int(v) for v in window)
    c0, r0 = max(col, 0), max(row, 0)
    c1, r1 = min(col + width, src.width), min(row + height, src.height)
    if c0 == col and r0 == row and c1 == col + width and r1 == row + height:
        return src.read(indexes, window=Window(col, row, width, height))
    lead = (len(indexes),) if isinstance(indexes, (list, tuple)) else ()
    out = np.full((*lead, height, width), fill, dtype=src.dtypes[0])
    if c1 > c0 and r1 > r0:
        out[..., r0 - row:r1 - row, c0 - col:c1 - col] = src.read(
            indexes, window=Window(c0, r0, c1 - c0, r1 - r0))
    return out


def read_window(uri: str, window: Sequence[int], bands: Sequence[int] | None = None,
                grid: Grid | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Read ``window`` = (col_off, row_off, width, height) as (bands, H, W) plus a validity mask.

    With ``grid`` the raster is warped onto that grid first (bilinear), so the window is in the
    grid's pixel coordinates; pixels outside the source come back invalid, never as fake zeros.
    Windows running off the raster are padded and marked invalid (boundless read).
    """
    col, row, width, height = (int(v) for v in window)
    with rasterio.Env(**gdal_env()):
        with rasterio.open(gdal_path(uri)) as src:
            idx = list(bands) if bands else list(range(1, src.count + 1))
            shift = None if grid is None else whole_pixel_shift(src, grid)
            if shift is not None:
                # The grid is the raster's own, or moved by whole pixels: a warp would only
                # copy pixels (bilinear weights 1 and 0), so they are read directly.
                col, row, grid = col + shift[0], row + shift[1], None
                window = (col, row, width, height)
            win = Window(col, row, width, height)
            if grid is None:
                # rasterio serves boundless reads through a VRT: several times slower, so only
                # for windows that really run off the raster.
                off = not (col >= 0 and row >= 0 and col + width <= src.width
                           and row + height <= src.height)
                data = read_padded(src, idx, window, 0)
                mask = src.dataset_mask(window=win, boundless=off) if src.nodata is not None or \
                    _has_internal_mask(src) else None
                if mask is None:
                    # Boundless reads pad with zeros: mark the padding invalid by geometry.
                    valid = window_in_raster(window, src.width, src.height) & \
                        np.all(holds_data(data, None), axis=0)
                else:
                    valid = _valid_mask(src, data, mask) & \
                        window_in_raster(window, src.width, src.height)
                return data, valid
            # Warp onto the target grid; a large-enough VRT covers the requested window.
            vrt_width = max(col + width, 1)
            vrt_height = max(row + height, 1)
            # A scene with its own alpha band keeps it (WarpedVRT refuses to add a second one);
            # without nodata or alpha, an added alpha band marks where the source has pixels.
            add_alpha = src.nodata is None and not has_alpha(src)
            with WarpedVRT(src, crs=CRS.from_user_input(grid.crs), transform=grid.affine,
                           width=vrt_width, height=vrt_height, resampling=Resampling.bilinear,
                           src_nodata=src.nodata if src.nodata is not None else None,
                           nodata=src.nodata if src.nodata is not None else None,
                           add_alpha=add_alpha) as vrt:
                data = vrt.read(idx, window=win)
                if add_alpha:
                    valid = vrt.read(vrt.count, window=win) > 0
                else:
                    valid = vrt.dataset_mask(window=win) > 0
                return data, valid & np.all(holds_data(data, src.nodata), axis=0)


def has_alpha(src) -> bool:
    return ColorInterp.alpha in src.colorinterp


def scene_positions(uri: str, grid: Grid, grid_x: np.ndarray, grid_y: np.ndarray,
                    step: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Pixel positions in the scene's own raster of points given in ``grid`` pixel coordinates.

    Same CRS: exact (two affine maps). Other CRS: reprojected on every ``step``-th point of the
    (H, W) position arrays and interpolated linearly in between (reprojection is smooth at that
    scale: errors far below a hundredth of a pixel).
    """
    with rasterio.Env(**gdal_env()):
        with rasterio.open(gdal_path(uri)) as src:
            src_crs, inv = src.crs, ~src.transform
    to_world = grid.affine
    target = CRS.from_user_input(grid.crs)
    if src_crs == target:
        wx = to_world.a * (grid_x + 0.5) + to_world.b * (grid_y + 0.5) + to_world.c
        wy = to_world.d * (grid_x + 0.5) + to_world.e * (grid_y + 0.5) + to_world.f
        return _to_pixels(inv, wx, wy)
    h, w = grid_x.shape
    ys = np.unique(np.r_[np.arange(0, h, step), h - 1])
    xs = np.unique(np.r_[np.arange(0, w, step), w - 1])
    gx, gy = grid_x[np.ix_(ys, xs)], grid_y[np.ix_(ys, xs)]
    wx = to_world.a * (gx + 0.5) + to_world.b * (gy + 0.5) + to_world.c
    wy = to_world.d * (gx + 0.5) + to_world.e * (gy + 0.5) + to_world.f
    tx, ty = transform_points(target, src_crs, wx.ravel().tolist(), wy.ravel().tolist())
    px, py = _to_pixels(inv, np.reshape(tx, gx.shape), np.reshape(ty, gx.shape))
    fine_y, fine_x = np.arange(h), np.arange(w)
    return (_interp2(ys, xs, px, fine_y, fine_x), _interp2(ys, xs, py, fine_y, fine_x))


def whole_pixel_shift(src, grid: Grid, tol: float = 1e-9) -> tuple[int, int] | None:
    """(columns, rows) to add to a ``grid`` pixel to get the open raster ``src``'s pixel when
    the two grids differ by whole pixels only (same CRS, pixel size and orientation), else None."""
    if src.crs is None or src.crs != CRS.from_user_input(grid.crs):
        return None
    m = ~src.transform * grid.affine
    dc, dr = round(m.c), round(m.f)
    if max(abs(m.a - 1), abs(m.b), abs(m.d), abs(m.e - 1), abs(m.c - dc), abs(m.f - dr)) > tol:
        return None
    return int(dc), int(dr)


def grid_to_scene(uri: str, grid: Grid) -> np.ndarray | None:
    """The 3 x 3 affine matrix taking ``grid`` pixel positions to the scene's own pixel
    positions (centres at integers, as :func:`scene_positions`) when the scene shares the
    grid's CRS, else None (a reprojection is no matrix). Composed with a homography into the
    grid, the positions of a whole crop come from one evaluation instead of three maps."""
    with rasterio.Env(**gdal_env()):
        with rasterio.open(gdal_path(uri)) as src:
            src_crs, inv = src.crs, ~src.transform
    if src_crs != CRS.from_user_input(grid.crs):
        return None
    half = np.array([[1, 0, 0.5], [0, 1, 0.5], [0, 0, 1]], np.float64)
    back = np.array([[1, 0, -0.5], [0, 1, -0.5], [0, 0, 1]], np.float64)
    m = inv * grid.affine
    return back @ np.array([[m.a, m.b, m.c], [m.d, m.e, m.f], [0, 0, 1]], np.float64) @ half


def _to_pixels(inv: Affine, wx: np.ndarray, wy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """World -> pixel-centre coordinates (centres at integers) under an inverse affine."""
    return (inv.a * wx + inv.b * wy + inv.c - 0.5, inv.d * wx + inv.e * wy + inv.f - 0.5)


def _interp2(ys, xs, values, fine_y, fine_x) -> np.ndarray:
    """Separable linear interpolation of a coarse lattice onto every pixel."""
    rows = np.stack([np.interp(fine_x, xs, v) for v in values])
    return np.stack([np.interp(fine_y, ys, c) for c in rows.T], axis=1)


def read_at(uri: str, bands: Sequence[int], grid: Grid, grid_x: np.ndarray, grid_y: np.ndarray,
            resample) -> tuple[np.ndarray, np.ndarray]:
    """The scene sampled at (H, W) positions given in ``grid`` pixel coordinates, resampling its
    own pixels once (``resample(data, valid, map_x, map_y)``, e.g. ``registration.remap_bands``)."""
    px, py = scene_positions(uri, grid, grid_x, grid_y)
    return read_at_scene(uri, bands, px, py, resample)


def read_at_scene(uri: str, bands: Sequence[int], px: np.ndarray, py: np.ndarray,
                  resample) -> tuple[np.ndarray, np.ndarray]:
    """:func:`read_at` with the positions given in the scene's own pixels (centres at
    integers)."""
    finite = np.isfinite(px) & np.isfinite(py)
    if not finite.any():
        return np.zeros((len(bands),) + px.shape, np.uint8), np.zeros(px.shape, bool)
    sigma = antialias_sigma(sample_step(px, py))
    margin = 2 + int(np.ceil(3 * sigma))  # interpolation (and prefilter) support
    # A homography's positions are finite everywhere (no copy of a million positions to skip
    # the odd non-finite one).
    fx, fy = (px, py) if finite.all() else (px[finite], py[finite])
    c0 = int(np.floor(fx.min())) - margin
    r0 = int(np.floor(fy.min())) - margin
    c1 = int(np.ceil(fx.max())) + margin + 1
    r1 = int(np.ceil(fy.max())) + margin + 1
    data, valid = read_window_anywhere(uri, (c0, r0, c1 - c0, r1 - r0), bands)
    if sigma > 0:
        data = prefilter(data, valid, sigma)
    return resample(data, valid, (px - c0).astype(np.float32), (py - r0).astype(np.float32))


def sample_step(px: np.ndarray, py: np.ndarray) -> float:
    """Median distance, in source pixels, between the positions of neighbouring target pixels
    (> 1: the source is finer than the target grid)."""
    # Every 4th line across the step's direction: the mapping is smooth, the median the same.
    steps = []
    if px.shape[0] > 1:
        steps.append(np.hypot(np.diff(px[:, ::4], axis=0), np.diff(py[:, ::4], axis=0)))
    if px.shape[1] > 1:
        steps.append(np.hypot(np.diff(px[::4], axis=1), np.diff(py[::4], axis=1)))
    vals = [float(np.nanmedian(s)) for s in steps if np.isfinite(s).any()]
    return max(vals) if vals else 1.0


def antialias_sigma(step: float) -> float:
    """Gaussian sigma (source px) that removes what a sampling every ``step`` px would alias;
    0 when the source is not finer than the target."""
    return 0.5 * float(np.sqrt(step * step - 1.0)) if step > 1.05 else 0.0


def prefilter(data: np.ndarray, valid: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian low-pass of every band before point sampling a finer source (normalised by the
    valid pixels' weights, so nodata does not bleed into the data)."""
    w = valid.astype(np.float32)
    wb = cv2.GaussianBlur(w, (0, 0), sigma, borderType=cv2.BORDER_REPLICATE)
    out = np.empty_like(data)
    for i, band in enumerate(data):
        b = cv2.GaussianBlur(band.astype(np.float32) * w, (0, 0), sigma,
                             borderType=cv2.BORDER_REPLICATE)
        with np.errstate(invalid="ignore", divide="ignore"):
            f = np.where(wb > 0, b / np.maximum(wb, 1e-6), 0.0)
        if np.issubdtype(data.dtype, np.integer):
            info = np.iinfo(data.dtype)
            f = np.clip(np.rint(f), info.min, info.max)
        out[i] = f.astype(data.dtype)
    return out


def read_window_anywhere(uri: str, window: Sequence[int], bands: Sequence[int] | None = None,
                         grid: Grid | None = None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`read_window` that also takes windows starting left of / above the raster (or grid)
    origin; the part outside comes back invalid."""
    col, row, width, height = (int(v) for v in window)
    c0, r0 = max(col, 0), max(row, 0)
    w, h = width - (c0 - col), height - (r0 - row)
    n = len(bands) if bands else 1
    if w <= 0 or h <= 0:
        return np.zeros((n, height, width), np.uint8), np.zeros((height, width), bool)
    data, valid = read_window(uri, (c0, r0, w, h), bands, grid=grid)
    if (c0, r0) == (col, row):
        return data, valid
    out = np.zeros((data.shape[0], height, width), data.dtype)
    ok = np.zeros((height, width), bool)
    out[:, r0 - row:, c0 - col:] = data
    ok[r0 - row:, c0 - col:] = valid
    return out, ok


def _has_internal_mask(src) -> bool:
    from rasterio.enums import MaskFlags
    return any(MaskFlags.per_dataset in f or MaskFlags.alpha in f for f in src.mask_flag_enums)


def window_in_raster(window: Sequence[int], raster_width: int, raster_height: int) -> np.ndarray:
    """(h, w) bool: the pixels of ``window`` = (col, row, w, h) that lie inside a raster of
    ``raster_width`` x ``raster_height`` pixels (a window may start at negative offsets)."""
    col, row, width, height = (int(v) for v in window)
    rows = np.arange(row, row + height)
    cols = np.arange(col, col + width)
    return ((rows >= 0) & (rows < raster_height))[:, None] & ((cols >= 0) & (cols < raster_width))[None, :]


def grid_bbox(gx: np.ndarray, gy: np.ndarray, margin: int = 2) -> list[int]:
    """The common-grid window holding every position (plus interpolation support)."""
    c0, r0 = int(np.floor(np.nanmin(gx))) - margin, int(np.floor(np.nanmin(gy))) - margin
    c1, r1 = int(np.ceil(np.nanmax(gx))) + margin + 1, int(np.ceil(np.nanmax(gy))) + margin + 1
    return [c0, r0, c1 - c0, r1 - r0]
