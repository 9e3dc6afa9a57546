"""The validate job resumes by lineage (operators.language.claims_resume): each verdict records the claim,
the mask and the rules it was checked from; a rerun checks again exactly the claims whose text, mask or
rules changed, says why, and leaves a claim whose mask cannot be read failed, named with the file and the
reason, instead of checking it again on every run (issue 44)."""
from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import pytest

from operators.io import lineage
from operators.language import claims_resume
from tests.conftest import DATA

MASKS = ("train_386_0512_0768", "test_77_0512_0256", "test_102_0512_0000")


def claim(i, text="No change is visible.", kind="captions", mask="m0.png"):
    return {"id": f"c{i}", "kind": kind, "text": text, "question": None, "type": None, "masks": [f"/d/{mask}"]}


def test_a_claim_is_stale_by_what_changed_and_read_again_only_when_its_stamp_moved():
    reads = []

    def digest_of(uri):
        reads.append(uri)
        return {"/d/m0.png": "new pixels", "/d/bad.png": lineage.unreadable("/d/bad.png", "not a readable image")}[uri]

    c = [claim(0), claim(1, "Yes.", "qa"), claim(2), claim(3), claim(4, mask="bad.png"), claim(5), claim(6),
         claim(7, mask="bad.png")]
    rec = lambda cl, mask="pixels", stamp="s0", rules="r": lineage.loads(lineage.dumps(  # noqa: E731
        claims_resume.row_lineage(cl, cl["masks"][0], mask, stamp, rules)))
    recorded = {"c0": rec(c[0]), "c1": rec(claim(1, "No.", "qa")), "c2": rec(c[2], rules="older rules"),
                "c3": rec(c[3], stamp="s-1"), "c5": None, "c7": rec(c[7], stamp="s-1"),
                "c4": rec(c[4], mask=lineage.unreadable("/d/bad.png", "no such file"), stamp="s-1")}
    stamps = {"/d/m0.png": "s0", "/d/bad.png": "s1"}
    plan = claims_resume.plan(c, recorded, stamps, digest_of, "r")
    assert plan.current == ["c0"] and plan.missing == ["c6"] and plan.unrecorded == ["c5"]
    # c7's mask became unreadable since its verdict: checked once more (its verdict then says so); c4's was
    # unreadable when its verdict was made: not checked again, it would fail the same way
    assert plan.stale == {"c1": ["QA"], "c2": ["options"], "c3": ["mask"], "c7": ["mask"]}
    assert plan.unreadable == {"c4": "/d/bad.png: not a readable image"}
    assert sorted(x["id"] for x in plan.todo) == ["c1", "c2", "c3", "c5", "c6", "c7"]
    assert sorted(set(reads)) == ["/d/bad.png", "/d/m0.png"]      # c3 and c4's stamps moved; no other mask read
    s = lineage.status(plan)
    assert (s["failed"], s["unreadable"], s["needs_run"]) == (1, 1, True)
    # a mask that is not listed any more: a changed mask once, then unreadable, named by its first candidate
    assert claims_resume.plan([c[0]], {"c0": rec(c[0])}, {}, digest_of, "r").stale == {"c0": ["mask"]}
    gone = claims_resume.plan([c[0]], {"c0": rec(c[0], mask=lineage.unreadable("/d/m0.png", "no such file"))},
                              {}, digest_of, "r")
    assert gone.unreadable == {"c0": "/d/m0.png: no such file"} and gone.todo == []


@pytest.fixture
def dataset(tmp_path):
    labels = tmp_path / "label"
    labels.mkdir()
    for m in MASKS:
        shutil.copy(DATA / "levir-cd" / "label" / f"{m}.png", labels / f"{m}.png")
    claims = [{"id": f"c{i}", "mask": f"{m}.png", "text": "No change is visible."} for i, m in enumerate(MASKS)]
    path = tmp_path / "claims.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in claims) + "\n")
    return tmp_path, path, labels


def test_a_validate_rerun_checks_again_exactly_what_changed_and_not_an_unreadable_mask(dataset):
    from jobs import validate
    base, path, labels = dataset
    out = str(base / "out")
    args = validate.parse_args(["--input", str(path), "--masks", str(labels), "--output", out])
    assert validate.run(str(path), out, str(labels))["checked"] == 3
    again = validate.run(str(path), out, str(labels))
    assert again["checked"] == 0 and again["claims"] == 3
    assert lineage.status_line(validate.status(args)) == "3 current, 0 stale, 0 missing, 0 failed"

    # one mask redrawn, one claim's text edited, one mask corrupted
    shutil.copy(labels / f"{MASKS[2]}.png", labels / f"{MASKS[0]}.png")
    lines = path.read_text().splitlines()
    lines[1] = json.dumps({"id": "c1", "mask": f"{MASKS[1]}.png", "text": "Several houses were built."})
    path.write_text("\n".join(lines) + "\n")
    (labels / f"{MASKS[2]}.png").write_bytes(b"not a png")
    s = validate.status(args)     # the corrupted mask is a changed mask, once
    assert lineage.status_line(s) == "0 current, 3 stale (claim 1, mask 2: c0, c1, c2), 0 missing, 0 failed"
    third = validate.run(str(path), out, str(labels))
    assert third["checked"] == 3 and third["redone"] == "3 checked again because their input changed: claim 1, mask 2"
    verdicts = [json.loads(x) for x in (base / "out" / "verdicts.jsonl").read_text().splitlines()]
    assert [v["id"] for v in verdicts] == ["c0", "c1", "c2"] and verdicts[1]["ok"] is False
    assert verdicts[2]["ok"] is None and f"{MASKS[2]}.png is not a readable image" in verdicts[2]["error"]
    # the old rows are superseded, not deleted; from now on the unreadable mask is failed, named, not redone
    assert len(pq.read_table(base / "out" / "verdicts").to_pylist()) == 6
    for _ in range(2):
        s = validate.status(args)
        assert lineage.status_line(s) == (f"2 current, 0 stale, 0 missing, 1 failed (1 unreadable: c2: "
                                          f"{labels}/{MASKS[2]}.png: ValueError: {labels}/{MASKS[2]}.png is not "
                                          "a readable image)")
        assert s["needs_run"] is False
        fourth = validate.run(str(path), out, str(labels))
        assert fourth["checked"] == 0 and fourth["errors"] == 1
        assert fourth["unreadable"].startswith("1 claim(s) not checked again, a file cannot be read: c2: ")


def test_a_rerun_within_the_same_second_still_supersedes(monkeypatch):
    """Shards are read in run-id order: a rerun's id must sort after the last run's, even when drawn in the
    same second with a smaller random part."""
    from operators.io import tables
    drawn = iter(["20260101T000000-000000", "20260101T000000-aaaaaa", "20260101T000001-000000"])
    monkeypatch.setattr(tables, "new_run_id", lambda: next(drawn))
    monkeypatch.setattr(tables.time, "sleep", lambda s: None)
    assert tables.run_id_after("20260101T000000-aaaaaa") == "20260101T000001-000000"
    monkeypatch.setattr(tables, "new_run_id", lambda: "20260101T000002-000000")
    assert tables.run_id_after("") == "20260101T000002-000000"      # a first run draws once
