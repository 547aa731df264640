"""What marsgpt/run_dir.py's protections cost: checksums, independent copies, the per-step agreement of ranks.

    python -m bench.bench_run_dir            # a GPT-2-small-sized checkpoint (~2 GB), 3 repeats of each
    python -m bench.bench_run_dir --quick    # a 3-layer model's, 2 repeats

The checkpoint is GPT-2 small's (124M parameters, the tied embedding stored once) with MARS-AdamW's state
(two moments for every parameter, the previous gradient for the matrices), built on the CPU and written to
a temporary directory on this machine's disk. Rows:
  * hashlib's candidates for the checksum, GiB/s on one core: checkpoint.py uses sha256;
  * a save as it was (torch.save into an atomic, fsync'ed file) against checkpoint.save_checkpoint (the same,
    with the bytes hashed as they are written and the checksum trailer), called in turn: the checksum's cost;
  * checkpoint.verify: the hashing read every load adds;
  * checkpoint.keep_copy: writing best.pt or a kept ckpt_<iter>.pt as a copy instead of a hard link;
  * checkpoint.cpu_copy: what a save blocks training for on the CPU (on a GPU, the device-to-host copy);
  * parallel.Parallelism.read_agreed under DDP: the all-reduce of the ranks' 4 requests that each step adds (2 gloo
    ranks).
"""

import argparse
import hashlib
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import print_table, rendezvous, row, time_it
from marsgpt import checkpoint
from marsgpt.files import atomic_writer
from marsgpt.runtime import exit_process
from model import GPT, GPTConfig

GIB = 2**30


def gpt2_small_state(n_layer):
    """A checkpoint's state as train.py saves it: the model and MARS-AdamW's state for every parameter."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=12, n_embd=768, block_size=1024, vocab_size=50304))
    state = {}
    for index, p in enumerate(model.parameters()):
        moments = dict(exp_avg=torch.randn_like(p), exp_avg_sq=torch.rand_like(p), step=torch.tensor(1000.0))
        if p.ndim >= 2:
            moments["last_grad"] = torch.randn_like(p)
        state[index] = moments
    return {"model": model.state_dict(), "optimizer": {"state": state}, "model_args": {}}


def hash_rate(name, data, repeats):
    """GiB/s of hashlib's `name` over `data` on one core."""
    seconds = time_it(lambda: hashlib.new(name, data).digest(), warmup=1, repeats=repeats)
    return len(data) / seconds / GIB


def alternating(a, b, repeats):
    """Median seconds of a() and of b(), called in turn (a b a b ...: both see the same load and page cache
    state), after one untimed round."""
    times = ([], [])
    for _ in range(repeats + 1):
        for fn, timed in zip((a, b), times):
            t0 = time.perf_counter()
            fn()
            timed.append(time.perf_counter() - t0)
    return tuple(sorted(t[1:])[len(t[1:]) // 2] for t in times)


def agreement_worker(rank, rendezvous_env, steps, results):
    os.environ.update(rendezvous_env, RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    norms = torch.ones(2)
    timings = {}
    for with_requests in (False, True, False, True):  # alternate: both see the same load
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            if with_requests:
                flags = torch.tensor([0.0, 0.0, 0.0, 0.0])
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                torch.cat([norms, flags]).tolist()
            else:
                norms.tolist()
        elapsed = (time.perf_counter() - t0) / steps
        timings[with_requests] = min(timings.get(with_requests, elapsed), elapsed)
    if rank == 0:
        results.update(timings)
    dist.destroy_process_group()
    exit_process(0)


def agreement_cost(steps):
    results = mp.Manager().dict()
    with rendezvous() as env:
        mp.spawn(agreement_worker, args=(env, steps, results), nprocs=2)
    return (results[True] - results[False]) * 1e6


def run(quick=False):
    repeats = 2 if quick else 3
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        state = gpt2_small_state(3 if quick else 12)
        data = os.urandom(64 << 20 if quick else 256 << 20)
        rates = {name: hash_rate(name, data, repeats) for name in ("sha256", "sha1", "blake2b", "md5", "sha512")}
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as directory:
            path, copy = os.path.join(directory, "ckpt.pt"), os.path.join(directory, "best.pt")

            def plain_save():
                with atomic_writer(path) as f:
                    torch.save(state, f)

            plain_s, hashed_s = alternating(plain_save, lambda: checkpoint.save_checkpoint(path, state), repeats)
            size = os.path.getsize(path)
            verify_s = time_it(lambda: checkpoint.verify(path), warmup=1, repeats=repeats)
            copy_s = time_it(lambda: checkpoint.keep_copy(path, copy), warmup=1, repeats=repeats)
        cpu_copy_s = time_it(lambda: checkpoint.cpu_copy(state), warmup=1, repeats=repeats)
    finally:
        torch.set_num_threads(threads)
    label = f"{size / GIB:.2f} GiB checkpoint"
    rows = [
        row(f"checksum candidate {name}", rate, unit="GiB/s", note="one core; sha256 is checkpoint.py's")
        for name, rate in rates.items()
    ]
    rows += [
        row(
            f"save with the sha256 trailer vs without ({label})",
            hashed_s,
            plain_s,
            unit="s",
            note="torch.save into an atomic, fsync'ed file; hashing as the bytes are written",
        ),
        row(f"verify on load ({label})", verify_s, unit="s", note=f"{size / verify_s / GIB:.2f} GiB/s read + hashed"),
        row(
            f"independent copy for best.pt / ckpt_<iter>.pt ({label})",
            copy_s,
            unit="s",
            note=f"copy_file_range; {size / copy_s / GIB:.2f} GiB/s (a hard link cost ~0 and was no copy)",
        ),
        row(f"cpu_copy: what a save blocks training for on CPU ({label})", cpu_copy_s, unit="s"),
        row(
            "per-step agreement of the ranks' requests (2 gloo ranks)",
            agreement_cost(200 if quick else 2000),
            unit="us/step",
            note="one all-reduce of 4 numbers, read with the step's own read",
        ),
    ]
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    print_table(run(quick=p.parse_args().quick))
