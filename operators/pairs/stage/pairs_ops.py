"""Thin Ray Data operators of the pairs job around the pure cores (catalogue, slicing, labels).

Registration lives in :mod:`operators.pairs.stage.register_stage`. Every operator here turns one input row into
envelopes (see :mod:`operators.io.tables`), so whatever happens to a row, it ends in some table.
"""
from __future__ import annotations

import json

from operators.pairs.catalogue.catalogue import SceneInput, read_scene_header
from operators.io.images import decode_image, write_png
from operators.pairs.labels.labels import LABEL_FOLDERS, merge_label_maps
from operators.pairs.selection.slicing import slice_rows
from operators.io.storage import Store
from operators.io.tables import envelope, error_envelope


def catalogue_scene(row: dict, rgb_bands=None, percentiles=(2.0, 98.0), run_id: str = "") -> list[dict]:
    """flat_map: one scene input -> a ``scenes`` envelope, or an ``errors`` envelope saying why."""
    scene = SceneInput(uri=row["uri"], acquired=row.get("acquired"), location=row.get("location"))
    try:
        record = read_scene_header(scene, rgb_bands=rgb_bands, stretch_percentiles=percentiles)
        return [envelope("scenes", record)]
    except Exception as exc:  # noqa: BLE001 - a bad scene must not stop the archive
        return [error_envelope(scene.uri, "catalogue", exc, job="build_pairs", run_id=run_id)]


def cut_pair(row: dict, slice_size: int, stride: int, skip: frozenset[str] = frozenset()) -> list[dict]:
    """flat_map: one accepted pair -> its slice rows, minus those finished by an earlier run."""
    pair, pre, post = (json.loads(row[k]) for k in ("pair", "pre", "post"))
    rows = slice_rows(pair, pre, post, slice_size, stride, row["split"])
    return [r for r in rows if r["slice_id"] not in skip]


def merge_slice_labels(row: dict, labels_root: str, out_root: str, crop_size: int,
                       run_id: str = "") -> list[dict]:
    """map: merge one slice's two annotator maps into ``label/<slice_id>.png``."""
    slice_id = row["slice_id"]
    try:
        labels = Store(labels_root)
        maps = []
        for folder in LABEL_FOLDERS:
            rel = f"{folder}/{slice_id}.png"
            if not labels.exists(rel):
                raise FileNotFoundError(f"{folder}/{slice_id}.png is missing (both label1 and label2 are needed)")
            maps.append(decode_image(labels.read_bytes(rel), grey=True))
        merged = merge_label_maps(maps[0], maps[1], expected_shape=(crop_size, crop_size))
        uri = write_png(Store(out_root), f"label/{slice_id}.png", merged)
        return [envelope("labels", {
            "slice_id": slice_id, "label_uri": uri,
            "new_pixels": int((maps[0] > 0).sum()), "demolished_pixels": int((maps[1] > 0).sum()),
            "changed_pixels": int((merged > 0).sum()),
        })]
    except Exception as exc:  # noqa: BLE001
        return [error_envelope(slice_id, "labels", exc, job="build_pairs", run_id=run_id)]
