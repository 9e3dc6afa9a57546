"""Pre-labels: keyed by the full pair id in a split-folder dataset with equal stems, sizes checked at
export, RGBA masks read on their colour channels, a bad pre-label that never costs a pair its mask,
and an ONNX change model (a tiny graph built here with onnx.helper) run as a Ray Data map."""
from __future__ import annotations

import json

import cv2
import numpy as np
import pyarrow.parquet as pq
import pytest

from jobs.annotate import ExportConfig, IngestConfig, run_export, run_ingest
from operators.annotation.brush_rle import decode_mask
from operators.annotation.onnx_prelabels import masks_from_output, model_inputs, session
from tests.annotation import drawing
from tests.annotation.drawing import brush

H, W = 24, 32


def rect(y0, y1, x0, x1, shape=(H, W)):
    return drawing.rect(shape, y0, y1, x0, x1)


def split_dataset(root):
    """train/A/1.png and test/A/1.png (equal stems), val/A/2.png; the post image brighter in a box."""
    rng = np.random.default_rng(3)
    for split, stem, box in (("train", "1", (2, 10, 3, 12)), ("test", "1", (12, 20, 15, 30)), ("val", "2", (0, 5, 0, 5))):
        pre = rng.integers(40, 80, (H, W, 3), dtype=np.uint8)
        post = pre.copy()
        post[rect(*box)] = 250
        for folder, img in (("A", pre), ("B", post)):
            (root / split / folder).mkdir(parents=True, exist_ok=True)
            cv2.imwrite(str(root / split / folder / f"{stem}.png"), img)
    return root


def tasks_by_item(out):
    return {t["data"]["item_id"]: t for t in json.loads((out / "tasks.json").read_text())}


def test_split_folders_with_equal_stems_sizes_and_rgba(tmp_path):
    ds = split_dataset(tmp_path / "root" / "ds")
    model = tmp_path / "model"
    for split in ("train", "test", "val"):
        (model / split).mkdir(parents=True)
    cv2.imwrite(str(model / "train" / "1.png"), rect(2, 10, 3, 12).astype(np.uint8) * 255)
    rgba = np.zeros((H, W, 4), np.uint8)
    rgba[:, :, 3] = 255                                   # opaque everywhere: alpha is not change
    rgba[12:16, 15:19, 2] = 255                           # 16 red pixels (BGRA order on disk)
    cv2.imwrite(str(model / "test" / "1.png"), rgba)
    cv2.imwrite(str(model / "val" / "2.png"), np.zeros((H + 1, W), np.uint8))    # wrong size
    s = run_export(ExportConfig(input=str(ds), output=str(tmp_path / "out"), prelabel=f"folder:{model}"))
    tasks = tasks_by_item(tmp_path / "out")
    assert sorted(tasks) == ["test/1", "train/1"] and s["prelabel_errors"] == 1     # val/2: an error row, no task
    (err,) = pq.read_table(tmp_path / "out" / "errors").to_pylist()
    assert err["item"] == "val/2" and "33x25" not in err["message"] and f"{W}x{H + 1}" in err["message"]
    got = {k: decode_mask(t["predictions"][0]["result"][0]["value"]["rle"], W, H) for k, t in tasks.items()}
    assert np.array_equal(got["train/1"], rect(2, 10, 3, 12))
    assert int(got["test/1"].sum()) == 16 and np.array_equal(got["test/1"], rect(12, 16, 15, 19))

    # Ingest: each task's mask goes to its own split folder; a broken pre-label (another size) leaves
    # the IoU empty and an error row, and the pair is merged all the same.
    export = []
    for i, (item, t) in enumerate(sorted(tasks.items())):
        drawn = rect(2, 10, 3, 12) if item == "train/1" else rect(12, 20, 15, 30)
        export.append(dict(t, id=i + 1, annotations=[{"id": i + 1, "completed_by": 1, "result": [brush("new", "post", drawn)],
                                                      "created_at": "2026-01-01T00:00:00Z"}]))
    export[0]["predictions"][0]["result"][0]["original_width"] = W + 3
    (tmp_path / "x.json").write_text(json.dumps(export))
    run_ingest(IngestConfig(input=str(ds), export=str(tmp_path / "x.json")))
    assert np.array_equal(cv2.imread(str(ds / "train" / "label1" / "1.png"), 0) > 0, rect(2, 10, 3, 12))
    assert np.array_equal(cv2.imread(str(ds / "test" / "label1" / "1.png"), 0) > 0, rect(12, 20, 15, 30))
    rows = {r["pair_id"]: r for r in pq.read_table(ds / "annotations").to_pylist() if r["annotation_id"] > 0}
    assert rows["test/1"]["prelabel_iou"] is None and json.loads(rows["train/1"]["prelabel_iou"])["new"] == 1.0
    errors = pq.read_table(ds / "errors").to_pylist()
    assert [e["item"] for e in errors] == ["test/1"] and errors[0]["stage"] == "annotate_prelabel_iou"


