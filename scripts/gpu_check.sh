#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on synthetic data and without network, every launch path, GPT-2 small's
# throughput with MARS and AdamW, the MARS CUDA step, a kill -9 and resume, peak memory, sample.py and
# HellaSwag, printed as one table (< 8 minutes on one H200). The logic is scripts/gpu_check.py.
#     bash scripts/gpu_check.sh [--out DIR] [--only CHECK ...] [--device=cpu]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec python -m scripts.gpu_check "$@"
