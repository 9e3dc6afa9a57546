"""The Ray registration stage end to end on small GeoTIFF scenes written to tmp_path.

Scenes: the pre date is a real NAIP quarter-quad (4 bands, RGB used); the post date is derived
from it with a known homography (shift, rotation, scale about the centre) and a gain/gamma/offset
change, written with the same CRS and transform, nodata 0 where the warp leaves the source.
"""
from __future__ import annotations

import json

import cv2
import numpy as np
import pytest
import rasterio
from affine import Affine
from rasterio.enums import ColorInterp

from operators.io.images import decode_image
from operators.pairs.imagery.radiometry import scene_stretch
from operators.pairs.regional.regional_ops import (guided_rel, matches_rel, plan_tiles, prior_rel,
                                                   run_tile_stage, work_id)
from operators.pairs.stage.register_stage import METADATA_SCHEMA, registration_stage
from operators.pairs.registration.registration import RegistrationConfig, translation
from operators.pairs.imagery.raster_io import Grid, read_window
from operators.pairs.crops.slice_io import SHIFTS_SCHEMA, read_registered_post, screening_limit
from operators.io.storage import Store
from operators.io.tables import records_to_table, split_envelopes
from tests.pairs.registration.test_registration import NAIP, corner_errors, known_homography, make_post

SLICE, CROP = 512, 256
W_TRUE = known_homography(dx=-8.6, dy=5.3, degrees=0.4, scale=1.003, about=(467, 362))


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    root = tmp_path_factory.mktemp("scenes")
    with rasterio.open(NAIP) as src:
        pre = src.read()
        profile = src.profile
    post = make_post(pre, W_TRUE, pre.shape[1:])
    valid = make_post(np.full((1,) + pre.shape[1:], 255, np.uint8), W_TRUE, pre.shape[1:],
                      gain=1, offset=0, gamma=1)[0] == 255
    post[:, ~valid] = 0
    post[:, valid] = np.maximum(post[:, valid], 1)  # 0 is nodata
    profile.update(driver="GTiff", nodata=0)
    paths = {}
    for name, data in (("pre", pre), ("post", post),
                       ("noise", np.random.default_rng(3).integers(1, 255, pre.shape, np.uint8))):
        paths[name] = str(root / f"{name}.tif")
        with rasterio.open(paths[name], "w", **profile) as dst:
            dst.write(data)
    with rasterio.open(paths["pre"]) as src:
        crs, transform = src.crs.to_wkt(), list(src.transform)[:6]
    return paths, crs, transform


def slice_row(paths, crs, transform, pair, post, window, pre="pre") -> dict:
    return {
        "slice_id": f"{pair}_r{window[1]:05d}_c{window[0]:05d}", "pair_id": pair,
        "location": "naip", "split": "train", "pre_uri": paths.get(pre, pre),
        "post_uri": paths[post], "pre_scene": pre, "post_scene": post,
        "pre_date": "2016-08-16", "post_date": "2020-08-31", "crs": crs, "transform": transform,
        "window": list(window), "bands_pre": [1, 2, 3], "bands_post": [1, 2, 3],
        "stretch_pre": scene_stretch(paths.get(pre, pre), [1, 2, 3]) if pre in paths
        else [[0, 255]] * 3,
        "stretch_post": scene_stretch(paths[post], [1, 2, 3]),
    }


def all_rows(scenes):
    paths, crs, transform = scenes
    good = [slice_row(paths, crs, transform, "good", "post", w)
            for w in [(0, 0, SLICE, SLICE), (256, 0, SLICE, SLICE), (256, 200, SLICE, SLICE)]]
    noise = [slice_row(paths, crs, transform, "noise", "noise", (0, 0, SLICE, SLICE))]
    broken = [slice_row(paths, crs, transform, "broken", "post", (0, 0, SLICE, SLICE),
                        pre="/nonexistent/scene.tif")]
    return good, noise, broken


def run(rows, method, out_root):
    import ray.data
    cfg = RegistrationConfig(method=method, crop_size=CROP, tile_size=256, search_margin_px=32,
                             screen_window_px=64)
    ds = registration_stage(ray.data.from_items(rows), cfg, out_root, run_id="t1")
    return cfg, split_envelopes(ds.take_all())


