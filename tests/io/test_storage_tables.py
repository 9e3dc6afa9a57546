"""The output store (local and S3 through a local S3-compatible server) and the routed table sink."""
from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operators.io.storage import Store, gdal_env, read_uri
from operators.io.tables import (ERRORS_SCHEMA, envelope, error_envelope, error_record, finished_keys,
                                 latest_run_id, read_table, run_id_after, write_table_shard)

SCHEMA = pa.schema([("key", pa.string()), ("value", pa.float64()), ("tags", pa.list_(pa.int64()))])


def _roundtrip(store: Store):
    store.write_bytes("a/b.bin", b"hello")
    assert store.exists("a/b.bin") and not store.exists("a/missing")
    assert store.read_bytes("a/b.bin") == b"hello"
    assert read_uri(store.uri("a/b.bin")) == b"hello"
    store.write_bytes("a/c.txt", b"x")
    assert store.list("a") == ["a/b.bin", "a/c.txt"]
    assert store.list("a", suffixes=(".txt",)) == ["a/c.txt"]
    store.delete("a/c.txt")
    assert store.list("a") == ["a/b.bin"]
    assert store.list("nothing-here") == []
    # Written in pieces, published whole; a failed write publishes nothing and leaves no temporary.
    with store.open_output("big/doc.json") as f:
        for k in range(3):
            f.write(b"x" * 1000 + str(k).encode())
    assert store.read_bytes("big/doc.json") == b"".join(b"x" * 1000 + str(k).encode() for k in range(3))
    with pytest.raises(RuntimeError):
        with store.open_output("big/half.json") as f:
            f.write(b"half")
            raise RuntimeError("the writer failed")
    assert store.list("big") == ["big/doc.json"]
    if not store.uri().startswith("s3://"):   # list() hides temporaries: look at the folder itself
        import os
        assert os.listdir(store.path("big")) == ["doc.json"]


def test_local_store(tmp_path):
    _roundtrip(Store(str(tmp_path / "out")))


def test_s3_store_and_gdal_settings(s3_bucket):
    _roundtrip(Store(f"s3://{s3_bucket}/prefix"))
    env = gdal_env()
    assert env["AWS_S3_ENDPOINT"].startswith("127.0.0.1:") and env["AWS_HTTPS"] == "NO"


def test_shards_share_one_schema_even_when_a_column_is_all_null(tmp_path):
    store = Store(str(tmp_path))
    write_table_shard(store, "t", [{"key": "a", "value": None, "tags": None}], SCHEMA, "run1")
    write_table_shard(store, "t", [{"key": "b", "value": 2.5, "tags": [1, 2]}], SCHEMA, "run2")
    # The folder reads as one table with the plain pyarrow API users will use.
    t = pq.read_table(str(tmp_path / "t"))
    assert sorted(t.column("key").to_pylist()) == ["a", "b"] and t.schema.field("value").type == pa.float64()
    assert finished_keys(store, "t", "key") == {"a", "b"}


def test_runs_accumulate_and_one_call_gives_the_current_state(tmp_path):
    from operators.io.tables import keyed
    store = Store(str(tmp_path))
    schema = keyed(SCHEMA, "key")
    write_table_shard(store, "t", [{"key": "a", "value": 1.0}, {"key": "b", "value": 1.0}], schema,
                      "20260101T000000-aaaaaa")
    write_table_shard(store, "t", [{"key": "b", "value": 2.0}, {"key": "c", "value": 2.0}], schema,
                      "20260102T000000-bbbbbb")
    now = {r["key"]: (r["value"], r["run_id"]) for r in read_table(store, "t").to_pylist()}
    assert now == {"a": (1.0, "20260101T000000-aaaaaa"), "b": (2.0, "20260102T000000-bbbbbb"),
                   "c": (2.0, "20260102T000000-bbbbbb")}
    assert read_table(store, "t", current=False).num_rows == 4  # the history stays
    assert pq.read_table(str(tmp_path / "t")).num_rows == 4


