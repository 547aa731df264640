#!/usr/bin/env bash
# Quickstart, no network needed: prepare the stdlib_char corpus (this Python's own standard-library
# sources, character level), train a small GPT with MARS (config/quickstart.py; under 3 minutes on a
# 2-core CPU, a GPU is used when there is one), then sample from it. Extra --key=value arguments go to
# train.py, e.g. `bash scripts/quickstart.sh --max_iters=100`; an --out_dir among them is where the sample
# is read from too.
# Running it again continues the run in its out_dir (--init_from=auto): an interrupted or preempted one
# from its newest checkpoint, a finished one only samples again. To train afresh over it:
#   bash scripts/quickstart.sh --init_from=scratch --overwrite=True
# The three steps run in one Python process this script becomes (exec, scripts/quickstart.py), so a signal
# to the script's pid stops the training itself, with a checkpoint the same command continues.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec python -m scripts.quickstart "$@"
