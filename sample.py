"""Sample text from a trained checkpoint, or from OpenAI's GPT-2 weights where they can be downloaded.

    python sample.py --out_dir=out --start="def main(" --num_samples=3 --max_new_tokens=200
    python sample.py --init_from=gpt2 --start=FILE:prompt.txt

Text is encoded with the character vocabulary of the checkpoint's dataset (its meta.pkl) when the
dataset has one, else with GPT-2's BPE.
"""

import argparse
import os
import sys

import torch

from marsgpt.checkpoint import CheckpointError
from marsgpt.runtime import add_device_arguments, autocast, resolve_device, resolve_dtype
from marsgpt.tokens import DataError, get_gpt2_encoding, read_meta
from marsgpt.trained_model import load_model, load_pretrained

MISSING_ADVICE = "train a model first (python train.py ...), or pass --out_dir of a trained run"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", default="out", help="the training run's out_dir (or a checkpoint file)")
    p.add_argument(
        "--init_from",
        default="resume",
        help="'resume' samples from --out_dir's checkpoint; gpt2, gpt2-medium, gpt2-large, "
        "gpt2-xl or a Hugging Face GPT-2 folder (marsgpt/export_hf.py's) from those weights",
    )
    p.add_argument("--start", default="\n", help="prompt text, or FILE:path to read it from a file")
    p.add_argument("--num_samples", type=int, default=3)
    p.add_argument("--max_new_tokens", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.8, help="< 1 sharper, > 1 more random")
    p.add_argument("--top_k", type=int, default=200, help="keep only the k likeliest tokens (0 = all)")
    p.add_argument("--seed", type=int, default=1337)
    add_device_arguments(p)
    args = p.parse_args(argv)
    for name in ("num_samples", "max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.temperature <= 0:
        p.error(f"--temperature must be positive, got {args.temperature}")
    if args.top_k < 0:
        p.error(f"--top_k must be 0 (off) or positive, got {args.top_k}")
    return args


def char_codec(meta):
    """encode/decode for a character vocabulary (meta.pkl with 'stoi' and 'itos', as nanoGPT writes)."""
    stoi, itos = meta["stoi"], meta["itos"]

    def encode(text):
        unknown = sorted({c for c in text if c not in stoi})
        if unknown:
            raise ValueError(f"the prompt has characters outside the dataset's vocabulary: {unknown!r}")
        return [stoi[c] for c in text]

    # A model's vocabulary may be padded past the dataset's; those ids never occur in training data.
    return encode, lambda ids: "".join(itos[i] for i in ids if i < len(itos))


def bpe_codec():
    enc = get_gpt2_encoding()
    # ids in a padded vocabulary (50257..50303) have no text; an undertrained model may still pick one
    return enc.encode_ordinary, lambda ids: enc.decode([i for i in ids if i < enc.n_vocab])


def checkpoint_codec(ckpt, vocab_size):
    """The codec of the dataset a checkpoint was trained on: its meta.pkl, else GPT-2 BPE."""
    config = ckpt.get("config")
    config = config if isinstance(config, dict) else {}
    data_dir = os.path.join(str(config.get("data_path", "")), str(config.get("dataset", "")))
    meta_path = os.path.join(data_dir, "meta.pkl")
    if config.get("dataset") and os.path.isfile(meta_path):
        meta = read_meta(meta_path)
        if not (isinstance(meta.get("stoi"), dict) and isinstance(meta.get("itos"), (dict, list))):
            raise ValueError(
                f"{meta_path} has no character vocabulary ('stoi' and 'itos'); rerun the dataset's prepare.py"
            )
        return char_codec(meta)
    enc = get_gpt2_encoding()
    if vocab_size < enc.n_vocab:
        raise ValueError(
            f"the model's vocabulary has {vocab_size} tokens, so it was trained on a "
            f"character dataset, but its meta.pkl was not found at {meta_path!r}; run "
            "from the directory you trained in (the checkpoint's data_path is relative)"
        )
    return bpe_codec()


def read_prompt(start):
    if start.startswith("FILE:"):
        path = start[len("FILE:") :]
        if not os.path.isfile(path):
            raise ValueError(f"prompt file {path!r} does not exist")
        with open(path, encoding="utf-8") as f:
            return f.read()
    return start


def generate(args):
    """The samples as a list of strings."""
    torch.manual_seed(args.seed)
    args.device = resolve_device(args.device)
    prompt = read_prompt(args.start)
    if args.init_from == "resume":
        model, ckpt = load_model(args.out_dir, device=args.device, missing_advice=MISSING_ADVICE)
        encode, decode = checkpoint_codec(ckpt, model.config.vocab_size)
    else:
        model = load_pretrained(args.init_from).to(args.device)
        encode, decode = bpe_codec()
    model.eval()
    start_ids = encode(prompt)
    if not start_ids:
        raise ValueError("the prompt encodes to no tokens; give some text with --start")
    x = torch.tensor(start_ids, dtype=torch.long, device=args.device)[None, ...]
    samples = []
    device_type = torch.device(args.device).type
    with torch.no_grad(), autocast(device_type, resolve_dtype(args.dtype, device_type)):
        for _ in range(args.num_samples):
            y = model.generate(x, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None)
            samples.append(decode(y[0].tolist()))
    return samples


def main(argv=None):
    args = parse_args(argv)
    try:
        samples = generate(args)
    except (ValueError, OSError, ImportError, CheckpointError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for text in samples:
        print(text)
        print("---------------")
    return 0


if __name__ == "__main__":
    sys.exit(main())
