"""Sharded Parquet tables in the output store, and the one sink every job writes through.

Tables accumulate across runs: a run appends shards (``<table>/part-<run_id>-<content hash>.parquet``)
and never deletes another run's rows; every row carries its ``run_id``. :func:`read_table` gives the
current state in one call (latest row per key, resolved errors dropped); ``current=False`` gives
the whole history. Plain ``pyarrow.parquet.read_table(<out>/<table>)`` still reads every shard
(the history).

Operators emit *envelopes*: ``{"_table": name, "_record": json}``. One Ray Data pass can then route
every input row to the table where it ends (``metadata``, ``errors``, ``captions``...), which is how
"every row ends somewhere" holds without running the pipeline twice. Each table has a declared
schema, so shards written by different tasks (one all-null column here, a value there) always read
back as one table with ``pyarrow.parquet.read_table(<out>/<table>/)``.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import posixpath
import re
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from operators.io.storage import Store, retry_transient

log = logging.getLogger(__name__)

_ERRORS_COLUMNS = pa.schema([
    ("item", pa.string()),        # what failed: a scene URI, a pair id, a slice id, a caption pair
    ("stage", pa.string()),       # catalogue, pairing, slicing, registration, captioning, ...
    ("error_type", pa.string()),  # exception class or a short code
    ("message", pa.string()),
    ("job", pa.string()),
    ("run_id", pa.string()),
    ("time", pa.string()),
    ("resolved", pa.bool_()),     # true: the item succeeded later (see resolve_errors)
])


_PLAIN = (str, int, bool, type(None))


def _jsonable(value: Any) -> Any:
    # Exact-type fast paths first: a slice record carries thousands of plain values (its
    # screening windows), and the ABC checks below cost more than the JSON encoding.
    t = type(value)
    if t in _PLAIN:
        return value
    if t is float:
        return None if value != value else value
    if t is dict:
        return {k: _jsonable(v) for k, v in value.items()}
    if t is list or t is tuple:
        return [_jsonable(v) for v in value]
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


# -- keys, run ids and the current state -----------------------------------------------------
# Tables accumulate: every run appends shards and never deletes another run's rows. A table's key
# travels in its Parquet schema metadata, so any reader (and a later run) knows which rows are
# versions of one item; the current state is the latest row per key.
KEY_META = b"changeforge.key"


def keyed(schema: pa.Schema, *key: str) -> pa.Schema:
    """``schema`` declaring ``key`` (column names) as the table's key, plus a ``run_id`` column
    (added if missing) so every row says which run wrote it."""
    missing = [k for k in key if k not in schema.names]
    if missing:
        raise KeyError(f"key column(s) {missing} not in schema")
    return with_run_id(schema).with_metadata({**(schema.metadata or {}), KEY_META: ",".join(key).encode()})


def with_run_id(schema: pa.Schema) -> pa.Schema:
    return schema if "run_id" in schema.names else schema.append(pa.field("run_id", pa.string()))


def table_key(schema: pa.Schema | None) -> tuple[str, ...]:
    raw = (schema.metadata or {}).get(KEY_META) if schema is not None else None
    return tuple(raw.decode().split(",")) if raw else ()


# errors/ keeps an item's error (one current row per item and stage) until the item succeeds.
ERRORS_SCHEMA = keyed(_ERRORS_COLUMNS, "item", "stage")
RESOLVED = "Resolved"


def shard_name(table: str, run_id: str, records: list[dict], key: Sequence[str] = ()) -> str:
    """Deterministic for the shard's content: the keys it holds (or all of it, for unkeyed tables),
    so a write retried by Ray (lost node, task retry) replaces its shard instead of adding one."""
    if key:
        content = json.dumps(sorted([[str(r.get(k)) for k in key] for r in records]))
    else:
        content = json.dumps(_jsonable(records), sort_keys=True, default=str)
    digest = hashlib.sha1(content.encode()).hexdigest()[:16]
    return f"{table}/part-{run_id}-{digest}.parquet"


def write_table_shard(store: Store, table: str, records: list[dict], schema: pa.Schema,
                      run_id: str) -> str | None:
    """One Parquet shard of ``records`` (run_id filled in where the schema has the column)."""
    if not records:
        return None
    schema = with_run_id(schema)
    records = [r if r.get("run_id") else {**r, "run_id": run_id} for r in records]
    buf = io.BytesIO()
    pq.write_table(records_to_table(records, schema), buf, compression="zstd")
    rel = shard_name(table, run_id, records, table_key(schema))
    retry_transient(lambda: store.write_bytes(rel, buf.getvalue()), f"write {store.uri(rel)}")
    return rel


def changed_rows(store: Store, table: str, records: list[dict], schema: pa.Schema) -> list[dict]:
    """The records that are new or differ (``run_id`` aside) from the table's current state.

    A rerun recomputes some small tables in full (the scenes it re-catalogues, the pairs it
    re-judges); writing them again would put every row into the history twice, and a reader of the
    raw Parquet would see duplicates. Unchanged rows are left to the run that wrote them."""
    key = table_key(schema)
    current = read_table(store, table) if records and key else None
    if current is None:
        return records
    ignore = {"run_id"}
    names = [n for n in schema.names if n not in ignore]
    have = {tuple(r[k] for k in key): {n: r.get(n) for n in names} for r in current.to_pylist()}
    normal = records_to_table(records, with_run_id(schema)).to_pylist()
    return [rec for rec, row in zip(records, normal)
            if have.get(tuple(row[k] for k in key)) != {n: row.get(n) for n in names}]


class TableReadError(RuntimeError):
    """A shard that exists but cannot be read: named, never skipped (skipping would hide rows)."""


# Columns renamed so that the captions and QA jobs' tables use one vocabulary (0.x -> next release). Readers
# accept the old names for one release: a shard written before the rename reads back under the new name
# (read_table, and operators.review.outputs.read_current). Only where the table holds the old name.
RENAMED_COLUMNS: dict[str, dict[str, str]] = {
    "qa": {"prompt_version_generate": "generate_prompt_version", "prompt_version_judge": "judge_prompt_version",
           "reason": "selection_reason"},
    "pairs": {"prompt_version_generate": "generate_prompt_version", "prompt_version_judge": "judge_prompt_version"},
}


def rename_legacy_columns(table: str, t: pa.Table) -> pa.Table:
    """``t`` (one shard of ``table``) with its deprecated column names replaced by the current ones."""
    renames = {old: new for old, new in RENAMED_COLUMNS.get(table, {}).items()
               if old in t.column_names and new not in t.column_names}
    if not renames:
        return t
    return t.rename_columns([renames.get(c, c) for c in t.column_names])


def _read_shard(store: Store, rel: str, columns: Sequence[str] | None) -> pa.Table:
    data = retry_transient(lambda: store.read_bytes(rel), f"read {store.uri(rel)}")
    name = rel.split("/")[0]
    try:
        pf = pq.ParquetFile(io.BytesIO(data))
        names = pf.schema_arrow.names
        if columns:  # the key (and run_id, resolved) always come along: the current state needs them
            columns = list(dict.fromkeys([*columns, *table_key(pf.schema_arrow), "run_id", "resolved"]))
            old = {new: o for o, new in RENAMED_COLUMNS.get(name, {}).items()}
            columns += [old[c] for c in columns if c in old and c not in names]   # asked by its new name
        t = pf.read(columns=[c for c in columns if c in names] if columns else None)
        return rename_legacy_columns(name, t.replace_schema_metadata({**(pf.schema_arrow.metadata or {})}))
    except Exception as exc:  # noqa: BLE001 - reported with the shard's name
        raise TableReadError(
            f"shard {store.uri(rel)} of table {rel.split('/')[0]!r} is not readable Parquet ({exc}). "
            "Writes are atomic, so it was damaged after it was written: move it away and rerun "
            "(the items it held are redone)") from None


def read_table(store: Store, table: str, schema: pa.Schema | None = None, *, current: bool = True,
               key: Sequence[str] | None = None, columns: Sequence[str] | None = None,
               threads: int = 16) -> pa.Table | None:
    """The table's **current state**: the latest row per key (key from the shards' metadata, or
    ``key``), without rows marked ``resolved`` (errors fixed by a later run). ``current=False``
    gives every row of every run (the history). Shards are read in parallel; transient storage
    errors are retried; an unreadable shard raises :class:`TableReadError` naming it. None when the
    table has no shards."""
    rels = store.list(table, suffixes=(".parquet",))  # sorted: part-<run_id>-... is chronological
    if not rels:
        return None
    want = list(dict.fromkeys([*columns, *(key or ())])) if columns else None
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(rels)))) as pool:
        parts = list(pool.map(lambda rel: _read_shard(store, rel, want), rels))
    k = tuple(key or ()) or next((table_key(p.schema) for p in parts if table_key(p.schema)), ())
    meta = parts[0].schema.metadata
    if schema is not None:
        target = with_run_id(schema)
        if want:  # only the columns read: nulls for every other column, per shard, cost the driver RSS
            read = set(want) | set(k) | {"run_id", "resolved"}
            target = pa.schema([f for f in target if f.name in read], metadata=target.metadata)
        parts = [_conform(p, target) for p in parts]
    t = pa.concat_tables(parts, promote_options="permissive")
    if meta:
        t = t.replace_schema_metadata(meta)
    if current:
        t = current_state(t, k)
    if columns:
        t = t.select([c for c in columns if c in t.column_names])
    return t


def _conform(t: pa.Table, schema: pa.Schema) -> pa.Table:
    """Columns of ``schema`` first (cast), nulls for the ones a (legacy) shard lacks."""
    cols, fields = [], []
    for f in schema:
        if f.name in t.column_names:
            cols.append(t.column(f.name).cast(f.type))
        else:
            cols.append(pa.nulls(t.num_rows, f.type))
        fields.append(f)
    for name in t.column_names:
        if name not in schema.names:
            cols.append(t.column(name))
            fields.append(t.schema.field(name))
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


def current_state(t: pa.Table, key: Sequence[str]) -> pa.Table:
    """Latest row per ``key`` (rows are in write order), minus rows marked ``resolved``."""
    if key and t.num_rows:
        order = pa.array(np.arange(t.num_rows))
        latest = (t.select(list(key)).append_column("__order", order)
                  .group_by(list(key), use_threads=False).aggregate([("__order", "max")]))
        t = t.take(pa.array(np.sort(latest.column("__order_max").to_numpy())))
    if "resolved" in t.column_names and t.num_rows:
        t = t.filter(pc.invert(pc.fill_null(t.column("resolved"), False)))
    return t


def finished_keys(store: Store, table: str, key: str) -> set[str]:
    t = read_table(store, table, columns=[key])
    if t is None or key not in t.column_names:
        return set()
    return set(v for v in t.column(key).to_pylist() if v is not None)


def current_error_items(store: Store) -> set[str]:
    """Items with a current (unresolved) error in ``errors/``."""
    t = read_table(store, "errors", ERRORS_SCHEMA, columns=["item"])
    return set() if t is None else {v for v in t.column("item").to_pylist() if v is not None}


def resolve_errors(store: Store, items: Iterable[str], run_id: str, *, stages: Sequence[str] | None = None,
                   job: str = "") -> int:
    """Mark the current errors of ``items`` (optionally only those of ``stages``) as resolved: an
    error row stays in the current state of ``errors/`` until its item succeeds. Returns how many."""
    items = set(items)
    errs = read_table(store, "errors", columns=["item", "stage"])
    if errs is None or not items:
        return 0
    rows = [r for r in errs.to_pylist() if r["item"] in items and (stages is None or r["stage"] in stages)]
    marks = [{**error_record(r["item"], r["stage"], f"succeeded in run {run_id}", error_type=RESOLVED,
                             job=job, run_id=run_id), "resolved": True} for r in rows]
    write_table_shard(store, "errors", marks, ERRORS_SCHEMA, run_id)
    return len(marks)


def prune_shards(store: Store, table: str, keep_run_id: str) -> int:
    """Deprecated: deletes other runs' shards of ``table``. Kept only so jobs not yet moved to
    accumulating tables still import; new code appends and reads the current state instead
    (:func:`read_table`, :func:`resolve_errors`). The pairs and captions jobs no longer call it."""
    n = 0
    for rel in store.list(table, suffixes=(".parquet",)):
        if f"part-{keep_run_id}-" not in rel:
            store.delete(rel)
            n += 1
    return n


# -- streaming writes: small shards where the work finishes, compacted by the driver ---------
def persist_envelopes(envelopes: Sequence[Mapping[str, Any]], spec: Mapping[str, Any]) -> list[str]:
    """Write ``envelopes`` to one shard per table where they were produced (a Ray task), so rows
    survive whatever happens to the driver next. ``spec`` is :meth:`StreamingTableWriter.spec`.
    Returns the shards written (the driver folds them into bigger ones)."""
    store = Store(spec["root"])
    rels = []
    for name, recs in split_envelopes(envelopes).items():
        if name not in spec["schemas"]:
            raise KeyError(f"no schema declared for table {name!r}")
        recs = [{**spec.get("constants", {}), **r} for r in recs]
        rel = write_table_shard(store, name, recs, spec["schemas"][name], spec["run_id"])
        if rel:
            rels.append(rel)
    return rels


class StreamingTableWriter:
    """Driver side of streamed tables: rows arrive as work finishes (already persisted in small
    shards by the tasks, or not); every ``rows_per_shard`` rows or ``flush_s`` seconds they are
    written as one bigger shard and the small shards it covers are deleted. The driver holds at
    most one shard's worth of rows; a crash at any point loses no persisted row (a merged shard is
    written before the small ones go; duplicates in between are deduplicated on read)."""

    def __init__(self, store: Store, schemas: Mapping[str, pa.Schema], run_id: str, *,
                 rows_per_shard: int = 2000, flush_s: float = 60.0,
                 constants: Mapping[str, Any] | None = None):
        self.store, self.run_id = store, run_id
        self.schemas = {**dict(schemas), "errors": schemas.get("errors", ERRORS_SCHEMA)}
        self.rows_per_shard, self.flush_s = rows_per_shard, flush_s
        self.constants = dict(constants or {})
        self.buffer: dict[str, list[dict]] = {}
        self.small: list[str] = []
        self.counts: dict[str, int] = {}
        self.shards_written = 0
        self._last_flush = time.monotonic()

    def spec(self) -> dict:
        """What a task needs to persist its own rows (small, picklable)."""
        return {"root": self.store.uri(), "schemas": self.schemas, "run_id": self.run_id,
                "constants": self.constants}

    def add(self, envelopes: Iterable[Mapping[str, Any]], persisted: Iterable[str] = ()) -> None:
        for name, recs in split_envelopes(envelopes).items():
            self.buffer.setdefault(name, []).extend({**self.constants, **r} for r in recs)
            self.counts[name] = self.counts.get(name, 0) + len(recs)
        self.small.extend(persisted)
        if (sum(map(len, self.buffer.values())) >= self.rows_per_shard
                or time.monotonic() - self._last_flush >= self.flush_s):
            self.flush()

    def flush(self) -> None:
        merged = set()
        for name, recs in self.buffer.items():
            if name not in self.schemas:
                raise KeyError(f"no schema declared for table {name!r}")
            rel = write_table_shard(self.store, name, recs, self.schemas[name], self.run_id)
            if rel:
                merged.add(rel)
                self.shards_written += 1
        for rel in self.small:
            if rel not in merged:
                self.store.delete(rel)
        self.buffer, self.small = {}, []
        self._last_flush = time.monotonic()


def _persist_block(batch: pa.Table, spec: dict) -> pa.Table:
    rels = persist_envelopes(batch.select(["_table", "_record"]).to_pylist(), spec)
    return batch.append_column("_shards", pa.array([json.dumps(rels)] * batch.num_rows))


def stream_dataset_to_tables(ds, writer: StreamingTableWriter) -> None:
    """Run a Ray dataset of envelopes, each block persisted where it is produced, into ``writer``."""
    persisted = ds.map_batches(_persist_block, fn_kwargs={"spec": writer.spec()},
                               batch_format="pyarrow", batch_size=None, zero_copy_batch=True)
    for batch in persisted.iter_batches(batch_format="pyarrow", batch_size=None):
        shards = sorted({rel for v in batch.column("_shards").to_pylist() for rel in json.loads(v)})
        writer.add(batch.select(["_table", "_record"]).to_pylist(), shards)


def new_run_id() -> str:
    """``<UTC time to the millisecond>-<6 hex>``, e.g. ``20261207T071500123-3fa9c2``. Shards are read in
    run-id order; an id of the older second-precision form (``20261207T071500-...``) sorts before every
    millisecond id of its second and after every earlier second, so old outputs keep their order."""
    ms = int(time.time() * 1000)   # both parts from one integer, so they always agree
    return _utc_second(ms // 1000) + f"{ms % 1000:03d}-" + uuid.uuid4().hex[:6]


def _utc_second(t: float) -> str:
    """A run id's time to the second (``20261207T071500``), the part both forms share."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(t))


