"""The score step's items by lineage (jobs.score.status, operators.io.lineage.keyed_status): each scored
row records what it was scored from; ``chain --explain`` counts the images current, stale by cause (the
prediction, the mask, the reference captions), missing, or failed (a mask that cannot be read, named with
its file and reason), reading only the masks whose stamps moved (issue 44)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import cv2
import numpy as np

from operators.io import lineage
from operators.io.storage import Store
from operators.io.tables import new_run_id, write_table_shard

REPO = Path(__file__).resolve().parents[2]
LABELS = REPO / "data" / "levir-cd" / "label"
NAMES = sorted(p.name for p in LABELS.glob("*.png"))[:4]


def test_keyed_status_counts_current_stale_removed_missing_and_failed():
    rec = {"a": {"mask": "m"}, "b": {"mask": "m"}, "gone": {"mask": "m"}, "old": None}
    today = {"a": {"mask": "m"}, "b": {"mask": "m2"}, "new": {"mask": "m"}, "bad": {"mask": "m"}, "old": {"mask": "m"},
             "cannot": {"mask": lineage.unreadable("x.png", "not a readable image")}}
    rec["cannot"] = {"mask": "m"}
    s = lineage.keyed_status(rec, today, failed={"bad"})
    assert lineage.status_line(s) == ("1 current, 2 stale (mask 1, removed 1: b, gone), 1 missing (new), 2 failed "
                                      "(1 unreadable: cannot: x.png: not a readable image), 1 without lineage")
    assert s["needs_run"] is True
    assert lineage.keyed_status({"a": {"mask": "m"}}, {"a": {"mask": "m"}}, ())["needs_run"] is False


def test_the_change_score_status_follows_the_masks(tmp_path, monkeypatch):
    import jobs.score as score
    from operators.scoring.change_ops import PER_IMAGE_SCHEMA, score_pair
    pred, label, out = tmp_path / "pred", tmp_path / "label", tmp_path / "out"
    pred.mkdir(), label.mkdir()
    for n in NAMES:
        shutil.copy(LABELS / n, label / n)
        cv2.imwrite(str(pred / n), np.flipud(cv2.imread(str(LABELS / n), cv2.IMREAD_GRAYSCALE)))
    args = score.parse_args(["change", "--pred", str(pred), "--masks", str(label), "--output", str(out)])
    assert lineage.status_line(score.status(args)) == "0 current, 0 stale, 4 missing (" + ", ".join(NAMES) + "), 0 failed"
    rows = [score_pair(i) for i in score._change_items(args[1])[0]]
    write_table_shard(Store(str(out)), "per_image", [{k: r[k] for k in PER_IMAGE_SCHEMA.names} for r in rows],
                      PER_IMAGE_SCHEMA, new_run_id())
    reads = []
    real = score._mask_digest
    monkeypatch.setattr(score, "_mask_digest", lambda uri: reads.append(Path(uri).parent.name) or real(uri))
    s = score.status(args)
    assert (s["current"], s["needs_run"], reads) == (4, False, [])       # nothing read: every stamp as recorded
    data = (label / NAMES[0]).read_bytes()
    (label / NAMES[0]).unlink()
    (label / NAMES[0]).write_bytes(data)                                   # rewritten, the same mask
    os.utime(label / NAMES[0], ns=(1, 1))
    shutil.copy(pred / NAMES[2], pred / NAMES[1])                         # another prediction
    (label / NAMES[3]).write_bytes(b"not a png")                          # cannot be read
    s = score.status(args)
    assert lineage.status_line(s).startswith(f"2 current, 1 stale (prediction 1: {NAMES[1]}), 0 missing, 1 failed "
                                             f"(1 unreadable: {NAMES[3]}: {label}/{NAMES[3]}: ")
    assert s["needs_run"] is True
    assert sorted(reads) == ["label", "label", "pred"]                      # only the three moved files


def test_the_caption_score_status_follows_references_and_predictions(tmp_path):
    import jobs.score as score
    from operators.scoring.caption_scoring import PER_IMAGE_SCHEMA, row_lineage
    from operators.scoring.caption_sets import match_captions, read_caption_predictions, read_references
    refs, preds = tmp_path / "refs.json", tmp_path / "preds.json"
    shutil.copy(REPO / "data" / "levir-cc" / "LevirCCcaptions.json", refs)
    shutil.copy(REPO / "data" / "levir-cc" / "predictions.json", preds)
    args = score.parse_args(["captions", "--pred", str(preds), "--refs", str(refs), "--output", str(tmp_path / "o")])
    doc = json.loads(refs.read_text())
    split = args[1].split if args[1].split != "auto" else "test"
    images, _ = read_references(doc, split)
    matched = match_captions(images, read_caption_predictions(json.loads(preds.read_text()))[0], split)
    write_table_shard(Store(str(tmp_path / "o")), "per_image", [
        {"filename": i.filename, "lineage": lineage.dumps(row_lineage(i, matched.predictions[i.key]))}
        for i in matched.images], PER_IMAGE_SCHEMA, new_run_id())
    s = score.status(args)
    n = s["current"]
    assert n == len(matched.images) > 1 and s["needs_run"] is False
    first = matched.images[0].filename
    p = json.loads(preds.read_text())
    edited = [dict(e, caption="something else entirely") if isinstance(e, dict) and e.get("filename") == first else e
              for e in p] if isinstance(p, list) else {**p, first: "something else entirely"}
    preds.write_text(json.dumps(edited))
    s = score.status(args)
    assert (s["current"], s["stale_by_cause"], s["stale_first"], s["needs_run"]) == (n - 1, {"prediction": 1}, [first], True)
