"""FineWeb-Edu -> GPT-2 token shards in llm.c's format, streamed, parallel and resumable.

    python -m data.fineweb_edu.prepare                          # sample-10BT from the Hub, streamed
    python -m data.fineweb_edu.prepare --subset sample-100BT    # what the paper trained on
    python -m data.fineweb_edu.prepare --data_files shards/*.parquet   # local files, no network

Every document is preceded by <|endoftext|> and documents keep their order; a document may continue
into the next shard. The first shard is fineweb_val_000000.bin, then fineweb_train_000001.bin, ...
The input is a list of parquet (or, locally, jsonl) files read one at a time in a fixed order: the
--data_files as given, or the subset's files on the Hub, listed once and kept in progress.json. Each
shard is written under a temporary name and renamed when complete, and progress.json records, for
every finished shard, where the next one starts as (source file, row, tokens into that document); a
rerun with the same flags keeps finished shards, opens only the files from there on (skipping whole
row groups inside the first), and produces byte-identical shards. manifest.json, brought up to date after
each shard, records every shard's size and SHA-256: the fingerprint a training run records of its data.
Memory: one shard buffer (2 bytes per token) plus a few MB of text in flight per process.
"""

import argparse
import collections
import json
import multiprocessing
import os
import sys

import numpy as np
from tqdm import tqdm

if not __package__:  # run by its path (python data/<name>/prepare.py, as nanoGPT's): import from the repository
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.prepare_common import (
    add_data_files,
    add_output_dir,
    check_data_files,
    check_parquet_schema,
    is_arrow_data_error,
    json_line_texts,
    make_output_dir,
    read_error,
    run_prepare,
)
from marsgpt.files import atomic_write_bytes, remove_stale_temporaries
from marsgpt.runtime import network_reachable
from marsgpt.tokens import (
    EOT_TOKEN,
    HEADER_BYTES,
    DataError,
    get_gpt2_encoding,
    write_manifest,
    write_shard,
)

HUB_DATASET = "HuggingFaceFW/fineweb-edu"
PROGRESS_FILE = "progress.json"
CHUNK_CHARS = 1 << 20  # text per task handed to a worker: large enough to amortise the IPC
ROWS_PER_READ = 1024


def shard_name(index):
    return f"fineweb_{'val' if index == 0 else 'train'}_{index:06d}.bin"


# ---------------------------------------------------------------------------------------------------
# Document sources: files read one at a time, in order, each through an opener (local or the Hub).


def hub_files(subset):
    """The subset's parquet files on the Hub, in the order `load_dataset(..., streaming=True)` reads them,
    as hf:// URLs pinned to the current revision. Resolves the subset exactly as `datasets` does (the
    dataset card's configs), downloading no data."""
    from datasets import load_dataset_builder

    try:
        builder = load_dataset_builder(HUB_DATASET, name=subset)
    except ValueError as e:  # an unknown config name
        raise DataError(f"{HUB_DATASET} has no subset {subset!r}: {e}") from None
    return sorted(builder.config.data_files["train"])


def open_hub_file(url):
    """A hub file opened for reading; parquet reads fetch only the byte ranges they need."""
    import fsspec

    return fsspec.open(url, "rb")


def open_local_file(path):
    return open(path, "rb")


def _parquet_reader(name, file):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Every row group's buffers come and go; arrow's default mimalloc pool keeps the freed pages and the
    # process would grow with the corpus. The system allocator returns them.
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        parquet = pq.ParquetFile(file)
    except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid is a ValueError
        if not is_arrow_data_error(e):
            raise
        raise read_error(name, "parquet", e) from None
    check_parquet_schema(name, parquet.schema_arrow)

    def texts(skip):
        try:
            for group in range(parquet.num_row_groups):
                rows = parquet.metadata.row_group(group).num_rows
                if skip >= rows:  # a resume skips whole row groups without reading them
                    skip -= rows
                    continue
                for batch in parquet.iter_batches(batch_size=ROWS_PER_READ, row_groups=[group], columns=["text"]):
                    if batch.column(0).null_count:
                        raise DataError(f"{name}: row group {group} has a null 'text'; every row needs a text")
                    batch_texts = batch.column(0).to_pylist()
                    yield from batch_texts[skip:]
                    skip = max(0, skip - len(batch_texts))
        except (ValueError, OSError) as e:  # a corrupt page; the consumer's exceptions never arrive here
            if not is_arrow_data_error(e):
                raise
            raise read_error(name, "parquet", e) from None

    return parquet.metadata.num_rows, texts


def _jsonl_reader(name, file):
    def texts(skip):
        for text in json_line_texts(name, file):
            if skip:
                skip -= 1
                continue
            yield text

    return None, texts  # the row count is known only once read


def open_reader(name, file):
    """(row count or None, texts(skip)) for an open parquet or jsonl file."""
    if name.endswith(".parquet"):
        return _parquet_reader(name, file)
    if name.endswith((".jsonl", ".json")):
        return _jsonl_reader(name, file)
    raise DataError(f"{name}: takes .parquet or .jsonl files")


