"""Export without a server: images from S3 as presigned URLs that fetch the dataset's bytes, local
images as Label Studio local-files URLs, a pair without images as an error row, and reproducibility."""
import json
import urllib.request

import pyarrow.parquet as pq
import pytest

from jobs.review import ExportConfig, run_export
from tests.review.conftest import LEVIR, write_parquet_shard

PAIRS = ["test_2_0000_0000", "test_55_0256_0000", "train_36_0512_0512", "val_27_0000_0256"]


def small_captions_output(folder, pair_ids):
    rows, pairs = [], []
    for p in pair_ids:
        for i, persp in enumerate(("change_type", "spatial_location", "visual_appearance", "scale", "implication")):
            overall = float(4 + (i * 3 + len(p)) % 7)
            rows.append({"pair_id": p, "split": p.split("_")[0], "filename": f"{p}.png", "candidate_index": i,
                         "perspective": persp, "caption": f"{persp} caption of {p}", "overall": overall,
                         "selected": overall >= 7, "judge_reason": "r", "judge_model": "judge", "run_id": "r1"})
        pairs.append({"pair_id": p, "split": p.split("_")[0], "filename": f"{p}.png", "car": 0.1})
    write_parquet_shard(folder / "captions", rows)
    write_parquet_shard(folder / "pairs", pairs)
    return folder


def test_export_with_s3_images_uses_presigned_urls(s3_client, s3_bucket, tmp_path):
    for p in PAIRS[:3]:                                  # the fourth pair's images are not uploaded
        for folder in ("A", "B", "label"):
            s3_client.put_object(Bucket=s3_bucket, Key=f"levir/{folder}/{p}.png",
                                 Body=(LEVIR / folder / f"{p}.png").read_bytes())
    src = small_captions_output(tmp_path / "captions", PAIRS)
    s = run_export(ExportConfig(input=str(src), output=f"s3://{s3_bucket}/review", images=f"s3://{s3_bucket}/levir",
                                sample=8, include_rejected=True, stratify="perspective"))
    assert s["image_urls"] == "presigned-s3" and s["missing_images"] == 5 and s["population"] == 20
    tasks = json.loads(s3_client.get_object(Bucket=s3_bucket, Key="review/tasks.json")["Body"].read())
    assert len(tasks) == 8 and not any(t["data"]["pair_id"] == PAIRS[3] for t in tasks)
    t = tasks[0]["data"]
    for key, folder in (("pre", "A"), ("post", "B"), ("mask", "label")):
        assert "X-Amz-Signature=" in t[key]
        with urllib.request.urlopen(t[key], timeout=10) as r:
            assert r.read() == (LEVIR / folder / f"{t['pair_id']}.png").read_bytes()
    errors = s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="review/errors/")["Contents"]
    assert len(errors) == 1


def test_export_local_files_is_reproducible_and_selected_only(tmp_path):
    src = small_captions_output(tmp_path / "captions", PAIRS)
    cfg = ExportConfig(input=str(src), output=str(tmp_path / "out"), images=str(LEVIR), sample=6, seed=5)
    s = run_export(cfg)
    first = (tmp_path / "out" / "tasks.json").read_text()
    run_export(cfg)
    assert (tmp_path / "out" / "tasks.json").read_text() == first
    tasks = json.loads(first)
    selected = pq.read_table(src / "captions").to_pandas()["selected"]
    assert s["local_files_root"] == str(LEVIR.parent) and s["population"] == selected.sum() < len(selected)
    assert all(t["data"]["selected"] for t in tasks)
    assert tasks[0]["data"]["pre"] == f"/data/local-files/?d=levir-cd/A/{tasks[0]['data']['pair_id']}.png"
    sample = pq.read_table(tmp_path / "out" / "sample.parquet").to_pandas()
    assert sorted(sample["item_id"]) == sorted(t["data"]["item_id"] for t in tasks)
    other = run_export(ExportConfig(input=str(src), output=str(tmp_path / "out2"), images=str(LEVIR), sample=6, seed=6))
    assert other["sampled"] == 6
    with pytest.raises(ValueError, match="subfolder"):
        run_export(ExportConfig(input=str(src), output=str(tmp_path / "o3"), images=str(LEVIR), local_files_root=str(LEVIR)))


def test_export_of_a_qa_output(tmp_path):
    from tests.review.conftest import make_qa_output
    pairs = [{"pair_id": p, "filename": f"{p}.png", "split": p.split("_")[0], "car": 0.02 * i}
             for i, p in enumerate(PAIRS)]
    src = make_qa_output(tmp_path / "qa", pairs)
    s = run_export(ExportConfig(input=str(src), output=str(tmp_path / "out"), images=str(LEVIR), sample=6,
                                stratify="question_type,car_class", include_rejected=True))
    assert s["kind"] == "qa" and s["population"] == 20           # the older run's duplicate row is not an item
    tasks = json.loads((tmp_path / "out" / "tasks.json").read_text())
    assert all(t["data"]["text"].startswith("Q: ") and "\nA: " in t["data"]["text"] for t in tasks)
    assert "question" in (tmp_path / "out" / "label_config.xml").read_text()
