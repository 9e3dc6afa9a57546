"""Change-detection scoring: real LEVIR-CD masks against predictions derived from them, checked against an
independent computation written here from the textbook definitions (2x2 histogram, class-wise scores,
Cohen's kappa from observed and chance agreement)."""
from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pyarrow.parquet as pq
import pytest

from operators.scoring.confusion import SCORE_KEYS, confusion_counts, scores_from_counts
from operators.scoring.masks import decode_mask, match_masks

REPO = Path(__file__).resolve().parents[2]
LABELS = REPO / "data" / "levir-cd" / "label"
NAMES = sorted(p.name for p in LABELS.glob("*.png"))


def real_label(name: str) -> np.ndarray:
    return cv2.imread(str(LABELS / name), cv2.IMREAD_GRAYSCALE) > 0


def derive(label: np.ndarray, how: str) -> np.ndarray:
    if how == "shifted":
        return np.roll(label, (9, -5), axis=(0, 1))
    if how == "eroded":
        return cv2.erode(label.astype(np.uint8), np.ones((7, 7), np.uint8)).astype(bool)
    if how == "empty":
        return np.zeros_like(label)
    if how == "all_change":
        return np.ones_like(label)
    if how == "same":
        return label.copy()
    raise ValueError(how)


def reference_scores(hist: np.ndarray) -> dict:
    """hist[label, pred] (2x2). Written independently of operators.scoring.confusion."""
    hist = hist.astype(np.float64)
    n = hist.sum()
    ref = {}
    f1s, ious = [], []
    for c in (0, 1):
        tp = hist[c, c]
        p = tp / hist[:, c].sum()           # column: predicted as c
        r = tp / hist[c, :].sum()           # row: labelled c
        f1s.append(2 * p * r / (p + r))
        ious.append(tp / (hist[:, c].sum() + hist[c, :].sum() - tp))
        if c == 1:
            ref.update(precision=p, recall=r, f1=f1s[-1], iou=ious[-1])
    po = np.trace(hist) / n
    pe = sum(hist[c, :].sum() * hist[:, c].sum() for c in (0, 1)) / n ** 2
    ref.update(oa=po, kappa=(po - pe) / (1 - pe), mf1=np.mean(f1s), miou=np.mean(ious))
    return ref


def histogram(pred: np.ndarray, label: np.ndarray) -> np.ndarray:
    return np.bincount(label.ravel().astype(np.int64) * 2 + pred.ravel(), minlength=4).reshape(2, 2)


@pytest.mark.parametrize("how", ["shifted", "eroded"])
def test_scores_match_independent_computation_on_real_masks(how):
    changed = [n for n in NAMES if real_label(n).any()]
    assert len(changed) >= 8
    total = np.zeros((2, 2), np.int64)
    for name in changed:
        label = real_label(name)
        pred = derive(label, how)
        hist = histogram(pred, label)
        total += hist
        tn, fp, fn, tp = confusion_counts(pred, label)
        assert (tn, fp, fn, tp) == (hist[0, 0], hist[0, 1], hist[1, 0], hist[1, 1])
        ours, ref = scores_from_counts(tn, fp, fn, tp), reference_scores(hist)
        for k in SCORE_KEYS:
            assert ours[k] == pytest.approx(ref[k], rel=1e-12, abs=1e-15), (name, k)
    ours = scores_from_counts(total[0, 0], total[0, 1], total[1, 0], total[1, 1])
    ref = reference_scores(total)
    for k in SCORE_KEYS:
        assert ours[k] == pytest.approx(ref[k], rel=1e-12), k
    assert 0.3 < ours["f1"] < 0.99  # a real, imperfect prediction, not a degenerate one


def test_defined_values_on_edge_cases():
    label = real_label("train_36_0512_0512.png")
    empty, full = np.zeros_like(label), np.ones_like(label)
    assert set(scores_from_counts(*confusion_counts(empty, empty)).values()) == {1.0}
    assert set(scores_from_counts(*confusion_counts(full, full)).values()) == {1.0}
    # Nothing predicted on a changed label: changed-class scores 0, unchanged class scored normally.
    s = scores_from_counts(*confusion_counts(empty, label))
    n_change = label.sum()
    assert (s["precision"], s["recall"], s["f1"], s["iou"], s["kappa"]) == (0.0, 0.0, 0.0, 0.0, 0.0)
    assert s["oa"] == pytest.approx(1 - n_change / label.size)
    assert s["miou"] == pytest.approx(s["oa"] / 2)
    # Everything predicted: recall 1, precision = change fraction.
    s = scores_from_counts(*confusion_counts(full, label))
    assert s["recall"] == 1.0 and s["precision"] == pytest.approx(n_change / label.size)
    # Change predicted on an unchanged (real, all-zero) label.
    nochange = real_label("train_386_0512_0768.png")
    assert not nochange.any()
    s = scores_from_counts(*confusion_counts(full, nochange))
    assert (s["precision"], s["recall"], s["f1"], s["oa"]) == (0.0, 0.0, 0.0, 0.0)
    assert all(v is None for v in scores_from_counts(0, 0, 0, 0).values())


