"""Default RGB bands from the file's colour interpretation or band descriptions, not 1,2,3."""
from __future__ import annotations

import numpy as np
import rasterio
from affine import Affine
from rasterio.enums import ColorInterp

from operators.pairs.catalogue.catalogue import SceneInput, default_rgb_bands, read_scene_header


def write(path, count, descriptions=None, colorinterp=None):
    profile = {"driver": "GTiff", "dtype": "uint16", "count": count, "width": 32, "height": 32,
               "crs": "EPSG:32633", "transform": Affine(10, 0, 500000, 0, -10, 5000000)}
    with rasterio.open(path, "w", **profile) as dst:
        dst.write(np.arange(count * 32 * 32, dtype=np.uint16).reshape(count, 32, 32) + 1)
        for i, d in enumerate(descriptions or [], start=1):
            dst.set_band_description(i, d)
        if colorinterp:
            dst.colorinterp = colorinterp


def test_sentinel2_band_stack_gives_red_green_blue(tmp_path):
    path = tmp_path / "s2_20230815.tif"
    write(path, 4, ["B02", "B03", "B04", "B08"])  # blue, green, red, NIR: 1,2,3 would be BGR
    assert read_scene_header(SceneInput(str(path)))["rgb_bands"] == [3, 2, 1]


def test_colour_interpretation_and_alpha():
    ci = ["blue", "green", "red", "alpha"]
    assert default_rgb_bands(4, None, ci) == [3, 2, 1]
    assert default_rgb_bands(4, None, ["alpha", "gray", "undefined", "undefined"]) == [2, 3, 4]
    assert default_rgb_bands(2, None, ["gray", "alpha"]) == [1]
    assert default_rgb_bands(4, None, None, ["Red band", "green", "BLUE", None]) == [1, 2, 3]
    assert default_rgb_bands(4, [4, 3, 2], ci) == [4, 3, 2]  # an explicit choice wins


def test_rgba_file_excludes_alpha(tmp_path):
    path = tmp_path / "rgba_20200101.tif"
    write(path, 4, colorinterp=[ColorInterp.red, ColorInterp.green, ColorInterp.blue,
                                ColorInterp.alpha])
    assert read_scene_header(SceneInput(str(path)))["rgb_bands"] == [1, 2, 3]
