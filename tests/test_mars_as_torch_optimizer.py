"""MARS held to the protocol torch's generic optimizer tests (test/test_optim.py's TestOptimRenewed) hold torch's
optimizers to, in this repository's CI: one check per torch test that applies, named after it and written here,
driven by the same OptimizerInfo entries (tests/mars_optim_infos.py: every MARS variant, every configuration,
each path: the single-tensor reference, foreach, fused).

Where an entry's step takes a closure (exact MARS), the checks give it one that computes the gradient, as its
protocol needs; tests/mars_optim_infos.py's CONVENTIONS lists where torch's own tests do not, and the other
conventions that do not fit MARS. tests/torch_optim_suite.py runs torch's test file itself on the same entries.
"""

import copy
import io

import pytest
import torch
from torch.nn import Parameter
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

pytest.importorskip("expecttest", reason="torch's test utilities import it: pip install -r requirements-test.txt")

from mars_optim_infos import MARS_OPTIM_DB  # noqa: E402
from torch.testing._internal.common_optimizers import (  # noqa: E402
    OptimizerErrorEnum,
    _get_optim_inputs_including_global_cliquey_kwargs,
)

INFOS = pytest.mark.parametrize("info", MARS_OPTIM_DB, ids=lambda info: info.name)


def every_input(info, dtype=torch.float32, skip=()):
    """Each configuration with each path flag (foreach, fused) off and on, as torch's tests take them."""
    return _get_optim_inputs_including_global_cliquey_kwargs("cpu", dtype, info, skip=skip)


def take_step(optimizer, info, closure):
    """A step as torch's tests take one: through the closure where the entry's step needs one, else the closure's
    backward pass, then step()."""
    if info.step_requires_closure:
        return optimizer.step(closure)
    loss = closure()
    optimizer.step()
    return loss


def linear(contiguous=True, dtype=torch.float32):
    """torch's problem: a (10, 5) weight and a bias (non-contiguous: every other element of a larger tensor)."""
    if contiguous:
        return Parameter(torch.randn(10, 5, dtype=dtype)), Parameter(torch.randn(10, dtype=dtype))
    return Parameter(torch.randn(10, 5, 2, dtype=dtype)[..., 0]), Parameter(torch.randn(10, 2, dtype=dtype)[..., 0])


def squared_loss(optimizer, weights, x, bias=None):
    """A closure: ‖Σ w·x (+ bias)‖², its gradient computed (the closure torch's tests pass)."""

    def closure():
        optimizer.zero_grad()
        y = sum(w.mv(x) for w in weights)
        loss = (y if bias is None else y + bias).pow(2).sum()
        loss.backward()
        return loss

    return closure


def scheduler_steps(schedulers, loss):
    for scheduler in schedulers:
        scheduler.step(loss) if isinstance(scheduler, ReduceLROnPlateau) else scheduler.step()


