"""memory_plan.py: exact parameter, gradient and optimizer-state bytes; the activation formula against the bytes a
forward and backward pass allocates on the CPU; the largest micro-batch; --dry_run and the plan of a real run.
(Each rank's share under ZeRO-1 is checked against real sharded optimizers in test_zero.py; under FSDP2 against
the rows torch.chunk gives each rank, the split FSDP2's Shard(0) makes.)"""

import contextlib
import dataclasses
import importlib.util
import os
import re

import pytest
import torch
from allocator import allocator_peak
from train_helpers import ROOT, tiny_args

import model as model_module
import train
from bench.bench_fsdp import EXCHANGES, XL_SCALE, planned_exchange
from marsgpt import memory_plan
from marsgpt.config import TrainConfig
from marsgpt.parallel import Parallelism
from marsgpt.training_optimizer import build_optimizer
from model import GPT, GPTConfig, model_args_from_config

MODEL = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
OPTIMIZERS = [
    dict(optimizer="mars-adamw"),
    dict(optimizer="mars-adamw", is_approx=False),
    dict(optimizer="mars-lion"),
    dict(optimizer="mars-shampoo"),
    dict(optimizer="mars-adamw", optimize_1d=True),
    dict(optimizer="adamw"),
    dict(optimizer="muon", learning_rate=6e-4),
    dict(optimizer="muon", muon_matrices="hidden", learning_rate=6e-4),
    dict(optimizer="mars-m"),
    dict(optimizer="mars-m", is_approx=False),
    dict(optimizer="moonlight"),
]


pytestmark = pytest.mark.usefixtures("one_thread")


def config(**overrides):
    shape = {k: v for k, v in MODEL.items() if k != "vocab_size"}
    return dataclasses.replace(TrainConfig(), **shape, batch_size=2, **overrides)


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: "-".join(map(str, o.values())))
def test_parameter_gradient_and_state_bytes_are_those_allocated(optimizer, bias):
    """One real step of the real optimizer on a small model allocates exactly the planned bytes."""
    cfg = config(**optimizer, bias=bias)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL, bias=bias))
    opt = build_optimizer(model, cfg, Parallelism.single())
    x = torch.randint(0, MODEL["vocab_size"], (2, MODEL["block_size"]))
    if opt.look_ahead is not None:  # exact MARS: the look-ahead gradient first
        model(x, x)[1].backward()
        opt.keep_look_ahead_gradient()
    model(x, x)[1].backward()
    opt.step()
    states = opt.optimizers
    state = [t for o in states for s in o.state.values() for t in s.values() if torch.is_tensor(t)]
    plan = memory_plan.plan(cfg, model_args=dict(MODEL, bias=bias))
    assert plan.parameter_bytes == tensor_bytes(model.parameters())
    assert plan.gradient_bytes == tensor_bytes(p.grad for p in model.parameters())
    assert plan.state_bytes == tensor_bytes(state) > 0


# ---------------------------------------------------------------------------------------------------
# The activation formula against the CPU allocator (tests/allocator.py).


