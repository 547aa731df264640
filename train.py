"""Pretrain GPT-2 with MARS (or AdamW / Muon): nanoGPT's training loop as small functions main() composes.

    python train.py [config/a.py ...] [--key=value ...]              # one process: CPU or one GPU
    torchrun --standalone --nproc_per_node=8 train.py config/...     # DDP on one node

The configuration (configurator.py) is checked, and so are the data, the world size and any
checkpoint, before any work starts; a mistake prints `error: ...` and exits 2.

Data parallelism: gradient_accumulation_steps counts the micro-batches of one optimizer step across ALL
ranks. Micro-batch k of step s is TokenData.get_batch(seed, s, k) wherever it runs; rank r takes
k = r, r + world_size, ... . So the windows, and up to float rounding the model, do not depend on the
number of GPUs, and a run can resume on a different number of GPUs.

Exact resume: checkpoints are written after the evaluation that follows a step, holding everything the
next steps depend on (see checkpoint.py); batches and dropout masks are pure functions of
(seed, step, micro-batch); evaluation windows are fixed. A run killed at any moment and restarted with
--init_from=resume ends with the same losses and parameters as one left alone.
"""

import contextlib
import dataclasses
import datetime
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
from checkpoint import CheckpointError
from configurator import ConfigError, config_to_dict, load_config, print_help, wants_help
from model import GPT, GPTConfig
from optim import build_optimizer, set_lr
from tokens import DataError, TokenData

# Model arguments a checkpoint must share with the config it resumes under (dropout may change).
SHAPE_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "scale_attn_by_inverse_layer_idx")


class TrainingStopped(Exception):
    """The run cannot continue (diverged); the message is the one line the user sees."""


@dataclasses.dataclass
class Dist:
    ddp: bool = False  # launched by torchrun (even with one process)
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def device_type(self):
        return torch.device(self.device).type

    @property
    def is_master(self):
        return self.rank == 0


@dataclasses.dataclass
class Progress:
    """What the loop carries from step to step; saved in every checkpoint under these names."""

    iter_num: int = 0
    best_val_loss: float = math.inf
    tokens: int = 0
    elapsed_s: float = 0.0
    bad_steps: int = 0  # consecutive skipped steps
    skipped_steps: int = 0
    clip_count: int = 0
    wandb_run_id: str = ""


# What resuming needs beyond the weights: the rest of checkpoint.py's list.
RESUME_KEYS = ("optimizer", "scaler", "rng", *(f.name for f in dataclasses.fields(Progress)))


@dataclasses.dataclass
class Run:
    """The objects one training run is built from."""

    cfg: object
    dist: Dist
    model: torch.nn.Module  # the plain GPT: parameters, state_dict, estimate_mfu
    train_model: torch.nn.Module  # what the training forward goes through (compiled, DDP-wrapped)
    eval_model: torch.nn.Module  # compiled, without DDP
    model_args: dict
    optimizer: object
    scaler: torch.amp.GradScaler
    autocast: object
    train_data: TokenData
    val_data: TokenData
    val_batches: list  # this rank's share of the fixed evaluation windows
    train_batches: list
    hellaswag_examples: list | None
    metrics: "MetricsLog"

    @property
    def exact_mars(self):
        return self.cfg.optimizer_name == "mars" and not self.cfg.is_approx

    @property
    def tokens_per_step(self):
        return self.cfg.batch_size * self.cfg.gradient_accumulation_steps * self.cfg.block_size


# ---------------------------------------------------------------------------------------------------
# Setup: every check on the user's input happens here, before the first step.


