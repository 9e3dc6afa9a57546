"""People, not positions (the decision core on history rows): who is annotator, checker and expert is
read from Label Studio's users (``completed_by``, ``updated_by``) and the experts list; the agreement's
noise floor; a batch's own threshold. Pure and quick, beside test_decisions.py."""
from __future__ import annotations

import numpy as np
import pytest

from operators.annotation import decisions as dc
from operators.annotation.decisions import DecisionConfig, decide_all, decide_pair
from tests.annotation.test_decisions import SHAPE, masks_of, rect, row

CFG = DecisionConfig(noise_px=0)
A, B, E = rect(0, 10, 0, 10), rect(20, 30, 30, 40), rect(2, 12, 2, 12)


def test_two_annotations_by_one_person_are_one_persons_and_the_latest_is_their_vote():
    rows = [row(1, "p", A, 1, task=1, project=1), row(2, "p", B, 2, task=2, project=2)]
    d = decide_pair("p", rows, masks_of, CFG)
    assert (d.status, d.annotator, d.checker, d.reason) == ("merged", "p", None, "one annotation, merged unchecked")
    assert np.array_equal(d.masks["new"], B) and d.batch == 2
    assert decide_pair("p", rows, masks_of, DecisionConfig(noise_px=0, require_check=True)).status == "awaiting_check"
    # their earlier annotation edited later is their vote then
    rows[0] = row(1, "p", A, 1, task=1, project=1, edited="2026-01-01T00:30:00Z")
    assert np.array_equal(decide_pair("p", rows, masks_of, CFG).masks["new"], A)


def test_an_in_place_correction_by_another_user_is_a_check():
    edited = row(1, "p", B, 1, by="q", edited="2026-01-01T00:20:00Z")
    for cfg in (CFG, DecisionConfig(noise_px=0, require_check=True)):
        d = decide_pair("p", [edited], masks_of, cfg)
        assert (d.status, d.annotator, d.checker, d.agreement) == ("merged", "p", "q", None)
        assert d.reason == "checked in place: the checker's edit of the annotator's annotation is merged"
        assert d.merged_from == ("", 1, 1, 1, "2026-01-01T00:20:00Z", False) and np.array_equal(d.masks["new"], B)
    # the author saving their own annotation again is no check
    own = row(1, "p", B, 1, by="p", edited="2026-01-01T00:20:00Z")
    assert decide_pair("p", [own], masks_of, CFG).checker is None
    # a correction that ticks unusable excludes the pair; one that asks for the expert hands it over
    assert decide_pair("p", [dict(edited, quality='["cloud"]')], masks_of, CFG).reason == "cloud"
    assert decide_pair("p", [dict(edited, quality='["needs expert"]')], masks_of, CFG).reason == \
        "flagged 'needs expert' by the checker"
    # the corrector who also drew on their own: their latest version is their vote (here their own drawing)
    d = decide_pair("p", [edited, row(2, "q", A, 30, task=2)], masks_of, CFG)
    assert (d.annotator, d.checker, d.status) == ("p", "q", "disagreement")


def test_a_persons_first_part_is_their_earliest_whatever_the_order_of_the_rows():
    rows = [row(2, "p", B, 30, task=2), row(1, "q", A, 10), row(3, "p", A, 5, task=3)]
    for order in (rows, rows[::-1]):
        d = decide_pair("p", order, masks_of, CFG)
        assert (d.annotator, d.checker) == ("p", "q"), order


def test_roles_follow_when_each_person_took_part():
    # q edited p's annotation (minute 20) before r drew (minute 25): q is the checker, r does not vote
    rows = [row(1, "p", B, 1, by="q", edited="2026-01-01T00:20:00Z"), row(2, "r", A, 25, task=2)]
    d = decide_pair("p", rows, masks_of, CFG)
    assert (d.annotator, d.checker, d.status) == ("p", "q", "merged")
    rows[1] = row(2, "r", A, 15, task=2)                              # r drew first: r is the checker
    d = decide_pair("p", rows, masks_of, CFG)
    assert (d.annotator, d.checker, d.status) == ("p", "r", "disagreement")


def test_an_expert_is_never_one_of_the_pairs_annotators():
    rows = [row(1, "p", A, 1), row(2, "q", B, 2)]
    review = row(3, "p", E, 3, task=9, project=2, queue="review")     # p answers the review task: no expert
    d = decide_pair("p", rows + [review], masks_of, CFG)
    assert (d.status, d.expert) == ("disagreement", None)
    # even when listed: an expert who annotated this pair is one of its annotators
    assert decide_pair("p", rows + [review], masks_of, DecisionConfig(noise_px=0, experts=("p",))).status == "disagreement"
    # p's star on their own drawing, or on q's, is no expert's either
    assert decide_pair("p", [dict(rows[0], ground_truth=True), rows[1]], masks_of, CFG).expert is None
    assert decide_pair("p", [rows[0], dict(rows[1], ground_truth=True, updated_by="p")], masks_of, CFG).expert is None
    # a listed expert who annotated another pair is this pair's expert
    d = decide_pair("p", rows + [row(3, "e", E, 3, task=9, project=2, queue="review")], masks_of,
                    DecisionConfig(noise_px=0, experts=("e",)))
    assert (d.status, d.expert) == ("expert", "e")


