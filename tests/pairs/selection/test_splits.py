"""Splits by location: seeded draw, fractions, split lists, and stability as the archive grows."""
from __future__ import annotations

import pytest

from operators.pairs.selection.pairing import PairingConfig, select_pairs
from operators.pairs.selection.slicing import slice_rows
from operators.pairs.selection.splits import assign_splits, list_files, parse_fractions
from tests.pairs._scenes import utm_tile


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
