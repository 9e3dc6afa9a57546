"""A real multi-node Ray cluster on 127.0.0.1 for tests: a head and extra worker nodes started with
the ``ray`` CLI (token authentication on, as Ray 2.59+ does for local clusters), jobs submitted through
the job API with a working dir (what ``ray job submit --working-dir`` does) and polled every few seconds
over HTTP (a ``ray`` CLI call costs about a second of CPU, taken from the jobs under test), and nodes
killed on purpose.

Test equipment. Everything it starts lives under its own temporary directory and ports, and it
stops only what it started (``ray stop`` would kill every Ray on the machine, including other test
sessions').
"""
from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.equipment import kill_marked, marked_processes, reaper, release

RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class JobResult:
    job_id: str
    status: str
    logs: str
    seconds: float


@dataclass
class LocalRayCluster:
    head_cpus: int = 2
    temp_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="cf-ray-"))
    gcs_port: int = field(default_factory=_free_port)
    dashboard_port: int = field(default_factory=_free_port)
    env: dict = field(default_factory=dict)
    nodes: dict = field(default_factory=dict)   # name -> resources marker

    def __post_init__(self):
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
        # Token authentication as on a real cluster, with a token of the cluster's own (never one that a
        # ~/.ray of this machine happens to hold: a new machine has none, and `ray start` creates none).
        token = os.path.join(self.temp_dir, "auth_token")
        with open(token, "w") as f:
            f.write(secrets.token_hex(32))
        # The jobs' entrypoint is `python ...`, found on PATH: this Python's (the tests' venv, activated or
        # not), never another one that happens to come first.
        path = os.pathsep.join([os.path.dirname(sys.executable), base.get("PATH", os.defpath)])
        self.env = {**base, "PATH": path, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token,
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_free_objects_period_milliseconds": "100",
                    **self.env}   # as cluster.yaml
        # Killed without its teardown (SIGTERM, SIGKILL), the test process leaves no cluster running.
        self._watchdog = reaper(self.marks, remove=self.temp_dir)
        try:
            self._start_head()
        except BaseException:
            self.shutdown()   # a head that failed to start may have left its GCS and dashboard running
            raise

    def _start_head(self) -> None:
        self._start(self.temp_dir, "--head", "--node-ip-address", "127.0.0.1", "--port", str(self.gcs_port),
                  "--num-cpus", str(self.head_cpus), "--dashboard-host", "127.0.0.1",
                  "--dashboard-port", str(self.dashboard_port),
                  "--ray-client-server-port", str(_free_port()),
                  "--dashboard-agent-listen-port", str(_free_port()),
                  "--min-worker-port", "0", "--max-worker-port", "0",
                  "--temp-dir", self.temp_dir, "--disable-usage-stats")

    START_ATTEMPTS = 3
    RETRY_PAUSE_S = 2.0   # after a failed attempt only; its processes are already stopped (and waited for)

    def _start(self, own_dir: str, *args: str) -> None:
        """``ray start``, again (after stopping what the failed attempt left) when it fails: Ray gives a
        starting raylet a fixed 30 s to register with the GCS, which a loaded shared machine can miss.
        Not what the tests test; three attempts."""
        for attempt in range(1, self.START_ATTEMPTS + 1):
            try:
                self._ray("start", *args)
                return
            except RuntimeError as exc:
                if attempt == self.START_ATTEMPTS:
                    raise
                print(f"[cluster] ray start attempt {attempt} failed ({str(exc).strip().splitlines()[-1][:120]}); "
                      f"again", flush=True)
                kill_marked((own_dir,))
                time.sleep(self.RETRY_PAUSE_S)

    # -- nodes ------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def add_node(self, name: str, cpus: int = 2) -> None:
        """A worker node on this machine, tagged with a custom resource ``node_<name>``."""
        # Its own temp dir: nodes sharing one would share (and garbage-collect) each other's
        # runtime_env packages, which no two real machines do.
        node_dir = os.path.join(self.temp_dir, f"node-{name}")
        os.makedirs(node_dir, exist_ok=True)
        self._start(node_dir, "--address", self.address, "--node-ip-address", "127.0.0.1",
                  "--temp-dir", node_dir, "--dashboard-agent-listen-port", str(_free_port()),
                  "--num-cpus", str(cpus), "--resources", json.dumps({f"node_{name}": 1}),
                  "--min-worker-port", "0", "--max-worker-port", "0", "--disable-usage-stats")
        self.nodes[name] = cpus
        self.wait_for_nodes(1 + len(self.nodes))

    def alive_nodes(self) -> int:
        """Alive nodes, from the dashboard's state API (0 while it is not up yet)."""
        url = (f"{self.dashboard}/api/v0/nodes?limit=100&filter_keys=state&filter_predicates=%3D"
               f"&filter_values=ALIVE")
        try:
            req = urllib.request.Request(url, headers=self.auth_headers)
            with urllib.request.urlopen(req, timeout=10) as r:
                return len(json.loads(r.read())["data"]["result"]["result"])
        except (OSError, ValueError, KeyError):
            return 0

    def wait_for_nodes(self, n: int, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while self.alive_nodes() < n:
            if time.time() > deadline:
                raise RuntimeError(f"cluster did not reach {n} alive nodes")
            time.sleep(self.POLL_S)

    @property
    def workers(self) -> list[str]:
        """The worker nodes added and not killed, oldest first."""
        return list(self.nodes)

    def kill_node(self, name: str) -> int:
        """SIGKILL a worker node's raylet and every process under it (its workers): a lost node.
        Returns the number of processes killed."""
        raylet = self._raylet_of(name)
        victims = [raylet] + raylet.children(recursive=True)
        for p in victims:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.nodes.pop(name, None)
        return len(victims)

    def _raylet_of(self, name: str) -> psutil.Process:
        """The raylet whose static resources carry ``node_<name>``."""
        for p in marked_processes(self.marks):
            try:
                cmd = p.cmdline()
            except psutil.NoSuchProcess:
                continue
            if cmd and cmd[0].endswith("raylet") and any(
                    a.startswith("--static_resource_list=") and f"node_{name}," in a for a in cmd):
                return p
        raise LookupError(f"no raylet for node {name}")

    # -- jobs ---------------------------------------------------------------------------------------
    # Job status and node polls: one HTTP request to the dashboard each (cheap, unlike a `ray` CLI call),
    # so a finished job or a new node is seen within half a second.
    POLL_S = 0.5

    @property
    def auth_headers(self) -> dict:
        with open(self.env["RAY_AUTH_TOKEN_PATH"]) as f:
            return {"Authorization": f"Bearer {f.read().strip()}"}

    @property
    def client(self):
        """Ray's job API client for this cluster (token authentication by header: this process's own
        Ray, if any, is left alone)."""
        if getattr(self, "_client", None) is None:
            from ray.job_submission import JobSubmissionClient
            self._client = JobSubmissionClient(self.dashboard, headers=self.auth_headers)
        return self._client

    def submit(self, entrypoint: list[str], working_dir: str, env_vars: dict | None = None,
               wait: bool = True, timeout: float = 600) -> str:
        runtime_env = {"working_dir": working_dir, "env_vars": env_vars or {}}
        deadline = time.time() + 120
        while True:
            try:
                job_id = self.client.submit_job(entrypoint=shlex.join(entrypoint), runtime_env=runtime_env)
                break
            except (RuntimeError, ConnectionError) as exc:
                # The head's job agent comes up some seconds after `ray start` returns.
                if "No available agent" not in str(exc) or time.time() > deadline:
                    raise
                time.sleep(1)
        if wait:
            self.wait(job_id, timeout)
        return job_id

    def status(self, job_id: str) -> str:
        """PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
        return str(self.client.get_job_status(job_id).value)

    def wait(self, job_id: str, timeout: float = 600) -> JobResult:
        t0 = time.time()
        while True:
            status = self.status(job_id)
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                return JobResult(job_id, status, self.logs(job_id), time.time() - t0)
            if time.time() - t0 > timeout:
                raise TimeoutError(f"job {job_id} still {status} after {timeout}s")
            time.sleep(self.POLL_S)

    def logs(self, job_id: str) -> str:
        try:
            return self.client.get_job_logs(job_id)
        except RuntimeError as exc:
            return f"(no logs: {exc})"

    def stop_job(self, job_id: str) -> None:
        self.client.stop_job(job_id)

    # -- teardown ---------------------------------------------------------------------------------
    @property
    def marks(self) -> tuple[str, ...]:
        """What marks this cluster's processes (``tests.equipment.marked_processes``): its temp dir and
        its GCS port (Ray's client server carries only the port)."""
        return (self.temp_dir, f":{self.gcs_port}", f"={self.gcs_port}")

    def shutdown(self) -> None:
        kill_marked(self.marks)
        shutil.rmtree(self.temp_dir, ignore_errors=True)   # sessions, logs, spilled objects
        release(self._watchdog)

    def _ray(self, *args: str, check: bool = True, timeout: float = 180, both: bool = False) -> str:
        """Run the ``ray`` CLI; its stdout (and stderr, where it logs statuses, with ``both``)."""
        proc = subprocess.run([RAY, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"ray {' '.join(args[:3])} failed ({proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc.stdout + proc.stderr if both else proc.stdout


# Two logical CPUs a node (on a 2-core machine): with one, two jobs side by side stalled each other, not
# for want of cycles but of accounting -- one job's 0.25-CPU actors on both nodes left no whole CPU for the
# other job's 1-CPU tasks (the pairs job's catalogue waited minutes for the captions job to end).
NODE_CPUS = 2


@contextmanager
def two_node_cluster():
    """A head and one worker node ``w1``, two CPUs each, torn down afterwards."""
    c = LocalRayCluster(head_cpus=NODE_CPUS)
    try:
        c.add_node("w1", cpus=NODE_CPUS)
        yield c
    finally:
        c.shutdown()
