"""Test equipment: the Ray object store's own accounting, read from the GCS.

Two measures that do not depend on when a sampler happens to run:
- ``store_created()``: bytes of every object created in the store over a block of code (Ray's
  ``cumulative_created_bytes``), a bound on what ever went through it;
- ``store_bytes()``: bytes in use now, read synchronously where the test chooses (e.g. at every batch
  a consumer takes), for claims about what the store holds throughout a run.
"""
from __future__ import annotations

import contextlib


def _store_stats():
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address
    gcs = ray.get_runtime_context().gcs_address
    return get_memory_info_reply(get_state_from_address(gcs)).store_stats


def store_bytes() -> int:
    return int(_store_stats().object_store_bytes_used)


class Created:
    bytes = 0


@contextlib.contextmanager
def store_created():
    """``.bytes``: bytes of all objects created in the object store inside the block (freed or not)."""
    created, before = Created(), int(_store_stats().cumulative_created_bytes)
    try:
        yield created
    finally:
        created.bytes = int(_store_stats().cumulative_created_bytes) - before
