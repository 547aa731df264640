"""MARS's sharded step under FSDP2 against FSDP2 + torch.optim.AdamW, on 2 gloo ranks (CPU), and how evenly the
Newton-Schulz owners share GPT-2's matrices.

    python -m bench.bench_fsdp            # GPT, 4 blocks of width 256, 8,192-token vocabulary; 7 rounds
    python -m bench.bench_fsdp --quick    # 2 blocks of width 128, 1,024 tokens; 3 rounds

Both ranks build the same GPT in float32 and fully_shard each block and the root, as a trainer does. Each round
runs one training step per optimizer (AdamW(fused=True), each MARS rule, MARS-M again with Newton-Schulz in
bfloat16 as on GPUs, then Muon on the blocks' matrices as the trainer steps it -- each matrix whole at an owner --
and as torch.optim.Muon steps DTensors by itself) and times optimizer.step() alone, between barriers, on rank 0;
a row is the median over the rounds, after one warm-up round. Then rank 0 times each MARS rule's step on the
whole, unsharded model in one process (the other rank waits), which shows how the sharded step divides the work
(Newton-Schulz: whole matrices at their owners). "Bytes sent" counts the buffers step() hands to collectives on
one rank (an all-reduce's tensor, an all-to-all's send buffer with the rank's own share left out), by collective:
the forward's all-gathers and the backward's reduce-scatters are FSDP2's and the same for every optimizer. Last, one
MARS-M step with its exchange in small buckets, phase by phase on rank 0 (mars_sharded.timeline): the table's
last row says how much of the all-to-alls' time was hidden behind Newton-Schulz, and the command prints the
timeline under the table. The owner rows need no ranks: mars_sharded.balanced_owners over GPT-2's matrix shapes,
as the busiest rank's Newton-Schulz multiply-adds against the mean, beside round-robin in parameter order.

On GPUs: scripts/gpu_check.py's fsdp check runs `measure` under torchrun, one rank per GPU over NCCL, on GPT-2
small's shapes (GPT2_SMALL), and shows `step_rows` in its table.
"""

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

import mars
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
# MARS-M with Newton-Schulz in bfloat16, as it runs on GPUs (mars.newton_schulz_dtype), wherever the bench runs: the
# owners then send their results back in bfloat16
MARS_M_BFLOAT16 = "mars-m, bfloat16 Newton-Schulz"
# The timeline's MARS-M step: its exchange in buckets of this many MiB per owner, about one matrix each here (the
# bench's matrices fit the default bucket all at once, where nothing is left to overlap)
TIMELINE_BUCKET_MIB = 0.25
# Muon on the blocks' matrices two ways: the trainer's (marsgpt.fsdp.ShardedMuon: each matrix whole at an
# owner, MARS's scheme) and torch.optim.Muon as it runs on DTensors by itself (DTensor's dispatch)
MUONS = ("muon-owners", "muon-dtensor")
BATCH = 2  # sequences per rank


# ops of torch's collective namespaces that send nothing: a wait for a result, a functional collective's autograd wrap
NOT_SENDING = ("wait_tensor", "_wrap_tensor_autograd")


