"""HellaSwag, completion style: which of four endings does the model find most likely after the context?

For each example the context and each ending (tokenized with a leading space, as the official format
joins them) are scored by the cross-entropy of the ending's tokens given everything before them.
acc_norm picks the ending with the lowest MEAN loss per token, acc the lowest SUMMED loss -- the two
numbers the GPT-2 / llm.c evaluations report (GPT-2 124M: acc_norm 0.2955 on the 10,042 validation
examples). Used standalone on a checkpoint and by train.py every `hellaswag_interval` steps.

    python -m marsgpt.hellaswag --ckpt out [--data hellaswag_val.jsonl] [--device cpu] [--limit 500]
"""

import argparse
import contextlib
import os
import sys
import time
import urllib.error
import urllib.request

import torch
import torch.distributed as dist
import torch.nn.functional as F

from marsgpt.checkpoint import CheckpointError, load_model, load_pretrained
from marsgpt.files import JSONLineError, atomic_writer, json_lines
from marsgpt.runtime import add_device_arguments, autocast, resolve_device, resolve_dtype
from marsgpt.tokens import DataError, get_gpt2_encoding

VAL_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
CACHE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "hellaswag")
NUM_ENDINGS = 4
MISSING_ADVICE = (
    "train a model first (python train.py ...), or pass --ckpt the out_dir or checkpoint file of a trained run"
)


def ensure_data(path="", cache_dir=CACHE_DIR, url=VAL_URL, timeout_s=15):
    """The validation file to evaluate on, or None when there is none and it cannot be downloaded.

    A given path is used as is (a missing file is an error: the user asked for it). Otherwise the
    cached copy under cache_dir, else a download of the official file; offline that fails fast and
    returns None, so the caller can disable the evaluation with one warning.
    """
    if path:
        if not os.path.isfile(path):
            raise ValueError(
                f"HellaSwag file {path!r} does not exist; give the path of the official hellaswag_val.jsonl ({url})"
            )
        return path
    cached = os.path.join(cache_dir, os.path.basename(url))
    if os.path.isfile(cached):
        return cached
    os.makedirs(cache_dir, exist_ok=True)
    try:
        # never a half-downloaded file under the final name
        with urllib.request.urlopen(url, timeout=timeout_s) as response, atomic_writer(cached) as f:
            while chunk := response.read(1 << 20):
                f.write(chunk)
    except (urllib.error.URLError, OSError):
        return None
    return cached


def load_examples(path):
    """The examples of an official HellaSwag jsonl file: dicts with 'ctx', 'endings' (4 strings), 'label'."""
    examples = []
    try:
        with open(path, "rb") as f:
            for lineno, item in json_lines(f):
                examples.append(_example(f"{path}, line {lineno}", item))
    except JSONLineError as e:
        what = "not UTF-8 text" if e.reason is None else f"not valid JSON ({e.reason})"
        raise DataError(f"{path}, line {e.number}: {what}") from None
    except OSError as e:
        raise DataError(str(e)) from None
    if not examples:
        raise DataError(f"{path}: no HellaSwag examples in the file")
    return examples


def _example(where, item):
    """An official line's example, checked: 'ctx' a string, 'endings' 4 non-empty strings, 'label' 0..3."""
    if not isinstance(item, dict):
        raise DataError(f"{where}: expected a JSON object")
    ctx, endings, label = item.get("ctx"), item.get("endings"), item.get("label")
    if not isinstance(ctx, str):
        raise DataError(f"{where}: 'ctx' must be a string")
    if (
        not isinstance(endings, list)
        or len(endings) != NUM_ENDINGS
        or not all(isinstance(e, str) and e for e in endings)
    ):
        raise DataError(f"{where}: 'endings' must be a list of {NUM_ENDINGS} non-empty strings")
    # bool is an int subclass; the official files store the label as an int (older dumps: "2")
    if isinstance(label, str) and label.isdigit():
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < NUM_ENDINGS:
        raise DataError(f"{where}: 'label' must be an integer 0..{NUM_ENDINGS - 1}, got {label!r}")
    return dict(ctx=ctx, endings=endings, label=label)


def render_example(example, enc, block_size):
    """Token rows for the 4 (context + ending) sequences, each cut to at most block_size + 1 tokens.

    Returns (rows, ending_lengths): the last ending_lengths[i] tokens of rows[i] are the ending. A
    context too long for the model is left-truncated (the ending is what is scored, so it is kept);
    an ending longer than block_size keeps its last block_size tokens.
    """
    ctx_tokens = enc.encode_ordinary(example["ctx"])
    rows, ending_lengths = [], []
    for ending in example["endings"]:
        end_tokens = enc.encode_ordinary(" " + ending)
        row = (ctx_tokens + end_tokens)[-(block_size + 1) :]
        rows.append(row)
        ending_lengths.append(min(len(end_tokens), len(row) - 1))
    return rows, ending_lengths