@pytest.mark.parametrize("method", ["per-slice", "regional"])
def test_stage_end_to_end(ray_session, scenes, tmp_path, method):
    good, noise, broken = all_rows(scenes)
    out = str(tmp_path / "out")
    cfg, tables = run(good + noise + broken, method, out)
    meta = {r["slice_id"]: r for r in tables.get("metadata", [])}
    errors = {r["item"]: r for r in tables.get("errors", [])}
    # Every slice ends as exactly one envelope.
    assert len(meta) + len(errors) == len(good + noise + broken)
    assert set(meta) | set(errors) == {r["slice_id"] for r in good + noise + broken}
    assert not set(meta) & set(errors)

    store = Store(out)
    for row in good:
        rec = meta[row["slice_id"]]
        assert rec["status"] == "accepted", rec["reject_reason"]
        assert rec["reject_reason"] is None and rec["method"] == method
        assert rec["seconds"] > 0 and rec["cpu_seconds"] > 0
        col, r = row["window"][:2]
        W_slice = translation(-col, -r) @ W_TRUE @ translation(col, r)
        H = np.asarray(rec["homography"]).reshape(3, 3)
        assert np.median(corner_errors(H, W_slice, SLICE, CROP)) < 0.5
        # Screening measured the residual the known warp leaves (sub-pixel), over most of the crop.
        assert rec["residual_median_px"] < 0.5 and rec["screen_assessed_fraction"] > 0.8
        assert rec["window"] == [col + 128, r + 128, CROP, CROP]
        left, bottom, right, top = rec["bounds"]
        assert right - left == pytest.approx(CROP * 5.0) and top - bottom == pytest.approx(CROP * 5.0)
        for rel in (rec["image_a"], rec["image_b"]):
            image = decode_image(store.read_bytes(rel))
            assert image.shape == (CROP, CROP, 3)
        # The registered post crop looks like the pre crop (same place), not like a shifted one.
        a = decode_image(store.read_bytes(rec["image_a"]), grey=True).astype(float)
        b = decode_image(store.read_bytes(rec["image_b"]), grey=True).astype(float)
        assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.8

    # The shift field: one row per screening window with a peak, in px and metres (5 m NAIP).
    shifts = tables["shifts"]
    for row in good:
        mine = [s for s in shifts if s["slice_id"] == row["slice_id"]]
        kept = [s for s in mine if s["status"] == "kept"]
        assert len(kept) == meta[row["slice_id"]]["screen_windows"] >= 6
        assert all(s["shift_m"] == pytest.approx(5.0 * s["shift_px"]) for s in mine)
        assert max(s["shift_px"] for s in kept) <= meta[row["slice_id"]]["residual_px"] + 1e-9
        rmse = np.sqrt(np.mean([s["shift_px"] ** 2 for s in kept]))
        assert meta[row["slice_id"]]["shift_rmse_px"] == pytest.approx(rmse)
        assert meta[row["slice_id"]]["pixel_size_m"] == pytest.approx(5.0)
    assert records_to_table(shifts, SHIFTS_SCHEMA).num_rows == len(shifts)

    rec = meta[noise[0]["slice_id"]]
    assert rec["status"] == "rejected" and rec["reject_reason"]
    assert not store.exists(f"A/{rec['slice_id']}.png") and not store.exists(f"B/{rec['slice_id']}.png")

    err = errors[broken[0]["slice_id"]]
    assert err["stage"] == "registration" and err["message"]
    assert err["job"] == "build_pairs"       # the job that resolves it on a rerun

    # Records fit the declared schema (what the job's TableSink writes).
    table = records_to_table(list(meta.values()), METADATA_SCHEMA)
    assert table.num_rows == len(meta)


