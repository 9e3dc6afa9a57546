"""Who a pair's annotations speak for (rules 2 and 3 of :mod:`operators.annotation.decisions`).

People are user identities, never positions in time: a version speaks for the user who made it what it
is (``updated_by`` when another user edited it in place at least a second after it was made, else its
author, ``completed_by``); the people of a pair come in the order they took part, and each votes with
the latest version that speaks for them. An expert's decision is a review-queue answer, a ground-truth
star or (with an experts list) an in-place edit by a listed expert, by someone who is not one of the
pair's annotators.
"""
from __future__ import annotations

from datetime import datetime

REVIEW_QUEUE = "review"


def made_order(row: dict) -> tuple:
    """Who came first: when the annotation was made; the id only breaks ties."""
    return (str(row.get("created_at") or row.get("updated_at") or ""), int(row["annotation_id"]))


def edit_order(row: dict) -> tuple:
    return (str(row.get("updated_at") or ""), *made_order(row))


def author(row: dict) -> str:
    return str(row.get("annotator") or "")


def saved_later(row: dict) -> bool:
    """Whether a version was saved after the one that made the annotation: Label Studio stamps
    ``created_at`` and ``updated_at`` in that first save too, microseconds apart, so a second or more."""
    made, saved = str(row.get("created_at") or ""), str(row.get("updated_at") or "")
    try:
        return (datetime.fromisoformat(saved) - datetime.fromisoformat(made)).total_seconds() >= 1
    except (ValueError, TypeError):   # not ISO times (or one without its zone): later is later
        return saved > made


def editor(row: dict) -> str | None:
    """The user who edited the annotation in place after it was made, when that is not its author (the
    one who saved it first, e.g. an admin creating it for its author through the API, is no editor)."""
    e = str(row.get("updated_by") or "")
    return e if e and e != author(row) and saved_later(row) else None


def voice(row: dict) -> str:
    """Whom a version speaks for: the user who made it what it is."""
    return editor(row) or author(row)


def expert_of(row: dict, annotators: set[str], experts: tuple) -> str | None:
    """The expert whose decision ``row`` is (see rule 3), or None."""
    acts = (row.get("queue") == REVIEW_QUEUE or bool(row.get("ground_truth"))
            or (bool(experts) and editor(row) in experts))
    who = voice(row)
    if acts and who not in annotators and (not experts or who in experts):
        return who
    return None


def people(drawings: list[dict]) -> list[str]:
    """The people of a pair's drawings in the order they took part: an author when the annotation was
    made, an editor when the version was edited (ties: annotation id, then name)."""
    first: dict[str, tuple] = {}
    for v in drawings:
        for who, when in ((author(v), made_order(v)), (editor(v), (str(v.get("updated_at") or ""),
                                                                    int(v["annotation_id"])))):
            if who is not None and (who not in first or when < first[who]):
                first[who] = when
    return sorted(first, key=lambda who: (first[who], who))


def vote_of(who: str, drawings: list[dict]) -> dict:
    """A person's vote: the latest version that speaks for them, else the latest they authored."""
    own = [v for v in drawings if voice(v) == who] or [v for v in drawings if author(v) == who]
    return max(own, key=edit_order)
