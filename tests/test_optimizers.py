"""marsgpt/optimizers.py: the registry (each entry's keys, its parameter split, the optimizer it builds), every
group's lr against the reference's get_lr, each optimizer built as the reference builds it (the Muon split on
GPT-2 small by name), torch's Muon against the reference's, group_hyperparameters."""

import copy
import dataclasses
import glob
import io
import math
import os
import typing

import pytest
import torch
from reference_runs import PAPER_RUNS, reference_get_lr, reference_run

import mars
from mars import MARS
from marsgpt import optimizers
from marsgpt.config import TrainConfig, load_config, print_help
from marsgpt.config_schema import ConfigError
from marsgpt.optim_protocol import ChainedOptimizer
from marsgpt.optimizers import OPTIMIZERS, Registry, group_hyperparameters, scheduled_lr
from marsgpt.parallel import Parallelism
from marsgpt.training_optimizer import build_optimizer
from model import GPT, PRESETS, GPTConfig, hidden_matrix_params, matrix_params, param_groups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def paper_config(size, optimizer, *more):
    return load_config([os.path.join(ROOT, "config", f"train_gpt2_{size}_{optimizer}.py"), *more])


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
    """`steps` steps of the trainer's optimizer (build_optimizer's) on one fixed batch (so the loss must fall); the
    losses."""
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(seed))
    losses = []
    for _ in range(steps):
        _, loss = model(x, torch.roll(x, -1, dims=1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# --- the registry


def gpt2_small():
    with torch.device("meta"):  # the shapes and names only: no memory, no initialisation cost
        return GPT(GPTConfig(**PRESETS["small"], bias=False))


def entry_config(entry, **overrides):
    return dataclasses.replace(TrainConfig(), optimizer=entry.name, **overrides)


ENTRIES = pytest.mark.parametrize("entry", OPTIMIZERS.entries, ids=lambda entry: entry.name)

# Another valid value for every key some optimizer reads.
OTHER_VALUES = dict(
    learning_rate=1e-2,
    weight_decay=0.3,
    beta1=0.8,
    beta2=0.9,
    gamma=0.05,
    is_approx=False,
    betas_1d=(0.8, 0.85),
    last_grad_dtype="bfloat16",
    mars_fused=True,
    lr_1d=1e-4,
    weight_decay_1d=0.3,
    optimize_1d=True,
    muon_lr=1e-3,
    muon_adamw_lr=2e-4,
    muon_matrices="hidden",
)


def built(model, cfg):
    """What build_optimizer makes of cfg: each torch optimizer's class and its groups, parameters by name."""
    optimizer = build_optimizer(model, cfg, Parallelism.single())
    names = {id(p): name for name, p in model.named_parameters()}
    inner = optimizer.optimizers
    return [
        (
            type(o),
            [{k: [names[id(p)] for p in v] if k == "params" else v for k, v in g.items()} for g in o.param_groups],
        )
        for o in inner
    ]


@ENTRIES
def test_an_entry_reads_exactly_the_keys_it_declares(entry):
    """Each key some optimizer reads, set to another value: this optimizer changes exactly when its entry
    declares the key. So the keys it does not read (unused_keys: the resume rule, the ignored-settings note)
    are right."""
    every_key = frozenset().union(*(e.keys for e in OPTIMIZERS.entries))
    assert every_key == set(OTHER_VALUES)
    assert every_key <= {f.name for f in dataclasses.fields(TrainConfig)}
    assert entry.unused_keys == every_key - entry.keys
    cfg = entry_config(entry)
    model = tiny_model()
    baseline = built(model, cfg)
    for key, value in OTHER_VALUES.items():
        assert value != getattr(cfg, key)
        assert (built(model, dataclasses.replace(cfg, **{key: value})) != baseline) == (key in entry.keys), key


@pytest.mark.parametrize(
    "cfg",
    [entry_config(entry) for entry in OPTIMIZERS.entries] + [TrainConfig(optimizer="muon", muon_matrices="hidden")],
    ids=lambda cfg: f"{cfg.optimizer}-{cfg.muon_matrices}",
)
def test_every_parameter_is_in_exactly_one_group(cfg):
    for model in (tiny_model(), gpt2_small()):  # the tied embedding and head: one tensor, in one group
        optimizer = build_optimizer(model, cfg, Parallelism.single())
        grouped = [id(p) for group in optimizer.param_groups for p in group["params"]]
        assert sorted(grouped) == sorted(id(p) for p in model.parameters())


def with_split(entry, split):
    """A registry of one optimizer: `entry` with parameter groups split by `split`."""
    return Registry(dataclasses.replace(entry, split=split), key="optimizer")


def test_a_split_that_misses_or_repeats_a_parameter_is_refused():
    cfg = TrainConfig()
    entry, model = OPTIMIZERS.entry(cfg), tiny_model()
    wpe = model.transformer.wpe.weight

    def without_wpe(model, cfg):
        return [[p for p in group if p is not wpe] for group in entry.split(model, cfg)]

    def wpe_twice(model, cfg):
        decay, no_decay = entry.split(model, cfg)
        return [decay + [wpe], no_decay]

    def foreign(model, cfg):
        decay, no_decay = entry.split(model, cfg)
        return [decay + [torch.nn.Parameter(torch.zeros(2))], no_decay]

    for split, message in [
        (without_wpe, r"missing \['transformer.wpe.weight'\]"),
        (wpe_twice, r"in more than one group \['transformer.wpe.weight'\]"),
        (foreign, "1 tensors not the model's"),
    ]:
        with pytest.raises(ValueError, match=message):
            build_optimizer(model, cfg, Parallelism.single(), with_split(entry, split))
    wpe.requires_grad_(False)  # a frozen parameter may stay out
    frozen_out = build_optimizer(model, cfg, Parallelism.single(), with_split(entry, without_wpe))
    assert all(p is not wpe for group in frozen_out.param_groups for p in group["params"])


def test_every_entry_is_a_value_of_the_optimizer_key():
    cfg_types = typing.get_type_hints(TrainConfig)
    assert typing.get_args(cfg_types["optimizer"]) == tuple(entry.name for entry in OPTIMIZERS.entries)
    mars_rules = [e.reference_keys["mars_type"] for e in OPTIMIZERS.entries if "mars_type" in e.reference_keys]
    assert tuple(mars_rules) == mars.MARS_TYPES  # every rule mars.py offers, named as the reference names it
    for entry in OPTIMIZERS.entries:
        assert OPTIMIZERS.entry(entry_config(entry)) is entry
        assert entry.description and entry.label(entry_config(entry))


def test_help_shows_each_entry_s_description_under_the_key_that_names_it():
    out = io.StringIO()
    print_help(file=out)
    text = out.getvalue()
    names = text[text.index("  --optimizer=") : text.index("  --learning_rate=")]
    for entry in OPTIMIZERS.entries:
        assert entry.description in names, entry.name


def test_mars_m_and_moonlight_name_the_keys_they_do_not_read():
    """MARS-M's and Moonlight's AdamW part takes learning_rate and weight_decay (their reference), so the
    1-D settings other than betas_1d are unused; Moonlight reads beta1 as its momentum and no beta2."""
    mars_m = OPTIMIZERS.unused_keys(TrainConfig(optimizer="mars-m"))
    assert {"lr_1d", "weight_decay_1d", "optimize_1d"} <= mars_m and not {"betas_1d", "gamma", "is_approx"} & mars_m
    moonlight = OPTIMIZERS.unused_keys(TrainConfig(optimizer="moonlight"))
    assert {"gamma", "lr_1d", "weight_decay_1d", "beta2", "muon_lr"} <= moonlight
    assert not {"betas_1d", "beta1", "learning_rate", "weight_decay"} & moonlight


def construction_before_the_registry(model, cfg):
    """The optimizer build_optimizer made of cfg at a13f015, before the registry, written out. (MARS's
    fused=False: the mars_fused key's default; a13f015 left MARS's own None, which takes the same path.)"""
    betas = (cfg.beta1, cfg.beta2)

    def group(name, params, **settings):
        return dict(params=params, name=name, **settings, initial_lr=settings["lr"])

    mars_options = dict(
        is_approx=cfg.is_approx, mars_type=cfg.optimizer, last_grad_dtype=getattr(torch, cfg.last_grad_dtype)
    )
    decay, no_decay = (g["params"] for g in param_groups(model, cfg.weight_decay))
    if cfg.optimizer == "mars-m":
        matrices, rest = hidden_matrix_params(model)
        settings = dict(lr=cfg.learning_rate, betas=betas, weight_decay=cfg.weight_decay, gamma=cfg.gamma)
        settings.update(lr_1d=cfg.learning_rate, betas_1d=tuple(cfg.betas_1d), weight_decay_1d=cfg.weight_decay)
        groups = [group("matrices", matrices, **settings), group("adamw", rest, **settings, routing="none")]
        return MARS(groups, **mars_options, fused=False)
    if cfg.optimizer.startswith("mars-"):
        settings = dict(lr=cfg.learning_rate, betas=betas, gamma=cfg.gamma, lr_1d=cfg.lr_1d)
        settings.update(betas_1d=tuple(cfg.betas_1d), weight_decay_1d=cfg.weight_decay_1d)
        groups = [group("decay", decay, **settings, weight_decay=cfg.weight_decay)]
        groups.append(group("no_decay", no_decay, **settings, weight_decay=0.0))
        return MARS(groups, **mars_options, optimize_1d=cfg.optimize_1d, fused=False)
    if cfg.optimizer == "adamw":
        settings = dict(lr=cfg.learning_rate, betas=betas)
        groups = [group("decay", decay, **settings, weight_decay=cfg.weight_decay)]
        return torch.optim.AdamW(groups + [group("no_decay", no_decay, **settings, weight_decay=0.0)], fused=False)
    if cfg.optimizer == "muon":
        muon, rest = (matrix_params if cfg.muon_matrices == "all" else hidden_matrix_params)(model)
        return ChainedOptimizer(
            torch.optim.Muon(
                [group("muon", muon, lr=cfg.muon_lr, weight_decay=0.0)],
                momentum=0.95,
                nesterov=True,
                adjust_lr_fn="original",
            ),
            torch.optim.AdamW(
                [group("adamw", rest, lr=cfg.muon_adamw_lr, betas=betas, weight_decay=cfg.weight_decay)], fused=False
            ),
        )
    muon, rest = hidden_matrix_params(model)  # moonlight
    shared = dict(lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    return ChainedOptimizer(
        torch.optim.Muon(
            [group("muon", muon, **shared, momentum=cfg.beta1)], nesterov=True, adjust_lr_fn="match_rms_adamw"
        ),
        torch.optim.AdamW([group("adamw", rest, **shared, betas=tuple(cfg.betas_1d))], fused=False),
    )


def assert_same_state(a, b, where="state_dict"):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize(
    "optimizer, more",
    [(o, []) for o in ("mars", "mars_lion", "mars_shampoo", "mars_m", "adamw", "muon", "moonlight")]
    + [("mars", ["--is_approx=False"]), ("mars_m", ["--is_approx=False"]), ("muon", ["--muon_matrices=hidden"])]
    + [("mars", ["--optimize_1d=True", "--last_grad_dtype=bfloat16"])],
)
def test_each_config_builds_the_optimizer_it_built_before_the_registry(optimizer, more):
    """Four steps of the loop's protocol (exact MARS's look-ahead gradient included) from the same weights:
    the registry's optimizer and the one written out above end with the same state, bit for bit."""
    cfg = paper_config("small", optimizer, "--warmup_iters=2", *more)
    ours, before = tiny_model(), tiny_model()
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (4, 16), generator=generator) for _ in range(5)]

    def loss(model, it):
        return model(batches[it], torch.roll(batches[it], -1, dims=1))[1]

    opt = build_optimizer(ours, cfg, Parallelism.single())
    assert (opt.look_ahead is None) == cfg.is_approx
    for it in range(4):  # the trainer's optimizer, as train.train_step drives it
        opt.set_lr(it)
        if opt.look_ahead is not None:
            loss(ours, it + 1).backward()
            opt.keep_look_ahead_gradient()
            opt.zero_grad()
        loss(ours, it).backward()
        opt.step()
        opt.zero_grad()
    written_out = construction_before_the_registry(before, cfg)
    for it in range(4):  # the one written out, through torch's and mars.MARS's own calls
        for group in written_out.param_groups:
            group["lr"] = scheduled_lr(it, cfg, group["initial_lr"])
        if not cfg.is_approx:
            loss(before, it + 1).backward()
            written_out.update_previous_grad()
            written_out.zero_grad(set_to_none=True)
        loss(before, it).backward()
        written_out.step()
        if not cfg.is_approx:
            written_out.update_last_grad()
        written_out.zero_grad(set_to_none=True)
    assert_same_state((ours.state_dict(), opt.state_dict()), (before.state_dict(), written_out.state_dict()))


# --- the schedule

ITERS = (0, 1, 1000, 1999, 2000, 2001, 25000, 51000, 75000, 99999, 100000)


@pytest.mark.parametrize("size, optimizer", PAPER_RUNS)
def test_every_group_follows_the_reference_get_lr(size, optimizer):
    ref = reference_run(size, optimizer)
    cfg = paper_config(size, optimizer)
    opt = build_optimizer(tiny_model(), cfg, Parallelism.single())
    if optimizer == "muon":  # train_muon.py: each optimizer from its own base lr to the same min_lr
        peaks = [ref["muon_lr"], ref["learning_rate"]]  # Muon's group, then its AdamW's
    else:
        peaks = [ref["learning_rate"]] * 2  # the two weight-decay groups
    for it in ITERS:
        opt.set_lr(it)
        expected = [reference_get_lr(it, peak, ref["min_lr"]) for peak in peaks]
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(expected, rel=1e-12, abs=1e-18), it
        if optimizer == "mars":  # the 1-D tensors' AdamW: the scheduled lr x lr_1d / lr (optimizers/mars.py)
            lr_1d = expected[0] * ref["lr_1d"] / ref["learning_rate"]
            assert [g["lr"] * g["lr_1d_factor"] for g in opt.param_groups] == pytest.approx([lr_1d] * 2, rel=1e-12)


def test_cosine_beyond_lr_decay_iters_stays_at_min_lr():
    cfg = TrainConfig(warmup_iters=10, lr_decay_iters=100, max_iters=200, learning_rate=1e-3, min_lr=1e-4)
    assert scheduled_lr(100, cfg, 2e-2) == pytest.approx(1e-4)
    assert scheduled_lr(101, cfg, 2e-2) == scheduled_lr(10**7, cfg, 5e-3) == 1e-4  # absolute, any peak
    assert scheduled_lr(55, cfg, 2e-2) == pytest.approx((2e-2 + 1e-4) / 2)  # halfway through the cosine


def test_scale_schedule_fits_a_paper_schedule_to_a_short_run():
    """A paper run's 2,000 warmup steps of a 100,000-step cosine, shortened to 1,000 steps: warmup 20, the decay
    reaching min_lr at the last step, the same curve at a hundredth of the steps."""
    paper = paper_config("small", "mars")
    short = dataclasses.replace(paper, max_iters=1000, scale_schedule=True)
    assert optimizers.schedule_lengths(paper) == (2000, 100000)
    assert optimizers.schedule_lengths(short) == (20, 1000)
    for it in (0, 10, 20, 500, 999):
        assert scheduled_lr(it, short, 6e-3) == pytest.approx(scheduled_lr(100 * it, paper, 6e-3), rel=1e-12)
    assert optimizers.schedule_warning(short) is None


@pytest.mark.parametrize(
    "max_iters, warning",
    [
        (5, "max_iters=5 ends the run inside warmup_iters=2,000: the learning rate never rises above 0.2% of its peak"),
        (
            50000,
            "max_iters=50,000 stops the cosine decay (lr_decay_iters=100,000) at 49% of its length: the last step's "
            "learning rate is still 52% of the way from min_lr to its peak",
        ),
        (100000, None),
    ],
)
def test_a_max_iters_that_cuts_the_schedule_short_is_a_warning(max_iters, warning):
    cfg = paper_config("small", "mars", f"--max_iters={max_iters}")
    expected = (
        None if warning is None else f"warning: {warning}; --scale_schedule=True fits warmup and decay into max_iters"
    )
    assert optimizers.schedule_warning(cfg) == expected
    assert optimizers.schedule_warning(dataclasses.replace(cfg, decay_lr=False)) is None  # no schedule to cut


def test_wsd_and_constant():
    cfg = TrainConfig(schedule="wsd", max_iters=1000, warmup_iters=100, learning_rate=1e-3, min_lr=1e-4)
    peak = 2e-3  # any group's peak: the floor is min_lr for all of them
    assert [scheduled_lr(it, cfg, peak) for it in (0, 50, 100, 799, 800)] == pytest.approx([0, 1e-3, 2e-3, 2e-3, 2e-3])
    assert scheduled_lr(900, cfg, peak) == pytest.approx((2e-3 + 1e-4) / 2)  # halfway through the last 20%
    assert scheduled_lr(1000, cfg, peak) == scheduled_lr(5000, cfg, peak) == pytest.approx(1e-4)
    const = dataclasses.replace(cfg, schedule="constant")
    assert [scheduled_lr(it, const, peak) for it in (0, 50, 100, 10**6)] == pytest.approx([0, 1e-3, 2e-3, 2e-3])
    assert scheduled_lr(0, dataclasses.replace(cfg, decay_lr=False), peak) == peak  # no schedule, no warmup


def test_wsd_with_min_lr_0_is_the_reference_fineweb_trainers_wsd():
    """train_mars_fw.py: warmup, base lr until 0.8 max_iters, then base_lr * (max_iters - it) / (0.2 max_iters)."""
    cfg = TrainConfig(schedule="wsd", wsd_decay_frac=0.2, min_lr=0.0, max_iters=100000, warmup_iters=2000)
    for it in (0, 1000, 2000, 79999, 80000, 90000, 99999, 100000):
        expect = 6e-3 * (it / 2000 if it < 2000 else 1.0 if it < 80000 else (100000 - it) / 20000)
        assert scheduled_lr(it, cfg, 6e-3) == pytest.approx(expect, rel=1e-12, abs=1e-18)


# --- each optimizer as the reference builds it


def test_mars_is_built_as_the_reference_builds_it():
    cfg = paper_config("small", "mars")
    model = tiny_model()
    opt = build_optimizer(model, cfg, Parallelism.single())
    assert isinstance(opt.torch_optimizer, MARS)
    reference_groups = param_groups(model, cfg.weight_decay)
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == [
        [id(p) for p in g["params"]] for g in reference_groups
    ]
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-2, 0.0]
    for g in opt.param_groups:
        assert (g["lr"], g["initial_lr"], g["betas"], g["gamma"]) == (6e-3, 6e-3, (0.95, 0.99), 0.025)
        assert (g["lr_1d"], g["lr_1d_factor"], g["betas_1d"], g["weight_decay_1d"]) == (3e-3, 0.5, (0.9, 0.95), 0.1)
        assert (g["mars_type"], g["is_approx"], g["optimize_1d"]) == ("mars-adamw", True, False)
    losses = train_steps(model, opt, 6)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize("mars_type", ["mars-lion", "mars-shampoo"])
