"""MARS's sharded step under FSDP2 against FSDP2 + torch.optim.AdamW, on 2 gloo ranks (CPU), and how evenly the
Newton-Schulz owners share GPT-2's matrices.

    python -m bench.bench_fsdp            # GPT, 4 blocks of width 256, 8,192-token vocabulary; 7 rounds
    python -m bench.bench_fsdp --quick    # 2 blocks of width 128, 1,024 tokens; 3 rounds

Both ranks build the same GPT in float32 and fully_shard each block and the root, as a trainer does. Each round
runs one training step per optimizer (AdamW(fused=True), each MARS rule, then Muon on the blocks' matrices as the
trainer steps it -- each matrix whole at an owner -- and as torch.optim.Muon steps DTensors by itself) and times
optimizer.step() alone,
between barriers, on rank 0; a row is the median over the rounds, after one warm-up round. Then rank 0 times each
MARS rule's step on the whole, unsharded model in one process (the other rank waits), which shows how the
sharded step divides the work (Newton-Schulz: whole matrices at their owners). "Bytes sent" counts the buffers
step() hands to collectives on one rank (an all-reduce's tensor, an all-to-all's send buffer with the rank's own
share left out): the forward's all-gathers and the backward's reduce-scatters are FSDP2's and the same for every
optimizer. The owner rows need no ranks: mars_sharded.balanced_owners over GPT-2's matrix shapes, as the busiest rank's
Newton-Schulz multiply-adds against the mean, beside round-robin in parameter order.

On GPUs: scripts/gpu_check.py's fsdp check runs `measure` under torchrun, one rank per GPU over NCCL, on GPT-2
small's shapes (GPT2_SMALL), and shows `step_rows` in its table.
"""

import argparse
import contextlib
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

import mars_sharded
from bench.common import print_table, row
from mars import MARS
from marsgpt.fsdp import ShardedMuon
from model import GPT, GPTConfig, hidden_matrix_params

SIZES = {
    False: dict(n_layer=4, n_head=4, n_embd=256, block_size=64, vocab_size=8192, bias=False),
    True: dict(n_layer=2, n_head=4, n_embd=128, block_size=64, vocab_size=1024, bias=False),
}
# scripts/gpu_check.py's fsdp row: GPT-2 small's shapes, one rank per GPU over NCCL (measure(), under torchrun)
GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=False)
RULES = ("mars-adamw", "mars-lion", "mars-m")
# Muon on the blocks' matrices two ways: the trainer's (marsgpt.fsdp.ShardedMuon: each matrix whole at an
# owner, MARS's scheme) and torch.optim.Muon as it runs on DTensors by itself (DTensor's dispatch)
MUONS = ("muon-owners", "muon-dtensor")
BATCH = 2  # sequences per rank


# ops of torch's collective namespaces that send nothing: a wait for a result, a functional collective's autograd wrap
NOT_SENDING = ("wait_tensor", "_wrap_tensor_autograd")


class SentBytes(TorchDispatchMode):
    """Counts the collectives step() issues and the bytes they send from this rank."""

    def __init__(self, world):
        super().__init__()
        self.world, self.calls, self.bytes = world, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            # a DTensor's op: a mode sees it before DTensor does, so hand it on; DTensor runs it as ops on the local
            # tensors and the collectives it needs, which come back here (torch's CommDebugMode does the same)
            return NotImplemented
        name = func.__name__.split(".")[0]
        if func.namespace in ("c10d", "_c10d_functional") and name not in NOT_SENDING:
            self.calls[name] = self.calls.get(name, 0) + 1
            if name == "alltoall_base_":  # (output, input, group, output_split_sizes, input_split_sizes, ...)
                sent, splits = args[1], args[4]
                rows = sent.shape[0] if sent.ndim else 0
                own = splits[dist.get_rank()] if splits else rows // self.world
                self.bytes += (rows - own) * (sent.numel() // max(rows, 1)) * sent.element_size()
            else:
                tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                self.bytes += sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
        return func(*args, **(kwargs or {}))


def optimizer_for(name, model):
    if name in MUONS:
        muon_class = ShardedMuon if name == "muon-owners" else torch.optim.Muon
        matrices = hidden_matrix_params(model)[0]
        return muon_class(matrices, lr=0.02, momentum=0.95, nesterov=True, adjust_lr_fn="original")
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)  # torch's fastest
    return MARS(model.parameters(), lr=1e-3, weight_decay=0.1, mars_type=name)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(optimizer, device, ranks=True, counting=None):
    """Seconds of optimizer.step() alone: the device synchronised before and after, and with ranks=True every rank
    lined up at a barrier before and after, so the time is the slowest rank's; counting: a mode around it."""
    synchronize(device)
    if ranks:
        dist.barrier()
    start = time.perf_counter()
    with counting or contextlib.nullcontext():
        optimizer.step()
    synchronize(device)
    if ranks:
        dist.barrier()
    return time.perf_counter() - start


