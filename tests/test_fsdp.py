"""train.py --zero_stage=3 (FSDP2, marsgpt/fsdp.py; sharded checkpoints, marsgpt/shards.py) through the command
line: 2 gloo ranks train what one process trains, for every optimizer the trainer offers; the sharded checkpoints
resume on 2 ranks bit for bit after a kill -9 of the torchrun job during a save, after a Ctrl-C during a save
(kept, its directory too) and after a SIGTERM to one rank, on 1 rank, and from one process's checkpoint on 2 under
torchrun; scripts/copy_run.py copies a live sharded run that replaces a checkpoint meanwhile; a full disk during
a sharded save is one line with the OS's reason; a damaged shard file is refused in one line naming it; nothing
is overwritten; sample.py and export_hf.py read the sharded checkpoint directly; gradients reduce-scattered
every micro-batch with recomputed activations train the same. HSDP (torchrun, 4 ranks as 2 replicas x 2 shards)
is one more launch, marked slow.

Each optimizer is one launch of 4 steps on 2 ranks (2 micro-batches each: the first one's gradients stay
unsynchronised; 3 evaluation windows: rank 1 runs one uncounted pass to keep the collectives in step), started
as torchrun's agent starts them (`ranks`), and one run of train.main in this process (one thread), whose
directories the tests read. The killed job and its resume run under torchrun and end bit for bit as the sweep's
run of the same optimizer: the two launchers train the same.

Tolerances: both runs take the same windows in the same order; what differs is the order of float32 additions
(the reduce-scatter sums the two ranks' gradients, one process adds its micro-batches in turn), a few float32
roundings (2^-24 relative) per value, carried through 4 steps: measured at most 1.2e-7 on weights of order
0.02-1. rtol=1e-5, atol=1e-6 bounds that with room and is far below one step's change (the learning rate,
3e-3, times updates of order 1). Muon and Moonlight run Newton-Schulz in bfloat16 (torch.optim.Muon's rule):
there a float32 rounding can flip a bfloat16 rounding (2^-8), which the next steps carry on, so their bound is
relative to how far the parameters moved, as in tests/test_zero.py: after one update (iteration 2) 2^-5, after
three (iteration 4) 2^-3. Measured: plain DDP (zero_stage=0) on 2 ranks differs from one process by 6.2% of the
displacement at iteration 4, FSDP2 by 6.7%; a matrix orthogonalised in pieces, or by a wrong owner, would differ
by about the whole displacement.
"""

import contextlib
import inspect
import io
import json
import os
import re
import shutil
import signal
import subprocess

import pytest
import torch
from train_helpers import (
    ROOT,
    fill,
    kill_job,
    launch,
    start_torchrun,
    subprocess_env,
    tiny_args,
    tmpfs,
    torchrun_command,
    wait_for_line,
)

import sample
import train
from bench.common import rendezvous
from marsgpt import checkpoint, checkpointer, run_dir, shards
from model import GPT, Block, GPTConfig, chunk_loss
from scripts import copy_run

pytestmark = pytest.mark.slow

# checkpoints at 0, 2 and 4, each kept (ckpt_<iter>.pt): the resumes start from the kept one at 2. 3 evaluation
# windows: rank 1 has one fewer than rank 0 and runs one uncounted forward pass to keep FSDP2's collectives in step.
RUN = dict(
    max_iters=4, eval_interval=2, eval_iters=3, log_interval=1, gradient_accumulation_steps=4, keep_every_n_evals=1
)
OPTIMIZERS = {
    "mars-adamw-exact": dict(is_approx=False),
    "mars-lion": dict(optimizer="mars-lion"),
    "mars-shampoo": dict(optimizer="mars-shampoo"),
    "mars-m": dict(optimizer="mars-m"),
    "adamw": dict(optimizer="adamw"),
    "muon": dict(optimizer="muon"),
    "moonlight": dict(optimizer="moonlight"),
}
BFLOAT16_NEWTON_SCHULZ = ("muon", "moonlight")
TIMING = {"time_s", "tokens_per_sec", "step_ms", "mfu"}


