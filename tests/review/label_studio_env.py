"""Test equipment: Label Studio in its own virtual environment, and a server on 127.0.0.1.

label-studio 1.23 and label-studio-sdk 2.1 pin numpy, OpenCV and Django versions that fight the
pipeline's, so they live in their own venv (the review job's default, ``~/.cache/changeforge/venv-labelstudio``;
``LABEL_STUDIO_VENV`` overrides), created on first use and reused after:

    python tests/review/label_studio_env.py --install      # what .ci/run does

The server gets a headless admin whose legacy token is the API key (1.23 refuses that token unless
LABEL_STUDIO_ENABLE_LEGACY_API_TOKEN=true), and serves local files from a document root whose
*subfolder* the review registers as local storage. Its first start runs the migrations (about a minute).
"""
from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

try:
    from tests.equipment import die_with_parent, free_port, wait_for_port
except ModuleNotFoundError:   # run as a script (python tests/review/label_studio_env.py): the checkout on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.equipment import die_with_parent, free_port, wait_for_port

REPO = Path(__file__).resolve().parents[2]
VERSIONS = ("label-studio==1.23.2", "label-studio-sdk==2.1.2")
TOKEN = "changeforge-test-token-0123456789abcdef"   # test equipment's own key; nothing real


def venv_dir() -> Path:
    """LABEL_STUDIO_VENV, else the review job's default (``~/.cache/changeforge/venv-labelstudio``), so
    that the job finds the SDK there too; never inside the checkout."""
    from operators.labelstudio.client import default_venv
    return Path(os.environ.get("LABEL_STUDIO_VENV") or default_venv())


def ensure_venv(log=print) -> Path:
    """The venv's directory, with label-studio installed (installs only when missing)."""
    venv = venv_dir()
    exe = venv / "bin" / "label-studio"
    if exe.exists() and (venv / "bin" / "python").exists():
        return venv
    # Two test workers (pytest -n) may both find it missing: one installs, the other waits for it.
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if exe.exists() and (venv / "bin" / "python").exists():
            return venv
        log(f"installing {', '.join(VERSIONS)} into {venv} (a few minutes, once)")
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        *VERSIONS], check=True)
    return venv


DB_NAME = "label_studio.sqlite3"
TEMPLATE_DB = "changeforge-migrated.sqlite3"   # kept in the venv: a migrated, empty database


def _snapshot(db: Path, target: Path) -> None:
    """Copy the freshly migrated database (users only, no projects) for later starts: the migrations
    are what makes the first start slow. sqlite's backup API copies a live database consistently."""
    import sqlite3
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")   # two workers may snapshot at once
    src, dst = sqlite3.connect(str(db)), sqlite3.connect(str(tmp))
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    os.replace(tmp, target)


