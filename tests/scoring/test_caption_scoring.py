"""Caption scoring against pycocoevalcap called directly on the same inputs (tokenisation included), on
the repository's small caption set (data/levir-cc: references written for the real LEVIR-CD pairs in
data/levir-cd, predictions from a second writer)."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from operators.scoring.caption_metrics import METRIC_KEYS, JavaMissing, require_java
from operators.scoring.caption_sets import match_captions, read_caption_predictions, read_references

REPO = Path(__file__).resolve().parents[2]
REFS = REPO / "data" / "levir-cc" / "LevirCCcaptions.json"
PREDS = REPO / "data" / "levir-cc" / "predictions.json"


def direct_pycocoevalcap(ids: list[str], refs: dict[str, list[str]], preds: dict[str, str], meteor=None) -> dict:
    """What COCOEvalCap.evaluate does (minus SPICE), written out here against the package itself. ``meteor``:
    the package's METEOR scorer to use (its Java process starts and loads its tables on the first score, several
    seconds: one serves a test's sets), else a new one."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.meteor.meteor import Meteor
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    tok = PTBTokenizer()
    gts = tok.tokenize({i: [{"caption": c} for c in refs[i]] for i in ids})
    res = tok.tokenize({i: [{"caption": preds[i]}] for i in ids})
    out = {}
    for scorer, names in ((Bleu(4), METRIC_KEYS[:4]), (meteor or Meteor(), ["METEOR"]), (Rouge(), ["ROUGE_L"]),
                          (Cider(), ["CIDEr"])):
        score, _ = scorer.compute_score(gts, res)
        for name, value in zip(names, score if isinstance(score, list) else [score]):
            out[name] = value
    return out, gts, res


def test_reading_and_matching():
    images, problems = read_references(json.loads(REFS.read_text()), "test")
    assert len(images) == 8 and not problems
    preds, bad = read_caption_predictions(json.loads(PREDS.read_text()))
    m = match_captions(images, preds, "test")
    assert len(m.images) == 8  # "test_2_0000_0512" (no extension) matches test_2_0000_0512.png
    assert [(p["item"], p["error_type"]) for p in m.problems] == [("test_999_0000_0000.png", "extra_prediction")]
    dict_preds, _ = read_caption_predictions({"test_7_0256_0512.png": "houses appear"})
    m = match_captions(images, dict_preds, "test")
    assert len(m.images) == 1 and sum(p["error_type"] == "missing_prediction" for p in m.problems) == 7
    with pytest.raises(SystemExit, match="train, val"):
        read_references({"images": [{"filename": "a.png", "split": "train", "sentences": [{"raw": "x"}]},
                                     {"filename": "b.png", "split": "val", "sentences": [{"raw": "x"}]}]}, "test")


def test_missing_java_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(JavaMissing, match="default-jre-headless"):
        require_java()


@pytest.mark.slow
def test_caption_job_matches_pycocoevalcap(tmp_path):
    from jobs.score import CaptionScoreConfig, run_captions

    doc = run_captions(CaptionScoreConfig(pred=str(PREDS), refs=str(REFS), output=str(tmp_path / "out"),
                                          split="test", masks=str(REPO / "data" / "levir-cd" / "label")))
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == doc
    refs = {img["filename"]: [s["raw"] for s in img["sentences"]]
            for img in json.loads(REFS.read_text())["images"] if img["split"] == "test"}
    preds = {p["filename"] if p["filename"].endswith(".png") else p["filename"] + ".png": p["caption"]
             for p in json.loads(PREDS.read_text())}
    ids = sorted(refs)
    from pycocoevalcap.meteor.meteor import Meteor
    meteor = Meteor()       # the oracle's one METEOR for both sets below
    expected, gts, res = direct_pycocoevalcap(ids, refs, preds, meteor)
    for k in METRIC_KEYS:
        assert doc[k] == expected[k], k  # identical, not approximately: same tokens, same package
    assert doc["n_images"] == 8 and doc["change_flag_source"] == "masks"
    # test_113 has no mask: in neither subset, and an error row; the rest have non-empty masks.
    assert doc["change"]["n_images"] == 7 and doc["no_change"]["n_images"] == 0
    assert doc["no_change"]["CIDEr"] is None
    change_ids = [i for i in ids if i != "test_113_0256.png"]
    expected_change, _, _ = direct_pycocoevalcap(change_ids, refs, preds, meteor)
    for k in METRIC_KEYS:
        assert doc["change"][k] == expected_change[k], k
    errors = sorted((r["item"], r["error_type"]) for r in pq.read_table(tmp_path / "out" / "errors").to_pylist())
    assert errors == [("test_113_0256.png", "missing_mask"), ("test_999_0000_0000.png", "extra_prediction")]
    assert doc["n_errors"] == 2
    rows = {r["filename"]: r for r in pq.read_table(tmp_path / "out" / "per_image").to_pylist()}
    assert sorted(rows) == ids


@pytest.mark.slow
def test_tokenize_and_bleu_against_hand_worked_examples():
    """Oracles written by hand, not by the package: PTB tokenisation (lower case, clitics split off,
    punctuation dropped) and BLEU-1 of one caption (clipped unigram precision times the brevity
    penalty against the closest reference length)."""
    import math

    from operators.scoring.caption_metrics import score_tokenized, tokenize

    got = tokenize({"a": ["A new building's roof, near the road.", "Two houses -- demolished!"]})
    assert got == {"a": ["a new building 's roof near the road", "two houses demolished"]}
    gts = {"x": ["a new house is built near the road"]}
    res = {"x": ["a new house appears"]}
    scores, _ = score_tokenized(gts, res, {"all": ["x"]})["all"]
    # 3 of 4 predicted words in the reference; 4 words against 8: brevity penalty exp(1 - 8/4)
    assert scores["Bleu_1"] == pytest.approx(0.75 * math.exp(1 - 8 / 4), abs=1e-6)
