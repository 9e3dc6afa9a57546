"""Images for multimodal requests: resize to a maximum side, encode as base64 data URLs."""
from __future__ import annotations

import base64
import hashlib

import cv2
import numpy as np


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fit_max_side(image: np.ndarray, max_side: int, nearest: bool = False) -> np.ndarray:
    """Downscale so the longer side is at most ``max_side`` (never upscale). Masks use nearest
    neighbour so they stay binary; photos use area averaging, which does not alias."""
    h, w = image.shape[:2]
    if not max_side or max(h, w) <= max_side:
        return image
    scale = max_side / max(h, w)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return cv2.resize(image, size, interpolation=cv2.INTER_NEAREST if nearest else cv2.INTER_AREA)


def data_url(image: np.ndarray, fmt: str = "png", jpeg_quality: int = 90) -> str:
    """``data:image/...;base64,...`` of an RGB (HxWx3) or grey (HxW) uint8 array."""
    if image.ndim == 3:
        image = cv2.cvtColor(image, cv2.COLOR_RGB2BGR)
    if fmt == "jpeg":
        ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, jpeg_quality])
        mime = "image/jpeg"
    else:
        ok, buf = cv2.imencode(".png", image)
        mime = "image/png"
    if not ok:
        raise ValueError("could not encode image")
    return f"data:{mime};base64," + base64.b64encode(buf.tobytes()).decode("ascii")


def image_part(url: str, detail: str = "auto") -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}}


def estimate_image_tokens(width: int, height: int, detail: str = "auto") -> int:
    """OpenAI's published tile rule (85 base + 170 per 512-px tile after fitting in 2048 and 768 short
    side); a fair upper-side estimate for other vision models too. Used before the request only."""
    if detail == "low":
        return 85
    scale = min(1.0, 2048 / max(width, height))
    w, h = width * scale, height * scale
    scale = min(1.0, 768 / min(w, h))
    w, h = w * scale, h * scale
    tiles = int(np.ceil(w / 512) * np.ceil(h / 512))
    return 85 + 170 * tiles
