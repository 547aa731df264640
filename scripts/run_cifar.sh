#!/usr/bin/env bash
# The paper's CIFAR grid for one optimizer (vision/train_cifar.py): ResNet-18, 200 epochs, batch 128,
# MultiStepLR x0.1 at epochs 100 and 150, base learning rate 1e-5, 1e-4, 1e-3, 1e-2 and 1e-1; the paper
# reports each optimizer's best. The base lr is --learning_rate: AdamW's for every tensor, MARS's for
# the tensors MARS takes, Muon's for its matrices; lr_1d (3e-3) stays, as in the reference.
#
#   bash scripts/run_cifar.sh mars|mars-nd|adamw|muon [cifar10|cifar100] [config/file.py ...] [--key=value ...]
#
# mars is the paper's routing (only 2-D tensors take MARS), mars-nd puts the convolutions under MARS too.
# The runs go one after another into out-cifar/<dataset>_<optimizer>_lr<lr>/ and resume where they
# stopped (init_from=auto): rerun the same command after an interruption. LRS="1e-3 1e-2" runs part of
# the grid (e.g. one lr per GPU with --device=cuda:N); extra --key=value go to every run; DRY_RUN=1
# prints the commands only.
set -euo pipefail
usage="usage: bash scripts/run_cifar.sh mars|mars-nd|adamw|muon [cifar10|cifar100] [config/file.py ...] [--key=value ...]"
if [[ "${1:-}" == --help || "${1:-}" == -h ]]; then
  # this header comment, without its '#'s: the usage and what the script does
  sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"
  exit 0
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."  # config files are named from the repository root, as the runs see them
case "${1:-}" in
  mars) optimizer=(--optimizer_name=mars --mars_routing=2d) ;;
  mars-nd) optimizer=(--optimizer_name=mars --mars_routing=nd) ;;
  adamw | muon) optimizer=(--optimizer_name="$1") ;;
  *) echo "error: the first argument names the optimizer; $usage" >&2; exit 2 ;;
esac
name=$1
shift
dataset=cifar10
if [[ "${1:-}" == cifar10 || "${1:-}" == cifar100 ]]; then
  dataset=$1
  shift
elif [[ $# -gt 0 && "$1" != --* && ! -f "$1" ]]; then  # a typo of a dataset would otherwise train cifar10
  echo "error: the second argument '$1' is neither a dataset (cifar10 or cifar100) nor a config file; $usage" >&2
  exit 2
fi
for lr in ${LRS:-1e-5 1e-4 1e-3 1e-2 1e-1}; do
  ${DRY_RUN:+echo} python -m vision.train_cifar --dataset="$dataset" "${optimizer[@]}" --learning_rate="$lr" \
    --out_dir="out-cifar/${dataset}_${name}_lr${lr}" --init_from=auto "$@"
done
