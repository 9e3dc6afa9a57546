"""Resuming by lineage against a real dataset folder (operators.language.resume): a file that cannot be
read today is reported once, with its path and its reason, and counted as failed; it does not make the
step look stale, so a chain does not run the step again on every run (issue 44)."""
from __future__ import annotations

import shutil

import pytest

from operators.chain import plan as chain_plan
from operators.io import lineage
from operators.io.layout import find_dataset_pairs
from operators.io.storage import Store
from operators.io.tables import new_run_id, write_table_shard
from operators.language import resume
from operators.language.caption_ops import TABLE_SCHEMAS
from tests.conftest import DATA, REPO

PAIRS = ("test_102_0512_0000", "test_121_0768_0256")
JOB = {"model": "m", "options": "o"}


@pytest.fixture
def finished(tmp_path):
    """Two pairs of the bundled samples, both finished from today's files (their rows record them)."""
    data, out = tmp_path / "data", tmp_path / "out"
    for folder in ("A", "B", "label"):
        (data / folder).mkdir(parents=True)
        for pid in PAIRS:
            shutil.copy(DATA / "levir-cd" / folder / f"{pid}.png", data / folder / f"{pid}.png")
    pairs, _ = find_dataset_pairs(str(data))
    rows = []
    for p in pairs:
        files = lineage.file_lineage(p, None, lambda role, rel: resume.file_digest(p["root"], role, rel))
        rows.append({"pair_id": p["pair_id"], "lineage": lineage.dumps(
            {**files, **JOB, lineage.STAMPS: lineage.item_stamps(p)})})
    write_table_shard(Store(str(out)), "pairs", rows, TABLE_SCHEMAS["pairs"], new_run_id())
    return data, Store(str(out))


def status_of(data, out):
    pairs, _ = find_dataset_pairs(str(data))
    plan = resume.plan(out, pairs, lambda p: dict(JOB), TABLE_SCHEMAS["pairs"], threads=1)
    return plan, lineage.status(plan)


def test_an_unreadable_mask_is_failed_with_its_path_and_reason_and_does_not_make_the_step_run(finished):
    data, out = finished
    plan, s = status_of(data, out)
    assert (s["current"], s["needs_run"]) == (2, False)
    (data / "label" / f"{PAIRS[0]}.png").write_bytes(b"not a png at all")     # a truncated copy, a bad upload
    for _ in range(2):                                   # the second look says the same: nothing to redo
        plan, s = status_of(data, out)
        assert plan.todo == [] and plan.stale == {}
        assert (s["current"], s["stale"], s["failed"], s["unreadable"], s["needs_run"]) == (1, 0, 1, 1, False)
        line = lineage.status_line(s)
        assert line == (f"1 current, 0 stale, 0 missing, 1 failed (1 unreadable: {PAIRS[0]}: "
                        f"label/{PAIRS[0]}.png: not a readable image)"), line
        # docs/lineage.md shows these two lines as printed
        page = (REPO / "docs" / "lineage.md").read_text()
        assert f"\n{lineage.unreadable_line(plan)}\npairs: {line}\n" in page
        # the chain skips the finished step: an unreadable file does not run it again each time
        assert chain_plan.must_run({"argv": ["x"]}, ["x"], None, False, s) == (False, "finished earlier")


def test_a_file_that_cannot_be_opened_names_the_reason(finished, monkeypatch):
    data, out = finished
    (data / "A" / f"{PAIRS[1]}.png").write_bytes(b"other bytes")       # its stamp moves: read again
    real = Store.read_bytes

    def denied(self, rel):
        if rel.endswith(f"A/{PAIRS[1]}.png"):
            raise PermissionError(13, "Permission denied")
        return real(self, rel)

    monkeypatch.setattr(Store, "read_bytes", denied)
    plan, s = status_of(data, out)
    assert plan.unreadable == {PAIRS[1]: f"A/{PAIRS[1]}.png: PermissionError: [Errno 13] Permission denied"}
    assert s["needs_run"] is False and s["failed"] == 1


def test_a_readable_file_changed_again_is_stale_as_before(finished):
    data, out = finished
    (data / "label" / f"{PAIRS[0]}.png").write_bytes((data / "label" / f"{PAIRS[1]}.png").read_bytes())
    plan, s = status_of(data, out)
    assert plan.stale == {PAIRS[0]: ["mask"]} and s["needs_run"] is True and s["unreadable"] == 0
