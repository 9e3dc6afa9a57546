"""Sharded Parquet tables in the output store, and the one sink every job writes through.

Operators emit *envelopes*: ``{"_table": name, "_record": json}``. One Ray Data pass can then route
every input row to the table where it ends (``metadata``, ``errors``, ``captions``...), which is how
"every row ends somewhere" holds without running the pipeline twice. Each table has a declared
schema, so shards written by different tasks (one all-null column here, a value there) always read
back as one table with ``pyarrow.parquet.read_table(<out>/<table>/)``.
"""
from __future__ import annotations

import io
import json
import logging
import time
import traceback
import uuid
from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from operators.io.storage import Store

log = logging.getLogger(__name__)

ERRORS_SCHEMA = pa.schema([
    ("item", pa.string()),        # what failed: a scene URI, a pair id, a slice id, a caption pair
    ("stage", pa.string()),       # catalogue, pairing, slicing, registration, captioning, ...
    ("error_type", pa.string()),  # exception class or a short code
    ("message", pa.string()),
    ("job", pa.string()),
    ("run_id", pa.string()),
    ("time", pa.string()),
])


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return None if np.isnan(value) else float(value)
    if isinstance(value, (np.bool_,)):
        return bool(value)
    if isinstance(value, float) and value != value:  # NaN -> null keeps Parquet readers honest
        return None
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def envelope(table: str, record: Mapping[str, Any]) -> dict:
    """Wrap one output record for :class:`TableSink`."""
    return {"_table": table, "_record": json.dumps(_jsonable(dict(record)))}


def error_record(item: str, stage: str, error: BaseException | str, *, error_type: str | None = None,
                 job: str = "", run_id: str = "") -> dict:
    """An ``errors`` row. Messages are kept short and never carry request headers or keys."""
    if isinstance(error, BaseException):
        etype = error_type or type(error).__name__
        message = str(error) or repr(error)
    else:
        etype = error_type or "error"
        message = str(error)
    return {
        "item": str(item), "stage": stage, "error_type": etype, "message": message[:2000],
        "job": job, "run_id": run_id, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def error_envelope(item: str, stage: str, error: BaseException | str, **kw) -> dict:
    if isinstance(error, BaseException) and not isinstance(error, (ValueError, KeyError, OSError)):
        log.debug("error in %s for %s:\n%s", stage, item, traceback.format_exc())
    return envelope("errors", error_record(item, stage, error, **kw))


def records_to_table(records: list[dict], schema: pa.Schema) -> pa.Table:
    cols = {f.name: [r.get(f.name) for r in records] for f in schema}
    return pa.Table.from_pydict(cols, schema=schema)


def write_table_shard(store: Store, table: str, records: list[dict], schema: pa.Schema,
                      run_id: str) -> str | None:
    if not records:
        return None
    buf = io.BytesIO()
    pq.write_table(records_to_table(records, schema), buf, compression="zstd")
    rel = f"{table}/part-{run_id}-{uuid.uuid4().hex[:12]}.parquet"
    store.write_bytes(rel, buf.getvalue())
    return rel


def read_table(store: Store, table: str, schema: pa.Schema | None = None) -> pa.Table | None:
    """All readable shards of ``table``; a damaged shard (crash mid-write) is skipped and logged."""
    parts = []
    for rel in store.list(table, suffixes=(".parquet",)):
        try:
            parts.append(pq.read_table(io.BytesIO(store.read_bytes(rel)), schema=schema))
        except Exception as exc:  # noqa: BLE001 - a damaged shard must not stop a resume
            log.warning("skipping unreadable shard %s: %s", rel, exc)
    if not parts:
        return None
    return pa.concat_tables(parts, promote_options="default")


def finished_keys(store: Store, table: str, key: str) -> set[str]:
    t = read_table(store, table)
    if t is None or key not in t.column_names:
        return set()
    return set(v for v in t.column(key).to_pylist() if v is not None)


def prune_shards(store: Store, table: str, keep_run_id: str) -> int:
    """Delete shards of ``table`` written by runs other than ``keep_run_id`` (used for ``errors``,
    which describe the latest run: what is finished lives in the result tables)."""
    n = 0
    for rel in store.list(table, suffixes=(".parquet",)):
        if f"part-{keep_run_id}-" not in rel:
            store.delete(rel)
            n += 1
    return n


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def split_envelopes(rows: Iterable[Mapping[str, Any]]) -> dict[str, list[dict]]:
    by_table: dict[str, list[dict]] = {}
    for row in rows:
        by_table.setdefault(str(row["_table"]), []).append(json.loads(row["_record"]))
    return by_table


try:  # The sink needs Ray; the pure parts above do not.
    from ray.data import Datasink

    class TableSink(Datasink):
        """Ray Data sink that routes envelopes to sharded Parquet tables under ``root``.

        One shard per table per write task; the driver gets back row counts per table.
        """

        def __init__(self, root: str, schemas: Mapping[str, pa.Schema], run_id: str):
            self.root = root
            self.schemas = dict(schemas)
            self.schemas.setdefault("errors", ERRORS_SCHEMA)
            self.run_id = run_id
            self.counts: dict[str, int] = {}

        def write(self, blocks, ctx) -> dict[str, int]:
            store = Store(self.root)
            by_table: dict[str, list[dict]] = {}
            for block in blocks:
                t = block if isinstance(block, pa.Table) else pa.Table.from_pandas(block)
                for name, recs in split_envelopes(t.to_pylist()).items():
                    by_table.setdefault(name, []).extend(recs)
            counts = {}
            for name, recs in by_table.items():
                if name not in self.schemas:
                    raise KeyError(f"no schema declared for table {name!r}")
                write_table_shard(store, name, recs, self.schemas[name], self.run_id)
                counts[name] = len(recs)
            return counts

        def on_write_complete(self, write_result) -> None:
            totals: dict[str, int] = {}
            for part in write_result.write_returns:
                for name, n in (part or {}).items():
                    totals[name] = totals.get(name, 0) + n
            self.counts = totals

        def get_name(self) -> str:
            return "TableSink"
except ImportError:  # pragma: no cover
    TableSink = None  # type: ignore[assignment]
