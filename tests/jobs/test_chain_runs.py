"""jobs.chain's decisions, driven through ``jobs.chain.run`` with the real chain file, wiring, argv and
state file, and each step's process replaced by a recorder (the steps' own behaviour is the docs chain's
and the full loop's business, tests/jobs/test_chain_docs.py and test_chain_e2e.py): what is skipped, what
runs again and why, the people's fingerprint, the waiting status, booleans and required options."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jobs import chain as chain_job

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
REAL_RUN = subprocess.run     # the recorder below stands in for it (in the subprocess module itself)


class Recorder:
    """Stands in for each step's process: records (job, command line) and, for annotate ingest, writes
    the ``annotation_summary.json`` the test says the people reached."""

    def __init__(self):
        self.calls, self.summary = [], None

    def __call__(self, cmd, env=None, **kw):
        if cmd[0] != sys.executable:      # not a step (the chain's check of a program, e.g. `java -version`)
            return REAL_RUN(cmd, env=env, **kw)
        assert cmd[:3] == [sys.executable, "-m", "jobs.cli"], cmd     # through the changeforge command
        job = " ".join(cmd[3:5]) if cmd[3] in ("annotate", "review", "score") else cmd[3]
        self.calls.append((job, cmd[3:]))
        if job == "annotate ingest" and self.summary is not None:
            ds = cmd[cmd.index("--input") + 1]
            (__import__("pathlib").Path(ds) / "annotation_summary.json").write_text(json.dumps(self.summary))
        return subprocess.CompletedProcess(cmd, 0)

    def steps(self) -> list[str]:
        out = [j for j, _ in self.calls]
        self.calls = []
        return out


@pytest.fixture()
def rec(monkeypatch):
    r = Recorder()
    monkeypatch.setattr(chain_job.subprocess, "run", r)
    return r


def summary(total: int, decided: int) -> dict:
    return {"version": 1, "pairs": {"total": total, "decided": decided,
                                    "by_status": {"merged": decided, "disagreement": 1, "unannotated": total - decided - 1}}}


def write_chain(path, root, ds, export, caption_model="m1", extra=""):
    path.write_text(f"""output: {root}
steps:
  - annotate export: {{input: {ds}, no-skip-labelled: true}}
  - annotate ingest: {{input: {ds}, export: {export}}}
  - caption: {{input: {ds}, model: {caption_model}}}
  - report: {{}}
{extra}""")
    return path


@pytest.fixture()
def setup(tmp_path):
    ds = tmp_path / "ds"
    (ds / "A").mkdir(parents=True)
    export = tmp_path / "export.json"
    export.write_text("[]")
    return tmp_path / "chain.yaml", tmp_path / "root", ds, export


def test_unchanged_steps_are_skipped_a_changed_one_runs_with_every_later_step(rec, setup):
    config, root, ds, export = setup
    write_chain(config, root, ds, export)
    assert chain_job.run(str(config))["returncode"] == 0
    assert rec.steps() == ["annotate export", "annotate ingest", "caption", "report"]
    assert chain_job.run(str(config))["ran"] == [] and rec.steps() == []          # nothing changed
    write_chain(config, root, ds, export, caption_model="m2")                      # caption's command line
    assert chain_job.run(str(config))["ran"] == ["caption", "report"]
    assert rec.steps() == ["caption", "report"]
    state = json.loads((root / "chain_state.json").read_text())
    assert [s["step"] for s in state["steps"]] == ["annotate export", "annotate ingest", "caption", "report"]
    assert all(s["status"] == "finished" for s in state["steps"])
    assert chain_job.run(str(config))["ran"] == []


def test_from_step_reruns_that_step_and_every_later_one(rec, setup):
    config, root, ds, export = setup
    write_chain(config, root, ds, export)
    chain_job.run(str(config))
    rec.steps()
    assert chain_job.run(str(config), from_step="annotate ingest")["ran"] == ["annotate ingest", "caption", "report"]
    assert chain_job.run(str(config))["ran"] == []
    with pytest.raises(SystemExit, match="--from-step 'captions' is not a step"):
        chain_job.run(str(config), from_step="captions")


def test_a_new_export_at_the_same_path_reruns_ingest_and_the_later_steps(rec, setup):
    config, root, ds, export = setup
    write_chain(config, root, ds, export)
    chain_job.run(str(config))
    rec.steps()
    export.write_text('[{"id": 1, "annotations": [{"id": 7}]}]')     # the annotators' work arrives
    assert chain_job.run(str(config))["ran"] == ["annotate ingest", "caption", "report"]
    fp = json.loads((root / "chain_state.json").read_text())["steps"][1]["fingerprint"]
    assert fp.startswith("sha256:")
    export.write_text('[{"id": 1, "annotations": [{"id": 7}]}]')     # the same bytes again: nothing new
    assert chain_job.run(str(config))["ran"] == []


def test_pending_pairs_stop_the_chain_with_the_waiting_status_until_decided_or_partial(rec, setup, capsys):
    config, root, ds, export = setup
    write_chain(config, root, ds, export)
    rec.summary = summary(43, 12)
    s = chain_job.run(str(config))
    assert s["returncode"] == chain_job.WAITING == 3 and s["ran"] == ["annotate export", "annotate ingest"]
    assert "waiting for annotators: 12 of 43 pairs decided (disagreement 1, unannotated 30)" in capsys.readouterr().out
    rec.steps()
    # Nothing new exported: ingest is not run again, the chain still waits.
    assert chain_job.run(str(config))["returncode"] == 3 and rec.steps() == []
    # --partial: the later steps run on the decided pairs.
    s = chain_job.run(str(config), partial=True)
    assert s["returncode"] == 0 and rec.steps() == ["caption", "report"]
    # The rest is decided in a new export: ingest and everything after it again, and no waiting.
    export.write_text('[{"id": 1}]')
    rec.summary = summary(43, 43)
    s = chain_job.run(str(config))
    assert s["returncode"] == 0 and rec.steps() == ["annotate ingest", "caption", "report"]


def test_main_exits_with_the_waiting_status(rec, setup):
    config, root, ds, export = setup
    write_chain(config, root, ds, export)
    rec.summary = summary(5, 4)
    assert chain_job.main(["--config", str(config)]) == 3
    assert chain_job.main(["--config", str(config), "--partial"]) == 0


@pytest.mark.parametrize("option, flag", [("no-skip-labelled: true", "--no-skip-labelled"),
                                          ("skip-labelled: false", "--no-skip-labelled"),
                                          ("no-skip-labelled: false", "--skip-labelled"),
                                          ("skip_labelled: true", "--skip-labelled")])
def test_booleans_pass_through_as_written(tmp_path, option, flag):
    config = tmp_path / "chain.yaml"
    config.write_text(f"output: {tmp_path / 'root'}\nsteps:\n  - annotate export: {{input: {tmp_path}, {option}}}\n")
    root, steps = chain_job.load_chain(str(config))
    argv = chain_job.step_argv(chain_job.Store(root), *steps[0])
    assert flag in argv and ({"--skip-labelled", "--no-skip-labelled"} - {flag}).isdisjoint(argv), argv


def test_a_boolean_given_both_ways_is_refused(tmp_path):
    config = tmp_path / "chain.yaml"
    config.write_text(f"output: {tmp_path}\nsteps:\n  - annotate export: {{input: x, skip-labelled: true, no-skip-labelled: true}}\n")
    with pytest.raises(SystemExit):
        chain_job.run(str(config))


def test_required_options_neither_given_nor_wired_are_named_before_anything_runs(rec, tmp_path, capsys):
    config = tmp_path / "chain.yaml"
    (tmp_path / "p.json").write_text('[{"id": "x", "answer": "no"}]')   # exists: only what is missing is named
    config.write_text(f"""output: {tmp_path / 'root'}
