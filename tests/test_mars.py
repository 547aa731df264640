"""mars.py against a float64 transcription of issue 3's update rule, every path against the single-tensor
reference on every dtype and layout, and MARS as a drop-in torch optimizer."""

import ast
import copy
import itertools
import math
import pickle

import pytest
import torch
import torch._dynamo
from allocator import allocator_peak
from torch.utils._python_dispatch import TorchDispatchMode

import mars
from mars import MARS, MARS_TYPES, newton_schulz

# Shapes that exercise every branch: wide and tall 2-D (Newton-Schulz transposes tall ones), 1-D
# (MARS or AdamW depending on optimize_1d), and 3-D (mars-shampoo falls back to the AdamW rule).
SHAPES = [(4, 6), (7, 3), (5,), (2, 3, 2)]
LRS = [3e-2, 2e-2, 1e-2, 5e-3]  # a changing learning rate, as a schedule would set it

# The three ways a step runs; each must give the reference's result.
PATHS = {"reference": dict(foreach=False), "foreach": dict(), "fused": dict(fused=True)}


@pytest.fixture(autouse=True)
def room_for_every_compiled_variant():
    """These tests compile MARS's step (torch.compile(optimizer.step)) for many rules and paths in one process; a
    training run needs one. Above dynamo's recompile limit it would run eagerly and the compiled step go untested."""
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


# ---------------------------------------------------------------------------------------------------
# The rule, transcribed from the text in float64 (one function per numbered item).


def spec_newton_schulz(M, eps, dtype=torch.bfloat16):
    """The issue's NS; dtype=float64 gives the exact-arithmetic version the rule tests use."""
    X = M.to(dtype) / (torch.sqrt((M * M).sum()) + eps)
    transpose = M.shape[0] > M.shape[1]
    if transpose:
        X = X.T
    a, b, c = 3.4445, -4.7750, 2.0315
    for _ in range(5):
        A = X @ X.T
        X = a * X + b * (A @ X) + c * (A @ (A @ X))
    if transpose:
        X = X.T
    return X.to(M.dtype)


def spec_step(x, g, g_prev, st, t, lr, hp):
    """One step of the issue's rule for tensor x; st holds m, v, vmax. Returns the new x."""
    beta1, beta2 = hp["betas"]
    handled = x.dim() == 2 or (hp.get("routing") == "nd" and x.dim() > 2) or hp["optimize_1d"]
    if handled:
        c = g + hp["gamma"] * beta1 / (1 - beta1) * (g - g_prev)
        norm = torch.sqrt((c * c).sum())
        if norm > 1:
            c = c / norm
        st["m"] = beta1 * st["m"] + (1 - beta1) * c
        if hp["mars_type"] == "mars-lion":
            u = torch.sign(st["m"])
        elif hp["mars_type"] == "mars-shampoo" and x.dim() == 2:
            u = spec_newton_schulz(st["m"] / (1 - beta1), hp["eps"], torch.float64) * math.sqrt(
                max(1, x.shape[0] / x.shape[1])
            )
        elif hp["mars_type"] == "mars-m" and x.dim() == 2:  # tests/test_mars_m.py: against its reference code
            u = spec_newton_schulz(st["m"], 1e-7, torch.float64) * 0.2 * math.sqrt(max(x.shape))
        else:
            u = spec_adam(st, c, beta1, beta2, t, hp)
        return x - lr * (u + hp["weight_decay"] * x)
    beta1, beta2 = hp["betas_1d"]
    st["m"] = beta1 * st["m"] + (1 - beta1) * g
    u = spec_adam(st, g, beta1, beta2, t, hp)
    return x - lr * hp["lr_1d"] / hp["lr"] * (u + hp["weight_decay_1d"] * x)


def spec_adam(st, c, beta1, beta2, t, hp):
    st["v"] = beta2 * st["v"] + (1 - beta2) * c * c
    st["vmax"] = torch.maximum(st["vmax"], st["v"])
    v = st["vmax"] if hp["amsgrad"] else st["v"]
    return (st["m"] / (1 - beta1**t)) / (torch.sqrt(v / (1 - beta2**t)) + hp["eps"])


def spec_run(x0s, grads, lookaheads, hp):
    """x0s: initial tensors; grads[t][i]: g at step t+1; lookaheads[t][i]: ∇f(x_t, ξ_{t+1}) (exact)."""
    xs = [x.clone() for x in x0s]
    states = [dict(m=torch.zeros_like(x), v=torch.zeros_like(x), vmax=torch.zeros_like(x)) for x in xs]
    prev = None
    for t, (lr, gs) in enumerate(zip(LRS, grads), start=1):
        # t = 1: no previous gradient, the correction is zero (g_prev := g_1).
        g_prevs = gs if t == 1 else prev
        xs = [spec_step(x, g, gp, st, t, lr, hp) for x, g, gp, st in zip(xs, gs, g_prevs, states)]
        prev = gs if hp["is_approx"] else lookaheads[t - 1]
    return xs


# ---------------------------------------------------------------------------------------------------
# Driving MARS the way a training loop does.


def make_problem(
    dtype=torch.float64,
    seed=0,
    steps=None,
    shapes=SHAPES,
    x_scale=1.0,
    grad_scale=lambda t, i: 0.05 if (t + i) % 2 else 2.0,
):
    """Initial tensors, gradients and (exact MARS) look-ahead gradients per step; by default some
    gradient norms are below 1 and some above, so both sides of the clip are exercised."""
    gen = torch.Generator().manual_seed(seed)
    steps = len(LRS) if steps is None else steps

    def rand(shape, scale):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    x0s = [rand(s, x_scale) for s in shapes]
    grads = [[rand(s, grad_scale(t, i)) for i, s in enumerate(shapes)] for t in range(steps)]
    lookaheads = [[rand(s, grad_scale(t + 1, i)) for i, s in enumerate(shapes)] for t in range(steps)]
    return x0s, grads, lookaheads


def transposed(x):
    """The same values in column-major memory (what x.T of a contiguous tensor looks like)."""
    return x.T.contiguous().T if x.ndim == 2 else x


def run_mars(x0s, grads, lookaheads, lrs=LRS, params=None, opt=None, grad_layout=lambda g: g, **kwargs):
    params = params or [torch.nn.Parameter(x.clone()) for x in x0s]
    opt = opt or MARS(params, lr=lrs[0], **kwargs)
    for lr, gs, hs in zip(lrs, grads, lookaheads):
        for group in opt.param_groups:
            group["lr"] = lr
        if not opt.param_groups[0]["is_approx"]:
            for p, h in zip(params, hs):
                p.grad = grad_layout(h.clone())
            opt.update_previous_grad()
        for p, g in zip(params, gs):
            p.grad = grad_layout(g.clone())
        opt.step()
        if not opt.param_groups[0]["is_approx"]:
            opt.update_last_grad()
    return params, opt


HP = dict(
    lr=LRS[0], betas=(0.9, 0.95), eps=1e-8, gamma=0.5, lr_1d=7e-3, betas_1d=(0.8, 0.9), weight_decay_1d=0.2
)  # gamma large so the correction term is visible in the result