def test_mars_variants_build_from_their_configs(mars_type):
    opt = build_optimizer(tiny_model(), paper_config("small", mars_type.replace("-", "_")), Parallelism.single())
    assert {g["mars_type"] for g in opt.param_groups} == {mars_type}


def test_mars_refuses_a_zero_peak_lr_that_leaves_the_1d_lr_undefined():
    with pytest.raises(ValueError, match="lr=0 with optimize_1d=False"):
        build_optimizer(tiny_model(), TrainConfig(learning_rate=0.0), Parallelism.single())


def test_mars_keeps_its_last_gradient_in_the_configured_dtype():
    cfg = load_config([os.path.join(ROOT, "config", "train_gpt2_small_mars.py")])
    model = tiny_model()
    opt = build_optimizer(model, dataclasses.replace(cfg, last_grad_dtype="bfloat16"), Parallelism.single())
    train_steps(model, opt, 1)
    assert {s["last_grad"].dtype for s in opt.state.values() if "last_grad" in s} == {torch.bfloat16}


def test_adamw_uses_the_reference_groups_and_betas():
    model = tiny_model()
    opt = build_optimizer(model, paper_config("small", "adamw"), Parallelism.single())
    assert type(opt.torch_optimizer) is torch.optim.AdamW
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(g["betas"] == (0.9, 0.95) and g["initial_lr"] == 6e-4 and not g["fused"] for g in opt.param_groups)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def split_by_name(model, optimizer):
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [[name_of[id(p)] for g in opt.param_groups for p in g["params"]] for opt in optimizer.optimizers]


