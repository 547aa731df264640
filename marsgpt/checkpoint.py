"""Checkpoints: atomic saves written in the background, safe loads, and the model loader the tools share.

A checkpoint is one torch.save'd dict that torch.load(weights_only=True) accepts, so loading one cannot
run code: every value is a tensor, a number, a string or a list/tuple/dict of them. It holds

    model_args    the GPTConfig fields the model was built with
    config        the run's full configuration (config.config_to_dict)
    <part>        the state_dict() of each stateful part train.py names in checkpoint_parts():
                  model, optimizer, scaler, rng (RNGState), progress (train.Progress); the optimizer's is
                  the unsharded optimizer's format also under ZeRO-1 (optimizers.ShardedOptimizer gathers every
                  rank's share on rank 0), so any number of ranks, sharded or not, resumes it

and nothing else: what a resume restores is exactly what was saved, part by part. The batches need no
state of their own: tokens.TokenData.get_batch is a pure function of (seed, step, micro_step), so the
progress's iter_num and the config are all the sampler needs.
"""

import dataclasses
import os
import pickle
import random
import shutil
import threading
import weakref
import zipfile

import numpy as np
import torch

from marsgpt.files import atomic_path, atomic_writer

CKPT_NAME = "ckpt.pt"
BEST_NAME = "best.pt"
COMPILE_PREFIX = "_orig_mod."  # torch.compile's wrapper names every parameter with this prefix

REQUIRED_KEYS = ("model", "model_args")  # what the tools after training (sample, hellaswag, export) read


class CheckpointError(Exception):
    """A missing, corrupt or mismatching checkpoint; the message is the one line the user sees."""


def checkpoint_path(path):
    """`path` itself when it names a file, else the latest checkpoint inside the directory `path`."""
    return os.path.join(path, CKPT_NAME) if os.path.isdir(path) else path


def save_checkpoint(path, state):
    """Write `state` to `path` atomically: a crash, kill -9 or full disk leaves any previous file intact."""
    try:
        with atomic_writer(path) as f:
            torch.save(state, f)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        directory = os.path.dirname(os.path.abspath(path))
        raise CheckpointError(
            f"cannot write checkpoint {path}: {getattr(e, 'strerror', None) or e}; the previous one is "
            f"kept (free disk space in {directory} and resume)"
        ) from None


def keep_copy(src, dst):
    """Make `dst` an atomic copy of the finished checkpoint `src` (best-val and periodic checkpoints).

    A hard link costs no I/O and stays valid after `src` is replaced by the next save (the rename
    gives `src` a new inode); filesystems without hard links get a real copy. Either is renamed into
    place and made durable as every write is (marsgpt/files.py).
    """
    try:
        try:
            with atomic_path(dst) as tmp:
                os.link(src, tmp)  # src's bytes are on disk already: save_checkpoint fsync'ed them
        except OSError:
            with open(src, "rb") as f, atomic_writer(dst) as copy:
                shutil.copyfileobj(f, copy)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {dst}: {e.strerror or e}") from None


class DataclassState:
    """state_dict()/load_state_dict() for a dataclass of plain values (a run's progress counters), so it is
    a checkpoint part like the model and the optimizer."""

    def state_dict(self):
        return dataclasses.asdict(self)

    def load_state_dict(self, state):
        for f in dataclasses.fields(self):
            setattr(self, f.name, state[f.name])


_handed_over = weakref.WeakValueDictionary()  # id -> CPU tensor that hand_over gave to the next cpu_copy


def hand_over(state):
    """Give the CPU tensors of `state`, private copies their maker keeps no reference to (the ZeRO-1
    optimizer's gathered state), to the next cpu_copy that meets them: it takes their storage as it is
    instead of copying it again. Returns `state`. Each tensor is handed over once, so a tensor that later
    becomes live (loaded into an optimizer, say) is copied like any other at the next save."""
    for tensor in tensors_of(state):
        if tensor.device.type == "cpu":
            _handed_over[id(tensor)] = tensor
    return state


def map_tensors(value, fn):
    """A state tree (dicts, lists and tuples) with fn(tensor) in place of each tensor, depth first."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def tensors_of(value):
    """Every tensor of a state tree, in map_tensors' order."""
    found = []
    map_tensors(value, found.append)
    return found


