"""The measurements scripts/gpu_check.py takes inside a fresh process, each written as JSON to RESULT.json.

    python -m scripts.gpu_check_worker device RESULT.json                     # torch, CUDA and the GPUs
    python -m scripts.gpu_check_worker optimizer RESULT.json [N_EMBD]         # bench/bench_mars.py's rows
    python -m scripts.gpu_check_worker memory RESULT.json [train.py args]     # peak memory of 2 steps

A process of its own for each: a crash or an out-of-memory error ends only that measurement, the CUDA
peak-memory counters start from zero, and the driver can kill it when its time budget runs out.
"""

import json
import os
import resource
import sys

import torch

from marsgpt.files import atomic_writer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MEMORY_STEPS = 2


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


def peak_memory(train_argv):
    """Peak memory over MEMORY_STEPS optimizer steps of the run train_argv configures.

    The run is built by train.setup and stepped by train.train_step, what train.main runs between
    evaluations, without the evaluations and checkpoints (a GPT-2 XL MARS checkpoint is about 25 GB).
    On CUDA the peak is torch.cuda.max_memory_allocated; on CPU the process's peak resident set.
    """
    import train  # here, not at the top: the device read imports torch alone and answers in seconds
    from marsgpt.config import load_config

    cfg = load_config(train_argv)
    dist_info = train.setup_distributed(cfg)
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
    if dist_info.device_type == "cuda":
        torch.cuda.synchronize()
        result.update(
            peak_allocated_bytes=torch.cuda.max_memory_allocated(),
            peak_reserved_bytes=torch.cuda.max_memory_reserved(),
            total_bytes=torch.cuda.get_device_properties(dist_info.device).total_memory,
        )
    else:
        result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    result.update(memory_plan(cfg, dist_info.world_size))
    return result


def main(argv):
    if len(argv) < 2 or argv[0] not in ("device", "optimizer", "memory"):
        print("error: usage: gpu_check_worker.py device|optimizer|memory RESULT.json [train.py args]", file=sys.stderr)
        return 2
    kind, result_path, rest = argv[0], argv[1], argv[2:]
    if kind == "memory":
        result = peak_memory(rest)
    elif kind == "optimizer":
        result = bench_mars_rows(*(int(n) for n in rest))
    else:
        result = device_info()
    with atomic_writer(result_path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
