"""What the chain tests do as a user would: run ``changeforge chain`` as a process, and save a Label
Studio project's JSON export where the chain file says (Export -> JSON in the UI)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def run_chain(config: Path, cwd: Path, env: dict, *extra: str, command: str = "chain") -> dict:
    """``changeforge <command> --config <config> [extra]`` in ``cwd``: its exit status and output."""
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", command, "--config", str(config), *extra], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=1200)
    return {"code": proc.returncode, "out": proc.stdout, "err": proc.stderr}


def changeforge_in_process(*argv: str, env: dict | None = None, cwd: Path | None = None) -> dict:
    """``changeforge <argv>`` through the command's main in this process, with ``env``'s variables set
    and ``cwd`` as the working directory for the call: its exit status and output. For commands that
    only read (``status``, ``publish --verify``, ``annotate status``), where the test is about what they
    say, not the process: a process of its own spent a second or more importing the pipeline."""
    import contextlib
    import io

    from jobs import cli as changeforge
    from operators.io import cli
    prog, out, err = cli.PROG, io.StringIO(), io.StringIO()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, value in (env or {}).items():
                mp.setenv(name, value)
            if cwd is not None:
                mp.chdir(cwd)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = changeforge.main(list(argv))
    finally:
        cli.PROG = prog     # main names the command there
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}


def save_export(server, project_id: int, path: Path) -> None:
    """The team lead's Export -> JSON of one project, saved at ``path``."""
    from operators.labelstudio.client import call
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LABEL_STUDIO_API_KEY", server.token)
        path.write_text(json.dumps(call("export_json", url=server.url, project_id=project_id)))