# Mutants of operators/scoring/confusion.py no test can kill (tools/mutation.py reads these lines):
# counts are never negative (popcounts, or sums of them), and chance agreement is at most 1.
# equivalent mutant: core/ReplaceComparisonOperator_Eq_LtE on `perfect = fp == 0 and fn == 0`: with counts >= 0, `<= 0` is `== 0`
# equivalent mutant: core/ReplaceComparisonOperator_Eq_LtE on `if n == 0:`: with counts >= 0, `n <= 0` is `n == 0`
# equivalent mutant: core/ReplaceComparisonOperator_Gt_NotEq on `if den > 0:`: a sum of counts is >= 0, so `!= 0` is `> 0`
# equivalent mutant: core/ReplaceComparisonOperator_GtE_Eq on `kappa = 1.0 if chance >= 1.0 else (oa - chance) / (1.0 - chance)`: chance is at most 1, so `== 1.0` is `>= 1.0`


def test_a_size_mismatch_names_both_sizes():
    with pytest.raises(ValueError, match=r"^size mismatch: prediction 3x2, label 5x4$"):
        confusion_counts(np.zeros((2, 3), bool), np.zeros((4, 5), bool))
    # The larger mask on either side (a shape compared by order would let one through to broadcasting).
    with pytest.raises(ValueError, match=r"^size mismatch: prediction 5x4, label 4x4$"):
        confusion_counts(np.zeros((4, 5), bool), np.zeros((4, 4), bool))
    with pytest.raises(ValueError, match=r"^size mismatch: prediction 1x4, label 4x4$"):
        confusion_counts(np.zeros((4, 1), bool), np.ones((4, 4), bool))   # would broadcast


# equivalent mutant: core/ReplaceBinaryOperator_BitAnd_FloorDiv on `tp = int(np.count_nonzero(pred & label))`: (pred // label) on two masks of 0/1 (or 0/255) values p // l is non-zero exactly where both are (1 // 1, 255 // 255; x // 0 gives 0), so the count is the same.


