"""FineWeb-Edu -> GPT-2 token shards in llm.c's format, streamed, parallel and resumable.

    python data/fineweb_edu/prepare.py                          # sample-10BT from the Hub, streamed
    python data/fineweb_edu/prepare.py --subset sample-100BT    # what the paper trained on
    python data/fineweb_edu/prepare.py --data_files shards/*.parquet   # local files, no network

Every document is preceded by <|endoftext|> and documents keep their order; a document may continue
into the next shard. The first shard is fineweb_val_000000.bin, then fineweb_train_000001.bin, ...
Each shard is written under a temporary name and renamed when complete, and progress.json records,
for every finished shard, where in the document stream the next one starts; a rerun with the same
flags keeps finished shards and continues from there, producing byte-identical shards.
Memory: one shard buffer (2 bytes per token) plus a few MB of text in flight per process.
"""

import argparse
import collections
import glob
import json
import multiprocessing
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tokens import (
    EOT_TOKEN,
    HEADER_BYTES,
    DataError,
    atomic_write_bytes,  # noqa: E402
    get_gpt2_encoding,
    network_reachable,
    run_prepare,
    write_shard,
)

HUB_DATASET = "HuggingFaceFW/fineweb-edu"
PROGRESS_FILE = "progress.json"
CHUNK_CHARS = 1 << 20  # text per task handed to a worker: large enough to amortise the IPC
ROWS_PER_READ = 1024


def shard_name(index):
    return f"fineweb_{'val' if index == 0 else 'train'}_{index:06d}.bin"


# ---------------------------------------------------------------------------------------------------
# Document sources: each yields texts in a fixed order, starting after `skip` documents.


def local_documents(paths, skip):
    for path in paths:
        if path.endswith(".parquet"):
            yield from _parquet_documents(path, skip)
            skip = max(0, skip - _parquet_rows(path))
        elif path.endswith((".jsonl", ".json")):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        continue
                    if skip:
                        skip -= 1
                        continue
                    yield json.loads(line)["text"]
        else:
            raise DataError(f"{path}: --data_files takes .parquet or .jsonl files")


def _parquet_rows(path):
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def _parquet_documents(path, skip):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Every row group's buffers come and go; arrow's default mimalloc pool keeps the freed pages and the
    # process would grow with the corpus. The system allocator returns them.
    pa.set_memory_pool(pa.system_memory_pool())
    parquet = pq.ParquetFile(path)
    if "text" not in parquet.schema_arrow.names:
        raise DataError(f"{path}: no 'text' column (columns: {', '.join(parquet.schema_arrow.names)})")
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if skip >= rows:  # a resume skips whole row groups without reading them
            skip -= rows
            continue
        for batch in parquet.iter_batches(batch_size=ROWS_PER_READ, row_groups=[group], columns=["text"]):
            texts = batch.column(0).to_pylist()
            yield from texts[skip:]
            skip = max(0, skip - len(texts))


def hub_documents(subset, skip):
    if not network_reachable("huggingface.co"):
        raise DataError(
            f"cannot reach huggingface.co to stream {HUB_DATASET} ({subset}); on a machine "
            f"without internet pass --data_files with local parquet or jsonl files"
        )
    from datasets import load_dataset

    stream = load_dataset(HUB_DATASET, name=subset, split="train", streaming=True)
    for example in stream.skip(skip):
        yield example["text"]


# ---------------------------------------------------------------------------------------------------
# Tokenization: chunks of texts to worker processes, results back in order, a bounded number in flight.


def text_chunks(texts, chunk_chars=CHUNK_CHARS):
    chunk, size = [], 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= chunk_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def tokenize(texts):
    """[EOT, doc tokens...] for every text, concatenated as uint16, and each document's length."""
    # One call per text: encode_ordinary_batch would start a thread pool on every call, and the
    # parallelism here comes from the worker processes.
    encoding = get_gpt2_encoding()
    docs = [encoding.encode_ordinary(text) for text in texts]
    lengths = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=len(docs))
    tokens = np.empty(int(lengths.sum()), dtype=np.uint16)
    starts = np.cumsum(lengths) - lengths
    tokens[starts] = EOT_TOKEN
    for start, doc in zip(starts, docs):
        tokens[start + 1 : start + 1 + len(doc)] = doc
    return tokens, lengths


def ordered_map(fn, items, num_proc):
    """map(fn, items) in num_proc processes, in order, with at most 2*num_proc + 1 tasks in flight.

    (Pool.imap would read the whole input ahead of the workers: memory would grow with the corpus.)
    """
    if num_proc <= 1:
        yield from map(fn, items)
        return
    with multiprocessing.Pool(num_proc) as pool:
        pending = collections.deque()
        for item in items:
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) > 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ---------------------------------------------------------------------------------------------------
# Shards and the progress file that makes a rerun resume.


