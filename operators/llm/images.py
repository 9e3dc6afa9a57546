"""Images for multimodal requests: resize, encode as data URLs, and count them the provider's way.

Providers bill an image by its pixel size and detail level, and the rule differs by model family:
OpenAI's gpt-4o family counts 512-px tiles (85 + 170 per tile), gpt-4o-mini the same tiles at about
33x the price (2833 + 5667 per tile), the gpt-4.1-mini/nano and o4-mini family 32-px patches times a
multiplier, Qwen-VL 28-px patches. :func:`image_token_rule` picks the rule from the model name (or a
``--image-token-rule`` override); :func:`request_image_tokens` applies it to every image of a request,
reading each image's size from its data URL header, so a request is charged what the provider charges.
"""
from __future__ import annotations

import base64
import hashlib
import math
import re
import struct
from dataclasses import dataclass

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


# -- what an image costs ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageTokenRule:
    """How one model family counts an image. ``tile``: fit in ``max_side`` then ``short_side``, count
    ``tile``-px tiles, ``base + per_tile * tiles`` (``base`` alone at detail low). ``patch``: count
    ``patch``-px patches (capped at ``cap``, image scaled down to fit), times ``multiplier``."""

    kind: str = "tile"
    base: int = 85
    per_tile: int = 170
    tile: int = 512
    max_side: int = 2048
    short_side: int = 768
    patch: int = 32
    cap: int = 1536
    multiplier: float = 1.0

    def tokens(self, width: int | None, height: int | None, detail: str = "auto") -> int:
        if not width or not height:          # size unknown (a remote URL): the most it can cost
            width = height = self.max_side if self.kind == "tile" else self.patch * int(math.sqrt(self.cap))
        if self.kind == "patch":
            n = math.ceil(width / self.patch) * math.ceil(height / self.patch)
            if n > self.cap:
                shrink = math.sqrt(self.cap * self.patch ** 2 / (width * height))
                n = min(self.cap, math.ceil(width * shrink / self.patch) * math.ceil(height * shrink / self.patch))
            return int(math.ceil(n * self.multiplier))
        if detail == "low":
            return self.base
        scale = min(1.0, self.max_side / max(width, height))
        w, h = width * scale, height * scale
        scale = min(1.0, self.short_side / min(w, h))
        w, h = w * scale, h * scale
        return self.base + self.per_tile * int(math.ceil(w / self.tile) * math.ceil(h / self.tile))


# Model-name patterns (first match wins) and published rules; a model not listed gets the gpt-4o tile
# rule, and ``--image-token-rule`` overrides either.
IMAGE_TOKEN_RULES: list[tuple[str, ImageTokenRule]] = [
    (r"gpt-4o-mini", ImageTokenRule("tile", base=2833, per_tile=5667)),
    (r"gpt-4\.1-mini|gpt-5-mini", ImageTokenRule("patch", multiplier=1.62)),
    (r"gpt-4\.1-nano|gpt-5-nano", ImageTokenRule("patch", multiplier=2.46)),
    (r"o4-mini", ImageTokenRule("patch", multiplier=1.72)),
    (r"^o1|^o3|computer-use", ImageTokenRule("tile", base=75, per_tile=150)),
    (r"qwen.*vl|qwen2\.5-vl|qwen3-vl", ImageTokenRule("patch", patch=28, cap=16384)),
    (r"gpt-4o|gpt-4\.1|gpt-4-turbo|gpt-5|chatgpt", ImageTokenRule("tile", base=85, per_tile=170)),
]
DEFAULT_IMAGE_TOKEN_RULE = ImageTokenRule("tile", base=85, per_tile=170)


def image_token_rule(model: str, override: str = "") -> ImageTokenRule:
    """The rule for ``model``. ``override``: ``tile:<base>:<per_tile>`` or
    ``patch:<patch_px>:<cap>:<multiplier>``, or a model name whose rule to borrow."""
    if override:
        parts = override.split(":")
        try:
            if parts[0] == "tile":
                return ImageTokenRule("tile", base=int(parts[1]), per_tile=int(parts[2]))
            if parts[0] == "patch":
                return ImageTokenRule("patch", patch=int(parts[1]), cap=int(parts[2]),
                                      multiplier=float(parts[3]) if len(parts) > 3 else 1.0)
        except (IndexError, ValueError):
            raise ValueError(f"image token rule {override!r}: want tile:<base>:<per_tile> or "
                             "patch:<patch_px>:<cap>[:<multiplier>]") from None
        model = override
    for pattern, rule in IMAGE_TOKEN_RULES:
        if re.search(pattern, model or "", re.I):
            return rule
    return DEFAULT_IMAGE_TOKEN_RULE


def estimate_image_tokens(width: int, height: int, detail: str = "auto", rule: ImageTokenRule | None = None) -> int:
    """Tokens of one image under ``rule`` (default: the gpt-4o tile rule)."""
    return (rule or DEFAULT_IMAGE_TOKEN_RULE).tokens(width, height, detail)


def image_size_from_url(url: str) -> tuple[int, int] | None:
    """(width, height) from a PNG or JPEG data URL's header, without decoding pixels; None otherwise."""
    if not url.startswith("data:"):
        return None
    comma = url.find(",")
    if comma < 0:
        return None
    head = url[comma + 1: comma + 1 + 64]
    try:
        raw = base64.b64decode(head[: len(head) // 4 * 4])
    except ValueError:
        return None
    if raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) >= 24:
        return struct.unpack(">II", raw[16:24])
    if raw[:2] == b"\xff\xd8":
        return _jpeg_size(base64.b64decode(url[comma + 1:]))
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i = 2
    while i + 9 < len(data):
        if data[i] != 0xFF:
            i += 1
            continue
        marker = data[i + 1]
        if marker in (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF):
            h, w = struct.unpack(">HH", data[i + 5:i + 9])
            return w, h
        i += 2 + struct.unpack(">H", data[i + 2:i + 4])[0]
    return None


def iter_image_parts(messages: list[dict]):
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url":
                    yield part.get("image_url") or {}


def request_image_tokens(messages: list[dict], rule: ImageTokenRule) -> int:
    """What every image in ``messages`` costs under ``rule``, each at its own size and detail."""
    total = 0
    for image in iter_image_parts(messages):
        size = image_size_from_url(str(image.get("url", "")))
        total += rule.tokens(*(size or (None, None)), image.get("detail", "auto"))
    return total
