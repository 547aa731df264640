"""mars.py's parameter groups as a library user meets them: what a group's weight_decay means for its 1-D
tensors, every group number live (written by a scheduler or a user, used at the next step, read back as used),
and the trainer's groups training bit for bit as with the mars.py before these semantics (a13f015)."""

import copy
import math
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import mars
from mars import MARS, MARSWeightDecayWarning

PATHS = {"reference": dict(foreach=False), "foreach": dict(), "fused": dict(fused=True)}


@pytest.fixture(autouse=True)
def every_warning_is_seen():
    """Warnings are errors here, except where a test asks for one: a test that means no warning checks it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", MARSWeightDecayWarning)
        yield


# ---------------------------------------------------------------------------------------------------
# A float64 transcription of the rule (mars-adamw, the paper's routing, approximate MARS) in which every
# hyperparameter may change at every step; the 1-D lr of each step is given as it should be used.


def spec_run(x0s, grads, hps):
    """x0s: tensors; grads[t][i]: g of tensor i at step t+1; hps[t]: the group's numbers at step t+1, with
    'lr_1d' the 1-D lr that step must use. Returns the tensors after the steps."""
    xs = [x.clone() for x in x0s]
    states = [dict(m=torch.zeros_like(x), v=torch.zeros_like(x)) for x in xs]
    prev = None
    for t, (hp, gs) in enumerate(zip(hps, grads), start=1):
        new = []
        for i, (x, g, st) in enumerate(zip(xs, gs, states)):
            if x.ndim == 2:
                beta1, beta2 = hp["betas"]
                g_prev = g if t == 1 else prev[i]
                c = g + hp["gamma"] * beta1 / (1 - beta1) * (g - g_prev)
                c = c / max(1.0, torch.sqrt((c * c).sum()).item())
                lr, wd = hp["lr"], hp["weight_decay"]
            else:
                beta1, beta2 = hp["betas_1d"]
                c, lr, wd = g, hp["lr_1d"], hp["weight_decay_1d"]
            st["m"] = beta1 * st["m"] + (1 - beta1) * c
            st["v"] = beta2 * st["v"] + (1 - beta2) * c * c
            u = (st["m"] / (1 - beta1**t)) / (torch.sqrt(st["v"] / (1 - beta2**t)) + hp["eps"])
            new.append(x - lr * (u + wd * x))
        xs, prev = new, gs
    return xs


SHAPES = [(4, 6), (7, 3), (5,), (3,)]


def problem(steps=6, seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    x0s = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    scale = [0.05, 2.0]
    grads = [
        [torch.randn(s, generator=gen, dtype=torch.float64) * scale[(t + i) % 2] for i, s in enumerate(shapes)]
        for t in range(steps)
    ]
    return x0s, grads


BASE = dict(
    lr=2e-2,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.05,
    gamma=0.5,
    lr_1d=8e-3,
    betas_1d=(0.8, 0.9),
    weight_decay_1d=0.2,
)


def drive(x0s, grads, writes, path="reference", **kwargs):
    """MARS over tensors x0s for len(grads) steps; writes[t] (a dict) is written into the group before step
    t+1. Returns the tensors and the optimizer."""
    params = [torch.nn.Parameter(x.clone()) for x in x0s]
    opt = MARS(params, **{**BASE, **kwargs}, **PATHS[path])
    for t, gs in enumerate(grads):
        opt.param_groups[0].update(writes.get(t, {}))
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return params, opt


# ---------------------------------------------------------------------------------------------------
# 1. A group's weight_decay and its 1-D tensors.


def torch_adamw_run(x0, grads, lr, betas, weight_decay, eps=1e-8):
    p = torch.nn.Parameter(x0.clone())
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, foreach=False)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def nanogpt_groups(model, weight_decay):
    """nanoGPT's configure_optimizers (and Hugging Face Trainer's grouping): decay the matrices, not the rest."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@pytest.mark.parametrize("path", PATHS)