def args_for(data_path, out_dir, name, **overrides):
    return tiny_args(data_path, out_dir, **RUN, **OPTIMIZERS[name], zero_stage=3, **overrides)


def torchrun(args, nproc=2, timeout=300):
    for _attempt in range(2):
        done = subprocess.run(
            torchrun_command(args, nproc),
            cwd=ROOT,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        # --standalone picks a free port, which another process on a shared machine can take first
        if done.returncode == 0 or "address already in use" not in done.stderr.lower():
            break
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def ranks(args, nproc=2, timeout=300):
    """The ranks of a job started as torchrun's agent starts them -- train.py's command line (through
    train_helpers.py) with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and the address of a rendezvous store
    -- but without the agent, a process of its own that imports torch too (about 2.5 s of CPU a launch here,
    which the optimizer sweep would pay 7 times); the store is hosted by this process (bench.common.rendezvous).
    The tests that need torchrun itself (a killed job, HSDP, a resume) launch it. Returns rank 0's output."""
    with rendezvous() as env:
        procs = [
            launch(
                args,
                env=subprocess_env(
                    **env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc)
                ),
            )
            for r in range(nproc)
        ]
        try:
            outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert all(proc.returncode == 0 for proc in procs), "\n".join(outputs)
    return outputs[0]


def in_this_process(args):
    """train.main(args) on one thread, as the subprocesses run; returns its exit status."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train.main(args)
    finally:
        torch.set_num_threads(threads)


def records(out_dir):
    """metrics.jsonl without its wall-clock fields and a stop's record (only an interrupted run has one)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in lines if run_dir.metrics.STOPPED not in r]


def val_losses(out_dir, last=None):
    """The evaluations' validation losses: all, or the `last` ones (a resumed run records only those after it)."""
    losses = [r["val/loss"] for r in records(out_dir) if "val/loss" in r]
    return losses[-last:] if last else losses


def whole(path):
    """A checkpoint (file or out_dir) as the tools read it: a sharded one's tensors read whole."""
    return shards.load_checkpoint(path)


def copy_checkpoint(src, out_dir):
    """src (a checkpoint file) as out_dir/ckpt.pt, with the shard directory it names, if any."""
    os.makedirs(out_dir)
    shutil.copyfile(src, os.path.join(out_dir, "ckpt.pt"))
    record = torch.load(src, weights_only=True).get(shards.SHARDS_KEY)
    if record is not None:
        source = os.path.join(os.path.dirname(src), record["directory"])
        shutil.copytree(source, os.path.join(out_dir, record["directory"]))


@pytest.fixture(scope="module")
def runs(data_path, tmp_path_factory):
    """runs(name) -> (out_dir of 2 ranks under torchrun, out_dir of one process), each run once per module."""
    done = {}

    def run(name):
        if name not in done:
            root = tmp_path_factory.mktemp(name)
            sharded, single = str(root / "sharded"), str(root / "single")
            output = ranks(args_for(data_path, sharded, name))
            assert "world size 2 on cpu; 2 micro-batches per rank per step" in output
            assert "FSDP2 over 2 GPUs" in output
            assert in_this_process(args_for(data_path, single, name)) == 0
            done[name] = sharded, single
        return done[name]

    return run


