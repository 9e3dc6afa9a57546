"""Releases that cannot lie (operators.publish.made_from): the rule against generated cases with a reference
written from the documented rule, and publish / ``publish --verify`` on the bundled LEVIR-CD samples with a
captions output whose rows record what they were made from."""
from __future__ import annotations

import json
import shutil

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# A cheap rule (a few ms a case with its generator): five times the profile's budget (125 cases in the quick
# loop, 1,000 in the full suite).
RULE_BUDGET = settings(parent=settings.default, max_examples=settings.default.max_examples * 5)

from jobs.publish import PublishConfig, run as publish, verify_main
from operators.io import lineage
from operators.io.storage import Store
from operators.io.tables import write_table_shard
from operators.language.caption_ops import TABLE_SCHEMAS
from operators.language.qa_ops import TABLE_SCHEMAS as QA_SCHEMAS
from operators.publish import made_from
from operators.publish.versions import parse_sha256sums, sha256, sha256sums
from tests.conftest import DATA

digests = st.sampled_from(["d0", "d1"])


@st.composite
def cases(draw):
    sources = {"A": draw(digests), "B": draw(digests), "mask": draw(digests)}
    shipped = draw(st.none() | st.lists(st.sampled_from(["a", "b", "c"]), max_size=3, unique=True))
    made = {}
    if draw(st.booleans()):
        made["captions"] = {"A": draw(digests), "B": draw(digests), "mask": draw(digests)}
    if draw(st.booleans()):
        made["qa"] = {"A": draw(digests), "B": draw(digests), "mask": draw(digests)}
        if draw(st.booleans()):
            made["qa"]["captions"] = lineage.caption_set_digest(draw(st.lists(st.sampled_from(["a", "b", "c"]),
                                                                              max_size=3, unique=True)))
    return sources, shipped, made


def reference(sources, shipped, made) -> set[str]:
    """The documented rule: a caption or QA pair ships only with the mask and images it was made from, and a
    QA pair only with the captions it was grounded in (when the release ships captions)."""
    out = set()
    for name, (mask_cause, image_cause) in (("captions", (made_from.CAPTION_MASK, made_from.CAPTION_IMAGES)),
                                            ("qa", (made_from.QA_MASK, made_from.QA_IMAGES))):
        rec = made.get(name)
        if not rec:
            continue
        if rec["mask"] != sources["mask"]:
            out.add(mask_cause)
        if (rec["A"], rec["B"]) != (sources["A"], sources["B"]):
            out.add(image_cause)
    qa = made.get("qa") or {}
    if shipped is not None and "captions" in qa and qa["captions"] != lineage.caption_set_digest(shipped):
        out.add(made_from.QA_CAPTIONS)
    return out


@settings(RULE_BUDGET)
@given(cases())
def test_the_refusal_rule_agrees_with_the_reference(case):
    assert set(made_from.mismatches(*case)) == reference(*case)


def test_problem_lines_give_each_cause_its_count_and_first_items():
    lines = made_from.problem_lines({made_from.CAPTION_MASK: ["c", "a", "b", "d"], made_from.QA_MASK: []})
    assert lines == [f"{made_from.CAPTION_MASK}: 4 pair(s) (first: a, b, c)"]


RUN = "20260101T000000-aaaaaa"