def measured_peak(model, x, dtype, math_attention=False):
    """Peak bytes the CPU allocator holds during a forward and backward pass as train.py takes it (only the
    loss: model(x, y, return_logits=False)), beyond what was held before (parameters and gradients from an
    earlier pass included). math_attention: the math kernel, the one --deterministic=True leaves CUDA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def forward_backward():
        with sdpa_kernel(SDPBackend.MATH) if math_attention else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=getattr(torch, dtype), enabled=dtype != "float32"):
                loss = model(x, torch.roll(x, -1, dims=1), return_logits=False)[1]
            loss.backward()

    return allocator_peak(forward_backward)  # its unmeasured first pass leaves the gradients, as every later one


# GPT-2's proportions (vocabulary much larger than the width), small enough for the CPU; the last has GPT-2
# small's ratio of attention scores to width (n_head x block_size = 16 n_embd), where the math kernel's
# backward pass is the peak
SHAPES = {
    "4x256": dict(n_layer=4, n_head=4, n_embd=256, vocab_size=2048, block_size=128, bias=False),
    "2x128-bias": dict(n_layer=2, n_head=2, n_embd=128, vocab_size=4096, block_size=64, bias=True),
    "2x128-long": dict(n_layer=2, n_head=4, n_embd=128, vocab_size=1024, block_size=512, bias=False),
}


def formula_against_allocator(
    monkeypatch,
    shape,
    dtype,
    checkpointing,
    batch_size,
    loss_rows,
    math_attention,
    dropout,
    compiled=False,
    onednn=False,
):
    """(formula, measured) peak bytes. loss_rows: the loss's chunk (None: the default, one chunk here; a few
    dozen rows: many chunks, as GPT-2's vocabulary makes of a micro-batch; compiled, 4 times as many rows, as
    COMPILED_LOSS_CHUNK_SCORES is to LOSS_CHUNK_SCORES). compiled: model.GPT.compile_blocks, with inductor.

    The formula models torch's own kernels, which allocate the same on every processor: with onednn=False the
    bfloat16 matmuls are torch's too (oneDNN off), otherwise oneDNN's where torch picks them, whose buffers
    depend on the processor (test_onednns_bfloat16_matmul_adds_at_most_a_float32_copy_of_one_output)."""
    if not onednn:
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    if loss_rows:
        monkeypatch.setattr(model_module, "LOSS_CHUNK_SCORES", loss_rows * shape["vocab_size"])
        monkeypatch.setattr(model_module, "COMPILED_LOSS_CHUNK_SCORES", 4 * loss_rows * shape["vocab_size"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape, dropout=dropout))
    model.activation_checkpointing = checkpointing
    if compiled:
        model.compile_blocks()
    x = torch.randint(0, shape["vocab_size"], (batch_size, shape["block_size"]))
    peak = measured_peak(model, x, dtype, math_attention)
    activations = memory_plan.activations_for(
        dict(shape, dropout=dropout), dtype, math_attention, device_type="cpu", compiled=compiled
    )
    _, parts = activations.peak(batch_size * shape["block_size"], checkpointing)
    return sum(parts.values()), peak


@pytest.mark.slow
@pytest.mark.parametrize("loss_rows", [None, 48], ids=["one-chunk", "48-row-chunks"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", ["4x256", "2x128-bias"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_activation_formula_is_the_cpu_allocators_peak(monkeypatch, shape, dtype, checkpointing, batch_size, loss_rows):
    formula, peak = formula_against_allocator(
        monkeypatch, SHAPES[shape], dtype, checkpointing, batch_size, loss_rows, math_attention=False, dropout=0.0
    )
    # within 0.5%: what the formula leaves out is the loss's scalars and the CPU matmuls' small workspaces
    assert formula == pytest.approx(peak, rel=5e-3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, checkpointing, math_attention, dropout, compiled",
    [
        ("4x256", False, False, 0.0, False),  # the peak: the loss in the forward pass
        ("4x256", True, False, 0.0, False),
        ("4x256", True, True, 0.1, False),  # a recomputed block's backward pass
        ("2x128-long", False, True, 0.1, False),  # the math attention kernel's backward pass
        ("2x128-bias", False, False, 0.0, True),  # the compiled loss
    ],
)
def test_onednns_bfloat16_matmul_adds_at_most_a_float32_copy_of_one_output(
    monkeypatch, shape, checkpointing, math_attention, dropout, compiled
):
    """Where the processor has the instructions, torch runs a bfloat16 matmul on oneDNN's kernel, whose buffers
    depend on the processor: with AMX it packs the weight into a copy; with AVX-512 BF16 (an AMD EPYC) it takes a
    scratchpad, 99,328 bytes beside a 1 MiB output; with plain AVX-512 (no bfloat16 instructions:
    ATEN_CPU_CAPABILITY=avx512, which holds oneDNN to AVX512_CORE) it accumulates the output in float32, a buffer
    twice the output's size. So the formula of torch's own kernel, exact above, holds there as a lower bound and,
    with a float32 copy of the pass's largest matmul output (the MLP's hidden layer, a chunk of the loss's
    scores or the output weight's gradient), an upper one."""
    shape = SHAPES[shape]
    formula, peak = formula_against_allocator(
        monkeypatch, shape, "bfloat16", checkpointing, 4, 48, math_attention, dropout, compiled, onednn=True
    )
    c, v, tokens = shape["n_embd"], shape["vocab_size"], 4 * shape["block_size"]
    loss_rows = min(tokens, (4 if compiled else 1) * 48)
    largest_output = max(tokens * 4 * c, loss_rows * v, v * c)
    assert formula * (1 - 5e-3) <= peak <= (formula + 4 * largest_output) * (1 + 5e-3)


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", ["4x256", "2x128-long"])
def test_activation_formula_with_the_math_attention_kernel_is_the_cpu_allocators_peak(
    monkeypatch, shape, dtype, checkpointing, dropout
):
    """--deterministic=True: the math kernel keeps each layer's float32 probabilities, and its backward pass
    two more float32 tensors per score. (With a micro-batch of one sequence in float32 its v stays a view of
    the whole q, k, v tensor, 8 bytes per token and layer more than the formula counts: not tested here.)"""
    formula, peak = formula_against_allocator(
        monkeypatch, SHAPES[shape], dtype, checkpointing, 4, 48, math_attention=True, dropout=dropout
    )
    assert formula == pytest.approx(peak, rel=5e-3)


