"""The GPU-only paths, reached on a CPU: a mocked torch.cuda for the device, process-group and precision
decisions; the meta device for the training step and its logging on every optimizer and ZeRO-1 layout
(meta refuses host reads, and a tensor made on another device fails against it); the compiled model under
two-rank gloo DDP with recompiles forbidden; and a census of the aten ops a training step runs against the
ops torch documents as non-deterministic on CUDA."""

import functools
import json
import os
import sys
import time
import types

import numpy as np
import pytest
import torch
import torch._dynamo
import torch.distributed as dist

import model
import train
from marsgpt import metrics, runtime
from marsgpt.config import TrainConfig
from marsgpt.metrics import LogWindow
from marsgpt.tokens import write_bin

pytestmark = pytest.mark.usefixtures("one_thread")

# ---------------------------------------------------------------------------------------------------
# A mocked torch.cuda: GPUs as torch describes them (name, compute capability, memory).

GPUS = {
    # name: (compute capability major, total memory GiB)
    "Tesla V100-SXM2-32GB": (7, 32),
    "Tesla T4": (7, 15),
    "NVIDIA A100-SXM4-80GB": (8, 80),
    "NVIDIA H100 80GB HBM3": (9, 80),
}


@pytest.fixture
def gpu_machine(monkeypatch):
    """install(name, count): a machine with `count` GPUs called `name` as far as torch.cuda's queries go.
    torch's own is_bf16_supported runs on the mocked properties; bfloat16 tensors can be created on every
    GPU (emulated before compute capability 8). Returns the record of set_device and init_process_group
    calls (each init with the environment variables it would read)."""
    calls = types.SimpleNamespace(set_device=[], init=[])

    def install(name, count=8):
        major, gib = GPUS[name]
        props = types.SimpleNamespace(name=name, major=major, minor=0, total_memory=gib << 30)
        current = {"index": 0}

        def set_device(device):
            current["index"] = torch.device(device).index
            calls.set_device.append(str(device))

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
        monkeypatch.setattr(torch.cuda, "set_device", set_device)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (props.total_memory - (1 << 30), gib << 30))
        monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)
        monkeypatch.setattr(torch.version, "hip", None)

        def init_process_group(**kwargs):
            environment = {key: os.environ.get(key) for key in ("TORCH_NCCL_ASYNC_ERROR_HANDLING",)}
            calls.init.append(dict(kwargs, environment=environment))

        monkeypatch.setattr(runtime.dist, "init_process_group", init_process_group)
        return calls

    for key in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUBLAS_WORKSPACE_CONFIG", *runtime.ALLOCATOR_VARIABLES):
        monkeypatch.delenv(key, raising=False)
    return install


@pytest.mark.parametrize("name", GPUS)
def test_each_gpu_gets_its_precision_and_its_peak(gpu_machine, name):
    gpu_machine(name)
    native_bf16 = GPUS[name][0] >= 8
    assert runtime.resolve_dtype("auto", "cuda") == ("bfloat16" if native_bf16 else "float16")
    # the MFU denominator: the table's bf16 peak for a GPU it lists, else None (mfu is logged as null)
    assert model.peak_flops("cuda:0") == model.PEAK_BF16_FLOPS.get(name)
    if native_bf16:
        assert model.peak_flops("cuda:0") is not None, f"{name} runs bfloat16 but has no peak in PEAK_BF16_FLOPS"


def test_a_torchrun_rank_on_a_gpu_node_joins_nccl_on_its_own_gpu(gpu_machine, monkeypatch):
    calls = gpu_machine("NVIDIA H100 80GB HBM3", count=8)
    monkeypatch.setenv("RANK", "13")
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "16")
    info = runtime.setup_distributed(
        TrainConfig(device="auto", ddp_timeout_s=45, gradient_accumulation_steps=32, deterministic=True)
    )
    assert (info.device, info.rank, info.world_size, info.torchrun) == ("cuda:5", 13, 16, True)
    assert calls.set_device == ["cuda:5"] and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    (init,) = calls.init
    assert init["backend"] == "nccl" and init["device_id"] == torch.device("cuda:5")
    assert init["timeout"].total_seconds() == 45
    assert init["environment"] == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert torch.cuda.is_bf16_supported(including_emulation=False)  # the mock answers as an H100 does
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"


@pytest.mark.parametrize("variable", runtime.ALLOCATOR_VARIABLES)
def test_an_allocator_setting_the_user_chose_is_kept(gpu_machine, monkeypatch, variable):
    gpu_machine("NVIDIA H100 80GB HBM3", count=1)
    monkeypatch.setenv(variable, "max_split_size_mb:512")
    runtime.setup_distributed(TrainConfig(device="cuda"))
    assert {name: os.environ.get(name) for name in runtime.ALLOCATOR_VARIABLES} == {
        name: "max_split_size_mb:512" if name == variable else None for name in runtime.ALLOCATOR_VARIABLES
    }


