"""Ingest: a Label Studio export appended to the dataset's annotation history, and the state derived
from all of it (masks, ``annotation_state/``, ``annotation_pending/``, ``labels/``, the summary).

Tables in the dataset (all append-only; readers take the latest row per key):

- ``annotations/``: the history (:data:`operators.annotation.history.HISTORY_SCHEMA`), never pruned.
- ``annotation_state/``: one row per pair in the loop (status, reason, annotator, checker, expert,
  agreement, batch, which annotation is the mask).
- ``annotation_pending/``: the pairs without a mask (status and reason); a pair that gets its mask is
  marked ``resolved``.
- ``annotation_exports/``: which pairs an export sent out, and to which queue.

Derived rows and files are written only where they differ from what is there, so the same export
ingested twice leaves every byte of the dataset as it was.
"""
from __future__ import annotations

import functools
import json
import posixpath
import time

import numpy as np
import pyarrow as pa

from operators.annotation.decisions import (TASK_ROW, WITH_MASK, DecisionConfig, PairDecision, decide_all,
                                            history_key, overlap)
from operators.annotation.history import HISTORY_SCHEMA, history_rows, new_rows, withdrawals
from operators.annotation.results import class_masks
from operators.annotation.scheme import (DEFAULT_CLASSES, SCHEME_FILE, ChangeClass, parse_classes, read_scheme,
                                         write_scheme)
from operators.annotation.summary import SUMMARY_FILE, build_summary
from operators.io.images import decode_image, encode_png
from operators.io.layout import discover_pairs
from operators.io.storage import Store
from operators.io.tables import (ERRORS_SCHEMA, error_record, keyed, read_table, records_to_table,
                                 write_table_shard)
from operators.io.tables import ordered_run_id as tables_ordered_run_id
from operators.pairs.labels.labels import LABELS_SCHEMA, merge_label_maps

JOB = "annotate"

STATE_SCHEMA = keyed(pa.schema([
    ("pair_id", pa.string()), ("split", pa.string()), ("status", pa.string()), ("reason", pa.string()),
    ("annotations", pa.int32()), ("skipped", pa.int32()), ("agreement", pa.float64()),
    ("per_class", pa.string()), ("annotator", pa.string()), ("checker", pa.string()), ("expert", pa.string()),
    ("merged_from", pa.string()), ("batch", pa.int64()), ("instance", pa.string()), ("withdrawn", pa.int32()),
    ("run_id", pa.string()),
]), "pair_id")
PENDING_SCHEMA = keyed(pa.schema([
    ("pair_id", pa.string()), ("split", pa.string()), ("task_id", pa.int64()), ("status", pa.string()),
    ("annotations", pa.int32()), ("pair_agreement", pa.float64()), ("reason", pa.string()),
    ("resolved", pa.bool_()), ("run_id", pa.string()),
]), "pair_id")
EXPORTS_SCHEMA = keyed(pa.schema([
    ("pair_id", pa.string()), ("queue", pa.string()), ("output", pa.string()), ("run_id", pa.string()),
]), "pair_id", "queue")


TABLES = ("annotations", "annotation_state", "annotation_pending", "annotation_exports", "labels", "errors")


def ordered_run_id(store: Store, tables=TABLES) -> str:
    """A run id after every run id of the annotation tables: readers take the latest row per key in
    shard-name order, and two ingests within one second must not swap places."""
    return tables_ordered_run_id(store, tables)


# -- the scheme --------------------------------------------------------------------------------------
def _same(a: list[ChangeClass], b: list[ChangeClass]) -> bool:
    return [(c.name, c.image, c.folder) for c in a] == [(c.name, c.image, c.folder) for c in b]


def resolve_classes(dataset: Store, given: str, option: str = "--classes") -> list[ChangeClass]:
    """The dataset's scheme (``label_classes.json``) when it has one, else ``given`` (or the default),
    written into the dataset. A ``given`` that contradicts the dataset's scheme is a one-line error."""
    have = read_scheme(dataset)
    wanted = parse_classes(given) if given else None
    if have is not None:
        if wanted is not None and not _same(have, wanted):
            raise ValueError(f"{option} {given!r} contradicts the dataset's {SCHEME_FILE} "
                             f"({','.join(f'{c.name}:{c.image}' for c in have)}); leave {option} out or fix one")
        return have
    classes = wanted or parse_classes(DEFAULT_CLASSES)
    write_scheme(dataset, classes)
    return classes


# -- small helpers -----------------------------------------------------------------------------------
def _prefix(pair: dict) -> str:
    base = posixpath.dirname(posixpath.dirname(pair["a_rel"]))
    return f"{base}/" if base else ""