# The compiled model (train.py's on CUDA): inductor's C++ kernels build in a minute or two on a shared CPU, and
# later runs read them from inductor's cache. Where the peak is the loss in the forward pass -- every paper run's
# -- the formula is the allocator's to 0.5%; where it is a block's backward pass, the formula takes the eager
# block's, an upper bound: the compiled backward frees the block's saved tensors as it goes.
SMALL_VOCABULARY = dict(n_layer=2, n_head=4, n_embd=128, vocab_size=64, block_size=256, bias=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, dtype, batch_size, loss_rows",
    [("4x256", "bfloat16", 4, 48), ("4x256", "float32", 1, 48), ("2x128-bias", "bfloat16", 4, None)],
)
@pytest.mark.parametrize("by_layer", [False, True], ids=["", "scaled-by-layer"])
def test_compiled_activation_formula_is_the_cpu_allocators_peak(
    monkeypatch, shape, dtype, batch_size, loss_rows, by_layer
):
    """by_layer: scale_attn_by_inverse_layer_idx, the paper's setting, whose per-layer factor the compiled blocks
    multiply q by (a q-sized tensor more per block)."""
    shape = dict(SHAPES[shape], scale_attn_by_inverse_layer_idx=by_layer)
    formula, peak = formula_against_allocator(
        monkeypatch, shape, dtype, False, batch_size, loss_rows, False, 0.0, compiled=True
    )
    assert formula == pytest.approx(peak, rel=5e-3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, dtype, checkpointing, above",
    [(SMALL_VOCABULARY, "float32", False, 0.08), (SHAPES["4x256"], "float32", True, 0.17)],
    ids=["block-backward", "recomputed-block"],
)
def test_compiled_formula_bounds_the_backward_pass_from_above(monkeypatch, shape, dtype, checkpointing, above):
    """Peaks in a block's backward pass (a vocabulary smaller than the width; activation checkpointing, whose
    recomputed block's backward pass is the peak): the plan is at most `above` over the allocator's peak
    (measured on this repository's CPU: 6.1% and 15.4% over). In float32, whose peaks were the same bytes on
    this CPU's AVX-512 kernels and on the baseline ones (ATEN_CPU_CAPABILITY=default, with and without oneDNN);
    in bfloat16 the recomputed block's was 9.1% over here and 7.0% on the baseline kernels, as oneDNN's matmul
    repacks the weight and torch's does not."""
    formula, peak = formula_against_allocator(
        monkeypatch, shape, dtype, checkpointing, 4, 48, False, 0.0, compiled=True
    )
    assert peak <= formula <= (1 + above) * peak


@pytest.mark.slow
def test_calibration_gpt2_xl_on_an_h200():
    """The measured run (GPT-2 XL, MARS-AdamW, micro-batch 5 x 1024, bfloat16, uncompiled, one H200) peaked at
    48.4 GiB allocated, with the loss of its day: F.cross_entropy on the whole (B, T, V) logits. Its plan is
    written out here, the parts the chunked loss replaced in full: the peak was the start of the backward pass,
    with every block's activations (the formula's per-block term, unchanged), the output layer's input as well
    as the final LayerNorm's (a C more per token), 12 V bytes per token of float32 log-softmax and the
    gradients into and out of it, every Linear weight's autocast copy, and the bfloat16 logits that run's
    train.py held through the backward pass (2 V bytes per token). The chunked loss then planned 46.0 GiB and
    the H200 run of 2026-12-04 (docs/gpu.md, main at 3f25dc1) measured 46.1; its loop has since stopped
    holding a cast of the weight per chunk and the chunk before's gradient: 45.8 GiB."""
    cfg = dataclasses.replace(
        TrainConfig(),
        n_layer=48,
        n_head=25,
        n_embd=1600,
        bias=False,
        batch_size=5,
        optimizer="mars-adamw",
        compile=False,
    )
    plan = memory_plan.plan(cfg, dtype="bfloat16")
    activations = memory_plan.activations_for(model_args_from_config(cfg), "bfloat16")
    tokens, c, v, a = 5 * 1024, 1600, 50304, 2
    that_peak = (
        tokens * (48 * activations.per_block() + activations.after_blocks() + a * c)
        + tokens * v * (12 + 2)
        + a * activations.linear_weights
    )
    static = plan.parameter_bytes + plan.gradient_bytes + plan.state_bytes
    assert (static + that_peak) / memory_plan.GIB == pytest.approx(48.4, rel=0.01)
    # the chunked loss: its peak is in the forward pass, 2.7 GiB lower (48.5 -> 45.8)
    assert plan.peak_moment == "loss in the forward pass"
    assert (static + that_peak - plan.total_bytes) / memory_plan.GIB == pytest.approx(2.7, abs=0.05)
    assert plan.total_bytes / memory_plan.GIB == pytest.approx(45.8, abs=0.05)


