"""The WAVE case registered once per session: the spoiled-fit and the rescue tests both screen its
slices (registering it takes a tile pass over the whole case)."""
from __future__ import annotations

import pytest

from tests.pairs.screening._naip_cases import WAVE, WAVE_CROP, registered


@pytest.fixture(scope="session")
def wave_registered(tmp_path_factory):
    """``registered(WAVE, WAVE_CROP, ...)``: (slice rows, config, output root, known warp)."""
    return registered(WAVE, WAVE_CROP, tmp_path_factory.mktemp("naip-wave"))
