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


def save_export(server, project_id: int, path: Path) -> None:
    """The team lead's Export -> JSON of one project, saved at ``path``."""
    from operators.labelstudio.client import call
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LABEL_STUDIO_API_KEY", server.token)
        path.write_text(json.dumps(call("export_json", url=server.url, project_id=project_id)))