class SentBytes(TorchDispatchMode):
    """Counts the collectives step() issues and the bytes they send from this rank, in all (bytes) and by
    collective (sent)."""

    def __init__(self, world):
        super().__init__()
        self.world, self.calls, self.sent = world, {}, {}

    @property
    def bytes(self):
        return sum(self.sent.values())

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
                sent_bytes = (rows - own) * (sent.numel() // max(rows, 1)) * sent.element_size()
            else:
                tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                sent_bytes = sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
            self.sent[name] = self.sent.get(name, 0) + sent_bytes
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def newton_schulz_in(dtype):
    """Newton-Schulz in `dtype` on every device while the block runs (None: each device's own)."""
    kept = mars.newton_schulz_dtype
    if dtype is not None:
        mars.newton_schulz_dtype = lambda device, _=None: dtype
    try:
        yield
    finally:
        mars.newton_schulz_dtype = kept


def optimizer_for(name, model):
    if name == MARS_M_BFLOAT16:
        name = "mars-m"
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
    for name in ("adamw", *RULES, MARS_M_BFLOAT16, *MUONS):
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
            with newton_schulz_in(torch.bfloat16 if name == MARS_M_BFLOAT16 else None):
                seconds = timed_step(optimizer, device, counting=counting)
            if round_ > 0:  # round 0 warms up (state allocation)
                times[name].append(seconds)
            if counting is not None:
                sent[name] = (counting.sent, dict(counting.calls))
            optimizer.zero_grad()
    timeline = timeline_of_a_step(*runs["mars-m"], config, generator, device)
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
        results.update(timeline=timeline)
    dist.barrier()
    return results


def timeline_of_a_step(model, optimizer, config, generator, device):
    """One MARS-M step with its exchange in buckets of TIMELINE_BUCKET_MIB: what this rank did when, as
    mars_sharded.timeline records it, in ms from the step's start: [(phase, bucket, start, end)], the step's end
    last. On a GPU each phase is synchronised at its end only through the collectives' waits: its Newton-Schulz
    is the time to launch it."""
    for group in optimizer.param_groups:
        group["exchange_bucket_mib"] = TIMELINE_BUCKET_MIB
    x = torch.randint(0, config["vocab_size"], (BATCH, config["block_size"]), generator=generator, device=device)
    model(x, x)[1].backward()
    synchronize(device)
    dist.barrier()
    with mars_sharded.timeline() as events:
        start = time.perf_counter()
        optimizer.step()
        synchronize(device)
        end = time.perf_counter()
    optimizer.zero_grad()
    steps = [(name, bucket, (a - start) * 1e3, (b - start) * 1e3) for name, bucket, a, b in events]
    return sorted(steps, key=lambda event: event[2]) + [("step", None, 0.0, (end - start) * 1e3)]


# scripts/gpu_check.py's mesh-of-one rows: MARS-Shampoo's and MARS-M's sharded step on one GPU (a mesh of one still
# runs the owner exchange, its buckets and the results' transport) against the unsharded step of the same model
MESH_OF_ONE_RULES = ("mars-shampoo", "mars-m")
MESH_OF_ONE_STEPS = 4  # the same gradients on both, each step; the first allocates the state and is not timed
# Parameters after the steps, max |sharded - unsharded| per unit of lr (an update's entries are about 1 in size):
# the same rule, Newton-Schulz's products in column blocks at the owner (bfloat16 on a GPU may round them apart)
MESH_OF_ONE_EQUALITY_TARGET = "<= 0.01"
MEMORY_TARGET = "<= 1.1"  # the step's peak beyond the state against the plan (memory_plan.owner_exchange_bytes)


def mesh_of_one(config, device):
    """Each of MESH_OF_ONE_RULES on `device` in the default process group of one rank, sharded (fully_shard over a
    mesh of one) and not, from the same weights and gradients: {rule: {sharded_ms, whole_ms, difference,
    peak_bytes, planned_bytes}} (peak_bytes: CUDA's allocator, beyond what the step starts with; None elsewhere)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from marsgpt import fsdp, memory_plan

    device = torch.device(device)
    mesh = init_device_mesh(device.type, (1,))
    results = {}
    for rule in MESH_OF_ONE_RULES:
        models = {}
        for name in ("whole", "sharded"):
            torch.manual_seed(0)
            with device:
                models[name] = GPT(GPTConfig(**config))
        fsdp.shard_model(models["sharded"], mesh)
        optimizers = {name: optimizer_for(rule, model) for name, model in models.items()}
        generator = torch.Generator(device).manual_seed(1)
        times, peaks = {name: [] for name in models}, []
        for step in range(MESH_OF_ONE_STEPS):
            for whole, sharded in zip(models["whole"].parameters(), models["sharded"].parameters()):
                whole.grad = torch.randn(whole.shape, generator=generator, device=device)
                sharded.grad = distribute_tensor(whole.grad, mesh, sharded.placements)
            for name, optimizer in optimizers.items():
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                start_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                seconds = timed_step(optimizer, device, ranks=False)
                if step:  # the first step allocates the state
                    times[name].append(seconds)
                    if name == "sharded" and device.type == "cuda":
                        peaks.append(torch.cuda.max_memory_allocated(device) - start_bytes)
        lr = optimizers["whole"].param_groups[0]["lr"]
        difference = max(
            (whole.detach() - sharded.detach().full_tensor()).abs().max().item()
            for whole, sharded in zip(models["whole"].parameters(), models["sharded"].parameters())
        )
        shapes = [
            tuple(p.shape)
            for group in optimizers["whole"].param_groups
            for p in group["params"]
            if mars.update_rule(p, group) in mars.NEWTON_SCHULZ_RULES
        ]
        iteration_bytes = mars.newton_schulz_dtype(device).itemsize
        results[rule] = dict(
            sharded_ms=statistics.median(times["sharded"]) * 1e3,
            whole_ms=statistics.median(times["whole"]) * 1e3,
            difference=difference / lr,
            peak_bytes=max(peaks) if peaks else None,
            planned_bytes=max(memory_plan.owner_exchange_bytes(shapes, 1, 4, iteration_bytes)),
        )
    parameters = sum(p.numel() for p in models["whole"].parameters())
    return dict(rules=results, parameters=parameters)


def mesh_of_one_rows(results, device="1 GPU"):
    """mesh_of_one's results as table rows: per rule its time, its parameters against the unsharded step's, and
    its peak memory against the plan (CUDA)."""
    rows = []
    setting = f"{results['parameters'] / 1e6:.1f}M params, fp32, {device}, median of {MESH_OF_ONE_STEPS - 1} steps"
    for rule, measured in results["rules"].items():
        what = f"{rule} step on a mesh of one (the owner exchange)"
        rows.append(
            row(f"{what} vs the unsharded step", measured["sharded_ms"], measured["whole_ms"], "ms", note=setting)
        )
        rows.append(
            row(
                f"{what}: its parameters against the unsharded step's",
                measured["difference"],
                unit="lr",
                ratio=measured["difference"],
                target=MESH_OF_ONE_EQUALITY_TARGET,
                note=f"max |difference| per unit of lr after {MESH_OF_ONE_STEPS} steps of the same gradients",
            )
        )
        planned = measured["planned_bytes"] / 2**20
        peak = measured["peak_bytes"]
        rows.append(
            row(
                f"{what}: peak memory beyond the state vs the plan",
                float("nan") if peak is None else peak / 2**20,
                planned,
                "MiB",
                ratio=None if peak is None else peak / 2**20 / planned,
                target=MEMORY_TARGET,
                note="memory_plan.owner_exchange_bytes; " + ("CUDA's allocator" if peak else "measured on CUDA only"),
            )
        )
    return rows


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
    rows.append(
        row(
            f"FSDP2 {MARS_M_BFLOAT16} step vs FSDP2 mars-m step",
            times[MARS_M_BFLOAT16] * 1e3,
            times["mars-m"] * 1e3,
            unit="ms",
            note="Newton-Schulz in bfloat16 as on GPUs (a CPU computes bfloat16 products slowly)",
        )
    )
    for name in ("adamw", *RULES, MARS_M_BFLOAT16, *MUONS):
        sent_bytes, calls = sent[name]
        by_call = ", ".join(f"{k} x{n}: {amount(sent_bytes.get(k, 0))}" for k, n in sorted(calls.items()))
        rows.append(
            row(f"FSDP2 {name} step: bytes sent per rank", sum(sent_bytes.values()) / 2**10, unit="KiB", note=by_call)
        )
    float32, bfloat16 = (sent[name][0].get("alltoall_base_", 0) for name in ("mars-m", MARS_M_BFLOAT16))
    rows.append(
        row(
            "FSDP2 mars-m step: all-to-all bytes with results back in bfloat16 vs in float32",
            bfloat16 / 2**10,
            float32 / 2**10,
            unit="KiB",
            note="rank 0's rows out in float32 both ways; back in bfloat16 where Newton-Schulz ran in it",
        )
    )
    return rows + timeline_rows(results["timeline"])


def amount(n_bytes):
    return f"{n_bytes:,} bytes" if n_bytes < 2**10 else f"{n_bytes / 2**10:,.1f} KiB"


def timeline_rows(timeline):
    """How much of the exchange the timeline's step hid behind Newton-Schulz: the all-to-alls' time from start to
    use, less the time the rank waited for them, against that time."""
    exchange = sum(end - start for name, _, start, end in timeline if name in ("to owners", "back"))
    waiting = sum(end - start for name, _, start, end in timeline if name == "waiting")
    newton_schulz = sum(end - start for name, _, start, end in timeline if name == "Newton-Schulz")
    buckets = len({bucket for name, bucket, *_ in timeline if name == "Newton-Schulz"})
    step = timeline[-1][3]
    return [
        row(
            f"FSDP2 mars-m step in {buckets} buckets: all-to-all time hidden behind other work",
            100 * (1 - waiting / exchange) if exchange else float("nan"),
            unit="%",
            note=f"rank 0: all-to-alls {exchange:.1f} ms from start to use, {waiting:.1f} ms of it waited for; "
            f"Newton-Schulz {newton_schulz:.1f} ms of the {step:.1f} ms step",
        )
    ]


def timeline_table(timeline):
    """The timeline as lines: each phase with its bucket, start and end (ms), and a bar on a 60-column scale."""
    step = timeline[-1][3] or 1.0
    lines = [f"{'phase':<14} {'bucket':>6} {'start':>8} {'end':>8}  0 .. {step:.1f} ms"]
    for name, bucket, start, end in timeline:
        left, right = round(60 * start / step), max(round(60 * end / step), round(60 * start / step) + 1)
        mark = {"to owners": ">", "back": "<", "waiting": "w", "Newton-Schulz": "#"}.get(name, "-")
        bucket = "" if bucket is None else bucket
        lines.append(f"{name:<14} {bucket:>6} {start:8.2f} {end:8.2f}  {' ' * left}{mark * (right - left)}")
    return lines


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


def exchange_plan_rows():
    """The Newton-Schulz exchange's planned peak on its fullest rank (memory_plan.owner_exchange_bytes, which
    tests/test_memory_plan.py holds to 8 gloo ranks' measured peaks) for GPT-2 XL on 8 ranks: in the default
    buckets against all at once, with Newton-Schulz in bfloat16 (GPUs) and in float32 (CPUs)."""
    from marsgpt import memory_plan
    from marsgpt.config import TrainConfig
    from model import model_args_from_config

    rows = []
    for rule in ("mars-m", "mars-shampoo"):
        cfg = TrainConfig(optimizer=rule, n_layer=48, n_head=25, n_embd=1600)
        layout = memory_plan.optimizer_layout(cfg, model_args_from_config(cfg))
        shapes = [e.newton_schulz for e in layout.planned_parameters if e.newton_schulz is not None]
        for where, iteration_bytes in (("GPUs, bfloat16 Newton-Schulz", 2), ("CPUs, float32", 4)):
            peak, at_once = (
                max(memory_plan.owner_exchange_bytes(shapes, 8, 4, iteration_bytes, mib)) / 2**30
                for mib in (None, float("inf"))
            )
            rows.append(
                row(
                    f"Newton-Schulz exchange, GPT-2 XL {rule} on 8 {where}: fullest rank, buckets vs all at once",
                    peak,
                    at_once,
                    unit="GiB",
                    target="<= 1 GiB",
                    note=f"planned; {len(shapes)} matrices in buckets of {mars_sharded.BUCKET_MIB} MiB per owner",
                )
            )
    return rows


# The Newton-Schulz exchange's memory, measured (--exchange, and tests/test_memory_plan.py): GPT-2 XL's matrices
# divided by XL_SCALE in both dimensions (48 layers of width 200, a 6,288-token vocabulary) on 8 gloo ranks. Every
# byte the exchange holds scales by XL_SCALE² exactly, and so does the bucket, so the buckets, owners and column
# blocks are XL's own: XL's peak is XL_SCALE² times this.

XL_SCALE = 8
EXCHANGES = {  # optimizer, bucket (MiB, at XL), the dtype Newton-Schulz runs in (bfloat16: as on a GPU)
    "mars-shampoo": ("mars-shampoo", None, torch.float32),
    "mars-shampoo, bfloat16 Newton-Schulz": ("mars-shampoo", None, torch.bfloat16),
    "mars-m": ("mars-m", None, torch.float32),
    "mars-shampoo, all in one bucket": ("mars-shampoo", float("inf"), torch.float32),
}


def xl_model_args(optimizer, scale):
    """(TrainConfig, GPTConfig's fields) of GPT-2 XL with `optimizer`, both dimensions divided by `scale`."""
    import dataclasses

    from marsgpt.config import TrainConfig
    from model import model_args_from_config

    cfg = dataclasses.replace(TrainConfig(), optimizer=optimizer, n_layer=48, n_head=25, n_embd=1600 // scale)
    return cfg, model_args_from_config(dataclasses.replace(cfg, block_size=1024 // scale), 50304 // scale)


def planned_exchange(optimizer, bucket_mib, dtype, scale):
    """Each rank's planned bytes of the exchange for XL / scale on 8 ranks (the bucket scaled with the bytes)."""
    from marsgpt import memory_plan

    cfg, model_args = xl_model_args(optimizer, scale)
    shapes = [
        e.newton_schulz for e in memory_plan.optimizer_layout(cfg, model_args).planned_parameters if e.newton_schulz
    ]
    bucket = (bucket_mib or mars_sharded.BUCKET_MIB) / scale**2
    return memory_plan.owner_exchange_bytes(shapes, 8, 4, dtype.itemsize, bucket)


def exchange_worker(rank, world, store, report):
    """Each case's allocator peak of one optimizer step (after a first that allocates the state) on this rank
    (tests/allocator.py's: the profiler's allocation events)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from allocator import allocator_peak

    from marsgpt import fsdp
    from marsgpt.parallel import Parallelism
    from marsgpt.runtime import Dist
    from marsgpt.training_optimizer import build_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    # gloo's worker thread lets go of an all-to-all's buffers a moment after the wait returns: a wait of 10 ms
    # after each puts every free where the step drops the buffer (on NCCL the wait itself releases them)
    wait = mars_sharded._Transfer.wait

    def paced(transfer):
        received = wait(transfer)
        time.sleep(0.01)
        return received

    mars_sharded._Transfer.wait = paced
    peaks = {}
    for name, (optimizer, bucket_mib, dtype) in EXCHANGES.items():
        cfg, model_args = xl_model_args(optimizer, XL_SCALE)
        torch.manual_seed(0)
        model = fsdp.shard_model(GPT(GPTConfig(**model_args)), fsdp.device_mesh("cpu", world, 1))
        opt = build_optimizer(model, cfg, Parallelism(Dist(torchrun=True, rank=rank, world_size=world), zero_stage=3))
        for group in opt.param_groups:
            group["exchange_bucket_mib"] = (bucket_mib or mars_sharded.BUCKET_MIB) / XL_SCALE**2
        x = torch.randint(0, model_args["vocab_size"], (1, 16))
        model(x, x)[1].backward()
        with newton_schulz_in(dtype):
            peaks[name] = allocator_peak(opt.step)
    torch.save(peaks, f"{report}.{rank}")
    dist.destroy_process_group()


def exchange_peaks(world=8):
    """{case: [each rank's measured peak]} of EXCHANGES on `world` gloo ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(exchange_worker, args=(world, os.path.join(tmp, "store"), os.path.join(tmp, "report")), nprocs=world)
        reports = [torch.load(os.path.join(tmp, f"report.{rank}")) for rank in range(world)]
    return {case: [report[case] for report in reports] for case in EXCHANGES}


def exchange_rows(peaks):
    """exchange_peaks' measurements against the plan, per case: the fullest rank, and the largest gap on any rank."""
    rows = []
    for case, measured in peaks.items():
        planned = planned_exchange(*EXCHANGES[case], XL_SCALE)
        gap = max(abs(m - p) / p for m, p in zip(measured, planned))
        rows.append(
            row(
                f"Newton-Schulz exchange, GPT-2 XL / {XL_SCALE} on {len(measured)} gloo ranks, {case}: fullest rank",
                max(measured) / 2**20,
                max(planned) / 2**20,
                unit="MiB",
                target="<= 1.1",
                note=f"measured vs planned; every rank within {100 * gap:.2f}% of its plan; x{XL_SCALE**2} at XL: "
                f"{max(measured) * XL_SCALE**2 / 2**30:.2f} GiB",
            )
        )
    return rows


def run(quick=False, timeline=None):
    """The table; timeline: a list that receives the timeline's lines (timeline_table)."""
    rounds = 3 if quick else 7
    results = mp.Manager().dict()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(worker, args=(2, store, quick, rounds, results), nprocs=2, join=True)
    if timeline is not None:
        timeline += timeline_table(results["timeline"])
    return step_rows(dict(results)) + owner_rows() + exchange_plan_rows()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--exchange", action="store_true", help="only the exchange's memory on 8 ranks, against the plan")
    if p.parse_args().exchange:
        print_table(exchange_rows(exchange_peaks()))
        raise SystemExit(0)
    lines = []
    print_table(run(quick=p.parse_args().quick, timeline=lines))
    print("\nrank 0's MARS-M step, phase by phase (> to the owners, # Newton-Schulz, < back, w waiting):")
    print("\n".join(lines))
