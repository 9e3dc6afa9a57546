"""One multi-node cluster for all of tests/cluster (a cluster start costs ~10-50 s of a loaded 2-core
machine): a head and a worker node with two CPUs each, started at the first cluster test and stopped
after the last. The test that kills worker nodes runs last, so the others see the cluster as
started."""
from __future__ import annotations

import pytest

from tests.cluster.local_cluster import two_node_cluster

NODE_KILLING = ("test_lost_worker_nodes_cost_time_not_data",)


def pytest_collection_modifyitems(config, items):
    """Within tests/cluster, the node-killing test after the others (the rest of the order unchanged)."""
    slots = [i for i, item in enumerate(items) if "tests/cluster/" in item.nodeid]
    ordered = sorted((items[i] for i in slots), key=lambda item: item.originalname in NODE_KILLING)
    for i, item in zip(slots, ordered):
        items[i] = item


@pytest.fixture(scope="package")
def cluster(s3_endpoint):
    """The package's two-node cluster (torn down after the last cluster test)."""
    with two_node_cluster() as c:
        yield c