@pytest.fixture
def float64_newton_schulz(monkeypatch):
    """Newton-Schulz in float64 on both sides, so the rest of the shampoo rule is compared exactly;
    test_newton_schulz_matches_transcription holds the real function to the issue separately."""

    def per_matrix(G, steps=5, eps=1e-7):
        matrices = G.reshape(-1, *G.shape[-2:])
        return torch.stack([spec_newton_schulz(M, eps, torch.float64) for M in matrices]).reshape(G.shape)

    monkeypatch.setattr(mars, "newton_schulz", per_matrix)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mars_type,optimize_1d,routing,amsgrad,weight_decay,is_approx",
    [
        combo[:2] + (routing,) + combo[2:]
        for combo in itertools.product(MARS_TYPES, [False, True], [False, True], [0.0, 0.1], [True, False])
        for routing in ("2d", "nd")
        if routing == "2d" or not combo[1]  # optimize_1d=True takes every tensor whatever the routing
    ],
)
def test_matches_float64_transcription(
    mars_type, optimize_1d, routing, amsgrad, weight_decay, is_approx, float64_newton_schulz
):
    hp = dict(
        HP,
        mars_type=mars_type,
        optimize_1d=optimize_1d,
        routing=routing,
        amsgrad=amsgrad,
        weight_decay=weight_decay,
        is_approx=is_approx,
    )
    x0s, grads, lookaheads = make_problem()
    for steps in (1, len(LRS)):  # the first step on its own, then several
        expected = spec_run(x0s, grads[:steps], lookaheads, hp)
        # The multi-tensor path also without torch's fused AdamW kernel: its per-tensor fallback.
        for path, fused_adamw_devices in itertools.product(PATHS, [("cpu",), ()]):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(mars, "_FUSED_ADAMW_DEVICES", fused_adamw_devices)
                kw = {k: v for k, v in hp.items() if k != "lr"}
                params, _ = run_mars(x0s, grads[:steps], lookaheads, **kw, **PATHS[path])
            for p, e in zip(params, expected):
                torch.testing.assert_close(
                    p.detach(), e, rtol=1e-10, atol=1e-12, msg=lambda m, path=path: f"{path}: {m}"
                )


# ---------------------------------------------------------------------------------------------------
# Every path against the single-tensor reference, on every dtype and parameter layout.

LAYOUTS = {
    "contiguous": (lambda x: x, lambda g: g),
    # A transposed weight (x.T of a contiguous tensor) with its gradient in the same layout, as autograd gives.
    "transposed": (transposed, transposed),
    # The same weight with a contiguous gradient: the layouts differ.
    "mismatched": (transposed, lambda g: g),
}


def relative_difference(got, ref, start):
    """Σ|got - ref| / Σ|ref - start|: how far a path's result is from the reference's, per unit of update."""
    num = sum((a.double() - b.double()).abs().sum() for a, b in zip(got, ref))
    den = sum((b.double() - s.double()).abs().sum() for b, s in zip(ref, start))
    return (num / den).item()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_every_path_equals_the_reference(dtype, layout, mars_type):
    """Small weights and a large lr, so each update is many ulps even in bfloat16. In the half types the
    paths round differently (the fused kernels round once, the op-by-op paths after each op; Lion's sign
    may flip where m is within rounding of 0), so they agree in total, not bit for bit."""
    param_layout, grad_layout = LAYOUTS[layout]
    shapes = [(16, 24), (24, 12), (5,), (2, 3, 2)]
    x0s, grads, lookaheads = make_problem(dtype, shapes=shapes, x_scale=0.05)
    x0s = [param_layout(x) for x in x0s]
    lrs = [0.02, 0.03, 0.04, 0.05]
    kw = dict(lrs=lrs, grad_layout=grad_layout, mars_type=mars_type, weight_decay=0.1, amsgrad=True)
    ref, _ = run_mars(x0s, grads, lookaheads, **kw, **PATHS["reference"])
    assert all(torch.isfinite(p).all() for p in ref)
    for path in ("foreach", "fused"):
        got, _ = run_mars(x0s, grads, lookaheads, **kw, **PATHS[path])
        assert all(p.dtype == dtype and p.stride() == x.stride() for p, x in zip(got, x0s))
        if dtype == torch.float64:
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        elif dtype == torch.float32:
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        else:
            assert all(torch.isfinite(p).all() for p in got), path
            assert relative_difference(got, ref, x0s) < (0.1 if dtype == torch.bfloat16 else 0.02), path


