#!/usr/bin/env bash
# GPT-2 small with Moonlight (Muon + AdamW, MARS-M's baseline) on FineWeb-Edu (data/fineweb_edu): the MARS-M paper's FineWeb-Edu run.
# Extra --key=value arguments are passed on; NPROC=<n> sets the number of GPUs. Run it again to resume.
exec bash "$(dirname "$0")/_launch.sh" config/train_gpt2_small_moonlight.py config/fineweb_edu.py "$@"
