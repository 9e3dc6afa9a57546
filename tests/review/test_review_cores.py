"""Pure cores of the review: sampling, Wilson interval, Cohen's kappa, the Label Studio config and tasks,
reading annotations back, and the summary."""
import math
import xml.etree.ElementTree as ET

import numpy as np
import pandas as pd
import pytest

from operators.review.agreement import cohens_kappa, wilson_interval
from operators.review.items import review_items, stratum_columns
from operators.review.label_studio import (ERROR_CATEGORIES, VERDICTS, annotation_fields, labeling_config,
                                           review_rows, task)
from operators.review.sampling import allocate, car_class, stratified_sample
from operators.review.summary import summarize_reviews
from tests.review.conftest import reviewer_result


# -- Wilson and kappa against published values ------------------------------------------------------
def test_wilson_matches_published_values():
    lo, hi = wilson_interval(8, 10)                 # Newcombe (1998), table I: 0.4902-0.9433
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)
    lo, hi = wilson_interval(0, 10)                 # no successes: lower bound 0, upper 0.2775
    assert lo == 0.0 and round(hi, 4) == 0.2775
    lo, hi = wilson_interval(10, 10)
    assert hi == 1.0 and round(lo, 4) == 0.7225
    assert all(math.isnan(v) for v in wilson_interval(0, 0))
    with pytest.raises(ValueError):
        wilson_interval(11, 10)


def test_kappa_matches_textbook_example_and_edge_cases():
    # 50 items: both yes 20, A yes/B no 5, A no/B yes 10, both no 15 -> po 0.7, pe 0.5, kappa 0.4.
    a = ["y"] * 20 + ["y"] * 5 + ["n"] * 10 + ["n"] * 15
    b = ["y"] * 20 + ["n"] * 5 + ["y"] * 10 + ["n"] * 15
    assert cohens_kappa(a, b) == pytest.approx(0.4)
    assert cohens_kappa([True, False, True], [True, False, True]) == pytest.approx(1.0)
    assert cohens_kappa([True, False], [False, True]) == pytest.approx(-1.0)
    assert math.isnan(cohens_kappa([True, True], [True, True]))       # chance agreement 1: undefined
    assert math.isnan(cohens_kappa([], []))


# -- sampling --------------------------------------------------------------------------------------
def test_allocation_is_proportional_with_at_least_one_per_stratum():
    rng = np.random.default_rng(0)
    assert allocate({("a",): 50, ("b",): 30, ("c",): 20}, 10, rng) == {("a",): 5, ("b",): 3, ("c",): 2}
    alloc = allocate({("big",): 97, ("rare",): 3}, 10, np.random.default_rng(0))
    assert alloc == {("big",): 9, ("rare",): 1}                      # 0.3 rounds up to the floor of one
    assert sum(allocate({("a",): 3, ("b",): 2}, 50, np.random.default_rng(0)).values()) == 5   # n > population


def test_stratified_sample_is_seeded_without_repeats_and_respects_strata():
    strata = [("p1",)] * 60 + [("p2",)] * 30 + [("p3",)] * 10
    idx, info = stratified_sample(strata, 20, seed=7)
    again, _ = stratified_sample(strata, 20, seed=7)
    other, _ = stratified_sample(strata, 20, seed=8)
    assert idx.tolist() == again.tolist() and idx.tolist() != other.tolist()
    assert len(set(idx.tolist())) == 20
    drawn = pd.Series([strata[i][0] for i in idx]).value_counts().to_dict()
    assert drawn == {"p1": 12, "p2": 6, "p3": 2}
    assert info[("p3",)].size == 10 and info[("p3",)].sampled == 2


def test_car_classes():
    assert [car_class(v) for v in (0.0, 0.01, 0.05, 0.3, 0.9, None)] == [
        "no change", "small (<5%)", "medium (5-20%)", "large (20-50%)", "very large (>=50%)", "unknown"]
    assert car_class(0.15, (0.1,)) == ">=10%"


# -- items from the job tables ----------------------------------------------------------------------
def _captions():
    rows = []
    for p, car in (("train_1", 0.0), ("test_2", 0.12)):
        for i, persp in enumerate(("change_type", "spatial_location", "scale")):
            overall = (9, 7, 4)[i]
            rows.append({"pair_id": p, "split": p.split("_")[0], "filename": f"{p}.png", "candidate_index": i,
                         "perspective": persp, "caption": f"caption {p} {i}", "overall": float(overall),
                         "selected": overall >= 7, "judge_reason": "fine", "judge_model": "judge", "run_id": "r1"})
    pairs = pd.DataFrame({"pair_id": ["train_1", "test_2"], "car": [0.0, 0.12]})
    return pd.DataFrame(rows), pairs


def test_review_items_from_captions_and_qa():
    captions, pairs = _captions()
    items = review_items("captions", captions, pairs)
    assert items["item_id"].tolist()[:2] == ["train_1#0", "train_1#1"]
    assert items.loc[items["pair_id"] == "test_2", "car_class"].unique().tolist() == ["medium (5-20%)"]
    assert items["judge_accept"].tolist() == [True, True, False] * 2
    qa = pd.DataFrame({"pair_id": ["x"], "split": ["val"], "filename": ["x.png"], "qa_index": [3],
                       "question_type": ["WHERE"], "question": ["Where?"], "answer": ["Upper left."],
                       "overall": [6.0], "selected": [False], "reason": ["vague"], "judge_model": ["j"], "run_id": ["r"]})
    q = review_items("qa", qa, None).iloc[0]
    assert q["text"] == "Q: Where?\nA: Upper left." and q["facet"] == "WHERE" and q["car_class"] == "unknown"
    assert stratum_columns("question_type,car_class") == ["facet", "car_class"]
    with pytest.raises(ValueError):
        stratum_columns("colour")