BLOCK_MATRICES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def test_muon_split_is_the_reference_s_on_gpt2_small():
    """MARS/train_muon.py: CombinedOptimizer(model.parameters(), [AdamW, Muon]) gives Muon every tensor with
    2+ dims, in parameter order -- the token and position embeddings, the tied head (it is wte), the blocks'
    matrices -- at weight decay 0, and AdamW the LayerNorm weights at weight_decay (no biases: bias=False)."""
    model = gpt2_small()
    opt = build_optimizer(model, paper_config("small", "muon"), Parallelism.single())
    muon, adamw = split_by_name(model, opt)
    assert muon == ["transformer.wte.weight", "transformer.wpe.weight"] + [
        f"transformer.h.{i}.{m}.weight" for i in range(12) for m in BLOCK_MATRICES
    ]
    assert adamw == [f"transformer.h.{i}.{ln}.weight" for i in range(12) for ln in ("ln_1", "ln_2")] + [
        "transformer.ln_f.weight"
    ]
    assert any(p is model.lm_head.weight for p in opt.optimizers[0].param_groups[0]["params"])
    assert [type(o) for o in opt.optimizers] == [torch.optim.Muon, torch.optim.AdamW]
    assert [(g["weight_decay"], g["initial_lr"]) for g in opt.param_groups] == [(0.0, 2e-2), (0.1, 3e-3)]


