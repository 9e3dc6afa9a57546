"""jobs.annotate export and ingest on a small pairs-output layout, without a server: tasks as Label Studio
imports them, an export shaped as Label Studio writes it (brush RLE and polygons), the masks back as
PNGs pixel for pixel, agreement against a plain computation, a disagreement withheld."""
from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.annotate import ExportConfig, IngestConfig, run_export, run_ingest
from operators.annotation.brush_rle import decode_mask
from tests.annotation import drawing
from tests.annotation.drawing import brush

H, W = 40, 56                       # not square
SPLITS = {"s_r0_c0": "train", "s_r0_c1": "test", "s_r1_c0": "val", "s_r1_c1": "train"}


def make_dataset(root: Path) -> Path:
    rng = np.random.default_rng(1)
    for sid in SPLITS:
        for folder in ("A", "B"):
            (root / folder).mkdir(parents=True, exist_ok=True)
            cv2.imwrite(str(root / folder / f"{sid}.png"), rng.integers(0, 255, (H, W, 3), dtype=np.uint8))
    (root / "list").mkdir()
    for split in ("train", "val", "test"):
        (root / "list" / f"{split}.txt").write_text("".join(f"{k}.png\n" for k, v in SPLITS.items() if v == split))
    (root / "metadata").mkdir()
    pq.write_table(pa.table({"slice_id": list(SPLITS)}), root / "metadata" / "part-x-0.parquet")
    return root


def rect(y0, y1, x0, x1):
    return drawing.rect((H, W), y0, y1, x0, x1)


def polygon(name, image, y0, y1, x0, x1):
    pts = [[x * 100 / W, y * 100 / H] for x, y in ((x0, y0), (x1, y0), (x1, y1), (x0, y1))]
    return {"type": "polygonlabels", "from_name": f"{image}_polygon", "to_name": image, "original_width": W,
            "original_height": H, "value": {"points": pts, "polygonlabels": [name]}}


def annotation(aid, who, result, lead=10.0):
    return {"id": aid, "completed_by": who, "result": result, "was_cancelled": False, "lead_time": lead,
            "created_at": f"2026-01-01T00:00:{aid:02d}Z"}


def f1(a, b):                        # plain oracle: 2|a&b| / (|a| + |b|)
    a, b = a.ravel().tolist(), b.ravel().tolist()
    inter = sum(1 for x, y in zip(a, b) if x and y)
    return 1.0 if sum(a) + sum(b) == 0 else 2 * inter / (sum(a) + sum(b))


@pytest.fixture()
def exported(tmp_path):
    ds = make_dataset(tmp_path / "root" / "pairs")
    prelabels = tmp_path / "model"
    prelabels.mkdir()
    cv2.imwrite(str(prelabels / "s_r0_c0.png"), rect(5, 15, 5, 20).astype(np.uint8) * 255)
    s = run_export(ExportConfig(input=str(ds), output=str(tmp_path / "export"), prelabel=f"folder:{prelabels}"))
    return ds, tmp_path, s


def test_export_writes_tasks_with_splits_and_prelabels(exported):
    ds, tmp, s = exported
    tasks = json.loads((tmp / "export" / "tasks.json").read_text())
    assert {t["data"]["pair_id"]: t["data"]["split"] for t in tasks} == SPLITS
    assert s["tasks"] == 4 and s["prelabelled"] == 1
    assert all(t["data"]["pre"].startswith("/data/local-files/?d=pairs/A/") for t in tasks)
    (pred,) = next(t for t in tasks if t["data"]["pair_id"] == "s_r0_c0")["predictions"]
    assert pred["model_version"] == "folder:model" and pred["result"][0]["value"]["brushlabels"] == ["new"]
    assert np.array_equal(decode_mask(pred["result"][0]["value"]["rle"], W, H), rect(5, 15, 5, 20))
    xml = (tmp / "export" / "label_config.xml").read_text()
    assert '<BrushLabels name="post_brush" toName="post"><Label value="new"' in xml
    assert '<BrushLabels name="pre_brush" toName="pre"><Label value="demolished"' in xml


