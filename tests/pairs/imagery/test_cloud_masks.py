"""Cloud layers and the cloud-cover pair filter (issue 14)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from operators.pairs.imagery.cloud_masks import CloudConfig, cloud_pixels, filter_pairs_by_cloud_cover


def test_scl_classes():
    scl = np.arange(12, dtype=np.uint8).reshape(3, 4)
    got = cloud_pixels(scl, "scl", (3, 8, 9, 10))
    assert sorted(scl[got].tolist()) == [3, 8, 9, 10]


def test_qa_pixel_bits():
    # Landsat C2 QA_PIXEL: 21824 = clear land (bits 6, 8, 10, 12, 14); 22280 = cloud (bit 3 + conf);
    # 23888 = cloud shadow (bit 4 ...); 2 = dilated cloud; 4 = cirrus; 1 = fill only.
    qa = np.array([21824, 22280, 23888, 2, 4, 1, 1 << 5], dtype=np.uint16)
    assert cloud_pixels(qa, "qa_pixel", (1, 2, 3, 4)).tolist() == [False, True, True, True, True,
                                                                   False, False]


def test_kind_from_name_or_explicit():
    cfg = CloudConfig(cloud_mask="scl")
    assert cfg.kind_for("scl") == "scl" and cfg.kind_for("SCL") == "scl"
    assert cfg.kind_for("qa_pixel") == "qa_pixel"
    with pytest.raises(ValueError, match="--cloud-mask-kind"):
        cfg.kind_for("fmask")
    assert CloudConfig(cloud_mask_kind="qa_pixel").kind_for("fmask") == "qa_pixel"
    assert CloudConfig().values_for("qa_pixel") == [1, 2, 3, 4]


def test_cloud_cover_filter_rejects_with_reason_and_leaves_unknown_cover():
    scenes = {"a": {"cloud_cover": 1.7}, "b": {"cloud_cover": 69.3}, "c": {"cloud_cover": None},
              "d": {"cloud_cover": 44.0}}
    pairs = [{"pre_scene": x, "post_scene": y, "status": "accepted", "reason": None}
             for x, y in (("a", "b"), ("a", "c"), ("b", "d"), ("a", "d"))]
    pairs.append({"pre_scene": "a", "post_scene": "b", "status": "rejected", "reason": "older"})
    assert filter_pairs_by_cloud_cover(pairs, scenes, 30) == 3
    assert [p["status"] for p in pairs] == ["rejected", "accepted", "rejected", "rejected",
                                            "rejected"]
    assert pairs[0]["reason"] == "post scene cloud cover 69.3% > 30%"
    assert "pre scene cloud cover 69.3%" in pairs[2]["reason"] and "post scene" in pairs[2]["reason"]
    assert pairs[4]["reason"] == "older"
    assert filter_pairs_by_cloud_cover(pairs, scenes, 100) == 0


@pytest.mark.parametrize("limit, status", [(0.3, "accepted"), (0.01, "rejected")])
def test_post_cloud_crop_is_judged_by_its_cloud_fraction_not_as_nodata(tmp_path, limit, status):
    """A post date with a cloud over ~5 % of the kept crop, registered by a sub-pixel shift: the
    crop is judged by --max-crop-cloud (accepted at 0.3, rejected at 0.01 as cloud), not rejected
    as nodata for the ring of pixels next to the cloud."""
    import rasterio
    from affine import Affine

    from operators.pairs.catalogue.band_stack import BandAsset, CloudLayer, Stack
    from operators.pairs.registration.registration import HomographyFit, RegistrationConfig, translation
    from operators.pairs.crops.slice_io import (Clock, crop_window, finish_crop, read_pre,
                                                read_registered_post)
    from tests.pairs.registration.test_registration import naip_rgb

    grey = naip_rgb()[0][:300, :300]
    tr = Affine(1.0, 0, 500000, 0, -1.0, 5000000)
    scl = np.full(grey.shape, 4, np.uint8)           # vegetation
    scl[120:149, 120:149] = 9                         # cloud, high probability: 29 x 29 px
    assets = {}
    for name, arr in (("pre", grey), ("post", grey), ("scl", scl)):
        path = tmp_path / f"{name}.tif"
        with rasterio.open(path, "w", driver="GTiff", width=300, height=300, count=1,
                           dtype="uint8", crs="EPSG:32633", transform=tr) as dst:
            dst.write(arr, 1)
        assets[name] = BandAsset(name=name, href=str(path), crs="EPSG:32633",
                                 transform=tuple(tr)[:6], width=300, height=300, dtype="uint8")
    pre = Stack((assets["pre"],))
    post = Stack((assets["post"],), CloudLayer(assets["scl"], "scl", (3, 8, 9, 10), limit))
    cfg = RegistrationConfig(crop_size=128)
    row = {"slice_id": "s", "pair_id": "p", "crs": "EPSG:32633", "transform": list(tr)[:6],
           "window": [8, 8, 256, 256], "pre_stack": pre.to_json(), "post_stack": post.to_json(),
           "pre_uri": assets["pre"].href, "post_uri": assets["post"].href,
           "bands_pre": [1], "bands_post": [1], "stretch_pre": [[0, 255]],
           "stretch_post": [[0, 255]]}
    H = translation(0.4, 0.3)                          # post pixels sit between grid pixels
    fit = HomographyFit(H, 100, 100)
    pre_crop, pre_valid = read_pre(row, crop_window(row, cfg))
    post_crop, post_valid = read_registered_post(row, H, cfg)
    env = finish_crop(row, cfg, str(tmp_path / "out"), "r", Clock(), fit, pre_crop, pre_valid,
                      post_crop, post_valid)
    rec = json.loads(env["_record"])
    assert 0.05 <= rec["cloud_fraction"] <= 0.06      # 30 x 30 of 128 x 128 px: 5.5 %
    assert rec["status"] == status, rec["reject_reason"]
    if status == "rejected":
        assert rec["reject_reason"].startswith("cloud")
