"""MARS(mars_type="mars-m") against a float64 transcription of its reference code (MARS_M/optimizers/mars_m.py
at AGI-Arena/MARS 4831e28, as MARS_M/train_mars_m.py drives it), on square, tall and wide matrices, over 10
steps, approximate and exact, on every path. tests/test_mars.py holds mars-m to the rule's text with the
other instances (dtypes, layouts, host reads, state_dict)."""

import math

import pytest
import torch
from test_mars import PATHS, RefuseHostReads

from mars import MARS

# Two square matrices (one batched Newton-Schulz on the multi-tensor path), a tall and a wide one.
MATRICES = [(8, 8), (8, 8), (12, 5), (5, 12)]
# What the reference trains with its AdamW part: an embedding (2-D) and a LayerNorm weight (1-D).
ADAMW_TENSORS = [(10, 4), (6,)]
STEPS = 10
LRS = [2e-2 * (1 - 0.06 * t) for t in range(STEPS)]  # a changing lr, as a schedule sets it
HP = dict(beta=0.9, beta2=0.99, gamma=0.5, betas_1d=(0.8, 0.9), weight_decay=0.1, eps=1e-8)


def problem(first_scale=2.0, seed=0):
    """Start values, gradients and (exact) look-ahead gradients. The first step's gradients have norms above 1
    (first_scale=2.0), where the reference's zero g_0 and this repository's g_0 = g_1 give the same c̃_1 (see
    test_first_step_differs_from_the_reference_only_by_g0); later ones alternate below and above 1, so both
    sides of the clip of c_t run."""
    gen = torch.Generator().manual_seed(seed)
    shapes = MATRICES + ADAMW_TENSORS

    def scale(t, i):
        return first_scale if t == 0 else (0.05 if (t + i) % 2 else 2.0)

    def rand(shape, s):
        return torch.randn(shape, generator=gen, dtype=torch.float64) * s

    x0s = [rand(s, 1.0) for s in shapes]
    grads = [[rand(s, scale(t, i)) for i, s in enumerate(shapes)] for t in range(STEPS)]
    lookaheads = [[rand(s, scale(t + 1, i)) for i, s in enumerate(shapes)] for t in range(STEPS)]
    return x0s, grads, lookaheads


# ---------------------------------------------------------------------------------------------------
# The reference code's rule, transcribed in float64.


def reference_newton_schulz(G):
    """zeropower_via_newtonschulz5(G, steps=5) in float64 (the reference casts to bfloat16)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.double()
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(5):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.T if tall else X


def reference_run(x0s, grads, lookaheads, *, is_approx, g0="zero", eps=HP["eps"]):
    """MARS_M.step over the matrices and its AdamW part over the rest, in train_mars_m.py's order (exact:
    update_previous_grad on the look-ahead gradient, step, update_last_grad). g0: the g_{t-1} of the first
    step, "zero" as the reference, or "g1" (its own gradient, the choice of mars.py)."""
    beta, gamma, wd = HP["beta"], HP["gamma"], HP["weight_decay"]
    beta1, beta2 = HP["betas_1d"]
    mars_factor = gamma * beta / (1 - beta)
    xs = [x.clone() for x in x0s]
    n = len(MATRICES)
    last = [torch.zeros_like(g) if g0 == "zero" else g.clone() for g in grads[0][:n]]
    buf = [torch.zeros_like(x) for x in xs[:n]]
    moment1 = [torch.zeros_like(x) for x in xs[n:]]
    moment2 = [torch.zeros_like(x) for x in xs[n:]]
    for step, (lr, gs, hs) in enumerate(zip(LRS, grads, lookaheads), start=1):
        previous = hs[:n]  # update_previous_grad (exact)
        for i in range(n):
            g, p = gs[i], xs[i]
            c_t = (g - last[i]).mul(mars_factor).add(g)
            if c_t.norm() > 1:
                c_t = c_t / c_t.norm()
            buf[i] = buf[i] * beta + c_t * (1 - beta)
            u = reference_newton_schulz(buf[i])
            adjusted_lr = lr * 0.2 * math.sqrt(max(p.shape[:2]))
            p = p * (1 - lr * wd)
            xs[i] = p - adjusted_lr * u
            if is_approx:
                last[i] = g
        for j in range(len(xs) - n):
            g, p = gs[n + j], xs[n + j]
            moment1[j] = torch.lerp(moment1[j], g, 1 - beta1)
            moment2[j] = torch.lerp(moment2[j], g.square(), 1 - beta2)
            u = moment1[j] / (eps + moment2[j].sqrt())
            scale = (1 - beta1**step) / (1 - beta2**step) ** 0.5
            xs[n + j] = p * (1 - lr * wd) - lr / scale * u
        if not is_approx:
            last = [h.clone() for h in previous]  # update_last_grad
    return xs


# ---------------------------------------------------------------------------------------------------
# MARS-M here, built as marsgpt/optimizers.py builds it for the trainer.


def mars_m_run(x0s, grads, lookaheads, *, is_approx, eps_1d_uncorrected=True, eps=HP["eps"], **path):
    params = [torch.nn.Parameter(x.clone()) for x in x0s]
    n = len(MATRICES)
    opt = MARS(
        [dict(params=params[:n]), dict(params=params[n:], routing="none")],
        mars_type="mars-m",
        lr=LRS[0],
        betas=(HP["beta"], HP["beta2"]),
        weight_decay=HP["weight_decay"],
        gamma=HP["gamma"],
        is_approx=is_approx,
        lr_1d=LRS[0],
        betas_1d=HP["betas_1d"],
        weight_decay_1d=HP["weight_decay"],
        eps=eps,
        eps_1d_uncorrected=eps_1d_uncorrected,
        **path,
    )
    for lr, gs, hs in zip(LRS, grads, lookaheads):
        for group in opt.param_groups:
            group["lr"] = lr
        if not is_approx:
            for p, h in zip(params, hs):
                p.grad = h.clone()
            opt.update_previous_grad()
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
        opt.update_last_grad()
    return [p.detach() for p in params], opt


def max_difference(got, expected):
    return max((a - b).abs().max().item() for a, b in zip(got, expected))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("is_approx", [True, False], ids=["approx", "exact"])
def test_matches_the_reference_code_in_float64(is_approx, path):
    x0s, grads, lookaheads = problem()
    expected = reference_run(x0s, grads, lookaheads, is_approx=is_approx)
    got, opt = mars_m_run(x0s, grads, lookaheads, is_approx=is_approx, **PATHS[path])
    assert max_difference(got, expected) <= 1e-10
    moved = min((e - x).abs().max().item() for e, x in zip(expected, x0s))
    assert moved > 1e-2  # every tensor moved: the agreement is not that of tensors left alone
    assert all(g.dtype == torch.float64 for g in got)


def test_first_step_differs_from_the_reference_only_by_g0():
    """With first gradients of norm below 1 the reference's c_1 = (1 + γβ/(1-β)) g_1 (its g_0 is zero) is not
    clipped back to this repository's c_1 = g_1: the runs part, and a reference started from g_0 = g_1 is
    this one's again."""
    x0s, grads, lookaheads = problem(first_scale=0.05)
    assert all(g.norm() < 1 for g in grads[0][: len(MATRICES)])
    got, _ = mars_m_run(x0s, grads, lookaheads, is_approx=True)
    assert max_difference(got, reference_run(x0s, grads, lookaheads, is_approx=True, g0="g1")) <= 1e-10
    assert max_difference(got, reference_run(x0s, grads, lookaheads, is_approx=True)) > 1e-4