def test_a_no_decay_group_does_not_decay_its_1d_tensors(path):
    """The group says weight_decay=0.0 for its biases: they train as AdamW without decay (the paper's code decayed
    them at weight_decay_1d=0.1), the group reads weight_decay_1d=0.0, and the constructor says what changed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    with pytest.warns(MARSWeightDecayWarning, match=r"group 1 sets weight_decay=0.0 .* weight_decay_1d=0.1"):
        opt = MARS(nanogpt_groups(model, 1e-2), lr=1e-2, lr_1d=3e-3, **PATHS[path])
    assert [g["weight_decay_1d"] for g in opt.param_groups] == [1e-2, 0.0]
    bias0 = model.bias.detach().clone()
    grads = [torch.randn(4, generator=torch.Generator().manual_seed(t)) for t in range(4)]
    for g in grads:
        model.weight.grad, model.bias.grad = torch.randn(4, 6), g.clone()
        opt.step()
    expected = torch_adamw_run(bias0, grads, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    torch.testing.assert_close(model.bias.detach(), expected, rtol=1e-6, atol=1e-7)


def test_weight_decay_1d_set_in_the_group_is_taken_as_it_is():
    """The trainer's groups set both (the paper's numbers): no warning, and the 1-D tensors decay at weight_decay_1d."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    groups = [dict(g, weight_decay_1d=0.1) for g in nanogpt_groups(model, 1e-2)]
    opt = MARS(groups, lr=1e-2, lr_1d=3e-3)  # a warning would be an error here
    assert [g["weight_decay_1d"] for g in opt.param_groups] == [0.1, 0.1]
    bias0 = model.bias.detach().clone()
    grads = [torch.randn(4, generator=torch.Generator().manual_seed(t)) for t in range(3)]
    for g in grads:
        model.weight.grad, model.bias.grad = torch.randn(4, 6), g.clone()
        opt.step()
    expected = torch_adamw_run(bias0, grads, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    torch.testing.assert_close(model.bias.detach(), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "group",
    [
        dict(shapes=[(4, 3)], weight_decay=0.0),  # only matrices: no tensor takes the AdamW part
        dict(shapes=[(4, 3), (3,)], weight_decay=0.1),  # the same number both ways
        dict(shapes=[(3,)], weight_decay=0.0, optimize_1d=True),  # MARS takes the 1-D tensors too
        dict(shapes=[(3,)], weight_decay=0.0, weight_decay_1d=0.0),  # chosen explicitly
    ],
)
def test_no_warning_where_the_two_readings_agree(group):
    shapes = group.pop("shapes")
    MARS([dict(params=[torch.nn.Parameter(torch.zeros(s)) for s in shapes], **group)])


def test_constructor_weight_decay_leaves_weight_decay_1d_at_its_default():
    """Only a group's own weight_decay is read as meant for its 1-D tensors; MARS(..., weight_decay=x) keeps the
    paper's weight_decay_1d (the repository's drop-in example reproduces the paper's numbers)."""
    opt = MARS([torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3))], weight_decay=1e-2)
    assert opt.param_groups[0]["weight_decay_1d"] == 0.1


# The last commit before the change: the trainer must train bit for bit as with that mars.py.
PREVIOUS = "a13f015"


