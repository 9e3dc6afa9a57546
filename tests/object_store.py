"""Test equipment: the Ray object store's bytes in use, and their peak over a block of code."""
from __future__ import annotations

import contextlib
import threading
import time


def store_bytes() -> int:
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address
    gcs = ray.get_runtime_context().gcs_address
    return int(get_memory_info_reply(get_state_from_address(gcs)).store_stats.object_store_bytes_used)


class StorePeak:
    """Peak bytes in use above the level at entry (``.bytes``), sampled every ``every_s``."""

    def __init__(self, every_s: float = 0.02):
        self.every_s, self.bytes = every_s, 0


@contextlib.contextmanager
def store_peak(every_s: float = 0.02):
    peak, base, stop = StorePeak(every_s), store_bytes(), threading.Event()

    def sample():
        while not stop.is_set():
            peak.bytes = max(peak.bytes, store_bytes() - base)
            time.sleep(peak.every_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        stop.set()
        sampler.join()
