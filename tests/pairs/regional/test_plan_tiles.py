"""The regional tile plan against a brute-force computation from pixel geometry."""
from __future__ import annotations

import random

import pytest

from operators.pairs.regional.regional_ops import plan_tiles
from operators.pairs.registration.registration import RegistrationConfig

KEYS = dict(pre_uri="a.tif", post_uri="b.tif", crs="EPSG:32633", transform=[10, 0, 0, 0, -10, 0],
            bands_pre=[1, 2, 3], bands_post=[1, 2, 3], stretch_pre=[[0, 1]] * 3,
            stretch_post=[[0, 1]] * 3, pre_stack=None, post_stack=None)


def brute_force(rows, tile, margin):
    """Tiles (cores of ``tile`` px) that any slice window covers a pixel of, per pair; each
    tile's neighbours: planned tiles of its pair whose core meets the core grown by ``margin``."""
    def covers(window, tc, tr):
        c, r, w, h = window
        return c < (tc + 1) * tile and tc * tile < c + w and r < (tr + 1) * tile and tr * tile < r + h
    plan = {}
    for row in rows:
        c, r, w, h = row["window"]
        for tr in range((r - tile) // tile, (r + h) // tile + 2):
            for tc in range((c - tile) // tile, (c + w) // tile + 2):
                if covers(row["window"], tc, tr):
                    plan.setdefault(row["pair_id"], set()).add((tc, tr))
    out = {}
    for pair, cells in plan.items():
        for tc, tr in cells:
            grown = (tc * tile - margin, tr * tile - margin, tile + 2 * margin, tile + 2 * margin)
            out[(pair, tc, tr)] = sorted((c, r) for c, r in cells if covers(grown, c, r))
    return out


@pytest.mark.parametrize("tile,margin", [(1024, 128), (512, 64), (256, 256), (1024, 0)])
def test_plan_matches_brute_force(tile, margin):
    rng = random.Random(tile + margin)
    rows = [{**KEYS, "pair_id": f"p{p}", "slice_id": f"p{p}_{i}",
             "window": [rng.randint(-300, 6000), rng.randint(-300, 6000), 1500, 1500]}
            for p in range(4) for i in range(rng.randint(1, 12))]
    plan = plan_tiles(rows, RegistrationConfig(tile_size=tile, search_margin_px=margin))
    got = {(t["pair_id"], t["tile_col"], t["tile_row"]): sorted(map(tuple, t["neighbours"]))
           for t in plan}
    assert got == brute_force(rows, tile, margin)
    assert len(plan) == len(got)                      # no tile planned twice
    assert all(t["post_uri"] == "b.tif" for t in plan)
