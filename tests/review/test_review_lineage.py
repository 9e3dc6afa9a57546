"""A review verdict applies to the text the reviewer saw: each review item records what its row was made
from and its text's digest, and a release names the reviewed items redone since."""
from __future__ import annotations

import pandas as pd

from operators.io import lineage
from operators.review.items import review_items, reviewed_on_other_text


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