def test_a_star_credits_who_starred_and_the_list_limits_who_may():
    starred = row(2, "q", B, 2, gt=True, by="e", edited="2026-01-01T00:30:00Z")
    d = decide_pair("p", [row(1, "p", A, 1), starred], masks_of, CFG)
    assert (d.status, d.expert, d.annotator, d.checker) == ("expert", "e", "p", None)
    assert np.array_equal(d.masks["new"], B)
    listed = DecisionConfig(noise_px=0, experts=("boss",))
    assert decide_pair("p", [row(1, "p", A, 1), starred], masks_of, listed).expert is None
    review = row(3, "x", E, 3, task=9, queue="review")               # an unlisted reviewer decides nothing
    assert decide_pair("p", [row(1, "p", A, 1), review], masks_of, listed).status == "merged"
    # a listed expert's correction in place (no star needed) is their decision
    fixed = row(1, "p", E, 1, by="boss", edited="2026-01-01T00:40:00Z")
    d = decide_pair("p", [fixed], masks_of, listed)
    assert (d.status, d.expert, d.annotator) == ("expert", "boss", None)


def test_a_stray_dot_under_the_floor_is_noise_not_disagreement():
    big = rect(0, 30, 0, 30)                                          # 900 px on both sides
    dot = rect(20, 22, 40, 42)                                        # 2 x 2 on one side only

    def two(r):
        return {"new": big, "demolished": dot if r["annotator"] == "q" else np.zeros(SHAPE, bool)}

    rows = [row(1, "p", None, 1), row(2, "q", None, 2)]
    d = decide_pair("p", rows, two, DecisionConfig(noise_px=5))
    assert (d.status, d.agreement) == ("merged", 1.0)
    assert d.per_class["demolished"] == {"iou": 0.0, "f1": 0.0, "f1_tolerant": 1.0, "noise": True}
    assert d.per_class["new"]["noise"] is False
    # at the floor the dot is a drawing the other side lacks: a disagreement
    d = decide_pair("p", rows, two, DecisionConfig(noise_px=4))
    assert (d.status, d.agreement) == ("disagreement", 0.0) and d.per_class["demolished"]["noise"] is False
    # both sides empty agrees; both under the floor agrees, wherever they are
    d = decide_pair("p", rows, lambda r: {"new": big, "demolished": rect(0, 2, 0, 2) if r["annotator"] == "p" else dot},
                    DecisionConfig(noise_px=5))
    assert d.agreement == 1.0 and d.per_class["demolished"]["noise"] is True
    d = decide_pair("p", rows, lambda r: {"new": np.zeros(SHAPE, bool)}, DecisionConfig(noise_px=5))
    assert d.agreement == 1.0 and d.per_class["new"]["noise"] is False


def test_the_batch_threshold_is_its_own():
    # a pair at 0.85 passes min_agreement 0.8; its batch needs 0.9 (held) or 0.85 (accepted)
    m, part = rect(0, 10, 0, 20), rect(0, 10, 0, 20)
    part[:, 14:20] = False                                         # 140 px of 200: F1 = 2*140/340 = 0.8235
    rows = [row(1, "p", m, 1), row(2, "q", part, 2)]
    cfg = dict(noise_px=0, tolerance_px=0, min_agreement=0.8)
    assert decide_all(rows, masks_of, DecisionConfig(**cfg, batch_min_agreement=0.83))["p"].status == "disagreement"
    assert decide_all(rows, masks_of, DecisionConfig(**cfg, batch_min_agreement=0.82))["p"].status == "merged"
    agreement = decide_all(rows, masks_of, DecisionConfig(**cfg))["p"].agreement
    assert agreement == pytest.approx(280 / 340)
    assert decide_all(rows, masks_of, DecisionConfig(**cfg, batch_min_agreement=agreement))["p"].status == "merged"


def test_the_default_floor_is_validates_no_change_floor():
    from operators.language.validators import ValidatorConfig
    assert DecisionConfig().noise_px == ValidatorConfig().min_object_px == 200
    shape = (40, 40)
    house = np.zeros(shape, bool)
    house[:20, :10] = True                                          # 200 px: an object
    shed = house.copy()
    shed[19, 9] = False                                             # 199 px: under the floor

    def only_q(mask):
        return lambda r: {"new": mask if r["annotator"] == "q" else np.zeros(shape, bool)}

    rows = [row(1, "p", None, 1), row(2, "q", None, 2)]
    assert decide_pair("p", rows, only_q(house), DecisionConfig()).agreement == 0.0
    assert decide_pair("p", rows, only_q(shed), DecisionConfig()).agreement == 1.0


def fresh(text: str) -> str:
    """The same text as a new string object, as rows read back from a table hold it (not an interned literal)."""
    return "".join(list(text))


def test_names_and_queues_compare_by_value_not_identity():
    later = dict(created_at="2026-01-01T00:00:00Z", updated_at="2026-01-01T00:05:00Z")
    assert dc.editor({"annotator": fresh("p@x"), "updated_by": fresh("p@x"), **later}) is None
    review = dict(row(3, "e", E, 3, task=9, queue="review"), queue=fresh("review"))
    assert decide_pair("p", [row(1, "p", A, 1), review], masks_of, CFG).expert == "e"
    # p's two annotations, each corrected by someone else: p's vote falls back to the later one p authored
    first = row(1, fresh("p@x"), A, 1, by="q@x", edited="2026-01-01T00:20:00Z")
    second = row(2, fresh("p@x"), B, 2, task=2, by="r@x", edited="2026-01-01T00:40:00Z")
    d = decide_pair("p", [first, second], masks_of, CFG)
    assert (d.annotator, d.checker, d.status) == ("p@x", "q@x", "disagreement")   # p's vote is B, q's is A