def test_regional_matches_are_reused_on_resume(ray_session, scenes, tmp_path):
    good, _, _ = all_rows(scenes)
    cfg = RegistrationConfig(method="regional", crop_size=CROP, tile_size=256, search_margin_px=32)
    out = str(tmp_path / "out")
    tiles = plan_tiles(good, cfg)
    # Slices overlap, so tiles are shared: fewer tiles than slices x tiles-per-slice.
    assert len(tiles) < 4 * len(good)
    first = run_tile_stage(tiles, cfg, out, "r1")
    assert all(not t["reused"] and t["n"] > 0 and t["error"] is None for t in first)
    store = Store(out)
    pair = work_id(good[0])
    assert pair.startswith("good-")
    assert store.exists(matches_rel(cfg, pair, 0, 0))
    # The pair's prior and every tile's guided matches (what slices fit) are stored too.
    assert store.exists(prior_rel(cfg, pair))
    assert all(store.exists(guided_rel(cfg, pair, t["tile_col"], t["tile_row"])) for t in tiles)
    assert not store.list("_work/features")  # dropped once the pair's matches are complete
    audit = json.loads(store.read_bytes("_work/tile_runs/r1.json"))
    assert len(audit["features"]) == len(audit["matches"]) == len(audit["guided"]) == len(tiles)
    assert [p["n"] > 0 and not p["error"] for p in audit["priors"]] == [True]
    second = run_tile_stage(tiles, cfg, out, "r2")
    assert all(t["reused"] for t in second)
    # Other feature settings must not reuse these matches.
    other = RegistrationConfig(method="regional", crop_size=CROP, tile_size=256,
                               search_margin_px=32, ratio=0.7)
    assert other.features_key() != cfg.features_key()
    assert not any(t["reused"] for t in run_tile_stage(tiles, other, out, "r3"))
    # Nor other bands read from the same scenes.
    rgb = plan_tiles([{**r, "bands_pre": [3, 2, 1], "bands_post": [3, 2, 1]} for r in good], cfg)
    assert not any(t["reused"] for t in run_tile_stage(rgb, cfg, out, "r4"))


def test_regional_stage_writes_to_s3(ray_session, scenes, s3_bucket):
    good, _, _ = all_rows(scenes)
    out = f"s3://{s3_bucket}/pairs"
    _, tables = run(good[:1], "regional", out)
    (rec,) = tables["metadata"]
    assert rec["status"] == "accepted", rec["reject_reason"]
    store = Store(out)
    assert store.exists(rec["image_a"]) and store.exists(rec["image_b"])
    assert any("/good-" in rel for rel in store.list("_work/matches", suffixes=(".npz",)))
    assert json.dumps(rec)  # plain JSON-able record


def test_registered_post_is_resampled_once_from_its_own_pixels(tmp_path):
    """Post scene on another grid (origin shifted by 0.5 px, so the VRT copy on the pre grid is
    interpolated): the B crop must equal one bilinear resampling of the post scene's own pixels
    at the composed positions, not a resampling of that resampled copy."""
    with rasterio.open(NAIP) as src:
        data = src.read([1, 2, 3])[:, :400, :400]
        profile = src.profile
        transform = src.transform
    profile.update(driver="GTiff", count=3, width=400, height=400, nodata=None)
    pre_path, post_path = str(tmp_path / "pre.tif"), str(tmp_path / "post.tif")
    with rasterio.open(pre_path, "w", **{**profile, "transform": transform}) as dst:
        dst.write(data)
    shifted = transform @ Affine.translation(0.5, 0.25)  # post pixel (i, j) sits at grid (i+.5, j+.25)
    with rasterio.open(post_path, "w", **{**profile, "transform": shifted}) as dst:
        dst.write(data)
    row = {"window": [0, 0, 256, 256], "post_uri": post_path, "bands_post": [1, 2, 3],
           "crs": profile["crs"].to_wkt(), "transform": list(transform)[:6]}
    cfg = RegistrationConfig(crop_size=128)
    H = translation(1.3, -0.6)   # post slice -> pre slice
    out, valid = read_registered_post(row, H, cfg)
    assert valid.all()
    # Crop pixel (u, v) -> pre slice (u + 64, v + 64) -> grid (u + 62.7, v + 64.6) -> post pixel
    # (u + 62.2, v + 64.35): exactly one bilinear interpolation of the stored values.
    v, u = np.mgrid[0:128, 0:128].astype(np.float32)
    expect = np.stack([cv2.remap(b, u + 62.2, v + 64.35, cv2.INTER_LINEAR) for b in data])
    assert np.abs(out.astype(int) - expect.astype(int)).max() <= 1


