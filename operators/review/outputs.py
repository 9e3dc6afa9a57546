"""Reading the jobs' outputs for review and report: which job wrote a folder, its tables as they stand
now, and where a pair's images are.

Tables are sharded Parquet written by every run; a resumed or rerun job can leave an older row next to
a newer one for the same key, so rows are de-duplicated by their key, keeping the latest run's.
"""
from __future__ import annotations

import io
import logging
import posixpath

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from operators.io.storage import Store
from operators.io.tables import rename_legacy_columns

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")

# Key columns per (job kind, table): what identifies one row across runs.
TABLE_KEYS = {
    "captions": ("pair_id", "candidate_index"),
    "qa": ("pair_id", "qa_index"),
    "pairs": ("pair_id",),
    "metadata": ("slice_id",),
    "scenes": ("scene_id",),
    "review": ("task_id", "annotation_id"),
}


def output_kinds(store: Store) -> set[str]:
    """What a folder holds: ``pairs_job`` (metadata/), ``captions`` (captions/), ``qa`` (qa/),
    ``review`` (review/) and ``images`` (a LEVIR-CD layout: A/ ...)."""
    kinds = set()
    for folder, kind in (("metadata", "pairs_job"), ("captions", "captions"), ("qa", "qa"), ("review", "review")):
        if store.list(folder, suffixes=(".parquet",)):
            kinds.add(kind)
    if store.list("A", suffixes=IMAGE_SUFFIXES) or any(store.list(f"{s}/A", suffixes=IMAGE_SUFFIXES)
                                                       for s in ("train", "val", "test")):
        kinds.add("images")
    return kinds


def read_current(store: Store, table: str, keys: tuple[str, ...] | None = None) -> pd.DataFrame | None:
    """``<store>/<table>/*.parquet`` as one DataFrame, one row per key (the latest ``run_id`` wins).

    ``keys`` defaults to :data:`TABLE_KEYS`; a table without keys (usage, errors) is returned whole.
    A damaged shard is skipped with a warning (a crash mid-write must not stop a report)."""
    parts = []
    for rel in store.list(table, suffixes=(".parquet",)):
        try:
            parts.append(rename_legacy_columns(table, pq.read_table(io.BytesIO(store.read_bytes(rel)))))
        except Exception as exc:  # noqa: BLE001
            log.warning("skipping unreadable shard %s: %s", rel, exc)
    if not parts:
        return None
    df = pa.concat_tables(parts, promote_options="default").to_pandas()
    keys = TABLE_KEYS.get(table) if keys is None else keys
    if keys and all(k in df.columns for k in keys):
        order = df["run_id"].fillna("") if "run_id" in df.columns else pd.Series(range(len(df)), index=df.index)
        df = df.assign(_order=order.values).sort_values("_order", kind="stable")
        df = df.drop_duplicates(list(keys), keep="last").drop(columns="_order")
        df = df.sort_values(list(keys), kind="stable").reset_index(drop=True)
    return df


class ImageIndex:
    """Where a pair's pre (A), post (B) and mask (label) images are in a LEVIR-CD layout.

    A pair id is ``<stem>`` or ``<split>/<stem>`` (the captions job's naming); files are matched by stem,
    so ``x.png`` in A/ and ``x.tif`` in label/ belong together."""

    FOLDERS = ("A", "B", "label")

    def __init__(self, store: Store):
        self.store = store
        self._files: dict[str, dict[str, str]] = {}
        for prefix in ("", "train/", "val/", "test/"):
            for folder in self.FOLDERS:
                for rel in store.list(f"{prefix}{folder}", suffixes=IMAGE_SUFFIXES, recursive=False):
                    stem = posixpath.splitext(posixpath.basename(rel))[0]
                    self._files.setdefault(f"{prefix}{stem}", {})[folder] = rel

    def paths(self, pair_id: str) -> dict[str, str]:
        """Relative paths (within the store) keyed ``A``, ``B``, ``label``; missing ones absent."""
        return dict(self._files.get(pair_id, {}))

    def __len__(self) -> int:
        return len(self._files)
