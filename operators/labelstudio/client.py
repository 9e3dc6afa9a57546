"""The few Label Studio server calls the review needs, through ``label-studio-sdk``: create (or find) the
project, register the images folder as local import storage, import tasks, fetch the JSON export.

label-studio-sdk 2.1 pins numpy and OpenCV below what the pipeline uses, so it usually lives in its own
virtual environment (default ``~/.cache/changeforge/venv-labelstudio``, under ``$XDG_CACHE_HOME`` when
set). :func:`call` runs an operation in-process when the SDK imports here, else in that environment's
Python (``LABEL_STUDIO_PYTHON`` overrides): this file runs there once per process (``--serve``), one JSON
request per line on its stdin and one JSON reply per line on its stdout, so a review or a chain that
makes many calls starts the SDK's Python (seconds of imports) once, not per call. This module imports
nothing but the standard library and the SDK so that it runs there.

The API key comes from ``LABEL_STUDIO_API_KEY`` only (inherited by the subprocess, never on a command
line), and is never logged or written.
"""
from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import queue
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

API_KEY_ENV = "LABEL_STUDIO_API_KEY"
PYTHON_ENV = "LABEL_STUDIO_PYTHON"
SDK_VERSION = "label-studio-sdk==2.1.2"
CALL_TIMEOUT_S = 600
STDERR_TAIL_LINES = 40


def default_venv() -> str:
    """Where the SDK's own environment lives unless ``LABEL_STUDIO_PYTHON`` names another one."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "changeforge", "venv-labelstudio")


class StudioError(RuntimeError):
    pass


def connect(url: str):
    """An SDK client for ``url``; the key from the environment."""
    key = os.environ.get(API_KEY_ENV, "")
    if not key:
        raise StudioError(f"no Label Studio key: set {API_KEY_ENV} (Account & Settings -> Access Token)")
    from label_studio_sdk import LabelStudio
    return LabelStudio(base_url=url.rstrip("/"), api_key=key)


def create_project_with_tasks(url: str, title: str, label_config: str, tasks: list[dict],
                              storage_path: str | None, settings: dict | None = None) -> dict:
    """Create the project (or reuse the one with this title) and import the tasks whose ``item_id`` it
    does not hold yet, so re-running an export does not give reviewers the same task twice.
    ``settings``: further project fields for a new project (e.g. ``maximum_annotations``)."""
    client = connect(url)
    project = next((p for p in client.projects.list() if p.title == title), None)
    created = project is None
    if created:
        project = client.projects.create(title=title, label_config=label_config, **(settings or {}))
    if storage_path and not any(getattr(s, "path", None) == storage_path
                                for s in client.import_storage.local.list(project=project.id)):
        # Label Studio serves /data/local-files/ only from registered local storages.
        client.import_storage.local.create(project=project.id, path=storage_path, use_blob_urls=False,
                                           title="changeforge images")
    have = set() if created else {(t.data or {}).get("item_id") for t in client.tasks.list(project=project.id)}
    todo = [t for t in tasks if t["data"]["item_id"] not in have]
    if todo:
        client.projects.import_tasks(id=project.id, request=todo)
    return {"project_id": int(project.id), "project_url": f"{url.rstrip('/')}/projects/{project.id}",
            "created": created, "imported": len(todo), "already_there": len(tasks) - len(todo)}


def export_json(url: str, project_id: int) -> list[dict]:
    """The project's tasks with annotations, as Label Studio's JSON export."""
    data = connect(url).projects.exports.as_json(project_id)
    if isinstance(data, (bytes, bytearray, str)):
        data = json.loads(data)
    return list(data)


def name_users(tasks: list[dict], emails: dict) -> None:
    """Each annotation's ``completed_by`` and ``updated_by`` as ``{"id", "email"}`` where the user id is
    known (the JSON export gives bare ids; people are named, and listed with --experts, by email)."""
    for t in tasks:
        for a in t.get("annotations") or []:
            for key in ("completed_by", "updated_by"):
                if isinstance(a.get(key), int) and emails.get(a[key]):
                    a[key] = {"id": a[key], "email": emails[a[key]]}


def export_json_with_predictions(url: str, project_id: int) -> list[dict]:
    """:func:`export_json` with each task's predictions in full (the JSON export lists only their ids)
    and its users named (:func:`name_users`)."""
    client = connect(url)
    data = client.projects.exports.as_json(project_id)
    if isinstance(data, (bytes, bytearray, str)):
        data = json.loads(data)
    by_task: dict = {}
    for p in client.predictions.list(project=project_id):
        by_task.setdefault(p.task, []).append(p.model_dump(mode="json"))
    tasks = list(data)
    for t in tasks:
        t["predictions"] = sorted(by_task.get(t.get("id"), []), key=lambda p: p.get("id") or 0)
    name_users(tasks, {u.id: u.email for u in client.users.list() if getattr(u, "email", None)})
    return tasks


OPERATIONS = {"create_project_with_tasks": create_project_with_tasks, "export_json": export_json,
              "export_json_with_predictions": export_json_with_predictions}


def _sdk_here() -> bool:
    try:
        import label_studio_sdk  # noqa: F401
        return True
    except ImportError:
        return False


def sdk_python() -> str:
    return os.environ.get(PYTHON_ENV) or os.path.join(default_venv(), "bin", "python")


def call(op: str, **kwargs):
    """Run ``OPERATIONS[op](**kwargs)`` where the SDK is: here, or in the SDK's own environment."""
    if _sdk_here():
        try:
            return OPERATIONS[op](**kwargs)
        except StudioError:
            raise
        except Exception as exc:  # noqa: BLE001 - report without request details
            raise StudioError(f"Label Studio {op} failed: {type(exc).__name__}: {str(exc)[:500]}") from None
    python = sdk_python()
    if not os.path.exists(python):
        venv = os.path.dirname(os.path.dirname(python))
        raise StudioError(f"label-studio-sdk is neither importable here nor at {python}: python -m venv {venv} && "
                          f"{venv}/bin/pip install {SDK_VERSION} (or set {PYTHON_ENV})")
    return _worker(python).ask(op, kwargs)