@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 1.6e-2), (torch.float16, 2e-3)], ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_weight_decay_in_half_precision_on_every_path(mars_type, path, dtype, rtol):
    """The agreement test above bounds half-precision paths in total, where weight decay is a small part of an
    update. Here it is all of it: with zero gradients every rule's update is 0, so each step multiplies every
    tensor by 1 - lr · weight_decay (0.9) and four steps give 0.9⁴ to within four roundings (2⁻⁹ each in
    bfloat16, 2⁻¹¹ in float16). A path that dropped the decay would be 34% off."""
    shapes = [(16, 24), (24, 12), (5,), (2, 3, 2)]
    x0s = [torch.randn(s, generator=torch.Generator().manual_seed(i)).to(dtype) for i, s in enumerate(shapes)]
    zeros = [[torch.zeros(s, dtype=dtype) for s in shapes] for _ in range(4)]
    kw = dict(lrs=[0.5] * 4, mars_type=mars_type, weight_decay=0.2, lr_1d=0.5, weight_decay_1d=0.2)
    got, _ = run_mars(x0s, zeros, zeros, **kw, **PATHS[path])
    for p, x in zip(got, x0s):
        torch.testing.assert_close(p.double(), x.double() * 0.9**4, rtol=rtol, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_float16_weight_stays_finite(path):
    """Issue 13's case: a 768x768 float16 weight after one step. c̃'s entries are ~1/768, (1-β2)c̃² is
    below float16's smallest subnormal, and v = 0 made m/(sqrt(v)+eps) infinite in 81% of the entries;
    the smallest entries of c̃ and (1-β1)c̃ underflow too, so c̃, m and v are float32."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((torch.randn(768, 768, generator=gen) * 0.02).half())
    p.grad = torch.randn(768, 768, generator=gen).half()
    opt = MARS([p], lr=1e-3, **PATHS[path])
    opt.step()
    assert torch.isfinite(p).all()
    assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == torch.float32
    reference = torch.nn.Parameter((torch.randn(768, 768, generator=torch.Generator().manual_seed(0)) * 0.02).half())
    reference.grad = p.grad
    MARS([reference], lr=1e-3, foreach=False).step()
    # Each entry moved by lr = 1e-3; the paths agree to about one float16 ulp (6e-5 at |p| ~ 0.1).
    torch.testing.assert_close(p, reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("path", ["foreach", "fused"])
@pytest.mark.parametrize("shape", [(6, 4), (5,)])
def test_strided_view_parameter(path, shape):
    """A parameter that is a strided view (every other column of a buffer): torch's fused AdamW kernel
    walks raw memory and would write between the columns; the path must leave them alone."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)
    untouched = base[..., 1::2].clone()
    p = torch.nn.Parameter(base[..., ::2])
    assert not p.is_contiguous() and p.data_ptr() == base.data_ptr()
    reference = torch.nn.Parameter(p.detach().clone())
    for param, kw in ((p, PATHS[path]), (reference, PATHS["reference"])):
        opt = MARS([param], lr=1e-2, weight_decay=0.1, optimize_1d=True, **kw)
        for t in range(3):
            param.grad = torch.randn(shape, generator=torch.Generator().manual_seed(t))
            opt.step()
    assert torch.equal(base[..., 1::2], untouched)
    torch.testing.assert_close(p, reference)


# ---------------------------------------------------------------------------------------------------
# A learning rate stored as a tensor, without host syncs.


class RefuseHostReads(TorchDispatchMode):
    """Fails on any read of a tensor's value into Python or C++ scalars (aten._local_scalar_dense: what
    .item(), float(t) and a tensor passed as a Scalar argument run; a device sync on CUDA)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("the step read a tensor's value back to the host")
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
@pytest.mark.parametrize("mars_type", MARS_TYPES)
@pytest.mark.parametrize("path", PATHS)
def test_tensor_lr_equals_float_lr_without_host_reads(mars_type, path):
    x0s, grads, lookaheads = make_problem(torch.float32, steps=3)
    kw = dict(mars_type=mars_type, weight_decay=0.1, **PATHS[path])
    expected, _ = run_mars(x0s, grads, lookaheads, lrs=LRS[:3], **kw)

    params = [torch.nn.Parameter(x.clone()) for x in x0s]
    opt = MARS(params, lr=torch.tensor(LRS[0]), **kw)
    for t, (lr, gs) in enumerate(zip(LRS, grads)):
        for group in opt.param_groups:
            group["lr"] = torch.tensor(lr)
        for p, g in zip(params, gs):
            p.grad = g.clone()
        if t == 0:  # the first step allocates state
            opt.step()
            continue
        with RefuseHostReads():
            opt.step()
    for a, b in zip(params, expected):
        torch.testing.assert_close(a, b)


def test_refuse_host_reads_catches_a_scalar_argument():
    """The check above can fail: a tensor passed where torch wants a number is read back."""
    x = torch.zeros(3)
    with pytest.raises(AssertionError, match="host"), RefuseHostReads():
        torch._foreach_add_([x], [x], alpha=torch.tensor(0.5))


@pytest.mark.slow
@pytest.mark.parametrize("mars_type", MARS_TYPES)
@pytest.mark.parametrize("path", ["foreach", "fused"])
def test_compiled_optimizer_step_equals_the_reference(mars_type, path):
    """torch.compile(optimizer.step): traced, every path takes the reference's ops (torch's fused AdamW
    kernel cannot be traced), and the compiled step gives the reference's result."""
    x0s, grads, lookaheads = make_problem(torch.float32, steps=3)
    expected, _ = run_mars(x0s, grads, lookaheads, lrs=[1e-2] * 3, mars_type=mars_type)
    params = [torch.nn.Parameter(x.clone()) for x in x0s]
    opt = MARS(params, lr=1e-2, mars_type=mars_type, **PATHS[path])
    step = torch.compile(opt.step)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        step()
    for a, b in zip(params, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_groups_with_different_hyperparameters(path):
    """Two groups, every number different: the kernel must not take one group's numbers for the other's."""
    x0s, grads, lookaheads = make_problem(torch.float32, steps=3)
    # weight_decay_1d set in each group: a group's weight_decay alone would also be its 1-D tensors' (mars.py)
    groups = [
        dict(betas=(0.9, 0.95), eps=1e-6, weight_decay=0.0, weight_decay_1d=0.1, gamma=0.5),
        dict(betas=(0.95, 0.99), eps=1e-8, weight_decay=0.1, weight_decay_1d=0.1, gamma=0.025),
    ]
    expected = []
    for group in groups:
        params, _ = run_mars(x0s, grads, lookaheads, lrs=[1e-2] * 3, **group)
        expected.append(params)
    params = [[torch.nn.Parameter(x.clone()) for x in x0s] for _ in groups]
    opt = MARS([dict(params=ps, **group) for ps, group in zip(params, groups)], lr=1e-2, **PATHS[path])
    for gs in grads:
        for ps in params:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
        opt.step()
    for got, want in zip(params, expected):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("rule,amsgrad", [("adamw", False), ("adamw", True), ("lion", False)])
def test_compiled_step_is_one_graph(rule, amsgrad):
    """No graph breaks: the whole per-tensor step compiles into one graph (one reduction, one loop)."""
    gen = torch.Generator().manual_seed(0)
    p, g, g_prev, m = (torch.randn(40, generator=gen) for _ in range(4))
    v = torch.zeros(40) if rule == "adamw" else None
    v_max = torch.zeros(40) if amsgrad else None
    explanation = torch._dynamo.explain(mars._mars_tensor_step)(
        p,
        g,
        g_prev,
        m,
        v,
        v_max,
        torch.tensor(1e-2),
        torch.tensor(0.1),
        torch.tensor(1.2),
        rule=rule,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        gamma=0.025,
    )
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0


# ---------------------------------------------------------------------------------------------------
# Exact MARS: the protocol, with and without a GradScaler.


def exact_run(scaler, steps=4):
    """Exact MARS on a tiny linear model, as the class docstring's protocol says; with a GradScaler the
    look-ahead gradient is stored unscaled through inverse_scale."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4, bias=False)
    opt = MARS(model.parameters(), lr=1e-2, is_approx=False)
    data = torch.randn(steps + 1, 8, 6, generator=torch.Generator().manual_seed(1))

    def backward(batch):
        loss = model(batch).square().mean()
        (scaler.scale(loss) if scaler else loss).backward()

    for t in range(steps):
        backward(data[t + 1])  # ∇f(x_t, ξ_{t+1})
        opt.update_previous_grad(inverse_scale=1 / scaler.get_scale() if scaler else None)
        opt.zero_grad(set_to_none=True)
        backward(data[t])
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.update_last_grad()
        opt.zero_grad(set_to_none=True)
    return model.weight.detach()


def test_exact_mars_under_a_grad_scaler_equals_the_unscaled_run():
    scaled = exact_run(torch.amp.GradScaler("cpu", init_scale=2.0**16))
    torch.testing.assert_close(scaled, exact_run(None), rtol=1e-6, atol=0)


def test_exact_mars_drops_a_non_finite_look_ahead_gradient_under_a_grad_scaler():
    """The scaler checks only the gradient step() sees; an overflowed look-ahead gradient stored as g_{t-1}
    made every later step NaN. It falls back to the look-ahead gradient stored before it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4, bias=False)
    opt = MARS(model.parameters(), lr=1e-2, is_approx=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    data = torch.randn(7, 8, 6, generator=torch.Generator().manual_seed(1))
    state = opt.state[model.weight]
    for t in range(6):
        scaler.scale(model(data[t + 1]).square().mean()).backward()
        if t == 3:
            model.weight.grad[0, 0] = float("inf")
            before = state["last_grad"].clone()
        opt.update_previous_grad(inverse_scale=1 / scaler.get_scale())
        opt.zero_grad(set_to_none=True)
        scaler.scale(model(data[t]).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.update_last_grad()
        opt.zero_grad(set_to_none=True)
        if t == 3:
            assert torch.equal(state["last_grad"], before)
        assert torch.isfinite(model.weight).all() and torch.isfinite(state["last_grad"]).all(), t


def test_exact_mars_parameter_without_a_look_ahead_gradient_takes_its_own():
    """A tensor unused in the look-ahead pass but used in the step: its g_{t-1} is its own gradient of the
    step (approximate MARS for it), not the look-ahead gradient it had steps ago."""
    a, b = torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2, 2))
    opt = MARS([a, b], is_approx=False)
    for t in range(3):
        a.grad, b.grad = torch.randn(3, 2), (torch.randn(2, 2) if t == 0 else None)
        opt.update_previous_grad()  # b's look-ahead only at t = 0
        grads = torch.randn(3, 2), torch.randn(2, 2)
        a.grad, b.grad = grads[0].clone(), grads[1].clone()
        opt.step()
        opt.update_last_grad()
        if t > 0:
            assert torch.equal(opt.state[b]["last_grad"], grads[1])
            assert not torch.equal(opt.state[a]["last_grad"], grads[0])


