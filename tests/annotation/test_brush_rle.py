"""Label Studio's brush RLE: our encoder and decoder against label_studio_sdk.converter.brush, run in the
Label Studio environment (its own venv) through a subprocess."""
from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from operators.annotation.brush_rle import decode_mask, decode_values, encode_mask

SIZES = [(37, 53), (53, 37), (1, 1), (3, 29), (7, 20011)]   # odd, both orientations, runs > 2^16 values


SDK_SCRIPT = r"""
import json, sys
import numpy as np
from label_studio_sdk.converter import brush
cases = json.load(sys.stdin)
out = []
for c in cases:
    m = np.array(c["mask"], dtype=np.uint8).reshape(c["h"], c["w"])
    enc = [int(v) for v in brush.mask2rle(m * 255)]
    dec = brush.decode_rle(c["ours"]).reshape(c["h"], c["w"], 4)[:, :, 3]
    out.append({"sdk": enc, "decoded": (dec > 0).astype(int).ravel().tolist()})
ui = np.zeros((5, 7, 4), np.uint8)          # a UI brush layer: colour in RGB, the stroke in alpha
ui[1:4, 2:6] = (214, 39, 40, 255)
ui[2, 0] = (214, 39, 40, 128)               # a soft edge pixel still counts as drawn
out.append({"ui": [int(v) for v in brush.encode_rle(ui.ravel())]})
json.dump(out, sys.stdout)
"""


def test_round_trip_against_the_sdk(label_studio_python):
    rng = np.random.default_rng(7)
    masks = []
    for h, w in SIZES:
        m = (rng.random((h, w)) < 0.15).astype(np.uint8)
        m[: h // 2] = 0                          # long empty runs too
        m[-1, -1] = 1
        masks.append(m)
    masks.append(np.zeros((3, 5), np.uint8))    # 53 header + 19 run bits: byte-aligned, still padded by the SDK
    cases = [{"h": m.shape[0], "w": m.shape[1], "mask": m.ravel().tolist(), "ours": encode_mask(m)} for m in masks]
    proc = subprocess.run([str(label_studio_python), "-c", SDK_SCRIPT], input=json.dumps(cases), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answers = json.loads(proc.stdout)
    for m, case, ans in zip(masks, cases, answers):
        assert case["ours"] == ans["sdk"]                                    # byte for byte the SDK's encoding
        assert np.array_equal(np.array(ans["decoded"]).reshape(m.shape), m)  # the SDK decodes ours
        assert np.array_equal(decode_mask(ans["sdk"], m.shape[1], m.shape[0]), m > 0)   # we decode the SDK's
    ui = answers[-1]["ui"]
    expected = np.zeros((5, 7), bool)
    expected[1:4, 2:6] = True
    expected[2, 0] = True
    assert np.array_equal(decode_mask(ui, 7, 5), expected)
    assert decode_values(ui)[(1 * 7 + 2) * 4: (1 * 7 + 2) * 4 + 4].tolist() == [214, 39, 40, 255]


def test_wrong_size_and_truncated_stream_are_errors():
    rle = encode_mask(np.ones((4, 6), np.uint8))
    with pytest.raises(ValueError, match="not 5x4x4"):
        decode_mask(rle, 5, 4)
    with pytest.raises(ValueError, match="ends early"):
        decode_values(encode_mask(np.eye(9, dtype=np.uint8))[:8])


def _stream(num: int, records: list[tuple[int, list[int]]]) -> list[int]:
    """A stream written by hand: (repeated, values) records, 8-bit words, fields of 3, 4, 8, 16 bits."""
    bits = f"{num:032b}{7:05b}" + "".join(f"{s - 1:04b}" for s in (3, 4, 8, 16))
    for repeated, values in records:
        n = len(values) if not repeated else values[1]
        idx = next(i for i, s in enumerate((3, 4, 8, 16)) if n - 1 < 2 ** s)
        bits += f"{int(repeated)}{idx:02b}" + format(n - 1, f"0{(3, 4, 8, 16)[idx]}b")
        bits += f"{values[0]:08b}" if repeated else "".join(f"{v:08b}" for v in values)
    bits += "0" * (-len(bits) % 8)
    return [int(bits[i:i + 8], 2) for i in range(0, len(bits), 8)]


def test_literal_runs_long_fields_and_a_final_run_past_the_count():
    """Runs the encoder never writes (literal runs of several values, a 16-bit length field) but a valid
    stream may hold; the last run is cut at the value count, as Label Studio's decoder does."""
    rle = _stream(296, [(False, [1, 2, 3, 4, 5]), (True, [9, 20]), (True, [0, 270]), (False, [7, 8])])
    expected = np.r_[[1, 2, 3, 4, 5], np.full(20, 9), np.zeros(270), [7, 8]][:296].astype(np.uint8)
    assert np.array_equal(decode_values(rle), expected)
    assert np.array_equal(decode_values(_stream(4, [(False, [200, 100, 50, 25])])), [200, 100, 50, 25])
