"""Session-wide test equipment: one local S3-compatible server (moto, server mode) and one local Ray.

The S3 server is started before Ray so that Ray's workers inherit its endpoint from the environment,
exactly as they would inherit a real deployment's settings.
"""
from __future__ import annotations

import functools
import os
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

# Bytecode, even where PYTHONDONTWRITEBYTECODE=1 is set (as on CI's machines): every job the tests run in
# a process of its own (`python -m jobs.cli ...`) and every Ray worker imports the pipeline, and without
# cached bytecode each compiles its ~150 modules again (0.5 CPU s of a job's 2.2 s start, measured), and
# every pytest process rewrites the ~130 test modules' asserts again (5.5 CPU s). The cache lives in
# __pycache__ (ignored by git); processes that may not write it still read it. Set before anything below
# imports hypothesis: pytest rewrites the asserts of its ~130 modules (a plugin's), 1.6 CPU s in every
# pytest process (each xdist worker, each mutant's run) when the rewritten code may not be cached.
sys.dont_write_bytecode = bool(os.environ.get('NOPYC'))


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
HEAVY = set(FIXTURE_MARKERS.values()) | {"slow", "seeds"}


def pytest_xdist_make_scheduler(config, log):
    """On two or more workers (pytest -n, --dist loadfile as in pyproject.toml): a module's tests on one
    worker, so its module fixtures run once; all of tests/cluster on one, so its one cluster serves
    them and the node-killing test still runs after the others; and the modules on the session's Label
    Studio and captions output on one (``uses_session_label_studio``), so they share them.
    (pytest-xdist's own loadgroup cannot say this under pytest 9: it renames the tests' ids, which
    pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module.startswith("tests/cluster/"):
                return "tests/cluster/"
            return SESSION_LABEL_STUDIO if uses_session_label_studio(module) else module

        def schedule(self) -> None:
            # The heaviest modules first, the quick ones last. xdist's own order (most tests first) put the
            # end-to-end modules, one to six tests each and 30-100 s apiece, at the end of the run, where a
            # worker holding one (and the next, queued behind it) kept running while the other was idle.
            # (LoadScopeScheduling.schedule's first distribution, with that one order changed.)
            assert self.collection_is_completed
            if self.collection is not None:
                return super().schedule()
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            if not self.collection:
                return
            units: dict[str, dict[str, bool]] = {}
            for nodeid in self.collection:
                units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
            for scope in sorted(units, key=lambda s: -(len(units[s]) + scope_weight(s))):   # stable
                self.workqueue[scope] = units[scope]
            for _ in range(max(0, len(self.nodes) - len(self.workqueue))):
                unused_node, _assigned = self.assigned_work.popitem()
                unused_node.shutdown()
            for node in self.nodes:
                self._assign_work_unit(node)
            for node in self.nodes:
                self._reschedule(node)
            if not self.workqueue:
                for node in self.nodes:
                    node.shutdown()

    return ModuleScheduling(config, log)


# What makes a module heavy, read from its source (the scheduler sees node ids, not the tests' markers):
# a cluster start, a Label Studio server, end-to-end runs marked slow, the session's Ray or servers.
HEAVY_SOURCE = ((re.compile(r"LabelStudioServer|(?<![.\w])label_studio\b"), 400.0),   # the fixture, not a module path
                (re.compile(r"mark\.slow"), 200.0),
                (re.compile(r"\b(ray_session|s3_endpoint|s3_bucket|s3_client|openai_server|"
                            r"openai_test_server_process|chromium_path)\b"), 50.0))


# The modules on the session's one Label Studio and on the session's captions output (the ``label_studio``
# fixture, tests/review/conftest.py's ``captions_output``, as a parameter) form one scope, so one worker
# starts the server and runs the captions job for all of them: apart, each worker handed one of them
# started a server of its own (about 3 CPU s and 5 s) and ran the job again (about 5 s).
SESSION_LABEL_STUDIO = "session Label Studio"
_USES_LABEL_STUDIO = re.compile(r"[(,]\s*(label_studio|captions_output)\s*[,)]")


@functools.lru_cache(maxsize=None)
def uses_session_label_studio(module: str) -> bool:
    try:
        return bool(_USES_LABEL_STUDIO.search((REPO / module).read_text(errors="replace")))
    except OSError:
        return False


def scope_weight(scope: str) -> float:
    """A rough cost of a scheduling scope (a module, or all of tests/cluster), for ordering only."""
    if scope.startswith("tests/cluster/"):
        return 1000.0
    if scope == SESSION_LABEL_STUDIO:
        return 900.0
    try:
        text = (REPO / scope).read_text(errors="replace")
    except OSError:
        return 0.0
    return sum(weight for pattern, weight in HEAVY_SOURCE if pattern.search(text))


# Generated-case tests (hypothesis): a small budget in the quick loop (`-m quick`, the mutation tool's runs),
# a larger one in the full suite; HYPOTHESIS_PROFILE names another (e.g. `hunt` for a long search). A test
# sets its own max_examples only relative to these (settings(parent=...)) or where its budget is stated.
# deadline=None: the machine is shared and slow first calls (imports, JIT) are not failures.
def _register_hypothesis_profiles() -> None:
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:   # the quick loop of an old venv; the [test] extra installs it
        return
    common = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("quick", max_examples=25, **common)
    settings.register_profile("full", max_examples=200, **common)
    settings.register_profile("hunt", max_examples=5000, **common)


_register_hypothesis_profiles()


def compile_the_pipeline() -> None:
    """Bytecode for the repository's packages, once per run (the processes the tests start read it)."""
    import compileall
    for package in ("operators", "jobs", "benchmarks", "tools"):
        if (REPO / package).is_dir():
            compileall.compile_dir(str(REPO / package), quiet=2, workers=1)


