"""The chain files of docs/chain.md, parsed out of the page and run as written through ``changeforge
chain``: the one without people end to end (LEVIR-CD crops -> captions, QA, validate, report, caption
scores, a release) against the OpenAI-compatible test server, and the full loop's as a dry run."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "chain.md"
DOC_URL = "http://127.0.0.1:8011/v1"      # what the page tells the reader to start


def chain_file(name: str) -> str:
    """The ```yaml block of docs/chain.md whose first line is ``# <name>``."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    found = [b for b in blocks if b.startswith(f"# {name}\n")]
    assert len(found) == 1, f"docs/chain.md has {len(found)} chain file(s) named {name}"
    return found[0]


def run_chain(cwd: Path, config: Path, *extra, env=None):
    return subprocess.run([sys.executable, "-m", "jobs.cli", "chain", "--config", str(config), *extra], cwd=cwd,
                          env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=900)


def workdir(tmp_path: Path) -> Path:
    """A working directory holding the repository's data/ as the page's relative paths expect."""
    (tmp_path / "data").symlink_to(REPO / "data")
    return tmp_path


@pytest.mark.slow          # six steps, each its own process; captions and QA start a Ray each
@pytest.mark.timeout(900)
def test_the_chain_without_people_runs_as_written(tmp_path, openai_test_server_process, ray_session):
    server = openai_test_server_process
    server.configure(latency_ms=0, reject_json_schema=False, faults=[])
    text = chain_file("chain-levir.yaml")
    assert DOC_URL in text and "python -m tests.openai_test_server --port 8011" in DOC.read_text()
    cwd = workdir(tmp_path)
    config = cwd / "chain-levir.yaml"
    config.write_text(text.replace(DOC_URL, server.base_url))   # the session's server, not the page's port
    # The steps attach to the session's Ray (RAY_ADDRESS, as on a cluster): on a loaded machine a local
    # Ray started by each step can miss Ray's fixed 30 s node start-up limit.
    ray_address = ray_session.address_info["gcs_address"]
    env = {**os.environ, "OPENAI_API_KEY": "test-key", "RAY_ADDRESS": ray_address}
    out = run_chain(cwd, config, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    root = cwd / yaml.safe_load(text)["output"]
    steps = [s for step in yaml.safe_load(text)["steps"] for s in step]
    assert f"ran {len(steps)} step(s); done" in out.stdout
    state = json.loads((root / "chain_state.json").read_text())
    assert [(s["step"], s["status"]) for s in state["steps"]] == [(s, "finished") for s in steps]
    cc = json.loads((root / "captions" / "LevirCCcaptions.json").read_text())
    vqa = json.loads((root / "qa" / "VQA.json").read_text())
    assert cc["images"] and vqa["images"]
    assert (root / "report" / "index.html").exists() and (root / "validate").is_dir()
    metrics = json.loads((root / "score-captions" / "metrics.json").read_text())
    assert metrics["n_images"] > 0
    release = root / "releases" / "1.0.0"
    assert (release / "SHA256SUMS").exists() and list(release.glob("*/captions.json"))
    inputs = json.loads((release / "release.json").read_text())["inputs"]
    # named relative to the release's inputs: no absolute path of the building machine in a release
    assert inputs["captions"]["uri"] == "captions" and inputs["qa"]["uri"] == "qa"
    card = (release / "README.md").read_text()
    assert "as given with the input" in card          # no annotation summary: no figures made up
    # A second run has nothing to do.
    again = run_chain(cwd, config, env=env)
    assert again.returncode == 0 and "ran 0 step(s)" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    # --explain, as the page shows it: every step current, the pairs counted
    explained = run_chain(cwd, config, "--explain", env=env)
    assert explained.returncode == 0, explained.stdout[-2000:] + explained.stderr[-2000:]
    assert ("explain: step 1 caption: current (finished earlier); pairs: 11 current, 0 stale, 0 missing, 1 failed"
            in explained.stdout), explained.stdout[-3000:]
    # docs/lineage.md's verify command, as written, from the page's working directory
    command = re.search(r"^(changeforge publish --verify .+)$", (REPO / "docs" / "lineage.md").read_text(), re.M)
    verified = subprocess.run([sys.executable, "-m", "jobs.cli", *command.group(1).split()[1:]], cwd=cwd,
                              env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "sources checked for 11 pairs" in verified.stdout


def test_the_full_loop_chain_file_checks_out_in_a_dry_run(tmp_path, monkeypatch, capsys):
    """Through the changeforge command's main, in this process (a process of its own spent seconds
    importing every job; the chain without people above runs the command itself): a traceback would
    be an exception here."""
    from jobs import cli as changeforge
    from operators.io import cli

    monkeypatch.setattr(cli, "PROG", cli.PROG)   # main names the command there; restored afterwards
    # The file is under test, not this machine: the Label Studio SDK's interpreter is given (in a fresh
    # HOME the quick loop runs before any test installs it; a missing SDK has a test of its own).
    monkeypatch.setenv("LABEL_STUDIO_PYTHON", sys.executable)
    text = chain_file("chain-people.yaml")
    cwd = workdir(tmp_path)
    config = cwd / "chain-people.yaml"
    config.write_text(text)
    monkeypatch.chdir(cwd)                        # the page's relative paths, as a reader runs it
    assert changeforge.main(["chain", "--config", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    steps = [s for step in yaml.safe_load(text)["steps"] for s in step]
    printed = re.findall(r"\[chain\] step \d+/\d+ (.+?) \(", out)
    assert printed == steps
    assert "needs --" not in out                  # every required option is given or wired
    root = cwd / "out" / "chain-naip"
    assert f"--input {root / 'pairs'}" in out and f"--output {root / 'releases'}" in out
    # the expert's review queue has a folder of its own; each ingest reads the tasks its export sent
    assert f"--queue review --label-studio-url http://localhost:8080 --input {root / 'pairs'} --output " \
           f"{root / 'annotate-review'}" in out
    ingests = re.findall(r"annotate ingest .*? --tasks (\S+)", out)
    assert ingests == [str(root / "annotate" / "tasks.json"), str(root / "annotate-review" / "tasks.json")]
    assert out.rstrip().splitlines()[-1] == "[chain] dry run: nothing ran; no problems found"
    assert not root.exists()                      # a dry run writes nothing