class DocumentStream:
    """The documents of `files` in order, from row `row` of file `file_index` on, which is document
    `first_doc` of the whole stream. Remembers where each file it opened begins, so that position()
    names any document it has read as (file index, row)."""

    def __init__(self, files, open_file, file_index, row, first_doc):
        self.files, self.open_file = files, open_file
        self.file_index, self.row, self.first_doc = file_index, row, first_doc
        self.opened = []  # (file index, stream index of its row 0, its row count or None)

    def __iter__(self):
        row0 = self.first_doc - self.row
        for i in range(self.file_index, len(self.files)):
            skip = self.row if i == self.file_index else 0
            with self.open_file(self.files[i]) as file:
                rows, texts = open_reader(self.files[i], file)
                self.opened.append((i, row0, rows))
                read = skip
                for text in texts(skip):
                    read += 1
                    yield text
            row0 += read

    def position(self, doc):
        """(file index, row) of stream document `doc`; past a file's last row is row 0 of the next."""
        for file_index, row0, rows in reversed(self.opened):
            if row0 <= doc:
                if doc - row0 == rows:
                    return file_index + 1, 0
                return file_index, doc - row0
        raise ValueError(f"document {doc} precedes the files read")


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
    if progress["shards"] and "next_file" not in progress["shards"][-1]:
        raise DataError(
            f"{path} was written by an older prepare.py, which recorded no source-file positions; "
            f"use a new --output_dir"
        )
    for i, shard in enumerate(progress["shards"]):
        path = os.path.join(output_dir, shard["name"])
        if not os.path.exists(path) or os.path.getsize(path) != HEADER_BYTES + 2 * shard["tokens"]:
            progress["shards"], progress["done"] = progress["shards"][:i], False
            break
    return progress


def save_progress(output_dir, progress):
    atomic_write_bytes(os.path.join(output_dir, PROGRESS_FILE), json.dumps(progress, indent=1).encode())


def prepare(source, list_files, open_file, output_dir, shard_size, num_proc):
    """Tokenize the documents of the files list_files() names, each read through open_file, into shards
    of shard_size tokens in output_dir; resumes a stopped run from its first unfinished file."""
    make_output_dir(output_dir)
    remove_stale_temporaries(output_dir)  # shards a killed run left half-written
    progress = load_progress(output_dir, dict(source=source, shard_size=shard_size))
    shards = progress["shards"]
    if progress["done"]:
        print(f"{output_dir}: all {len(shards)} shards already prepared")
        write_manifest(output_dir)  # for shards prepared before manifests: hashed once, here
        return shards
    get_gpt2_encoding()  # fail before starting workers; forked workers inherit it
    if "files" not in progress:  # listed once: a resume reads the same files in the same order
        progress["files"] = list_files()
    files = progress["files"]
    file_index = row = doc_index = skip_tokens = 0
    if shards:
        last = shards[-1]
        file_index = len(files) if last["next_file"] is None else files.index(last["next_file"])
        row, doc_index, skip_tokens = last["next_row"], last["next_doc"], last["doc_offset"]
        print(f"resuming after {len(shards)} finished shards, at row {row:,} of {last['next_file']}")
    stream = DocumentStream(files, open_file, file_index, row, doc_index)
    buffer = np.empty(shard_size, dtype=np.uint16)
    filled = 0

    def finish_shard(tokens, next_doc, doc_offset):
        name = shard_name(len(shards))
        write_shard(os.path.join(output_dir, name), tokens)
        next_file, next_row = stream.position(next_doc)
        shards.append(
            dict(
                name=name,
                tokens=len(tokens),
                next_doc=int(next_doc),
                next_file=files[next_file] if next_file < len(files) else None,
                next_row=int(next_row),
                doc_offset=int(doc_offset),
            )
        )
        save_progress(output_dir, progress)
        write_manifest(output_dir)  # hashes the new shard (still in the page cache) and keeps the others' entries

    # closed (its line ended) before an error is printed: the error is a line of its own
    with tqdm(unit="tok", unit_scale=True, desc="tokenizing", initial=len(shards) * shard_size) as bar:
        chunks = text_chunks(stream)
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
    add_data_files(parser, "stream --subset from the Hugging Face hub")
    add_output_dir(parser, __file__, "the shards and progress.json")
    parser.add_argument("--shard_size", type=int, default=100_000_000, help="tokens per shard (default: 100000000)")
    parser.add_argument(
        "--num_proc",
        type=int,
        default=os.cpu_count() or 1,
        help="tokenizer processes (default: one per core; the main process mostly waits)",
    )
    parser.add_argument(
        "--subset",
        default="sample-10BT",
        help="the hub subset to stream: sample-10BT, sample-100BT, sample-350BT, ... (default: sample-10BT; "
        "ignored with --data_files)",
    )
    args = parser.parse_args(argv)
    if args.shard_size < 1:
        raise DataError(f"--shard_size must be positive, got {args.shard_size}")
    if args.num_proc < 1:
        raise DataError(f"--num_proc must be positive, got {args.num_proc}")
    if args.data_files:
        check_data_files(args.data_files)
        source = [os.path.abspath(p) for p in args.data_files]
        return prepare(source, lambda: source, open_local_file, args.output_dir, args.shard_size, args.num_proc)
    if not network_reachable("huggingface.co"):
        raise DataError(
            f"cannot reach huggingface.co to stream {HUB_DATASET} ({args.subset}); on a machine "
            f"without internet pass --data_files with local parquet or jsonl files"
        )
    source = f"{HUB_DATASET}:{args.subset}"
    list_files = lambda: hub_files(args.subset)  # noqa: E731
    return prepare(source, list_files, open_hub_file, args.output_dir, args.shard_size, args.num_proc)


if __name__ == "__main__":
    run_prepare(main)
