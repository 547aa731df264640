"""DDP's gradient_as_bucket_view: the memory it saves and what it costs, measured on 2 gloo ranks (CPU).

    python -m bench.bench_ddp            # 6 alternating rounds of 5 steps per setting
    python -m bench.bench_ddp --quick    # 2 rounds

train.py wraps the model with gradient_as_bucket_view=True: each parameter's .grad is then a view into
DDP's all-reduce bucket instead of a tensor of its own that DDP copies into the bucket and back. The bench
trains the same model (4 GPT-2-small-wide blocks, 256-symbol vocabulary, 28M parameters) on 2 processes
with the flag off and on, alternating round by round, and reports per setting
  * the fastest round's step time (forward, backward with the all-reduce, clip, MARS step);
  * the process's resident memory after the steps minus before the model was built;
  * how many distinct storages the gradients live in (one per parameter without the flag; one per bucket
    with it), which is what saves the gradient-sized copy.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.common import print_table, rendezvous, row
from mars import MARS
from marsgpt.runtime import exit_process
from model import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG = dict(n_layer=4, n_head=12, n_embd=768, block_size=256, vocab_size=256, bias=False)
BATCH = 4


def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(rank, rendezvous_env, bucket_view, steps, results):
    os.environ.update(rendezvous_env, RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    before = resident_bytes()
    torch.manual_seed(0)
    model = DDP(GPT(GPTConfig(**CONFIG)), gradient_as_bucket_view=bucket_view)
    optimizer = MARS(model.parameters(), lr=1e-3)
    x = torch.randint(
        0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"]), generator=torch.Generator().manual_seed(rank)
    )
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        _, loss = model(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep .grad (and its bucket view) alive between steps
    step_s = (time.perf_counter() - t0) / steps
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    if rank == 0:
        results[bucket_view] = dict(
            step_s=step_s,
            rss=resident_bytes() - before,
            storages=len(storages),
            params=len(list(model.parameters())),
            grad_bytes=sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()),
        )
    dist.destroy_process_group()
    exit_process(0)


def measure(bucket_view, steps):
    results = mp.Manager().dict()
    with rendezvous() as env:
        mp.spawn(worker, args=(env, bucket_view, steps, results), nprocs=2)
    return results[bucket_view]


def run(quick=False):
    rounds, steps = (2, 3) if quick else (6, 5)
    runs = {False: [], True: []}
    for _ in range(rounds):  # alternate the settings, so both see the same load on shared cores
        for bucket_view in (False, True):
            runs[bucket_view].append(measure(bucket_view, steps))
    best = {k: min(v, key=lambda r: r["step_s"]) for k, v in runs.items()}
    off, on = best[False], best[True]
    grad_mib = off["grad_bytes"] / 2**20
    return [
        row(
            "DDP step, 2 gloo ranks, gradient_as_bucket_view on vs off",
            on["step_s"] * 1e3,
            off["step_s"] * 1e3,
            unit="ms",
            target="<= 1 (costs nothing)",
        ),
        row(
            "DDP resident memory after the steps, on vs off",
            on["rss"] / 2**20,
            off["rss"] / 2**20,
            unit="MiB",
            note=f"gradients are {grad_mib:.0f} MiB; distinct gradient storages: "
            f"{on['storages']} on, {off['storages']} off ({off['params']} parameters)",
        ),
    ]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    print_table(run(quick=p.parse_args().quick))
