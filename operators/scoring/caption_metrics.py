"""Caption metrics through the COCO caption evaluation package (``pycocoevalcap``), exactly as the field
calls it: PTB tokenizer (Stanford CoreNLP 3.4.1, lower-cased, punctuation removed), then ``Bleu(4)``,
``Meteor()``, ``Rouge()`` and ``Cider()`` (which is CIDEr-D: Gaussian length penalty and clipped
counts). SPICE is left out: it downloads Stanford CoreNLP models on first use, impossible offline.

Pitfalls of the package (also in the README): CIDEr's document frequencies come from the references of
the set being scored, so scores over different subsets (or a subset vs the whole) are not comparable,
and a set of one image scores 0 CIDEr (every n-gram then has document frequency 1 -> idf 0).
"""
from __future__ import annotations

import contextlib
import io
import shutil
import subprocess

from operators.optional import require

METRIC_KEYS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr")
SPICE_NOTE = "SPICE not computed: it downloads Stanford CoreNLP models on first use, which is not possible offline"


class JavaMissing(RuntimeError):
    pass


def require_java() -> str:
    """Path of a working ``java``; a clear error naming what to install otherwise."""
    java = shutil.which("java")
    hint = ("the caption metrics need Java (pycocoevalcap's PTB tokenizer and METEOR run it): install a Java "
            "runtime, e.g. Debian's default-jre-headless (apt-get install -y default-jre-headless), and put "
            "`java` on PATH")
    if not java:
        raise JavaMissing(f"java not found: {hint}")
    try:
        subprocess.run([java, "-version"], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise JavaMissing(f"java at {java} does not run ({exc}): {hint}") from None
    return java


def tokenize(texts: dict[str, list[str]]) -> dict[str, list[str]]:
    """``{id: [sentence, ...]}`` -> the same, PTB-tokenised by the package's own tokenizer."""
    PTBTokenizer = require("pycocoevalcap.tokenizer.ptbtokenizer").PTBTokenizer

    require_java()
    with contextlib.redirect_stdout(io.StringIO()):
        return PTBTokenizer().tokenize({k: [{"caption": s} for s in v] for k, v in texts.items()})


def score_tokenized(gts: dict[str, list[str]], res: dict[str, list[str]],
                    subsets: dict[str, list[str]]) -> dict[str, tuple[dict[str, float | None], dict[str, dict[str, float]]]]:
    """For each named subset of ids: corpus scores and per-id scores of the tokenised references and
    predictions (one prediction per id); an empty subset gives ``None`` scores. Each subset is scored
    on its own, exactly as the package scores a set (so CIDEr's document frequencies are the subset's).
    One METEOR process serves every subset (its start-up dominates small sets)."""
    Bleu = require("pycocoevalcap.bleu.bleu").Bleu
    Cider = require("pycocoevalcap.cider.cider").Cider
    Meteor = require("pycocoevalcap.meteor.meteor").Meteor
    Rouge = require("pycocoevalcap.rouge.rouge").Rouge

    require_java()
    meteor = Meteor()
    out = {}
    try:
        for subset, ids in subsets.items():
            if not ids:
                out[subset] = ({k: None for k in METRIC_KEYS}, {})
                continue
            g = {i: gts[i] for i in ids}
            r = {i: res[i] for i in ids}
            corpus: dict[str, float | None] = {}
            per_id: dict[str, dict[str, float]] = {i: {} for i in ids}
            scorers = [(Bleu(4), list(METRIC_KEYS[:4])), (meteor, ["METEOR"]), (Rouge(), ["ROUGE_L"]),
                       (Cider(), ["CIDEr"])]
            for scorer, names in scorers:
                with contextlib.redirect_stdout(io.StringIO()):  # Bleu prints its n-gram statistics
                    score, scores = scorer.compute_score(g, r)
                if len(names) == 1:
                    score, scores = [score], [scores]
                for name, sc, scs in zip(names, score, scores):
                    corpus[name] = float(sc)
                    for i, s in zip(ids, scs):
                        per_id[i][name] = float(s)
            out[subset] = (corpus, per_id)
    finally:
        _close_meteor(meteor)
    return out


def _close_meteor(meteor) -> None:
    """Stop METEOR's Java process now (the package only does it in ``__del__``)."""
    proc = getattr(meteor, "meteor_p", None)
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(Exception):
            proc.stdin.close()
        proc.kill()
        proc.wait()
    with contextlib.suppress(Exception):
        meteor.meteor_p = _DeadProcess()


class _DeadProcess:
    """Stands in for the killed METEOR process so the package's ``__del__`` is a no-op."""

    class _Pipe:
        def close(self):
            pass

    stdin = _Pipe()

    def kill(self):
        pass

    def wait(self):
        pass
