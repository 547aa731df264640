#!/usr/bin/env bash
# GPT-2 small with MARS-M on OpenWebText: the MARS-M paper's run (global batch 480 x 1024 tokens, 100k steps).
# Extra --key=value arguments are passed on; NPROC=<n> sets the number of GPUs. Run it again to resume.
exec bash "$(dirname "$0")/_launch.sh" config/train_gpt2_small_mars_m.py "$@"
