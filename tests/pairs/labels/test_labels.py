"""Label maps: the union of new and demolished buildings, and size checks."""
from __future__ import annotations

import numpy as np
import pytest

from operators.pairs.labels.labels import merge_label_maps


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
