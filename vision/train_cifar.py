"""Train a CIFAR ResNet with MARS, AdamW or Muon: the paper's vision experiments (arXiv:2411.10438, §4.3).

    python -m vision.train_cifar --dataset=cifar10 --data_dir=data/cifar --optimizer_name=mars \
        --learning_rate=1e-3 --epochs=200 --device=cuda --out_dir=out-cifar/mars

Defaults are the reference trainer's (AGI-Arena/MARS, MARS/train_CV.py with utils/cv_utils.py):
ResNet-18, batch 128, 200 epochs, MultiStepLR at 1/2 and 3/4 of the epochs (factor 0.1), seed 0, MARS
with its defaults (betas (0.95, 0.99), gamma 0.025) at --learning_rate for the tensors MARS takes and
--lr_1d=3e-3 (the reference's --adamw_lr) with AdamW betas (0.9, 0.95) and weight decay 0.1 for the rest.

Which tensors MARS takes is --mars_routing: '2d' (default; the paper's code) gives it only exactly-2-D
tensors, so in a ResNet every convolution kernel (4-D) trains with the AdamW rule above and only the
classifier's weight with MARS; 'nd' gives it the convolution kernels too.

Each epoch: a progress bar, a line with train/test loss and test accuracy, a record in
out_dir/metrics.jsonl, and out_dir/ckpt.pt (written atomically) holding everything the next epoch depends
on: model, optimizer, epoch (the learning-rate schedule is a function of the epoch), RNG states. Batches
and augmentation are a pure function of (seed, epoch) (vision/cifar.py), so on CPU a run killed at any
moment and restarted with --init_from=resume ends with bit-identical parameters to one left alone. On a
GPU that holds only with deterministic kernels, which the trainer does not ask for: it sets
cudnn.benchmark (as the reference), which times candidate convolution kernels at startup and may pick
other ones in the resumed process.

Differences from the reference, each deliberate:
- One device (the reference wraps the model in DataParallel over every visible GPU, which splits each
  batch, and so its BatchNorm statistics, across them; on one GPU the two are the same).
- Data: the data set lives on the device and is augmented there (vision/cifar.py), instead of a
  torchvision DataLoader; the same transforms, other random draws.
- MARS's first step has no correction term (mars.py says why); Muon is vision/muon.py (the reference's
  rule); AdamW is torch's (the reference's Muon pairs its own AdamW, whose eps sits outside the bias
  correction: a 1e-8-level difference).
"""

import dataclasses
import json
import os
import sys
import time
from typing import Literal

import torch
import torch.nn.functional as F
from tqdm import tqdm

from mars import MARS
from marsgpt import checkpoint, resume, run_dir, shards, training_optimizer
from marsgpt.checkpoint import CheckpointError
from marsgpt.checkpoint_parts import DataclassState, RNGState, load_model_state
from marsgpt.config_schema import (
    ConfigError,
    betas,
    config_to_dict,
    device_check,
    fraction,
    key,
    load_config,
    non_negative,
    positive,
    print_help,
    wants_help,
)
from marsgpt.files import atomic_writer
from marsgpt.metrics import MetricsLog
from marsgpt.optim_protocol import ChainedOptimizer
from marsgpt.optimizers import OptimizerEntry, Registry
from marsgpt.parallel import Parallelism
from marsgpt.runtime import resolve_device
from marsgpt.tokens import DataError
from vision.cifar import CifarData
from vision.muon import Muon
from vision.resnet import ResNet

