"""The decision core's edges that mutation testing (tools/mutation.py) showed untested: ties, fallbacks,
exact reasons, the expert's path with the annotators' agreement, unreadable drawings and the batch
threshold at its boundary. Pure and quick, beside tests/annotation/test_decisions.py."""
from __future__ import annotations

import numpy as np
import pytest

from operators.annotation import agreement
from operators.annotation import decisions as dc
from operators.annotation.decisions import DecisionConfig, decide_all, decide_pair
from tests.annotation.test_decisions import SHAPE, masks_of, rect, row

CFG = DecisionConfig(noise_px=0)


def test_a_tie_in_updated_at_keeps_the_later_row_and_task_rows_are_dropped():
    a, b = row(1, "a", rect(0, 4, 0, 4), 1), row(1, "a", rect(8, 12, 8, 12), 1)
    assert dc.latest_versions([a, b]) == [b] and dc.latest_versions([b, a]) == [a]
    task = dict(a, annotation_id=-1)          # the task row as history tables on disk hold it (a format)
    assert dc.TASK_ROW == -1 and dc.latest_versions([task]) == []
    # rows without updated_at still group by (project, task, annotation)
    c = dict(a, updated_at=None, project=None, instance=None)
    assert dc.version_key(c) == ("", 0, 1, 1) and dc.latest_versions([c, dict(c, task_id=2)]) == [c, dict(c, task_id=2)]
    assert dc.history_key(c) == ("", 0, 1, 1, "", False)
    # a withdrawal (whichever row comes first) takes the annotation out; other annotations stay
    gone = dict(b, withdrawn=True, updated_at="2026-01-01T00:05:00Z")
    other = row(2, "b", None, 3)
    assert dc.latest_versions([a, gone, other]) == [other] and dc.latest_versions([gone, a]) == []
    assert dc.withdrawn_keys([a, gone, other]) == {("", 1, 1, 1)} and dc.history_key(gone)[-1] is True


def test_quality_roles_and_order_read_every_shape_ingest_writes():
    assert dc.quality_of({"quality": ""}) == [] and dc.quality_of({}) == []
    assert dc.quality_of({"quality": ["cloud", 3]}) == ["cloud", "3"]
    assert dc.unusable_reasons({"quality": '["needs expert", "no data", "cloud"]'}) == ["no data", "cloud"]
    # experts are people: acts by someone who is not one of the pair's annotators (and on the list, if one)
    later = {"created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:05:00Z"}
    assert dc.expert_of({"ground_truth": 1, "annotator": "a", "updated_by": "e", **later}, {"a"}, ()) == "e"
    assert dc.expert_of({"ground_truth": 1, "annotator": "a", "updated_by": "a", **later}, {"a"}, ()) is None
    assert dc.expert_of({"queue": "review", "annotator": "e"}, {"a"}, ()) == "e"
    assert dc.expert_of({"queue": "review", "annotator": "a"}, {"a"}, ()) is None
    assert dc.expert_of({"queue": "review", "annotator": "x"}, {"a"}, ("e",)) is None
    assert dc.expert_of({"annotator": "a", "updated_by": "e", **later}, {"a"}, ("e",)) == "e"   # a listed expert's edit
    assert dc.expert_of({"annotator": "a", "updated_by": "e", **later}, {"a"}, ()) is None      # anyone else's: a check
    assert dc.expert_of({"ground_truth": 0, "queue": "annotate", "annotator": "e"}, set(), ("e",)) is None
    assert dc.voice({"annotator": "a", "updated_by": "a", **later}) == "a" and dc.editor({"annotator": "a"}) is None


def test_an_edit_is_a_save_a_second_or_more_after_the_annotation_was_made():
    # Label Studio stamps created_at and updated_at in the save that makes an annotation, microseconds apart:
    # an admin creating one for its author through the API is in updated_by then, and is no editor.
    made = "2026-01-01T10:00:00.000010Z"
    on_behalf = {"annotator": "a", "updated_by": "admin", "created_at": made, "updated_at": "2026-01-01T10:00:00.999990Z"}
    assert dc.editor(on_behalf) is None and dc.voice(on_behalf) == "a"
    edited = dict(on_behalf, updated_at="2026-01-01T10:00:01.000010Z")
    assert dc.editor(edited) == "admin" and dc.voice(edited) == "admin"
    assert dc.saved_later({"created_at": "x1", "updated_at": "x2"}) and not dc.saved_later({"created_at": "x1"})
    assert dc.saved_later({"created_at": "2026-01-01T10:00:00", "updated_at": "2026-01-01T10:00:05Z"})   # zone on one
    assert dc.made_order({"updated_at": "u", "annotation_id": "4"}) == ("u", 4)
    assert dc.made_order({"created_at": "c", "updated_at": "u", "annotation_id": 4}) == ("c", 4)
    assert dc.made_order({"annotation_id": 4}) == ("", 4)