def test_muon_matrices_hidden_keeps_the_embeddings_and_head_in_adamw():
    model = gpt2_small()
    opt = build_optimizer(model, paper_config("small", "muon", "--muon_matrices=hidden"), Parallelism.single())
    muon, adamw = split_by_name(model, opt)
    assert muon == [f"transformer.h.{i}.{m}.weight" for i in range(12) for m in BLOCK_MATRICES]
    assert adamw[:2] == ["transformer.wte.weight", "transformer.wpe.weight"] and len(adamw) == 2 + 2 * 12 + 1
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.1]  # the embeddings decay in AdamW
    assert [id(p) for p in opt.optimizers[0].param_groups[0]["params"]] == [
        id(p) for p in hidden_matrix_params(model)[0]
    ]


def test_muon_chain_trains_and_zero_grads_both_parts():
    model = tiny_model()
    opt = build_optimizer(model, paper_config("small", "muon"), Parallelism.single())
    assert isinstance(opt.torch_optimizer, ChainedOptimizer)
    g = opt.optimizers[0].param_groups[0]
    assert (g["momentum"], g["nesterov"], g["adjust_lr_fn"]) == (0.95, True, "original")
    assert all(g["betas"] == (0.9, 0.95) for g in opt.optimizers[1].param_groups)
    losses = train_steps(model, opt, 6)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert all(p.grad is None for p in model.parameters())


