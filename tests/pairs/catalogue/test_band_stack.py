"""Per-band stacking: windows from each band asset onto one grid (issue 14)."""
from __future__ import annotations

import csv

import numpy as np
import pytest
import rasterio
from affine import Affine
from rasterio.enums import Resampling

from operators.pairs.catalogue.band_manifest import group_record, group_rows, has_band_column
from operators.pairs.catalogue.band_stack import BandAsset, Stack, read_band, read_stack, stack_stretch
from operators.pairs.imagery.cloud_masks import CloudConfig
from operators.pairs.imagery.raster_io import Grid
from tests.pairs.stac_zagreb import PRODUCTS, file_grid

P13 = PRODUCTS["20230813"]


def asset(path, name="b") -> BandAsset:
    g = file_grid(path)
    return BandAsset(name=name, href=str(path), crs=g["crs"], transform=tuple(g["transform"]),
                     width=g["shape"][1], height=g["shape"][0], nodata=g["nodata"], dtype=g["dtype"])


def plain(path) -> np.ndarray:
    with rasterio.Env(GDAL_DISABLE_READDIR_ON_OPEN="FALSE"), rasterio.open(path) as src:
        return src.read(1)


def test_native_read_needs_no_sidecar_and_marks_outside_invalid():
    red = asset(P13 / "B04.tif")
    data, valid = read_band(red, (-8, 900, 40, 30), red.grid)
    full = plain(P13 / "B04.tif")
    assert np.array_equal(data[:15, 8:], full[900:915, 0:32])
    assert not valid[:, :8].any() and not valid[15:].any()
    assert valid[:15, 8:].sum() == np.count_nonzero(full[900:915, 0:32])


def test_window_in_raster_marks_only_pixels_on_the_raster():
    from operators.pairs.imagery.raster_io import window_in_raster

    inside = window_in_raster((-2, 3, 5, 4), 4, 5)   # rows 3..6, cols -2..2 of a 4 x 5 raster
    expected = np.zeros((4, 5), bool)
    expected[:2, 2:] = True                           # rows 3-4, cols 0-2
    assert np.array_equal(inside, expected)


def test_plain_read_off_the_raster_marks_the_padding_invalid():
    from operators.pairs.imagery.raster_io import read_window

    path = P13 / "B04.tif"
    full = plain(path)
    data, valid = read_window(str(path), (-8, 900, 40, 30), [1])
    assert np.array_equal(data[0, :15, 8:], full[900:915, 0:32])
    assert not valid[:, :8].any() and not valid[15:].any() and valid[:15, 8:].any()


def test_stretch_reads_are_decimated_to_max_side():
    """Both stretches (plain scenes and band stacks) measure on this decimated read."""
    from operators.pairs.imagery.radiometry import decimated_shape

    assert decimated_shape(4000, 2000, 1024) == (512, 1024)
    assert decimated_shape(300, 200, 1024) == (200, 300)          # never upsampled
    assert decimated_shape(5000, 3, 1024) == (1, 1024)            # at least one row


def test_coarser_band_is_resampled_to_the_finest_grid(tmp_path):
    """A 240 m copy of B04 stacked with the 120 m original: the scene grid is the 120 m one and the
    coarse band comes back upsampled (bilinear) close to the original."""
    fine = asset(P13 / "B04.tif", "red")
    full = plain(P13 / "B04.tif")
    coarse_path = tmp_path / "B04_240m.tif"
    with rasterio.Env(GDAL_DISABLE_READDIR_ON_OPEN="FALSE"), rasterio.open(P13 / "B04.tif") as src:
        half = src.read(1, out_shape=(458, 458), resampling=Resampling.average)
    with rasterio.open(coarse_path, "w", driver="GTiff", width=458, height=458, count=1,
                       dtype="uint16", crs=fine.crs, nodata=0,
                       transform=fine.grid.affine @ Affine.scale(2)) as dst:
        dst.write(half, 1)
    coarse = asset(coarse_path, "red240")
    stack = Stack((coarse, fine))
    assert stack.finest() is fine
    got = read_stack(stack, (300, 300, 128, 96), fine.grid)
    assert got.data.shape == (2, 96, 128)
    assert np.array_equal(got.data[1], full[300:396, 300:428])
    # What a 240 m band upsampled should look like: the 120 m band under a 2x2 box filter.
    import cv2
    box = cv2.blur(full.astype(np.float32), (2, 2))

    def corr(dy, dx):
        ref = box[300 + dy:396 + dy, 300 + dx:428 + dx]
        return np.corrcoef(got.data[0].ravel().astype(float), ref.ravel())[0, 1]

    assert corr(0, 0) > 0.9
    assert corr(0, 0) > max(corr(1, 0), corr(0, 1), corr(-1, 0), corr(0, -1)) + 0.05  # in place


