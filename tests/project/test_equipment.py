"""The test equipment itself: a server is ready only when the process we started answers on its port,
and the OpenAI-compatible test server's hold switch holds and releases requests at a known point."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request

import pytest

from tests.equipment import listen_socket, start_announced, stop, wait_for_port

pytestmark = pytest.mark.equipment


def test_a_port_served_by_another_process_is_not_ready():
    """The readiness check names the stranger on the port instead of passing against it."""
    stranger = listen_socket()
    port = stranger.getsockname()[1]
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(RuntimeError, match="not by the server we started"):
            wait_for_port(port, timeout=10, proc=ours)
        wait_for_port(port, timeout=10)   # without a process to check, any listener would do
    finally:
        stop(ours)
        stranger.close()


def test_a_server_that_exits_is_not_waited_for():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match=r"exited \(3\)"):
        wait_for_port(1, timeout=30, proc=proc)


def test_the_reported_port_is_the_servers_own():
    proc, port, log = start_announced([sys.executable, "-m", "tests.openai_test_server", "--port", "0"])
    try:
        wait_for_port(port, timeout=10, proc=proc)
    finally:
        stop(proc)
        log.unlink()


def test_label_studio_on_a_port_another_process_holds_fails_with_that_pid(label_studio_python, tmp_path):
    """Label Studio, given a taken port, quietly starts on the next one; its start names the process on
    the port instead of taking it for Label Studio, and stops the label-studio it started."""
    import os

    from tests.review.label_studio_env import LabelStudioServer
    stranger = listen_socket()
    port = stranger.getsockname()[1]
    server = LabelStudioServer(tmp_path / "data", tmp_path, port=port, startup_s=120)
    try:
        with pytest.raises(RuntimeError, match=rf"port {port} is served by pid \[{os.getpid()}\], not by the "
                                               r"server we started") as failed:
            server.start()
        assert f"(pid {server.proc.pid})" in str(failed.value)      # ours, named too, and stopped
        assert server.proc.poll() is not None
    finally:
        server.stop()
        stranger.close()


def chat(base_url: str, i: int) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"request {i}"}]}).encode()
    req = urllib.request.Request(base_url + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200


def test_the_hold_switch_holds_requests_after_the_first_n_until_released(openai_server):
    openai_server.hold(after=2)
    threads = [threading.Thread(target=chat, args=(openai_server.base_url, i)) for i in range(5)]
    for t in threads:
        t.start()
    try:
        held = openai_server.wait_held(3, timeout_s=60)
        assert (held["passed"], held["held"]) == (2, 3)
        with pytest.raises(TimeoutError):      # no fourth one: exactly the requests after the first two
            openai_server.wait_held(4, timeout_s=1)
        assert openai_server.stats()["total"] == 2   # held requests are neither counted nor answered yet
    finally:
        openai_server.release()
        for t in threads:
            t.join(timeout=120)
    assert openai_server.stats()["by_status"] == {"200": 5}
    chat(openai_server.base_url, 5)                  # released: the hold is over
    assert openai_server.stats()["total"] == 6
