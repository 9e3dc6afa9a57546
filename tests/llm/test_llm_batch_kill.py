"""One submission per line with a real kill: the batch driver runs in a process of its own
(tests/llm/batch_driver_process.py) against the test server, is SIGKILLed at each step of a submission,
then run again to the end; the server counts each line submitted exactly once and every request answered.

The test knows where the driver is from the wire, not from a sleep: the driver talks to the test server
through a gate (a forwarding proxy in this process) that holds the n-th call of one endpoint, either on
arrival (the server never saw it) or after the server answered it (the answer never reaches the driver),
and says so; the driver is killed while that call hangs. The steps, in the order a submission takes them:

- ``before upload``: the lines' keys recorded (``pending/``), the file not at the provider;
- ``after upload``: the file at the provider, its id not recorded by the driver;
- ``before create``: the file id recorded, ``POST /batches`` not received;
- ``after create``: the batch created at the provider, its id never written (the answer lost with the driver);
- ``while polling``: every batch recorded, the driver waiting for them.

With three files (5 lines, 2 a file), the second call of an endpoint is a kill with one batch of the
run already recorded and the next one half done."""
from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
N, PER_FILE = 5, 2

STEPS = {   # step: (method, path, phase)
    "before upload": ("POST", r"/v1/files", "arrival"),
    "after upload": ("POST", r"/v1/files", "answered"),
    "before create": ("POST", r"/v1/batches", "arrival"),
    "after create": ("POST", r"/v1/batches", "answered"),
    "while polling": ("GET", r"/v1/batches/batch_[^/]+", "arrival"),
}
CASES = [(step, at) for step in STEPS for at in (1, 2) if not (step == "while polling" and at == 2)]

pytestmark = pytest.mark.slow      # nine kills and nine reruns, each a Python process of its own: over 20 s


class Gate:
    """A forwarding proxy to the test server that holds the ``at``-th ``method`` call whose path matches
    ``path``: on ``arrival`` (not forwarded) or once ``answered`` by the server (the answer kept back).
    ``held`` is set when it holds one; the held call hangs until ``close``."""

    def __init__(self, target: str, method: str, path: str, phase: str, at: int):
        self.target, self.method, self.path, self.phase, self.at = target.rstrip("/"), method, path, phase, at
        self.seen = 0
        self.held = threading.Event()
        self.released = threading.Event()
        self.lock = threading.Lock()
        gate = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                gate.handle(self)
            do_GET = do_POST = do_DELETE = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0)) or None
        with self.lock:
            mine = h.command == self.method and re.fullmatch(self.path, h.path.split("?")[0]) is not None
            self.seen += mine
            hold = mine and self.seen == self.at
        if hold and self.phase == "arrival":
            self._hold(h)
            return
        headers = {k: v for k, v in h.headers.items() if k.lower() in ("authorization", "content-type")}
        req = urllib.request.Request(self.target + h.path[len("/v1"):], data=body, method=h.command, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status, content, ctype = resp.status, resp.read(), resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            status, content, ctype = exc.code, exc.read(), exc.headers.get("Content-Type", "")
        if hold:
            self._hold(h)
            return
        h.send_response(status)
        h.send_header("Content-Type", ctype or "application/json")
        h.send_header("Content-Length", str(len(content)))
        h.end_headers()
        h.wfile.write(content)

    def _hold(self, h) -> None:
        self.held.set()
        self.released.wait()
        h.close_connection = True

    def open(self) -> None:
        """Hold nothing more (the call held is let go: its connection closes unanswered)."""
        with self.lock:
            self.at = 0
        self.released.set()

    def close(self) -> None:
        self.open()
        self.server.shutdown()
        self.server.server_close()


def driver(base_url: str, root: Path, run_id: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.llm.batch_driver_process", "--base-url", base_url, "--root", str(root),
           "--run-id", run_id, "--requests", str(N), "--per-file", str(PER_FILE)]
    tmp = root.parent / "tmp"       # the driver's batch files: a killed one's are looked for here
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)}
    with open(log, "wb") as out:     # the child has its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_held(gate: Gate, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    """Until the gate holds its call (the driver is then stopped at that step), or fail if the driver ended."""
    waited = 0.0
    while not gate.held.wait(0.5):
        waited += 0.5
        assert proc.poll() is None, f"the driver ended ({proc.returncode}) before the step: " + \
            log.read_text(errors="replace")[-3000:]
        assert waited < timeout_s, f"the gate held nothing within {timeout_s} s (saw {gate.seen})"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("step,at", CASES, ids=[f"{s}-{a}" for s, a in CASES])
def test_a_driver_sigkilled_at_any_step_of_a_submission_submits_each_line_once(openai_server, tmp_path, step, at):
    root = tmp_path / "out"
    gate = Gate(openai_server.base_url, *STEPS[step], at)
    try:
        killed = driver(gate.base_url, root, "run1", tmp_path / "killed.log")
        try:
            wait_held(gate, killed, tmp_path / "killed.log")
        finally:
            killed.send_signal(signal.SIGKILL)
            killed.wait(timeout=60)
        assert killed.returncode == -signal.SIGKILL
        left = list((tmp_path / "tmp").glob("changeforge-batch-*"))
        if step in ("before upload", "after upload"):     # killed while its file was being sent
            assert left, "the killed driver left no batch file: the sweep below is not tested"
        before = openai_server.stats()
        assert set(before["batch_submissions"].values()) <= {1}, before["batch_submissions"]
        # The rerun: a new process, through the same endpoint (a request's key names it), nothing held.
        gate.open()
        rerun = driver(gate.base_url, root, "run2", tmp_path / "rerun.log")
        assert rerun.wait(timeout=240) == 0, (tmp_path / "rerun.log").read_text(errors="replace")[-3000:]
    finally:
        gate.close()
    last = json.loads((tmp_path / "rerun.log").read_text().strip().splitlines()[-1])
    stats = openai_server.stats()
    assert last["ok"] == N                                                        # every request answered
    assert len(stats["batch_submissions"]) == N and set(stats["batch_submissions"].values()) == {1}, \
        stats["batch_submissions"]                                               # each line submitted once
    assert stats["total"] == 0                                                    # nothing in real time
    assert stats["batches_created"] == -(-N // PER_FILE)                          # no batch made twice
    assert not list((root / "_batch" / "t" / "pending").glob("*.json"))           # no submission left begun
    # Every file deleted at the provider once its results were stored, but one: the file a kill "after
    # upload" leaves there, its id never learnt (not paid for; a provider keeps it until it is deleted).
    assert stats["files_stored"] == (1 if step == "after upload" else 0)
    # The batch file the killed driver was filling, on its local disk, was removed by the rerun.
    assert not list((tmp_path / "tmp").glob("changeforge-batch-*")), list((tmp_path / "tmp").iterdir())
