"""Scene catalogue: acquisition dates, scene headers, bad scenes, scene manifests and folder listing."""
from __future__ import annotations

import datetime as dt
import shutil

import numpy as np
import pytest
import rasterio

from operators.pairs.catalogue.catalogue import (SceneInput, date_from_name, list_scene_inputs, parse_date,
                                                 read_scene_header)
from tests.conftest import DATA
from tests.pairs._scenes import NAIP


def test_dates_from_tags_and_names():
    assert parse_date("2016:08:16 10:00:00") == dt.date(2016, 8, 16)
    assert parse_date("2020-08-31T12:00:00Z") == dt.date(2020, 8, 31)
    assert parse_date("not a date") is None
    assert date_from_name("m_4709963_se_14_1_20090818.tif") == dt.date(2009, 8, 18)
    assert date_from_name("scene_2021-03-04_rgb.tif") == dt.date(2021, 3, 4)
    assert date_from_name("scene_20211340.tif") is None  # month 13 is no date


def test_header_of_real_naip_scene():
    rec = read_scene_header(SceneInput(str(NAIP[1])))
    assert rec["crs"] == "EPSG:26914" and rec["count"] == 4 and rec["dtype"] == "uint8"
    assert rec["acquired"] == "2016-08-16" and rec["date_source"] == "filename"
    assert rec["rgb_bands"] == [1, 2, 3] and len(rec["stretch"]) == 3
    assert rec["width"] == 934 and rec["height"] == 723


def test_format_detected_by_content_not_extension():
    # Sentinel-2 band named .jp2 is really a GeoTIFF; it opens, but has no date anywhere.
    with pytest.raises(ValueError, match="no acquisition date"):
        read_scene_header(SceneInput(str(DATA / "uint16" / "s2_B8A.jp2")))
    rec = read_scene_header(SceneInput(str(DATA / "uint16" / "s2_B8A.jp2"), acquired="2019-05-01"))
    assert rec["driver"] == "GTiff" and rec["dtype"] == "uint16" and rec["rgb_bands"] == [1]


def test_bad_scenes_give_clear_errors(tmp_path):
    empty = tmp_path / "empty_20200101.tif"
    empty.write_bytes(b"")
    corrupt = tmp_path / "corrupt_20200101.tif"
    corrupt.write_bytes(NAIP[0].read_bytes()[:5000])  # a TIFF cut off after its header
    text = tmp_path / "notes_20200101.tif"
    text.write_text("this is not a raster")
    with pytest.raises(ValueError, match="empty file"):
        read_scene_header(SceneInput(str(empty)))
    # A truncated TIFF opens (its header is intact); reading its pixels then fails.
    with pytest.raises(ValueError, match="corrupt or truncated"):
        read_scene_header(SceneInput(str(corrupt)))
    with pytest.raises(ValueError, match="not a readable raster"):
        read_scene_header(SceneInput(str(text)))
    nocrs = tmp_path / "nocrs_20200101.tif"
    with rasterio.open(nocrs, "w", driver="GTiff", width=8, height=8, count=1, dtype="uint8") as dst:
        dst.write(np.ones((1, 8, 8), np.uint8))
    with pytest.raises(ValueError, match="no CRS"):
        read_scene_header(SceneInput(str(nocrs)))


def test_manifest_csv_with_relative_uris(tmp_path):
    for p in NAIP[:2]:
        shutil.copy(p, tmp_path / p.name)
    (tmp_path / "m.csv").write_text(
        "uri,acquired,location\n"
        f"{NAIP[0].name},2010-01-02,farm\n{NAIP[1].name},,farm\n")
    rows = list_scene_inputs(str(tmp_path / "m.csv"))
    assert [r.location for r in rows] == ["farm", "farm"]
    assert rows[0].uri == str(tmp_path / NAIP[0].name) and rows[0].acquired == "2010-01-02"
    assert read_scene_header(rows[0])["date_source"] == "manifest"
    assert read_scene_header(rows[1])["acquired"] == "2016-08-16"  # falls back to the file name


def test_manifest_parquet_and_csv_with_bom_read_alike(tmp_path):
    """Scene manifests and band manifests share one reader: Parquet, and CSV saved with a BOM."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from operators.pairs.catalogue.band_manifest import has_band_column

    pq.write_table(pa.table({"uri": ["a.tif", "/abs/b.tif"], "acquired": ["2020-01-02", None]}),
                   tmp_path / "m.parquet")
    (tmp_path / "m.csv").write_bytes("uri,acquired,band\r\na.tif,2020-01-02,B04\r\n".encode("utf-8-sig"))
    rows = list_scene_inputs(str(tmp_path / "m.parquet"))
    assert [(r.uri, r.acquired) for r in rows] == [(str(tmp_path / "a.tif"), "2020-01-02"),
                                                   ("/abs/b.tif", None)]
    rows = list_scene_inputs(str(tmp_path / "m.csv"))
    assert [(r.uri, r.acquired) for r in rows] == [(str(tmp_path / "a.tif"), "2020-01-02")]
    assert has_band_column(str(tmp_path / "m.csv")) and not has_band_column(str(tmp_path / "m.parquet"))


def test_folder_listing_skips_sidecars(tmp_path):
    shutil.copy(NAIP[0], tmp_path / NAIP[0].name)
    (tmp_path / "README.md").write_text("x")
    (tmp_path / (NAIP[0].name + ".aux.xml")).write_text("<x/>")
    assert [r.uri for r in list_scene_inputs(str(tmp_path))] == [str(tmp_path / NAIP[0].name)]
