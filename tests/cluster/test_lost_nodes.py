"""The jobs as users run them, submitted with the repository as working dir (``ray job submit
--working-dir .``) to a real two-node Ray cluster (a head and one worker node on 127.0.0.1, token
authentication on), inputs and outputs in the local S3-compatible server, captions through the
OpenAI-compatible test server; and what a cluster does to them: lost worker nodes and killed drivers.
The run finishes through Ray's retries or a resubmission of the same command finishes it, and either
way every scene, pair, slice and caption row is in the output exactly once (history included, not only
the current state), every PNG decodes, no LLM request answered before the kill is paid again, and the
outcome is exactly the undisturbed one (``check_outputs``: the counts of the bundled inputs).

The captions input is the bundled LEVIR-CD samples under new names, and the test server holds every
request after the first few (its hold switch) until the kill has landed, so the captions kill lands with
LLM work in flight however fast or slow the machine is; the pairs job runs at the same time. (The hold,
not the input's size, makes the kill land mid-run: one copy of the samples is enough, and the counts
below are exact for it.) Both tests run on the package's one cluster (tests/cluster/conftest.py), the
node-killing one last.
"""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import psutil
import pytest

from operators.io.images import decode_image
from operators.io.storage import Store
from operators.io.tables import read_table, table_key
from tests.cluster.local_cluster import LocalRayCluster
from tests.conftest import DATA, REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]   # a cluster start, two jobs and a resubmission

NAIP = {p.name.split("_")[-1][:4]: p for p in sorted((DATA / "naip").glob("*.tif"))}
# The bundled inputs' known outcome: the 2017/2020 NAIP pair gives 6 slices at 512 px / stride 256, of
# which ACCEPTED_SLICES pass registration and screening; LEVIR-CD's 12 pairs give 11 captioned pairs
# and one error row, the pair without a mask.
SLICES = 6
ACCEPTED_SLICES = 6
NO_MASK = "test_113_0256"


def s3_env() -> dict:
    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
            "AWS_REGION")
    return {k: os.environ[k] for k in keys}


def llm_env(server) -> dict:
    """The captions job's environment: the test server, and account limiters of the job's own (the
    session's cluster runs several captions jobs)."""
    from operators.llm.ratelimit import NAMESPACE_ENV
    return {**s3_env(), "OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": "test-key",
            NAMESPACE_ENV: f"changeforge-llm-cluster-{uuid.uuid4().hex[:8]}"}


def assert_package_left_data_behind(cluster: LocalRayCluster) -> None:
    """The working dir went up as a package with the jobs (Ray unpacks it under the cluster's temp
    dir), and without the bundled data and the tests (.rayignore)."""
    packages = [p for p in Path(cluster.temp_dir).rglob("working_dir_files/*") if p.is_dir()]
    assert packages, "no working_dir package found on the nodes"
    for pkg in packages:
        assert (pkg / "jobs" / "build_pairs.py").exists()
        assert not (pkg / "data").exists() and not (pkg / "tests").exists()

LEVIR = DATA / "levir-cd"
COPIES = 1                # 12 pairs (one without a mask): 22 requests
REQUESTS = 2 * 11 * COPIES
# Requests outstanding at once across the captions job's pool.
MAX_IN_FLIGHT = 8
PASSED = 6                 # replies before the hold: the run has begun and has most of its work ahead
HELD = 2                   # requests waiting at the server: LLM work in flight at the kill


def upload_inputs(s3_client, bucket: str) -> tuple[str, str, set[str]]:
    for year in ("2017", "2020"):
        s3_client.upload_file(str(NAIP[year]), bucket, f"archive/{NAIP[year].name}")
    names = set()
    for k in range(COPIES):
        for sub in ("A", "B", "label"):
            for path in sorted((LEVIR / sub).glob("*.png")):
                name = f"c{k}_{path.name}"
                s3_client.upload_file(str(path), bucket, f"levir/{sub}/{name}")
                if sub == "A":
                    names.add(Path(name).stem)
    return f"s3://{bucket}/archive", f"s3://{bucket}/levir", names


def commands(archive: str, levir: str, bucket: str) -> dict[str, list[str]]:
    return {
        "pairs": ["python", "jobs/build_pairs.py", "--input", archive, "--output",
                  f"s3://{bucket}/pairs", "--slice-size", "512", "--stride", "256",
                  "--crop-size", "256", "--reference-date", "2021-01-01"],
        "captions": ["python", "jobs/caption.py", "--input", levir, "--output",
                     f"s3://{bucket}/captions", "--model", "test-equipment", "--max-in-flight", str(MAX_IN_FLIGHT)],
    }