@pytest.mark.parametrize("counts", [(0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (1, 0, 0, 0), (1, 1, 1, 1),
                                    (2, 1, 0, 1), (3, 0, 2, 1), (0, 1, 1, 0), (5, 2, 3, 7)])
def test_scores_of_small_counts_match_the_formulas(counts):
    """Counts of a few pixels, where a ratio's denominator is 1 or 2 and one class may be absent: each
    score against its formula written out here (0/0 as the module doc defines it)."""
    tn, fp, fn, tp = counts
    n = tn + fp + fn + tp

    def ratio(num, den, absent):
        return num / den if den else (1.0 if absent else 0.0)

    def cls(tp_, fp_, fn_):
        absent = fp_ == 0 and fn_ == 0
        return (ratio(tp_, tp_ + fp_, absent), ratio(tp_, tp_ + fn_, absent),
                ratio(2 * tp_, 2 * tp_ + fp_ + fn_, absent), ratio(tp_, tp_ + fp_ + fn_, absent))

    p, r, f1, iou = cls(tp, fp, fn)
    _, _, f1_0, iou_0 = cls(tn, fn, fp)
    oa = (tp + tn) / n
    pe = ((tp + fp) * (tp + fn) + (tn + fn) * (tn + fp)) / n ** 2
    kappa = 1.0 if pe == 1 else (oa - pe) / (1 - pe)
    expected = {"precision": p, "recall": r, "f1": f1, "iou": iou, "oa": oa, "kappa": kappa,
                "mf1": (f1 + f1_0) / 2, "miou": (iou + iou_0) / 2}
    ours = scores_from_counts(*counts)
    assert ours == pytest.approx(expected, rel=1e-12, abs=1e-15)
    pred = np.array([False] * tn + [True] * fp + [False] * fn + [True] * tp)
    label = np.array([False] * (tn + fp) + [True] * (fn + tp))
    assert confusion_counts(pred, label) == counts


def test_any_nonzero_pixel_is_change():
    label = real_label("test_2_0000_0000.png")
    for encoded in (label.astype(np.uint8), label.astype(np.uint8) * 255, label.astype(np.uint8) * 37,
                    np.dstack([label.astype(np.uint8)] * 3), (label.astype(np.uint16) * 1000)):
        ok, buf = cv2.imencode(".png", encoded)
        assert np.array_equal(decode_mask(buf.tobytes()), label)
    with pytest.raises(ValueError):
        decode_mask(b"not a png")


def test_matching_by_file_name():
    pairs, problems = match_masks(["a.png", "b.png", "x.png", "sub/a.png"], ["a.png", "b.png", "c.png"])
    assert [p["name"] for p in pairs] == ["b.png"]
    kinds = sorted((p["error_type"], p["name"]) for p in problems)
    assert kinds == [("duplicate_name", "a.png"), ("extra_prediction", "x.png"), ("missing_prediction", "a.png"),
                     ("missing_prediction", "c.png")]


def _write_predictions(folder: Path) -> dict[str, np.ndarray]:
    """Derived predictions in several encodings; returns what each file means as a boolean mask."""
    folder.mkdir(parents=True, exist_ok=True)
    hows = ["shifted", "eroded", "empty", "all_change", "same"]
    meaning = {}
    for i, name in enumerate(NAMES):
        if name == "val_27_0000_0256.png":
            continue  # missing prediction
        label = real_label(name)
        pred = derive(label, hows[i % len(hows)])
        encoded = pred.astype(np.uint8) * (1, 255, 128)[i % 3]  # 0/1, 0/255 and stray greys
        cv2.imwrite(str(folder / name), encoded)
        meaning[name] = pred
    cv2.imwrite(str(folder / "not_in_labels.png"), np.zeros((8, 8), np.uint8))  # extra prediction
    cv2.imwrite(str(folder / "test_2_0000_0512.png"), np.zeros((128, 256), np.uint8))  # size mismatch
    meaning.pop("test_2_0000_0512.png")
    return meaning


def _expected(meaning: dict[str, np.ndarray]) -> tuple[dict, dict]:
    total, per_image = np.zeros((2, 2), np.int64), {}
    for name, pred in meaning.items():
        hist = histogram(pred, real_label(name))
        total += hist
        per_image[name] = scores_from_counts(hist[0, 0], hist[0, 1], hist[1, 0], hist[1, 1])
    return reference_scores(total), per_image


def _check_outputs(doc: dict, per_image_table, errors_table, meaning) -> None:
    ref, per_image = _expected(meaning)
    assert set(doc) == set(SCORE_KEYS) | {"per_image_mean", "n_images", "n_errors"}
    for k in SCORE_KEYS:
        assert doc[k] == pytest.approx(ref[k], rel=1e-12), k
        assert doc["per_image_mean"][k] == pytest.approx(np.mean([s[k] for s in per_image.values()]), rel=1e-12), k
    assert doc["n_images"] == len(meaning) and doc["n_errors"] == 3
    rows = {r["name"]: r for r in per_image_table.to_pylist()}
    assert sorted(rows) == sorted(meaning)
    for name, s in per_image.items():
        for k in SCORE_KEYS:
            assert rows[name][k] == pytest.approx(s[k], rel=1e-12)
    errors = sorted((r["item"], r["error_type"]) for r in errors_table.to_pylist())
    assert errors == [("not_in_labels.png", "extra_prediction"), ("test_2_0000_0512.png", "size_mismatch"),
                      ("val_27_0000_0256.png", "missing_prediction")]


@pytest.mark.slow
def test_change_job_local_and_s3(tmp_path, ray_session, s3_client, s3_bucket):
    from jobs.score import ChangeScoreConfig, run_change

    meaning = _write_predictions(tmp_path / "pred")
    out = tmp_path / "out"
    doc = run_change(ChangeScoreConfig(pred=str(tmp_path / "pred"), label=str(LABELS), output=str(out)))
    assert json.loads((out / "metrics.json").read_text()) == doc
    _check_outputs(doc, pq.read_table(out / "per_image"), pq.read_table(out / "errors"), meaning)
    # A rerun replaces the tables instead of adding to them.
    run_change(ChangeScoreConfig(pred=str(tmp_path / "pred"), label=str(LABELS), output=str(out)))
    assert pq.read_table(out / "per_image").num_rows == len(meaning)
    assert pq.read_table(out / "errors").num_rows == 3

    for side, folder in (("pred", tmp_path / "pred"), ("label", LABELS)):
        for f in folder.glob("*.png"):
            s3_client.upload_file(str(f), s3_bucket, f"{side}/{f.name}")
    doc_s3 = run_change(ChangeScoreConfig(pred=f"s3://{s3_bucket}/pred", label=f"s3://{s3_bucket}/label",
                                          output=f"s3://{s3_bucket}/out"))
    assert doc_s3 == doc
    import io
    read = lambda t: pq.read_table(io.BytesIO(s3_client.get_object(Bucket=s3_bucket, Key=t)["Body"].read()))  # noqa: E731
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="out/")["Contents"]]
    import pyarrow as pa
    per_image = pa.concat_tables([read(k) for k in keys if k.startswith("out/per_image/")])
    errors = pa.concat_tables([read(k) for k in keys if k.startswith("out/errors/")])
    _check_outputs(doc_s3, per_image, errors, meaning)


def test_a_scored_pair_records_the_two_masks_it_was_scored_on(tmp_path):
    from operators.io import lineage
    from operators.scoring.change_ops import score_pair
    label = sorted(LABELS.glob("*.png"))[0]
    pred = tmp_path / "pred.png"
    m = cv2.imread(str(label), cv2.IMREAD_GRAYSCALE)
    cv2.imwrite(str(pred), np.flipud(m))
    row = score_pair({"name": label.stem, "pred": str(pred), "label": str(label)})
    assert lineage.loads(row["lineage"]) == {"pred_mask": lineage.mask_digest(np.flipud(m)),
                                             "mask": lineage.mask_digest(m)}
