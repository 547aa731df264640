"""marsgpt/runtime.py: the device each launch path runs on, the process group's arguments, precision, determinism,
and setup decisions that every rank takes together. CUDA is simulated: the logic is what is tested."""

import multiprocessing
import os
import re
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
from train_helpers import ROOT, tiny_args

from bench.common import rendezvous
from marsgpt import runtime
from marsgpt.config import TrainConfig


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_mps_without_mps_is_a_clear_error():
    with pytest.raises(ValueError, match="device='mps' but MPS is not available"):
        runtime.resolve_device("mps")


@pytest.fixture
def fake_cuda(monkeypatch):
    """A machine with 4 visible GPUs as far as torch.cuda's queries go; set_device calls are recorded."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(str(device)))
    return calls


@pytest.mark.parametrize(
    "device, ddp, local_rank, expected",
    [
        ("auto", False, 0, "cuda:0"),  # python train.py on a GPU machine: an index set_device accepts
        ("cuda", False, 0, "cuda:0"),
        ("cuda:2", False, 0, "cuda:2"),  # one process on a chosen GPU
        ("cuda", True, 3, "cuda:3"),  # torchrun: the rank's own GPU
        ("auto", True, 1, "cuda:1"),
        ("cpu", True, 1, "cpu"),
    ],
)
def test_every_launch_path_gets_a_device_with_an_index(fake_cuda, device, ddp, local_rank, expected):
    assert runtime.resolve_device(device, ddp, local_rank) == expected


def test_explicit_gpu_under_torchrun_is_refused_not_ignored(fake_cuda):
    with pytest.raises(ValueError, match=r"device='cuda:1' under torchrun: each rank uses cuda:LOCAL_RANK"):
        runtime.resolve_device("cuda:1", torchrun=True, local_rank=0)


def test_a_gpu_that_is_not_there_is_refused(fake_cuda, monkeypatch):
    with pytest.raises(ValueError, match=r"device='cuda:4' but only 4 CUDA device\(s\) are visible"):
        runtime.resolve_device("cuda:4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="CUDA is not available; use --device=cpu"):
        runtime.resolve_device("cuda")


def test_single_gpu_process_sets_an_indexed_device(fake_cuda, monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    info = runtime.setup_distributed(TrainConfig(device="cuda"))
    assert (info.device, info.torchrun, fake_cuda) == ("cuda:0", False, ["cuda:0"])


def test_nccl_process_group_is_bound_to_the_rank_s_gpu(fake_cuda, monkeypatch):
    seen = {}
    monkeypatch.setattr(runtime.dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    info = runtime.setup_distributed(TrainConfig(device="auto", ddp_timeout_s=30))
    assert info.device == "cuda:1" and fake_cuda == ["cuda:1"]
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda:1")
    assert seen["timeout"].total_seconds() == 30
    seen.clear()
    runtime.setup_distributed(TrainConfig(device="cpu"))
    assert seen["backend"] == "gloo" and "device_id" not in seen


def test_auto_precision(monkeypatch):
    assert runtime.resolve_dtype("auto", "cpu") == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert runtime.resolve_dtype("auto", "cuda") == "float16"
    autocast, scaler = runtime.setup_precision("float32", "cpu")
    assert not scaler.is_enabled()
    autocast, scaler = runtime.setup_precision("bfloat16", "cpu")
    with autocast:
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_auto_precision_takes_float16_where_bfloat16_is_only_emulated(fake_cuda, monkeypatch):
    """A V100 or T4: torch.cuda.is_bf16_supported() says True by default because bfloat16 can be emulated
    there; auto takes float16 with a GradScaler instead, the faster of the two on such a GPU."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert runtime.resolve_dtype("auto", "cuda") == "float16"
    assert runtime.resolve_dtype("bfloat16", "cuda") == "bfloat16"  # asked for by name: the user's choice
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # Ampere on
    assert runtime.resolve_dtype("auto", "cuda") == "bfloat16"


def torchrun_env(monkeypatch, rank, local_rank, world_size):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))


@pytest.mark.parametrize("user_value", [None, "2"])
def test_nccl_timeout_handling_is_chosen_before_the_process_group_exists(fake_cuda, monkeypatch, user_value):
    """TORCH_NCCL_ASYNC_ERROR_HANDLING is read when the NCCL process group is created: it is in the
    environment by then, 3 (the watchdog ends the process) unless the user chose a value."""
    seen = {}
    monkeypatch.setattr(
        runtime.dist,
        "init_process_group",
        lambda **kwargs: seen.update(handling=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), **kwargs),
    )
    torchrun_env(monkeypatch, rank=1, local_rank=1, world_size=2)
    if user_value is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", user_value)
    runtime.setup_distributed(TrainConfig(device="cuda"))
    assert seen["backend"] == "nccl" and seen["handling"] == (user_value or "3")


