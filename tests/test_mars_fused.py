"""fused=True, MARS's Triton kernel (mars_triton.py): two launches per device and dtype for every tensor of
every group, one compiled variant for any shapes, numbers and number of optimizers, equal to the reference path.

On a CPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 and makes its
bfloat16 cast round as a GPU's does); what only a compiled kernel shows, that it compiles for an H100 with 16-byte
loads and torch's rounding of divisions and square roots, comes from compiling it for that GPU here (no GPU is
needed to compile). Its speed on a GPU is bench/bench_mars.py's, and scripts/gpu_check.py's optimizer row."""

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mars
import mars_triton
from mars import MARS

pytest.importorskip("triton", reason="fused=True runs a Triton kernel: pip install -r requirements-test.txt")

ROOT = Path(__file__).resolve().parents[1]
HALF_TOLERANCE = {torch.bfloat16: 0.1, torch.float16: 0.02}  # tests/test_mars.py's, in total (relative_difference)


class Launches:
    """The kernels, counted: each launch's kernel, grid, arguments and compile-time constants; and the tensors of
    fused=True optimizers the kernel did not take (stepped on another path)."""

    def __init__(self, kernels):
        self.kernels, self.calls, self.left = kernels, [], []

    def spy(self, index):
        launches = self

        class Kernel:
            def __getitem__(self, grid):
                def launch(*args, **constants):
                    launches.calls.append((index, grid, args, constants))
                    return launches.kernels[index][grid](*args, **constants)

                return launch

        return Kernel()

    def variants(self):
        """What Triton compiles a variant for: the kernel, the dtype and 16-byte alignment of each tensor argument,
        and the constants (it specializes integer arguments on their value too: the kernels take none)."""
        keys = set()
        for index, _, args, constants in self.calls:
            assert all(torch.is_tensor(a) for a in args), "an argument that is not a tensor would be specialized on"
            keys.add((index, tuple((a.dtype, a.data_ptr() % 16 == 0) for a in args), tuple(sorted(constants.items()))))
        return keys

    def taken(self):
        """The parameters (addresses) the first launches listed."""
        return {
            address for index, _, args, _ in self.calls if index == 0 for address in args[0].view(-1, 12)[:, 0].tolist()
        }


@pytest.fixture
def launches(monkeypatch):
    record = Launches(mars_triton._kernels())
    monkeypatch.setattr(mars_triton, "_kernels", lambda: (record.spy(0), record.spy(1)))
    monkeypatch.setattr(mars_triton, "_kernels_interpreted", lambda: True)
    fused_step = mars_triton.step

    def kept(parts, **helpers):
        rest = fused_step(parts, **helpers)
        record.left += [p for part in rest for p in part.params]
        return rest

    monkeypatch.setattr(mars_triton, "step", kept)
    return record


def problem(shapes, dtype, steps, seed=0):
    """Initial tensors and gradients, some gradient norms above 1 (clipped) and some below."""
    gen = torch.Generator().manual_seed(seed)

    def rand(shape, scale):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    x0s = [rand(s, 0.05) for s in shapes]
    grads = [[rand(s, 2.0 if (t + i) % 2 else 0.05) for i, s in enumerate(shapes)] for t in range(steps)]
    return x0s, grads


def build(x0s, groups, **settings):
    """MARS over copies of x0s split into `groups` (a list of (indices, group settings))."""
    params = [torch.nn.Parameter(x.clone()) for x in x0s]
    return params, MARS([dict(params=[params[i] for i in idx], **group) for idx, group in groups], **settings)


def step(params, optimizer, grads, lrs=None):
    for t, gs in enumerate(grads):
        if lrs:
            for group in optimizer.param_groups:
                group["lr"] = lrs[t]
        for p, g in zip(params, gs):
            p.grad = g.clone()
        optimizer.step()


def reference(x0s, groups, grads, lrs=None, **settings):
    """The same optimizer on the single-tensor reference path."""
    params, optimizer = build(x0s, groups, **{**settings, "fused": None, "foreach": False})
    step(params, optimizer, grads, lrs)
    return params


def assert_equal_to_reference(got, expected, start, dtype):
    """float64 to rounding; float32 to tests/test_mars.py's tolerance; the half types in total, as there (the
    kernel rounds once, the reference after each op)."""
    if dtype in HALF_TOLERANCE:
        num = sum((a.double() - b.double()).abs().sum() for a, b in zip(got, expected))
        den = sum((b.double() - s.double()).abs().sum() for b, s in zip(expected, start))
        assert all(torch.isfinite(p).all() for p in got) and (num / den).item() < HALF_TOLERANCE[dtype]
        return
    rtol, atol = (1e-12, 1e-14) if dtype == torch.float64 else (1e-5, 1e-7)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------------
