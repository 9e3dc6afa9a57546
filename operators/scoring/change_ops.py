"""Change-detection scoring on Ray Data: one map over (prediction, label) file pairs that turns each
pair into a row of confusion counts and per-image scores (pixels never leave the task that decoded
them), then one Ray Data aggregation that sums the counts over the set."""
from __future__ import annotations

import json

import pyarrow as pa

from operators.io import lineage
from operators.io.storage import read_uri
from operators.io.tables import envelope, error_record
from operators.scoring.confusion import COUNT_KEYS, SCORE_KEYS, confusion_counts, scores_from_counts
from operators.scoring.masks import decode_mask

JOB = "score_change"
STAGE = "score_change"

PER_IMAGE_SCHEMA = pa.schema(
    [("name", pa.string()), ("pred", pa.string()), ("label", pa.string()), ("height", pa.int64()),
     ("width", pa.int64())]
    + [(k, pa.int64()) for k in COUNT_KEYS] + [(k, pa.float64()) for k in SCORE_KEYS]
    + [("lineage", pa.string())])   # the two masks scored, as pixel digests (operators.io.lineage)
TABLE_SCHEMAS = {"per_image": PER_IMAGE_SCHEMA}

# Columns of a scored row; error rows carry zeros/nulls there and the reason in error_type/message.
ROW_KEYS = ("name", "pred", "label", "height", "width", *COUNT_KEYS, *SCORE_KEYS, "lineage", "scored",
            "error_type", "message")


def row_lineage(pred: str, label: str, row: dict) -> dict:
    """What a row was scored from: both masks' pixel digests, and their files' stamps when listed
    (``pred_stamp``, ``label_stamp``: a status reads again only the masks whose stamps moved)."""
    stamps = {role: row[k] for role, k in (("pred_mask", "pred_stamp"), ("mask", "label_stamp")) if row.get(k)}
    return {"pred_mask": pred, "mask": label, **({lineage.STAMPS: stamps} if stamps else {})}


def today_lineage(pairs: list[dict], recorded: dict, digest_of) -> dict[str, dict]:
    """name -> the lineage of each matched pair today (``pairs``: ``name``, ``pred``, ``label`` URIs and
    their ``pred_stamp``, ``label_stamp``): a mask whose stamp is the one recorded keeps its recorded digest
    (the file is not read); another is read (``digest_of(uri)``: a pixel digest, or
    :func:`operators.io.lineage.unreadable`)."""
    out = {}
    for p in pairs:
        rec = recorded.get(p["name"]) or {}
        stamps = rec.get(lineage.STAMPS) or {}
        out[p["name"]] = {role: rec[role] if p.get(k + "_stamp") and stamps.get(role) == p[k + "_stamp"]
                          and rec.get(role) else digest_of(p[k])
                          for role, k in (("pred_mask", "pred"), ("mask", "label"))}
    return out


def score_pair(row: dict) -> dict:
    """One (prediction, label) pair -> counts and scores, or the reason it cannot be scored."""
    out = {k: row.get(k) for k in ("name", "pred", "label")}
    out.update({k: 0 for k in (*COUNT_KEYS, "height", "width", "scored")})
    out.update({k: None for k in (*SCORE_KEYS, "lineage", "error_type", "message")})
    if row.get("error_type"):  # found by the matching on the driver: passes through to errors
        out.update(error_type=row["error_type"], message=row["message"])
        return out
    try:
        pred = decode_mask(read_uri(row["pred"]))
    except Exception as exc:  # noqa: BLE001 - an unreadable file is one error row, not a failed job
        out.update(error_type="unreadable_prediction", message=f"{row['pred']}: {exc}")
        return out
    try:
        label = decode_mask(read_uri(row["label"]))
    except Exception as exc:  # noqa: BLE001
        out.update(error_type="unreadable_label", message=f"{row['label']}: {exc}")
        return out
    if pred.shape != label.shape:
        out.update(error_type="size_mismatch",
                   message=f"prediction is {pred.shape[1]}x{pred.shape[0]}, label is {label.shape[1]}x{label.shape[0]}")
        return out
    counts = confusion_counts(pred, label)
    out.update(dict(zip(COUNT_KEYS, counts)), height=label.shape[0], width=label.shape[1], scored=1,
               lineage=lineage.dumps(row_lineage(lineage.mask_digest(pred), lineage.mask_digest(label), row)))
    out.update(scores_from_counts(*counts))
    return out


def score_batch(batch: dict) -> dict:
    """``map_batches`` UDF: columns name/pred/label(/error_type/message) -> :data:`ROW_KEYS` columns."""
    keys = list(batch.keys())
    n = len(batch[keys[0]]) if keys else 0
    rows = [score_pair({k: _py(batch[k][i]) for k in keys}) for i in range(n)]
    return {k: [r[k] for r in rows] for k in ROW_KEYS}


def _py(value):
    return value.item() if hasattr(value, "item") else value


def to_envelopes(batch: dict, run_id: str) -> dict:
    """Scored rows -> ``per_image`` envelopes, failed rows -> ``errors`` envelopes (for TableSink)."""
    out = []
    n = len(batch["name"])
    for i in range(n):
        row = {k: _py(batch[k][i]) for k in ROW_KEYS}
        if row["scored"]:
            out.append(envelope("per_image", {k: row[k] for k in PER_IMAGE_SCHEMA.names}))
        else:
            out.append(envelope("errors", error_record(row["name"], STAGE, row["message"] or "",
                                                       error_type=row["error_type"], job=JOB, run_id=run_id)))
    return {"_table": [e["_table"] for e in out], "_record": [e["_record"] for e in out]}


def aggregate(tables) -> dict:
    """Summed confusion counts, mean per-image scores (over the images that have one) and images
    scored, from the scored rows' Arrow blocks. Done on the driver: the rows are a few numbers each
    and already materialised, and a Ray Data aggregation (a shuffle) cost ~5 s of a 10,000-mask run."""
    import pyarrow as pa
    import pyarrow.compute as pc

    tables = [t for t in tables if t.num_rows]
    out: dict = {k: 0 for k in (*COUNT_KEYS, "scored")}
    out.update({f"mean_{k}": None for k in SCORE_KEYS})
    if not tables:
        return out
    t = pa.concat_tables([t.select([*COUNT_KEYS, "scored", *SCORE_KEYS]) for t in tables],
                         promote_options="permissive")
    for k in (*COUNT_KEYS, "scored"):
        out[k] = int(pc.sum(t[k]).as_py() or 0)
    for k in SCORE_KEYS:
        col = pc.cast(t[k], pa.float64())
        col = pc.if_else(pc.is_nan(col), None, col)
        out[f"mean_{k}"] = pc.mean(col).as_py()
    return out


def metrics_document(agg: dict, n_errors: int) -> dict:
    """``metrics.json``: global scores (summed confusion matrix) at the top level, ``per_image_mean``
    beside them, ``n_images`` and ``n_errors`` (the summed counts are the sums of ``per_image/``)."""
    counts = {k: int(agg.get(k) or 0) for k in COUNT_KEYS}
    n_images = int(agg.get("scored") or 0)
    doc: dict = scores_from_counts(*(counts[k] for k in COUNT_KEYS))
    doc["per_image_mean"] = {k: (None if n_images == 0 or agg.get(f"mean_{k}") is None else float(agg[f"mean_{k}"]))
                             for k in SCORE_KEYS}
    doc.update(n_images=n_images, n_errors=int(n_errors))
    return doc


def dumps(doc: dict) -> bytes:
    return (json.dumps(doc, indent=2) + "\n").encode()
