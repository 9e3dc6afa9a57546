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


def decode_values(rle) -> np.ndarray:
    """Label Studio RLE bytes -> the 1-d uint8 array of values it holds.

    Vectorised: a record's length in bits depends only on the bits where it starts, so it is computed
    for every bit position at once; a Python loop then only hops from record to record (two lookups
    each), and the values are gathered in one numpy pass."""
    data = np.asarray(rle, np.uint8).ravel()
    nbits = data.size * 8
    if nbits < 53:
        raise ValueError("brush RLE stream ends early")
    padded = np.concatenate([data, np.zeros(4, np.uint8)]).astype(np.int32)
    # w16[q]: the 16 bits starting at bit q (zeros past the end), from a 24-bit window of bytes
    # (int32 throughout: a noisy 1024 px mask is ~10^7 bits).
    b24 = (padded[:-2] << 16) | (padded[1:-1] << 8) | padded[2:]
    q = np.arange(nbits + 24, dtype=np.int32)
    w16 = (b24[np.minimum(q >> 3, b24.size - 1)] >> (8 - (q & 7))) & 0xFFFF
    del b24, q

    def field(at, n):
        return int(w16[at] >> (16 - n)) if n else 0

    num = (field(0, 16) << 16) | field(16, 16)
    word = field(32, 5) + 1
    sizes = np.array([field(37 + 4 * i, 4) + 1 for i in range(4)], np.int32)
    if word != 8 or sizes.max() > 16:
        raise ValueError(f"brush RLE with {word}-bit words or run fields of {sizes.tolist()} bits is not Label Studio's")
    # Every bit position as a possible record start: flag, length field, run length, record bits.
    head = w16[:nbits]
    flag = head >> 15
    width = sizes[(head >> 13) & 3]
    del head
    run = (w16[3:nbits + 3] >> (16 - width)) + 1
    rec = 3 + width + np.where(flag == 1, word, word * run).astype(np.int32)
    hop, count = memoryview(rec), memoryview(run)
    starts, p, n = [], 53, 0
    while n < num:
        if p >= nbits:
            raise ValueError("brush RLE stream ends early")
        starts.append(p)
        n += count[p]
        p += hop[p]
    if p > nbits:
        raise ValueError("brush RLE stream ends early")
    s = np.array(starts, np.int64)
    lengths = run[s].astype(np.int64)
    base = s + 3 + width[s]                    # the first value's bit
    out = np.repeat((w16[base] >> 8).astype(np.uint8), lengths)   # a repeated run: one value
    literal = np.flatnonzero((flag[s] == 0) & (lengths > 1))        # a literal run: one value per element
    if literal.size:
        ln = lengths[literal]
        k = np.arange(int(ln.sum()), dtype=np.int64) - np.repeat(np.cumsum(ln) - ln, ln)
        first = (np.cumsum(lengths) - lengths)[literal]
        out[np.repeat(first, ln) + k] = (w16[np.repeat(base[literal], ln) + word * k] >> 8).astype(np.uint8)
    return out[:num]


def decode_mask(rle, width: int, height: int) -> np.ndarray:
    """A brush result's RLE -> a ``height x width`` bool mask (the alpha channel, non-zero = drawn)."""
    values = decode_values(rle)
    if values.size != width * height * 4:
        raise ValueError(f"brush RLE holds {values.size} values, not {width}x{height}x4 = {width * height * 4}")
    return values.reshape(height, width, 4)[:, :, 3] > 0