def pytest_configure(config):
    if not os.environ.get('NOPYC') and not hasattr(config, "workerinput"):       # the controller (or the one process): before workers start
        compile_the_pipeline()
    try:
        from hypothesis import settings
    except ImportError:
        return
    profile = os.environ.get("HYPOTHESIS_PROFILE")
    if not profile:
        markexpr = (config.getoption("markexpr", default="") or "").strip()
        # The quick loop and the mutation oracles of the screening modules (their quick tests and the
        # generated-case tests' further cases: tools/mutation.toml) run each mutant: the small budget.
        profile = "quick" if markexpr in ("quick", "quick or seeds") else "full"
    settings.load_profile(profile)


def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, marker in FIXTURE_MARKERS.items():
            if fixture in item.fixturenames:
                item.add_marker(marker)
        if "tests/cluster/" in item.nodeid:
            item.add_marker("cluster")
        if not any(item.get_closest_marker(m) for m in HEAVY):
            item.add_marker("quick")


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most four (each worker starts its own Ray, S3 server, test
    server and, when a test asks for one, Label Studio: about 1.5 GiB)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


@pytest.fixture(scope="session")
def label_studio_python() -> Path:
    """The Python of Label Studio's own environment (created on first use: a few minutes, once)."""
    from tests.review.label_studio_env import ensure_venv
    return ensure_venv() / "bin" / "python"


OWN_VARIABLES = {"PYTEST_CURRENT_TEST"}   # pytest's own, set per test phase
# Libraries whose first import sets environment variables, and those variables (names or prefixes).
_IMPORT_SETS_VARIABLES = {"cv2", "rasterio", "ray", "sklearn", "threadpoolctl"}   # threadpoolctl: via datasets, scipy
IMPORT_VARIABLES = ("RAY_CLIENT_MODE", "GDAL_", "PROJ_CURL_CA_BUNDLE", "LD_LIBRARY_PATH", "KMP_DUPLICATE_LIB_OK",
                    "KMP_INIT_AT_FORK")


@pytest.fixture(autouse=True)
def _environment_restored():
    """A test leaves os.environ as it found it (monkeypatch.setenv does; a bare os.environ[...] = or a
    job that rewrites a variable does not, and the next test then runs in another environment). Session
    and module fixtures set theirs before this snapshot and restore them after the last test. Set up
    before any function's monkeypatch (the quick-test guard asks for it first), so its check runs after
    monkeypatch has undone its changes."""
    # Their first import sets variables (RAY_CLIENT_MODE; GDAL_/PROJ_CURL_CA_BUNDLE; LD_LIBRARY_PATH;
    # KMP_DUPLICATE_LIB_OK, KMP_INIT_AT_FORK): not a test's doing. Importing them all here cost every test
    # run (each mutant of tools/mutation.py, a one-file quick run) seconds of sklearn, pandas and pyarrow;
    # instead those variables are let through only when one of those libraries was first imported during
    # the test. A test that changes them without such an import still fails.
    first = _IMPORT_SETS_VARIABLES - set(sys.modules)
    before = {k: v for k, v in os.environ.items() if k not in OWN_VARIABLES}
    yield
    after = {k: v for k, v in os.environ.items() if k not in OWN_VARIABLES}
    if after != before:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        if first & set(sys.modules):
            changed = [k for k in changed if not k.startswith(IMPORT_VARIABLES)]
            restore = {k: v for k, v in after.items() if k.startswith(IMPORT_VARIABLES)}
        else:
            restore = {}
        own = {k: v for k, v in os.environ.items() if k in OWN_VARIABLES}   # pytest's, of this run (or an outer one)
        os.environ.clear()
        os.environ.update({**before, **restore, **own})   # the next test starts clean either way
        if not changed:
            return
        pytest.fail(f"the test left os.environ changed: {changed}", pytrace=False)



