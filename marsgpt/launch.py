"""How a training run is built before its first step: the run's state (Progress, Run) and setup, which makes it from
the configuration -- the data, the resume (marsgpt/resume.py), the model, the optimizer, the parallelism, the parts a
checkpoint holds -- and the summary the start prints (describe).

What init_from means for out_dir -- its lock, which checkpoint a resume continues, when a fresh start is
refused -- is marsgpt/run_dir.py's; rank 0 decides it, and every rank then loads the checkpoint chosen and
checks it (resume.resolve_run). A resume applies the configuration it is given: changed
hyperparameters (learning rates, weight decays, betas, clip, ...) take effect, each printed as
`resume: key old -> new`.

Every check on the user's input happens before the first step and before any file in out_dir changes.
Whatever a rank reads from disk or the network is agreed on by all ranks (runtime.agree), so a rank that
cannot read it makes every rank exit with the same error instead of a hang.
"""

import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from marsgpt import checkpoint, checkpoint_parts, memory_plan, metrics, optimizers, trained_model
from marsgpt.checkpoint import CheckpointError
from marsgpt.checkpoint_parts import RNGState
from marsgpt.checkpointer import METRICS_SIZE
from marsgpt.compile_cache import CompileCache
from marsgpt.config import TrainConfig
from marsgpt.config_schema import ConfigError, config_to_dict
from marsgpt.exits import USER_ERRORS
from marsgpt.memory_plan import MemoryPlan, plan_memory
from marsgpt.metrics import LogWindow, MetricsLog
from marsgpt.optimizers import OPTIMIZERS
from marsgpt.parallel import Parallelism
from marsgpt.resume import config_changes, resolve_run
from marsgpt.run_dir import LaunchDecision, RunDir
from marsgpt.runtime import (
    Dist,
    agree,
    decide_on_master,
    resolve_compile,
    resolve_dtype,
    set_deterministic,
    setup_precision,
)
from marsgpt.stop_signals import StopSignals
from marsgpt.tokens import TokenData, get_gpt2_encoding
from marsgpt.training_optimizer import TrainingOptimizer, build_optimizer
from model import GPT, GPT2_VOCAB_SIZE, GPTConfig, model_args_from_config, model_vocab_size, peak_flops

# ---------------------------------------------------------------------------------------------------
# The run: what it carries from step to step, the objects it is built from, and setup, which builds them.


@dataclasses.dataclass
class Progress(checkpoint_parts.DataclassState):
    """What the loop carries from step to step (a checkpoint part)."""

    iter_num: int = 0  # also the data's position: batches are a function of the step
    evaluated_iter: int = -1  # the step whose evaluations are done and recorded (the metrics' cursor)
    best_val_loss: float = math.inf
    tokens: int = 0
    elapsed_s: float = 0.0
    bad_steps: int = 0  # consecutive skipped steps
    skipped_steps: int = 0
    clip_count: int = 0
    wandb_run_id: str = ""

    def load_state_dict(self, state: dict | None) -> None:
        super().load_state_dict(state)
        if "evaluated_iter" not in state:  # written before the field: always right after its step's evaluation
            self.evaluated_iter = self.iter_num
        self.bad_steps = 0  # a resume (with a lower learning rate, say) starts with a clean count


@dataclasses.dataclass
class Run:
    """The objects one training run is built from (setup builds them; train.py's loop runs them)."""

    cfg: TrainConfig
    dist: Dist
    parallel: Parallelism  # how the run is spread over its ranks: DDP, ZeRO-1 or FSDP2
    model: torch.nn.Module  # the GPT (its blocks compiled, under FSDP2 sharded, in place): what evaluation runs
    train_model: torch.nn.Module  # what the training forward goes through: the model, or DDP's wrapper of it
    compiled: bool  # torch.compile: each block and the loss (model.GPT.compile_blocks)
    model_args: dict
    optimizer: TrainingOptimizer  # and the GradScaler (float16's loss scaling) with it
    autocast: contextlib.AbstractContextManager
    train_data: TokenData
    val_batches: list  # this rank's share of the fixed evaluation windows
    train_batches: list
    hellaswag_examples: list | None
    metrics: MetricsLog | None
    window: LogWindow  # the steps since the last train line
    directory: RunDir
    tokens_per_step: int  # batch_size x gradient_accumulation_steps (over all ranks) x block_size
    memory_plan: MemoryPlan | None = None  # rank 0's, printed by describe()


