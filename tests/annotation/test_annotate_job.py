"""jobs.annotate export, ingest and status over two rounds, without a server: exports shaped as Label
Studio writes them (brush RLE, polygons, `quality` choices, skips, ground truth, edits), the masks back
as PNGs pixel for pixel, the history append-only and the derived state byte-identical when an old export
arrives again."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.annotate import ExportConfig, IngestConfig, StatusConfig, main, run_export, run_ingest, run_status
from operators.annotation.brush_rle import decode_mask
from operators.annotation.summary import format_status
from operators.io.storage import Store
from operators.io.tables import read_table
from tests.annotation import drawing
from tests.annotation.drawing import brush

H, W = 40, 56                       # not square
IDS = [f"s{i}" for i in range(8)]
SPLITS = {sid: ("train", "val", "test")[i % 3] for i, sid in enumerate(IDS)}


def make_dataset(root: Path, ids=IDS) -> Path:
    rng = np.random.default_rng(1)
    for sid in ids:
        for folder in ("A", "B"):
            (root / folder).mkdir(parents=True, exist_ok=True)
            cv2.imwrite(str(root / folder / f"{sid}.png"), rng.integers(0, 255, (H, W, 3), dtype=np.uint8))
    (root / "list").mkdir()
    for split in ("train", "val", "test"):
        (root / "list" / f"{split}.txt").write_text("".join(f"{k}.png\n" for k, v in SPLITS.items() if v == split))
    (root / "metadata").mkdir()
    pq.write_table(pa.table({"slice_id": list(ids)}), root / "metadata" / "part-x-0.parquet")
    return root


def rect(y0, y1, x0, x1):
    return drawing.rect((H, W), y0, y1, x0, x1)


def polygon(name, image, y0, y1, x0, x1):
    pts = [[x * 100 / W, y * 100 / H] for x, y in ((x0, y0), (x1, y0), (x1, y1), (x0, y1))]
    return {"type": "polygonlabels", "from_name": f"{image}_polygon", "to_name": image, "original_width": W,
            "original_height": H, "value": {"points": pts, "polygonlabels": [name]}}


def quality(*choices):
    return {"type": "choices", "from_name": "quality", "to_name": "post", "value": {"choices": list(choices)}}


def annotation(aid, who, result, minute, project=1, lead=10.0, cancelled=False, ground_truth=False, edited=None):
    made = f"2026-01-01T00:{minute:02d}:00Z"
    return {"id": aid, "completed_by": who, "result": result, "was_cancelled": cancelled, "lead_time": lead,
            "ground_truth": ground_truth, "project": project, "created_at": made, "updated_at": edited or made}


def read(ds: Path, rel: str):
    m = cv2.imread(str(ds / rel), cv2.IMREAD_UNCHANGED)
    return None if m is None else m > 0


def tree_digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def history(ds: Path) -> list[dict]:
    return pq.read_table(ds / "annotations").to_pylist()


def state(ds: Path) -> dict:
    return {r["pair_id"]: r for r in read_table(Store(str(ds)), "annotation_state").to_pylist()}


# The round-1 drawings. s0: annotator and checker agree within the tolerance; the checker (id 3) drew
# later than the annotator (id 4) although its id is lower. s2: they disagree (tolerant F1 0.6).
S0_ANNOTATOR, S0_CHECKER = rect(5, 20, 5, 25), rect(6, 20, 5, 26)
S1 = rect(0, 10, 0, 10)
S2_A, S2_B = rect(0, 20, 0, 20), rect(0, 20, 10, 30)
S3_NEW, S3_GONE = rect(8, 20, 10, 30), (25, 35, 40, 50)
S6 = rect(30, 38, 2, 12)
EXPERT = rect(2, 18, 4, 24)


def round1(tasks: list[dict]) -> list[dict]:
    by = {t["data"]["pair_id"]: dict(t, id=100 + i, project=1) for i, t in enumerate(tasks)}
    by["s0"]["annotations"] = [annotation(4, "ann@x", [brush("new", "post", S0_ANNOTATOR)], 1),
                               annotation(3, "chk@x", [brush("new", "post", S0_CHECKER)], 2)]
    by["s1"]["annotations"] = [annotation(5, "ann@x", [brush("new", "post", S1)], 3),
                               annotation(6, "chk@x", [brush("new", "post", S1)], 4)]
    by["s2"]["annotations"] = [annotation(7, "ann@x", [brush("new", "post", S2_A)], 5),
                               annotation(8, "chk@x", [brush("new", "post", S2_B)], 6)]
    by["s3"]["annotations"] = [annotation(9, "ann@x", [brush("new", "post", S3_NEW), polygon("demolished", "pre", *S3_GONE)], 7)]
    by["s4"]["annotations"] = [annotation(10, "ann@x", [quality("unusable", "cloud")], 8)]
    by["s5"]["annotations"] = [annotation(11, "ann@x", [], 9, cancelled=True)]
    by["s6"]["annotations"] = [annotation(12, "ann@x", [brush("new", "post", S6)], 10),
                               annotation(13, "chk@x", [], 11, cancelled=True)]
    del by["s7"]                     # exported, nobody has opened it yet
    return list(by.values())


@pytest.fixture()
def dataset(tmp_path):
    return make_dataset(tmp_path / "root" / "pairs")


def export(ds: Path, out: Path, **kw) -> tuple[dict, list[dict]]:
    s = run_export(ExportConfig(input=str(ds), output=str(out), **kw))
    return s, json.loads((out / "tasks.json").read_text())


def ingest(ds: Path, export_tasks, path: Path, **kw) -> dict:
    path.write_text(json.dumps(export_tasks))
    return run_ingest(IngestConfig(input=str(ds), export=str(path), **kw))


def test_two_rounds_history_roles_and_an_old_export_arriving_again(dataset, tmp_path, capsys):
    ds = dataset
    s, tasks = export(ds, tmp_path / "r1")
    assert s["tasks"] == 8 and json.loads((ds / "label_classes.json").read_text())["classes"][1]["folder"] == "label2"
    assert '<Choices name="quality"' in (tmp_path / "r1" / "label_config.xml").read_text()
    r1 = round1(tasks)
    s1 = ingest(ds, r1, tmp_path / "r1.json")

    st = state(ds)
    assert {k: v["status"] for k, v in st.items()} == {
        "s0": "merged", "s1": "merged", "s2": "disagreement", "s3": "merged", "s4": "unusable",
        "s5": "unannotated", "s6": "merged"}
    # The checker's drawing is the mask (not the annotator's, not their union); who is who by created_at.
    assert np.array_equal(read(ds, "label1/s0.png"), S0_CHECKER)
    assert st["s0"]["annotator"] == "ann@x" and st["s0"]["checker"] == "chk@x"
    assert np.array_equal(read(ds, "label1/s3.png"), S3_NEW)
    assert np.array_equal(read(ds, "label2/s3.png"), rect(*S3_GONE))
    assert np.array_equal(read(ds, "label/s3.png"), S3_NEW | rect(*S3_GONE))
    assert np.array_equal(read(ds, "label1/s6.png"), S6)          # the skipped check is not a drawing
    for sid in ("s2", "s4", "s5", "s7"):
        assert not any((ds / f / f"{sid}.png").exists() for f in ("label", "label1", "label2"))
    assert st["s4"]["reason"] == "cloud, unusable"
    assert s1["pairs"]["by_status"] == {"merged": 4, "expert": 0, "awaiting_check": 0, "disagreement": 1,
                                        "unusable": 1, "unannotated": 2, "not_exported": 0, "unreadable": 0}
    assert s1["annotations"] == {"total": 11, "submitted": 9, "skipped": 2, "annotators": 2, "experts": 0}
    assert s1["agreement"]["pairs"] == 3 and s1["agreement"]["mean"] == pytest.approx((1 + 1 + 0.6) / 3)
    assert s1["excluded"] == [{"pair_id": "s4", "status": "unusable", "reason": "cloud, unusable"}]
    assert s1["pairs"]["decided"] == 5 and s1["double_annotated_share"] == pytest.approx(2 / 4)
    assert s1["disagreements"] == ["s2"] and s1["merged"] == 4
    assert len(history(ds)) == 7 + 11                             # a task row per task, a row per annotation
    pending = {r["pair_id"]: r["status"] for r in read_table(Store(str(ds)), "annotation_pending").to_pylist()}
    assert pending == {"s2": "disagreement", "s4": "unusable", "s5": "unannotated"}

    # Round 2: the review queue carries s2 with both drawings; the annotate queue the pairs not decided.
    s, review = export(ds, tmp_path / "r2-review", queue="review")
    assert [t["data"]["item_id"] for t in review] == ["s2"] and review[0]["data"]["queue"] == "review"
    assert [p["model_version"] for p in review[0]["predictions"]] == ["annotator:ann@x", "checker:chk@x"]
    assert np.array_equal(decode_mask(review[0]["predictions"][1]["result"][0]["value"]["rle"], W, H), S2_B)
    assert run_status(StatusConfig(input=str(ds)))["next"] == [
        "1 disagreements wait in the expert's review project: ingest it when reviewed",
        "2 pairs exported but not annotated (or skipped): in Label Studio, or export them again with --resend"]
    s, _ = export(ds, tmp_path / "r2-review-again", queue="review")
    assert s["tasks"] == 0 and s["left_out"]["handed out"] == 1               # already with the expert
    # s5 (skipped) and s7 (nobody got to it) are still open in project 1: sent again only when asked
    s, _ = export(ds, tmp_path / "r2-no")
    assert s["tasks"] == 0 and s["left_out"] == {"decided": 4, "disagreement": 1, "unusable": 1, "handed out": 2}
    s, again = export(ds, tmp_path / "r2", resend=True)
    assert sorted(t["data"]["item_id"] for t in again) == ["s5", "s7"]      # never s4 (unusable)
    r2 = [dict(review[0], id=200, project=2, annotations=[
              annotation(20, "exp@x", [brush("new", "post", EXPERT)], 20, project=2, ground_truth=True)]),
          dict(next(t for t in again if t["data"]["item_id"] == "s5"), id=201, project=2, annotations=[
              annotation(21, "ann@x", [brush("new", "post", S1)], 21, project=2),
              annotation(22, "chk@x", [brush("new", "post", S1)], 22, project=2)]),
          dict(next(t for t in again if t["data"]["item_id"] == "s7"), id=202, project=2, annotations=[
              annotation(23, "ann@x", [brush("new", "post", S6)], 23, project=2)])]
    ingest(ds, r2, tmp_path / "r2.json")
    st = state(ds)
    assert st["s2"]["status"] == "expert" and np.array_equal(read(ds, "label1/s2.png"), EXPERT)
    assert st["s5"]["status"] == "merged" and st["s7"]["status"] == "merged"
    # Round 1's pairs are not in round 2's export: their masks stay.
    assert np.array_equal(read(ds, "label1/s0.png"), S0_CHECKER) and (ds / "label2" / "s3.png").exists()
    status = run_status(StatusConfig(input=str(ds)))
    assert status["pairs"]["by_status"]["merged"] == 6 and status["pairs"]["by_status"]["expert"] == 1
    assert status["pairs"]["decided"] == 8 and status["expert_resolved_share"] == pytest.approx(1 / 7)
    assert main(["status", "--input", str(ds)]) == 0
    out = capsys.readouterr().out
    assert "merged 6, expert 1" in out and "excluded s4: cloud, unusable" in out
    print(out)  # noqa: T201 - the report quotes it (pytest -s)

    # Round 1's export again, and an empty export: nothing changes, not a byte, not a history row.
    before, rows = tree_digest(ds), len(history(ds))
    ingest(ds, r1, tmp_path / "r1.json")
    assert len(history(ds)) == rows and tree_digest(ds) == before
    ingest(ds, [], tmp_path / "empty.json")
    assert tree_digest(ds) == before

    # An edited annotation is a new version; the latest wins.
    edited = json.loads(json.dumps(r1))
    s3 = next(t for t in edited if t["data"]["item_id"] == "s3")
    s3["annotations"][0].update(result=[brush("new", "post", S6)], updated_at="2026-01-02T00:00:00Z")
    ingest(ds, [s3], tmp_path / "edit.json")
    assert len(history(ds)) == rows + 1
    assert np.array_equal(read(ds, "label1/s3.png"), S6) and not read(ds, "label2/s3.png").any()
    # --require-check: s3, s6 and s7 (single annotations) now wait, and every mask written for them goes;
    # so does s4 (one person's "unusable" is an answer like a drawing: it waits for its check too).
    s = ingest(ds, [], tmp_path / "empty.json", require_check=True)
    assert s["pairs"]["by_status"]["awaiting_check"] == 4
    for sid in ("s3", "s6", "s7"):
        assert not any((ds / f / f"{sid}.png").exists() for f in ("label", "label1", "label2"))
    labels = {r["slice_id"]: r for r in read_table(Store(str(ds)), "labels").to_pylist()}
    assert labels["s3"]["label_uri"] is None and labels["s0"]["changed_pixels"] == int(S0_CHECKER.sum())


def test_a_rejected_batch_is_held_for_the_expert(dataset, tmp_path):
    _, tasks = export(dataset, tmp_path / "r1")
    by = {t["data"]["pair_id"]: dict(t, id=100 + i, project=1) for i, t in enumerate(tasks)}
    by["s0"]["annotations"] = [annotation(1, "a", [brush("new", "post", S1)], 1), annotation(2, "b", [brush("new", "post", S1)], 2)]
    by["s1"]["annotations"] = [annotation(3, "a", [brush("new", "post", S2_A)], 3), annotation(4, "b", [brush("new", "post", rect(30, 40, 40, 56))], 4)]
    s = ingest(dataset, [by["s0"], by["s1"]], tmp_path / "x.json")
    assert s["batches"] == [{"project": 1, "instance": "", "mean_agreement": 0.5, "pairs": 2, "accepted": False}]
    st = state(dataset)
    assert st["s0"]["status"] == "disagreement" and "batch (project 1) rejected" in st["s0"]["reason"]
    assert s["pairs"]["held_by_batch"] == 1                          # s0; s1 is a real disagreement
    assert "disagreement 2, " in format_status(s) and "(1 of the disagreements held by a rejected batch" in format_status(s)
    assert not (dataset / "label" / "s0.png").exists()


def test_single_class_scheme_travels_and_a_contradicting_classes_is_one_line(dataset, tmp_path):
    _, tasks = export(dataset, tmp_path / "r1", classes="change:post")
    doc = json.loads((dataset / "label_classes.json").read_text())
    assert doc["classes"] == [{"name": "change", "image": "post", "folder": "label1"}]
    t = dict(tasks[0], id=1, annotations=[annotation(1, "a", [brush("change", "post", S1)], 1)])
    s = ingest(dataset, [t], tmp_path / "x.json")                  # no --classes: the dataset's scheme
    assert s["classes"] == doc["classes"]
    assert np.array_equal(read(dataset, "label1/s0.png"), S1) and np.array_equal(read(dataset, "label/s0.png"), S1)
    assert not (dataset / "label2").exists()
    with pytest.raises(SystemExit, match="contradicts the dataset's label_classes.json"):
        main(["ingest", "--input", str(dataset), "--export", str(tmp_path / "x.json"), "--classes", "new:post,demolished:pre"])


def test_a_file_export_with_prediction_ids_takes_the_prelabels_from_tasks_json(dataset, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    cv2.imwrite(str(model / "s0.png"), rect(5, 15, 5, 20).astype(np.uint8) * 255)
    _, tasks = export(dataset, tmp_path / "r1", prelabel=f"folder:{model}")
    drawn = rect(8, 20, 10, 30)
    t = dict(tasks[0], id=1, predictions=[1], annotations=[annotation(1, 7, [brush("new", "post", drawn)], 1)])
    pre = rect(5, 15, 5, 20)
    ingest(dataset, [t], tmp_path / "ui.json", tasks=str(tmp_path / "r1" / "tasks.json"))
    (row,) = [r for r in history(dataset) if r["annotation_id"] == 1]
    assert json.loads(row["prelabel_iou"])["new"] == pytest.approx((drawn & pre).sum() / (drawn | pre).sum())
    assert json.loads(row["pixels"]) == {"new": int(drawn.sum()), "demolished": 0}
    summary = json.loads((dataset / "annotation_summary.json").read_text())
    assert summary["prelabel"] == {"method": "folder", "median_iou": pytest.approx((drawn & pre).sum() / (drawn | pre).sum())}


def test_an_export_with_a_broken_annotation_id_and_a_foreign_task_loses_nothing_else(dataset, tmp_path):
    """An annotation whose id is not a positive integer, and a task naming no pair, each become one error
    row with its reason; the good annotations of the same task are merged as if the bad one were absent,
    and the same export again adds no error twice over (the errors are this run's, the state unchanged)."""
    _, tasks = export(dataset, tmp_path / "r1")
    by = {t["data"]["pair_id"]: dict(t, id=100 + i, project=1) for i, t in enumerate(tasks)}
    s0 = dict(by["s0"], annotations=[annotation(-1, "ghost@x", [brush("new", "post", S2_B)], 1),
                                     annotation(4, "ann@x", [brush("new", "post", S0_ANNOTATOR)], 2),
                                     annotation("x7", "odd@x", [], 3),
                                     annotation(3, "chk@x", [brush("new", "post", S0_CHECKER)], 4)])
    foreign = dict(by["s1"], id=999, data=dict(by["s1"]["data"], item_id="elsewhere", pair_id="elsewhere"))
    ingest(dataset, [s0, foreign], tmp_path / "a.json")
    st = state(dataset)["s0"]
    assert (st["status"], st["annotations"], st["annotator"], st["checker"]) == ("merged", 2, "ann@x", "chk@x")
    assert sorted(r["annotation_id"] for r in history(dataset)) == [-1, 3, 4]     # the task row, the two good
    errors = read_table(Store(str(dataset)), "errors").to_pylist()        # the current state, as users read it
    assert sorted((e["item"], e["stage"], e["error_type"], e["message"].split(" (")[0]) for e in errors) == [
        ("elsewhere", "annotate_ingest", "UnknownPair", "task 999 names a pair that is not in the dataset"),
        ("s0", "annotation_ids", "BadAnnotationId", "task 100: annotation id(s) -1, 'x7' not positive integers")]
    before = tree_digest(dataset / "annotation_state")
    ingest(dataset, [s0, foreign], tmp_path / "a.json")
    assert tree_digest(dataset / "annotation_state") == before


def test_a_third_class_is_never_dropped(dataset, tmp_path):
    _, tasks = export(dataset, tmp_path / "r1", classes="building:post,road:post,demolished:pre")
    drawn = {"building": rect(0, 10, 0, 10), "road": rect(20, 24, 0, 56), "demolished": rect(30, 40, 40, 50)}
    image = {"building": "post", "road": "post", "demolished": "pre"}
    t = dict(tasks[0], id=1, annotations=[annotation(1, "a", [brush(c, image[c], m) for c, m in drawn.items()], 1)])
    ingest(dataset, [t], tmp_path / "x.json")
    for i, c in enumerate(drawn):
        assert np.array_equal(read(dataset, f"label{i + 1}/s0.png"), drawn[c])
    assert np.array_equal(read(dataset, "label/s0.png"), drawn["building"] | drawn["road"] | drawn["demolished"])


def ls_task(t: dict, updated: str) -> dict:
    """A task as a full Label Studio export gives it: its annotation counts and when it was last saved."""
    anns = t.get("annotations") or []
    return dict(t, updated_at=updated, total_annotations=sum(1 for a in anns if not a.get("was_cancelled")),
                cancelled_annotations=sum(1 for a in anns if a.get("was_cancelled")))


def test_a_deleted_annotation_is_withdrawn_on_disk_and_a_partial_export_withdraws_nothing(dataset, tmp_path):
    _, tasks = export(dataset, tmp_path / "r1")
    by = {t["data"]["pair_id"]: dict(t, id=100 + i, project=1) for i, t in enumerate(tasks)}
    wrong, right = annotation(1, "ann@x", [brush("new", "post", S2_B)], 1), annotation(2, "chk@x", [brush("new", "post", S2_A)], 2)
    s0, s1 = dict(by["s0"], annotations=[wrong, right]), dict(by["s1"], annotations=[])
    ingest(dataset, [ls_task(s0, "2026-01-01T00:02:00Z"), ls_task(s1, "2026-01-01T00:00:00Z")], tmp_path / "a.json")
    assert state(dataset)["s0"]["status"] == "disagreement"
    # the lead deletes 1 and the annotator submits 3; a partial export (s1 missing) withdraws nothing
    redo = dict(s0, annotations=[right, annotation(3, "ann@x", [brush("new", "post", S2_A)], 4)])
    ingest(dataset, [ls_task(redo, "2026-01-01T00:04:00Z")], tmp_path / "b.json")
    assert state(dataset)["s0"]["annotations"] == 3 and state(dataset)["s0"]["withdrawn"] == 0
    full = [ls_task(redo, "2026-01-01T00:04:00Z"), ls_task(s1, "2026-01-01T00:00:00Z")]
    ingest(dataset, full, tmp_path / "c.json")
    st = state(dataset)["s0"]
    assert (st["status"], st["annotations"], st["withdrawn"]) == ("merged", 2, 1)
    assert np.array_equal(read(dataset, "label1/s0.png"), S2_A)
    gone = [r for r in history(dataset) if r["annotation_id"] == 1]
    assert [r["withdrawn"] for r in gone] == [False, True]          # the version stays, with its withdrawal
    before = tree_digest(dataset)
    ingest(dataset, full, tmp_path / "c.json")
    assert tree_digest(dataset) == before


def test_a_second_server_under_the_default_instance_stops_before_the_download(dataset, tmp_path, monkeypatch):
    from operators.annotation import ingest_ops
    from operators.annotation.decisions import DecisionConfig
    from operators.annotation.scheme import parse_classes
    _, tasks = export(dataset, tmp_path / "r1")
    t = dict(tasks[0], id=1, project=1, annotations=[annotation(1, "a", [brush("new", "post", S2_A)], 1)])
    store = Store(str(dataset))
    ingest_ops.ingest(store, [t], parse_classes("new:post,demolished:pre"), DecisionConfig(),
                      ingest_ops.ordered_run_id(store), server="http://a:8080")
    monkeypatch.setattr("jobs.annotate.load_export", lambda *a: pytest.fail("downloaded before the check"))
    with pytest.raises(SystemExit, match=r"^jobs.annotate ingest: --export http://b:8080: the history's instance "
                                         r"'\(default\)' is http://a:8080; .*--instance$"):
        main(["ingest", "--input", str(dataset), "--export", "http://B:8080/", "--project-id", "1"])
    # named, the same ids are another instance's: s0 now has two annotations, one from each server
    monkeypatch.setattr("jobs.annotate.load_export", lambda *a: [dict(t, annotations=[
        annotation(1, "b", [brush("new", "post", S2_A)], 2)])])
    s = run_ingest(IngestConfig(input=str(dataset), export="http://b:8080", project_id=1, instance="lab-b"))
    st = state(dataset)["s0"]
    assert (st["status"], st["annotations"], st["annotator"], st["checker"]) == ("merged", 2, "a", "b")
    assert s["agreement"]["per_class"] == {"new": {"mean": 1.0, "median": 1.0, "pairs": 1},
                                           "demolished": {"mean": 1.0, "median": 1.0, "pairs": 1}}
    assert s["settings"]["noise_px"] == 200 and s["batches"][0]["instance"] == "lab-b"


def test_masks_given_with_the_dataset_count_as_decided(tmp_path):
    from operators.chain.people import progress, waiting_line
    ds = make_dataset(tmp_path / "root" / "pairs")
    (ds / "label").mkdir()
    cv2.imwrite(str(ds / "label" / "s7.png"), (rect(0, 10, 0, 10) * 255).astype(np.uint8))
    _, tasks = export(ds, tmp_path / "r1")
    assert len(tasks) == 7                                                 # s7 has its mask
    done = [dict(t, id=i + 1, project=1, annotations=[annotation(i + 1, "a", [brush("new", "post", S2_A)], 1)])
            for i, t in enumerate(tasks)]
    s = ingest(ds, done[:6], tmp_path / "a.json")
    assert (s["pairs"]["total"], s["pairs"]["decided"], s["pairs"]["given_masks"]) == (8, 7, 1)
    assert waiting_line(progress(Store(str(ds)))) == "waiting for annotators: 7 of 8 pairs decided (unannotated 1)"
    s = ingest(ds, done, tmp_path / "b.json")
    assert s["pairs"]["decided"] == 8 and waiting_line(progress(Store(str(ds)))) is None


def test_a_given_mask_of_a_pair_marked_unusable_is_set_aside(tmp_path):
    from operators.io.layout import discover_pairs
    ds = make_dataset(tmp_path / "root" / "pairs")
    (ds / "label").mkdir()
    cv2.imwrite(str(ds / "label" / "s7.png"), (rect(0, 10, 0, 10) * 255).astype(np.uint8))
    given = (ds / "label" / "s7.png").read_bytes()
    _, tasks = export(ds, tmp_path / "r1", skip_labelled=False)
    t = next(t for t in tasks if t["data"]["item_id"] == "s7")
    s = ingest(ds, [dict(t, id=1, project=1, annotations=[annotation(1, "a", [quality("cloud")], 1)])], tmp_path / "a.json")
    assert s["excluded"] == [{"pair_id": "s7", "status": "unusable", "reason": "cloud"}]
    assert not (ds / "label" / "s7.png").exists() and (ds / "unusable_masks" / "label" / "s7.png").read_bytes() == given
    assert next(p for p in discover_pairs(str(ds)) if p["pair_id"] == "s7")["label_rel"] == ""   # what readers see
    before = tree_digest(ds)
    ingest(ds, [dict(t, id=1, project=1, annotations=[annotation(1, "a", [quality("cloud")], 1)])], tmp_path / "a.json")
    assert tree_digest(ds) == before


def test_an_ingest_run_id_sorts_after_every_shard_even_one_from_a_clock_ahead(tmp_path):
    """Readers take the latest row per key in shard-name order: an ingest's run id sorts after every
    run id of the annotation tables, here one written by a clock 0.3 s ahead with the largest suffix."""
    import time
    from operators.annotation.ingest_ops import TABLES, ordered_run_id
    store = Store(str(tmp_path))
    now = time.time() + 0.3
    ahead = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now * 1000) % 1000:03d}-ffffff"
    store.write_bytes(f"{TABLES[-1]}/part-{ahead}-0123456789abcdef.parquet", b"")
    store.write_bytes(f"{TABLES[0]}/part-20260101T000000000-000000-0123456789abcdef.parquet", b"")
    assert ordered_run_id(store) > ahead
