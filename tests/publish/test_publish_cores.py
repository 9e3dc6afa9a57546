"""Pure cores of jobs.publish: mask encodings, versions and checksums, licences, Parquet shards and their
Hugging Face features, preparing a pair's files, reading LEVIR-CD layouts, the card's YAML, STAC items."""
from __future__ import annotations

import hashlib
import io
import shutil
import subprocess

import cv2
import numpy as np
import pyarrow.parquet as pq
import pytest

from operators.io.storage import Store
from operators.publish import card, masks, shards, stac, versions
from operators.publish.layout import png_rgb8, png_size, prepare_pair
from operators.publish.sources import PairSource, read_dataset, resolve_licence
from tests.conftest import DATA

LEVIR = DATA / "levir-cd"


# -- masks -------------------------------------------------------------------------------------------
def test_binary_mask_any_nonzero_in_any_channel_is_255():
    rgb = np.zeros((2, 3, 3), np.uint8)
    rgb[0, 1, 2] = 1
    rgb[1, 2, 0] = 200
    out = masks.binary_mask(rgb)
    assert out.dtype == np.uint8 and out.shape == (2, 3)
    assert out.tolist() == [[0, 255, 0], [0, 0, 255]]
    assert masks.is_binary_encoded(out) and not masks.is_binary_encoded(rgb)
    assert not masks.is_binary_encoded(np.array([[0, 1]], np.uint8))


def test_index_mask_new_is_1_demolished_is_2_overlap_is_1():
    new = np.array([[0, 255, 255, 0]], np.uint8)
    gone = np.array([[0, 0, 1, 7]], np.uint8)
    assert masks.index_mask(new, gone).tolist() == [[0, 1, 1, 2]]
    stats = masks.mask_stats(masks.binary_mask(np.maximum(new, gone)), {"new": new, "demolished": gone})
    assert stats == {"changed_pixels": 3, "car": 0.75, "class_pixels": {"new": 2, "demolished": 2}, "overlap_pixels": 1}
    with pytest.raises(ValueError, match="label1 is 4x1 but label2 is 2x1"):
        masks.index_mask(new, gone[:, :2])


# -- versions and checksums --------------------------------------------------------------------------
def test_semantic_versions_order_and_previous():
    order = ["0.9.0", "1.0.0-rc.1", "1.0.0", "1.0.1", "1.2.0", "1.10.0", "2.0.0"]
    assert sorted(reversed(order), key=versions.parse_version) == order
    assert versions.previous_version(["1.0.0", "1.10.0", "1.2.0"], "1.10.0") == "1.2.0"
    assert versions.previous_version(["1.0.0"], "1.0.0") is None
    for bad in ("1.0", "v1.0.0", "01.0.0", ""):
        with pytest.raises(ValueError, match="not a semantic version"):
            versions.parse_version(bad)


def test_sha256sums_is_what_sha256sum_checks(tmp_path):
    files = {"README.md": b"# card\n", "train/A/x 1.png": b"\x89PNG...", "data/train-00000.parquet": b"PAR1"}
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    text = versions.sha256sums({rel: versions.sha256(d) for rel, d in files.items()})
    assert text.splitlines()[0] == f"{hashlib.sha256(b'# card' + bytes([10])).hexdigest()}  README.md"
    assert versions.parse_sha256sums(text) == {rel: hashlib.sha256(d).hexdigest() for rel, d in files.items()}
    (tmp_path / "SHA256SUMS").write_text(text)
    assert shutil.which("sha256sum"), "sha256sum (GNU coreutils) is not on PATH"
    ok = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=tmp_path, capture_output=True, timeout=30)
    assert ok.returncode == 0, ok.stdout
    (tmp_path / "README.md").write_bytes(b"# edited\n")
    bad = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=tmp_path, capture_output=True, timeout=30)
    assert bad.returncode != 0
    with pytest.raises(ValueError):
        versions.sha256sums({"a\nb": "00"})


