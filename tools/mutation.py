"""Mutation testing of the modules where a wrong line costs users the most, with their quick tests as
the oracle (cosmic-ray 8): does a test fail when a line of the code is wrong?

    python tools/mutation.py                          # every module of tools/mutation.toml, all mutants
    python tools/mutation.py --sample 40 --seed 35 --fail-on-survivor     # CI: a fixed sample
    python tools/mutation.py --module operators/scoring/confusion.py      # one module

For each module (``[[module]]`` in ``tools/mutation.toml``: its path and the quick tests that cover it,
or the name of an ``[oracle.<name>]`` holding the tests that modules split from one rule share)
cosmic-ray writes each mutant (an operator swapped, a constant changed, a condition negated, ...) into
a copy of the checkout and runs the tests against it: a failing run kills the mutant; a mutant the
tests pass is a survivor. Printed per module: killed / survived / timeouts / incompetent (mutants
that cannot run, e.g. a syntax the operator made), the score (killed / (killed + survived)), and each
survivor's line and change.

An equivalent mutant (one no test can kill because the program means the same, e.g. ``>`` for ``>=``
where both sides are never equal) is explained in a comment of the module's test file, which this tool
reads:

    # equivalent mutant: <operator name> on `<the source line, stripped>`: <why it cannot be killed>

and it is then counted apart, not as a survivor. Exit 1 with ``--fail-on-survivor`` if any survived,
or when a module's score is under ``--min-score``; exit 2 if a module's tests fail unmutated.

The checkout is copied (``operators``, ``jobs``, ``prompts``, ``tests``, ``benchmarks``, ``pyproject.toml``; ``data``
linked): cosmic-ray edits the files it mutates, and the working tree is never touched.
"""
from __future__ import annotations

import argparse
import ast
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "tools" / "mutation.toml"
COPIED = ("operators", "jobs", "prompts", "tests", "benchmarks", "pyproject.toml")   # benchmarks: test cases import its data
LINKED = ("data",)
EQUIVALENT = re.compile(r"#\s*equivalent mutant:\s*(\S+)\s+on\s+`(.+?)`\s*:\s*(.+)")


@dataclass
class Module:
    path: str
    tests: list[str]
    timeout_s: float = 240.0   # per test (pytest-timeout): generous, a loaded machine imports slowly
    only: list[str] = field(default_factory=list)   # mutate only these definitions (``f``, ``Class``, ``Class.m``)
    # The tests' marker expression: the quick loop's by default; a module whose rules only tests with
    # a server reach (the provider batch driver, against the local OpenAI-compatible test server)
    # names its own.
    marker: str = "quick"


@dataclass
class Outcome:
    module: str
    killed: int = 0
    survived: list[dict] = field(default_factory=list)
    equivalent: list[dict] = field(default_factory=list)
    timeouts: int = 0
    incompetent: int = 0
    skipped: int = 0
    seconds: float = 0.0

    @property
    def score(self) -> float | None:
        judged = self.killed + len(self.survived)
        return None if judged == 0 else self.killed / judged


def load_modules(path: Path = CONFIG) -> list[Module]:
    """The ``[[module]]`` entries. A module names its tests (and their marker) itself, or names an
    ``[oracle.<name>]`` table that holds them, shared by the modules one set of tests judges whole (a
    module split into parts); a module with both, or naming an oracle not declared, is refused."""
    doc = tomllib.loads(path.read_text())
    oracles = doc.get("oracle", {})
    out = []
    for m in doc["module"]:
        own = {k: m[k] for k in ("tests", "marker") if k in m}
        if "oracle" in m:
            if own:
                raise ValueError(f"{path}: {m['path']}: names oracle {m['oracle']!r} and its own {sorted(own)}")
            if m["oracle"] not in oracles:
                raise ValueError(f"{path}: {m['path']}: no [oracle.{m['oracle']}] declared")
            own = oracles[m["oracle"]]
        out.append(Module(path=m["path"], tests=list(own["tests"]), timeout_s=float(m.get("timeout_s", 240)),
                          only=list(m.get("only", ())), marker=str(own.get("marker", "quick"))))
    return out


def equivalents(tests: list[str], root: Path = REPO) -> dict[tuple[str, str], str]:
    """(operator, stripped source line) -> the reason, from the tests' ``# equivalent mutant:`` comments."""
    out = {}
    for t in tests:
        for line in (root / t).read_text().splitlines():
            found = EQUIVALENT.search(line)
            if found:
                out[(found[1], found[2].strip())] = found[3].strip()
    return out