# The reference's ResNets of BasicBlocks (model_CNN.py), by depth.
NETS = {"resnet10": (1, 1, 1, 1), "resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3)}


# ---------------------------------------------------------------------------------------------------
# The optimizers: the reference train_CV.py's, each over one group of all parameters (none is excluded from
# weight decay), or Muon's split by dimension.


def every_parameter(model, cfg):
    return [list(model.parameters())]


def by_dimension(model, cfg):
    """As the reference's CombinedOptimizer: tensors of 2 or more dimensions (convolution kernels included)
    to Muon, the rest to AdamW."""
    params = list(model.parameters())
    return [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]


def mars_settings(cfg):
    mars = dict(lr=cfg.learning_rate, betas=tuple(cfg.mars_betas), weight_decay=cfg.weight_decay, gamma=cfg.gamma)
    return {"mars": dict(mars, lr_1d=cfg.lr_1d, betas_1d=tuple(cfg.betas_1d), weight_decay_1d=cfg.weight_decay_1d)}


def adamw_settings(cfg):
    return {"adamw": dict(lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)}


def muon_settings(cfg):
    return {
        "muon": dict(lr=cfg.learning_rate, weight_decay=0.0),
        "adamw": dict(lr=cfg.lr_1d, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay),
    }


def build_mars(groups, cfg, parallel):
    return parallel.place_optimizer(MARS, groups, mars_type=cfg.mars_type, routing=cfg.mars_routing)


def build_adamw(groups, cfg, parallel):
    return parallel.place_optimizer(torch.optim.AdamW, groups)


def build_muon(groups, cfg, parallel):
    muon, adamw = groups
    return ChainedOptimizer(
        parallel.place_optimizer(Muon, [muon]), parallel.place_optimizer(torch.optim.AdamW, [adamw])
    )


CIFAR_OPTIMIZERS = Registry(
    OptimizerEntry(
        name="mars",
        description="MARS (mars_type) on the tensors mars_routing names, AdamW (lr_1d, betas_1d, weight_decay_1d) "
        "on the rest",
        keys=frozenset({"learning_rate", "weight_decay", "gamma", "mars_betas", "mars_routing", "mars_type"})
        | {"lr_1d", "betas_1d", "weight_decay_1d"},
        group_settings=mars_settings,
        split=every_parameter,
        build=build_mars,
    ),
    OptimizerEntry(
        name="adamw",
        description="torch.optim.AdamW",
        keys=frozenset({"learning_rate", "weight_decay", "beta1", "beta2"}),
        group_settings=adamw_settings,
        split=every_parameter,
        build=build_adamw,
    ),
    OptimizerEntry(
        name="muon",
        description="the reference's Muon (vision/muon.py) on the tensors of 2+ dimensions, AdamW (lr_1d) on the rest",
        keys=frozenset({"learning_rate", "lr_1d", "weight_decay", "beta1", "beta2"}),
        group_settings=muon_settings,
        split=by_dimension,
        build=build_muon,
    ),
    key="optimizer_name",
)


@dataclasses.dataclass
class CifarConfig:
    """Every key of a CIFAR run (vision/train_cifar.py); defaults are the reference train_CV.py's."""

    # --- data and model
    dataset: Literal["cifar10", "cifar100"] = key("cifar10", "which CIFAR", fixed=True)
    data_dir: str = key("data/cifar", "folder of the CIFAR distributions; the python one is downloaded here if absent")
    net: Literal["resnet10", "resnet18", "resnet34"] = key("resnet18", "the reference's CIFAR ResNet", fixed=True)
    width: int = key(64, "channels of the first stage, doubled by each next one (ResNet-18: 64)", positive, fixed=True)
    # --- optimizer
    optimizer_name: Literal[tuple(CIFAR_OPTIMIZERS.descriptions())] = key(
        "mars", "the optimizer", fixed=True, choices=CIFAR_OPTIMIZERS.descriptions()
    )
    learning_rate: float = key(
        0.1, "lr of MARS's tensors, of everything under AdamW, of Muon's tensors (--lr there)", positive
    )
    lr_1d: float = key(
        3e-3, "lr of MARS's AdamW-rule tensors and of Muon's AdamW part (--adamw_lr there)", non_negative
    )
    weight_decay: float = key(
        0.0, "weight decay of MARS's tensors, AdamW's, Muon's AdamW part (--wd there)", non_negative
    )
    beta1: float = key(0.9, "AdamW's (and Muon's AdamW part's) first-moment decay", fraction)
    beta2: float = key(0.999, "AdamW's (and Muon's AdamW part's) second-moment decay", fraction)
    mars_routing: Literal["2d", "nd"] = key(
        "2d",
        "which tensors take MARS: 2d = exactly 2-D ones (the paper's code: conv kernels get AdamW); nd = 2+ dims",
        fixed=True,
    )
    mars_type: Literal["mars-adamw", "mars-lion", "mars-shampoo"] = key(
        "mars-adamw", "MARS: the preconditioner", fixed=True
    )
    gamma: float = key(0.025, "MARS: strength of the variance-reduction correction", non_negative)
    mars_betas: tuple[float, float] = key((0.95, 0.99), "MARS: betas of its tensors (MARS's defaults)", betas)
    betas_1d: tuple[float, float] = key((0.9, 0.95), "MARS: AdamW betas of the other tensors", betas)
    weight_decay_1d: float = key(0.1, "MARS: AdamW weight decay of the other tensors", non_negative)
    # --- schedule
    epochs: int = key(
        200,
        "passes over the training set; a resume may change it, and the multistep milestones (1/2 and 3/4 of it) "
        "move with it: extending a run past a drop raises the lr again",
        positive,
    )
    batch_size: int = key(128, "training images per step", positive)
    eval_batch_size: int = key(100, "test images per forward pass", positive)
    schedule: Literal["multistep", "constant"] = key(
        "multistep", "multistep: lr x0.1 from epochs 1/2 and 3/4 of the way (MultiStepLR as the reference steps it)"
    )
    seed: int = key(0, "seed of the weights, the batch order and the augmentation", non_negative)
    # --- run, logging, system
    out_dir: str = key("out-cifar", "directory of the run: ckpt.pt, metrics.jsonl, config.json")
    init_from: Literal["scratch", "resume", "auto"] = key(
        "scratch",
        "scratch: a new run (refused when out_dir holds a checkpoint); resume: continue out_dir's ckpt.pt; "
        "auto: resume when there is one, else scratch",
    )
    overwrite: bool = key(False, "with init_from=scratch: delete out_dir's previous run (checkpoint, metrics) first")
    wandb_log: bool = key(False, "log every epoch's record to wandb too")
    wandb_project: str = key("CV", "wandb project (the reference's)")
    wandb_run_name: str = key(
        "", "wandb run name; '' = the reference's {dataset}_{net}_{optimizer_name}_{learning_rate}"
    )
    device: str = key("auto", "auto (CUDA when present), cpu, cuda or cuda:N", device_check("cpu", "cuda"))


# ---------------------------------------------------------------------------------------------------
# Building


def model_args(cfg, num_classes):
    return {"num_classes": num_classes, "width": cfg.width, "blocks": list(NETS[cfg.net])}


def build_optimizer(model, cfg):
    """The optimizer cfg names, over model's parameters (on their device): an training_optimizer.TrainingOptimizer."""
    device_type = next(model.parameters()).device.type
    return training_optimizer.build_optimizer(model, cfg, Parallelism.single(device_type), CIFAR_OPTIMIZERS)


def lr_factor(epoch, cfg):
    """Every group's lr during epoch `epoch` (from 1), as a multiple of its initial lr.

    multistep: the reference's MultiStepLR(milestones=[epochs // 2, 3 * epochs // 4], gamma=0.1), which
    it steps at the START of each epoch: epoch e trains at 0.1^(milestones <= e), so with 200 epochs the
    lr drops for epochs 100 and 150 (not 101 and 151).
    """
    if cfg.schedule == "constant":
        return 1.0
    milestones = (cfg.epochs // 2, 3 * cfg.epochs // 4)
    return 0.1 ** sum(m <= epoch for m in milestones)


@dataclasses.dataclass
class Progress(DataclassState):
    """What the loop carries from epoch to epoch (a checkpoint part)."""

    epoch: int = 0  # epochs completed
    iter_num: int = 0  # optimizer steps taken
    best_acc: float = 0.0  # best test accuracy so far (%)
    elapsed_s: float = 0.0  # training wall-clock time, carried across resumes
    wandb_run_id: str = ""


@dataclasses.dataclass
class Run:
    cfg: CifarConfig
    device: str
    data: CifarData
    model: torch.nn.Module
    model_args: dict
    optimizer: training_optimizer.TrainingOptimizer
    rng: RNGState
    saved_epoch: int = 0  # the epoch out_dir's checkpoint holds (0: none written or resumed yet)


# What a checkpoint holds besides model_args and config: each part's state_dict(), by name. The learning
# rate is a function of the epoch and the batches of (seed, epoch), so these are all a resume needs.
CHECKPOINT_PARTS = ("model", "optimizer", "rng", "progress")


def checkpoint_parts(run, progress):
    objects = dict(model=run.model, optimizer=run.optimizer, rng=run.rng, progress=progress)
    return {name: objects[name] for name in CHECKPOINT_PARTS}


def load_resume_checkpoint(cfg):
    """out_dir's checkpoint, checked for every part and, by launch's resume rule, for the keys declared
    fixed=True (the data set, the network, the optimizer and its routing) that the run's optimizer reads:
    every other key may change."""
    path = checkpoint.checkpoint_path(cfg.out_dir)
    ckpt = shards.load_checkpoint(path)
    missing = [part for part in (*CHECKPOINT_PARTS, "config") if part not in ckpt]
    if missing:
        raise CheckpointError(
            f"{path} lacks {', '.join(missing)}: it was not written by vision/train_cifar.py, so it cannot be "
            "resumed; start a new run in a new --out_dir"
        )
    changed = resume.fixed_changes(ckpt["config"], cfg, CIFAR_OPTIMIZERS)
    if changed:
        key, old, new = changed[0]
        raise CheckpointError(
            f"{path} was trained with {key}={old!r}, not {new!r}; a resumed run cannot change {key}: resume "
            f"with --{key}={old}, or start a new run in a new --out_dir"
        )
    return ckpt


# A CIFAR run is its checkpoint: metrics.jsonl without one holds at most the record of the epoch whose save
# was cut short (nothing at all after a Ctrl-C in the first epoch), so the same command may start again.
RUN_FILE_NAMES = (run_dir.CKPT_NAME,)


def setup(cfg):
    """(Run, Progress, resumed): everything checked and built; nothing trained yet."""
    start = run_dir.decide_start(cfg, RUN_FILE_NAMES)
    cfg = dataclasses.replace(cfg, init_from=start.init_from)
    try:
        device = resolve_device(cfg.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ckpt = load_resume_checkpoint(cfg) if cfg.init_from == "resume" else None
    if device.startswith("cuda"):
        torch.backends.cudnn.benchmark = True  # as the reference: fixed shapes, so the fastest kernels
    data = CifarData.from_dir(cfg.dataset, cfg.data_dir, device)
    torch.manual_seed(cfg.seed)  # the model's initialisation, as the reference seeds before building it
    args = model_args(cfg, data.num_classes)
    model = ResNet(**args)
    if ckpt is not None:
        load_model_state(model, ckpt["model"], checkpoint.checkpoint_path(cfg.out_dir))
    model.to(device)
    run = Run(cfg, device, data, model, args, build_optimizer(model, cfg), RNGState())
    progress = Progress()
    if ckpt is not None:
        # the moments and step counts are the checkpoint's, the hyperparameters this configuration's
        run.optimizer.load_state_dict(ckpt["optimizer"])
        run.rng.load_state_dict(ckpt["rng"])
        progress.load_state_dict(ckpt["progress"])
        run.saved_epoch = progress.epoch
    # Everything is checked: the first change to out_dir, as train.py makes it (what a killed save left goes,
    # --overwrite=True removes the old run, a resume says where it continues and what it changes).
    changes = resume.config_changes(ckpt["config"], cfg, CIFAR_OPTIMIZERS) if ckpt is not None else ()
    run_dir.prepare_out_dir(cfg, start, ckpt, changes, at=f"epoch {progress.epoch}")
    return run, progress, ckpt is not None


# ---------------------------------------------------------------------------------------------------
# Training and evaluation


def train_epoch(run, epoch, progress):
    """One pass over the training set (epoch from 1); returns (mean loss, accuracy %) over its images."""
    cfg, model, optimizer = run.cfg, run.model, run.optimizer
    for group in optimizer.param_groups:  # MARS's AdamW-rule lr follows as lr_1d / lr x the group's lr
        group["lr"] = group["initial_lr"] * lr_factor(epoch, cfg)
    model.train()
    loss_sum = torch.zeros((), device=run.device)
    correct = torch.zeros((), dtype=torch.long, device=run.device)
    seen = 0
    bar = tqdm(
        total=run.data.train_batches_per_epoch(cfg.batch_size),
        desc=f"epoch {epoch}/{cfg.epochs}",
        leave=False,
        mininterval=1.0,
        disable=None,  # on a terminal only: a log file gets the per-epoch lines, not carriage returns
    )
    with bar:  # closed on Ctrl-C too, so the line saying so starts on a clean line
        for step, (images, labels) in enumerate(run.data.train_batches(cfg.seed, epoch, cfg.batch_size), 1):
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            progress.iter_num += 1
            loss_sum += loss.detach() * len(labels)
            correct += (logits.argmax(1) == labels).sum()
            seen += len(labels)
            bar.update()
            if step % 20 == 0 and not bar.disable:  # reading the loss waits for the device: only for a bar on show
                bar.set_postfix(loss=f"{loss_sum.item() / seen:.3f}")
    return loss_sum.item() / seen, 100.0 * correct.item() / seen


@torch.no_grad()
def evaluate(run):
    """(mean loss, accuracy %) on the test set."""
    model = run.model
    model.eval()
    loss_sum = torch.zeros((), device=run.device)
    correct = torch.zeros((), dtype=torch.long, device=run.device)
    for images, labels in run.data.test_batches(run.cfg.eval_batch_size):
        logits = model(images)
        loss_sum += F.cross_entropy(logits, labels, reduction="sum")
        correct += (logits.argmax(1) == labels).sum()
    seen = len(run.data.test_labels)
    return loss_sum.item() / seen, 100.0 * correct.item() / seen


def save_checkpoint(run, progress):
    state = {name: part.state_dict() for name, part in checkpoint_parts(run, progress).items()}
    state.update(model_args=run.model_args, config=config_to_dict(run.cfg))
    checkpoint.save_checkpoint(os.path.join(run.cfg.out_dir, run_dir.CKPT_NAME), state)
    run.saved_epoch = progress.epoch


def open_metrics(cfg, progress, resumed):
    """metrics.MetricsLog: metrics.jsonl cut back to the checkpoint's step on resume, and wandb when asked."""
    name = cfg.wandb_run_name or f"{cfg.dataset}_{cfg.net}_{cfg.optimizer_name}_{cfg.learning_rate}"
    log = MetricsLog(
        dataclasses.replace(cfg, wandb_run_name=name),
        is_master=True,
        resume_iter=progress.iter_num if resumed else None,
        wandb_run_id=progress.wandb_run_id,
        config=config_to_dict(cfg),
    )
    progress.wandb_run_id = log.wandb_run_id  # in every checkpoint: a resumed run continues this wandb run
    return log


def fit(run, progress, metrics):
    """Train from epoch progress.epoch + 1 to cfg.epochs; evaluate, log and checkpoint after each."""
    cfg = run.cfg
    for epoch in range(progress.epoch + 1, cfg.epochs + 1):
        t0 = time.perf_counter()
        train_loss, train_acc = train_epoch(run, epoch, progress)
        train_s = time.perf_counter() - t0
        test_loss, test_acc = evaluate(run)
        progress.epoch = epoch
        progress.best_acc = max(progress.best_acc, test_acc)
        progress.elapsed_s += time.perf_counter() - t0
        images_per_s = len(run.data.train_labels) / train_s
        print(
            f"epoch {epoch}/{cfg.epochs}: train/loss {train_loss:.4f}, train/acc {train_acc:.2f}%, "
            f"test/loss {test_loss:.4f}, test/acc {test_acc:.2f}% (best {progress.best_acc:.2f}%), "
            f"lr {run.optimizer.param_groups[0]['lr']:.3e}, {images_per_s:,.0f} images/s",
            flush=True,
        )
        metrics.write(
            {
                "epoch": epoch,
                "iter": progress.iter_num,
                "time_s": progress.elapsed_s,
                "lr": run.optimizer.param_groups[0]["lr"],
                "train/loss": train_loss,
                "train/acc": train_acc,
                "test/loss": test_loss,
                "test/acc": test_acc,
                "test/best_acc": progress.best_acc,
                "images_per_s": images_per_s,
            }
        )
        save_checkpoint(run, progress)  # after the record: a resume cuts metrics.jsonl back to its step


def describe(run, progress):
    cfg = run.cfg
    config = config_to_dict(cfg)
    for name, value in config.items():
        print(f"{name} = {value!r}")
    n_params = sum(p.numel() for p in run.model.parameters())
    n_train, n_test = len(run.data.train_labels), len(run.data.test_labels)
    print(f"{cfg.net} width {cfg.width}: {n_params / 1e6:.2f}M parameters on {run.device}")
    print(f"{cfg.dataset}: {n_train:,} training and {n_test:,} test images")
    if progress.epoch >= cfg.epochs:
        print(
            f"nothing to train: the run is at epoch {progress.epoch} and epochs is {cfg.epochs}; "
            f"raise --epochs to train further"
        )
    with atomic_writer(os.path.join(cfg.out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def interrupted(run):
    """The line for Ctrl-C during training: the epoch cut short, and the checkpoint to resume from."""
    cfg = run.cfg
    where = f"interrupted at epoch {min(run.saved_epoch + 1, cfg.epochs)}/{cfg.epochs}"
    if run.saved_epoch == 0:
        return f"{where}, before any checkpoint was written; rerun the same command to start again"
    ckpt_path = os.path.join(cfg.out_dir, run_dir.CKPT_NAME)
    return f"{where}; {ckpt_path} holds epoch {run.saved_epoch}: resume with --init_from=resume (or auto)"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print_help(CifarConfig, usage="python -m vision.train_cifar [config/file.py ...] [--key=value ...]")
        return 0
    try:
        cfg = load_config(argv, CifarConfig)
        run, progress, resumed = setup(cfg)
        metrics = open_metrics(run.cfg, progress, resumed)
    except (ConfigError, DataError, CheckpointError, ValueError) as e:  # ValueError: wandb could not start
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while reading the data or the checkpoint: nothing was trained
        print("interrupted before training began; rerun the same command", file=sys.stderr)
        return 130
    try:
        describe(run, progress)
        fit(run, progress, metrics)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line instead of a traceback; 130 = 128 + SIGINT, as a shell reports it
        print(interrupted(run), file=sys.stderr)
        return 130
    finally:
        metrics.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