def previous_mars():
    """mars.py as of PREVIOUS, from git (skips where there is no repository history)."""
    try:
        root = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
        ).stdout.strip()
        source = subprocess.run(
            ["git", "-C", root, "show", f"{PREVIOUS}:mars.py"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"needs the repository's history ({PREVIOUS})")
    module = types.ModuleType("mars_previous")
    module.__file__ = "mars_previous.py"
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


@pytest.mark.parametrize(
    "config,overrides",
    [
        ("mars", []),
        ("mars", ["--is_approx=False"]),
        ("mars_m", []),
    ],
)
def test_the_trainers_numbers_are_bit_identical_to_the_previous_mars(monkeypatch, config, overrides):
    """The trainer's groups (marsgpt.optimizers: weight_decay_1d and lr_1d in every group), its schedule from lr 0
    (set_lr), its exact look-ahead, and a resume that writes the configuration back (load_state_dict), with the changed
    learning rates a resume may bring: every parameter and state tensor equal, bit for bit, to the previous mars.py."""
    training_optimizer = pytest.importorskip("marsgpt.training_optimizer")
    config_module = pytest.importorskip("marsgpt.config")
    Parallelism = pytest.importorskip("marsgpt.parallel").Parallelism
    from model import GPT, GPTConfig

    old = previous_mars()
    root = Path(training_optimizer.__file__).resolve().parents[1]
    schedule = ["--warmup_iters=2", "--lr_decay_iters=8", "--max_iters=8"]
    cfg = config_module.load_config([str(root / "config" / f"train_gpt2_small_{config}.py"), *schedule, *overrides])
    resumed = config_module.load_config(
        [
            str(root / "config" / f"train_gpt2_small_{config}.py"),
            *schedule,
            *overrides,
            "--learning_rate=2e-3",
            "--lr_1d=1e-3",
        ]
    )
    data = torch.randint(0, 64, (9, 2, 16), generator=torch.Generator().manual_seed(1))

    def run(module):
        monkeypatch.setitem(sys.modules, "mars", module)  # what the trainer's optimizers import where they build
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, bias=True))
        opt = training_optimizer.build_optimizer(model, cfg, Parallelism.single())
        settings = cfg
        for it in range(8):
            if it == 4:  # a resume: a new optimizer, the checkpoint's state, this run's settings written on top
                saved = copy.deepcopy(opt.state_dict())
                settings = resumed
                opt = training_optimizer.build_optimizer(model, settings, Parallelism.single())
                opt.load_state_dict(saved)
            opt.set_lr(it)
            if opt.look_ahead is not None:
                model(data[it + 1], torch.roll(data[it + 1], -1, 1))[1].backward()
                opt.keep_look_ahead_gradient()
                opt.zero_grad()
            model(data[it], torch.roll(data[it], -1, 1))[1].backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    new_model, new_opt = run(mars)
    old_model, old_opt = run(old)
    for a, b in zip(new_model.parameters(), old_model.parameters()):
        assert torch.equal(a, b)
    for p_new, p_old in zip(new_model.parameters(), old_model.parameters()):
        assert new_opt.state[p_new].keys() == old_opt.state[p_old].keys()
        for key, value in new_opt.state[p_new].items():
            # Exact MARS's previous_grad is scratch between update_last_grad() and the next update_previous_grad(),
            # which writes it whole (a state_dict leaves it out): the step now leaves g_t in last_grad's buffer,
            # which update_last_grad() swaps there, where the previous mars.py left the look-ahead gradient before.
            if key != "previous_grad":
                assert torch.equal(value, old_opt.state[p_old][key]), key
    for g_new, g_old in zip(new_opt.param_groups, old_opt.param_groups):
        # The 1-D lr read back: what the last step used, where the previous mars.py kept the peak lr_1d.
        assert g_new["lr_1d"] == g_new["lr"] * g_new["lr_1d_factor"]
        assert g_new["lr_1d_factor"] == g_old["lr_1d_factor"]


# ---------------------------------------------------------------------------------------------------
# 2. Every group number is live: written, it is used at the next step and reads back as used.


LIVE_WRITES = {
    "lr": 5e-3,
    "betas": (0.7, 0.9),
    "betas_1d": (0.5, 0.6),
    "eps": 1e-3,
    "weight_decay": 0.3,
    "weight_decay_1d": 0.0,
    "gamma": 0.1,
    "lr_1d": 1e-3,
    "lr_1d_factor": 0.25,
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("key", LIVE_WRITES)
def test_every_group_number_written_takes_effect_at_the_next_step(key, path):
    x0s, grads = problem()
    value = LIVE_WRITES[key]
    params, opt = drive(x0s, grads, {3: {key: value}}, path=path)
    ratio = BASE["lr_1d"] / BASE["lr"]
    hps = []
    for t in range(len(grads)):
        hp = dict(BASE)
        if t >= 3:
            hp[key] = value
        if key == "lr_1d":  # the 1-D lr of step 4, then lr_1d / lr times lr (lr does not change here)
            ratio = value / BASE["lr"] if t >= 3 else ratio
        if key == "lr_1d_factor":
            ratio = value if t >= 3 else ratio
        hp["lr_1d"] = hp["lr"] * ratio
        hps.append(hp)
    expected = spec_run(x0s, grads, hps)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12)
    group = opt.param_groups[0]
    assert group[key] == value or key in ("lr_1d", "lr_1d_factor")
    assert group["lr_1d"] == pytest.approx(hps[-1]["lr_1d"], rel=1e-12)  # reads back the 1-D lr last used


def test_the_1d_lr_follows_a_torch_scheduler_and_reads_back_as_used():
    """LambdaLR writes only lr; the 1-D lr follows it as lr × lr_1d / lr (the paper's), and group['lr_1d'] is
    the 1-D lr of the last step, not the constructed one."""
    x0s, grads = problem(steps=5)
    params = [torch.nn.Parameter(x.clone()) for x in x0s]
    opt = MARS(params, **BASE)
    factors = [1.0, 0.5, 0.25, 0.75, 0.1]
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: (factors + [1.0])[t])
    used = []
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        used.append(opt.param_groups[0]["lr_1d"])
        scheduler.step()
    ratio = BASE["lr_1d"] / BASE["lr"]
    assert used == pytest.approx([BASE["lr"] * f * ratio for f in factors], rel=1e-12)
    hps = [dict(BASE, lr=BASE["lr"] * f, lr_1d=BASE["lr"] * f * ratio) for f in factors]
    for p, e in zip(params, spec_run(x0s, grads, hps)):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12)


