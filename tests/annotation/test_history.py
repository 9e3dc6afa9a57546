"""The history's reading of Label Studio exports: deletions (a full export withdraws, a partial, filtered or
older one does not), in-place edits by another user, and server identity in every key."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operators.annotation.decisions import DecisionConfig, decide_all, latest_versions
from operators.annotation.history import history_rows, withdrawals
from operators.annotation.ingest_ops import check_server, new_history

PAIRS = {"p": {"pair_id": "p", "split": "train"}, "q": {"pair_id": "q", "split": "train"}}


def t(minute: int) -> str:
    return f"2026-01-01T00:{minute:02d}:00Z"


def ann(aid, who, minute, *, by=None, edited=None, cancelled=False, drawn="x"):
    return {"id": aid, "completed_by": who, "updated_by": by, "created_at": t(minute),
            "updated_at": t(edited if edited is not None else minute), "was_cancelled": cancelled,
            "result": [{"drawn": drawn}], "project": 1}


def task(tid, item, anns, updated, *, project=1, counts=True):
    """A task as Label Studio's JSON export writes it: its own annotation counts and updated_at."""
    out = {"id": tid, "project": project, "data": {"item_id": item}, "annotations": anns, "updated_at": t(updated)}
    if counts:
        out["total_annotations"] = sum(1 for a in anns if not a.get("was_cancelled"))
        out["cancelled_annotations"] = sum(1 for a in anns if a.get("was_cancelled"))
    return out


def ingest(history, tasks, instance=""):
    fresh, _ = new_history(history, tasks, PAIRS, instance=instance)
    return history + fresh, fresh


def current(history):
    return sorted((v["instance"], v["task_id"], v["annotation_id"]) for v in latest_versions(history))


@pytest.fixture()
def two_tasks():
    h, _ = ingest([], [task(10, "p", [ann(1, "a", 1), ann(2, "b", 2)], 2), task(11, "q", [ann(3, "a", 3)], 3)])
    return h


def test_an_annotation_absent_from_a_later_full_export_is_withdrawn_and_its_history_kept(two_tasks):
    h, fresh = ingest(two_tasks, [task(10, "p", [ann(2, "b", 2)], 5), task(11, "q", [ann(3, "a", 3)], 3)])
    assert [(r["annotation_id"], r["withdrawn"], r["updated_at"]) for r in fresh] == [(1, True, t(5))]
    assert current(h) == [("", 10, 2), ("", 11, 3)]
    assert [r["annotation_id"] for r in h if r["annotation_id"] == 1] == [1, 1]     # the version, and its withdrawal
    assert ingest(h, [task(10, "p", [ann(2, "b", 2)], 9), task(11, "q", [ann(3, "a", 3)], 3)])[1] == []   # once
    # deleted in the same second it was saved (Label Studio saves the task after the annotation): withdrawn
    h2, fresh = ingest(two_tasks, [task(10, "p", [ann(1, "a", 1)], 2), task(11, "q", [ann(3, "a", 3)], 3)])
    assert [r["annotation_id"] for r in fresh] == [2]


@pytest.mark.parametrize("why, export", [
    ("a task of the project missing: a partial export", [task(10, "p", [ann(2, "b", 2)], 5)]),
    ("the task's counts say an annotation was filtered out", [
        dict(task(10, "p", [ann(2, "b", 2)], 5), total_annotations=2), task(11, "q", [ann(3, "a", 3)], 3)]),
    ("a cancelled count that does not match", [
        dict(task(10, "p", [ann(2, "b", 2)], 5), cancelled_annotations=1), task(11, "q", [ann(3, "a", 3)], 3)]),
    ("no counts (a file not from Label Studio)", [task(10, "p", [ann(2, "b", 2)], 5, counts=False),
                                                   task(11, "q", [ann(3, "a", 3)], 3)]),
    ("an older export: the task was last saved before the annotation", [
        task(10, "p", [ann(2, "b", 2)], 0), task(11, "q", [ann(3, "a", 3)], 3)]),
    ("the task without its updated_at", [dict(task(10, "p", [ann(2, "b", 2)], 5), updated_at=None),
                                          task(11, "q", [ann(3, "a", 3)], 3)]),
])
def test_a_partial_filtered_or_older_export_withdraws_nothing(two_tasks, why, export):
    assert withdrawals(export, two_tasks) == [], why
    assert current(ingest(two_tasks, export)[0]) == [("", 10, 1), ("", 10, 2), ("", 11, 3)]


def test_a_deleted_annotation_stops_voting_and_the_pair_recovers():
    """The issue's case: the annotator's wrong drawing (1) and the checker's (2) disagree; the lead deletes
    1, the annotator submits 3, which agrees: merged with 3 voting, 1 withdrawn."""
    shape = (24, 24)
    masks = {"good": np.zeros(shape, bool), "bad": np.zeros(shape, bool)}
    masks["good"][2:18, 2:18] = True
    masks["bad"][18:24, 0:24] = True

    def masks_of(r):
        return {"new": masks[json.loads(r["result"])[0]["drawn"]]}

    cfg = DecisionConfig(noise_px=0)
    h, _ = ingest([], [task(10, "p", [ann(1, "a", 1, drawn="bad"), ann(2, "b", 2, drawn="good")], 2)])
    assert decide_all(h, masks_of, cfg)["p"].status == "disagreement"
    h, _ = ingest(h, [task(10, "p", [ann(2, "b", 2, drawn="good"), ann(3, "a", 4, drawn="good")], 4)])
    d = decide_all(h, masks_of, cfg)["p"]
    assert (d.status, d.annotations, d.withdrawn, d.annotator, d.checker) == ("merged", 2, 1, "b", "a")
    # a mistaken "cloud" tick, deleted, then two agreeing drawings: merged, not unusable
    cloud = dict(ann(5, "a", 1, drawn="good"), result=[{"drawn": "good", "from_name": "quality", "type": "choices",
                                                        "value": {"choices": ["cloud"]}}])
    h, _ = ingest([], [task(20, "q", [cloud], 1)])
    assert decide_all(h, masks_of, cfg)["q"].status == "unusable"
    h, _ = ingest(h, [task(20, "q", [ann(6, "a", 3, drawn="good"), ann(7, "b", 4, drawn="good")], 4)])
    assert decide_all(h, masks_of, cfg)["q"].status == "merged"