def test_the_latest_run_id_is_read_from_every_shard_of_the_tables_named(tmp_path):
    """A rerun's id must sort after every row already in the output, whoever wrote it: the largest
    run id among the shards' names of the tables asked about, '' for none."""
    store = Store(str(tmp_path))
    assert latest_run_id(store, ["t", "u"]) == ""
    write_table_shard(store, "t", [{"key": "a", "value": 1.0, "tags": []}], SCHEMA, "20260101T000005-000001")
    write_table_shard(store, "t", [{"key": "a", "value": 2.0, "tags": []}], SCHEMA, "20260101T000004-ffffff")
    store.write_bytes("u/part-20260101T000005-aaaaaa-legacy.parquet", b"")   # another writer's name
    store.write_bytes("v/part-20990101T000000-000000-x.parquet", b"")        # a table not asked about
    store.write_bytes("u/notes.txt", b"")
    assert latest_run_id(store, ["t"]) == "20260101T000005-000001"
    assert latest_run_id(store, ["t", "u"]) == "20260101T000005-aaaaaa"
    assert run_id_after(latest_run_id(store, ["t", "u"])) > "20260101T000005-aaaaaa"
    # Names that hold no run id are not one ('legacy' and 'run2' sort after every date: a job
    # would wait for its clock to pass them, for ever).
    for name in ("part-legacy.parquet", "part-run2-0123.parquet", "part-20260101T000009-xyz123-a.parquet",
                 "part-20260101T00000-aaaaaa-a.parquet", "part-20260101T000009-aaaaaa.tmp.parquet"):
        store.write_bytes(f"u/{name}", b"")
    assert latest_run_id(store, ["t", "u"]) == "20260101T000005-aaaaaa"
    store.write_bytes("u/part-20260101T000007123-aaaaaa.parquet", b"")         # no hash: still a run id
    assert latest_run_id(store, ["t", "u"]) == "20260101T000007123-aaaaaa"


@pytest.mark.quick
def test_a_run_id_far_ahead_of_the_clock_stops_the_job_in_one_line_instead_of_waiting(tmp_path, monkeypatch):
    """An output whose latest run id is more than MAX_CLOCK_AHEAD_S ahead (a writer with a wrong
    clock): waiting it out could take days, so the job refuses at once, naming both times; a clock
    ahead by less is waited out. (The limit made 3 s here, so that the case under it waits 1 s.)"""
    import time
    from operators.io import tables
    assert tables.MAX_CLOCK_AHEAD_S == 120
    monkeypatch.setattr(tables, "MAX_CLOCK_AHEAD_S", 3)
    store = Store(str(tmp_path))
    for ahead_s, refused in ((4.5, True), (86400 * 400, True), (1.0, False)):
        rid = time.strftime("%Y%m%dT%H%M%S", time.gmtime(time.time() + ahead_s)) + "000-ffffff"
        store.write_bytes(f"t/part-{rid}-0123.parquet", b"")
        if refused:
            with pytest.raises(SystemExit, match=f"latest run id {rid} is more than 3 s ahead of this machine's clock"):
                tables.ordered_run_id(store, ["t"])
            store.delete(f"t/part-{rid}-0123.parquet")
        else:
            assert tables.ordered_run_id(store, ["t"]) > rid


