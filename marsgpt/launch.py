"""How a training run starts: the run's state (Progress, Run) and setup, which builds it from the configuration
before its first step -- what a resume must keep and may change, the data, the model, the optimizer, the parts a
checkpoint holds -- and how it ends: the exit status of whatever ended it (exit_status).

What init_from means for out_dir -- its lock, which checkpoint a resume continues, when a fresh start is
refused -- is marsgpt/run_dir.py's; rank 0 decides it, and every rank then loads the checkpoint chosen and
checks it here (resolve_run). A resume applies the configuration it is given: changed
hyperparameters (learning rates, weight decays, betas, clip, ...) take effect, each printed as
`resume: key old -> new`; keys that cannot change mid-run (config's fixed keys: the model shape, the
optimizer) are refused, and a key the run's optimizer does not read is neither.

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

from marsgpt import checkpoint, checkpoint_parts, memory_plan, metrics, optimizers, shards, tokens, trained_model
from marsgpt.checkpoint import CheckpointError
from marsgpt.checkpoint_parts import RNGState
from marsgpt.checkpointer import DATA_FINGERPRINT, METRICS_SIZE
from marsgpt.compile_cache import CompileCache
from marsgpt.config import TrainConfig
from marsgpt.config_schema import ConfigError, config_to_dict, current_keys, fixed_keys
from marsgpt.memory_plan import MemoryPlan, plan_memory
from marsgpt.metrics import LogWindow, MetricsError, MetricsLog
from marsgpt.optimizers import OPTIMIZERS, Registry
from marsgpt.parallel import Parallelism
from marsgpt.run_dir import RunDir, RunDirError, RunStopped, Start
from marsgpt.runtime import (
    Dist,
    SetupError,
    agree,
    decide_on_master,
    is_collective_timeout,
    resolve_compile,
    resolve_dtype,
    set_deterministic,
    setup_precision,
)
from marsgpt.stop_signals import StopSignals, say
from marsgpt.tokens import DataError, TokenData, get_gpt2_encoding
from marsgpt.training_optimizer import TrainingOptimizer, build_optimizer
from model import GPT, GPT2_VOCAB_SIZE, GPTConfig, model_args_from_config, model_vocab_size, peak_flops

# The errors a user's input, a missing or damaged file or an unusable out_dir can cause: each is one `error:`
# line and exit status 2.
USER_ERRORS = (ConfigError, DataError, CheckpointError, SetupError, RunDirError, MetricsError)


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


# Hashing more data than this at a launch (files no manifest.json records as they are) prints a note naming the
# command that records them, so that the next launch reads nothing.
HASH_NOTE_BYTES = 1 << 30


def resolve_run(
    cfg: TrainConfig, dist_info: Dist, directory: RunDir, vocabulary: str, parallel: Parallelism
) -> tuple[TrainConfig, Start, dict | None]:
    """(cfg with init_from decided, the run_dir.Start, the checkpoint to resume or None), agreed on by every
    rank: rank 0 holds out_dir and decides (run_dir.RunDir.start), every rank fingerprints the data (the
    Start's `data`), then every rank loads the checkpoint rank 0 chose and checks it against this launch's
    configuration and data (`vocabulary`: TokenData.vocabulary; the fingerprint: the Start's `data_change` says
    how it changed, when allow_data_change lets it). `parallel`: the run's parallel.Parallelism, whose sharded
    model reads a sharded checkpoint's rows later (run_dir.RunDir.restore) instead of whole tensors here."""
    start = decide_on_master(dist_info, lambda: directory.start(cfg), USER_ERRORS)
    cfg = dataclasses.replace(cfg, init_from=start.init_from)
    # Every rank, each its own: none waits in a collective while another hashes data no manifest records (that
    # may take minutes), and a node whose copy of the data differs is named when it resumes.
    data = agree(dist_info, lambda: data_fingerprint(cfg, dist_info.is_master), USER_ERRORS)
    start = dataclasses.replace(start, data=data)
    ckpt = None
    if start.path is not None:

        def load():
            ckpt = load_resume_checkpoint(cfg, start.path, dist_info, vocabulary, whole=not parallel.shards_parameters)
            return ckpt, data_change(cfg, start.path, ckpt, start.data)

        ckpt, change = agree(dist_info, load, USER_ERRORS)
        start = dataclasses.replace(start, data_change=change)
    return cfg, start, ckpt


def data_fingerprint(cfg: TrainConfig, is_master: bool) -> dict:
    """tokens.fingerprint of the run's dataset, with a note (rank 0's) when making it read much of the data."""
    data_dir = os.path.join(cfg.data_path, cfg.dataset)
    data, hashed = tokens.fingerprint(data_dir)
    if is_master and hashed >= HASH_NOTE_BYTES:
        print(
            f"note: hashed {hashed / 2**30:.1f} GiB of {data_dir} to fingerprint it (its {tokens.MANIFEST_NAME} "
            f"does not record those files as they are); `python -m data.manifest {data_dir}` records them, so "
            "that the next launch reads nothing",
            flush=True,
        )
    return data


def data_change(cfg: TrainConfig, path: str, ckpt: dict, data: dict) -> str:
    """How the data changed since the checkpoint at `path` was written ('' when it did not, or the checkpoint
    predates fingerprints); CheckpointError naming the change unless allow_data_change."""
    if DATA_FINGERPRINT not in ckpt:
        return ""
    changes = tokens.data_changes(ckpt[DATA_FINGERPRINT], data)
    if changes and not cfg.allow_data_change:
        data_dir = os.path.join(cfg.data_path, cfg.dataset)
        raise CheckpointError(
            f"{path} was trained on other data than {data_dir} holds now ({', '.join(changes)}); resume on the "
            "data it was trained on, continue on this data on purpose with --allow_data_change=True (metrics.jsonl "
            "records the change), or start a new run in a new out_dir"
        )
    return ", ".join(changes)


def load_resume_checkpoint(cfg: TrainConfig, path: str, dist_info: Dist, vocabulary: str, whole: bool) -> dict:
    """The checkpoint at `path`, checked for keys the configuration may not change and for the data's vocabulary
    (its parts are checked as they are restored). Rank 0 verified its checksum while choosing it; the other ranks
    verify it here. A sharded checkpoint's tensors are read whole here (`whole`) for an unsharded run; a sharded
    run reads its rows of them later (run_dir.RunDir.restore), once its model is sharded."""
    ckpt = shards.load_checkpoint(
        path,
        mmap=dist_info.device_type == "cuda",
        verify_checksum=not dist_info.is_master,
        whole=whole,
    )
    if "config" not in ckpt:  # its parts are checked as they are restored (run_dir.RunDir.restore)
        raise CheckpointError(
            f"{path} lacks config: it was not written by this train.py, so it cannot be resumed (init_from=resume); "
            "start a new run from its weights instead"
        )
    changed = fixed_changes(ckpt["config"], cfg, OPTIMIZERS)
    if changed:
        key, old, new = changed[0]
        raise CheckpointError(
            f"{path} was trained with {key}={old!r} but the config gives {key}={new!r}; a resumed run cannot "
            f"change {key}: resume with --{key}={old!r}, or start a new run in a new out_dir"
        )
    if ckpt.get("vocabulary", vocabulary) != vocabulary:
        data_dir = os.path.join(cfg.data_path, cfg.dataset)
        raise CheckpointError(
            f"{path} was trained on another vocabulary than {data_dir}'s (its ids map to other tokens: fingerprint "
            f"{ckpt['vocabulary']}, the data's {vocabulary}; was the dataset prepared again from other text?); "
            "resume on the data it was trained on, or start a new run in a new out_dir"
        )
    return ckpt


def fixed_changes(saved: dict, cfg: object, registry: Registry) -> list[tuple]:
    """(key, saved value, new value) for each key of cfg's class declared fixed=True that cfg changes from the
    checkpoint's configuration `saved`: the resume rule. Every other key may change (config_changes names
    them), and so may a fixed key the run's optimizer (in `registry`, an optimizers.Registry) does not read
    (muon_matrices in a MARS run)."""
    saved, unused = current_keys(saved, type(cfg)), registry.unused_keys(cfg)
    changes = []
    for key in fixed_keys(type(cfg)):
        new = getattr(cfg, key)
        old = saved_value(saved, key, new)
        if old != new and key not in unused:
            changes.append((key, old, new))
    return changes


def saved_value(saved: dict, key: str, new: object) -> object:
    """A key's value in a checkpoint's configuration, as comparable with the new value `new` (a tuple, when
    it is one); `new` itself when the checkpoint predates the key."""
    old = saved.get(key, new)
    return tuple(old) if isinstance(new, tuple) else old


def config_changes(saved: dict, cfg: object, registry: Registry) -> list[str]:
    """`resume: key old -> new` for every key the resumed run's configuration changes (a key the run's
    optimizer, in `registry`, does not read says so)."""
    saved, unused = current_keys(saved, type(cfg)), registry.unused_keys(cfg)
    lines = []
    for key, new in config_to_dict(cfg).items():
        old = saved_value(saved, key, new)
        if key not in ("init_from", "overwrite", "allow_data_change") and old != new:
            note = f" (not used by {registry.selected_by(cfg)})" if key in unused else ""
            lines.append(f"resume: {key} {old!r} -> {new!r}{note}")
    return lines


def build_model(cfg: TrainConfig, vocab_size: int, ckpt: dict | None) -> tuple[GPT, dict]:
    """(GPT, model_args) for init_from: a fresh model, one shaped as the checkpoint's (a resume restores its weights
    as it restores every part: run_dir.RunDir.restore), or a pretrained GPT-2 with its weights (OpenAI's by name, or
    a local Hugging Face folder's).

    A resumed model has the shape the checkpoint was saved with: the configuration's for a run started from
    scratch (load_resume_checkpoint has checked that it still is), OpenAI's (bias, vocabulary, size) for one
    started from GPT-2. Only dropout, which may change on resume, is the configuration's.
    """
    if cfg.init_from not in ("scratch", "resume"):  # pretrained weights (run_dir.Start: never auto)
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


def open_metrics(cfg: TrainConfig, dist_info: Dist, progress: Progress, start: Start, ckpt: dict | None) -> MetricsLog:
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
        at = metrics.stamp(progress.iter_num, progress.tokens, progress.elapsed_s)
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


# ---------------------------------------------------------------------------------------------------
# How a run ends: the exit status of whatever ended it.

TIMED_OUT = 1  # the exit status after a collective timed out


def say_stop(line, directory, progress, interrupted=False):
    """The line that ends a run early, on stderr (stop_signals.say: after a Ctrl-C, `interrupted`, on the terminal
    too) and in metrics.jsonl (metrics.STOPPED), where it stays with the run."""
    say(line, to_terminal=interrupted)
    if directory is not None and progress is not None:
        directory.record_stop(line, progress)


def exit_status(
    error: BaseException,
    cfg: TrainConfig | None,
    dist_info: Dist | None,
    directory: RunDir | None,
    progress: Progress | None,
) -> int | None:
    """The exit status for the exception that ended train.main (`directory`, `progress`: the run's, None before
    they exist), after its one line on stderr; None for an exception that is not one of this repository's (it
    keeps its traceback)."""
    master = dist_info is None or dist_info.is_master
    if isinstance(error, USER_ERRORS):
        # a setup decision every rank took together fails on every rank: rank 0 says it once
        if master or not isinstance(error, SetupError):
            print(f"error: {error}", file=sys.stderr)
        return 2
    if isinstance(error, RunStopped):  # a signal, divergence, a failed write: rank 0 knows the checkpoints
        if error.line:
            say_stop(error.line, directory, progress)
        return error.status
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C (torchrun passes it to every rank): one line, no traceback
        if master and directory is None:  # while reading the configuration or joining the ranks
            say_stop("interrupted before the run started", None, None)
        elif master:
            directory.checkpoints.wait("interrupted")  # a save in flight is the newest checkpoint
            where = "before the first step" if progress is None else f"at iter {progress.iter_num}"
            say_stop(
                f"interrupted {where}; {directory.checkpoints.resume_advice()}", directory, progress, interrupted=True
            )
        return 130
    if is_collective_timeout(error, dist_info):
        say_stop(
            f"error: rank {dist_info.rank}: a collective timed out after ddp_timeout_s={cfg.ddp_timeout_s} s "
            f"(another rank died or hangs); {directory.checkpoints.resume_advice()}",
            directory,
            progress,
        )
        return TIMED_OUT
    return None