@pytest.fixture()
def levir(tmp_path):
    """The bundled samples, a captions output and a QA output whose rows record what they were made from
    (the QA pairs grounded in the captions shipped)."""
    src = tmp_path / "levir"
    shutil.copytree(DATA / "levir-cd", src)
    (src / "licence.txt").write_text("LicenseRef-LEVIR-CD-academic\n")
    caps, qa = tmp_path / "captions", tmp_path / "qa"
    cap_rows, qa_pairs, qa_rows = [], [], []
    for label in sorted((src / "label").glob("*.png")):
        pid = label.stem
        m = cv2.imread(str(label), cv2.IMREAD_UNCHANGED)
        made = {"A": lineage.bytes_digest((src / "A" / label.name).read_bytes()),
                "B": lineage.bytes_digest((src / "B" / label.name).read_bytes()),
                "mask": lineage.mask_digest(m)}
        captions = [f"caption of {pid}", f"another caption of {pid}"]
        cap_rows.append({"pair_id": pid, "split": "train", "filename": label.name, "n_candidates": 5,
                         "n_selected": 2, "selected_captions": captions, "selected_perspectives": ["overall", "object"],
                         "lineage": lineage.dumps(made), "run_id": RUN})
        grounded = lineage.dumps({**made, "captions": lineage.caption_set_digest(captions)})
        qa_pairs.append({"pair_id": pid, "split": "train", "filename": label.name, "lineage": grounded, "run_id": RUN})
        qa_rows.append({"pair_id": pid, "split": "train", "filename": label.name, "qa_index": 0,
                        "question_type": "change_existence", "question": "Did anything change?", "answer": "Yes.",
                        "selected": True, "lineage": grounded, "run_id": RUN})
    write_table_shard(Store(str(caps)), "pairs", cap_rows, TABLE_SCHEMAS["pairs"], RUN)
    write_table_shard(Store(str(qa)), "pairs", qa_pairs, QA_SCHEMAS["pairs"], RUN)
    write_table_shard(Store(str(qa)), "qa", qa_rows, QA_SCHEMAS["qa"], RUN)
    return src, caps, qa


def release(src, caps, out, version="1.0.0", qa=None):
    return publish(PublishConfig(input=str(src), captions=str(caps), qa=str(qa) if qa else "", output=str(out),
                                 name="t", version=version, date="2026-01-01", threads=2))


def test_a_release_made_from_its_sources_verifies_and_a_redrawn_mask_is_refused(levir, tmp_path, capsys):
    src, caps, qa = levir
    first = release(src, caps, tmp_path / "rel")
    assert sum(first["pairs"].values()) == 11
    assert verify_main(["--verify", str(tmp_path / "rel" / "1.0.0"), "--sources", str(src)]) == 0
    # A mask redrawn after its caption was written: publish refuses, naming the pair; nothing is kept.
    label = src / "label" / "test_102_0512_0000.png"
    m = cv2.imread(str(label), cv2.IMREAD_GRAYSCALE)
    m[0, 0] = 255 - m[0, 0]                           # one pixel
    cv2.imwrite(str(label), m)
    with pytest.raises(SystemExit) as refused:
        release(src, caps, tmp_path / "rel", "1.1.0")
    assert f"{made_from.CAPTION_MASK}: 1 pair(s) (first: test_102_0512_0000)" in str(refused.value)
    assert not (tmp_path / "rel" / "1.1.0").exists() or not list((tmp_path / "rel" / "1.1.0").rglob("*.*"))
    # The finished 1.0.0 against its sources now: the redrawn mask is named.
    capsys.readouterr()
    assert verify_main(["--verify", str(tmp_path / "rel" / "1.0.0"), "--sources", str(src)]) == 1
    assert "sources changed since the release (mask): 1 pair(s) (first: test_102_0512_0000)" in capsys.readouterr().out


def test_a_mask_re_encoded_in_the_source_is_the_same_mask(levir, tmp_path):
    src, caps, qa = levir
    label = src / "label" / "test_102_0512_0000.png"
    m = cv2.imread(str(label), cv2.IMREAD_GRAYSCALE)
    cv2.imwrite(str(label), (m > 0).astype(np.uint8), [cv2.IMWRITE_PNG_COMPRESSION, 1])   # 0/1, other compression
    assert sum(release(src, caps, tmp_path / "rel")["pairs"].values()) == 11


def verify_lines(capsys, *argv) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = verify_main(["--verify", *map(str, argv)])
    out = capsys.readouterr().out.splitlines()
    return code, [ln.removeprefix("[publish --verify] ") for ln in out[:-1]] if code else out