def load_progress(output_dir, run):
    """The finished shards of an earlier run with the same source and shard size (checked on disk)."""
    path = os.path.join(output_dir, PROGRESS_FILE)
    if not os.path.exists(path):
        return dict(run, shards=[], done=False)
    with open(path) as f:
        progress = json.load(f)
    if {k: progress.get(k) for k in run} != run:
        raise DataError(
            f"{output_dir} holds shards of another run ({progress.get('source')}, shard_size "
            f"{progress.get('shard_size')}); rerun with those flags or use a new --output_dir"
        )
    for i, shard in enumerate(progress["shards"]):
        path = os.path.join(output_dir, shard["name"])
        if not os.path.exists(path) or os.path.getsize(path) != HEADER_BYTES + 2 * shard["tokens"]:
            progress["shards"], progress["done"] = progress["shards"][:i], False
            break
    return progress


def save_progress(output_dir, progress):
    atomic_write_bytes(os.path.join(output_dir, PROGRESS_FILE), json.dumps(progress, indent=1).encode())


def prepare(documents, source, output_dir, shard_size, num_proc):
    """Tokenize documents(skip) into shards of shard_size tokens in output_dir; resumes a stopped run."""
    os.makedirs(output_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(output_dir, "*.tmp.*")):  # left by a killed run
        os.remove(stale)
    progress = load_progress(output_dir, dict(source=source, shard_size=shard_size))
    shards = progress["shards"]
    if progress["done"]:
        print(f"{output_dir}: all {len(shards)} shards already prepared")
        return shards
    get_gpt2_encoding()  # fail before starting workers; forked workers inherit it
    doc_index, skip_tokens = (shards[-1]["next_doc"], shards[-1]["doc_offset"]) if shards else (0, 0)
    if shards:
        print(f"resuming after {len(shards)} finished shards, at document {doc_index:,}")
    buffer = np.empty(shard_size, dtype=np.uint16)
    filled = 0

    def finish_shard(tokens, next_doc, doc_offset):
        name = shard_name(len(shards))
        write_shard(os.path.join(output_dir, name), tokens)
        shards.append(dict(name=name, tokens=len(tokens), next_doc=int(next_doc), doc_offset=int(doc_offset)))
        save_progress(output_dir, progress)

    bar = tqdm(unit="tok", unit_scale=True, desc="tokenizing", initial=len(shards) * shard_size)
    chunks = text_chunks(documents(doc_index))
    for tokens, lengths in ordered_map(tokenize, chunks, num_proc):
        doc_ends = np.cumsum(lengths)  # token position where each document of this chunk ends
        position, skip_tokens = skip_tokens, 0  # a resumed document drops what the last shard holds
        start = position
        while position < len(tokens):
            take = min(shard_size - filled, len(tokens) - position)
            buffer[filled : filled + take] = tokens[position : position + take]
            filled += take
            position += take
            if filled == shard_size:
                # The next shard starts in document j of this chunk, `position - doc start` tokens in.
                j = int(np.searchsorted(doc_ends, position, side="right"))
                finish_shard(buffer, doc_index + j, position - (doc_ends[j - 1] if j else 0))
                filled = 0
        doc_index += len(lengths)
        bar.set_postfix(docs=f"{doc_index:,}", shards=len(shards), refresh=False)
        bar.update(len(tokens) - start)
    bar.close()
    if filled:
        finish_shard(buffer[:filled], doc_index, 0)
    if not shards:
        raise DataError(f"no documents in {source}")
    progress["done"] = True
    save_progress(output_dir, progress)
    total = sum(s["tokens"] for s in shards)
    print(f"{doc_index:,} documents, {total:,} tokens in {len(shards)} shards in {output_dir}")
    if len(shards) == 1:
        print("warning: only the val shard was written; use a smaller --shard_size to get train shards")
    return shards


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_files", nargs="+", help="local .parquet/.jsonl files (no network is touched)")
    parser.add_argument("--output_dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--shard_size", type=int, default=100_000_000, help="tokens per shard")
    parser.add_argument(
        "--num_proc",
        type=int,
        default=os.cpu_count() or 1,
        help="tokenizer processes (default: one per core; the main process mostly waits)",
    )
    parser.add_argument("--subset", default="sample-10BT", help="sample-10BT, sample-100BT, sample-350BT, ...")
    args = parser.parse_args(argv)
    if args.shard_size < 1:
        raise DataError(f"--shard_size must be positive, got {args.shard_size}")
    if args.data_files:
        missing = [p for p in args.data_files if not os.path.isfile(p)]
        if missing:
            raise DataError(f"--data_files: no such file {missing[0]}")
        source = [os.path.abspath(p) for p in args.data_files]
        documents = lambda skip: local_documents(source, skip)  # noqa: E731
    else:
        source = f"{HUB_DATASET}:{args.subset}"
        documents = lambda skip: hub_documents(args.subset, skip)  # noqa: E731
    return prepare(documents, source, args.output_dir, args.shard_size, args.num_proc)


if __name__ == "__main__":
    run_prepare(main)