def test_exact_mars_a_skipped_step_does_not_store_its_gradient():
    """Under a GradScaler a step with inf gradients never reaches step(); update_last_grad() still runs. A
    tensor without a look-ahead gradient must not take that step's (inf) gradient as its g_{t-1}."""
    a, b = torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2, 2))
    opt = MARS([a, b], is_approx=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    scaler.scale(torch.zeros(()))  # the scaler's state starts with its first scale()
    for t in range(4):
        a.grad, b.grad = torch.randn(3, 2), (torch.randn(2, 2) if t == 0 else None)
        opt.update_previous_grad(inverse_scale=1 / scaler.get_scale())  # b's look-ahead only at t = 0
        a.grad, b.grad = torch.randn(3, 2), torch.randn(2, 2)
        if t == 1:
            b.grad[0, 0] = math.inf  # the scaler skips this step
        scaler.step(opt)
        scaler.update()
        opt.update_last_grad()
        assert torch.isfinite(opt.state[b]["last_grad"]).all() and torch.isfinite(b).all(), t


@pytest.mark.parametrize("is_approx", [True, False])
def test_copied_and_unpickled_optimizers_step(is_approx):
    """Optimizer.__getstate__ keeps only defaults, state and param_groups; the exact protocol's bookkeeping
    travels too (a copy made between step() and update_last_grad() still expects update_last_grad())."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = MARS([p], is_approx=is_approx)
    p.grad = torch.randn(4, 3)
    opt.update_previous_grad()
    opt.step()
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        (q,) = copied.param_groups[0]["params"]
        q.grad = torch.randn(4, 3)
        if not is_approx:
            copied.update_previous_grad()
            with pytest.raises(RuntimeError, match=r"update_last_grad\(\)"):
                copied.step()
            copied.update_last_grad()
        copied.step()
        assert copied.state[q]["step"].item() == 2


def test_exact_mars_without_update_last_grad_raises():
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = MARS([p], is_approx=False)
    p.grad = torch.randn(4, 3)
    opt.update_previous_grad()
    opt.step()
    p.grad = torch.randn(4, 3)
    opt.update_previous_grad()
    with pytest.raises(RuntimeError, match=r"update_last_grad\(\)"):
        opt.step()


def test_exact_mars_update_last_grad_without_a_look_ahead_gradient_raises():
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = MARS([p], is_approx=False)
    p.grad = torch.randn(4, 3)
    opt.step()
    with pytest.raises(RuntimeError, match=r"update_previous_grad\(\)"):
        opt.update_last_grad()


def test_exact_mars_with_only_1d_tensors_follows_the_protocol_without_error():
    # Nothing MARS-handled to store (optimize_1d=False): a ZeRO-1 rank whose share holds no matrix is the same.
    p = torch.nn.Parameter(torch.randn(5))
    opt = MARS([p], is_approx=False, lr_1d=1e-2)
    for _ in range(3):
        p.grad = torch.randn(5)
        opt.update_previous_grad()
        opt.step()
        opt.update_last_grad()
    assert "last_grad" not in opt.state[p] and "exp_avg_sq" in opt.state[p]


def test_approximate_mars_ignores_the_exact_protocol_calls():
    x0s, grads, lookaheads = make_problem(torch.float32, steps=3)
    expected, _ = run_mars(x0s, grads, lookaheads, lrs=[1e-2] * 3)
    params = [torch.nn.Parameter(x.clone()) for x in x0s]
    opt = MARS(params, lr=1e-2)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.update_previous_grad()
        opt.step()
        opt.update_last_grad()
    for a, b in zip(params, expected):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------
# The stored previous gradient in bfloat16 (last_grad_dtype).


@pytest.mark.slow
@pytest.mark.parametrize("is_approx", [True, False])
def test_bfloat16_last_grad_on_every_path(is_approx):
    x0s, grads, lookaheads = make_problem(torch.float32, steps=4)
    kw = dict(lrs=[1e-2] * 4, is_approx=is_approx, weight_decay=0.1, last_grad_dtype=torch.bfloat16)
    ref, opt = run_mars(x0s, grads, lookaheads, **kw, **PATHS["reference"])
    mars_tensors = [p for p in ref if p.ndim == 2]
    assert all(opt.state[p]["last_grad"].dtype == torch.bfloat16 for p in mars_tensors)
    full, _ = run_mars(x0s, grads, lookaheads, **{**kw, "last_grad_dtype": None})
    assert 0 < relative_difference(ref, full, x0s) < 0.02  # g_{t-1} rounded to 8 bits: a small change
    for path in ("foreach", "fused"):
        got, _ = run_mars(x0s, grads, lookaheads, **kw, **PATHS[path])
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------------
# Newton-Schulz.


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 200)])
def test_newton_schulz_singular_values_near_one(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    out = newton_schulz(G)
    assert out.dtype == G.dtype and out.shape == G.shape
    s = torch.linalg.svdvals(out.double())
    assert s.min() >= 0.5 and s.max() <= 1.5


@pytest.mark.parametrize(
    "major, hip, expected", [(9, None, torch.bfloat16), (8, None, torch.bfloat16), (7, None, torch.float16)]
)
def test_newton_schulz_dtype_is_native_bfloat16_else_float16_on_a_gpu(monkeypatch, major, hip, expected):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"major": major}))
    monkeypatch.setattr(torch.version, "hip", hip)
    assert mars.newton_schulz_dtype("cuda:3") == expected
    assert mars.newton_schulz_dtype("cpu") == torch.float32
    assert mars.newton_schulz_dtype("cpu", torch.float64) == torch.float64
    assert mars.newton_schulz_dtype("cpu", torch.bfloat16) == torch.float32


@pytest.mark.slow
def test_newton_schulz_dtype_float16_is_nearer_the_exact_iteration_than_bfloat16():
    """Why GPUs without native bfloat16 take float16: on a GPT-2-sized momentum (768 x 2304: a low-rank part and
    noise) float16's Newton-Schulz stays far closer to float64's than bfloat16's, the reference's."""
    gen = torch.Generator().manual_seed(0)
    rows, cols = 768, 2304
    m = 1e-3 * torch.randn(rows, cols, dtype=torch.float64, generator=gen)
    m += 1e-3 * torch.randn(rows, 8, dtype=torch.float64, generator=gen) @ torch.randn(8, cols, dtype=torch.float64)
    exact = newton_schulz(m, dtype=torch.float64)
    errors = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        u = newton_schulz(m.float(), dtype=dtype).double()
        errors[str(dtype)] = ((u - exact).norm() / exact.norm()).item()
    print("relative to float64:", {name: f"{error:.2%}" for name, error in errors.items()})
    assert errors["torch.float32"] < 1e-3 < errors["torch.float16"] < 1e-2 < errors["torch.bfloat16"] < 5e-2
    assert errors["torch.float16"] < errors["torch.bfloat16"] / 5


@pytest.mark.parametrize("shape", [(16, 40), (40, 16)])
def test_newton_schulz_matches_transcription(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    out = newton_schulz(G, dtype=torch.bfloat16)
    torch.testing.assert_close(out, spec_newton_schulz(G, 1e-7), rtol=0, atol=1e-2)
    # The CPU default computes in float32 (bf16 matmuls are slow on CPUs): the same rule, less rounding.
    torch.testing.assert_close(newton_schulz(G), spec_newton_schulz(G, 1e-7, torch.float32), rtol=0, atol=1e-5)
    # float64 matrices keep float64 on CPU.
    G64 = G.double()
    torch.testing.assert_close(newton_schulz(G64), spec_newton_schulz(G64, 1e-7, torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(16, 40), (40, 16)])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=str)
def test_batched_newton_schulz_equals_one_matrix_at_a_time(shape, dtype, atol):
    stack = torch.randn(3, *shape, generator=torch.Generator().manual_seed(3))
    batched = newton_schulz(stack, dtype=dtype)
    for matrix, out in zip(stack, batched):
        torch.testing.assert_close(out, newton_schulz(matrix, dtype=dtype), rtol=0, atol=atol)


def test_newton_schulz_on_a_spread_spectrum():
    gen = torch.Generator().manual_seed(1)
    U, _ = torch.linalg.qr(torch.randn(48, 48, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(48, 48, generator=gen))
    s = torch.linalg.svdvals(newton_schulz(U @ torch.diag(torch.linspace(1.0, 0.05, 48)) @ V.T).double())
    assert s.min() >= 0.5 and s.max() <= 1.5


# ---------------------------------------------------------------------------------------------------
# Arguments and parameter groups.


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(lr=-1e-3), "lr"),
        (dict(lr=torch.tensor([1e-3, 1e-3])), "lr"),
        (dict(eps=-1e-8), "eps"),
        (dict(eps=0.0), "eps"),
        (dict(lr_1d=-1.0), "lr_1d"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(weight_decay_1d=-0.1), "weight_decay_1d"),
        (dict(gamma=-0.025), "gamma"),
        (dict(betas=(1.0, 0.99)), "betas"),
        (dict(betas=(0.9, -0.1)), "betas"),
        (dict(betas=(0.9,)), "betas"),
        (dict(betas_1d=(0.9, 1.5)), "betas_1d"),
        (dict(mars_type="mars-sgd"), "mars_type"),
        (dict(foreach="yes"), "foreach"),
        (dict(fused=1), "fused"),
        (dict(fused=True, foreach=True), "fused"),
        (dict(routing="conv"), "routing"),
        (dict(last_grad_dtype="bfloat16"), "last_grad_dtype"),
        (dict(last_grad_dtype=torch.int8), "last_grad_dtype"),
        (dict(lr=0.0), "lr"),
        (dict(lr=math.inf), "lr"),
        (dict(gamma=math.inf), "gamma"),
        (dict(eps=math.nan), "eps"),
        (dict(optimize_1d="no"), "optimize_1d"),
        (dict(amsgrad="yes"), "amsgrad"),
        (dict(is_approx=0), "is_approx"),
    ],
)
def test_invalid_arguments_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b") as err:
        MARS([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs)
    if name == "mars_type":
        assert all(t in str(err.value) for t in MARS_TYPES)


def test_invalid_per_group_override_raises():
    with pytest.raises(ValueError, match="gamma"):
        MARS([{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "gamma": -1.0}])


@pytest.mark.parametrize("override", [dict(gamma=-1.0), dict(eps=0.0), dict(lr=0.0)])
def test_add_param_group_validates_before_installing(override):
    first, second = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(3, 2))
    opt = MARS([first])
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [second], **override})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [second]})  # not half-installed: adding it properly still works
    assert opt.param_groups[1]["params"] == [second]


def test_negative_eps_is_told_it_must_be_positive():
    with pytest.raises(ValueError, match="> 0"):
        MARS([torch.nn.Parameter(torch.zeros(2, 2))], eps=-1e-8)


def test_complex_parameter_raises():
    with pytest.raises(ValueError, match="complex"):
        MARS([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])


def test_mars_type_written_into_a_group_later_is_checked():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = MARS([p])
    p.grad = torch.ones(2, 2)
    opt.step()
    opt.param_groups[0]["mars_type"] = "mars-sgd"
    with pytest.raises(ValueError, match="mars_type"):
        opt.step()
    assert opt.state[p]["step"].item() == 1  # refused before anything changed


def test_sparse_gradient_raises():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        MARS(emb.parameters()).step()


def step_allocations(opt):
    """The most bytes the CPU allocator holds at once during opt.step(), beyond what it held before (the step
    measured as it comes: a warm-up step would change the state it allocates)."""
    return allocator_peak(opt.step, warm_up=False)


@pytest.mark.parametrize("last_grad_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("is_approx", [True, False])
def test_a_step_allocates_a_gradient_sized_buffer_only_for_another_last_grad_dtype(is_approx, last_grad_dtype):
    """c_t is computed in last_grad's buffer, which the step then refills with g_t: no gradient-sized buffer,
    approximate or exact (the memory plan counts one only for a last_grad in another dtype than the parameter's)."""
    p = torch.nn.Parameter(torch.randn(256, 256))
    opt = MARS([p], is_approx=is_approx, last_grad_dtype=last_grad_dtype)
    for t in range(3):
        if not is_approx:
            p.grad = torch.randn_like(p)
            opt.update_previous_grad()
        p.grad = torch.randn_like(p)
        if t < 2:
            opt.step()
        else:
            peak = step_allocations(opt)
        opt.update_last_grad()
    gradient = p.numel() * p.element_size()
    assert peak >= gradient if last_grad_dtype else peak < gradient // 100


# ---------------------------------------------------------------------------------------------------
# What torch's optimizers accept, MARS accepts (issue 36: torch's generic optimizer tests found each of these).


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_a_one_element_tensor_lr_of_any_shape_steps_as_the_number(shape, path):
    """torch takes lr=torch.tensor([1e-3]); so does MARS, stepping as with the number (a 2-element lr is refused,
    test_invalid_arguments_raise_naming_the_argument)."""
    x0s, grads, lookaheads = make_problem(torch.float32, steps=3)
    expected, _ = run_mars(x0s, grads, lookaheads, lrs=[1e-2] * 3, **PATHS[path])
    lrs = [torch.tensor(1e-2).reshape(shape)] * 3
    params, opt = run_mars(x0s, grads, lookaheads, lrs=lrs, **PATHS[path])
    for a, b in zip(params, expected):
        torch.testing.assert_close(a, b)
    assert opt.param_groups[0]["lr_1d"].shape == ()  # the 1-D lr of the step, lr × lr_1d_factor


def test_fused_with_foreach_false_takes_the_kernel(monkeypatch):
    """torch refuses only fused=True with foreach=True: fused=True, foreach=False (what torch's test helper
    generates on CUDA) steps every tensor in the kernel."""
    x0s, grads, lookaheads = make_problem(torch.float32, steps=3)
    expected, _ = run_mars(x0s, grads, lookaheads, lrs=[1e-2] * 3, foreach=False)
    monkeypatch.setattr(mars, "_single_tensor_mars", None)  # called, it would raise
    params, opt = run_mars(x0s, grads, lookaheads, lrs=[1e-2] * 3, fused=True, foreach=False)
    for a, b in zip(params, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the kernel rounds in its own order


@pytest.mark.parametrize("how", ["constructor", "add_param_group"])
def test_a_complex_parameter_passed_by_name_is_refused(how):
    """A (name, tensor) pair (model.named_parameters()) is checked as a tensor is: with foreach=False it trained
    with meaningless complex arithmetic, and MARS-Shampoo made NaN."""
    named = [("w", torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64)))]
    with pytest.raises(ValueError, match="MARS does not support complex parameters.*view_as_real"):
        if how == "constructor":
            MARS(named, foreach=False)
        else:
            MARS([("v", torch.nn.Parameter(torch.zeros(2, 2)))]).add_param_group({"params": named})


@pytest.mark.parametrize("named_before,named_after", [(False, True), (True, False)])
def test_a_state_dict_loads_between_plain_and_named_parameters(named_before, named_after):
    """param_names is torch's own group key: an optimizer built from model.named_parameters() loads a state dict
    saved from model.parameters(), and back, and continues bit for bit; the group keeps whichever names it had."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    twin = copy.deepcopy(model)
    data = torch.randn(6, 5, 4, generator=torch.Generator().manual_seed(1))

    def params(module, named):
        return list(module.named_parameters()) if named else list(module.parameters())

    def train(module, opt, batches):
        for x in batches:
            opt.zero_grad()
            module(x).square().sum().backward()
            opt.step()

    opt = MARS(params(model, named_before), lr=1e-2)
    train(model, opt, data[:3])
    twin.load_state_dict(model.state_dict())
    twin_opt = MARS(params(twin, named_after), lr=1e-2)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a file: a live one shares its tensors
    train(model, opt, data[3:])
    train(twin, twin_opt, data[3:])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert twin_opt.param_groups[0]["param_names"] == [name for name, _ in model.named_parameters()]


def test_a_state_dict_without_later_settings_takes_this_optimizers():
    """A state dict whose groups lack foreach and fused (older files, or stripped) or a setting later versions of
    mars.py added loads, each missing setting taking the restoring optimizer's (as foreach and fused always do);
    the settings it has are its own."""
    x0s, grads, lookaheads = make_problem(torch.float32, steps=2, shapes=SHAPES[:3])  # no N-D tensor: routings agree
    _, opt = run_mars(x0s, grads, lookaheads, lrs=[5e-3] * 2, gamma=0.1)
    saved = opt.state_dict()
    later = ("foreach", "fused", "routing", "eps_1d_uncorrected", "last_grad_dtype")
    for group in saved["param_groups"]:
        for key in later:
            del group[key]
    params = [torch.nn.Parameter(x.clone()) for x in x0s]
    settings = dict(foreach=False, routing="nd", eps_1d_uncorrected=True, last_grad_dtype=torch.bfloat16)
    restored = MARS(params, lr=1e-2, **settings)
    restored.load_state_dict(saved)
    group = restored.param_groups[0]
    assert {key: group[key] for key in later} == dict(settings, fused=None)
    assert group["lr"] == 5e-3 and group["gamma"] == 0.1
    for p, g in zip(params, grads[0]):
        p.grad = g.clone()
    restored.step()


@pytest.mark.parametrize("is_approx", [True, False])
def test_an_entry_of_the_state_that_is_no_parameters_state_is_carried(is_approx):
    """torch's state-dict hooks may write into optimizer.state an entry that is not a parameter's state (a number):
    state_dict() carries it, load_state_dict keeps it, and steps (exact MARS's hand-written protocol too, whose
    step drops x_{t-1} from every state) step past it."""
    x0s, grads, lookaheads = make_problem(torch.float32, steps=3)
    params, opt = run_mars(x0s, grads[:1], lookaheads[:1], is_approx=is_approx)
    opt.state["marker"] = 1
    saved = opt.state_dict()
    assert saved["state"]["marker"] == 1
    opt.load_state_dict(saved)
    assert opt.state["marker"] == 1
    run_mars(x0s, grads[1:], lookaheads[1:], lrs=LRS[1:], params=params, opt=opt)


def test_exact_mars_through_a_closure_resumes_through_a_torch_distributed_checkpoint(tmp_path):
    """The route docs/mars.md gives for FSDP2 (get_state_dict -> dcp.save; a fresh model and optimizer ->
    get_state_dict -> dcp.load -> set_state_dict), here in one process: torch creates the fresh optimizer's state
    with a step(closure=None), and dcp.load fills only the keys that state has. x_{t-1} (previous_param), which
    step(closure) needs, was not among them, so the first step after the resume was approximate; now it is, and
    the run continues bit for bit (test_mars_sharded.py: the same on two FSDP2 ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    data = torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(1))

    def train(module, opt, batches):
        for x in batches:

            def closure(x=x):
                opt.zero_grad()
                loss = module(x).square().sum()
                loss.backward()
                return loss

            opt.step(closure)

    opt = MARS(model.parameters(), lr=1e-2, gamma=0.5, is_approx=False)
    train(model, opt, data[:3])
    model_state, optimizer_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp_path))
    resumed = copy.deepcopy(model)
    train(model, opt, data[3:])
    torch.manual_seed(5)
    for p in resumed.parameters():  # other values: the load must bring the saved ones back
        torch.nn.init.normal_(p)
    resumed_opt = MARS(resumed.parameters(), lr=1e-2, gamma=0.5, is_approx=False)
    model_state, optimizer_state = get_state_dict(resumed, resumed_opt)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(tmp_path))
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    assert all("previous_param" in resumed_opt.state[p] for p in resumed.parameters())
    train(resumed, resumed_opt, data[3:])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))