def reference_muon_step(params, grads, buffers, lr, nesterov=True, momentum=0.95):
    """MARS/optimizers/muon.py's step on one process, transcribed: momentum summed (not averaged),
    Nesterov, 5 quintic Newton-Schulz steps in bfloat16 on the (transposed, if tall) normalised matrix,
    the result scaled by sqrt(max(1, rows/cols)); weight decay 0."""
    for p, g, buf in zip(params, grads, buffers):
        buf.mul_(momentum).add_(g)
        update = g.add(buf, alpha=momentum) if nesterov else buf
        x = update.bfloat16()
        x /= x.norm() + 1e-7
        tall = update.size(0) > update.size(1)
        if tall:
            x = x.T
        for _ in range(5):
            a = x @ x.T
            b = a @ x
            x = 3.4445 * x + -4.7750 * b + 2.0315 * a @ b
        if tall:
            x = x.T
        x *= max(1, update.size(0) / update.size(1)) ** 0.5
        p.add_(x.type_as(p), alpha=-lr)


def test_torch_muon_takes_the_reference_muon_s_steps():
    """torch's Muon averages its momentum (buf = m buf + (1 - m) g) where the reference sums it: the Nesterov
    update is then (1 - m) times the reference's, and Newton-Schulz normalises that factor away. What is
    left is bfloat16 rounding (a few %), well apart from what a different rule gives (no Nesterov: over 20%)."""
    model = tiny_model()
    opt = build_optimizer(model, paper_config("small", "muon"), Parallelism.single())
    muon = opt.optimizers[0]
    params = muon.param_groups[0]["params"]
    assert {(p.size(0) > p.size(1), p.size(0) < p.size(1)) for p in params} >= {(True, False), (False, True)}
    start = [p.detach().clone() for p in params]
    ours = [p.clone() for p in start]
    no_nesterov = [p.clone() for p in start]
    buffers, buffers_plain = [torch.zeros_like(p) for p in start], [torch.zeros_like(p) for p in start]
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=generator) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        muon.step()
        reference_muon_step(ours, grads, buffers, lr=2e-2)
        reference_muon_step(no_nesterov, grads, buffers_plain, lr=2e-2, nesterov=False)

    def worst_error(reference):
        return max(((p.detach() - r).norm() / (r - s).norm()).item() for p, r, s in zip(params, reference, start))

    assert worst_error(ours) < 0.1 < worst_error(no_nesterov)


