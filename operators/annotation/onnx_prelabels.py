"""``--prelabel onnx:<model.onnx>``: any change-detection model exported to ONNX, run with onnxruntime as
a Ray Data map (CUDA when onnxruntime has it, else CPU).

The model's contract (also in docs/annotation.md):

- Inputs: the pre and post images as float32 ``1 x 3 x H x W`` (RGB, channels first, values scaled to
  [0, 1], no mean/std: fold any normalisation into the graph), either as two inputs (the first is
  pre, the second post) or as one ``1 x 6 x H x W`` input (pre's three channels, then post's).
- Output (the first one): ``1 x 1 x H x W`` (or ``1 x H x W``) change probability, thresholded at 0.5
  (logits, i.e. values outside [0, 1], go through a sigmoid first); or ``1 x K x H x W`` per-class
  logits, K >= 2: the argmax, class 0 = no change, class k = the scheme's k-th class (with K = 2,
  class 1 is the first class).

The core (:func:`masks_from_output`, :func:`model_inputs`) is numpy; :class:`OnnxPrelabeller` is the
Ray Data callable holding one session per worker.
"""
from __future__ import annotations

import json

import numpy as np

from operators.io.tables import envelope, error_envelope

JOB = "annotate"


def model_inputs(input_names: list[str], a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """The session's feed for one pair of ``H x W x 3`` uint8 RGB images."""
    def chw(x):
        x = np.asarray(x)
        if x.ndim == 2:
            x = np.repeat(x[:, :, None], 3, axis=2)
        return (x[:, :, :3].astype(np.float32) / 255.0).transpose(2, 0, 1)[None]
    if len(input_names) >= 2:
        return {input_names[0]: chw(a), input_names[1]: chw(b)}
    return {input_names[0]: np.concatenate([chw(a), chw(b)], axis=1)}


def masks_from_output(out: np.ndarray, class_names: list[str], shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """{class: bool mask} from the model's first output; ValueError when its size is not the pair's."""
    x = np.asarray(out, np.float32)
    if x.ndim == 4:
        x = x[0]
    if x.ndim == 2:
        x = x[None]
    if x.ndim != 3 or tuple(x.shape[1:]) != tuple(shape):
        raise ValueError(f"the model's output is {list(np.asarray(out).shape)}; expected 1 x C x {shape[0]} x {shape[1]}")
    if x.shape[0] == 1:
        p = x[0]
        if p.min() < 0 or p.max() > 1:
            p = 1.0 / (1.0 + np.exp(-p))
        return {class_names[0]: p > 0.5}
    label = x.argmax(axis=0)
    return {name: label == k + 1 for k, name in enumerate(class_names[: x.shape[0] - 1])}


def session(model: bytes):
    from operators.optional import require
    ort = require("onnxruntime")
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
    return ort.InferenceSession(model, providers=providers)


class OnnxPrelabeller:
    """Ray Data flat_map callable: ``{pair_id, root, a_rel, b_rel}`` -> a ``prelabels`` envelope holding
    the per-class masks as 0/255 PNG bytes (hex), or an ``errors`` envelope."""

    def __init__(self, model_uri: str, class_names: list[str], run_id: str = ""):
        from operators.io.storage import read_uri
        self.session = session(read_uri(model_uri))
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.class_names, self.run_id = class_names, run_id

    def __call__(self, row: dict) -> list[dict]:
        from operators.io.images import decode_image, encode_png
        from operators.io.storage import Store
        try:
            store = Store(row["root"])
            a, b = decode_image(store.read_bytes(row["a_rel"])), decode_image(store.read_bytes(row["b_rel"]))
            if a.shape != b.shape:
                raise ValueError(f"pre {a.shape[1]}x{a.shape[0]} and post {b.shape[1]}x{b.shape[0]} differ in size")
            (out, *_) = self.session.run(None, model_inputs(self.inputs, a, b))
            masks = masks_from_output(out, self.class_names, a.shape[:2])
            pngs = {k: encode_png(np.where(m, 255, 0).astype(np.uint8)).hex() for k, m in masks.items()}
            return [envelope("prelabels", {"pair_id": row["pair_id"], "masks": pngs})]
        except Exception as exc:  # noqa: BLE001 - every pair ends in a table
            return [error_envelope(row["pair_id"], "prelabel:onnx", exc, job=JOB, run_id=self.run_id)]


def input_mismatch(inputs: list[tuple[str, list]], height: int, width: int) -> str | None:
    """Why a model's declared inputs (name, shape; a str or None is a dynamic axis) cannot take a pair of
    ``height x width``, or None: two ``1 x 3 x H x W`` inputs or one ``1 x 6 x H x W``."""
    used = inputs[:2] if len(inputs) >= 2 else inputs[:1]
    channels = 3 if len(used) == 2 else 6
    for name, shape in used:
        want = [1, channels, height, width]
        if len(shape) != 4 or any(isinstance(d, int) and d != w for d, w in zip(shape, want)):
            declared = ", ".join(f"{n} {'x'.join(str(d) if isinstance(d, int) else '?' for d in s)}" for n, s in used)
            return (f"the model takes {declared}; the pairs need {'x'.join(map(str, want))} "
                    f"({height} x {width} px): export it with dynamic spatial axes or at the pairs' size")
    return None


def check_model(model_uri: str, first_pair: dict | None) -> None:
    """Load the model and check its inputs against the first pair's size: a missing, broken or
    wrong-shape model stops the export here, before any task or project, in one line naming both."""
    from operators.io.images import decode_image
    from operators.io.storage import Store, read_uri
    from operators.optional import MissingExtra
    try:
        sess = session(read_uri(model_uri))
    except MissingExtra:
        raise
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types
        raise ValueError(f"--prelabel onnx:{model_uri}: cannot load the model "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''})") from None
    if first_pair is None:
        return
    h, w = decode_image(Store(first_pair["root"]).read_bytes(first_pair["a_rel"])).shape[:2]
    why = input_mismatch([(i.name, list(i.shape)) for i in sess.get_inputs()], h, w)
    if why:
        raise ValueError(f"--prelabel onnx:{model_uri}: {why}")


def run_onnx(model_uri: str, pairs: list[dict], classes, run_id: str = "") -> tuple[dict, list[dict]]:
    """({pair_id: {class: mask}}, error rows) for ``pairs`` through the model (checked first:
    :func:`check_model`), on Ray Data. A model that fails on every pair fails the run."""
    import ray.data
    from operators.io.images import decode_image
    if not pairs:
        return {}, []
    rows = [{"pair_id": p["pair_id"], "root": p["root"], "a_rel": p["a_rel"], "b_rel": p["b_rel"]} for p in pairs]
    ds = ray.data.from_items(rows, override_num_blocks=max(1, min(len(rows), 64)))
    out = ds.flat_map(OnnxPrelabeller, fn_constructor_kwargs={"model_uri": model_uri,
                                                              "class_names": [c.name for c in classes],
                                                              "run_id": run_id}, concurrency=1).take_all()
    masks, errors = {}, []
    for env in out:
        rec = json.loads(env["_record"])
        if env["_table"] == "errors":
            errors.append(rec)
        else:
            masks[rec["pair_id"]] = {k: decode_image(bytes.fromhex(v), grey=True) > 0 for k, v in rec["masks"].items()}
    if errors and not masks:
        first = min(errors, key=lambda e: e["item"])
        raise ValueError(f"--prelabel onnx:{model_uri}: the model failed on every pair ({len(errors)}), e.g. "
                         f"{first['item']}: {str(first.get('message') or '')[:300]}")
    return masks, errors
