"""Tiny Shakespeare, character-level: train.bin / val.bin (uint16) and meta.pkl, as nanoGPT's.

python -m data.shakespeare_char.prepare                   # downloads input.txt (1.1 MB) when online
python -m data.shakespeare_char.prepare --input PATH      # a local copy, no network
"""

import argparse
import http.client
import os
import sys
import urllib.request

if not __package__:  # run by its path (python data/<name>/prepare.py, as nanoGPT's): import from the repository
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.prepare_common import add_output_dir, run_prepare, write_char_corpus
from marsgpt.files import atomic_write_bytes
from marsgpt.runtime import network_reachable
from marsgpt.tokens import DataError

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def download(path):
    if not network_reachable("raw.githubusercontent.com"):
        raise DataError(
            f"cannot reach raw.githubusercontent.com to download tiny Shakespeare; fetch {URL} "
            f"elsewhere and pass --input PATH (or use the offline quickstart: "
            f"python -m data.stdlib_char.prepare)"
        )
    try:
        with urllib.request.urlopen(URL, timeout=30) as response:
            data = response.read()
    except (OSError, http.client.HTTPException) as e:  # URLError, HTTPError and timeouts are OSErrors
        raise DataError(f"downloading {URL} failed ({e}); fetch it elsewhere and pass --input PATH") from None
    atomic_write_bytes(path, data)  # an interrupted download leaves no input.txt that looks complete


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", help="a local UTF-8 input.txt (default: download it beside this script)")
    add_output_dir(parser, __file__, "train.bin, val.bin and meta.pkl")
    args = parser.parse_args(argv)
    path = args.input or os.path.join(os.path.dirname(os.path.abspath(__file__)), "input.txt")
    if args.input is None and not os.path.exists(path):
        download(path)
    if os.path.isdir(path):
        raise DataError(f"--input: {path} is a directory; pass a text file")
    if not os.path.isfile(path):
        raise DataError(f"--input: no such file {path}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:  # read() decodes the whole file at once: e.start is its byte offset
        raise DataError(
            f"--input: {path} is not UTF-8 text (byte {e.start}: {e.reason}); convert it to UTF-8 first "
            f"(iconv -f <its encoding> -t UTF-8)"
        ) from None
    write_char_corpus(args.output_dir, text)


if __name__ == "__main__":
    run_prepare(main)
