"""OpenWebText -> train.bin / val.bin: headerless uint16 GPT-2 tokens, nanoGPT's layout and split.

    python -m data.openwebtext.prepare                               # Skylion007/openwebtext from the Hub
    python -m data.openwebtext.prepare --data_files owt/*.parquet    # local parquet/jsonl, no network

The split is nanoGPT's (train_test_split(test_size=0.0005, seed=2357), 'test' renamed 'val') and
<|endoftext|> follows every document, so the bins match nanoGPT's and the MARS reference code's
token for token, and either side reads the other's. Each bin appears under its final name only
when complete.
"""

import argparse
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm import tqdm

if not __package__:  # run by its path (python data/<name>/prepare.py, as nanoGPT's): import from the repository
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.prepare_common import (
    add_data_files,
    add_output_dir,
    check_data_files,
    is_arrow_data_error,
    make_output_dir,
    read_error,
    run_prepare,
)
from marsgpt.files import atomic_writer
from marsgpt.runtime import network_reachable
from marsgpt.tokens import EOT_TOKEN, DataError, get_gpt2_encoding, write_manifest

HUB_DATASET = "Skylion007/openwebtext"
WRITE_BATCH = 1 << 16  # documents per write
VAL_FRACTION = 0.0005  # nanoGPT's test_size: ceil(0.0005 * documents) go to val.bin


def load_local_documents(data_files):
    """The documents of local parquet or JSON-lines files, as one datasets.Dataset."""
    data_files = check_data_files(data_files)  # checks each file's head; damage further in surfaces below
    if not data_files:
        raise DataError("the --data_files hold no documents")
    parquet = [p for p in data_files if p.endswith(".parquet")]
    if parquet and len(parquet) < len(data_files):
        other = next(p for p in data_files if not p.endswith(".parquet"))
        raise DataError(f"--data_files: pass only .parquet or only .jsonl files, got {parquet[0]} and {other}")
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    kind = "parquet" if parquet else "JSON lines"
    try:
        return load_dataset("parquet" if parquet else "json", data_files=data_files, split="train")
    except DatasetGenerationError as e:
        # The loader wraps what reading a file raised: pyarrow's ArrowInvalid for bad JSON or parquet,
        # an errno-less OSError for a corrupt parquet page; anything else (a full cache disk) propagates.
        if not is_arrow_data_error(e.__cause__):
            raise
        which = data_files[0] if len(data_files) == 1 else f"one of the {len(data_files)} --data_files (logged above)"
        raise read_error(which, kind, e.__cause__) from None


def load_documents(data_files, num_proc):
    from datasets import load_dataset

    if data_files:
        return load_local_documents(data_files)
    if not network_reachable("huggingface.co"):
        raise DataError(
            f"cannot reach huggingface.co to download {HUB_DATASET}; on a machine without "
            f"internet pass --data_files with local parquet or jsonl files of it"
        )
    return load_dataset(HUB_DATASET, split="train", num_proc=num_proc)


def tokenize(example):
    ids = get_gpt2_encoding().encode_ordinary(example["text"])
    ids.append(EOT_TOKEN)  # nanoGPT appends the delimiter after each document
    return {"ids": ids, "len": len(ids)}


def write_split(dataset, path):
    total = int(np.sum(dataset["len"], dtype=np.int64))
    with atomic_writer(path) as f, tqdm(total=total, unit="tok", unit_scale=True, desc=os.path.basename(path)) as bar:
        for batch in dataset.with_format("arrow").iter(batch_size=WRITE_BATCH):
            ids = batch["ids"].combine_chunks().flatten().to_numpy().astype(np.uint16)
            f.write(memoryview(ids))
            bar.update(len(ids))
    return total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_files(parser, f"download {HUB_DATASET} from the Hugging Face hub, ~54 GB of cache")
    add_output_dir(parser, __file__, "train.bin and val.bin")
    parser.add_argument(
        "--num_proc",
        type=int,
        default=max(1, (os.cpu_count() or 1) // 2),
        help="download and tokenizer processes (default: half the cores)",
    )
    args = parser.parse_args(argv)
    if args.num_proc < 1:
        raise DataError(f"--num_proc must be positive, got {args.num_proc}")
    make_output_dir(args.output_dir)  # before hours of work, not after
    get_gpt2_encoding()  # fail early (and seed the offline cache once, before the workers fork)
    dataset = load_documents(args.data_files, args.num_proc)
    if "text" not in dataset.column_names:
        raise DataError(f"the dataset has no 'text' column (columns: {', '.join(dataset.column_names)})")
    text = dataset.data.column("text")  # a JSON line without 'text' gives a null, mixed types a JSON column
    if not (pa.types.is_string(text.type) or pa.types.is_large_string(text.type)):
        raise DataError(f"the dataset's 'text' column holds {dataset.features['text']}, not only strings")
    if text.null_count:
        first = pc.index(text.is_null(), True).as_py()
        where = args.data_files[0] if args.data_files and len(args.data_files) == 1 else "the dataset"
        raise DataError(
            f"{where}: {text.null_count:,} document(s) have no 'text' (a null, or a JSON line without it), "
            f"the first at row {first} (from 0, files in order)"
        )
    if len(dataset) < 2:  # train_test_split would raise (one document) or write two empty bins (none)
        raise DataError(
            f"the corpus has {len(dataset)} document(s); nanoGPT's split needs at least 2, one for val.bin "
            f"and one for train.bin: pass more --data_files"
        )
    split = dataset.train_test_split(test_size=VAL_FRACTION, seed=2357, shuffle=True)
    split["val"] = split.pop("test")
    tokenized = split.map(tokenize, remove_columns=dataset.column_names, desc="tokenizing", num_proc=args.num_proc)
    for name, dset in tokenized.items():
        count = write_split(dset, os.path.join(args.output_dir, f"{name}.bin"))
        print(f"{name}.bin: {len(dset):,} documents, {count:,} tokens")
    write_manifest(args.output_dir)


if __name__ == "__main__":
    run_prepare(main)