def _stem(pair: dict) -> str:
    return posixpath.basename(pair["pair_id"])


def _latest(store: Store, table: str, schema: pa.Schema, key: str = "pair_id") -> dict:
    """{key: latest row} over every row ever written (``resolved`` rows included)."""
    t = read_table(store, table, schema, current=False)
    out: dict = {}
    for r in ([] if t is None else t.to_pylist()):
        out[r[key]] = r
    return out


def _changed(rows: list[dict], before: dict, schema: pa.Schema, key: str = "pair_id",
             ignore=("run_id", "time")) -> list[dict]:
    """The rows that differ (``ignore`` aside, after the schema's casts) from the latest row of their key."""
    if not rows:
        return []
    names = [n for n in schema.names if n not in ignore]
    normal = records_to_table(rows, schema).to_pylist()
    return [r for r, n in zip(rows, normal)
            if before.get(n[key]) is None or any(before[n[key]].get(c) != n.get(c) for c in names)]


def _write_if_changed(store: Store, rel: str, data: bytes) -> str:
    if store.exists(rel) and store.read_bytes(rel) == data:
        return store.uri(rel)
    return store.write_bytes(rel, data)


def write_masks(dataset: Store, pair: dict, classes: list[ChangeClass], masks: dict) -> dict:
    """``label<i>/`` per class of the scheme and their union ``label/``; the pair's ``labels/`` row."""
    prefix, stem = _prefix(pair), _stem(pair)
    maps = [np.where(masks[c.name], 255, 0).astype(np.uint8) for c in classes]
    for c, m in zip(classes, maps):
        _write_if_changed(dataset, f"{prefix}{c.folder}/{stem}.png", encode_png(m))
    union = functools.reduce(merge_label_maps, maps[1:], merge_label_maps(maps[0], np.zeros_like(maps[0])))
    uri = _write_if_changed(dataset, f"{prefix}label/{stem}.png", encode_png(union))
    by_name = {c.name: m for c, m in zip(classes, maps)}
    new = by_name.get("new", maps[0])
    gone = by_name.get("demolished", maps[1] if len(maps) > 1 else np.zeros_like(maps[0]))
    return {"slice_id": pair["pair_id"], "label_uri": uri, "new_pixels": int((new > 0).sum()),
            "demolished_pixels": int((gone > 0).sum()), "changed_pixels": int((union > 0).sum())}


def withdraw_masks(dataset: Store, pair: dict, classes: list[ChangeClass]) -> None:
    """Every mask an earlier ingest wrote for a pair that has lost its decision: each class's and the union."""
    for folder in [c.folder for c in classes] + ["label"]:
        rel = f"{_prefix(pair)}{folder}/{_stem(pair)}.png"
        if dataset.exists(rel):
            dataset.delete(rel)


UNUSABLE_MASKS = "unusable_masks"   # where a given mask of a pair marked unusable is set aside (kept, unread)


def set_aside_given(dataset: Store, pair: dict, classes: list[ChangeClass]) -> None:
    """A mask the pair came with, of a pair now unusable: moved out of ``label/`` (and ``label<i>/``) into
    ``unusable_masks/<folder>/``, so captions, QA and publish no longer read it; nothing is lost."""
    for folder in [c.folder for c in classes] + ["label"]:
        rel = f"{_prefix(pair)}{folder}/{_stem(pair)}.png"
        if dataset.exists(rel):
            _write_if_changed(dataset, f"{_prefix(pair)}{UNUSABLE_MASKS}/{folder}/{_stem(pair)}.png", dataset.read_bytes(rel))
            dataset.delete(rel)


# -- ingest ------------------------------------------------------------------------------------------
class _Decoder:
    """Drawings decoded once per ingest, at the size of their pair's images."""

    def __init__(self, dataset: Store, pairs: dict, classes):
        self.dataset, self.pairs, self.classes = dataset, pairs, classes
        self.sizes: dict[str, tuple[int, int]] = {}
        self.cache: dict[tuple, dict] = {}

    def size(self, pair_id: str) -> tuple[int, int]:
        if pair_id not in self.sizes:
            h, w = decode_image(self.dataset.read_bytes(self.pairs[pair_id]["a_rel"]), grey=True).shape
            self.sizes[pair_id] = (w, h)
        return self.sizes[pair_id]

    def masks(self, row: dict) -> dict:
        k = history_key(row)
        if k not in self.cache:
            w, h = self.size(row["pair_id"])
            self.cache[k] = class_masks(json.loads(row["result"] or "[]"), self.classes, w, h)
        return self.cache[k]


