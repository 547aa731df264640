"""FineWeb-Edu prepare: tokens/s against tiktoken's ceiling and an HF datasets pipeline; peak memory.

    python -m bench.bench_data            # 32 MB corpus for speed; memory at 32 MB and 128 MB
    python -m bench.bench_data --quick    # 8 MB for speed; memory at 8 MB and 32 MB

The corpus is generated deterministically (no network): the first 8 MB of the running Python's
standard-library .py files in sorted order, repeated to the size asked, as one parquet file.
Rows:
  * ours (data/fineweb_edu/prepare.py, --num_proc 2) vs tiktoken's encode_ordinary_batch on the same
    texts already in memory, the better of 1 thread and one per core: the ceiling (target >= 0.8);
  * ours vs HF datasets Dataset.from_parquet + .map(num_proc=2) writing the same shards, as the
    reference prepare scripts do (target >= 1.5); the two outputs are compared byte for byte;
  * peak memory (PSS) of the prepare's whole process tree at two corpus sizes with the same shard
    size: it follows the shard size, not the corpus (target: ratio ~ 1).
"""

import contextlib
import glob
import io
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.common import print_table, quick_flag, row
from data.fineweb_edu import prepare as fineweb_edu_prepare
from marsgpt.tokens import EOT_TOKEN, get_gpt2_encoding, write_shard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PREPARE = "data.fineweb_edu.prepare"  # run as its docs show it, from the repository root
SHARD_SIZE = 2_000_000  # tokens: 4 MB shards, so every corpus here makes several
ROW_GROUP_ROWS = 100  # documents per parquet row group (the reader decodes one group at a time)


def make_corpus(path, megabytes, base_megabytes=8):
    """The first `base_megabytes` MB of stdlib .py files (sorted), cycled to `megabytes` MB: one parquet.

    Every corpus size repeats the same documents, so the largest document -- which, beside the shard
    buffer, sets the peak memory -- is the same at every size.
    """
    root = sysconfig.get_paths()["stdlib"]
    base, size = [], 0
    for name in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        if size >= base_megabytes * 1_000_000:
            break
        with open(name, encoding="utf-8", errors="replace") as f:
            base.append(f.read())
        size += len(base[-1])
    texts, size = [], 0
    while size < megabytes * 1_000_000:
        texts.append(base[len(texts) % len(base)])
        size += len(texts[-1])
    pq.write_table(pa.table(dict(text=texts)), path, row_group_size=ROW_GROUP_ROWS)
    return texts


def prepare_args(data_file, out_dir, num_proc):
    """data/fineweb_edu/prepare.py's command line for one corpus file."""
    return [
        "--data_files",
        data_file,
        "--output_dir",
        out_dir,
        "--shard_size",
        str(SHARD_SIZE),
        "--num_proc",
        str(num_proc),
    ]


def run_ours(data_file, out_dir, num_proc=2):
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        t0 = time.perf_counter()
        fineweb_edu_prepare.main(prepare_args(data_file, out_dir, num_proc))
        return time.perf_counter() - t0


def _hf_tokenize(example):
    ids = [EOT_TOKEN] + get_gpt2_encoding().encode_ordinary(example["text"])
    return {"ids": ids, "len": len(ids)}


def run_hf_reference(data_file, out_dir, cache_dir, num_proc=2):
    """The reference recipe: Dataset .map(num_proc) to per-document id lists, then fill the shards."""
    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()
    t0 = time.perf_counter()
    dataset = Dataset.from_parquet(data_file, cache_dir=cache_dir)
    tokenized = dataset.map(_hf_tokenize, remove_columns=dataset.column_names, num_proc=num_proc)
    buffer, filled, index = np.empty(SHARD_SIZE, dtype=np.uint16), 0, 0
    for batch in tokenized.with_format("arrow").iter(batch_size=1024):
        ids = batch["ids"].combine_chunks().flatten().to_numpy().astype(np.uint16)
        while len(ids):
            take = min(SHARD_SIZE - filled, len(ids))
            buffer[filled : filled + take], filled, ids = ids[:take], filled + take, ids[take:]
            if filled == SHARD_SIZE:
                write_shard(os.path.join(out_dir, _shard_name(index)), buffer)
                filled, index = 0, index + 1
    if filled:
        write_shard(os.path.join(out_dir, _shard_name(index)), buffer[:filled])
    return time.perf_counter() - t0