def test_dilate_grows_by_the_disk_and_not_at_all_at_radius_zero():
    m = np.zeros((9, 9), bool)
    m[4, 4] = True
    assert dc.dilate(m, 0) is m and dc.dilate(m, -1) is m
    assert np.count_nonzero(dc.dilate(m, 1)) == 5 and np.count_nonzero(dc.dilate(m, 2)) == 13
    assert agreement._disk(1).tolist() == [[0, 1, 0], [1, 1, 1], [0, 1, 0]]
    empty = np.zeros((9, 9), bool)
    assert dc.dilate(empty, 3) is empty


def test_overlap_and_tolerant_f1_values():
    a, b = rect(0, 10, 0, 10), rect(0, 10, 5, 15)
    assert dc.overlap(a, b) == pytest.approx((50 / 150, 100 / 200))
    z = np.zeros(SHAPE, bool)
    assert dc.overlap(z, z) == (1.0, 1.0) and dc.overlap(a, z) == (0.0, 0.0)
    assert dc.tolerant_f1(z, a, 2) == 0.0
    # precision over a, recall over b: a strip of a 3 px outside b is unmatched at 2 px, matched at 3
    p = rect(0, 10, 0, 13)
    assert dc.tolerant_f1(p, a, 2) == pytest.approx(2 * (120 / 130) * 1.0 / (120 / 130 + 1.0))
    assert dc.tolerant_f1(p, a, 3) == 1.0 and dc.tolerant_f1(a, p, 2) == dc.tolerant_f1(p, a, 2)
    far = rect(20, 30, 30, 40)
    assert dc.tolerant_f1(a, far, 2) == 0.0


def test_compare_takes_the_lowest_class_and_is_one_without_classes():
    two = {"new": rect(0, 10, 0, 10), "gone": rect(20, 30, 0, 10)}
    other = {"new": rect(0, 10, 0, 10), "gone": rect(20, 30, 30, 40)}
    agreement, per = dc.compare(two, other, 2)
    assert agreement == 0.0 and per["new"] == {"iou": 1.0, "f1": 1.0, "f1_tolerant": 1.0, "noise": False}
    assert per["gone"]["f1_tolerant"] == 0.0 and per["gone"]["iou"] == 0.0
    assert dc.compare({}, {}, 2) == (1.0, {})


def test_the_expert_path_keeps_the_annotators_roles_batch_and_agreement():
    a, b, e = rect(0, 10, 0, 10), rect(0, 10, 0, 10), rect(2, 12, 2, 12)
    expert = row(9, "e", e, 9, project=7, task=3, queue="review")
    one = decide_pair("p", [row(1, "a", a, 1, project=4), expert], masks_of, CFG)
    assert (one.status, one.reason, one.annotator, one.checker, one.batch, one.agreement) == \
        ("expert", "decided by the expert", "a", None, 4, None)
    assert one.merged_from == ("", 7, 3, 9, "2026-01-01T00:09:00Z", False) and one.annotations == 2
    both = decide_pair("p", [row(1, "a", a, 1, project=4), row(2, "b", b, 2, project=5), expert], masks_of, CFG)
    assert (both.annotator, both.checker, both.batch, both.agreement) == ("a", "b", 5, 1.0)
    assert both.per_class["new"]["iou"] == 1.0
    alone = decide_pair("p", [expert], masks_of, CFG)
    assert (alone.annotator, alone.checker, alone.batch) == (None, None, None)