# Two launches, one variant.

# A matrix of three chunks (_CHUNK elements each: ‖c_t‖ adds the chunks' sums), an empty one and a one-element
# one, a transposed one, and the 1-D and 3-D tensors of the AdamW part.
SHAPES = [(200, 210), (24, 16), (0, 4), (1, 1), (7, 3), (16,), (5,), (2, 3, 2)]


@pytest.mark.parametrize("mars_type", mars.MARS_TYPES)
def test_a_step_is_two_launches_over_every_tensor_of_every_group(launches, mars_type):
    """Two groups with different numbers, each with MARS tensors and an AdamW part: per step one launch that
    counts the steps and sums c², one that updates, whatever the number of tensors and groups. Newton-Schulz
    rules take their elementwise part in the kernel."""
    x0s, grads = problem(SHAPES, torch.float32, steps=3)
    x0s[4] = x0s[4].T.contiguous().T  # a transposed weight, its gradients and state transposed alike
    grads = [[g.T.contiguous().T if i == 4 else g for i, g in enumerate(gs)] for gs in grads]
    groups = [
        ([0, 2, 5, 7], dict(weight_decay=0.1, weight_decay_1d=0.1)),
        ([1, 3, 4, 6], dict(betas=(0.9, 0.95), gamma=0.5, amsgrad=True, weight_decay=0.0, weight_decay_1d=0.2)),
    ]
    settings = dict(lr=2e-2, mars_type=mars_type)
    params, optimizer = build(x0s, groups, **settings, fused=True)
    step(params, optimizer, grads, lrs=[2e-2, 3e-2, 1e-2])
    assert [index for index, *_ in launches.calls] == [0, 1] * 3 and not launches.left
    expected = reference(x0s, groups, grads, lrs=[2e-2, 3e-2, 1e-2], **settings)
    assert_equal_to_reference(params, expected, x0s, torch.float32)
    assert all(optimizer.state[p]["step"].item() == 3 for p in params)


def test_each_dtype_is_two_launches_and_a_tensor_whose_state_differs_in_layout_steps_on_the_default_path(launches):
    """A float32 and a bfloat16 group: two launches each. A weight whose gradient is not in its layout (a
    transposed weight, a contiguous gradient) cannot be walked in memory order: that tensor takes the default path."""
    x0s, grads = problem([(8, 6), (6,), (7, 3)], torch.float32, steps=2)
    x0s[2] = x0s[2].T.contiguous().T  # its gradients stay contiguous
    halves, half_grads = problem([(4, 8), (8,)], torch.bfloat16, steps=2, seed=1)
    groups = [([0, 1, 2], {}), ([3, 4], {})]
    params, optimizer = build(x0s + halves, groups, lr=1e-2, fused=True)
    step(params, optimizer, [gs + hs for gs, hs in zip(grads, half_grads)])
    assert sorted(index for index, *_ in launches.calls) == [0] * 4 + [1] * 4
    assert launches.left == [params[2]] * 2 and params[2].data_ptr() not in launches.taken()
    expected = reference(x0s + halves, groups, [gs + hs for gs, hs in zip(grads, half_grads)], lr=1e-2)
    assert_equal_to_reference(params[:3], expected[:3], x0s, torch.float32)
    assert_equal_to_reference(params[3:], expected[3:], halves, torch.bfloat16)


def test_state_in_dtypes_the_kernel_does_not_read_steps_on_the_default_path(launches):
    """Moments in bfloat16 for a float32 parameter (torch's Adam tests pre-populate such state; a checkpoint may hold
    it) would be read as float32 by the kernel: that tensor steps on the default path (as it does alone there, bit
    for bit), its neighbour on the kernel (as on the reference path)."""
    x0s, grads = problem([(8, 16), (16, 8)], torch.float32, steps=2)

    def run(indices, **flags):
        params, optimizer = build(x0s, [(indices, {})], lr=1e-2, **flags)
        if 0 in indices:
            state = optimizer.state[params[0]]
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"], state["exp_avg_sq"] = (torch.zeros_like(x0s[0], dtype=torch.bfloat16) for _ in "mv")
            state["last_grad"] = grads[0][0].clone()
        step(params, optimizer, grads)
        return params

    fused, reference, alone = run([0, 1], fused=True), run([0, 1], foreach=False), run([0])
    assert launches.left == [fused[0]] * 2 and fused[1].data_ptr() in launches.taken()
    assert torch.equal(fused[0], alone[0])
    assert_equal_to_reference(fused[1:], reference[1:], x0s[1:], torch.float32)


