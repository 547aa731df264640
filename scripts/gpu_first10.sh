#!/usr/bin/env bash
# The first minutes of a lent GPU (docs/gpu.md): warm the node, then the checks that decide the most -- GPT-2
# small's paper config compiled under DDP (tokens/s, MFU both ways, compile cold and then warm, graph breaks and
# recompiles, peak memory against the plan, the attention kernel), MARS's default step against fused=True with
# the host-sync check, FSDP2 (train.py --zero_stage=3 sharded over every GPU, MARS's sharded steps against
# FSDP2 + AdamW), a bitwise kill -9 resume and the quickstart's seconds -- as one table (< 8 minutes on one
# H200). scripts/gpu_check.py --first10.
#     bash scripts/gpu_first10.sh [--out DIR] [--device=cpu]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec python -m scripts.gpu_check --first10 "$@"
