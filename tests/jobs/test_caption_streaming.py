"""The captions/QA pipeline writes its tables while pairs are still being worked on, not at the end.

On a 2-CPU node the stages' reservations (prepare tasks at half a CPU, LLM actors at a quarter) left
no whole CPU for a default write task until every pair was done: all rows waited in the object
store (growing with the input) and reached the output only at the end."""
import os
import time

import pytest

from operators.llm.job_passes import run_stages
from operators.io.storage import Store
from operators.io import tables   # its TableSink (a Ray Data sink) is read in the tests: collection stays without Ray Data
from operators.io.tables import envelope, read_table
from operators.llm.client import LLMConfig, LLMRequest, Secret
from operators.llm.stage import PoolConfig, StageSpec
from operators.llm.usage import USAGE_SCHEMA
from tests.object_store import store_created

pytestmark = pytest.mark.slow
SCHEMA = {"type": "object", "required": ["answer"], "additionalProperties": False,
          "properties": {"answer": {"type": "string"}}}


def slow_prepare(item: dict) -> list[dict]:
    time.sleep(0.1)   # reading and encoding a pair's images, which the row then carries
    return [envelope("_ask", dict(item, images="x" * 300_000))]


def build_request(record: dict) -> LLMRequest:
    return LLMRequest(item=record["pair_id"], schema=SCHEMA, schema_name="answer", cache_parts={},
                      messages=[{"role": "user", "content": f"What changed in {record['pair_id']}?"}])


def handle_result(record: dict, result) -> list[dict]:
    return [envelope("errors", {"item": record["pair_id"], "stage": "done", "error_type": "Done",
                                "message": f"answered at {time.time():.3f}"})]


def shards_seen(folder):
    """A result handler that records how many shards of the output table existed when it answered."""
    def handle(record: dict, result) -> list[dict]:
        shards = len(list(folder.glob("*.parquet"))) if folder.exists() else 0
        return [envelope("errors", {"item": record["pair_id"], "stage": "done", "error_type": "Done",
                                    "message": f"shards already written {shards}"})]
    return handle


def ask_stage(server, handle) -> StageSpec:
    return StageSpec(name="ask", input_table="_ask", build_request=build_request, handle_result=handle,
                     llm=LLMConfig(model="m", base_url=server.base_url, use_cache=False),
                     api_key=Secret.from_source("env:CHANGEFORGE_TEST_NO_KEY"))


def test_rows_reach_the_tables_while_pairs_are_still_worked_on(ray_session, openai_server, tmp_path):
    todo = [{"pair_id": f"p{i:03d}"} for i in range(160)]
    openai_server.configure(latency_ms=100)
    stage = ask_stage(openai_server, handle_result)
    second = StageSpec(**{**stage.__dict__, "name": "again", "input_table": "_again",
                          "handle_result": shards_seen(tmp_path / "errors")})
    stage.handle_result = lambda record, result: [envelope("_again", record)]
    run_stages(todo, slow_prepare, {}, [stage, second], PoolConfig(batch_size=4, concurrent_batches=2), tables.TableSink(str(tmp_path), {"usage": USAGE_SCHEMA}, "run1"),
               work=Store(str(tmp_path)), job="streaming", run_id="run1",
               limiter=None, progress_every_s=60)
    rows = read_table(Store(str(tmp_path)), "errors").to_pylist()
    assert sorted(r["item"] for r in rows) == [t["pair_id"] for t in todo]
    # Counted, not timed: written only at the end, every answer would have seen no shard at all.
    seen = [int(r["message"].split()[-1]) for r in rows]
    assert sum(n > 0 for n in seen) >= 16, f"answers that found rows already in the table: {sum(n > 0 for n in seen)}"


def pid_prepare(item: dict) -> list[dict]:
    # 300 KB a pair, as a pair's encoded images; and which process prepared it.
    return [envelope("_ask", dict(item, images="x" * 300_000, prepared_in=os.getpid()))]


def pid_result(record: dict, result) -> list[dict]:
    return [envelope("errors", {"item": record["pair_id"], "stage": "done", "error_type": "Done",
                                "message": f"{record['prepared_in']} {os.getpid()}"})]


def test_prepared_images_stay_in_the_actor_and_out_of_the_object_store(ray_session, openai_server, tmp_path):
    # 160 pairs x 300 KB = 48 MB prepared. Carried through the object store (a prepare step of its
    # own, then from stage to stage), a batch of 4 is a 1.2 MB block there and several queue at once.
    todo = [{"pair_id": f"p{i:03d}"} for i in range(160)]
    openai_server.configure(latency_ms=50)
    with store_created() as created:
        run_stages(todo, pid_prepare, {}, [ask_stage(openai_server, pid_result)],
                   PoolConfig(batch_size=4, concurrent_batches=2),
                   tables.TableSink(str(tmp_path), {"usage": USAGE_SCHEMA}, "run1"), work=Store(str(tmp_path)),
                   job="inactor", run_id="run1", limiter=None, progress_every_s=60)
    rows = read_table(Store(str(tmp_path)), "errors").to_pylist()
    assert sorted(r["item"] for r in rows) == [t["pair_id"] for t in todo]
    # Prepared in the process that sent the pair's request, and never a block in the store.
    assert all(r["message"].split()[0] == r["message"].split()[1] for r in rows)
    # Ray's own count of every byte created in the store during the run (it cannot miss a short peak):
    # the work list and the finished rows, never the 48 MB of prepared pairs.
    assert created.bytes < 4 * 2**20, f"{created.bytes / 2**20:.1f} MB went through the object store"


def stamp_prepare(item: dict, path: str) -> list[dict]:
    with open(path, "a") as f:
        f.write(f"{time.time():.3f}\n")
    return [dict(item, images="x" * 1000)]


class SlowStartingStage:
    """An LLM stage's actor as the pipeline sees it: seconds of start-up (imports, a client)."""

    def __init__(self, path: str):
        time.sleep(3)
        with open(path, "w") as f:
            f.write(f"{time.time():.3f}\n")

    def __call__(self, batch):
        return batch


def test_no_pair_is_prepared_before_the_llm_actors_are_up(ray_session, tmp_path):
    # Work read before the LLM actors are up has no consumer yet: configure_pipeline makes the
    # pipeline wait for them (and fail with a timeout if they never start).
    import ray.data

    from operators.llm.job_passes import configure_pipeline
    from operators.io.work_list import read_work_list, write_work_list

    ctx = ray.data.DataContext.get_current()
    saved = ctx.wait_for_min_actors_s
    try:
        configure_pipeline(PoolConfig(max_store_mb=0, actor_start_timeout_s=120))
        store = Store(str(tmp_path))
        parts = write_work_list(store, "t-run", [{"pair_id": f"p{i:02d}"} for i in range(32)])
        prepared, ready = tmp_path / "prepared.txt", tmp_path / "ready.txt"
        ds = read_work_list(store, parts, 8, stamp_prepare, {"path": str(prepared)}).map_batches(
            SlowStartingStage, fn_constructor_args=(str(ready),), batch_size=8, num_cpus=0.25,
            compute=ray.data.ActorPoolStrategy(size=1))
        assert sorted(r["pair_id"] for r in ds.take_all()) == [f"p{i:02d}" for i in range(32)]
    finally:
        ctx.wait_for_min_actors_s = saved
    first_prepared = min(float(t) for t in prepared.read_text().split())
    assert first_prepared >= float(ready.read_text())