def finish(cluster: LocalRayCluster, jobs: dict, cmds: dict, env: dict) -> tuple[dict, set[str]]:
    """Wait for each job; resubmit the same command once for every job that did not succeed (the
    resubmissions run side by side). Returns the results and the names of the resubmitted jobs."""
    results = {name: cluster.wait(job, timeout=900) for name, job in jobs.items()}
    resubmitted = {name for name, r in results.items() if r.status != "SUCCEEDED"}
    again = {name: cluster.submit(cmds[name], working_dir=str(REPO), env_vars=env[name], wait=False)
             for name in sorted(resubmitted)}
    results.update({name: cluster.wait(job, timeout=900) for name, job in again.items()})
    for name, r in results.items():
        print(f"[finish] {name}{' (resubmitted)' if name in resubmitted else ''}: {r.status}, "
              f"{r.seconds:.0f}s", flush=True)
        assert r.status == "SUCCEEDED", r.logs[-4000:]
    return results, resubmitted


def assert_exactly_once(store: Store, table: str, expected: int | None = None,
                        key: tuple[str, ...] = ()) -> list[dict]:
    """Every key (the shards' declared key, else ``key``) once in the table's whole history (every
    run's shards); returns the current state."""
    history = read_table(store, table, current=False)
    assert history is not None, f"{table}/ is empty"
    key = table_key(history.schema) or key
    assert key, f"{table}/ shards carry no key"
    keys = [tuple(r[k] for k in key) for r in history.select(list(key)).to_pylist()]
    dupes = {k for k in keys if keys.count(k) > 1}
    assert not dupes, f"{table}: rows written twice: {sorted(dupes)[:5]}"
    if expected is not None:
        assert len(keys) == expected, (table, len(keys))
    return read_table(store, table).to_pylist()


def check_outputs(s3_bucket: str, names: set[str]) -> None:
    """The outcome of an undisturbed run, exactly: the killed runs change how long, not what."""
    pairs_out = Store(f"s3://{s3_bucket}/pairs")
    assert_exactly_once(pairs_out, "scenes", 2)
    meta = assert_exactly_once(pairs_out, "metadata", SLICES)
    accepted = [m for m in meta if m["status"] == "accepted"]
    assert len(accepted) == ACCEPTED_SLICES, [(m["slice_id"], m["reject_reason"]) for m in meta]
    for m in accepted:
        for rel in (m["image_a"], m["image_b"]):
            assert decode_image(pairs_out.read_bytes(rel)).shape[:2] == (256, 256)
    errors = read_table(pairs_out, "errors")
    assert errors is None or errors.num_rows == 0, errors.to_pylist()

    captions_out = Store(f"s3://{s3_bucket}/captions")
    pairs = assert_exactly_once(captions_out, "pairs", key=("pair_id",))
    no_mask = {n for n in names if n.endswith(NO_MASK)}          # one per copy
    assert len(no_mask) == COPIES
    assert sorted(p["pair_id"] for p in pairs) == sorted(names - no_mask)
    errors = read_table(captions_out, "errors").to_pylist()
    assert sorted((e["item"], e["stage"]) for e in errors) == sorted((n, "prepare") for n in no_mask)
    captions = assert_exactly_once(captions_out, "captions", key=("pair_id", "candidate_index"))
    assert {c["pair_id"] for c in captions} == {p["pair_id"] for p in pairs}
    assert captions_out.list("_work/worklist") == []   # a killed driver's work list went with the rerun


def assert_nothing_paid_twice(s3_bucket: str) -> None:
    """Counted, not timed: every answer the job received was cached with it, so over both runs (the
    usage table's whole history) no request of a pair and stage was paid for more than once. A request
    still in flight when its process died was never received, and is paid once, by the run that
    finished it."""
    usage = read_table(Store(f"s3://{s3_bucket}/captions"), "usage", current=False).to_pylist()
    paid = {}
    for u in usage:
        if u["status"] == "ok" and not u["cached"]:
            paid[(u["item"], u["stage"])] = paid.get((u["item"], u["stage"]), 0) + 1
    assert paid and max(paid.values()) == 1, sorted(k for k, n in paid.items() if n > 1)[:5]


def captions_in_flight(cluster, jobs: dict, server) -> int:
    """Once the captions job has requests waiting at the server (held: LLM work in flight, and the rest
    of its work behind them), the replies so far."""
    server.wait_held(HELD, timeout_s=300)
    answered = sum(server.stats()["ok_by_key"].values())
    assert answered < REQUESTS, "the captions job had finished its requests before the kill"
    assert cluster.status(jobs["captions"]) == "RUNNING"
    return answered