def test_one_compiled_variant_serves_every_lr_shape_number_and_count_of_tensors(launches):
    """A schedule writes lr and the betas every step, groups differ in every number, optimizers differ in their
    shapes and number of tensors: the kernels take them all in the table, so Triton compiles one variant of each
    kernel per dtype combination and alignment (here: float32, aligned or not), never per number or shape. With
    the numbers compiled in, today's fused=True recompiled per β1 until dynamo's limit."""
    for seed, shapes in enumerate([[(16, 32), (32,)], [(48, 16), (16, 16), (64,), (32, 32)], [(7, 5), (3,)]]):
        x0s, grads = problem(shapes, torch.float32, steps=4, seed=seed)
        params = [torch.nn.Parameter(x.clone()) for x in x0s]
        optimizer = MARS([dict(params=params[:1]), dict(params=params[1:], gamma=0.1 * seed)], lr=1e-2, fused=True)
        for t, gs in enumerate(grads):
            for group in optimizer.param_groups:
                group.update(lr=1e-2 / (t + 1), betas=(0.85 + 0.02 * t, 0.95 + 0.01 * t), weight_decay=0.01 * t)
            for p, g in zip(params, gs):
                p.grad = g.clone()
            optimizer.step()
    aligned = {dict(constants)["ALIGNED"] for *_, constants in launches.variants()}
    assert aligned == {True, False} and len(launches.variants()) == 4  # 2 kernels x aligned or not


def test_the_kernels_count_the_steps_and_read_a_tensor_lr_on_the_device(launches):
    """The first launch advances every step count (no separate launch), and a tensor lr reaches the kernels
    through the table on the device: the result is the number lr's (float64: the table's own dtype, so the lrs
    are the same number)."""
    x0s, grads = problem([(8, 16), (16,)], torch.float32, steps=3)
    with_numbers, opt = build(x0s, [([0, 1], {})], lr=1e-2, fused=True)
    step(with_numbers, opt, grads)
    with_tensor, opt = build(x0s, [([0, 1], {})], lr=torch.tensor(1e-2, dtype=torch.float64), fused=True)
    step(with_tensor, opt, grads)
    assert len(launches.calls) == 2 * 2 * 3 and not launches.left
    assert [opt.state[p]["step"].item() for p in with_tensor] == [3.0, 3.0]
    for a, b in zip(with_tensor, with_numbers):
        assert torch.equal(a, b)


@pytest.mark.parametrize("last_grad_dtype", [None, torch.bfloat16])
def test_a_step_allocates_no_gradient_sized_buffer(last_grad_dtype):
    """c_t is formed twice as the kernel goes, never stored: not even with g_prev in another dtype, where the
    default path makes a gradient-sized buffer (tests/test_mars.py's test of it; the memory plan counts that one)."""
    from test_mars import step_allocations

    p = torch.nn.Parameter(torch.randn(256, 256))
    optimizer = MARS([p], last_grad_dtype=last_grad_dtype, fused=True)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        optimizer.step()
    p.grad = torch.randn_like(p)
    assert step_allocations(optimizer) < p.numel() * p.element_size() // 100


@pytest.mark.slow
def test_ninety_optimizers_in_one_process_all_step_on_the_kernel(launches):
    """Issue 35's test: 90 MARS optimizers in one process, over shapes x settings x dtypes, built first and then
    stepped in turn, every tensor on the kernel (no other path is called: `launches`), each equal to its reference,
    and all of them on a handful of compiled variants (dtype combinations x aligned or not)."""
    shape_sets = [[(16, 16)], [(32, 8), (8,)], [(5, 7), (7,)], [(64, 16), (16, 64), (64,)], [(3, 3, 3)], [(1, 48)]]
    settings = [
        dict(),
        dict(mars_type="mars-lion", betas=(0.9, 0.99), weight_decay=0.1),
        dict(amsgrad=True, gamma=0.1, lr_1d=1e-2, eps_1d_uncorrected=True),
        dict(optimize_1d=True, routing="nd", weight_decay=0.05),
        dict(mars_type="mars-m", last_grad_dtype=torch.bfloat16),
    ]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    runs = []
    for seed, (shapes, setting, dtype) in enumerate(itertools.product(shape_sets, settings, dtypes)):
        x0s, grads = problem(shapes, dtype, steps=2, seed=seed)
        params, optimizer = build(x0s, [(range(len(shapes)), {})], lr=1e-2, **setting, fused=True)
        runs.append((x0s, grads, setting, dtype, params, optimizer))
    assert len(runs) == 90
    for t in range(2):
        for _, grads, _, _, params, optimizer in runs:
            for p, g in zip(params, grads[t]):
                p.grad = g.clone()
            optimizer.step()
    assert len(launches.calls) == 2 * 2 * 90 and not launches.left
    for x0s, grads, setting, dtype, params, _ in runs:
        expected = reference(x0s, [(range(len(x0s)), {})], grads, lr=1e-2, **setting)
        assert_equal_to_reference(params, expected, x0s, dtype)
    # float32 and float16 with g_prev in their dtype or bfloat16, bfloat16; aligned or not; two kernels
    assert len(launches.variants()) == 5 * 2 * 2


