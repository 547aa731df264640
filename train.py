"""Pretrain GPT-2 with MARS (or AdamW / Muon): nanoGPT's training loop as small functions main() composes.

    python train.py [config/a.py ...] [--key=value ...]              # one process: CPU or one GPU
    torchrun --standalone --nproc_per_node=8 train.py config/...     # DDP on one node
    python train.py --help                                           # every key

The configuration (configurator.py) is checked, and so are the data, the world size, out_dir and any
checkpoint, before any work starts; a mistake prints `error: ...` and exits 2, on every rank at once.

Runs and out_dir: init_from=scratch refuses an out_dir that already holds a run (--overwrite=True
deletes it first); init_from=resume continues out_dir's ckpt.pt; init_from=auto does whichever applies,
so a preempted job relaunched with the same command continues. A resume applies the configuration it is
given: changed hyperparameters (learning rates, weight decays, betas, clip, ...) take effect, each
printed as `resume: key old -> new`; keys that cannot change mid-run (configurator's fixed keys: the
model shape, the optimizer and its MARS variant) are refused.

Data parallelism: gradient_accumulation_steps counts the micro-batches of one optimizer step across ALL
ranks. Micro-batch k of step s is TokenData.get_batch(seed, s, k) wherever it runs; rank r takes
k = r, r + world_size, ... . So the windows, and up to float rounding the model, do not depend on the
number of GPUs, and a run can resume on a different number of GPUs.

Exact resume: checkpoints are written after the evaluation that follows a step, holding everything the
next steps depend on (checkpoint_parts below); batches and dropout masks are pure functions of
(seed, step, micro-batch); evaluation windows are fixed. A run killed at any moment and restarted with
--init_from=resume ends with the same losses and parameters as one left alone (bit for bit on CPU; on
CUDA with --deterministic=True, see set_deterministic).
"""

import contextlib
import dataclasses
import glob
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import memplan
import metrics
from checkpoint import CheckpointError, CheckpointWriter, RNGState
from configurator import (
    ConfigError,
    TrainConfig,
    config_to_dict,
    fixed_keys,
    load_config,
    print_help,
    unused_keys,
    wants_help,
)
from files import atomic_writer, remove_stale_temporaries
from metrics import LogWindow, MetricsLog
from model import (
    GPT,
    GPT2_VOCAB_SIZE,
    HF_CHECKPOINTS,
    PRESETS,
    GPTConfig,
    model_args_from_config,
    peak_flops,
)
from optim import build_optimizer, group_hyperparameters, is_sharded, set_lr
from runtime import (
    SetupError,
    agree,
    decide_on_master,
    exit_process,
    resolve_dtype,
    set_deterministic,
    setup_distributed,
    setup_precision,
)
from tokens import DataError, TokenData

# The errors a user's input or a missing file can cause: printed as one `error:` line, exit 2.
USER_ERRORS = (ConfigError, DataError, CheckpointError, SetupError, ValueError, OSError)


class TrainingStopped(Exception):
    """The run cannot continue (diverged); the message is the one line the user sees."""


@dataclasses.dataclass
class Progress(checkpoint.DataclassState):
    """What the loop carries from step to step (a checkpoint part)."""

    iter_num: int = 0
    best_val_loss: float = math.inf
    tokens: int = 0
    elapsed_s: float = 0.0
    bad_steps: int = 0  # consecutive skipped steps
    skipped_steps: int = 0
    clip_count: int = 0
    wandb_run_id: str = ""


# The steps after which a CUDA run prints its measured peak memory beside the plan: by then the optimizer
# state exists and a step has run with it.
MEMORY_REPORT_STEP = 2

# The parts of a run a checkpoint holds, by name; checkpoint_parts() maps them to the run's objects.
CHECKPOINT_PARTS = ("model", "optimizer", "scaler", "rng", "progress")


@dataclasses.dataclass
class Run:
    """The objects one training run is built from."""

    cfg: object
    dist: object  # runtime.Dist
    model: torch.nn.Module  # the plain GPT: parameters, state_dict, estimate_mfu
    train_model: torch.nn.Module  # what the training forward goes through (compiled, DDP-wrapped)
    eval_model: torch.nn.Module  # compiled, without DDP
    model_args: dict
    optimizer: object
    scaler: torch.amp.GradScaler
    autocast: object
    rng: RNGState
    train_data: TokenData
    val_data: TokenData
    val_batches: list  # this rank's share of the fixed evaluation windows
    train_batches: list
    hellaswag_examples: list | None
    metrics: MetricsLog
    writer: CheckpointWriter
    memory_plan: memplan.MemoryPlan | None = None  # rank 0's, printed by describe()

    @property
    def sharded(self):
        return is_sharded(self.cfg, self.dist.world_size)

    @property
    def exact_mars(self):
        return self.cfg.optimizer_name == "mars" and not self.cfg.is_approx

    @property
    def tokens_per_step(self):
        return self.cfg.batch_size * self.cfg.gradient_accumulation_steps * self.cfg.block_size


def checkpoint_parts(run, progress):
    """Each checkpoint part's object: what it saves with state_dict() and restores with load_state_dict()."""
    return dict(zip(CHECKPOINT_PARTS, (run.model, run.optimizer, run.scaler, run.rng, progress), strict=True))