def assert_work_after_kill(server, answered_before_kill: int) -> None:
    assert sum(server.stats()["ok_by_key"].values()) > answered_before_kill, "nothing answered after the kill"


def drivers(cluster: LocalRayCluster, script: str) -> list[psutil.Process]:
    """The driver processes of a submitted job (its entrypoint, run from the unpacked package)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        try:
            if script in " ".join(cmd) and cluster.temp_dir in p.cwd():
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def kill_all(procs: list[psutil.Process]) -> int:
    """SIGKILL each process still alive; how many were killed (a driver that has exited is not an error)."""
    n = 0
    for p in procs:
        try:
            p.kill()
            n += 1
        except psutil.NoSuchProcess:
            continue
    return n


def submit_both(cluster, s3_client, s3_bucket, openai_server):
    """Upload the inputs and submit both jobs (not waiting for them)."""
    archive, levir, names = upload_inputs(s3_client, s3_bucket)
    cmds = commands(archive, levir, s3_bucket)
    openai_server.hold(after=PASSED)   # released once the kill has landed
    env = {"pairs": s3_env(), "captions": llm_env(openai_server)}
    jobs = {name: cluster.submit(cmd, working_dir=str(REPO), env_vars=env[name], wait=False)
            for name, cmd in cmds.items()}
    return names, cmds, env, jobs


def test_lost_worker_nodes_cost_time_not_data(cluster, s3_client, s3_bucket, openai_server):
    names, cmds, env, jobs = submit_both(cluster, s3_client, s3_bucket, openai_server)
    # One node lost in each job's run: the first once the pairs job has catalogued its scenes (its
    # driver alive, slices still to register), its replacement once the captions job has LLM work
    # in flight. (No job status call before the first kill: a live driver process is the evidence.)
    wait_for_shard(Store(f"s3://{s3_bucket}/pairs"), "scenes")
    assert any(p.is_running() for p in drivers(cluster, "jobs/build_pairs.py")), \
        "the pairs job had finished before the node was lost"
    first = cluster.workers[-1]
    assert cluster.kill_node(first) > 0
    cluster.add_node(f"{first}r")          # the autoscaler's replacement
    answered = captions_in_flight(cluster, jobs, openai_server)
    assert cluster.kill_node(f"{first}r") > 0
    openai_server.release()
    # No second replacement: the head finishes both runs alone (this test is the package's last, and a
    # third `ray start` proves nothing the first replacement did not).
    _, resubmitted = finish(cluster, jobs, cmds, env)
    # Time, not data: the drivers run on the head, and what ran on the lost nodes is retried by Ray
    # (tasks, Ray Data's actors, the limiter), so neither run fails and nothing is resubmitted.
    assert resubmitted == set(), f"{sorted(resubmitted)} failed at the node loss and were resubmitted"
    assert_work_after_kill(openai_server, answered)
    check_outputs(s3_bucket, names)
    assert_nothing_paid_twice(s3_bucket)


def wait_for_shard(bucket_store: Store, table: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not bucket_store.list(table):
        if time.time() > deadline:
            raise TimeoutError(f"no {table}/ shard after {timeout}s")
        time.sleep(0.2)


def test_killed_driver_resubmitted_loses_nothing(cluster, s3_client, s3_bucket, openai_server):
    names, cmds, env, jobs = submit_both(cluster, s3_client, s3_bucket, openai_server)
    # Each driver is killed mid-run: the pairs driver once its scenes are catalogued (slices still to
    # register), the captions driver with LLM replies in and more to come.
    # (No `ray job status` call between: its CLI takes seconds the pairs job may finish in. A kill that
    # landed is a live driver killed, and the job found failed and resubmitted below.)
    wait_for_shard(Store(f"s3://{s3_bucket}/pairs"), "scenes")
    assert kill_all(drivers(cluster, "jobs/build_pairs.py")), "the pairs driver had exited before the kill"
    answered = captions_in_flight(cluster, jobs, openai_server)
    assert kill_all(drivers(cluster, "jobs/caption.py")), "no live captions driver to kill"
    openai_server.release()
    results, resubmitted = finish(cluster, jobs, cmds, env)
    assert resubmitted == {"pairs", "captions"}, f"only {resubmitted} failed at the kill and were resubmitted"
    assert_work_after_kill(openai_server, answered)
    assert all("test-key" not in r.logs for r in results.values())
    assert_package_left_data_behind(cluster)
    check_outputs(s3_bucket, names)
    assert_nothing_paid_twice(s3_bucket)