def test_the_largest_micro_batch_that_fits_is_the_boundary():
    cfg = config(optimizer="mars-adamw", dtype="bfloat16")
    plan = memory_plan.plan(cfg, gpu_memory_gb=0.01, model_args=MODEL)
    b = plan.max_micro_batch
    assert b > 1
    fits = [
        memory_plan.plan(dataclasses.replace(cfg, batch_size=n), gpu_memory_gb=0.01, model_args=MODEL).fits
        for n in (b, b + 1)
    ]
    assert fits == [True, False]
    assert memory_plan.plan(cfg, gpu_memory_gb=1e-6, model_args=MODEL).max_micro_batch == 0


@pytest.mark.slow
def test_sharding_and_checkpointing_lower_the_plan():
    cfg = dataclasses.replace(TrainConfig(), n_layer=24, n_head=16, n_embd=1024, batch_size=15)
    layout = memory_plan.optimizer_layout(cfg, model_args_from_config(cfg))
    plain = memory_plan.plan(cfg, 8, layout=layout)
    sharded = memory_plan.plan(dataclasses.replace(cfg, zero_stage=1), 8, layout=layout)
    recomputing = memory_plan.plan(dataclasses.replace(cfg, activation_checkpointing=True), 8, layout=layout)
    assert sharded.total_state_bytes == plain.state_bytes
    # the fullest rank holds the token embedding (50304 x 1024, 15% of the parameters) on top of its share
    assert plain.state_bytes / 8 <= sharded.state_bytes < plain.state_bytes / 3
    assert sum(recomputing.peak_parts.values()) < sum(plain.peak_parts.values()) / 2
    assert memory_plan.plan(dataclasses.replace(cfg, zero_stage=1), 1, layout=layout).state_bytes == plain.state_bytes


@pytest.mark.parametrize("optimizer", OPTIMIZERS[:4] + OPTIMIZERS[5:7], ids=lambda o: "-".join(map(str, o.values())))
def test_a_sharded_save_adds_the_largest_state_tensor_rank_0_receives_through_its_gpu(optimizer):
    """ShardedOptimizer.state_dict gathers tensor by tensor; over NCCL each tensor of another rank's share
    passes through one buffer of its size on rank 0's GPU (test_zero.py checks the messages on gloo ranks)."""
    cfg = config(**optimizer, zero_stage=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    opt = build_optimizer(model, cfg, Parallelism.single())  # unsharded: the state each parameter has on whichever rank
    x = torch.randint(0, MODEL["vocab_size"], (2, MODEL["block_size"]))
    model(x, x)[1].backward()
    if opt.look_ahead is not None:
        opt.keep_look_ahead_gradient()
    opt.step()
    inner = opt.optimizers
    others = [  # the parameters ZeRO gives ranks 1..7, in each torch optimizer of the run
        p
        for o in inner
        for share in memory_plan.zero_partition([[(p.numel(), p) for p in g["params"]] for g in o.param_groups], 8)[1:]
        for _, p in share
    ]
    largest = max(t.numel() * t.element_size() for o in inner for p in others for t in o.state[p].values())
    plan = memory_plan.plan(cfg, 8, model_args=MODEL)
    assert plan.save_bytes == largest
    assert f"  checkpoint save  {memory_plan.gib(largest):>11}  (on rank 0 between steps" in "\n".join(
        memory_plan.format_plan(plan)
    )
    over_gloo = memory_plan.plan(dataclasses.replace(cfg, backend="gloo"), 8, model_args=MODEL)
    assert over_gloo.save_bytes == 0  # host buffers only
    unsharded = memory_plan.plan(dataclasses.replace(cfg, zero_stage=0), 8, model_args=MODEL)
    assert unsharded.save_bytes == 0 and not any(
        "checkpoint save" in line for line in memory_plan.format_plan(unsharded)
    )


@pytest.mark.slow
def test_a_sharded_save_is_not_the_peak_of_gpt2_xl_on_two_gpus():
    """It used to be planned as twice the fullest share moving through the GPU at once (18.3 GiB here), which
    made it the plan's peak; one state tensor at a time (an MLP matrix's, 0.04 GiB) is far below the pass's."""
    cfg = dataclasses.replace(
        TrainConfig(), n_layer=48, n_head=25, n_embd=1600, batch_size=5, zero_stage=1, activation_checkpointing=True
    )
    plan = memory_plan.plan(cfg, 2)
    assert plan.peak_moment != "checkpoint save" and "state_transfer" not in plan.peak_parts
    assert plan.save_bytes == 1600 * 6400 * 4


@pytest.mark.slow
def test_the_docs_tables_are_the_scripts_output():
    """docs/memory.md's rows for two runs, regenerated by scripts/memory_table.py (the whole table takes ~10 s)."""
    memory_table = memory_table_module()
    runs = [run for run in memory_table.paper_runs() if run[:2] in (("small", "mars"), ("xl", "adamw"))]
    assert len(runs) == 2
    plans = memory_table.plan_runs(runs)
    with open(os.path.join(ROOT, "docs", "memory.md")) as f:
        docs = f.read()
    for gpu_memory_gb in memory_table.GPU_MEMORY_GB:
        for line in memory_table.table(gpu_memory_gb, runs, plans):
            assert line in docs


def memory_table_module():
    spec = importlib.util.spec_from_file_location("memory_table", os.path.join(ROOT, "scripts", "memory_table.py"))
    memory_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory_table)
    return memory_table