def assert_same(a, b):
    """Two state dicts (or parts) equal: tensors bit for bit, everything else by ==."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif torch.is_tensor(a):
        assert torch.equal(a, b)
    else:
        assert a == b


# ---------------------------------------------------------------------------------------------------
# The entries and the errors.


@INFOS
def test_optim_infos_do_not_specify_global_cliquey_kwargs(info):
    for optim_input in info.optim_inputs_func(device="cpu"):
        assert not {"foreach", "fused", "differentiable"} & optim_input.kwargs.keys()


@INFOS
def test_errors(info):
    for error_input in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        optim_input = error_input.optimizer_error_input
        raises = pytest.warns if issubclass(error_input.error_type, Warning) else pytest.raises
        if error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
            with raises(error_input.error_type, match=error_input.error_regex):
                info.optim_cls(optim_input.params, **optim_input.kwargs)
        else:
            optimizer = info.optim_cls(optim_input.params, **optim_input.kwargs)
            with raises(error_input.error_type, match=error_input.error_regex):
                optimizer.step()


# ---------------------------------------------------------------------------------------------------
# The update goes downhill: the reference path, parameter groups, schedulers, a tensor lr.


@INFOS
@pytest.mark.parametrize("with_lrsched", [True, False])
@pytest.mark.parametrize("contiguous", [True, False])
def test_forloop_goes_right_direction(info, contiguous, with_lrsched):
    torch.manual_seed(0)
    for schedulers in info.scheduler_inputs if with_lrsched else [[]]:
        for optim_input in info.optim_inputs_func(device="cpu"):  # fresh each time: a tensor lr is mutated
            weight, bias = linear(contiguous)
            x = torch.randn(5)
            optimizer = info.optim_cls([weight, bias], **optim_input.kwargs, foreach=False)
            live = [make(optimizer) for make in schedulers]
            closure = squared_loss(optimizer, [weight], x, bias)
            initial = closure().item()
            for _ in range(20):
                scheduler_steps(live, take_step(optimizer, info, closure))
            assert closure().item() < initial, optim_input.desc


@INFOS
def test_param_group_with_lrscheduler_goes_right_direction(info):
    torch.manual_seed(0)
    for schedulers in info.scheduler_inputs:
        weight, weight2 = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10, 5))
        x = torch.randn(5)
        optimizer = info.optim_cls([{"params": [weight]}, {"params": [weight2], "lr": 0.01}])
        live = [make(optimizer) for make in schedulers]
        closure = squared_loss(optimizer, [weight, weight2], x)
        initial = closure().item()
        for _ in range(20):
            scheduler_steps(live, optimizer.step(closure))
        assert closure().item() < initial


@pytest.mark.slow  # 1-4 s each: every input on every path, fused=True's in Triton's interpreter
@INFOS
@pytest.mark.parametrize("num_dim", [0, 1, 2])
def test_tensor_lr(info, num_dim):
    """A 1-element tensor lr of any shape steps as the same lr given as a number."""
    torch.manual_seed(0)
    for optim_input in every_input(info):
        weight, bias = linear()
        weight_c, bias_c = (Parameter(t.detach().clone()) for t in (weight, bias))
        x = torch.randn(5)
        kwargs = {k: v for k, v in optim_input.kwargs.items() if k != "lr"}
        reference = info.optim_cls([weight, bias], lr=1e-3, **kwargs)
        tensor_lr = torch.tensor(1e-3).reshape([1] * num_dim)
        optimizer = info.optim_cls([weight_c, bias_c], lr=tensor_lr, **kwargs)
        for _ in range(5):
            take_step(reference, info, squared_loss(reference, [weight], x, bias))
            take_step(optimizer, info, squared_loss(optimizer, [weight_c], x, bias_c))
            torch.testing.assert_close(weight_c, weight)
            torch.testing.assert_close(bias_c, bias)


@pytest.mark.slow  # 1-4 s each: every input on every path, fused=True's in Triton's interpreter
@INFOS
def test_param_groups_weight_decay(info):
    torch.manual_seed(0)
    for optim_input in every_input(info):
        weight, weight2 = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10, 5))
        x = torch.randn(5)
        groups = [dict(params=[weight], **optim_input.kwargs), dict(params=[weight2], **optim_input.kwargs)]
        groups[1]["weight_decay"] = 0.0
        optimizer = info.optim_cls(groups)
        closure = squared_loss(optimizer, [weight, weight2], x)
        initial = closure().item()
        for _ in range(20):
            take_step(optimizer, info, closure)
        assert closure().item() < initial, optim_input.desc


@pytest.mark.slow  # 1-4 s each: every input on every path, fused=True's in Triton's interpreter
@INFOS
def test_param_groups_lr(info):
    """A group at lr 1e-28 does not move; the other group, at its own lr, goes downhill."""
    torch.manual_seed(0)
    for optim_input in every_input(info):
        kwargs = dict(optim_input.kwargs, lr=optim_input.kwargs.get("lr") or 1e-3)
        weight, bias = linear()
        irrelevant = Parameter(torch.randn(2, 2))
        before = irrelevant.detach().clone()
        x = torch.randn(5)
        optimizer = info.optim_cls([dict(params=[weight, bias], **kwargs), dict(params=[irrelevant])], lr=1e-28)
        loss = squared_loss(optimizer, [weight], x, bias)

        def closure(irrelevant=irrelevant, loss=loss):
            irrelevant.grad = torch.rand_like(irrelevant)
            return loss()

        initial = loss().item()
        for _ in range(20):
            take_step(optimizer, info, closure)
        assert loss().item() < initial, optim_input.desc
        assert torch.equal(irrelevant, before)


# ---------------------------------------------------------------------------------------------------
# The paths agree: foreach and fused against the single-tensor reference.


def compare_paths(info, dtype, flag):
    """torch's _test_derived_optimizers: each configuration with `flag` off and on, on the same small network and
    a 0-d parameter, seven steps, one without gradients and two with a layer frozen: the parameters and every
    state tensor equal, to torch's default tolerance for the dtype."""
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype).reshape(3, 2)
    for optim_input in info.optim_inputs_func(device="cpu", dtype=dtype):
        runs = []
        for value in (False, True):
            torch.manual_seed(1)
            model = torch.nn.Sequential(
                torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1), torch.nn.Sigmoid()
            ).to(dtype)
            scalar = torch.full((), 0.5, dtype=dtype, requires_grad=True)  # a 0-d parameter, as torch's
            scalar.grad = torch.full_like(scalar, 0.25)
            params = [*model.parameters(), scalar]
            runs.append((model, params, info.optim_cls(params, **optim_input.kwargs, **{flag: value})))
        for i in range(7):
            for model, _, optimizer in runs:
                model[2].requires_grad_(not 3 <= i < 5)

                def closure(model=model, optimizer=optimizer):
                    optimizer.zero_grad()
                    loss = model(x).sum()
                    loss.backward()
                    return loss

                if i != 2:
                    take_step(optimizer, info, closure)
                elif not info.step_requires_closure:  # no gradients: a step that changes nothing
                    optimizer.zero_grad()
                    optimizer.step()
            (_, params, optimizer), (_, params_c, optimizer_c) = runs
            for p, p_c in zip(params, params_c):
                for key, value in [("parameter", p), *optimizer.state[p].items()]:
                    actual = p_c if key == "parameter" else optimizer_c.state[p_c][key]
                    where = f"{optim_input.desc}, step {i}, {key}"
                    torch.testing.assert_close(actual, value, msg=lambda m, where=where: f"{where}: {m}")
                    with torch.no_grad():  # as torch's TensorTracker: each step compared from the same values
                        actual.copy_(value)


