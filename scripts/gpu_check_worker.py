"""The measurements scripts/gpu_check.py takes inside a fresh process, each written as JSON to RESULT.json.

    python -m scripts.gpu_check_worker warm RESULT.json                       # load everything, wake every GPU
    python -m scripts.gpu_check_worker device RESULT.json                     # torch, CUDA and the GPUs
    python -m scripts.gpu_check_worker optimizer RESULT.json [N_EMBD]         # bench/bench_mars.py's rows
    python -m scripts.gpu_check_worker memory RESULT.json [train.py args]     # peak memory of 2 steps
    python -m torch.distributed.run --standalone --nproc_per_node=1 \\
        -m scripts.gpu_check_worker compiled RESULT.json STEPS PROFILED [train.py args]  # compiled, under DDP
    python -m torch.distributed.run --standalone --nproc_per_node=N \\
        -m scripts.gpu_check_worker fsdp RESULT.json cuda|cpu               # bench_fsdp's sharded steps
    python -m torch.distributed.run --standalone --nproc_per_node=1 \\
        -m scripts.gpu_check_worker mesh_of_one RESULT.json cuda|cpu        # the sharded step on one GPU

A process of its own for each: a crash or an out-of-memory error ends only that measurement, the CUDA
peak-memory counters start from zero, and the driver can kill it when its time budget runs out.
"""

import contextlib
import functools
import gzip
import json
import math
import os
import re
import resource
import shutil
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from marsgpt.files import atomic_writer
from marsgpt.runtime import exit_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MEMORY_STEPS = 2
# The compiled run: a first step (the training graph's compile) and an evaluation (the evaluation graph's),
# a second step, then the timed steps with recompiles forbidden.
WARM_UP_STEPS = 2
# What the device ran in a step, by kind: the first pattern a kernel's name matches (in lower case) names its kind.
# On the CPU the names are the operators torch.profiler sees at the top level.
KERNEL_KINDS = (
    ("NCCL", r"nccl"),
    ("copies", r"memcpy|memset|^aten::copy_|^aten::to\b"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|^aten::(mm|addmm|bmm|matmul|linear)$"),
    ("attention", r"flash|fmha|cudnn|attention"),
    ("MARS kernel", r"^(norm_pass|update_pass)"),
    ("multi-tensor (optimizer step, clipping)", r"multi_tensor|fused_adam|^aten::_foreach|^aten::_fused"),
    ("inductor's fused", r"^triton_|^cpp_fused|compiled"),
    ("other", r""),
)
TOP_KERNELS = 8  # the kernels a profile names, by their summed time
# --device=cpu compiles with dynamo's aot_eager backend: dynamo's graphs, graph breaks and recompiles are the
# same with any backend, and inductor's C++ kernels take minutes to build on a shared CPU.
CPU_COMPILE_BACKEND = "aot_eager"
# The attention ops SDPA dispatches to, by the kernel they are; none of them in a forward pass: the math kernel.
ATTENTION_KERNELS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "memory-efficient",
    "_scaled_dot_product_cudnn_attention": "cuDNN",
    "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
}
MATH_KERNEL = "math"


def warm_up(devices):
    """What every check loads, loaded before the timed device read: the repository's modules (torch and its
    CUDA libraries with them) and, on each device, a context and cuBLAS's handle (a matmul). On a cold node
    the first of these take tens of seconds (a network file system, CUDA's lazy loading); the checks after
    them then start warm."""
    t0 = time.perf_counter()
    import train  # noqa: F401  (its imports are the point)

    imported_s = time.perf_counter() - t0
    for device in devices:
        x = torch.ones(256, 256, device=device)
        (x @ x).sum().item()
    return dict(import_s=imported_s, devices=list(devices), seconds=time.perf_counter() - t0)


def device_info():
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, gpus=torch.cuda.device_count())
    if info["gpus"]:
        props = torch.cuda.get_device_properties(0)
        # including_emulation=False: a V100 or T4 emulates bfloat16 (slowly); it counts as without
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        info.update(name=props.name, memory_bytes=props.total_memory, bf16=bf16)
    return info


def bench_mars_rows(n_embd=None):
    """bench/bench_mars.py's own table (its public entry point); gpu_check.optimizer_rows reads it. A
    width (n_embd) is gpu_check --device=cpu's tiny run, on one thread: tiny compiled steps spend far
    longer waiting for CPU threads that other processes hold than computing."""
    from bench import bench_mars

    if n_embd is None:
        return dict(rows=bench_mars.run(quick=True))
    torch.set_num_threads(1)
    return dict(rows=bench_mars.run(quick=True, n_embd=n_embd))