def test_warped_read_onto_a_shifted_grid():
    """Post scenes are read onto the pre grid: a grid shifted by whole pixels is a shifted read."""
    red = asset(P13 / "B04.tif")
    shifted = Grid(red.crs, (120.0, 0.0, 499980.0 + 5 * 120, 0.0, -120.0, 5100000.0 - 3 * 120))
    data, valid = read_band(red, (100, 200, 64, 64), shifted)
    full = plain(P13 / "B04.tif")
    assert valid.all()
    assert np.array_equal(data, full[203:267, 105:169])


def test_cloud_layer_is_read_nearest_and_makes_pixels_unusable():
    p18 = PRODUCTS["20230818"]
    stack = Stack((asset(p18 / "B04.tif"), asset(p18 / "B03.tif")),
                  cloud=None)
    from operators.pairs.catalogue.band_stack import CloudLayer
    cloudy = Stack(stack.bands, CloudLayer(asset(p18 / "SCL.tif", "scl"), "scl", (3, 8, 9, 10)))
    got = read_stack(cloudy, (0, 0, 915, 915), stack.finest().grid)
    scl = plain(p18 / "SCL.tif")
    assert np.array_equal(got.cloud, np.isin(scl, (3, 8, 9, 10)))
    assert not (got.usable() & got.cloud).any()
    assert 0.3 < got.cloud.mean() < 0.7
    # The stretch ignores clouds: bright cloud tops no longer set the 98th percentile.
    assert stack_stretch(cloudy)[0][1] < stack_stretch(stack)[0][1]


def test_band_manifest_stacks_like_stac(tmp_path):
    rows = []
    for date, folder in PRODUCTS.items():
        for band in ("B02", "B03", "B04", "SCL"):
            rows.append({"uri": str(folder / f"{band}.tif"), "acquired": f"{date[:4]}-{date[4:6]}-{date[6:]}",
                         "location": "zagreb", "band": band})
    manifest = tmp_path / "bands.csv"
    with open(manifest, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert has_band_column(str(manifest))
    groups = group_rows(str(manifest))
    assert len(groups) == len(PRODUCTS)
    key = next(k for k in groups if "20230813" in k.replace("-", ""))
    rec = group_record(key, groups[key], ["red", "green", "blue"], CloudConfig(cloud_mask="SCL"))
    stack = Stack.from_json(rec["stack"])
    assert [b.name for b in stack.bands] == ["B04", "B03", "B02"]
    assert stack.cloud.kind == "scl"
    assert rec["crs"] == "EPSG:32633" and rec["location"] == "zagreb"
    assert rec["acquired"] == "2023-08-13" and rec["transform"][0] == 120.0
    with pytest.raises(ValueError, match="no band 'nir'"):
        group_record(key, groups[key], ["nir"], CloudConfig())


def test_nan_nodata_is_invalid_in_band_and_plain_reads(tmp_path):
    """A float band with NaN as nodata (and one without any nodata declared): NaN pixels are no
    data in a stacked read and in a plain window read."""
    from operators.pairs.imagery.raster_io import read_window
    data = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    data[10:20, 5:30] = np.nan
    nan_px = np.isnan(data)
    tr = Affine(10, 0, 500000, 0, -10, 5000000)
    for name, nodata in (("declared.tif", float("nan")), ("undeclared.tif", None)):
        path = tmp_path / name
        with rasterio.open(path, "w", driver="GTiff", width=64, height=64, count=1,
                           dtype="float32", crs="EPSG:32633", transform=tr, nodata=nodata) as dst:
            dst.write(data, 1)
        band = BandAsset(name="b", href=str(path), crs="EPSG:32633", transform=tuple(tr)[:6],
                         width=64, height=64, nodata=nodata, dtype="float32")
        _, valid = read_band(band, (0, 0, 64, 64), band.grid)
        assert np.array_equal(valid, ~nan_px), name
        _, valid = read_window(str(path), (0, 0, 64, 64))
        assert np.array_equal(valid, ~nan_px), name
