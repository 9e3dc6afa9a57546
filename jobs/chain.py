"""The chain: the jobs in order on one output root, each reading the previous one's output, from one file.

    python -m jobs.chain --config chain.yaml [--from-step caption] [--dry-run] [--partial]

``chain.yaml``::

    output: out/demo                      # the root: every step writes a folder under it
    steps:
      - pairs: {input: data/naip, preset: demo}
      - annotate export: {prelabel: cva, label-studio-url: http://localhost:8080, annotations-per-task: 2}
      - annotate ingest: {export: http://localhost:8080, project-id: 1}
      - caption: {model: gpt-4.1-mini}
      - qa: {model: gpt-4.1-mini}
      - validate: {}
      - report: {}
      - publish: {name: demo, version: 1.0.0, licence: CC0-1.0}

A step is a job of ``changeforge`` (with its command where it has one) and its options, named as on
its command line (``no-x: true`` is ``--no-x``). Inputs and outputs a step does not name are wired on
the root (see :data:`WIRING`). Before anything runs, every step's options are checked against its
parser, and an option a step requires that is neither given nor wired, or an optional part it needs
that is not installed, is named (``--dry-run`` lists them all). Each step runs as its own process;
``<root>/chain_state.json`` records the finished ones with their command lines and, for the human
steps (annotate ingest, review ingest), a fingerprint of their input (operators.chain.people). A rerun
skips a finished step whose command line and input are unchanged and, for caption, qa, validate, report
and score, whose items are all current by lineage (a redrawn mask re-runs them: operators.io.lineage),
and runs every step after one that ran again. ``--explain`` says what each step would do, and why, without running. After
annotate ingest the chain reads the dataset's ``annotation_summary.json``: while pairs are undecided it
goes on only through the annotation loop's own steps (an export, e.g. the expert's review queue, and the
ingest of its answers: operators.chain.people) and stops before the first other step with exit status 3
("waiting for annotators"), unless ``--partial``. ``--dry-run`` and ``--explain`` exit 2 when they found
a missing option or optional part.
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

from operators.chain import needs, people, plan
from operators.chain import options as options_
from operators.io import cli, lineage, validation
from operators.io.storage import Store

log = logging.getLogger("changeforge.chain")
STATE_FILE = "chain_state.json"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAITING = 3   # exit status: the chain stopped at a human step whose people have not decided every pair


def _prelabel_folder(root: Store, earlier: list, options: dict) -> str:
    """The proposal masks annotate export wrote (``annotate/prelabels/<method>/``), for score change."""
    methods = sorted({rel.split("/")[2] for rel in root.list("annotate/prelabels", suffixes=(".png",))
                      if rel.count("/") >= 3})
    return root.uri(f"annotate/prelabels/{methods[0]}") if methods else root.uri("annotate/prelabels")


def _outputs(earlier: list) -> set[str]:
    return {WIRING[s]["output"] for s, _ in earlier if isinstance(WIRING.get(s, {}).get("output"), str)}


def _report_inputs(root: Store, earlier: list, options: dict) -> list[str]:
    """The outputs of the chain's earlier pairs, caption, QA and review steps."""
    made = _outputs(earlier)
    return [root.uri(d) for d in ("pairs", "captions", "qa", "review") if d in made]


def _dataset(root: Store, earlier: list, options: dict) -> str:
    """The chain's dataset: what its earlier annotate or caption step names as input, else ``<root>/pairs``."""
    for step, given in earlier:
        if step in ("annotate export", "annotate ingest", "caption") and given.get("input"):
            return str(given["input"])
    return root.uri("pairs")


def _made(rel: str, by: str):
    """``<root>/<rel>`` when an earlier step wrote the output folder ``by``, else not wired."""
    return lambda root, earlier, options: root.uri(rel) if by in _outputs(earlier) else None


def _option(options: dict, key: str):
    """A step's option as the chain file names it (``queue``, ``--queue``), or None."""
    return next((v for k, v in options.items() if str(k).lstrip("-").replace("_", "-") == key), None)


def _export_folder(root: Store, earlier: list, options: dict) -> str:
    """Where an annotate export writes: its ``output``, else ``<root>/annotate``, and for the expert's
    review queue ``<root>/annotate-review``; a later export to the same queue writes
    ``<root>/annotate-<its step number>`` (``annotate-review-<n>``), so no export's tasks.json replaces
    another's that an ingest reads."""
    given = _option(options, "output")
    if given:
        return str(given)
    review = str(_option(options, "queue") or "") == "review"
    base = "annotate-review" if review else "annotate"
    before = [o for s, o in earlier if s == "annotate export" and not _option(o, "output")
              and (str(_option(o, "queue") or "") == "review") == review]
    return root.uri(f"{base}-{len(earlier) + 1}" if before else base)


