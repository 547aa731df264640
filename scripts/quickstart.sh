#!/usr/bin/env bash
# Quickstart, no network needed: prepare the stdlib_char corpus (this Python's own standard-library
# sources, character level), train a 3.2M-parameter GPT with MARS for 300 steps (a few minutes on a
# 2-core CPU; a GPU is used when there is one), then sample from it. Extra --key=value arguments go to
# train.py, e.g. `bash scripts/quickstart.sh --max_iters=100`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python data/stdlib_char/prepare.py
python train.py config/quickstart.py "$@"
python sample.py --out_dir=out-quickstart --start="def " --num_samples=1 --max_new_tokens=400
