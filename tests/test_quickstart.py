"""scripts/quickstart.sh end to end, shortened, on a copy of the repository's code (so the corpus it prepares
and the run it writes stay out of the checkout): it prepares stdlib_char, trains, evaluates and samples from
the out_dir it trained; launched again, it continues that run (a finished one only samples again), so the same
command after a preemption neither refuses nor deletes the checkpoint."""

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from train_helpers import wait_for_line

from marsgpt.metrics import ITER, VAL_LOSS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART_FILES = [
    "config/quickstart.py",
    "scripts/quickstart.sh",
    "scripts/__init__.py",
    "scripts/quickstart.py",
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


def quickstart(tree, *args, **popen):
    """bash scripts/quickstart.sh args in the copy `tree`: its finished run (subprocess.run), or with
    start_new_session=True the process, running in a session of its own (a job a scheduler can signal)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    argv = ["bash", os.path.join(tree, "scripts", "quickstart.sh"), *args]
    if popen:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    return subprocess.run(argv, env=env, capture_output=True, text=True)


def val_loss_iters(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r[ITER] for r in records if VAL_LOSS in r]


def sample_of(stdout):
    """The sample that ends the output, after the run's summary (whose last line names metrics.jsonl): the prompt
    and 400 characters, then sample.py's separator."""
    sample = stdout.rsplit("\nmetrics: ", 1)[1].split("\n", 1)[1]
    assert sample.endswith("\n---------------\n"), stdout[-800:]
    sample = sample.removesuffix("\n---------------\n")
    assert sample.startswith("def ") and len(sample) == len("def ") + 400, sample
    return sample


@pytest.mark.slow
def test_quickstart_trains_samples_its_out_dir_and_continues_when_run_again(tmp_path):
    tree = copy_of_the_code(tmp_path / "repo")
    out_dir = tmp_path / "my-run"
    first = quickstart(tree, *SHORT_RUN, f"--out_dir={out_dir}")
    assert first.returncode == 0, first.stderr
    after_training = first.stdout.split("\nstep 2: train loss ", 1)[1].split("\n", 1)[1]
    assert after_training.startswith("best val loss ")  # the run's summary, then the sample
    sample_of(first.stdout)
    assert val_loss_iters(out_dir) == [0, 2]
    again = quickstart(tree, *SHORT_RUN, f"--out_dir={out_dir}")  # the same command: the run is finished
    assert again.returncode == 0, again.stderr
    assert f"resuming {out_dir}/ckpt.pt at iter 2" in again.stdout and "nothing to train" in again.stdout
    sample_of(again.stdout)
    assert val_loss_iters(out_dir) == [0, 2]  # sampled again; the run untouched
    fresh = quickstart(tree, *SHORT_RUN, f"--out_dir={out_dir}", "--init_from=scratch", "--overwrite=True")
    assert fresh.returncode == 0, fresh.stderr
    assert "resuming" not in fresh.stdout and val_loss_iters(out_dir) == [0, 2]  # a new run of 2 steps
    assert os.path.isfile(tree / "data" / "stdlib_char" / "train.bin")
    assert not os.path.exists(tree / "out-quickstart")  # trained and sampled in --out_dir only


def processes_in_group(group):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(int(pid)) == group:
                found.append(int(pid))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("target", ["its process group", "its own pid"])
def test_a_quickstart_stopped_by_sigterm_continues_with_the_same_command(tmp_path, target):
    """A preemption signals the whole job (its process group); `kill <the script's pid>` the script alone, which
    was bash waiting on train.py: train.py kept training as an orphan holding out_dir, and the next quickstart was
    refused. Now the script is the training process (exec). Either way the training step in flight ends with a
    checkpoint and a line saying that the same command continues, exit 0, nothing left running; the same command
    continues to the end and the sample."""
    tree = copy_of_the_code(tmp_path / "repo")
    out_dir = tmp_path / "run"
    # a 1-layer model, a few ms a step: about 1,000 steps stay after the signal, however late it lands
    args = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--max_iters=1000", "--eval_interval=500", "--eval_iters=2"]
    args += ["--log_interval=1", "--device=cpu", f"--out_dir={out_dir}"]
    job = quickstart(tree, *args, start_new_session=True)
    try:
        wait_for_line(job, "iter 3:")
        (os.killpg if target == "its process group" else os.kill)(job.pid, signal.SIGTERM)
        output, _ = job.communicate(timeout=120)
        assert job.returncode == 0 and processes_in_group(job.pid) == [], output
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever of the job is left when the test fails
            os.killpg(job.pid, signal.SIGKILL)
    stopped = [line for line in output.splitlines() if line.startswith("stopped by SIGTERM after iter ")]
    assert len(stopped) == 1 and "Traceback" not in output, output
    iteration = int(stopped[0].split()[5].rstrip(":"))
    assert stopped[0].endswith(f": {out_dir}/ckpt.pt holds it; run the same command to continue")
    assert 3 <= iteration < 1000
    again = quickstart(tree, *args)
    assert again.returncode == 0, again.stderr
    assert f"resuming {out_dir}/ckpt.pt at iter {iteration}" in again.stdout
    assert val_loss_iters(out_dir) == [0, 500, 1000] if iteration < 500 else [0, 1000]
    sample_of(again.stdout)


def test_on_a_gpu_the_quickstart_compiles_in_float32_and_on_the_cpu_neither_changes():
    """config/quickstart.py: on CUDA float32 (not autocast's bfloat16) and torch.compile, its default there; on the
    CPU float32 uncompiled, what dtype 'auto' and compile's default gave before (the README's CPU figures)."""
    from marsgpt.config import load_config
    from marsgpt.runtime import resolve_compile, resolve_dtype

    cfg = load_config([os.path.join(ROOT, "config", "quickstart.py")])
    assert (resolve_dtype(cfg.dtype, "cuda"), resolve_compile(cfg.compile, "cuda")) == ("float32", True)
    assert (resolve_dtype(cfg.dtype, "cpu"), resolve_compile(cfg.compile, "cpu")) == ("float32", False)
    assert (resolve_dtype("auto", "cpu"), resolve_compile(None, "cpu")) == ("float32", False)