def memory_plan(cfg, world_size):
    """The memory plan's per-GPU estimate for this run (memory_plan.plan, what train.py prints at its start).
    A plan that cannot be computed is reported in the row."""
    from marsgpt import memory_plan as plans

    try:
        return dict(plan_bytes=int(plans.plan(cfg, world_size=world_size).total_bytes), plan_note="")
    except Exception as e:  # the row says why and fails
        return dict(plan_bytes=None, plan_note=f"memory_plan.plan failed: {type(e).__name__}: {e}", plan_error=True)


@contextlib.contextmanager
def models_built_on(device):
    """train.setup builds its GPT on `device` rather than on the CPU: its initialisation (torch's reset of each
    Linear, then GPT-2's normal_ over every weight) runs there, in milliseconds on a GPU, where on a CPU it
    takes over a minute for GPT-2 XL, and nothing is copied over afterwards. The values are not train.py's
    (another generator draws them): what is measured here, memory and speed, does not depend on them."""
    from marsgpt import launch

    build = launch.GPT

    def on_device(config):
        with torch.device(device):
            return build(config)

    launch.GPT = on_device
    try:
        yield
    finally:
        launch.GPT = build


@contextlib.contextmanager
def compiled_by(backend):
    """torch.compile, which train.setup calls, with `backend` (None: its default, inductor)."""
    compile_model = torch.compile
    if backend is not None:
        torch.compile = functools.partial(compile_model, backend=backend)
    try:
        yield
    finally:
        torch.compile = compile_model


def cuda_memory(device):
    torch.cuda.synchronize(device)
    return dict(
        peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
        peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
        total_bytes=torch.cuda.get_device_properties(device).total_memory,
    )