def test_gloo_process_group_leaves_nccl_settings_alone(monkeypatch):
    seen = {}
    monkeypatch.setattr(runtime.dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    torchrun_env(monkeypatch, rank=0, local_rank=0, world_size=2)
    runtime.setup_distributed(TrainConfig(device="cpu"))
    assert seen["backend"] == "gloo" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ


@pytest.mark.parametrize("deterministic", [True, False])
def test_cublas_workspace_is_set_before_any_cuda_work(monkeypatch, deterministic):
    """cuBLAS reads CUBLAS_WORKSPACE_CONFIG when torch creates its handle, so the variable must be set before
    the process touches the GPU: setup_distributed's set_device is its first CUDA call."""
    cuda_calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        torch.cuda,
        "set_device",
        lambda device: cuda_calls.append(("set_device", os.environ.get("CUBLAS_WORKSPACE_CONFIG"))),
    )
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    runtime.setup_distributed(TrainConfig(device="cuda", deterministic=deterministic))
    assert cuda_calls == [("set_device", ":4096:8" if deterministic else None)]


def test_network_check_bounds_name_resolution(monkeypatch):
    """An air-gapped node whose DNS server never answers: getaddrinfo alone would wait out the resolver's
    retries; the check gives up within its timeout."""
    answered = threading.Event()

    def unanswered_lookup(*args, **kwargs):
        answered.wait(20)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", unanswered_lookup)
    start = time.monotonic()
    try:
        assert not runtime.network_reachable("huggingface.co", timeout=0.5)
        assert time.monotonic() - start < 15  # the resolver alone would take 20 s; a loaded machine is slower
    finally:
        answered.set()  # the resolver thread ends


def test_network_check_connects_where_something_listens():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert runtime.network_reachable("127.0.0.1", port, timeout=2)
    assert not runtime.network_reachable("127.0.0.1", port, timeout=2)  # nothing listens any more: refused


def gloo_rank(rank, rendezvous_env, peer, timeout_s, report):
    """Both ranks all-reduce once; then rank 1 (the peer) 'hangs' (never joins another collective) or 'dies'
    (exits), and rank 0 reports what its next all-reduce does."""
    os.environ.update(rendezvous_env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    cfg = TrainConfig(device="cpu", ddp_timeout_s=timeout_s, gradient_accumulation_steps=2)
    runtime.setup_distributed(cfg)
    runtime.dist.all_reduce(torch.ones(4))
    if rank == 1:
        if peer == "dies":
            os._exit(3)
        time.sleep(60)  # the test ends this process
    start = time.monotonic()
    try:
        runtime.dist.all_reduce(torch.ones(4))
        report.send(("no error", "", time.monotonic() - start))
    except Exception as e:
        report.send((type(e).__name__, str(e), time.monotonic() - start))  # sent before send returns
    os._exit(0)  # no teardown of a process group whose peer is gone


@pytest.mark.slow
@pytest.mark.parametrize("peer, timeout_s", [("hangs", 2), ("dies", 120)])
def test_gloo_collective_with_a_lost_peer_raises_in_the_main_thread(peer, timeout_s):
    """What train.py's handler for a timed-out collective sees on gloo (NCCL's watchdog ends the process
    instead, docs/training.md): a peer that hangs makes the collective raise once ddp_timeout_s has passed,
    saying it timed out; a peer that died makes it raise without waiting for the timeout. (The bounds are the
    timeout itself and a minute: a loaded machine may be slow, never that slow.)"""
    context = multiprocessing.get_context("fork")  # started in milliseconds: torch is imported already
    received, report = context.Pipe(duplex=False)
    with rendezvous() as env:
        ranks = [context.Process(target=gloo_rank, args=(r, env, peer, timeout_s, report)) for r in range(2)]
        for process in ranks:
            process.start()
        try:
            assert received.poll(180), "rank 0 sent no report"
            error, message, elapsed_s = received.recv()
        finally:
            for process in ranks:
                process.kill()
                process.join()
    assert error == "RuntimeError"
    if peer == "hangs":
        assert "timed out" in message.lower() and timeout_s <= elapsed_s < timeout_s + 60, (message, elapsed_s)
    else:
        assert re.search("Connection (reset|closed) by peer", message) and elapsed_s < 60, (message, elapsed_s)


def test_deterministic_mode_turns_on_deterministic_algorithms_and_math_attention(monkeypatch):
    calls = {}
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on: calls.update(deterministic=on))
    for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp"):
        monkeypatch.setattr(torch.backends.cuda, name, lambda on, name=name: calls.update({name: on}))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    runtime.set_deterministic(False, "cuda")
    assert calls == {}
    runtime.set_deterministic(True, "cuda")
    assert calls == dict(
        deterministic=True, enable_flash_sdp=False, enable_mem_efficient_sdp=False, enable_cudnn_sdp=False
    )
    assert runtime.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_agreement_in_one_process_raises_setup_error_with_the_message():
    one = types.SimpleNamespace(torchrun=False, is_master=True)
    assert runtime.agree(one, lambda: 3, (ValueError,)) == 3
    with pytest.raises(runtime.SetupError, match="^bad file$"):
        runtime.agree(one, lambda: (_ for _ in ()).throw(ValueError("bad file")), (ValueError,))
    with pytest.raises(KeyError):  # not a user error: a bug, raised as is
        runtime.decide_on_master(one, lambda: {}["x"], (ValueError,))


