"""The caption and QA selection rules at their edges (pure, quick): the overall score per mode, the
hallucination band's boundary, rounding half up, the threshold and the top-k cut with ties, the seeded
draw of question types. A file of its own beside test_caption_selection.py and test_qa.py (which other
work edits), written against the mutants tools/mutation.py runs on captions.py and qa.py."""
from __future__ import annotations

import hashlib
import random

import pytest

from operators.language import captions, qa
from operators.language.captions import overall_score, round_half_up, select_captions


def scores(accuracy, others=(8, 8, 8, 8), overall=3):
    return dict(zip(captions.CRITERIA, (accuracy, *others)), overall=overall)


def test_round_half_up_at_every_half():
    assert [round_half_up(x) for x in (6.5, 7.5, 6.49, 6.51, 7.0, 0.5, 0.0)] == [7, 8, 6, 7, 7, 1, 0]


def test_the_criteria_mean_rounds_half_up_and_the_hallucination_band_ends_at_four():
    assert overall_score(scores(9, (8, 8, 8, 8))) == 8                    # 41 / 5 = 8.2
    assert overall_score(scores(9, (9, 9, 6, 6))) == 8                    # 39 / 5 = 7.8
    assert overall_score(dict(zip(captions.CRITERIA, (7, 7, 8, 8, 8)))) == 8   # 7.6
    assert overall_score(dict(zip(captions.CRITERIA, (6, 7, 7, 8, 7)))) == 7   # 35 / 5 = 7.0 exactly
    assert overall_score(scores(4, (10, 10, 10, 10))) == 4                # hallucinated: its accuracy
    assert overall_score(scores(5, (10, 10, 10, 10))) == 9                # 45 / 5: out of the band
    assert overall_score(scores(1)) == 1
    assert overall_score(scores("5", ("10", "10", "10", "10"))) == 9      # the judge's strings count too


def test_the_other_modes():
    s = scores(3, (9, 10, 6, 7), overall="6")
    assert overall_score(s, "judge") == 6
    assert overall_score(s, "mean") == pytest.approx(35 / 5) and isinstance(overall_score(s, "mean"), float)
    assert overall_score(s, "min") == 3
    assert overall_score(scores(9, (9, 9, 9, 10)), "mean") == pytest.approx(9.2)
    with pytest.raises(ValueError, match="unknown overall mode 'best'; one of"):
        overall_score(s, "best")
    # the criteria and the hallucination criteria are the caller's (the QA job's four)
    four = {"a": 9, "b": 9, "c": 9, "d": 2}
    assert overall_score(four, criteria=("a", "b", "c", "d"), hallucination=("a",)) == 7     # 29 / 4 = 7.25
    assert overall_score(four, criteria=("a", "b", "c", "d"), hallucination=("d",)) == 2
    assert overall_score(four, criteria=("a", "b", "c"), hallucination=()) == 9


def test_select_captions_threshold_top_k_and_the_reasons():
    out = select_captions([7.0, 6.9, 9.0, 8.0, 7.5])
    assert [o.selected for o in out] == [False, False, True, True, True]
    assert out[0].reason == "not in top 3: overall 7 below the cut 7.5"
    assert out[1].reason == "rejected: overall 6.9 below 7"
    assert out[2].reason == "selected: rank 1 of 4 passing"
    assert out[3].reason == "selected: rank 2 of 4 passing"
    assert out[4].reason == "selected: rank 3 of 4 passing"


def test_fewer_passing_than_keep_all_kept_and_none_passing():
    out = select_captions([7.0, 8.0], keep=3)
    assert [(o.selected, o.reason) for o in out] == [(True, "selected: rank 2 of 2 passing"),
                                                     (True, "selected: rank 1 of 2 passing")]
    out = select_captions([6.0, 2.0])
    assert [o.reason for o in out] == ["rejected: overall 6 below 7", "rejected: overall 2 below 7"]
    assert select_captions([]) == []


def test_ties_at_the_cut_are_all_kept_and_named_only_when_they_exceed_keep():
    out = select_captions([9, 8, 8, 8, 7], keep=3)
    assert [o.selected for o in out] == [True, True, True, True, False]
    assert out[1].reason == "selected: rank 2 of 5 passing (tied at the top-3 cut)"
    assert out[0].reason == "selected: rank 1 of 5 passing"
    exact = select_captions([9, 8, 8], keep=3)
    assert [o.reason for o in exact] == ["selected: rank 1 of 3 passing", "selected: rank 2 of 3 passing",
                                         "selected: rank 2 of 3 passing"]
    one = select_captions([8, 9, 8.5], keep=1, threshold=8.5)
    assert [o.selected for o in one] == [False, True, False]
    assert one[2].reason == "not in top 1: overall 8.5 below the cut 9"
    assert one[0].reason == "rejected: overall 8 below 8.5"