def test_diff_and_changelog():
    d = lambda v: {"split": "train", "digest": v}  # noqa: E731
    old = {"a": d("1"), "b": d("2"), "c": d("3")}
    new = {"b": d("2"), "c": d("X"), "e": d("5"), "d": d("4")}
    changes = versions.diff_pairs(old, new)
    assert changes == {"added": ["d", "e"], "removed": ["a"], "changed": ["c"]}
    first = versions.changelog(versions.changelog_entry("1.0.0", "2026-01-01", None, versions.diff_pairs({}, old),
                                                        {"train": 3, "val": 0, "test": 0}), None)
    second = versions.changelog(versions.changelog_entry("1.1.0", "2026-02-01", "1.0.0", changes,
                                                         {"train": 4, "val": 0, "test": 0}), first)
    assert second.startswith("# Changelog\n\n## 1.1.0 (2026-02-01)")
    assert second.count("# Changelog") == 1 and "## 1.0.0 (2026-01-01)" in second
    assert "2 pairs added, 1 removed, 1 changed" in second
    assert "- Added: `d`, `e`" in second and "- Removed: `a`" in second and "- Changed: `c`" in second
    many = versions.changelog_entry("2.0.0", "x", "1.0.0", {"added": [str(i) for i in range(5)], "removed": [],
                                                            "changed": []}, {"train": 5}, listed=2)
    assert "`0`, `1` and 3 more (changes.json)" in many


def test_pair_digest_changes_with_any_content():
    base = versions.pair_digest({"A": "a", "label": "l"}, "train", ["c"], [])
    assert base == versions.pair_digest({"label": "l", "A": "a"}, "train", ["c"], [])
    assert base != versions.pair_digest({"A": "a", "label": "m"}, "train", ["c"], [])
    assert base != versions.pair_digest({"A": "a", "label": "l"}, "test", ["c"], [])
    assert base != versions.pair_digest({"A": "a", "label": "l"}, "train", ["c2"], [])


# -- licences ----------------------------------------------------------------------------------------
def test_licence_refused_when_unknown_or_conflicting_unless_given():
    with pytest.raises(SystemExit, match="licence of --input is unknown"):
        resolve_licence({"--input": None})
    with pytest.raises(SystemExit, match="declare different licences"):
        resolve_licence({"--input": "CC0-1.0", "--captions": "CC-BY-4.0"})
    assert resolve_licence({"--input": "CC-BY-4.0", "--qa": "CC-BY-4.0"}) == ("CC-BY-4.0", "declared by --input, --qa")
    assert resolve_licence({"--input": None}, "MIT") == ("MIT", "--licence")
    lic, note = resolve_licence({"--input": "CC0-1.0"}, "CC-BY-4.0", "relicensed by its owner")
    assert lic == "CC-BY-4.0" and "inputs declare --input: CC0-1.0; overridden: relicensed by its owner" in note


# -- Parquet shards ----------------------------------------------------------------------------------
def test_hf_features_are_what_datasets_reads():
    import datasets  # the test extra: a missing package fails, never skips
    expected = datasets.Features({
        "id": datasets.Value("string"), "pre": datasets.Image(), "car": datasets.Value("float64"),
        "width": datasets.Value("int32"), "captions": datasets.List(datasets.Value("string")),
        "qa": datasets.List({"type": datasets.Value("string"), "question": datasets.Value("string"),
                             "answer": datasets.Value("string")}),
        "bounds": datasets.List(datasets.Value("float64")),
    }).to_dict()
    got = shards.hf_features()
    assert {k: got[k] for k in expected} == expected
    assert datasets.Features.from_arrow_schema(shards.release_schema())["mask"] == datasets.Image()


def _row(i: int, n_bytes: int) -> dict:
    row = {f.name: None for f in shards.SCHEMA}
    row.update(id=f"p{i:03d}", split="train", pre={"bytes": bytes(n_bytes), "path": f"train/A/p{i:03d}.png"},
               post={"bytes": bytes(n_bytes), "path": f"train/B/p{i:03d}.png"})
    return row