def _annotate_rows(rows: list[dict], decoder: _Decoder, classes, errors: list[dict], run_id: str) -> None:
    """Pixels per class, and the IoU against the task's pre-label, on the rows about to be appended.
    The pre-label is read on its own: a bad one leaves the IoU empty and an error row, and never
    touches the pair's decision."""
    prelabels = {(r["instance"], r["project"], r["task_id"]): r for r in rows if r["annotation_id"] == TASK_ROW}
    for r in rows:
        if r["annotation_id"] == TASK_ROW or r["was_cancelled"] or r.get("withdrawn"):
            continue
        try:
            masks = decoder.masks(r)
        except (ValueError, OSError):
            continue   # the decision names it (status unreadable)
        r["pixels"] = json.dumps({c.name: int(masks[c.name].sum()) for c in classes})
        task = prelabels.get((r["instance"], r["project"], r["task_id"]))
        if task is None or not task.get("result"):
            continue
        try:
            w, h = decoder.size(r["pair_id"])
            pre = class_masks(json.loads(task["result"]), classes, w, h)
            # A class neither drew is left out (null): "both empty" says nothing about the pre-label.
            r["prelabel_iou"] = json.dumps({c.name: (overlap(masks[c.name], pre[c.name])[0]
                                                     if masks[c.name].any() or pre[c.name].any() else None)
                                            for c in classes})
        except (ValueError, OSError) as exc:
            errors.append(error_record(r["pair_id"], "annotate_prelabel_iou", exc, job=JOB, run_id=run_id))


def state_row(d: PairDecision, pair: dict) -> dict:
    return {"pair_id": d.pair_id, "split": pair["split"], "status": d.status, "reason": d.reason,
            "annotations": d.annotations, "skipped": d.skipped, "agreement": d.agreement,
            "per_class": json.dumps(d.per_class, sort_keys=True) if d.per_class else None,
            "annotator": d.annotator, "checker": d.checker, "expert": d.expert,
            "merged_from": json.dumps(list(d.merged_from)) if d.merged_from else None, "batch": d.batch,
            "instance": d.instance, "withdrawn": d.withdrawn}


def exported_pairs(dataset: Store, queue: str | None = None) -> set[str]:
    t = read_table(dataset, "annotation_exports", EXPORTS_SCHEMA)
    return set() if t is None else {r["pair_id"] for r in t.to_pylist() if queue is None or r["queue"] == queue}


def read_states(dataset: Store) -> dict[str, dict]:
    t = read_table(dataset, "annotation_state", STATE_SCHEMA)
    return {} if t is None else {r["pair_id"]: r for r in t.to_pylist()}


def read_history(dataset: Store) -> list[dict]:
    t = read_table(dataset, "annotations", HISTORY_SCHEMA, current=False)
    return [] if t is None else t.to_pylist()


def write_summary(dataset: Store, summary: dict) -> dict:
    """The summary file, rewritten only when more than its ``generated_at`` changed."""
    if dataset.exists(SUMMARY_FILE):
        try:
            old = json.loads(dataset.read_bytes(SUMMARY_FILE))
        except ValueError:
            old = {}
        if {**old, "generated_at": None} == {**summary, "generated_at": None}:
            return old
    dataset.write_bytes(SUMMARY_FILE, (json.dumps(summary, indent=1) + "\n").encode())
    return summary


