"""The tables of docs/memory.md: the memory plan --dry_run=True prints for every paper run on 8 GPUs of 40 and
80 GiB, plain DDP or ZeRO-1, with and without activation checkpointing, and plain DDP with --deterministic=True;
and the largest GPT-2-shaped model of a ladder (GPT-2's four sizes, then GPT-3's shapes) that MARS trains on 8 GPUs
of 40 and 80 GiB with ZeRO-1 and with FSDP2 (largest_models).

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
PAPER_OPTIMIZERS = ("mars", "adamw", "muon")  # the optimizers of the paper's runs, as config/ names them
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
        for optimizer in PAPER_OPTIMIZERS:
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


# GPT-2-shaped (model.py's GPT: pre-LayerNorm, learned positions, tied embeddings, 64-wide heads but GPT-2 XL's
# 25 of 64): GPT-2's sizes, then GPT-3's 2.7B, 6.7B and 13B shapes, GPT-NeoX-20B's and a 39B one
LADDER = ((12, 768, 12), (24, 1024, 16), (36, 1280, 20), (48, 1600, 25), (32, 2560, 32), (32, 4096, 32))
LADDER += ((40, 5120, 40), (44, 6144, 48), (48, 8192, 64))
# the most memory-frugal way to train each: micro-batch 1 of 1024 tokens, activation checkpointing, one
# micro-batch per rank and step (no whole gradients waiting between micro-batches under FSDP2)
FRUGAL = ["--batch_size=1", f"--gradient_accumulation_steps={GPUS}", "--activation_checkpointing=True"]
SHARDINGS = {"ZeRO-1": "--zero_stage=1", "FSDP2": "--zero_stage=3"}


def largest_command(gpu_memory_gb, sharding, shape):
    """The train.py arguments whose --dry_run=True plan the largest-model table reads."""
    n_layer, n_embd, n_head = shape
    return [
        "config/train_gpt2_xl_mars.py",
        "--dry_run=True",
        f"--plan_world_size={GPUS}",
        f"--gpu_memory_gb={gpu_memory_gb}",
        SHARDINGS[sharding],
        f"--n_layer={n_layer}",
        f"--n_embd={n_embd}",
        f"--n_head={n_head}",
        *FRUGAL,
    ]


def largest_models_from(gpu_memory_gb, sharding, ladder=LADDER):
    """(shape, its plan) of the largest shape of `ladder` (smallest first) that fits, before the first that does
    not; None when the first does not: MARS (the paper's XL config: MARS-AdamW, bfloat16) planned as
    largest_command says."""
    found = None
    for shape in ladder:
        plan = memory_plan.dry_run_plan(load_config(largest_command(gpu_memory_gb, sharding, shape)))
        if not plan.fits:
            break
        found = shape, plan
    return found


def largest_models():
    """{(GiB, sharding): largest_models_from's answer} for every GPU size and sharding of the table."""
    return {(gb, sharding): largest_models_from(gb, sharding) for gb in GPU_MEMORY_GB for sharding in SHARDINGS}


def largest_table(found):
    lines = [
        f"| {GPUS} GPUs of | " + " | ".join(f"largest with {s}" for s in SHARDINGS) + " |",
        "|---|" + "---|" * len(SHARDINGS),
    ]
    for gpu_memory_gb in GPU_MEMORY_GB:
        cells = []
        for sharding in SHARDINGS:
            if found[gpu_memory_gb, sharding] is None:
                cells.append("none")
                continue
            (n_layer, n_embd, _), plan = found[gpu_memory_gb, sharding]
            gib = plan.total_bytes / memory_plan.GIB
            cells.append(f"{plan.n_params / 1e9:.2f}B: {n_layer} layers x {n_embd} ({gib:.1f} GiB per GPU)")
        lines.append(f"| {gpu_memory_gb} GiB | " + " | ".join(cells) + " |")
    return lines


def main():
    os.chdir(ROOT)  # the config files import config.paper
    runs = paper_runs()
    plans = plan_runs(runs)
    missing = sorted({f"{s} {o}" for s in SIZES for o in PAPER_OPTIMIZERS} - {f"{s} {o}" for s, o, _ in runs})
    out = []
    for gpu_memory_gb in GPU_MEMORY_GB:
        out += table(gpu_memory_gb, runs, plans) + [""]
    if missing:
        out.append(f"(No config for: {', '.join(missing)}.)")
    out += ["", *largest_table(largest_models())]
    print("\n".join(out).rstrip())


if __name__ == "__main__":
    main()
