"""A trained model for the tools after training (sample.py, marsgpt/hellaswag.py, marsgpt/export_hf.py) and for a
run that starts from GPT-2's weights: a checkpoint of either format (shards.read_checkpoint), or GPT-2 from the
Hugging Face hub or its local cache. Whatever cannot be loaded is a CheckpointError: one line in every tool.
"""

import os
import sys

from marsgpt.checkpoint import CheckpointError, checkpoint_path
from marsgpt.checkpoint_parts import load_model_state
from marsgpt.shards import read_checkpoint

TOOL_ADVICE = "train a model first (python train.py ...), or give the out_dir of a trained run"


def load_pretrained(name, override_args=None):
    """GPT.from_pretrained(name) for train.py, sample.py and marsgpt/hellaswag.py: where the Hugging Face hub cannot
    be reached (a compute node without internet) or is not to be (HF_HUB_OFFLINE=1, Hugging Face's own switch),
    the local cache at once instead of retries. Weights that cannot be loaded (not cached offline, a failed
    download, an unknown name, no transformers) are a CheckpointError: one line in every tool."""
    from marsgpt.runtime import network_reachable
    from model import GPT, HF_CHECKPOINTS, HF_HUB_HOST  # here, as in load_model

    hub_off = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")  # huggingface_hub's values
    offline = name in HF_CHECKPOINTS and (hub_off or not network_reachable(HF_HUB_HOST))
    try:
        return GPT.from_pretrained(name, override_args, offline=offline)
    except (ValueError, ImportError) as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:  # online: the hub's or the file system's own error, on one line
        raise CheckpointError(f"cannot load {name}: {' '.join(str(e).split())}") from None


def load_model(path_or_out_dir, device="cpu", missing_advice=TOOL_ADVICE):
    """(GPT, checkpoint dict): the trained model in eval mode, for sample.py and the hellaswag and export_hf tools."""
    from model import GPT, GPTConfig  # here, so this module stays importable without model.py's cost

    path = checkpoint_path(path_or_out_dir)
    ckpt, trailer = read_checkpoint(path, missing_advice=missing_advice)
    if trailer is None:
        print(
            f"note: {path} has no checksum (written before checksums, or by another program): not verified",
            file=sys.stderr,
        )
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