steps:
  - caption: {{input: {tmp_path}, model: m}}
  - score captions: {{}}
  - score qa: {{pred: {tmp_path / 'p.json'}}}
  - publish: {{licence: CC0-1.0}}
""")
    with pytest.raises(SystemExit) as exc:
        chain_job.run(str(config))
    msg = str(exc.value)
    assert "nothing ran" in msg and "step 2 'score captions' needs --pred" in msg
    assert "step 3 'score qa' needs --refs" in msg        # no qa step before it: not wired
    assert "needs --name" in msg and "needs --version" in msg
    assert "needs --refs" not in msg.split("step 3")[0]   # captions' refs are wired from the caption step
    assert rec.calls == [] and not (tmp_path / "root" / "chain_state.json").exists()
    chain_job.run(str(config), dry_run=True)              # the dry run lists them, and every step's line
    out = capsys.readouterr().out
    assert out.count("[chain] dry run: step") == 4 and "score-captions" in out
    assert f"--refs {tmp_path / 'root' / 'captions' / 'LevirCCcaptions.json'}" in out
    assert f"--captions {tmp_path / 'root' / 'captions'}" in out and "--output " + str(tmp_path / "root" / "releases") in out
    assert rec.calls == []


def test_a_missing_label_studio_sdk_is_one_line_with_the_install_hint(tmp_path, monkeypatch, capsys):
    """Through the changeforge command's main (in this process: a traceback would be an exception here;
    the chain as a process of its own is test_chain_command's and test_chain_docs' end-to-end runs),
    with no SDK here or in its environment."""
    from jobs import cli as changeforge
    from operators.io import cli

    monkeypatch.setattr(cli, "PROG", cli.PROG)   # main names the command there; restored afterwards
    config = tmp_path / "chain.yaml"
    config.write_text(f"output: {tmp_path / 'root'}\nsteps:\n"
                      f"  - annotate export: {{input: {tmp_path}, label-studio-url: http://127.0.0.1:9}}\n")
    monkeypatch.setenv("LABEL_STUDIO_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    assert changeforge.main(["chain", "--config", str(config)]) == 2
    out = capsys.readouterr()
    lines = [l for l in out.err.splitlines() if l.strip()]
    assert len(lines) == 1 and "pip install label-studio-sdk==" in lines[0] and "step 1 'annotate export'" in lines[0]
    assert "Traceback" not in out.out + out.err
    assert not (tmp_path / "root").exists()


def test_an_export_that_has_not_arrived_is_waited_for_not_run(rec, setup, capsys):
    config, root, ds, export = setup
    export.unlink()
    write_chain(config, root, ds, export)
    s = chain_job.run(str(config))
    assert s["returncode"] == 3 and rec.steps() == ["annotate export"]
    assert f"waiting for annotators: no export at {export} yet" in capsys.readouterr().out
    export.write_text("[]")
    assert chain_job.run(str(config))["returncode"] == 0 and rec.steps() == ["annotate ingest", "caption", "report"]