def test_a_hand_written_protocol_checkpoint_carries_no_x_previous_into_the_loaded_state():
    """In exact mode a state dict holds 'previous_param' for every tensor, whichever protocol ran, so that every
    checkpoint has the keys of a fresh optimizer's state; where the hand-written protocol kept none, the parameter
    stands in and 'previous_param_kept' says so: the loaded state holds no copy of the parameters (memory the
    protocol does not spend)."""
    x0s, grads, lookaheads = make_problem(torch.float32, steps=2)
    _, opt = run_mars(x0s, grads, lookaheads, is_approx=False)
    assert all("previous_param" not in state for state in opt.state.values())
    saved = opt.state_dict()
    assert all("previous_param" in state and not state["previous_param_kept"] for state in saved["state"].values())
    restored = MARS([torch.nn.Parameter(x.clone()) for x in x0s], is_approx=False)
    restored.load_state_dict(saved)
    assert restored.state and all(
        state.keys().isdisjoint({"previous_param", "previous_param_kept"}) for state in restored.state.values()
    )


# ---------------------------------------------------------------------------------------------------
# State.


@pytest.mark.slow
@pytest.mark.parametrize("mars_type", MARS_TYPES)
@pytest.mark.parametrize("is_approx", [True, False])
@pytest.mark.parametrize("path", PATHS)
def test_state_dict_round_trip_continues_bit_for_bit(mars_type, is_approx, path):
    x0s, grads, lookaheads = make_problem(dtype=torch.float32, steps=6)
    kw = dict(mars_type=mars_type, is_approx=is_approx, weight_decay=0.1, amsgrad=True, **PATHS[path])
    params, opt = run_mars(x0s, grads[:3], lookaheads[:3], lrs=LRS[:3], **kw)
    saved_params = [p.detach().clone() for p in params]
    saved_state = copy.deepcopy(opt.state_dict())
    run_mars(x0s, grads[3:], lookaheads[3:], lrs=LRS[:3], params=params, opt=opt)

    restored = [torch.nn.Parameter(x.clone()) for x in saved_params]
    opt2 = MARS(restored, **kw)
    opt2.load_state_dict(saved_state)
    run_mars(x0s, grads[3:], lookaheads[3:], lrs=LRS[:3], params=restored, opt=opt2)
    for a, b in zip(params, restored):
        assert torch.equal(a, b)