# ---------------------------------------------------------------------------------------------------
# Setup: every check on the user's input happens here, before the first step and before any file in
# out_dir changes. Whatever a rank reads from disk or the network is agreed on by all ranks (runtime.agree),
# so a rank that cannot read it makes every rank exit with the same error instead of a hang.


def load_data(cfg):
    data_dir = os.path.join(cfg.data_path, cfg.dataset)
    train_data, val_data = TokenData(data_dir, "train"), TokenData(data_dir, "val")
    vocab_size = model_vocab_size(train_data)
    train_data.check_vocab(vocab_size)
    val_data.check_vocab(vocab_size)
    return train_data, val_data, vocab_size


def model_vocab_size(data):
    """The data's own vocabulary (meta.pkl) or GPT-2's, padded to 50304 as the reference does."""
    return data.vocab_size if data.meta is not None else GPTConfig().vocab_size


def run_files(out_dir):
    """The files in out_dir that belong to a run: its checkpoints and its metrics."""
    names = [checkpoint.CKPT_NAME, checkpoint.BEST_NAME, metrics.FILE_NAME]
    found = [os.path.join(out_dir, n) for n in names if os.path.isfile(os.path.join(out_dir, n))]
    return found + sorted(glob.glob(os.path.join(out_dir, "ckpt_*.pt")))


def resolve_init_from(cfg):
    """init_from as this launch means it: 'auto' becomes 'resume' when out_dir holds ckpt.pt, else 'scratch'.

    A fresh start (anything but resume) into an out_dir that holds a run is refused unless overwrite is
    set: a relaunch that forgot --init_from=resume must not erase days of training.
    """
    has_checkpoint = os.path.isfile(os.path.join(cfg.out_dir, checkpoint.CKPT_NAME))
    init_from = cfg.init_from
    if init_from == "auto":
        init_from = "resume" if has_checkpoint else "scratch"
    previous = run_files(cfg.out_dir)
    if cfg.init_from == "auto" and not has_checkpoint:
        previous = []  # a run killed before its first checkpoint: nothing to keep
    if init_from != "resume" and previous and not cfg.overwrite:
        if not has_checkpoint:  # e.g. an eval_only run's metrics: nothing to resume
            raise ConfigError(
                f"out_dir {cfg.out_dir} holds {os.path.basename(previous[0])} but no {checkpoint.CKPT_NAME} to "
                f"resume; start elsewhere with a new --out_dir, or replace it with --overwrite=True"
            )
        raise ConfigError(
            f"out_dir {cfg.out_dir} already holds a run ({os.path.basename(previous[0])}); continue it with "
            f"--init_from=resume (or auto), start elsewhere with a new --out_dir, or delete it with --overwrite=True"
        )
    return init_from


def remove_previous_run(cfg):
    """--overwrite=True: the old run's checkpoints and metrics go before the new run writes anything."""
    for path in run_files(cfg.out_dir):
        os.remove(path)


def load_resume_checkpoint(cfg, device_type):
    """The checkpoint to resume, checked for every part and for keys the configuration may not change."""
    path = checkpoint.checkpoint_path(cfg.out_dir)
    ckpt = checkpoint.load_checkpoint(path, mmap=device_type == "cuda")
    missing = [part for part in (*CHECKPOINT_PARTS, "config") if part not in ckpt]
    if missing:
        raise CheckpointError(
            f"{path} lacks {', '.join(missing)}: it was not written by this train.py, "
            f"so it cannot be resumed (init_from=resume); start a new run from its weights instead"
        )
    unused = unused_keys(cfg)  # e.g. mars_type in a Muon run: nothing to keep fixed
    for key in [key for key in fixed_keys() if key not in unused]:
        new = getattr(cfg, key)
        old = saved_value(ckpt["config"], key, new)
        if old != new:
            raise CheckpointError(
                f"{path} was trained with {key}={old!r} but the config gives {key}={new!r}; a resumed run cannot "
                f"change {key}: resume with --{key}={old!r}, or start a new run in a new out_dir"
            )
    return ckpt


def saved_value(saved, key, new):
    """A key's value in a checkpoint's configuration, as comparable with the new value `new` (a tuple, when
    it is one); `new` itself when the checkpoint predates the key."""
    old = saved.get(key, new)
    return tuple(old) if isinstance(new, tuple) else old


def config_changes(saved, cfg):
    """`resume: key old -> new` for every key the resumed run's configuration changes (a key this optimizer
    does not read says so)."""
    lines, unused = [], unused_keys(cfg)
    for key, new in config_to_dict(cfg).items():
        old = saved_value(saved, key, new)
        if key not in ("init_from", "overwrite") and old != new:
            note = f" (not used by optimizer_name={cfg.optimizer_name})" if key in unused else ""
            lines.append(f"resume: {key} {old!r} -> {new!r}{note}")
    return lines