def test_alpha_band_post_reads_on_the_grid(tmp_path):
    """A GeoTIFF with an alpha band (ExtraSamples) resampled onto a grid: WarpedVRT refused to add
    a second alpha band ("The VRT already has an alpha band"); alpha 0 must come back invalid."""
    data = np.full((4, 64, 64), 200, np.uint8)
    data[3, :, :10] = 0
    profile = {"driver": "GTiff", "dtype": "uint8", "count": 4, "width": 64, "height": 64,
               "crs": "EPSG:32633", "transform": Affine(10, 0, 500000, 0, -10, 5000000),
               "photometric": "RGB", "alpha": "YES"}
    path = str(tmp_path / "rgba.tif")
    with rasterio.open(path, "w", **profile) as dst:
        dst.write(data)
    with rasterio.open(path) as src:
        assert src.colorinterp[3] == ColorInterp.alpha
    grid = Grid("EPSG:32633", (10, 0, 500000, 0, -10, 5000000))
    out, valid = read_window(path, (0, 0, 32, 32), [1, 2, 3], grid=grid)
    assert out.shape == (3, 32, 32)
    assert not valid[:, :9].any() and valid[:, 11:].all()


def test_post_scene_with_alpha_band_registers(ray_session, scenes, tmp_path):
    """An RGBA post scene (alpha, no nodata): WarpedVRT must not add a second alpha band, and the
    alpha band marks nodata."""
    paths, crs, transform = scenes
    with rasterio.open(paths["post"]) as src:
        rgb = src.read([1, 2, 3])
        profile = src.profile
    alpha = np.where(rgb.any(axis=0), 255, 0).astype(np.uint8)
    profile.update(count=4, nodata=None, photometric="RGB", alpha="YES")
    rgba = str(tmp_path / "post_rgba.tif")
    with rasterio.open(rgba, "w", **profile) as dst:
        dst.write(np.concatenate([rgb, alpha[None]]))
    paths = {**paths, "rgba": rgba}
    rows = [slice_row(paths, crs, transform, "alpha", "rgba", (256, 200, SLICE, SLICE))]
    for method in ("per-slice", "regional"):
        _, tables = run(rows, method, str(tmp_path / method))
        assert not tables.get("errors"), tables.get("errors")
        (rec,) = tables["metadata"]
        assert rec["status"] == "accepted", rec["reject_reason"]


def test_screening_limit_in_metres_follows_the_pixel_size():
    row = {"crs": "EPSG:32633", "transform": [10.0, 0, 500000, 0, -10.0, 5000000]}
    assert screening_limit(row, RegistrationConfig()) == 8.0                  # the px default
    assert screening_limit(row, RegistrationConfig(max_residual_m=25.0)) == 2.5
    geo = {"crs": "EPSG:4326", "transform": [0.0001, 0, 15, 0, -0.0001, 45]}
    assert screening_limit(geo, RegistrationConfig(max_residual_m=25.0)) == 8.0  # no metres


@pytest.mark.parametrize("spoil", ["rotation", "shift"])
def test_smooth_residual_is_rescued_and_screened_again(scenes, tmp_path, spoil):
    """Real NAIP with a known warp; the true slice homography spoiled by a rotation about the
    slice centre (11 px at the crop corners) or a 10 px shift: screening rejects it, the rescue
    refits it from the shift field, and the re-warped crop passes a second screening. The
    accepted homography is within 1 px of the truth at the crop corners; without rescue the
    crop is rejected."""
    from operators.pairs.registration.registration import HomographyFit
    from operators.pairs.crops.slice_io import Clock, crop_window, finish_crop, read_pre
    paths, crs, transform = scenes
    row = slice_row(paths, crs, transform, "good", "post", (256, 200, SLICE, SLICE))
    W_slice = translation(-256, -200) @ W_TRUE @ translation(256, 200)
    c = (SLICE - 1) / 2
    t = 11.0 / np.hypot(CROP / 2, CROP / 2)
    R = np.array([[np.cos(t), -np.sin(t), 0], [np.sin(t), np.cos(t), 0], [0, 0, 1.0]])
    P = translation(c, c) @ R @ translation(-c, -c) if spoil == "rotation" else translation(10, 0)
    fit = HomographyFit(P @ W_slice, 500, 400, matches=slice_matches(W_slice))
    assert corner_errors(fit.homography, W_slice, SLICE, CROP).max() > 9.0
    pre, pre_valid = read_pre(row, crop_window(row, RegistrationConfig(crop_size=CROP)))
    recs = {}
    for rescue in (False, True):
        cfg = RegistrationConfig(crop_size=CROP, rescue=rescue)
        post, post_valid = read_registered_post(row, fit.homography, cfg)
        env = finish_crop(row, cfg, str(tmp_path / "out"), "r", Clock(), fit, pre, pre_valid,
                          post, post_valid)
        recs[rescue] = json.loads(env["_record"])
    assert recs[False]["status"] == "rejected" and not recs[False]["rescued"]
    rec = recs[True]
    assert rec["status"] == "accepted" and rec["rescued"], rec["reject_reason"]
    assert rec["rescue_reason"] == recs[False]["reject_reason"]
    assert 9.0 < rec["rescue_px"] < 13.0
    H = np.asarray(rec["homography"]).reshape(3, 3)
    assert corner_errors(H, W_slice, SLICE, CROP).max() < 1.0
    assert rec["residual_px"] < 2.0      # the second screening's own measurement, corners included