@INFOS
def test_foreach_matches_forloop(info):
    compare_paths(info, torch.float64, "foreach")


@pytest.mark.slow
@INFOS
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fused_matches_forloop(info, dtype):
    compare_paths(info, dtype, "fused")


# ---------------------------------------------------------------------------------------------------
# Steps that change nothing, and gradients that stay the caller's.


@INFOS
def test_step_is_noop_when_params_have_no_grad(info):
    params = [torch.randn(2, 3) for _ in range(2)]
    before = [p.clone() for p in params]
    for optim_input in every_input(info):
        info.optim_cls(params, **optim_input.kwargs).step(lambda: torch.tensor([1.0]))
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@INFOS
def test_step_is_noop_for_zero_grads(info):
    for optim_input in every_input(info):
        if optim_input.kwargs.get("weight_decay", 0) != 0:  # decay moves the parameter whatever its gradient
            continue
        param = Parameter(torch.randn(5, 1))
        before = param.detach().clone()
        optimizer = info.optim_cls([param], **optim_input.kwargs)

        def closure(param=param, optimizer=optimizer):
            optimizer.zero_grad()
            param.grad = torch.zeros_like(param)
            return torch.tensor([1.0])

        optimizer.step(closure)
        assert torch.equal(param, before), optim_input.desc


@INFOS
def test_grads_are_never_inplaced_into(info):
    param = Parameter(torch.randn(5, 1))
    grad = torch.rand_like(param)
    for optim_input in every_input(info):
        optimizer = info.optim_cls([param], **optim_input.kwargs)
        version = grad._version

        def closure(optimizer=optimizer):
            optimizer.zero_grad()
            param.grad = grad
            return torch.tensor([1.0])

        for _ in range(5):
            optimizer.step(closure)
            assert grad._version == version, optim_input.desc


@INFOS
def test_optimizer_can_be_printed(info):
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for optim_input in every_input(info):
        text = repr(info.optim_cls(params, **optim_input.kwargs))
        assert text.startswith("MARS (") and "mars_type:" in text


# ---------------------------------------------------------------------------------------------------
# State dicts: deterministic, loadable from older and from named optimizers, through torch.save.


def named(params, is_named):
    return [(f"name{i}", p) for i, p in enumerate(params)] if is_named else params


def without_param_names(state_dict):
    state_dict = copy.deepcopy(state_dict)
    for group in state_dict["param_groups"]:
        group.pop("param_names", None)
    return state_dict


