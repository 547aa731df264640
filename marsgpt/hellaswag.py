"""HellaSwag, completion style: which of four endings does the model find most likely after the context?

The numbers are lm-evaluation-harness's (0.4.x, task `hellaswag`, zero-shot), so they compare with published
lm-eval results. Each example is rendered as lm-eval renders it ("<activity_label>: <ctx_a> <Ctx_b>", the
WikiHow [tags] cleaned away; see `render_lm_eval`), each ending is scored by its summed log-likelihood after
the context, over GPT-2's 50,257 tokens only (the model's head is padded to 50,304; the padding is not part
of the distribution), and

    acc              picks the ending with the highest log-likelihood,
    acc_norm         the highest log-likelihood per character of the ending (lm-eval's acc_norm),
    acc_norm_tokens  the highest per token (what llm.c and build-nanogpt call acc_norm).

`--prompt llm.c` scores the raw `ctx` and endings instead, as llm.c does: its acc_norm_tokens is the figure
the GPT-2 / llm.c logs report (GPT-2 124M: 0.2955 on the 10,042 validation examples, llm.c's published
number). `--scores FILE` writes every example's log-likelihoods, lengths and predictions as JSON lines.
Used standalone on a checkpoint and by train.py every `hellaswag_interval` steps (lm-eval's rendering).

    python -m marsgpt.hellaswag --ckpt out [--data hellaswag_val.jsonl] [--prompt llm.c] [--scores s.jsonl]
"""

import argparse
import contextlib
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request

import torch
import torch.distributed as dist
import torch.nn.functional as F

from marsgpt.checkpoint import CheckpointError
from marsgpt.files import JSONLineError, atomic_writer, json_lines
from marsgpt.runtime import add_device_arguments, autocast, resolve_device, resolve_dtype
from marsgpt.tokens import DataError, get_gpt2_encoding
from marsgpt.trained_model import load_model, load_pretrained

VAL_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
CACHE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "hellaswag")
NUM_ENDINGS = 4
PROMPTS = ("lm-eval", "llm.c")
METRICS = ("acc", "acc_norm", "acc_norm_tokens")
OFFICIAL_FIELDS = ("activity_label", "ctx_a", "ctx_b")
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


def load_examples(path, prompt="lm-eval"):
    """The examples of a HellaSwag jsonl file, rendered for `prompt` (see render_lm_eval, render_llmc):
    dicts with 'context', 'endings' (4 strings), 'label', and 'from_ctx' (True where the line had no
    activity_label/ctx_a/ctx_b, so its 'ctx' was rendered instead)."""
    if prompt not in PROMPTS:
        raise ValueError(f"unknown HellaSwag prompt {prompt!r}; choose one of {', '.join(PROMPTS)}")
    examples = []
    try:
        with open(path, "rb") as f:
            for lineno, item in json_lines(f):
                examples.append(_example(f"{path}, line {lineno}", item, prompt))
    except JSONLineError as e:
        what = "not UTF-8 text" if e.reason is None else f"not valid JSON ({e.reason})"
        raise DataError(f"{path}, line {e.number}: {what}") from None
    except OSError as e:
        raise DataError(str(e)) from None
    if not examples:
        raise DataError(f"{path}: no HellaSwag examples in the file")
    return examples


def _example(where, item, prompt):
    """A line's example, checked and rendered: 'endings' 4 non-empty strings, 'label' 0..3, and the
    context's fields (activity_label, ctx_a and ctx_b as in the official files, or at least 'ctx')."""
    if not isinstance(item, dict):
        raise DataError(f"{where}: expected a JSON object")
    endings, label = item.get("endings"), item.get("label")
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
    official = has_official_fields(item)
    if not isinstance(item.get("ctx"), str):
        if prompt == "llm.c":
            raise DataError(f"{where}: 'ctx' must be a string (the llm.c prompt scores it)")
        if not official:
            raise DataError(f"{where}: no context: give 'activity_label', 'ctx_a' and 'ctx_b', or 'ctx' (strings)")
    context, endings = (render_lm_eval if prompt == "lm-eval" else render_llmc)(item)
    return dict(context=context, endings=endings, label=label, from_ctx=not official)


def has_official_fields(item):
    return all(isinstance(item.get(k), str) for k in OFFICIAL_FIELDS)


def lm_eval_clean(text):
    """lm-eval's cleaning of HellaSwag text: stripped, WikiHow's " [title]" made a sentence break, every other
    [tag] removed, then each pair of spaces made one (a single pass: three spaces become two, as there)."""
    text = re.sub(r"\[.*?\]", "", text.strip().replace(" [title]", ". "))
    return text.replace("  ", " ")


