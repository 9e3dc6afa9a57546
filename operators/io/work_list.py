"""A job's work list, kept in the output store and streamed into Ray Data a block at a time.

``ray.data.from_items(todo)`` puts every input row into the object store and keeps it there for the
whole run: 2.5 MB for 6,000 caption pairs, ten times what 600 pairs hold, and about 42 MB for an
archive of 100,000 (benchmarks/memory_scale.py). The work list is written instead as a few Parquet
parts beside the job's other work files (``_work/worklist/<job>-<run id>/``, ``rows_per_part`` rows each, one JSON
string per item so that nested items keep their shape). One read task per block reads its rows from
a part and runs the job's first step on them in the same task, so the object store holds the read
tasks (a part name and a row range each) and that step's outputs, not the input.
"""
from __future__ import annotations

import functools
import json
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from operators.io.storage import Store, retry_transient

WORK_LIST_DIR = "_work/worklist"
ITEM_COLUMN = "item"
ROWS_PER_PART = 512


def write_work_list(store: Store, name: str, items: Iterable[dict],
                    rows_per_part: int = ROWS_PER_PART) -> list[tuple[str, int]]:
    """Write ``items`` as parts of ``rows_per_part`` rows under ``_work/worklist/<name>/`` (name:
    ``<job>-<run id>``); returns each part's relative path and row count, in order."""
    parts, chunk = [], []

    def flush() -> None:
        rel = f"{WORK_LIST_DIR}/{name}/part-{len(parts):05d}.parquet"
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({ITEM_COLUMN: pa.array(chunk, pa.string())}), sink)
        store.write_bytes(rel, sink.getvalue().to_pybytes())
        parts.append((rel, len(chunk)))
        chunk.clear()

    for item in items:
        chunk.append(json.dumps(item, sort_keys=True))
        if len(chunk) >= rows_per_part:
            flush()
    if chunk:
        flush()
    return parts


def delete_work_list(store: Store, name: str) -> None:
    """Remove a run's work list (its items are in the output tables or the errors table by now)."""
    for rel in store.list(f"{WORK_LIST_DIR}/{name}"):
        store.delete(rel)


def delete_stale_work_lists(store: Store, job: str) -> int:
    """Remove the work lists that earlier runs of ``job`` left (a killed driver never reaches its
    own cleanup); other jobs' lists are left alone. Returns how many were removed."""
    names = {rel.split("/")[2] for rel in store.list(WORK_LIST_DIR) if rel.count("/") >= 3}
    stale = sorted(n for n in names if n.startswith(f"{job}-"))
    for name in stale:
        delete_work_list(store, name)
    return len(stale)


@functools.lru_cache(maxsize=4)
def _part(root: str, rel: str) -> pa.Table:
    # A part serves rows_per_part / rows_per_block read tasks; a worker reads it once.
    store = Store(root)
    return pq.read_table(pa.BufferReader(retry_transient(lambda: store.read_bytes(rel), f"read {store.uri(rel)}")))


def read_block(root: str, rel: str, offset: int, rows: int) -> list[pa.Table]:
    """Rows ``offset .. offset + rows`` of one part (a read task's work)."""
    return [_part(root, rel).slice(offset, rows)]


def block_ranges(parts: list[tuple[str, int]], rows_per_block: int) -> list[tuple[str, int, int]]:
    """(part, offset, rows) of every block, in order."""
    step = max(1, rows_per_block)
    return [(rel, offset, min(step, n - offset)) for rel, n in parts for offset in range(0, n, step)]


def read_work_list(store: Store, parts: list[tuple[str, int]], rows_per_block: int, fn=None,
                   fn_kwargs: dict | None = None, num_cpus: float = 0.5):
    """A Ray Dataset of ``fn(item, **fn_kwargs)`` (a list of rows) over a written work list, one task
    per block of ``rows_per_block`` items. Without ``fn``: the work-list rows themselves (one JSON
    item each, in the ``item`` column), for a consumer that prepares items itself.

    The read and ``fn`` run in one task (same CPU request, so Ray Data fuses them): the object
    store then holds the read tasks (a part name and a row range each, freed as they start) and
    ``fn``'s outputs, never a queue of raw items, which a read running ahead of a slow ``fn`` would
    otherwise pile up until the whole input is in the store."""
    import ray.data
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    root, ranges = store.uri(), block_ranges(parts, rows_per_block)

    class WorkListDatasource(Datasource):
        def estimate_inmemory_data_size(self):
            return None

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            # One task per block whatever the parallelism asked: the blocks are cut for the LLM batches.
            return [ReadTask(functools.partial(read_block, root, rel, offset, rows),
                             BlockMetadata(num_rows=rows, size_bytes=None, input_files=None, exec_stats=None))
                    for rel, offset, rows in ranges]

    # override_num_blocks = the read tasks: asked for more, Ray Data would split every block it reads.
    ds = ray.data.read_datasource(WorkListDatasource(), num_cpus=num_cpus, override_num_blocks=max(1, len(ranges)))
    if fn is None:
        return ds
    return ds.flat_map(map_items, fn_kwargs={"fn": fn, **(fn_kwargs or {})}, num_cpus=num_cpus)


def item_of(row: dict) -> dict:
    return json.loads(row[ITEM_COLUMN])


def map_items(row: dict, fn, **kwargs) -> list[dict]:
    """``flat_map`` adapter: ``fn(item, **kwargs)`` on the item a work-list row carries."""
    return fn(item_of(row), **kwargs)