class _Worker:
    """This file serving in the SDK's Python (``--serve``): one per (python, key) and process."""

    def __init__(self, python: str, key: str):
        self.python, self.key, self.pid = python, key, os.getpid()
        # This file run by path: the SDK's environment must not see this one's packages (numpy, OpenCV).
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.replies: queue.Queue = queue.Queue()
        # What the SDK's Python last printed (bounded), for the error when it dies: a traceback, a failed import.
        self.stderr_tail: collections.deque = collections.deque(maxlen=STDERR_TAIL_LINES)
        threading.Thread(target=self._read, daemon=True).start()
        self.stderr_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self.stderr_reader.start()
        self.lock = threading.Lock()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.replies.put(line)
        self.replies.put(None)   # it exited

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:   # drained always, so a chatty SDK never blocks on a full pipe
            self.stderr_tail.append(line.rstrip("\n"))

    def last_words(self) -> str:
        """The tail of the worker's stderr, at most 800 characters, with the API key masked."""
        text = "\n".join(self.stderr_tail)[-800:]
        if self.key:
            text = text.replace(self.key, "***")
        return text

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, op: str, kwargs: dict):
        with self.lock:
            try:
                self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
                self.proc.stdin.flush()
                line = self.replies.get(timeout=CALL_TIMEOUT_S)
            except queue.Empty:
                self.close()
                raise StudioError(f"Label Studio {op} did not answer within {CALL_TIMEOUT_S} s") from None
            except (BrokenPipeError, OSError):
                line = None
            if line is None:
                self.close()
                self.stderr_reader.join(timeout=5)   # it ends with the pipe: the last lines are in
                words = self.last_words()
                raise StudioError(f"Label Studio {op} failed: the SDK's Python ({self.python}) exited "
                                  f"(code {self.proc.poll()})" + (f"; its last output:\n{words}" if words else ""))
            reply = json.loads(line)
            if "error" in reply:
                raise StudioError(f"Label Studio {op} failed: {reply['error']}")
            return reply["ok"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


_WORKERS: dict[tuple[str, str], _Worker] = {}
_WORKERS_LOCK = threading.Lock()


def _worker(python: str) -> _Worker:
    """The live worker for this Python and key (a new key, a dead worker or a forked process: a new one)."""
    key = (python, os.environ.get(API_KEY_ENV, ""))
    with _WORKERS_LOCK:
        w = _WORKERS.get(key)
        if w is None or not w.alive() or w.pid != os.getpid():
            w = _WORKERS[key] = _Worker(*key)
        return w


@atexit.register
def close_workers() -> None:
    """Stop this process's SDK workers (at exit; tests call it to start afresh)."""
    with _WORKERS_LOCK:
        for w in [w for w in _WORKERS.values() if w.pid == os.getpid()]:
            w.close()
        _WORKERS.clear()


def _run(request: dict) -> dict:
    op = request.pop("op")
    try:
        return {"ok": OPERATIONS[op](**request)}
    except Exception as exc:  # noqa: BLE001 - report without request details
        return {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}


def main() -> int:
    """``--serve``: one JSON request per stdin line, one JSON reply (``{"ok": ...}`` or ``{"error": ...}``)
    per stdout line, until stdin closes. What the SDK prints goes to stderr, never into a reply."""
    if sys.argv[1:] != ["--serve"]:
        print("usage: client.py --serve (run by operators.labelstudio.client.call)", file=sys.stderr)
        return 2
    replies, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(_run(json.loads(line))), file=replies, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
