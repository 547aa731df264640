#!/usr/bin/env bash
# The small-scale optimizer study (see scripts/study_small.py): every optimizer at a bracketed learning rate,
# 3 seeds there, at 120 and 480 steps, on the offline stdlib_char corpus, CPU, two runs at a time. Resumable:
# rerun the same command after an interruption, or after adding an optimizer. Arguments go to study_small.py
# (--out DIR, --only ..., --budgets ..., --seeds N, --jobs N, --dry_run, --key=value for train.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -f data/stdlib_char/train.bin ] || python -m data.stdlib_char.prepare
python -m scripts.study_small "$@"
