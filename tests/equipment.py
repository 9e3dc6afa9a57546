"""Starting the tests' servers so that the one answering is the one we started.

A port chosen by bind-and-close can be taken by another process before our server binds it, and a
readiness check that accepts any listener then passes against the wrong server. So a server binds
port 0 itself and prints the port it got (``announce``); the starter reads it from the server's own
output (``start_announced``) and confirms, from the kernel's socket table, that the listener on that
port belongs to the process it started (``wait_for_port`` with ``proc``).
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
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
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
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
