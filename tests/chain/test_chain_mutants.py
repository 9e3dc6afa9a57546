"""The chain's state and wiring at the edges the mutants of tools/mutation.py found untested (pure, quick):
a file of its own beside test_needs.py, test_plan.py, test_people.py and test_options.py (which other work
edits), in the oracle of the chain modules in tools/mutation.toml."""
from __future__ import annotations

from operators.chain import needs
from operators.labelstudio import client as sc


def test_an_option_s_needs_belong_to_its_step_only_not_to_steps_named_before_it(monkeypatch, tmp_path):
    # BY_OPTION is keyed by the step's exact name: a step that sorts before "annotate export" ("annotate",
    # "annotate check") with the same option and value needs nothing (a `>=` for `==` would ask them for
    # sklearn).
    monkeypatch.setattr(needs, "_installed", lambda m: False)
    monkeypatch.setattr(sc, "sdk_python", lambda: str(tmp_path / "venv" / "bin" / "python"))
    for step in ("annotate", "annotate check", "alpha"):
        assert needs.missing(step, {"prelabel": "pca-kmeans"}) == [], step
    assert len(needs.missing("annotate export", {"prelabel": "pca-kmeans"})) == 1


def test_a_boolean_option_whose_own_name_starts_with_no_is_not_read_as_a_negation():
    # `--no-llm/--no-no-llm`: "no-llm" is the positive flag (the first option string), kept as given;
    # only "no-no-llm" is its negation (an empty slice for `[:1]` would turn no-llm: true into llm: false).
    import argparse

    from operators.chain.options import normalise_booleans
    ap = argparse.ArgumentParser(prog="job", exit_on_error=False)
    ap.add_argument("--no-llm", action=argparse.BooleanOptionalAction, default=False)
    assert normalise_booleans(ap, {"no-llm": True}, "step") == {"no-llm": True}
    assert normalise_booleans(ap, {"no-no-llm": True}, "step") == {"no-llm": False}