def open_directory(
    cfg: TrainConfig, dist_info: Dist, signals: StopSignals | None = None, argv: list[str] | None = None
) -> RunDir:
    """The run's out_dir, not yet held (setup holds it): the one place a RunDir is made. `signals`: the stop signals
    train.py's command line took over; `argv`: its arguments, for the command a stopped run prints."""
    return RunDir(cfg, dist_info, signals, argv)


def setup(cfg: TrainConfig, dist_info: Dist, directory: RunDir | None = None) -> tuple[Run, Progress, bool]:
    """(Run, Progress, resumed): everything checked and built, and a resumed run's every part restored, before the
    first change to out_dir (`directory`: open_directory's, held here; by default one without stop signals taken
    over); nothing trained yet."""
    parallel = Parallelism.of(cfg, dist_info)
    directory = directory or open_directory(cfg, dist_info)
    train_data, val_data, vocab_size = agree(dist_info, lambda: load_data(cfg), USER_ERRORS)
    cfg, start, ckpt = resolve_run(cfg, dist_info, directory, train_data.vocabulary, parallel)
    hellaswag_examples = setup_hellaswag(cfg, train_data, dist_info)
    model, model_args = agree(dist_info, lambda: build_model(cfg, vocab_size, ckpt), USER_ERRORS)
    set_deterministic(cfg.deterministic, dist_info.device_type)
    model.to(dist_info.device)
    model.activation_checkpointing = cfg.activation_checkpointing
    autocast, scaler = setup_precision(cfg.dtype, dist_info.device_type)
    compile_model = resolve_compile(cfg.compile, dist_info.device_type)
    run = Run(
        cfg=cfg,
        dist=dist_info,
        parallel=parallel,
        model=model,
        train_model=parallel.wrap(model, compile_model, resolve_dtype(cfg.dtype, dist_info.device_type)),
        compiled=compile_model,
        model_args=model_args,
        optimizer=build_optimizer(model, cfg, parallel, scaler=scaler),
        autocast=autocast,
        train_data=train_data,
        val_batches=eval_windows(cfg, val_data, dist_info),
        train_batches=eval_windows(cfg, train_data, dist_info),
        hellaswag_examples=hellaswag_examples,
        metrics=None,
        window=LogWindow(
            device=dist_info.device,
            rank=dist_info.rank,
            world_size=dist_info.world_size,
            gather=gather_by_rank(dist_info),
        ),
        directory=directory,
        tokens_per_step=cfg.batch_size * cfg.gradient_accumulation_steps * cfg.block_size,
        memory_plan=plan_memory(cfg, dist_info, model_args) if dist_info.is_master else None,
    )
    progress = Progress()
    # What a checkpoint holds: each stateful part, restored by its own load_state_dict (checkpoint_parts.ModelState's
    # places the weights as the parallelism keeps them), and the values every checkpoint records beside them.
    parts = dict(
        model=checkpoint_parts.ModelState(model, parallel.place_state, checkpoint.checkpoint_path(cfg.out_dir)),
        optimizer=run.optimizer,
        scaler=run.optimizer.scaler_part,
        rng=RNGState(dist_info.rank, dist_info.world_size, gather_rng(dist_info)),
        progress=progress,
        log_window=run.window,
    )
    extras = dict(model_args=model_args, config=config_to_dict(cfg), vocabulary=train_data.vocabulary)
    directory.checkpoints.register(cfg, parts, extras, parallel)
    if ckpt is not None:
        agree(dist_info, lambda: directory.checkpoints.restore(ckpt, start.path), USER_ERRORS)
    if dist_info.is_master:
        changes = config_changes(ckpt["config"], cfg, OPTIMIZERS) if ckpt else []
        directory.prepare(cfg, start, ckpt, changes)
    if compile_model and cfg.compile_cache:
        directory.checkpoints.compile_cache = CompileCache(
            cfg.out_dir, dist_info.device, announce=dist_info.is_master, start_iter=progress.iter_num
        )
        if ckpt is not None:
            directory.checkpoints.compile_cache.load()  # what the run compiled, ahead of this process's first compile
    run.metrics = directory.use_metrics(open_metrics(cfg, dist_info, progress, start, ckpt))
    return run, progress, ckpt is not None


