"""The captions and QA jobs' work list: written to the output store, read back a block at a time,
and never held whole in the object store (benchmarks/memory_scale.py, issue 10 item 5)."""
import time

import pytest

from operators.io.storage import Store
from operators.io.work_list import (WORK_LIST_DIR, block_ranges, delete_stale_work_lists, delete_work_list, item_of, read_block,
                                    read_work_list, write_work_list)
from tests.object_store import store_bytes


def items(n: int, pad: int = 0) -> list[dict]:
    # Nested values, as the QA job's items carry (context captions, mask facts).
    return [{"pair_id": f"p{k:05d}", "split": "train", "context_captions": [f"caption {k}", "b"],
             "facts": {"car": k / 7, "none": None}, "pad": "x" * pad} for k in range(n)]


def read_back(store: Store, parts, rows_per_block: int) -> tuple[list[dict], list[int]]:
    back, sizes = [], []
    for rel, offset, rows in block_ranges(parts, rows_per_block):
        for block in read_block(store.uri(), rel, offset, rows):
            sizes.append(block.num_rows)
            back.extend(item_of(r) for r in block.to_pylist())
    return back, sizes


def test_every_item_comes_back_once_in_order_in_small_blocks(tmp_path):
    store = Store(str(tmp_path))
    todo = items(1100)
    parts = write_work_list(store, "run1", todo, rows_per_part=512)
    assert [n for _, n in parts] == [512, 512, 76]
    back, sizes = read_back(store, parts, 8)
    assert back == todo
    assert max(sizes) == 8 and len(sizes) == 64 + 64 + 10
    delete_work_list(store, "run1")
    assert store.list(WORK_LIST_DIR) == []


def test_a_rerun_removes_what_a_killed_run_of_its_job_left(tmp_path):
    store = Store(str(tmp_path))
    write_work_list(store, "caption-20260101T000000-aaaaaa", items(3))   # a driver killed mid-run
    write_work_list(store, "qa-20260101T000000-bbbbbb", items(3))        # another job, maybe running
    assert delete_stale_work_lists(store, "caption") == 1
    assert store.list(WORK_LIST_DIR) == [f"{WORK_LIST_DIR}/qa-20260101T000000-bbbbbb/part-00000.parquet"]


def test_work_list_on_s3(s3_bucket):
    store = Store(f"s3://{s3_bucket}/worklist-test")
    todo = items(20)
    parts = write_work_list(store, "run2", todo, rows_per_part=16)
    assert read_back(store, parts, 4)[0] == todo
    delete_work_list(store, "run2")
    assert store.list(WORK_LIST_DIR) == []


def tag(item: dict, suffix: str = "") -> list[dict]:
    return [{"pair_id": item["pair_id"] + suffix, "pad": item["pad"]}]


@pytest.mark.slow
def test_the_object_store_does_not_hold_the_whole_input(ray_session, tmp_path):
    # 3,000 items of 2 KB: 6 MB of input. ray.data.from_items keeps all of it in the object store for
    # the whole run, and so would a separate read running ahead of a slower first step; here the
    # store holds the first step's outputs in flight.
    store = Store(str(tmp_path))
    todo = items(3000, pad=2000)
    parts = write_work_list(store, "run3", todo)
    seen, held = [], []
    base = store_bytes()
    # What the store holds, read at every batch the consumer takes (not by a sampler that a loaded
    # machine may starve): from_items holds the whole input from the dataset's creation to its end, so
    # it would show at every one of these readings.
    ds = read_work_list(store, parts, 8, tag, {"suffix": "-done"})
    for batch in ds.iter_batches(batch_size=8, batch_format="pyarrow", prefetch_batches=1):
        seen.extend(batch.column("pair_id").to_pylist())
        held.append(store_bytes() - base)
        time.sleep(0.002)   # a consumer slower than the first step, as the LLM stages are
    assert sorted(seen) == [t["pair_id"] + "-done" for t in todo]
    assert len(held) == 375 and max(held) < 3 * 2**20, \
        f"object store held up to {max(held) / 2**20:.1f} MB of a 6 MB input"


@pytest.mark.slow
def test_one_task_per_block_of_the_size_asked(ray_session, tmp_path):
    # A block is one LLM batch: it must stay rows_per_block items, and Ray Data, asked for more
    # blocks than there are read tasks, would split them.
    store = Store(str(tmp_path))
    parts = write_work_list(store, "run4", items(100), rows_per_part=64)
    blocks = read_work_list(store, parts, 8, tag).materialize()
    assert blocks.num_blocks() == 13 and blocks.count() == 100
    assert "ReadWorkList->FlatMap(map_items)" in blocks.stats()