def test_load_state_dict_keeps_this_processs_path():
    """foreach and fused choose how this process computes the step; a checkpoint of another path must not
    switch it (a fused=True optimizer restored from a default-path run kept compiling)."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    p.grad = torch.randn(4, 3)
    saved = MARS([p])
    saved.step()
    restored = MARS([torch.nn.Parameter(p.detach().clone())], fused=True)
    restored.load_state_dict(saved.state_dict())
    assert restored.param_groups[0]["fused"] is True and restored.param_groups[0]["foreach"] is None


def test_load_state_dict_keeps_the_state_dtypes():
    """Optimizer.load_state_dict casts state to the parameter's dtype; float16 parameters keep a float32
    v, and last_grad_dtype=bfloat16 keeps a bfloat16 g_{t-1}."""
    params = [torch.nn.Parameter(torch.randn(4, 3).half()), torch.nn.Parameter(torch.randn(5, 2))]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = MARS(params, last_grad_dtype=torch.bfloat16)
    opt.step()
    dtypes = {(i, k): v.dtype for i, p in enumerate(params) for k, v in opt.state[p].items()}
    assert dtypes[(0, "exp_avg_sq")] == torch.float32 and dtypes[(1, "last_grad")] == torch.bfloat16
    opt2 = MARS(params, last_grad_dtype=torch.bfloat16)
    opt2.load_state_dict(opt.state_dict())
    assert {(i, k): v.dtype for i, p in enumerate(params) for k, v in opt2.state[p].items()} == dtypes


def test_checkpoint_with_integer_steps_loads():
    """Checkpoints written before the step count was a tensor hold Python ints."""
    x0s, grads, lookaheads = make_problem(dtype=torch.float32, steps=4)
    params, opt = run_mars(x0s, grads[:2], lookaheads, lrs=[1e-2] * 2)
    old = copy.deepcopy(opt.state_dict())
    for state in old["state"].values():
        state["step"] = int(state["step"])
    restored = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = MARS(restored, lr=1e-2)
    opt2.load_state_dict(old)
    run_mars(x0s, grads[2:], lookaheads, lrs=[1e-2] * 2, params=params, opt=opt)
    run_mars(x0s, grads[2:], lookaheads, lrs=[1e-2] * 2, params=restored, opt=opt2)
    for a, b in zip(params, restored):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_previous_gradient_is_the_optimizers_own_copy(path):
    """Zeroing, accumulating into or clipping .grad in place after step() leaves the run unchanged."""
    x0s, grads, lookaheads = make_problem(dtype=torch.float32, steps=4)
    expected, _ = run_mars(x0s, grads, lookaheads, lrs=[1e-2] * 4, **PATHS[path])

    params = [torch.nn.Parameter(x.clone()) for x in x0s]
    opt = MARS(params, lr=1e-2, **PATHS[path])
    for gs in grads:
        for p, g in zip(params, gs):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.add_(g)  # accumulate into the (zeroed) buffer
        opt.step()
        for p in params:
            if "last_grad" in opt.state[p]:
                assert opt.state[p]["last_grad"].data_ptr() != p.grad.data_ptr()
            p.grad.mul_(0.5)  # an in-place clip after the step
        opt.zero_grad(set_to_none=False)
    for a, b in zip(expected, params):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mars_type", MARS_TYPES)
@pytest.mark.parametrize("path", ["reference", "foreach"])
def test_bfloat16_parameters_keep_bfloat16_state(mars_type, path):
    x0s, grads, lookaheads = make_problem(dtype=torch.bfloat16, steps=2)
    params, opt = run_mars(x0s, grads, lookaheads, lrs=[1e-2] * 2, mars_type=mars_type, amsgrad=True, **PATHS[path])
    for p in params:
        assert p.dtype == torch.bfloat16 and torch.isfinite(p.float()).all()
        for key, value in opt.state[p].items():
            assert key == "step" or value.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "mars_type,per_tensor", [("mars-adamw", 3), ("mars-lion", 2), ("mars-shampoo", 2), ("mars-m", 2)]
)
def test_state_holds_what_the_rule_needs(mars_type, per_tensor):
    params = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3))]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = MARS(params, mars_type=mars_type)
    opt.step()
    tensors = [k for k, v in opt.state[params[0]].items() if k != "step"]
    assert len(tensors) == per_tensor
    assert sorted(opt.state[params[1]]) == ["exp_avg", "exp_avg_sq", "step"]  # 1-D: AdamW
    assert opt.state[params[0]]["step"].device == params[0].device


def test_step_returns_closure_loss():
    p = torch.nn.Parameter(torch.ones(3, 2))
    opt = MARS([p])

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 6.0
    assert not torch.equal(p.detach(), torch.ones(3, 2))


def test_grad_scaler_skipped_step_changes_nothing():
    model = torch.nn.Linear(4, 3)
    opt = MARS(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    for poison in (False, True):
        before = copy.deepcopy((opt.state_dict(), model.state_dict()))
        opt.zero_grad()
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()
        if poison:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
    after = (opt.state_dict(), model.state_dict())
    torch.testing.assert_close(after[1], before[1], rtol=0, atol=0)
    torch.testing.assert_close(after[0]["state"], before[0]["state"], rtol=0, atol=0)


@pytest.mark.parametrize("written", ["bfloat16", torch.bfloat16], ids=["by name", "as a dtype"])
def test_state_dict_names_last_grad_dtype_and_loads_either_form(written):
    """state_dict() writes last_grad_dtype by name (torch.distributed.checkpoint's full-state gather takes no
    torch.dtype); checkpoints written with the dtype itself still load, and either continues bit for bit."""
    x0s, grads, lookaheads = make_problem(dtype=torch.float32, steps=4)
    kw = dict(last_grad_dtype=torch.bfloat16, is_approx=False)
    params, opt = run_mars(x0s, grads[:2], lookaheads[:2], **kw)
    saved = copy.deepcopy(opt.state_dict())
    assert [group["last_grad_dtype"] for group in saved["param_groups"]] == ["bfloat16"]
    for group in saved["param_groups"]:
        group["last_grad_dtype"] = written
    restored = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = MARS(restored, **kw)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["last_grad_dtype"] is torch.bfloat16
    run_mars(x0s, grads[2:], lookaheads[2:], lrs=LRS[2:], params=params, opt=opt)
    run_mars(x0s, grads[2:], lookaheads[2:], lrs=LRS[2:], params=restored, opt=opt2)
    assert all(torch.equal(a, b) for a, b in zip(params, restored))


def test_a_dtype_name_a_wrapper_copies_into_a_group_is_taken():
    """torch's ZeroRedundancyOptimizer copies its groups' values into the wrapped optimizer's at every step, so a
    name a checkpoint brought ("bfloat16") reaches the group that allocates g_{t-1} and the look-ahead gradient."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = MARS([p], is_approx=False)
    opt.param_groups[0]["last_grad_dtype"] = "bfloat16"
    p.grad = torch.randn(4, 3)
    opt.update_previous_grad()
    opt.step()
    assert opt.state[p]["last_grad"].dtype == opt.state[p]["previous_grad"].dtype == torch.bfloat16


