#!/usr/bin/env bash
# Shared by the run_*.sh scripts and multinode.sh: torchrun train.py with the given config files and
# --key=value arguments, one process per visible GPU of this node (NPROC overrides; 1 without GPUs). Runs
# from the repository root, so paths are relative to it. TORCHRUN_ARGS replaces --standalone (multinode.sh).
# --init_from=auto goes first: the same command run again (a requeued or preempted job, a crash) resumes
# from out_dir's checkpoint, and the caller's own --init_from=... (given later) wins.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z "${NPROC:-}" ]]; then
  # torch counts what CUDA_VISIBLE_DEVICES leaves visible; nvidia-smi is the fallback without torch.
  gpus=$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null) \
    || gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') || gpus=0
  NPROC=$(( gpus > 0 ? gpus : 1 ))
fi
# A SIGTERM to torchrun (a preemption, the SLURM example's time limit) reaches the ranks too; torchrun then
# waits this long for them to write their checkpoint and exit before it kills them (torch 2.12 and later read
# it; older ones wait 30 s). A GPT-2 XL checkpoint (~25 GB) needs minutes on slow storage.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}
read -r -a launcher <<< "${TORCHRUN_ARGS:---standalone}"
exec torchrun "${launcher[@]}" --nproc_per_node="$NPROC" train.py --init_from=auto "$@"
