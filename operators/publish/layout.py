"""The folder layout of a release, ``{train,val,test}/{A,B,label}/<id>.png`` (open-cd, LEVIR-CD+ style),
plus the per-class maps and ``label_index/`` when two or more classes were annotated apart
(:mod:`operators.publish.classes`), and ``captions.json``
(LEVIR-CC style) / ``qa.json`` per split.

:func:`prepare_pair` turns one input pair into the bytes of its release files: PNG inputs already in
the release encoding are copied byte for byte, anything else is decoded and written as PNG; masks
are single channel 0/255 (``label_index`` 0/1/2). A pair that cannot be published raises ValueError
with the reason.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace

import numpy as np

from operators.io import lineage
from operators.io.images import decode_image, encode_png
from operators.io.storage import Store
from operators.language.captions import levir_cc_document
from operators.publish.classes import S2LOOKING, ReleaseClasses
from operators.publish.masks import binary_mask, index_mask, is_binary_encoded, mask_stats
from operators.publish.sources import PairSource

IMAGE_ROLES = ("A", "B")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def release_path(split: str, role: str, pair_id: str) -> str:
    return f"{split}/{role}/{pair_id}.png"


@dataclass
class PreparedPair:
    pair_id: str
    split: str
    files: dict[str, bytes]          # role -> PNG bytes (A, B, and the masks present)
    size: tuple[int, int]            # width, height
    stats: dict                      # changed_pixels, car (+ per-class counts)
    meta: dict
    # What the pair's files are, as the language jobs' lineage records them (operators.io.lineage): the
    # source images' bytes and the released mask's pixels.
    lineage: dict = field(default_factory=dict)


def png_rgb8(data: bytes) -> bool:
    """True for a PNG of 8-bit RGB (colour type 2, depth 8): such an image file is copied as is."""
    if not data.startswith(PNG_SIGNATURE) or len(data) < 26:
        return False
    return data[24] == 8 and data[25] == 2


def png_size(data: bytes) -> tuple[int, int] | None:
    if not data.startswith(PNG_SIGNATURE) or len(data) < 24:
        return None
    return struct.unpack(">II", data[16:24])


def _image(data: bytes, what: str) -> tuple[bytes, tuple[int, int]]:
    if png_rgb8(data):
        return data, png_size(data)
    try:
        img = decode_image(data)
    except ValueError:
        raise ValueError(f"{what} is not a readable image") from None
    return encode_png(img), (img.shape[1], img.shape[0])


def _mask(data: bytes, what: str) -> np.ndarray:
    import cv2
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    if img is None:
        raise ValueError(f"{what} is not a readable image")
    return img


def prepare_pair(store: Store, pair: PairSource, require_label: bool = True,
                 classes: ReleaseClasses | None = None) -> PreparedPair:
    """The release files of one pair (see the module docstring); ``classes``: the release's mask classes
    (default: S2Looking's two maps, as without a ``label_classes.json``). Raises ValueError with the reason."""
    classes = classes or ReleaseClasses(S2LOOKING, False)
    missing = [r for r in IMAGE_ROLES if r not in pair.files]
    if missing:
        raise ValueError(f"missing {' and '.join(missing)} image")
    files, sizes, sources = {}, {}, {}
    for role in IMAGE_ROLES:
        data = store.read_bytes(pair.files[role])
        sources[role] = lineage.bytes_digest(data)
        files[role], sizes[role] = _image(data, f"{role}/{pair.pair_id}")
    prepared = _prepare_masks(store, pair, require_label, classes, files, sizes)
    if "label" in prepared.files:
        sources["mask"] = lineage.mask_digest(_mask(prepared.files["label"], f"label/{pair.pair_id}"))
    return replace(prepared, lineage=sources)


def _prepare_masks(store: Store, pair: PairSource, require_label: bool, classes: ReleaseClasses,
                   files: dict, sizes: dict) -> PreparedPair:
    if sizes["A"] != sizes["B"]:
        raise ValueError(f"A is {sizes['A'][0]}x{sizes['A'][1]} but B is {sizes['B'][0]}x{sizes['B'][1]}")
    folders = classes.folders
    raw = {r: _mask(store.read_bytes(pair.files[r]), f"{r}/{pair.pair_id}")
           for r in ("label", *folders) if r in pair.files}
    for role, m in raw.items():
        if (m.shape[1], m.shape[0]) != sizes["A"]:
            raise ValueError(f"{role} is {m.shape[1]}x{m.shape[0]} but the images are {sizes['A'][0]}x{sizes['A'][1]}")
    given = [f for f in folders if f in raw]
    if not classes.per_class:            # one class: its map and label/ are one and the same mask
        return _single(store, pair, files, sizes["A"], raw, folders[0], require_label)
    if given and len(given) != len(folders):
        scheme = ("S2Looking maps come in pairs: label1 and label2" if not classes.declared else
                  "label_classes.json names " + ", ".join(f"{c.name} ({c.folder}/)" for c in classes.classes))
        raise ValueError(f"only {' and '.join(given)} {'is' if len(given) == 1 else 'are'} given ({scheme})")
    per = bool(given)
    if "label" not in raw and not per:
        if require_label:
            raise ValueError(f"no change mask (label/, or {' and '.join(f + '/' for f in folders)})")
        return PreparedPair(pair.pair_id, pair.split, files, sizes["A"], {}, pair.meta)
    union = binary_mask(np.maximum.reduce([binary_mask(raw[f]) for f in folders])) if per else None
    if "label" in raw:
        mask = binary_mask(raw["label"])
        if union is not None and not np.array_equal(mask, union):
            raise ValueError(f"label/ differs from the union of {' and '.join(f + '/' for f in folders)} in "
                             f"{int((mask != union).sum())} pixel(s)")
        files["label"] = _copy_or_encode(store.read_bytes(pair.files["label"]), raw["label"], mask)
    else:
        mask = union
        files["label"] = encode_png(mask)
    stats = mask_stats(mask, {c.name: raw[c.folder] for c in classes.classes} if per else None)
    if per:
        for role in folders:
            files[role] = _copy_or_encode(store.read_bytes(pair.files[role]), raw[role], binary_mask(raw[role]))
        files["label_index"] = encode_png(index_mask(*(raw[f] for f in folders), names=tuple(folders)))
    return PreparedPair(pair.pair_id, pair.split, files, sizes["A"], stats, pair.meta)


def _single(store: Store, pair: PairSource, files: dict, size, raw: dict, folder: str,
            require_label: bool) -> PreparedPair:
    """A single-class scheme: ``label/`` (or the class's own map when label/ is not there yet), 0/255."""
    if "label" in raw and folder in raw and not np.array_equal(binary_mask(raw["label"]), binary_mask(raw[folder])):
        raise ValueError(f"label/ differs from {folder}/ (the scheme's only class) in "
                         f"{int((binary_mask(raw['label']) != binary_mask(raw[folder])).sum())} pixel(s)")
    src = "label" if "label" in raw else folder if folder in raw else None
    if src is None:
        if require_label:
            raise ValueError(f"no change mask (label/ or {folder}/)")
        return PreparedPair(pair.pair_id, pair.split, files, size, {}, pair.meta)
    mask = binary_mask(raw[src])
    files["label"] = _copy_or_encode(store.read_bytes(pair.files[src]), raw[src], mask)
    return PreparedPair(pair.pair_id, pair.split, files, size, mask_stats(mask), pair.meta)


def _copy_or_encode(data: bytes, decoded: np.ndarray, encoded: np.ndarray) -> bytes:
    return data if data.startswith(PNG_SIGNATURE) and is_binary_encoded(decoded) else encode_png(encoded)


# -- per-split language files ------------------------------------------------------------------------
def captions_document(rows: list[dict]) -> dict:
    """LEVIR-CC ``captions.json`` of one split: ``rows`` are {id, split, captions, car}."""
    return levir_cc_document([{"split": r["split"], "filename": f"{r['id']}.png", "car": r.get("car"),
                               "selected_captions": r["captions"]} for r in rows if r.get("captions")])


def qa_document(rows: list[dict]) -> dict:
    """``qa.json`` of one split, as the QA job's VQA.json: {filename, filepath, split, change_ratio, qa}."""
    return {"images": [{"filename": f"{r['id']}.png", "filepath": r["split"], "split": r["split"],
                        "change_ratio": r.get("car"), "qa": r["qa"]}
                       for r in sorted(rows, key=lambda r: r["id"]) if r.get("qa")]}


# -- STAC items of per-class maps ----------------------------------------------------------------------
STAC_ROLES = ("A", "B", "label", "label1", "label2", "label_index")   # the roles pair_item titles itself


def stac_class_assets(item: dict, paths: dict[str, str], classes: ReleaseClasses) -> dict:
    """A pair's STAC item with its per-class maps titled by the scheme's class names (and any class folder
    beyond label2 added), and the index values named."""
    if not classes.per_class or "label_index" not in paths:
        return item
    for c in classes.classes:
        if c.folder in paths:
            item["assets"][c.folder] = {"href": f"../../{paths[c.folder]}", "type": "image/png",
                                        "title": f"{classes.describe(c)} 0/255", "roles": ["labels", "labels-raster"]}
    values = ", ".join(f"{v} = {name}" for v, name in classes.index_values().items())
    item["assets"]["label_index"]["title"] = f"index mask {values}"
    item["properties"]["label:description"] = f"change mask: 0 = no change, 255 = change; label_index: {values}"
    return item
