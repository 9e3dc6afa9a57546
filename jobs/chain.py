"""The chain: the jobs in order on one output root, each reading the previous one's output, from one file.

    python -m jobs.chain --config chain.yaml [--from-step caption] [--dry-run]

``chain.yaml``::

    output: out/demo                      # the root: every step writes a folder under it
    steps:
      - pairs: {input: data/naip, preset: demo}
      - annotate export: {prelabel: cva, label-studio-url: http://localhost:8080, annotations-per-task: 2}
      - annotate ingest: {export: http://localhost:8080, project-id: 1}
      - caption: {model: gpt-4o-mini}
      - qa: {model: gpt-4o-mini}
      - validate: {}
      - review export: {sample: 50}
      - report: {}
      - score change: {}

A step is a job of ``changeforge`` (with its command where it has one) and its options, named as on
its command line. Inputs and outputs a step does not name are wired on the root: ``pairs/``,
``annotate/``, ``captions/``, ``qa/``, ``validate/``, ``review/``, ``report/``, ``score/`` (see
:data:`WIRING`). Every step's options are checked against its parser before anything runs. Each step
runs as its own process; ``<root>/chain_state.json`` records the finished ones with their command
lines, so a rerun skips them and resumes at the first step that failed, did not run or changed (and
runs every step after a changed one again, as their inputs changed). The jobs resume inside a step.
"""
from __future__ import annotations

import os
import sys

if not __package__:  # run as `python jobs/chain.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import importlib
import json
import logging
import subprocess
import time

from operators.io import cli, validation
from operators.io.storage import Store

log = logging.getLogger("changeforge.chain")
STATE_FILE = "chain_state.json"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _prelabel_folder(root: Store, earlier: list[str]) -> str:
    """The proposal masks annotate export wrote (``annotate/prelabels/<method>/``), for score change."""
    methods = sorted({rel.split("/")[2] for rel in root.list("annotate/prelabels", suffixes=(".png",))
                      if rel.count("/") >= 3})
    return root.uri(f"annotate/prelabels/{methods[0]}") if methods else root.uri("annotate/prelabels")


def _report_inputs(root: Store, earlier: list[str]) -> list[str]:
    """The outputs of the chain's earlier pairs, caption, QA and review steps."""
    made = {WIRING[s]["output"] for s in earlier if isinstance(WIRING.get(s, {}).get("output"), str)}
    return [root.uri(d) for d in ("pairs", "captions", "qa", "review") if d in made]


# step -> {option: value on the root}; a callable (root, earlier step names) is evaluated when the step
# is about to run.
WIRING = {
    "pairs": {"output": "pairs"},
    "annotate export": {"input": "pairs", "output": "annotate"},
    "annotate ingest": {"input": "pairs", "tasks": "annotate/tasks.json"},
    "caption": {"input": "pairs", "output": "captions"},
    "qa": {"input": "captions", "output": "qa"},
    "validate": {"input": "qa/VQA.json", "output": "validate"},
    "review export": {"input": "captions", "output": "review"},
    "review ingest": {"output": "review"},
    "report": {"input": _report_inputs, "output": "report"},
    "score change": {"pred": _prelabel_folder, "masks": "pairs/label", "output": "score"},
    "score captions": {"output": "score-captions"},
    "score qa": {"output": "score-qa"},
}


def load_chain(path: str) -> tuple[str, list[tuple[str, dict]]]:
    """(output root, [(step, options)]) from a chain file; SystemExit on a malformed one."""
    values = cli._read_run_file(path)
    root, steps = values.get("output"), values.get("steps")
    if not root or not isinstance(steps, list) or not steps:
        raise SystemExit(f"{path}: needs 'output' (the root) and a list of 'steps'")
    out = []
    for i, step in enumerate(steps):
        if isinstance(step, str):
            step = {step: {}}
        if not isinstance(step, dict) or len(step) != 1:
            raise SystemExit(f"{path}: step {i + 1} must be one '<job> [command]: {{options}}' entry")
        (name, options), = step.items()
        out.append((" ".join(str(name).split()), dict(options or {})))
    return str(root), out


def _parser_for(step: str) -> tuple[str, list[str], argparse.ArgumentParser]:
    """(module, command tokens, the parser its options go to) of a step."""
    from jobs.cli import JOBS
    job, *command = step.split()
    if job not in JOBS or job == "chain":
        raise SystemExit(f"chain: unknown job {job!r} in step {step!r} (one of {', '.join(j for j in JOBS if j != 'chain')})")
    module = JOBS[job][0]
    parser = importlib.import_module(module).build_parser()
    target, at = cli._subparser_for(parser, command)
    if (at < 0) != (not command) or len(command) > 1:
        raise SystemExit(f"chain: step {step!r}: name the command of {job} ({', '.join(_commands(parser))})")
    cli._add_run_options(target, getattr(target, "presets", None) or getattr(parser, "presets", None))
    return module, command, target


