"""optim.py: the learning-rate schedules at their boundaries, and each optimizer built on a tiny GPT."""

import copy
import dataclasses
import glob
import math
import os

import pytest
import torch

from configurator import TrainConfig, load_config
from mars import MARS
from model import GPT, GPTConfig, hidden_matrix_params, param_groups
from optim import ChainedOptimizer, build_optimizer, lr_factor, set_lr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference_cosine_lr(it, cfg):
    """The paper's reference get_lr (MARS/train_mars.py), transcribed: the absolute lr."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * it / cfg.warmup_iters
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    decay_ratio = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (cfg.learning_rate - cfg.min_lr)


def test_cosine_matches_the_reference_at_its_boundaries():
    cfg = load_config([os.path.join(ROOT, "config", "train_gpt2_small_mars.py")])
    floor = cfg.min_lr / cfg.learning_rate
    assert lr_factor(0, cfg) == 0.0  # the reference's warmup starts from lr 0
    assert lr_factor(1000, cfg) == pytest.approx(0.5)
    assert lr_factor(2000, cfg) == pytest.approx(1.0)  # warmup end: the peak
    assert lr_factor(51000, cfg) == pytest.approx((1 + floor) / 2)  # halfway through the cosine
    assert lr_factor(100000, cfg) == pytest.approx(floor)  # lr_decay_iters: min_lr
    assert lr_factor(100001, cfg) == lr_factor(10**7, cfg) == pytest.approx(floor)  # and beyond
    for it in (0, 1, 1999, 2000, 2001, 30000, 99999, 100000, 100001, 200000):
        assert cfg.learning_rate * lr_factor(it, cfg) == pytest.approx(reference_cosine_lr(it, cfg), rel=1e-12)


def test_wsd_and_constant():
    cfg = TrainConfig(schedule="wsd", max_iters=1000, warmup_iters=100, learning_rate=1e-3, min_lr=1e-4)
    assert [lr_factor(it, cfg) for it in (0, 50, 100, 799, 800)] == pytest.approx([0, 0.5, 1, 1, 1])
    assert lr_factor(900, cfg) == pytest.approx(0.55)  # halfway through the last 20%: between 1 and 0.1
    assert lr_factor(1000, cfg) == lr_factor(5000, cfg) == pytest.approx(0.1)  # min_lr at max_iters, after
    const = dataclasses.replace(cfg, schedule="constant")
    assert [lr_factor(it, const) for it in (0, 50, 100, 10**6)] == pytest.approx([0, 0.5, 1, 1])
    assert lr_factor(0, dataclasses.replace(cfg, decay_lr=False)) == 1.0  # no schedule, no warmup


def test_muon_configs_reproduce_the_reference_muon_schedule():
    """train_muon.py: warmup 2000, constant, then base_lr * (max_iters - it) / 2000 over the last 2000."""
    cfg = load_config([os.path.join(ROOT, "config", "train_gpt2_small_muon.py")])
    for it in (0, 1000, 2000, 50000, 97999, 98000, 99000, 99999, 100000):
        expect = it / 2000 if it < 2000 else 1.0 if it < 98000 else (100000 - it) / 2000
        assert lr_factor(it, cfg) == pytest.approx(expect, abs=1e-12)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return GPT(
        GPTConfig(
            block_size=16,
            vocab_size=64,
            n_layer=2,
            n_head=2,
            n_embd=32,
            bias=False,
            scale_attn_by_inverse_layer_idx=True,
        )
    )


def train_steps(model, optimizer, steps, seed=1):
    """`steps` optimizer steps on one fixed batch (so the loss must fall); the losses."""
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(seed))
    losses = []
    for _ in range(steps):
        _, loss = model(x, torch.roll(x, -1, dims=1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if isinstance(optimizer, MARS):
            optimizer.update_last_grad()
        losses.append(loss.item())
    return losses


def test_mars_is_built_as_the_reference_builds_it():
    cfg = load_config([os.path.join(ROOT, "config", "train_gpt2_small_mars.py")])
    model = tiny_model()
    opt = build_optimizer(model, cfg, "cpu")
    assert isinstance(opt, MARS)
    reference_groups = param_groups(model, cfg.weight_decay)
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == [
        [id(p) for p in g["params"]] for g in reference_groups
    ]
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-2, 0.0]
    for g in opt.param_groups:
        assert (g["lr"], g["initial_lr"], g["betas"], g["gamma"]) == (6e-3, 6e-3, (0.95, 0.99), 0.025)
        assert (g["lr_1d"], g["betas_1d"], g["weight_decay_1d"]) == (3e-3, (0.9, 0.95), 0.1)
        assert (g["mars_type"], g["is_approx"], g["optimize_1d"]) == ("mars-adamw", True, False)
    losses = train_steps(model, opt, 6)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize("mars_type", ["mars-lion", "mars-shampoo"])
def test_mars_variants_build_from_their_configs(mars_type):
    cfg = load_config([os.path.join(ROOT, "config", f"train_gpt2_small_{mars_type.replace('-', '_')}.py")])
    opt = build_optimizer(tiny_model(), cfg, "cpu")
    assert {g["mars_type"] for g in opt.param_groups} == {mars_type}


def test_mars_keeps_its_last_gradient_in_the_configured_dtype():
    cfg = load_config([os.path.join(ROOT, "config", "train_gpt2_small_mars.py")])
    model = tiny_model()
    opt = build_optimizer(model, dataclasses.replace(cfg, last_grad_dtype="bfloat16"), "cpu")
    train_steps(model, opt, 1)
    assert {s["last_grad"].dtype for s in opt.state.values() if "last_grad" in s} == {torch.bfloat16}


def test_adamw_uses_the_reference_groups_and_betas():
    cfg = load_config([os.path.join(ROOT, "config", "train_gpt2_small_adamw.py")])
    model = tiny_model()
    opt = build_optimizer(model, cfg, "cpu")
    assert type(opt) is torch.optim.AdamW
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(g["betas"] == (0.9, 0.95) and g["initial_lr"] == 6e-4 and not g["fused"] for g in opt.param_groups)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_muon_chains_muon_on_hidden_matrices_and_adamw_on_the_rest():
    cfg = load_config([os.path.join(ROOT, "config", "train_gpt2_small_muon.py")])
    model = tiny_model()
    opt = build_optimizer(model, cfg, "cpu")
    assert isinstance(opt, ChainedOptimizer)
    muon, adamw = opt.optimizers
    hidden, other = hidden_matrix_params(model)
    assert type(muon) is torch.optim.Muon and [id(p) for p in muon.param_groups[0]["params"]] == [id(p) for p in hidden]
    g = muon.param_groups[0]
    assert (g["lr"], g["weight_decay"], g["momentum"], g["nesterov"], g["adjust_lr_fn"]) == (
        2e-2,
        0.0,
        0.95,
        True,
        "original",
    )
    assert type(adamw) is torch.optim.AdamW
    assert {id(p) for g in adamw.param_groups for p in g["params"]} == {id(p) for p in other}
    assert all(g["lr"] == 3e-3 and g["betas"] == (0.9, 0.95) for g in adamw.param_groups)
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.1]
    assert [g["initial_lr"] for g in opt.param_groups] == [2e-2, 3e-3]
    losses = train_steps(model, opt, 6)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize("name", ["small_mars", "small_adamw", "small_muon"])
def test_state_dict_round_trip_continues_identically(name):
    cfg = load_config([os.path.join(ROOT, "config", f"train_gpt2_{name}.py")])
    model, other_model = tiny_model(), tiny_model()
    opt = build_optimizer(model, cfg, "cpu")
    train_steps(model, opt, 2)
    other_model.load_state_dict(model.state_dict())
    other_opt = build_optimizer(other_model, cfg, "cpu")
    other_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # as a checkpoint would: no shared tensors
    set_lr(opt, 0.5)
    set_lr(other_opt, 0.5)  # after load_state_dict: the group dicts it replaced
    train_steps(model, opt, 2, seed=7)
    train_steps(other_model, other_opt, 2, seed=7)
    for a, b in zip(model.parameters(), other_model.parameters()):
        assert torch.equal(a, b)


def test_set_lr_scales_every_group_from_its_initial_lr():
    cfg = load_config([os.path.join(ROOT, "config", "train_gpt2_small_muon.py")])
    opt = build_optimizer(tiny_model(), cfg, "cpu")
    set_lr(opt, 0.25)
    assert [g["lr"] for g in opt.param_groups] == [2e-2 * 0.25, 3e-3 * 0.25]
    set_lr(opt, 1.0)
    assert [g["lr"] for g in opt.param_groups] == [g["initial_lr"] for g in opt.param_groups]


def test_every_shipped_config_builds_its_optimizer():
    for path in sorted(glob.glob(os.path.join(ROOT, "config", "train_gpt2_*.py"))):
        cfg = load_config([path])
        opt = build_optimizer(tiny_model(), cfg, "cpu")
        assert {g["initial_lr"] for g in opt.param_groups} <= {cfg.learning_rate, cfg.muon_lr, cfg.muon_adamw_lr}
