"""jobs.chain after an ingest that leaves pairs undecided: the annotation loop's own steps (exports, to the
annotators or the expert's review queue, and the ingests of their answers) still run, the chain waits at
the first other step; ``--tasks`` is wired from the nearest earlier export; a dry run that found a missing
requirement exits 2. Each step's process is the recorder of test_chain_runs (the steps' own behaviour is
the end-to-end tests' business)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from jobs import chain as chain_job
from tests.jobs.test_chain_runs import Recorder


class People(Recorder):
    """The recorder, with each annotate ingest writing the summary its export says the people reached
    (``{export path: decided?}``): 12 of 43 pairs decided, or all 43."""

    def __init__(self):
        super().__init__()
        self.decided: dict[str, bool] = {}

    def __call__(self, cmd, env=None, **kw):
        job = " ".join(cmd[3:5]) if cmd[3] in ("annotate", "review", "score") else cmd[3]
        if job == "annotate ingest":
            done = self.decided[cmd[cmd.index("--export") + 1]]
            self.summary = {"version": 1, "pairs": {"total": 43, "decided": 43 if done else 12, "by_status": {
                "merged": 43 if done else 12, "disagreement": 0 if done else 31}}}
        return super().__call__(cmd, env, **kw)

    def argv(self, job: str) -> list[list[str]]:
        return [c for j, c in self.calls if j == job]


@pytest.fixture()
def rec(monkeypatch):
    r = People()
    monkeypatch.setattr(chain_job.subprocess, "run", r)
    return r


def expert_chain(tmp_path: Path) -> tuple[Path, Path, Path, Path, Path]:
    """export -> ingest of round 1 -> export of the review queue -> ingest of the review -> caption -> report."""
    ds, root = tmp_path / "ds", tmp_path / "root"
    (ds / "A").mkdir(parents=True)
    round1, review = tmp_path / "round1.json", tmp_path / "review.json"
    config = tmp_path / "chain.yaml"
    config.write_text(f"""output: {root}
steps:
  - annotate export: {{input: {ds}, no-skip-labelled: true}}
  - annotate ingest: {{input: {ds}, export: {round1}}}
  - annotate export: {{input: {ds}, queue: review}}
  - annotate ingest: {{input: {ds}, export: {review}}}
  - caption: {{input: {ds}, model: m}}
  - report: {{}}
