"""scripts/quickstart.sh end to end, shortened to 2 steps, on a copy of the repository's code (so the corpus it
prepares and the run it writes stay out of the checkout): it prepares stdlib_char, trains, evaluates and
samples from the out_dir it trained; launched again, it trains again instead of refusing that out_dir."""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from marsgpt.metrics import ITER, VAL_LOSS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART_FILES = [
    "config/quickstart.py",
    "scripts/quickstart.sh",
    "data/__init__.py",
    "data/prepare_common.py",
    "data/stdlib_char/prepare.py",
]
SHORT_RUN = ["--max_iters=2", "--eval_iters=1", "--log_interval=1", "--device=cpu"]


def copy_of_the_code(tree):
    """The top-level modules and the quickstart's own files under `tree`."""
    top_level = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "marsgpt", "*.py"))
    paths = [os.path.relpath(p, ROOT) for p in top_level] + QUICKSTART_FILES
    for path in paths:
        os.makedirs(os.path.join(tree, os.path.dirname(path)), exist_ok=True)
        shutil.copy(os.path.join(ROOT, path), os.path.join(tree, path))
    return tree


def quickstart(tree, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    return subprocess.run(
        ["bash", os.path.join(tree, "scripts", "quickstart.sh"), *args], env=env, capture_output=True, text=True
    )


def val_loss_iters(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r[ITER] for r in records if VAL_LOSS in r]


@pytest.mark.slow
def test_quickstart_trains_samples_its_out_dir_and_trains_again_when_run_again(tmp_path):
    tree = copy_of_the_code(tmp_path / "repo")
    out_dir = tmp_path / "my-run"
    for launch in ("first", "second"):
        result = quickstart(tree, *SHORT_RUN, f"--out_dir={out_dir}")
        assert result.returncode == 0, f"{launch} launch: {result.stderr}"
        after_training = result.stdout.split("\nstep 2: train loss ", 1)[1].split("\n", 1)[1]
        assert after_training.endswith("\n---------------\n")  # sample.py's separator ends the output
        sample = after_training.removesuffix("\n---------------\n")
        assert sample.startswith("def ") and len(sample) == len("def ") + 400  # the prompt, then 400 characters
        # the second launch replaced the first run: its metrics hold one run's evaluations, not two
        assert val_loss_iters(out_dir) == [0, 2], launch
    assert os.path.isfile(tree / "data" / "stdlib_char" / "train.bin")
    assert not os.path.exists(tree / "out-quickstart")  # trained and sampled in --out_dir only


def test_on_a_gpu_the_quickstart_compiles_in_float32_and_on_the_cpu_neither_changes():
    """config/quickstart.py: on CUDA float32 (not autocast's bfloat16) and torch.compile, its default there; on the
    CPU float32 uncompiled, what dtype 'auto' and compile's default gave before (the README's CPU figures)."""
    from marsgpt.config import load_config
    from marsgpt.runtime import resolve_compile, resolve_dtype

    cfg = load_config([os.path.join(ROOT, "config", "quickstart.py")])
    assert (resolve_dtype(cfg.dtype, "cuda"), resolve_compile(cfg.compile, "cuda")) == ("float32", True)
    assert (resolve_dtype(cfg.dtype, "cpu"), resolve_compile(cfg.compile, "cpu")) == ("float32", False)
    assert (resolve_dtype("auto", "cpu"), resolve_compile(None, "cpu")) == ("float32", False)
