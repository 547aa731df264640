"""The quickstart corpus: the running interpreter's own standard-library sources, character-level.

Needs no network and takes seconds. Takes ASCII-only .py files (tests, idlelib and site-packages
left out) in sorted path order until --chars characters, then splits 90/10 by position like nanoGPT's
shakespeare_char. Writes train.bin and val.bin (headerless uint16) and meta.pkl (the ~100-character
vocabulary) beside this file, or in --output_dir.

    python -m data.stdlib_char.prepare
"""

import argparse
import os
import sys
import sysconfig

if not __package__:  # run by its path (python data/<name>/prepare.py, as nanoGPT's): import from the repository
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.prepare_common import add_output_dir, run_prepare, write_char_corpus
from marsgpt.tokens import DataError

SKIPPED_DIRS = {"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "__pycache__"}


def stdlib_sources(max_chars):
    """The stdlib's .py files in sorted order, concatenated up to max_chars characters."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    parts, total = [], 0
    for path in sorted(paths, key=lambda p: os.path.relpath(p, root)):
        with open(path, "rb") as f:
            raw = f.read()
        if not raw.isascii():
            continue
        text = raw.decode("ascii").replace("\r\n", "\n")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if total == 0:
        raise DataError(f"no ASCII .py sources found under {root}")
    return "".join(parts)[:max_chars]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_dir(parser, __file__, "train.bin, val.bin and meta.pkl")
    parser.add_argument("--chars", type=int, default=5_000_000, help="corpus size in characters (default: 5000000)")
    args = parser.parse_args(argv)
    if args.chars < 1:  # [:max_chars] would cut characters off the end instead
        raise DataError(f"--chars must be positive, got {args.chars}")
    write_char_corpus(args.output_dir, stdlib_sources(args.chars))


if __name__ == "__main__":
    run_prepare(main)
