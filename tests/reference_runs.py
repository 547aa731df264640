"""The paper's GPT-2 runs as its reference code sets them, transcribed for the tests from AGI-Arena/MARS
at 4831e28: config/train_gpt2_<size>_<optimizer>.py applied over the defaults of MARS/train_<optimizer>.py
(the learning rates and weight decays are also the table in its README), in this repository's key names;
the MARS-M paper's runs from the same repository's MARS_M/ folder (MARS_M/config/train_gpt2_<size>_<optimizer>.py
over MARS_M/train_<optimizer>.py, batch as MARS_M/scripts/run_<optimizer>_<size>.sh launches it); and the
reference's get_lr."""

import math

# The reference ran 8 GPUs; batch_size sequences per micro-batch, per_gpu micro-batches per GPU and step.
SIZES = {
    "small": dict(n_layer=12, n_head=12, n_embd=768, batch_size=15, per_gpu=4, min_lr=3e-5),
    "medium": dict(n_layer=24, n_head=16, n_embd=1024, batch_size=15, per_gpu=4, min_lr=6e-5),
    "large": dict(n_layer=36, n_head=20, n_embd=1280, batch_size=5, per_gpu=12, min_lr=1e-5),
    "xl": dict(n_layer=48, n_head=25, n_embd=1600, batch_size=5, per_gpu=12, min_lr=1e-5),
}
ADAMW_LR = {"small": 6e-4, "medium": 3e-4, "large": 2e-4, "xl": 2e-4}
MARS_LRS = {"small": (6e-3, 3e-3), "medium": (3e-3, 1.5e-3), "large": (2e-3, 1e-3), "xl": (2e-3, 1e-3)}  # lr, lr_1d
# train_muon.py: muon_learning_rate (Muon, every 2-D tensor) and learning_rate (its AdamW, the 1-D tensors)
MUON_LRS = {"small": (2e-2, 3e-3), "medium": (1e-2, 1.5e-3), "large": (6.67e-3, 1e-3)}
# MARS_M/config: learning_rate at each size, the same for MARS-M and Moonlight
MARS_M_LR = {"small": 6e-3, "medium": 5e-3, "large": 5e-3, "xl": 3e-3}
PAPER_RUNS = [(size, opt) for size in SIZES for opt in ("adamw", "mars", "muon") if (opt, size) != ("muon", "xl")] + [
    (size, opt) for size in SIZES for opt in ("mars_m", "moonlight")
]


def reference_run(size, optimizer):
    """Every setting of the reference's run that has a key here (system settings aside: the reference
    hard-codes CUDA, bfloat16, NCCL and torch.compile)."""
    shape = SIZES[size]
    run = dict(
        n_layer=shape["n_layer"],
        n_head=shape["n_head"],
        n_embd=shape["n_embd"],
        block_size=1024,
        dropout=0.0,
        bias=False,
        scale_attn_by_inverse_layer_idx=True,
        batch_size=shape["batch_size"],
        gradient_accumulation_steps=8 * shape["per_gpu"],  # here counted over all ranks
        grad_multiplier=shape["per_gpu"],  # the reference summed each GPU's micro-batch gradients
        max_iters=100000,
        lr_decay_iters=100000,
        warmup_iters=2000,
        decay_lr=True,
        schedule="cosine",  # train_muon.py's default too; the Muon configs set it or leave it
        min_lr=shape["min_lr"],
        grad_clip=1.0,
        seed=5000,
        eval_interval=1000,
        eval_iters=200,
        log_interval=10,
        dataset="openwebtext",
        wandb_log=True,
        wandb_project="mars-m" if optimizer in ("mars_m", "moonlight") else "mars",
        wandb_run_name=f"gpt2-{size}-{optimizer.replace('_', '-')}-100k",
        # the reference's xl AdamW, MARS-M and Moonlight configs write to out_large_*_100k, a slip not reproduced
        out_dir=f"out_{size}_{optimizer}_100k",
    )
    if optimizer == "adamw":
        run.update(optimizer_name="adamw", learning_rate=ADAMW_LR[size], weight_decay=0.1, beta1=0.9, beta2=0.95)
    elif optimizer == "mars":
        learning_rate, lr_1d = MARS_LRS[size]
        run.update(
            optimizer_name="mars",
            learning_rate=learning_rate,
            lr_1d=lr_1d,
            weight_decay=1e-2,
            beta1=0.95,
            beta2=0.99,
            gamma=0.025,
            is_approx=True,
            mars_type="mars-adamw",
            optimize_1d=False,
            weight_decay_1d=0.1,
            betas_1d=(0.9, 0.95),
        )
    elif optimizer == "mars_m":  # train_mars_m.py: MARS_M(lr, wd, momentum=beta1, adamw_betas=betas_1d, gamma)
        run.update(
            optimizer_name="mars",
            mars_type="mars-m",
            learning_rate=MARS_M_LR[size],
            weight_decay=1e-2,  # its README's table says 1e-1; the configs that ran say 1e-2
            beta1=0.95,
            beta2=0.99,
            gamma=0.025,
            is_approx=True,
            optimize_1d=False,
            betas_1d=(0.9, 0.95),
        )
    elif optimizer == "moonlight":  # train_moonlight.py: Moonlight(lr, wd, momentum=beta1, adamw_betas=betas_1d)
        run.update(
            optimizer_name="moonlight",
            learning_rate=MARS_M_LR[size],
            weight_decay=1e-1,
            beta1=0.95,
            beta2=0.99,
            betas_1d=(0.9, 0.95),
        )
    else:
        muon_lr, adamw_lr = MUON_LRS[size]
        run.update(
            optimizer_name="muon",
            muon_lr=muon_lr,
            muon_adamw_lr=adamw_lr,
            learning_rate=adamw_lr,
            muon_matrices="all",
            weight_decay=0.1,
            beta1=0.9,
            beta2=0.95,
        )
    return run


def reference_get_lr(it, base_lr, min_lr, warmup_iters=2000, lr_decay_iters=100000):
    """MARS/train_muon.py's get_lr(it, schedule='cosine', base_lr) transcribed; train_mars.py's and
    train_adamw.py's are the same with base_lr = learning_rate."""
    if it < warmup_iters:
        return base_lr * it / warmup_iters
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (base_lr - min_lr)
