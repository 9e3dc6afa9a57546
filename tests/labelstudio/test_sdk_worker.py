"""operators.labelstudio.client.call without the SDK here: one SDK process per (Python, key) and process,
reused across calls, restarted when it died or the key changed, every call's wait bounded. The SDK's
"Python" here is this one (where label-studio-sdk is not installed, so every operation answers with its
ImportError: the reply path is the real one) or a script that never answers."""
from __future__ import annotations

import os
import sys

import pytest

from operators.labelstudio import client as sc


@pytest.fixture
def no_sdk_here(monkeypatch):
    monkeypatch.setattr(sc, "_sdk_here", lambda: False)
    monkeypatch.setenv(sc.PYTHON_ENV, sys.executable)
    monkeypatch.setenv(sc.API_KEY_ENV, "key-one")
    sc.close_workers()
    yield
    sc.close_workers()


def test_calls_share_one_sdk_process_and_errors_come_back_as_studio_errors(no_sdk_here, monkeypatch):
    with pytest.raises(sc.StudioError, match=r"^Label Studio export_json failed: ModuleNotFoundError: No module "
                                             r"named 'label_studio_sdk'$"):
        sc.call("export_json", url="http://127.0.0.1:1", project_id=1)
    (worker,) = sc._WORKERS.values()
    pid = worker.proc.pid
    with pytest.raises(sc.StudioError, match="ModuleNotFoundError"):
        sc.call("create_project_with_tasks", url="http://127.0.0.1:1", title="t", label_config="<View/>",
                tasks=[], storage_path=None)
    with pytest.raises(sc.StudioError, match=r"KeyError: 'no_such_op'"):
        sc.call("no_such_op")
    assert [w.proc.pid for w in sc._WORKERS.values()] == [pid] and worker.alive()
    monkeypatch.setenv(sc.API_KEY_ENV, "key-two")                     # another key: a process of its own
    with pytest.raises(sc.StudioError):
        sc.call("export_json", url="http://127.0.0.1:1", project_id=1)
    assert len(sc._WORKERS) == 2 and len({w.proc.pid for w in sc._WORKERS.values()}) == 2
    sc.close_workers()
    assert not worker.alive() and sc._WORKERS == {}


def test_a_dead_sdk_process_is_replaced(no_sdk_here):
    with pytest.raises(sc.StudioError):
        sc.call("export_json", url="http://127.0.0.1:1", project_id=1)
    (worker,) = sc._WORKERS.values()
    worker.proc.kill()
    worker.proc.wait(timeout=30)
    with pytest.raises(sc.StudioError, match="ModuleNotFoundError"):
        sc.call("export_json", url="http://127.0.0.1:1", project_id=1)
    (again,) = sc._WORKERS.values()
    assert again is not worker and again.alive()


def test_a_process_that_never_answers_fails_the_call_within_the_timeout(no_sdk_here, monkeypatch, tmp_path):
    silent = tmp_path / "python"
    silent.write_text("#!/bin/sh\nexec sleep 600\n")
    silent.chmod(0o755)
    monkeypatch.setenv(sc.PYTHON_ENV, str(silent))
    monkeypatch.setattr(sc, "CALL_TIMEOUT_S", 0.2)      # the bound is waited out: kept short
    with pytest.raises(sc.StudioError, match=r"^Label Studio export_json did not answer within 0\.2 s$"):
        sc.call("export_json", url="http://127.0.0.1:1", project_id=1)
    (worker,) = sc._WORKERS.values()
    assert not worker.alive()                                          # killed, not left behind


def test_a_process_that_exits_says_so(no_sdk_here, monkeypatch, tmp_path):
    gone = tmp_path / "python"
    gone.write_text("#!/bin/sh\nexit 3\n")
    gone.chmod(0o755)
    monkeypatch.setenv(sc.PYTHON_ENV, str(gone))
    with pytest.raises(sc.StudioError, match=rf"^Label Studio export_json failed: the SDK's Python \({gone}\) "
                                             r"exited \(code 3\)$"):
        sc.call("export_json", url="http://127.0.0.1:1", project_id=1)
    assert os.path.exists(gone)


def test_a_process_that_dies_passes_on_its_last_words_without_the_key(no_sdk_here, monkeypatch, tmp_path):
    dying = tmp_path / "python"
    filler = "".join(f"echo 'noise line {i}' >&2\n" for i in range(100))   # more than the kept tail
    dying.write_text("#!/bin/sh\n" + filler + "echo 'Traceback (most recent call last):' >&2\n"
                     "echo \"ImportError: cannot import name 'Client' (token $LABEL_STUDIO_API_KEY)\" >&2\nexit 1\n")
    dying.chmod(0o755)
    monkeypatch.setenv(sc.PYTHON_ENV, str(dying))
    with pytest.raises(sc.StudioError) as caught:
        sc.call("export_json", url="http://127.0.0.1:1", project_id=1)
    message = str(caught.value)
    assert "exited (code 1); its last output:" in message
    assert message.endswith("ImportError: cannot import name 'Client' (token ***)")
    assert "key-one" not in message and "noise line 0\n" not in message and len(message) < 1200
