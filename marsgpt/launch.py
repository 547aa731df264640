"""How a training run starts: what init_from means for out_dir, what a resume must keep and may change, and
the parts train.py builds from the configuration before its first step.

Runs and out_dir: init_from=scratch refuses an out_dir that already holds a run (--overwrite=True deletes it
first); init_from=resume continues out_dir's ckpt.pt; init_from=auto does whichever applies, so a preempted
job relaunched with the same command continues. A resume applies the configuration it is given: changed
hyperparameters (learning rates, weight decays, betas, clip, ...) take effect, each printed as
`resume: key old -> new`; keys that cannot change mid-run (config's fixed keys: the model shape, the
optimizer and its MARS variant) are refused, and a key the run's optimizer does not read is neither.

Every check on the user's input happens before the first step and before any file in out_dir changes.
Whatever a rank reads from disk or the network is agreed on by all ranks (runtime.agree), so a rank that
cannot read it makes every rank exit with the same error instead of a hang.
"""

import dataclasses
import glob
import json
import os
import sys

import torch
import torch.distributed as dist

from marsgpt import checkpoint, memory_plan, metrics, optimizers
from marsgpt.checkpoint import CheckpointError
from marsgpt.config import ConfigError, TrainConfig, config_to_dict, fixed_keys
from marsgpt.files import atomic_writer, remove_stale_temporaries
from marsgpt.metrics import MetricsLog
from marsgpt.optimizers import OPTIMIZERS
from marsgpt.runtime import SetupError, agree, decide_on_master
from marsgpt.tokens import DataError, TokenData, get_gpt2_encoding
from model import GPT, GPT2_VOCAB_SIZE, GPTConfig, model_args_from_config, model_vocab_size, peak_flops

# The errors a user's input or a missing file can cause: each is one `error:` line and exit status 2.
USER_ERRORS = (ConfigError, DataError, CheckpointError, SetupError)

# The parts of a run a checkpoint holds, by name (train.checkpoint_parts maps them to the run's objects).
CHECKPOINT_PARTS = ("model", "optimizer", "scaler", "rng", "progress")

# The files that make out_dir a run (with the kept ckpt_<iter>.pt copies): a fresh start does not replace them
# unless told to.
RUN_FILE_NAMES = (checkpoint.CKPT_NAME, checkpoint.BEST_NAME, metrics.FILE_NAME)


def load_data(cfg):
    data_dir = os.path.join(cfg.data_path, cfg.dataset)
    train_data, val_data = TokenData(data_dir, "train"), TokenData(data_dir, "val")
    vocab_size = model_vocab_size(train_data)
    train_data.check_vocab(vocab_size)
    val_data.check_vocab(vocab_size)
    return train_data, val_data, vocab_size


def run_files(out_dir, names=RUN_FILE_NAMES):
    """The files in out_dir that belong to a run: its checkpoints and its metrics (those of `names` there are)."""
    found = [os.path.join(out_dir, n) for n in names if os.path.isfile(os.path.join(out_dir, n))]
    return found + sorted(glob.glob(os.path.join(out_dir, "ckpt_*.pt")))


def resolve_init_from(cfg, names=RUN_FILE_NAMES):
    """init_from as this launch means it: 'auto' becomes 'resume' when out_dir holds ckpt.pt, else 'scratch'.

    A fresh start (anything but resume) into an out_dir that holds a run (run_files with `names`) is refused
    unless overwrite is set: a relaunch that forgot --init_from=resume must not erase days of training.
    """
    has_checkpoint = os.path.isfile(os.path.join(cfg.out_dir, checkpoint.CKPT_NAME))
    init_from = cfg.init_from
    if init_from == "auto":
        init_from = "resume" if has_checkpoint else "scratch"
    previous = run_files(cfg.out_dir, names)
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


def resolve_run(cfg, dist_info):
    """(cfg with init_from decided, the checkpoint to resume or None), agreed on by every rank."""
    init_from = decide_on_master(dist_info, lambda: resolve_init_from(cfg), USER_ERRORS)
    cfg = dataclasses.replace(cfg, init_from=init_from)
    ckpt = None
    if init_from == "resume":
        ckpt = agree(dist_info, lambda: load_resume_checkpoint(cfg, dist_info.device_type), USER_ERRORS)
    return cfg, ckpt


def prepare_out_dir(cfg, ckpt, optimizer_entry, at=None):
    """Rank 0, once every check has passed: what a killed save left goes, --overwrite=True removes the old
    run, and a resume says where it continues (`at`; by default the checkpoint's iteration) and what its
    configuration changes (config_changes, for the run's optimizers.OptimizerEntry)."""
    remove_stale_temporaries(cfg.out_dir)
    if cfg.overwrite and cfg.init_from != "resume":
        remove_previous_run(cfg)
    if ckpt is not None:
        at = at or f"iter {ckpt['progress']['iter_num']:,}"
        print(f"resuming {checkpoint.checkpoint_path(cfg.out_dir)} at {at}", flush=True)
        for line in config_changes(ckpt["config"], cfg, optimizer_entry):
            print(line, flush=True)


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
    changed = fixed_changes(ckpt["config"], cfg, OPTIMIZERS.entry(cfg))
    if changed:
        key, old, new = changed[0]
        raise CheckpointError(
            f"{path} was trained with {key}={old!r} but the config gives {key}={new!r}; a resumed run cannot "
            f"change {key}: resume with --{key}={old!r}, or start a new run in a new out_dir"
        )
    return ckpt


