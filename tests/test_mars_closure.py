"""Exact MARS through step(closure): equal to the hand-written protocol (update_previous_grad / step /
update_last_grad) on every path, rule and mix of exact and approximate groups; what it refuses and what it
leaves untouched then; x_{t-1} kept only where the closure route needs it; and the protocol through a wrapper
that forwards attributes (Lightning's LightningOptimizer)."""

import copy

import pytest
import torch

from mars import MARS

PATHS = {"reference": dict(foreach=False), "foreach": dict(), "fused": dict(fused=True)}


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3, bias=False)
    )


def batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 5, generator=gen), torch.randn(6, 3, generator=gen)) for _ in range(n)]


def loss_on(model, batch):
    x, y = batch
    return (model(x) - y).square().mean()


def groups_of(model, mixed):
    """One exact group, or (mixed) the matrices exact and the rest approximate."""
    if not mixed:
        return [dict(params=list(model.parameters()), is_approx=False)]
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [dict(params=matrices, is_approx=False), dict(params=rest, is_approx=True)]


def hand_written_run(steps, lrs, mixed=False, **kwargs):
    """The class docstring's protocol: look-ahead backward on the next batch, store; backward on the batch, step,
    update_last_grad."""
    model = small_model()
    opt = MARS(groups_of(model, mixed), lr=lrs[0], **kwargs)
    data = batches(steps + 1)
    for t in range(steps):
        opt.param_groups[0]["lr"] = lrs[t]
        loss_on(model, data[t + 1]).backward()
        opt.update_previous_grad()
        opt.zero_grad(set_to_none=True)
        loss_on(model, data[t]).backward()
        opt.step()
        opt.update_last_grad()
        opt.zero_grad(set_to_none=True)
    return model, opt


def closure_run(steps, lrs, mixed=False, model=None, opt=None, start=0, **kwargs):
    """The same batches through step(closure), the closure as torch documents it (Lightning's does the same)."""
    model = model or small_model()
    opt = opt or MARS(groups_of(model, mixed), lr=lrs[0], **kwargs)
    data = batches(steps + 1)
    losses = []
    for t in range(start, steps):
        opt.param_groups[0]["lr"] = lrs[t]

        def closure(batch=data[t]):
            opt.zero_grad()
            loss = loss_on(model, batch)
            loss.backward()
            return loss

        losses.append(opt.step(closure))
    return model, opt, losses


LRS = [1e-2, 3e-2, 2e-2, 1e-2, 5e-3, 5e-3]


@pytest.mark.slow
@pytest.mark.parametrize("mixed", [False, True], ids=["exact", "exact-and-approximate-groups"])
@pytest.mark.parametrize("mars_type", ["mars-adamw", "mars-lion", "mars-shampoo", "mars-m"])
@pytest.mark.parametrize("path", PATHS)
def test_exact_mars_through_a_closure_equals_the_hand_written_protocol(path, mars_type, mixed):
    kwargs = dict(mars_type=mars_type, gamma=0.5, weight_decay=0.1, weight_decay_1d=0.05, **PATHS[path])
    expected, _ = hand_written_run(len(LRS), LRS, mixed, **kwargs)
    got, opt, losses = closure_run(len(LRS), LRS, mixed, **kwargs)
    for a, b in zip(got.parameters(), expected.parameters()):
        assert torch.equal(a, b)
    # step() returns the loss at the current parameters (the closure's last call), as torch's optimizers do
    data = batches(len(LRS) + 1)
    assert losses[0].item() == pytest.approx(loss_on(small_model(), data[0]).item(), rel=1e-6)
    assert all("previous_param" in opt.state[p] for p in got.parameters())


@pytest.mark.slow
def test_a_closure_run_resumes_bit_for_bit_from_a_state_dict():
    kwargs = dict(gamma=0.5, is_approx=False)
    expected, _, _ = closure_run(len(LRS), LRS, **kwargs)
    model, opt, _ = closure_run(3, LRS, **kwargs)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    restored = small_model(seed=5)
    restored.load_state_dict(saved[0])
    opt2 = MARS(restored.parameters(), lr=LRS[0], **kwargs)
    opt2.load_state_dict(saved[1])
    closure_run(len(LRS), LRS, model=restored, opt=opt2, start=3)
    for a, b in zip(restored.parameters(), expected.parameters()):
        assert torch.equal(a, b)


def test_a_closure_that_adds_to_accumulated_gradients_is_refused_and_changes_nothing():
    """Lightning with accumulate_grad_batches > 1: the stepping micro-batch's closure does not zero the gradients
    the earlier micro-batches left. Exact MARS cannot evaluate those at x_{t-1}: refused, nothing touched."""
    model, opt, _ = closure_run(2, LRS, is_approx=False)
    data = batches(4, seed=7)
    loss_on(model, data[0]).backward()  # an earlier micro-batch
    held = [p.grad.clone() for p in model.parameters()]
    before = copy.deepcopy(([p.detach().clone() for p in model.parameters()], opt.state_dict()))

    def accumulating_closure():
        loss = loss_on(model, data[1])
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.step(accumulating_closure)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before[0]))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), held))
    torch.testing.assert_close(opt.state_dict()["state"], before[1]["state"], rtol=0, atol=0)