# A run id in either form (second or millisecond time) at the start of a shard's name.
RUN_ID = re.compile(r"part-(\d{8}T\d{6}(?:\d{3})?-[0-9a-f]{6})(?:-|\.parquet$)")
# How far ahead of this machine's clock an output's latest run id may be before a job refuses to
# start: waiting out a clock a few seconds fast is cheap, waiting out a wrong one would never end.
MAX_CLOCK_AHEAD_S = 120


def latest_run_id(store: Store, tables: Iterable[str]) -> str:
    """The largest run id among the shards of ``tables`` in ``store`` ('' when there are none): from
    the shards' names (``part-<run_id>-...``), so rows any writer left count, not only recorded runs.
    A name that holds no run id (``part-legacy.parquet``) is not one."""
    latest = ""
    for table in tables:
        for rel in store.list(table, suffixes=(".parquet",)):
            found = RUN_ID.match(posixpath.basename(rel))
            if found:
                latest = max(latest, found.group(1))
    return latest


def run_id_after(latest: str) -> str:
    """A run id that sorts after ``latest``: shards are read in run-id order, so a rerun right after the
    last run (or after a writer whose clock ran a little ahead) must not draw a smaller one (its rows
    would not supersede); a ``latest`` more than MAX_CLOCK_AHEAD_S ahead stops the job instead."""
    run_id = new_run_id()
    ahead = _utc_second(time.time() + MAX_CLOCK_AHEAD_S)
    if latest > ahead:
        raise SystemExit(f"the output's latest run id {latest} is more than {MAX_CLOCK_AHEAD_S} s ahead of this "
                         f"machine's clock (now {run_id[:18]} UTC): one of the clocks is wrong; fix it and run again")
    while run_id <= latest:
        time.sleep(0.002)
        run_id = new_run_id()
    return run_id


