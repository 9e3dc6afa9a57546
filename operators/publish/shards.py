"""Parquet shards of a release with image columns, as the Hugging Face Hub and ``datasets.load_dataset``
read them: each image is a ``{bytes, path}`` struct and the schema carries the ``huggingface`` features
metadata (``Image`` for the image columns), so images come back decoded. One file set per split,
``data/<split>-<nnnnn>.parquet``, cut at about ``shard_mb`` of encoded images, in row groups of
``rows_per_group`` rows (small groups keep the Hub's viewer and random access cheap).
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

IMAGE_COLUMNS = {  # Parquet column -> layout role
    "pre": "A", "post": "B", "mask": "label", "mask_new": "label1", "mask_demolished": "label2",
    "mask_index": "label_index",
}
IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
QA_TYPE = pa.struct([("type", pa.string()), ("question", pa.string()), ("answer", pa.string())])


def schema_for(image_columns: dict[str, str], pixel_columns: list[str]) -> pa.Schema:
    """The release schema with these image columns (column -> layout role) and per-class pixel counts."""
    return pa.schema([
        ("id", pa.string()), ("split", pa.string()),
        *[(c, IMAGE_TYPE) for c in image_columns],
        ("width", pa.int32()), ("height", pa.int32()),
        ("car", pa.float64()), ("changed_pixels", pa.int64()),
        *[(c, pa.int64()) for c in pixel_columns],
        ("captions", pa.list_(pa.string())), ("caption_perspectives", pa.list_(pa.string())),
        ("qa", pa.list_(QA_TYPE)),
        ("location", pa.string()), ("pre_date", pa.string()), ("post_date", pa.string()),
        ("sensor", pa.string()), ("crs", pa.string()), ("bounds", pa.list_(pa.float64())),
        ("pre_source", pa.list_(pa.string())), ("post_source", pa.list_(pa.string())),
        ("source_run_id", pa.string()),
    ])


# Without a class scheme (label_classes.json): S2Looking's two maps, as releases always had them.
SCHEMA = schema_for(IMAGE_COLUMNS, ["new_pixels", "demolished_pixels"])

COLUMN_DOCS = {
    "id": "pair id (the file-name stem in the folder layout)", "split": "train, val or test",
    "pre": "pre-change image (A), PNG", "post": "post-change image (B), PNG",
    "mask": "change mask, PNG, single channel 0 = no change / 255 = change",
    "mask_new": "new buildings (S2Looking label1), PNG 0/255; null when not annotated apart",
    "mask_demolished": "demolished buildings (S2Looking label2), PNG 0/255; null when not annotated apart",
    "mask_index": "index mask, PNG 0 = no change / 1 = new / 2 = demolished; null when not annotated apart",
    "width": "image width in pixels", "height": "image height in pixels",
    "car": "change area ratio: changed pixels / all pixels of the mask",
    "changed_pixels": "pixels marked changed", "new_pixels": "pixels marked in label1 (null without it)",
    "demolished_pixels": "pixels marked in label2 (null without it)",
    "captions": "selected change captions", "caption_perspectives": "perspective of each selected caption",
    "qa": "selected question-answer pairs {type, question, answer}",
    "location": "location id (pairs of one place share it, and its split)",
    "pre_date": "acquisition date of the pre image", "post_date": "acquisition date of the post image",
    "sensor": "platform of the source scenes, when known", "crs": "coordinate reference system of bounds",
    "bounds": "left, bottom, right, top of the crop in crs units",
    "pre_source": "source of the pre image: STAC item or files read", "post_source": "source of the post image",
    "source_run_id": "run of the pairs job that made the pair",
}


def _hf_feature(t: pa.DataType) -> dict:
    if t == IMAGE_TYPE:
        return {"_type": "Image"}
    if pa.types.is_list(t):
        return {"feature": _hf_feature(t.value_type), "_type": "List"}
    if pa.types.is_struct(t):
        return {f.name: _hf_feature(f.type) for f in t}
    dtype = {pa.string(): "string", pa.float64(): "float64", pa.int64(): "int64", pa.int32(): "int32"}[t]
    return {"dtype": dtype, "_type": "Value"}


def hf_features(schema: pa.Schema = SCHEMA) -> dict:
    """The ``datasets`` features of ``schema`` (what ``Features.to_dict()`` writes)."""
    return {f.name: _hf_feature(f.type) for f in schema}


def release_schema(schema: pa.Schema = SCHEMA) -> pa.Schema:
    return schema.with_metadata({"huggingface": json.dumps({"info": {"features": hf_features(schema)}})})


def shard_name(split: str, index: int) -> str:
    return f"data/{split}-{index:05d}.parquet"


@dataclass
class ShardWriter:
    """Rows of one split in, Parquet shards out through ``write(rel, data)`` (which returns nothing)."""
    split: str
    write: Callable[[str, bytes], object]
    shard_mb: float = 256.0
    rows_per_group: int = 100
    schema: pa.Schema = SCHEMA
    written: list[tuple[str, int]] = field(default_factory=list)   # (rel, rows)
    _rows: list[dict] = field(default_factory=list)
    _bytes: int = 0

    def add(self, row: dict) -> None:
        self._rows.append(row)
        self._bytes += sum(len(row[f.name]["bytes"]) for f in self.schema if f.type == IMAGE_TYPE and row.get(f.name))
        if self._bytes >= self.shard_mb * 1e6:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        table = pa.Table.from_pylist(self._rows, schema=release_schema(self.schema))
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=self.rows_per_group, compression="zstd")
        rel = shard_name(self.split, len(self.written))
        self.write(rel, buf.getvalue())
        self.written.append((rel, len(self._rows)))
        self._rows, self._bytes = [], 0


def image_cell(data: bytes | None, path: str) -> dict | None:
    return None if data is None else {"bytes": data, "path": path}
