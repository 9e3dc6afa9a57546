"""Imports of the optional parts (extras), failing with a one-line install hint.

Core jobs never need these; a user who skips an extra gets the hint only when they run the part
that needs it.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# import name -> (extra that provides it, what needs it)
EXTRAS = {
    "matplotlib": ("report", "the report's figures"),
    "wordcloud": ("report", "the report's word cloud"),
    "pycocoevalcap": ("score", "caption scoring (BLEU, METEOR, ROUGE-L, CIDEr-D)"),
    "sklearn": ("prelabels", "the pca-kmeans change proposals"),
    "onnxruntime": ("prelabels", "onnx: pre-labels"),
}


class MissingExtra(ImportError):
    pass


def require(module: str) -> ModuleType:
    """``importlib.import_module(module)``, or :class:`MissingExtra` naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        extra, what = EXTRAS[top]
        raise MissingExtra(f"{what} need{'s' if not what.endswith('s') else ''} {top}: "
                           f"pip install 'changeforge[{extra}]' (from a checkout: pip install -e '.[{extra}]')"
                           ) from exc