def assert_close_states(a, b, rtol=1e-5, atol=1e-6):
    """Two state trees with the same keys, types and shapes everywhere, their tensors equal to rtol/atol."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (a.keys(), b.keys())
        for key in a:
            assert_close_states(a[key], b[key], rtol, atol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_close_states(x, y, rtol, atol)
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    else:
        assert a == b


def assert_same_training(sharded, single, name):
    """The sharded run's checkpoint, read whole, is the one-process run's: the same model and optimizer state
    (same keys and shapes; values to the module's tolerance) and the same evaluations (the single run's last
    ones when `sharded` is a resumed run)."""
    a, b = whole(sharded), whole(single)
    if name in BFLOAT16_NEWTON_SCHULZ:
        torch.manual_seed(1)  # the seed tiny_args gives: the initial weights, as launch.build_model makes them
        start = GPT(GPTConfig(**b["model_args"])).state_dict()
        for iteration, bound in ((2, 2**-5), (4, 2**-3)):
            a, b = (whole(os.path.join(out, f"ckpt_{iteration:07d}.pt"))["model"] for out in (sharded, single))
            for key, value in b.items():
                assert (a[key] - value).norm() <= bound * (value - start[key]).norm(), (iteration, key)
        assert val_losses(sharded) == pytest.approx(val_losses(single, len(val_losses(sharded))), abs=1e-3)
        return
    assert_close_states(a["model"], b["model"])
    assert_close_states(a["optimizer"], b["optimizer"])
    assert val_losses(sharded) == pytest.approx(val_losses(single, len(val_losses(sharded))), abs=1e-5)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_two_sharded_ranks_train_what_one_process_trains(runs, name):
    sharded, single = runs(name)
    assert shards.has_shards(torch.load(os.path.join(sharded, "ckpt.pt"), weights_only=True))
    assert_same_training(sharded, single, name)
    if name == "mars-adamw-exact":
        assert any("last_grad" in s for s in whole(sharded)["optimizer"]["state"].values())


def assert_same_run(out_a, out_b):
    """Bit for bit: the same records (but wall-clock times), model and optimizer state."""
    assert records(out_a) == records(out_b)
    a, b = whole(out_a), whole(out_b)
    for part in ("model", "optimizer"):
        assert_close_states(a[part], b[part], rtol=0, atol=0)


def test_killed_during_a_sharded_save_the_run_resumes_on_two_ranks_bit_for_bit(runs, data_path, tmp_path):
    """kill -9 of the whole job while rank 0 renames the iteration-4 checkpoint file into place: every rank has
    written its shard file and the directory holding them is complete, but no checkpoint file names it yet, so
    ckpt.pt is still iteration 2's; the same command with --init_from=auto removes the unnamed directory,
    resumes at 2 and ends exactly where the run left alone ends."""
    uninterrupted, _ = runs("mars-adamw-exact")
    out = str(tmp_path / "out")
    args = args_for(data_path, out, "mars-adamw-exact")
    proc = start_torchrun(args, TEST_HOLD_SAVE=f"3:{tmp_path / 'never'}")
    try:
        wait_for_line(proc, "renaming")
    finally:
        kill_job(proc)
    named = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert named["progress"]["iter_num"] == 2
    unnamed = [d for d in os.listdir(os.path.join(out, "shards")) if d.startswith("0000004.") and d.count(".") == 2]
    assert len(unnamed) == 1 and unnamed[0] != os.path.basename(named[shards.SHARDS_KEY]["directory"])
    output = torchrun(args + ["--init_from=auto"])
    assert f"resuming {os.path.join(out, 'ckpt.pt')} at iter 2" in output
    assert f"removed {os.path.join(out, 'shards', unnamed[0])}, a sharded checkpoint no checkpoint file names" in output
    assert_same_run(out, uninterrupted)


def test_ctrl_c_while_a_sharded_save_waits_for_a_slow_one_keeps_both_and_the_next_launch_resumes_bit_for_bit(
    runs, data_path, tmp_path
):
    """Storage slower than the checkpoints: rank 0's iteration-2 save is held at the rename of its checkpoint file
    (its shard directory complete), and the iteration-4 save waits for it. Ctrl-C then (SIGINT to torchrun, which
    passes it on to each rank): rank 0 says it hands iteration 4's checkpoint to the disk first, both saves land
    once the slow one is let go, and the run ends (130) naming iteration 4. The next launch keeps every directory a
    checkpoint file names, resumes at 4 and ends bit for bit as the run left alone. (Before, the Ctrl-C dropped the
    iteration-4 state while saying it waited for the checkpoint in flight; earlier still, the process left mid-write
    and the next launch deleted the complete directory.)"""
    uninterrupted, _ = runs("mars-adamw-exact")
    out, release = str(tmp_path / "out"), str(tmp_path / "release")
    args = args_for(data_path, out, "mars-adamw-exact") + ["--init_from=auto"]
    proc = start_torchrun(args, TEST_HOLD_SAVE=f"2:{release}")
    try:
        seen = wait_for_line(proc, "waiting on the held save")  # rank 0 inside iteration 4's save
        proc.send_signal(signal.SIGINT)
        seen += wait_for_line(proc, "interrupted: handing the checkpoint of iter 4 to the disk first")
        open(release, "w").close()
        output = seen + proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            kill_job(proc)
    ckpt = os.path.join(out, "ckpt.pt")
    assert re.search(rf"^interrupted at iter 4; resume from {re.escape(ckpt)} \(iter 4\)", output, re.M), output
    named = os.path.join(out, torch.load(ckpt, weights_only=True)[shards.SHARDS_KEY]["directory"])
    assert whole(ckpt)["progress"]["iter_num"] == 4  # its shard files verified and read
    output = torchrun(args)
    assert f"resuming {ckpt} at iter 4" in output and f"removed {named}" not in output
    assert_same_run(out, uninterrupted)


def test_a_copy_of_a_live_sharded_run_resumes_even_when_a_save_replaces_what_it_was_copying(
    data_path, tmp_path, monkeypatch
):
    """scripts/copy_run.py on a zero_stage=3 job that writes a checkpoint at every step boundary, paused after the
    iteration-2 one: as the copy reaches ckpt.pt's shard directory the job goes on and writes the checkpoints of
    iterations 3 and 4, removing iteration 2's directory (what a plain `cp -r` then misses). The copy finds it
    gone, copies the newer ckpt.pt and its directory instead, leaves run.lock behind, and resumes in one process
    at iteration 4 to the end."""
    out, backup, pause = str(tmp_path / "out"), str(tmp_path / "backup"), str(tmp_path / "pause")
    shape = dict(max_iters=6, eval_interval=6, checkpoint_interval=1, gradient_accumulation_steps=4, zero_stage=3)
    proc = start_torchrun(tiny_args(data_path, out, **shape), TEST_PAUSE=f"0:2,4:{pause}")
    try:
        wait_for_line(proc, "paused before step 2", timeout=240)
        real_copy, replaced = run_dir.copy_file, []

        def copy_file(src, dst):
            if os.sep + "shards" + os.sep in src and not replaced:
                replaced.append(os.path.dirname(src))
                open(f"{pause}.2", "w").close()
                wait_for_line(proc, "paused before step 4")  # ckpt.pt is iteration 4's, on disk
            real_copy(src, dst)

        monkeypatch.setattr(run_dir, "copy_file", copy_file)
        assert copy_run.main([out, backup]) == 0
        assert not os.path.exists(replaced[0])  # the directory the first ckpt.pt named, gone meanwhile
        assert whole(backup)["progress"]["iter_num"] == 4 and not os.path.exists(os.path.join(backup, "run.lock"))
        open(f"{pause}.4", "w").close()
        assert proc.wait(timeout=240) == 0
    finally:
        if proc.poll() is None:
            kill_job(proc)
    assert in_this_process(tiny_args(data_path, backup, **shape, init_from="auto")) == 0
    assert whole(backup)["progress"]["iter_num"] == 6


def test_a_plain_cp_of_a_live_sharded_run_holds_an_intact_checkpoint_whatever_order_it_copies_in(data_path, tmp_path):
    """`cp -r` of a zero_stage=3 job that saves at every step boundary, in the order that lost it: cp lists shards/
    before the iteration-2 save's directory appears (copying the directories there were: iteration 1's, which ckpt.pt
    names, and the one before), and copies the checkpoint files only after that save has replaced ckpt.pt and
    rotated the old directories. The copy's ckpt.pt then names a directory it lacks; before, nothing named the
    complete one it has, and it held no intact checkpoint. Now previous.pt names it: the copy resumes from it
    (iteration 1) to the end."""
    out, copy, release, pause = (str(tmp_path / name) for name in ("out", "copy", "release", "pause"))
    shape = dict(max_iters=4, eval_interval=4, checkpoint_interval=1, gradient_accumulation_steps=4, zero_stage=3)
    args = tiny_args(data_path, out, **shape, save_best=False)
    proc = start_torchrun(args, TEST_HOLD_SAVE=f"3:{release}", TEST_PAUSE=f"0:2:{pause}")
    try:
        wait_for_line(proc, "renaming", timeout=240)  # iteration 2's directory complete, ckpt.pt still iteration 1's
        shards = os.path.join(out, "shards")
        for name in os.listdir(shards):  # cp's pass over shards/, made before iteration 2's directories appeared
            if int(name.split(".")[0]) < 2:  # shards.py names each <iteration>.<launch>.<save>
                shutil.copytree(os.path.join(shards, name), os.path.join(copy, "shards", name))
        open(release, "w").close()
        wait_for_line(proc, "paused before step 2")  # iteration 2's save on disk, the old directories rotated
        for path in checkpointer.checkpoint_files(out):  # cp reaches the checkpoint files
            shutil.copy(path, os.path.join(copy, os.path.basename(path)))
        open(f"{pause}.2", "w").close()
        assert proc.wait(timeout=240) == 0
    finally:
        if proc.poll() is None:
            kill_job(proc)
    assert sorted(os.listdir(copy)) == ["ckpt.pt", "previous.pt", "shards"]
    resumed = launch(tiny_args(data_path, copy, **shape, save_best=False, init_from="auto"))
    output, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, output
    assert f"resuming {os.path.join(copy, 'previous.pt')} at iter 1" in output and "is missing" in output, output
    assert whole(os.path.join(copy, "ckpt.pt"))["progress"]["iter_num"] == 4


def test_sigterm_to_one_sharded_rank_stops_the_job_at_one_checkpoint_which_resumes_bit_for_bit(
    runs, data_path, tmp_path
):
    """A scheduler's SIGTERM that reaches one rank of a zero_stage=3 job under torchrun (rank 1, paused before its
    third step): the ranks agree on it, all write their shards of one checkpoint after iteration 3 (between the
    evaluations at 2 and 4), and exit 0; the same command resumes and ends bit for bit as the job left alone."""
    uninterrupted, _ = runs("mars-adamw-exact")
    out, pause = str(tmp_path / "out"), str(tmp_path / "pause")
    args = args_for(data_path, out, "mars-adamw-exact") + ["--init_from=auto"]
    proc = start_torchrun(args, TEST_PAUSE=f"1:2:{pause}")
    try:
        seen = wait_for_line(proc, "paused before step 2")
        os.kill(int(seen.rsplit("(pid ", 1)[1].split(")")[0]), signal.SIGTERM)
        open(f"{pause}.2", "w").close()
        output = seen + proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            kill_job(proc)
    assert proc.returncode == 0, output
    ckpt = os.path.join(out, "ckpt.pt")
    assert f"stopped by SIGTERM after iter 3: {ckpt} holds it; run the same command to continue" in output
    assert output.count("stopped by SIGTERM") == 1 and "Traceback" not in output and "iter 4:" not in output
    assert shards.has_shards(torch.load(ckpt, weights_only=True)) and whole(ckpt)["progress"]["iter_num"] == 3
    torchrun(args)
    assert_same_run(out, uninterrupted)


def test_a_full_disk_during_a_sharded_save_is_one_line_with_the_os_reason_and_the_job_resumes(data_path, tmp_path):
    """The disk fills while 2 ranks train under torchrun (at step 4, leaving room for the metrics but not for a
    checkpoint): the sharded save at iteration 6 fails in one line naming the shard directory, the file and
    ENOSPC (not torch's "unexpected pos"); the job stops naming the checkpoint to resume (iteration 3, intact,
    the failed directory removed); once there is room the same command resumes from it and finishes."""
    with tmpfs(str(tmp_path / "disk")) as disk:
        out, pause = os.path.join(disk, "out"), str(tmp_path / "pause")
        args = tiny_args(data_path, out, max_iters=8, eval_interval=3, gradient_accumulation_steps=4, zero_stage=3)
        args.append("--init_from=auto")
        proc = start_torchrun(args, TEST_PAUSE=f"0:4,6:{pause}")
        try:
            seen = wait_for_line(proc, "paused before step 4")
            filler = fill(disk, leave_bytes=256 << 10)
            for step in (4, 6):
                open(f"{pause}.{step}", "w").close()
            output = seen + proc.communicate(timeout=120)[0]
        finally:
            if proc.poll() is None:
                kill_job(proc)
        shards = os.path.join(out, "shards")
        failed = re.search(
            rf"^error: cannot write checkpoint {re.escape(shards)}/0000006\.\w+\.\d+\.tmp: (.*)$", output, re.M
        )
        assert failed, output
        # which file meets the full disk first, and in which call (a write, a flush, the fsync), varies
        reason = re.fullmatch(r"rank \d: (\S+): \[ENOSPC\] No space left on device; (.*)", failed.group(1))
        assert reason and re.fullmatch(r"__\d_0\.distcp|\.metadata.*", reason.group(1)), failed.group(0)
        assert reason.group(2) == f"the previous one is kept (free space in {shards})", failed.group(0)
        assert "unexpected pos" not in output
        resume = f"resume from {out}/ckpt.pt (iter 3) with --init_from=resume (or auto) once {out} has room"
        assert f"stopped at iter 7: a write failed (above); {resume}" in output, output
        assert proc.returncode == 1
        assert whole(out)["progress"]["iter_num"] == 3
        assert not [name for name in os.listdir(shards) if name.endswith(".tmp")]
        os.remove(filler)
        output = torchrun(args)
        assert f"resuming {out}/ckpt.pt at iter 3" in output
        assert whole(out)["progress"]["iter_num"] == 8


def test_a_two_rank_checkpoint_resumes_in_one_process(runs, data_path, tmp_path):
    sharded, single = runs("mars-adamw-exact")
    out = str(tmp_path / "out")
    copy_checkpoint(os.path.join(sharded, "ckpt_0000002.pt"), out)
    assert in_this_process(args_for(data_path, out, "mars-adamw-exact", init_from="resume")) == 0
    assert_same_training(out, single, "mars-adamw-exact")


def test_a_one_process_checkpoint_resumes_on_two_sharded_ranks(runs, data_path, tmp_path):
    sharded, single = runs("mars-adamw-exact")
    out = str(tmp_path / "out")
    copy_checkpoint(os.path.join(single, "ckpt_0000002.pt"), out)
    torchrun(args_for(data_path, out, "mars-adamw-exact", init_from="resume"))
    assert shards.has_shards(torch.load(os.path.join(out, "ckpt.pt"), weights_only=True))
    assert_same_training(out, sharded, "mars-adamw-exact")


def test_a_damaged_shard_file_is_refused_in_one_line_naming_it(runs, data_path, tmp_path, capsys):
    sharded, _ = runs("mars-adamw-exact")
    out = str(tmp_path / "out")
    copy_checkpoint(os.path.join(sharded, "ckpt_0000002.pt"), out)
    directory = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)[shards.SHARDS_KEY]["directory"]
    damaged = os.path.join(out, directory, "__1_0.distcp")
    with open(damaged, "r+b") as f:
        f.seek(os.path.getsize(damaged) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    capsys.readouterr()
    assert in_this_process(args_for(data_path, out, "mars-adamw-exact", init_from="resume")) != 0
    errors = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(errors) == 1 and errors[0].startswith("error: ") and f"{damaged} is damaged" in errors[0], errors
    assert sample.main(["--out_dir", out, "--num_samples=1", "--max_new_tokens=4"]) == 2
    assert f"{damaged} is damaged" in capsys.readouterr().err


def test_init_from_auto_passes_over_a_damaged_shard_file_to_the_newest_intact_checkpoint(runs, data_path, tmp_path):
    sharded, _ = runs("mars-adamw-exact")
    out = str(tmp_path / "out")
    shutil.copytree(sharded, out)
    directory = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)[shards.SHARDS_KEY]["directory"]
    with open(os.path.join(out, directory, "__0_0.distcp"), "r+b") as f:
        f.truncate(100)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert in_this_process(args_for(data_path, out, "mars-adamw-exact", init_from="auto")) == 0
    printed = output.getvalue()
    assert f"{os.path.join(out, directory, '__0_0.distcp')} is damaged" in printed
    resumed = re.search(r"^resuming (\S+) at iter 4", printed, re.M)
    assert resumed and resumed.group(1) in (os.path.join(out, name) for name in ("best.pt", "ckpt_0000004.pt"))


def test_a_sharded_run_is_not_overwritten_without_overwrite(runs, data_path, tmp_path, capsys):
    sharded, _ = runs("mars-adamw-exact")
    out = str(tmp_path / "out")
    shutil.copytree(sharded, out)
    before = {
        os.path.relpath(os.path.join(d, f), out): os.path.getmtime(os.path.join(d, f))
        for d, _, fs in os.walk(out)
        for f in fs
    }
    assert in_this_process(args_for(data_path, out, "mars-adamw-exact", init_from="scratch")) != 0
    assert "--overwrite=True" in capsys.readouterr().err
    after = {
        os.path.relpath(os.path.join(d, f), out): os.path.getmtime(os.path.join(d, f))
        for d, _, fs in os.walk(out)
        for f in fs
    }
    assert after == before


def one_file_equal(sharded, out_dir):
    """out_dir with a ckpt.pt of one file holding the sharded run's checkpoint, its tensors read whole."""
    os.makedirs(out_dir)
    checkpoint.save_checkpoint(os.path.join(out_dir, "ckpt.pt"), whole(sharded))
    return out_dir