def ignored_settings(cfg):
    """A note naming the keys set away from their defaults that this run's optimizer does not read, or None.
    Muon's learning_rate is exempt where it mirrors muon_adamw_lr (the paper configs set both: the
    reference calls the AdamW part's lr learning_rate)."""
    defaults = TrainConfig()
    ignored = [
        f"{key}={getattr(cfg, key)!r}"
        for key in sorted(unused_keys(cfg))
        if getattr(cfg, key) != getattr(defaults, key)
        and not (key == "learning_rate" and cfg.learning_rate == cfg.muon_adamw_lr)
    ]
    if not ignored:
        return None
    hint = " (Muon's lrs are muon_lr and muon_adamw_lr)" if cfg.optimizer_name == "muon" else ""
    return f"note: optimizer_name={cfg.optimizer_name} does not use {', '.join(ignored)}{hint}"


def build_model(cfg, vocab_size, ckpt, ckpt_path):
    """(GPT, model_args) for init_from: a fresh model, the checkpoint's weights, or OpenAI's GPT-2.

    A resumed model has the shape the checkpoint was saved with: the configuration's for a run started from
    scratch (load_resume_checkpoint has checked that it still is), OpenAI's (bias, vocabulary, size) for one
    started from GPT-2. Only dropout, which may change on resume, is the configuration's.
    """
    if cfg.init_from.startswith("gpt2"):
        if vocab_size != GPTConfig.vocab_size:  # checked before the download
            raise ConfigError(
                f"init_from={cfg.init_from} needs GPT-2-tokenized data, but the dataset {cfg.dataset} has its own "
                f"vocabulary of {vocab_size} tokens (meta.pkl); train it with --init_from=scratch, or use a GPT-2 "
                "dataset (openwebtext, fineweb_edu)"
            )
        model = checkpoint.load_pretrained(cfg.init_from, dict(dropout=cfg.dropout))
        if cfg.block_size < model.config.block_size:
            model.crop_block_size(cfg.block_size)
        return model, dataclasses.asdict(model.config)
    if ckpt is None:
        model_args = model_args_from_config(cfg, vocab_size)
    else:
        model_args = {**ckpt["model_args"], "dropout": cfg.dropout}
        # GPT-2-tokenized data: a run from scratch pads the vocabulary, one from init_from=gpt2* keeps OpenAI's
        gpt2_data = vocab_size == GPTConfig.vocab_size
        if model_args.get("vocab_size") not in ((vocab_size, GPT2_VOCAB_SIZE) if gpt2_data else (vocab_size,)):
            raise CheckpointError(
                f"{ckpt_path} was trained with a vocabulary of {model_args.get('vocab_size')} tokens but "
                f"the dataset {cfg.dataset} has {vocab_size}; resume on data with the same vocabulary"
            )
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = GPT(GPTConfig(**model_args))
    if ckpt is not None:
        checkpoint.load_model_state(model, ckpt["model"], ckpt_path)
    return model, model_args


def load_optimizer_state(optimizer, state, cfg):
    """The checkpoint's optimizer state with the configuration's hyperparameters.

    load_state_dict restores each group's saved settings (lr, initial_lr, weight decay, betas, gamma,
    MARS's 1-D lr factor, ...); group_hyperparameters writes this run's configuration back on top, so a
    resume with --learning_rate=1e-4 trains at 1e-4. The moments and step counts are the checkpoint's.
    """
    optimizer.load_state_dict(state)
    group_hyperparameters(optimizer, cfg)


def setup_hellaswag(cfg, train_data, dist_info):
    """HellaSwag examples when hellaswag_interval asks for them and they can be scored, else None.

    Rank 0 finds or downloads the file; every rank then reads it, and all agree that they could.
    """
    if cfg.hellaswag_interval == 0:
        return None
    import hellaswag

    reason = None
    if train_data.meta is not None:
        reason = f"the dataset {cfg.dataset} is not GPT-2-tokenized"
    else:
        path = decide_on_master(dist_info, lambda: hellaswag.ensure_data(cfg.hellaswag_path), USER_ERRORS)
        if path is None:
            reason = "its data is not available offline (give --hellaswag_path)"
        else:
            return agree(dist_info, lambda: hellaswag.load_examples(path), USER_ERRORS)
    if dist_info.is_master:
        print(f"warning: HellaSwag evaluation disabled: {reason}", file=sys.stderr)
    return None


def resolve_compile(cfg, device_type):
    return cfg.compile if cfg.compile is not None else device_type == "cuda"


def gather_rng(dist_info):
    """RNGState's gather: every rank's CUDA generator states (a collective under DDP on CUDA); None, RNGState's
    default (this rank's alone), otherwise."""
    if not (dist_info.ddp and torch.cuda.is_available()):
        return None

    def gather(state):
        states = [None] * dist_info.world_size
        dist.all_gather_object(states, state)
        return states

    return gather


