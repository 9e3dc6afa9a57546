"""The tests' equipment does not outlive a test process killed without its teardown (SIGTERM, SIGKILL):
servers die with the process that started them, and a cluster's daemons (re-parented, as ``ray start``
leaves them) are killed by the cluster's watchdog, which kills only what carries the cluster's marks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
SLEEP = "import time; time.sleep(300)"

pytestmark = pytest.mark.slow   # processes started and killed; the full suite's


def start_parent(code: str, tmp_path: Path) -> tuple[subprocess.Popen, dict]:
    """A test process of its own (``code``, with the repository importable), and the pids it prints as
    one JSON line once everything it starts is up."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, text=True)
    line = proc.stdout.readline()
    assert line, f"the parent exited ({proc.wait()}) before reporting its pids"
    return proc, json.loads(line)


def gone(pid: int, timeout: float) -> bool:
    """Whether ``pid`` has exited within ``timeout`` (waited on, not slept through)."""
    try:
        psutil.Process(pid).wait(timeout=timeout)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return False
    return True


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_parent_and_watch(parent: subprocess.Popen, watchdog: int, started: list[int]) -> None:
    """While the test process lives, its watchdog waits and what it started runs (a zombie counts as
    dead); once it is SIGKILLed, the watchdog finishes and nothing it started is left."""
    assert not gone(watchdog, timeout=1.0), "the watchdog ended while its test process lived"
    assert [pid for pid in started if not alive(pid)] == []
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert gone(watchdog, timeout=30), "the watchdog did not finish"
    assert [pid for pid in started if not gone(pid, timeout=1)] == []


def kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("guarded", [True, False], ids=["die_with_parent", "without it"])
def test_a_server_dies_with_the_test_process_that_started_it(tmp_path, guarded):
    parent, pids = start_parent(f"""
        import json, subprocess, sys, time
        from tests.equipment import die_with_parent
        child = subprocess.Popen([sys.executable, "-c", {SLEEP!r}], {"preexec_fn=die_with_parent" if guarded else ""})
        print(json.dumps({{"server": child.pid}}), flush=True)
        time.sleep(300)
    """, tmp_path)
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        # Without the guard the server outlives its test process: the case the guard is for.
        assert gone(pids["server"], timeout=10 if guarded else 2) is guarded
    finally:
        kill([pids["server"]])


def test_a_cluster_s_daemons_die_with_the_test_process_and_nothing_else_does(tmp_path):
    marked_dir = tmp_path / "cf-ray-test"
    marked_dir.mkdir()
    port = 3313
    # Outside the cluster, started by this test: a process whose argument holds the port's digits
    # followed by another digit (another port), and one holding neither mark.
    strangers = [subprocess.Popen([sys.executable, "-c", SLEEP, f"--address=127.0.0.1:{port}1"]),
                 subprocess.Popen([sys.executable, "-c", SLEEP, str(tmp_path / "elsewhere")])]
    parent, pids = start_parent(f"""
        import json, os, subprocess, sys, time
        from tests.equipment import TEST_PROCESS_ENV, guard_this_process, reaper
        session = guard_this_process()      # as in every test process: the two watchdogs fire together
        watchdog = reaper(({str(marked_dir)!r}, ":{port}"), remove={str(marked_dir)!r})
        daemon = lambda *args: subprocess.Popen([sys.executable, "-c", *args], start_new_session=True)
        # A daemon marked by its directory; one by its port; and one whose child renames itself (as
        # Ray's workers do): found as the marked one's child.
        by_dir = daemon({SLEEP!r}, "--log_dir={marked_dir}/logs")
        by_port = daemon({SLEEP!r}, "--address=192.0.2.2:{port}")
        spawner = daemon("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {SLEEP!r}]); "
                         "time.sleep(300)", "--temp-dir", {str(marked_dir)!r})
        while not __import__("psutil").Process(spawner.pid).children():
            time.sleep(0.01)
        worker = __import__("psutil").Process(spawner.pid).children()[0].pid
        # And one as Ray's agents are left when their raylet dies first: renamed, nobody's child, no
        # test token, the cluster's path only in its environment.
        env = {{k: v for k, v in os.environ.items() if k != TEST_PROCESS_ENV}}
        env["RAY_AUTH_TOKEN_PATH"] = {str(marked_dir / "auth_token")!r}
        agent = int(subprocess.run([sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen("
                                    "[sys.executable, '-c', {SLEEP!r}], start_new_session=True, "
                                    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
                                   env=env, capture_output=True, text=True, check=True).stdout)
        print(json.dumps({{"cluster": [by_dir.pid, by_port.pid, spawner.pid, worker, agent],
                          "watchdog": watchdog.pid}}), flush=True)
        time.sleep(300)
    """, tmp_path)
    try:
        kill_parent_and_watch(parent, pids["watchdog"], pids["cluster"])
        assert not marked_dir.exists()
        assert all(s.poll() is None for s in strangers), "the watchdog killed a process not of its cluster"
    finally:
        kill(pids["cluster"] + [pids["watchdog"]] + [s.pid for s in strangers])
        for s in strangers:
            s.wait()