def test_state_dict_leaves_out_the_look_ahead_gradient():
    """Exact MARS's previous_grad is rewritten whole by the next update_previous_grad() before any use: not saved.
    (test_state_dict_round_trip_continues_bit_for_bit resumes exact runs from such checkpoints.)"""
    x0s, grads, lookaheads = make_problem(dtype=torch.float32, steps=2)
    params, opt = run_mars(x0s, grads, lookaheads, is_approx=False)
    assert "previous_grad" in opt.state[params[0]]
    assert all("previous_grad" not in state for state in opt.state_dict()["state"].values())


def test_a_state_dict_load_restarts_the_exact_protocol():
    """torch.distributed.checkpoint's set_state_dict on a fresh optimizer first takes a zero-lr step() to create the
    state (no update_last_grad() follows); the loaded optimizer must then take the next step of the protocol."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    opt = MARS(model.parameters(), is_approx=False)
    batches = [torch.randn(3, 4) for _ in range(4)]
    for x, x_next in zip(batches, batches[1:]):
        model(x_next).square().sum().backward()
        opt.update_previous_grad()
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
        opt.update_last_grad()
        opt.zero_grad()
    model_state, optimizer_state = get_state_dict(model, opt)
    restored = copy.deepcopy(model)
    restored_opt = MARS(restored.parameters(), is_approx=False)
    set_state_dict(restored, restored_opt, model_state_dict=model_state, optim_state_dict=optimizer_state)
    restored(batches[0]).square().sum().backward()
    restored_opt.update_previous_grad()
    restored_opt.zero_grad()
    restored(batches[1]).square().sum().backward()
    restored_opt.step()  # raised "step() was called again without update_last_grad()" before the restart
    restored_opt.update_last_grad()


def test_mars_imports_only_torch_and_the_standard_library():
    """mars.py is copied and installed on its own: at module level it imports no module of this repository (not
    mars_triton, fused=True's kernel, which only fused=True imports, nor mars_sharded, which only DTensor parameters
    import) and not torch.distributed. mars_triton.py, installed beside it, imports Triton only inside its
    functions; mars_sharded.py imports torch.distributed only inside its functions."""

    def imported_at_module_level(path):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        imported = set()
        for node in tree.body:
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module)
        return imported

    import mars_sharded
    import mars_triton

    assert imported_at_module_level(mars.__file__) == {"importlib", "math", "sys", "typing", "warnings", "torch"}
    assert imported_at_module_level(mars_triton.__file__) == {"functools", "math", "torch"}
    assert imported_at_module_level(mars_sharded.__file__) == {"contextlib", "math", "time", "torch"}


def test_lr_1d_follows_the_schedule_after_a_state_dict_round_trip():
    opt = MARS([torch.nn.Parameter(torch.zeros(3))], lr=1e-2, lr_1d=4e-3)
    opt2 = MARS([torch.nn.Parameter(torch.zeros(3))], lr=5.0, lr_1d=1.0)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.param_groups[0]["lr_1d_factor"] == pytest.approx(0.4)


# ---------------------------------------------------------------------------------------------------
# Cross-check against pytorch_optimizer's independent MARS. Its last_grad starts at zero, so its first
# step sees c_1 = (1 + γβ1/(1-β1)) g_1; once every first-step gradient norm exceeds 1 the clip maps both
# c_1 to g_1/‖g_1‖, and from then on both keep g_{t-1} identically. Its AdamW denominator is
# (sqrt(v + 1e-15) + eps) / sqrt(1-β2^t) -- eps not bias-corrected -- so agreement is to ~1e-7.
# Its shampoo uses a different Newton-Schulz, so only adamw and lion are compared. It gives MARS every
# tensor with 2 or more dimensions, which is routing="nd" here.


@pytest.mark.parametrize("mars_type", ["mars-adamw", "mars-lion"])
@pytest.mark.parametrize("optimize_1d", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_agrees_with_pytorch_optimizer(mars_type, optimize_1d, amsgrad):
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
    x0s, grads, lookaheads = make_problem(grad_scale=lambda t, i: 3.0 if t == 0 else 0.3)
    assert all(g.norm() > 1 for g in grads[0])
    kw = dict(
        betas=(0.9, 0.95),
        gamma=0.5,
        optimize_1d=optimize_1d,
        lr_1d=7e-3,
        betas_1d=(0.8, 0.9),
        weight_decay=0.1,
        weight_decay_1d=0.2,
    )
    ours, _ = run_mars(x0s, grads, lookaheads, mars_type=mars_type, amsgrad=amsgrad, routing="nd", **kw)

    theirs = [torch.nn.Parameter(x.clone()) for x in x0s]
    opt = pytorch_optimizer.MARS(theirs, lr=LRS[0], mars_type=mars_type.removeprefix("mars-"), ams_bound=amsgrad, **kw)
    for lr, gs in zip(LRS, grads):
        opt.param_groups[0]["lr"] = lr
        for p, g in zip(theirs, gs):
            p.grad = g.clone()
        opt.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_routing_decides_which_tensors_take_mars(path):
    """A 4-D convolution kernel takes the AdamW rule under the paper's routing and MARS under "nd"."""
    for routing, kernel_is_mars in (("2d", False), ("nd", True)):
        kernel = torch.nn.Parameter(torch.randn(4, 3, 3, 3))
        matrix = torch.nn.Parameter(torch.randn(5, 4))
        opt = MARS([kernel, matrix], lr=1e-2, routing=routing, **PATHS[path])
        kernel.grad, matrix.grad = torch.ones_like(kernel), torch.ones_like(matrix)
        opt.step()
        assert ("last_grad" in opt.state[kernel]) == kernel_is_mars
        assert "last_grad" in opt.state[matrix]