def fixed_changes(saved, cfg, optimizer_entry):
    """(key, saved value, new value) for each key of cfg's class declared fixed=True that cfg changes from the
    checkpoint's configuration `saved`: the resume rule. Every other key may change (config_changes names
    them), and so may a fixed key the run's optimizer (optimizer_entry) does not read (mars_type in a Muon
    run)."""
    changes = []
    for key in fixed_keys(type(cfg)):
        new = getattr(cfg, key)
        old = saved_value(saved, key, new)
        if old != new and key not in optimizer_entry.unused_keys:
            changes.append((key, old, new))
    return changes


def saved_value(saved, key, new):
    """A key's value in a checkpoint's configuration, as comparable with the new value `new` (a tuple, when
    it is one); `new` itself when the checkpoint predates the key."""
    old = saved.get(key, new)
    return tuple(old) if isinstance(new, tuple) else old


def config_changes(saved, cfg, optimizer_entry):
    """`resume: key old -> new` for every key the resumed run's configuration changes (a key the run's
    optimizer, optimizer_entry, does not read says so)."""
    lines = []
    for key, new in config_to_dict(cfg).items():
        old = saved_value(saved, key, new)
        if key not in ("init_from", "overwrite") and old != new:
            note = f" (not used by {optimizer_entry.selected_by})" if key in optimizer_entry.unused_keys else ""
            lines.append(f"resume: {key} {old!r} -> {new!r}{note}")
    return lines


def ignored_settings(cfg):
    """A note naming the keys set away from their defaults that this run's optimizer does not read, or None.
    A key the optimizer entry calls an alias is exempt where it has the value of the key it stands for (Muon's
    learning_rate = muon_adamw_lr in the paper configs: the reference's name for the AdamW part's lr)."""
    entry, defaults = OPTIMIZERS.entry(cfg), TrainConfig()
    ignored = [
        f"{key}={getattr(cfg, key)!r}"
        for key in sorted(entry.unused_keys)
        if getattr(cfg, key) != getattr(defaults, key)
        and not (key in entry.aliases and getattr(cfg, key) == getattr(cfg, entry.aliases[key]))
    ]
    if not ignored:
        return None
    hint = f" ({entry.unused_hint})" if entry.unused_hint else ""
    return f"note: {entry.selected_by} does not use {', '.join(ignored)}{hint}"


def build_model(cfg, vocab_size, ckpt):
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
    model = GPT(GPTConfig(**model_args))
    if ckpt is not None:
        checkpoint.load_model_state(model, ckpt["model"], ckpt_path)
    return model, model_args


def restore(ckpt, cfg, dist_info, optimizer, scaler, rng, progress):
    """Load a resumed run's parts from its checkpoint: the optimizer under this run's hyperparameters
    (optimizers.load_state), the loss scale where float16 uses one, every rank's RNG state, the progress."""
    optimizers.load_state(optimizer, ckpt["optimizer"], OPTIMIZERS.entry(cfg), cfg)
    if scaler.is_enabled() and ckpt["scaler"]:
        scaler.load_state_dict(ckpt["scaler"])
    rng.load_state_dict(ckpt["rng"], dist_info.world_size)
    progress.load_state_dict(ckpt["progress"])


def eval_windows(cfg, data, dist_info):
    """This rank's share of the fixed evaluation windows: every world_size-th (train.evaluate all-reduces)."""
    batches = data.eval_batches(cfg.seed, cfg.eval_iters, cfg.batch_size, cfg.block_size, cfg.windows_per_stream)
    return batches[dist_info.rank :: dist_info.world_size]


def open_metrics(cfg, dist_info, progress, resumed):
    """The run's MetricsLog (metrics.jsonl and wandb on rank 0); a resumed run continues its records and its
    wandb run (or the one --wandb_run_id names), whose id progress then carries."""
    if cfg.wandb_run_id:
        progress.wandb_run_id = cfg.wandb_run_id
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
    return log


def setup_hellaswag(cfg, train_data, dist_info):
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
    print("\n".join(memory_plan.format_plan(plan)))
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
    with atomic_writer(os.path.join(cfg.out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def resume_advice(cfg):
    """What continues a run that stopped: its checkpoint, or starting over when it has none yet."""
    path = checkpoint.checkpoint_path(cfg.out_dir)
    if os.path.isfile(path):
        return f"resume from {path} with --init_from=resume (or auto)"
    if cfg.init_from == "auto" or cfg.overwrite:  # a relaunch starts over by itself
        return "no checkpoint was written yet: run the same command again to start over"
    return "no checkpoint was written yet: start over with --overwrite=True (or --init_from=auto)"


def checkpoint_copies(cfg, it, is_best):
    """The paths ckpt.pt is copied to after the evaluation at iteration `it`: best.pt when the validation loss
    is the run's best (save_best), and ckpt_<it>.pt every keep_every_n_evals evaluations."""
    copies = []
    if is_best and cfg.save_best:
        copies.append(os.path.join(cfg.out_dir, checkpoint.BEST_NAME))
    evals = it // cfg.eval_interval
    if cfg.keep_every_n_evals and it > 0 and it % cfg.eval_interval == 0 and evals % cfg.keep_every_n_evals == 0:
        copies.append(os.path.join(cfg.out_dir, f"ckpt_{it:07d}.pt"))
    return copies