def setup_distributed(cfg):
    """Dist for this process; joins the process group under torchrun (NCCL on CUDA, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.gradient_accumulation_steps % world_size:
        raise ValueError(
            f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} (micro-batches per step "
            f"across all ranks) is not divisible by the world size {world_size}; use a multiple "
            f"of {world_size} or a different number of processes"
        )
    ddp = "RANK" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device={cfg.device!r} but CUDA is not available; use --device=cpu")
        if ddp:
            device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    info = Dist(ddp=ddp, rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    if ddp:
        backend = cfg.backend
        if backend == "auto":
            backend = "nccl" if info.device_type == "cuda" else "gloo"
        # The timeout bounds every collective: when a rank dies or hangs the others fail with an error
        # after ddp_timeout_s instead of waiting forever.
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=cfg.ddp_timeout_s))
    return info


def setup_precision(cfg, device_type):
    """(autocast context, GradScaler): bfloat16 where CUDA supports it, else float16 with loss scaling."""
    dtype = cfg.dtype
    if dtype == "auto":
        if device_type == "cuda":
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        else:
            dtype = "float32"
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls
        torch.backends.cudnn.allow_tf32 = True
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    autocast = (
        contextlib.nullcontext() if ptdtype == torch.float32 else torch.autocast(device_type=device_type, dtype=ptdtype)
    )
    return autocast, torch.amp.GradScaler(device_type, enabled=(ptdtype == torch.float16))


def load_data(cfg):
    data_dir = os.path.join(cfg.data_path, cfg.dataset)
    return TokenData(data_dir, "train"), TokenData(data_dir, "val")


def model_vocab_size(data):
    """The data's own vocabulary (meta.pkl) or GPT-2's, padded to 50304 as the reference does."""
    return data.vocab_size if data.meta is not None else GPTConfig().vocab_size


def model_args_from_config(cfg, vocab_size):
    return dict(
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_embd=cfg.n_embd,
        block_size=cfg.block_size,
        bias=cfg.bias,
        vocab_size=vocab_size,
        dropout=cfg.dropout,
        scale_attn_by_inverse_layer_idx=cfg.scale_attn_by_inverse_layer_idx,
    )


def build_model(cfg, vocab_size, ckpt, ckpt_path):
    """(GPT, model_args) for init_from: a fresh model, the checkpoint's weights, or OpenAI's GPT-2."""
    if cfg.init_from.startswith("gpt2"):
        model = GPT.from_pretrained(cfg.init_from, dict(dropout=cfg.dropout))
        if cfg.block_size < model.config.block_size:
            model.crop_block_size(cfg.block_size)
        model_args = {k: getattr(model.config, k) for k in model_args_from_config(cfg, vocab_size)}
        return model, model_args
    model_args = model_args_from_config(cfg, vocab_size)
    if ckpt is not None:
        for key in SHAPE_ARGS:
            if ckpt["model_args"].get(key) != model_args[key]:
                raise CheckpointError(
                    f"{ckpt_path} was trained with {key}={ckpt['model_args'].get(key)!r} but "
                    f"the config gives {key}={model_args[key]!r}; resume with the same "
                    f"model settings (--{key}={ckpt['model_args'].get(key)!r})"
                )
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = GPT(GPTConfig(**model_args))
    if ckpt is not None:
        checkpoint.load_model_state(model, ckpt["model"], ckpt_path)
    return model, model_args


def setup_hellaswag(cfg, train_data, dist_info):
    """HellaSwag examples when hellaswag_interval asks for them and they can be scored, else None."""
    if cfg.hellaswag_interval == 0:
        return None
    import hellaswag

    reason = None
    if train_data.meta is not None:
        reason = f"the dataset {cfg.dataset} is not GPT-2-tokenized"
    else:
        path = hellaswag.ensure_data(cfg.hellaswag_path)
        if path is None:
            reason = "its data is not available offline (give --hellaswag_path)"
        else:
            return hellaswag.load_examples(path)
    if dist_info.is_master:
        print(f"warning: HellaSwag evaluation disabled: {reason}", file=sys.stderr)
    return None


def resolve_compile(cfg, device_type):
    return cfg.compile if cfg.compile is not None else device_type == "cuda"


def setup(cfg, dist_info):
    """(Run, Progress, resumed): everything checked and built; nothing trained yet."""
    train_data, val_data = load_data(cfg)
    vocab_size = model_vocab_size(train_data)
    train_data.check_vocab(vocab_size)
    val_data.check_vocab(vocab_size)
    ckpt, ckpt_path = None, checkpoint.checkpoint_path(cfg.out_dir)
    if cfg.init_from == "resume":
        ckpt = checkpoint.load_checkpoint(ckpt_path)
        missing = [key for key in RESUME_KEYS if key not in ckpt]
        if missing:
            raise CheckpointError(
                f"{ckpt_path} lacks {', '.join(missing)}: it was not written by this train.py, "
                f"so it cannot be resumed (init_from=resume); load its weights instead"
            )
    hellaswag_examples = setup_hellaswag(cfg, train_data, dist_info)

    model, model_args = build_model(cfg, vocab_size, ckpt, ckpt_path)
    model.to(dist_info.device)
    autocast, scaler = setup_precision(cfg, dist_info.device_type)
    optimizer = build_optimizer(model, cfg, dist_info.device_type)
    progress = Progress()
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        if scaler.is_enabled() and ckpt["scaler"]:
            scaler.load_state_dict(ckpt["scaler"])
        checkpoint.set_rng_state(ckpt["rng"])
        progress = Progress(**{f.name: ckpt[f.name] for f in dataclasses.fields(Progress)})
    if cfg.wandb_run_id:
        progress.wandb_run_id = cfg.wandb_run_id

    eval_model = torch.compile(model) if resolve_compile(cfg, dist_info.device_type) else model
    train_model = eval_model
    if dist_info.ddp:
        train_model = DDP(eval_model, device_ids=[dist_info.local_rank] if dist_info.device_type == "cuda" else None)

    def my_share(batches):  # every rank scores every world_size-th window; evaluate() all-reduces
        return batches[dist_info.rank :: dist_info.world_size]

    val_batches = my_share(val_data.eval_batches(cfg.seed, cfg.eval_iters, cfg.batch_size, cfg.block_size))
    train_batches = my_share(train_data.eval_batches(cfg.seed, cfg.eval_iters, cfg.batch_size, cfg.block_size))

    metrics = MetricsLog(cfg, dist_info, progress, resume_iter=progress.iter_num if ckpt else None)
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
        train_data=train_data,
        val_data=val_data,
        val_batches=val_batches,
        train_batches=train_batches,
        hellaswag_examples=hellaswag_examples,
        metrics=metrics,
    )
    return run, progress, ckpt is not None


def describe(run):
    """Print the effective configuration and the token budget; record the configuration in out_dir."""
    cfg = run.cfg
    config = config_to_dict(cfg)
    for key, value in config.items():
        print(f"{key} = {value!r}")
    print(
        f"world size {run.dist.world_size} on {run.dist.device}; "
        f"{cfg.gradient_accumulation_steps // run.dist.world_size} micro-batches per rank per step"
    )
    print(
        f"tokens per optimizer step: {run.tokens_per_step:,} = batch_size {cfg.batch_size} x "
        f"gradient_accumulation_steps {cfg.gradient_accumulation_steps} x block_size {cfg.block_size}"
    )
    print(f"total tokens: {run.tokens_per_step * cfg.max_iters:,} over max_iters {cfg.max_iters:,}")
    print(f"model parameters: {run.model.get_num_params() / 1e6:.2f}M")
    with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
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
                _, loss = run.train_model(x, y)
                loss = loss / len(micro_steps)
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
    return StepResult(loss=loss, grad_norm=grad_norm, skipped=skipped, clipped=clipped)


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


def checkpoint_state(run, progress):
    return dict(
        model=run.model.state_dict(),
        model_args=run.model_args,
        optimizer=run.optimizer.state_dict(),
        scaler=run.scaler.state_dict(),
        config=config_to_dict(run.cfg),
        rng=checkpoint.rng_state(),
        **dataclasses.asdict(progress),
    )


def save_checkpoints(run, progress, is_best):
    """ckpt.pt (the latest, what resume reads), plus best.pt and periodic copies as the config asks."""
    cfg = run.cfg
    latest = os.path.join(cfg.out_dir, checkpoint.CKPT_NAME)
    checkpoint.save_checkpoint(latest, checkpoint_state(run, progress))
    it = progress.iter_num
    if is_best and cfg.save_best:
        checkpoint.keep_copy(latest, os.path.join(cfg.out_dir, checkpoint.BEST_NAME))
    if (
        cfg.keep_every_n_evals
        and it > 0
        and it % cfg.eval_interval == 0
        and (it // cfg.eval_interval) % cfg.keep_every_n_evals == 0
    ):
        checkpoint.keep_copy(latest, os.path.join(cfg.out_dir, f"ckpt_{it:07d}.pt"))


def _json_number(value):
    return value if value is None or math.isfinite(value) else None  # JSON has no NaN / inf


class MetricsLog:
    """out_dir/metrics.jsonl (always) and wandb (when wandb_log): the same records, from rank 0 only.

    On resume the file is cut back to the checkpoint's iteration, so the steps redone after a crash are
    not recorded twice; wandb continues the checkpoint's run and plots against 'iter'.
    """

    def __init__(self, cfg, dist_info, progress, resume_iter):
        self.enabled = dist_info.is_master
        self.wandb = None
        if not self.enabled:
            return
        os.makedirs(cfg.out_dir, exist_ok=True)
        self.path = os.path.join(cfg.out_dir, "metrics.jsonl")
        if resume_iter is not None:
            self._truncate(resume_iter)
        elif os.path.exists(self.path):
            os.remove(self.path)  # a fresh run in an old out_dir
        self.file = open(self.path, "a")
        if cfg.wandb_log:
            import wandb

            self.wandb = wandb.init(
                project=cfg.wandb_project,
                name=cfg.wandb_run_name,
                id=progress.wandb_run_id or None,
                resume="allow",
                config=config_to_dict(cfg),
            )
            progress.wandb_run_id = self.wandb.id  # saved in every checkpoint: resume continues this run
            self.wandb.define_metric("iter")
            self.wandb.define_metric("*", step_metric="iter")

    def _truncate(self, resume_iter):
        if not os.path.exists(self.path):
            return
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by the crash
                if record.get("iter", math.inf) <= resume_iter:
                    kept.append(line if line.endswith("\n") else line + "\n")
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def write(self, record):
        if not self.enabled:
            return
        record = {k: _json_number(v) if isinstance(v, float) else v for k, v in record.items()}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(record)

    def close(self):
        if self.enabled:
            self.file.close()
            if self.wandb is not None:
                self.wandb.finish()


@dataclasses.dataclass
class LogWindow:
    """Steps since the last train log line: their losses (on the device) and wall-clock time."""

    loss_sum: torch.Tensor | None = None
    losses: int = 0
    steps: int = 0
    t0: float = dataclasses.field(default_factory=time.perf_counter)

    def add(self, result):
        self.steps += 1
        if not result.skipped:
            self.loss_sum = result.loss if self.loss_sum is None else self.loss_sum + result.loss
            self.losses += 1

    def restart(self):
        self.loss_sum, self.losses, self.steps, self.t0 = None, 0, 0, time.perf_counter()


def norm_of(tensors):
    return torch.nn.utils.get_total_norm(list(tensors)) if tensors else torch.zeros(())


def log_train(run, progress, window, result, time_s):
    """A train line: mean loss of the window's steps (all ranks take part in its all-reduce)."""
    cfg = run.cfg
    loss = None
    if window.losses:
        loss = all_reduce_sum(run, window.loss_sum / window.losses) / run.dist.world_size
    if not run.dist.is_master:
        return
    dt = (time.perf_counter() - window.t0) / window.steps
    values = [loss if loss is not None else torch.tensor(math.nan), norm_of(list(run.model.parameters()))]
    if cfg.optimizer_name == "mars":  # the momentum norms the reference train_mars.py logs
        states = [s for s in run.optimizer.state.values() if "exp_avg" in s]
        values.append(norm_of([s["exp_avg"] for s in states]))
        values.append(norm_of([s["exp_avg_sq"] for s in states if "exp_avg_sq" in s]))
    values = torch.stack([v.float().to(run.dist.device) for v in values]).tolist()
    passes = 2 if run.exact_mars else 1
    mfu = run.model.estimate_mfu(run.tokens_per_step // run.dist.world_size * passes, dt)
    record = {
        "iter": progress.iter_num,
        "tokens": progress.tokens,
        "time_s": time_s,
        "train/loss": values[0],
        "lr": run.optimizer.param_groups[0]["lr"],
        "grad_norm": result.grad_norm,
        "clip_rate": progress.clip_count / progress.iter_num,
        "tokens_per_sec": run.tokens_per_step / dt,
        "step_ms": dt * 1000,
        "mfu": None if mfu is None else mfu * 100,
        "param_norm": values[1],
        "skipped_steps": progress.skipped_steps,
    }
    if cfg.optimizer_name == "mars":
        record.update(
            momentum_norm=values[2], momentum_norm_sq=values[3], momentum_div=values[2] / (math.sqrt(values[3]) + 1e-8)
        )
    mfu_text = "" if mfu is None else f", mfu {mfu * 100:.1f}%"
    print(
        f"iter {progress.iter_num}: loss {values[0]:.4f}, lr {record['lr']:.3e}, grad_norm {result.grad_norm:.3f}, "
        f"{dt * 1000:.1f} ms/step, {record['tokens_per_sec']:,.0f} tok/s{mfu_text}",
        flush=True,
    )
    run.metrics.write(record)


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
        run.metrics.write(
            {
                "iter": progress.iter_num,
                "tokens": progress.tokens,
                "time_s": time_s,
                "val/loss": val_loss,
                "eval/train_loss": train_loss,
            }
        )
    if run.dist.is_master and not cfg.eval_only:
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
        run.metrics.write(
            {
                "iter": progress.iter_num,
                "tokens": progress.tokens,
                "time_s": time_s,
                "hellaswag/acc_norm": result["acc_norm"],
            }
        )


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
    window.add(result)
    if result.skipped:
        record_skip(run, progress, result, time_s())
    else:
        progress.bad_steps = 0
    if progress.iter_num % run.cfg.log_interval == 0:
        log_train(run, progress, window, result, time_s())
        window.restart()


def record_skip(run, progress, result, time_s):
    progress.bad_steps += 1
    progress.skipped_steps += 1
    it = progress.iter_num
    if run.dist.is_master:
        print(
            f"iter {it}: non-finite loss or gradient norm ({result.grad_norm}); step skipped "
            f"({progress.bad_steps} in a row, {progress.skipped_steps} in the run)",
            flush=True,
        )
        run.metrics.write(
            {
                "iter": progress.iter_num,
                "tokens": progress.tokens,
                "time_s": time_s,
                "skipped_steps": progress.skipped_steps,
            }
        )
    if progress.bad_steps >= run.cfg.max_bad_steps:
        latest = os.path.join(run.cfg.out_dir, checkpoint.CKPT_NAME)
        raise TrainingStopped(
            f"{progress.bad_steps} consecutive steps (up to iter {it}) had a non-finite "
            f"loss or gradient norm (max_bad_steps={run.cfg.max_bad_steps}); stopped. The last "
            f"good checkpoint is {latest}: resume it with --init_from=resume and a lower "
            f"learning_rate, or check the data"
        )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print_help()
        return 0
    dist_info = None
    try:
        try:
            cfg = load_config(argv)
            dist_info = setup_distributed(cfg)
            if dist_info.is_master:
                os.makedirs(cfg.out_dir, exist_ok=True)
            run, progress, resumed = setup(cfg, dist_info)
        except (ConfigError, DataError, CheckpointError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if dist_info.is_master:
            describe(run)
        try:
            fit(run, progress, resumed)
        except (DataError, CheckpointError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except TrainingStopped as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        finally:
            run.metrics.close()
        return 0
    finally:
        if dist_info is not None and dist_info.ddp and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
