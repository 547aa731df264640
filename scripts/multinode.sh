#!/usr/bin/env bash
# Multi-node training: run the same command on every node, e.g. on 2 nodes of 8 GPUs
#   node 0: NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash scripts/multinode.sh config/train_gpt2_xl_mars.py config/fineweb_edu.py
#   node 1: NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash scripts/multinode.sh config/train_gpt2_xl_mars.py config/fineweb_edu.py
# The global batch stays the config's (gradient_accumulation_steps counts micro-batches over all ranks,
# and must be a multiple of NNODES x NPROC). Run again, the same command resumes from out_dir's checkpoint
# (--init_from=auto, see _launch.sh).
# NODE_RANK defaults to SLURM_NODEID; MASTER_PORT to 29500; RDZV_ID to SLURM_JOB_ID; NPROC to the node's GPUs.
set -euo pipefail
: "${NNODES:?set NNODES (number of nodes)}" "${MASTER_ADDR:?set MASTER_ADDR (host name of node 0)}"
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:?set NODE_RANK (0 .. NNODES-1)}}
export TORCHRUN_ARGS="--nnodes=$NNODES --node_rank=$NODE_RANK --rdzv_id=${RDZV_ID:-${SLURM_JOB_ID:-mars}} \
--rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:${MASTER_PORT:-29500}"
exec bash "$(dirname "$0")/_launch.sh" "$@"