def summarise(dataset: Store, classes, cfg: DecisionConfig, pairs: list[dict] | None = None) -> dict:
    """The summary from the dataset's tables as they are (what ``annotate status`` shows)."""
    pairs = discover_pairs(dataset.uri()) if pairs is None else pairs
    return build_summary(pairs=pairs, states=read_states(dataset), history=read_history(dataset),
                         exported=exported_pairs(dataset), reviewed=exported_pairs(dataset, "review"),
                         classes=classes, cfg=cfg,
                         generated_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def check_server(history: list[dict], instance: str, server: str) -> None:
    """A second Label Studio server ingested under the first one's instance name would mix their ids:
    a one-line error before any work."""
    seen = sorted({str(r["server"]) for r in history if r.get("server") and str(r.get("instance") or "") == instance})
    if server and seen and server not in seen:
        raise ValueError(f"--export {server}: the history's instance {instance or '(default)'!r} is {seen[0]}; "
                         "another server's project, task and annotation ids would collide: name it with --instance")


def new_history(history: list[dict], tasks: list[dict], pairs: dict, project_id: int = 0, instance: str = "",
                server: str = "") -> tuple[list[dict], list[dict]]:
    """(the rows an export adds to ``history``: new versions, then withdrawals; what it refused, as
    :func:`history_rows` says)."""
    rows, refused = history_rows(tasks, pairs, project_id, instance, server)
    fresh = new_rows(rows, {history_key(r) for r in history})
    return fresh + new_rows(withdrawals(tasks, history, instance, project_id), set()), refused


def ingest(dataset: Store, tasks: list[dict], classes: list[ChangeClass], cfg: DecisionConfig, run_id: str,
           project_id: int = 0, instance: str = "", server: str = "") -> dict:
    """Append the export's new history rows, re-derive every pair's decision from the whole history and
    bring masks and tables to it. Returns the summary (plus this run's ``new_rows`` and ``errors``)."""
    pair_list = discover_pairs(dataset.uri())
    pairs = {p["pair_id"]: p for p in pair_list}
    errors: list[dict] = []
    history = read_history(dataset)
    check_server(history, instance, server)
    fresh, refused = new_history(history, tasks, pairs, project_id, instance, server)
    for u in refused:
        errors.append(error_record(u["item"], u.get("stage", "annotate_ingest"), u["message"] + f" ({dataset.uri()})",
                                   error_type=u["error_type"], job=JOB, run_id=run_id))
    decoder = _Decoder(dataset, pairs, classes)
    _annotate_rows(fresh, decoder, classes, errors, run_id)
    write_table_shard(dataset, "annotations", fresh, HISTORY_SCHEMA, run_id)
    history = history + records_to_table(fresh, HISTORY_SCHEMA).to_pylist() if fresh else history

    decisions = decide_all((r for r in history if r["pair_id"] in pairs), decoder.masks, cfg)
    before = _latest(dataset, "annotation_state", STATE_SCHEMA)
    labels, states, pending = [], [], []
    latest_task = {}
    for r in history:
        latest_task[r["pair_id"]] = max(latest_task.get(r["pair_id"], 0), int(r["task_id"]))
    for pid, d in decisions.items():
        pair = pairs[pid]
        if d.status in WITH_MASK:
            labels.append(write_masks(dataset, pair, classes, d.masks))
        elif (before.get(pid) or {}).get("status") in WITH_MASK or (d.status == "unusable" and pair["label_rel"]):
            if (before.get(pid) or {}).get("status") in WITH_MASK:
                withdraw_masks(dataset, pair, classes)      # ingest's own masks
            else:
                set_aside_given(dataset, pair, classes)     # the input's: kept aside
            # labels/ keeps the pair as unlabelled (no URI, no pixels): the report's CAR drops it.
            labels.append({"slice_id": pid, "label_uri": None, "new_pixels": None, "demolished_pixels": None,
                           "changed_pixels": None})
        states.append(state_row(d, pair))
        pending.append({"pair_id": pid, "split": pair["split"], "task_id": latest_task.get(pid), "status": d.status,
                        "annotations": d.annotations, "pair_agreement": d.agreement, "reason": d.reason,
                        "resolved": d.status in WITH_MASK})
        if d.status == "unreadable":
            errors.append(error_record(pid, "annotate_ingest", d.reason, error_type="UnreadableAnnotation",
                                       job=JOB, run_id=run_id))
    state_rows = _changed(states, before, STATE_SCHEMA)
    write_table_shard(dataset, "annotation_state", state_rows, STATE_SCHEMA, run_id)
    pend_before = _latest(dataset, "annotation_pending", PENDING_SCHEMA)
    # A pair that gets its mask leaves the pending table (resolved); one never pending needs no row.
    pending = [p for p in pending if not (p["resolved"] and p["pair_id"] not in pend_before)]
    write_table_shard(dataset, "annotation_pending", _changed(pending, pend_before, PENDING_SCHEMA), PENDING_SCHEMA,
                      run_id)
    # The pairs job's labels/ table (its key and columns): the report's change area ratio reads it.
    labels_schema = keyed(LABELS_SCHEMA, "slice_id")
    write_table_shard(dataset, "labels", _changed(labels, _latest(dataset, "labels", labels_schema, "slice_id"),
                                                  labels_schema, "slice_id"), labels_schema, run_id)
    err_before = {(r["item"], r["stage"]): r for r in
                  (lambda t: [] if t is None else t.to_pylist())(read_table(dataset, "errors", ERRORS_SCHEMA))}
    errs = [e for e in errors if {k: v for k, v in (err_before.get((e["item"], e["stage"])) or {}).items()
                                  if k in ("error_type", "message")} != {"error_type": e["error_type"], "message": e["message"]}]
    write_table_shard(dataset, "errors", errs, ERRORS_SCHEMA, run_id)
    summary = write_summary(dataset, summarise(dataset, classes, cfg, pair_list))
    return {**summary, "new_rows": len(fresh), "errors": len(errors)}