def test_select_qa_keeps_at_the_threshold_and_names_the_rejection():
    assert qa.select_qa(7.0) == qa.QASelection(True, None)
    assert qa.select_qa(6.99) == qa.QASelection(False, "overall 6.99 below 7")
    assert qa.select_qa(8.0, threshold=8.5) == qa.QASelection(False, "overall 8 below 8.5")
    assert qa.THRESHOLD == 7.0


def test_qa_overall_uses_its_four_criteria_and_answer_accuracy_as_the_hallucination_band():
    s = dict(zip(qa.QA_CRITERIA, (8, 9, 9, 9)), overall=2)
    assert qa.overall_score(s) == 9                                      # 35 / 4 = 8.75
    assert qa.overall_score(dict(s, answer_accuracy=4)) == 4
    assert qa.overall_score(dict(s, redundancy=1)) == 7                  # 27 / 4 = 6.75: not a hallucination
    assert qa.overall_score(s, "judge") == 2 and qa.overall_score(s, "min") == 8


def test_draw_types_is_the_seeded_draw_in_the_papers_order_within_bounds():
    expected_rng = random.Random(int.from_bytes(hashlib.sha256(b"3:pair-7").digest()[:8], "big"))
    picked = set(expected_rng.sample(qa.QUESTION_TYPES, 5))
    assert qa.draw_types("pair-7", 3) == [t for t in qa.QUESTION_TYPES if t in picked]
    assert len(qa.draw_types("pair-7", 3, k=1)) == 1
    assert qa.draw_types("pair-7", 3, k=8) == list(qa.QUESTION_TYPES)
    for k in (0, 9, -1):
        with pytest.raises(ValueError, match=f"--qa-per-pair must be between 1 and 8, got {k}"):
            qa.draw_types("p", 1, k=k)


def test_a_mode_read_from_the_command_line_is_compared_by_value():
    # argparse hands over the argv string, not the interned literal: `is` for `==` would miss it.
    s = scores(3, (9, 10, 6, 7), overall="6")
    built = {m: "".join(list(m)) for m in captions.OVERALL_MODES}
    assert all(built[m] == m and built[m] is not m for m in built)
    assert [overall_score(s, built[m]) for m in ("criteria", "judge", "mean", "min")] == [3, 6, 7.0, 3]
    # unknown modes on either side of the known ones (alphabetically) are refused, not read as the nearest
    for mode in ("best", "sum", "top", "zeta"):
        with pytest.raises(ValueError, match=f"unknown overall mode '{mode}'"):
            overall_score(s, mode)


def test_the_cut_with_one_passing_and_with_other_keeps():
    # one passing candidate, fewer than keep: it is the cut (an index past it would raise)
    out = select_captions([8.0, 5.0])
    assert [(o.selected, o.reason) for o in out] == [(True, "selected: rank 1 of 1 passing"),
                                                     (False, "rejected: overall 5 below 7")]
    # three passing, keep 4: all kept, the lowest too (the cut is the last passing one, not the second)
    assert [o.selected for o in select_captions([9.0, 8.0, 7.5], keep=4)] == [True, True, True]
    # keep 2 and keep 4 of more: the cut is the keep-th best (keep ^ 1 would be the third / the fifth)
    out = select_captions([9.0, 8.5, 8.0, 7.5, 7.2, 7.1], keep=2)
    assert [o.selected for o in out] == [True, True, False, False, False, False]
    assert out[2].reason == "not in top 2: overall 8 below the cut 8.5"
    out = select_captions([9.0, 8.5, 8.0, 7.5, 7.2, 7.1], keep=4)
    assert [o.selected for o in out] == [True, True, True, True, False, False]


# equivalent mutant: core/ReplaceComparisonOperator_GtE_Gt on `cut = passing[keep - 1] if len(passing) >= keep else (passing[-1] if passing else None)`: with exactly keep passing, passing[keep - 1] is passing[-1], the other branch's cut


def test_every_candidate_tied_at_the_cut_is_labelled_tied_whatever_float_object_it_is():
    # Scores are computed per candidate (overall_score), so equal scores are distinct float objects:
    # a tie is equality, not identity (`s is cut` labelled only the one object sorted into the cut).
    overall = [float("9"), float("8"), float("8"), float("8"), float("6.5")]
    got = select_captions(overall, threshold=7.0, keep=3)
    assert [g.selected for g in got] == [True, True, True, True, False]
    assert [g.reason.endswith("(tied at the top-3 cut)") for g in got] == [False, True, True, True, False]


# equivalent mutant: core/ReplaceComparisonOperator_Eq_LtE on `tie = s == cut and sum(1 for p in passing if p >= cut) > keep`: (s <= cut) the branch holds only candidates with s >= cut, where s <= cut means s == cut.