def test_sample_py_reads_a_sharded_checkpoint_as_its_one_file_equal(runs, tmp_path, capsys):
    """sample.py (and hellaswag.py and export_hf.py, which load through the same trained_model.load_model) reads the
    sharded checkpoint directly: the same text as from one file holding the same tensors."""
    sharded, _ = runs("mars-adamw-exact")
    one_file = one_file_equal(sharded, str(tmp_path / "one_file"))
    texts = []
    for out in (sharded, one_file):
        capsys.readouterr()
        assert sample.main(["--out_dir", out, "--start=def", "--num_samples=2", "--max_new_tokens=24"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > 24


def test_gradients_reduced_every_micro_batch_with_recomputed_activations_train_what_one_process_trains(
    runs, data_path, tmp_path
):
    """--gradient_sync=micro_batch (a reduce-scatter after each micro-batch, the gradients never whole) with
    --activation_checkpointing=True (each block's forward run again in the backward pass, its parameters
    all-gathered again): the same training as one process, exact MARS's look-ahead pass included."""
    _, single = runs("mars-adamw-exact")
    out = str(tmp_path / "out")
    ranks(args_for(data_path, out, "mars-adamw-exact", gradient_sync="micro_batch", activation_checkpointing=True))
    assert_same_training(out, single, "mars-adamw-exact")


def test_export_hf_reads_a_sharded_checkpoint_as_its_one_file_equal(runs, tmp_path):
    """marsgpt/export_hf.py on the sharded run's out_dir writes the same Hugging Face model as on one file holding
    the same tensors (hellaswag.py loads through the same trained_model.load_model as it and sample.py)."""
    transformers = pytest.importorskip("transformers")
    from marsgpt import export_hf

    sharded, _ = runs("mars-adamw-exact")
    one_file = one_file_equal(sharded, str(tmp_path / "one_file"))
    exported = []
    for out in (sharded, one_file):
        hf_dir = str(tmp_path / f"hf_{os.path.basename(out)}")
        assert export_hf.main([out, hf_dir]) == 0
        exported.append(transformers.GPT2LMHeadModel.from_pretrained(hf_dir).state_dict())
    assert exported[0].keys() == exported[1].keys()
    for key, value in exported[0].items():
        assert torch.equal(value, exported[1][key]), key
    trained = whole(sharded)["model"]["transformer.wte.weight"]
    assert torch.equal(exported[0]["transformer.wte.weight"], trained)


@pytest.mark.slow
def test_hsdp_two_replicas_of_two_shards_train_what_one_process_trains(runs, data_path, tmp_path):
    """4 ranks as a 2 x 2 mesh (--hsdp_replicas=2): each replica's 2 ranks hold the rows of one copy, the
    replicas all-reduce their gradients; MARS-Shampoo's Newton-Schulz owners are within each replica."""
    _, single = runs("mars-shampoo")
    out = str(tmp_path / "hsdp")
    output = torchrun(args_for(data_path, out, "mars-shampoo", hsdp_replicas=2), nproc=4)
    assert "world size 4 on cpu; 1 micro-batch per rank per step" in output
    assert "FSDP2 over 2 GPUs in each of 2 HSDP replicas" in output
    assert_same_training(out, single, "mars-shampoo")


def test_one_rank_under_torchrun_shards_over_a_mesh_of_one_as_its_plan_says(data_path, tmp_path):
    """zero_stage=3 with one process under torchrun (a node with one GPU): FSDP2 over a mesh of one -- DTensor
    parameters, the sharded step, a sharded checkpoint -- and the memory plan it prints says so."""
    out = str(tmp_path / "out")
    run = dict(RUN, max_iters=2, keep_every_n_evals=0)
    args = tiny_args(data_path, out, **run, optimizer="mars-shampoo", zero_stage=3)
    output = ranks(args, nproc=1)
    assert "world size 1 on cpu" in output and "FSDP2 over 1 GPU," in output
    assert shards.has_shards(torch.load(os.path.join(out, "ckpt.pt"), weights_only=True))


def test_compiled_blocks_share_one_graph_and_train_what_eager_blocks_train(data_path, tmp_path, monkeypatch):
    """--compile=True under FSDP2: each block compiled on its own (dynamo's aot_eager backend here; the graphs,
    breaks and recompiles are dynamo's whatever the backend), 10 blocks whose attention is scaled by layer
    (the trainer's default). Every block runs the same graphs -- no-grad for the first evaluation, then one
    recompile for training, as the loss's chunk, first without its gradient, then with it -- with no graph
    break and torch's recompile_limit (8) never reached (with the factor a constant per block it was, and blocks
    ran uncompiled); the run trains what one eager process trains."""
    shape = dict(n_layer=10, max_iters=4, eval_interval=2, eval_iters=3, log_interval=1, gradient_accumulation_steps=4)
    out, single = str(tmp_path / "compiled"), str(tmp_path / "single")
    args = tiny_args(data_path, out, **shape, zero_stage=3, compile=True, scale_attn_by_inverse_layer_idx=True)
    monkeypatch.setenv("TEST_COMPILE_BACKEND", "aot_eager")  # the ranks inherit the environment
    monkeypatch.setenv("TORCH_LOGS", "recompiles,graph_breaks")
    output = ranks(args)
    recompiles = re.findall(r"Recompiling function (\w+) in (\S+)", output)
    model_py = os.path.join(ROOT, "model.py")
    assert recompiles == [
        ("forward", f"{model_py}:{line_of(Block.forward)}"),
        ("chunk_loss", f"{model_py}:{line_of(chunk_loss)}"),
    ]
    assert "GLOBAL_STATE changed: grad_mode" in output
    assert "recompile_limit" not in output and "Graph break" not in output
    assert in_this_process(tiny_args(data_path, single, **shape, scale_attn_by_inverse_layer_idx=True)) == 0
    assert_close_states(whole(out)["model"], whole(single)["model"])
    assert val_losses(out) == pytest.approx(val_losses(single), abs=1e-5)


def line_of(function):
    """The line of a function's def: what dynamo names when it compiles it."""
    return inspect.getsourcelines(function)[1]


def test_bfloat16_on_cuda_gathers_the_blocks_in_bfloat16_and_reduces_in_float32():
    """The CUDA branch of fsdp.mixed_precision, reached on the CPU: only bfloat16 on CUDA gets a policy (blocks'
    parameters in bfloat16, gradients reduced in float32, inputs left as they are; the root stays float32)."""
    from marsgpt import fsdp

    blocks, root = fsdp.mixed_precision("bfloat16", "cuda")
    assert (blocks.param_dtype, blocks.reduce_dtype, blocks.cast_forward_inputs) == (
        torch.bfloat16,
        torch.float32,
        False,
    )
    assert root.param_dtype is None and root.reduce_dtype == torch.float32
    for dtype, device_type in (("bfloat16", "cpu"), ("float16", "cuda"), ("float32", "cuda")):
        assert fsdp.mixed_precision(dtype, device_type) == (None, None)