def host_memory():
    return dict(peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux


def peak_memory(train_argv):
    """Peak memory over MEMORY_STEPS optimizer steps of the run train_argv configures.

    The run is built by train.setup (its model on the GPU, models_built_on) and stepped by train.train_step,
    what train.main runs between evaluations, without the evaluations and checkpoints (a GPT-2 XL MARS
    checkpoint is about 25 GB). On CUDA the peak is torch.cuda.max_memory_allocated; on CPU the process's
    peak resident set.
    """
    import train  # here, not at the top: the device read imports torch alone and answers in seconds
    from marsgpt.config import load_config

    cfg = load_config(train_argv)
    dist_info = train.setup_distributed(cfg)
    with models_built_on(dist_info.device):
        run, _, _ = train.setup(cfg, dist_info)
    result = dict(device=dist_info.device, steps=0, oom="")
    try:
        for it in range(MEMORY_STEPS):
            train.train_step(run, it)
            result["steps"] += 1
    except torch.OutOfMemoryError as e:
        result["oom"] = str(e).strip().splitlines()[0]
    finally:
        run.metrics.close()
    result.update(cuda_memory(dist_info.device) if dist_info.device_type == "cuda" else host_memory())
    result.update(memory_plan(cfg, dist_info.world_size))
    return result


class OpCensus(TorchDispatchMode):
    """The names of the aten ops run while it is active (after autograd: a backward's too)."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def attention_kernel(run):
    """Which kernel the model's attention dispatches to for a training forward pass of one sequence in the
    run's precision: the aten op SDPA chose, as the op census of the uncompiled model sees it (the compiled
    graph calls the op SDPA chose when it was traced)."""
    x, y = run.val_batches[0]
    x, y = x[:1].to(run.dist.device), y[:1].to(run.dist.device)
    with OpCensus() as census, run.autocast:
        run.model(x, y, return_logits=False)
    fused = [ATTENTION_KERNELS[op] for op in sorted(census.ops) if op in ATTENTION_KERNELS]
    return fused[0] if fused else MATH_KERNEL


def busy_union(spans):
    """The time (µs) covered by at least one of the (start, end) spans: overlapping kernels (streams) count once."""
    busy, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def kernel_kind(name):
    return next(kind for kind, pattern in KERNEL_KINDS if re.search(pattern, name.lower()))


def profile_summary(spans):
    """spans: (name, start_us, end_us) of what the device ran over the profiled steps. How long from the first start
    to the last end, the share of it the device was busy (a gap is the device waiting for the host), each kind's
    share of the summed kernel time (KERNEL_KINDS) and the TOP_KERNELS largest kernels."""
    if not spans:
        return None
    first, last = min(start for _, start, _ in spans), max(end for _, _, end in spans)
    summed, by_name = {}, {}
    for name, start, end in spans:
        kind = kernel_kind(name)
        summed[kind] = summed.get(kind, 0.0) + end - start
        total, calls = by_name.get(name, (0.0, 0))
        by_name[name] = (total + end - start, calls + 1)
    all_time = sum(summed.values()) or 1.0
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    return dict(
        span_s=(last - first) / 1e6,
        busy=busy_union([(start, end) for _, start, end in spans]) / max(last - first, 1e-9),
        kinds={kind: summed.get(kind, 0.0) / all_time for kind, _ in KERNEL_KINDS if kind in summed},
        top=[dict(name=name[:100], ms=total / 1e3, calls=calls) for name, (total, calls) in top],
    )


def profile_steps(run, first_iter, count, trace_path):
    """`count` more steps under torch.profiler: on CUDA what the GPU ran (its kernels, copies and collectives; the
    host's operators are left out, so the profiler's own host time does not open gaps), on the CPU its top-level
    operators. Returns profile_summary with the steps and the trace, written gzipped to trace_path (Perfetto and
    chrome://tracing read it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    import train

    cuda = run.dist.device_type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for it in range(first_iter, first_iter + count):
            train.train_step(run, it)
        if cuda:
            torch.cuda.synchronize(run.dist.device)
    if cuda:
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        events = [e for e in prof.events() if e.cpu_parent is None]
    summary = profile_summary([(e.name, e.time_range.start, e.time_range.end) for e in events])
    plain = trace_path.removesuffix(".gz")
    prof.export_chrome_trace(plain)
    with open(plain, "rb") as source, gzip.open(trace_path, "wb") as target:
        shutil.copyfileobj(source, target)
    os.remove(plain)
    return summary and dict(summary, steps=count, trace=trace_path)


def compiled_run(steps, train_argv, profiled=0, result_path=None):
    """The path a paper run takes on a GPU, as train.main takes it: train.setup's compiled model under DDP
    (launched by torchrun, one rank), its first step and first evaluation (each compiles its graphs), a second
    step, then `steps` timed steps and an evaluation with recompiles forbidden
    (torch.compiler.set_stance("fail_on_recompile")). TORCH_LOGS (set by gpu_check) logs every recompile and
    graph break; dynamo's counters count the graphs and the breaks. Returns the compile seconds, the graphs,
    the breaks, tokens/s, MFU as train.py logs it, peak memory beside the memory plan train.py printed, and
    which attention kernel ran; a recompile or an out-of-memory error ends the timed steps and is reported.
    The run's compile_cache.bin (marsgpt/compile_cache.py) is written after the timed steps, as train.py writes it
    with a checkpoint. steps=0: the compile seconds alone, after loading the compile_cache.bin in out_dir, if any
    (gpu_check's second run: a requeued job on another node). Both count the graphs inductor compiled and those it
    found in its cache. profiled > 0: that many steps more under torch.profiler (profile_steps) once the result so
    far is written to result_path, so that a profile cut short by the time budget leaves the measurements; its
    trace goes beside it (<result>_trace.json.gz)."""
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel

    import train
    from marsgpt.compile_cache import CompileCache, compile_counts
    from marsgpt.config import load_config

    cfg = load_config(train_argv)
    dist_info = train.setup_distributed(cfg)
    torch._dynamo.reset()
    counters.clear()
    if not steps:
        CompileCache(cfg.out_dir, dist_info.device, announce=dist_info.is_master).load()
    backend = CPU_COMPILE_BACKEND if dist_info.device_type == "cpu" else None
    with models_built_on(dist_info.device), compiled_by(backend):
        run, _, _ = train.setup(cfg, dist_info)
    result = dict(
        device=dist_info.device,
        world_size=dist_info.world_size,
        ddp=isinstance(run.train_model, DistributedDataParallel),
        compiled=run.compiled,
        backend=backend or "inductor",
        tokens_per_step=run.tokens_per_step,
        steps=0,
        error="",
    )
    try:
        t0 = time.perf_counter()
        train.train_step(run, 0)
        result["first_step_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        train.evaluate(run, run.val_batches)
        result["eval_s"] = time.perf_counter() - t0
        if not steps:
            run.metrics.close()
            return dict(result, graphs=counters["stats"]["unique_graphs"], **compile_counts())
        for it in range(1, WARM_UP_STEPS):
            train.train_step(run, it)
        result["graphs_after_warm_up"] = counters["stats"]["unique_graphs"]
        with torch.compiler.set_stance("fail_on_recompile"):
            t0 = time.perf_counter()
            for it in range(WARM_UP_STEPS, WARM_UP_STEPS + steps):
                result["skipped"] = result.get("skipped", 0) + train.train_step(run, it).skipped
                result["steps"] += 1
            step_s = (time.perf_counter() - t0) / steps
            train.evaluate(run, run.val_batches)
        if run.directory.checkpoints.compile_cache is not None:
            run.directory.checkpoints.compile_cache.save(WARM_UP_STEPS + steps)
        mfu, mfu_llmc = train.step_mfu(run, step_s)
        result.update(
            step_s=step_s,
            tokens_per_sec=run.tokens_per_step / step_s,
            mfu=None if mfu is None else mfu * 100,
            mfu_llmc=None if mfu_llmc is None else mfu_llmc * 100,
        )
    except RuntimeError as e:  # a recompile under the stance, out of memory
        result["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    result.update(
        **compile_counts(),
        graphs=counters["stats"]["unique_graphs"],
        graph_breaks={reason: count for reason, count in counters["graph_break"].items()},
        attention_kernel=attention_kernel(run),
        deterministic=cfg.deterministic,
        plan_bytes=run.memory_plan.total_bytes,
    )
    result.update(cuda_memory(dist_info.device) if dist_info.device_type == "cuda" else host_memory())
    if profiled and not result["error"]:
        write_result(result_path, result)
        trace_path = f"{result_path.removesuffix('.json')}_trace.json.gz"
        with torch.compiler.set_stance("fail_on_recompile"):
            result["profile"] = profile_steps(run, WARM_UP_STEPS + steps, profiled, trace_path)
    run.metrics.close()
    return result


# The sharded steps' rounds (after one warm-up round): each a forward, backward and step per optimizer
FSDP_ROUNDS = 5


@contextlib.contextmanager
def bench_ranks(device_type):
    """The process group of the ranks torchrun started, for bench/bench_fsdp.py: on CUDA one GPU per rank over
    NCCL and GPT-2 small's shapes, on the CPU gloo ranks and the bench's quick shapes. Yields (device, config)."""
    import torch.distributed as dist

    from bench import bench_fsdp

    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        config = bench_fsdp.GPT2_SMALL
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        config = bench_fsdp.SIZES[True]
    try:
        yield device, config
    finally:
        dist.destroy_process_group()


def fsdp_steps(device_type):
    """bench/bench_fsdp.py's measure on the ranks torchrun started (bench_ranks). Rank 0 returns the bench's rows,
    the others None."""
    from bench import bench_fsdp

    with bench_ranks(device_type) as (device, config):
        results = bench_fsdp.measure(config, FSDP_ROUNDS, device)
    if results is None:
        return None
    where = f"{results['world']} {'GPU' if device_type == 'cuda' else 'gloo rank'}{'s' * (results['world'] > 1)}"
    return dict(rows=bench_fsdp.step_rows(results, where), world=results["world"])


def mesh_of_one_steps(device_type):
    """bench/bench_fsdp.py's mesh_of_one in the one process torchrun started (bench_ranks): MARS-Shampoo's and
    MARS-M's sharded step on a mesh of one against the unsharded step, as rows."""
    from bench import bench_fsdp

    with bench_ranks(device_type) as (device, config):
        results = bench_fsdp.mesh_of_one(config, device)
    return dict(rows=bench_fsdp.mesh_of_one_rows(results, "1 GPU" if device_type == "cuda" else "1 gloo rank"))


KINDS = ("warm", "device", "optimizer", "memory", "compiled", "fsdp", "mesh_of_one")


def main(argv):
    if len(argv) < 2 or argv[0] not in KINDS:
        print(f"error: usage: gpu_check_worker.py {'|'.join(KINDS)} RESULT.json [train.py args]", file=sys.stderr)
        return 2
    kind, result_path, rest = argv[0], argv[1], argv[2:]
    if kind == "warm":
        count = torch.cuda.device_count()
        result = warm_up([f"cuda:{i}" for i in range(count)] if count else ["cpu"])
    elif kind == "memory":
        result = peak_memory(rest)
    elif kind == "compiled":
        result = compiled_run(int(rest[0]), rest[2:], profiled=int(rest[1]), result_path=result_path)
    elif kind == "fsdp":
        result = fsdp_steps(rest[0])
    elif kind == "mesh_of_one":
        result = mesh_of_one_steps(rest[0])
    elif kind == "optimizer":
        result = bench_mars_rows(*(int(n) for n in rest))
    else:
        result = device_info()
    write_result(result_path, result)
    return 0


def write_result(path, result):
    if os.environ.get("RANK", "0") == "0":
        with atomic_writer(path, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