def slice_matches(W: np.ndarray, n: int = 600, seed: int = 0) -> tuple:
    """``n`` SIFT-like matches (post_xy, pre_xy) of a slice that follow ``W`` (post -> pre)
    with 0.5 px of noise."""
    from operators.pairs.registration.registration import apply_homography
    rng = np.random.default_rng(seed)
    post = rng.uniform(0, SLICE, (n, 2))
    return post, apply_homography(W, post) + rng.normal(0, 0.5, (n, 2))


def test_a_rescue_the_crops_own_matches_do_not_back_is_refused(scenes, tmp_path):
    """The same spoiled fit (a 10 px shift), but the slice's SIFT matches agree with the
    spoiled homography, not with the field screening measured: the rescue is not independent
    evidence, so the crop stays rejected. With matches that follow the truth it is rescued, and
    its record carries the rescue's own evidence (the crop's matches and their inliers under
    the rescued homography), not the first fit's counts."""
    from operators.pairs.registration.registration import HomographyFit
    from operators.pairs.crops.slice_io import Clock, crop_window, finish_crop, read_pre
    paths, crs, transform = scenes
    row = slice_row(paths, crs, transform, "good", "post", (256, 200, SLICE, SLICE))
    W_slice = translation(-256, -200) @ W_TRUE @ translation(256, 200)
    H = translation(10, 0) @ W_slice
    cfg = RegistrationConfig(crop_size=CROP)
    pre, pre_valid = read_pre(row, crop_window(row, cfg))
    post, post_valid = read_registered_post(row, H, cfg)
    recs = {}
    for name, W in (("spoiled", H), ("true", W_slice)):
        fit = HomographyFit(H, 500, 400, matches=slice_matches(W))
        env = finish_crop(row, cfg, str(tmp_path / name), "r", Clock(), fit, pre, pre_valid,
                          post, post_valid)
        recs[name] = json.loads(env["_record"])
    assert recs["spoiled"]["status"] == "rejected" and not recs["spoiled"]["rescued"]
    good = recs["true"]
    assert good["status"] == "accepted" and good["rescued"], good["reject_reason"]
    assert (good["n_matches"], good["n_inliers"]) != (500, 400)
    assert good["n_inliers"] > 0.9 * good["n_matches"] > 0


def test_finer_post_scene_is_low_passed_before_point_sampling(tmp_path):
    """A post scene at half the pre grid's pixel size holding a one-pixel checkerboard (all of
    its detail above the pre grid's Nyquist): sampled onto the pre grid it must come out as the
    pattern's mean grey, not as an aliased pattern of 0 and 255."""
    tr = Affine(1.0, 0, 500000, 0, -1.0, 5000000)
    fine = Affine(0.5, 0, 500000, 0, -0.5, 5000000)
    board = (np.indices((1200, 1200)).sum(axis=0) % 2 * 254 + 1).astype(np.uint8)[None]
    path = str(tmp_path / "fine.tif")
    with rasterio.open(path, "w", driver="GTiff", width=1200, height=1200, count=1,
                       dtype="uint8", crs="EPSG:32633", transform=fine) as dst:
        dst.write(board)
    row = {"window": [0, 0, 256, 256], "post_uri": path, "bands_post": [1],
           "crs": "EPSG:32633", "transform": list(tr)[:6]}
    cfg = RegistrationConfig(crop_size=128)
    out, valid = read_registered_post(row, translation(0.3, 0.2), cfg)
    assert valid.all()
    assert abs(float(out.mean()) - 127.5) < 5 and float(out.std()) < 8


