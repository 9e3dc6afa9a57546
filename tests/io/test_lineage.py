"""Resuming by lineage (operators.io.lineage) against generated histories of a dataset and a job, with a
reference written from the documented rule: a finished pair is skipped exactly when every input its row
was made from (file contents, caption set, templates, models, settings) is unchanged today; files are
read again only when their stamps changed; a row made before lineage was kept is left alone."""
from __future__ import annotations

import json

import cv2
import pytest
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

# A cheap rule (a few ms a case with its generator): five times the profile's budget (125 cases in the quick
# loop, 1,000 in the full suite).
RULE_BUDGET = settings(parent=settings.default, max_examples=settings.default.max_examples * 5)

from operators.io import lineage

JOB_INPUTS = ("generate_template", "judge_template", "model", "judge_model", "options", "captions")
ROLES = (("A", "a"), ("B", "b"), ("mask", "label"))


@st.composite
def histories(draw):
    """Pairs whose files had a content version and a stamp when their rows were made, and today: each file
    kept, touched (new stamp, same content), rewritten (new stamp, new content), or rewritten with the
    same content; the run-wide inputs kept or changed; some pairs never finished, some rows without
    lineage (older outputs)."""
    n = draw(st.integers(1, 12))
    job_then = {k: draw(st.sampled_from(["x", "y"])) for k in JOB_INPUTS}
    job_now = {k: (draw(st.sampled_from(["x", "y"])) if draw(st.booleans()) else v) for k, v in job_then.items()}
    pairs, recorded, truth = [], {}, {}
    for i in range(n):
        pid = f"p{i}"
        item = {"pair_id": pid, "root": "/data"}
        rec = {}
        changed = set()
        for role, short in ROLES:
            if role == "mask" and draw(st.integers(0, 5)) == 0:
                continue                                         # a pair without a mask file
            content = draw(st.sampled_from(["c0", "c1"]))
            stamp = f"s{draw(st.integers(0, 3))}"
            event = draw(st.sampled_from(["kept", "touched", "rewritten", "rewritten same"]))
            now_content = {"rewritten": "c9"}.get(event, content)
            now_stamp = stamp if event == "kept" else stamp + "'"
            item[f"{short}_rel"] = f"{role}/{pid}.png"
            item[f"{short}_stamp"] = now_stamp
            item[f"_content_{role}"] = now_content
            rec[role] = content
            rec.setdefault(lineage.STAMPS, {})[role] = stamp
            if now_content != content:
                changed.add(lineage.CAUSES[role])
        rec.update(job_then)
        changed |= {lineage.CAUSES[k] for k in JOB_INPUTS if job_now[k] != job_then[k]}
        kind = draw(st.sampled_from(["finished", "finished", "missing", "unrecorded"]))
        if kind == "finished":
            recorded[pid] = rec
            truth[pid] = ("stale", sorted(changed)) if changed else ("current", [])
        elif kind == "unrecorded":
            recorded[pid] = None
            truth[pid] = ("unrecorded", [])
        else:
            truth[pid] = ("missing", [])
        pairs.append(item)
    # The recorded lineage as the job reads it back (stored, then parsed): equal stamps are equal strings,
    # not the same objects (an `is` for `==` in moved_files survived a generator that shared them).
    return pairs, json.loads(json.dumps(recorded)), job_now, truth