def render_lm_eval(item):
    """(context, endings) as lm-eval 0.4's hellaswag task renders an official line: "<activity_label>: <ctx_a>
    <ctx_b with its first letter capitalised and the rest lower-cased (str.capitalize)>", endings cleaned alike.
    A line without those fields (a hand-made file) has its 'ctx' cleaned instead."""
    if has_official_fields(item):
        context = f"{item['activity_label']}: {item['ctx_a']} {item['ctx_b'].capitalize()}"
    else:
        context = item["ctx"]
    return lm_eval_clean(context), [lm_eval_clean(e) for e in item["endings"]]


def render_llmc(item):
    """(context, endings) as llm.c's HellaSwag evaluation reads a line: 'ctx' and the endings as they are."""
    return item["ctx"], list(item["endings"])


def render_example(example, enc, block_size):
    """Token rows for the 4 (context + " " + ending) sequences, each cut to at most block_size + 1 tokens.

    Returns (rows, ending_lengths): the last ending_lengths[i] tokens of rows[i] are the ending. Tokenized as
    lm-eval does: trailing spaces of the context join the ending, the whole text is encoded and the ending is
    what follows the context's tokens; an empty context is GPT-2's end-of-text token. A context too long for
    the model is left-truncated (the ending is what is scored, so it is kept); an ending longer than
    block_size keeps its last block_size tokens.
    """
    context = example["context"]
    stripped = context.rstrip()
    ctx_tokens = enc.encode_ordinary(stripped) if context else [enc.eot_token]
    rows, ending_lengths = [], []
    for ending in example["endings"]:
        continuation = context[len(stripped) :] + " " + ending
        if context:
            end_tokens = enc.encode_ordinary(stripped + continuation)[len(ctx_tokens) :]
        else:
            end_tokens = enc.encode_ordinary(continuation)
        row = (ctx_tokens + end_tokens)[-(block_size + 1) :]
        rows.append(row)
        ending_lengths.append(min(len(end_tokens), len(row) - 1))
    return rows, ending_lengths


@torch.no_grad()
def ending_logliks(model, rendered, device, vocab_size, ctx=None):
    """Summed log-likelihood of each ending and its token count, each (len(rendered), 4), in one forward pass.

    The log-softmax runs over the first vocab_size logits only: the rows the model's head is padded with
    (50,304 for 50,257 tokens) are no token, and taking them into the normalisation would lower every
    log-likelihood by log(1 + their share of the probability mass).
    """
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
    token_loglik = -F.cross_entropy(logits[scored][:, :vocab_size].float(), targets[scored], reduction="none")
    summed = torch.zeros(len(rows), device=device).index_add_(0, scored.nonzero()[:, 0], token_loglik)
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


def score(model, examples, device, ctx=None, batch_examples=4):
    """dict(loglik, tokens, chars), each (len(examples), 4) on the CPU: every ending's summed log-likelihood
    (float32), the number of its tokens scored, and its length in characters (what acc_norm divides by).

    Pass the bare model (not DDP-wrapped); it is put in eval mode for the duration and restored.
    """
    enc = check_vocab(model)
    loglik, tokens = [torch.zeros(0, NUM_ENDINGS)], [torch.zeros(0, NUM_ENDINGS, dtype=torch.long)]
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(examples), batch_examples):
            rendered = [
                render_example(e, enc, model.config.block_size) for e in examples[start : start + batch_examples]
            ]
            summed, lengths = ending_logliks(model, rendered, device, enc.n_vocab, ctx)
            loglik.append(summed.cpu())
            tokens.append(lengths.cpu())
    finally:
        model.train(was_training)
    chars = torch.tensor([[len(e) for e in example["endings"]] for example in examples], dtype=torch.long)
    return dict(loglik=torch.cat(loglik), tokens=torch.cat(tokens), chars=chars.view(-1, NUM_ENDINGS))


def predictions(scores):
    """The ending each metric picks, (n,) per name in METRICS; ties go to the first ending, as with lm-eval's
    numpy argmax. An ending that cleaning left empty scores -inf per character (lm-eval divides by 0 too)."""
    loglik = scores["loglik"].double()
    return dict(
        acc=loglik.argmax(dim=1),
        acc_norm=(loglik / scores["chars"]).argmax(dim=1),
        acc_norm_tokens=(loglik / scores["tokens"]).argmax(dim=1),
    )


def labels_of(examples):
    return torch.tensor([e["label"] for e in examples], dtype=torch.long)


def correct_counts(scores, labels):
    """How many of the examples each metric in METRICS gets right, given their labels (n,)."""
    picked = predictions(scores)
    return [int((picked[name] == labels).sum()) for name in METRICS]