def test_the_latest_expert_decides_and_an_unreadable_annotator_drawing_does_not_stop_the_expert():
    e1, e2 = rect(0, 4, 0, 4), rect(6, 10, 6, 10)
    rows = [row(5, "e1", e1, 1, task=2, queue="review"), row(3, "e2", e2, 2, task=3, queue="review")]
    d = decide_pair("p", rows, masks_of, CFG)
    assert d.expert == "e2" and np.array_equal(d.masks["new"], e2)
    # same updated_at: who made it later wins
    d = decide_pair("p", [row(5, "e1", e1, 2, task=2, queue="review"),
                          row(3, "e2", e2, 1, task=3, queue="review", edited="2026-01-01T00:02:00Z")], masks_of, CFG)
    assert d.expert == "e1"
    # the same edit and creation times on two instances: the key decides, the same way in any order
    twins = [row(5, "e1", e1, 2, task=2, queue="review", instance="b"), row(5, "e2", e2, 2, task=2, queue="review")]
    assert decide_pair("p", twins, masks_of, CFG).expert == decide_pair("p", twins[::-1], masks_of, CFG).expert == "e1"

    def unreadable(r):
        if r["annotator"] == "bad":
            raise ValueError("wrong size")
        return masks_of(r)

    d = decide_pair("p", [row(1, "a", e1, 1), row(2, "bad", e1, 2), row(3, "e", e2, 3, task=2, queue="review")],
                    unreadable, CFG)
    assert (d.status, d.agreement, d.per_class, d.checker) == ("expert", None, {}, "bad")
    d = decide_pair("p", [row(1, "a", e1, 1), row(3, "e", None, 3, task=2, queue="review", quality=("cloud", "no data"))],
                    masks_of, CFG)
    assert (d.status, d.reason, d.masks, d.merged_from) == ("unusable", "cloud, no data (expert)", None, None)


def test_unusable_when_both_say_so_names_every_reason_once():
    rows = [row(1, "a", rect(0, 4, 0, 4), 1, project=3, quality=("cloud",)),
            row(2, "b", None, 2, project=4, quality=("no data", "cloud")),
            row(3, "c", None, 3, project=3, cancelled=True, quality=("misregistered",))]
    d = decide_pair("p", rows, masks_of, CFG)
    assert (d.status, d.reason, d.annotator, d.checker, d.batch, d.annotations, d.skipped) == \
        ("unusable", "cloud, no data", "a", "b", 4, 2, 1)
    assert d.masks is None and d.merged_from is None
    # the flag wins over the unusable marks: the checker hands it to the expert
    flagged = [rows[0], dict(rows[1], quality='["no data", "needs expert"]')]
    assert decide_pair("p", flagged, masks_of, CFG).reason == "flagged 'needs expert' by the checker"
    d = decide_pair("p", [row(1, "a", rect(0, 4, 0, 4), 1), rows[1]], masks_of, CFG)
    assert (d.status, d.reason) == ("disagreement", "the checker marks the pair unusable (cloud, no data), the "
                                    "annotator drew it; for the expert")
    d = decide_pair("p", [rows[0], row(2, "b", rect(0, 4, 0, 4), 2)], masks_of, CFG)
    assert d.reason == "the annotator marks the pair unusable (cloud), the checker drew it; for the expert"
    alone = decide_pair("p", rows[:1], masks_of, CFG)
    assert (alone.status, alone.reason, alone.masks) == ("unusable", "cloud", None)


def test_nothing_submitted_says_whether_it_was_skipped():
    assert decide_pair("p", [], masks_of, CFG).reason == "no submitted annotation yet"
    d = decide_pair("p", [row(1, "a", None, 1, cancelled=True), row(2, "b", None, 2, cancelled=True)], masks_of, CFG)
    assert (d.status, d.reason, d.skipped, d.annotations) == ("unannotated", "2 skipped, none submitted", 2, 0)


def test_one_annotation_flagged_waiting_or_merged_with_its_exact_reason():
    m = rect(0, 10, 0, 10)
    d = decide_pair("p", [row(1, "a", m, 1, project=6, quality=("needs expert",))], masks_of,
                    DecisionConfig(require_check=True))
    assert (d.status, d.reason, d.masks) == ("disagreement", "flagged 'needs expert' by the annotator", None)
    d = decide_pair("p", [row(1, "a", m, 1, project=6)], masks_of, DecisionConfig(require_check=True))
    assert (d.status, d.reason, d.masks, d.batch) == \
        ("awaiting_check", "one annotation; --require-check waits for the checker's", None, 6)
    d = decide_pair("p", [row(1, "a", m, 1, project=6)], masks_of, CFG)
    assert (d.status, d.reason, d.annotator, d.batch, d.agreement) == \
        ("merged", "one annotation, merged unchecked", "a", 6, None)
    assert d.merged_from == ("", 6, 1, 1, "2026-01-01T00:01:00Z", False) and np.array_equal(d.masks["new"], m)


