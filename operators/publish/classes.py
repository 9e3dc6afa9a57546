"""The mask classes of a release: the dataset's scheme (``label_classes.json``, read with
:func:`operators.annotation.scheme.read_scheme`), else S2Looking's two maps, label1 = new buildings and
label2 = demolished buildings, when a pair has both (what releases did before the scheme travelled).

A single-class scheme (LEVIR-CD's, JL1-CD's ``change:post``) publishes one mask, ``label/``. A
scheme of two or more classes publishes a 0/255 map per class in the scheme's folder (``label1/``,
``label2/``, ``label3/`` ...), a Parquet column ``mask_<name>`` and a pixel count ``<name>_pixels``
per class, all named by the scheme, never by position; ``label_index`` numbers them in scheme order.
"""
from __future__ import annotations

import posixpath
from dataclasses import dataclass

from operators.annotation.scheme import ChangeClass, read_scheme, scheme_document
from operators.io.storage import Store
from operators.publish.masks import INDEX_CLASSES
from operators.publish.shards import schema_for

S2LOOKING = (ChangeClass("new", "post", "label1", ""), ChangeClass("demolished", "pre", "label2", ""))
BASE_COLUMNS = {"pre": "A", "post": "B", "mask": "label"}
DISCOVERED = ("label1", "label2")   # the class folders operators.publish.sources finds by itself


@dataclass(frozen=True)
class ReleaseClasses:
    classes: tuple[ChangeClass, ...]
    declared: bool                      # from the dataset's label_classes.json

    @property
    def per_class(self) -> bool:
        return len(self.classes) >= 2

    @property
    def folders(self) -> list[str]:
        return [c.folder for c in self.classes]

    def column(self, c: ChangeClass) -> str:
        return "mask_" + c.name.replace("-", "_")

    def pixels_column(self, c: ChangeClass) -> str:
        return c.name.replace("-", "_") + "_pixels"

    def image_columns(self) -> dict[str, str]:
        """Parquet image column -> layout role."""
        if not self.per_class:
            return dict(BASE_COLUMNS)
        return {**BASE_COLUMNS, **{self.column(c): c.folder for c in self.classes}, "mask_index": "label_index"}

    def schema(self):
        return schema_for(self.image_columns(), [self.pixels_column(c) for c in self.classes] if self.per_class else [])

    def index_values(self) -> dict[int, str]:
        if not self.declared:
            return dict(INDEX_CLASSES)
        return {0: "no change", **{i + 1: c.name for i, c in enumerate(self.classes)}}

    def describe(self, c: ChangeClass) -> str:
        if not self.declared:
            return {"new": "new buildings", "demolished": "demolished buildings"}[c.name]
        return f"{c.name} (drawn on the {c.image}-change image)"

    def document(self) -> dict:
        return scheme_document(list(self.classes))


def release_classes(dataset: Store) -> ReleaseClasses:
    """The release's classes (see the module docstring); SystemExit naming the file when it is malformed
    or a class name would collide with a release column."""
    try:
        scheme = read_scheme(dataset)
    except ValueError as exc:
        raise SystemExit(f"{dataset.uri()}: {exc}") from None
    if scheme is None:
        return ReleaseClasses(S2LOOKING, False)
    out = ReleaseClasses(tuple(scheme), True)
    taken = set(schema_for(BASE_COLUMNS, []).names) | {"mask_index"}
    clash = [c.name for c in out.classes if out.per_class and ({out.column(c), out.pixels_column(c)} & taken)]
    if clash or any(c.folder in ("A", "B", "label", "label_index") for c in out.classes):
        raise SystemExit(f"{dataset.uri('label_classes.json')}: class {(clash or [c.name for c in out.classes])[0]!r} "
                         "collides with a release column or folder; rename it")
    return out


def add_class_files(store: Store, pairs: list, classes: ReleaseClasses) -> None:
    """Give each pair (operators.publish.sources.PairSource) its maps in the class folders the dataset
    reader does not look in (``label3/`` ...), next to its ``A/`` image."""
    extra = [f for f in classes.folders if f not in DISCOVERED]
    if not extra:
        return
    listed: dict[str, dict[str, str]] = {}
    for p in pairs:
        if "A" not in p.files:
            continue
        base = posixpath.dirname(posixpath.dirname(p.files["A"]))
        prefix = f"{base}/" if base else ""
        for folder in extra:
            key = prefix + folder
            if key not in listed:
                listed[key] = {posixpath.splitext(posixpath.basename(r))[0]: r
                               for r in store.list(key, suffixes=(".png", ".tif", ".tiff", ".jpg", ".jpeg", ".bmp"),
                                                   recursive=False)}
            if p.pair_id in listed[key]:
                p.files[folder] = listed[key][p.pair_id]
