"""MARS in other people's tools: docs/mars.md's Hugging Face Trainer, Lightning and accelerate examples as they
stand (each trains as a plain loop would, and resumes bit for bit), Lightning's manual optimization, and the
settings that reproduce timm's and pytorch_optimizer's MARS (their type names refused here). Each test skips,
naming the package, where its framework is not installed."""

import importlib
import importlib.util
import inspect
import shutil
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from doc_examples import docs_example

import mars
from mars import MARS

PATHS = {"reference": dict(foreach=False), "foreach": dict()}


def run_example(name, tmp_path, monkeypatch):
    """docs/mars.md's example `name`, run in tmp_path as a user's script; its names."""
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"example_{name}"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the frameworks' own deprecation and set-up notices
        exec(compile(docs_example(name), f"docs/mars.md: {name}", "exec"), namespace)
    return namespace


def assert_same_parameters(a, b):
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


# ---------------------------------------------------------------------------------------------------
# Hugging Face Trainer.


@pytest.mark.slow
def test_hugging_face_trainer_example_resumes_bit_for_bit(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate")
    example = run_example("hf-trainer", tmp_path, monkeypatch)
    trainer = example["trainer"]
    assert trainer.state.global_step == 6 and isinstance(trainer.optimizer.optimizer, MARS)
    shutil.copytree(tmp_path / "gpt2-mars" / "checkpoint-3", tmp_path / "resumed" / "checkpoint-3")
    resumed = example["make_trainer"]("resumed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    assert_same_parameters(resumed.model, trainer.model)


@pytest.mark.slow
def test_exact_mars_under_the_hugging_face_trainer_says_what_to_do(tmp_path, monkeypatch):
    """The Trainer calls step() alone: the second step has no second gradient, and the error names the ways out."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate")
    example = run_example("hf-trainer", tmp_path, monkeypatch)
    trainer = example["make_trainer"]("exact")
    trainer.optimizer = MARS(trainer.model.parameters(), lr=3e-3, is_approx=False)
    with pytest.raises(RuntimeError, match=r"closure.*update_previous_grad.*is_approx=True"):
        trainer.train()


# ---------------------------------------------------------------------------------------------------
# Lightning.


def lightning():
    return pytest.importorskip("pytorch_lightning", reason="needs pytorch_lightning (Lightning 2.x)")


def closure_loop(module, batches, epochs):
    """The same training as a plain loop of optimizer.step(closure)."""
    optimizer = module.configure_optimizers()
    for _ in range(epochs):
        for batch in batches:

            def closure(batch=batch):
                optimizer.zero_grad()
                loss = module.training_step(batch, 0)
                loss.backward()
                return loss

            optimizer.step(closure)
    return module


def quiet_trainer(pl, **kwargs):
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


@pytest.mark.slow
def test_lightning_example_is_exact_mars_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    pl = lightning()
    example = run_example("lightning", tmp_path, monkeypatch)
    module_class, batches = example["Regression"], example["batches"]
    assert_same_parameters(example["model"], closure_loop(module_class(), batches, epochs=2))

    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    first = module_class()
    trainer = quiet_trainer(pl, max_epochs=1)
    trainer.fit(first, loader)
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed = module_class()
    quiet_trainer(pl, max_epochs=2).fit(resumed, loader, ckpt_path=tmp_path / "epoch1.ckpt")
    assert_same_parameters(resumed, example["model"])


@pytest.mark.slow
def test_lightning_manual_optimization_with_the_hand_written_protocol(tmp_path):
    """self.optimizers() is a LightningOptimizer, whose methods run with the wrapper as self and whose step()
    passes a closure that computes nothing: the hand-written protocol through it equals the plain loop."""
    pl = lightning()
    from test_mars_closure import LRS, batches, groups_of, hand_written_run, loss_on, small_model

    data = batches(len(LRS) + 1)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = small_model()

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            self.manual_backward(loss_on(self.net, data[batch_idx + 1]))
            opt.update_previous_grad()
            opt.zero_grad()
            self.manual_backward(loss_on(self.net, batch))
            opt.step()
            opt.update_last_grad()
            opt.zero_grad()

        def configure_optimizers(self):
            return MARS(groups_of(self.net, False), lr=1e-2, gamma=0.5)

    module = Module()
    quiet_trainer(pl, max_steps=4, default_root_dir=tmp_path).fit(
        module, train_dataloaders=torch.utils.data.DataLoader(data[:4], batch_size=None)
    )
    expected, _ = hand_written_run(4, [1e-2] * 4, gamma=0.5)
    assert_same_parameters(module.net, expected)


# ---------------------------------------------------------------------------------------------------
# accelerate.


@pytest.mark.slow
def test_accelerate_example_matches_a_plain_loop_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    """The plain loop is held to a tolerance, the resume bit for bit: the plain loop slices its micro-batches
    out of `inputs` (views at other memory offsets) where accelerate's DataLoader collates each into a new
    tensor, and a BLAS may sum the same values in another order by their alignment (seen on an AMD EPYC). One
    rounding's worth of difference in the first forward pass moves these parameters by up to 1e-6 relative
    (3e-8 absolute) after the 8 steps: the tolerance is 10x that. The resume runs the uninterrupted run's own
    code on the same tensors, so it must be bit-equal."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    example = run_example("accelerate", tmp_path, monkeypatch)
    inputs, targets = example["data"].tensors

    def fresh(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3)
        )
        return model, MARS(model.parameters(), lr=1e-2, gamma=0.5)

    model, optimizer = fresh(0)
    for _ in range(2):
        for start in range(0, 24, 6):
            for micro in (start, start + 3):
                loss = torch.nn.functional.mse_loss(model(inputs[micro : micro + 3]), targets[micro : micro + 3])
                (loss / 2).backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, p), (_, q) in zip(model.named_parameters(), example["model"].named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda text, name=name: f"{name}: {text}")

    AcceleratorState._reset_state(True)  # accelerate's state is per process: a second Accelerator starts afresh
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer = fresh(seed=5)  # other weights: load_state must replace them
    loader = torch.utils.data.DataLoader(example["data"], batch_size=3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.load_state("checkpoints/epoch0")
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    assert_same_parameters(model, example["model"])


# ---------------------------------------------------------------------------------------------------
# timm's and pytorch_optimizer's MARS: the settings of this one that reproduce theirs (docs/mars.md's tables).


def settings_for_timm(
    lr=3e-3,
    betas=(0.9, 0.99),
    eps=1e-8,
    weight_decay=0.0,
    gamma=0.025,
    mars_type="adamw",
    optimize_1d=False,
    lr_1d_factor=1.0,
    betas_1d=None,
    caution=False,
):
    """timm.optim.Mars(**kwargs) as this MARS's keywords (its defaults are timm's)."""
    if caution:
        raise ValueError("timm's caution=True (Cautious Optimizers' mask) has no equivalent here")
    return dict(
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        gamma=gamma,
        mars_type=f"mars-{mars_type}",
        optimize_1d=optimize_1d,
        routing="nd",
        lr_1d=lr * lr_1d_factor,
        betas_1d=betas_1d or betas,
        weight_decay_1d=weight_decay,
    )


def settings_for_pytorch_optimizer(
    lr=3e-3,
    betas=(0.95, 0.99),
    gamma=0.025,
    mars_type="adamw",
    optimize_1d=False,
    lr_1d=3e-3,
    betas_1d=(0.9, 0.95),
    weight_decay=0.0,
    weight_decay_1d=0.1,
    weight_decouple=True,
    fixed_decay=False,
    ams_bound=False,
    cautious=False,
    eps=1e-8,
    maximize=False,
):
    """pytorch_optimizer.MARS(**kwargs) as this MARS's keywords (its defaults are pytorch_optimizer's)."""
    if mars_type == "shampoo" or not weight_decouple or fixed_decay or cautious or maximize:
        raise ValueError("no equivalent here (its shampoo's Newton-Schulz differs)")
    return dict(
        lr=lr,
        betas=betas,
        gamma=gamma,
        mars_type=f"mars-{mars_type}",
        optimize_1d=optimize_1d,
        routing="nd",
        lr_1d=lr_1d,
        betas_1d=betas_1d,
        weight_decay=weight_decay,
        weight_decay_1d=weight_decay_1d,
        amsgrad=ams_bound,
        eps=eps,
        eps_1d_uncorrected=True,
    )


def timm_mars_class():
    """timm.optim.Mars. timm's package __init__ imports torchvision, which its optimizers do not need: where
    torchvision is missing, optim/mars.py (and the optim/_types.py it imports) load on their own."""
    spec = importlib.util.find_spec("timm")
    if spec is None:
        pytest.skip("needs timm")
    try:
        from timm.optim import Mars

        return Mars
    except ImportError:
        pass
    package = types.ModuleType("_timm_optim")
    package.__path__ = [str(Path(spec.submodule_search_locations[0]) / "optim")]
    sys.modules.setdefault("_timm_optim", package)
    return importlib.import_module("_timm_optim.mars").Mars


def problem(steps, seed=0):
    """Float64 tensors (4, 6), (7, 3), (5,), (2, 3, 2) -- a 3-D one: both libraries give MARS every tensor with
    ndim >= 2 -- and steps of gradients whose norms alternate between small and large."""
    shapes = [(4, 6), (7, 3), (5,), (2, 3, 2)]
    gen = torch.Generator().manual_seed(seed)
    x0s = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    scale = [0.05, 2.0]
    grads = [
        [torch.randn(s, generator=gen, dtype=torch.float64) * scale[(t + i) % 2] for i, s in enumerate(shapes)]
        for t in range(steps)
    ]
    return x0s, grads


def run_other(optimizer_class, kwargs, x0s, grads, lrs):
    params = [torch.nn.Parameter(x.clone()) for x in x0s]
    opt = optimizer_class(params, **kwargs)
    for lr, gs in zip(lrs, grads):
        for group in opt.param_groups:
            group["lr"] = lr
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return params


def largest_difference(ours, theirs):
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs))


