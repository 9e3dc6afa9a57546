"""jobs.publish reads the dataset's class scheme (label_classes.json) and annotation summary
(annotation_summary.json): a single-class scheme publishes one mask, several classes publish per-class
maps named by the scheme (any order, a third class kept), and the summary's figures, and only those,
reach the card, Croissant's RAI fields and excluded.json."""
from __future__ import annotations

import io
import json
import shutil

import cv2
import numpy as np
import pyarrow.parquet as pq
import pytest

from jobs.publish import main
from operators.annotation.scheme import parse_classes, scheme_document
from tests.conftest import DATA

LEVIR = DATA / "levir-cd"
PAIRS = ("test_102_0512_0000", "test_121_0768_0256", "test_2_0000_0000", "train_36_0512_0512")


def dataset(root, scheme: str | None, maps: dict[str, dict[str, np.ndarray]] | None = None):
    """The pairs as a flat LEVIR-CD layout; with ``maps`` ({pair: {folder: mask}}) the per-class maps and
    label/ as their union (what annotate ingest writes), else label/ copied and label1/ the same mask."""
    for n in PAIRS:
        for role in ("A", "B"):
            (root / role).mkdir(parents=True, exist_ok=True)
            shutil.copy(LEVIR / role / f"{n}.png", root / role / f"{n}.png")
        if maps is None:
            (root / "label").mkdir(exist_ok=True)
            (root / "label1").mkdir(exist_ok=True)
            shutil.copy(LEVIR / "label" / f"{n}.png", root / "label" / f"{n}.png")
            shutil.copy(LEVIR / "label" / f"{n}.png", root / "label1" / f"{n}.png")
        else:
            union = None
            for folder, m in maps[n].items():
                (root / folder).mkdir(exist_ok=True)
                cv2.imwrite(str(root / folder / f"{n}.png"), np.where(m, 255, 0).astype(np.uint8))
                union = m if union is None else (union | m)
            (root / "label").mkdir(exist_ok=True)
            cv2.imwrite(str(root / "label" / f"{n}.png"), np.where(union, 255, 0).astype(np.uint8))
    (root / "licence.txt").write_text("CC0-1.0\n")
    if scheme:
        (root / "label_classes.json").write_text(json.dumps(scheme_document(parse_classes(scheme))))
    return root


def publish(inp, out) -> dict:
    return main(["--input", str(inp), "--output", str(out), "--name", "t", "--version", "1.0.0", "--date", "2026-01-01"])


def rows(release) -> dict[str, dict]:
    table = pq.read_table(sorted((release / "data").glob("*.parquet")))
    return {r["id"]: r for r in table.to_pylist()}, table.schema.names


def decode(cell) -> np.ndarray:
    return cv2.imdecode(np.frombuffer(cell["bytes"], np.uint8), cv2.IMREAD_UNCHANGED)


def test_a_single_class_scheme_publishes_one_mask(tmp_path):
    s = publish(dataset(tmp_path / "ds", "change:post"), tmp_path / "rel")
    release = tmp_path / "rel" / "1.0.0"
    assert sum(s["pairs"].values()) == len(PAIRS) and s["excluded"] == 0
    assert not list(release.glob("*/label1")) and not list(release.glob("*/label_index"))
    got, names = rows(release)
    assert {"mask_new", "mask_demolished", "mask_index", "new_pixels"}.isdisjoint(names)
    for n in PAIRS:
        truth = cv2.imread(str(LEVIR / "label" / f"{n}.png"), cv2.IMREAD_GRAYSCALE) > 0
        assert np.array_equal(decode(got[n]["mask"]) > 0, truth)
    assert json.loads((release / "label_classes.json").read_text())["classes"][0]["name"] == "change"
    card = (release / "README.md").read_text()
    assert "One change class (change, drawn on the post-change image)" in card
    assert "new/demolished" not in card


def test_without_a_scheme_a_lone_label1_is_still_refused(tmp_path):
    """No label_classes.json: label1/ means S2Looking's new buildings and needs its label2/."""
    ds = dataset(tmp_path / "ds", None)
    with pytest.raises(SystemExit, match="only label1 is given"):
        publish(ds, tmp_path / "rel")


SCHEME = "demolished:pre,new:post,road:post"      # not S2Looking's order, and a third class


def drawn():
    out = {}
    for i, n in enumerate(PAIRS):
        h, w = cv2.imread(str(LEVIR / "A" / f"{n}.png")).shape[:2]
        m = {f: np.zeros((h, w), bool) for f in ("label1", "label2", "label3")}
        m["label1"][10:20 + i, 10:30] = True            # demolished: 10+i rows x 20
        m["label2"][50:90, 50:60 + i] = True            # new: 40 x (10+i), overlaps nothing
        m["label3"][15:60, 25:28] = True                # road: crosses both, overlaps them
        out[n] = m
    return out


