"""The S3 fault proxy itself: it does inject faults (a client without retries fails), and a client
with adaptive retries gets every object through it intact."""
from __future__ import annotations

import boto3
import botocore.config
import botocore.exceptions
import pytest

from tests.s3_fault_proxy import FaultProxyProcess


@pytest.fixture()
def proxy(s3_endpoint):
    p = FaultProxyProcess(s3_endpoint, fraction=0.0, seed=7)
    try:
        yield p
    finally:
        p.close()


def test_the_proxy_answers_on_a_port_it_bound_itself(proxy):
    from tests.equipment import listener_pids
    assert listener_pids(proxy.port) == {proxy.proc.pid}
    assert proxy.stats()["requests"] == 0


def client(endpoint: str, attempts: int, mode: str = "standard"):
    cfg = botocore.config.Config(retries={"total_max_attempts": attempts, "mode": mode},
                                 connect_timeout=2, read_timeout=10)
    return boto3.client("s3", endpoint_url=endpoint, config=cfg)


def test_without_retries_faults_surface(proxy, s3_bucket):
    proxy.set(fraction=0.3, seed=1)
    c = client(proxy.endpoint, attempts=1)
    failures = 0
    for i in range(40):
        try:
            c.put_object(Bucket=s3_bucket, Key=f"k{i}", Body=b"x" * 100)
        except (botocore.exceptions.ClientError, botocore.exceptions.ConnectionError,
                botocore.exceptions.HTTPClientError):
            failures += 1
    stats = proxy.stats()
    assert sum(stats["faults"].values()) > 0 and failures == sum(stats["faults"].values())


def test_adaptive_retries_get_everything_through(proxy, s3_bucket):
    proxy.set(fraction=0.2, seed=2)
    c = client(proxy.endpoint, attempts=10, mode="adaptive")
    bodies = {f"obj/{i:03d}": bytes([i % 251]) * (1000 + i) for i in range(60)}
    for key, body in bodies.items():
        c.put_object(Bucket=s3_bucket, Key=key, Body=body)
    got = {key: c.get_object(Bucket=s3_bucket, Key=key)["Body"].read() for key in bodies}
    assert got == bodies
    stats = proxy.stats()
    assert all(stats["faults"][k] > 0 for k in ("slowdown", "internal", "drop")), stats
