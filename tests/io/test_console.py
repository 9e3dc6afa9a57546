"""The end of a captions or QA run (operators.io.console): when it counts as failed (exit 3), and how a
pair without a mask is reported. The decision is a pure function, checked against the rule written out
again over generated runs; the printing is checked on a small errors/ table (no Ray, no endpoint)."""
from __future__ import annotations

import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st

from operators.io import console
from operators.io.layout import NO_MASK_ERROR, no_mask_message
from operators.io.storage import Store
from operators.io.tables import ERRORS_SCHEMA, error_record, write_table_shard
from operators.io.validation import NOTHING_DONE

# What happened to one pair found in --input: finished by an earlier run, without a mask (set aside),
# or done in this run and finished or failed.
OUTCOMES = ("finished_before", "no_mask", "ok", "failed")


def expected_failed(outcomes: list[str]) -> bool:
    """The rule, independently of the job's code: a run fails when it found no pair, when it had pairs
    with a mask to do and finished none of them, or when every pair it found lacks a mask. A pair
    without a mask never makes a run failed otherwise."""
    with_mask_to_do = [o for o in outcomes if o in ("ok", "failed")]
    if not outcomes:
        return True
    if with_mask_to_do:
        return "ok" not in with_mask_to_do
    return all(o == "no_mask" for o in outcomes)


def verdict(outcomes: list[str]) -> str:
    return console.llm_run_shortfall(found=len(outcomes), finished_before=outcomes.count("finished_before"),
                                     no_mask=outcomes.count("no_mask"), done=outcomes.count("ok"))


@given(st.lists(st.sampled_from(OUTCOMES), max_size=30))
@example(["finished_before"] * 11 + ["no_mask"])                   # issue 44: a plain rerun of the bundled data
@example(["ok"] * 11 + ["no_mask"])                                # its first run
@example(["failed"] * 11 + ["no_mask"])                            # the endpoint never answered
@example(["no_mask"] * 3)                                          # nothing could be done
@example([])
def test_a_run_fails_only_when_no_pair_with_a_mask_could_be_done(outcomes):
    failed = expected_failed(outcomes)
    event("failed" if failed else "succeeded")
    said = verdict(outcomes)
    assert bool(said) == failed, (outcomes, said)
    if failed and outcomes and "ok" not in outcomes and any(o == "failed" for o in outcomes):
        # the line counts the pairs with a mask it had to do, not the ones without
        assert f"none of the {outcomes.count('failed')} pair(s) with a mask" in said
    if failed and outcomes and all(o == "no_mask" for o in outcomes):
        assert "has a change mask" in said


@given(st.lists(st.sampled_from(OUTCOMES), min_size=1, max_size=20), st.integers(min_value=1, max_value=20))
def test_pairs_without_a_mask_never_change_a_run_that_had_pairs_with_one(outcomes, extra):
    """Adding pairs without a mask to a run that found any pair with one leaves its verdict as it was."""
    if all(o == "no_mask" for o in outcomes):
        outcomes = outcomes + ["finished_before"]
    assert bool(verdict(outcomes + ["no_mask"] * extra)) == bool(verdict(outcomes))


# -- what the console says ---------------------------------------------------------------------------------
NO_MASK_PAIR = {"pair_id": "test_113_0256", "filename": "test_113_0256.png"}


def _errors(out: Store, rows: list[dict], run_id: str) -> None:
    write_table_shard(out, "errors", rows, ERRORS_SCHEMA, run_id)


def _no_mask_row(run_id: str) -> dict:
    return error_record("test_113_0256", "prepare", no_mask_message(NO_MASK_PAIR), error_type=NO_MASK_ERROR,
                        job="caption", run_id=run_id)


def _summary(run_id: str, found: int, finished_before: int, no_mask: int, done: int) -> dict:
    return {"run_id": run_id, "pairs_found": found, "pairs_skipped_finished": finished_before,
            "pairs_no_mask": no_mask, "pairs_no_mask_first": ["test_113_0256"][:no_mask],
            "pairs_skipped": {}, "rows_written": {"pairs": done} if done else {}}


def _explain(out: Store, summary: dict, capsys) -> tuple[int, str]:
    try:
        console.explain_llm_run("caption:", out.uri(), summary)
        code = 0
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_rerun_whose_only_unfinished_pair_has_no_mask_succeeds_and_names_it_once(tmp_path, capsys):
    out = Store(str(tmp_path / "out"))
    _errors(out, [_no_mask_row("run-1")], "run-1")           # written by the first run
    for run_id, done in (("run-1", 11), ("run-2", 0)):       # the first run, then a plain rerun
        finished_before = 0 if run_id == "run-1" else 11
        code, text = _explain(out, _summary(run_id, 12, finished_before, 1, done), capsys)
        assert code == 0, text
        assert text.count("test_113_0256") == 1, text      # once per run, whoever wrote its row
        assert "1 pair(s) without a change mask" in text and "NoMask" in text
        assert "error row(s)" not in text                  # not among the run's errors as well


def test_pairs_with_a_mask_that_all_failed_still_exit_3_without_the_no_mask_pair_as_a_reason(tmp_path, capsys):
    out = Store(str(tmp_path / "out"))
    failed = [error_record(f"pair_{i}", "caption_generate", "HTTP 500 after 4 attempts", error_type="ServerError",
                           job="caption", run_id="run-1") for i in range(11)]
    _errors(out, failed + [_no_mask_row("run-1")], "run-1")
    code, text = _explain(out, _summary("run-1", 12, 0, 1, 0), capsys)
    assert code == NOTHING_DONE, text
    assert "none of the 11 pair(s) with a mask to do finished" in text
    assert "11 x ServerError in caption_generate" in text
    assert text.count("test_113_0256") == 1, text          # its own line, not one of the reasons


def test_a_run_whose_pairs_all_lack_a_mask_says_so_and_exits_3(tmp_path, capsys):
    out = Store(str(tmp_path / "out"))
    _errors(out, [_no_mask_row("run-1")], "run-1")
    for run_id in ("run-1", "run-2"):                       # and again on a rerun: still nothing could be done
        code, text = _explain(out, _summary(run_id, 1, 0, 1, 0), capsys)
        assert code == NOTHING_DONE, text
        assert "none of the 1 pair(s) in --input has a change mask" in text
        assert text.count("test_113_0256") == 1, text


@pytest.mark.parametrize("found,finished_before", [(0, 0), (3, 3)])
def test_without_pairs_lacking_a_mask_the_old_rules_hold(found, finished_before):
    assert bool(console.llm_run_shortfall(found, finished_before, 0, 0)) == (found == 0)
