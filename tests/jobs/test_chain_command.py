"""jobs.chain as a command: steps checked before anything runs, wired on one output root, waiting at an
export that has not arrived and resumed there on the next run (finished steps skipped, as their state
file says)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.annotation.drawing import brush
from tests.annotation.test_annotate_job import make_dataset, rect

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def chain(config, *extra):
    return subprocess.run([sys.executable, "-m", "jobs.chain", "--config", str(config), *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow   # three chain runs, each step its own process (~25 s)
def test_chain_waits_for_the_export_and_resumes_at_ingest(tmp_path):
    ds = make_dataset(tmp_path / "docroot" / "pairs")
    __import__("shutil").rmtree(ds / "metadata")        # a LEVIR-CD-layout dataset, not a pairs output
    root, export = tmp_path / "run", tmp_path / "ls-export.json"
    config = tmp_path / "chain.yaml"
    config.write_text(f"""output: {root}
steps:
  - annotate export: {{input: {ds}}}
  - annotate ingest: {{input: {ds}, export: {export}}}
  - report: {{input: [{ds}]}}
""")
    first = chain(config)     # the annotators' export is not there yet: the chain waits for them
    assert first.returncode == 3 and f"waiting for annotators: no export at {export} yet" in first.stdout, \
        first.stdout[-2000:] + first.stderr[-2000:]
    state = json.loads((root / "chain_state.json").read_text())
    assert [(s["step"], s["status"]) for s in state["steps"]] == [("annotate export", "finished")]
    tasks = json.loads((root / "annotate" / "tasks.json").read_text())     # wired: <root>/annotate
    exported_at = (root / "annotate" / "tasks.json").stat().st_mtime_ns

    # The annotators' work arrives; the chain resumes at ingest.
    tasks[0].update(id=1, annotations=[{"id": 1, "completed_by": 1, "result": [brush("new", "post", rect(0, 9, 0, 9))]}])
    export.write_text(json.dumps(tasks))
    second = chain(config)     # one pair of eight decided: the chain ingests and waits for the rest
    assert second.returncode == 3, second.stdout[-2000:] + second.stderr[-2000:]
    assert "finished earlier" in second.stderr and "waiting for annotators: 1 of " in second.stdout
    assert (root / "annotate" / "tasks.json").stat().st_mtime_ns == exported_at     # not exported again
    assert (ds / "label" / f"{tasks[0]['data']['pair_id']}.png").exists()
    assert not (root / "report").exists()
    # --partial: the report runs on what is decided; ingest is not run again (its export is unchanged).
    third = chain(config, "--partial")
    assert third.returncode == 0 and "ran 1 step(s)" in third.stdout, third.stdout[-2000:] + third.stderr[-2000:]
    assert (root / "report" / "index.html").exists()
    # Nothing left to do: a fourth run runs nothing.
    fourth = chain(config, "--partial")
    assert fourth.returncode == 0 and "ran 0 step(s)" in fourth.stdout


def test_unknown_options_are_refused_before_anything_runs(tmp_path, capsys):
    # In-process (main as the command runs it): a traceback would be an exception here, not exit 2.
    # The chain as a process of its own is the slow test above (and test_chain_docs' chain without people).
    from jobs import chain as chain_job
    config = tmp_path / "chain.yaml"
    config.write_text(f"output: {tmp_path / 'run'}\nsteps:\n  - caption: {{modle: x}}\n")
    with pytest.raises(SystemExit) as exc:          # argparse's error: exit 2, its line on stderr
        chain_job.main(["--config", str(config)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown option 'modle'" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "chain_state.json").exists()