def copy_checkout(dest: Path) -> None:
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest / name)
    for name in LINKED:
        if (REPO / name).exists():
            (dest / name).symlink_to(REPO / name)


def test_command(module: Module) -> str:
    # -x: the first failure kills the mutant; no cache kept between runs; no plugins a mutant run never uses.
    return " ".join([sys.executable, "-m", "pytest", "-x", "-q", "-m", shlex.quote(module.marker),
                     "-p", "no:cacheprovider",
                     "-n", "0", "-p", "no:random_order", "--timeout", str(int(module.timeout_s)),
                     *module.tests])


def write_config(work: Path, module: Module, timeout_s: float) -> Path:
    cfg = work / f"cr-{Path(module.path).stem}.toml"
    cfg.write_text(
        "[cosmic-ray]\n"
        f"module-path = {module.path!r}\n"
        f"timeout = {timeout_s}\n"
        "excluded-modules = []\n"
        f"test-command = {test_command(module)!r}\n"
        "[cosmic-ray.distributor]\n"
        "name = \"local\"\n")
    return cfg


def run(cmd: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (start, end) positions of the module's annotations, if it never evaluates them (``from
    __future__ import annotations``): a mutant there is equivalent by construction."""
    tree = ast.parse(source)
    lazy = any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and
               any(a.name == "annotations" for a in n.names) for n in tree.body)
    if not lazy:
        return []
    spans = []
    for node in ast.walk(tree):
        found = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            found.append(node.returns)
        if isinstance(node, ast.arg) and node.annotation is not None:
            found.append(node.annotation)
        if isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
        spans += [((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)) for a in found]
    return spans


def definition_spans(source: str, names: list[str]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (start, end) positions of the named top-level functions and classes (``Class.method`` for a
    method): the part of a module a ``only = [...]`` entry of the config puts under test."""
    tree = ast.parse(source)
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        found[f"{node.name}.{sub.name}"] = sub
    unknown = [n for n in names if n not in found]
    if unknown:
        raise SystemExit(f"only = {unknown}: no such definition")
    return [((found[n].lineno, 0), (found[n].end_lineno + 1, 0)) for n in names]


