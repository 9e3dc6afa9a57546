"""A review verdict applies to the text the reviewer saw: each review item records what its row was made
from and its text's digest, and a release names the reviewed items redone since."""
from __future__ import annotations

import pandas as pd

from operators.io import lineage
from operators.review.items import review_items, review_status, reviewed_on_other_text


def captions(texts: dict[tuple[str, int], str], made: str | None = None) -> pd.DataFrame:
    return pd.DataFrame([{"pair_id": p, "candidate_index": i, "perspective": "overall", "caption": t,
                          "overall": 8.0, "selected": True, "lineage": made} for (p, i), t in texts.items()])


def test_review_items_record_their_text_and_what_their_row_was_made_from():
    made = lineage.dumps({"mask": "m1", "A": "a", "B": "b", lineage.STAMPS: {"mask": "1:2"}})
    items = review_items("captions", captions({("p", 0): "a road was built"}, made), None)
    rec = lineage.loads(items.loc[0, "lineage"])
    assert rec == {"mask": "m1", "A": "a", "B": "b", "text": lineage.value_digest("a road was built")}


def test_only_items_whose_text_changed_since_review_are_named():
    then = review_items("captions", captions({("p", 0): "old", ("p", 1): "same", ("q", 0): "kept"}), None)
    reviews = then[["item_id", "lineage"]].assign(kind="captions")
    reviews.loc[len(reviews)] = {"item_id": "r#0", "lineage": None, "kind": "captions"}   # made before lineage
    now = review_items("captions", captions({("p", 0): "new", ("p", 1): "same", ("q", 0): "kept"}), None)
    assert reviewed_on_other_text(reviews, now) == ["p#0"]
    gone = now[now["item_id"] != "q#0"]                                                   # an item no longer there
    assert reviewed_on_other_text(reviews, gone) == ["p#0", "q#0"]


def review_rows(items: pd.DataFrame, verdicts: dict[str, str]) -> pd.DataFrame:
    """One review row per item (task ids in order), as ingest writes them; an item not in ``verdicts``
    is a task nobody answered yet."""
    return pd.DataFrame([{"task_id": n, "annotation_id": n if i in verdicts else -1, "item_id": i, "kind": "captions",
                          "pair_id": i.split("#")[0], "facet": "overall", "text": t, "overall": 8.0,
                          "judge_accept": True, "selected": True, "stratum": "s", "stratum_size": 4,
                          "stratum_sampled": 4, "verdict": verdicts.get(i), "error_categories": [],
                          "corrected_text": None, "human_judge_score": None, "annotator": "1",
                          "annotated_at": "2026-01-01", "run_id": "r", "source": "captions", "lineage": m,
                          "status": "reviewed" if i in verdicts else "unreviewed"}
                         for n, (i, t, m) in enumerate(zip(items["item_id"], items["text"], items["lineage"]))])


def test_the_review_status_counts_items_redone_since_review_as_stale_by_caption():
    mask = lambda m: lineage.dumps({"mask": m})   # noqa: E731
    then = pd.concat([review_items("captions", captions({(p, 0): "old " + p}, mask("m1")), None)
                      for p in ("a", "b", "c", "d")], ignore_index=True)
    rows = review_rows(then, {"a#0": "correct", "b#0": "wrong", "c#0": "correct"})   # d#0: not answered yet
    now = pd.concat([review_items("captions", captions({("a", 0): "new a"}, mask("m2")), None),   # mask redrawn
                     review_items("captions", captions({("b", 0): "new b"}, mask("m2")), None),   # mask redrawn
                     review_items("captions", captions({("c", 0): "old c"}, mask("m1")), None),
                     review_items("captions", captions({("d", 0): "old d"}, mask("m1")), None)], ignore_index=True)
    s = review_status(rows, {"captions": now})
    assert (s["current"], s["stale"], s["stale_by_cause"], s["missing"], s["needs_run"]) == \
        (1, 2, {"caption": 2}, 1, False)
    assert lineage.status_line(s) == "1 current, 2 stale (caption 2: a#0, b#0), 1 missing (d#0), 0 failed"
    # the same text, made from another mask: the verdict was about the other mask
    same_text = now.copy()
    same_text.loc[2, "lineage"] = review_items("captions", captions({("c", 0): "old c"}, mask("m3")), None)["lineage"][0]
    assert review_status(rows, {"captions": same_text})["stale_by_cause"] == {"caption": 2, "mask": 1}
    # QA items redone are stale by QA; an item gone from the output too; sample rows have no status column
    qa_rows = rows.drop(columns="status").assign(kind="qa")
    assert review_status(qa_rows, {"qa": now.iloc[2:]})["stale_by_cause"] == {"QA": 2}
    assert review_status(None, {})["current"] == 0


def test_a_release_leaves_out_the_verdicts_of_items_redone_since_review(tmp_path):
    from operators.io.storage import Store
    from operators.io.tables import write_table_shard
    from operators.publish import recipes
    from operators.publish.sources import LanguageSource
    from jobs.review import REVIEW_SCHEMA
    then = captions({("a", 0): "old a", ("b", 0): "b", ("c", 0): "c"}, lineage.dumps({"mask": "m"}))
    rows = review_rows(review_items("captions", then, None), {"a#0": "correct", "b#0": "wrong", "c#0": "correct"})
    write_table_shard(Store(str(tmp_path)), "review", rows.to_dict("records"), REVIEW_SCHEMA, "r1")
    now = captions({("a", 0): "new a", ("b", 0): "b", ("c", 0): "c"}, lineage.dumps({"mask": "m"}))
    s = recipes.review_summary(str(tmp_path), LanguageSource(uri="c", by_pair={}, table=now))
    assert s["reviewed_on_other_text"] == ["a#0"]
    # a's "correct" described the old text: acceptance is b and c only, and a is a task left unreviewed
    assert (s["tasks"], s["reviewed"], s["unreviewed"]) == (3, 2, 1)
    assert (s["acceptance"]["accepted"], s["acceptance"]["n"]) == (1, 2)
    assert s["verdicts"] == {"correct": 1, "partly correct": 0, "wrong": 1}
    fact = recipes.annotation_facts(LanguageSource(uri="c", by_pair={}, table=now), None, s)["human review"]
    assert fact.startswith("2 of 3 sampled items reviewed; acceptance 1/2")
    assert "1 sampled item(s) unreviewed since redone (their text changed after the review" in fact
    # nothing redone: every verdict counts
    unchanged = recipes.review_summary(str(tmp_path), LanguageSource(uri="c", by_pair={}, table=then))
    assert (unchanged["reviewed"], unchanged["acceptance"]["accepted"], unchanged["reviewed_on_other_text"]) == (3, 2, [])