def test_a_release_with_captions_and_grounded_qa_verifies_with_its_sources_by_default(levir, tmp_path, capsys,
                                                                                     monkeypatch):
    src, caps, qa = levir
    release(src, caps, tmp_path / "rel", qa=qa)
    monkeypatch.chdir(tmp_path)          # release.json names its dataset portably: "levir", found from here
    code, out = verify_lines(capsys, tmp_path / "rel" / "1.0.0")
    assert code == 0 and "sources checked for 11 pairs" in out[-1], out
    code, out = verify_lines(capsys, tmp_path / "rel" / "1.0.0", "--no-sources")
    assert code == 0 and "sources not checked (--no-sources)" in out[-1], out
    monkeypatch.chdir(src)               # no "levir" here: said, not guessed
    code, out = verify_lines(capsys, tmp_path / "rel" / "1.0.0")
    assert code == 0 and "sources not checked (dataset 'levir' not found here: give --sources)" in out[-1], out


@pytest.mark.parametrize("edit", ["source image", "source gone"])
def test_verify_names_sources_changed_since_the_release(levir, tmp_path, capsys, edit):
    src, caps, qa = levir
    release(src, caps, tmp_path / "rel")
    image = src / "B" / "test_102_0512_0000.png"
    if edit == "source image":
        cv2.imwrite(str(image), 255 - cv2.imread(str(image)))
    else:
        image.unlink()
    code, lines = verify_lines(capsys, tmp_path / "rel" / "1.0.0", "--sources", src)
    assert code == 1 and lines == ["sources changed since the release (images): 1 pair(s) (first: test_102_0512_0000)"]


def test_status_counts_the_latest_release_s_pairs_current_stale_by_cause_and_missing(levir, tmp_path):
    """``changeforge chain --explain``'s view of a publish step: before any release every pair is missing;
    after one, a redrawn mask and a replaced image are stale by their cause, a pair added to the dataset
    is missing, the pair without a mask (excluded) is counted apart."""
    from jobs.publish import status
    src, caps, qa = levir
    cfg = PublishConfig(input=str(src), captions=str(caps), output=str(tmp_path / "rel"), name="t",
                        version="1.0.0", date="2026-01-01", threads=2)
    before = status(cfg)
    assert (before["current"], before["missing"]) == (0, 12), before
    first = before["missing_first"]
    assert len(first) == 5 and first == sorted(first) and set(first) <= {p.stem for p in (src / "A").glob("*.png")}
    release(src, caps, tmp_path / "rel")
    s = status(cfg)
    assert (s["current"], s["stale"], s["missing"], s["failed"]) == (11, 0, 0, 1), s
    for pid in ("test_102_0512_0000", "test_2_0000_0000"):      # two of one cause: counted, not toggled
        m = cv2.imread(str(src / "label" / f"{pid}.png"), cv2.IMREAD_GRAYSCALE)
        m[0, 0] = 255 - m[0, 0]
        cv2.imwrite(str(src / "label" / f"{pid}.png"), m)
    b = src / "B" / "test_121_0768_0256.png"
    cv2.imwrite(str(b), 255 - cv2.imread(str(b)))
    for role in ("A", "B", "label"):
        shutil.copy(src / role / "train_36_0512_0512.png", src / role / "train_99_0000_0000.png")
    s = status(cfg)
    assert (s["current"], s["stale"], s["missing"], s["failed"]) == (8, 3, 1, 1), s
    assert s["stale_by_cause"] == {"images": 1, "mask": 2} and s["stale_first"] == \
        ["test_102_0512_0000", "test_121_0768_0256", "test_2_0000_0000"] and \
        s["missing_first"] == ["train_99_0000_0000"], s
    assert not s["needs_run"]          # a new release is a new version, asked for
    for k in range(93, 99):            # six pairs more: of the seven missing, the first five are named
        for role in ("A", "B", "label"):
            shutil.copy(src / role / "train_36_0512_0512.png", src / role / f"train_{k}_0000_0000.png")
    s = status(cfg)
    assert s["missing"] == 7 and s["missing_first"] == [f"train_{k}_0000_0000" for k in range(93, 98)], s
    # A release made before its pairs' source files were recorded: those pairs are unrecorded, not current.
    doc_path = next((tmp_path / "rel").rglob("release.json"))
    doc = json.loads(doc_path.read_text())
    for pid in ("train_36_0512_0512", "val_27_0000_0256"):
        del doc["pairs"][pid]["source_files"]
    doc_path.write_text(json.dumps(doc))
    s = status(cfg)
    assert (s["current"], s["stale"], s["unrecorded"], s["failed"]) == (6, 3, 2, 1), s