# ---------------------------------------------------------------------------------------------------
# CPU threads on a busy or small machine.


@pytest.fixture
def torch_threads():
    """Restores torch's thread count after the test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "idle, usable, expected, why",
    [
        (0.3, 4, 1, "0.3 of the 4 CPUs it may use were idle (other work is running)"),
        (2.6, 4, 3, "2.6 of the 4 CPUs it may use were idle (other work is running)"),
        (4.0, 2, 2, "it may use 2 CPUs (its affinity or a CPU quota)"),
        (None, 2, 2, "it may use 2 CPUs (its affinity or a CPU quota)"),  # no /proc/stat: the cap alone
        (3.7, 4, None, None),  # enough idle CPUs: torch's own choice stands
    ],
)
def test_cpu_threads_are_lowered_to_the_idle_usable_cpus_with_a_line_saying_so(
    monkeypatch, torch_threads, idle, usable, expected, why
):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime, "usable_cpus", lambda: (list(range(usable)), usable))
    monkeypatch.setattr(runtime, "idle_cpus", lambda cpus: idle)
    torch.set_num_threads(4)
    note = runtime.choose_cpu_threads()
    if expected is None:
        assert note is None and torch.get_num_threads() == 4
        return
    assert torch.get_num_threads() == expected
    assert note == (
        f"note: {expected} CPU thread{'s' if expected > 1 else ''} instead of torch's 4: {why}; "
        "set OMP_NUM_THREADS to choose"
    )


def test_cpu_threads_the_user_chose_are_kept(monkeypatch, torch_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setattr(runtime, "idle_cpus", lambda cpus: 0.0)
    torch.set_num_threads(4)
    assert runtime.choose_cpu_threads() is None and torch.get_num_threads() == 4


def test_each_of_a_node_s_torchrun_processes_gets_its_share(monkeypatch, torch_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(runtime, "usable_cpus", lambda: (list(range(8)), 8))
    monkeypatch.setattr(runtime, "idle_cpus", lambda cpus: 8.0)
    torch.set_num_threads(8)
    assert runtime.choose_cpu_threads().endswith(", shared by 2 processes; set OMP_NUM_THREADS to choose")
    assert torch.get_num_threads() == 4


@pytest.mark.parametrize("v2, v1, usable", [("max 100000", None, 64), ("150000 100000", None, 2), (None, "200000", 2)])
def test_a_cgroup_cpu_quota_caps_the_usable_cpus(tmp_path, monkeypatch, v2, v1, usable):
    """A container given 1.5 CPUs (cgroup v2's cpu.max) or 2 (v1's quota over its period) on a 64-CPU host."""
    files = {"cpu.max": v2, "cfs_quota_us": v1, "cfs_period_us": "100000" if v1 else None}
    for name, text in files.items():
        if text is not None:
            (tmp_path / name).write_text(text + "\n")
    quota_files = ((str(tmp_path / "cpu.max"),), (str(tmp_path / "cfs_quota_us"), str(tmp_path / "cfs_period_us")))
    monkeypatch.setattr(runtime, "CPU_QUOTA_FILES", quota_files)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert runtime.usable_cpus() == (list(range(64)), usable)


def test_idle_cpus_are_measured_between_none_and_all_of_them():
    cpus, usable = runtime.usable_cpus()
    assert 1 <= usable <= len(cpus)
    idle = runtime.idle_cpus(cpus, seconds=0.1)
    assert idle is None or 0.0 <= idle <= len(cpus) + 1e-9


def spinning(count):
    """`count` processes that each keep a CPU busy (other work on the machine) until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


@pytest.mark.slow
def test_train_py_on_a_machine_busy_with_other_work_takes_one_thread_and_says_so(data_path, tmp_path):
    """Every usable CPU kept busy by another process: torch's threads would wait on each other at every
    operation, so train.py (no OMP_NUM_THREADS set) takes one thread and says why in one line."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = ROOT
    default = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env, capture_output=True, text=True
    )
    threads = int(default.stdout)
    if threads < 2:
        pytest.skip(f"torch takes {threads} thread here: there is nothing to lower")
    busy = spinning(runtime.usable_cpus()[1])
    try:
        args = tiny_args(data_path, str(tmp_path / "out"), max_iters=1, eval_iters=1)
        done = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stdout.splitlines() if "CPU thread" in line]
    assert len(notes) == 1 and notes[0].startswith(f"note: 1 CPU thread instead of torch's {threads}: "), done.stdout
    assert "other work is running" in notes[0]