def _ids_at(t: float, hexes: str) -> tuple[str, str]:
    """The run ids a writer at time ``t`` draws: the second-precision form older outputs hold, and the
    millisecond form every job now draws (written here from new_run_id's docstring)."""
    import time
    ms = int(t * 1000)
    sec = time.strftime("%Y%m%dT%H%M%S", time.gmtime(ms // 1000))
    return f"{sec}-{hexes}", f"{sec}{ms % 1000:03d}-{hexes}"


@pytest.mark.quick
@settings(deadline=None)
@given(offsets=st.lists(st.tuples(st.floats(-5.0, 0.05), st.booleans(), st.sampled_from(["000000", "ffffff", "7a7a7a"])),
                        min_size=0, max_size=6))
def test_every_job_draws_a_run_id_after_every_shard_of_its_tables_old_form_or_new(tmp_path_factory, offsets):
    """Shards written up to 5 s ago or by a clock up to 50 ms ahead, in either run-id form and with the
    largest suffix: the drawn id sorts after every one (readers take the latest row per key in
    shard-name order), and ids drawn one after another by the jobs keep their order."""
    import time
    from operators.io import tables
    store = Store(str(tmp_path_factory.mktemp("ids")))
    now = time.time()
    written = []
    for i, (dt, old_form, hexes) in enumerate(offsets):
        rid = _ids_at(now + dt, hexes)[0 if old_form else 1]
        store.write_bytes(f"{'tu'[i % 2]}/part-{rid}-0123456789abcdef.parquet", b"")
        written.append(rid)
    first = tables.ordered_run_id(store, ["t", "u"])
    assert all(first > rid for rid in written), (first, written)
    store.write_bytes(f"u/part-{first}-0123456789abcdef.parquet", b"")
    assert tables.ordered_run_id(store, ["t", "u"]) > first


# Times as second, millisecond and the rest: the ends of a second and of a millisecond come up often.
TIMES = st.builds(lambda s, ms, frac: 1_700_000_000 + s + (ms + frac) / 1000, st.integers(0, 2),
                  st.one_of(st.integers(0, 999), st.sampled_from([0, 999])),
                  st.one_of(st.floats(0, 1, exclude_max=True), st.just(0.9999999)))


@pytest.mark.quick
@settings(max_examples=500, deadline=None)
@given(t1=TIMES, t2=TIMES)
def test_run_ids_sort_in_time_order_across_the_old_and_the_new_form(t1, t2):
    """new_run_id is the millisecond form; an old second-form id sorts before every new id of its
    second and later ones, after every new id of earlier seconds; new ids sort by millisecond."""
    from unittest import mock
    from operators.io import tables
    with mock.patch.object(tables.time, "time", return_value=t2):
        drawn = tables.new_run_id()
    assert drawn[:-6] == _ids_at(t2, "")[1] and len(drawn) == 25
    old1, new1 = _ids_at(t1, "ffffff")
    ms1, ms2 = int(t1 * 1000), int(t2 * 1000)
    assert (old1 < drawn) == (ms1 // 1000 <= ms2 // 1000)
    if ms1 != ms2:
        assert (new1 < drawn) == (ms1 < ms2)


def test_a_rerun_writes_only_new_or_changed_rows(tmp_path):
    from operators.io.tables import changed_rows, keyed
    store = Store(str(tmp_path))
    schema = keyed(SCHEMA, "key")
    first = [{"key": "a", "value": 1.0, "tags": [1, 2]}, {"key": "b", "value": 1.0, "tags": None}]
    write_table_shard(store, "t", first, schema, "20260101T000000-aaaaaa")
    # The same rows recomputed (another run_id, ints where the table holds floats) are not new.
    again = [{"key": "a", "value": 1, "tags": [1, 2], "run_id": "x"}, {"key": "b", "value": 1.0}]
    assert changed_rows(store, "t", again, schema) == []
    changed = {"key": "b", "value": 2.0, "tags": None}
    new = {"key": "c", "value": 1.0, "tags": []}
    assert changed_rows(store, "t", again[:1] + [changed, new], schema) == [changed, new]
    assert changed_rows(store, "nothing", first, schema) == first


def test_errors_stay_until_their_item_succeeds(tmp_path):
    from operators.io.tables import resolve_errors
    store = Store(str(tmp_path))
    write_table_shard(store, "errors", [error_record("x", "s1", "bad"), error_record("y", "s1", "bad")],
                      ERRORS_SCHEMA, "20260101T000000-aaaaaa")
    write_table_shard(store, "errors", [error_record("x", "s1", "still bad")], ERRORS_SCHEMA,
                      "20260102T000000-bbbbbb")
    rows = read_table(store, "errors").to_pylist()
    assert sorted((r["item"], r["message"]) for r in rows) == [("x", "still bad"), ("y", "bad")]
    assert resolve_errors(store, ["y"], "20260103T000000-cccccc") == 1
    assert [r["item"] for r in read_table(store, "errors").to_pylist()] == ["x"]


def test_retried_shard_write_leaves_one_shard(tmp_path):
    store = Store(str(tmp_path))
    rows = [{"key": "a", "value": 1.0}, {"key": "b", "value": 2.0}]
    write_table_shard(store, "t", rows, SCHEMA, "run1")
    write_table_shard(store, "t", rows, SCHEMA, "run1")  # Ray retried the task that wrote it
    assert len(store.list("t")) == 1 and read_table(store, "t", current=False).num_rows == 2


def test_corrupt_shard_fails_loudly_by_name(tmp_path):
    store = Store(str(tmp_path))
    write_table_shard(store, "t", [{"key": "a", "value": 1.0}], SCHEMA, "run1")
    (tmp_path / "t" / "part-run3-broken.parquet").write_bytes(b"PAR1 garbage")
    with pytest.raises(Exception, match="part-run3-broken.parquet"):
        read_table(store, "t")


class FlakyStore(Store):
    """Fault injection: the first GET of every shard fails as a dropped S3 connection would."""

    failed: set = set()

    def read_bytes(self, rel: str = "") -> bytes:
        from botocore.exceptions import EndpointConnectionError
        if rel.endswith(".parquet") and rel not in self.failed:
            self.failed.add(rel)
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1/injected")
        return super().read_bytes(rel)


def test_transient_s3_error_on_shard_read_is_retried(s3_bucket):
    root = f"s3://{s3_bucket}/tables"
    for i in range(3):
        write_table_shard(Store(root), "t", [{"key": f"k{i}", "value": float(i)}], SCHEMA, f"run{i}")
    flaky = FlakyStore(root)
    t = read_table(flaky, "t")
    assert sorted(t.column("key").to_pylist()) == ["k0", "k1", "k2"]
    assert len(FlakyStore.failed) == 3  # every shard did fail once


def test_table_sink_routes_every_row(tmp_path, ray_session):
    import ray.data

    def route(row):
        i = row["id"]
        if i % 3 == 0:
            return [error_envelope(f"item{i}", "test", ValueError(f"bad {i}"), job="t", run_id="r")]
        return [envelope("t", {"key": f"k{i}", "value": i / 2, "tags": [i]})]

    ds = ray.data.range(30, override_num_blocks=4).flat_map(route)
    from operators.io.tables import TableSink    # Ray Data's import: here, not in every collecting process
    sink = TableSink(str(tmp_path), {"t": SCHEMA}, "r")
    ds.write_datasink(sink)
    assert sink.counts == {"t": 20, "errors": 10}
    t = read_table(Store(str(tmp_path)), "t")
    e = read_table(Store(str(tmp_path)), "errors")
    assert t.num_rows == 20 and e.num_rows == 10
    assert set(e.column("message").to_pylist()) == {f"bad {i}" for i in range(0, 30, 3)}
    assert e.schema.equals(ERRORS_SCHEMA)


def test_renamed_qa_columns_read_under_their_new_names_for_one_release(tmp_path):
    """A QA output written before the vocabulary change (prompt_version_generate, reason), resumed by a run
    that writes the new names: read_table and the review/publish reader see one set of columns."""
    from operators.language.qa_ops import QA_SCHEMA
    from operators.review.outputs import read_current
    store = Store(str(tmp_path))
    old_schema = pa.schema([pa.field({"generate_prompt_version": "prompt_version_generate",
                                      "judge_prompt_version": "prompt_version_judge",
                                      "selection_reason": "reason"}.get(f.name, f.name), f.type, metadata=f.metadata)
                            for f in QA_SCHEMA], metadata=QA_SCHEMA.metadata)
    old = {"pair_id": "p1", "qa_index": 0, "question_type": "WHAT", "selected": False,
           "prompt_version_generate": "qa_generate.v1", "prompt_version_judge": "qa_judge.v1",
           "reason": "overall 6 below 7"}
    new = {"pair_id": "p2", "qa_index": 0, "question_type": "WHAT", "selected": False,
           "generate_prompt_version": "qa_generate.v2", "judge_prompt_version": "qa_judge.v2",
           "selection_reason": "validator: numbers"}
    write_table_shard(store, "qa", [old], old_schema, "run1")
    write_table_shard(store, "qa", [new], QA_SCHEMA, "run2")
    rows = {r["pair_id"]: r for r in read_table(store, "qa", QA_SCHEMA).to_pylist()}
    assert rows["p1"]["selection_reason"] == "overall 6 below 7" and rows["p1"]["generate_prompt_version"] == "qa_generate.v1"
    assert rows["p2"]["selection_reason"] == "validator: numbers" and rows["p2"]["judge_prompt_version"] == "qa_judge.v2"
    assert "reason" not in rows["p1"]
    # Asked for by the new name only, the old shard's column still comes back.
    some = read_table(store, "qa", QA_SCHEMA, columns=["pair_id", "selection_reason"]).to_pylist()
    assert sorted(r["selection_reason"] for r in some) == ["overall 6 below 7", "validator: numbers"]
    df = read_current(store, "qa")
    assert "reason" not in df.columns and "prompt_version_generate" not in df.columns
    assert sorted(df["selection_reason"]) == ["overall 6 below 7", "validator: numbers"]
    # Only where the table holds the old name: the pairs job's pairs/ keeps its "reason".
    write_table_shard(store, "pairs", [{"pair_id": "x", "reason": "too close in time"}],
                      pa.schema([("pair_id", pa.string()), ("reason", pa.string())]), "run1")
    assert read_table(store, "pairs").to_pylist()[0]["reason"] == "too close in time"
