#!/usr/bin/env bash
# The small-scale optimizer study (see scripts/study_small.py): 5 optimizers x 3 learning rates on the
# offline stdlib_char corpus, CPU: 10 minutes on 2 idle cores, 33 under load. Resumable: rerun the same
# command after an interruption. Arguments go to study_small.py (--out DIR, --only ..., --dry_run,
# --key=value for train.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -f data/stdlib_char/train.bin ] || python data/stdlib_char/prepare.py
python scripts/study_small.py "$@"