@pytest.mark.slow  # 1-4 s each: every input on every path, fused=True's in Triton's interpreter
@INFOS
@pytest.mark.parametrize("is_named_optim1", [True, False])
@pytest.mark.parametrize("is_named_optim0", [True, False])
def test_state_dict_deterministic(info, is_named_optim0, is_named_optim1):
    """Loaded into an optimizer of cloned parameters, a state dict continues bit for bit, whether either side was
    built from named parameters; and it is the same state dict."""
    torch.manual_seed(0)
    for optim_input in every_input(info):
        weight, bias = Parameter(torch.randn(2, 3)), Parameter(torch.randn(2))
        x = torch.randn(3)
        optimizer = info.optim_cls(named([weight, bias], is_named_optim0), **optim_input.kwargs)
        closure = squared_loss(optimizer, [weight], x, bias)
        for _ in range(10):
            take_step(optimizer, info, closure)
        weight_c, bias_c = (Parameter(t.detach().clone()) for t in (weight, bias))
        optimizer_c = info.optim_cls(named([weight_c, bias_c], is_named_optim1), **optim_input.kwargs)
        optimizer_c.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        closure_c = squared_loss(optimizer_c, [weight_c], x, bias_c)
        for _ in range(10):
            take_step(optimizer, info, closure)
            take_step(optimizer_c, info, closure_c)
            assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c), optim_input.desc
        assert_same(without_param_names(optimizer.state_dict()), without_param_names(optimizer_c.state_dict()))
        optimizer_c.param_groups.extend(optimizer_c.param_groups)  # a repeated group is written alike
        assert_same(
            without_param_names(optimizer.state_dict())["param_groups"][-1],
            without_param_names(optimizer_c.state_dict())["param_groups"][-1],
        )


def conv_and_norm():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2), torch.nn.BatchNorm2d(2))
    return model, torch.rand(1, 4, 16, 16)


def model_loss(optimizer, model, x):
    def closure():
        optimizer.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    return closure


@pytest.mark.slow  # 1-4 s each: every input on every path, fused=True's in Triton's interpreter
@INFOS
def test_can_load_older_state_dict(info):
    """A state dict without the settings later versions added (not_og_supported_flags) loads, and steps."""
    for optim_input in every_input(info):
        model, x = conv_and_norm()
        optimizer = info.optim_cls(model.parameters(), **optim_input.kwargs)
        for _ in range(3):
            take_step(optimizer, info, model_loss(optimizer, model, x))
        old = copy.deepcopy(optimizer.state_dict())
        for group in old["param_groups"]:
            for flag in info.not_og_supported_flags:
                group.pop(flag, None)
        optimizer.load_state_dict(old)
        before = [p.detach().clone() for p in model.parameters()]
        take_step(optimizer, info, model_loss(optimizer, model, x))
        assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before)), optim_input.desc


@pytest.mark.slow  # 1-4 s each: every input on every path, fused=True's in Triton's interpreter
@INFOS
@pytest.mark.parametrize("is_named_optim1", [True, False])
@pytest.mark.parametrize("is_named_optim0", [True, False])
def test_can_load_from_to_named_state_dict(info, is_named_optim0, is_named_optim1):
    for optim_input in every_input(info):
        model, x = conv_and_norm()
        source = model.named_parameters() if is_named_optim0 else model.parameters()
        optimizer = info.optim_cls(source, **optim_input.kwargs)
        for _ in range(3):
            take_step(optimizer, info, model_loss(optimizer, model, x))
        target = model.named_parameters() if is_named_optim1 else model.parameters()
        optimizer2 = info.optim_cls(target, **optim_input.kwargs)
        optimizer2.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        take_step(optimizer2, info, model_loss(optimizer2, model, x))
        if is_named_optim0 or is_named_optim1:  # the names of whichever side had them
            names = [name for name, _ in model.named_parameters()]
            assert optimizer2.state_dict()["param_groups"][0]["param_names"] == names


@INFOS
@pytest.mark.parametrize("is_named_optim", [True, False])
def test_save_load_equality_with_weights_only(info, is_named_optim):
    torch.manual_seed(0)
    for optim_input in every_input(info):
        weight, bias = Parameter(torch.randn(2, 3)), Parameter(torch.randn(2))
        x = torch.randn(3)
        optimizer = info.optim_cls(named([weight, bias], is_named_optim), **optim_input.kwargs)
        for _ in range(3):
            optimizer.step(squared_loss(optimizer, [weight], x, bias))
        state_dict = optimizer.state_dict()
        for weights_only in (False, True):
            buffer = io.BytesIO()
            torch.save(state_dict, buffer)
            buffer.seek(0)
            assert_same(torch.load(buffer, weights_only=weights_only), state_dict)