@pytest.fixture(autouse=True)
def _quick_tests_start_no_ray(request, _environment_restored, monkeypatch):
    """A quick test that reaches ray.init would start a whole Ray: it must use ray_session instead (and so
    leave the quick loop)."""
    if request.node.get_closest_marker("quick") is None:
        return
    import ray

    def refuse(*args, **kwargs):
        raise RuntimeError("a quick test started Ray: use the ray_session fixture (which marks it 'ray')")

    monkeypatch.setattr(ray, "init", refuse)


# Kept here too: other test modules import them from tests.conftest.
from tests.equipment import free_port, start_announced, stop, wait_for_port  # noqa: E402,F401
from tests.equipment import guard_this_process  # noqa: E402

# Nothing this process starts outlives it, teardown or not (a SIGKILLed run left its servers, cluster and
# jobs running: tests/equipment.py). Kept for the process's life: its exit closes the watchdog's pipe.
WATCHDOG = guard_this_process()

MOTO_READY = re.compile(r"Running on http://127\.0\.0\.1:(\d+)")


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 (on a port it bound itself, confirmed to be it answering); sets
    AWS_* so boto3, pyarrow and GDAL all talk to it."""
    proc, port, log = start_announced([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
                                      timeout=30, pattern=MOTO_READY)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        with pytest.MonkeyPatch.context() as env:   # restored when the session ends
            for name, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                                "AWS_REGION": "us-east-1"}.items():
                env.setenv(name, value)
            yield endpoint
    finally:
        stop(proc)
        log.unlink(missing_ok=True)


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
    # address="local" (never a leftover cluster) and the jobs' own system config (what users run), with
    # one worker-pool setting of the tests': idle workers kept for the next test's job in this process.
    # Ray keeps as many as the node has CPUs (2) and stops the others a second after they idle, and each
    # LLM job's stage actors take two workers from the pool, so every test's job started workers again
    # (each a Python process importing Ray Data and the pipeline). With four kept, tests/jobs/
    # test_caption_job.py started 50 processes instead of 67 (CPU 85 s -> 75 s); six or ten kept, no
    # fewer. A job in a process of its own (RAY_ADDRESS) gets workers of its own either way.
    ctx = ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True,
                   log_to_driver=False, configure_logging=False,
                   _system_config={**RAY_SYSTEM_CONFIG, "num_workers_soft_limit": 4})
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


def stop_limiters(namespace: str) -> int:
    """Stop the account limiters left in ``namespace`` on this process's Ray; how many. The jobs
    start them detached (one budget for every job on the account), so each test's own stayed up
    until the session's Ray stopped: 20 or more idle actor processes by the end of a run, each
    with its share of Ray's upkeep and the log monitor's tailing."""
    import ray
    if not ray.is_initialized():
        return 0
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace))
        except ValueError:   # gone meanwhile
            pass
    return len(names)


@contextmanager
def own_llm_namespace(label: str):
    """For a session or module fixture that runs LLM jobs: account limiters of its own while it runs
    (llm_namespace is the per-test form), stopped and the namespace restored afterwards."""
    import uuid

    from operators.llm.ratelimit import NAMESPACE_ENV
    namespace = f"changeforge-llm-{label}-{uuid.uuid4().hex[:8]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(NAMESPACE_ENV, namespace)
        try:
            yield
        finally:
            stop_limiters(namespace)


@pytest.fixture()
def llm_namespace(monkeypatch):
    """A fresh Ray namespace for this test's account limiters (jobs and run_pool find them there), so
    limits a test sets, or lowers after 429s, never reach another test's pool; stopped after it."""
    import uuid

    from operators.llm.ratelimit import NAMESPACE_ENV
    namespace = f"changeforge-llm-test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(NAMESPACE_ENV, namespace)
    yield namespace
    stop_limiters(namespace)


@pytest.fixture()
def openai_server(openai_test_server_process, llm_namespace):
    """The test server with counters cleared and no faults, no latency, json_schema accepted; the test
    gets limiters of its own (llm_namespace)."""
    server = openai_test_server_process
    server.restore_defaults()
    server.reset()
    yield server
    server.release()   # a test that held requests and failed leaves none waiting
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