def ordered_run_id(store: Store, tables: Iterable[str]) -> str:
    """A run id after every run id among the shards of ``tables``: a job writing to those tables draws
    its run id here, so its rows supersede every earlier run's (and a clock a little ahead's)."""
    return run_id_after(latest_run_id(store, tables))


def split_envelopes(rows: Iterable[Mapping[str, Any]]) -> dict[str, list[dict]]:
    by_table: dict[str, list[dict]] = {}
    for row in rows:
        by_table.setdefault(str(row["_table"]), []).append(json.loads(row["_record"]))
    return by_table


def _define_table_sink():
    """The sink's class, defined on first use (``TableSink``, below): it needs Ray Data, whose import
    (about 0.8 s) the jobs and commands that never start Ray (validate, report, publish, ``--help``,
    ``status``) no longer pay. None without Ray; the pure parts above do not need it."""
    try:
        from ray.data import Datasink
    except ImportError:  # pragma: no cover
        return None

    class TableSink(Datasink):
        """Ray Data sink that routes envelopes to sharded Parquet tables under ``root``.

        One shard per table per write task (``rows_per_shard`` asks Ray Data to hand each write
        task at least that many rows); the driver gets back row counts per table.
        """

        def __init__(self, root: str, schemas: Mapping[str, pa.Schema], run_id: str,
                     rows_per_shard: int | None = None):
            self.root = root
            self.schemas = dict(schemas)
            self.schemas.setdefault("errors", ERRORS_SCHEMA)
            self.run_id = run_id
            self.rows_per_shard = rows_per_shard
            self.counts: dict[str, int] = {}

        @property
        def min_rows_per_write(self) -> int | None:
            return self.rows_per_shard

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
    TableSink.__qualname__ = "TableSink"   # pickled by reference, as a class defined at module level
    return TableSink


def __getattr__(name: str):
    # ``from operators.io.tables import TableSink`` (and pickle's lookup by name) lands here once; the
    # class is then a module global like any other.
    if name == "TableSink":
        sink = globals()["TableSink"] = _define_table_sink()
        return sink
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