@INFOS
def test_load_nontensor_step(info):
    """A state dict whose step counts are Python numbers (as older checkpoints wrote them) loads, and steps."""
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for optim_input in every_input(info):
        optimizer = info.optim_cls(params, **optim_input.kwargs)
        closure = random_grads(optimizer, params)
        for _ in range(3):
            optimizer.step(closure)
        state_dict = copy.deepcopy(optimizer.state_dict())
        for entry in state_dict["state"].values():
            entry["step"] = entry["step"].item()
        optimizer.load_state_dict(state_dict)
        optimizer.step(closure)
        assert all(torch.is_tensor(optimizer.state[p]["step"]) for p in params)


def random_grads(optimizer, params):
    """A closure that zeroes the gradients and sets random ones (a loss it does not compute)."""

    def closure():
        optimizer.zero_grad()
        for p in params:
            p.grad = torch.rand_like(p)
        return torch.tensor([1.0])

    return closure


# ---------------------------------------------------------------------------------------------------
# Hooks: state dict, load state dict, step.


def state_dict_pre_hook(optimizer):
    optimizer.state["test"] = 1


def state_dict_post_hook(optimizer, state_dict):
    state_dict["ran_state_dict_pre_hook"] = "test" in state_dict["state"]
    state_dict["state"].pop("test", None)
    return state_dict


def state_dict_with_hooks(info, optim_input, pre, post):
    optimizer = info.optim_cls([torch.rand(2, 3, requires_grad=True)], **optim_input.kwargs)
    if pre:
        optimizer.register_state_dict_pre_hook(state_dict_pre_hook)
    if post:
        optimizer.register_state_dict_post_hook(state_dict_post_hook)
    return optimizer.state_dict()


@INFOS
def test_state_dict_pre_hook(info):
    """A pre-hook may write an entry that is no parameter's state into optimizer.state: state_dict() carries it."""
    for optim_input in every_input(info):
        assert state_dict_with_hooks(info, optim_input, pre=True, post=False)["state"]["test"] == 1


@INFOS
def test_state_dict_post_hook(info):
    for optim_input in every_input(info):
        assert not state_dict_with_hooks(info, optim_input, pre=False, post=True)["ran_state_dict_pre_hook"]


@INFOS
def test_state_dict_pre_post_hook(info):
    for optim_input in every_input(info):
        state_dict = state_dict_with_hooks(info, optim_input, pre=True, post=True)
        assert state_dict["ran_state_dict_pre_hook"] and "test" not in state_dict["state"]


# The load-state-dict hooks mark the group's lr: 0.002 and 0.004, not torch's 0.003, which is MARS's default lr
# (tests/mars_optim_infos.py, CONVENTIONS).
def load_pre_hook_writes(optimizer, state_dict):
    state_dict["param_groups"][0]["lr"] = 0.002


def load_pre_hook_returns(optimizer, state_dict):
    state_dict = copy.deepcopy(state_dict)
    state_dict["param_groups"][0]["lr"] = 0.004
    return state_dict


def load_post_hook(optimizer):
    optimizer.state["ran_load_pre_hook_returns"] = optimizer.param_groups[0]["lr"] == 0.004
    optimizer.state["ran_load_post_hook"] = True


@INFOS
def test_load_state_dict_pre_hook_and_prepend(info):
    for optim_input in every_input(info):
        optimizer = info.optim_cls([torch.rand(2, 3, requires_grad=True)], **optim_input.kwargs)
        state_dict = optimizer.state_dict()
        optimizer.register_load_state_dict_pre_hook(load_pre_hook_writes)
        optimizer.load_state_dict(state_dict)
        assert optimizer.param_groups[0]["lr"] == 0.002
        optimizer.register_load_state_dict_pre_hook(load_pre_hook_returns, prepend=True)
        optimizer.load_state_dict(state_dict)
        assert optimizer.param_groups[0]["lr"] == 0.002  # the prepended hook ran first; the other wrote after it