def test_feature_block_runs_sift_once_and_splits_by_tile_core(scenes, tmp_path):
    """tile_block=2: one SIFT run per date over a 2 x 2 block of tiles plus context gives each
    tile exactly the keypoints of that run that lie in its core (none lost, none twice), and
    stores them under their own tile; a block is its own features key."""
    from operators.pairs.regional.regional import TileFeatures, grow, inside, tile_core
    from operators.pairs.regional.regional_ops import (feature_blocks, features_block_rows, features_rel)
    from operators.pairs.registration.registration import detect_features, feature_grey
    from operators.pairs.crops.slice_io import read_post, read_pre
    good, _, _ = all_rows(scenes)
    cfg = RegistrationConfig(method="regional", crop_size=CROP, tile_size=256,
                             search_margin_px=32, tile_block=2)
    assert cfg.features_key() != RegistrationConfig(
        method="regional", crop_size=CROP, tile_size=256, search_margin_px=32,
        tile_block=1).features_key()
    tiles = plan_tiles(good, cfg)
    blocks = feature_blocks(tiles, cfg)
    assert sorted(t["tile_col"] * 10 + t["tile_row"] for b in blocks for t in b) == \
        sorted(t["tile_col"] * 10 + t["tile_row"] for t in tiles)
    assert all(len({(t["tile_col"] // 2, t["tile_row"] // 2) for t in b}) == 1 for b in blocks)
    block = next(b for b in blocks if b[0]["tile_col"] < 2 and b[0]["tile_row"] < 2)
    assert len(block) == 4
    out = str(tmp_path / "out")
    res = features_block_rows(block, cfg, out)
    assert all(r["error"] is None and r["n"] > 0 and not r["reused"] for r in res)
    # The oracle: SIFT over the block's cores plus the context, once per date.
    window = grow((0, 0, 512, 512), cfg.tile_context_px)
    for read in (read_pre, read_post):
        data, valid = read(block[0], window)
        xy, _ = detect_features(feature_grey(data, valid, cfg), valid, cfg)
        xy = xy + np.float32(window[:2])
        xy = xy[inside(xy, (0, 0, 512, 512))]            # the context's own keypoints go
        stored = []
        for t in block:
            f = TileFeatures.from_bytes(Store(out).read_bytes(
                features_rel(cfg, work_id(t), t["tile_col"], t["tile_row"])))
            pts = f.pre_xy if read is read_pre else f.post_xy
            assert inside(pts, tile_core(t["tile_col"], t["tile_row"], 256)).all()
            stored.append(pts)
        stored = np.concatenate(stored)
        assert len(stored) == len(xy)
        assert np.array_equal(np.unique(stored, axis=0), np.unique(xy, axis=0))
    # Stored features are reused, not recomputed.
    assert all(r["reused"] for r in features_block_rows(block, cfg, out))


def _first_passes(scenes, tmp_path, **settings):
    """Features and first-pass matches of the good pair's tiles (256 px) -> (cfg, out, tiles)."""
    from operators.pairs.regional.regional_ops import feature_blocks, features_block_rows, match_tile_row
    good, _, _ = all_rows(scenes)
    cfg = RegistrationConfig(method="regional", crop_size=CROP, tile_size=256,
                             search_margin_px=32, **settings)
    out = str(tmp_path / "out")
    tiles = plan_tiles(good, cfg)
    for block in feature_blocks(tiles, cfg):
        assert all(r["error"] is None for r in features_block_rows(block, cfg, out))
    assert all(r["error"] is None for r in (match_tile_row(t, cfg, out) for t in tiles))
    return cfg, out, tiles


def _tile_features(cfg, out, tile):
    from operators.pairs.regional.regional import TileFeatures
    from operators.pairs.regional.regional_ops import features_rel
    return {(c, r): TileFeatures.from_bytes(Store(out).read_bytes(
        features_rel(cfg, work_id(tile), c, r))) for c, r in tile["neighbours"]}


def test_tile_block_2_matches_across_block_edges(scenes, tmp_path):
    """Blocks of 2 x 2 tiles: a tile on a block's edge matches against the post features its
    neighbouring block stored (W_TRUE moves content 8.6 px across the edge at x = 512), and
    those matches are right."""
    from operators.pairs.regional.regional import TileMatches
    cfg, out, tiles = _first_passes(scenes, tmp_path, tile_block=2)
    tile = next(t for t in tiles if (t["tile_col"], t["tile_row"]) == (1, 0))
    assert [2, 0] in tile["neighbours"]                 # in the next block
    m = TileMatches.from_bytes(Store(out).read_bytes(matches_rel(cfg, work_id(tile), 1, 0)))
    across = m.post_xy[:, 0] >= 512 - 0.5
    assert across.sum() >= 5, across.sum()
    # Oracle: the known warp (post -> pre) puts each such partner where its pre feature is.
    from operators.pairs.registration.registration import apply_homography
    err = np.hypot(*(apply_homography(W_TRUE, m.post_xy[across]) - m.pre_xy[across]).T)
    assert np.median(err) < 1.0, err


def test_a_sampled_first_pass_is_redone_in_full_when_the_pair_has_no_prior(scenes, tmp_path):
    """The first pass matches a sample of each tile's pre features (it only feeds the prior);
    when the pair gets no prior, the slices' matches are the unguided pass over every feature,
    not the stored sample."""
    from operators.pairs.registration.guided_matching import MatchPrior
    from operators.pairs.regional.regional import TileMatches, match_tile
    from operators.pairs.regional.regional_ops import guided_tile_row
    cfg, out, tiles = _first_passes(scenes, tmp_path, prior_features_per_tile=60)
    tile = tiles[0]
    tc, tr = tile["tile_col"], tile["tile_row"]
    store = Store(out)
    store.write_bytes(prior_rel(cfg, work_id(tile)), MatchPrior(None).to_bytes())   # no prior
    assert guided_tile_row(tile, cfg, out)["error"] is None
    final = TileMatches.from_bytes(store.read_bytes(guided_rel(cfg, work_id(tile), tc, tr)))
    sampled = TileMatches.from_bytes(store.read_bytes(matches_rel(cfg, work_id(tile), tc, tr)))
    feats = _tile_features(cfg, out, tile)
    full = match_tile(feats[(tc, tr)], feats.values(), tc, tr, cfg)   # oracle: every feature
    assert len(feats[(tc, tr)].pre_xy) > 60 and len(sampled) < len(full)
    assert len(final) == len(full)
    np.testing.assert_array_equal(final.pre_xy, full.pre_xy)


@pytest.mark.slow   # three first passes over the scenes: about 3 s, the quick loop's slowest
def test_a_weak_sampled_prior_is_refitted_from_every_feature(scenes, tmp_path):
    """A pair whose sampled first pass gives a prior on fewer than ``prior_sample_min_inliers``
    inliers gets the prior of the first pass over every feature (what it got before sampling);
    a strong sampled prior is kept."""
    from operators.pairs.registration.guided_matching import MatchPrior
    from operators.pairs.regional.regional_ops import prior_pair_rows
    cfg, out, tiles = _first_passes(scenes, tmp_path / "sampled", prior_features_per_tile=60,
                                    prior_sample_min_inliers=10 ** 6)
    ref_cfg, ref_out, ref_tiles = _first_passes(scenes, tmp_path / "full", prior_features_per_tile=0)
    res, ref = prior_pair_rows(tiles, cfg, out), prior_pair_rows(ref_tiles, ref_cfg, ref_out)
    assert res["error"] is None and res["full_first_pass"] and not ref["full_first_pass"]
    got = MatchPrior.from_bytes(Store(out).read_bytes(prior_rel(cfg, work_id(tiles[0]))))
    want = MatchPrior.from_bytes(Store(ref_out).read_bytes(prior_rel(ref_cfg, work_id(tiles[0]))))
    assert got.pair_inliers == want.pair_inliers > 0
    np.testing.assert_allclose(got.pair, want.pair)
    assert sorted(got.tiles) == sorted(want.tiles)
    # A bar the sample clears: its own prior is kept (fewer inliers than the full pass's).
    cfg2, out2, tiles2 = _first_passes(scenes, tmp_path / "kept", prior_features_per_tile=60,
                                       prior_sample_min_inliers=12)
    kept = prior_pair_rows(tiles2, cfg2, out2)
    assert not kept["full_first_pass"] and 12 <= kept["n"] < want.pair_inliers
