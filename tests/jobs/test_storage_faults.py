"""The pairs job under storage faults: the same S3 archive processed once directly against the local
S3-compatible server and once through a proxy that answers 5 % of requests with 503 SlowDown, 500 or
a dropped connection. boto3 (adaptive retries) and GDAL (GDAL_HTTP_MAX_RETRY) retry; the outputs
must be identical, byte for byte for the PNGs and row for row for the tables.

The faulty run is the job as a user runs it, a process with its own local Ray (so every one of its
workers talks to the proxy); the clean run, its reference, is the same command line through the job's
``main`` on the session's Ray (whose workers talk to the server directly), at the same time."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from jobs import build_pairs
from operators.io.storage import Store
from operators.io.tables import read_table
from tests.conftest import DATA
from tests.s3_fault_proxy import FaultProxyProcess

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
NAIP = {p.name.split("_")[-1][:4]: p for p in sorted((DATA / "naip").glob("*.tif"))}
VOLATILE = {"run_id", "seconds", "cpu_seconds", "started_at", "finished_at"}


def job_args(inp: str, out: str) -> list[str]:
    return ["--input", inp, "--output", out, "--slice-size", "512", "--stride", "256", "--crop-size", "256",
            "--reference-date", "2021-01-01", "--num-cpus", "2"]


def start_pairs_job(endpoint: str, inp: str, out: str, log) -> subprocess.Popen:
    """The job as a user runs it, in its own process and its own local Ray, so that every worker
    talks to ``endpoint``; its output goes to ``log`` (a file: a pipe nobody reads would stall it)."""
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, "-m", "jobs.build_pairs", *job_args(inp, out)],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def stable_rows(store: Store, table: str, key: str) -> list[dict]:
    rows = read_table(store, table).to_pylist()
    return sorted(({k: v for k, v in r.items() if k not in VOLATILE} for r in rows),
                  key=lambda r: str(r.get(key)))


def test_outputs_identical_under_five_percent_storage_faults(s3_endpoint, s3_client, s3_bucket, ray_session):
    for year in ("2016", "2020"):
        s3_client.upload_file(str(NAIP[year]), s3_bucket, f"archive/{NAIP[year].name}")
    inp = f"s3://{s3_bucket}/archive"
    proxy = FaultProxyProcess(s3_endpoint, fraction=0.05, seed=11)
    try:
        with tempfile.TemporaryFile() as log:
            faulty = start_pairs_job(proxy.endpoint, inp, f"s3://{s3_bucket}/faulty", log)
            try:
                clean = build_pairs.main(job_args(inp, f"s3://{s3_bucket}/clean"))
                returncode = faulty.wait(timeout=1200)
            finally:
                if faulty.poll() is None:
                    faulty.kill()
                    faulty.wait(timeout=30)
            log.seek(0)
            output = log.read().decode(errors="replace")
        stats = proxy.stats()
    finally:
        proxy.close()
    assert clean["slices_this_run"] == 6 and clean["errors_this_run"] == 0, clean
    assert returncode == 0, output[-3000:]
    assert sum(stats["faults"].values()) >= 3, stats      # faults were really injected

    a, b = Store(f"s3://{s3_bucket}/clean"), Store(f"s3://{s3_bucket}/faulty")
    for table, key in (("metadata", "slice_id"), ("pairs", "pair_id"), ("scenes", "scene_id")):
        assert stable_rows(a, table, key) == stable_rows(b, table, key), table
    errors = read_table(b, "errors")
    assert errors is None or errors.num_rows == 0
    pngs = sorted(r for r in a.list("") if r.endswith(".png"))
    assert pngs and pngs == sorted(r for r in b.list("") if r.endswith(".png"))
    for rel in pngs:
        assert a.read_bytes(rel) == b.read_bytes(rel), rel
