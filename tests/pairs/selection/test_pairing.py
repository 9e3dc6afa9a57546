"""Pair selection: footprint IoU, the pair rules and their reasons, locations."""
from __future__ import annotations

import pytest

from operators.pairs.catalogue.catalogue import SceneInput, read_scene_header
from operators.pairs.selection.pairing import PairingConfig, box_iou, footprint_iou, group_by_location, select_pairs
from operators.pairs.selection.splits import assign_splits
from tests.pairs._scenes import NAIP, scene, utm_tile


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
