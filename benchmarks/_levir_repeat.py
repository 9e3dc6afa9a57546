"""A large captions input from the repository's 12 LEVIR-CD samples, repeated under new names.

Copy ``k`` of sample ``name`` is ``<split>_r<k>_<rest>`` (the ``train_/val_/test_`` prefix is kept,
so the split is too). Each copy's pre and post images get copy ``k`` written into the low bits of a
few pixels: every copy is then a distinct request (the response cache keys on image content, and the
test server draws its faults per request), while what the images show is unchanged. Masks are
copied as they are; the sample without a mask stays without one, the mismatched-size one stays
mismatched, so every repetition carries the edge cases (they end as error rows with a reason).
"""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

LEVIR = Path(__file__).resolve().parent.parent / "data" / "levir-cd"


def _mark(image: np.ndarray, k: int) -> np.ndarray:
    """``k`` in the lowest bit of the first 24 values of the first row (invisible, unique per copy)."""
    out = image.copy()
    row = out[0].reshape(-1)
    bits = np.array([(k >> i) & 1 for i in range(24)], dtype=out.dtype)
    row[:24] = (row[:24] & ~np.array(1, out.dtype)) | bits
    out[0] = row.reshape(out[0].shape)
    return out


def build_repeated_levir(dest: Path, n_pairs: int, source: Path = LEVIR) -> list[str]:
    """Write ``n_pairs`` pairs (``A/ B/ label/``) into ``dest``; returns their pair ids."""
    names = sorted(p.name for p in (source / "A").glob("*.png"))
    images = {(folder, name): cv2.imread(str(source / folder / name), cv2.IMREAD_UNCHANGED)
              for folder in ("A", "B") for name in names}
    masks = {name: (source / "label" / name).read_bytes() for name in names if (source / "label" / name).exists()}
    for folder in ("A", "B", "label"):
        (dest / folder).mkdir(parents=True, exist_ok=True)
    ids = []
    for k in range(n_pairs):
        name = names[k % len(names)]
        split, rest = name.split("_", 1)
        new = f"{split}_r{k:05d}_{rest}"
        for folder in ("A", "B"):
            cv2.imwrite(str(dest / folder / new), _mark(images[(folder, name)], k))
        if name in masks:
            (dest / "label" / new).write_bytes(masks[name])
        ids.append(new[:-4])
    return ids


def build_levir_mosaics(dest: Path, tiles: int = 4, source: Path = LEVIR) -> Path:
    """LEVIR-CD-sized pairs (1024 px for the 256 px samples) as ``tiles x tiles`` mosaics of the real
    samples whose images and mask agree in size, one mosaic per sample, each a different arrangement
    of them. Real content at the size a full LEVIR-CD image has, for what the images' size drives
    (the encoded data URLs, the LLM actors' memory). Returns ``dest``, a folder to repeat from."""
    names = sorted(p.name for p in (source / "A").glob("*.png"))
    read = {(f, n): cv2.imread(str(source / f / n), cv2.IMREAD_UNCHANGED) if (source / f / n).exists() else None
            for f in ("A", "B", "label") for n in names}
    usable = [n for n in names if read[("label", n)] is not None
              and read[("A", n)].shape[:2] == read[("B", n)].shape[:2] == read[("label", n)].shape[:2]]
    for folder in ("A", "B", "label"):
        (dest / folder).mkdir(parents=True, exist_ok=True)
    for k, name in enumerate(usable):
        order = [usable[(k + 5 * i) % len(usable)] for i in range(tiles * tiles)]
        for folder in ("A", "B", "label"):
            cells = [read[(folder, n)] for n in order]
            rows = [np.concatenate(cells[r * tiles:(r + 1) * tiles], axis=1) for r in range(tiles)]
            cv2.imwrite(str(dest / folder / f"{name.split('_', 1)[0]}_mosaic{k:02d}.png"), np.concatenate(rows, axis=0))
    return dest