def cpu_copy(value):
    """A deep copy of a state tree with every tensor copied to the CPU: what the background write
    serialises while training goes on changing the live tensors (and the live lr values).

    Tensors that share storage share it in the copy too, as torch.save keeps them: the tied token embedding
    and output head are one matrix in the checkpoint, not two. Each storage is copied once and whole (what
    torch.save writes of it anyway). The storage of a CPU tensor given to hand_over is taken as it is.
    """
    storages = {}  # (device, address) of each storage met so far -> its CPU copy

    def copy(tensor):
        handed_over = _handed_over.pop(id(tensor), None) is tensor
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if key not in storages:
            if handed_over:
                storages[key] = storage
            else:
                storages[key] = storage.clone() if tensor.device.type == "cpu" else storage.cpu()
        view = torch.empty(0, dtype=tensor.dtype)
        return view.set_(storages[key], tensor.storage_offset(), tensor.size(), tensor.stride())

    return map_tensors(value, copy)


class CheckpointWriter:
    """Writes checkpoints in a background thread, so training goes on while the bytes reach storage.

    save() takes a CPU copy of the state at once (the checkpoint is exactly the state at that moment),
    then a thread writes it atomically and makes its copies (best.pt, periodic ones). One write is in
    flight at a time: the next save, or wait(), first waits for it and raises its error, if any (always
    a CheckpointError, whatever went wrong). With a GPT-2 XL checkpoint (~25 GB) on storage at 40 MB/s
    a synchronous save would stall every rank for ten minutes and trip the collective timeout; here it
    costs the device-to-host copy. The cost is host memory for one copy of the state on the saving rank.
    """

    def __init__(self):
        self._thread = None
        self._error = None

    def save(self, path, state, copies=()):
        self.wait()
        snapshot = cpu_copy(state)
        self._thread = threading.Thread(target=self._write, args=(path, snapshot, tuple(copies)), daemon=False)
        self._thread.start()

    def _write(self, path, snapshot, copies):
        try:
            save_checkpoint(path, snapshot)
            for dst in copies:
                keep_copy(path, dst)
        except CheckpointError as e:
            self._error = e
        except Exception as e:  # anything else would end the thread unseen, and training would go on unsaved
            error = CheckpointError(f"cannot write checkpoint {path}: {type(e).__name__}: {e}")
            error.__cause__ = e
            self._error = error

    def wait(self):
        """Block until the write in flight is on disk; raise its error, if it had one."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


RESUME_ADVICE = "train with --init_from=scratch first, or point out_dir at the run to resume"  # train.py's
TOOL_ADVICE = "train a model first (python train.py ...), or give the out_dir of a trained run"  # the tools'


def load_checkpoint(path, mmap=False, missing_advice=RESUME_ADVICE):
    """The checkpoint dict at `path` (a file, or a directory holding ckpt.pt), loaded onto the CPU.

    mmap=True maps the file instead of reading it: the tensors are paged in from the page cache as they
    are copied to their device, so the 8 ranks of a node resuming a GPT-2 XL run share one copy of the
    file in memory instead of holding 8 (about 200 GB). The mapping is private (copy-on-write), and
    checkpoints are only ever replaced by a rename, which leaves a mapped file intact. `missing_advice`
    ends the error for a missing file: what the user of this tool should do.
    """
    path = checkpoint_path(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path}; {missing_advice}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path} is not a readable checkpoint ({reason}); it may be truncated or from an incompatible version"
        ) from None
    if not isinstance(ckpt, dict) or any(key not in ckpt for key in REQUIRED_KEYS):
        raise CheckpointError(f"{path} is not a training checkpoint (expected the keys {', '.join(REQUIRED_KEYS)})")
    return ckpt


def strip_compile_prefix(state_dict):
    return {k.removeprefix(COMPILE_PREFIX): v for k, v in state_dict.items()}


def is_reference_mask(key):
    """The paper's code saves each layer's causal mask as a buffer 'attn.bias'; our SDPA model has none."""
    return key.endswith(".attn.bias")


def load_model_state(model, state_dict, path):
    """Load `state_dict` into `model`, naming the first key whose presence or shape does not match."""
    state_dict = strip_compile_prefix(state_dict)
    expected = model.state_dict()
    for key, value in expected.items():
        if key not in state_dict:
            raise CheckpointError(
                f"{path}: the checkpoint has no '{key}' (the model was built with a "
                f"different shape; resume with the config it was trained with)"
            )
        if tuple(state_dict[key].shape) != tuple(value.shape):
            raise CheckpointError(
                f"{path}: '{key}' has shape {tuple(state_dict[key].shape)} in the "
                f"checkpoint but {tuple(value.shape)} in the model built from the config"
            )
    extra = [key for key in state_dict if key not in expected and not is_reference_mask(key)]
    if extra:
        raise CheckpointError(
            f"{path}: the checkpoint has '{extra[0]}', which the model built from the "
            f"config lacks (a different number of layers?)"
        )
    model.load_state_dict(state_dict)


def load_pretrained(name, override_args=None):
    """GPT.from_pretrained(name) for train.py, sample.py and marsgpt/hellaswag.py: where the Hugging Face hub cannot
    be reached (a compute node without internet), the local cache at once instead of retries."""
    from marsgpt.runtime import network_reachable
    from model import GPT, HF_CHECKPOINTS, HF_HUB_HOST  # here, as in load_model

    offline = name in HF_CHECKPOINTS and not network_reachable(HF_HUB_HOST)
    return GPT.from_pretrained(name, override_args, offline=offline)


def load_model(path_or_out_dir, device="cpu", missing_advice=TOOL_ADVICE):
    """(GPT, checkpoint dict): the trained model in eval mode, for sample.py and the hellaswag and export_hf tools."""
    from model import GPT, GPTConfig  # here, so this module stays importable without model.py's cost

    path = checkpoint_path(path_or_out_dir)
    ckpt = load_checkpoint(path, missing_advice=missing_advice)
    if not isinstance(ckpt["model"], dict) or not isinstance(ckpt["model_args"], dict):
        raise CheckpointError(f"{path} is not a training checkpoint (its model and model_args are not dicts)")
    try:
        config = GPTConfig(**ckpt["model_args"])
    except TypeError as e:  # another model's arguments (a vision/ checkpoint) or a newer model.py's
        raise CheckpointError(f"{path} is not a checkpoint of this repository's GPT ({e})") from None
    model = GPT(config)
    load_model_state(model, ckpt["model"], path)
    model.to(device)
    model.eval()
    return model, ckpt


def iteration(ckpt):
    """The step a checkpoint was saved after (its progress part's iter_num), or None when it has none."""
    progress = ckpt.get("progress")
    return progress.get("iter_num") if isinstance(progress, dict) else None


# ---------------------------------------------------------------------------------------------------
# Random number generator states, in forms weights_only loading accepts (numpy's array becomes a tensor).


class RNGState:
    """The Python, numpy and torch generators of this process, and the CUDA generators of every rank.

    Each rank's CUDA generators differ (they are seeded per device), so state_dict() takes every rank's
    (gathered by the caller: `cuda_by_rank`) and load_state_dict() gives each rank its own when the world
    size is the same; on a different world size the CUDA generators keep their fresh seeds. Nothing in
    training draws from them between checkpoints except dropout, which is reseeded every micro-batch.
    """

    def __init__(self, rank=0, gather=None):
        self.rank = rank
        self.gather = gather or (lambda state: [state])  # this rank's CUDA state -> every rank's

    def state_dict(self):
        np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return {
            "python": random.getstate(),
            "numpy": {
                "name": np_name,
                "keys": torch.from_numpy(np_keys.astype(np.int64)),
                "pos": int(np_pos),
                "has_gauss": int(np_has_gauss),
                "cached_gaussian": float(np_gauss),
            },
            "torch": torch.get_rng_state(),
            "cuda_by_rank": self.gather(cuda),
        }

    def load_state_dict(self, state, world_size=1):
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
        np_state = state["numpy"]
        np.random.set_state(
            (
                np_state["name"],
                np_state["keys"].numpy().astype(np.uint32),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["cached_gaussian"],
            )
        )
        torch.set_rng_state(state["torch"])
        cuda_by_rank = state.get("cuda_by_rank", [])
        if len(cuda_by_rank) == world_size and torch.cuda.is_available():
            mine = cuda_by_rank[self.rank]
            if len(mine) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(mine)
