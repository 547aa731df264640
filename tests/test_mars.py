"""mars.py against a float64 transcription of issue 3's update rule, and as a drop-in torch optimizer."""

import copy
import itertools
import math

import pytest
import torch

import mars
from mars import MARS, MARS_TYPES, newton_schulz

# Shapes that exercise every branch: wide and tall 2-D (Newton-Schulz transposes tall ones), 1-D
# (MARS or AdamW depending on optimize_1d), and 3-D (mars-shampoo falls back to the AdamW rule).
SHAPES = [(4, 6), (7, 3), (5,), (2, 3, 2)]
LRS = [3e-2, 2e-2, 1e-2, 5e-3]  # a changing learning rate, as a schedule would set it


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


def make_problem(dtype=torch.float64, seed=0, steps=None, grad_scale=lambda t, i: 0.05 if (t + i) % 2 else 2.0):
    """Initial tensors, gradients and (exact MARS) look-ahead gradients per step; by default some
    gradient norms are below 1 and some above, so both sides of the clip are exercised."""
    gen = torch.Generator().manual_seed(seed)
    steps = len(LRS) if steps is None else steps

    def rand(shape, scale):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    x0s = [rand(s, 1.0) for s in SHAPES]
    grads = [[rand(s, grad_scale(t, i)) for i, s in enumerate(SHAPES)] for t in range(steps)]
    lookaheads = [[rand(s, grad_scale(t + 1, i)) for i, s in enumerate(SHAPES)] for t in range(steps)]
    return x0s, grads, lookaheads


def run_mars(x0s, grads, lookaheads, lrs=LRS, params=None, opt=None, **kwargs):
    params = params or [torch.nn.Parameter(x.clone()) for x in x0s]
    opt = opt or MARS(params, lr=lrs[0], **kwargs)
    for lr, gs, hs in zip(lrs, grads, lookaheads):
        for group in opt.param_groups:
            group["lr"] = lr
        if not opt.param_groups[0]["is_approx"]:
            for p, h in zip(params, hs):
                p.grad = h.clone()
            opt.update_previous_grad()
        for p, g in zip(params, gs):
            p.grad = g.clone()
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
    test_newton_schulz_matches_transcription holds the bf16 function to the issue separately."""
    monkeypatch.setattr(mars, "newton_schulz", lambda G, steps=5, eps=1e-7: spec_newton_schulz(G, eps, torch.float64))


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
        for foreach, fused_devices in ((False, ()), (True, ()), (True, ("cpu",))):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(mars, "_FUSED_ADAM_DEVICES", fused_devices)
                params, _ = run_mars(
                    x0s, grads[:steps], lookaheads, foreach=foreach, **{k: v for k, v in hp.items() if k != "lr"}
                )
            for p, e in zip(params, expected):
                torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mars_type", MARS_TYPES)
@pytest.mark.parametrize("is_approx", [True, False])
@pytest.mark.parametrize("fused_devices", [("cpu",), ()])
def test_foreach_equals_single_tensor_reference(mars_type, is_approx, fused_devices, monkeypatch):
    """The multi-tensor path, with CPU's fused AdamW kernel and with the foreach ops CUDA uses."""
    monkeypatch.setattr(mars, "_FUSED_ADAM_DEVICES", fused_devices)
    x0s, grads, lookaheads = make_problem(dtype=torch.float32, steps=6)
    lrs = [1e-2] * 6
    kw = dict(mars_type=mars_type, is_approx=is_approx, weight_decay=0.1, amsgrad=True)
    ref, _ = run_mars(x0s, grads, lookaheads, lrs=lrs, foreach=False, **kw)
    fast, _ = run_mars(x0s, grads, lookaheads, lrs=lrs, foreach=True, **kw)
    for a, b in zip(ref, fast):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("mars_type", MARS_TYPES)
@pytest.mark.parametrize("is_approx", [True, False])
@pytest.mark.parametrize("foreach", [False, True])
def test_state_dict_round_trip_continues_bit_for_bit(mars_type, is_approx, foreach):
    x0s, grads, lookaheads = make_problem(dtype=torch.float32, steps=6)
    kw = dict(mars_type=mars_type, is_approx=is_approx, foreach=foreach, weight_decay=0.1, amsgrad=True)
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