def test_more_ranks_on_a_node_than_gpus_is_one_line(gpu_machine, monkeypatch):
    """torchrun --nproc_per_node=8 on a node with 4 GPUs: ranks 4-7 say so, before CUDA or NCCL fail on them."""
    calls = gpu_machine("NVIDIA A100-SXM4-80GB", count=4)
    monkeypatch.setenv("RANK", "6")
    monkeypatch.setenv("LOCAL_RANK", "6")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(runtime.SetupError, match=r"^this node's rank LOCAL_RANK=6 has no GPU: only 4 CUDA device"):
        runtime.setup_distributed(TrainConfig(device="auto", gradient_accumulation_steps=8))
    assert calls.set_device == [] and calls.init == []


# ---------------------------------------------------------------------------------------------------
# The training step and its train line on the meta device, one rank of a layout at a time. Meta tensors
# have shapes and no data: any read of a value on the host raises, and so does an op that mixes a meta
# tensor with one made on the CPU, where on a GPU it would mix CUDA and CPU. The step's one intended host
# read (the .tolist() of the gradient norms, the per-step sync: parallel.Parallelism.read_agreed, which
# train_step calls) and the train line's (its values for the log) are let through, counted and answered with
# ones; any other .tolist() or .item() fails.

OPTIMIZERS = {
    "mars-adamw": dict(optimizer="mars-adamw"),
    "mars-adamw-exact": dict(optimizer="mars-adamw", is_approx=False),
    "mars-lion": dict(optimizer="mars-lion"),
    "mars-shampoo": dict(optimizer="mars-shampoo"),
    "adamw": dict(optimizer="adamw"),
    "muon": dict(optimizer="muon"),
    "mars-m": dict(optimizer="mars-m"),
    "mars-m-exact": dict(optimizer="mars-m", is_approx=False),
    "moonlight": dict(optimizer="moonlight"),
}
# (world size, zero_stage, rank). ZeRO-1 on a 1-layer GPT with GPT-2's vocabulary gives, on 2 ranks, rank 1
# two matrices and the token embedding, and on 8 ranks, ranks 0-5 one matrix each and ranks 6-7 the 1-D
# tensors (torch's ZeroRedundancyOptimizer partition). So ranks 1 of 2 and 0 of 8 hold no 1-D tensor and,
# under MARS-Lion and MARS-Shampoo, no exp_avg_sq -- as rank 0 does on GPT-2 small with 2 or 8 GPUs; ranks
# 0 and 7 of 8 stand for the two kinds of share.
LAYOUTS = [(1, 0, 0), (2, 1, 0), (2, 1, 1), (8, 1, 0), (8, 1, 7)]
ALLOWED_HOST_READS = {"read_agreed": 1, "log_train": 1}


def tiny_config(data_path, dataset, tmp_path, optimizer, **overrides):
    """A 1-layer, 16-wide GPT run of OPTIMIZERS[optimizer] on `dataset`, uncompiled, one evaluation batch."""
    settings = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, eval_iters=1, compile=False)
    return TrainConfig(
        data_path=data_path,
        dataset=dataset,
        out_dir=str(tmp_path / "out"),
        **settings,
        **OPTIMIZERS[optimizer],
        **overrides,
    )


@pytest.fixture(scope="module")
def gpt2_tokens(tmp_path_factory):
    """A GPT-2-tokenized dataset 'bpe' (no meta.pkl: the model pads the vocabulary to 50304)."""
    root = tmp_path_factory.mktemp("tokens")
    ids = np.random.default_rng(0).integers(0, 50257, 2000)
    os.makedirs(root / "bpe")
    write_bin(root / "bpe" / "train.bin", ids)
    write_bin(root / "bpe" / "val.bin", ids[:500])
    return str(root)


@pytest.fixture
def host_reads(monkeypatch):
    """The functions that read a device tensor's value on the host, each time one does: a list of names.
    A CPU tensor's value (the step counts of torch's unfused optimizers) is read without waiting for any
    device, so it is not counted."""
    reads = []

    def reader(name):
        original = getattr(torch.Tensor, name)

        def read(tensor):
            if not tensor.is_meta:
                return original(tensor)
            caller = sys._getframe(1).f_code.co_name
            reads.append(caller)
            if reads.count(caller) > ALLOWED_HOST_READS.get(caller, 0):
                raise AssertionError(f"{caller} reads a device tensor's value on the host ({name})")
            return original(torch.ones(tensor.shape))

        monkeypatch.setattr(torch.Tensor, name, read)

    reader("tolist")
    reader("item")
    return reads


