"""What the docs show that tests run as it stands: the code examples (the ```python block after
`<!-- example: NAME -->`) and the commands (doc_commands)."""

import glob
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


DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
_FENCED = re.compile(r"```(\w*)\n(.*?)```", re.DOTALL)
_INLINE = re.compile(r"`([^`]+)`")
# what a command starts with: environment variables, then a program a reader runs from the repository root
_COMMAND = re.compile(
    r"^(?:[A-Z_]+=\S+ )*(?:time |nohup |sudo )?(?:python3?|bash|torchrun|sbatch|pip|lm_eval|ruff)( |$)"
)


def doc_commands():
    """{command: [the docs that show it]}, as a reader would copy them: each line of a ```bash block (continued
    lines joined, a trailing # comment dropped) and each code span of the text that starts as a command does
    (python, bash, torchrun, pip, ..., after NAME=value settings), its line breaks made spaces."""
    commands = {}
    for doc in DOCS:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = f.read()
        for language, block in _FENCED.findall(text):
            if language != "bash":
                continue
            for line in block.replace("\\\n", " ").splitlines():
                line = " ".join(re.sub(r"(^|\s)#.*$", "", line).split())
                if line:
                    commands.setdefault(line, []).append(doc)
        for span in _INLINE.findall(_FENCED.sub("", text)):
            span = " ".join(span.split())
            if _COMMAND.match(span):
                commands.setdefault(span, []).append(doc)
    return commands