@torch.no_grad()
def ending_losses(model, rendered, device, ctx=None):
    """Summed ending loss and ending length, each (len(rendered), 4), for rendered examples in one batch."""
    rows = [row for rows, _ in rendered for row in rows]
    lengths = [n for _, lens in rendered for n in lens]
    width = max(len(r) for r in rows) - 1
    # Right padding: with causal attention a position never sees the padding after it.
    idx = torch.zeros(len(rows), width, dtype=torch.long)
    targets = torch.zeros(len(rows), width, dtype=torch.long)
    scored = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        t = torch.tensor(row)
        idx[i, : len(row) - 1] = t[:-1]
        targets[i, : len(row) - 1] = t[1:]
        scored[i, len(row) - 1 - lengths[i] : len(row) - 1] = True
    idx, targets, scored = idx.to(device), targets.to(device), scored.to(device)
    with ctx or contextlib.nullcontext():
        # Passing targets makes the model return logits at every position (not only the last).
        logits, _ = model(idx, targets)
    # Only the ending positions: the (rows, width, vocab) logits are never copied whole.
    token_loss = F.cross_entropy(logits[scored].float(), targets[scored], reduction="none")
    summed = torch.zeros(len(rows), device=device).index_add_(0, scored.nonzero()[:, 0], token_loss)
    return summed.view(-1, NUM_ENDINGS), torch.tensor(lengths, device=device).view(-1, NUM_ENDINGS)


def check_vocab(model):
    """GPT-2's encoding, after checking that `model` reads its tokens (ValueError for a character model)."""
    enc = get_gpt2_encoding()
    if model.config.vocab_size < enc.n_vocab:
        raise ValueError(
            f"HellaSwag needs a model with GPT-2's vocabulary (vocab_size >= {enc.n_vocab}); "
            f"this one has vocab_size {model.config.vocab_size}"
        )
    return enc


def evaluate(model, examples, device, rank=0, world_size=1, ctx=None, batch_examples=4):
    """acc_norm, acc and n over `examples`, rank r scoring examples i with i % world_size == r.

    With torch.distributed initialised the counts are all-reduced, so every rank returns the totals;
    every rank must call this with the same examples. Pass the bare model (not DDP-wrapped); it is put
    in eval mode for the duration and restored.
    """
    if not examples:
        raise ValueError("no HellaSwag examples to evaluate")
    enc = check_vocab(model)
    mine = examples[rank::world_size]
    counts = torch.zeros(3, dtype=torch.long, device=device)  # correct_norm, correct, n
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(mine), batch_examples):
            batch = mine[start : start + batch_examples]
            rendered = [render_example(e, enc, model.config.block_size) for e in batch]
            summed, lengths = ending_losses(model, rendered, device, ctx)
            labels = torch.tensor([e["label"] for e in batch], device=device)
            counts[0] += ((summed / lengths).argmin(dim=1) == labels).sum()
            counts[1] += (summed.argmin(dim=1) == labels).sum()
            counts[2] += len(batch)
    finally:
        model.train(was_training)
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    correct_norm, correct, n = counts.tolist()
    return dict(acc_norm=correct_norm / n, acc=correct / n, n=n)


def main(argv=None):
    p = argparse.ArgumentParser(description="HellaSwag accuracy of a checkpoint (or of GPT-2 weights).")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="a checkpoint file or the out_dir holding ckpt.pt")
    source.add_argument(
        "--init_from",
        help="GPT-2 weights instead: gpt2, gpt2-medium, gpt2-large, gpt2-xl or a Hugging Face GPT-2 folder",
    )
    p.add_argument("--data", default="", help="hellaswag_val.jsonl (default: download into data/hellaswag/)")
    add_device_arguments(p)
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N examples (0 = all)")
    p.add_argument("--batch_examples", type=int, default=4, help="examples per forward pass")
    args = p.parse_args(argv)
    if args.batch_examples < 1:
        p.error(f"--batch_examples must be at least 1, got {args.batch_examples}")
    try:
        args.device = resolve_device(args.device)
        device_type = torch.device(args.device).type
        if args.ckpt:
            model, _ = load_model(args.ckpt, device=args.device, missing_advice=MISSING_ADVICE)
        else:
            model = load_pretrained(args.init_from).to(args.device)
        check_vocab(model)  # before any download: a character model cannot be scored
        path = ensure_data(args.data)
        if path is None:
            raise ValueError(
                f"no HellaSwag data: could not download {VAL_URL} (offline?); "
                "download it elsewhere and pass --data PATH"
            )
        examples = load_examples(path)
        if args.limit > 0:
            examples = examples[: args.limit]
        t0 = time.time()
        result = evaluate(
            model,
            examples,
            args.device,
            ctx=autocast(device_type, resolve_dtype(args.dtype, device_type)),
            batch_examples=args.batch_examples,
        )
    except (ValueError, OSError, ImportError, CheckpointError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"hellaswag: n={result['n']} acc={result['acc']:.4f} acc_norm={result['acc_norm']:.4f} "
        f"({time.time() - t0:.1f}s, {path})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