def test_a_written_lr_1d_is_the_next_1d_lr_and_then_follows_lr():
    x0s, grads = problem(steps=6)
    lrs = [2e-2, 2e-2, 2e-2, 1e-2, 5e-3, 5e-3]
    writes = {t: {"lr": lr} for t, lr in enumerate(lrs)}
    writes[2] = {"lr": lrs[2], "lr_1d": 4e-3}
    params, opt = drive(x0s, grads, writes)
    lrs_1d = [lr * BASE["lr_1d"] / BASE["lr"] for lr in lrs[:2]] + [lr * 4e-3 / 2e-2 for lr in lrs[2:]]
    hps = [dict(BASE, lr=lr, lr_1d=lr_1d) for lr, lr_1d in zip(lrs, lrs_1d)]
    for p, e in zip(params, spec_run(x0s, grads, hps)):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12)
    assert opt.param_groups[0]["lr_1d_factor"] == pytest.approx(0.2)
    assert opt.param_groups[0]["lr_1d"] == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "write,match",
    [
        (dict(lr_1d=1e-3, lr_1d_factor=0.5), "disagree"),
        (dict(lr=0.0, lr_1d=1e-3), "lr is 0"),
        (dict(betas_1d=(1.5, 0.9)), "betas_1d"),
        (dict(weight_decay_1d=-0.1), "weight_decay_1d"),
        (dict(lr_1d_factor=math.inf), "lr_1d_factor"),
        (dict(gamma=None), "gamma"),
    ],
)
def test_a_bad_write_raises_at_the_next_step_before_anything_changes(write, match):
    x0s, grads = problem(steps=3)
    params, opt = drive(x0s, grads[:2], {})
    before = copy.deepcopy(([p.detach() for p in params], opt.state_dict()))
    opt.param_groups[0].update(write)
    for p, g in zip(params, grads[2]):
        p.grad = g.clone()
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before[0]))
    torch.testing.assert_close(opt.state_dict()["state"], before[1]["state"], rtol=0, atol=0)


def test_the_peak_pair_written_back_restates_the_ratio():
    """A trainer restoring its settings writes lr = initial_lr = the peak and lr_1d = the 1-D peak, then its
    schedule writes lr: the 1-D lr follows the schedule at the unchanged ratio, as before the restore."""
    x0s, grads = problem(steps=4)
    writes = {t: {"lr": lr} for t, lr in enumerate([2e-2, 1e-2, 5e-3, 5e-3])}
    expected, _ = drive(x0s, grads, writes)
    restored = {t: dict(w) for t, w in writes.items()}
    restored[2] = dict(initial_lr=BASE["lr"], lr_1d=BASE["lr_1d"], lr_1d_factor=BASE["lr_1d"] / BASE["lr"], lr=5e-3)
    got, _ = drive(x0s, grads, restored)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_one_cycle_lr_writes_beta1_into_betas_and_leaves_betas_1d():
    x0s, grads = problem(steps=4)
    params = [torch.nn.Parameter(x.clone()) for x in x0s]
    opt = MARS(params, **BASE)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=8)
    hps = []
    for gs in grads:
        group = opt.param_groups[0]
        hps.append(dict(BASE, lr=group["lr"], betas=group["betas"], lr_1d=group["lr"] * BASE["lr_1d"] / BASE["lr"]))
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        scheduler.step()
    assert hps[0]["betas"][0] == 0.95 and len({hp["betas"][0] for hp in hps}) > 2  # β1 cycles from 0.95 to 0.85
    assert opt.param_groups[0]["betas_1d"] == BASE["betas_1d"]
    for p, e in zip(params, spec_run(x0s, grads, hps)):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12)


def test_a_tensor_lr_gives_a_tensor_lr_1d():
    x0s, grads = problem(steps=2)
    params = [torch.nn.Parameter(x.clone()) for x in x0s]
    opt = MARS(params, **{**BASE, "lr": torch.tensor(2e-2, dtype=torch.float64)})
    for gs in grads:
        opt.param_groups[0]["lr"] = torch.tensor(1e-2, dtype=torch.float64)
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    lr_1d = opt.param_groups[0]["lr_1d"]
    assert torch.is_tensor(lr_1d) and lr_1d.item() == pytest.approx(1e-2 * BASE["lr_1d"] / BASE["lr"])
