"""Label Studio's brush mask encoding (its own run-length format, not COCO's RLE), in numpy.

A brush result stores an RGBA layer of the image (row-major, ``height x width x 4``, one byte per
channel) as a bit stream: 32 bits value count, 5 bits word size - 1 (8-bit words), four 4-bit run
length field sizes - 1 (3, 4, 8, 16), then per run a flag bit (1 = a repeated value), 2 bits choosing
the length field, the length - 1 and the value (8 bits), padded with zero bits to whole bytes. The
encoder writes exactly the bytes of ``label_studio_sdk.converter.brush.mask2rle`` (every channel of a
pixel holds the mask value); the decoder reads any valid stream, e.g. one drawn in the UI, where the
stroke is in the alpha channel.
"""
from __future__ import annotations

import numpy as np

WORD_BITS = 8
RLE_SIZES = (3, 4, 8, 16)
MAX_RUN = 2 ** 16


def _runs(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, values) of the runs of equal values in a 1-d array."""
    if flat.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.uint8)
    ends = np.append(np.flatnonzero(flat[1:] != flat[:-1]), flat.size - 1)
    lengths = np.diff(np.append(-1, ends))
    return lengths.astype(np.int64), flat[ends]


def encode_values(flat: np.ndarray) -> list[int]:
    """A 1-d uint8 array (RGBA values, row-major) as Label Studio RLE bytes (a list of ints)."""
    flat = np.asarray(flat, np.uint8).ravel()
    lengths, values = _runs(flat)
    # Runs longer than 2^16 are written as chunks of 2^16 and a remainder, as the SDK does.
    chunks = np.maximum(1, -(-lengths // MAX_RUN))
    rep_values = np.repeat(values, chunks)
    last = lengths - (chunks - 1) * MAX_RUN
    chunk_len = np.full(int(chunks.sum()), MAX_RUN, np.int64)
    chunk_len[np.cumsum(chunks) - 1] = last
    idx = np.searchsorted(np.array([8, 16, 256]), chunk_len, side="left")   # 0..3: field of 3, 4, 8, 16 bits
    field = np.array(RLE_SIZES)[idx]
    flag = (chunk_len > 1).astype(np.int64)
    code = (flag << (2 + field + WORD_BITS)) | (idx << (field + WORD_BITS)) | ((chunk_len - 1) << WORD_BITS) | rep_values
    width = 3 + field + WORD_BITS
    header = f"{flat.size:032b}{WORD_BITS - 1:05b}" + "".join(f"{s - 1:04b}" for s in RLE_SIZES)
    head = np.array([int(c) for c in header], np.uint8)
    top = int(width.max()) if width.size else 0
    pos = np.arange(top)
    shifts = width[:, None] - 1 - pos[None, :]
    bits = ((code[:, None] >> np.maximum(shifts, 0)) & 1).astype(np.uint8)
    body = bits[shifts >= 0]   # row-major: run by run, most significant bit first
    stream = np.concatenate([head, body])
    pad = 8 - stream.size % 8   # the SDK always pads, a whole zero byte when already aligned
    stream = np.concatenate([stream, np.zeros(pad, np.uint8)])
    return np.packbits(stream).astype(int).tolist()


def encode_mask(mask: np.ndarray) -> list[int]:
    """A 2-d mask (non-zero = drawn) as the RLE of a brush layer: 255 in every channel where drawn."""
    m = np.where(np.asarray(mask) > 0, 255, 0).astype(np.uint8)
    if m.ndim != 2:
        raise ValueError(f"a mask must be 2-d, got shape {m.shape}")
    return encode_values(np.repeat(m.ravel(), 4))


class _Bits:
    def __init__(self, data):
        self.bits = np.unpackbits(np.asarray(data, np.uint8))
        self.i = 0

    def read(self, n: int) -> int:
        if self.i + n > self.bits.size:
            raise ValueError("brush RLE stream ends early")
        chunk = self.bits[self.i:self.i + n]
        self.i += n
        return int(chunk.dot(1 << np.arange(n - 1, -1, -1, dtype=np.int64))) if n else 0


def decode_values(rle) -> np.ndarray:
    """Label Studio RLE bytes -> the 1-d uint8 array of values it holds."""
    s = _Bits(rle)
    num = s.read(32)
    word = s.read(5) + 1
    sizes = [s.read(4) + 1 for _ in range(4)]
    out = np.zeros(num, np.uint8)
    i = 0
    while i < num:
        repeated = s.read(1)
        j = min(num, i + 1 + s.read(sizes[s.read(2)]))
        if repeated:
            out[i:j] = s.read(word)
        else:
            for k in range(i, j):
                out[k] = s.read(word)
        i = j
    return out


def decode_mask(rle, width: int, height: int) -> np.ndarray:
    """A brush result's RLE -> a ``height x width`` bool mask (the alpha channel, non-zero = drawn)."""
    values = decode_values(rle)
    if values.size != width * height * 4:
        raise ValueError(f"brush RLE holds {values.size} values, not {width}x{height}x4 = {width * height * 4}")
    return values.reshape(height, width, 4)[:, :, 3] > 0
