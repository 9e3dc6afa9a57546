"""A pair without a mask before the captions and QA jobs' work list (operators.llm.job_runner.set_aside_no_mask):
set aside, recorded in errors/ once however often the job is rerun, superseding an older row of the pair.
No Ray: the driver does this before any worker starts."""
from __future__ import annotations

import shutil
from pathlib import Path

from operators.io.layout import NO_MASK_ERROR, discover_pairs, lacks_mask
from operators.io.storage import Store
from operators.io.tables import ERRORS_SCHEMA, error_record, read_table, resolve_errors, write_table_shard
from operators.llm.job_runner import set_aside_no_mask

LEVIR = Path(__file__).resolve().parents[2] / "data" / "levir-cd"
NO_MASK = "test_113_0256"


def _errors(out: Store, current: bool = True) -> list[dict]:
    t = read_table(out, "errors", ERRORS_SCHEMA, current=current)
    return [] if t is None else t.to_pylist()


def test_set_aside_once_across_reruns(tmp_path):
    out = Store(str(tmp_path / "out"))
    todo = discover_pairs(str(LEVIR))
    assert len(todo) == 12
    for run_id in ("run-1", "run-2", "run-3"):
        kept, no_mask = set_aside_no_mask(out, todo, "caption", run_id)
        assert no_mask == [NO_MASK] and len(kept) == 11 and NO_MASK not in {p["pair_id"] for p in kept}
        history = _errors(out, current=False)
        assert [(e["item"], e["stage"], e["error_type"], e["run_id"]) for e in history] == [
            (NO_MASK, "prepare", NO_MASK_ERROR, "run-1")], history      # one row, the first run's
    assert history[0]["message"].startswith("no mask: missing change mask (label) for test_113_0256.png")
    assert history[0]["job"] == "caption"


def test_an_older_row_of_the_pair_is_superseded_once_and_a_later_mask_resolves_it(tmp_path):
    out = Store(str(tmp_path / "out"))
    todo = [p for p in discover_pairs(str(LEVIR)) if p["pair_id"] == NO_MASK]
    # An output made before pairs without a mask were set aside: its prepare error of the pair.
    write_table_shard(out, "errors", [error_record(NO_MASK, "prepare", FileNotFoundError("missing change mask"),
                                                   job="caption", run_id="old")], ERRORS_SCHEMA, "old")
    for run_id in ("run-1", "run-2"):
        assert set_aside_no_mask(out, todo, "caption", run_id) == ([], [NO_MASK])
    assert [(e["error_type"], e["run_id"]) for e in _errors(out, current=False)] == [
        ("FileNotFoundError", "old"), (NO_MASK_ERROR, "run-1")]
    assert [(e["item"], e["error_type"]) for e in _errors(out)] == [(NO_MASK, NO_MASK_ERROR)]
    # Its mask arrives: the pair is work again, and its success resolves the row (as for any error).
    with_mask = [dict(todo[0], label_rel="label/test_113_0256.png")]
    assert set_aside_no_mask(out, with_mask, "caption", "run-3") == (with_mask, [])
    resolve_errors(out, [NO_MASK], "run-3", job="caption")
    assert _errors(out) == []


def test_a_pair_missing_its_images_too_is_not_a_pair_without_a_mask(tmp_path):
    data = tmp_path / "data"
    for folder in ("A", "B"):
        (data / folder).mkdir(parents=True)
    shutil.copy(LEVIR / "A" / f"{NO_MASK}.png", data / "A" / f"{NO_MASK}.png")       # no B, no label
    shutil.copy(LEVIR / "A" / "test_2_0000_0000.png", data / "A" / "test_2_0000_0000.png")
    shutil.copy(LEVIR / "B" / "test_2_0000_0000.png", data / "B" / "test_2_0000_0000.png")  # A and B, no label
    pairs = {p["pair_id"]: p for p in discover_pairs(str(data))}
    assert not lacks_mask(pairs[NO_MASK]) and lacks_mask(pairs["test_2_0000_0000"])
    out = Store(str(tmp_path / "out"))
    kept, no_mask = set_aside_no_mask(out, list(pairs.values()), "qa", "run-1")
    assert [p["pair_id"] for p in kept] == [NO_MASK] and no_mask == ["test_2_0000_0000"]   # prepare reports it
    assert [(e["item"], e["job"]) for e in _errors(out)] == [("test_2_0000_0000", "qa")]
