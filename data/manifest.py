"""Write manifest.json for a dataset prepared elsewhere (by nanoGPT, the paper's code, or before manifests).

    python -m data.manifest data/openwebtext

The prepare scripts write it as they finish. It records each token file's and meta.pkl's size, modification
time and SHA-256, so that train.py fingerprints the data (what each checkpoint records, to name a resume on
changed data) without reading it: without a manifest every launch hashes every file. A file changed since
is hashed again at each launch, until this command is run again (it rehashes only the files that changed).
"""

import argparse

from data.prepare_common import run_prepare
from marsgpt.tokens import write_manifest


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", help="the dataset's directory, e.g. data/openwebtext")
    args = parser.parse_args(argv)
    print(f"wrote {write_manifest(args.data_dir)}")


if __name__ == "__main__":
    run_prepare(main)
