"""Test equipment: one Ray head on 127.0.0.1 for a chain's steps to attach to (``RAY_ADDRESS``, as on a
cluster), instead of a local Ray started by each step. On a loaded machine a starting Ray node can miss
Ray's fixed 30 s start-up limit; the head's start is tried a bounded number of times, and whatever a
failed start left running is stopped (only this head's processes: tests.cluster.local_cluster)."""
from __future__ import annotations

import tempfile
from contextlib import contextmanager

from tests.cluster.local_cluster import LocalRayCluster, _free_port


@contextmanager
def ray_head(cpus: int = 2, tries: int = 3):
    for attempt in range(tries):
        temp_dir, port = tempfile.mkdtemp(prefix="cf-ray-"), _free_port()
        try:
            head = LocalRayCluster(head_cpus=cpus, temp_dir=temp_dir, gcs_port=port)
        except RuntimeError:
            left = LocalRayCluster.__new__(LocalRayCluster)     # what the failed start left behind
            left.temp_dir, left.gcs_port = temp_dir, port
            left.shutdown()
            if attempt == tries - 1:
                raise
            continue
        try:
            yield head
        finally:
            head.shutdown()
        return
