"""The jobs as users run them: submitted with the repository as working dir (``ray job submit
--working-dir .``) to a real two-node Ray cluster (a head and one worker node on 127.0.0.1, token
authentication on), inputs and outputs in the local S3-compatible server, captions through the
OpenAI-compatible test server. Both jobs are submitted at once and run side by side; each test checks
one of them."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from operators.io.images import decode_image
from operators.io.storage import Store
from operators.io.tables import read_table
from tests.cluster.local_cluster import LocalRayCluster
from tests.conftest import DATA

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]   # a cluster start and two jobs

REPO = Path(__file__).resolve().parents[2]
NAIP = {p.name.split("_")[-1][:4]: p for p in sorted((DATA / "naip").glob("*.tif"))}
LEVIR = DATA / "levir-cd"


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


# The bundled inputs' known outcome: the 2017/2020 NAIP pair gives 6 slices at 512 px / stride 256, of
# which ACCEPTED_SLICES pass registration and screening; LEVIR-CD's 12 pairs give 11 captioned pairs
# and one error row, the pair without a mask.
SLICES = 6
ACCEPTED_SLICES = 6
NO_MASK = "test_113_0256"


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


@pytest.fixture(scope="module")
def submitted(cluster, s3_client, openai_test_server_process):
    """Both jobs submitted at once (they share the cluster as users' jobs do); the tests wait for them."""
    bucket = f"t-submitted-{uuid.uuid4().hex[:8]}"
    s3_client.create_bucket(Bucket=bucket)
    for year in ("2017", "2020"):
        s3_client.upload_file(str(NAIP[year]), bucket, f"archive/{NAIP[year].name}")
    assert upload_folder(s3_client, bucket, LEVIR, "levir") > 0
    server = openai_test_server_process
    server.restore_defaults()
    jobs = {
        "pairs": cluster.submit(
            ["python", "jobs/build_pairs.py", "--input", f"s3://{bucket}/archive", "--output",
             f"s3://{bucket}/pairs", "--slice-size", "512", "--stride", "256", "--crop-size", "256",
             "--reference-date", "2021-01-01"],
            working_dir=str(REPO), env_vars=s3_env(), wait=False),
        "captions": cluster.submit(
            ["python", "jobs/caption.py", "--input", f"s3://{bucket}/levir", "--output",
             f"s3://{bucket}/captions", "--model", "test-equipment"],
            working_dir=str(REPO), env_vars=llm_env(server), wait=False),
    }
    yield {"bucket": bucket, "jobs": jobs}
    for job in jobs.values():   # none left running into the next module's tests
        if cluster.status(job) in ("PENDING", "RUNNING"):
            cluster.stop_job(job)
            cluster.wait(job, timeout=120)


def test_pairs_job_submitted_from_working_dir(cluster, submitted):
    result = cluster.wait(submitted["jobs"]["pairs"], timeout=900)
    assert result.status == "SUCCEEDED", result.logs[-4000:]

    store = Store(f"s3://{submitted['bucket']}/pairs")
    meta = read_table(store, "metadata").to_pylist()
    assert sorted(m["slice_id"] for m in meta) == sorted({m["slice_id"] for m in meta})
    assert len(meta) == SLICES
    accepted = [m for m in meta if m["status"] == "accepted"]
    assert len(accepted) == ACCEPTED_SLICES, [(m["slice_id"], m["reject_reason"]) for m in meta]
    for m in accepted:
        for rel in (m["image_a"], m["image_b"]):
            assert decode_image(store.read_bytes(rel)).shape[:2] == (256, 256)
    # The bundled data, tests and benchmarks stayed behind (.rayignore).
    packages = uploaded_package_dirs(cluster)
    assert packages, "no working_dir package found on the nodes"
    for pkg in packages:
        assert (pkg / "jobs" / "build_pairs.py").exists()
        assert not (pkg / "data").exists() and not (pkg / "tests").exists()


def test_captions_job_submitted_from_working_dir(cluster, submitted):
    result = cluster.wait(submitted["jobs"]["captions"], timeout=900)
    assert result.status == "SUCCEEDED", result.logs[-4000:]

    store = Store(f"s3://{submitted['bucket']}/captions")
    pairs = read_table(store, "pairs").to_pylist()
    errors = read_table(store, "errors").to_pylist()
    # Every pair captioned but the one without a mask, which is the one error row, exactly once.
    expected = sorted(p.stem for p in (LEVIR / "A").glob("*.png"))
    assert sorted(p["pair_id"] for p in pairs) == [p for p in expected if p != NO_MASK]
    assert [(e["item"], e["stage"]) for e in errors] == [(NO_MASK, "prepare")]
    captions = read_table(store, "captions").to_pylist()
    assert {c["pair_id"] for c in captions} == {p["pair_id"] for p in pairs}
    assert "test-key" not in result.logs
