"""A generated-case test's cases split between the quick loop and the full suite.

The first case (or the first few) of a parametrized generated-case test runs in the quick loop
(`pytest -m quick`): each family and rule keeps a case there. The rest carry the ``seeds`` marker:
they run in the full suite and in the mutation oracle of the modules they test (tools/mutation.toml,
``marker = "quick or seeds"``), not in the quick loop, whose budget (60 s on two cores) the
1024 px crops would otherwise use up (docs/testing.md, "The quick loop")."""
from __future__ import annotations

from typing import Iterable

import pytest


def quick_first(values: Iterable, quick: int = 1, ids: Iterable | None = None) -> list:
    """``values`` as pytest params: the first ``quick`` in the quick loop, the others marked ``seeds``.
    A tuple is one case's arguments (for a parametrize of several names). A test keeps at least one
    case in the quick loop (its rule is checked at every quick run)."""
    if quick < 1:
        raise ValueError(f"quick_first: keep at least one case in the quick loop, got quick={quick}")
    ids = list(ids) if ids is not None else None
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)),
                         marks=() if i < quick else pytest.mark.seeds,
                         id=None if ids is None else ids[i])
            for i, v in enumerate(values)]
