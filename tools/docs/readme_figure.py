"""Render docs/assets/example-pair.png: one bundled LEVIR-CD pair, its change mask, the mask analysis
the captions and QA jobs compute, a reference caption and a reference QA pair, both checked by the
grounded validators. Run from the repository root: python tools/docs/readme_figure.py"""
from __future__ import annotations

import io
import json
import sys
import textwrap
from pathlib import Path

import cv2
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from PIL import Image  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from operators.language.mask_analysis import analyze_mask  # noqa: E402
from operators.language.validators import mask_facts, validate_text  # noqa: E402

NAME = "test_102_0512_0000"
CAPTION_INDEX = 1          # the reference caption shown (of three)
QA_LINE = "WHERE|Where did the most significant change occur?"  # a true statement of the benchmark set


def main(out: Path = ROOT / "docs/assets/example-pair.png") -> None:
    data = ROOT / "data"
    pre = cv2.cvtColor(cv2.imread(str(data / f"levir-cd/A/{NAME}.png")), cv2.COLOR_BGR2RGB)
    post = cv2.cvtColor(cv2.imread(str(data / f"levir-cd/B/{NAME}.png")), cv2.COLOR_BGR2RGB)
    mask = cv2.imread(str(data / f"levir-cd/label/{NAME}.png"), cv2.IMREAD_GRAYSCALE)
    stats = analyze_mask(mask)
    refs = json.load(open(data / "levir-cc/LevirCCcaptions.json"))
    image = next(i for i in refs["images"] if i["filename"] == f"{NAME}.png")
    caption = image["sentences"][CAPTION_INDEX]["raw"].strip().rstrip(" .") + "."
    qtype, question = QA_LINE.split("|")
    answer = next(line.split("|")[6] for line in open(ROOT / "benchmarks/validator_statements.txt")
                  if line.startswith(f"{NAME}|-|T|") and f"|{qtype}|{question}|" in line)
    facts = mask_facts(mask > 0, stats.components)
    for text, q, t in ((caption, None, None), (answer, question, qtype)):
        ok, violations = validate_text(text, facts, question=q, qtype=t)
        if not ok:
            raise SystemExit(f"validators reject {text!r}: {violations}")

    fig, axes = plt.subplots(1, 3, figsize=(9, 4.1), dpi=80)
    for ax, img, title in zip(axes, (pre, post, mask), ("pre (A)", "post (B)", "change mask (label)")):
        ax.imshow(img, cmap="gray" if img.ndim == 2 else None)
        ax.set_title(title, fontsize=11)
        ax.axis("off")
    lines = [f"mask analysis: CAR {stats.car:.1%}, {stats.components} changed area(s), {stats.region}",
             f"caption: {caption}", f"QA ({qtype}): {question}  {answer}"]
    text = "\n".join(textwrap.fill(s, 110, subsequent_indent="    ") for s in lines)
    fig.text(0.02, 0.02, text, fontsize=9.5, va="bottom", family="DejaVu Sans")
    fig.subplots_adjust(left=0.01, right=0.99, top=0.93, bottom=0.25, wspace=0.04)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    # A 256-colour palette halves the file; the photos show no banding at this size.
    Image.open(buf).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT,
                                            dither=Image.Dither.NONE).save(out, optimize=True)
    print(out, stats)


if __name__ == "__main__":
    main()