def test_two_annotations_flagged_by_either_disagreeing_or_checked():
    m = rect(0, 10, 0, 10)
    d = decide_pair("p", [row(1, "a", m, 1, quality=("needs expert",)), row(2, "b", m, 2)], masks_of, CFG)
    assert (d.status, d.reason, d.masks) == ("disagreement", "flagged 'needs expert' by the annotator", None)
    # a third annotator's flag does not count: only the two who vote
    d = decide_pair("p", [row(1, "a", m, 1), row(2, "b", m, 2, project=8), row(3, "c", m, 3, quality=("needs expert",))],
                    masks_of, CFG)
    assert (d.status, d.reason, d.batch) == ("merged", "checked: agreement 1.000; the checker's drawing is merged", 8)
    assert d.merged_from == ("", 8, 1, 2, "2026-01-01T00:02:00Z", False)
    half = rect(0, 10, 0, 5)
    d = decide_pair("p", [row(1, "a", m, 1), row(2, "b", half, 2)], masks_of, DecisionConfig(tolerance_px=0, noise_px=0))
    assert d.status == "disagreement" and d.masks is None and d.agreement == pytest.approx(2 / 3)
    assert d.reason == ("annotator and checker agree at 0.667 < 0.8 (F1 with a 0 px boundary tolerance, a class "
                        "under 0 px counted as not drawn (lowest class)); for the expert")
    # exactly at min_agreement is enough
    d = decide_pair("p", [row(1, "a", m, 1), row(2, "b", half, 2)], masks_of,
                    DecisionConfig(tolerance_px=0, noise_px=0, min_agreement=2 / 3))
    assert d.status == "merged" and np.array_equal(d.masks["new"], half)


def test_a_history_row_without_a_queue_is_an_annotation():
    """History tables written before the review queue was recorded hold no queue (null in Parquet): their
    rows are annotations, read the same as rows of the annotate queue."""
    m = rect(0, 10, 0, 10)
    for queue in (None, "annotate"):
        rows = [row(1, "a", m, 1, queue=queue), row(2, "b", m, 2, queue=queue)]
        d = decide_pair("p", rows, masks_of, CFG)
        assert (d.status, d.annotator, d.checker, d.expert) == ("merged", "a", "b", None)
    # a reviewer's row next to them still decides as the expert
    rows = [row(1, "a", m, 1, queue=None), row(2, "b", m, 2, queue=None), row(3, "e", m, 3, queue="review")]
    d = decide_pair("p", rows, masks_of, CFG)
    assert (d.status, d.expert, d.annotator, d.checker) == ("expert", "e", "a", "b")


def test_batch_agreements_count_only_checked_pairs_with_a_batch():
    P = dc.PairDecision
    ds = [P("a", "merged", agreement=0.5, checker="c", batch=1), P("b", "expert", agreement=1.0, checker="c", batch=1),
          P("c", "merged", agreement=0.1, checker=None, batch=1), P("d", "merged", agreement=0.2, checker="c", batch=None),
          P("e", "merged", agreement=None, checker="c", batch=2), P("f", "merged", agreement=0.9, checker="c", batch=0),
          P("g", "disagreement", agreement=0.3, checker="c", batch=1), P("h", "unusable", agreement=0.0, checker="c", batch=1),
          P("i", "merged", agreement=0.7, checker="c", batch=1, instance="two")]
    # the expert's and the unusable pair are decided: they leave the mean; another instance is another batch
    assert dc.batch_agreements(ds) == {("", 0): (0.9, 1), ("", 1): (0.4, 2), ("two", 1): (0.7, 1)}
    assert dc.batch_name("", 3) == "project 3" and dc.batch_name("b", 3) == "project 3 on b"