# ---------------------------------------------------------------------------------------------------
# FSDP2 (zero_stage=3).


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: "-".join(map(str, o.values())))
def test_fsdp2_ranks_hold_the_rows_torch_chunk_gives_them(optimizer, world_size):
    """FSDP2 shards each parameter, its gradient and each state tensor shaped like it by rows, in torch.chunk's
    sizes (3 ranks: uneven, and some rank gets no rows of a 2-row tensor). The plan's parameters are rank 0's
    rows (the most), each rank's state its rows of every state tensor; the 0-d step counts, which every rank
    holds whole, the plan scales like the rest: within 8 bytes per parameter."""
    cfg = config(**optimizer, zero_stage=3)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    opt = build_optimizer(model, cfg, Parallelism.single())
    x = torch.randint(0, MODEL["vocab_size"], (2, MODEL["block_size"]))
    model(x, x)[1].backward()
    if opt.look_ahead is not None:
        opt.keep_look_ahead_gradient()
    opt.step()
    inner = opt.optimizers

    def rows(t, rank):
        chunks = torch.chunk(t, world_size) if t.ndim else [t] * world_size
        return chunks[rank] if rank < len(chunks) else t[:0]

    plan = memory_plan.plan(cfg, world_size, model_args=MODEL)
    assert plan.fsdp_shards == world_size and plan.world_size == world_size
    assert plan.parameter_bytes == plan.gradient_bytes == tensor_bytes(rows(p, 0) for p in model.parameters())
    n_params = len(list(model.parameters()))
    for rank in range(world_size):
        held = tensor_bytes(rows(t, rank) for o in inner for state in o.state.values() for t in state.values())
        assert abs(plan.rank_state_bytes[rank] - held) <= 8 * n_params, rank
    assert plan.total_state_bytes == pytest.approx(
        memory_plan.plan(config(**optimizer), 1, model_args=MODEL).state_bytes, abs=8 * n_params
    )


@pytest.mark.slow
def test_fsdp2_plan_of_gpt2_xl_on_8_gpus_beats_zero_1_and_names_what_it_adds(capsys):
    argv = ["config/train_gpt2_xl_mars.py", "--dry_run=True", "--plan_world_size=8", "--gpu_memory_gb=40"]
    assert train.main(argv + ["--zero_stage=1"]) == 0
    zero_1 = capsys.readouterr().out
    assert train.main(argv + ["--zero_stage=3", "--gradient_sync=micro_batch"]) == 0
    fsdp = capsys.readouterr().out
    assert "mars-adamw (approximate), FSDP2 over 8 GPUs, micro-batch 5 x 1024 tokens" in fsdp
    assert "(the fullest rank's share of 17.40 GiB)" in fsdp  # the same state as ZeRO-1's, split by rows
    for part in ("gathered params", "whole gradients"):
        assert f"  {part}" in fsdp
    total = {name: float(re.search(r"total +([\d.]+) GiB", out).group(1)) for name, out in (("1", zero_1), ("3", fsdp))}
    # parameters and gradients, 5.8 GiB each under ZeRO-1, are 1/8 each; the optimizer state 1/8 rather than
    # ZeRO-1's fullest rank's share (which holds the token embedding whole)
    assert total["1"] - total["3"] > 2 * 5.8 * 7 / 8 - 1
    # gradient_sync=step with 12 micro-batches per rank: the whole model's float32 gradients add up between them
    assert train.main(argv + ["--zero_stage=3"]) == 0
    whole = capsys.readouterr().out
    gradients = [float(re.search(r"whole gradients +([\d.]+) GiB", out).group(1)) for out in (fsdp, whole)]
    assert gradients[1] - gradients[0] == pytest.approx(1_556.8e6 * 4 / memory_plan.GIB, abs=0.01)


