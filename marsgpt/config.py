"""train.py's configuration: every key declared once, with its type, default, meaning and check (TrainConfig).

    python train.py [config/a.py ...] [--key=value ...]
    python train.py --help                      # every key: type, default, meaning
    python -m marsgpt.config [args]             # the effective configuration (itself a valid config file)

Key names and defaults are those of the paper's reference training script (AGI-Arena/MARS, MARS/train_mars.py),
except where a key's help says otherwise. How config files and --key=value are read and checked, and the one-line
errors, are marsgpt/config_schema.py's.
"""

import os
import sys
import typing
from dataclasses import dataclass
from typing import Literal

from marsgpt import config_schema
from marsgpt.config_schema import (
    ConfigError,
    betas,
    config_to_dict,
    device_check,
    fraction,
    key,
    non_empty,
    non_negative,
    positive,
    print_lines,
    wants_help,
)
from marsgpt.optimizers import OPTIMIZERS

INIT_FROM_NAMES = ("scratch", "resume", "auto", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def init_source(value):
    """init_from: one of INIT_FROM_NAMES, or a folder holding a Hugging Face model (its config.json)."""
    if value in INIT_FROM_NAMES or os.path.isfile(os.path.join(value, "config.json")):
        return None
    return (
        f"is not one of: {', '.join(INIT_FROM_NAMES)}, nor a local Hugging Face GPT-2 folder (config.json and "
        "its weights, as save_pretrained or python -m marsgpt.export_hf writes them)"
    )


# ---------------------------------------------------------------------------------------------------
# The training configuration.


@dataclass
class TrainConfig:
    """Every key of a training run (train.py)."""

    # The paper's reference code names the optimizer with optimizer_name and, for MARS, mars_type (its update
    # rule). Config files and overrides may too, as its configs do: each sets `optimizer` (resolve_aliases).
    KEY_ALIASES: typing.ClassVar[dict] = {"optimizer_name": "optimizer", "mars_type": "optimizer"}

    @staticmethod
    def resolve_aliases(key, current, given):
        """The value of `key` that the aliases `given` ({alias: value}) give it, where it was `current` so far."""
        return OPTIMIZERS.from_reference_keys(current, given)

    # --- run and checkpoints
    out_dir: str = key(
        "out", "directory of the run: ckpt.pt, best.pt, metrics.jsonl, config.json (marsgpt/run_dir.py)", non_empty
    )
    init_from: str = key(
        "scratch",
        "scratch: a new run (refused when out_dir holds one); resume: continue out_dir's newest intact "
        "checkpoint (ckpt.pt, else a kept copy or best.pt); auto: resume when out_dir holds a checkpoint, else "
        "scratch; gpt2, gpt2-medium, gpt2-large, gpt2-xl: start from OpenAI's weights (the Hugging Face hub or its "
        "cache); or a local Hugging Face GPT-2 folder: start from its weights (offline)",
        init_source,
    )
    overwrite: bool = key(False, "with init_from=scratch: delete out_dir's previous run (checkpoints, metrics) first")
    allow_data_change: bool = key(
        False,
        "resume on data whose files differ from those the checkpoint was trained on (it is refused otherwise); "
        "the change is printed and recorded in metrics.jsonl at the resumed step",
    )
    eval_interval: int = key(2000, "evaluate (and write ckpt.pt) every this many steps", positive)
    checkpoint_interval: int = key(0, "also write ckpt.pt every this many steps; 0 = at evaluations only", non_negative)
    checkpoint_minutes: float = key(
        15.0,
        "also write ckpt.pt when this many minutes have passed since the last one (rank 0's clock, agreed by "
        "every rank); 0 = off. A preemption without warning loses at most this much training",
        non_negative,
    )
    lock_timeout_s: int = key(
        120,
        "out_dir's lock (run.lock) is refreshed every lock_timeout_s / 4 seconds; a lock from another machine "
        "left unrefreshed this long belongs to a dead run and is taken over",
        positive,
    )
    log_interval: int = key(1, "print and record a train line every this many steps", positive)
    eval_iters: int = key(200, "fixed batches per evaluation", positive)
    eval_only: bool = key(False, "stop right after the first evaluation")
    save_best: bool = key(True, "also keep the best-validation checkpoint as best.pt")
    keep_every_n_evals: int = key(0, "keep ckpt_<iter>.pt every N evaluations; 0 = off", non_negative)
    # --- wandb
    wandb_log: bool = key(False, "log to wandb as well (offline, with a warning, when there is no login)")
    wandb_project: str = key("owt", "wandb project")
    wandb_run_name: str = key("gpt2", "wandb run name")
    wandb_run_id: str = key("", "continue this wandb run; a resume takes it from the checkpoint")
    # --- data and batch
    data_path: str = key("data", "folder holding the datasets (data/<name>/prepare.py writes them)", non_empty)
    dataset: str = key("openwebtext", "token files in data_path/dataset: openwebtext, fineweb_edu, ...", non_empty)
    gradient_accumulation_steps: int = key(
        40,
        "micro-batches per optimizer step across ALL ranks (nanoGPT's meaning): the global batch does not "
        "change with the number of GPUs; 40 = the reference's 5 per GPU on its 8 GPUs",
        positive,
    )
    batch_size: int = key(12, "micro-batch size: sequences per forward pass", positive)
    windows_per_stream: int = key(
        0,
        "the training and evaluation windows are drawn this many per random stream (0: batch_size, a stream "
        "per micro-batch); set, it makes the windows independent of batch_size, so a step split into larger "
        "micro-batches (gradient_accumulation_steps, eval_iters lowered to match) trains on the same data",
        non_negative,
    )
    block_size: int = key(1024, "sequence length in tokens", positive, fixed=True)
    seed: int = key(
        5000,
        "seed of the weights, batches and dropout (the reference's 5000)",
        lambda v: None if 0 <= v < 2**64 else "must be in [0, 2**64) (numpy's and torch's seeds are unsigned 64-bit)",
    )
    # --- model
    n_layer: int = key(12, "transformer blocks", positive, fixed=True)
    n_head: int = key(12, "attention heads", positive, fixed=True)
    n_embd: int = key(768, "embedding width (a multiple of n_head)", positive, fixed=True)
    dropout: float = key(0.0, "dropout probability", fraction)
    bias: bool = key(False, "biases in Linear and LayerNorm layers", fixed=True)
    scale_attn_by_inverse_layer_idx: bool = key(
        True, "divide layer i's attention logits by i + 1 (the paper's)", fixed=True
    )
    # --- optimizer
    optimizer: Literal[tuple(OPTIMIZERS.descriptions())] = key(
        "mars-adamw",
        "the optimizer (marsgpt/optimizers.py); the reference's keys name it too: optimizer_name=mars with "
        "mars_type=mars-m is optimizer=mars-m, optimizer_name=adamw is optimizer=adamw",
        fixed=True,
        choices=OPTIMIZERS.descriptions(),
    )
    learning_rate: float = key(
        6e-4,
        "peak lr: MARS's 2-D tensors, AdamW's everything, MARS-M's and Moonlight's every tensor (Muon: unused, "
        "see muon_lr, muon_adamw_lr)",
        non_negative,
    )
    max_iters: int = key(600000, "optimizer steps of the run", non_negative)
    weight_decay: float = key(
        1e-1,
        "decoupled weight decay of the 2-D tensors (Muon: of its AdamW part; Muon's matrices take 0; MARS-M, "
        "Moonlight: of every tensor)",
        non_negative,
    )
    beta1: float = key(
        0.95, "first-moment decay (Muon: its AdamW part's; Muon's momentum is 0.95; Moonlight: its momentum)", fraction
    )
    beta2: float = key(0.99, "second-moment decay (Muon: its AdamW part's; Moonlight: unused)", fraction)
    grad_clip: float = key(1.0, "global gradient-norm clip; 0 disables", non_negative)
    grad_multiplier: float = key(
        1.0,
        "a step's gradient is this x the mean over its micro-batches; the paper's code summed each GPU's "
        "micro-batches (4 small/medium, 12 large/xl), which the paper configs reproduce on any GPU count",
        positive,
    )
    max_bad_steps: int = key(10, "stop after this many consecutive non-finite steps", positive)
    # --- MARS (mars.py's docstring says what each one does)
    gamma: float = key(0.025, "MARS: strength of the variance-reduction correction", non_negative)
    lr_1d: float = key(
        3e-3, "MARS: AdamW lr of the 1-D tensors (optimize_1d=False); follows the schedule", non_negative
    )
    is_approx: bool = key(True, "MARS: False = exact MARS, an extra forward/backward per step", fixed=True)
    optimize_1d: bool = key(False, "MARS: apply MARS to the 1-D tensors too (else AdamW)", fixed=True)
    weight_decay_1d: float = key(0.1, "MARS: weight decay of the 1-D tensors", non_negative)
    betas_1d: tuple[float, float] = key(
        (0.9, 0.95), "MARS: AdamW betas of the 1-D tensors (MARS-M, Moonlight: of their AdamW part)", betas
    )
    last_grad_dtype: Literal["float32", "bfloat16"] = key(
        "float32", "MARS: dtype of its stored previous gradient; bfloat16 saves half a parameter copy", fixed=True
    )
    mars_fused: bool = key(
        False,
        "MARS: its Triton kernel (mars.MARS(fused=True): every tensor in two launches per step), CUDA only (a CPU "
        "run refuses it); docs/mars.md says which path to train with",
    )
    # --- Muon baseline: torch.optim.Muon on matrices, AdamW on the rest (defaults: the reference's)
    muon_lr: float = key(2e-2, "Muon: lr of the matrices", non_negative)
    muon_adamw_lr: float = key(6e-4, "Muon: lr of the AdamW part", non_negative)
    muon_matrices: Literal["all", "hidden"] = key(
        "all",
        "Muon: all = every 2-D tensor, the embeddings and tied head included (the reference's); "
        "hidden = the blocks' matrices only, AdamW takes embeddings and head at weight_decay",
        fixed=True,
    )
    # --- learning-rate schedule (optimizers.scheduled_lr)
    decay_lr: bool = key(True, "False: constant learning_rate from step 0, no warmup")
    warmup_iters: int = key(2000, "linear warmup steps", non_negative)
    lr_decay_iters: int = key(600000, "cosine reaches min_lr at this step (~= max_iters)", non_negative)
    min_lr: float = key(6e-5, "where every group's lr decays to (absolute, as the reference)", non_negative)
    scale_schedule: bool = key(
        False,
        "fit warmup and decay to max_iters: warmup_iters and lr_decay_iters, taken as written for a run of "
        "lr_decay_iters steps, are scaled by max_iters / lr_decay_iters (a paper config shortened with --max_iters "
        "keeps its schedule's shape); False = as given (the paper's)",
    )
    schedule: Literal["cosine", "wsd", "constant"] = key("cosine", "lr schedule after warmup")
    wsd_decay_frac: float = key(
        0.2,
        "wsd: linear decay over this last fraction of max_iters",
        lambda v: None if 0.0 < v <= 1.0 else "must be in (0, 1]",
    )
    # --- evaluation
    hellaswag_interval: int = key(0, "HellaSwag every N steps; 0 = off", non_negative)
    hellaswag_path: str = key("", "hellaswag_val.jsonl; empty = download when online")
    # --- system. 'auto' (and compile=None) choose per device; the reference hard-codes
    # cuda / nccl / bfloat16 / compile=True.
    backend: Literal["auto", "nccl", "gloo"] = key("auto", "process-group backend: NCCL on CUDA, gloo on CPU")
    device: str = key("auto", "auto (CUDA when present), cpu, cuda, cuda:N or mps", device_check("cpu", "cuda", "mps"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = key(
        "auto", "autocast dtype: auto = bfloat16 where CUDA supports it, else float16 + GradScaler; float32 on CPU"
    )
    compile: bool | None = key(None, "torch.compile the model; None = on CUDA only")
    compile_cache: bool = key(
        True,
        "compiled: keep what the run compiled in out_dir/compile_cache.bin, which a resume loads, so that a job "
        "requeued onto other nodes compiles nothing again (marsgpt/compile_cache.py)",
    )
    deterministic: bool = key(
        False,
        "CUDA: deterministic kernels (torch.use_deterministic_algorithms, math attention), so a resume is bit-exact; "
        "slower. CPU runs are deterministic anyway",
    )
    ddp_timeout_s: int = key(600, "collective timeout: a dead rank ends the job instead of hanging it", positive)
    # --- memory (memory_plan.py, docs/memory.md). None of these changes the training math: a resume may change them.
    zero_stage: int = key(
        0,
        "0 = DDP, every rank keeps all the state; 1 = ZeRO-1: each DDP rank keeps the optimizer state of "
        "~1/world_size of the parameters; 3 = FSDP2: each rank keeps ~1/world_size of the parameters, gradients "
        "and optimizer state, and checkpoints are written by every rank (marsgpt/fsdp.py). A resume may change it",
        lambda v: None if v in (0, 1, 3) else "must be 0, 1 or 3 (ZeRO-2 is not offered: zero_stage=3 shards more)",
    )
    hsdp_replicas: int = key(
        1,
        "zero_stage=3: HSDP, the ranks in this many replica groups, each holding the whole model sharded over "
        "world_size / hsdp_replicas ranks (e.g. the number of nodes: the shards' traffic stays in a node); "
        "1 = FSDP over every rank",
        positive,
    )
    gradient_sync: Literal["step", "micro_batch"] = key(
        "step",
        "zero_stage=3: when gradients are reduce-scattered. step = once per step, after the last micro-batch (the "
        "micro-batches before it add up whole, unsharded gradients: one gradient of the whole model per rank); "
        "micro_batch = after every micro-batch (the gradients stay sharded, one reduce-scatter per micro-batch)",
    )
    activation_checkpointing: bool = key(
        False, "keep only each block's input and recompute its activations in the backward pass (one more forward)"
    )
    dry_run: bool = key(False, "print the memory plan per GPU and exit: reads no data, needs no GPU")
    verbose: bool = key(
        False, "print every key of the run and the whole memory plan at its start (they are in out_dir/config.json)"
    )
    gpu_memory_gb: float = key(
        0.0, "GiB of one GPU for the memory plan's verdict; 0 = the detected GPU's (none: no verdict)", non_negative
    )
    plan_world_size: int = key(
        0, "dry_run: plan for this many GPUs; 0 = the launch's (WORLD_SIZE under torchrun, else 1)", non_negative
    )

    def validate(self):
        """The checks that involve more than one key."""
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        problem = OPTIMIZERS.check(self)
        if problem:
            raise ConfigError(problem)
        if self.zero_stage != 3 and (self.hsdp_replicas != 1 or self.gradient_sync != "step"):
            key = "hsdp_replicas" if self.hsdp_replicas != 1 else "gradient_sync"
            raise ConfigError(f"{key} applies to zero_stage=3 (FSDP2) only; this run has zero_stage={self.zero_stage}")
        if self.decay_lr and self.schedule == "cosine" and self.lr_decay_iters <= self.warmup_iters:
            raise ConfigError(
                f"lr_decay_iters={self.lr_decay_iters} must exceed warmup_iters={self.warmup_iters} "
                "for the cosine schedule"
            )


def load_config(argv):
    """TrainConfig from train.py's arguments: config files (in order), then --key=value overrides."""
    return config_schema.load_config(argv, TrainConfig)


def fixed_keys():
    """The keys a resumed run must keep (declared with fixed=True)."""
    return config_schema.fixed_keys(TrainConfig)


def current_keys(saved):
    """A configuration saved as a dict (a checkpoint's, config.json) in TrainConfig's keys today."""
    return config_schema.current_keys(saved, TrainConfig)


def print_help(usage="python train.py [config/file.py ...] [--key=value ...]", file=None):
    """Every key with its type, default and meaning, in declaration order."""
    config_schema.print_help(TrainConfig, usage, file)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print_help(usage="python -m marsgpt.config [config/file.py ...] [--key=value ...]")
        return 0
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_lines([f"{name} = {value!r}" for name, value in config_to_dict(cfg).items()], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