def test_mars_m_is_built_as_the_reference_trainer_builds_it():
    """MARS_M/train_mars_m.py: MARS-M on every tensor with 2+ dims but the embeddings and head (the blocks'
    matrices), its AdamW part (betas_1d) on those and the 1-D tensors, all at learning_rate and weight_decay
    (the LayerNorm weights and embeddings decay too), momentum beta1."""
    model = gpt2_small()
    opt = build_optimizer(model, paper_config("small", "mars_m"), Parallelism.single())
    assert isinstance(opt.torch_optimizer, MARS)
    name_of = {id(p): n for n, p in model.named_parameters()}
    matrices, rest = ([name_of[id(p)] for p in g["params"]] for g in opt.param_groups)
    assert matrices == [f"transformer.h.{i}.{m}.weight" for i in range(12) for m in BLOCK_MATRICES]
    assert rest[:2] == ["transformer.wte.weight", "transformer.wpe.weight"] and len(rest) == 2 + 2 * 12 + 1
    assert [g["routing"] for g in opt.param_groups] == ["2d", "none"]
    for g in opt.param_groups:
        assert (g["mars_type"], g["lr"], g["betas"], g["weight_decay"], g["gamma"]) == (
            "mars-m",
            6e-3,
            (0.95, 0.99),
            1e-2,
            0.025,
        )
        assert (g["lr_1d_factor"], g["betas_1d"], g["weight_decay_1d"]) == (1.0, (0.9, 0.95), 1e-2)


def test_mars_m_trains_the_embeddings_with_adamw():
    model = tiny_model()
    opt = build_optimizer(model, paper_config("small", "mars_m"), Parallelism.single())
    losses = train_steps(model, opt, 6)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert "exp_avg_sq" in opt.state[model.transformer.wte.weight]  # AdamW, not Newton-Schulz
    assert "last_grad" in opt.state[model.transformer.h[0].attn.c_attn.weight]


def test_mars_m_refuses_optimize_1d():
    with pytest.raises(ConfigError, match="optimize_1d=True does not apply to optimizer=mars-m"):
        paper_config("small", "mars_m", "--optimize_1d=True")


