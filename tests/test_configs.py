"""config/: every paper run's effective configuration is the reference's, key by key (tests/reference_runs.py
transcribes it), and the runs are composed from model.PRESETS and config/paper.py."""

import glob
import os
import subprocess
import sys

import pytest
from reference_runs import PAPER_RUNS, reference_run
from train_helpers import tiny_args

import train
from marsgpt import metrics
from marsgpt.config import current_keys, load_config
from marsgpt.config_schema import config_to_dict
from model import PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINEWEB = os.path.join(ROOT, "config", "fineweb_edu.py")


def config_path(size, optimizer):
    return os.path.join(ROOT, "config", f"train_gpt2_{size}_{optimizer}.py")


def effective(size, optimizer, *more):
    return config_to_dict(load_config([config_path(size, optimizer), *more]))


# What the micro-batch split may change: how the reference's global batch and evaluation windows are cut into
# micro-batches (config/paper.py's MICRO_BATCH), never which windows they are.
SPLIT_KEYS = ("batch_size", "gradient_accumulation_steps", "eval_iters")


@pytest.mark.parametrize("size, optimizer", PAPER_RUNS)
def test_every_paper_run_is_the_reference_s(size, optimizer):
    cfg = effective(size, optimizer)
    expected = current_keys(reference_run(size, optimizer))  # its optimizer_name and mars_type: our optimizer
    assert {key: cfg[key] for key in expected if key not in SPLIT_KEYS} == {
        key: value for key, value in expected.items() if key not in SPLIT_KEYS
    }
    # the same windows: the reference's global batch and evaluation windows, drawn as its micro-batches drew
    # them, in micro-batches of any size
    assert cfg["windows_per_stream"] == expected["batch_size"]
    assert cfg["batch_size"] * cfg["gradient_accumulation_steps"] == 480
    assert cfg["batch_size"] * cfg["eval_iters"] == expected["batch_size"] * expected["eval_iters"]


def test_the_config_files_are_the_paper_runs_and_two_mars_variants():
    files = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "config", "train_gpt2_*.py"))}
    variants = {"train_gpt2_small_mars_lion.py", "train_gpt2_small_mars_shampoo.py"}
    assert files == {os.path.basename(config_path(s, o)) for s, o in PAPER_RUNS} | variants


@pytest.mark.parametrize(
    "variant, optimizer, lrs",
    [
        ("mars_lion", "mars-lion", dict(learning_rate=6e-4, min_lr=3e-6, weight_decay=1e-1)),
        ("mars_shampoo", "mars-shampoo", dict(learning_rate=2e-2, min_lr=1e-4, weight_decay=0.0)),
    ],
)
def test_mars_variants_are_the_small_mars_run_with_their_own_optimizer(variant, optimizer, lrs):
    mars, other = effective("small", "mars"), effective("small", variant)
    names = dict(out_dir=f"out_small_{variant}_100k", wandb_run_name=f"gpt2-small-{variant.replace('_', '-')}-100k")
    assert {k: v for k, v in other.items() if mars[k] != v} == dict(optimizer=optimizer, **lrs, **names)


@pytest.mark.parametrize(
    "size, optimizer",
    [("small", "mars"), ("xl", "mars"), ("small", "adamw"), ("xl", "adamw")]
    + [(size, opt) for size in ("small", "xl") for opt in ("mars_m", "moonlight")],  # MARS_M/scripts/*_fw.sh
)
def test_fineweb_edu_overlay(size, optimizer):
    plain, fw = effective(size, optimizer), effective(size, optimizer, FINEWEB)
    assert fw["dataset"] == "fineweb_edu" and os.path.isfile(os.path.join(ROOT, "data", "fineweb_edu", "prepare.py"))
    assert (fw["out_dir"], fw["wandb_run_name"]) == (plain["out_dir"] + "_fw", plain["wandb_run_name"] + "-fw")
    assert {k: v for k, v in fw.items() if plain[k] != v}.keys() == {"dataset", "out_dir", "wandb_run_name"}


@pytest.mark.parametrize("size", ["small", "medium", "large", "xl"])
def test_mars_m_and_moonlight_runs_differ_only_in_the_optimizer(size):
    """The MARS-M paper compares the two at the same lr, schedule and batch: only what names the run, the
    optimizer and its weight decay (1e-2 in MARS-M's configs, 1e-1 in Moonlight's) differ."""
    mars_m, moonlight = effective(size, "mars_m"), effective(size, "moonlight")
    differing = {k for k in mars_m if mars_m[k] != moonlight[k]}
    assert differing == {"optimizer", "weight_decay", "out_dir", "wandb_run_name"}
    assert (mars_m["weight_decay"], moonlight["weight_decay"]) == (1e-2, 1e-1)


def test_model_shapes_are_model_presets(monkeypatch):
    """The shape is written once, in model.PRESETS: change it there and every run of that size follows."""
    monkeypatch.setitem(PRESETS, "medium", dict(n_layer=2, n_head=4, n_embd=64))
    for optimizer in ("adamw", "mars", "muon"):
        cfg = effective("medium", optimizer)
        assert (cfg["n_layer"], cfg["n_head"], cfg["n_embd"]) == (2, 4, 64)


@pytest.mark.slow
def test_train_py_reads_a_paper_config_from_any_directory(tmp_path):
    """The config imports config.paper: that works wherever train.py is started from (its folder is on
    sys.path). The run gets as far as looking for its data."""
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), config_path("small", "mars"), f"--data_path={tmp_path}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert run.stderr.startswith(f"error: data directory {tmp_path}/openwebtext not found"), run.stderr


def run_losses(data_path, out_dir, **split):
    """{(iter, key): loss} of a tiny 8-step MARS run through train.py, its global batch split as `split` says."""
    argv = tiny_args(data_path, out_dir, max_iters=8, eval_interval=4, grad_multiplier=2, **split)
    assert train.main(argv) == 0
    keys = (metrics.TRAIN_LOSS, metrics.VAL_LOSS, metrics.EVAL_TRAIN_LOSS)
    return {(r[metrics.ITER], k): r[k] for r in metrics.read_records(out_dir) for k in keys if k in r}


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_larger_micro_batch_of_the_same_windows_is_the_same_run(data_path, tmp_path):
    """What config/paper.py does to GPT-2 small (15 x 32 -> 30 x 16, eval 200 x 15 -> 100 x 30, the windows drawn
    as 15s), on a tiny model: 8 micro-batches of 2 against 4 of 4 and 2 of 8, windows drawn 2 at a time. The
    losses differ only in float32 rounding (the micro-batch means are summed in another order)."""
    reference = run_losses(data_path, str(tmp_path / "2s"), batch_size=2, gradient_accumulation_steps=8, eval_iters=8)
    assert len(reference) == 8 + 3 * 2  # a train loss per step, two evaluations of two losses
    for batch_size in (4, 8):
        split = dict(batch_size=batch_size, gradient_accumulation_steps=16 // batch_size, eval_iters=16 // batch_size)
        losses = run_losses(data_path, str(tmp_path / f"{batch_size}s"), windows_per_stream=2, **split)
        assert losses.keys() == reference.keys()
        for key, loss in losses.items():
            assert loss == pytest.approx(reference[key], rel=1e-5, abs=0), key
    # without windows_per_stream the larger micro-batch draws other windows: a different run
    other = run_losses(data_path, str(tmp_path / "other"), batch_size=8, gradient_accumulation_steps=2, eval_iters=2)
    assert max(abs(other[key] - reference[key]) for key in reference) > 1e-3