def sample_jobs(session: Path, source: str, n: int | None, seed: int, only: list[str] = (),
                lines: set[int] | None = None) -> tuple[int, int, int]:
    """Mark mutants inside never-evaluated annotations (and outside the ``only`` definitions, if any;
    off the ``lines`` given, if any) skipped, then keep ``n`` of the rest (a seeded draw; all if None)
    and mark the others skipped. Returns (kept, left out, eligible)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult
    spans = annotation_spans(source)
    wanted = definition_spans(source, list(only)) if only else None
    skipped = WorkResult(worker_outcome=WorkerOutcome.SKIPPED)

    def left_out(pos: tuple) -> bool:
        if any(a <= pos < b for a, b in spans) or (lines is not None and pos[0] not in lines):
            return True
        return wanted is not None and not any(a <= pos < b for a, b in wanted)

    with use_db(str(session), WorkDB.Mode.open) as db:
        # Ordered by what a mutant is (its job ids are random per init): the same seed, the same sample.
        items = sorted(db.work_items, key=lambda i: (tuple(i.mutations[0].start_pos), i.mutations[0].operator_name,
                                                     i.mutations[0].occurrence))
        inside = [i.job_id for i in items if left_out(tuple(i.mutations[0].start_pos))]
        jobs = [i.job_id for i in items if i.job_id not in set(inside)]
        # A seeded shuffle, then the first n: a smaller sample is a prefix of a larger one with the same
        # seed, so the mutants of CI's sample are among those of any longer run.
        random.Random(seed).shuffle(jobs)
        keep = set(jobs if n is None else jobs[:n])
        db.set_multiple_results(inside + [j for j in jobs if j not in keep], skipped)
        return len(keep), len(inside), len(jobs)


def collect(session: Path, module: Module, root: Path) -> Outcome:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome
    known = equivalents(module.tests, root)
    source = (root / module.path).read_text().splitlines()
    out = Outcome(module.path)
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                out.skipped += 1
                continue
            if result.worker_outcome == WorkerOutcome.ABNORMAL:
                out.timeouts += 1          # killed by cosmic-ray's timeout: the mutant hangs
                continue
            if result.test_outcome == TestOutcome.INCOMPETENT or result.worker_outcome == WorkerOutcome.EXCEPTION:
                out.incompetent += 1
                continue
            if result.test_outcome == TestOutcome.KILLED:
                out.killed += 1
                continue
            m = item.mutations[0]
            line = source[m.start_pos[0] - 1].strip()
            entry = {"line": m.start_pos[0], "operator": m.operator_name, "occurrence": m.occurrence,
                     "source": line, "diff": result.diff or ""}
            reason = known.get((m.operator_name, line))
            if reason:
                out.equivalent.append({**entry, "reason": reason})
            else:
                out.survived.append(entry)
    return out


def unmutated_seconds(module: Module, work: Path, env: dict, baselines: dict[str, float]) -> float:
    """The module's oracle run on the unmutated checkout, which must pass; its wall time. Run once per
    test command: modules judged by the same tests (screening's parts) share the run, since the
    checkout is the same unmutated tree between modules (cosmic-ray restores each mutant)."""
    command = test_command(module)
    if command not in baselines:
        t0 = time.time()
        base = run(shlex.split(command), work, env)
        if base.returncode != 0:
            raise SystemExit(f"{module.path}: its tests fail without a mutation (exit {base.returncode}):\n"
                             f"{base.stdout[-3000:]}\n{base.stderr[-2000:]}")
        baselines[command] = time.time() - t0
    return baselines[command]


def mutate(module: Module, work: Path, sample: int | None, seed: int, log=print,
           lines: set[int] | None = None, baselines: dict[str, float] | None = None) -> Outcome:
    env = {**os.environ, "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.time()
    baseline_s = unmutated_seconds(module, work, env, {} if baselines is None else baselines)
    timeout = max(module.timeout_s, 4 * baseline_s + 10)
    cfg = write_config(work, module, timeout)
    session = work / f"cr-{Path(module.path).stem}.sqlite"
    init = run([sys.executable, "-m", "cosmic_ray.cli", "init", str(cfg), str(session), "--force"], work, env)
    if init.returncode != 0:
        raise SystemExit(f"cosmic-ray init failed for {module.path}:\n{init.stderr[-3000:]}")
    kept, left, eligible = sample_jobs(session, (work / module.path).read_text(), sample, seed, module.only,
                                       lines)
    where = f" of {', '.join(module.only)}" if module.only else ""
    if lines is not None:
        where += f" on the {len(lines)} changed line(s)"
    log(f"[mutation] {module.path}: {kept} of {eligible} mutants{where} (seed {seed}; {left} more outside "
        f"those or in never-evaluated annotations), tests {baseline_s:.1f} s unmutated", flush=True)
    ex = run([sys.executable, "-m", "cosmic_ray.cli", "exec", str(cfg), str(session)], work, env)
    if ex.returncode != 0:
        raise SystemExit(f"cosmic-ray exec failed for {module.path}:\n{ex.stderr[-3000:]}")
    out = collect(session, module, work)
    out.seconds = time.time() - t0
    return out


def report(outcomes: list[Outcome], log=print) -> None:
    log(f"{'module':<48} {'killed':>6} {'survived':>8} {'equiv.':>6} {'timeout':>7} {'incomp.':>7} {'score':>6}")
    for o in outcomes:
        score = "-" if o.score is None else f"{100 * o.score:.0f} %"
        log(f"{o.module:<48} {o.killed:>6} {len(o.survived):>8} {len(o.equivalent):>6} {o.timeouts:>7} "
            f"{o.incompetent:>7} {score:>6}   ({o.seconds:.0f} s)")
    for o in outcomes:
        for s in o.survived:
            log(f"\nSURVIVED {o.module}:{s['line']} {s['operator']} (occurrence {s['occurrence']}): {s['source']}")
            log("\n".join("    " + d for d in s["diff"].splitlines() if d.startswith(("+", "-"))
                          and not d.startswith(("+++", "---"))))


def verdict(outcomes: list[Outcome], fail_on_survivor: bool, min_score: float, min_judged: float,
            none_ok: bool = False) -> tuple[int, list[str]]:
    """(exit status, lines) of a run. Judged mutants are the killed, survived and explained-equivalent ones;
    a run whose mutants mostly timed out or were incompetent judged nothing and fails (a harness that
    cannot run the tests must not pass as "no survivor"). With ``none_ok`` (mutants of changed lines
    only) a run that found no mutant to run passes: the change made none (comments, plumbing)."""
    killed = sum(o.killed for o in outcomes)
    survived = sum(len(o.survived) for o in outcomes)
    equivalent = sum(len(o.equivalent) for o in outcomes)
    unjudged = sum(o.timeouts + o.incompetent for o in outcomes)
    judged = killed + survived + equivalent
    ran = judged + unjudged
    lines = [f"[mutation] {ran} mutant(s) ran: {killed} killed, {survived} survived, {equivalent} equivalent, "
             f"{unjudged} not judged (timeouts, incompetent); kill rate "
             + (f"{killed / (killed + survived):.0%}" if killed + survived else "-")]
    code = 0
    if ran == 0 and none_ok:
        lines.append("[mutation] no mutant on the changed lines")
    elif ran == 0 or judged < min_judged * ran:
        lines.append(f"[mutation] only {judged} of {ran} mutants judged (at least {min_judged:.0%} required): "
                     "the tests could not run against them")
        code = 1
    if fail_on_survivor and survived:
        lines.append(f"[mutation] {survived} mutant(s) survived")
        code = 1
    low = [o.module for o in outcomes if o.score is not None and o.score < min_score]
    if low:
        lines.append(f"[mutation] score under {min_score:.0%}: {', '.join(low)}")
        code = 1
    return code, lines


def changed_lines(path: str, rev: str, root: Path = REPO) -> set[int]:
    """The lines of ``path`` (in the working tree) added or changed since ``rev``: the new side of
    ``git diff --unified=0``'s hunks."""
    got = subprocess.run(["git", "diff", "--unified=0", "--no-color", rev, "--", path], cwd=root,
                         capture_output=True, text=True)
    if got.returncode != 0:
        raise SystemExit(f"--changed-since {rev}: {got.stderr.strip().splitlines()[-1] if got.stderr.strip() else 'git diff failed'}"
                         " (a shallow clone has no parent commit: fetch it, e.g. git fetch --deepen 1)")
    lines: set[int] = set()
    for m in re.finditer(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", got.stdout, re.M):
        start, count = int(m.group(1)), int(m.group(2) or 1)
        lines.update(range(start, start + count))
    return lines


def commit_seed(root: Path = REPO) -> int:
    """A seed from the checkout's commit (``GITHUB_SHA``/``CI_COMMIT_SHA`` if set, else ``git rev-parse``):
    each commit draws its own sample, and the same commit draws the same one."""
    sha = os.environ.get("GITHUB_SHA") or os.environ.get("CI_COMMIT_SHA")
    if not sha:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    if not sha:
        raise SystemExit("--seed commit: no commit found (not a git checkout and no GITHUB_SHA / CI_COMMIT_SHA)")
    return int(sha[:8], 16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=CONFIG, help="the module list (default: tools/mutation.toml)")
    ap.add_argument("--module", action="append", default=[], help="only this module path (repeatable)")
    ap.add_argument("--sample", type=int, default=None, help="mutants per module, drawn with --seed (default: all)")
    ap.add_argument("--seed", default="35", help="an integer, or 'commit': a seed from the checkout's commit")
    ap.add_argument("--fail-on-survivor", action="store_true", help="exit 1 if any mutant survived")
    ap.add_argument("--min-score", type=float, default=0.0, help="exit 1 if a module's score is below (0-1)")
    ap.add_argument("--changed-since", metavar="REV", default=None,
                    help="only mutants on lines changed since this revision (e.g. HEAD~1: the commit's own "
                         "lines); modules with none are not run, and a run with none passes")
    ap.add_argument("--min-judged", type=float, default=0.5,
                    help="exit 1 if fewer than this share of the mutants run were judged (not timeouts or incompetent)")
    args = ap.parse_args(argv)
    args.seed = commit_seed() if args.seed == "commit" else int(args.seed)
    print(f"[mutation] seed {args.seed} (repeat this sample with --seed {args.seed})", flush=True)
    modules = load_modules(args.config)
    if args.module:
        unknown = set(args.module) - {m.path for m in modules}
        if unknown:
            ap.error(f"--module {sorted(unknown)[0]}: not in {args.config}")
        modules = [m for m in modules if m.path in args.module]
    lines: dict[str, set[int] | None] = {m.path: None for m in modules}
    if args.changed_since:
        lines = {m.path: changed_lines(m.path, args.changed_since) for m in modules}
        modules = [m for m in modules if lines[m.path]]
        print(f"[mutation] lines changed since {args.changed_since}: "
              + (", ".join(f"{m.path} ({len(lines[m.path])})" for m in modules) or "none in these modules"),
              flush=True)
        if not modules:
            return 0
    with tempfile.TemporaryDirectory(prefix="cf-mutation-") as tmp:
        work = Path(tmp)
        copy_checkout(work)
        baselines: dict[str, float] = {}
        outcomes = [mutate(m, work, args.sample, args.seed, lines=lines[m.path], baselines=baselines)
                    for m in modules]
    report(outcomes)
    code, out = verdict(outcomes, args.fail_on_survivor, args.min_score, args.min_judged,
                        none_ok=bool(args.changed_since))
    print("\n" + "\n".join(out), file=sys.stderr if code else sys.stdout, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