def measure(config, rounds, device):
    """The step times and bytes sent, on every rank of the default process group (already started: gloo on the
    CPU, NCCL with one GPU per rank); the results on rank 0, None on the others. `device`: this rank's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = torch.device(device)
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    runs = {}
    for name in ("adamw", *RULES, *MUONS):
        torch.manual_seed(0)
        with device:
            model = GPT(GPTConfig(**config))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        runs[name] = (model, optimizer_for(name, model))
    generator = torch.Generator(device).manual_seed(dist.get_rank())
    batch = (BATCH, config["block_size"])
    times = {name: [] for name in runs}
    sent = {}
    for round_ in range(rounds + 1):
        for name, (model, optimizer) in runs.items():
            x = torch.randint(0, config["vocab_size"], batch, generator=generator, device=device)
            model(x, x)[1].backward()
            counting = SentBytes(world) if round_ == 1 else None
            seconds = timed_step(optimizer, device, counting=counting)
            if round_ > 0:  # round 0 warms up (state allocation)
                times[name].append(seconds)
            if counting is not None:
                sent[name] = (counting.bytes, dict(counting.calls))
            optimizer.zero_grad()
    parameters = sum(p.numel() for p in runs["adamw"][0].parameters())
    del runs, model, optimizer  # the sharded models' memory, before rank 0 builds whole ones
    results = None
    if dist.get_rank() == 0:
        whole = {}
        for name in RULES:
            torch.manual_seed(0)
            with device:
                model = GPT(GPTConfig(**config))
            optimizer = optimizer_for(name, model)
            steps = []
            for _ in range(rounds + 1):
                x = torch.randint(
                    0, config["vocab_size"], (BATCH * world, batch[1]), generator=generator, device=device
                )
                model(x, x)[1].backward()
                steps.append(timed_step(optimizer, device, ranks=False))
                optimizer.zero_grad()
            whole[name] = statistics.median(steps[1:])
        medians = {k: statistics.median(v) for k, v in times.items()}
        results = dict(times=medians, whole=whole, sent=sent, parameters=parameters, world=world, rounds=rounds)
    dist.barrier()
    return results


def worker(rank, world, store, quick, rounds, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    measured = measure(SIZES[quick], rounds, "cpu")
    if measured is not None:
        results.update(measured)
    dist.destroy_process_group()


def step_rows(results, device="2 gloo ranks"):
    """The table of measure()'s results: each MARS rule's sharded step against FSDP2 + AdamW(fused=True) and
    against its step in one process, then the bytes each optimizer's step sends from one rank."""
    times, sent = results["times"], results["sent"]
    setting = f"{results['parameters'] / 1e6:.1f}M params, fp32, {device}, median of {results['rounds']} rounds"
    rows = []
    for name in RULES:
        rows.append(
            row(
                f"FSDP2 {name} step vs FSDP2 AdamW(fused=True) step",
                times[name] * 1e3,
                times["adamw"] * 1e3,
                unit="ms",
                note=setting,
            )
        )
    for name in RULES:
        rows.append(
            row(
                f"FSDP2 {name} step vs its step in one process",
                times[name] * 1e3,
                results["whole"][name] * 1e3,
                unit="ms",
                note="one process: the unsharded model, on rank 0 alone",
            )
        )
    rows.append(
        row(
            "FSDP2 Muon step: owners (the trainer's ShardedMuon) vs torch.optim.Muon through DTensor",
            times["muon-owners"] * 1e3,
            times["muon-dtensor"] * 1e3,
            unit="ms",
            note="the blocks' matrices; each matrix's Newton-Schulz at one owner vs on every rank",
        )
    )
    for name in ("adamw", *RULES, *MUONS):
        sent_bytes, calls = sent[name]
        rows.append(
            row(
                f"FSDP2 {name} step: bytes sent per rank",
                sent_bytes / 2**10,
                unit="KiB",
                note=", ".join(f"{k} x{n}" for k, n in sorted(calls.items())) or "no collective",
            )
        )
    return rows


def owner_rows():
    """Newton-Schulz work per rank under balanced_owners, for GPT-2's matrices (mars-m: the blocks' matrices;
    mars-shampoo: the embeddings too)."""
    rows = []
    for size, (n_layer, width) in {"small": (12, 768), "xl": (48, 1600)}.items():
        blocks = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * n_layer
        for rule, shapes in (("mars-m", blocks), ("mars-shampoo", blocks + [(50304, width), (1024, width)])):
            costs = [mars_sharded.newton_schulz_cost(shape) for shape in shapes]
            for world in (8, 64):
                load = [0] * world
                for cost, owner in zip(costs, mars_sharded.balanced_owners(costs, world)):
                    load[owner] += cost
                mean = sum(costs) / world
                round_robin = max(sum(costs[r::world]) for r in range(world)) / mean
                rows.append(
                    row(
                        f"Newton-Schulz owners, GPT-2 {size} {rule}, {world} ranks: busiest rank vs the mean",
                        max(load) / mean,
                        unit="x",
                        note=f"{len(shapes)} matrices; round-robin in parameter order: {round_robin:.2f}x",
                    )
                )
    return rows


def run(quick=False):
    rounds = 3 if quick else 7
    results = mp.Manager().dict()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(worker, args=(2, store, quick, rounds, results), nprocs=2, join=True)
    return step_rows(dict(results)) + owner_rows()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    print_table(run(quick=p.parse_args().quick))