# ---------------------------------------------------------------------------------------------------
# What setup builds a run from.


def load_data(cfg: TrainConfig) -> tuple[TokenData, TokenData, int]:
    data_dir = os.path.join(cfg.data_path, cfg.dataset)
    train_data, val_data = TokenData(data_dir, "train"), TokenData(data_dir, "val")
    vocab_size = model_vocab_size(train_data)
    train_data.check_vocab(vocab_size)
    val_data.check_vocab(vocab_size)
    return train_data, val_data, vocab_size


def build_model(cfg: TrainConfig, vocab_size: int, ckpt: dict | None) -> tuple[GPT, dict]:
    """(GPT, model_args) for init_from: a fresh model, one shaped as the checkpoint's (a resume restores its weights
    as it restores every part: run_dir.RunDir.restore), or a pretrained GPT-2 with its weights (OpenAI's by name, or
    a local Hugging Face folder's).

    A resumed model has the shape the checkpoint was saved with: the configuration's for a run started from
    scratch (load_resume_checkpoint has checked that it still is), OpenAI's (bias, vocabulary, size) for one
    started from GPT-2. Only dropout, which may change on resume, is the configuration's.
    """
    if cfg.init_from not in ("scratch", "resume"):  # pretrained weights (run_dir.LaunchDecision: never auto)
        if vocab_size != GPTConfig.vocab_size:  # checked before the download
            raise ConfigError(
                f"init_from={cfg.init_from} needs GPT-2-tokenized data, but the dataset {cfg.dataset} has its own "
                f"vocabulary of {vocab_size} tokens (meta.pkl); train it with --init_from=scratch, or use a GPT-2 "
                "dataset (openwebtext, fineweb_edu)"
            )
        model = trained_model.load_pretrained(cfg.init_from, dict(dropout=cfg.dropout))
        if cfg.block_size < model.config.block_size:
            model.crop_block_size(cfg.block_size)
        return model, dataclasses.asdict(model.config)
    ckpt_path = checkpoint.checkpoint_path(cfg.out_dir)
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
    return GPT(GPTConfig(**model_args)), model_args


def eval_windows(cfg: TrainConfig, data: TokenData, dist_info: Dist) -> list:
    """This rank's share of the fixed evaluation windows: every world_size-th (train.evaluate all-reduces)."""
    batches = data.eval_batches(cfg.seed, cfg.eval_iters, cfg.batch_size, cfg.block_size, cfg.windows_per_stream)
    return batches[dist_info.rank :: dist_info.world_size]


