"""The output store (local and S3 through a local S3-compatible server) and the routed table sink."""
from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from operators.io.storage import Store, gdal_env, read_uri
from operators.io.tables import (ERRORS_SCHEMA, TableSink, envelope, error_envelope, finished_keys,
                              prune_shards, read_table, write_table_shard)

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
    # A damaged shard (a crash mid-write on some filesystem) is skipped, not fatal.
    (tmp_path / "t" / "part-run3-broken.parquet").write_bytes(b"PAR1 garbage")
    assert read_table(store, "t").num_rows == 2
    assert prune_shards(store, "t", keep_run_id="run2") == 2
    assert read_table(store, "t").column("key").to_pylist() == ["b"]


def test_table_sink_routes_every_row(tmp_path, ray_session):
    import ray.data

    def route(row):
        i = row["id"]
        if i % 3 == 0:
            return [error_envelope(f"item{i}", "test", ValueError(f"bad {i}"), job="t", run_id="r")]
        return [envelope("t", {"key": f"k{i}", "value": i / 2, "tags": [i]})]

    ds = ray.data.range(30, override_num_blocks=4).flat_map(route)
    sink = TableSink(str(tmp_path), {"t": SCHEMA}, "r")
    ds.write_datasink(sink)
    assert sink.counts == {"t": 20, "errors": 10}
    t = read_table(Store(str(tmp_path)), "t")
    e = read_table(Store(str(tmp_path)), "errors")
    assert t.num_rows == 20 and e.num_rows == 10
    assert set(e.column("message").to_pylist()) == {f"bad {i}" for i in range(0, 30, 3)}
    assert e.schema.equals(ERRORS_SCHEMA)