def test_adamw_part_eps_placement_is_the_reference_s_only_when_asked():
    """eps_1d_uncorrected=True is the reference's (eps added to sqrt(v) before its bias correction); the
    default (torch.optim.AdamW's) differs from it. A large eps makes the difference plain."""
    x0s, grads, lookaheads = problem()
    expected = reference_run(x0s, grads, lookaheads, is_approx=True, eps=1e-2)
    reference_eps, _ = mars_m_run(x0s, grads, lookaheads, is_approx=True, eps=1e-2)
    torch_eps, _ = mars_m_run(x0s, grads, lookaheads, is_approx=True, eps=1e-2, eps_1d_uncorrected=False)
    assert max_difference(reference_eps, expected) <= 1e-10
    assert max_difference(torch_eps, expected) > 1e-5
    n = len(MATRICES)  # the matrices do not use the AdamW part: identical either way
    assert max_difference(torch_eps[:n], expected[:n]) <= 1e-10


def test_state_is_the_momentum_and_the_previous_gradient():
    x0s, grads, lookaheads = problem()
    _, opt = mars_m_run(x0s, grads, lookaheads, is_approx=True)
    matrix, embedding = opt.param_groups[0]["params"][0], opt.param_groups[1]["params"][0]
    assert sorted(opt.state[matrix]) == ["exp_avg", "last_grad", "step"]
    assert sorted(opt.state[embedding]) == ["exp_avg", "exp_avg_sq", "step"]  # routing="none": AdamW


@pytest.mark.parametrize("path", ["reference", "foreach"])
def test_reference_adamw_part_reads_nothing_back_to_the_host(path):
    x0s, grads, _ = problem()
    params = [torch.nn.Parameter(x.float()) for x in x0s]
    n = len(MATRICES)
    groups = [dict(params=params[:n]), dict(params=params[n:], routing="none")]
    opt = MARS(groups, mars_type="mars-m", lr=torch.tensor(1e-2), lr_1d=1e-2, eps_1d_uncorrected=True, **PATHS[path])
    for t, gs in enumerate(grads[:3]):
        for p, g in zip(params, gs):
            p.grad = g.float()
        if t == 0:  # the first step allocates state
            opt.step()
            continue
        with RefuseHostReads():
            opt.step()
    assert all(torch.isfinite(p).all() for p in params)


def test_routing_none_refuses_optimize_1d():
    with pytest.raises(ValueError, match='invalid routing="none" with optimize_1d=True'):
        MARS([torch.nn.Parameter(torch.zeros(3, 2))], mars_type="mars-m", routing="none", optimize_1d=True)


def test_eps_1d_uncorrected_must_be_a_bool():
    with pytest.raises(ValueError, match="invalid eps_1d_uncorrected: 1"):
        MARS([torch.nn.Parameter(torch.zeros(3, 2))], eps_1d_uncorrected=1)
