#!/usr/bin/env bash
# GPT-2 small with MARS on FineWeb-Edu (data/fineweb_edu): the paper's FineWeb-Edu run.
# Extra --key=value arguments are passed on; NPROC=<n> sets the number of GPUs. Run it again to resume.
exec bash "$(dirname "$0")/_launch.sh" config/train_gpt2_small_mars.py config/fineweb_edu.py "$@"