def change_model(path, single_input=False, classes=0, size=("H", "W"), collapse=False):
    """A tiny change model: mean absolute difference over the channels, a steep sigmoid around 0.3; or,
    with ``classes``, per-class logits (no change, then change in class 1). ``size``: its declared input
    size (dynamic by default); ``collapse``: its output is one value (fails on every pair)."""
    import onnx
    from onnx import TensorProto, helper
    dims = [1, 6 if single_input else 3, *size]
    nodes, inputs = [], []
    if single_input:
        inputs = [helper.make_tensor_value_info("pair", TensorProto.FLOAT, dims)]
        nodes.append(helper.make_node("Split", ["pair"], ["pre", "post"], axis=1, num_outputs=2))
    else:
        inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, dims) for n in ("pre", "post")]
    inits = [helper.make_tensor("k", TensorProto.FLOAT, [], [40.0]), helper.make_tensor("t", TensorProto.FLOAT, [], [0.3]),
             helper.make_tensor("axes", TensorProto.INT64, [3] if collapse else [1], [1, 2, 3] if collapse else [1])]
    nodes += [helper.make_node("Sub", ["post", "pre"], ["d"]), helper.make_node("Abs", ["d"], ["ad"]),
              helper.make_node("ReduceMean", ["ad", "axes"], ["m"], keepdims=1),
              helper.make_node("Sub", ["m", "t"], ["c"]), helper.make_node("Mul", ["c", "k"], ["logit"])]
    if classes:
        nodes += [helper.make_node("Neg", ["logit"], ["nochange"]),
                  helper.make_node("Concat", ["nochange", "logit"], ["out"], axis=1)]
    else:
        nodes.append(helper.make_node("Sigmoid", ["logit"], ["out"]))
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 2 if classes else 1, *(("1", "1") if collapse else size)])
    graph = helper.make_graph(nodes, "change", inputs, [out], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("single_input,classes", [(False, 0), (True, 2)])
def test_onnx_core_both_input_layouts_and_outputs(tmp_path, single_input, classes):
    a = np.full((H, W, 3), 60, np.uint8)
    b = a.copy()
    b[rect(5, 15, 8, 20)] = 240
    sess = session(change_model(tmp_path / "m.onnx", single_input, classes).read_bytes())
    (out, *_) = sess.run(None, model_inputs([i.name for i in sess.get_inputs()], a, b))
    masks = masks_from_output(out, ["new", "demolished"], (H, W))
    assert np.array_equal(masks["new"], rect(5, 15, 8, 20))
    with pytest.raises(ValueError, match="expected 1 x C x 25"):
        masks_from_output(out, ["new"], (H + 1, W))


def test_onnx_prelabels_through_export_on_ray(ray_session, tmp_path):
    ds = split_dataset(tmp_path / "root" / "ds")
    model = change_model(tmp_path / "tiny.onnx")
    s = run_export(ExportConfig(input=str(ds), output=str(tmp_path / "out"), prelabel=f"onnx:{model}"))
    assert s["prelabel"] == "onnx:tiny.onnx" and s["prelabelled"] == 3
    tasks = tasks_by_item(tmp_path / "out")
    for item, box in (("train/1", (2, 10, 3, 12)), ("test/1", (12, 20, 15, 30)), ("val/2", (0, 5, 0, 5))):
        (pred,) = tasks[item]["predictions"]
        assert pred["model_version"] == "onnx:tiny.onnx"
        assert np.array_equal(decode_mask(pred["result"][0]["value"]["rle"], W, H), rect(*box))
    with pytest.raises(ValueError, match="cannot load the model"):
        run_export(ExportConfig(input=str(ds), output=str(tmp_path / "out2"), prelabel=f"onnx:{tmp_path / 'nope.onnx'}"))


def test_a_model_of_another_input_size_stops_the_export_before_any_task_or_project(tmp_path, monkeypatch):
    from operators.annotation.onnx_prelabels import input_mismatch
    ds = split_dataset(tmp_path / "root" / "ds")
    model = change_model(tmp_path / "fixed.onnx", size=(256, 256))
    monkeypatch.setattr("operators.labelstudio.client.call", lambda *a, **k: pytest.fail("a project was made"))
    monkeypatch.setattr("operators.io.cli.init_ray", lambda *a, **k: pytest.fail("Ray started"))
    with pytest.raises(ValueError, match=r"^--prelabel onnx:.*fixed.onnx: the model takes pre 1x3x256x256, post "
                                         r"1x3x256x256; the pairs need 1x3x24x32 \(24 x 32 px\): export it with dynamic"):
        run_export(ExportConfig(input=str(ds), output=str(tmp_path / "out"), prelabel=f"onnx:{model}",
                                label_studio_url="http://127.0.0.1:9"))
    assert not (tmp_path / "out" / "tasks.json").exists()
    # at the pairs' size, with one six-channel input, with dynamic axes: fine; a wrong channel count is not
    assert input_mismatch([("pre", [1, 3, 24, 32]), ("post", [1, 3, "H", None])], 24, 32) is None
    assert input_mismatch([("pair", [1, 6, "H", "W"])], 24, 32) is None
    assert "pair 1x3x?x?" in input_mismatch([("pair", [1, 3, "H", "W"])], 24, 32)
    assert input_mismatch([("pre", [1, 3, 24])], 24, 32) is not None
    assert "pre 1x3x24x33" in input_mismatch([("pre", [1, 3, 24, 33]), ("post", [1, 3, 24, 32])], 24, 32)


def test_a_model_that_fails_on_every_pair_fails_the_run(ray_session, tmp_path):
    ds = split_dataset(tmp_path / "root" / "ds")
    model = change_model(tmp_path / "one-value.onnx", collapse=True)
    with pytest.raises(ValueError, match=r"the model failed on every pair \(3\), e.g. test/1: the model's output is "
                                         r"\[1, 1, 1, 1\]"):
        run_export(ExportConfig(input=str(ds), output=str(tmp_path / "out"), prelabel=f"onnx:{model}"))
    assert not (tmp_path / "out" / "tasks.json").exists()
