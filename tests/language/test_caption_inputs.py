"""Finding pairs in the supported layouts and preparing them (no Ray, no LLM)."""
import json
import shutil
from pathlib import Path

import cv2
import numpy as np

from operators.language.caption_ops import PrepareConfig, discover_pairs, prepare_pair

LEVIR = Path(__file__).resolve().parents[2] / "data" / "levir-cd"


def unwrap(envelopes):
    assert len(envelopes) == 1
    return envelopes[0]["_table"], json.loads(envelopes[0]["_record"])


def test_flat_layout_finds_every_name_and_splits_from_prefixes():
    pairs = discover_pairs(str(LEVIR))
    assert len(pairs) == 12
    by_id = {p["pair_id"]: p for p in pairs}
    assert by_id["val_27_0000_0256"]["split"] == "val"
    assert by_id["train_36_0512_0512"]["split"] == "train"
    assert by_id["test_113_0256"]["label_rel"] == ""          # no mask: reported when prepared


def test_list_file_restricts_pairs():
    pairs = discover_pairs(str(LEVIR), list_file="list/demo.txt")
    names = [ln.strip() for ln in (LEVIR / "list" / "demo.txt").read_text().splitlines() if ln.strip()]
    assert sorted(p["filename"] for p in pairs) == sorted(names)


def test_split_folders(tmp_path):
    for split, name in (("train", "train_36_0512_0512.png"), ("test", "test_2_0000_0000.png")):
        for folder in ("A", "B", "label"):
            (tmp_path / split / folder).mkdir(parents=True)
            shutil.copy(LEVIR / folder / name, tmp_path / split / folder / name)
    pairs = discover_pairs(str(tmp_path))
    assert sorted((p["pair_id"], p["split"]) for p in pairs) == [
        ("test/test_2_0000_0000", "test"), ("train/train_36_0512_0512", "train")]


def test_prepare_real_pair_and_missing_mask():
    pairs = {p["pair_id"]: p for p in discover_pairs(str(LEVIR))}
    table, rec = unwrap(prepare_pair(pairs["train_386_0512_0768"], PrepareConfig(max_image_side=128)))
    assert table == "_generate" and rec["car"] == 0 and rec["change_region"] == "no change"
    assert rec["a_url"].startswith("data:image/png;base64,")
    decoded = cv2.imdecode(np.frombuffer(__import__("base64").b64decode(rec["a_url"].split(",", 1)[1]), np.uint8),
                           cv2.IMREAD_UNCHANGED)
    assert decoded.shape[:2] == (128, 128)                       # resized to --max-image-side
    assert set(rec["hashes"]) == {"a_rel", "b_rel", "label_rel"}
    table, rec = unwrap(prepare_pair(pairs["test_113_0256"]))
    assert table == "errors" and "missing change mask" in rec["message"]


def _write_pair(root, name, a, b, label):
    for folder, img in (("A", a), ("B", b), ("label", label)):
        (root / folder).mkdir(parents=True, exist_ok=True)
        if isinstance(img, bytes):
            (root / folder / name).write_bytes(img)
        else:
            cv2.imwrite(str(root / folder / name), img)


def test_prepare_reports_size_mismatch_and_unreadable_files(tmp_path):
    img = np.full((20, 30, 3), 90, np.uint8)
    mask01 = np.zeros((20, 30), np.uint8)
    mask01[5:10, 5:10] = 1
    mask01[0, 0] = 3                                              # a stray grey value
    _write_pair(tmp_path, "ok.png", img, img, mask01)
    _write_pair(tmp_path, "sizes.png", img, np.zeros((20, 31, 3), np.uint8), mask01)
    _write_pair(tmp_path, "broken.png", img, b"not a png at all", mask01)
    pairs = {p["pair_id"]: p for p in discover_pairs(str(tmp_path))}
    table, rec = unwrap(prepare_pair(pairs["ok"]))
    assert table == "_generate" and rec["changed_pixels"] == 26
    table, rec = unwrap(prepare_pair(pairs["sizes"]))
    assert table == "errors" and "size mismatch" in rec["message"]
    table, rec = unwrap(prepare_pair(pairs["broken"]))
    assert table == "errors" and "not a readable image" in rec["message"]


def test_real_rgba_interlaced_pair_with_different_sizes_is_an_error(tmp_path):
    a = (LEVIR / "A" / "test_113_0256.png").read_bytes()
    b = (LEVIR / "B" / "test_113_0256.png").read_bytes()
    _write_pair(tmp_path, "test_113_0256.png", a, b, np.zeros((384, 768), np.uint8))
    (pair,) = discover_pairs(str(tmp_path))
    table, rec = unwrap(prepare_pair(pair))
    assert table == "errors"
    assert "size mismatch" in rec["message"] and "768x384" in rec["message"] and "768x383" in rec["message"]
