"""The decision core on history rows shaped as ingest writes them (no files, no Ray): versions, skips,
roles by time, the expert, unusable, flags, the tolerant agreement and batches."""
from __future__ import annotations

import json

import numpy as np
import pytest

from operators.annotation.decisions import (DecisionConfig, decide_all, decide_pair, latest_versions, overlap,
                                            tolerant_f1)
from operators.annotation.history import history_rows, new_rows
from tests.annotation import drawing

SHAPE = (32, 48)
CFG = DecisionConfig(noise_px=0)    # the agreement's mechanics on small masks; the noise floor has its own tests


def rect(y0, y1, x0, x1):
    return drawing.rect(SHAPE, y0, y1, x0, x1)


def row(aid, who, mask=None, minute=0, *, project=1, task=1, pair="p", cancelled=False, gt=False, queue="annotate",
        quality=(), edited=None, by=None, instance=""):
    made = f"2026-01-01T00:{minute:02d}:00Z"
    return {"pair_id": pair, "instance": instance, "project": project, "task_id": task, "annotation_id": aid,
            "annotator": who, "updated_by": by, "created_at": made, "updated_at": edited or made,
            "was_cancelled": cancelled, "ground_truth": gt, "queue": queue, "quality": json.dumps(list(quality)),
            "mask": mask}


def masks_of(r):
    m = r["mask"] if r["mask"] is not None else np.zeros(SHAPE, bool)
    return {"new": m}


def test_roles_follow_created_at_not_the_id_and_the_checkers_drawing_is_merged():
    annot, check = rect(4, 20, 4, 30), rect(5, 20, 4, 31)       # a pixel apart at the boundary
    d = decide_pair("p", [row(2, "checker", check, 5), row(9, "annotator", annot, 1)], masks_of, CFG)
    assert (d.status, d.annotator, d.checker) == ("merged", "annotator", "checker")
    assert np.array_equal(d.masks["new"], check) and not np.array_equal(d.masks["new"], annot | check)
    assert d.agreement == 1.0 and d.per_class["new"]["f1"] < 1.0     # plain F1 would count the boundary


def test_cancelled_annotations_are_skips_not_drawings():
    d = decide_pair("p", [row(1, "a", rect(0, 8, 0, 8), 1), row(2, "b", None, 2, cancelled=True)], masks_of, CFG)
    assert (d.status, d.annotations, d.skipped) == ("merged", 1, 1)
    d = decide_pair("p", [row(2, "b", None, 2, cancelled=True)], masks_of, CFG)
    assert (d.status, d.annotations, d.skipped) == ("unannotated", 0, 1)


def test_the_latest_version_of_an_edited_annotation_wins():
    rows = [row(1, "a", rect(0, 8, 0, 8), 1), row(1, "a", rect(10, 20, 10, 20), 1, edited="2026-01-03T00:00:00Z")]
    assert len(latest_versions(rows)) == 1
    d = decide_pair("p", rows[::-1], masks_of, CFG)
    assert np.array_equal(d.masks["new"], rect(10, 20, 10, 20))


def test_the_expert_decides_whatever_the_others_drew_and_unusable_needs_both():
    a, b, e = rect(0, 10, 0, 10), rect(20, 30, 30, 40), rect(2, 12, 2, 12)
    rows = [row(1, "a", a, 1), row(2, "b", b, 2)]
    assert decide_pair("p", rows, masks_of, CFG).status == "disagreement"
    # one expert path: a review answer, or a star the expert put on a drawing (updated_by: who starred it)
    for expert in (row(3, "e", e, 3, task=2, queue="review"), dict(row(2, "b", e, 2, gt=True, by="e",
                                                                       edited="2026-01-01T00:09:00Z"))):
        d = decide_pair("p", [r for r in rows if r["annotation_id"] != expert["annotation_id"]] + [expert],
                        masks_of, CFG)
        assert d.status == "expert" and np.array_equal(d.masks["new"], e) and d.expert == "e", d
    # the checker's "unusable" against the annotator's drawing is for the expert; both saying so excludes
    d = decide_pair("p", [row(1, "a", a, 1), row(4, "c", None, 4, quality=("unusable", "misregistered"))], masks_of, CFG)
    assert (d.status, d.reason) == ("disagreement", "the checker marks the pair unusable (misregistered, unusable), "
                                    "the annotator drew it; for the expert")
    d = decide_pair("p", [row(1, "a", None, 1, quality=("cloud",)), row(4, "c", None, 4, quality=("unusable",))],
                    masks_of, CFG)
    assert (d.status, d.reason, d.masks) == ("unusable", "cloud, unusable", None)
    d = decide_pair("p", rows + [row(4, "c", None, 4, quality=("unusable",)), row(5, "e", e, 5, task=3, queue="review")],
                    masks_of, CFG)
    assert d.status == "expert"                                   # the expert overrules an unusable mark