def test_ingest_writes_masks_agreement_and_withholds_disagreement(exported):
    ds, tmp, _ = exported
    tasks = json.loads((tmp / "export" / "tasks.json").read_text())
    by = {t["data"]["pair_id"]: dict(t, id=i + 1) for i, t in enumerate(tasks)}
    new0, dem0 = rect(8, 20, 10, 30), rect(25, 35, 40, 50)
    by["s_r0_c0"]["annotations"] = [annotation(1, 7, [brush("new", "post", new0), polygon("demolished", "pre", 25, 35, 40, 50)])]
    agree_a, agree_b = rect(0, 10, 0, 10), rect(0, 10, 1, 10)      # F1 = 2*90/(100+90) = 0.947
    by["s_r0_c1"]["annotations"] = [annotation(3, 8, [brush("new", "post", agree_b)]),
                                    annotation(2, 7, [brush("new", "post", agree_a)])]
    by["s_r1_c0"]["annotations"] = [annotation(4, 7, [brush("new", "post", rect(0, 20, 0, 20))]),
                                    annotation(5, 8, [brush("new", "post", rect(20, 40, 30, 56))])]
    by["s_r1_c1"]["annotations"] = []
    export = tmp / "ls-export.json"
    export.write_text(json.dumps(list(by.values())))

    s = run_ingest(IngestConfig(input=str(ds), export=str(export)))
    read = lambda rel: cv2.imread(str(ds / rel), cv2.IMREAD_UNCHANGED)
    # The single annotation as it is: both classes, 0/255 single channel, pixel for pixel.
    assert read("label1/s_r0_c0.png").ndim == 2 and set(np.unique(read("label1/s_r0_c0.png"))) == {0, 255}
    assert np.array_equal(read("label1/s_r0_c0.png") > 0, new0)
    assert np.array_equal(read("label2/s_r0_c0.png") > 0, dem0)
    assert np.array_equal(read("label/s_r0_c0.png") > 0, new0 | dem0)
    # Two agreeing annotations: the earliest (id 2, created first) is merged.
    assert np.array_equal(read("label1/s_r0_c1.png") > 0, agree_a)
    # Disagreement and no annotation: no mask at all, listed instead.
    for sid in ("s_r1_c0", "s_r1_c1"):
        assert not any((ds / f / f"{sid}.png").exists() for f in ("label", "label1", "label2"))
    pending = {r["pair_id"]: r for r in pq.read_table(ds / "annotation_pending").to_pylist()}
    assert {k: v["status"] for k, v in pending.items()} == {"s_r1_c0": "disagreement", "s_r1_c1": "unannotated"}
    assert s["merged"] == 2 and s["disagreements"] == ["s_r1_c0"] and s["double_annotated"] == 2

    rows = pq.read_table(ds / "annotations").to_pylist()
    assert len(rows) == (1 + 2 + 2) * 2                               # annotations x classes
    agree = {(r["pair_id"], r["class"]): r["agreement_f1"] for r in rows if r["order"] == 0}
    assert agree[("s_r0_c1", "new")] == pytest.approx(f1(agree_a, agree_b))
    assert agree[("s_r1_c0", "new")] == pytest.approx(f1(rect(0, 20, 0, 20), rect(20, 40, 30, 56)))
    assert agree[("s_r0_c1", "demolished")] == 1.0                   # both empty: they agree there is none
    assert s["batch_agreement"] == pytest.approx((f1(agree_a, agree_b) + 0.0) / 2) and s["batch_accepted"] is False
    first = next(r for r in rows if r["pair_id"] == "s_r0_c0" and r["class"] == "new")
    pre = rect(5, 15, 5, 20)
    assert first["iou_vs_prelabel"] == pytest.approx((new0 & pre).sum() / (new0 | pre).sum())
    assert first["pixels"] == new0.sum() and first["annotator"] == "7" and first["lead_time_s"] == 10.0

    # --require-check: the single annotation now waits, and the maps an earlier ingest wrote are withdrawn.
    s = run_ingest(IngestConfig(input=str(ds), export=str(export), require_check=True))
    assert s["merged"] == 1 and not (ds / "label" / "s_r0_c0.png").exists()


def test_a_file_export_with_prediction_ids_takes_the_prelabels_from_tasks_json(exported):
    ds, tmp, _ = exported
    tasks = json.loads((tmp / "export" / "tasks.json").read_text())
    drawn = rect(8, 20, 10, 30)
    for i, t in enumerate(tasks):       # as downloaded from the UI: predictions by id only
        t.update(id=i + 1, predictions=[i + 1], annotations=[annotation(i + 1, 7, [brush("new", "post", drawn)])])
    export = tmp / "ui-export.json"
    export.write_text(json.dumps(tasks))
    pre = rect(5, 15, 5, 20)
    expected = (drawn & pre).sum() / (drawn | pre).sum()
    for given, iou in (("", None), (str(tmp / "export" / "tasks.json"), expected)):
        run_ingest(IngestConfig(input=str(ds), export=str(export), tasks=given))
        rows = pq.read_table(ds / "annotations").to_pylist()
        row = next(r for r in rows if r["pair_id"] == "s_r0_c0" and r["class"] == "new")
        assert row["iou_vs_prelabel"] == (None if iou is None else pytest.approx(iou))
