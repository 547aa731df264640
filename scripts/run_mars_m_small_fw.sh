#!/usr/bin/env bash
# GPT-2 small with MARS-M on FineWeb-Edu (data/fineweb_edu): the MARS-M paper's FineWeb-Edu run.
# Extra --key=value arguments are passed on; NPROC=<n> sets the number of GPUs. Run it again to resume.
exec bash "$(dirname "$0")/_launch.sh" config/train_gpt2_small_mars_m.py config/fineweb_edu.py "$@"
