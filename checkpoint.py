"""Checkpoints: atomic saves, safe loads, and the model loader the tools after training share.

A checkpoint is one torch.save'd dict (keys below) that torch.load(weights_only=True) accepts, so
loading one cannot run code: every value is a tensor, a number, a string or a list/tuple/dict of them.

    model         the model's state_dict, without torch.compile's '_orig_mod.' prefix
    model_args    the GPTConfig fields the model was built with
    optimizer     the optimizer's state_dict (for exact MARS this includes its stored gradients)
    scaler        the float16 GradScaler's state_dict ({} when it is disabled)
    iter_num      optimizer steps taken; training resumes with this step
    best_val_loss lowest validation loss so far
    config        the run's full configuration (configurator.config_to_dict)
    rng           python / numpy / torch / CUDA generator states (see rng_state)
    wandb_run_id  so a resumed run continues the same wandb run ('' without wandb)
    tokens        training tokens consumed so far
    elapsed_s     training wall-clock seconds so far, carried across resumes
    bad_steps     consecutive non-finite steps skipped right before this checkpoint
    skipped_steps non-finite steps skipped in the whole run
    clip_count    steps whose gradient norm exceeded grad_clip (for the running clip rate)

The batches need no state of their own: tokens.TokenData.get_batch is a pure function of
(seed, step, micro_step), so iter_num and the config are all the sampler needs.
"""

import os
import pickle
import random
import shutil
import zipfile

import numpy as np
import torch

CKPT_NAME = "ckpt.pt"
BEST_NAME = "best.pt"
COMPILE_PREFIX = "_orig_mod."  # torch.compile's wrapper names every parameter with this prefix

REQUIRED_KEYS = ("model", "model_args", "iter_num")


class CheckpointError(Exception):
    """A missing, corrupt or mismatching checkpoint; the message is the one line the user sees."""


def checkpoint_path(path):
    """`path` itself when it names a file, else the latest checkpoint inside the directory `path`."""
    return os.path.join(path, CKPT_NAME) if os.path.isdir(path) else path


def save_checkpoint(path, state):
    """Write `state` to `path` atomically: a crash, kill -9 or full disk leaves any previous file intact.

    The bytes go to a temporary file in the same directory (so the rename cannot cross filesystems),
    are flushed and fsync'ed, and only then renamed over `path`; the directory is fsync'ed so the
    rename itself survives a power loss.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoint {path}: {e.strerror or e}; the previous one is "
            f"kept (free disk space in {directory} and resume)"
        ) from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync_directory(directory)


def _fsync_directory(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def keep_copy(src, dst):
    """Make `dst` an atomic copy of the finished checkpoint `src` (best-val and periodic checkpoints).

    A hard link costs no I/O and stays valid after `src` is replaced by the next save (the rename
    gives `src` a new inode); filesystems without hard links get a real copy.
    """
    tmp = f"{dst}.tmp.{os.getpid()}"
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {dst}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path):
    """The checkpoint dict at `path` (a file, or a directory holding ckpt.pt), loaded onto the CPU."""
    path = checkpoint_path(path)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"no checkpoint at {path}; train with --init_from=scratch first, or point out_dir at the run to resume"
        )
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
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
    extra = [key for key in state_dict if key not in expected]
    if extra:
        raise CheckpointError(
            f"{path}: the checkpoint has '{extra[0]}', which the model built from the "
            f"config lacks (a different number of layers?)"
        )
    model.load_state_dict(state_dict)


def load_model(path_or_out_dir, device="cpu"):
    """(GPT, checkpoint dict): the trained model in eval mode, for sample.py, hellaswag.py, export_hf.py."""
    from model import GPT, GPTConfig  # here, so checkpoint.py stays importable without model.py's cost

    path = checkpoint_path(path_or_out_dir)
    ckpt = load_checkpoint(path)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    load_model_state(model, ckpt["model"], path)
    model.to(device)
    model.eval()
    return model, ckpt


# ---------------------------------------------------------------------------------------------------
# Random number generator states, in forms weights_only loading accepts (numpy's array becomes a tensor).


def rng_state():
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
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
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