def test_shards_are_cut_by_image_bytes_in_small_row_groups():
    written = {}
    w = shards.ShardWriter("train", lambda rel, data: written.__setitem__(rel, data), shard_mb=1.0, rows_per_group=2)
    for i in range(10):
        w.add(_row(i, 200_000))          # 0.4 MB of images per row: a shard closes at the 3rd row
    w.flush()
    assert [rel for rel, _ in w.written] == ["data/train-00000.parquet", "data/train-00001.parquet",
                                             "data/train-00002.parquet", "data/train-00003.parquet"]
    assert [n for _, n in w.written] == [3, 3, 3, 1]
    ids = []
    for rel in sorted(written):
        f = pq.ParquetFile(io.BytesIO(written[rel]))
        assert f.metadata.row_group(0).num_rows <= 2
        assert b"huggingface" in f.schema_arrow.metadata
        ids += f.read(columns=["id"]).column("id").to_pylist()
    assert ids == [f"p{i:03d}" for i in range(10)]


# -- preparing a pair --------------------------------------------------------------------------------
def _png(img) -> bytes:
    return cv2.imencode(".png", img)[1].tobytes()


@pytest.fixture()
def pair_store(tmp_path):
    rgb = (np.arange(64 * 48 * 3) % 251).astype(np.uint8).reshape(48, 64, 3)
    mask = np.zeros((48, 64), np.uint8)
    mask[5:20, 10:30] = 255
    files = {"A/ok.png": _png(rgb), "B/ok.png": _png(rgb[::-1].copy()), "label/ok.png": _png(mask),
             "A/jpg.jpg": cv2.imencode(".jpg", rgb)[1].tobytes(), "B/jpg.png": _png(rgb),
             "label/rgbmask.png": _png(np.dstack([mask // 255] * 3)),
             "B/small.png": _png(rgb[:40]), "label/small.png": _png(mask[:40]),
             "label1/two.png": _png(mask), "label2/two.png": _png(np.roll(mask, 8, axis=1)),
             "label/bad.png": _png(mask), "label1/bad.png": _png(mask), "label2/bad.png": _png(np.roll(mask, 8, axis=1))}
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    return Store(str(tmp_path)), rgb, mask


def _pair(files: dict) -> PairSource:
    return PairSource("x", "train", files, {})


def test_prepare_copies_release_ready_files_and_reencodes_the_rest(pair_store):
    store, rgb, mask = pair_store
    ok = prepare_pair(store, _pair({"A": "A/ok.png", "B": "B/ok.png", "label": "label/ok.png"}))
    assert ok.files["A"] == (store.read_bytes("A/ok.png")) and ok.files["label"] == store.read_bytes("label/ok.png")
    assert ok.size == (64, 48) and ok.stats["changed_pixels"] == 15 * 20
    other = prepare_pair(store, _pair({"A": "A/jpg.jpg", "B": "B/jpg.png", "label": "label/rgbmask.png"}))
    assert png_rgb8(other.files["A"]) and png_size(other.files["A"]) == (64, 48)
    m = cv2.imdecode(np.frombuffer(other.files["label"], np.uint8), cv2.IMREAD_UNCHANGED)
    assert m.ndim == 2 and np.array_equal(m, mask)              # 0/1 RGB mask -> single channel 0/255


def test_prepare_builds_union_and_index_from_two_maps(pair_store):
    store, rgb, mask = pair_store
    p = prepare_pair(store, _pair({"A": "A/ok.png", "B": "B/ok.png", "label1": "label1/two.png",
                                   "label2": "label2/two.png"}))
    dec = {k: cv2.imdecode(np.frombuffer(v, np.uint8), cv2.IMREAD_UNCHANGED) for k, v in p.files.items()}
    shifted = np.roll(mask, 8, axis=1)
    assert np.array_equal(dec["label"], np.where((mask > 0) | (shifted > 0), 255, 0))
    assert np.array_equal(dec["label_index"], np.where(mask > 0, 1, np.where(shifted > 0, 2, 0)))
    assert p.stats["overlap_pixels"] == 15 * 12


@pytest.mark.parametrize("files, message", [
    ({"A": "A/ok.png"}, "missing B image"),
    ({"A": "A/ok.png", "B": "B/small.png"}, "A is 64x48 but B is 64x40"),
    ({"A": "A/ok.png", "B": "B/ok.png", "label": "label/small.png"}, "label is 64x40 but the images are 64x48"),
    ({"A": "A/ok.png", "B": "B/ok.png"}, "no change mask"),
    ({"A": "A/ok.png", "B": "B/ok.png", "label1": "label1/two.png"}, "only label1 is given"),
    ({"A": "A/ok.png", "B": "B/ok.png", "label": "label/bad.png", "label1": "label1/bad.png",
      "label2": "label2/bad.png"}, r"label/ differs from the union of label1/ and label2/ in 120 pixel"),
])
def test_prepare_refuses_bad_pairs_with_the_reason(pair_store, files, message):
    with pytest.raises(ValueError, match=message):
        prepare_pair(pair_store[0], _pair(files))


def test_prepare_keeps_unlabelled_pairs_when_asked(pair_store):
    p = prepare_pair(pair_store[0], _pair({"A": "A/ok.png", "B": "B/ok.png"}), require_label=False)
    assert set(p.files) == {"A", "B"} and p.stats == {}


# -- reading LEVIR-CD layouts ------------------------------------------------------------------------
def test_levir_flat_splits_from_list_files_then_name_prefix(tmp_path):
    root = tmp_path / "flat"
    shutil.copytree(LEVIR, root)
    (root / "list" / "val.txt").write_text("test_2_0000_0000.png\n")
    ds = read_dataset(str(root))
    names = sorted(p.stem for p in (LEVIR / "A").glob("*.png"))
    assert [p.pair_id for p in ds.pairs] == names and ds.errors == []
    split = {p.pair_id: p.split for p in ds.pairs}
    assert split["test_2_0000_0000"] == "val"
    assert {n: split[n] for n in names if n != "test_2_0000_0000"} == {n: n.split("_")[0] for n in names if n != "test_2_0000_0000"}
    p = next(p for p in ds.pairs if p.pair_id == "test_113_0256")
    assert set(p.files) == {"A", "B"}                            # no mask: prepare will say so


def test_levir_split_folders_and_duplicate_ids(tmp_path):
    root = tmp_path / "split"
    for split, name in (("train", "train_36_0512_0512"), ("test", "test_2_0000_0000"), ("val", "test_2_0000_0000")):
        for role in ("A", "B", "label"):
            (root / split / role).mkdir(parents=True, exist_ok=True)
            shutil.copy(LEVIR / role / f"{name}.png", root / split / role / f"{name}.png")
    (root / "val" / "label1").mkdir()
    shutil.copy(LEVIR / "label" / "test_2_0000_0000.png", root / "val" / "label1" / "test_2_0000_0000.png")
    ds = read_dataset(str(root))
    # Split folders are read in train, val, test order: the first holder of an id keeps it.
    assert [(p.pair_id, p.split) for p in ds.pairs] == [("test_2_0000_0000", "val"), ("train_36_0512_0512", "train")]
    assert [(e["item"], e["stage"]) for e in ds.errors] == [("test/test_2_0000_0000", "inputs")]
    assert "also in val/" in ds.errors[0]["message"]
    assert set(ds.pairs[0].files) == {"A", "B", "label", "label1"}


def test_read_dataset_refuses_a_folder_without_pairs(tmp_path):
    with pytest.raises(SystemExit, match="holds no A/ B/ label/ images"):
        read_dataset(str(tmp_path))


# -- card and STAC -----------------------------------------------------------------------------------
def test_card_front_matter_is_yaml_with_configs_for_present_splits():
    import yaml
    text = card.front_matter("demo", "CC-BY-4.0", {"train": 5, "val": 0, "test": 2}, True, False)
    y = yaml.safe_load(text.strip().strip("-"))
    assert y["license"] == "cc-by-4.0" and y["pretty_name"] == "demo"
    assert y["configs"] == [{"config_name": "default", "data_files": [
        {"split": "train", "path": "data/train-*.parquet"}, {"split": "test", "path": "data/test-*.parquet"}]}]
    assert y["task_categories"] == ["image-segmentation", "image-to-text"]
    assert card.hub_licence("LicenseRef-LEVIR") == {"license": "other", "license_name": "LicenseRef-LEVIR"}


def test_stac_item_geometry_split_labels_and_sources():
    from rasterio.warp import transform
    bounds = [486545.6, 5207326.2, 487825.6, 5208606.2]
    row = {"id": "p1", "split": "val", "bounds": bounds, "crs": "EPSG:26914", "pre_date": "2016-08-16",
           "post_date": "2017-08-27", "changed_pixels": 12, "car": 0.1, "pre_source": ["s3://b/d/pre.tif"],
           "post_source": ["naip/post.tif"], "sensor": None}
    item = stac.pair_item(row, {"A": "val/A/p1.png", "B": "val/B/p1.png", "label": "val/label/p1.png"},
                          ["manual"], [{"name": "change", "classes": [0, 255]}])
    (lon0, lon1), (lat0, lat1) = transform("EPSG:26914", "EPSG:4326", [bounds[0], bounds[2]], [bounds[1], bounds[3]])
    w, s, e, n = item["bbox"]
    assert w <= min(lon0, lon1) + 1e-9 and e >= max(lon0, lon1) - 1e-9 and abs(s - min(lat0, lat1)) < 1e-3
    assert item["properties"]["ml-aoi:split"] == "val" and item["properties"]["label:type"] == "raster"
    assert item["properties"]["start_datetime"].startswith("2016-08-16")
    assert item["assets"]["label"]["href"] == "../../val/label/p1.png" and "labels" in item["assets"]["label"]["roles"]
    links = {(link["rel"], link["href"]) for link in item["links"]}
    assert {("derived_from", "s3://b/d/pre.tif"), ("source", "s3://b/d/pre.tif")} <= links
    # a local file is named relative to the pairs run's input, not linked (it would resolve inside the release)
    assert item["properties"]["changeforge:sources"] == {"post": ["naip/post.tif"]}
    assert "platform" not in item["properties"] and not any(link["href"] == "naip/post.tif" for link in item["links"])
    nogeo = stac.pair_item({"id": "p2", "split": "train"}, {"A": "a"}, ["manual"], [], "2026-03-04")
    assert nogeo["geometry"] is None and "bbox" not in nogeo
    assert nogeo["properties"]["datetime"].startswith("2026-03-04") and not nogeo["properties"]["acquisition_dates_known"]


# -- annotations facts from a review output ----------------------------------------------------------
def test_review_output_reaches_the_annotation_facts(tmp_path):
    import pandas as pd
    from operators.publish import recipes
    from operators.publish.sources import LanguageSource
    from operators.review.agreement import wilson_interval

    def row(tid, verdict, selected, judge):
        return {"task_id": tid, "annotation_id": tid * 10, "status": "reviewed" if verdict else "unreviewed",
                "item_id": f"i{tid}", "pair_id": f"p{tid}", "facet": "scale", "text": f"t{tid}", "verdict": verdict,
                "selected": selected, "judge_accept": judge, "error_categories": [], "corrected_text": None,
                "stratum": "scale", "stratum_size": 10, "annotated_at": "2026-01-01"}
    rows = [row(1, "correct", True, True), row(2, "wrong", True, True), row(3, "correct", True, False),
            row(4, None, True, True)]
    (tmp_path / "review").mkdir()
    pd.DataFrame(rows).to_parquet(tmp_path / "review" / "part-0.parquet")
    review = recipes.review_summary(str(tmp_path))
    table = pd.DataFrame({"validator_ok": [True, False, False, None]})
    caps = LanguageSource("x", {}, table, [{"run_id": "r1", "model": "gen-m", "judge_model": "judge-m",
                                           "generate_prompt_version": "g.v1", "judge_prompt_version": "j.v1",
                                           "validators": "reject"}])
    facts = recipes.annotation_facts(caps, None, review)
    lo, hi = wilson_interval(2, 3)
    assert facts["human review"].startswith(f"3 of 4 sampled items reviewed; acceptance 2/3 (Wilson 95% {lo:.3f}-{hi:.3f})")
    assert facts["captions generator models"] == "gen-m" and facts["captions judge models"] == "judge-m"
    assert facts["captions prompt versions"] == "g.v1, j.v1" and facts["captions validators"] == (
        "reject (rules checked against the change mask: numbers, change, location, magnitude, counts, existence; "
        "2 of 3 checked candidates broke a rule)")
    assert "top 3" in facts["captions selection"]
    assert recipes.annotation_facts(caps, None, None)["human review"] == "none recorded for this release"
