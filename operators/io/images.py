"""Encoding and decoding of image files in the output store (PNG, as LEVIR-CD-style loaders expect)."""
from __future__ import annotations

import cv2
import numpy as np

from operators.io.storage import Store


def encode_png(image: np.ndarray) -> bytes:
    """(H, W) or (H, W, 3|4) uint8 in RGB order -> PNG bytes."""
    if image.dtype != np.uint8:
        raise TypeError(f"PNG output must be uint8, got {image.dtype}")
    if image.ndim == 3 and image.shape[2] in (3, 4):
        code = cv2.COLOR_RGB2BGR if image.shape[2] == 3 else cv2.COLOR_RGBA2BGRA
        image = cv2.cvtColor(image, code)
    ok, buf = cv2.imencode(".png", image)
    if not ok:
        raise ValueError("PNG encoding failed")
    return buf.tobytes()


def decode_image(data: bytes, grey: bool = False) -> np.ndarray:
    """Image bytes (PNG/JPEG/TIFF...) -> uint8 RGB (H, W, 3) or grey (H, W); raises on garbage."""
    arr = np.frombuffer(data, dtype=np.uint8)
    flag = cv2.IMREAD_GRAYSCALE if grey else cv2.IMREAD_COLOR
    image = cv2.imdecode(arr, flag)
    if image is None:
        raise ValueError("not a decodable image")
    if not grey:
        image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
    return image


def write_png(store: Store, rel: str, image: np.ndarray) -> str:
    return store.write_bytes(rel, encode_png(image))