def setup(cfg, dist_info):
    """(Run, Progress, resumed): everything checked and built; nothing trained yet."""
    train_data, val_data, vocab_size = agree(dist_info, lambda: load_data(cfg), USER_ERRORS)
    init_from = decide_on_master(dist_info, lambda: resolve_init_from(cfg), USER_ERRORS)
    cfg = dataclasses.replace(cfg, init_from=init_from)
    ckpt, ckpt_path = None, checkpoint.checkpoint_path(cfg.out_dir)
    if init_from == "resume":
        ckpt = agree(dist_info, lambda: load_resume_checkpoint(cfg, dist_info.device_type), USER_ERRORS)
    hellaswag_examples = setup_hellaswag(cfg, train_data, dist_info)
    model, model_args = agree(dist_info, lambda: build_model(cfg, vocab_size, ckpt, ckpt_path), USER_ERRORS)

    if dist_info.is_master:
        remove_stale_temporaries(cfg.out_dir)
        if cfg.overwrite and init_from != "resume":
            remove_previous_run(cfg)
        if ckpt is not None:
            print(f"resuming {ckpt_path} at iter {ckpt['progress']['iter_num']:,}", flush=True)
        for line in config_changes(ckpt["config"], cfg) if ckpt else []:
            print(line, flush=True)
    set_deterministic(cfg.deterministic, dist_info.device_type)
    model.to(dist_info.device)
    model.activation_checkpointing = cfg.activation_checkpointing
    autocast, scaler = setup_precision(cfg.dtype, dist_info.device_type)
    optimizer = build_optimizer(model, cfg, dist_info.device_type, dist_info.world_size)
    rng = RNGState(dist_info.rank, gather_rng(dist_info))
    progress = Progress()
    if ckpt is not None:
        load_optimizer_state(optimizer, ckpt["optimizer"], cfg)
        if scaler.is_enabled() and ckpt["scaler"]:
            scaler.load_state_dict(ckpt["scaler"])
        rng.load_state_dict(ckpt["rng"], dist_info.world_size)
        progress.load_state_dict(ckpt["progress"])
    if cfg.wandb_run_id:
        progress.wandb_run_id = cfg.wandb_run_id
    ckpt = None  # with mmap, this unmaps the file: everything is in the model and optimizer now

    eval_model = torch.compile(model) if resolve_compile(cfg, dist_info.device_type) else model
    train_model = eval_model
    if dist_info.ddp:
        # gradient_as_bucket_view: the gradients live in DDP's all-reduce buckets instead of beside them,
        # which saves one gradient-sized copy (6.2 GB on GPT-2 XL).
        train_model = DDP(
            eval_model,
            device_ids=[dist_info.local_rank] if dist_info.device_type == "cuda" else None,
            gradient_as_bucket_view=True,
        )

    def my_share(batches):  # every rank scores every world_size-th window; evaluate() all-reduces
        return batches[dist_info.rank :: dist_info.world_size]

    val_batches = my_share(val_data.eval_batches(cfg.seed, cfg.eval_iters, cfg.batch_size, cfg.block_size))
    train_batches = my_share(train_data.eval_batches(cfg.seed, cfg.eval_iters, cfg.batch_size, cfg.block_size))

    resumed = init_from == "resume"
    log = agree(
        dist_info,
        lambda: MetricsLog(
            cfg,
            dist_info.is_master,
            resume_iter=progress.iter_num if resumed else None,
            wandb_run_id=progress.wandb_run_id,
            config=config_to_dict(cfg),
        ),
        USER_ERRORS,
    )
    progress.wandb_run_id = log.wandb_run_id
    run = Run(
        cfg=cfg,
        dist=dist_info,
        model=model,
        train_model=train_model,
        eval_model=eval_model,
        model_args=model_args,
        optimizer=optimizer,
        scaler=scaler,
        autocast=autocast,
        rng=rng,
        train_data=train_data,
        val_data=val_data,
        val_batches=val_batches,
        train_batches=train_batches,
        hellaswag_examples=hellaswag_examples,
        metrics=log,
        writer=CheckpointWriter(),
        memory_plan=plan_memory(cfg, dist_info, model_args) if dist_info.is_master else None,
    )
    return run, progress, resumed


def gpu_memory(cfg, device):
    """(GiB, name) of the GPU the plan is checked against: --gpu_memory_gb, else the GPU `device` is on,
    else (None, None)."""
    if cfg.gpu_memory_gb:
        return cfg.gpu_memory_gb, None
    if torch.device(device).type != "cuda":
        return None, None
    return torch.cuda.get_device_properties(device).total_memory / memplan.GIB, torch.cuda.get_device_name(device)


def plan_memory(cfg, dist_info, model_args):
    """This run's memory plan (memplan.py) on its GPUs, for describe() to print."""
    gb, name = gpu_memory(cfg, dist_info.device)
    dtype = resolve_dtype(cfg.dtype, dist_info.device_type)
    return memplan.plan(cfg, dist_info.world_size, gb, model_args=model_args, dtype=dtype, gpu_name=name)