# -- Label Studio config, tasks, export ---------------------------------------------------------------
def test_labeling_config_shows_triplet_text_and_asks_the_questions():
    root = ET.fromstring(labeling_config("captions"))
    images = [e.get("value") for e in root.iter("Image")]
    assert images == ["$pre", "$post", "$mask"]
    choices = {e.get("name"): [c.get("value") for c in e.iter("Choice")] for e in root.iter("Choices")}
    assert choices["verdict"] == list(VERDICTS) and choices["error_category"] == list(ERROR_CATEGORIES)
    assert [e.get("name") for e in root.iter("TextArea")] == ["corrected"]
    assert [e.get("name") for e in root.iter("Rating")] == ["judge_score"]
    assert "question" in labeling_config("qa")


def test_task_uses_urls_and_prefills_the_judge_score():
    item = {"item_id": "p#1", "pair_id": "p", "split": "test", "text": "a caption", "facet": "scale",
            "overall": 8.0, "car": np.float64(0.1), "car_class": "medium (5-20%)", "judge_accept": np.bool_(True),
            "selected": True, "index": np.int64(1)}
    t = task(item, {"pre": "/data/local-files/?d=x/A/p.png", "post": "u2", "mask": "u3"}, "captions", "judge-m")
    assert t["data"]["pre"].startswith("/data/local-files/") and "base64" not in str(t)
    pred = t["predictions"][0]
    assert pred["result"][0]["value"] == {"rating": 8} and pred["score"] == 0.8 and pred["model_version"].endswith("judge-m")
    assert isinstance(t["data"]["car"], float) and t["data"]["index"] == 1


def _annotation(aid, verdict, cats=(), corrected=None, when="2026-01-01T00:00:00Z"):
    return {"id": aid, "result": reviewer_result(verdict, cats, corrected), "was_cancelled": False,
            "completed_by": 1, "updated_at": when}


def test_review_rows_keep_every_task():
    export = [
        {"id": 1, "data": {"item_id": "a#0", "facet": "scale"}, "annotations": [_annotation(11, "wrong", ["vague"], "better")]},
        {"id": 2, "data": {"item_id": "b#0"}, "annotations": []},
        {"id": 3, "data": {"item_id": "c#0"}, "annotations": [dict(_annotation(31, "correct"), was_cancelled=True)]},
    ]
    rows = review_rows(export)
    assert [(r["task_id"], r["status"]) for r in rows] == [(1, "reviewed"), (2, "unreviewed"), (3, "unreviewed")]
    assert rows[0]["error_categories"] == ["vague"] and rows[0]["corrected_text"] == "better"
    assert annotation_fields([{"from_name": "judge_score", "value": {"rating": 6}}])["human_judge_score"] == 6


def test_summary_acceptance_agreement_and_categories():
    def row(tid, verdict, selected, judge, facet="scale", cats=(), corrected=None, aid=None, when="2026-01-01"):
        return {"task_id": tid, "annotation_id": aid or tid * 10, "status": "reviewed" if verdict else "unreviewed",
                "item_id": f"i{tid}", "pair_id": f"p{tid}", "facet": facet, "text": f"t{tid}", "verdict": verdict,
                "selected": selected, "judge_accept": judge, "error_categories": list(cats), "corrected_text": corrected,
                "stratum": facet, "stratum_size": 10, "annotated_at": when}
    rows = [row(1, "correct", True, True), row(2, "correct", True, True), row(3, "partly correct", True, True),
            row(4, "wrong", True, True, "change_type", ["hallucinated object"], "fixed text"),
            row(5, "wrong", False, False, "change_type", ["vague", "wrong count"]),
            row(6, None, True, True),
            # task 1 re-reviewed later: the latest verdict counts
            row(1, "wrong", True, True, cats=["wrong location"], aid=99, when="2026-02-01")]
    s = summarize_reviews(pd.DataFrame(rows))
    assert (s["tasks"], s["reviewed"], s["unreviewed"]) == (6, 5, 1)
    # selected and reviewed: tasks 1 (now wrong), 2, 3, 4 -> strict 1/4, lenient 2/4
    assert s["acceptance_strict"]["accepted"] == 1 and s["acceptance_strict"]["n"] == 4
    assert s["acceptance_lenient"]["accepted"] == 2
    assert s["acceptance"]["wilson95"] == pytest.approx(list(wilson_interval(1, 4)))
    # human accept (correct) vs judge accept over 5 reviewed: h=[F,T,F,F,F], j=[T,T,T,T,F]
    assert s["judge_agreement"]["cohens_kappa"] == pytest.approx(cohens_kappa([0, 1, 0, 0, 0], [1, 1, 1, 1, 0]))
    assert s["by_facet"]["change_type"]["error_categories"]["vague"] == 1
    assert s["by_facet"]["scale"]["error_categories"]["wrong location"] == 1
    assert [c["corrected_text"] for c in s["corrections"]] == ["fixed text"]
    lenient = summarize_reviews(pd.DataFrame(rows), accept_partly=True)
    assert lenient["acceptance"]["accepted"] == 2