def test_a_closure_that_raises_leaves_the_parameters_where_they_were():
    model, opt, _ = closure_run(2, LRS, is_approx=False)
    before = [p.detach().clone() for p in model.parameters()]

    def failing():
        raise KeyError("data loader gone")

    with pytest.raises(KeyError):
        opt.step(failing)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_step_alone_in_exact_mode_says_what_to_do():
    """What Hugging Face's Trainer does (step() with nothing else): the second step cannot correct, and the error
    names the three ways out."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = MARS([p], is_approx=False)
    for _ in range(2):
        p.grad = torch.randn(4, 3)
        if opt.state:
            with pytest.raises(RuntimeError, match=r"closure.*update_previous_grad.*is_approx=True"):
                opt.step()
        else:
            opt.step()  # the first step needs no second gradient (c_1 = g_1)


def test_with_update_previous_grad_a_closure_is_called_once():
    """The hand-written protocol with the step's own gradient from a closure: update_previous_grad() says the loop
    supplies g_{t-1}, so step() calls the closure once, as any optimizer does."""
    model = small_model()
    opt = MARS(groups_of(model, False), lr=LRS[0], gamma=0.5)
    data = batches(len(LRS) + 1)
    calls = []
    for t in range(len(LRS)):
        opt.param_groups[0]["lr"] = LRS[t]
        loss_on(model, data[t + 1]).backward()
        opt.update_previous_grad()

        def closure(batch=data[t], t=t):
            calls.append(t)
            opt.zero_grad()
            loss = loss_on(model, batch)
            loss.backward()
            return loss

        opt.step(closure)
        opt.update_last_grad()
        opt.zero_grad(set_to_none=True)
    assert calls == list(range(len(LRS)))
    expected, _ = hand_written_run(len(LRS), LRS, gamma=0.5)
    for a, b in zip(model.parameters(), expected.parameters()):
        assert torch.equal(a, b)


def test_a_closure_that_computes_no_gradient_is_refused_and_keeps_the_gradients():
    """Lightning's manual optimization passes step() a closure that computes nothing, the gradients coming from
    the module's own manual_backward: exact MARS cannot get its second gradient there, and says so."""
    model, opt, _ = closure_run(2, LRS, is_approx=False)
    loss_on(model, batches(1, seed=9)[0]).backward()
    held = [p.grad.clone() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="computed no gradient.*update_previous_grad.*is_approx=True"):
        opt.step(lambda: None)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), held))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


class ForwardingWrapper:
    """What Lightning 2.x's LightningOptimizer is to the optimizer it wraps: an object whose class also derives
    from the optimizer's (so the optimizer's methods run with the wrapper as self) and which forwards every
    attribute it lacks; an attribute the methods assign lands on the wrapper."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.__class__ = type("Wrapped" + type(optimizer).__name__, (ForwardingWrapper, type(optimizer)), {})

    def __getattr__(self, item):
        return getattr(self._optimizer, item)

    def step(self, closure=None):
        return self._optimizer.step(closure)


def test_the_hand_written_protocol_through_a_forwarding_wrapper():
    """Lightning's manual optimization: opt = self.optimizers() is such a wrapper. The protocol's bookkeeping is
    shared with the wrapped optimizer (mutated in place), so update_last_grad() through the wrapper reaches it."""
    model = small_model()
    opt = ForwardingWrapper(MARS(groups_of(model, False), lr=LRS[0], gamma=0.5))
    data = batches(len(LRS) + 1)
    for t in range(len(LRS)):
        opt.param_groups[0]["lr"] = LRS[t]
        loss_on(model, data[t + 1]).backward()
        opt.update_previous_grad()
        opt.zero_grad(set_to_none=True)
        loss_on(model, data[t]).backward()
        opt.step()
        opt.update_last_grad()
        opt.zero_grad(set_to_none=True)
    expected, _ = hand_written_run(len(LRS), LRS, gamma=0.5)
    for a, b in zip(model.parameters(), expected.parameters()):
        assert torch.equal(a, b)


def test_x_previous_is_kept_only_by_the_closure_route():
    """'previous_param' (a copy of the parameters) is allocated where step(closure) needs x_{t-1}: not for
    approximate MARS given a closure, not for the hand-written protocol."""
    model = small_model()
    _, approx, _ = closure_run(3, LRS, model=model, opt=MARS(model.parameters(), lr=LRS[0], is_approx=True))
    _, hand_written = hand_written_run(3, LRS)
    assert approx.state and hand_written.state
    for opt in (approx, hand_written):
        assert all("previous_param" not in state for state in opt.state.values())


def test_a_step_without_the_closure_route_drops_x_previous():
    """x_{t-1} is the previous step's parameters only while every step goes through the closure: after a step
    of the hand-written protocol it would be stale, so it is dropped, and the next step(closure) has none (it calls
    the closure once, correcting with the g_{t-1} that step left)."""
    model, opt, _ = closure_run(2, LRS, gamma=0.5)
    data = batches(5, seed=3)
    loss_on(model, data[1]).backward()
    opt.update_previous_grad()
    opt.zero_grad(set_to_none=True)
    loss_on(model, data[0]).backward()
    opt.step()
    opt.update_last_grad()
    assert all("previous_param" not in state for state in opt.state.values())
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = loss_on(model, data[2])
        loss.backward()
        return loss

    opt.step(closure)
    assert len(calls) == 1 and all("previous_param" in opt.state[p] for p in model.parameters())
    opt.step(closure)
    assert len(calls) == 3