def test_moonlight_is_built_as_the_reference_trainer_builds_it():
    """MARS_M/train_moonlight.py: Muon (Nesterov, momentum beta1, update 0.2 sqrt(max(rows, cols)) times
    Newton-Schulz) on the blocks' matrices, AdamW (betas_1d) on the embeddings, head and 1-D tensors, both at
    learning_rate and weight_decay."""
    model = gpt2_small()
    opt = build_optimizer(model, paper_config("small", "moonlight"), Parallelism.single())
    assert [type(o) for o in opt.optimizers] == [torch.optim.Muon, torch.optim.AdamW]
    muon, adamw = split_by_name(model, opt)
    assert muon == [f"transformer.h.{i}.{m}.weight" for i in range(12) for m in BLOCK_MATRICES]
    assert adamw[:2] == ["transformer.wte.weight", "transformer.wpe.weight"] and len(adamw) == 2 + 2 * 12 + 1
    g_muon, g_adamw = opt.param_groups
    assert (g_muon["momentum"], g_muon["nesterov"], g_muon["adjust_lr_fn"]) == (0.95, True, "match_rms_adamw")
    assert (g_muon["lr"], g_muon["weight_decay"]) == (g_adamw["lr"], g_adamw["weight_decay"]) == (6e-3, 0.1)
    assert g_adamw["betas"] == (0.9, 0.95)
    tiny = tiny_model()
    losses = train_steps(tiny, build_optimizer(tiny, paper_config("small", "moonlight"), Parallelism.single()), 6)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def reference_moonlight_step(params, grads, buffers, lr, wd, momentum=0.95, nesterov=True, scale="moonlight"):
    """MARS_M/optimizers/moonlight.py's matrix step, transcribed: momentum summed, Nesterov, Newton-Schulz
    (here float64: mars.newton_schulz normalises by norm + 1e-7 as the reference), weight decay lr * wd, the
    update scaled by 0.2 sqrt(max(rows, cols)) ("original": Muon's sqrt(max(1, rows/cols)), for contrast)."""
    for p, g, buf in zip(params, grads, buffers):
        buf.mul_(momentum).add_(g)
        update = g.add(buf, alpha=momentum) if nesterov else buf
        rows, cols = p.shape
        factor = 0.2 * math.sqrt(max(rows, cols)) if scale == "moonlight" else math.sqrt(max(1, rows / cols))
        p.mul_(1 - lr * wd).sub_(mars.newton_schulz(update), alpha=lr * factor)