def test_a_folder_that_is_not_a_finished_release_is_said_to_be_one(levir, tmp_path, capsys):
    src, caps, qa = levir
    release(src, caps, tmp_path / "rel")
    (tmp_path / "rel" / "1.0.0" / "release.json").unlink()
    code, lines = verify_lines(capsys, tmp_path / "rel" / "1.0.0")
    assert code == 1 and lines[0].endswith("not a finished release (no SHA256SUMS or release.json)")


def _digest_on_side(recorded: str, above: bool) -> bytes:
    """Bytes whose SHA-256 sorts above (or below) ``recorded``: a mismatch either way must be seen."""
    for i in range(1000):
        data = f"edited {i}".encode()
        if (sha256(data) > recorded) == above:
            return data
    raise AssertionError("no such bytes")


@pytest.mark.parametrize("edit", ["mask", "checksum", "extra file", "missing file", "captions"])
def test_verify_names_every_hand_edit_of_a_release(levir, tmp_path, capsys, edit):
    src, caps, qa = levir
    release(src, caps, tmp_path / "rel", qa=qa)
    rel = tmp_path / "rel" / "1.0.0"
    doc = json.loads((rel / "release.json").read_text())
    pid = "test_102_0512_0000"
    split = doc["pairs"][pid]["split"]
    sums = parse_sha256sums((rel / "SHA256SUMS").read_text())
    if edit == "mask":            # another mask, checksums made to agree
        label = rel / split / "label" / f"{pid}.png"
        cv2.imwrite(str(label), np.zeros_like(cv2.imread(str(label), cv2.IMREAD_GRAYSCALE)))
        sums[f"{split}/label/{pid}.png"] = sha256(label.read_bytes())
        want = [made_from.CAPTION_MASK, "released masks that are not the mask release.json records"]
    elif edit == "checksum":      # two files, one whose new digest sorts above the recorded one, one below
        for role, above in (("A", True), ("B", False)):
            rel_path = f"{split}/{role}/{pid}.png"
            (rel / rel_path).write_bytes(_digest_on_side(sums[rel_path], above))
        want = [f"files whose SHA-256 differs from SHA256SUMS: 2 pair(s) (first: {split}/A/{pid}.png, "
                f"{split}/B/{pid}.png)"]
    elif edit == "extra file":
        (rel / "notes.txt").write_text("added by hand")
        want = ["files not listed in SHA256SUMS: 1 pair(s) (first: notes.txt)"]
    elif edit == "missing file":
        (rel / split / "B" / f"{pid}.png").unlink()
        want = [f"files listed in SHA256SUMS but missing: 1 pair(s) (first: {split}/B/{pid}.png)"]
    else:                         # a QA pair's grounding changed: the captions shipped are not its captions
        made = doc["pairs"][pid]["made_from"]
        made["qa"] = {**made["qa"], "captions": lineage.caption_set_digest(["another caption"])}
        (rel / "release.json").write_text(json.dumps(doc))
        sums["release.json"] = sha256((rel / "release.json").read_bytes())
        want = [f"{made_from.QA_CAPTIONS}: 1 pair(s) (first: {pid})"]
    (rel / "SHA256SUMS").write_text(sha256sums(sums))
    code, lines = verify_lines(capsys, rel, "--no-sources")
    assert code == 1
    if edit == "mask":
        assert lines == sorted([f"{made_from.CAPTION_MASK}: 1 pair(s) (first: {pid})",
                                f"{made_from.QA_MASK}: 1 pair(s) (first: {pid})",
                                f"released masks that are not the mask release.json records: 1 pair(s) (first: {pid})"])
    else:
        assert lines == want


# equivalent mutant: `src.list("", recursive=False)` -> `recursive=True` in made_from.verify: whether the dataset
# holds anything is the same question at any depth (recursive=False keeps it one listing page on S3).
