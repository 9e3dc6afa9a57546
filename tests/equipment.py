"""Starting the tests' servers so that the one answering is the one we started.

A port chosen by bind-and-close can be taken by another process before our server binds it, and a
readiness check that accepts any listener then passes against the wrong server. So a server binds
port 0 itself and prints the port it got (``announce``); the starter reads it from the server's own
output (``start_announced``) and confirms, from the kernel's socket table, that the listener on that
port belongs to the process it started (``wait_for_port`` with ``proc``).
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

READY = "changeforge-test-server listening on 127.0.0.1:{port} pid={pid}"
READY_RE = re.compile(r"changeforge-test-server listening on 127\.0\.0\.1:(\d+) pid=(\d+)")


def listen_socket(host: str = "127.0.0.1", port: int = 0, backlog: int = 4096) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: a port the kernel picks, no race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


def announce(sock: socket.socket) -> None:
    """Print the line ``start_announced`` waits for (the socket is already listening)."""
    print(READY.format(port=sock.getsockname()[1], pid=os.getpid()), flush=True)


def free_port() -> int:
    """A port free a moment ago, for programs that cannot bind port 0 themselves (Ray, Label Studio);
    pair it with ``wait_for_port(port, proc=...)``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids(proc) -> set[int]:
    import psutil
    try:
        root = psutil.Process(proc.pid)
        return {proc.pid} | {c.pid for c in root.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def listener_pids(port: int) -> set[int]:
    """The processes listening on 127.0.0.1:``port`` (or on every address)."""
    import psutil
    return {c.pid for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
            and c.laddr.ip in ("127.0.0.1", "0.0.0.0", "::", "::1") and c.pid is not None}


def wait_for_port(port: int, timeout: float = 20.0, proc=None) -> None:
    """Until 127.0.0.1:``port`` accepts connections; with ``proc`` (a Popen), until it is ``proc`` (or a
    child of it) listening there: another process on that port is an error, not a ready server."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before listening on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                pass
        except OSError:
            time.sleep(0.1)
            continue
        if proc is None:
            return
        owners = listener_pids(port)
        if owners & _pids(proc):
            return
        if owners:
            raise RuntimeError(f"port {port} is served by pid {sorted(owners)}, not by the server we "
                               f"started (pid {proc.pid})")
        time.sleep(0.1)
    raise RuntimeError(f"nothing of ours listening on 127.0.0.1:{port} after {timeout}s")


def start_announced(cmd: list[str], timeout: float = 20.0, cwd: str | None = None,
                    pattern: re.Pattern = READY_RE, env: dict | None = None) -> tuple[subprocess.Popen, int, Path]:
    """Start ``cmd`` (a server that binds port 0 and reports its port on stdout or stderr, matching
    ``pattern``'s first group); returns the process, its port and its log file, once it is the
    process answering there."""
    log = Path(tempfile.mkstemp(prefix="cf-server-", suffix=".log")[1])
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)
    deadline = time.time() + timeout
    try:
        while True:
            found = pattern.search(log.read_text(errors="replace"))
            if found:
                port = int(found.group(1))
                wait_for_port(port, max(1.0, deadline - time.time()), proc=proc)
                return proc, port, log
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{cmd[:3]} did not report a port ({proc.poll()}):\n"
                                   + log.read_text(errors="replace")[-2000:])
            time.sleep(0.05)
    except BaseException:
        stop(proc)
        raise


def stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


# -- equipment that outlives the tests ---------------------------------------------------------------
# A test run stopped by SIGTERM or SIGKILL (a CI time limit, `timeout`, the OOM killer, a killed terminal)
# runs no fixture's teardown: every server and cluster it started kept running, re-parented to init, and
# the cluster's jobs kept working (seen: an interrupted cluster test left two raylets, a GCS, Ray's
# client server, the S3 server and the test server up, the machine at load average 31, and the next
# run's killed-driver test waited over four minutes for work that takes seconds). Three guards: servers that are one process die with their
# starter (``die_with_parent``); each test process has a watchdog for what carries its token
# (``guard_this_process``); a cluster, which ``ray start`` daemonizes, has one for its marks (``reaper``).

PR_SET_PDEATHSIG = 1
# Looked up here, in the parent: between fork and exec the child only calls it (loading a library there,
# with other threads' locks copied in whatever state they were, could hang).
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """``preexec_fn`` for a server the tests start: the kernel sends it SIGKILL when the thread that
    started it exits, with its process however that exits (Linux; elsewhere nothing). The tests start
    servers from their main thread. For servers that are one process; Ray's ``ray start`` daemonizes,
    so a cluster has a :func:`reaper` instead."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


TEST_PROCESS_ENV = "CHANGEFORGE_TEST_PROCESS"


def marked_processes(marks: tuple[str, ...], token: str | None = None) -> list:
    """The processes whose command line holds one of ``marks`` (or, for a path, whose environment
    does), or whose environment holds ``token`` in ``TEST_PROCESS_ENV``, with everything under them;
    never the caller, never a watchdog."""
    import psutil
    own = os.getpid()
    # A mark not followed by a digit: port 3313's mark is not found in ":33131".
    rule = re.compile("|".join(re.escape(m) + r"(?!\d)" for m in marks)) if marks else None
    paths = [m for m in marks if os.sep in m]     # unique to what they mark, in any variable (a port is not)
    found = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid == own:
            continue
        try:
            environ = p.environ() if paths or token else {}     # read only when a rule looks there
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            environ = {}
        # Marks are looked for in the environment too, where a process's title has not overwritten it.
        if (rule and (any(rule.search(a) for a in p.info["cmdline"] or []) or
                      any(m in v for m in paths for v in environ.values()))) or \
                (token and environ.get(TEST_PROCESS_ENV) == token):
            # With everything under it (Ray's processes retitle themselves, which can overwrite their
            # environment too: a raylet's agents are found as its children), but never a watchdog: a test
            # process killed by its parent's watchdog (xdist's worker) leaves its own to do their work.
            try:
                found.update((q.pid, q) for q in [p] + p.children(recursive=True)
                             if q.pid != own and not _is_watchdog(q))
            except psutil.NoSuchProcess:
                continue
    return list(found.values())


RESCANS = 3          # a net: a process started while a scan ran (a last spawn of a dying parent) is found by the next
RESCAN_PAUSE_S = 0.5


def _is_watchdog(proc) -> bool:
    try:
        return proc.cmdline()[1:3] == ["-m", "tests.equipment"]
    except Exception:  # noqa: BLE001 - gone or unreadable: not one to spare
        return False


def kill_marked(marks: tuple[str, ...], token: str | None = None, timeout: float = 10) -> int:
    """SIGKILL every :func:`marked_processes` (each tree found before the first kill: a killed
    parent's children are re-parented and no longer found under it), scanning again until a scan
    finds none alive; how many were signalled."""
    import psutil
    n = 0
    for _ in range(1 + RESCANS):
        procs = [q for q in marked_processes(marks, token) if _alive(q)]
        if not procs:
            break
        for q in procs:
            try:
                q.send_signal(signal.SIGKILL)
                n += 1
            except psutil.NoSuchProcess:
                pass
        deadline = time.time() + timeout
        while time.time() < deadline and any(_alive(q) for q in procs):
            time.sleep(0.05)
        time.sleep(RESCAN_PAUSE_S)
    return n


def _alive(proc) -> bool:
    """Running and not a zombie (a killed process whose parent has not reaped it yet is done)."""
    import psutil
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def reaper(marks: tuple[str, ...], remove: str | None = None, token: str | None = None) -> subprocess.Popen:
    """A watchdog for equipment that daemonizes: a process of its own session (a terminal's Ctrl-C
    does not reach it) that waits for its stdin to close, which happens when the process that started
    it exits however it exits, and then kills what :func:`kill_marked` finds for ``marks`` and removes
    ``remove``. The marks go through the pipe, not the command line, so the watchdog is not one of the
    processes they mark. The caller keeps the returned process (its stdin is the pipe's only write end)
    and calls :func:`release` after its own teardown."""
    import json
    root = str(Path(__file__).resolve().parent.parent)
    # Without the test process's token: watchdogs firing together (the session's, a cluster's) never
    # kill each other.
    env = {**{k: v for k, v in os.environ.items() if k != TEST_PROCESS_ENV},
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    watchdog = subprocess.Popen([sys.executable, "-m", "tests.equipment"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                env=env, cwd=root)
    watchdog.stdin.write(json.dumps({"marks": list(marks), "remove": remove, "token": token}).encode() + b"\n")
    watchdog.stdin.flush()
    return watchdog


def release(watchdog: subprocess.Popen, timeout: float = 30) -> None:
    """Close the watchdog's pipe (what the caller's exit would do) and wait for it: after a teardown
    that stopped everything it finds nothing left to kill."""
    if watchdog.stdin and not watchdog.stdin.closed:
        watchdog.stdin.close()
    try:
        watchdog.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        watchdog.kill()


def guard_this_process() -> subprocess.Popen | None:
    """Everything this test process starts, directly or not, carries a token of this process in its
    environment (``TEST_PROCESS_ENV``: set here, inherited by every process started after, Ray's
    daemons and workers and the jobs' processes included), and a :func:`reaper` kills what carries it
    when this process exits, however it exits. Each pytest process (xdist's workers too) has its own."""
    if os.environ.get(TEST_PROCESS_ENV, "").startswith(f"{os.getpid()}-"):
        return None      # guarded already (a pytest run inside this one: pytester)
    token = f"{os.getpid()}-{os.urandom(4).hex()}"
    os.environ[TEST_PROCESS_ENV] = token
    return reaper((), token=token)


def _reap() -> None:
    import json
    import shutil
    orders = json.loads(sys.stdin.buffer.readline())
    sys.stdin.buffer.read()            # until the starter's end of the pipe closes
    kill_marked(tuple(orders["marks"]), orders.get("token"))
    if orders["remove"]:
        shutil.rmtree(orders["remove"], ignore_errors=True)


if __name__ == "__main__":
    _reap()