def test_updated_by_is_recorded_and_an_edit_by_another_user_is_a_new_version():
    rows, _ = history_rows([task(10, "p", [ann(1, {"id": 4, "email": "a@x"}, 1, by=7, edited=3)], 3)], PAIRS)
    assert [(r["annotator"], r["updated_by"]) for r in rows if r["annotation_id"] == 1] == [("a@x", "7")]


def test_two_instances_never_collide_and_a_second_server_under_one_name_is_refused():
    export = [task(1, "p", [ann(1, "a", 1)], 1)]
    h, fresh = ingest([], export)
    h, fresh = ingest(h, export, instance="lab-b")               # the same ids on another server: new rows
    assert len(fresh) == 2 and current(h) == [("", 1, 1), ("lab-b", 1, 1)]
    assert ingest(h, export, instance="lab-b")[1] == []            # and the same export twice adds nothing
    rows, _ = history_rows(export, PAIRS, instance="", server="http://a:8080")
    check_server(rows, "", "http://a:8080")
    check_server(rows, "lab-b", "http://b:8080")
    with pytest.raises(ValueError, match=r"^--export http://b:8080: the history's instance '\(default\)' is "
                                         r"http://a:8080; .* name it with --instance$"):
        check_server(rows, "", "http://b:8080")


def test_a_server_export_names_its_users_by_email():
    from operators.labelstudio.client import name_users
    export = [task(1, "p", [ann(1, 4, 1, by=7, edited=3), ann(2, 9, 2)], 3)]
    name_users(export, {4: "a@x", 7: "q@x"})
    rows, _ = history_rows(export, PAIRS)
    assert [(r["annotator"], r["updated_by"]) for r in rows if r["annotation_id"] > 0] == [("a@x", "q@x"), ("9", None)]


# An annotation id Label Studio could have given (a positive integer, as a JSON number or a digit string),
# each drawn with its truth; the rest are ids an edited or foreign export can hold.
_GOOD_IDS = st.one_of(st.integers(1, 10**12), st.integers(1, 10**12).map(str))
_BAD_IDS = st.one_of(st.integers(-10**12, 0), st.integers(-10**12, 0).map(str), st.none(), st.booleans(),
                     st.floats(allow_nan=False),
                     st.sampled_from(["", "abc", "1.5", "0x10", " "]), st.just([3]))
_DRAWN_ID = st.one_of(_GOOD_IDS.map(lambda i: (i, True)), _BAD_IDS.map(lambda i: (i, False)))


@settings(max_examples=400, deadline=None)
@given(tasks=st.lists(st.tuples(st.sampled_from(["p", "q", "nowhere"]), st.lists(_DRAWN_ID, max_size=5)),
                      min_size=1, max_size=4),
       full=st.booleans())
def test_an_annotation_whose_id_is_not_a_positive_integer_is_refused_and_the_rest_of_its_task_kept(tasks, full):
    """Label Studio's annotation ids are positive integers. A missing, zero, negative or non-integer id
    (an edited or foreign export) would share a key with a task row (-1) or with another broken one, and
    a task row is never a version: each such annotation is refused with its reason, and every good one
    of the same task is ingested as a version that counts, however many bad ones sit beside it."""
    export, minute = [], 1
    for n, (item, drawn) in enumerate(tasks):
        anns = []
        for aid, _ in drawn:
            anns.append(ann(aid, f"u{minute}", minute))
            minute += 1
        export.append(task(100 + n, item, anns, minute, counts=full))
    history, refused = new_history([], json.loads(json.dumps(export)), PAIRS)
    want_kept = sorted((100 + n, int(aid)) for n, (item, drawn) in enumerate(tasks) if item in PAIRS
                       for aid, good in drawn if good)
    want_refused_in_order = [(100 + n, repr(aid)) for n, (item, drawn) in enumerate(tasks) if item in PAIRS
                             for aid, good in drawn if not good]
    want_refused = sorted(want_refused_in_order)
    assert sorted((r["task_id"], r["annotation_id"]) for r in history if r["annotation_id"] != -1) == want_kept
    assert all(r["annotation_id"] == -1 or r["annotation_id"] > 0 for r in history)
    assert sorted({(v["task_id"], v["annotation_id"]) for v in latest_versions(history)}) == sorted(set(want_kept))
    bad = {r["task_id"]: r["message"] for r in refused if r["error_type"] == "BadAnnotationId"}
    assert sorted(bad) == sorted({t for t, _ in want_refused})          # one row per task
    named = sorted((t, m.split("annotation id(s) ", 1)[1].split(" not positive")[0]) for t, m in bad.items())
    assert named == sorted((t, ", ".join(r for tt, r in want_refused_in_order if tt == t)) for t in bad)
    assert sorted(r["task_id"] for r in refused if r["error_type"] == "UnknownPair") == \
        [100 + n for n, (item, _) in enumerate(tasks) if item not in PAIRS]
    # the same export again (a full one can withdraw): nothing new, nothing withdrawn, no crash on a bad id
    again, _ = new_history(history, json.loads(json.dumps(export)), PAIRS)
    assert again == []