""")
    return config, root, ds, round1, review


def test_the_expert_s_review_is_exported_and_ingested_while_the_chain_waits(rec, tmp_path, capsys):
    config, root, ds, round1, review = expert_chain(tmp_path)
    round1.write_text("[1]")
    rec.decided = {str(round1): False}
    s = chain_job.run(str(config))
    # round 1 leaves a disagreement: its review is exported; the review's export has not arrived
    assert s["returncode"] == 3 and s["ran"] == ["annotate export", "annotate ingest", "annotate export"]
    assert f"waiting for annotators: no export at {review} yet" in capsys.readouterr().out
    first, second = rec.argv("annotate export")
    assert "--queue" not in first and first[first.index("--output") + 1] == str(root / "annotate")
    assert second[second.index("--queue") + 1] == "review"
    assert second[second.index("--output") + 1] == str(root / "annotate-review")   # not the annotators' tasks.json
    [ingest] = rec.argv("annotate ingest")
    assert ingest[ingest.index("--tasks") + 1] == str(root / "annotate" / "tasks.json")
    rec.steps()

    # The expert has answered part of it: the review is ingested, the chain waits before caption.
    review.write_text("[2]")
    rec.decided[str(review)] = False
    s = chain_job.run(str(config))
    assert s["returncode"] == 3 and rec.steps() == ["annotate ingest"]
    out = capsys.readouterr().out
    assert "waiting for annotators: 12 of 43 pairs decided (disagreement 31); step 5 caption and the later " \
           "steps run when every pair is decided" in out
    state = json.loads((root / "chain_state.json").read_text())
    assert [st_["step"] for st_ in state["steps"]] == ["annotate export", "annotate ingest", "annotate export",
                                                      "annotate ingest"]
    assert state["steps"][3]["argv"][state["steps"][3]["argv"].index("--tasks") + 1] == \
        str(root / "annotate-review" / "tasks.json")

    # Nothing new: nothing runs, still waiting.
    assert chain_job.run(str(config))["returncode"] == 3 and rec.steps() == []
    # The expert decides the rest: the review's ingest re-runs, every pair is decided, the chain goes on.
    review.write_text("[2, 3]")
    rec.decided[str(review)] = True
    s = chain_job.run(str(config))
    assert s["returncode"] == 0 and rec.steps() == ["annotate ingest", "caption", "report"]


def test_a_review_export_that_never_comes_is_not_waited_for_once_every_pair_is_decided(rec, tmp_path, capsys):
    config, root, ds, round1, review = expert_chain(tmp_path)
    round1.write_text("[1]")
    rec.decided = {str(round1): True}          # no disagreement: the expert gets no task, and sends nothing
    s = chain_job.run(str(config))
    assert s["returncode"] == 0
    assert rec.steps() == ["annotate export", "annotate ingest", "annotate export", "caption", "report"]
    assert f"step 4 annotate ingest: no export at {review}, and every pair is decided: nothing to wait for" \
        in capsys.readouterr().out
    # A later round 1 with a disagreement: the review is exported again and waited for.
    round1.write_text("[1, 2]")
    rec.decided[str(round1)] = False
    s = chain_job.run(str(config))
    assert s["returncode"] == 3 and rec.steps() == ["annotate ingest", "annotate export"]
    assert f"waiting for annotators: no export at {review} yet" in capsys.readouterr().out


def test_the_first_ingest_waits_for_its_export_whatever_an_old_summary_says(rec, tmp_path, capsys):
    config, root, ds, round1, review = expert_chain(tmp_path)
    (ds / "annotation_summary.json").write_text(json.dumps({"pairs": {"total": 3, "decided": 3}}))
    s = chain_job.run(str(config))
    assert s["returncode"] == 3 and rec.steps() == ["annotate export"]
    assert f"waiting for annotators: no export at {round1} yet" in capsys.readouterr().out


def test_partial_goes_on_past_every_waiting_ingest(rec, tmp_path):
    config, root, ds, round1, review = expert_chain(tmp_path)
    round1.write_text("[1]")
    review.write_text("[2]")
    rec.decided = {str(round1): False, str(review): False}
    s = chain_job.run(str(config), partial=True)
    assert s["returncode"] == 0 and len(s["ran"]) == 6


# -- --tasks only from an export step -----------------------------------------------------------------
def _argv(tmp_path: Path, steps: str) -> list[list[str]]:
    config = tmp_path / "chain.yaml"
    config.write_text(f"output: {tmp_path / 'root'}\nsteps:\n{steps}")
    root, parsed = chain_job.load_chain(str(config))
    return [chain_job.step_argv(chain_job.Store(root), s, o, parsed[:i]) for i, (s, o) in enumerate(parsed)]


def test_ingest_gets_tasks_only_from_an_export_step_before_it(tmp_path):
    ds = tmp_path / "ds"
    [ingest] = _argv(tmp_path, f"  - annotate ingest: {{input: {ds}, export: e.json}}\n")
    assert "--tasks" not in ingest                      # no export step: nothing wired (the job's own default)
    ingest, _ = _argv(tmp_path, f"  - annotate ingest: {{input: {ds}, export: e.json}}\n"
                                f"  - annotate export: {{input: {ds}}}\n")
    assert "--tasks" not in ingest                      # an export after it sent nothing it reads
    *_, ingest = _argv(tmp_path, f"  - annotate export: {{input: {ds}, output: {tmp_path / 'mine'}}}\n"
                                 f"  - caption: {{input: {ds}, model: m}}\n"
                                 f"  - annotate ingest: {{input: {ds}, export: e.json}}\n")
    assert ingest[ingest.index("--tasks") + 1] == str(tmp_path / "mine" / "tasks.json")   # its own output
    *_, ingest = _argv(tmp_path, f"  - annotate export: {{input: {ds}}}\n"
                                 f"  - annotate export: {{input: {ds}, --queue: review, output: {tmp_path / 'rv'}}}\n"
                                 f"  - annotate ingest: {{input: {ds}, export: e.json, tasks: {tmp_path / 'given.json'}}}\n")
    assert ingest[ingest.index("--tasks") + 1] == str(tmp_path / "given.json")       # given: kept


def test_each_export_writes_a_folder_of_its_own_and_each_ingest_reads_the_one_before_it(tmp_path):
    ds, root = tmp_path / "ds", tmp_path / "root"
    argv = _argv(tmp_path, f"  - annotate export: {{input: {ds}}}\n"
                           f"  - annotate ingest: {{input: {ds}, export: a.json}}\n"
                           f"  - annotate export: {{input: {ds}, queue: review}}\n"
                           f"  - annotate export: {{input: {ds}, resend: true}}\n"
                           f"  - annotate ingest: {{input: {ds}, export: b.json}}\n"
                           f"  - annotate export: {{input: {ds}, queue: review, output: {tmp_path / 'mine'}}}\n"
                           f"  - annotate export: {{input: {ds}, queue: review}}\n"
                           f"  - annotate ingest: {{input: {ds}, export: c.json}}\n")
    out = [a[a.index("--output") + 1] for a in argv if "export" in a]
    assert out == [str(root / "annotate"), str(root / "annotate-review"), str(root / "annotate-4"),
                   str(tmp_path / "mine"), str(root / "annotate-review-7")]
    tasks = [a[a.index("--tasks") + 1] for a in argv if "ingest" in a]
    assert tasks == [str(root / "annotate" / "tasks.json"), str(root / "annotate-4" / "tasks.json"),
                     str(root / "annotate-review-7" / "tasks.json")]


# -- the dry run's exit status ------------------------------------------------------------------------
def test_a_dry_run_that_found_a_missing_requirement_exits_2_and_one_that_found_none_exits_0(rec, tmp_path, capsys):
    config = tmp_path / "chain.yaml"
    config.write_text(f"output: {tmp_path / 'root'}\nsteps:\n  - caption: {{input: {tmp_path}, model: m}}\n"
                      f"  - publish: {{licence: CC0-1.0}}\n")
    for flag in ("--dry-run", "--explain"):
        assert chain_job.main(["--config", str(config), flag]) == 2
        out = capsys.readouterr().out
        assert "dry run: step 2 'publish' needs --name" in out
        assert out.rstrip().splitlines()[-1] == ("[chain] dry run: nothing ran; 2 problem(s) found (above): the "
                                                 "chain would stop before its first step")
    from jobs import cli as changeforge        # the changeforge command passes the status on
    from operators.io import cli
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "PROG", cli.PROG)      # main names the command there; restored afterwards
        assert changeforge.main(["chain", "--config", str(config), "--dry-run"]) == 2
    capsys.readouterr()
    config.write_text(f"output: {tmp_path / 'root'}\nsteps:\n  - caption: {{input: {tmp_path}, model: m}}\n")
    assert chain_job.main(["--config", str(config), "--dry-run"]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == "[chain] dry run: nothing ran; no problems found"
    assert rec.calls == [] and not (tmp_path / "root").exists()


def test_a_chain_with_score_captions_stops_before_anything_runs_without_java(rec, tmp_path, monkeypatch):
    from operators.chain import needs
    monkeypatch.setattr(needs, "_installed", lambda m: True)
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    (tmp_path / "p.json").write_text("{}")
    config = tmp_path / "chain.yaml"
    config.write_text(f"output: {tmp_path / 'root'}\nsteps:\n  - caption: {{input: {tmp_path}, model: m}}\n"
                      f"  - score captions: {{pred: {tmp_path / 'p.json'}}}\n")
    with pytest.raises(SystemExit) as exc:
        chain_job.run(str(config))
    assert "nothing ran; step 2 'score captions' needs a working java: java not found" in str(exc.value)
    assert rec.calls == [] and chain_job.run(str(config), dry_run=True)["returncode"] == 2


# -- generated chains ---------------------------------------------------------------------------------
# A chain: the annotators' export, then steps drawn from ingests (each with an export that arrived or
# not, and that decides every pair or not), review-queue exports and later steps. The reference walks the
# documented rule: after an ingest that leaves pairs undecided only exports and ingests run; an ingest
# whose export is missing waits, unless an earlier ingest of this run decided every pair (then it is
# skipped); the chain waits before the first other step, or at its end, while the latest ingest left
# pairs undecided.
STEP = st.one_of(st.tuples(st.just("ingest"), st.booleans(), st.booleans()),     # (arrived, decides all)
                 st.just(("review",)), st.just(("caption",)), st.just(("report",)))


def reference(steps: list[tuple]) -> tuple[list[str], int]:
    ran, progress, waiting = ["annotate export"], None, False
    for step in steps:
        if waiting and step[0] not in ("ingest", "review"):
            return ran, 3
        if step[0] == "ingest":
            if not step[1]:
                if not progress:               # no ingest before it in this run, or pairs undecided
                    return ran, 3
                continue
            ran.append("annotate ingest")
            progress = step[2]
            waiting = not step[2]
        else:
            ran.append({"review": "annotate export", "caption": "caption", "report": "report"}[step[0]])
    return ran, 3 if waiting else 0


@given(st.lists(STEP, min_size=1, max_size=6))
def test_generated_chains_run_and_wait_as_the_rule_says(steps):
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        tmp = Path(tmp)
        ds = tmp / "ds"
        (ds / "A").mkdir(parents=True)
        r = People()
        mp.setattr(chain_job.subprocess, "run", r)
        lines = [f"  - annotate export: {{input: {ds}}}"]
        for i, step in enumerate(steps):
            if step[0] == "ingest":
                export = tmp / f"export-{i}.json"
                if step[1]:
                    export.write_text("[]")
                r.decided[str(export)] = step[2]
                lines.append(f"  - annotate ingest: {{input: {ds}, export: {export}}}")
            elif step[0] == "review":
                lines.append(f"  - annotate export: {{input: {ds}, queue: review}}")
            elif step[0] == "caption":
                lines.append(f"  - caption: {{input: {ds}, model: m}}")
            else:
                lines.append(f"  - report: {{input: [{ds}]}}")
        config = tmp / "chain.yaml"
        config.write_text(f"output: {tmp / 'root'}\nsteps:\n" + "\n".join(lines) + "\n")
        s = chain_job.run(str(config))
        assert (r.steps(), s["returncode"]) == reference(steps)
