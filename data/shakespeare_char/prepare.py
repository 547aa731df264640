"""Tiny Shakespeare, character-level: train.bin / val.bin (uint16) and meta.pkl, as nanoGPT's.

python data/shakespeare_char/prepare.py                   # downloads input.txt (1.1 MB) when online
python data/shakespeare_char/prepare.py --input PATH      # a local copy, no network
"""

import argparse
import os
import sys
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from tokens import DataError, network_reachable, run_prepare, write_char_corpus  # noqa: E402

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def download(path):
    if not network_reachable("raw.githubusercontent.com"):
        raise DataError(
            f"cannot reach raw.githubusercontent.com to download tiny Shakespeare; fetch {URL} "
            f"elsewhere and pass --input PATH (or use the offline quickstart: "
            f"python data/stdlib_char/prepare.py)"
        )
    with urllib.request.urlopen(URL, timeout=30) as response:
        data = response.read()
    with open(path, "wb") as f:
        f.write(data)


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", help="a local input.txt (default: download it beside this script)")
    parser.add_argument("--output_dir", default=here)
    args = parser.parse_args(argv)
    path = args.input or os.path.join(here, "input.txt")
    if args.input is None and not os.path.exists(path):
        download(path)
    if not os.path.isfile(path):
        raise DataError(f"--input: no such file {path}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    write_char_corpus(args.output_dir, text)


if __name__ == "__main__":
    run_prepare(main)