def loaded_with_hooks(info, optim_input, pre):
    optimizer = info.optim_cls([torch.rand(2, 3, requires_grad=True)], **optim_input.kwargs)
    if pre:
        optimizer.register_load_state_dict_pre_hook(load_pre_hook_returns)
    optimizer.register_load_state_dict_post_hook(load_post_hook)
    optimizer.load_state_dict(optimizer.state_dict())
    return optimizer.state


@INFOS
def test_load_state_dict_post_hook(info):
    for optim_input in every_input(info):
        state = loaded_with_hooks(info, optim_input, pre=False)
        assert not state["ran_load_pre_hook_returns"] and state["ran_load_post_hook"]


@INFOS
def test_load_state_dict_pre_post_hook(info):
    for optim_input in every_input(info):
        state = loaded_with_hooks(info, optim_input, pre=True)
        assert state["ran_load_pre_hook_returns"] and state["ran_load_post_hook"]


def hooked_steps(info, optim_input, register):
    """Three steps, then one after the hooks `register` installed are removed; returns the hooks' calls."""
    params = [torch.tensor([[1.0, 1.0]])]
    optimizer = info.optim_cls(params, **optim_input.kwargs)
    calls = []
    handles = register(optimizer, lambda mark: lambda opt, args, kwargs: calls.append((opt is optimizer, mark)))
    for _ in range(2):
        optimizer.step(lambda: 1)
    for handle in handles:
        handle.remove()
    optimizer.step(lambda: 1)
    return calls


@INFOS
def test_step_pre_hook(info):
    for optim_input in every_input(info):
        calls = hooked_steps(info, optim_input, lambda opt, hook: [opt.register_step_pre_hook(hook("pre"))])
        assert calls == [(True, "pre")] * 2


@INFOS
def test_step_post_hook(info):
    for optim_input in every_input(info):
        calls = hooked_steps(info, optim_input, lambda opt, hook: [opt.register_step_post_hook(hook("post"))])
        assert calls == [(True, "post")] * 2


@INFOS
def test_step_all_hooks(info):
    """Global and per-optimizer hooks around each step in order: global pre, pre, post, global post."""

    def register(opt, hook):
        return [
            register_optimizer_step_pre_hook(hook("global pre")),
            opt.register_step_pre_hook(hook("pre")),
            opt.register_step_post_hook(hook("post")),
            register_optimizer_step_post_hook(hook("global post")),
        ]

    for optim_input in every_input(info):
        marks = [mark for _, mark in hooked_steps(info, optim_input, register)]
        assert marks == ["global pre", "pre", "post", "global post"] * 2


# ---------------------------------------------------------------------------------------------------
# Copies, and the state a step leaves.


@INFOS
def test_deepcopy_copies_all_public_attrs(info):
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for optim_input in every_input(info):
        optimizer = info.optim_cls(params, **optim_input.kwargs)
        for _ in range(3):
            optimizer.step(random_grads(optimizer, params))
        public = {k for k in optimizer.__dict__ if not k.startswith("_")}
        assert {k for k in copy.deepcopy(optimizer).__dict__ if not k.startswith("_")} == public


@INFOS
def test_non_empty_state(info):
    model = torch.nn.Linear(5, 5, bias=False)
    x = torch.rand(2, 5)
    for optim_input in info.optim_inputs_func(device="cpu"):
        optimizer = info.optim_cls(model.parameters(), **optim_input.kwargs)
        take_step(optimizer, info, model_loss(optimizer, model, x))
        assert optimizer.state and all(len(state) > 0 for state in optimizer.state.values())


@INFOS
def test_fused_error_on_params_on_meta(info):
    """As torch's fused optimizers: parameters on the meta device are refused at the step, in torch's words (the
    kernel runs on CUDA, and on CPU tensors in Triton's interpreter), before any state is made; moved to a device
    the kernel runs on, the model's new parameters step. (The trainer's memory plan steps its optimizer on the meta
    device with fused off.)"""
    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1), torch.nn.Sigmoid()
        )
    optimizer = info.optim_cls(model.parameters(), fused=True)
    with torch.device("meta"):
        for p in model.parameters():
            p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point Tensors"):
        optimizer.step()
    assert not optimizer.state
    optimizer.zero_grad(set_to_none=True)
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.grad = torch.rand_like(p)
    optimizer.step()  # torch's sequence: the optimizer holds the meta parameters, now without gradients
