"""Pure cores of the pairs job: catalogue, pair selection, slice windows, 8-bit conversion, labels,
splits. No Ray here."""
from __future__ import annotations

import datetime as dt
import shutil

import numpy as np
import pytest
import rasterio

from operators.pairs.catalogue.catalogue import (SceneInput, date_from_name, list_scene_inputs, parse_date,
                                                 read_scene_header)
from operators.pairs.labels.labels import merge_label_maps
from operators.pairs.selection.pairing import PairingConfig, box_iou, footprint_iou, group_by_location, select_pairs
from operators.pairs.imagery.radiometry import band_percentiles, scene_stretch, to_uint8
from operators.pairs.selection.slicing import axis_starts, intersection_window, slice_rows, slice_windows
from operators.pairs.selection.splits import assign_splits, list_files, parse_fractions
from tests.conftest import DATA

NAIP = sorted((DATA / "naip").glob("*.tif"))


def scene(uri="s", acquired="2020-01-01", bounds=(0, 0, 1000, 1000), crs="EPSG:32614",
          res=1.0, location=None, **kw):
    left, bottom, right, top = bounds
    return {"scene_id": uri, "uri": uri, "acquired": acquired, "crs": crs, "bounds": list(bounds),
            "transform": [res, 0.0, left, 0.0, -res, top], "width": int((right - left) / res),
            "height": int((top - bottom) / res), "location": location, "rgb_bands": [1, 2, 3],
            "stretch": [[0, 255]] * 3, **kw}


# -- catalogue ------------------------------------------------------------------------------
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


# -- pairing --------------------------------------------------------------------------------
def test_iou_and_crs_aware_footprints():
    assert box_iou((0, 0, 10, 10), (0, 0, 10, 10)) == 1.0
    assert box_iou((0, 0, 10, 10), (5, 0, 15, 10)) == pytest.approx(1 / 3)
    assert box_iou((0, 0, 1, 1), (2, 2, 3, 3)) == 0.0
    a = read_scene_header(SceneInput(str(NAIP[1])))
    # The same footprint expressed in geographic coordinates still overlaps almost perfectly.
    from rasterio.warp import transform_bounds
    b = dict(a, crs="EPSG:4326", bounds=list(transform_bounds(a["crs"], "EPSG:4326", *a["bounds"])))
    assert footprint_iou(a, b) > 0.95


def test_pair_rules_gap_iou_lookback_and_reasons():
    cfg = PairingConfig(reference_date="2021-01-01")
    scenes = [
        scene("old", "2009-08-18"), scene("a", "2016-08-16"), scene("b", "2017-08-27"),
        scene("c", "2017-09-01"), scene("shifted", "2019-06-01", bounds=(400, 0, 1400, 1000)),
        scene("future", "2022-01-01"),
    ]
    for s in scenes:
        s["location"] = "x"
    pairs = {(p["pre_scene"], p["post_scene"]): p for p in select_pairs(scenes, cfg)}
    assert len(pairs) == 15  # every candidate is recorded
    assert pairs[("a", "b")]["status"] == "accepted" and pairs[("a", "b")]["gap_days"] == 376
    assert "days apart" in pairs[("b", "c")]["reason"]
    assert "older than 10 years" in pairs[("old", "a")]["reason"]
    assert "after the reference date" in pairs[("a", "future")]["reason"]
    assert "IoU 0.429" in pairs[("a", "shifted")]["reason"]
    # IoU exactly at the threshold is not "above" it.
    cfg2 = PairingConfig(reference_date="2021-01-01", min_iou=0.4285714)
    ok = {(p["pre_scene"], p["post_scene"]): p for p in select_pairs(scenes, cfg2)}
    assert ok[("a", "shifted")]["status"] == "accepted"


def test_crs_mismatch_that_breaks_overlap_is_rejected_with_reason():
    cfg = PairingConfig(reference_date="2021-01-01")
    a = scene("a", "2016-01-01", location="x")
    # Same numbers, wrong CRS: once reprojected the footprints are nowhere near each other.
    b = scene("b", "2019-01-01", crs="EPSG:3857", location="x")
    [p] = select_pairs([a, b], cfg)
    assert p["status"] == "rejected" and "CRS EPSG:32614 vs EPSG:3857" in p["reason"]


