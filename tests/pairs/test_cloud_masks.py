"""Cloud layers and the cloud-cover pair filter (issue 14)."""
from __future__ import annotations

import numpy as np
import pytest

from operators.pairs.cloud_masks import CloudConfig, cloud_pixels, filter_pairs_by_cloud_cover


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
