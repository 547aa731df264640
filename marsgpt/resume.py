"""What a resume must keep and may change: rank 0's decision of what the launch does in out_dir (run_dir), agreed on by
every rank; the data's fingerprint; the checkpoint chosen, loaded and checked against this launch's configuration
(config's fixed keys, the model shape and the optimizer, are refused, and a key the run's optimizer does not read is
neither) and data; and the lines naming what the resumed configuration changes (`resume: key old -> new`). The
checks are any trainer's, through plain arguments (vision/train_cifar.py uses fixed_changes and config_changes).
"""

import dataclasses
import os

from marsgpt import shards, tokens
from marsgpt.checkpoint import CheckpointError
from marsgpt.checkpointer import DATA_FINGERPRINT
from marsgpt.config import TrainConfig
from marsgpt.config_schema import config_to_dict, current_keys, fixed_keys
from marsgpt.exits import USER_ERRORS
from marsgpt.optimizers import OPTIMIZERS, Registry
from marsgpt.parallel import Parallelism
from marsgpt.run_dir import LaunchDecision, RunDir
from marsgpt.runtime import Dist, agree, decide_on_master

# Hashing more data than this at a launch (files no manifest.json records as they are) prints a note naming the
# command that records them, so that the next launch reads nothing.
HASH_NOTE_BYTES = 1 << 30


def resolve_run(
    cfg: TrainConfig, dist_info: Dist, directory: RunDir, vocabulary: str, parallel: Parallelism
) -> tuple[TrainConfig, LaunchDecision, dict | None]:
    """(cfg with init_from decided, the run_dir.LaunchDecision, the checkpoint to resume or None), agreed on by every
    rank: rank 0 holds out_dir and decides (run_dir.RunDir.start), every rank fingerprints the data (the
    LaunchDecision's `data`), then every rank loads the checkpoint rank 0 chose and checks it against this launch's
    configuration and data (`vocabulary`: TokenData.vocabulary; the fingerprint: the LaunchDecision's `data_change` says
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
