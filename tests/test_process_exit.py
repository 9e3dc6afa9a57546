"""A job's process ends with its own exit code even when the interpreter's teardown would abort
(Arrow's thread pools: apache/arrow#34314), after its exit handlers ran and its output flushed."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A process whose teardown aborts, as Arrow's can: an object whose finaliser calls abort(), freed
# only when the interpreter clears the modules at exit.
SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    from operators.process_exit import run

    class AbortsAtTeardown:
        def __del__(self):
            os.abort()

    KEEP = AbortsAtTeardown()
    atexit.register(lambda: open(sys.argv[2], "w").write("exit handler ran"))

    def main():
        print("summary line", end="")      # buffered: no newline, stdout a pipe
        outcome = sys.argv[1]
        if outcome == "raise-message":
            sys.exit("refused: a message")
        if outcome == "raise-code":
            raise SystemExit(2)
        if outcome == "summary":
            return {"accepted": 3}
        return int(outcome)

    if sys.argv[3] == "plain":
        code = main()
        sys.exit(code)
    run(main)
""")


def _run(tmp_path, outcome, how="run"):
    marker = tmp_path / f"handler-{outcome}-{how}"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, outcome, str(marker), how], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    return proc, marker


@pytest.mark.parametrize("outcome,code", [("0", 0), ("3", 3), ("summary", 0), ("raise-code", 2),
                                          ("raise-message", 1)])
def test_the_job_exit_code_survives_a_teardown_that_aborts(tmp_path, outcome, code):
    proc, marker = _run(tmp_path, outcome)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "summary line"
    assert marker.read_text() == "exit handler ran"
    if outcome == "raise-message":
        assert proc.stderr.strip() == "refused: a message"


def test_without_it_the_same_process_aborts(tmp_path):
    # The control: the planted teardown does abort a plain exit, so the test above can fail.
    proc, marker = _run(tmp_path, "0", how="plain")
    assert proc.returncode == -6
    assert marker.read_text() == "exit handler ran"


def test_the_command_line_entry_exits_through_it(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "no-such-job"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown job 'no-such-job'" in proc.stderr
    import tomllib
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["changeforge"] == "jobs.cli:run"


def test_no_job_s_main_block_rebinds_a_name_of_its_module():
    # `from operators.process_exit import run` under `if __name__ == "__main__":` replaced the caption
    # job's own run() at module level, and main() then called the wrong one (every job run as a script
    # or by `ray job submit` failed).
    import ast
    for path in sorted((REPO / "jobs").glob("*.py")):
        tree = ast.parse(path.read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {a.asname or a.name for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                    for a in n.names}
        for node in tree.body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                bound = {a.asname or a.name for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))
                         for a in n.names}
                bound |= {t.id for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets
                          if isinstance(t, ast.Name)}
                assert not bound & defined, (path.name, bound & defined)
        if path.name not in ("__init__.py", "cli_reference.py"):
            assert "run_process(main)" in path.read_text(), path.name    # every job ends through it
