"""The paper's GPT-2 runs, composed from their parts: the model size (model.PRESETS), the 100k-step
recipe every run shares, and the optimizer with its learning rates for that size. Each
config/train_gpt2_<size>_<optimizer>.py is one call to paper_run; `python -m marsgpt.config <that file>`
prints every key of the run.

The numbers are the reference's (AGI-Arena/MARS at 4831e28: its config/train_gpt2_*.py over the
defaults of MARS/train_*.py; the learning rates are the table in its README) unless a comment says not.
MARS-M and its Moonlight baseline are that repository's MARS_M/ runs: MARS_M/config/*.py over the defaults
of MARS_M/train_{mars_m,moonlight}.py, with the batch of MARS_M/scripts/*.sh (the same 480 sequences).
Keys not set here keep TrainConfig's defaults, which are the reference trainer's: block_size 1024, no
dropout or biases, attention logits scaled by 1/(layer + 1), grad_clip 1.0, the cosine schedule.
"""

from model import PRESETS

# 480 sequences of 1,024 tokens per optimizer step on any number of GPUs. The reference ran 8 GPUs with
# micro-batches of 15 sequences (small, medium) or 5 (large, xl).
GLOBAL_BATCH = 480
REFERENCE_GPUS = 8
REFERENCE_MICRO_BATCH = {"small": 15, "medium": 15, "large": 5, "xl": 5}
REFERENCE_EVAL_ITERS = 200  # evaluation batches of the reference's micro-batch
# Ours, where the memory plan leaves room on 8 GPUs of 40 GiB as well as 80 (docs/memory.md, "A larger
# micro-batch"): the windows are still drawn as the reference's micro-batches (windows_per_stream), so a
# step trains on the same windows and each evaluation scores the same ones.
MICRO_BATCH = {"small": 30, "medium": 15, "large": 5, "xl": 5}
# Where every parameter group's lr ends, whatever the optimizer (absolute).
MIN_LR = {"small": 3e-5, "medium": 6e-5, "large": 1e-5, "xl": 1e-5}

# Each optimizer's settings, the same at every size.
OPTIMIZER_SETTINGS = {
    "adamw": dict(optimizer="adamw", weight_decay=1e-1, beta1=0.9, beta2=0.95),
    "mars": dict(optimizer="mars-adamw", weight_decay=1e-2, beta1=0.95, beta2=0.99),
    # As MARS/train_muon.py: Muon (weight decay 0) on every 2-D tensor, the token and position embeddings
    # and the tied head included (muon_matrices="all"); AdamW on the 1-D tensors at this weight_decay;
    # both on the cosine schedule down to the same min_lr.
    "muon": dict(optimizer="muon", muon_matrices="all", weight_decay=1e-1, beta1=0.9, beta2=0.95),
    # Not the paper's: the reference tunes only MARS-AdamW. Untuned starting points that need a sweep of
    # their own: Lion's sign update wants a ~10x smaller lr and ~10x larger weight decay (Lion paper); the
    # orthogonalised update takes the Muon baseline's lr and weight decay (2e-2, 0).
    "mars_lion": dict(optimizer="mars-lion", weight_decay=1e-1, beta1=0.95, beta2=0.99),
    "mars_shampoo": dict(optimizer="mars-shampoo", weight_decay=0.0, beta1=0.95, beta2=0.99),
    # MARS_M/: every tensor at learning_rate and weight_decay (the blocks' matrices MARS-M or Muon, the rest
    # AdamW with betas_1d (0.9, 0.95)), momentum beta1. MARS-M's weight decay is its configs' 1e-2 at every
    # size, which is what ran; its README's table says 1e-1.
    "mars_m": dict(optimizer="mars-m", weight_decay=1e-2, beta1=0.95, beta2=0.99),
    "moonlight": dict(optimizer="moonlight", weight_decay=1e-1, beta1=0.95, beta2=0.99),
}


def muon_lrs(muon_lr, adamw_lr):
    """Muon's peak lrs: its own, and its AdamW part's, which the reference's Muon trainer calls learning_rate."""
    return dict(muon_lr=muon_lr, muon_adamw_lr=adamw_lr, learning_rate=adamw_lr)


# Peak learning rates by (optimizer, size). MARS: lr of the 2-D tensors and AdamW's lr_1d of the others;
# Muon: its own and its AdamW part's.
LEARNING_RATES = {
    ("adamw", "small"): dict(learning_rate=6e-4),
    ("adamw", "medium"): dict(learning_rate=3e-4),
    ("adamw", "large"): dict(learning_rate=2e-4),
    ("adamw", "xl"): dict(learning_rate=2e-4),
    ("mars", "small"): dict(learning_rate=6e-3, lr_1d=3e-3),
    ("mars", "medium"): dict(learning_rate=3e-3, lr_1d=1.5e-3),
    ("mars", "large"): dict(learning_rate=2e-3, lr_1d=1e-3),
    ("mars", "xl"): dict(learning_rate=2e-3, lr_1d=1e-3),
    ("muon", "small"): muon_lrs(2e-2, 3e-3),
    ("muon", "medium"): muon_lrs(1e-2, 1.5e-3),
    ("muon", "large"): muon_lrs(6.67e-3, 1e-3),
    # not the paper's (see OPTIMIZER_SETTINGS); min_lr scaled with the lr
    ("mars_lion", "small"): dict(learning_rate=6e-4, lr_1d=3e-3, min_lr=3e-6),
    ("mars_shampoo", "small"): dict(learning_rate=2e-2, lr_1d=3e-3, min_lr=1e-4),
}
# MARS-M and Moonlight share their learning rates at every size (the grid searched for Moonlight).
for _size, _lr in {"small": 6e-3, "medium": 5e-3, "large": 5e-3, "xl": 3e-3}.items():
    LEARNING_RATES["mars_m", _size] = LEARNING_RATES["moonlight", _size] = dict(learning_rate=_lr)
# The wandb project each optimizer's runs log to (the reference's).
WANDB_PROJECT = {"mars_m": "mars-m", "moonlight": "mars-m"}


def paper_run(size, optimizer):
    """Every key the paper's run of `optimizer` (a key of OPTIMIZER_SETTINGS) on GPT-2 `size` sets."""
    micro_batch, reference_micro_batch = MICRO_BATCH[size], REFERENCE_MICRO_BATCH[size]
    run = dict(
        PRESETS[size],
        batch_size=micro_batch,
        gradient_accumulation_steps=GLOBAL_BATCH // micro_batch,  # counted over all ranks
        windows_per_stream=reference_micro_batch,
        # the paper's gradient scale: its code summed the micro-batches each of its GPUs ran (4 or 12)
        grad_multiplier=GLOBAL_BATCH // (REFERENCE_GPUS * reference_micro_batch),
        max_iters=100000,  # 100k steps x 491,520 tokens = 49.2B tokens
        lr_decay_iters=100000,
        warmup_iters=2000,
        min_lr=MIN_LR[size],
        eval_interval=1000,
        eval_iters=REFERENCE_EVAL_ITERS * reference_micro_batch // micro_batch,
        log_interval=10,
        out_dir=f"out_{size}_{optimizer}_100k",
        wandb_log=True,
        wandb_project=WANDB_PROJECT.get(optimizer, "mars"),
        wandb_run_name=f"gpt2-{size}-{optimizer.replace('_', '-')}-100k",
    )
    run.update(OPTIMIZER_SETTINGS[optimizer], **LEARNING_RATES[optimizer, size])
    return run