@pytest.fixture
def fake_ranks():
    """join(rank, world_size): this process becomes `rank` of a fake process group, whose collectives
    return at once without communicating (torch's testing backend "fake")."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def join(rank, world_size):
        if world_size > 1:
            dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "{}ranks-zero{}-rank{}".format(*layout))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_step_and_its_train_line_stay_on_the_device(
    gpt2_tokens, tmp_path, request, host_reads, fake_ranks, optimizer, layout
):
    world_size, zero_stage, rank = layout
    fake_ranks(rank, world_size)
    cfg = tiny_config(
        gpt2_tokens,
        "bpe",
        tmp_path,
        optimizer,
        batch_size=1,
        gradient_accumulation_steps=world_size,
        zero_stage=zero_stage,
        dtype="float32",
    )
    run, progress, _ = train.setup(cfg, runtime.Dist(rank=rank, world_size=world_size, device="meta"))
    request.addfinalizer(run.metrics.close)
    assert run.parallel.shards_optimizer_state == (zero_stage == 1 and world_size > 1)

    result = train.train_step(run, 0)
    assert host_reads == ["read_agreed"] and not result.skipped and result.loss.is_meta
    progress.iter_num = 1
    window = LogWindow()
    window.add(result.loss, result.skipped)
    train.log_train(run, progress, window, result, time_s=1.0)
    assert host_reads == ["read_agreed"] + (["log_train"] if rank == 0 else [])

    tensors = [*run.model.parameters(), *(p.grad for p in run.model.parameters() if p.grad is not None)]
    tensors += [t for state in run.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    # torch's optimizers keep their step counts as CPU scalars when not fused: the only tensors off the device
    assert all(t.is_meta or t.ndim == 0 for t in tensors)
    if rank == 0:
        with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
            (record,) = [json.loads(line) for line in f]
        mars_run = cfg.optimizer.startswith("mars")
        assert record[metrics.TRAIN_LOSS] == 1.0 and (metrics.MOMENTUM_NORM in record) == mars_run


# ---------------------------------------------------------------------------------------------------
# The compiled model under two-rank gloo DDP, as train.setup builds it with compile=True: the training
# graph and the evaluation graph are compiled once each (a first step, a first evaluation), and then
# twenty steps with evaluations between them run with recompiles forbidden. Graph breaks and recompiles
# are dynamo's decisions, the same whichever backend compiles the graphs: aot_eager (autograd's graphs,
# run by eager kernels) finds them in seconds; inductor, train.py's backend, also generates and compiles
# the C++ kernels.

COMPILED_STEPS = 20


def compiled_ddp_rank(rank, rendezvous_env, backend, data_path, out_dir, report_path):
    os.environ.update(rendezvous_env)
    torch.compile = functools.partial(torch.compile, backend=backend)  # what train.setup calls
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)

    cfg = TrainConfig(
        data_path=data_path,
        dataset="tiny",
        out_dir=out_dir,
        n_layer=2,
        n_head=2,
        n_embd=32,
        block_size=16,
        batch_size=2,
        gradient_accumulation_steps=4,  # two micro-batches per rank: no_sync, then the synced one
        eval_iters=2,
        compile=True,
    )
    run, progress, _ = train.setup(cfg, runtime.Dist(torchrun=True, rank=rank, world_size=2, device="cpu"))
    start = time.perf_counter()
    train.train_step(run, 0)
    train.evaluate(run, run.val_batches)
    compile_s = time.perf_counter() - start
    report = dict(compile_s=compile_s, recompile_error=None)
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            losses = []
            for it in range(1, COMPILED_STEPS + 1):
                losses.append(train.train_step(run, it).loss.item())
                if it % 10 == 0:
                    train.evaluate(run, run.val_batches)
        report.update(losses=losses)
    except RuntimeError as e:
        report.update(recompile_error=str(e).splitlines()[0])
    report.update(
        steps_s=time.perf_counter() - start - compile_s,
        graph_breaks=dict(torch._dynamo.utils.counters["graph_break"]),
        unique_graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],
    )
    torch.save(report, f"{report_path}.{rank}")
    run.metrics.close()
    # Leave without tearing the gloo group down: its destructor can deadlock with its own thread at exit
    # (seen in this test under load), and the report is on disk already.
    os._exit(0)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_compiled_model_trains_under_ddp_without_graph_breaks_or_recompiles(data_path, tmp_path, backend):
    import torch.multiprocessing as mp

    from bench.common import rendezvous

    report_path = str(tmp_path / "report")
    with rendezvous() as env:
        args = (env, backend, data_path, str(tmp_path / "out"), report_path)
        # A cold inductor compile took 5.5 minutes here with the machine's two cores shared; a rank still running
        # after 15 minutes is stopped, so a hung compile fails the test instead of holding up CI.
        ranks = mp.start_processes(compiled_ddp_rank, args=args, nprocs=2, join=False, start_method="spawn")
        deadline = time.monotonic() + 900
        while not ranks.join(timeout=max(1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for process in ranks.processes:
                    process.kill()
                pytest.fail(f"the compiled {backend} run did not finish in 15 minutes")
    reports = [torch.load(f"{report_path}.{rank}", weights_only=False) for rank in range(2)]
    for report in reports:
        print({key: value for key, value in report.items() if key != "losses"})
        assert report["recompile_error"] is None
        assert report["graph_breaks"] == {}
        assert len(report["losses"]) == COMPILED_STEPS and all(np.isfinite(report["losses"]))


# ---------------------------------------------------------------------------------------------------
# The op census. torch.use_deterministic_algorithms's docstring (torch 2.13) lists the operations that are
# non-deterministic on CUDA by default: those it then replaces by deterministic kernels, and those for which
# it raises instead. Here each is named by the aten ops that carry it (forward or backward, as listed).
# NLLLoss's entry is the spatial loss: PyTorch's CUDA source alerts in nll_loss2d's forward only. The list's
# sparse-dense bmm is left out: the model has no sparse tensors, and its dense bmm is not in the list.

MADE_DETERMINISTIC = {
    "convolution",  # Conv1d/2d/3d, ConvTranspose1d/2d/3d
    "convolution_backward",
    "replication_pad1d_backward",
    "replication_pad2d_backward",
    "replication_pad3d_backward",
    "index",  # __getitem__ with a list of index tensors, differentiated: its backward is index_put
    "index_put",
    "index_put_",
    "_index_put_impl_",
    "put_",
    "scatter_add",
    "scatter_add_",
    "gather",
    "index_add",
    "index_add_",
    "index_select",  # differentiated: its backward is index_add
    "repeat_interleave",
    "index_copy",
    "index_copy_",
    "scatter",
    "scatter_",
    "scatter_reduce",
    "scatter_reduce_",
    "max_pool3d_with_indices_backward",
}
RAISES_ON_CUDA = {
    "avg_pool3d_backward",
    "_adaptive_avg_pool2d_backward",
    "adaptive_avg_pool3d_backward",
    "adaptive_max_pool2d_backward",
    "fractional_max_pool2d_backward",
    "fractional_max_pool3d_backward",
    "max_unpool2d",
    "max_unpool3d",
    "upsample_linear1d_backward",
    "upsample_bilinear2d_backward",
    "upsample_bicubic2d_backward",
    "upsample_trilinear3d_backward",
    "reflection_pad1d_backward",
    "reflection_pad2d_backward",
    "reflection_pad3d_backward",
    "nll_loss2d_forward",
    "_ctc_loss_backward",
    "_embedding_bag_backward",
    "_embedding_bag_dense_backward",
    "histc",
    "bincount",
    "median",
    "grid_sampler_2d_backward",
    "grid_sampler_3d_backward",
    "cumsum",
    "cumsum_",
}
# The documented ops a training step uses (model, loss, clipping, each optimizer's update): none. Its
# non-determinism on CUDA is elsewhere, in what runtime.set_deterministic switches off besides: the flash,
# memory-efficient and cuDNN attention kernels, cuBLAS's workspace, cuDNN's benchmarking.
DOCUMENTED_OPS_A_STEP_USES = set()


def step_ops(run):
    """The names of the aten ops one train_step runs (after autograd: the backward's too), counted by gpu_check's
    census (the one its attention-kernel row reads)."""
    from scripts.gpu_check_worker import OpCensus

    with OpCensus() as census:
        train.train_step(run, 0)
    return census.ops


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_training_step_uses_no_op_deterministic_mode_refuses_on_cuda(data_path, tmp_path, request, optimizer):
    cfg = tiny_config(data_path, "tiny", tmp_path, optimizer, batch_size=2, gradient_accumulation_steps=1, dropout=0.1)
    run, _, _ = train.setup(cfg, runtime.Dist())
    request.addfinalizer(run.metrics.close)
    ops = step_ops(run)
    assert {"embedding_dense_backward", "nll_loss_forward", "native_layer_norm_backward"} <= ops  # it counted
    assert ops & RAISES_ON_CUDA == set()  # else --deterministic=True would fail at the first step on a GPU
    assert ops & MADE_DETERMINISTIC == DOCUMENTED_OPS_A_STEP_USES
