"""Change masks for scoring: decoding to booleans and matching predictions to labels by file name
(pure; the Ray operator is in :mod:`operators.scoring.change_ops`)."""
from __future__ import annotations

import posixpath

import cv2
import numpy as np

from operators.language.mask_analysis import binarize_mask

MASK_SUFFIXES = (".png",)


def decode_mask(data: bytes) -> np.ndarray:
    """PNG bytes -> boolean change mask. Any non-zero pixel is change (0/1, 0/255, stray greys, RGB(A),
    16-bit all work); the file is read unchanged so no colour conversion can round a faint value to 0."""
    image = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_UNCHANGED)
    if image is None:
        raise ValueError("not a decodable image")
    return binarize_mask(image)


def match_masks(pred_names: list[str], label_names: list[str]) -> tuple[list[dict], list[dict]]:
    """Pair prediction and label files by file name.

    Returns ``(pairs, problems)``: pairs ``{"name", "pred", "label"}`` (relative paths), and one problem
    ``{"name", "error_type", "message"}`` per label without a prediction (``missing_prediction``), per
    prediction without a label (``extra_prediction``) and per name that occurs twice on one side
    (``duplicate_name``; such names are not scored)."""
    def by_name(names: list[str], side: str, problems: list[dict]) -> dict[str, str]:
        out: dict[str, str] = {}
        dup: set[str] = set()
        for rel in names:
            name = posixpath.basename(rel)
            if name in out:
                dup.add(name)
                problems.append({"name": name, "error_type": "duplicate_name",
                                 "message": f"{side} file name {name} occurs twice: {out[name]} and {rel}"})
            else:
                out[name] = rel
        for name in dup:
            out.pop(name)
        return out

    problems: list[dict] = []
    preds = by_name(pred_names, "prediction", problems)
    labels = by_name(label_names, "label", problems)
    pairs = [{"name": n, "pred": preds[n], "label": labels[n]} for n in sorted(preds.keys() & labels.keys())]
    problems += [{"name": n, "error_type": "missing_prediction", "message": f"no prediction for label {labels[n]}"}
                 for n in sorted(labels.keys() - preds.keys())]
    problems += [{"name": n, "error_type": "extra_prediction", "message": f"no label for prediction {preds[n]}"}
                 for n in sorted(preds.keys() - labels.keys())]
    return pairs, problems
