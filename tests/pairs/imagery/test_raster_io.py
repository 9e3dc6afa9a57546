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