def test_locations_grouped_by_overlap_when_not_given():
    s = [scene("a", "2016-01-01"), scene("b", "2018-01-01", bounds=(100, 0, 1100, 1000)),
         scene("far", "2018-01-01", bounds=(10000, 0, 11000, 1000))]
    groups = group_by_location(s)
    assert sorted(len(g) for g in groups.values()) == [1, 2]


def utm_tile(name, acquired, col, width=5000.0, step=4750.0):
    """A 5 km tile in UTM 14N at about 45 N, ``col`` steps east (5 % overlap with its neighbour)."""
    x0, y0 = 500000.0 + col * step, 5000000.0
    return scene(name, acquired, bounds=(x0, y0, x0 + width, y0 + width), res=10.0)


def test_fifty_overlapping_tiles_do_not_chain_into_one_location():
    tiles = [utm_tile(f"t{i:02d}-{y}", f"{y}-06-01", i) for i in range(50) for y in (2016, 2019)]
    cfg = PairingConfig(reference_date="2021-01-01")
    pairs = select_pairs(tiles, cfg)
    # Each tile pairs with its own second date only: neighbours (IoU 0.026) are not the same place.
    assert len(pairs) == 50
    assert all(p["pre_scene"].split("-")[0] == p["post_scene"].split("-")[0] for p in pairs)
    assert all(p["status"] == "accepted" for p in pairs)
    # Locations are fixed 0.1 degree cells (~8 km here): many of them, never one for the strip.
    locations = {p["location"] for p in pairs}
    assert len(locations) >= 25
    assert len(set(assign_splits(locations, (0.7, 0.1, 0.2), seed=0).values())) == 3


def _slice_splits(scenes):
    cfg = PairingConfig(reference_date="2021-01-01")
    pairs = [p for p in select_pairs(scenes, cfg) if p["status"] == "accepted"]
    splits = assign_splits({p["location"] for p in pairs}, (0.7, 0.1, 0.2), seed=3)
    by_id = {s["scene_id"]: s for s in scenes}
    out = {}
    for p in pairs:
        for r in slice_rows(p, by_id[p["pre_scene"]], by_id[p["post_scene"]], 200, 200,
                            splits[p["location"]]):
            out[r["slice_id"]] = (r["location"], r["split"])
    return out