def test_torch_muon_with_match_rms_adamw_is_the_reference_moonlight(monkeypatch):
    """torch's Muon averages its momentum where the reference sums it; Newton-Schulz normalises the factor
    (1 - m) away, up to its 1e-7 normaliser. With Newton-Schulz in float64 on both sides (torch's runs in
    bfloat16) the two agree to 1e-6 of the update, where Muon's own scale or no Nesterov differ by over 10%."""

    def float64_newton_schulz(grad, ns_coefficients, ns_steps, eps):
        assert ns_coefficients == mars._NS_COEFFS and grad.dtype == torch.float64
        return mars.newton_schulz(grad, steps=ns_steps, eps=eps)

    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", float64_newton_schulz)
    model = tiny_model().double()
    opt = build_optimizer(model, paper_config("small", "moonlight"), Parallelism.single())
    muon = opt.optimizers[0]
    params = muon.param_groups[0]["params"]
    assert {(p.size(0) > p.size(1), p.size(0) < p.size(1)) for p in params} >= {(True, False), (False, True)}
    start = [p.detach().clone() for p in params]
    runs = {name: [p.clone() for p in start] for name in ("moonlight", "original", "no_nesterov")}
    buffers = {name: [torch.zeros_like(p) for p in start] for name in runs}
    generator = torch.Generator().manual_seed(0)
    for step in range(5):
        lr = 6e-3 * (1 - 0.1 * step)
        muon.param_groups[0]["lr"] = lr
        grads = [torch.randn(p.shape, generator=generator, dtype=torch.float64) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        muon.step()
        for name, run in runs.items():
            kw = dict(nesterov=name != "no_nesterov", scale="original" if name == "original" else "moonlight")
            reference_moonlight_step(run, grads, buffers[name], lr=lr, wd=0.1, **kw)

    def worst_error(reference):
        return max(((p.detach() - r).norm() / (r - s).norm()).item() for p, r, s in zip(params, reference, start))

    assert worst_error(runs["moonlight"]) < 1e-6  # measured 3e-8: the normaliser eps meets a (1 - m) smaller input
    assert worst_error(runs["original"]) > 0.1 and worst_error(runs["no_nesterov"]) > 0.1


# --- resuming and group_hyperparameters


@pytest.mark.parametrize(
    "size, optimizer",
    [("small", "mars"), ("small", "adamw"), ("small", "muon"), ("small", "mars_m"), ("small", "moonlight")],
)
def test_state_dict_round_trip_continues_identically(size, optimizer):
    cfg = paper_config(size, optimizer)
    model, other_model = tiny_model(), tiny_model()
    opt = build_optimizer(model, cfg, Parallelism.single())
    train_steps(model, opt, 2)
    other_model.load_state_dict(model.state_dict())
    other_opt = build_optimizer(other_model, cfg, Parallelism.single())
    other_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # as a checkpoint would: no shared tensors
    opt.set_lr(1000)
    other_opt.set_lr(1000)  # after load_state_dict: the group dicts it replaced
    train_steps(model, opt, 2, seed=7)
    train_steps(other_model, other_opt, 2, seed=7)
    for a, b in zip(model.parameters(), other_model.parameters()):
        assert torch.equal(a, b)


def changed(cfg):
    """cfg with every hyperparameter group_hyperparameters writes set to another value."""
    return dataclasses.replace(
        cfg,
        learning_rate=cfg.learning_rate / 3,
        lr_1d=cfg.lr_1d / 5,
        weight_decay=cfg.weight_decay * 2,
        beta1=0.8,
        beta2=0.9,
        gamma=0.05,
        betas_1d=(0.85, 0.97),
        weight_decay_1d=0.3,
        muon_lr=cfg.muon_lr / 7,
        muon_adamw_lr=cfg.muon_adamw_lr / 11,
    )


def hyperparameters(optimizer):
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


@pytest.mark.parametrize(
    "size, optimizer",
    [("small", "mars"), ("small", "adamw"), ("small", "muon"), ("small", "mars_m"), ("small", "moonlight")],
)
def test_group_hyperparameters_apply_a_new_config_after_load_state_dict(size, optimizer):
    old = paper_config(size, optimizer)
    new = changed(old)
    model = tiny_model()
    opt = build_optimizer(model, old, Parallelism.single())
    train_steps(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    resumed = build_optimizer(model, new, Parallelism.single())
    fresh = hyperparameters(resumed)
    resumed.torch_optimizer.load_state_dict(copy.deepcopy(saved))
    assert hyperparameters(resumed) == hyperparameters(opt) != fresh  # the checkpoint's values came back
    group_hyperparameters(resumed.torch_optimizer, OPTIMIZERS.entry(new), new)
    assert hyperparameters(resumed) == fresh  # every key as a new optimizer built from `new` has it
    resumed.load_state_dict(saved)  # the trainer's optimizer does both
    assert hyperparameters(resumed) == fresh
    for p in model.parameters():  # and the state stays the checkpoint's
        assert resumed.state[p].keys() == opt.state[p].keys()
        assert all(
            torch.equal(torch.as_tensor(resumed.state[p][k]), torch.as_tensor(v)) for k, v in opt.state[p].items()
        )


def test_group_hyperparameters_refuses_an_optimizer_with_other_groups():
    model = tiny_model()
    cfg = paper_config("small", "adamw")
    with pytest.raises(ValueError, match="adamw has 2 parameter groups, this optimizer 1"):
        group_hyperparameters(torch.optim.SGD(model.parameters(), lr=0.1), OPTIMIZERS.entry(cfg), cfg)


def test_every_shipped_config_builds_its_optimizer():
    for path in sorted(glob.glob(os.path.join(ROOT, "config", "train_gpt2_*.py"))):
        cfg = load_config([path])
        opt = build_optimizer(tiny_model(), cfg, Parallelism.single())
        assert {g["initial_lr"] for g in opt.param_groups} <= {cfg.learning_rate, cfg.muon_lr, cfg.muon_adamw_lr}


@pytest.mark.parametrize("optimizer", ["mars", "adamw", "muon"])
def test_group_hyperparameters_pair_groups_by_name_not_position(optimizer):
    """A checkpoint whose groups come in another order still gets each group's own settings."""
    cfg = paper_config("small", optimizer)
    expected = hyperparameters(build_optimizer(tiny_model(), cfg, Parallelism.single()))
    opt = build_optimizer(tiny_model(), cfg, Parallelism.single()).torch_optimizer
    groups = opt.param_groups
    reordered = list(reversed(groups))
    if isinstance(opt, ChainedOptimizer):
        swapped = [{k: group[k] for k in ("lr", "initial_lr", "weight_decay")} for group in reordered]
        for inner, settings in zip(opt.optimizers, swapped):  # each inner optimizer gets the other's numbers
            inner.param_groups[0].update(settings)
    else:
        opt.param_groups[:] = reordered
    group_hyperparameters(opt, OPTIMIZERS.entry(cfg), cfg)
    by_name = {g["name"]: g for g in hyperparameters(opt)}
    assert by_name == {g["name"]: g for g in expected}
