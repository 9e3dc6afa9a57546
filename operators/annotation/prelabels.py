"""Pre-labels for the tasks, keyed by the full pair id (a split-folder dataset may hold train/A/1.png and
test/A/1.png: they never share one), with their size checked against the pair's images.

- ``folder:<path>``: any model's masks, laid out as the dataset (``<pair_id>.png`` for the first class,
  or ``[<split>/]label1/<stem>.png ...`` per class). RGBA masks binarise on their colour channels, not
  on alpha (an opaque PNG whose change is 16 red pixels is 16 pixels of change).
- ``cva | irmad | pca-kmeans``: the classical proposals of :mod:`operators.annotation.proposals`.
- ``onnx:<model.onnx>``: :mod:`operators.annotation.onnx_prelabels`.
"""
from __future__ import annotations

import posixpath

import cv2
import numpy as np

from operators.io.storage import Store


def binarise(data: bytes) -> np.ndarray:
    """A mask file -> bool (H, W): any non-zero colour channel (alpha is transparency, not change)."""
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    if image is None:
        raise ValueError("not a decodable image")
    if image.ndim == 3:
        return (image[:, :, :3] if image.shape[2] >= 3 else image[:, :, :1]).any(axis=2)
    return image > 0


def image_size(store: Store, rel: str) -> tuple[int, int]:
    """(height, width) of an image file."""
    image = cv2.imdecode(np.frombuffer(store.read_bytes(rel), np.uint8), cv2.IMREAD_UNCHANGED)
    if image is None:
        raise ValueError(f"{rel}: not a decodable image")
    return image.shape[:2]


def _mask_rels(pair: dict, classes, per_class: bool) -> list[tuple[str, str]]:
    prefix = posixpath.dirname(posixpath.dirname(pair["a_rel"]))
    prefix = f"{prefix}/" if prefix else ""
    stem = posixpath.basename(pair["pair_id"])
    if per_class:
        return [(c.name, f"{prefix}{c.folder}/{stem}.png") for c in classes]
    return [(classes[0].name, f"{pair['pair_id']}.png")]


def folder_prelabels(path: str, dataset: Store, pairs: list[dict], classes) -> tuple[dict, dict]:
    """({pair_id: {class: mask}}, {pair_id: why it is not used}) from a folder of masks. A mask whose size
    is not its pair's is the pair's error, never a task with a misplaced pre-label."""
    store = Store(path)
    per_class = any(store.list(c.folder, suffixes=(".png",)) for c in classes) or any(
        store.list(f"{s}/{c.folder}", suffixes=(".png",)) for s in ("train", "val", "test") for c in classes)
    out, bad = {}, {}
    for p in pairs:
        masks = {}
        try:
            for name, rel in _mask_rels(p, classes, per_class):
                if store.exists(rel):
                    masks[name] = binarise(store.read_bytes(rel))
            if masks:
                size = image_size(dataset, p["a_rel"])
                wrong = {n: m.shape for n, m in masks.items() if m.shape != tuple(size)}
                if wrong:
                    raise ValueError(f"pre-label {', '.join(f'{n} {s[1]}x{s[0]}' for n, s in wrong.items())} "
                                     f"but the pair is {size[1]}x{size[0]}")
                out[p["pair_id"]] = masks
        except (ValueError, OSError) as exc:
            bad[p["pair_id"]] = f"{type(exc).__name__}: {exc}"
    return out, bad


MODEL_VERSION_PREFIX = "changeforge"


def run_prelabels(spec: str, dataset: Store, out: Store, pairs: list[dict], classes, run_id: str,
                  num_cpus: int | None = None) -> tuple[dict, dict, dict, list[dict], str]:
    """({pair_id: {class: mask}}, {pair_id: score}, {pair_id: why}, error rows, model_version) of
    ``--prelabel``. A pair in ``why`` is not exported (its pre-label is wrong, e.g. of another size); an
    error row alone (a proposal that failed) leaves its task without a pre-label."""
    from operators.annotation.proposals import METHODS
    if not spec:
        return {}, {}, {}, [], ""
    if spec.startswith("folder:"):
        path = spec.split(":", 1)[1]
        masks, bad = folder_prelabels(path, dataset, pairs, classes)
        return masks, {}, bad, [], f"folder:{posixpath.basename(path.rstrip('/'))}"
    if spec.startswith("onnx:"):
        from operators.annotation.onnx_prelabels import check_model, run_onnx
        from operators.io.cli import init_ray
        path = spec.split(":", 1)[1]
        check_model(path, pairs[0] if pairs else None)   # before Ray, any task or project
        init_ray(num_cpus)
        masks, errors = run_onnx(path, pairs, classes, run_id)
        return masks, {}, {}, errors, f"onnx:{posixpath.basename(path)}"
    if spec not in METHODS:
        raise ValueError(f"--prelabel {spec!r}: one of {', '.join(METHODS)}, folder:<path> or onnx:<model.onnx>")
    from operators.annotation.proposal_ops import run_proposals
    from operators.annotation.proposals import ProposalConfig
    from operators.io.cli import init_ray
    from operators.io.images import decode_image
    init_ray(num_cpus)
    rows = [{"pair_id": p["pair_id"], "root": p["root"], "a_rel": p["a_rel"], "b_rel": p["b_rel"]} for p in pairs]
    found, errors = run_proposals(rows, spec, out.uri(), ProposalConfig(), run_id)
    masks = {r["pair_id"]: {classes[0].name: decode_image(out.read_bytes(r["mask_rel"]), grey=True) > 0} for r in found}
    scores = {r["pair_id"]: r["score"] for r in found}
    return masks, scores, {}, errors, f"{MODEL_VERSION_PREFIX}:{spec}"