class LabelStudioServer:
    """``label-studio start`` on 127.0.0.1 with its data in ``data_dir`` and local files under
    ``document_root``. Use as a context manager; ``url`` and ``token`` once started.

    Label Studio cannot bind port 0 and report the port, and when the port it is given is taken it
    quietly moves to the next one. So the port is chosen here (free a moment ago), and the server is
    ready only when the process listening on it is the one started here (or a child of it, from the
    kernel's socket table: ``tests.equipment.wait_for_port``) and answers the API; another process on
    the port fails the start with that process's pid instead of being taken for Label Studio."""

    def __init__(self, data_dir: Path, document_root: Path, port: int | None = None, startup_s: float = 300):
        self.data_dir, self.document_root = Path(data_dir), Path(document_root)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = TOKEN
        self.startup_s = startup_s
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir / "server.log"

    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LABEL_STUDIO_", "DJANGO_"))}
        env.update({
            "LABEL_STUDIO_BASE_DATA_DIR": str(self.data_dir),
            "LABEL_STUDIO_USERNAME": "reviewer@changeforge.test", "LABEL_STUDIO_PASSWORD": "changeforge-test",
            "LABEL_STUDIO_USER_TOKEN": self.token, "LABEL_STUDIO_ENABLE_LEGACY_API_TOKEN": "true",
            "LABEL_STUDIO_LOCAL_FILES_SERVING_ENABLED": "true",
            "LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT": str(self.document_root),
            "LABEL_STUDIO_DISABLE_SIGNUP_WITHOUT_LINK": "true", "SENTRY_DSN": "", "FRONTEND_SENTRY_DSN": "",
            "COLLECT_ANALYTICS": "false", "LATEST_VERSION_CHECK": "false",  # no network here
        })
        return env

    def start(self) -> "LabelStudioServer":
        """Start the server and wait until it answers (``launch`` then ``ready``)."""
        return self.launch().ready()

    def launch(self) -> "LabelStudioServer":
        """Start the process, not waiting for it: two servers started together start in the time of one
        (``ready`` waits for each)."""
        venv = ensure_venv()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._template = venv / TEMPLATE_DB
        self._fresh = not (self.data_dir / DB_NAME).exists()
        if self._fresh and self._template.exists():
            shutil.copyfile(self._template, self.data_dir / DB_NAME)   # migrated already: starts in seconds
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(venv / "bin" / "label-studio"), "start", "--no-browser", "--host", "127.0.0.1",
             "--internal-host", "127.0.0.1", "--port", str(self.port), "--data-dir", str(self.data_dir)],
            env=self.env(), stdout=log, stderr=subprocess.STDOUT, cwd=str(self.data_dir),
            preexec_fn=die_with_parent)
        self._deadline = time.time() + self.startup_s
        return self

    def ready(self) -> "LabelStudioServer":
        """Wait (within ``startup_s`` of the launch) until the launched server is the listener on its port
        and its API answers; stopped when it does not."""
        fresh, template, deadline = self._fresh, self._template, self._deadline
        try:
            # Ours listening on the port first (through the migrations of a first start): a stranger
            # there is an error at once, naming its pid; then its API answering.
            try:
                wait_for_port(self.port, max(1.0, deadline - time.time()), proc=self.proc)
            except RuntimeError as e:
                raise RuntimeError(f"label-studio (pid {self.proc.pid}) on 127.0.0.1:{self.port}: {e}; "
                                   f"see {self.log_path}:\n{self._log_tail()}") from None
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"label-studio exited ({self.proc.returncode}); see {self.log_path}:\n"
                                       + self._log_tail())
                try:
                    req = urllib.request.Request(f"{self.url}/api/projects",
                                                 headers={"Authorization": f"Token {self.token}"})
                    with urllib.request.urlopen(req, timeout=2) as r:
                        if r.status == 200:
                            if fresh and not template.exists():
                                _snapshot(self.data_dir / DB_NAME, template)
                            return self
                except OSError:
                    pass
                time.sleep(0.25)
            raise RuntimeError(f"label-studio did not answer within {self.startup_s:.0f}s; see {self.log_path}")
        except BaseException:
            self.stop()
            raise

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--install", action="store_true", help="create/complete the venv and exit")
    ap.add_argument("--serve", metavar="DOCUMENT_ROOT", help="run a server until Ctrl-C (for trying the review by hand)")
    ap.add_argument("--port", type=int, default=8080)
    args = ap.parse_args()
    venv = ensure_venv()
    if args.install and not (venv / TEMPLATE_DB).exists():
        # One start runs the migrations and leaves the migrated database as the template.
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            with LabelStudioServer(Path(tmp) / "data", Path(tmp), startup_s=1200):
                pass
    print(f"label-studio ready in {venv}")
    if args.serve:
        data = Path(args.serve).resolve() / ".label-studio-data"
        with LabelStudioServer(data, Path(args.serve).resolve(), port=args.port, startup_s=600) as server:
            print(f"Label Studio at {server.url}, LABEL_STUDIO_API_KEY={server.token}")
            try:
                server.proc.wait()
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