def _commands(parser) -> list[str]:
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    return list(sub.choices) if sub else []


def step_argv(root: Store, step: str, options: dict, earlier: list[str] = ()) -> list[str]:
    """The step's command line: its options, and the wiring for those it does not give (``earlier``:
    the names of the chain's steps before it)."""
    module, command, parser = _parser_for(step)
    given = {str(k).lstrip("-").replace("_", "-") for k in options}
    values = dict(options)
    for key, default in WIRING.get(step, {}).items():
        if key.replace("_", "-") not in given:
            values[key] = default(root, list(earlier)) if callable(default) else root.uri(default)
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    tokens = []
    for key, value in values.items():
        action = by_flag.get("--" + str(key).lstrip("-").replace("_", "-"))
        if action is not None and action.nargs in ("+", "*") and isinstance(value, (list, tuple)):
            tokens += [action.option_strings[0], *map(str, value)]
        else:
            tokens += cli._option_tokens(parser, {key: value}, f"step {step!r}")
    return ["-m", module, *command, *tokens]


def _load_state(root: Store) -> dict:
    try:
        return json.loads(root.read_bytes(STATE_FILE)) if root.exists(STATE_FILE) else {"steps": []}
    except (OSError, ValueError):
        return {"steps": []}


def run(config: str, from_step: str = "", dry_run: bool = False) -> dict:
    root_uri, steps = load_chain(config)
    from jobs.cli import JOBS
    validation.check_chain(config, steps, _parser_for, WIRING, [j for j in JOBS if j != "chain"])  # before any step
    root = Store(root_uri)
    names = [s for s, _ in steps]
    if from_step and from_step not in names:
        raise SystemExit(f"chain: --from-step {from_step!r} is not a step ({', '.join(names)})")
    for i, (step, options) in enumerate(steps):       # every step's options checked before anything runs
        step_argv(root, step, options, names[:i])
    state = _load_state(root)
    done = {(s["index"], s["step"]): s for s in state["steps"] if s.get("status") == "finished"}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    record, stale, ran = [], False, []
    for i, (step, options) in enumerate(steps):
        if step == from_step:
            stale = True
        argv = step_argv(root, step, options, names[:i])   # read now: earlier steps' outputs exist
        prev = done.get((i, step))
        if prev and prev["argv"] == argv and not stale:
            log.info("step %d %s: finished earlier (%s), skipped", i + 1, step, prev["finished"])
            record.append(prev)
            continue
        stale = True   # everything after a step that runs again reads its new output
        print(f"[chain] step {i + 1}/{len(steps)} {step}: python {' '.join(argv)}", flush=True)
        if dry_run:
            continue
        entry = {"index": i, "step": step, "argv": argv, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        proc = subprocess.run([sys.executable, *argv], env=env)
        entry.update(returncode=proc.returncode, finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     status="finished" if proc.returncode == 0 else "failed")
        record.append(entry)
        ran.append(step)
        root.write_bytes(STATE_FILE, json.dumps({"config": os.path.abspath(config), "steps": record}, indent=1).encode())
        if proc.returncode != 0:
            print(f"[chain] step {i + 1} {step} failed (exit {proc.returncode}); fix it and run the chain again: "
                  "it resumes here", flush=True)
            return {"ran": ran, "failed": step, "returncode": proc.returncode}
    if not dry_run:
        root.write_bytes(STATE_FILE, json.dumps({"config": os.path.abspath(config), "steps": record}, indent=1).encode())
    return {"ran": ran, "failed": None, "returncode": 0}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jobs.chain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, metavar="CHAIN.yaml",
                    help="chain file: the output root and the steps with their options")
    ap.add_argument("--from-step", default="", help="run this step (a name as in the chain file) and every later one "
                                                    "again, even if finished")
    ap.add_argument("--dry-run", action=argparse.BooleanOptionalAction, default=False,
                    help="print the steps' command lines without running them")
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = build_parser()
    if cli.PROG:
        ap.prog = cli.PROG
    args = validation.make_strict(ap).parse_args(argv)
    s = run(args.config, args.from_step, args.dry_run)
    print(f"[chain] ran {len(s['ran'])} step(s)" + (f"; stopped at {s['failed']}" if s["failed"] else "; done"))
    return s["returncode"]


if __name__ == "__main__":
    sys.exit(main())
