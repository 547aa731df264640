"""The tables of docs/memory.md: the memory plan --dry_run=True prints for every paper run on 8 GPUs of 40 and
80 GiB, plain DDP or ZeRO-1, with and without activation checkpointing, and plain DDP with --deterministic=True.

    python -m scripts.memory_table

Each cell is what `python train.py config/<run>.py --dry_run=True --plan_world_size=8 --gpu_memory_gb=<40|80>
[--zero_stage=1] [--activation_checkpointing=True] [--deterministic=True]` prints on its total line
(memory_plan.dry_run_plan).
"""

import os

from marsgpt import memory_plan
from marsgpt.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GPUS = 8
GPU_MEMORY_GB = (40, 80)
SIZES = ("small", "medium", "large", "xl")
OPTIMIZERS = ("mars", "adamw", "muon")
VARIANTS = {  # column -> overrides
    "DDP": [],
    "ZeRO-1": ["--zero_stage=1"],
    "DDP + ckpt": ["--activation_checkpointing=True"],
    "ZeRO-1 + ckpt": ["--zero_stage=1", "--activation_checkpointing=True"],
    "DDP, deterministic": ["--deterministic=True"],
}


def paper_runs():
    """(size, optimizer, config path) of every config/train_gpt2_<size>_<optimizer>.py the paper ran."""
    runs = []
    for size in SIZES:
        for optimizer in OPTIMIZERS:
            path = os.path.join("config", f"train_gpt2_{size}_{optimizer}.py")
            if os.path.isfile(os.path.join(ROOT, path)):
                runs.append((size, optimizer, path))
    return runs


def cell(plan):
    mark = "fits" if plan.fits else "**no**"
    return f"{plan.total_bytes / memory_plan.GIB:.1f} {mark} ({plan.max_micro_batch})"


def table(gpu_memory_gb, runs, plans):
    lines = [
        f"**{GPUS} GPUs of {gpu_memory_gb} GiB** ({gpu_memory_gb * (1 - memory_plan.HEADROOM):.0f} GiB usable): "
        "GiB per GPU at the peak, whether it fits, (the largest micro-batch that fits)",
        "",
        "| run | micro-batch | " + " | ".join(VARIANTS) + " |",
        "|---|---|" + "---|" * len(VARIANTS),
    ]
    for size, optimizer, path in runs:
        cells = [cell(plans[path, gpu_memory_gb, variant]) for variant in VARIANTS]
        micro_batch = plans[path, gpu_memory_gb, "DDP"].micro_batch
        lines.append(f"| {size} {optimizer} | {micro_batch} x 1024 | " + " | ".join(cells) + " |")
    return lines


def plan_runs(runs):
    """{(config path, GiB, column): the plan --dry_run=True prints} for runs as paper_runs() lists them."""
    plans = {}
    for _, _, path in runs:
        layout = None  # the optimizer's state per parameter: the same in every column
        for gpu_memory_gb in GPU_MEMORY_GB:
            for variant, overrides in VARIANTS.items():
                argv = [path, "--dry_run=True", f"--plan_world_size={GPUS}", f"--gpu_memory_gb={gpu_memory_gb}"]
                cfg = load_config(argv + overrides)
                layout = layout or memory_plan.optimizer_layout(cfg, memory_plan.planned_model_args(cfg))
                plans[path, gpu_memory_gb, variant] = memory_plan.dry_run_plan(cfg, layout)
    return plans


def main():
    os.chdir(ROOT)  # the config files import config.paper
    runs = paper_runs()
    plans = plan_runs(runs)
    missing = sorted({f"{s} {o}" for s in SIZES for o in OPTIMIZERS} - {f"{s} {o}" for s, o, _ in runs})
    out = []
    for gpu_memory_gb in GPU_MEMORY_GB:
        out += table(gpu_memory_gb, runs, plans) + [""]
    if missing:
        out.append(f"(No config for: {', '.join(missing)}.)")
    print("\n".join(out).rstrip())


if __name__ == "__main__":
    main()