TIMM_CASES = [
    dict(),  # timm's defaults
    dict(mars_type="lion", lr=1e-3),
    dict(weight_decay=0.1, lr_1d_factor=0.5, betas_1d=(0.8, 0.9)),
    dict(optimize_1d=True, gamma=0.5, betas=(0.95, 0.99)),
]
SCHEDULE = (1.0, 1.0, 0.5, 0.5, 0.25, 1.0, 2.0, 1.0)  # each step's lr as a multiple of the case's


@pytest.mark.parametrize("case", TIMM_CASES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_settings_for_timm_reproduce_timms_mars(case, path):
    Mars = timm_mars_class()
    x0s, grads = problem(steps=8)
    lrs = [c * case.get("lr", 3e-3) for c in SCHEDULE]
    theirs = run_other(Mars, case, x0s, grads, lrs)
    ours = run_other(lambda ps, **kw: MARS(ps, **kw, **PATHS[path]), settings_for_timm(**case), x0s, grads, lrs)
    assert largest_difference(ours, theirs) <= 1e-12


def test_timms_defaults_are_not_these():
    """Default against default the two differ (betas, betas_1d, 1-D decay, routing): why mars_type="adamw" is
    refused rather than taken as an alias. docs/mars.md quotes the difference after 20 steps."""
    Mars = timm_mars_class()
    x0s, grads = problem(steps=20)
    difference = largest_difference(
        run_other(MARS, {}, x0s, grads, [3e-3] * 20), run_other(Mars, {}, x0s, grads, [3e-3] * 20)
    )
    assert difference > 1e-2


PYTORCH_OPTIMIZER_CASES = [
    dict(),  # its defaults (the paper's, as here)
    dict(mars_type="lion", lr=1e-3, lr_1d=1e-3),
    dict(weight_decay=0.1, weight_decay_1d=0.0, ams_bound=True, gamma=0.5),
    dict(optimize_1d=True, betas=(0.9, 0.95)),
]


@pytest.mark.parametrize("case", PYTORCH_OPTIMIZER_CASES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_settings_for_pytorch_optimizer_reproduce_its_mars(case, path):
    """Its last_grad starts at zero (first c = (1 + γβ1/(1-β1)) g_1): the same as here once ‖g_1‖ >= 1 clips both.
    Its MARS tensors add eps to sqrt(v) before the bias correction, which no setting here does: agreement to about
    eps relative, held to 1e-7 absolute on moves of 1e-2 (its 1-D tensors' is eps_1d_uncorrected=True, exact)."""
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
    x0s, grads = problem(steps=8)
    grads[0] = [g / g.norm() * 3.0 for g in grads[0]]
    lrs = [c * case.get("lr", 3e-3) for c in SCHEDULE]
    theirs = run_other(pytorch_optimizer.MARS, dict(case, foreach=False), x0s, grads, lrs)
    settings = settings_for_pytorch_optimizer(**case)
    ours = run_other(lambda ps, **kw: MARS(ps, **kw, **PATHS[path]), settings, x0s, grads, lrs)
    assert largest_difference(ours, theirs) <= 1e-7
    assert largest_difference(ours, x0s) > 1e-3  # the runs moved


@pytest.mark.parametrize("name,ours", [("adamw", "mars-adamw"), ("lion", "mars-lion"), ("shampoo", "mars-shampoo")])
def test_other_libraries_type_names_are_refused_with_the_way_to_their_settings(name, ours):
    with pytest.raises(ValueError, match=rf"mars_type: '{name}'.*'{ours}'.*timm or pytorch_optimizer") as err:
        MARS([torch.nn.Parameter(torch.zeros(2, 2))], mars_type=name)
    assert all(t in str(err.value) for t in mars.MARS_TYPES)


@pytest.mark.slow
def test_heavyballs_mars_correction_takes_gamma_and_beta1_swapped():
    """heavyball's mars transform calls mars_correction(g, old_g, beta1, gamma) with (mars_gamma, beta1): at the
    paper's γ = 0.025, β1 = 0.95 its correction weight is β1γ/(1-γ) = 0.0244, this rule's γβ1/(1-β1) = 0.475."""
    heavyball = pytest.importorskip("heavyball")
    chainable, utils = importlib.import_module("heavyball.chainable"), heavyball.utils
    assert list(inspect.signature(utils.mars_correction).parameters) == ["g", "old_g", "beta1", "gamma"]
    source = inspect.getsource(chainable.mars.get_fn())  # the transform under its decorators
    assert 'mars_correction(update, mars_old_grad, group["mars_gamma"], utils.get_beta1(group))' in source
    gamma, beta1 = 0.025, 0.95
    g, old = torch.tensor([1.0], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64)
    utils.mars_correction([g], [old], gamma, beta1)  # as its mars transform passes them
    theirs, ours = g.item() - 1.0, gamma * beta1 / (1 - beta1)
    assert theirs == pytest.approx(beta1 * gamma / (1 - gamma)) and ours / theirs == pytest.approx(19.5, abs=0.05)
