#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on synthetic data and without network, every launch path, GPT-2 small compiled
# under DDP with MARS, AdamW and --deterministic=True, the MARS CUDA step, a kill -9 and resume, peak memory
# against the plan, sample.py and HellaSwag, printed as one table (< 14 minutes on one H200; the checks that
# decide the most: scripts/gpu_first10.sh). The logic is scripts/gpu_check.py.
#     bash scripts/gpu_check.sh [--out DIR] [--only CHECK ...] [--device=cpu]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec python -m scripts.gpu_check "$@"