@pytest.mark.parametrize("foreach", [False, True])
def test_previous_gradient_is_the_optimizers_own_copy(foreach):
    """Zeroing, accumulating into or clipping .grad in place after step() leaves the run unchanged."""
    x0s, grads, lookaheads = make_problem(dtype=torch.float32, steps=4)
    expected, _ = run_mars(x0s, grads, lookaheads, lrs=[1e-2] * 4, foreach=foreach)

    params = [torch.nn.Parameter(x.clone()) for x in x0s]
    opt = MARS(params, lr=1e-2, foreach=foreach)
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


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 200)])
def test_newton_schulz_singular_values_near_one(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    out = newton_schulz(G)
    assert out.dtype == G.dtype and out.shape == G.shape
    s = torch.linalg.svdvals(out.double())
    assert s.min() >= 0.5 and s.max() <= 1.5


@pytest.mark.parametrize("shape", [(16, 40), (40, 16)])
def test_newton_schulz_matches_transcription(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    out = newton_schulz(G, dtype=torch.bfloat16)
    torch.testing.assert_close(out, spec_newton_schulz(G, 1e-7), rtol=0, atol=1e-2)
    # The CPU default computes in float32 (bf16 matmuls are slow on CPUs): the same rule, less rounding.
    torch.testing.assert_close(newton_schulz(G), spec_newton_schulz(G, 1e-7, torch.float32), rtol=0, atol=1e-5)


def test_newton_schulz_on_a_spread_spectrum():
    gen = torch.Generator().manual_seed(1)
    U, _ = torch.linalg.qr(torch.randn(48, 48, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(48, 48, generator=gen))
    s = torch.linalg.svdvals(newton_schulz(U @ torch.diag(torch.linspace(1.0, 0.05, 48)) @ V.T).double())
    assert s.min() >= 0.5 and s.max() <= 1.5


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(lr=-1e-3), "lr"),
        (dict(eps=-1e-8), "eps"),
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
        (dict(routing="conv"), "routing"),
        (dict(lr=0.0), "lr"),
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


def test_sparse_gradient_raises():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        MARS(emb.parameters()).step()


@pytest.mark.parametrize("mars_type", MARS_TYPES)
@pytest.mark.parametrize("foreach", [False, True])
def test_bfloat16_parameters_keep_bfloat16_state(mars_type, foreach):
    x0s, grads, lookaheads = make_problem(dtype=torch.bfloat16, steps=2)
    params, opt = run_mars(x0s, grads, lookaheads, lrs=[1e-2] * 2, mars_type=mars_type, foreach=foreach, amsgrad=True)
    for p in params:
        assert p.dtype == torch.bfloat16 and torch.isfinite(p.float()).all()
        for key, value in opt.state[p].items():
            assert key == "step" or value.dtype == torch.bfloat16


@pytest.mark.parametrize("mars_type,per_tensor", [("mars-adamw", 3), ("mars-lion", 2), ("mars-shampoo", 2)])
def test_state_holds_what_the_rule_needs(mars_type, per_tensor):
    params = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3))]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = MARS(params, mars_type=mars_type)
    opt.step()
    tensors = [k for k, v in opt.state[params[0]].items() if torch.is_tensor(v)]
    assert len(tensors) == per_tensor
    assert sorted(opt.state[params[1]]) == ["exp_avg", "exp_avg_sq", "step"]  # 1-D: AdamW


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


def test_routing_decides_which_tensors_take_mars():
    """A 4-D convolution kernel takes the AdamW rule under the paper's routing and MARS under "nd"."""
    kernel = torch.nn.Parameter(torch.randn(4, 3, 3, 3))
    matrix = torch.nn.Parameter(torch.randn(5, 4))
    for routing, kernel_is_mars in (("2d", False), ("nd", True)):
        opt = MARS([kernel, matrix], lr=1e-2, routing=routing)
        kernel.grad, matrix.grad = torch.ones_like(kernel), torch.ones_like(matrix)
        opt.step()
        assert ("last_grad" in opt.state[kernel]) == kernel_is_mars
        assert "last_grad" in opt.state[matrix]
