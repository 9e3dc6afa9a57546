"""Real-pair screening cases: the bundled NAIP 2016 -> 2020 pair (the later date resampled onto the
earlier grid) with a known warp laid on the later date, registered by the regional method's tile
passes in this process."""
from __future__ import annotations

from dataclasses import replace

from benchmarks.registration_real import CASES, Case, slice_rows_for, write_case
from operators.pairs.regional.regional_ops import plan_tiles, tile_passes_in_process
from operators.pairs.registration.registration import RegistrationConfig
from tests.conftest import DATA

# A geocoding offset, a small rotation and scale, and a sinusoidal field of 24 px over 1600 px:
# over a 384 px slice the field bends away from any homography; over the central 130 px crop
# (the paper's crop/slice ratio, 1024/3000) it is close to affine.
WAVE = Case("naip-wave", "naip/m_4709963_se_14_1_20160816.tif",
            "naip/m_4709963_se_14_1_20200831.tif", (1, 2, 3), 384, 96, (62.0, -41.0), 0.35,
            1.003, True, wave_px=24.0, wave_len_px=1600.0)
WAVE_CROP = 130
# The benchmark's plain NAIP case (a 3 px sinusoid), from the repository's copies.
_naip = next(c for c in CASES if c.name == "naip-2016-2020")
NAIP = replace(_naip, pre=_naip.pre.replace("naip-timeseries/", "naip/"),
               post=_naip.post.replace("naip-timeseries/", "naip/"))
NAIP_CROP = 192


def registered(case: Case, crop: int, tmp_path):
    """(slice rows, config, output root, known warp) with the tile passes done."""
    paths, warp, profile, pre_valid, post_valid = write_case(case, DATA, tmp_path / "case")
    rows = slice_rows_for(case, paths, profile, pre_valid, post_valid, crop, None, warp)
    cfg = RegistrationConfig(crop_size=crop, tile_size=256, search_margin_px=91,
                             max_shift_px=300.0, tile_block=2)
    out = str(tmp_path / "out")
    tile_passes_in_process(plan_tiles(rows, cfg), cfg, out)
    return rows, cfg, out, warp