def test_flag_require_check_and_min_agreement():
    m = rect(0, 10, 0, 10)
    d = decide_pair("p", [row(1, "a", m, 1), row(2, "b", m, 2, quality=("needs expert",))], masks_of, CFG)
    assert d.status == "disagreement" and "checker" in d.reason
    assert decide_pair("p", [row(1, "a", m, 1)], masks_of, DecisionConfig(require_check=True)).status == "awaiting_check"
    third = [row(1, "a", m, 1), row(2, "b", m, 2), row(3, "c", rect(20, 30, 20, 40), 3)]
    assert decide_pair("p", third, masks_of, CFG).status == "merged"     # a third annotator does not vote


def test_tolerant_f1_forgives_a_boundary_not_a_missing_building():
    a = rect(5, 25, 5, 25)
    assert tolerant_f1(a, rect(6, 26, 6, 26), 2) == 1.0
    assert tolerant_f1(a, rect(9, 29, 9, 29), 2) < 0.9
    assert tolerant_f1(a, a | rect(28, 31, 40, 46), 2) < 0.98
    assert tolerant_f1(np.zeros(SHAPE, bool), np.zeros(SHAPE, bool), 2) == 1.0
    assert tolerant_f1(a, np.zeros(SHAPE, bool), 2) == 0.0
    assert overlap(a, rect(5, 25, 6, 25)) == pytest.approx((380 / 400, 2 * 380 / 780))


def test_a_batch_below_its_threshold_is_held_until_the_expert_resolves_it():
    good, bad_a, bad_b = rect(0, 10, 0, 10), rect(0, 10, 0, 10), rect(20, 30, 30, 40)
    rows = [row(1, "a", good, 1, pair="p1", task=1), row(2, "b", good, 2, pair="p1", task=1),
            row(3, "a", bad_a, 3, pair="p2", task=2), row(4, "b", bad_b, 4, pair="p2", task=2)]
    out = decide_all(rows, masks_of, CFG)
    assert out["p1"].status == "disagreement" and "rejected" in out["p1"].reason and out["p1"].masks is None
    # the expert resolves p2 (a review answer or a star: one path): it leaves the mean, the batch recovers
    for expert in (row(5, "e", good, 5, pair="p2", task=9, project=2, queue="review"),
                   row(4, "b", good, 4, pair="p2", task=2, gt=True, by="e", edited="2026-01-01T00:30:00Z")):
        out = decide_all(rows + [expert], masks_of, CFG)
        assert out["p2"].status == "expert" and out["p1"].status == "merged", expert
    ok = rows[:2] + [row(3, "a", good, 3, pair="p2", task=2, project=3), row(4, "b", bad_b, 4, pair="p2", task=2, project=3)]
    assert decide_all(ok, masks_of, CFG)["p1"].status == "merged"           # another project's batch
    # the batch threshold is its own: pairs pass at 0.8 while their batch needs 0.9
    out = decide_all(rows, masks_of, DecisionConfig(noise_px=0, batch_min_agreement=0.5))
    assert out["p1"].status == "merged"
    out = decide_all(rows[:2], masks_of, DecisionConfig(noise_px=0, min_agreement=0.5, batch_min_agreement=1.0))
    assert out["p1"].status == "merged"


def test_the_same_export_twice_adds_no_history_rows():
    pairs = {"p": {"pair_id": "p", "split": "train"}}
    export = [{"id": 7, "project": 3, "data": {"item_id": "p"}, "annotations": [
        {"id": 1, "completed_by": 5, "result": [], "created_at": "2026-01-01T00:00:00Z",
         "updated_at": "2026-01-01T00:01:00Z"}]}]
    rows, unknown = history_rows(export, pairs)
    assert not unknown and len(rows) == 2
    assert new_rows(rows, set()) == rows
    from operators.annotation.decisions import history_key
    assert new_rows(history_rows(export, pairs)[0], {history_key(r) for r in rows}) == []
    export[0]["annotations"][0]["updated_at"] = "2026-01-02T00:00:00Z"            # edited: one new version
    assert len(new_rows(history_rows(export, pairs)[0], {history_key(r) for r in rows})) == 1
