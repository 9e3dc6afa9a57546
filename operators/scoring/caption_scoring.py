"""The captions scoring run: matched references and predictions in, ``metrics.json`` content and
per-image rows out (corpus scores over the set, and over its change and no-change subsets)."""
from __future__ import annotations

import pyarrow as pa

from operators.io import lineage
from operators.io.storage import Store
from operators.scoring.caption_metrics import METRIC_KEYS, SPICE_NOTE, score_tokenized, tokenize
from operators.scoring.caption_sets import RefImage, name_key
from operators.scoring.masks import MASK_SUFFIXES, decode_mask

PER_IMAGE_SCHEMA = pa.schema(
    [("filename", pa.string()), ("split", pa.string()), ("changeflag", pa.int64()), ("prediction", pa.string()),
     ("references", pa.list_(pa.string()))] + [(k, pa.float64()) for k in METRIC_KEYS]
    + [("lineage", pa.string())])   # the reference set and the prediction scored (operators.io.lineage)


def change_flags_from_masks(images: list[RefImage], masks: str) -> tuple[dict[str, int | None], list[dict]]:
    """``{key: 1 | 0}`` from the masks folder (a pair whose mask is empty is no-change); an image without a
    readable mask gets ``None`` (in no subset) and a problem row."""
    store = Store(masks)
    by_key = {name_key(rel): rel for rel in store.list(suffixes=MASK_SUFFIXES, recursive=False)}
    if not by_key:
        raise SystemExit(f"jobs.score captions: no PNG masks in --masks {masks}")
    flags: dict[str, int | None] = {}
    problems = []
    for img in images:
        rel = by_key.get(img.key)
        if rel is None:
            flags[img.key] = None
            problems.append({"item": img.filename, "error_type": "missing_mask",
                             "message": f"no mask for {img.filename} in {masks}: in neither subset"})
            continue
        try:
            flags[img.key] = int(decode_mask(store.read_bytes(rel)).any())
        except Exception as exc:  # noqa: BLE001 - one bad mask is one error row
            flags[img.key] = None
            problems.append({"item": img.filename, "error_type": "unreadable_mask", "message": f"{rel}: {exc}"})
    return flags, problems


def row_lineage(img: RefImage, prediction: str) -> dict:
    """What an image's row was scored from: its reference caption set and the prediction."""
    return {"captions": lineage.caption_set_digest(img.refs), "prediction": lineage.value_digest(prediction)}


def score_caption_set(images: list[RefImage], predictions: dict[str, str],
                      flags: dict[str, int | None]) -> tuple[dict, list[dict]]:
    """Corpus metrics (all, change, no_change) and one row per image. Tokenisation runs once for all."""
    gts = tokenize({img.key: img.refs for img in images})
    res = tokenize({img.key: [predictions[img.key]] for img in images})
    subsets = {"all": [img.key for img in images],
               "change": [img.key for img in images if flags.get(img.key) == 1],
               "no_change": [img.key for img in images if flags.get(img.key) == 0]}
    scored = score_tokenized(gts, res, subsets)
    overall, per_id = scored["all"]
    doc: dict = dict(overall)
    for subset in ("change", "no_change"):
        doc[subset] = {**scored[subset][0], "n_images": len(subsets[subset])}
    doc["n_images"] = len(images)
    rows = [{"filename": img.filename, "split": img.split, "changeflag": flags.get(img.key),
             "prediction": predictions[img.key], "references": img.refs, **per_id.get(img.key, {}),
             "lineage": lineage.dumps(row_lineage(img, predictions[img.key]))}
            for img in images]
    return doc, rows


def caption_metrics_document(doc: dict, n_errors: int, split: str, flag_source: str | None) -> dict:
    return {**{k: doc.get(k) for k in METRIC_KEYS}, "n_images": doc["n_images"], "n_errors": n_errors,
            "split": split, "change": doc["change"], "no_change": doc["no_change"],
            "change_flag_source": flag_source, "spice": SPICE_NOTE,
            "note": "CIDEr (CIDEr-D) document frequencies come from each scored set's own references: "
                    "change/no_change CIDEr are not comparable with the whole set's"}