def test_decide_all_holds_unreadable_pairs_named_and_rejects_a_batch_only_below_the_threshold():
    def unreadable(r):
        if r["pair_id"] == "bad":
            raise ValueError("mask 3x3, expected 32x48")
        return masks_of(r)

    m, half = rect(0, 10, 0, 10), rect(0, 10, 0, 5)
    rows = [row(1, "a", m, 1, pair="bad", task=5), row(2, "b", m, 2, pair="bad", task=5),
            row(3, "c", None, 3, pair="bad", task=5, cancelled=True),
            row(1, "a", m, 1, pair="ok", task=1), row(2, "b", half, 2, pair="ok", task=1)]
    cfg = DecisionConfig(tolerance_px=0, noise_px=0, min_agreement=2 / 3, batch_min_agreement=2 / 3)
    out = decide_all(rows, unreadable, cfg)
    assert list(out) == ["bad", "ok"]
    assert (out["bad"].status, out["bad"].reason, out["bad"].annotations, out["bad"].skipped) == \
        ("unreadable", "ValueError: mask 3x3, expected 32x48", 2, 1)
    gone = dict(rows[0], withdrawn=True, updated_at="2026-01-01T00:09:00Z")
    assert (decide_all(rows + [gone], unreadable, cfg)["bad"].withdrawn, out["bad"].withdrawn) == (1, 0)
    assert out["ok"].status == "merged"                         # batch mean == min_agreement: accepted
    out = decide_all(rows, unreadable, DecisionConfig(tolerance_px=0, noise_px=0, min_agreement=0.7))
    assert out["ok"].status == "disagreement" and out["ok"].masks is None and out["ok"].merged_from is None
    assert out["ok"].reason == ("annotator and checker agree at 0.667 < 0.7 (F1 with a 0 px boundary tolerance, "
                                "a class under 0 px counted as not drawn (lowest class)); for the expert")
    # a merged pair of a bad batch: held, with the batch's reason
    good = [row(1, "a", m, 1, pair="g", task=2), row(2, "b", m, 2, pair="g", task=2)]
    out = decide_all(rows + good, unreadable, DecisionConfig(tolerance_px=0, noise_px=0, min_agreement=0.9,
                                                             batch_min_agreement=0.9))
    assert out["g"].reason == ("batch (project 1) rejected: mean agreement 0.833 over 2 pairs awaiting a decision "
                               "< 0.9; held for the expert")
    assert (out["g"].status, out["g"].masks, out["g"].merged_from) == ("disagreement", None, None)


def test_the_tolerance_disk_is_round_at_every_radius():
    for r, pixels in ((1, 5), (2, 13), (3, 29), (4, 49)):               # lattice points with x^2 + y^2 <= r^2
        assert np.count_nonzero(agreement._disk(r)) == pixels, r
        assert agreement._disk(r).shape == (2 * r + 1, 2 * r + 1)



def test_with_three_annotators_and_an_expert_the_first_two_are_annotator_and_checker():
    # A third drawing (a re-annotation) does not stop the first two's agreement being measured.
    a, b, c, e = rect(0, 10, 0, 10), rect(0, 10, 0, 10), rect(20, 30, 20, 30), rect(2, 12, 2, 12)
    rows = [row(1, "a", a, 1, project=4), row(2, "b", b, 2, project=5), row(3, "c", c, 3, project=6),
            row(9, "e", e, 9, project=7, task=3, queue="review")]
    d = decide_pair("p", rows, masks_of, CFG)
    assert (d.status, d.annotator, d.checker, d.batch, d.agreement) == ("expert", "a", "b", 5, 1.0)
    assert d.annotations == 4 and np.array_equal(d.masks["new"], e)


def test_the_expert_who_edited_last_decides_not_the_one_who_started_last():
    # Two experts review a pair: the first revises hers after the second submitted. The pair follows the
    # review edited last (updated_at), not the one created last (a key of made_order alone).
    first = row(1, "expert-a", rect(0, 8, 0, 8), 1, gt=True, queue="review", edited="2026-01-01T00:30:00Z")
    second = row(2, "expert-b", rect(10, 20, 10, 20), 5, gt=True, queue="review")
    for rows in ([first, second], [second, first]):
        d = decide_pair("p", rows, masks_of, CFG)
        assert (d.status, d.expert) == ("expert", "expert-a"), d
        assert np.array_equal(d.masks["new"], first["mask"])


def test_the_overlap_of_masks_that_do_not_cover_each_other_is_computed_without_a_warning():
    # The intersection is a boolean and: an arithmetic stand-in (a // b) gives the same count but divides
    # by zero wherever a mask is empty, a RuntimeWarning on every ordinary pair.
    import warnings
    a, b = np.zeros((4, 4), bool), np.zeros((4, 4), bool)
    a[:2, :2], b[1:3, 1:3] = True, True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert agreement.overlap(a, b) == (1 / 7, 2 / 8)