def open_metrics(
    cfg: TrainConfig, dist_info: Dist, progress: Progress, start: LaunchDecision, ckpt: dict | None
) -> MetricsLog:
    """The run's MetricsLog (metrics.jsonl and wandb on rank 0); a resumed run continues its records (an
    eval_only launch, which trains nothing, cuts none) and its wandb run (or the one --wandb_run_id names),
    whose id progress then carries.

    A resume records at its step what it found: records lost before it (then the evaluations of that step run
    again, restoring theirs: they change nothing in training) and a change of the data (start.data_change).
    Lines that were not whole records (metrics.MetricsLog's repairs) are named."""
    if cfg.wandb_run_id:
        progress.wandb_run_id = cfg.wandb_run_id
    log = agree(
        dist_info,
        lambda: MetricsLog(
            cfg,
            dist_info.is_master,
            resume_iter=progress.iter_num if ckpt is not None else None,
            wandb_run_id=progress.wandb_run_id,
            config=config_to_dict(cfg),
            truncate=not cfg.eval_only,
            synced_size=ckpt.get(METRICS_SIZE) if ckpt is not None else None,
        ),
        USER_ERRORS,
    )
    progress.wandb_run_id = log.wandb_run_id
    lost = decide_on_master(dist_info, lambda: log.lost, USER_ERRORS)  # every rank evaluates again, or none
    if lost and progress.evaluated_iter == progress.iter_num:
        progress.evaluated_iter = -1
    if dist_info.is_master:
        at = metrics.record_axes(progress.iter_num, progress.tokens, progress.elapsed_s)
        for line in log.repairs:
            print(f"note: {line}", flush=True)
        if lost:
            print(f"note: {lost}; {metrics.LOST_RECORDS} records it at iter {progress.iter_num:,}", flush=True)
            log.write({**at, metrics.LOST_RECORDS: lost})
        if start.data_change:
            log.write({**at, metrics.DATA_CHANGE: start.data_change})
    return log


def setup_hellaswag(cfg: TrainConfig, train_data: TokenData, dist_info: Dist) -> list | None:
    """HellaSwag examples when hellaswag_interval asks for them and they can be scored, else None.

    Rank 0 finds or downloads the file; every rank then reads it and loads the GPT-2 tokenizer the evaluation
    uses, and all agree that they could: a rank without the tokenizer fails the set-up with the others, not
    its first evaluation alone while they wait for it.
    """
    if cfg.hellaswag_interval == 0:
        return None
    from marsgpt import hellaswag

    reason = None
    if train_data.meta is not None:
        reason = f"the dataset {cfg.dataset} is not GPT-2-tokenized"
    else:
        path = decide_on_master(dist_info, lambda: hellaswag.ensure_data(cfg.hellaswag_path), USER_ERRORS)
        if path is None:
            reason = "its data is not available offline (give --hellaswag_path)"
        else:

            def load():
                get_gpt2_encoding()  # kept by tokens for the evaluations
                return hellaswag.load_examples(path)

            return agree(dist_info, load, USER_ERRORS)
    if dist_info.is_master:
        print(f"warning: HellaSwag evaluation disabled: {reason}", file=sys.stderr)
    return None


def gather_rng(dist_info: Dist) -> Callable | None:
    """RNGState's gather: every rank's CUDA generator states (a collective under DDP on CUDA); None, RNGState's
    default (this rank's alone), otherwise."""
    return gather_by_rank(dist_info) if torch.cuda.is_available() else None


def gather_by_rank(dist_info: Dist) -> Callable | None:
    """A function from this rank's value to every rank's, in rank order (a collective), under DDP; else None."""
    if not dist_info.torchrun:
        return None

    def gather(value):
        values = [None] * dist_info.world_size
        dist.all_gather_object(values, value)
        return values

    return gather


# The optimizer's keys describe() names, those of them it reads
HEADLINE_KEYS = ("learning_rate", "lr_1d", "muon_lr", "muon_adamw_lr", "weight_decay")