def describe(run, progress):
    """Print the effective configuration and the token budget; record the configuration in out_dir."""
    cfg = run.cfg
    micro_batches = cfg.gradient_accumulation_steps // run.dist.world_size
    config = config_to_dict(cfg)
    for key, value in config.items():
        print(f"{key} = {value!r}")
    print(
        f"world size {run.dist.world_size} on {run.dist.device}; "
        f"{micro_batches} micro-batch{'es' if micro_batches != 1 else ''} per rank per step"
    )
    print(
        f"tokens per optimizer step: {run.tokens_per_step:,} = batch_size {cfg.batch_size} x "
        f"gradient_accumulation_steps {cfg.gradient_accumulation_steps} x block_size {cfg.block_size}"
    )
    print(f"total tokens: {run.tokens_per_step * cfg.max_iters:,} over max_iters {cfg.max_iters:,}")
    if progress.iter_num >= cfg.max_iters and not cfg.eval_only:
        print(
            f"nothing to train: the run is at iter {progress.iter_num:,} and max_iters is {cfg.max_iters:,}; "
            f"raise --max_iters to train further"
        )
    print(f"model parameters: {run.model.get_num_params() / 1e6:.2f}M")
    note = ignored_settings(cfg)
    if note:
        print(note)
    plan = run.memory_plan
    print("\n".join(memplan.format_plan(plan)))
    if plan.fits is False:
        print(
            f"warning: the memory plan ({plan.total_bytes / memplan.GIB:.1f} GiB per GPU) exceeds the "
            f"{plan.usable_bytes / memplan.GIB:.1f} GiB usable on this GPU: the run may stop with CUDA out of "
            f"memory; try {memplan.advice(plan)}",
            file=sys.stderr,
        )
    if run.dist.device_type == "cuda" and peak_flops(run.dist.device) is None:
        print(
            f"note: mfu is logged as null: no peak bf16 FLOP/s is known for {torch.cuda.get_device_name()} "
            "(model.PEAK_BF16_FLOPS)"
        )
    with atomic_writer(os.path.join(cfg.out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


# ---------------------------------------------------------------------------------------------------
# One optimizer step.


def to_device(x, y, device):
    if torch.device(device).type == "cuda":  # pinned memory lets the copy overlap the running kernels
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def dropout_seed(seed, step, micro_step):
    """Dropout masks, like the windows, depend only on (seed, step, micro-batch): not on rank or resume."""
    return int(np.random.SeedSequence([seed, step, micro_step, 2]).generate_state(1)[0])


def forward_backward(run, step):
    """Accumulate this rank's gradients for step `step`; return its mean micro-batch loss (a tensor).

    Each loss is divided by this rank's number of micro-batches and DDP averages across ranks, so the
    gradient is the mean over all gradient_accumulation_steps micro-batches, times grad_multiplier (the
    paper's gradient scale, see configurator.py; the returned loss stays the mean). DDP all-reduces only in
    the last micro-batch's backward (no_sync before it). Nothing here waits for the device.
    """
    cfg, info = run.cfg, run.dist
    micro_steps = range(info.rank, cfg.gradient_accumulation_steps, info.world_size)
    loss_sum = torch.zeros((), device=info.device)

    def fetch(k):
        x, y = run.train_data.get_batch(cfg.seed, step, k, cfg.batch_size, cfg.block_size)
        return to_device(x, y, info.device)

    x, y = fetch(micro_steps[0])
    for i, k in enumerate(micro_steps):
        last = i == len(micro_steps) - 1
        with contextlib.nullcontext() if last or not info.ddp else run.train_model.no_sync():
            if cfg.dropout > 0:
                torch.manual_seed(dropout_seed(cfg.seed, step, k))
            with run.autocast:
                # only the loss: the (micro-batch, block, vocabulary) logits are freed before the backward pass
                loss = run.train_model(x, y)[1] / len(micro_steps)
            if not last:
                x, y = fetch(micro_steps[i + 1])  # while the device works on this forward
            run.scaler.scale(loss * cfg.grad_multiplier).backward()
        loss_sum += loss.detach()
    return loss_sum


def clip_gradients(run):
    """The global gradient norm before clipping (a tensor); clips to grad_clip when it is > 0."""
    params = [p for p in run.model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if run.cfg.grad_clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, run.cfg.grad_clip, norm)
    return norm


@dataclasses.dataclass
class StepResult:
    loss: torch.Tensor  # this rank's mean loss over the step's micro-batches
    grad_norm: float  # pre-clip global norm
    skipped: bool  # non-finite loss or gradient: nothing changed
    clipped: bool
    non_finite: str = ""  # when skipped: which norm, e.g. "look-ahead gradient norm nan" (exact MARS)


def train_step(run, it):
    """Optimizer step `it`: gradients of its micro-batches, clipping, and the update.

    Exact MARS (is_approx=False), in the reference train_mars.py's order: first the gradient of the
    NEXT step's batch at the current parameters, clipped like any gradient, which update_previous_grad
    stores (it becomes g_{t-1} of the next step's correction); then the current batch's gradient, the
    step, and update_last_grad.

    A non-finite gradient norm (from a non-finite loss, or an overflow) skips the update: parameters,
    optimizer state and MARS's last gradient stay as they were. The decision uses the all-reduced norm,
    so every rank takes the same one. This reads one number from the device per step.
    """
    cfg, optimizer, scaler = run.cfg, run.optimizer, run.scaler
    set_lr(optimizer, it, cfg)
    norms = []
    if run.exact_mars:
        forward_backward(run, it + 1)
        if scaler.is_enabled():  # unscale by hand: scaler.unscale_ may run only once per update()
            inverse_scale = 1.0 / scaler.get_scale()
            for p in run.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(inverse_scale)
        norms.append(clip_gradients(run))
        optimizer.update_previous_grad()
        optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(run, it)
    scaler.unscale_(optimizer)
    norms.append(clip_gradients(run))
    norm_values = torch.stack(norms).tolist()  # the per-step device sync
    grad_norm = norm_values[-1]
    skipped = not all(math.isfinite(n) for n in norm_values)
    names = ["look-ahead gradient", "gradient"][-len(norm_values) :]
    non_finite = ", ".join(f"{name} norm {n}" for name, n in zip(names, norm_values) if not math.isfinite(n))
    if skipped:
        if scaler.is_enabled():
            scaler.update()  # float16: an overflow lowers the loss scale, as scaler.step would
    else:
        scaler.step(optimizer)
        scaler.update()
        if run.exact_mars:
            optimizer.update_last_grad()
    optimizer.zero_grad(set_to_none=True)
    clipped = not skipped and cfg.grad_clip > 0 and grad_norm > cfg.grad_clip
    return StepResult(loss=loss, grad_norm=grad_norm, skipped=skipped, clipped=clipped, non_finite=non_finite)


# ---------------------------------------------------------------------------------------------------
# Evaluation, checkpoints, metrics.


def all_reduce_sum(run, tensor):
    if run.dist.ddp:
        dist.all_reduce(tensor)
    return tensor


@torch.no_grad()
def evaluate(run, batches):
    """Mean loss over the fixed windows (`batches` is this rank's share of cfg.eval_iters of them)."""
    run.eval_model.eval()
    loss_sum = torch.zeros((), device=run.dist.device)
    for x, y in batches:
        x, y = to_device(x, y, run.dist.device)
        with run.autocast:
            _, loss = run.eval_model(x, y)
        loss_sum += loss.float()
    run.eval_model.train()
    return all_reduce_sum(run, loss_sum).item() / run.cfg.eval_iters


def save_checkpoints(run, progress, is_best):
    """ckpt.pt (the latest, what resume reads), plus best.pt and periodic copies as the config asks.

    Every rank takes part (the RNG part gathers each rank's CUDA generators); rank 0 hands the state to
    the background writer and goes on training.
    """
    cfg = run.cfg
    state = {name: part.state_dict() for name, part in checkpoint_parts(run, progress).items()}
    if not run.dist.is_master:
        return
    state.update(model_args=run.model_args, config=config_to_dict(cfg))
    it = progress.iter_num
    copies = []
    if is_best and cfg.save_best:
        copies.append(os.path.join(cfg.out_dir, checkpoint.BEST_NAME))
    if (
        cfg.keep_every_n_evals
        and it > 0
        and it % cfg.eval_interval == 0
        and (it // cfg.eval_interval) % cfg.keep_every_n_evals == 0
    ):
        copies.append(os.path.join(cfg.out_dir, f"ckpt_{it:07d}.pt"))
    run.writer.save(os.path.join(cfg.out_dir, checkpoint.CKPT_NAME), state, copies)


def stamp(progress, time_s):
    """The x axes every metrics record carries."""
    return {metrics.ITER: progress.iter_num, metrics.TOKENS: progress.tokens, metrics.TIME_S: time_s}


def log_train(run, progress, window, result, time_s):
    """A train line: mean loss of the window's steps (all ranks take part in its all-reduce)."""
    cfg = run.cfg
    loss = None
    if window.losses:
        loss = all_reduce_sum(run, window.loss_sum / window.losses) / run.dist.world_size
    # momentum_norms all-reduces under ZeRO-1 only: unsharded, the other ranks need not compute it
    momentum = momentum_norms(run) if cfg.optimizer_name == "mars" and (run.sharded or run.dist.is_master) else []
    if not run.dist.is_master:
        return
    dt = (time.perf_counter() - window.t0) / window.steps
    param_norm = norm_of(list(run.model.parameters()), run.dist.device)
    values = [loss if loss is not None else torch.tensor(math.nan), param_norm, *momentum]
    values = torch.stack([v.float().to(run.dist.device) for v in values]).tolist()
    passes = 2 if run.exact_mars else 1
    mfu = run.model.estimate_mfu(run.tokens_per_step // run.dist.world_size * passes, dt)
    record = {
        **stamp(progress, time_s),
        metrics.TRAIN_LOSS: values[0],
        metrics.LR: run.optimizer.param_groups[0]["lr"],
        metrics.GRAD_NORM: result.grad_norm,
        metrics.CLIP_RATE: progress.clip_count / progress.iter_num,
        metrics.TOKENS_PER_SEC: run.tokens_per_step / dt,
        metrics.STEP_MS: dt * 1000,
        metrics.MFU: None if mfu is None else mfu * 100,
        metrics.PARAM_NORM: values[1],
        metrics.SKIPPED_STEPS: progress.skipped_steps,
    }
    if cfg.optimizer_name == "mars":
        record[metrics.MOMENTUM_NORM] = values[2]
        if cfg.mars_type == "mars-adamw":  # Lion's and Shampoo's matrices keep no v: only the 1-D tensors' would count
            record[metrics.MOMENTUM_NORM_SQ] = values[3]
            record[metrics.MOMENTUM_DIV] = values[2] / (math.sqrt(values[3]) + 1e-8)
    mfu_text = "" if mfu is None else f", mfu {mfu * 100:.1f}%"
    print(
        f"iter {progress.iter_num}: loss {values[0]:.4f}, lr {record[metrics.LR]:.3e}, "
        f"grad_norm {result.grad_norm:.3f}, {dt * 1000:.1f} ms/step, "
        f"{record[metrics.TOKENS_PER_SEC]:,.0f} tok/s{mfu_text}",
        flush=True,
    )
    run.metrics.write(record)


def norm_of(tensors, device):
    """The global norm of `tensors`; 0 on `device` (the parameters') when there are none."""
    return torch.nn.utils.get_total_norm(list(tensors)) if tensors else torch.zeros((), device=device)


def momentum_norms(run):
    """The norms of MARS's m and v the reference train_mars.py logs, over all of the state: under ZeRO-1
    every rank holds a share, so the squares are summed over the ranks (every rank takes part)."""
    states = [s for s in run.optimizer.state.values() if "exp_avg" in s]
    m = norm_of([s["exp_avg"] for s in states], run.dist.device)
    v = norm_of([s["exp_avg_sq"] for s in states if "exp_avg_sq" in s], run.dist.device)
    if not run.sharded:
        return [m, v]
    squares = torch.stack([m, v]).float().to(run.dist.device) ** 2
    return list(all_reduce_sum(run, squares).sqrt())


def evaluate_and_save(run, progress, time_s):
    """Validation and train-estimate losses at progress.iter_num; ckpt.pt unless eval_only."""
    cfg = run.cfg
    val_loss = evaluate(run, run.val_batches)
    train_loss = evaluate(run, run.train_batches)
    is_best = val_loss < progress.best_val_loss
    if is_best:
        progress.best_val_loss = val_loss
    if run.dist.is_master:
        print(f"step {progress.iter_num}: train loss {train_loss:.4f}, val loss {val_loss:.4f}", flush=True)
        run.metrics.write({**stamp(progress, time_s), metrics.VAL_LOSS: val_loss, metrics.EVAL_TRAIN_LOSS: train_loss})
    if not cfg.eval_only:
        progress.elapsed_s = time_s
        save_checkpoints(run, progress, is_best)


def evaluate_hellaswag(run, progress, time_s):
    import hellaswag

    result = hellaswag.evaluate(
        run.model,
        run.hellaswag_examples,
        run.dist.device,
        rank=run.dist.rank,
        world_size=run.dist.world_size,
        ctx=run.autocast,
    )
    if run.dist.is_master:
        print(f"step {progress.iter_num}: hellaswag acc_norm {result['acc_norm']:.4f} (n={result['n']})", flush=True)
        run.metrics.write({**stamp(progress, time_s), metrics.HELLASWAG: result["acc_norm"]})


# ---------------------------------------------------------------------------------------------------
# The loop.


def fit(run, progress, resumed):
    """Train from progress.iter_num to max_iters, evaluating every eval_interval steps and at the end.

    A resumed run does not repeat the evaluation its checkpoint was written after.
    """
    cfg = run.cfg
    start_iter, start_elapsed, t_start = progress.iter_num, progress.elapsed_s, time.perf_counter()

    def time_s():
        return start_elapsed + time.perf_counter() - t_start

    window = LogWindow()
    while True:
        it = progress.iter_num
        repeat = resumed and it == start_iter and not cfg.eval_only
        if (it % cfg.eval_interval == 0 or it == cfg.max_iters) and not repeat:
            evaluate_and_save(run, progress, time_s())
            if cfg.eval_only:
                break
            window.restart()
        if run.hellaswag_examples and it % cfg.hellaswag_interval == 0 and not repeat:
            evaluate_hellaswag(run, progress, time_s())
            window.restart()
        if it >= cfg.max_iters:
            break
        step_and_log(run, progress, window, time_s)


def step_and_log(run, progress, window, time_s):
    """Optimizer step progress.iter_num, its bookkeeping, and a train line every log_interval steps."""
    result = train_step(run, progress.iter_num)
    progress.iter_num += 1
    progress.tokens += run.tokens_per_step
    progress.clip_count += result.clipped
    window.add(result.loss, result.skipped)
    if result.skipped:
        record_skip(run, progress, result, time_s())
    else:
        progress.bad_steps = 0
    if progress.iter_num % run.cfg.log_interval == 0:
        log_train(run, progress, window, result, time_s())
        window.restart()
    if progress.iter_num == MEMORY_REPORT_STEP and run.memory_plan and run.dist.device_type == "cuda":
        print(
            f"memory: rank 0 peaked at {torch.cuda.max_memory_allocated() / memplan.GIB:.2f} GiB allocated "
            f"({torch.cuda.max_memory_reserved() / memplan.GIB:.2f} GiB reserved) in the first "
            f"{MEMORY_REPORT_STEP} steps; the plan: {run.memory_plan.total_bytes / memplan.GIB:.2f} GiB",
            flush=True,
        )


def record_skip(run, progress, result, time_s):
    progress.bad_steps += 1
    progress.skipped_steps += 1
    it = progress.iter_num
    if run.dist.is_master:
        print(
            f"iter {it}: non-finite loss or {result.non_finite}; step skipped "
            f"({progress.bad_steps} in a row, {progress.skipped_steps} in the run)",
            flush=True,
        )
        run.metrics.write({**stamp(progress, time_s), metrics.SKIPPED_STEPS: progress.skipped_steps})
    if progress.bad_steps >= run.cfg.max_bad_steps:
        latest = os.path.join(run.cfg.out_dir, checkpoint.CKPT_NAME)
        raise TrainingStopped(
            f"{progress.bad_steps} consecutive steps (up to iter {it}) had a non-finite "
            f"loss or gradient norm (max_bad_steps={run.cfg.max_bad_steps}); stopped. The last "
            f"good checkpoint is {latest}: resume it with --init_from=resume and a lower "
            f"learning_rate, or check the data"
        )


def planned_model_args(cfg):
    """The model a run of cfg builds, without reading tokens: the data's vocabulary when its files are there,
    else GPT-2's (padded); OpenAI's shape for init_from=gpt2*."""
    if cfg.init_from in HF_CHECKPOINTS:
        preset = PRESETS[HF_CHECKPOINTS[cfg.init_from]]
        return {
            **model_args_from_config(cfg, GPT2_VOCAB_SIZE),
            **preset,
            "bias": True,
            "block_size": min(cfg.block_size, 1024),
        }
    try:
        vocab_size = model_vocab_size(TokenData(os.path.join(cfg.data_path, cfg.dataset), "train"))
    except DataError:
        vocab_size = GPTConfig().vocab_size
    return model_args_from_config(cfg, vocab_size)


def dry_run_plan(cfg, layout=None):
    """The memory plan --dry_run=True prints: no process group, data or GPU needed.

    The world size is plan_world_size, else the launch's; the GPU is gpu_memory_gb, else the one present;
    dtype=auto is planned as it resolves on that GPU (bfloat16 without one, as on any GPU from the A100 on).
    layout: memplan.optimizer_layout's, to reuse across plans of one model and optimizer.
    """
    world_size = cfg.plan_world_size or int(os.environ.get("WORLD_SIZE", "1"))
    on_gpu = cfg.device not in ("cpu", "mps")  # auto: the run is planned for GPUs, present or not
    gpu_here = on_gpu and torch.cuda.is_available()
    dtype = resolve_dtype(cfg.dtype, "cuda") if gpu_here else cfg.dtype
    if dtype == "auto":
        dtype = memplan.AUTO_DTYPE if on_gpu else "float32"
    gb, name = gpu_memory(cfg, "cuda" if gpu_here else "cpu")
    model_args = planned_model_args(cfg)
    return memplan.plan(cfg, world_size, gb, model_args=model_args, dtype=dtype, layout=layout, gpu_name=name)


def dry_run(cfg):
    """--dry_run=True: print the memory plan per GPU (rank 0 only, under torchrun) and return 0."""
    plan = dry_run_plan(cfg)
    if os.environ.get("RANK", "0") == "0":
        print("\n".join(memplan.format_plan(plan)))
        if plan.fits is False:
            print(f"to fit, try {memplan.advice(plan)}")
        if cfg.gradient_accumulation_steps % plan.world_size:
            print(
                f"note: a run on {plan.world_size} processes is refused: gradient_accumulation_steps="
                f"{cfg.gradient_accumulation_steps} is not a multiple of {plan.world_size}"
            )
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print_help()
        return 0
    dist_info = None
    try:
        try:
            cfg = load_config(argv)
            if cfg.dry_run:
                return dry_run(cfg)
            dist_info = setup_distributed(cfg)
            run, progress, resumed = setup(cfg, dist_info)
        except USER_ERRORS as e:
            if dist_info is None or dist_info.is_master or not isinstance(e, SetupError):
                print(f"error: {e}", file=sys.stderr)
            return 2
        if dist_info.is_master:
            describe(run, progress)
        try:
            fit(run, progress, resumed)
            run.writer.wait()
        except (DataError, CheckpointError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except TrainingStopped as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C (torchrun passes it to every rank): one line, not a traceback
            if dist_info.is_master:
                with contextlib.suppress(CheckpointError):
                    run.writer.wait()  # a save in flight is the newest checkpoint
                path = checkpoint.checkpoint_path(cfg.out_dir)
                resume = (
                    f"resume from {path} with --init_from=resume (or auto)"
                    if os.path.isfile(path)
                    else "no checkpoint was written yet: run the same command again to start over"
                )
                print(f"interrupted at iter {progress.iter_num}; {resume}", file=sys.stderr)
            return 130
        except RuntimeError as e:
            if not (dist_info.ddp and "timed out" in str(e).lower()):
                raise
            print(
                f"error: rank {dist_info.rank}: a collective timed out after ddp_timeout_s={cfg.ddp_timeout_s} s "
                f"(another rank died or hangs); resume from {checkpoint.checkpoint_path(cfg.out_dir)} with "
                "--init_from=resume",
                file=sys.stderr,
            )
            # After a timeout the process group cannot be torn down (destroying it waits on the dead
            # peer): finish the checkpoint in flight and the metrics, then leave at once.
            with contextlib.suppress(CheckpointError):
                run.writer.wait()
            run.metrics.close()
            exit_process(1)
        finally:
            with contextlib.suppress(CheckpointError):
                run.writer.wait()  # a checkpoint in flight reaches the disk before the process ends
            run.metrics.close()
        return 0
    finally:
        if dist_info is not None and dist_info.ddp and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    exit_process(main())
