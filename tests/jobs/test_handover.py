"""The seams between jobs, without Ray or an LLM: a pairs output read by the language jobs' pair finder
(splits from list/, unannotated pairs counted, not errors), source.json followed back to the dataset,
jobs.validate on a QA job's VQA.json, and jobs.score's split that exists."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from operators.io.sources import dataset_of, write_source
from operators.io.storage import Store
from operators.language.caption_ops import NO_MASK_YET, find_dataset_pairs
from operators.scoring.caption_sets import pick_split

LEVIR = Path(__file__).resolve().parents[2] / "data" / "levir-cd"
NAMES = ["train_36_0512_0512", "test_2_0000_0000", "val_27_0000_0256", "test_55_0256_0000"]


def fake_pairs_output(root: Path, labelled: set[str]) -> dict[str, str]:
    """A pairs job's output layout from real LEVIR-CD crops under slice-like names: A/ B/, label/ for
    ``labelled``, list/{train,val,test}.txt (splits deliberately unlike the names' prefixes) and a
    metadata/ table. Returns {slice id: split}."""
    splits = {f"p0_r{i:05d}_c00000": s for i, s in enumerate(("test", "train", "train", "val"))}
    for (sid, _), name in zip(splits.items(), NAMES):
        for folder in ("A", "B") + (("label",) if sid in labelled else ()):
            (root / folder).mkdir(parents=True, exist_ok=True)
            shutil.copy(LEVIR / folder / f"{name}.png", root / folder / f"{sid}.png")
    (root / "list").mkdir()
    for split in ("train", "val", "test"):
        (root / "list" / f"{split}.txt").write_text("".join(f"{k}.png\n" for k, v in sorted(splits.items()) if v == split))
    (root / "metadata").mkdir()
    pq.write_table(pa.table({"slice_id": list(splits), "status": ["accepted"] * 4}), root / "metadata" / "part-r-0.parquet")
    return splits


def test_pairs_output_splits_from_lists_and_unannotated_pairs_counted(tmp_path):
    splits = fake_pairs_output(tmp_path, labelled={"p0_r00000_c00000", "p0_r00002_c00000"})
    pairs, skipped = find_dataset_pairs(str(tmp_path))
    assert {p["pair_id"]: p["split"] for p in pairs} == {k: splits[k] for k in ("p0_r00000_c00000", "p0_r00002_c00000")}
    assert skipped == {NO_MASK_YET: 2}


def test_levir_cd_keeps_its_behaviour():
    pairs, skipped = find_dataset_pairs(str(LEVIR))
    assert len(pairs) == 12 and skipped == {}                       # the pair without a mask stays (an error row)
    assert {p["pair_id"]: p["split"] for p in pairs}["val_27_0000_0256"] == "val"


def test_source_json_leads_back_to_the_dataset(tmp_path):
    fake_pairs_output(tmp_path / "pairs", labelled=set())
    write_source(Store(str(tmp_path / "captions")), "caption", input=str(tmp_path / "pairs"), dataset=str(tmp_path / "pairs"))
    write_source(Store(str(tmp_path / "qa")), "qa", input=str(tmp_path / "captions"))
    write_source(Store(str(tmp_path / "review")), "review_export", input=str(tmp_path / "qa"))
    assert dataset_of(str(tmp_path / "review")) == Store(str(tmp_path / "pairs")).uri()
    assert dataset_of(str(tmp_path / "nothing")) is None


def test_validate_reads_a_vqa_json_and_finds_masks_through_source_json(tmp_path):
    from jobs.validate import run
    dataset = tmp_path / "pairs"
    fake_pairs_output(dataset, labelled={"p0_r00000_c00000"})
    mask = cv2.imread(str(dataset / "label" / "p0_r00000_c00000.png"), cv2.IMREAD_GRAYSCALE)
    assert (mask > 0).any()
    qa_out = tmp_path / "qa"
    write_source(Store(str(qa_out)), "qa", input=str(dataset), dataset=str(dataset))
    vqa = {"images": [{"filename": "p0_r00000_c00000.png", "filepath": "test", "split": "test", "qa": [
        {"type": "YES/NO", "question": "Has anything changed?", "answer": "No, nothing changed."},
        {"type": "WHAT", "question": "What changed?", "answer": "New buildings were built."}]}]}
    (qa_out / "VQA.json").write_text(json.dumps(vqa))
    s = run(str(qa_out / "VQA.json"), str(tmp_path / "audit"))
    verdicts = [json.loads(x) for x in (tmp_path / "audit" / "verdicts.jsonl").read_text().splitlines()]
    assert s["claims"] == 2 and s["errors"] == 0
    assert [v["id"] for v in verdicts] == ["p0_r00000_c00000.png#qa0", "p0_r00000_c00000.png#qa1"]
    assert verdicts[0]["ok"] is False                                # "nothing changed" against a changed mask
    assert json.loads((tmp_path / "audit" / "source.json").read_text())["masks"] == Store(str(dataset)).uri()


def test_score_picks_the_split_that_exists():
    docs = [{"images": [{"filename": "a.png", "split": "train"}, {"filename": "b.png", "split": "val"}]}]
    assert pick_split(docs, "auto") == "val"
    assert pick_split(docs + [{"images": [{"filename": "c.png", "split": "test"}]}], "auto") == "test"
    assert pick_split(docs, "train") == "train"
    assert pick_split([{"images": [{"filename": "a.png"}]}], "auto") == "all"
