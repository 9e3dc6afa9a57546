"""Brush RLE decoder benchmark: the vectorised decoder against the per-value loop it replaced, on noisy
masks at the paper's crop size (1024 x 1024), side by side in one process.

    python -m benchmarks.brush_rle [--size 1024] [--noise 0.15] [--repeat 3]

Both decoders read the same stream (our encoder's bytes, which equal the SDK's) and must give the same
values. Prints one row per mask and ends with

    size=<n> old_s=<x> new_s=<x> old_cpu_s=<x> new_cpu_s=<x> speedup=<x>

(the noisy mask; wall and CPU seconds, the new decoder's the fastest of --repeat runs, the old one run
once: it takes half a minute).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from operators.annotation.brush_rle import decode_values, encode_mask


class _Bits:
    """The decoder before vectorisation (kept here only to measure against)."""

    def __init__(self, data):
        self.bits = np.unpackbits(np.asarray(data, np.uint8))
        self.i = 0

    def read(self, n: int) -> int:
        if self.i + n > self.bits.size:
            raise ValueError("brush RLE stream ends early")
        chunk = self.bits[self.i:self.i + n]
        self.i += n
        return int(chunk.dot(1 << np.arange(n - 1, -1, -1, dtype=np.int64))) if n else 0


def old_decode_values(rle) -> np.ndarray:
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


def best_of(fn, repeat: int) -> tuple[float, float, np.ndarray]:
    """(wall s, CPU s of this process, result), the fastest of ``repeat`` runs. On a shared machine the
    CPU time is the fairer figure: wall time there includes waiting for a core."""
    best, cpu, out = float("inf"), float("inf"), None
    for _ in range(max(1, repeat)):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        best, cpu = min(best, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return best, cpu, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--noise", type=float, default=0.15, help="share of pixels flipped at random in the noisiest mask")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    n = args.size
    masks = {"buildings": np.zeros((n, n), bool), "noisy": None}
    masks["buildings"][n // 8: n // 3, n // 5: n // 2] = True
    masks["buildings"][n // 2: 3 * n // 4, n // 2: 7 * n // 8] = True
    masks["noisy"] = masks["buildings"] ^ (rng.random((n, n)) < args.noise)
    print(f"{'mask':<10} {'rle bytes':>10} {'old s':>8} {'new s':>8} {'old cpu s':>10} {'new cpu s':>10} {'speedup':>8}")
    last = None
    for name, m in masks.items():
        rle = encode_mask(m)
        new_s, new_cpu, new = best_of(lambda: decode_values(rle), args.repeat)
        old_s, old_cpu, old = best_of(lambda: old_decode_values(rle), 1)
        if not np.array_equal(old, new):
            raise SystemExit(f"{name}: the decoders disagree")
        print(f"{name:<10} {len(rle):>10} {old_s:>8.3f} {new_s:>8.3f} {old_cpu:>10.3f} {new_cpu:>10.3f} "
              f"{old_s / new_s:>8.1f}")
        last = (old_s, new_s, old_cpu, new_cpu)
    print(f"size={n} old_s={last[0]:.3f} new_s={last[1]:.3f} old_cpu_s={last[2]:.3f} new_cpu_s={last[3]:.3f} "
          f"speedup={last[0] / last[1]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
