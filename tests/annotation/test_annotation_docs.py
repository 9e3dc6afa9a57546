"""The ```python examples of docs/annotation.md, run in order in one namespace as a reader would paste
them: each rule the page states holds as written."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "annotation.md"


def test_every_python_example_of_the_annotation_page_runs():
    blocks = [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)]
    assert len(blocks) >= 7, "the page's rule examples went missing"
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name} example {i + 1}", "exec"), namespace)   # noqa: S102 - the page's own code
