"""How one job's output leads the next job to the dataset it came from.

Every job writes ``source.json`` at the root of its output: which job wrote it, what it read
(``input``) and the dataset in the LEVIR-CD layout behind it (``dataset``). A later job given that
output finds the images by following ``dataset`` (or ``input``) until it reaches a folder holding
``A/``, so ``--images`` is needed only for datasets from outside the chain.
"""
from __future__ import annotations

import json

from operators.io.storage import Store

SOURCE_FILE = "source.json"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
SPLITS = ("train", "val", "test")


def write_source(out: Store, job: str, **fields) -> None:
    """``source.json`` of a job's output (empty values are left out)."""
    doc = {"job": job, **{k: v for k, v in fields.items() if v not in (None, "")}}
    out.write_bytes(SOURCE_FILE, json.dumps(doc, indent=1).encode())


def read_source(store: Store) -> dict:
    """The output's ``source.json``, or ``{}`` when it has none (or an unreadable one)."""
    try:
        if not store.exists(SOURCE_FILE):
            return {}
        doc = json.loads(store.read_bytes(SOURCE_FILE))
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def holds_images(store: Store) -> bool:
    """A LEVIR-CD layout: ``A/`` at the root or under a split folder."""
    return bool(store.list("A", suffixes=IMAGE_SUFFIXES, recursive=False)) or any(
        store.list(f"{s}/A", suffixes=IMAGE_SUFFIXES, recursive=False) for s in SPLITS)


def dataset_of(uri: str, max_hops: int = 5) -> str | None:
    """The dataset (a folder or prefix holding ``A/``) behind a job output: the output itself when it
    holds images, else what its ``source.json`` names, followed up to ``max_hops`` outputs back."""
    seen = set()
    for _ in range(max_hops + 1):
        if not uri or uri in seen:
            return None
        seen.add(uri)
        store = Store(uri)
        if holds_images(store):
            return store.uri()
        doc = read_source(store)
        uri = doc.get("dataset") or doc.get("input") or ""
    return None