def evaluate(model, examples, device, rank=0, world_size=1, ctx=None, batch_examples=4, lockstep=False):
    """acc, acc_norm, acc_norm_tokens and n over `examples`, rank r scoring examples i with i % world_size == r.

    With torch.distributed initialised the counts are all-reduced, so every rank returns the totals;
    every rank must call this with the same examples. Pass the bare model (not DDP-wrapped). lockstep: every
    rank runs as many forward passes (an FSDP2 model's are collectives): a rank with one example fewer scores
    the first example once more, uncounted.
    """
    if not examples:
        raise ValueError("no HellaSwag examples to evaluate")
    mine = examples[rank::world_size]
    repeats = examples[:1] * (-(-len(examples) // world_size) - len(mine)) if lockstep else []
    scores = score(model, mine + repeats, device, ctx, batch_examples)
    scores = {name: values[: len(mine)] for name, values in scores.items()}
    correct = correct_counts(scores, labels_of(mine))
    counts = torch.tensor(correct + [len(mine)], dtype=torch.long, device=device)
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    *correct, n = counts.tolist()
    return dict({name: c / n for name, c in zip(METRICS, correct)}, n=n)


def score_records(examples, scores):
    """One JSON-ready dict per example: its index in the file (lm-eval's doc_id), label, each ending's summed
    log-likelihood, token and character counts, and each metric's predicted ending."""
    picked = predictions(scores)
    for i, example in enumerate(examples):
        yield dict(
            index=i,
            label=example["label"],
            loglik=scores["loglik"][i].tolist(),
            tokens=scores["tokens"][i].tolist(),
            chars=scores["chars"][i].tolist(),
            pred={name: int(picked[name][i]) for name in METRICS},
        )


def check_scores_path(path, overwrite):
    """Refuse a --scores file that exists (unless overwrite) or whose folder does not, before any scoring."""
    if os.path.lexists(path) and not overwrite:
        raise ValueError(f"--scores {path} exists; give a new file, or add --overwrite to replace it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--scores {path}: the folder {folder} does not exist")


def write_scores(path, examples, scores):
    try:
        with atomic_writer(path, "w") as f:
            for record in score_records(examples, scores):
                f.write(json.dumps(record) + "\n")
    except OSError as e:
        raise OSError(f"cannot write {path}: {e.strerror or e}") from None


def main(argv=None):
    p = argparse.ArgumentParser(description="HellaSwag accuracy of a checkpoint (or of GPT-2 weights).")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="a checkpoint file or the out_dir holding ckpt.pt")
    source.add_argument(
        "--init_from",
        help="GPT-2 weights instead: gpt2, gpt2-medium, gpt2-large, gpt2-xl or a Hugging Face GPT-2 folder",
    )
    p.add_argument("--data", default="", help="hellaswag_val.jsonl (default: download into data/hellaswag/)")
    p.add_argument(
        "--prompt",
        default="lm-eval",
        choices=PROMPTS,
        help="lm-eval: the text lm-evaluation-harness's hellaswag task scores (default); llm.c: raw ctx and endings",
    )
    add_device_arguments(p)
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N examples (0 = all)")
    p.add_argument("--batch_examples", type=int, default=4, help="examples per forward pass")
    p.add_argument("--scores", default="", help="write per-example log-likelihoods and predictions here (JSON lines)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --scores file")
    args = p.parse_args(argv)
    if args.batch_examples < 1:
        p.error(f"--batch_examples must be at least 1, got {args.batch_examples}")
    try:
        if args.scores:
            check_scores_path(args.scores, args.overwrite)
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
        examples = load_examples(path, args.prompt)
        if args.limit > 0:
            examples = examples[: args.limit]
        from_ctx = sum(e["from_ctx"] for e in examples)
        if args.prompt == "lm-eval" and from_ctx:
            print(
                f"warning: {from_ctx} of {len(examples)} examples have no {'/'.join(OFFICIAL_FIELDS)} (the official "
                "file's fields): their 'ctx' is scored, cleaned as lm-eval cleans text",
                file=sys.stderr,
            )
        t0 = time.time()
        ctx = autocast(device_type, resolve_dtype(args.dtype, device_type))
        scores = score(model, examples, args.device, ctx, args.batch_examples)
        result = {name: c / len(examples) for name, c in zip(METRICS, correct_counts(scores, labels_of(examples)))}
        if args.scores:
            write_scores(args.scores, examples, scores)
    except (ValueError, OSError, ImportError, CheckpointError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"hellaswag: n={len(examples)} acc={result['acc']:.4f} acc_norm={result['acc_norm']:.4f} "
        f"acc_norm_tokens={result['acc_norm_tokens']:.4f} (prompt {args.prompt}, {time.time() - t0:.1f}s, {path})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