def _export_tasks(root: Store, earlier: list, options: dict) -> str | None:
    """The ``tasks.json`` of the chain's nearest earlier annotate export (the work this ingest takes
    back); not wired when the chain has no export step before it."""
    for i in range(len(earlier) - 1, -1, -1):
        if earlier[i][0] == "annotate export":
            return _export_folder(root, earlier[:i], earlier[i][1]).rstrip("/") + "/tasks.json"
    return None


# step -> {option: value on the root}; a callable (root, [(earlier step, its options)], the step's own
# options) is evaluated when the step is about to run, and wires nothing when it returns None.
WIRING = {
    "pairs": {"output": "pairs"},
    "annotate export": {"input": "pairs", "output": _export_folder},
    "annotate ingest": {"input": "pairs", "tasks": _export_tasks},
    "caption": {"input": "pairs", "output": "captions"},
    "qa": {"input": "captions", "output": "qa"},
    "validate": {"input": "qa/VQA.json", "output": "validate"},
    "review export": {"input": "captions", "output": "review"},
    "review ingest": {"output": "review"},
    "report": {"input": _report_inputs, "output": "report"},
    "score change": {"pred": _prelabel_folder, "masks": "pairs/label", "output": "score"},
    "score captions": {"refs": _made("captions/LevirCCcaptions.json", "captions"), "output": "score-captions"},
    "score qa": {"refs": _made("qa/VQA.json", "qa"), "output": "score-qa"},
    "publish": {"input": _dataset, "captions": _made("captions", "captions"), "qa": _made("qa", "qa"),
                "review": _made("review", "review"), "output": "releases"},
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
        if options is not None and not isinstance(options, dict):
            raise SystemExit(f"{path}: step {i + 1} ({name}): options must be a mapping, not {options!r}")
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


def step_values(root: Store, step: str, options: dict, earlier: list = ()) -> tuple[str, list[str], argparse.ArgumentParser, dict]:
    """(module, command, parser, {option: value}) of a step: its options, booleans as written, and the
    wiring for those it does not give (``earlier``: the chain's steps before it, with their options)."""
    module, command, parser = _parser_for(step)
    values = options_.normalise_booleans(parser, options, f"step {step!r}")
    given = {str(k).lstrip("-").replace("_", "-") for k in values}
    for key, default in WIRING.get(step, {}).items():
        if key.replace("_", "-") not in given:
            value = default(root, list(earlier), options) if callable(default) else root.uri(default)
            if value is not None:
                values[key] = value
    return module, command, parser, {str(k).lstrip("-").replace("_", "-"): v for k, v in values.items()}


def step_argv(root: Store, step: str, options: dict, earlier: list = ()) -> list[str]:
    """The step's command line (see :func:`step_values`)."""
    module, command, parser, values = step_values(root, step, options, earlier)
    return ["-m", module, *command, *_tokens(parser, step, values)]


def _tokens(parser, step: str, values: dict) -> list[str]:
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    tokens = []
    for key, value in values.items():
        action = by_flag.get("--" + key)
        if action is not None and action.nargs in ("+", "*") and isinstance(value, (list, tuple)):
            tokens += [action.option_strings[0], *map(str, value)]
        else:
            tokens += cli._option_tokens(parser, {key: value}, f"step {step!r}")
    return tokens


def check(root: Store, steps: list[tuple[str, dict]]) -> list[str]:
    """Every problem found before anything runs, one line each: a required option neither given nor wired,
    an optional part (extra, Label Studio SDK) a step needs but is not installed. Unknown options and bad
    values stop at once (the step's parser says which)."""
    problems = []
    for i, (step, options) in enumerate(steps):
        module, command, parser, values = step_values(root, step, options, steps[:i])
        for flag in options_.missing_required(parser, _tokens(parser, step, values)):
            problems.append(f"step {i + 1} {step!r} needs {flag}: give it in the chain file "
                            f"({step}: {{{flag[2:]}: ...}}); the chain does not wire it")
        problems += [f"step {i + 1} {line[5:]}" for line in needs.missing(step, values)]
    return problems


def _load_state(root: Store) -> dict:
    try:
        return json.loads(root.read_bytes(STATE_FILE)) if root.exists(STATE_FILE) else {"steps": []}
    except (OSError, ValueError):
        return {"steps": []}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run(config: str, from_step: str = "", dry_run: bool = False, partial: bool = False, explain: bool = False) -> dict:
    root_uri, steps = load_chain(config)
    from jobs.cli import JOBS
    # before any step: jobs, options and values here; the required options below (all of them at once)
    validation.check_chain(config, steps, _parser_for, WIRING, [j for j in JOBS if j != "chain"], required=False)
    root = Store(root_uri)
    names = [s for s, _ in steps]
    if from_step and from_step not in names:
        raise SystemExit(f"chain: --from-step {from_step!r} is not a step ({', '.join(names)})")
    dry_run = dry_run or explain           # --explain runs nothing either
    problems = check(root, steps)          # every step's options and needs, before anything runs
    if problems and not dry_run:
        raise SystemExit(f"changeforge chain: {config}: nothing ran; " + "; ".join(problems))
    for line in problems:
        print(f"[chain] dry run: {line}", flush=True)
    state = _load_state(root)
    done = {(s["index"], s["step"]): s for s in state["steps"] if s.get("status") == "finished"}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    record, stale, ran = [], False, []

    def save() -> None:
        root.write_bytes(STATE_FILE, json.dumps({"config": os.path.abspath(config), "steps": record}, indent=1).encode())

    # After an annotate ingest: how far the people are (None before the first) and, while pairs are
    # undecided without --partial, the line the chain waits with once the annotation loop's steps are done.
    progress, waiting = None, None

    def wait(line: str, advice: str) -> dict:
        save()
        print(f"[chain] {line}; {advice}", flush=True)
        return {"ran": ran, "failed": None, "waiting": line, "returncode": WAITING}

    for i, (step, options) in enumerate(steps):
        if waiting and not people.runs_while_waiting(step):
            return wait(waiting, f"step {i + 1} {step} and the later steps run when every pair is decided: run "
                                 "the chain again when more work is exported (an ingest re-runs when its input "
                                 "changes), or with --partial to go on with the decided pairs")
        if step == from_step:
            stale = True
        # read now: earlier steps' outputs exist
        module, command, parser, values = step_values(root, step, options, steps[:i])
        argv = ["-m", module, *command, *_tokens(parser, step, values)]
        human = people.HUMAN_STEPS.get(step)
        fp = None
        if human and values.get(human) and not (dry_run and people.is_server(values[human])):
            try:
                fp = people.fingerprint(str(values[human]), values.get("project-id"))
            except Exception as exc:  # noqa: BLE001 - the server's error, one line (never a key)
                print(f"[chain] step {i + 1} {step}: cannot read its input {values[human]}: {exc}", flush=True)
                return {"ran": ran, "failed": step, "returncode": 1}
        if fp == people.MISSING and not dry_run:     # the people's export has not arrived yet
            if step == "annotate ingest" and not people.waits_for_export(progress):
                print(f"[chain] step {i + 1} {step}: no export at {values[human]}, and every pair is decided: "
                      "nothing to wait for, skipped", flush=True)
                continue
            line = f"waiting for {'annotators' if step.startswith('annotate') else 'reviewers'}: no export at {values[human]} yet"
            return wait(line, "save the project's JSON export there and run the chain again")
        go, why = plan.must_run(done.get((i, step)), argv, fp, stale)
        # Caption and QA resume by lineage: a finished step runs again when its pairs' inputs changed
        # (read only when the step would otherwise be skipped, or to explain).
        data = _data_status(module, command, parser, step, values, explain) if (explain or not go) else None
        if data is not None:
            go, why = plan.must_run(done.get((i, step)), argv, fp, stale, data)
        pairs_line = "" if data is None else "; pairs: " + (
            f"cannot tell ({data['error']})" if "error" in data else lineage.status_line(data))
        if explain:
            print(f"[chain] explain: step {i + 1} {step}: {'would run' if go else 'current'} ({why}){pairs_line}",
                  flush=True)
            stale = stale or go
            continue
        if not go:
            log.info("step %d %s: %s (%s), skipped", i + 1, step, why, done[(i, step)]["finished"])
            record.append(done[(i, step)])
        else:
            stale = True   # everything after a step that runs again reads its new output
            print(f"[chain] step {i + 1}/{len(steps)} {step} ({why}{pairs_line}): python {' '.join(argv)}", flush=True)
            if dry_run:
                continue
            entry = {"index": i, "step": step, "argv": argv, "started": _now(),
                     **({"fingerprint": fp} if fp is not None else {})}
            # Through the changeforge command: a missing extra is its one-line hint, not a traceback.
            job = next(j for j, (m, _) in _jobs().items() if m == module)
            proc = subprocess.run([sys.executable, "-m", "jobs.cli", job, *argv[2:]], env=env)
            entry.update(returncode=proc.returncode, finished=_now(),
                         status="finished" if proc.returncode == 0 else "failed")
            record.append(entry)
            ran.append(step)
            save()
            if proc.returncode != 0:
                print(f"[chain] step {i + 1} {step} failed (exit {proc.returncode}); fix it and run the chain again: "
                      "it resumes here", flush=True)
                return {"ran": ran, "failed": step, "returncode": proc.returncode}
        if step == "annotate ingest" and not dry_run:
            progress = people.progress(Store(str(values["input"])))
            line = people.waiting_line(progress) if progress else None
            waiting = line if not partial else None     # the latest ingest says how far the people are
            if line and partial:
                print(f"[chain] {line}; --partial: the later steps run on the {progress['decided']} decided pairs",
                      flush=True)
    if waiting:
        return wait(waiting, "run the chain again when more work is exported (an ingest re-runs when its input "
                             "changes), or with --partial to go on with the decided pairs")
    if not dry_run:
        save()
    elif problems:    # a dry run that found a missing option or part: the chain would not run
        return {"ran": ran, "failed": None, "problems": len(problems), "returncode": 2}
    return {"ran": ran, "failed": None, "returncode": 0}


def _data_status(module: str, command: list[str], parser, step: str, values: dict,
                 explain: bool = False) -> dict | None:
    """A step's items by lineage (current, stale by cause, missing, failed: the job's ``status``), for the
    steps whose job has one: caption, qa and validate (which resume by lineage), report and the score
    commands (recomputed whole when an item is stale or missing); publish and the review commands, whose
    counts only explain (``STATUS_TO_EXPLAIN``: a release is a version you ask for, a review people's
    work). None for the others. Reads only; an input that cannot be read is said, not fatal."""
    job = importlib.import_module(module)
    if not hasattr(job, "status") or (getattr(job, "STATUS_TO_EXPLAIN", False) and not explain):
        return None
    try:
        return job.status(job.parse_args([*command, *_tokens(parser, step, values)]))
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - an input that is not there yet: said, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"[:200], "needs_run": False}


def _jobs() -> dict:
    from jobs.cli import JOBS
    return JOBS


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jobs.chain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, metavar="CHAIN.yaml",
                    help="chain file: the output root and the steps with their options")
    ap.add_argument("--from-step", default="", help="run this step (a name as in the chain file) and every later one "
                                                    "again, even if finished")
    ap.add_argument("--dry-run", action=argparse.BooleanOptionalAction, default=False,
                    help="print the steps that would run with their command lines, and every option or optional "
                         "part a step needs but is not given or installed, without running anything (exit status 2 "
                         "when one is missing)")
    ap.add_argument("--explain", action=argparse.BooleanOptionalAction, default=False,
                    help="without running anything, say per step whether it would run and why, and for the caption, "
                         "QA, validate, review, report and score steps how many items are current, stale (and why: "
                         "mask, image, caption, QA, template, model, options, prediction, review), missing or failed; "
                         "for publish, the latest release's pairs against today's dataset")
    ap.add_argument("--partial", action=argparse.BooleanOptionalAction, default=False,
                    help="go on past an annotate ingest whose pairs are not all decided: the later steps run "
                         "on the decided pairs (without it only the annotation loop's exports and ingests run "
                         f"on, and the chain stops before the first other step with exit status {WAITING})")
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = build_parser()
    if cli.PROG:
        ap.prog = cli.PROG
    args = validation.make_strict(ap).parse_args(argv)
    try:
        s = run(args.config, args.from_step, args.dry_run, args.partial, args.explain)
    except SystemExit as exc:   # a wrong chain file or step: one line, nothing ran
        if isinstance(exc.code, int) or exc.code is None:
            raise
        print(exc.code, file=sys.stderr)
        return 2
    if args.dry_run or args.explain:
        found = s.get("problems", 0)
        print("[chain] dry run: nothing ran; " + (f"{found} problem(s) found (above): the chain would stop before "
                                                   "its first step" if found else "no problems found"))
        return s["returncode"]
    end = f"; stopped at {s['failed']}" if s["failed"] else "; waiting" if s.get("waiting") else "; done"
    print(f"[chain] ran {len(s['ran'])} step(s)" + end)
    return s["returncode"]


if __name__ == "__main__":
    from operators.process_exit import run as run_process    # this module may have its own run
    run_process(main)
