"""The parts of a run that are not stateful objects of their own, as a checkpoint holds them: the model (its weights
checked against the model and placed as the parallelism keeps them), the GradScaler, the random number generators,
and a dataclass of counters. Each has state_dict() and load_state_dict(state); load_state_dict(None) -- a checkpoint
without the part -- starts it afresh or raises MissingPart (marsgpt/checkpointer.py names every part missing).
vision/train_cifar.py uses them too.
"""

import dataclasses
import random

import numpy as np
import torch

from marsgpt.checkpoint import CheckpointError

COMPILE_PREFIX = "_orig_mod."  # torch.compile's wrapper names every parameter with this prefix


class MissingPart(CheckpointError):
    """A checkpoint lacks a part the run cannot start without: a part's load_state_dict(None) raises it
    (run_dir.RunDir.restore offers None for a part the checkpoint does not hold, and names every such part)."""


class DataclassState:
    """state_dict()/load_state_dict() for a dataclass of plain values (a run's progress counters), so it is
    a checkpoint part like the model and the optimizer."""

    def state_dict(self):
        return dataclasses.asdict(self)

    def load_state_dict(self, state):
        """Every field the state holds; a field added since the checkpoint was written keeps its value."""
        if state is None:
            raise MissingPart(type(self).__name__)
        for f in dataclasses.fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])


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


class ModelState:
    """A model as a checkpoint part: its state_dict, and a load_state_dict that places the checkpoint's tensors
    where the model keeps them (`place`: parallel.Parallelism.place_state, FSDP2's rows of a one-file checkpoint's
    whole tensors) and names the first key whose presence or shape does not match (load_model_state; `path` is
    the checkpoint the message names)."""

    def __init__(self, model, place, path):
        self.model, self.place, self.path = model, place, path

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, state):
        if state is None:
            raise MissingPart("model")
        load_model_state(self.model, self.place(state), self.path)


class ScalerState:
    """A torch.amp.GradScaler as a checkpoint part, restored where float16 enables it: a run resumed in bfloat16 or
    float32 drops a float16 run's scale, and one resumed in float16 from a run without a scaler starts afresh."""

    def __init__(self, scaler):
        self.scaler = scaler

    def state_dict(self):
        return self.scaler.state_dict()

    def load_state_dict(self, state):
        if state is None:
            raise MissingPart("scaler")
        if self.scaler.is_enabled() and state:
            self.scaler.load_state_dict(state)


# Random number generator states, in forms weights_only loading accepts (numpy's array becomes a tensor).


class RNGState:
    """The Python, numpy and torch generators of this process, and the CUDA generators of every rank.

    Each rank's CUDA generators differ (they are seeded per device), so state_dict() takes every rank's
    (gathered by the caller: `cuda_by_rank`) and load_state_dict() gives each rank its own when the world
    size (this run's `world_size` ranks) is the same; on a different world size the CUDA generators keep their
    fresh seeds. Nothing in training draws from them between checkpoints except dropout, which is reseeded every
    micro-batch.
    """

    def __init__(self, rank=0, world_size=1, gather=None):
        self.rank, self.world_size = rank, world_size
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

    def load_state_dict(self, state):
        if state is None:
            raise MissingPart("rng")
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
        if len(cuda_by_rank) == self.world_size and torch.cuda.is_available():
            mine = cuda_by_rank[self.rank]
            if len(mine) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(mine)