@settings(RULE_BUDGET)
@given(histories())
def test_a_pair_is_redone_exactly_when_an_input_it_was_made_from_changed(history):
    pairs, recorded, job_now, truth = history
    reads = []

    def digest_of(item):
        def read(role, rel):
            reads.append((item["pair_id"], role))
            return item[f"_content_{role}"]
        return read

    plan = lineage.plan_resume(pairs, recorded,
                               lambda item, rec: {**lineage.file_lineage(item, rec, digest_of(item)), **job_now})
    got = {**{k: ("current", []) for k in plan.current}, **{k: ("missing", []) for k in plan.missing},
           **{k: ("unrecorded", []) for k in plan.unrecorded}, **{k: ("stale", v) for k, v in plan.stale.items()}}
    assert got == truth
    assert sorted(p["pair_id"] for p in plan.todo) == sorted(k for k, (s, _) in truth.items()
                                                             if s in ("stale", "missing"))
    # A file is read again only when its stamp moved since its row was made (never for a pair not finished).
    moved = {(p["pair_id"], role) for p in pairs if recorded.get(p["pair_id"])
             for role, short in ROLES if f"{short}_stamp" in p
             and recorded[p["pair_id"]][lineage.STAMPS][role] != p[f"{short}_stamp"]}
    assert set(reads) <= moved


def test_the_redo_line_names_each_cause_with_its_count():
    plan = lineage.ResumePlan(stale={"a": ["mask"], "b": ["mask", "template"], "c": ["caption"]})
    assert lineage.redo_line(plan) == "3 redone because their input changed: caption 1, mask 2, template 1"
    assert lineage.redo_line(lineage.ResumePlan()) == ""


def test_status_counts_failed_pairs_apart_and_only_stale_or_untried_ones_need_a_run():
    plan = lineage.ResumePlan(current=["a"], missing=["b", "c"])
    assert lineage.status(plan, failed={"b", "c"})["needs_run"] is False
    s = lineage.status(plan, failed={"b"})
    assert (s["missing"], s["failed"], s["needs_run"]) == (1, 1, True)
    assert lineage.status(lineage.ResumePlan(current=["a"], stale={"d": ["model"]}))["needs_run"] is True
    assert lineage.status_line(lineage.status(lineage.ResumePlan(current=["a"], stale={"d": ["mask"]}))) == \
        "1 current, 1 stale (mask 1: d), 0 missing, 0 failed"


@settings(settings.default)
@given(st.integers(8, 64), st.integers(8, 64), st.integers(0, 2 ** 32 - 1))
def test_a_mask_digest_is_of_its_pixels_not_its_encoding(h, w, seed):
    rng = np.random.default_rng(seed)
    m = rng.random((h, w)) < 0.3
    forms = [m, m.astype(np.uint8), m.astype(np.uint8) * 255, np.dstack([m.astype(np.uint8) * 255] * 3),
             m.astype(np.uint16) * 7]
    png = cv2.imdecode(cv2.imencode(".png", m.astype(np.uint8) * 255, [cv2.IMWRITE_PNG_COMPRESSION, 9])[1],
                       cv2.IMREAD_UNCHANGED)
    digests = {lineage.mask_digest(f) for f in forms} | {lineage.mask_digest(png)}
    assert len(digests) == 1
    y, x = rng.integers(0, h), rng.integers(0, w)
    one_off = m.copy()
    one_off[y, x] = not one_off[y, x]
    assert lineage.mask_digest(one_off) not in digests
    assert lineage.mask_digest(m.T) not in digests or h == w and np.array_equal(m, m.T)


def test_caption_sets_are_digested_as_sets_of_stripped_captions():
    assert lineage.caption_set_digest(["b ", "a"]) == lineage.caption_set_digest(["a", " b"])
    assert lineage.caption_set_digest(["a"]) != lineage.caption_set_digest(["a", "b"])


def test_a_row_without_lineage_or_with_a_damaged_one_reads_as_unrecorded():
    assert lineage.loads(None) is None and lineage.loads(float("nan")) is None
    assert lineage.loads("not json") is None and lineage.loads("[1]") is None
    assert lineage.loads(lineage.dumps({"mask": "m"})) == {"mask": "m"}


def test_digests_of_values_and_stored_lineage_do_not_depend_on_key_order():
    assert lineage.value_digest({"a": 1, "b": 2}) == lineage.value_digest({"b": 2, "a": 1})
    # stored canonical: two rows made from the same inputs hold the same text (tables compare rows by value)
    assert lineage.dumps({"b": 1, "a": 2}) == '{"a": 2, "b": 1}'