def test_hsdp_plans_the_shards_of_one_replica(capsys):
    argv = ["config/train_gpt2_small_mars.py", "--dry_run=True", "--plan_world_size=8", "--zero_stage=3"]
    assert train.main(argv + ["--hsdp_replicas=2"]) == 0
    hsdp = capsys.readouterr().out
    assert "FSDP2 over 4 GPUs in each of 2 HSDP replicas" in hsdp
    assert train.main([*argv[:2], "--plan_world_size=4", "--zero_stage=3"]) == 0
    fsdp_on_4 = capsys.readouterr().out
    parts = ("parameters", "gradients", "optimizer state")
    assert [re.search(rf"  {p} +([\d.]+) GiB", hsdp).group(1) for p in parts] == [
        re.search(rf"  {p} +([\d.]+) GiB", fsdp_on_4).group(1) for p in parts
    ]


@pytest.mark.parametrize(
    "optimizer, newton_schulz",
    [("mars-adamw", False), ("mars-lion", False), ("mars-shampoo", True), ("mars-m", True), ("muon", True)],
)
def test_newton_schulz_owners_buffers_are_planned_for_the_matrix_rules_only(optimizer, newton_schulz):
    """The owner of a matrix holds it whole (mars_sharded's exchange): the fullest rank's buffers are at least one
    float32 copy of the largest matrix the rule orthogonalises (here the MLP's 4c x c)."""
    selected = dict(optimizer=optimizer)
    owners = memory_plan.FSDP2.of(config(zero_stage=3), 2, MODEL, "bfloat16", "cuda").newton_schulz_bytes(
        memory_plan.optimizer_layout(config(**selected), MODEL).planned_parameters
    )
    if not newton_schulz:
        assert owners == 0
        return
    c = MODEL["n_embd"]
    assert owners >= 4 * (4 * c * c)


def test_zero_stage_3_on_one_gpu_is_fsdp2_under_torchrun_and_unsharded_without():
    """As marsgpt/fsdp.py's enabled decides: torchrun with one process shards over a mesh of one (the plan counts
    the gathered block), one process without torchrun trains the whole model; more than one GPU means torchrun."""
    cfg = config(zero_stage=3)
    under_torchrun = memory_plan.plan(cfg, 1, model_args=MODEL, torchrun=True)
    alone = memory_plan.plan(cfg, 1, model_args=MODEL)
    assert under_torchrun.fsdp_shards == 1 and memory_plan.sharding(under_torchrun) == "FSDP2 over 1 GPU"
    assert under_torchrun.peak_parts["gathered"] > 0 and "gathered" not in alone.peak_parts
    assert alone.fsdp_shards == 0 and memory_plan.sharding(alone) == "1 GPU(s), unsharded"
    assert memory_plan.plan(cfg, 2, model_args=MODEL).fsdp_shards == 2


@pytest.mark.slow
def test_the_largest_models_in_the_docs_fit_and_the_next_shapes_do_not():
    """docs/memory.md's largest-model table on 8 GPUs of 40 GiB: the shapes it names fit, with ZeRO-1 and with
    FSDP2, and the next shape of the ladder does not (the 80 GiB row and the whole table: python -m
    scripts.memory_table, ~40 s)."""
    memory_table = memory_table_module()
    with open(os.path.join(ROOT, "docs", "memory.md")) as f:
        docs = f.read()
    row = next(line for line in docs.splitlines() if line.startswith("| 40 GiB | "))
    cells = row.strip("| ").split(" | ")[1:]
    for sharding, cell in zip(memory_table.SHARDINGS, cells):
        n_layer, n_embd = map(int, re.search(r"(\d+) layers x (\d+)", cell).groups())
        index = next(i for i, shape in enumerate(memory_table.LADDER) if shape[:2] == (n_layer, n_embd))
        found = memory_table.largest_models_from(40, sharding, memory_table.LADDER[index : index + 2])
        assert found is not None and found[0] == memory_table.LADDER[index], sharding
        gib = found[1].total_bytes / memory_plan.GIB
        assert f"{found[1].n_params / 1e9:.2f}B: {n_layer} layers x {n_embd} ({gib:.1f} GiB per GPU)" == cell


