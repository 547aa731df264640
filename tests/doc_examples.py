"""The code examples of the docs that tests run as they stand: the ```python block after `<!-- example: NAME -->`."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def docs_example(name, doc="docs/mars.md"):
    """The source of the example NAME in doc (a path from the repository root)."""
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = f.read()
    marker = f"<!-- example: {name} -->"
    if marker not in text:
        raise LookupError(f"{doc} has no example {name!r} (a line {marker} before its ```python block)")
    return _BLOCK.search(text, text.index(marker)).group(1)
