"""Windowed reads onto the common grid."""
from __future__ import annotations

import numpy as np
import rasterio

from operators.pairs.catalogue.catalogue import SceneInput, read_scene_header
from operators.pairs.selection.pairing import PairingConfig, select_pairs
from operators.pairs.selection.slicing import slice_windows
from tests.pairs._scenes import NAIP


def test_post_in_another_crs_is_read_onto_the_pre_grid(tmp_path):
    """A post scene delivered in another CRS is resampled onto the pre grid by the windowed read."""
    import cv2
    from rasterio.warp import Resampling, calculate_default_transform, reproject

    from operators.pairs.imagery.raster_io import Grid, read_window

    src_path = NAIP[2]
    dst_path = tmp_path / "web_mercator_20200101.tif"
    with rasterio.open(src_path) as src:
        transform, width, height = calculate_default_transform(src.crs, "EPSG:3857", src.width,
                                                               src.height, *src.bounds)
        profile = dict(src.profile, crs="EPSG:3857", transform=transform, width=width, height=height)
        with rasterio.open(dst_path, "w", **profile) as dst:
            for b in range(1, src.count + 1):
                reproject(rasterio.band(src, b), rasterio.band(dst, b), resampling=Resampling.bilinear)
        grid = Grid(src.crs.to_string(), tuple(src.transform)[:6])
    window = (200, 150, 400, 400)
    native, nv = read_window(str(src_path), window, [1, 2, 3])
    warped, wv = read_window(str(dst_path), window, [1, 2, 3], grid=grid)
    assert warped.shape == native.shape and wv.mean() > 0.99
    (dx, dy), _ = cv2.phaseCorrelate(native[0].astype(np.float32), warped[0].astype(np.float32))
    assert np.hypot(dx, dy) < 1.0
    pre = read_scene_header(SceneInput(str(src_path)))
    post = read_scene_header(SceneInput(str(dst_path)))
    [pair] = select_pairs([pre, dict(post, acquired="2021-06-01")], PairingConfig(reference_date="2022-01-01"))
    assert pair["status"] == "accepted" and pair["iou"] > 0.9
    assert len(slice_windows(pre, post, 512, 256)) == 6


def test_grid_to_scene_composed_with_a_crop_homography_equals_the_three_maps(tmp_path):
    """The registered post crop's positions from one composed matrix (crop -> grid -> scene)
    equal the three maps one after another (crop -> grid by ``crop_positions_on_grid``, then
    ``scene_positions``) to far below 0.01 px at the paper's geometry, on a post scene whose
    origin and pixel size differ from the grid's; another CRS gives no matrix."""
    from affine import Affine
    from operators.pairs.imagery.raster_io import Grid, grid_to_scene, scene_positions
    from operators.pairs.registration.registration import (crop_positions_on_grid, crop_to_grid,
                                                           homography_positions)
    path = tmp_path / "post.tif"
    profile = {"driver": "GTiff", "dtype": "uint8", "count": 1, "width": 64, "height": 64,
               "crs": "EPSG:32618", "transform": Affine(0.5, 0, 500003.25, 0, -0.5, 4500011.75)}
    with rasterio.open(path, "w", **profile) as dst:
        dst.write(np.zeros((1, 64, 64), np.uint8))
    grid = Grid("EPSG:32618", (1.0, 0.0, 500000.0, 0.0, -1.0, 4500000.0))
    H = np.array([[1.0012, 0.0021, -23.4], [-0.0019, 0.9991, 17.8], [2.1e-6, -1.4e-6, 1.0]])
    window, off, crop = (9216, 8192, 3000, 3000), 988, 1024
    M = grid_to_scene(str(path), grid)
    assert M is not None
    px, py = homography_positions(M @ crop_to_grid(H, window, off), crop)
    rx, ry = scene_positions(str(path), grid, *crop_positions_on_grid(H, window, off, crop))
    assert np.abs(px - rx).max() < 1e-6 and np.abs(py - ry).max() < 1e-6
    assert abs(rx[0, 0] - px[0, 0]) < 1e-9 and np.ptp(px) > 2000     # a real, large map
    other = Grid("EPSG:32619", grid.transform)
    assert grid_to_scene(str(path), other) is None


def test_a_grid_moved_by_whole_pixels_is_read_directly_with_the_warps_values(tmp_path):
    """A post scene on the pre grid, or on it moved by whole pixels, is read without a warp:
    the same values and validity as the bilinear warp gives (weights 1 and 0), at windows
    inside, across the edges and outside the raster; a sub-pixel offset still warps."""
    from affine import Affine

    from operators.pairs.imagery import raster_io
    from operators.pairs.imagery.raster_io import Grid, read_window, read_window_anywhere

    rng = np.random.default_rng(0)
    data = rng.integers(1, 60000, (2, 300, 260)).astype(np.uint16)
    data[:, :20, :30] = 0                                  # nodata in a corner
    path = tmp_path / "post.tif"
    post_t = Affine(2.0, 0, 500006.0, 0, -2.0, 4499996.0)  # 3 px right, 2 px down of the grid
    with rasterio.open(path, "w", driver="GTiff", width=260, height=300, count=2,
                       dtype="uint16", crs="EPSG:32618", transform=post_t, nodata=0) as dst:
        dst.write(data)
    grid = Grid("EPSG:32618", (2.0, 0.0, 500000.0, 0.0, -2.0, 4500000.0))
    with rasterio.open(path) as src:
        assert raster_io.whole_pixel_shift(src, grid) == (-3, -2)
        assert raster_io.whole_pixel_shift(src, Grid(grid.crs, (2.0, 0.0, 500000.5, 0.0, -2.0,
                                                                4500000.0))) is None
        assert raster_io.whole_pixel_shift(src, Grid("EPSG:32619", grid.transform)) is None

    def warped(window):   # the warp path, forced
        real = raster_io.whole_pixel_shift
        raster_io.whole_pixel_shift = lambda src, grid: None
        try:
            return read_window_anywhere(str(path), window, [1, 2], grid)
        finally:
            raster_io.whole_pixel_shift = real

    for window in [(10, 12, 100, 90), (0, 0, 50, 40), (-7, -9, 60, 50), (230, 270, 80, 70),
                   (400, 500, 20, 20)]:
        fast, fast_ok = read_window_anywhere(str(path), window, [1, 2], grid)
        slow, slow_ok = warped(window)
        np.testing.assert_array_equal(fast_ok, slow_ok)
        np.testing.assert_array_equal(fast[:, fast_ok], slow[:, slow_ok])
    inside, ok = read_window(str(path), (40, 30, 100, 90), [1, 2], grid)
    assert ok.all()
    np.testing.assert_array_equal(inside, data[:, 28:118, 37:137])
