"""Pre-label benchmark: each unsupervised change-proposal method against the real change masks the
repository ships (``data/levir-cd``: LEVIR-CD crops with their label/ masks), and how much of an
annotator's work a proposal would save.

    python -m benchmarks.prelabels [--data data/levir-cd] [--repeat 1]

Per method, over every pair with a mask (pooled over all pixels, as change-detection scores are):
precision, recall, F1 and IoU of the proposal against the real mask, and the edit share: the pixels an
annotator must change to turn the proposal into the real mask (false alarms to erase plus misses to
draw), over the pixels to draw when starting from an empty mask (the changed pixels). Below 1 the
proposal saves work; above 1 it costs more than drawing from nothing. ``proposals_per_s`` is pairs per
second of the best method's core in this one process (``--repeat`` runs, the fastest kept). Ends with

    best_method=<name> best_f1=<x> edit_share_vs_empty=<x> proposals_per_s=<x>

(the best method by F1; its edit share and speed).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import cv2
import numpy as np

from operators.annotation.proposals import METHODS, ProposalConfig, propose

REPO = Path(__file__).resolve().parents[1]


def load_pairs(root: Path) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    pairs = []
    for label in sorted((root / "label").glob("*.png")):
        a, b = cv2.imread(str(root / "A" / label.name)), cv2.imread(str(root / "B" / label.name))
        mask = cv2.imread(str(label), cv2.IMREAD_GRAYSCALE)
        if a is None or b is None or mask is None or a.shape != b.shape or a.shape[:2] != mask.shape:
            print(f"skipping {label.name}: missing image or size mismatch")
            continue
        pairs.append((label.stem, a, b, mask > 0))
    return pairs


def evaluate(method: str, pairs, repeat: int) -> dict:
    tp = fp = fn = changed = 0
    best_s = float("inf")
    for r in range(max(1, repeat)):
        t0 = time.perf_counter()
        found = [propose(method, a, b, ProposalConfig()).mask for _, a, b, _ in pairs]
        best_s = min(best_s, time.perf_counter() - t0)
    for m, (_, _, _, truth) in zip(found, pairs):
        tp += int(np.count_nonzero(m & truth))
        fp += int(np.count_nonzero(m & ~truth))
        fn += int(np.count_nonzero(~m & truth))
        changed += int(np.count_nonzero(truth))
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    return {"method": method, "precision": precision, "recall": recall,
            "f1": 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0,
            "iou": tp / (tp + fp + fn) if tp + fp + fn else 0.0,
            "edit_share_vs_empty": (fp + fn) / changed if changed else float("nan"),
            "proposals_per_s": len(pairs) / best_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(REPO / "data" / "levir-cd"), help="LEVIR-CD-layout folder with label/")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per method (the fastest is kept)")
    args = ap.parse_args(argv)
    pairs = load_pairs(Path(args.data))
    n_px = sum(t.size for *_, t in pairs)
    print(f"{len(pairs)} pairs with real masks, {n_px} pixels, {sum(int(t.sum()) for *_, t in pairs)} changed")
    rows = [evaluate(m, pairs, args.repeat) for m in METHODS]
    print(f"{'method':<11} {'precision':>9} {'recall':>7} {'F1':>6} {'IoU':>6} {'edit share':>10} {'pairs/s':>8}")
    for r in rows:
        print(f"{r['method']:<11} {r['precision']:9.3f} {r['recall']:7.3f} {r['f1']:6.3f} {r['iou']:6.3f} "
              f"{r['edit_share_vs_empty']:10.3f} {r['proposals_per_s']:8.2f}")
    best = max(rows, key=lambda r: r["f1"])
    print(f"best_method={best['method']} best_f1={best['f1']:.4f} edit_share_vs_empty={best['edit_share_vs_empty']:.4f} "
          f"proposals_per_s={best['proposals_per_s']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
