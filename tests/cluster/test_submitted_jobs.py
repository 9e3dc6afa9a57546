"""The jobs as users run them: ``ray job submit --working-dir .`` against a real two-node Ray cluster
(a head and one worker node on 127.0.0.1, token authentication on), inputs and outputs in the local
S3-compatible server, captions through the OpenAI-compatible test server."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from operators.io.images import decode_image
from operators.io.storage import Store
from operators.io.tables import read_table
from tests.cluster.local_cluster import LocalRayCluster, two_node_cluster
from tests.conftest import DATA

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]   # a cluster start, two jobs and a resubmission

REPO = Path(__file__).resolve().parents[2]
NAIP = {p.name.split("_")[-1][:4]: p for p in sorted((DATA / "naip").glob("*.tif"))}
LEVIR = DATA / "levir-cd"


def s3_env() -> dict:
    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
            "AWS_REGION")
    return {k: os.environ[k] for k in keys}


@pytest.fixture(scope="module")
def cluster(s3_endpoint):
    with two_node_cluster() as c:
        yield c


def upload_folder(s3_client, bucket: str, folder: Path, prefix: str) -> int:
    n = 0
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            s3_client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}")
            n += 1
    return n


def uploaded_package_dirs(cluster: LocalRayCluster) -> list[Path]:
    """The working-dir packages Ray unpacked on the nodes (under the cluster's temp dir)."""
    return [p for p in Path(cluster.temp_dir).rglob("working_dir_files/*") if p.is_dir()]


def test_pairs_job_submitted_from_working_dir(cluster, s3_client, s3_bucket):
    for year in ("2017", "2020"):
        s3_client.upload_file(str(NAIP[year]), s3_bucket, f"archive/{NAIP[year].name}")
    out = f"s3://{s3_bucket}/pairs"
    job = cluster.submit(
        ["python", "jobs/build_pairs.py", "--input", f"s3://{s3_bucket}/archive", "--output", out,
         "--slice-size", "512", "--stride", "256", "--crop-size", "256",
         "--reference-date", "2021-01-01"],
        working_dir=str(REPO), env_vars=s3_env(), wait=False)
    result = cluster.wait(job, timeout=900)
    assert result.status == "SUCCEEDED", result.logs[-4000:]

    store = Store(out)
    meta = read_table(store, "metadata").to_pylist()
    assert sorted(m["slice_id"] for m in meta) == sorted({m["slice_id"] for m in meta})
    assert len(meta) == 6
    for m in meta:
        if m["status"] == "accepted":
            for rel in (m["image_a"], m["image_b"]):
                assert decode_image(store.read_bytes(rel)).shape[:2] == (256, 256)
    # The bundled data, tests and benchmarks stayed behind (.rayignore).
    packages = uploaded_package_dirs(cluster)
    assert packages, "no working_dir package found on the nodes"
    for pkg in packages:
        assert (pkg / "jobs" / "build_pairs.py").exists()
        assert not (pkg / "data").exists() and not (pkg / "tests").exists()


def test_captions_job_submitted_from_working_dir(cluster, s3_client, s3_bucket, openai_server):
    n = upload_folder(s3_client, s3_bucket, LEVIR, "levir")
    assert n > 0
    out = f"s3://{s3_bucket}/captions"
    env = {**s3_env(), "OPENAI_BASE_URL": openai_server.base_url, "OPENAI_API_KEY": "test-key"}
    job = cluster.submit(
        ["python", "jobs/caption.py", "--input", f"s3://{s3_bucket}/levir", "--output", out,
         "--model", "test-equipment"],
        working_dir=str(REPO), env_vars=env, wait=False)
    result = cluster.wait(job, timeout=900)
    assert result.status == "SUCCEEDED", result.logs[-4000:]

    store = Store(out)
    pairs = read_table(store, "pairs").to_pylist()
    errors = read_table(store, "errors")
    errors = errors.to_pylist() if errors is not None else []
    # Every pair ends in pairs/ or errors/, exactly once.
    ids = [p["pair_id"] for p in pairs] + [e["item"] for e in errors]
    assert sorted(ids) == sorted(p.stem for p in (LEVIR / "A").glob("*.png"))
    assert "test-key" not in result.logs
