#!/usr/bin/env bash
# Quickstart, no network needed: prepare the stdlib_char corpus (this Python's own standard-library
# sources, character level), train a small GPT with MARS (config/quickstart.py; under 3 minutes on a
# 2-core CPU, a GPU is used when there is one), then sample from it. Extra --key=value arguments go to
# train.py, e.g. `bash scripts/quickstart.sh --max_iters=100`; an --out_dir among them is where the sample
# is read from too.
# Running it again continues the run in its out_dir (--init_from=auto): an interrupted or preempted one
# from its newest checkpoint, a finished one only samples again. To train afresh over it:
#   bash scripts/quickstart.sh --init_from=scratch --overwrite=True
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out_dir=out-quickstart
for arg in "$@"; do
    case "$arg" in
        --out_dir=*) out_dir="${arg#--out_dir=}" ;;
    esac
done
python -m data.stdlib_char.prepare
python train.py config/quickstart.py --init_from=auto "$@"
python sample.py --out_dir="$out_dir" --start="def " --num_samples=1 --max_new_tokens=400
