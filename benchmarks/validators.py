"""How well the grounded validators separate true statements from planted errors, on real masks.

    python -m benchmarks.validators [--statements <file> ...] [--show]

The statements (benchmarks/validator_statements.txt) were written by looking at the repository's real
LEVIR-CD masks (data/levir-cd/label, whole 256 px masks and their 128 px quadrants) before the
validators existed (see git history): half are true, half carry exactly one planted error, each
labelled with the rule it is about. A mask may also be synthetic, ``synth:<size>:<y>,<x>,<h>,<w>+...`` (boxes
of change on an empty square mask: the paper's 1024 px crops). A set whose header says ``# qa-numbers: strict``
has its QA answers checked with the QA job's numbers rule (:func:`qa_validator_config`: no figure, hedged or
not); the others were labelled under the audit's rule (a hedged round estimate is checked against the CAR).
Prints per rule how many planted errors were caught (by any rule,
and by the rule they were planted for) and how many true statements were rejected (by which rule),
then ``caught=<fraction of planted errors> false_rejects=<fraction of true statements> statements=<n>``.
Targets: caught >= 0.95, false_rejects <= 0.03.
"""
from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

import cv2
import numpy as np

from operators.language.mask_analysis import analyze_mask, binarize_mask
from operators.language.validators import RULES, ValidatorConfig, mask_facts, qa_validator_config, validate_text

REPO = Path(__file__).resolve().parents[1]
LABELS = REPO / "data" / "levir-cd" / "label"
HERE = Path(__file__).resolve().parent
# In the order they were written: the main set, two held-out sets, the two development sets of the
# fourth revision (see the README for which validator revision first saw each of them).
STATEMENT_SETS = [HERE / "validator_statements.txt", HERE / "validator_statements_heldout.txt",
                  HERE / "validator_statements_heldout2.txt", HERE / "validator_statements_dev.txt",
                  HERE / "validator_statements_dev2.txt"]
# Sets written blind, by someone who had seen neither the rules nor the other sets; each was run once on
# the rules as they stood, then revised on (see the README's history).
STATEMENT_SETS += [HERE / f"validator_statements_heldout{k}.txt" for k in (3, 4, 5, 6, 7)]
# Written before the validators were changed for issue 32 (exception scopes, one small object, hedged numbers).
STATEMENT_SETS += [HERE / "validator_statements_heldout8.txt"]
CROPS = {"ul": (0, 0), "ur": (0, 1), "ll": (1, 0), "lr": (1, 1)}


def load_statements(path: Path) -> list[dict]:
    out = []
    text = path.read_text(encoding="utf-8")
    strict = bool(re.search(r"^# qa-numbers: strict\b", text, re.M))
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        mask, crop, label, rule, qtype, question, text = line.split("|", 6)
        out.append({"set": path.stem, "mask": mask, "crop": None if crop == "-" else crop, "true": label == "T", "rule": rule,
                    "type": None if qtype == "-" else qtype, "question": question or None, "text": text,
                    "strict_qa": strict and qtype != "-"})
    return out


def load_mask(name: str, crop: str | None):
    if name.startswith("synth:"):
        _, size, boxes = name.split(":", 2)
        mask = np.zeros((int(size), int(size)), bool)
        for box in filter(None, boxes.split("+")):
            y, x, h, w = map(int, box.split(","))
            mask[y:y + h, x:x + w] = True
        return mask
    mask = binarize_mask(cv2.imread(str(LABELS / f"{name}.png"), cv2.IMREAD_UNCHANGED))
    if crop:
        h, w = mask.shape[0] // 2, mask.shape[1] // 2
        i, j = CROPS[crop]
        mask = mask[i * h:(i + 1) * h, j * w:(j + 1) * w]
    return mask


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--statements", action="append", default=None,
                    help="statement file(s) (default: all the sets in benchmarks/)")
    ap.add_argument("--show", action="store_true", help="print every miss and every false reject")
    args = ap.parse_args(argv)
    statements = [s for path in (args.statements or STATEMENT_SETS) for s in load_statements(Path(path))]
    facts_cache: dict = {}
    planted, caught, caught_own, true_n, false_rej = Counter(), Counter(), Counter(), Counter(), Counter()
    rejected_by = Counter()
    per_set: dict[str, Counter] = {}
    for s in statements:
        key = (s["mask"], s["crop"])
        if key not in facts_cache:
            mask = load_mask(*key)
            facts_cache[key] = mask_facts(mask, analyze_mask(mask).components)
        cfg = qa_validator_config() if s["strict_qa"] else ValidatorConfig()
        ok, violations = validate_text(s["text"], facts_cache[key], s["question"], s["type"], cfg)
        fired = {v.rule for v in violations}
        tally = per_set.setdefault(s["set"], Counter())
        tally["true" if s["true"] else "planted"] += 1
        tally[("false_reject" if s["true"] else "caught")] += not ok
        if s["true"]:
            true_n[s["rule"]] += 1
            if not ok:
                false_rej[s["rule"]] += 1
                rejected_by.update(fired)
                if args.show:
                    print(f"FALSE REJECT {key} {s['question'] or ''} {s['text']!r}: {violations}")
        else:
            planted[s["rule"]] += 1
            if not ok:
                caught[s["rule"]] += 1
                caught_own[s["rule"]] += s["rule"] in fired
            elif args.show:
                print(f"MISSED [{s['rule']}] {key} {s['question'] or ''} {s['text']!r}")
    synthetic = sum(1 for name, _ in facts_cache if name.startswith("synth:"))
    print(f"{len(facts_cache) - synthetic} real masks (whole and quadrants), {synthetic} synthetic, "
          f"{len(statements)} statements")
    print(f"{'rule':<10} {'planted':>7} {'caught':>6} {'by rule':>7} {'true':>5} {'false rejects':>13} {'rejecting':>9}")
    for rule in RULES:
        print(f"{rule:<10} {planted[rule]:>7} {caught[rule]:>6} {caught_own[rule]:>7} {true_n[rule]:>5} "
              f"{false_rej[rule]:>13} {rejected_by[rule]:>9}")
    for name, t in per_set.items():
        print(f"{name}: caught={t['caught'] / max(t['planted'], 1):.3f} "
              f"false_rejects={t['false_reject'] / max(t['true'], 1):.3f} statements={t['planted'] + t['true']}")
    n_planted, n_true = sum(planted.values()), sum(true_n.values())
    result = {"caught": sum(caught.values()) / max(n_planted, 1),
              "false_rejects": sum(false_rej.values()) / max(n_true, 1), "statements": len(statements)}
    print(f"caught={result['caught']:.3f} false_rejects={result['false_rejects']:.3f} statements={result['statements']}")
    return result


if __name__ == "__main__":
    main()
