"""runtime.py: the device each launch path runs on, the process group's arguments, precision, determinism,
and setup decisions that every rank takes together. CUDA is simulated: the logic is what is tested."""

import types

import pytest
import torch

import runtime
from configurator import TrainConfig


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
        runtime.resolve_device("cuda:1", ddp=True, local_rank=0)


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
    assert (info.device, info.ddp, fake_cuda) == ("cuda:0", False, ["cuda:0"])


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
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert runtime.resolve_dtype("auto", "cuda") == "float16"
    autocast, scaler = runtime.setup_precision("float32", "cpu")
    assert not scaler.is_enabled()
    autocast, scaler = runtime.setup_precision("bfloat16", "cpu")
    with autocast:
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


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
    one = types.SimpleNamespace(ddp=False, is_master=True)
    assert runtime.agree(one, lambda: 3, (ValueError,)) == 3
    with pytest.raises(runtime.SetupError, match="^bad file$"):
        runtime.agree(one, lambda: (_ for _ in ()).throw(ValueError("bad file")), (ValueError,))
    with pytest.raises(KeyError):  # not a user error: a bug, raised as is
        runtime.decide_on_master(one, lambda: {}["x"], (ValueError,))