# ---------------------------------------------------------------------------------------------------
# train.py: --dry_run, the plan at the start of a run, bad input.


@pytest.mark.slow
def test_dry_run_prints_the_plan_without_data_or_gpu(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["config/train_gpt2_xl_mars.py", f"--data_path={tmp_path / 'nothing'}", f"--out_dir={out}"]
    assert train.main(argv + ["--dry_run=True", "--plan_world_size=8", "--gpu_memory_gb=40", "--zero_stage=1"]) == 0
    printed = capsys.readouterr().out
    assert (
        "memory plan per GPU (an estimate): 1,556.8M parameters, mars-adamw (approximate), ZeRO-1 over 8 GPUs"
        in printed
    )
    assert "micro-batch 5 x 1024 tokens, bfloat16" in printed
    assert "(the fullest rank's share of 17.40 GiB)" in printed
    assert "of 40.0 GiB, 36.0 usable: fits; the largest micro-batch that fits:" in printed
    assert not out.exists()


@pytest.mark.slow
def test_dry_run_that_does_not_fit_says_what_to_try_and_which_world_sizes_are_refused(tmp_path, capsys):
    argv = ["config/train_gpt2_xl_mars.py", "--dry_run=True", "--plan_world_size=7", "--gpu_memory_gb=40"]
    assert train.main(argv) == 0
    printed = capsys.readouterr().out
    assert "does NOT fit" in printed
    assert "to fit, try --zero_stage=1 or --zero_stage=3 or --activation_checkpointing=True" in printed
    assert "note: a run on 7 processes is refused: gradient_accumulation_steps=96 is not a multiple of 7" in printed


def test_sharding_in_one_process_is_a_note_not_an_error(tmp_path, capsys):
    argv = ["config/train_gpt2_small_adamw.py", "--dry_run=True", "--zero_stage=1", "--device=cpu"]
    assert train.main(argv) == 0
    printed = capsys.readouterr().out
    assert "note: zero_stage=1 has no effect in one process: it shards the optimizer state over DDP ranks" in printed
    assert "1 GPU(s), unsharded" in printed and ", float32," in printed


def test_zero_stage_2_is_one_error_line(capsys):
    assert train.main(["--zero_stage=2", "--dry_run=True"]) == 2
    err = capsys.readouterr().err
    assert err == "error: zero_stage must be 0, 1 or 3 (ZeRO-2 is not offered: zero_stage=3 shards more), got 2\n"


def test_a_run_prints_its_plan_and_warns_when_it_does_not_fit(data_path, tmp_path, capsys):
    out = str(tmp_path / "out")
    argv = tiny_args(data_path, out, max_iters=2, eval_interval=2, activation_checkpointing=True, gpu_memory_gb=1e-4)
    assert train.main(argv) == 0
    captured = capsys.readouterr()
    assert "activation checkpointing on" in captured.out
    assert "does NOT fit; the largest micro-batch that fits: 0" in captured.out
    warning = [line for line in captured.err.splitlines() if line.startswith("warning: the memory plan")]
    assert len(warning) == 1 and "try --activation_checkpointing=True" not in warning[0]
    assert os.path.isfile(os.path.join(out, "ckpt.pt"))  # a warning: the run goes on


# ---------------------------------------------------------------------------------------------------
# --deterministic=True: the math attention kernel's probabilities.


@pytest.mark.slow
@pytest.mark.parametrize("dropout, bytes_per_score", [(0.0, 4), (0.1, 9)])
def test_a_deterministic_plan_counts_the_math_kernels_probabilities(dropout, bytes_per_score):
    """CUDA's math kernel keeps each layer's float32 softmax over n_head x block_size scores per token; with
    dropout also the dropped probabilities (float32) and the fused dropout's 1-byte mask."""
    cfg = dataclasses.replace(TrainConfig(), batch_size=15, optimizer="mars-adamw", dropout=dropout)  # GPT-2 small
    fused = memory_plan.plan(cfg, gpu_memory_gb=40)
    math = memory_plan.plan(dataclasses.replace(cfg, deterministic=True), gpu_memory_gb=40)
    tokens, scores_per_token = 15 * 1024, 12 * 1024
    assert math.peak_parts["attention"] == 12 * tokens * scores_per_token * bytes_per_score
    assert "attention" not in fused.peak_parts or fused.peak_parts["attention"] == 0
    assert math.fused_attention_bytes == fused.total_bytes and fused.fused_attention_bytes is None
    assert math.total_bytes > fused.total_bytes + math.peak_parts["attention"] // 2
    assert math.max_micro_batch < fused.max_micro_batch
    lines = memory_plan.format_plan(math)
    assert lines[0].endswith("deterministic (the math attention kernel)")
    assert any(line.startswith("  attention probs ") for line in lines)
    extra = memory_plan.gib(math.total_bytes - fused.total_bytes)
    assert "note: deterministic=True: CUDA runs only the math attention kernel" in "\n".join(lines)
    assert f"the total is {memory_plan.gib(fused.total_bytes)}, {extra} less" in "\n".join(lines)


@pytest.mark.slow
def test_a_deterministic_dry_run_that_does_not_fit_names_determinism_as_the_cost(capsys):
    """GPT-2 XL with dropout on 8 x 80 GB: the fused kernels' plan fits, the math kernel's does not."""
    argv = ["config/train_gpt2_xl_mars.py", "--dry_run=True", "--plan_world_size=8", "--gpu_memory_gb=80"]
    assert train.main(argv + ["--deterministic=True", "--dropout=0.1"]) == 0
    printed = capsys.readouterr().out
    assert "does NOT fit" in printed
    fits = re.search(r"--deterministic=False \(the fused attention kernels: ([0-9.]+) GiB \(which fits\)\)", printed)
    assert fits and float(fits.group(1)) < 72
    assert (
        "to fit, try --zero_stage=1 or --zero_stage=3 or --activation_checkpointing=True or --deterministic=False"
        in printed
    )


def test_a_deterministic_run_warns_with_what_determinism_costs(data_path, tmp_path, capsys):
    out = str(tmp_path / "out")
    argv = tiny_args(data_path, out, max_iters=1, eval_interval=1, deterministic=True, gpu_memory_gb=1e-4)
    assert train.main(argv) == 0
    captured = capsys.readouterr()
    assert "note: deterministic=True: CUDA runs only the math attention kernel" in captured.out
    warning = [line for line in captured.err.splitlines() if line.startswith("warning: the memory plan")]
    assert len(warning) == 1 and "--deterministic=False (the fused attention kernels: " in warning[0]


# ---------------------------------------------------------------------------------------------------
# FSDP2's Newton-Schulz exchange, measured (bench_fsdp.exchange_peaks): GPT-2 XL's matrices divided by XL_SCALE in
# both dimensions on 8 gloo ranks, whose buckets, owners and column blocks are XL's own.


@pytest.fixture(scope="module")
def exchange_peaks():
    from bench import bench_fsdp

    return bench_fsdp.exchange_peaks()


@pytest.mark.slow
@pytest.mark.parametrize("case", EXCHANGES)
def test_the_exchange_holds_what_the_plan_says_on_every_rank(exchange_peaks, case):
    """Every rank's measured peak within 10% of its plan (the rank that owns the token embedding, 6288 x 200, too:
    it holds that matrix alone in its bucket, its products in column blocks)."""
    planned = planned_exchange(*EXCHANGES[case], XL_SCALE)
    measured = exchange_peaks[case]
    for rank, (m, p) in enumerate(zip(measured, planned)):
        assert abs(m - p) <= 0.1 * p, (rank, m, p)
    assert max(planned) > 1.5 * sorted(planned)[-2] or case == "mars-m" or "all in one" in case  # the embedding


@pytest.mark.slow
@pytest.mark.parametrize("case", EXCHANGES)
def test_gpt2_xl_s_exchange_is_its_scale_model_s_times_the_scale_squared(case):
    """What makes the measurement above XL's: the plan of XL's matrices is XL_SCALE² times the scale model's (to
    the column blocks' rounding), and by default under 1 GiB per rank, bfloat16 (GPUs) or float32 Newton-Schulz."""
    xl, scaled = (planned_exchange(*EXCHANGES[case], scale) for scale in (1, XL_SCALE))
    for big, small in zip(xl, scaled):
        assert big == pytest.approx(small * XL_SCALE**2, rel=0.01)
    if EXCHANGES[case][1] is None:
        assert max(xl) <= memory_plan.GIB
    else:  # all in one bucket: every rank holds its whole share of the matrices at once
        assert max(xl) > 2 * memory_plan.GIB