def describe(run: Run, progress: Progress, asked: TrainConfig) -> None:
    """Print what the run is, as the launch settled it: how it starts (`asked`: the configuration as given, before
    init_from was decided), model, data, optimizer, batch, schedule and out_dir in a few lines; every key (and the
    whole memory plan, with no GPU to compare it with) only with --verbose=True, as config.json in out_dir holds
    them."""
    cfg = run.cfg
    micro_batches = cfg.gradient_accumulation_steps // run.dist.world_size
    if cfg.verbose:
        for key, value in config_to_dict(cfg).items():
            print(f"{key} = {value!r}")
    print(f"start: {start_line(asked.init_from, cfg, progress)}")
    shape = run.model.config  # the checkpoint's or the pretrained model's, which may not be the configuration's
    print(
        f"model: {run.model.get_num_params() / 1e6:.2f}M parameters, {shape.n_layer} layers x {shape.n_embd} wide, "
        f"{shape.n_head} heads, context {shape.block_size}, vocabulary {shape.vocab_size}; "
        f"data: {os.path.join(cfg.data_path, cfg.dataset)}"
    )
    entry = OPTIMIZERS.entry(cfg)
    rates = ", ".join(f"{key} {getattr(cfg, key):g}" for key in HEADLINE_KEYS if key in entry.keys)
    print(f"optimizer: {entry.label(cfg) if entry.label else cfg.optimizer}; {rates}; grad_clip {cfg.grad_clip:g}")
    print(
        f"world size {run.dist.world_size} on {run.dist.device}; "
        f"{micro_batches} micro-batch{'es' if micro_batches != 1 else ''} per rank per step"
    )
    print(
        f"tokens per optimizer step: {run.tokens_per_step:,} = batch_size {cfg.batch_size} x "
        f"gradient_accumulation_steps {cfg.gradient_accumulation_steps} x block_size {cfg.block_size}"
    )
    print(f"total tokens: {run.tokens_per_step * cfg.max_iters:,} over max_iters {cfg.max_iters:,}")
    print(schedule_line(cfg))
    warning = optimizers.schedule_warning(cfg)
    if warning:
        print(warning, file=sys.stderr)
    if progress.iter_num >= cfg.max_iters and not cfg.eval_only:
        print(
            f"nothing to train: the run is at iter {progress.iter_num:,} and max_iters is {cfg.max_iters:,}; "
            f"raise --max_iters to train further"
        )
    note = OPTIMIZERS.ignored_settings(cfg, TrainConfig())
    if note:
        print(note)
    plan = run.memory_plan
    lines = memory_plan.format_plan(plan)
    # whole where it has a GPU to compare with (on one, or --gpu_memory_gb), else its first line
    print("\n".join(lines if cfg.verbose or plan.fits is not None else lines[:1]))
    if plan.fits is False:
        print(
            f"warning: the memory plan ({plan.total_bytes / memory_plan.GIB:.1f} GiB per GPU) exceeds the "
            f"{plan.usable_bytes / memory_plan.GIB:.1f} GiB usable on this GPU: the run may stop with CUDA out of "
            f"memory; try {memory_plan.advice(plan)}",
            file=sys.stderr,
        )
    if run.dist.device_type == "cuda" and peak_flops(run.dist.device) is None:
        print(
            f"note: mfu is logged as null: no peak bf16 FLOP/s is known for {torch.cuda.get_device_name()} "
            "(model.PEAK_BF16_FLOPS)"
        )
    if not cfg.verbose:
        print(f"out_dir: {cfg.out_dir} (every key in its config.json; --verbose=True prints them here)")


def start_line(asked: str, cfg: TrainConfig, progress: Progress) -> str:
    """How the run starts: init_from as given and, where the launch decided it (auto), what it decided."""
    decided = "" if asked == cfg.init_from else f" -> {cfg.init_from}"
    if cfg.init_from == "resume":
        return f"init_from={asked}{decided}: continues at iter {progress.iter_num:,} of {cfg.max_iters:,}"
    if cfg.init_from == "scratch":
        return f"init_from={asked}{decided}: a new run"
    return f"init_from={asked}{decided}: a new run from its weights"


def schedule_line(cfg: TrainConfig) -> str:
    """The learning-rate schedule the run follows (scale_schedule's fitted lengths, when set)."""
    if not cfg.decay_lr:
        return "schedule: constant peak lr (decay_lr=False)"
    warmup_iters, lr_decay_iters = optimizers.schedule_lengths(cfg)
    if cfg.scale_schedule:
        return f"schedule fitted to max_iters (scale_schedule): warmup {warmup_iters:,}, decay to {lr_decay_iters:,}"
    ends = {"cosine": f"cosine to min_lr {cfg.min_lr:g} at iter {lr_decay_iters:,}", "constant": "then constant"}
    decay = ends.get(cfg.schedule, f"{cfg.schedule}, to min_lr {cfg.min_lr:g}")
    return f"schedule: warmup {warmup_iters:,} iters, {decay}"
