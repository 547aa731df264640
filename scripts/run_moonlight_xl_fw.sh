#!/usr/bin/env bash
# GPT-2 xl with Moonlight (Muon + AdamW, MARS-M's baseline) on FineWeb-Edu (data/fineweb_edu): the MARS-M paper's FineWeb-Edu run.
# (The reference's run_moonlight_xl_fw.sh launches train_adanw_fw.py, absent from its repository, with its large
# Moonlight config; this runs the xl one, as its MARS-M counterpart does.)
# Extra --key=value arguments are passed on; NPROC=<n> sets the number of GPUs. Run it again to resume.
exec bash "$(dirname "$0")/_launch.sh" config/train_gpt2_xl_moonlight.py config/fineweb_edu.py "$@"