def test_a_mask_digest_knows_its_shape_where_the_bits_alone_do_not():
    # zeros of 7 or 8 pixels pack to the same byte: only the shape tells them apart
    assert lineage.mask_digest(np.zeros((1, 7), bool)) != lineage.mask_digest(np.zeros((1, 8), bool))
    assert lineage.mask_digest(np.zeros((7, 1), bool)) != lineage.mask_digest(np.zeros((8, 1), bool))
    # any non-zero value is change, a negative one too (a signed mask's -1)
    assert lineage.mask_digest(np.array([[-1, 0]], np.int16)) == lineage.mask_digest(np.array([[1, 0]], bool))
    with pytest.raises(ValueError, match="not 4"):
        lineage.mask_digest(np.zeros((2, 2, 1, 1), bool))


def test_a_pair_without_one_file_still_has_the_digests_of_the_others():
    item = {"a_rel": "", "b_rel": "B/p.png", "label_rel": "label/p.png", "b_stamp": "1", "label_stamp": "2"}
    got = lineage.file_lineage(item, None, lambda role, rel: f"digest of {rel}")
    assert got == {"B": "digest of B/p.png", "mask": "digest of label/p.png"}


def test_an_input_recorded_on_one_side_only_is_a_change():
    assert lineage.changed_inputs({"mask": "m"}, {"mask": "m", "captions": "c"}) == ["captions"]
    assert lineage.changed_inputs({"mask": "m", "captions": "c"}, {"mask": "m"}) == ["captions"]
    assert lineage.changed_inputs({"mask": "m", lineage.STAMPS: {"mask": "1"}}, {"mask": "m"}) == []


def test_digests_keep_their_format_across_versions():
    """Digests are stored in tables and releases and compared by later versions of changeforge: the
    format is fixed (a change here makes every stored row look stale and every release fail --verify)."""
    from operators.language.captions import PromptTemplate
    assert lineage.mask_digest(np.eye(3, dtype=bool)) == \
        "35086cc63034810dca13fdfdc8fde2b9536ad199cde6fb9968064094851c53e0"
    assert lineage.value_digest({"b": [1, "é"], "a": None}) == \
        "1c3d52eb78675f43aa6a9ba74757059995a46043fee52c606fce62df3de0a8de"
    assert lineage.caption_set_digest([" b", "a"]) == \
        "3554d2b8a1e34099053865de8576d1460b807430ec8c6b85315c9607ba93d308"
    assert lineage.template_digest(PromptTemplate(version="t.v1", system="You describe change.",
                                                  user="Describe $pair.")) == \
        "18ef3c0b9806363e77329209ce571a309da387795d0a5c423e0e5f2665b49dd4"


