"""Session-wide test equipment: one local S3-compatible server (moto, server mode) and one local Ray.

The S3 server is started before Ray so that Ray's workers inherit its endpoint from the environment,
exactly as they would inherit a real deployment's settings.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data"

# Markers follow from the fixtures a test uses (item.fixturenames is the whole closure, so a fixture
# built on ray_session marks its users "ray" too). A test with none of them, and not marked slow, is
# "quick": the quick loop (`pytest -m quick`) runs only those, and they may not start Ray or servers.
FIXTURE_MARKERS = {
    "ray_session": "ray",
    "cluster": "cluster",
    "s3_endpoint": "equipment",
    "openai_test_server_process": "equipment",
    "label_studio": "labelstudio",
    "label_studio_python": "labelstudio",
    "chromium_path": "browser",
}
HEAVY = set(FIXTURE_MARKERS.values()) | {"slow"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, marker in FIXTURE_MARKERS.items():
            if fixture in item.fixturenames:
                item.add_marker(marker)
        if "tests/cluster/" in item.nodeid:
            item.add_marker("cluster")
        if not any(item.get_closest_marker(m) for m in HEAVY):
            item.add_marker("quick")


@pytest.fixture(scope="session")
def label_studio_python() -> Path:
    """The Python of Label Studio's own environment (created on first use: a few minutes, once)."""
    from tests.review.label_studio_env import ensure_venv
    return ensure_venv() / "bin" / "python"


@pytest.fixture(autouse=True)
def _quick_tests_start_no_ray(request, monkeypatch):
    """A quick test that reaches ray.init would start a whole Ray: it must use ray_session instead (and so
    leave the quick loop)."""
    if request.node.get_closest_marker("quick") is None:
        return
    import ray

    def refuse(*args, **kwargs):
        raise RuntimeError("a quick test started Ray: use the ray_session fixture (which marks it 'ray')")

    monkeypatch.setattr(ray, "init", refuse)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1; sets AWS_* so boto3, pyarrow and GDAL all talk to it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        endpoint = f"http://127.0.0.1:{port}"
        with pytest.MonkeyPatch.context() as env:   # restored when the session ends
            for name, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                                "AWS_REGION": "us-east-1"}.items():
                env.setenv(name, value)
            yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_client(s3_endpoint):
    import boto3
    return boto3.client("s3", endpoint_url=s3_endpoint)


@pytest.fixture()
def s3_bucket(s3_client, request):
    """A fresh bucket per test, named after the test."""
    name = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:50].strip("-")
    name = f"{name}-{int(time.time() * 1000) % 100000}"
    s3_client.create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def ray_session(s3_endpoint):
    """One local Ray for the whole session (2 CPUs), started after the S3 endpoint exists."""
    import ray
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from operators.io.cli import RAY_SYSTEM_CONFIG
    # address="local" (never a leftover cluster) and the jobs' own system config (what users run).
    ctx = ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True,
                   log_to_driver=False, configure_logging=False, _system_config=RAY_SYSTEM_CONFIG)
    import ray.data
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ctx
    ray.shutdown()


# ---------------------------------------------------------------------------------------------------
# Captions job / LLM layer (issue 4): the OpenAI-compatible test server (test equipment, not a model).
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def openai_test_server_process():
    """The test server in its own process on 127.0.0.1 (so its CPU is not the test process's)."""
    from tests.openai_test_server import ServerProcess
    server = ServerProcess()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture()
def llm_namespace(monkeypatch):
    """A fresh Ray namespace for this test's account limiters (jobs and run_pool find them there), so
    limits a test sets, or lowers after 429s, never reach another test's pool."""
    import uuid

    from operators.llm.ratelimit import NAMESPACE_ENV
    namespace = f"changeforge-llm-test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(NAMESPACE_ENV, namespace)
    return namespace


@pytest.fixture()
def openai_server(openai_test_server_process, llm_namespace):
    """The test server with counters cleared and no faults, no latency, json_schema accepted; the test
    gets limiters of its own (llm_namespace)."""
    server = openai_test_server_process
    server.restore_defaults()
    server.reset()
    yield server
    server.restore_defaults()


@pytest.fixture(scope="session")
def label_studio(tmp_path_factory):
    """The session's one Label Studio server on 127.0.0.1 (its own venv; installed on first use), serving
    local files from a document root (``document_root``) holding a copy of data/levir-cd; a test puts
    its own datasets under that root too."""
    import shutil
    from tests.review.label_studio_env import LabelStudioServer, venv_dir
    base = tmp_path_factory.mktemp("label-studio")
    root = base / "root"
    shutil.copytree(DATA / "levir-cd", root / "levir-cd")
    server = LabelStudioServer(base / "data", root, startup_s=900)
    server.start()
    # the jobs find the SDK in the same environment as the server (LABEL_STUDIO_VENV may move it)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LABEL_STUDIO_PYTHON", str(venv_dir() / "bin" / "python"))
        try:
            yield server
        finally:
            server.stop()