def test_adding_a_location_and_an_older_scene_moves_no_existing_slice():
    # 40 places 20 km apart, two dates each; then a run that also sees one more place and an
    # older scene of place 0 (the earliest scene there now).
    places = []
    for i in range(40):
        for y in (2016, 2019):
            t = utm_tile(f"p{i:02d}-{y}", f"{y}-06-01", 0)
            dx, dy = (i % 8) * 20000.0, (i // 8) * 20000.0
            t["bounds"] = [t["bounds"][0] + dx, t["bounds"][1] + dy, t["bounds"][2] + dx, t["bounds"][3] + dy]
            t["transform"] = [10.0, 0.0, t["bounds"][0], 0.0, -10.0, t["bounds"][3]]
            places.append(t)
    before = _slice_splits(places)
    extra = utm_tile("new-2016", "2016-06-01", 0)
    extra["bounds"] = [b + 200000.0 for b in extra["bounds"]]
    extra["transform"] = [10.0, 0.0, extra["bounds"][0], 0.0, -10.0, extra["bounds"][3]]
    extra2 = dict(extra, scene_id="new-2019", uri="new-2019", acquired="2019-06-01")
    older = dict(places[0], scene_id="p00-2012", uri="p00-2012", acquired="2012-06-01")
    after = _slice_splits(places + [extra, extra2, older])
    assert len(before) >= 40 and len(after) > len(before)
    assert len(set(v[1] for v in before.values())) == 3
    moved = {k: (v, after.get(k)) for k, v in before.items() if after.get(k) != v}
    assert not moved
    # The older scene's new pairs live at the same location, in the same split, as place 0's.
    place0 = {v for k, v in after.items() if "20120601" in k}
    assert place0 and place0 <= set(before.values())


# -- slicing --------------------------------------------------------------------------------
def test_axis_starts_cover_edges_flush():
    assert axis_starts(0, 3000, 3000, 1024) == [0]
    assert axis_starts(0, 5000, 3000, 1024) == [0, 1024, 2000]
    assert axis_starts(0, 5048, 3000, 1024) == [0, 1024, 2048]
    assert axis_starts(10, 2999, 3000, 1024) == []
    starts = axis_starts(0, 10000, 3000, 1024)
    assert starts[-1] + 3000 == 10000 and all(b - a <= 1024 for a, b in zip(starts, starts[1:]))


def test_windows_on_pre_grid_from_geographic_intersection():
    pre = scene("pre", bounds=(0, 0, 6000, 6000))
    post = scene("post", bounds=(500.4, -100, 6500, 5900), res=0.5)
    assert intersection_window(pre, post) == (501, 100, 6000, 6000)
    wins = slice_windows(pre, post, 3000, 1024)
    cols = sorted({w[0] for w in wins})
    rows = sorted({w[1] for w in wins})
    assert cols == [501, 1525, 2549, 3000] and rows == [100, 1124, 2148, 3000]
    assert all(c + 3000 <= 6000 and r + 3000 <= 6000 for c, r, _, _ in wins)


def test_slice_rows_carry_uris_and_windows_only():
    pre, post = scene("pre", bounds=(0, 0, 2000, 2000)), scene("post", "2022-01-01", bounds=(0, 0, 2000, 2000))
    pair = {"pair_id": "p1", "location": "x"}
    rows = slice_rows(pair, pre, post, 1000, 500, "train")
    assert len(rows) == 9 and rows[0]["slice_id"] == "p1_r00000_c00000"
    assert rows[-1]["window"] == [1000, 1000, 1000, 1000]
    assert not any(isinstance(v, np.ndarray) for r in rows for v in r.values())


# -- 8-bit conversion -----------------------------------------------------------------------
def test_uint16_to_uint8_uses_scene_stretch():
    data = np.array([[[100, 200, 300, 40000]]], dtype=np.uint16)
    out = to_uint8(data, [[100, 300]])
    assert out.shape == (1, 4, 1) and out.dtype == np.uint8
    assert out[0, :, 0].tolist() == [0, 128, 255, 255]
    valid = np.array([[True, True, False, True]])
    assert to_uint8(data, [[100, 300]], valid)[0, 2, 0] == 0
    # Percentiles ignore invalid (nodata) pixels.
    d = np.zeros((1, 10, 10), np.uint16)
    d[0, :, 5:] = np.arange(50).reshape(10, 5) + 1000
    v = d[0] > 0
    lo, hi = band_percentiles(d, v, (0, 100))[0]
    assert (lo, hi) == (1000.0, 1049.0)


def test_real_uint16_band_stretch_is_per_scene():
    uri = str(DATA / "uint16" / "l8_B4.tif")
    [[lo, hi]] = scene_stretch(uri)
    with rasterio.open(uri) as src:
        full = src.read(1)
    assert np.percentile(full, 2) == pytest.approx(lo, rel=0.05)
    assert np.percentile(full, 98) == pytest.approx(hi, rel=0.05)
    wa, wb = full[:100, :100], full[300:400, 300:400]
    a = to_uint8(wa[None], [[lo, hi]])[:, :, 0]
    b = to_uint8(wb[None], [[lo, hi]])[:, :, 0]
    assert a.dtype == b.dtype == np.uint8
    # The scene's linear mapping, computed independently, in both windows.
    for window, out in ((wa, a), (wb, b)):
        expect = np.clip(np.rint(255 * (window.astype(float) - lo) / (hi - lo)), 0, 255)
        assert np.abs(out.astype(int) - expect).max() <= 1
    # Same value, same byte, wherever the slice is: a DN present in both windows.
    shared = np.intersect1d(wa, wb)
    assert shared.size
    v = shared[len(shared) // 2]
    assert set(a[wa == v].tolist()) == set(b[wb == v].tolist()) and len(set(a[wa == v].tolist())) == 1


# -- labels ---------------------------------------------------------------------------------
def test_label_merge_is_union_and_checks_size():
    new = np.zeros((4, 4), np.uint8)
    new[0, 0] = 255
    gone = np.zeros((4, 4, 3), np.uint8)
    gone[3, 3] = (1, 1, 1)
    merged = merge_label_maps(new, gone)
    assert merged.dtype == np.uint8 and set(np.unique(merged)) == {0, 255}
    assert merged[0, 0] == 255 and merged[3, 3] == 255 and merged.sum() == 2 * 255
    with pytest.raises(ValueError, match="differ in size"):
        merge_label_maps(new, np.zeros((4, 5), np.uint8))
    with pytest.raises(ValueError, match="slice crop is 8x8"):
        merge_label_maps(new, new, expected_shape=(8, 8))


# -- splits ---------------------------------------------------------------------------------
def test_splits_by_location_seeded():
    locs = [f"loc{i}" for i in range(2000)]
    a = assign_splits(locs, (0.7, 0.1, 0.2), seed=1)
    assert a == assign_splits(reversed(locs), (0.7, 0.1, 0.2), seed=1)
    counts = {s: list(a.values()).count(s) for s in ("train", "val", "test")}
    assert abs(counts["train"] - 1400) < 80 and abs(counts["val"] - 200) < 50 and abs(counts["test"] - 400) < 70
    assert a != assign_splits(locs, (0.7, 0.1, 0.2), seed=2)
    # A location's split does not depend on which other locations are assigned with it.
    assert assign_splits(locs[:10], (0.7, 0.1, 0.2), seed=1) == {k: a[k] for k in locs[:10]}
    assert parse_fractions("7,1,2") == pytest.approx((0.7, 0.1, 0.2))
    with pytest.raises(ValueError):
        parse_fractions("1,2")
    assert list_files([("b", "test"), ("a", "train")]) == {"train": ["a.png"], "val": [], "test": ["b.png"]}


# -- reading onto the common grid -----------------------------------------------------------
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


def test_footprint_iou_uses_stac_geometry_not_the_tile_bounds():
    """Two items of one Sentinel-2 tile (same bounds, 109.8 km): one full, one an orbit's
    10 % sliver along the tile's west edge. Their bounding boxes agree (IoU 1); their footprints
    overlap by 10 %, and the pair is not the same place."""
    import json
    from rasterio.warp import transform as warp
    left, bottom, right, top = 500000.0, 5090200.0, 609800.0, 5200000.0
    cut = left + 0.1 * (right - left)

    def lonlat_ring(x0, x1):
        xs, ys = warp("EPSG:32633", "EPSG:4326", [x0, x1, x1, x0, x0], [bottom, bottom, top, top, bottom])
        return json.dumps({"type": "Polygon", "coordinates": [list(map(list, zip(xs, ys)))]})

    full = scene("full", "2023-08-13", bounds=(left, bottom, right, top), crs="EPSG:32633")
    sliver = scene("sliver", "2023-08-18", bounds=(left, bottom, right, top), crs="EPSG:32633")
    full["geometry"], sliver["geometry"] = lonlat_ring(left, right), lonlat_ring(left, cut)
    assert footprint_iou(full, sliver) == pytest.approx(0.1, abs=0.01)
    assert footprint_iou(full, dict(full, geometry=lonlat_ring(left, right))) == pytest.approx(1.0, abs=1e-3)
    for s in (full, sliver):
        s["location"] = "x"
    (pair,) = select_pairs([full, sliver], PairingConfig(reference_date="2024-01-01", min_gap_days=1))
    assert pair["status"] == "rejected" and "IoU 0.1" in pair["reason"]