def _shard_name(index):
    return f"fineweb_{'val' if index == 0 else 'train'}_{index:06d}.bin"


def _tree_pss_bytes(root_pid):
    """Proportional set size of a process and all its descendants, from /proc: pages shared by the
    forked workers count once in total, not once per process as RSS would."""
    parents = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parents[int(stat.split("/")[2])] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        tree.update(children)
        frontier += children
    total = 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
        except (OSError, StopIteration):
            continue
    return total


def peak_rss(data_file, out_dir, num_proc=2):
    """Peak memory (PSS) of `prepare.py` and its workers together, sampled every 20 ms, in MiB."""
    process = subprocess.Popen(
        [sys.executable, "-m", PREPARE, *prepare_args(data_file, out_dir, num_proc)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    peak = 0

    def sample():
        nonlocal peak
        while process.poll() is None:
            peak = max(peak, _tree_pss_bytes(process.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    process.wait()
    sampler.join()
    if process.returncode:
        raise RuntimeError(f"prepare.py exited with {process.returncode}")
    return peak / 2**20


def run(quick=False):
    speed_mb, memory_mb = (8, (8, 32)) if quick else (32, (32, 128))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.parquet")
        texts = make_corpus(corpus, speed_mb)
        enc = get_gpt2_encoding()
        enc.encode_ordinary_batch(texts[:100])  # warm up
        ceiling = 0.0
        for threads in sorted({1, os.cpu_count()}):  # the better of one thread and one per core
            t0 = time.perf_counter()
            num_tokens = sum(len(d) + 1 for d in enc.encode_ordinary_batch(texts, num_threads=threads))
            ceiling = max(ceiling, num_tokens / (time.perf_counter() - t0))
        del texts

        ours_dir, ref_dir = os.path.join(tmp, "ours"), os.path.join(tmp, "reference")
        os.makedirs(ref_dir)
        ours = num_tokens / run_ours(corpus, ours_dir)
        reference = num_tokens / run_hf_reference(corpus, ref_dir, os.path.join(tmp, "hf_cache"))
        names = sorted(os.listdir(ref_dir))
        identical = names == sorted(f for f in os.listdir(ours_dir) if f.endswith(".bin")) and all(
            open(os.path.join(ref_dir, n), "rb").read() == open(os.path.join(ours_dir, n), "rb").read() for n in names
        )
        note = f"{speed_mb} MB stdlib corpus, {num_tokens / 1e6:.1f}M tokens, 2 shared cores (noisy)"
        for what, speed, target in (
            ("tiktoken encode_ordinary_batch", ceiling, ">= 0.8"),
            ("HF datasets .map(num_proc=2)", reference, ">= 1.5"),
        ):
            rows.append(row(f"prepare vs {what}", ours / 1e6, speed / 1e6, unit="Mtok/s", target=target, note=note))
        rows.append(
            row(
                "prepare shards == HF .map shards",
                int(identical),
                unit="bool",
                target="1",
                note=f"{len(names)} shards compared byte for byte",
            )
        )

        peaks = []
        for mb in memory_mb:
            corpus = os.path.join(tmp, f"corpus_{mb}.parquet")
            make_corpus(corpus, mb)
            peaks.append(peak_rss(corpus, os.path.join(tmp, f"memory_{mb}")))
            os.remove(corpus)
        rows.append(
            row(
                f"prepare peak memory, {memory_mb[1]} MB vs {memory_mb[0]} MB corpus",
                peaks[1],
                peaks[0],
                unit="MiB",
                target="~1 (bounded by shard size)",
                note=f"PSS of main + 2 workers; shard_size {SHARD_SIZE:,} tokens",
            )
        )
    return rows


if __name__ == "__main__":
    print_table(run(quick=quick_flag(__doc__)))