def test_several_classes_publish_maps_named_by_the_scheme_in_its_order(tmp_path):
    maps = drawn()
    s = publish(dataset(tmp_path / "ds", SCHEME, maps), tmp_path / "rel")
    release = tmp_path / "rel" / "1.0.0"
    assert s["excluded"] == 0
    got, names = rows(release)
    assert {"mask_demolished", "mask_new", "mask_road", "mask_index", "road_pixels"} <= set(names)
    for n in PAIRS:
        r, m = got[n], maps[n]
        assert np.array_equal(decode(r["mask_demolished"]) > 0, m["label1"])
        assert np.array_equal(decode(r["mask_new"]) > 0, m["label2"])
        assert np.array_equal(decode(r["mask_road"]) > 0, m["label3"])
        assert (r["demolished_pixels"], r["new_pixels"], r["road_pixels"]) == tuple(int(m[f].sum()) for f in ("label1", "label2", "label3"))
        index = decode(r["mask_index"])
        # scheme order: 1 = demolished, 2 = new, 3 = road; where maps overlap the first class wins
        expect = np.where(m["label1"], 1, np.where(m["label2"], 2, np.where(m["label3"], 3, 0)))
        assert np.array_equal(index, expect)
        split = r["split"]
        assert np.array_equal(cv2.imread(str(release / split / "label3" / f"{n}.png"), 0) > 0, m["label3"])
    croissant = json.loads((release / "croissant.json").read_text())
    fields = {f["name"]: f["description"] for f in croissant["recordSet"][0]["field"]}
    assert fields["mask_road"].startswith("road (drawn on the post-change image)")
    assert "1 = demolished, 2 = new, 3 = road" in fields["mask_index"]
    assert {"png-label3"} <= {d["@id"] for d in croissant["distribution"]}
    item = json.loads((release / "stac" / "items" / f"{PAIRS[0]}.json").read_text())
    assert item["assets"]["label1"]["title"].startswith("demolished") and item["assets"]["label3"]["title"].startswith("road")
    assert item["properties"]["label:classes"][1]["classes"] == [0, 1, 2, 3]
    card = (release / "README.md").read_text()
    assert "<split>/label2/<id>.png new (drawn on the post-change image), 0/255" in card
    assert "one map per class: demolished, new, road" in card


SUMMARY = {
    "version": 1, "generated_at": "2026-02-01T10:00:00Z",
    "classes": [{"name": "change", "image": "post", "folder": "label1"}],
    "pairs": {"total": 6, "decided": 5, "by_status": {"merged": 3, "expert": 1, "awaiting_check": 0, "disagreement": 1,
                                                      "unusable": 1, "unannotated": 0, "not_exported": 0}},
    "annotations": {"total": 11, "submitted": 10, "skipped": 1, "annotators": 2, "experts": 1},
    "double_annotated_share": 0.6, "expert_resolved_share": 0.2,
    "agreement": {"metric": "boundary F1 at 2 px", "median": 0.913, "mean": 0.874, "pairs": 3},
    "per_annotator": [],
    "prelabel": {"method": "pca-kmeans", "median_iou": 0.41},
    "timeframe": {"first_annotation": "2026-01-20T08:00:00Z", "last_annotation": "2026-01-31T17:30:00Z"},
    "tools": ["Label Studio 1.23.2"],
    "excluded": [{"pair_id": PAIRS[1], "status": "unusable", "reason": "cloud"}],
    "protocol": "Each pair drawn by an annotator and checked by a second; experts decided disagreements."}


def test_the_annotation_summary_reaches_the_card_croissant_and_excluded(tmp_path):
    ds = dataset(tmp_path / "ds", "change:post")
    (ds / "annotation_summary.json").write_text(json.dumps(SUMMARY))
    s = publish(ds, tmp_path / "rel")
    release = tmp_path / "rel" / "1.0.0"
    got, _ = rows(release)
    assert PAIRS[1] not in got and sorted(got) == sorted(set(PAIRS) - {PAIRS[1]})
    excluded = json.loads((release / "excluded.json").read_text())
    assert [(e["item"], e["status"], e["reason"]) for e in excluded] == [(PAIRS[1], "unusable", "cloud")]
    assert s["excluded"] == 1
    rai = json.loads((release / "croissant.json").read_text())
    assert SUMMARY["protocol"] in rai["rai:dataAnnotationProtocol"]
    analysis = rai["rai:dataAnnotationAnalysis"]
    for text in ("boundary F1 at 2 px", "median 0.913", "mean 0.874 over 3", "double-annotated share 60.0%",
                 "resolved by experts 20.0%"):
        assert text in analysis, (text, analysis)
    assert rai["rai:machineAnnotationTools"] == ["change-mask pre-labels: pca-kmeans (median IoU of the final masks "
                                                 "against them 0.410)"]
    assert rai["rai:dataCollectionTimeframe"] == ["2026-01-20T08:00:00Z", "2026-01-31T17:30:00Z"]
    assert "1 pair(s) the annotators marked unusable" in rai["rai:dataPreprocessingProtocol"]
    card = (release / "README.md").read_text()
    assert f"- {PAIRS[1]}: unusable: cloud" in card and "median 0.913" in card and "Label Studio 1.23.2" in card
    assert json.loads((release / "release.json").read_text())["inputs"]["dataset"]["annotation_summary"] == {
        "file": "annotation_summary.json", "generated_at": "2026-02-01T10:00:00Z"}


def test_without_a_summary_the_release_says_the_masks_came_with_the_input_and_no_figure(tmp_path):
    publish(dataset(tmp_path / "ds", "change:post"), tmp_path / "rel")
    release = tmp_path / "rel" / "1.0.0"
    rai = json.loads((release / "croissant.json").read_text())
    assert rai["rai:dataAnnotationProtocol"].startswith("Change masks: as given with the input")
    assert not {"rai:dataAnnotationAnalysis", "rai:dataCollectionTimeframe", "rai:machineAnnotationTools"} & set(rai)
    card = (release / "README.md").read_text()
    section = card.split("### Change masks")[1].split("##")[0]
    assert "as given with the input" in section and not any(ch.isdigit() for ch in section)
