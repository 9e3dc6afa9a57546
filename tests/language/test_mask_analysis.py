"""Mask analysis on the real LEVIR-CD masks and on masks built to pin down each description."""
from pathlib import Path

import cv2
import numpy as np
import pytest

from operators.language.mask_analysis import analyze_mask, binarize_mask, describe_region, grid_shares

LABELS = Path(__file__).resolve().parents[2] / "data" / "levir-cd" / "label"


def _read(name):
    return cv2.imread(str(LABELS / name), cv2.IMREAD_UNCHANGED)


def test_real_masks_stats_are_consistent():
    names = sorted(p.name for p in LABELS.glob("*.png"))
    assert len(names) == 11
    for name in names:
        raw = _read(name)
        stats = analyze_mask(raw)
        changed = int((raw > 0).sum())
        assert stats.changed_pixels == changed
        assert stats.car == pytest.approx(changed / raw.size)
        assert (stats.height, stats.width) == raw.shape
        if changed:
            assert stats.components >= 1
            assert stats.region != "no change"
            assert sum(stats.cell_shares) == pytest.approx(1.0, abs=1e-3)


def test_all_zero_real_mask_is_no_change():
    stats = analyze_mask(_read("train_386_0512_0768.png"))
    assert stats.changed_pixels == 0 and stats.car == 0.0 and stats.components == 0
    assert stats.region == "no change"
    assert stats.cell_shares == [0.0] * 9


def test_real_mask_component_count_matches_opencv():
    raw = _read("test_77_0512_0256.png")
    stats = analyze_mask(raw)
    n, _, cc, _ = cv2.connectedComponentsWithStats((raw > 0).astype(np.uint8), connectivity=8)
    assert stats.components == int((cc[1:, cv2.CC_STAT_AREA] >= 10).sum())


def test_binarize_handles_encodings():
    base = np.zeros((8, 8), np.uint8)
    base[2:4, 2:4] = 1
    expected = base > 0
    assert (binarize_mask(base) == expected).all()                       # 0/1
    assert (binarize_mask(base * 255) == expected).all()                 # 0/255
    greys = base * 255
    greys[2, 2] = 128                                                    # stray grey inside the change
    assert (binarize_mask(greys) == expected).all()
    rgba = np.dstack([base * 255] * 3 + [np.full_like(base, 255)])       # opaque alpha everywhere
    assert (binarize_mask(rgba) == expected).all()
    rgb01 = np.dstack([base] * 3)                                        # a 0/1 label saved as RGB
    assert (binarize_mask(rgb01) == expected).all()
    assert (binarize_mask(base.astype(np.uint16) * 65535) == expected).all()


def _mask_with(cells, size=90):
    m = np.zeros((size, size), bool)
    step = size // 3
    for r, c in cells:
        m[r * step + 5:r * step + 25, c * step + 5:c * step + 25] = True
    return m


@pytest.mark.parametrize("cells,expected", [
    ([(0, 0)], "upper-left area of the image"),
    ([(1, 1)], "center area of the image"),
    ([(2, 2)], "lower-right area of the image"),
    ([(0, 0), (2, 2)], "upper-left and lower-right areas of the image"),
    ([(0, 0), (0, 2), (1, 1), (2, 0), (2, 2)], "scattered across the image"),
])
def test_region_descriptions(cells, expected):
    assert analyze_mask(_mask_with(cells)).region == expected


def test_widespread_change_is_most_of_the_image():
    m = np.ones((60, 60), bool)
    m[:10] = False
    assert analyze_mask(m).region == "most of the image"


def test_grid_shares_sum_to_one_and_empty_is_zero():
    m = _mask_with([(0, 1), (1, 2)])
    assert grid_shares(m).sum() == pytest.approx(1.0)
    assert grid_shares(np.zeros((9, 9), bool)).sum() == 0
    assert describe_region(np.zeros((3, 3)), 0.0, 0) == "no change"