def test_an_item_whose_file_cannot_be_read_is_neither_current_nor_stale_but_failed_with_its_reason():
    bad = lineage.unreadable("label/p.png", "ValueError:  not\n an image")
    assert bad == "unreadable: label/p.png: ValueError: not an image" and bad.startswith(lineage.UNREADABLE)
    # Every input but the stamps, whatever its name sorts next to ("template" after "stamps").
    assert lineage.unreadable_inputs({"A": "a", "mask": bad, lineage.STAMPS: {"mask": bad},
                                      "template": lineage.unreadable("prompts/t.json", "gone")}) == \
        ["label/p.png: ValueError: not an image", "prompts/t.json: gone"]
    items = [{"pair_id": p} for p in ("ok", "bad", "both", "new", "moved")]
    recorded = {"ok": {"mask": "m"}, "bad": {"mask": "m"}, "both": {"A": "a", "mask": "m"}, "moved": {"mask": "m"}}
    today = {"ok": {"mask": "m"}, "bad": {"mask": bad}, "moved": {"mask": "m2"},
             "both": {"A": lineage.unreadable("A/p.png", "gone"), "mask": bad}}
    plan = lineage.plan_resume(items, recorded, lambda item, rec: today[item["pair_id"]])
    assert plan.unreadable == {"bad": "label/p.png: ValueError: not an image",
                               "both": "A/p.png: gone; label/p.png: ValueError: not an image"}
    assert plan.current == ["ok"] and plan.stale == {"moved": ["mask"]} and plan.missing == ["new"]
    assert [i["pair_id"] for i in plan.todo] == ["new", "moved"]
    assert plan.counts()["unreadable"] == 2
    s = lineage.status(plan, failed={"new"})
    assert (s["failed"], s["unreadable"], s["missing"], s["needs_run"]) == (3, 2, 0, True)
    assert s["unreadable_first"] == ["bad: label/p.png: ValueError: not an image",
                                     "both: A/p.png: gone; label/p.png: ValueError: not an image"]
    only = lineage.status(lineage.ResumePlan(current=["ok"], unreadable={"bad": "label/p.png: gone"}))
    assert only["needs_run"] is False and only["failed"] == 1
    assert lineage.status_line(only) == "1 current, 0 stale, 0 missing, 1 failed (1 unreadable: bad: label/p.png: gone)"
    assert lineage.unreadable_line(lineage.ResumePlan(unreadable={"b": "x: gone", "a": "y: gone"})) == \
        "2 pair(s) not redone, a file cannot be read: a: y: gone; b: x: gone"
    assert lineage.unreadable_line(lineage.ResumePlan(), "claim(s)") == ""
    many = lineage.ResumePlan(unreadable={k: "f: r" for k in "abcde"})
    assert lineage.status(many)["unreadable_first"] == ["a: f: r", "b: f: r", "c: f: r"]
    assert lineage.unreadable_line(many, "claim(s) not checked again") == \
        "5 claim(s) not checked again, a file cannot be read: a: f: r; b: f: r; c: f: r"


def test_status_names_the_first_five_stale_and_missing_items_in_order():
    names = [f"p{i:02d}" for i in range(12)]
    plan = lineage.ResumePlan(missing=names[::-1][:7], stale={k: ["images"] for k in names[5:][::-1]})
    s = lineage.status(plan)
    assert s["missing_first"] == ["p05", "p06", "p07", "p08", "p09"] and s["missing"] == 7
    assert s["stale_first"] == ["p05", "p06", "p07", "p08", "p09"] and s["stale"] == 7
    s = lineage.status(plan, failed={"p05", "p06"})
    assert s["missing_first"] == ["p07", "p08", "p09", "p10", "p11"] and (s["missing"], s["failed"]) == (5, 2)


def test_a_step_recomputed_whole_counts_its_items_by_what_they_were_made_from():
    recorded = {"same": {"prediction": "p"}, "edited": {"prediction": "p"}, "gone": {"prediction": "p"},
                "old": None, "tried": {"prediction": "p"}}
    today = {"same": {"prediction": "p"}, "edited": {"prediction": "q", "captions": "c"}, "old": {"prediction": "p"},
             "new": {"prediction": "p"}, "failed": {"prediction": "p"},
             "tried": {"prediction": lineage.unreadable("m.png", "gone")}}
    s = lineage.keyed_status(recorded, today, failed={"failed", "same"})
    assert (s["current"], s["stale"], s["missing"], s["failed"], s["unrecorded"], s["unreadable"]) == (1, 2, 1, 2, 1, 1)
    assert s["stale_by_cause"] == {"caption": 1, "prediction": 1, "removed": 1} and s["stale_first"] == ["edited", "gone"]
    assert s["missing_first"] == ["new"] and s["needs_run"] is True
    assert lineage.keyed_status({"a": {"x": 1}}, {"a": {"x": 1}})["needs_run"] is False
    assert lineage.keyed_status({"a": {"x": 1}}, {})["stale_by_cause"] == {lineage.REMOVED: 1}