# equivalent mutant: core/ReplaceComparisonOperator_Lt_LtE on `if who is not None and (who not in first or when < first[who]):`: when the times are equal, the same time is stored again; first[who] holds equal tuples either way
# equivalent mutant: core/ReplaceBinaryOperator_BitAnd_Mul on `inter = int(np.count_nonzero(a & b))`: both masks are boolean arrays (np.asarray(a, bool) above), and for booleans * is &
# equivalent mutant: core/NumberReplacer on `annotations: int = 0           # submitted (latest versions)`: every PairDecision the module builds passes annotations (decide_pair's base, decide_all's unreadable row), so the default is never used
# equivalent mutant: core/NumberReplacer on `skipped: int = 0`: every PairDecision the module builds passes skipped (decide_pair's base, decide_all's unreadable row), so the default is never used
# equivalent mutant: core/NumberReplacer on `withdrawn: int = 0                 # annotations deleted in Label Studio (seen by a full export)`: every PairDecision the module builds passes withdrawn (decide_pair's base, decide_all's unreadable row), so the default is never used
# equivalent mutant: core/NumberReplacer on `def compare(first: dict, second: dict, tolerance_px: int, noise_px: int = 0) -> tuple[float, dict]:`: class_agreement floors noise_px at 1 (max(1, noise_px)), so a default of 0 and of 1 mean the same
# equivalent mutant: core/ReplaceComparisonOperator_NotEq_IsNot on `if d.status != "merged" or (d.instance, d.batch) not in batches:`: a decision's status is always one of the module's string literals, which Python interns, so identity and equality agree
# equivalent mutant: core/ReplaceComparisonOperator_Eq_Is on `if int(r["annotation_id"]) == TASK_ROW:`: TASK_ROW is -1, and CPython keeps one object for every int from -5 to 256, so int(x) is -1 exactly when int(x) == -1 (found by CI's moving sample, seed 2856212253)
# equivalent mutant: core/ReplaceComparisonOperator_Eq_LtE on `if int(r["annotation_id"]) == TASK_ROW:`: no history row has an id below TASK_ROW (-1): ingest refuses every annotation whose id is not a positive integer (operators.annotation.history.annotation_id; test_an_annotation_whose_id_is_not_a_positive_integer_is_refused_and_the_rest_of_its_task_kept), so <= -1 is == -1 (found by CI's moving sample, seed 609321803)


def test_a_rejected_batch_holds_its_merged_pairs_and_leaves_every_other_status_alone():
    # Every status a decision can have, in one batch whose mean agreement is under the threshold: only the
    # merged pairs are held for the expert (a pair the annotators marked unusable, one never exported, an
    # expert's, ... keep theirs; statuses sort on either side of "merged").
    from types import SimpleNamespace
    from operators.annotation.batches import hold_rejected
    ds = {}
    for status in dc.STATUSES:
        awaiting = status in dc.AWAITING
        ds[status] = SimpleNamespace(status=status, instance="", batch=1, checker="b" if awaiting else None,
                                     agreement=0.4 if awaiting else None, reason="", merged_from=["a", "b"],
                                     masks={"new": 1})
    hold_rejected(ds, 0.9)
    assert {s: d.status for s, d in ds.items()} == {s: ("disagreement" if s == "merged" else s) for s in dc.STATUSES}
    assert ds["merged"].masks is None and ds["unusable"].masks == {"new": 1}
    assert ds["merged"].reason.startswith("batch (project 1) rejected: mean agreement 0.400 over 2 pairs")


@pytest.mark.parametrize("grow, agree", [(2, True), (3, False)])
def test_the_default_boundary_tolerance_is_the_documented_two_pixels(grow, agree):
    """``--tolerance-px`` defaults to 2 (docs/annotation.md): a checker whose building's walls lie
    2 px outside the annotator's agrees with it fully; 3 px outside, not."""
    base, grown = rect(10, 20, 15, 30), rect(10, 20, 15 - grow, 30 + grow)
    d = decide_pair("p", [row(1, "a", base, 1), row(2, "b", grown, 2)], masks_of, DecisionConfig(noise_px=0))
    assert (d.agreement == 1.0) is agree, d.agreement