# ---------------------------------------------------------------------------------------------------
# Compiled for a GPU (no GPU needed to compile).

KERNEL_DTYPES = [  # p and g, g_prev
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float64, torch.float64),
    (torch.float64, torch.bfloat16),
]

# Compiles each kernel for every dtype pair (argv) aligned and not, in a process of its own: Triton's compiler
# does not run where TRITON_INTERPRET=1 is set (this session's), and prints the global loads and stores and the
# float32 divisions and square roots of each PTX.
COMPILE_FOR_H100 = """
import json, re, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import mars_triton

found = []
for pair in sys.argv[1:]:
    dtype, last_grad_dtype = (getattr(torch, name) for name in pair.split(","))
    compute = "fp64" if dtype == torch.float64 else "fp32"
    signature = dict(table="*i64", hyper="*fp64", programs="*i64", sums="*" + compute)
    for kernel in mars_triton._kernels():
        for aligned in (True, False):
            constants = dict(mars_triton._kernel_constants(dtype, last_grad_dtype, rows=[]), ALIGNED=aligned)
            source = ASTSource(kernel, signature | dict.fromkeys(constants, "constexpr"), constexprs=constants)
            ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
            memory = sorted(set(re.findall(r"(?:ld|st)\\.global\\.[\\w.]+", ptx)))
            arithmetic = sorted(set(re.findall(r"(?:div|sqrt|rcp)\\.[\\w.]+\\.f32", ptx)))
            found.append([pair, kernel.fn.__name__, aligned, memory, arithmetic])
print(json.dumps(found))
"""


@pytest.mark.slow
def test_the_kernels_compile_for_an_h100_with_16_byte_loads_and_torchs_rounding(tmp_path):
    """Each kernel compiled (not interpreted) for compute capability 9.0 by Triton's own compiler and ptxas, for
    every dtype pair: it compiles; aligned, its loads and stores of elements move 16 bytes (v4.b32, v2.b64) and,
    unaligned, one element each; and its float32 divisions and square roots are rounded to nearest as torch's
    (Triton's plain `/` and tl.sqrt are div.full.f32 and sqrt.approx.ftz.f32)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    pairs = [",".join(str(t).removeprefix("torch.") for t in pair) for pair in KERNEL_DTYPES]
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_H100, *pairs], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert len(found) == len(KERNEL_DTYPES) * 2 * 2
    for pair, kernel, aligned, memory, arithmetic in found:
        wide = [op for op in memory if re.search(r"\.v[24]\.b(32|64)$", op)]
        assert bool(wide) == aligned, (pair, kernel, aligned, memory)
        assert all(op.startswith(("div.rn.", "sqrt.rn.")) for op in arithmetic), (pair, kernel, arithmetic)


# ---------------------------------------------------------------------------------------------------
# Where the kernel cannot run.


def test_a_device_the_kernel_does_not_run_on_is_refused_at_the_step_before_anything_changes():
    """As torch's fused optimizers: constructing on the meta device is allowed (a model is often built there),
    the step refuses in torch's words; a CPU runs the kernel only in Triton's interpreter, and without it the step
    refuses before anything changes, saying what to do."""
    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    optimizer = MARS(model.parameters(), fused=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point Tensors.*meta"):
        optimizer.step()

    model = torch.nn.Linear(4, 3)
    optimizer = MARS(model.parameters(), fused=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mars_triton, "_kernels_interpreted", lambda: False)
        with pytest.raises(RuntimeError, match="float32 and cpu: construct MARS with fused=None .*TRITON_INTERPRET=1"):
            optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not optimizer.state  # refused before the state was made
    optimizer.step()
    assert all(optimizer.state[p]["step"].item() == 1 for p in model.parameters())


def test_fused_true_without_triton_is_refused_at_construction(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # what `import triton` meets where it is not installed
    with pytest.raises(ValueError, match="fused=True runs MARS's step as a Triton kernel.*fused=None"):
        MARS([torch.nn.Parameter(torch.zeros(2, 2))], fused=True)
    MARS([torch.nn.Parameter(torch.zeros(2, 2))])  # the default path needs no Triton
