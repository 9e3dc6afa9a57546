"""tools/mutation.py's own logic: the definitions ``only`` selects, the equivalent-mutant comments it
reads, and a seeded sample that is the same over two cosmic-ray inits (whose job ids are random) and a
prefix of a larger one (CI's sample is the start of any longer run)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# tools/ is not a package: the tool loaded from its file, as `python tools/mutation.py` runs it.
_spec = importlib.util.spec_from_file_location("mutation_tool", REPO / "tools" / "mutation.py")
mutation = importlib.util.module_from_spec(_spec)
sys.modules["mutation_tool"] = mutation      # its dataclasses look their module up
_spec.loader.exec_module(mutation)

SOURCE = '''from __future__ import annotations


def f(x: int) -> int:
    return x + 1 if x > 0 else x - 1


class C:
    def m(self, a: int) -> bool:
        return a * 2 >= 3

    def n(self):
        return 5 - 4
'''


def test_only_selects_the_named_definitions_and_refuses_unknown_names():
    spans = mutation.definition_spans(SOURCE, ["f", "C.m"])
    assert spans == [((4, 0), (6, 0)), ((9, 0), (11, 0))]
    with pytest.raises(SystemExit, match=r"no such definition"):
        mutation.definition_spans(SOURCE, ["g"])
    assert len(mutation.annotation_spans(SOURCE)) == 4          # x: int, -> int, a: int, -> bool


def test_equivalent_comments_are_read_per_operator_and_line(tmp_path):
    t = tmp_path / "test_x.py"
    t.write_text("# equivalent mutant: core/NumberReplacer on `return 5 - 4`: why not\nx = 1\n")
    assert mutation.equivalents(["test_x.py"], tmp_path) == {("core/NumberReplacer", "return 5 - 4"): "why not"}


def test_every_listed_module_and_oracle_exists_and_only_names_real_definitions():
    for m in mutation.load_modules():
        assert (REPO / m.path).is_file(), m.path
        assert all((REPO / t).is_file() for t in m.tests), m.tests
        if m.only:
            mutation.definition_spans((REPO / m.path).read_text(), m.only)


def test_modules_share_an_oracle_by_name_and_a_wrong_name_is_refused(tmp_path):
    """Modules naming ``[oracle.<name>]`` get its tests and marker; their own ``only`` stays theirs. A
    module naming an oracle not declared, or both an oracle and tests of its own, is refused by path."""
    cfg = tmp_path / "m.toml"
    oracle = '[oracle.o]\ntests = ["t1.py", "t2.py"]\nmarker = "quick or seeds"\n'
    cfg.write_text('[[module]]\npath = "a.py"\noracle = "o"\nonly = ["f"]\n\n'
                   '[[module]]\npath = "b.py"\noracle = "o"\n\n'
                   '[[module]]\npath = "c.py"\ntests = ["t3.py"]\n\n' + oracle)
    a, b, c = mutation.load_modules(cfg)
    assert (a.tests, a.marker, a.only) == (["t1.py", "t2.py"], "quick or seeds", ["f"])
    assert (b.tests, b.marker, b.only) == (["t1.py", "t2.py"], "quick or seeds", [])
    assert (c.tests, c.marker) == (["t3.py"], "quick")
    cfg.write_text('[[module]]\npath = "a.py"\noracle = "p"\n\n' + oracle)
    with pytest.raises(ValueError, match=r"a\.py: no \[oracle\.p\] declared"):
        mutation.load_modules(cfg)
    cfg.write_text('[[module]]\npath = "a.py"\noracle = "o"\ntests = ["t3.py"]\n\n' + oracle)
    with pytest.raises(ValueError, match=r"a\.py: names oracle 'o' and its own \['tests'\]"):
        mutation.load_modules(cfg)


def _sample(tmp_path: Path, name: str, n: int | None, lines: set[int] | None = None) -> list[tuple]:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome
    work = tmp_path / name
    work.mkdir()
    (work / "mod.py").write_text(SOURCE)
    module = mutation.Module(path="mod.py", tests=["t.py"])
    cfg = mutation.write_config(work, module, 10)
    session = work / "s.sqlite"
    subprocess.run([sys.executable, "-m", "cosmic_ray.cli", "init", str(cfg), str(session), "--force"], cwd=work,
                   check=True, capture_output=True, timeout=240)
    mutation.sample_jobs(session, SOURCE, n, 35, lines=lines)
    with use_db(str(session), WorkDB.Mode.open) as db:
        skipped = {i.job_id for i, r in db.completed_work_items if r.worker_outcome == WorkerOutcome.SKIPPED}
        return sorted((tuple(i.mutations[0].start_pos), i.mutations[0].operator_name, i.mutations[0].occurrence)
                      for i in db.work_items if i.job_id not in skipped)


@pytest.mark.slow   # three cosmic-ray inits
def test_a_seeded_sample_is_the_same_over_two_inits_and_a_prefix_of_a_larger_one(tmp_path):
    a, b = _sample(tmp_path, "a", 3), _sample(tmp_path, "b", 3)
    assert len(a) == 3 and a == b
    larger = _sample(tmp_path, "c", 6)
    assert len(larger) == 6 and set(a) < set(larger)


@pytest.mark.slow   # a cosmic-ray init
def test_changed_lines_restrict_the_draw_to_mutants_on_them(tmp_path):
    on = _sample(tmp_path, "d", None, lines={5, 13})
    assert on and {pos[0] for pos, _, _ in on} == {5, 13}


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


def test_the_changed_lines_are_the_new_side_of_the_diff(tmp_path):
    _git(tmp_path, "init", "-q")
    lines = [f"x{i} = {i}" for i in range(1, 11)]
    (tmp_path / "m.py").write_text("\n".join(lines) + "\n")
    _git(tmp_path, "add", "m.py")
    _git(tmp_path, "commit", "-q", "-m", "one")
    lines[2] = "x3 = 30"                   # line 3 changed
    lines[6:8] = ["x7 = 70", "x8 = 80"]    # lines 7-8 changed
    del lines[4]                           # old line 5 deleted: nothing of the new side
    lines.append("x11 = 11")               # a line added at the end (now line 10)
    (tmp_path / "m.py").write_text("\n".join(lines) + "\n")
    assert mutation.changed_lines("m.py", "HEAD", tmp_path) == {3, 6, 7, 10}
    _git(tmp_path, "commit", "-q", "-am", "two")
    assert mutation.changed_lines("m.py", "HEAD", tmp_path) == set()          # nothing since the commit
    assert mutation.changed_lines("m.py", "HEAD~1", tmp_path) == {3, 6, 7, 10}
    with pytest.raises(SystemExit, match="--changed-since HEAD~5"):
        mutation.changed_lines("m.py", "HEAD~5", tmp_path)


def test_a_run_of_the_changed_lines_with_no_mutant_on_them_passes_and_a_survivor_fails():
    assert mutation.verdict([], True, 0, 0.5, none_ok=True)[0] == 0
    assert mutation.verdict([_outcome()], True, 0, 0.5, none_ok=True)[0] == 0
    assert mutation.verdict([_outcome(killed=1, survived=1)], True, 0, 0.5, none_ok=True)[0] == 1
    assert mutation.verdict([_outcome(timeouts=2)], True, 0, 0.5, none_ok=True)[0] == 1


def _outcome(killed=0, survived=0, equivalent=0, timeouts=0, incompetent=0, name="m.py"):
    return mutation.Outcome(name, killed=killed, survived=[{}] * survived, equivalent=[{}] * equivalent,
                            timeouts=timeouts, incompetent=incompetent)


def test_a_run_that_judged_most_of_its_mutants_passes_and_says_its_kill_rate():
    code, lines = mutation.verdict([_outcome(killed=3, equivalent=1), _outcome(killed=1, timeouts=1)], True, 0, 0.5)
    assert code == 0
    assert lines == ["[mutation] 6 mutant(s) ran: 4 killed, 0 survived, 1 equivalent, 1 not judged (timeouts, "
                     "incompetent); kill rate 100%"]


def test_a_planted_survivor_fails_the_run():
    code, lines = mutation.verdict([_outcome(killed=3), _outcome(killed=1, survived=1)], True, 0, 0.5)
    assert code == 1 and "[mutation] 1 mutant(s) survived" in lines and "kill rate 80%" in lines[0]
    assert mutation.verdict([_outcome(killed=1, survived=1)], False, 0, 0.5)[0] == 0   # reported, not gating


@pytest.mark.parametrize("unjudged", [dict(timeouts=4), dict(incompetent=4), dict(timeouts=2, incompetent=2)])
def test_a_run_whose_mutants_mostly_timed_out_or_were_incompetent_fails(unjudged):
    code, lines = mutation.verdict([_outcome(killed=1, **unjudged)], True, 0, 0.5)
    assert code == 1 and "only 1 of 5 mutants judged (at least 50% required)" in lines[-1]
    assert mutation.verdict([_outcome()], True, 0, 0.5)[0] == 1           # nothing ran at all: nothing judged
    # exactly half judged is enough
    assert mutation.verdict([_outcome(killed=2, timeouts=2)], True, 0, 0.5)[0] == 0


def test_the_commit_seed_is_the_commit_s_and_the_environment_s_when_given(monkeypatch):
    monkeypatch.setenv("GITHUB_SHA", "00000010" + "f" * 32)
    assert mutation.commit_seed() == 16
    monkeypatch.delenv("GITHUB_SHA")
    monkeypatch.delenv("CI_COMMIT_SHA", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    if head:
        assert mutation.commit_seed() == int(head[:8], 16)


def test_modules_judged_by_the_same_tests_run_them_unmutated_once(monkeypatch, tmp_path):
    # Screening's five modules share one oracle: its unmutated run (about 100 s) once, not five times;
    # another oracle runs its own, and an oracle that fails unmutated stops the run.
    ran = []

    def run(cmd, cwd, env):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 1 if "tests/b.py" in cmd else 0, "", "")
    monkeypatch.setattr(mutation, "run", run)
    shared = [mutation.Module(path=f"m{k}.py", tests=["tests/a.py"]) for k in range(3)]
    baselines = {}
    for m in shared:
        assert mutation.unmutated_seconds(m, tmp_path, {}, baselines) >= 0
    assert len(ran) == 1
    other = mutation.Module(path="m.py", tests=["tests/a.py"], marker="quick or seeds")
    mutation.unmutated_seconds(other, tmp_path, {}, baselines)
    assert len(ran) == 2
    with pytest.raises(SystemExit, match="its tests fail without a mutation"):
        mutation.unmutated_seconds(mutation.Module(path="n.py", tests=["tests/b.py"]), tmp_path, {}, baselines)
