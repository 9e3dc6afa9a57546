"""operators.chain.options: a step's options as its job's command line (pure, quick)."""
from __future__ import annotations

import argparse

import pytest

from operators.chain.options import missing_required, normalise_booleans


def parser():
    ap = argparse.ArgumentParser(prog="job", exit_on_error=False)
    ap.add_argument("--skip-labelled", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--no-cache", action="store_true")     # a plain flag whose name starts with no-
    ap.add_argument("--refs", required=True)
    ap.add_argument("--name", "-n", required=True)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--out", "-o", required=False)
    return ap


class Refused(Exception):
    pass


@pytest.fixture
def ap(monkeypatch):
    p = parser()

    def error(message):
        raise Refused(message)

    monkeypatch.setattr(p, "error", error)
    return p


@pytest.mark.parametrize("given,expected", [
    ({"no-skip-labelled": True}, {"skip-labelled": False}),
    ({"no-skip-labelled": False}, {"skip-labelled": True}),
    ({"no_skip_labelled": True}, {"skip-labelled": False}),
    ({"--no-skip-labelled": True}, {"skip-labelled": False}),
    ({"skip-labelled": False}, {"skip-labelled": False}),
    ({"skip_labelled": True}, {"skip_labelled": True}),
])
def test_a_negative_boolean_becomes_the_positive_key_with_the_opposite_value(ap, given, expected):
    assert normalise_booleans(ap, given, "step 'x'") == expected


def test_other_options_pass_through_unchanged_and_in_order(ap):
    given = {"refs": "r.json", "no-cache": True, "limit": 3, "unknown-option": "v"}
    out = normalise_booleans(ap, given, "step 'x'")
    assert out == given and list(out) == list(given)         # a store_true no-x is not a negation


def test_a_negative_boolean_with_a_non_boolean_value_is_refused_naming_the_step_key_and_value(ap):
    with pytest.raises(Refused) as e:
        normalise_booleans(ap, {"no-skip-labelled": "yes"}, "step 'annotate export'")
    assert str(e.value) == "step 'annotate export': no-skip-labelled takes true or false, not 'yes'"
    with pytest.raises(Refused):
        normalise_booleans(ap, {"no-skip-labelled": 1}, "step 'x'")


@pytest.mark.parametrize("given", [{"skip-labelled": True, "no-skip-labelled": True},
                                   {"no-skip-labelled": False, "skip_labelled": True}])
def test_a_boolean_given_both_ways_is_refused(ap, given):
    with pytest.raises(Refused) as e:
        normalise_booleans(ap, given, "step 'x'")
    assert str(e.value) == "step 'x': skip-labelled is given twice (as skip-labelled and no-skip-labelled)"


def test_one_option_under_two_spellings_is_refused(ap):
    with pytest.raises(Refused, match="refs is given twice"):
        normalise_booleans(ap, {"refs": "a", "--refs": "b"}, "step 'x'")


def test_missing_required_names_each_required_option_neither_spelling_gives():
    ap = parser()
    assert missing_required(ap, []) == ["--refs", "--name"]
    assert missing_required(ap, ["--refs", "r.json"]) == ["--name"]
    assert missing_required(ap, ["--refs=r.json", "--name=x", "--out", "o"]) == []
    assert missing_required(ap, ["--refs", "r", "--name", "x"]) == []
    assert missing_required(ap, ["refs", "name"]) == ["--refs", "--name"]       # values, not options


# equivalent mutant: core/NumberReplacer on `given = {t.split("=", 1)[0] for t in tokens if t.startswith("--")}`: [0] is the part before the first "=" whatever the maxsplit (1 or 2)
