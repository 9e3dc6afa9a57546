"""Generated Label Studio histories (tests/annotation/label_studio_world.py: two instances, annotate and
review projects; create, edit in place by the author or another user, star, delete, skip, unusable ticked
and unticked, tasks re-imported, drafts; full, partial, filtered and old exports) through the real ingest core (history rows,
withdrawals, decisions) and, beside it, the reference oracle written from docs/annotation.md
(tests/annotation/oracle.py): every pair's status, reason, people, batch, merged version and mask must be
the same after every step. The example budget is the hypothesis profile's (tests/conftest.py: small in
the quick loop, larger in the full suite); masks are 16 px, and a fixed handful of runs is at 1024 px."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from operators.annotation.decisions import DecisionConfig, decide_all, history_key
from operators.annotation.history import HISTORY_SCHEMA
from operators.annotation.ingest_ops import new_history
from operators.annotation.results import class_masks
from operators.annotation.scheme import parse_classes
from operators.io.tables import records_to_table
from tests.annotation import oracle
from tests.annotation.label_studio_world import GONE, NEW, PAIRS, PROJECTS, TICKS, USERS, LabelStudio

CLASSES = parse_classes("new:post,demolished:pre")
DATASET = {p: {"pair_id": p, "split": "train"} for p in PAIRS}


class LabelStudioHistories(RuleBasedStateMachine):
    SIZE = 16
    NOISE_PX = 8

    def __init__(self):
        super().__init__()
        self.world = LabelStudio(self.SIZE, self.NOISE_PX)
        self.history: list[dict] = []
        self.known = oracle.Known()
        self.snapshots: list[tuple] = []
        self.decoded: dict = {}
        self.agreements: dict = {}
        self.real = self.expected = None

    @initialize(experts=st.sampled_from([(), ("boss",)]), require_check=st.sampled_from([False, False, True]),
                first_round=st.lists(st.tuples(st.sampled_from(PAIRS), st.sampled_from(USERS), st.sampled_from(NEW),
                                               st.sampled_from(GONE), st.sampled_from(TICKS)), min_size=2, max_size=5))
    def a_first_round(self, experts, require_check, first_round):
        """The run's settings, and a first round in the annotate project, exported in full."""
        self.rules = oracle.Rules(noise_px=self.NOISE_PX, experts=experts, require_check=require_check)
        self.cfg = DecisionConfig(min_agreement=self.rules.min_agreement, batch_min_agreement=self.rules.batch_min_agreement,
                                  tolerance_px=self.rules.tolerance_px, noise_px=self.NOISE_PX,
                                  require_check=require_check, experts=experts)
        for pair, user, new, gone, ticks in first_round:
            self.world.create("", 1, pair, user, (new, gone), ticks, False)
        self.export(("", 1), "full", 0)

    # -- what people do in Label Studio ---------------------------------------------------------------
    @rule(where=st.sampled_from(sorted(PROJECTS)), pair=st.sampled_from(PAIRS),
          work=st.lists(st.tuples(st.sampled_from(USERS), st.sampled_from(NEW), st.sampled_from(GONE),
                                  st.sampled_from(TICKS), st.sampled_from([False, False, False, True]),
                                  st.sampled_from([None, None, "admin"])),
                        min_size=1, max_size=3))
    def annotate(self, where, pair, work):
        # one or more people submit (or skip) a task; now and then an admin creates one for them (API)
        for user, new, gone, ticks, skipped, admin in work:
            self.world.create(*where, pair, user, (new, gone), ticks, skipped, saved_by=admin)

    def _pick(self, data):
        return self.world.anns[data.draw(st.sampled_from(sorted(self.world.anns)))]

    @precondition(lambda self: self.world.anns)
    @rule(data=st.data(), user=st.sampled_from(USERS), new=st.sampled_from(NEW), gone=st.sampled_from(GONE),
          ticks=st.sampled_from(TICKS))
    def edit_in_place(self, data, user, new, gone, ticks):
        self.world.update(self._pick(data), user, (new, gone), ticks)     # () unticks a mark

    @precondition(lambda self: self.world.anns)
    @rule(data=st.data(), user=st.sampled_from(USERS))
    def star(self, data, user):
        self.world.star(self._pick(data), user)

    @precondition(lambda self: self.world.anns)
    @rule(data=st.data())
    def delete(self, data):
        self.world.delete(self._pick(data))

    @rule(where=st.sampled_from(sorted(PROJECTS)), pair=st.sampled_from(PAIRS))
    def reimport(self, where, pair):
        self.world.reimport(*where, pair)

    @rule(where=st.sampled_from(sorted(PROJECTS)), pair=st.sampled_from(PAIRS), user=st.sampled_from(USERS),
          new=st.sampled_from(NEW))
    def draft(self, where, pair, user, new):
        self.world.draft(*where, pair, user, (new, "empty"))

    # -- exports, ingested --------------------------------------------------------------------------
    @rule(where=st.sampled_from(sorted(PROJECTS) + ["every project"]),
          how=st.sampled_from(["full", "full", "partial", "filtered"]), index=st.integers(0, 7))
    def export(self, where, how, index):
        for inst, project in (sorted(PROJECTS) if where == "every project" else [where]):
            tasks = self.world.export(inst, project, drop_task=index if how == "partial" else None,
                                      drop_ann=index if how == "filtered" else None)
            self.snapshots.append((inst, tasks))
            self._ingest(inst, tasks)

    @precondition(lambda self: self.snapshots)
    @rule(data=st.data())
    def an_old_export_again(self, data):
        self._ingest(*data.draw(st.sampled_from(self.snapshots)))

    def _ingest(self, instance, tasks):
        fresh, unknown = new_history(self.history, json.loads(json.dumps(tasks)), DATASET, instance=instance)
        assert not unknown
        self.history += records_to_table(fresh, HISTORY_SCHEMA).to_pylist()   # as ingest reads them back
        if any(r["withdrawn"] for r in fresh):
            event("an annotation withdrawn")
        self.real = decide_all(self.history, self._masks, self.cfg)
        self.known.ingest(instance, tasks)
        self.expected = oracle.decide_everything(self.known, self._palette_of, self.rules, self.agreements)

    def _masks(self, row):
        k = history_key(row)
        if k not in self.decoded:
            self.decoded[k] = class_masks(json.loads(row["result"] or "[]"), CLASSES, self.SIZE, self.SIZE)
        return self.decoded[k]

    def _palette_of(self, version):
        """The oracle's masks: the palette names the world drew with, never a decoded brush."""
        new, gone = self.world.drawing_of(version["result"])
        return {"new": (new, self.world.masks[new]), "demolished": (gone, self.world.masks[gone])}

    @invariant()
    def the_pipeline_agrees_with_the_oracle(self):
        if self.real is None:
            return
        assert sorted(self.real) == sorted(self.expected)
        for pid, want in self.expected.items():
            d = self.real[pid]
            got = dict(status=d.status, reason=d.reason, annotator=d.annotator, checker=d.checker, expert=d.expert,
                       batch=None if d.batch is None else (d.instance, d.batch),
                       merged=None if d.merged_from is None else d.merged_from[:5])
            exp = {k: want[k] for k in got}
            exp["merged"] = None if want["merged"] is None else (*want["merged"]["key"], want["merged"]["updated_at"])
            assert got == exp, pid
            event(f"{d.status}: {d.reason.split(':')[0][:40]}")   # which rules the runs reached (--hypothesis-show-statistics)
            assert d.agreement == (None if want["agreement"] is None else pytest.approx(want["agreement"], abs=1e-9)), pid
            if want["merged"] is not None:
                for name, (_, mask) in self._palette_of(want["merged"]).items():
                    assert np.array_equal(d.masks[name], mask), (pid, name)


# The profile's budget (tests/conftest.py), but at least 100 histories: the quick profile's 25 rarely reach a
# deletion seen by a partial export. Quick: 100 (~3 s); full: 200; hunt: 5000.
LabelStudioHistories.TestCase.settings = settings(settings.default, max_examples=max(100, settings.default.max_examples),
                                                  stateful_step_count=16)
TestLabelStudioHistories = LabelStudioHistories.TestCase


class AtFullSize(LabelStudioHistories):
    SIZE = 1024
    NOISE_PX = 200          # validate's no-change floor, the default


def test_histories_at_1024_px():
    """The paper's crop size, a fixed handful of histories (derandomized: the same ones every run; the first
    is hypothesis's simplest), so the brush encoding and decoding and the tolerance work at full size."""
    run_state_machine_as_test(AtFullSize, settings=settings(max_examples=8, stateful_step_count=12, derandomize=True))
