"""Where a run executes: the device, the process group, the autocast precision, determinism, how ranks
take setup decisions together, and whether the network can be reached.

train.py, sample.py and marsgpt/hellaswag.py share these, so "auto" means the same device and dtype everywhere.
"""

import contextlib
import dataclasses
import datetime
import math
import os
import pathlib
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

# The cuBLAS workspace torch.use_deterministic_algorithms requires on CUDA (about 24 MiB of GPU memory; ":16:8",
# the other accepted value, may be slower).
DETERMINISTIC_CUBLAS_WORKSPACE = ":4096:8"


class SetupError(ValueError):
    """The run cannot start here: a device or world size that does not fit the machine, or a setup step that
    failed on some rank (every rank then raises the same one, so they all exit together). A ValueError, as the
    tools after training catch it."""


@dataclasses.dataclass
class Dist:
    torchrun: bool = False  # launched by torchrun (even with one process): a process group of the ranks
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def device_type(self):
        return torch.device(self.device).type

    @property
    def is_master(self):
        return self.rank == 0


def resolve_device(device, torchrun=False, local_rank=0):
    """The torch device string a rank runs on: 'cpu', 'mps' or 'cuda:<index>'.

    'auto' is CUDA when present. Under torchrun each rank takes cuda:LOCAL_RANK, so an explicit
    'cuda:N' there is refused rather than silently ignored; without torchrun 'cuda' is cuda:0 (the first
    GPU CUDA_VISIBLE_DEVICES leaves visible) and 'cuda:N' is honoured.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "mps" and not torch.backends.mps.is_available():
        raise SetupError(
            "device='mps' but MPS is not available (this torch build or machine has none); use --device=cpu"
        )
    if not device.startswith("cuda"):
        return device
    if not torch.cuda.is_available():
        raise SetupError(f"device={device!r} but CUDA is not available; use --device=cpu")
    if torchrun:
        if device != "cuda":
            raise SetupError(
                f"device={device!r} under torchrun: each rank uses cuda:LOCAL_RANK; give --device=cuda and "
                "choose the GPUs with CUDA_VISIBLE_DEVICES"
            )
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise SetupError(
                f"this node's rank LOCAL_RANK={local_rank} has no GPU: only {visible} CUDA device(s) are visible; "
                f"start at most --nproc_per_node={visible} ranks per node (or make more GPUs visible with "
                "CUDA_VISIBLE_DEVICES)"
            )
        return f"cuda:{local_rank}"
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise SetupError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return f"cuda:{index}"


def setup_distributed(cfg):
    """Dist for this process; joins the process group under torchrun (NCCL on CUDA, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.gradient_accumulation_steps % world_size:
        raise SetupError(
            f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} (micro-batches per step "
            f"across all ranks) is not divisible by the world size {world_size}; use a multiple "
            f"of {world_size} or a different number of processes"
        )
    torchrun = "RANK" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg.device, torchrun, local_rank)
    if device.startswith("cuda"):
        use_expandable_segments()
        if cfg.deterministic:
            # cuBLAS reads the variable when torch creates its handle, at the first cuBLAS call on a device:
            # it is in the environment before this process does any CUDA work.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS_WORKSPACE)
        torch.cuda.set_device(device)
    elif device == "cpu":
        note = choose_cpu_threads()
        if note and rank == 0:
            print(note, flush=True)
    info = Dist(torchrun=torchrun, rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    if torchrun:
        backend = cfg.backend
        if backend == "auto":
            backend = "nccl" if info.device_type == "cuda" else "gloo"
        # The timeout bounds every collective: when a rank dies or hangs the others fail with an error
        # after ddp_timeout_s instead of waiting forever. device_id binds NCCL's communicator to this
        # rank's GPU at once (no guessing of the device, no extra context on GPU 0).
        kwargs = {"device_id": torch.device(device)} if backend == "nccl" else {}
        if backend == "nccl":
            # What a timed-out NCCL collective does, chosen here rather than left to the torch version: with
            # 3 (torch's default) its watchdog thread ends the process (SIGABRT) once a collective has run
            # past the timeout. By then kernels may have used half-reduced data, so this rank must not go
            # on; checkpoints are renamed into place whole, so the newest finished one stays intact. A value
            # already set is kept: the user's, or the 1 torchrun sets when the user set none (it also ends
            # the process, after aborting the communicator). See docs/training.md.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=cfg.ddp_timeout_s), **kwargs)
    return info


def is_collective_timeout(error: BaseException, dist_info: Dist | None) -> bool:
    """Whether `error` is a gloo collective that waited ddp_timeout_s in vain. (A timed-out NCCL collective never
    raises one: its watchdog ends the process, as setup_distributed chooses; docs/training.md says why.)"""
    timed_out = isinstance(error, RuntimeError) and "timed out" in str(error).lower()
    return timed_out and dist_info is not None and dist_info.torchrun


def leave_process_group(dist_info: Dist | None, timed_out: bool) -> None:
    """Destroy the process group a torchrun launch joined, unless a collective timed out: then it cannot be torn
    down (destroying it waits on the dead peer) and exit_process leaves at once."""
    if dist_info is not None and dist_info.torchrun and dist.is_initialized() and not timed_out:
        dist.destroy_process_group()


# A cgroup's CPU quota and period, as cgroup v2 and v1 give them (in a container, its own cgroup is mounted here).
CPU_QUOTA_FILES = (
    ("/sys/fs/cgroup/cpu.max",),
    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
)


def usable_cpus():
    """The CPU numbers this process may run on (its affinity), and how many of them it may use at once: their
    count, capped by a cgroup CPU quota (a container's --cpus, SLURM's cgroup), which affinity does not show."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    for paths in CPU_QUOTA_FILES:
        try:
            quota, period = " ".join(pathlib.Path(path).read_text() for path in paths).split()  # "max 100000"
            cap = math.ceil(int(quota) / int(period)) if quota not in ("max", "-1") else None
        except (OSError, ValueError):
            continue
        return cpus, len(cpus) if cap is None else max(1, min(len(cpus), cap))
    return cpus, len(cpus)


def idle_cpus(cpus, seconds=0.25):
    """How many of the CPUs numbered `cpus` sat idle over the next `seconds` (their idle and iowait time in
    /proc/stat over the time that passed: 1.5 = one and a half CPUs' worth), or None without /proc/stat."""

    def counters():
        found = {}
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name[:3] == "cpu" and name[3:].isdigit() and int(name[3:]) in cpus:
                    times = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
                    found[name] = (times[3] + times[4], sum(times))
        return found

    try:
        before = counters()
        time.sleep(seconds)
        after = counters()
    except (OSError, ValueError):
        return None
    idle = 0.0
    for name, (idle_after, total_after) in after.items():
        idle_before, total_before = before.get(name, (idle_after, total_after))
        if total_after > total_before:
            idle += (idle_after - idle_before) / (total_after - total_before)
    return idle


def choose_cpu_threads():
    """torch's threads for a CPU run where the user has not chosen them (OMP_NUM_THREADS): at most one per CPU
    this process may use and other work leaves idle, measured over a quarter of a second. torch starts one per
    core, and its threads wait on each other at every operation: on 2 cores busy with other work, one step of
    the quickstart took 512 ms on 2 threads and 49 ms on 1 (README, "Threads"). Returns the line that says so
    when it lowers them, else None. Under torchrun each of a node's LOCAL_WORLD_SIZE processes gets its share."""
    threads = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS") or threads == 1:
        return None
    cpus, usable = usable_cpus()
    share = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    idle = idle_cpus(cpus)
    free = usable if idle is None else min(usable, round(idle))
    chosen = max(1, min(threads, free // share))
    if chosen == threads:
        return None
    torch.set_num_threads(chosen)
    if idle is not None and round(idle) < usable:
        why = f"{idle:.1f} of the {usable} CPUs it may use were idle (other work is running)"
    else:
        why = f"it may use {usable} CPUs (its affinity or a CPU quota)"
    per_process = f", shared by {share} processes" if share > 1 else ""
    return (
        f"note: {chosen} CPU thread{'s' if chosen > 1 else ''} instead of torch's {threads}: {why}{per_process}; "
        "set OMP_NUM_THREADS to choose"
    )


# The caching allocator's settings: the first variable is torch's current name, the second its older one.
ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def use_expandable_segments():
    """Let the CUDA caching allocator grow its segments instead of reserving new fixed-size blocks, unless the
    user configured the allocator: with fixed blocks a run's reserved memory sits well above what it
    allocates (8% on the GPT-2 XL memory calibration, against the plan's 10% headroom), and the difference is
    fragmentation that can end a run that fits. The allocator reads the setting at its first allocation, so
    this runs before the process touches CUDA."""
    if not any(os.environ.get(name) for name in ALLOCATOR_VARIABLES):
        os.environ[ALLOCATOR_VARIABLES[0]] = "expandable_segments:True"


def network_reachable(host, port=443, timeout=3.0):
    """True when a TCP connection to host:port opens within `timeout` seconds, name resolution included.

    Asked before any download so that a machine without internet (or behind a firewall that drops
    packets, where a plain request hangs for minutes) falls back to local files in seconds. The name is
    resolved in a thread of its own: getaddrinfo takes no timeout, and on a node whose DNS server does
    not answer it waits out the resolver's own retries (tens of seconds) before failing.
    """
    deadline = time.monotonic() + timeout
    addresses = []

    def resolve():
        with contextlib.suppress(OSError):
            addresses.extend(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))

    resolver = threading.Thread(target=resolve, name="network_reachable", daemon=True)
    resolver.start()
    resolver.join(timeout)
    if resolver.is_alive():  # left to finish on its own; as a daemon it never delays the exit
        return False
    for family, kind, proto, _, address in addresses:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        with socket.socket(family, kind, proto) as s:
            s.settimeout(remaining)
            try:
                s.connect(address)
                return True
            except OSError:
                continue
    return False


def add_device_arguments(parser):
    """--device and --dtype for the tools after training (sample.py, marsgpt/hellaswag.py), meaning what they mean
    to train.py."""
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N or mps")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="autocast dtype (auto: bfloat16 on CUDA where supported, else float16; float32 on CPU)",
    )


def exit_process(code):
    """End this process with `code`. A torchrun rank leaves without the interpreter's teardown, which DDP over
    gloo sometimes aborts, failing a finished run (docs/training.md, "Checkpoints and faults"). Everything is
    written and closed by the time a rank gets here."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a pipe its reader closed (`| tee log` ended by the same Ctrl-C): nothing more goes there
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())  # so the interpreter's own flush as it exits does not fail again
            os.close(devnull)
    if "RANK" in os.environ:
        os._exit(code)
    sys.exit(code)


# ---------------------------------------------------------------------------------------------------
# Precision and determinism.


def resolve_dtype(dtype, device_type):
    """'auto': bfloat16 where the GPU runs it natively (Ampere and later), else float16 (with loss scaling);
    float32 off CUDA."""
    if dtype != "auto":
        return dtype
    if device_type == "cuda":
        # Native bfloat16 only: torch counts emulation by default, and emulated bfloat16 (V100, T4) is slower
        # than float16 with a GradScaler.
        return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"
    return "float32"


def resolve_compile(compile_model, device_type):
    """Whether a run compiles its model (model.GPT.compile_blocks): compile=None means on CUDA only."""
    return compile_model if compile_model is not None else device_type == "cuda"


def autocast(device_type, dtype):
    """The autocast context for a resolved dtype name (a no-op for float32)."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=getattr(torch, dtype))


def setup_precision(dtype, device_type):
    """(autocast context, GradScaler) for a run: the scaler is enabled for float16 only."""
    dtype = resolve_dtype(dtype, device_type)
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls
        torch.backends.cudnn.allow_tf32 = True
    return autocast(device_type, dtype), torch.amp.GradScaler(device_type, enabled=dtype == "float16")


def set_deterministic(enabled, device_type):
    """Bit-reproducible CUDA kernels, at some speed: deterministic algorithms (cuBLAS needs a fixed
    workspace), and the math attention kernel, since flash and memory-efficient attention have
    non-deterministic backward passes. CPU runs are deterministic already."""
    if not enabled:
        return
    # setup_distributed has set it before CUDA started; this covers callers that come without it
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    if device_type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)


# ---------------------------------------------------------------------------------------------------
# Setup decisions every rank takes together. A rank that cannot read a file (no shared file system, a
# transient download failure) must not leave the others waiting in a collective until ddp_timeout_s:
# the outcome is exchanged, and every rank raises the same SetupError when any rank failed.


def agree(dist_info, fn, errors):
    """fn() on every rank; if it raised `errors` on any rank, SetupError (the lowest failing rank's) on all."""
    try:
        result, failure = fn(), None
    except errors as e:
        result, failure = None, str(e)
    if not dist_info.torchrun:
        if failure is not None:
            raise SetupError(failure)
        return result
    failures = [None] * dist_info.world_size
    dist.all_gather_object(failures, failure)
    for rank, message in enumerate(failures):
        if message is not None:
            prefix = f"rank {rank}: " if dist_info.world_size > 1 else ""
            raise SetupError(prefix + message)
    return result


def decide_on_master(dist_info, fn, errors):
    """fn() on rank 0 only, its result (or its error, as SetupError) on every rank."""
    if not dist_info.torchrun:
        return agree(dist_info, fn, errors)
    outcome = [None, None]
    if dist_info.is_master:
        try:
            outcome = [fn(), None]
        except errors as e:
            outcome = [None, str(e)]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise SetupError(outcome[1])
    return outcome[0]