def test_a_released_watchdog_cleans_up_and_is_gone_when_release_returns(tmp_path):
    """``release`` (the teardown's last step) returns once the watchdog has finished: whatever the
    teardown missed under the marks is killed, the directory removed, and no watchdog is left."""
    from tests.equipment import reaper, release
    marked_dir = tmp_path / "cf-ray-released"
    marked_dir.mkdir()
    missed = subprocess.Popen([sys.executable, "-c", SLEEP, f"--log_dir={marked_dir}/logs"],
                              start_new_session=True)
    try:
        watchdog = reaper((str(marked_dir),), remove=str(marked_dir))
        release(watchdog)
        assert watchdog.returncode == 0
        assert missed.wait(timeout=5) == -signal.SIGKILL
        assert not marked_dir.exists()
    finally:
        kill([missed.pid])


def test_whatever_a_test_process_starts_dies_with_it_by_its_token(tmp_path):
    """The session's guard (tests/conftest.py): processes started by the test process, daemonized or
    not, nothing in their command lines, die with it; a process of another test process (its own
    token) is left alone."""
    from tests.equipment import TEST_PROCESS_ENV
    stranger = subprocess.Popen([sys.executable, "-c", SLEEP],
                                env={**os.environ, TEST_PROCESS_ENV: "another-test-process"})
    parent, pids = start_parent(f"""
        import json, subprocess, sys, time
        import psutil
        from tests.equipment import guard_this_process
        watchdog = guard_this_process()
        plain = subprocess.Popen([sys.executable, "-c", {SLEEP!r}])
        daemon = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                                   "subprocess.Popen([sys.executable, '-c', {SLEEP!r}]); time.sleep(300)"],
                                  start_new_session=True)
        while not psutil.Process(daemon.pid).children():
            time.sleep(0.01)
        print(json.dumps({{"started": [plain.pid, daemon.pid, psutil.Process(daemon.pid).children()[0].pid],
                          "watchdog": watchdog.pid}}), flush=True)
        time.sleep(300)
    """, tmp_path)
    try:
        kill_parent_and_watch(parent, pids["watchdog"], pids["started"])
        assert stranger.poll() is None, "the watchdog killed another test process's process"
    finally:
        kill(pids["started"] + [pids["watchdog"], stranger.pid])
        stranger.wait()


def test_a_killed_controller_s_workers_take_their_own_processes_with_them(tmp_path):
    """As under xdist: a controller (its token) starts a worker that guards itself (a token of its
    own), and the worker starts a daemon. Killing the controller kills the worker (it was started with
    the controller's token), and the worker's watchdog, which the controller's must leave alive, then
    kills the daemon."""
    worker_code = textwrap.dedent(f"""
        import json, subprocess, sys, time
        from tests.equipment import guard_this_process
        watchdog = guard_this_process()
        # Daemonized as `ray start` leaves its daemons: started by a process that exits at once, so
        # it is nobody's child here (re-parented), found only by its token.
        starter = subprocess.run([sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen("
                                  "[sys.executable, '-c', {SLEEP!r}], start_new_session=True, stdout=subprocess.DEVNULL, "
                                  "stderr=subprocess.DEVNULL).pid)"],
                                 capture_output=True, text=True, check=True)
        print(json.dumps({{"daemon": int(starter.stdout), "worker_watchdog": watchdog.pid}}), flush=True)
        time.sleep(300)
    """)
    parent, pids = start_parent(f"""
        import json, subprocess, sys, time
        from tests.equipment import guard_this_process
        watchdog = guard_this_process()
        worker = subprocess.Popen([sys.executable, "-c", {worker_code!r}], stdout=subprocess.PIPE, text=True)
        print(json.dumps({{"worker": worker.pid, **json.loads(worker.stdout.readline())}}), flush=True)
        time.sleep(300)
    """, tmp_path)
    started = [pids["worker"], pids["daemon"], pids["worker_watchdog"]]
    try:
        assert [pid for pid in started if not alive(pid)] == []
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert [pid for pid in started if not gone(pid, timeout=30)] == []
    finally:
        kill(started)
