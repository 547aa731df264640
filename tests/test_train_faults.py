"""train.py across processes: kill -9 (also during a save, and before the first checkpoint is complete, under
torchrun with every zero_stage) and resume, SIGTERM (one process, or one rank of a torchrun job), SIGHUP (a lost
terminal; torchrun passing it on) and Ctrl-C during a save, each then resumed; DDP equivalence, dead and hung
ranks.

Every run is a subprocess with one thread (train_helpers.subprocess_env), so runs compare bit for bit.
"""

import contextlib
import fcntl
import json
import os
import pty
import re
import shlex
import shutil
import signal
import subprocess
import sys
import termios
import time

import pytest
import torch
from train_helpers import (
    ROOT,
    kill_job,
    launch,
    start_torchrun,
    started,
    subprocess_env,
    tiny_args,
    torchrun_command,
    wait_for_line,
)

import train
from bench.common import rendezvous
from marsgpt import metrics

pytestmark = pytest.mark.slow

# Dropout on, so the test also covers the dropout masks; checkpoints at 0, 4, 8, 12, 16.
RESUME_RUN = dict(max_iters=16, eval_interval=4, dropout=0.1, log_interval=2)
# Exact MARS: the look-ahead pass goes through DDP too; checkpoints at 0, 3, 6, each kept.
DDP_RUN = dict(max_iters=6, eval_interval=3, is_approx=False, log_interval=1, keep_every_n_evals=1)


def run_to_end(args, env=None, timeout=180):
    proc = launch(args, env=env)
    output, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, output
    return output


def torchrun(args, nproc=2, timeout=240):
    cmd = torchrun_command(args, nproc)
    for _attempt in range(2):
        done = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
        # --standalone picks a free port, which another process on a shared machine can take first
        if done.returncode == 0 or "address already in use" not in done.stderr.lower():
            break
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def final_state(out_dir):
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)
    return ckpt["model"], ckpt["optimizer"]


def losses(out_dir):
    """Every record of metrics.jsonl without its wall-clock fields, and without the record of a stop (which only an
    interrupted run has)."""
    timing = {"time_s", "tokens_per_sec", "step_ms", "mfu"}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k not in timing} for r in records if metrics.STOPPED not in r]


def assert_same_run(out_a, out_b):
    assert losses(out_a) == losses(out_b)
    model_a, optimizer_a = final_state(out_a)
    model_b, optimizer_b = final_state(out_b)
    assert model_a.keys() == model_b.keys()
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)
    for index, state in optimizer_a["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(optimizer_b["state"][index][key])), key


@pytest.fixture(scope="module")
def uninterrupted(data_path, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("uninterrupted"))
    run_to_end(tiny_args(data_path, out, **RESUME_RUN))
    return out


def test_kill_9_during_a_save_and_mid_run_then_resume_ends_identical(data_path, uninterrupted, tmp_path):
    out = str(tmp_path / "out")
    args = tiny_args(data_path, out, **RESUME_RUN)
    # 1. killed while the step-8 checkpoint is written and fsync'ed but not yet renamed over ckpt.pt
    proc = launch(args, env=subprocess_env(TEST_HOLD_SAVE=f"3:{tmp_path / 'never'}"))
    wait_for_line(proc, "renaming")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert any(name.startswith("ckpt.pt.tmp.") for name in os.listdir(out))
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["progress"]["iter_num"] == 4
    # 2. resumed from step 4, killed again between steps, past the checkpoint at 12
    proc = launch(args + ["--init_from=resume"], env=subprocess_env(TEST_FAIL="0:14:hang"))
    wait_for_line(proc, "hanging before step 14")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["progress"]["iter_num"] == 12
    # 3. resumed from step 12 to the end: the same losses, weights and optimizer state as never killed
    run_to_end(args + ["--init_from=resume"])
    assert_same_run(out, uninterrupted)


def test_kill_9_after_a_checkpoint_between_evaluations_resumes_identical(data_path, uninterrupted, tmp_path):
    """checkpoint_interval=3 writes ckpt.pt at 3, 6, 9, 15 between the evaluations at 0, 4, 8, 12, 16: killed
    before step 11, the run resumes from the iter-9 checkpoint and ends as the run left alone (which wrote
    checkpoints at its evaluations only: saving changes nothing in training)."""
    out, pause = str(tmp_path / "out"), str(tmp_path / "pause")
    args = tiny_args(data_path, out, checkpoint_interval=3, **RESUME_RUN)
    proc = launch(args, env=subprocess_env(TEST_PAUSE=f"0:11:{pause}"))
    wait_for_line(proc, "paused before step 11")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["progress"]["iter_num"] == 9
    output = run_to_end(args + ["--init_from=auto"])
    assert f"resuming {os.path.join(out, 'ckpt.pt')} at iter 9" in output
    assert_same_run(out, uninterrupted)


def test_the_checkpoint_clock_writes_between_evaluations(data_path, tmp_path):
    """checkpoint_minutes (here so small that every step boundary is due) saves where no evaluation is."""
    out, pause = str(tmp_path / "out"), str(tmp_path / "pause")
    args = tiny_args(data_path, out, max_iters=12, eval_interval=12, checkpoint_minutes=1e-9)
    proc = launch(args, env=subprocess_env(TEST_PAUSE=f"0:9:{pause}"))
    wait_for_line(proc, "paused before step 9")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["progress"]["iter_num"] in (8, 9)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_a_signal_finishes_the_step_writes_a_checkpoint_and_the_run_resumes_identical(
    data_path, uninterrupted, tmp_path, name
):
    """SIGTERM (a preemption) or SIGUSR1 (the SLURM example's warning) while step 10 is about to run: the step
    runs, ckpt.pt gets iter 11 (between the evaluations at 8 and 12), the run exits 0 with one line saying so,
    and the same command continues to the very end the run left alone reaches."""
    out, pause = str(tmp_path / "out"), str(tmp_path / "pause")
    args = tiny_args(data_path, out, **RESUME_RUN)
    proc = launch(args + ["--init_from=auto"], env=subprocess_env(TEST_PAUSE=f"0:10:{pause}"))
    wait_for_line(proc, "paused before step 10")
    proc.send_signal(getattr(signal, name))
    open(f"{pause}.10", "w").close()
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    ckpt = os.path.join(out, "ckpt.pt")
    assert (
        output.splitlines()[-1] == f"stopped by {name} after iter 11: {ckpt} holds it; run the same command to continue"
    )
    assert "Traceback" not in output and "iter 12:" not in output
    assert torch.load(ckpt, weights_only=True)["progress"]["iter_num"] == 11
    run_to_end(args + ["--init_from=auto"])
    assert_same_run(out, uninterrupted)


def test_a_fresh_run_stopped_by_sigterm_prints_the_command_that_continues_it(data_path, uninterrupted, tmp_path):
    """`python train.py ...` without --init_from starts fresh, so running it again would be refused: a SIGTERM
    stop prints the command that continues instead (--overwrite=True left out: it would delete the run), and
    that command, run as printed, ends as the run left alone."""
    out, pause = str(tmp_path / "out"), str(tmp_path / "pause")
    args = tiny_args(data_path, out, **RESUME_RUN) + ["--overwrite=True"]
    proc = launch(args, env=subprocess_env(TEST_PAUSE=f"0:10:{pause}"))
    wait_for_line(proc, "paused before step 10")
    proc.send_signal(signal.SIGTERM)
    open(f"{pause}.10", "w").close()
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    stop, _, command = output.splitlines()[-1].partition("; continue with: ")
    assert stop == f"stopped by SIGTERM after iter 11: {os.path.join(out, 'ckpt.pt')} holds it"
    assert command == shlex.join(["python", "train.py", *args[:-1], "--init_from=resume"])
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])  # `python`: this interpreter
    done = subprocess.run(shlex.split(command), cwd=ROOT, env=subprocess_env(PATH=path), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resuming {os.path.join(out, 'ckpt.pt')} at iter 11" in done.stdout
    assert_same_run(out, uninterrupted)


def test_a_wait_for_a_line_that_never_comes_fails_at_its_deadline():
    """wait_for_line's deadline holds although the process prints nothing more (the read would block for ever):
    the process is killed at the deadline and the test fails saying what it saw, instead of hanging the suite (a
    Ctrl-C that reached no one did, under a shell's background job)."""
    code = "import time; print('first', flush=True); time.sleep(600)"
    proc = started(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True))
    begun = time.monotonic()
    with pytest.raises(AssertionError, match="no line starting with 'second' within 1 s in:\nfirst"):
        wait_for_line(proc, "second", timeout=1)
    assert time.monotonic() - begun < 30 and proc.wait(timeout=30) == -signal.SIGKILL


def test_ctrl_c_is_one_line_exit_130_and_the_run_resumes_identical(data_path, uninterrupted, tmp_path):
    out = str(tmp_path / "out")
    args = tiny_args(data_path, out, **RESUME_RUN)
    proc = launch(args, env=subprocess_env(TEST_FAIL="0:10:hang"))
    wait_for_line(proc, "hanging before step 10")
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert f"interrupted at iter 10; resume from {os.path.join(out, 'ckpt.pt')}" in output
    assert "Traceback" not in output
    stop = [r for r in metrics.read_records(out) if metrics.STOPPED in r]  # the line stays with the run too
    assert [(r["iter"], r[metrics.STOPPED]) for r in stop] == [(10, output.strip().splitlines()[-1])]
    run_to_end(args + ["--init_from=resume"])
    assert_same_run(out, uninterrupted)


def test_ctrl_c_during_a_save_waits_for_it_and_the_run_resumes_from_it(data_path, uninterrupted, tmp_path):
    """Ctrl-C while the iter-8 checkpoint is being written (held just before its rename): the run stops at once,
    says it waits for that checkpoint, and ends (130) only once it is on disk; the same command continues from it
    to the end the run left alone reaches."""
    out, release = str(tmp_path / "out"), str(tmp_path / "release")
    args = tiny_args(data_path, out, **RESUME_RUN)
    # held at its rename, and the run held before step 9, so no later save is due when the Ctrl-C comes
    proc = launch(args, env=subprocess_env(TEST_HOLD_SAVE=f"3:{release}", TEST_FAIL="0:9:hang"))
    seen = wait_for_line(proc, "renaming")
    seen += wait_for_line(proc, "hanging before step 9")
    proc.send_signal(signal.SIGINT)
    seen += wait_for_line(proc, "interrupted: waiting for the checkpoint of iter 8 to reach the disk")
    open(release, "w").close()
    output = seen + proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, output
    ckpt = os.path.join(out, "ckpt.pt")
    assert re.search(rf"^interrupted at iter \d+; resume from {re.escape(ckpt)} \(iter 8\)", output, re.M), output
    assert "Traceback" not in output and torch.load(ckpt, weights_only=True)["progress"]["iter_num"] == 8
    output = run_to_end(args + ["--init_from=auto"])
    assert f"resuming {ckpt} at iter 8" in output
    assert_same_run(out, uninterrupted)


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_while_the_next_save_waits_for_a_slow_one_keeps_the_next_one(
    data_path, uninterrupted, tmp_path, presses
):
    """Storage slower than the checkpoints (fsync taking seconds on a loaded network file system): the iter-4 save
    is still being written when iter 8's is due, and the run waits for it. Ctrl-C then (once, or twice 0.3 s apart)
    printed that it waited for the checkpoint in flight, then "resume from ckpt.pt (iter 4)": the iter-8 state was
    dropped. Now the interrupt waits until iter 8's state is handed to the writer, the way out waits for it to reach
    the disk, and the run ends (130) naming iter 8, which the same command continues to the uninterrupted end."""
    out, release = str(tmp_path / "out"), str(tmp_path / "release")
    args = tiny_args(data_path, out, **RESUME_RUN)
    proc = launch(args, env=subprocess_env(TEST_HOLD_SAVE=f"2:{release}"))
    seen = wait_for_line(proc, "waiting on the held save")
    for press in range(presses):
        time.sleep(0.3 * press)
        proc.send_signal(signal.SIGINT)
    seen += wait_for_line(proc, "interrupted: handing the checkpoint of iter 8 to the disk first")
    if presses == 2:
        seen += wait_for_line(proc, "SIGINT again: still finishing")
    open(release, "w").close()
    output = seen + proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, output
    ckpt = os.path.join(out, "ckpt.pt")
    assert "interrupted: waiting for the checkpoint of iter 8 to reach the disk" in output, output
    assert re.search(rf"^interrupted at iter 8; resume from {re.escape(ckpt)} \(iter 8\)", output, re.M), output
    assert "Traceback" not in output and torch.load(ckpt, weights_only=True)["progress"]["iter_num"] == 8
    output = run_to_end(args + ["--init_from=auto"])
    assert f"resuming {ckpt} at iter 8" in output
    assert_same_run(out, uninterrupted)


def test_a_third_ctrl_c_quits_at_once_and_the_next_launch_resumes_the_last_checkpoint_on_disk(
    data_path, uninterrupted, tmp_path
):
    out, never = str(tmp_path / "out"), str(tmp_path / "never")
    args = tiny_args(data_path, out, **RESUME_RUN)
    proc = launch(args, env=subprocess_env(TEST_HOLD_SAVE=f"3:{never}"))  # iter 8's save never lands
    seen = wait_for_line(proc, "renaming")
    for _press in range(3):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
    output = seen + proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, output
    assert "SIGINT a third time: quitting at once; a checkpoint in flight is lost" in output, output
    output = run_to_end(args + ["--init_from=auto"])
    assert f"resuming {os.path.join(out, 'ckpt.pt')} at iter 4" in output  # iter 8's was never renamed into place
    assert_same_run(out, uninterrupted)


@pytest.mark.parametrize("spacing", ["0.05 s", "once out_dir is released"])
def test_two_sigterms_stop_the_run_with_a_checkpoint_and_exit_0(data_path, uninterrupted, tmp_path, spacing):
    """A scheduler and a user, or a preemption notice sent twice: the second SIGTERM is answered with a line and the
    run still ends as the first asked, exit 0 -- also when it lands as the process ends, after the run released
    out_dir (it used to meet the default handler put back as the run closed: exit 143)."""
    out = str(tmp_path / "out")
    args = tiny_args(data_path, out, **RESUME_RUN)
    proc = launch(args, env=subprocess_env(TEST_PAUSE=f"0:5:{tmp_path / 'never'}"))
    seen = wait_for_line(proc, "paused before step 5")
    proc.send_signal(signal.SIGTERM)
    if spacing == "0.05 s":
        time.sleep(0.05)
    else:
        while os.path.exists(os.path.join(out, "run.lock")):
            time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    output = seen + proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    assert output.count("stopped by SIGTERM after iter ") == 1 and "Traceback" not in output, output
    run_to_end(args + ["--init_from=resume"])
    assert_same_run(out, uninterrupted)


def test_ctrl_c_through_2_to_1_tee_still_shows_where_the_run_continues(data_path, tmp_path):
    """`python train.py ... 2>&1 | tee log` in a terminal: Ctrl-C reaches tee too, which ends first, so the line
    saying where the run continues went into a closed pipe and was never seen. It goes to the terminal instead
    (and into metrics.jsonl), and the run still ends with 130."""
    out = str(tmp_path / "out")
    args = tiny_args(data_path, out, **RESUME_RUN)
    command = f"{shlex.join([sys.executable, 'tests/train_helpers.py', *args])} 2>&1 | tee {tmp_path / 'log'}"
    pid, fd = pty.fork()
    if pid == 0:  # a shell in a terminal of its own, as a user's
        os.chdir(ROOT)
        os.environ.update(subprocess_env(TEST_FAIL="0:10:hang"))
        os.execvp("bash", ["bash", "-c", command + "; exit ${PIPESTATUS[0]}"])
    try:
        read_until(fd, "hanging before step 10")
        os.write(fd, b"\x03")  # Ctrl-C, typed
        seen = b""
        with contextlib.suppress(OSError):  # EIO once every process on the terminal has ended
            while chunk := os.read(fd, 4096):
                seen += chunk
        seen = seen.decode(errors="replace")
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 130, seen
    assert f"interrupted at iter 10; resume from {os.path.join(out, 'ckpt.pt')} (iter 8)" in seen
    assert any(metrics.STOPPED in r for r in metrics.read_records(out))


def read_until(fd, text):
    """Read the pseudo-terminal `fd` until `text` has appeared; everything read."""
    seen = b""
    while text.encode() not in seen:
        chunk = os.read(fd, 4096)
        assert chunk, seen.decode(errors="replace")
        seen += chunk
    return seen.decode(errors="replace")


def a_terminal_session():
    """In the started process: run_side its controlling terminal, and SIGHUP as a login shell leaves it (a test
    session under nohup ignores SIGHUP, which its processes would inherit)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_an_ssh_session_that_drops_stops_the_run_at_a_checkpoint_which_resumes_identical(
    data_path, uninterrupted, tmp_path
):
    """The run's terminal goes away (an ssh connection drops: here the pseudo-terminal the run has as its
    controlling terminal is closed): the kernel sends SIGHUP, writes to the terminal fail from then on, and the
    run -- paused before step 10 -- still does as for SIGTERM: the step, a checkpoint (iter 11), exit 0. The same
    command continues to the end the run left alone reaches. (Before, SIGHUP killed it at once.)"""
    out, pause = str(tmp_path / "out"), str(tmp_path / "pause")
    args = tiny_args(data_path, out, **RESUME_RUN) + ["--init_from=auto"]
    terminal, run_side = pty.openpty()
    proc = started(  # killed when the test ends, should it fail while the run is paused
        subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "train_helpers.py"), *args],
            cwd=ROOT,
            env=subprocess_env(TEST_PAUSE=f"0:10:{pause}"),
            stdin=run_side,
            stdout=run_side,
            stderr=run_side,
            start_new_session=True,  # a session of its own, whose controlling terminal run_side becomes
            preexec_fn=a_terminal_session,
        )
    )
    os.close(run_side)
    try:
        read_until(terminal, "paused before step 10")
    finally:
        os.close(terminal)  # the hang-up
    assert proc.wait(timeout=120) == 0
    ckpt = os.path.join(out, "ckpt.pt")
    assert torch.load(ckpt, weights_only=True)["progress"]["iter_num"] == 11
    run_to_end(args)
    assert_same_run(out, uninterrupted)


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_a_job_killed_before_its_first_checkpoint_is_complete_starts_over_with_the_same_command(
    data_path, tmp_path, zero_stage
):
    """kill -9 of the whole torchrun job while rank 0 renames its first checkpoint into place -- the ranks have
    trained on and logged steps past 0 meanwhile (a large model's first save takes minutes) -- leaves metrics
    without a checkpoint: the same command starts the run over, says that nothing was saved, and trains it to
    the end with every step recorded once. (Before, it was refused: "holds metrics.jsonl but no ckpt.pt".)"""
    out = str(tmp_path / "out")
    args = tiny_args(data_path, out, gradient_accumulation_steps=4, zero_stage=zero_stage, **DDP_RUN)
    proc = start_torchrun(args, TEST_HOLD_SAVE=f"1:{tmp_path / 'never'}")
    try:
        wait_for_line(proc, "renaming", timeout=240)
        wait_for_line(proc, "iter 2:")
    finally:
        kill_job(proc)
    assert not os.path.exists(os.path.join(out, "ckpt.pt")) and "ckpt.pt" not in os.listdir(out)
    output = torchrun(args)
    assert f"out_dir {out} holds a run stopped before its first checkpoint was complete" in output, output
    assert "nothing was saved, so it starts over" in output
    records = metrics.read_records(out)
    assert [r["iter"] for r in records if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["iter"] for r in records if "val/loss" in r] == [0, 3, 6]
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["progress"]["iter_num"] == 6


def test_a_run_killed_before_its_first_checkpoint_is_complete_starts_over_identical(data_path, uninterrupted, tmp_path):
    """One process: killed during its first save with steps logged past 0, then the same command (no
    --init_from: the default, scratch) ends as the run left alone."""
    out = str(tmp_path / "out")
    args = tiny_args(data_path, out, **RESUME_RUN)
    proc = launch(args, env=subprocess_env(TEST_HOLD_SAVE=f"1:{tmp_path / 'never'}"))
    wait_for_line(proc, "renaming")
    wait_for_line(proc, "iter 4:")
    proc.kill()
    proc.wait()
    output = run_to_end(args)
    assert "nothing was saved, so it starts over" in output and f"removed {out}/ckpt.pt.tmp.{proc.pid}" in output
    assert_same_run(out, uninterrupted)


def ddp_and_single_runs(data_path, root, gradient_accumulation_steps):
    """(out_dir of 2 ranks under torchrun, out_dir of 1 process in this one) for the same run."""
    args = dict(DDP_RUN, gradient_accumulation_steps=gradient_accumulation_steps)
    ddp, single = str(root / "ddp"), str(root / "single")
    output = torchrun(tiny_args(data_path, ddp, **args))
    per_rank = gradient_accumulation_steps // 2
    micro_batches = "1 micro-batch" if per_rank == 1 else f"{per_rank} micro-batches"
    assert f"world size 2 on cpu; {micro_batches} per rank per step" in output
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train.main(tiny_args(data_path, single, **args)) == 0
    finally:
        torch.set_num_threads(threads)
    return ddp, single


@pytest.fixture(scope="module")
def ddp_run(data_path, tmp_path_factory):
    """2 ranks x 2 micro-batches: the gradients synchronise in the second backward only (no_sync)."""
    return ddp_and_single_runs(data_path, tmp_path_factory.mktemp("ddp4"), 4)


def assert_close_runs(out_a, out_b):
    """The same windows; only the order of float additions differs."""
    model_a, optimizer_a = final_state(out_a)
    model_b, _ = final_state(out_b)
    for key in model_b:
        torch.testing.assert_close(model_a[key], model_b[key], rtol=1e-5, atol=1e-6, msg=key)
    assert any("last_grad" in s for s in optimizer_a["state"].values())  # exact MARS ran
    val_a = [r["val/loss"] for r in losses(out_a) if "val/loss" in r]
    val_b = [r["val/loss"] for r in losses(out_b) if "val/loss" in r]
    assert val_a == pytest.approx(val_b, abs=1e-5)


def test_two_ranks_train_the_same_model_as_one_process(ddp_run):
    assert_close_runs(*ddp_run)


def test_two_ranks_one_micro_batch_each_train_the_same_model_as_one_process(data_path, tmp_path):
    assert_close_runs(*ddp_and_single_runs(data_path, tmp_path, 2))


@pytest.fixture(scope="module")
def sharded_run(data_path, tmp_path_factory):
    """ddp_run's 2-rank run with ZeRO-1 and activation checkpointing."""
    out = str(tmp_path_factory.mktemp("sharded"))
    args = dict(DDP_RUN, gradient_accumulation_steps=4, zero_stage=1, activation_checkpointing=True)
    output = torchrun(tiny_args(data_path, out, **args))
    assert "ZeRO-1 over 2 GPUs" in output and "activation checkpointing on" in output
    return out


def test_sharded_ddp_trains_and_saves_bit_for_bit_what_plain_ddp_does(sharded_run, ddp_run):
    """Each parameter's update is computed on one rank from the same all-reduced gradient, and the checkpoint
    holds the whole state in the unsharded format: the same losses, weights and optimizer state. (MARS's
    momentum norms are summed over the ranks' shares: equal up to float rounding.)"""
    model_a, optimizer_a = final_state(sharded_run)
    model_b, optimizer_b = final_state(ddp_run[0])
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_b)
    assert optimizer_a["param_groups"] == optimizer_b["param_groups"]
    assert optimizer_a["state"].keys() == optimizer_b["state"].keys()
    for index, state in optimizer_b["state"].items():
        assert state.keys() == optimizer_a["state"][index].keys()
        assert all(
            torch.equal(torch.as_tensor(v), torch.as_tensor(optimizer_a["state"][index][k])) for k, v in state.items()
        )
    momentum = {metrics.MOMENTUM_NORM, metrics.MOMENTUM_NORM_SQ, metrics.MOMENTUM_DIV}
    for a, b in zip(losses(sharded_run), losses(ddp_run[0]), strict=True):
        assert {k: v for k, v in a.items() if k not in momentum} == {k: v for k, v in b.items() if k not in momentum}
        assert [a[k] for k in momentum & a.keys()] == pytest.approx([b[k] for k in momentum & a.keys()], rel=1e-6)


def resume_from(data_path, checkpoint_file, out, launch):
    """Resume `checkpoint_file` (a kept step-3 checkpoint) to the end in a fresh out_dir, one process or torchrun."""
    os.makedirs(out)
    shutil.copyfile(checkpoint_file, os.path.join(out, "ckpt.pt"))
    args = tiny_args(data_path, out, gradient_accumulation_steps=4, **DDP_RUN) + ["--init_from=resume"]
    if launch == "torchrun":
        torchrun(args + ["--zero_stage=1"])
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train.main(args) == 0
    finally:
        torch.set_num_threads(threads)


def test_a_sharded_checkpoint_resumes_in_one_process_and_a_one_process_one_sharded(
    data_path, sharded_run, ddp_run, tmp_path
):
    """Both end where the run they came from ends, up to the float rounding of 1 process against 2 ranks."""
    resume_from(data_path, os.path.join(sharded_run, "ckpt_0000003.pt"), str(tmp_path / "one"), "python")
    resume_from(data_path, os.path.join(ddp_run[1], "ckpt_0000003.pt"), str(tmp_path / "sharded"), "torchrun")
    for resumed, original in ((tmp_path / "one", sharded_run), (tmp_path / "sharded", ddp_run[1])):
        model_a, _ = final_state(str(resumed))
        model_b, _ = final_state(original)
        for key in model_b:
            torch.testing.assert_close(model_a[key], model_b[key], rtol=1e-5, atol=1e-6, msg=key)


def launch_ranks(rendezvous_env, args, fail, timeout_s, unreadable=""):
    """Two gloo ranks started by hand (no torchrun agent to clean up after them), meeting at the store of
    bench.common.rendezvous (keep it open until they end); `fail` as TEST_FAIL, `unreadable` as TEST_UNREADABLE."""
    return [
        launch(
            args + [f"--ddp_timeout_s={timeout_s}"],
            env=subprocess_env(
                **rendezvous_env,
                WORLD_SIZE="2",
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                TEST_FAIL=fail,
                TEST_UNREADABLE=unreadable,
            ),
        )
        for rank in range(2)
    ]


def test_a_dead_rank_ends_the_job_which_then_resumes(data_path, ddp_run, tmp_path):
    out = str(tmp_path / "out")
    args = tiny_args(data_path, out, gradient_accumulation_steps=4, **DDP_RUN)
    with rendezvous() as env:
        procs = launch_ranks(env, args, fail="1:4:raise", timeout_s=60)
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert all(proc.returncode != 0 for proc in procs), outputs
    assert "injected failure on rank 1 at step 4" in outputs[1]
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["progress"]["iter_num"] == 3
    with rendezvous() as env:
        procs = launch_ranks(env, args + ["--init_from=resume"], fail="", timeout_s=60)
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outputs
    assert_same_run(out, ddp_run[0])


def test_sigterm_to_one_rank_stops_every_rank_at_one_checkpoint_and_the_job_resumes_identical(
    data_path, ddp_run, tmp_path
):
    """Under torchrun a signal that reaches one rank is enough: the ranks agree on it with the step's own
    read, all take part in one checkpoint (iter 5, between the evaluations at 3 and 6), and exit 0 -- torchrun
    too, with no traceback. Resumed under torchrun, the job ends where the job left alone ends."""
    out, pause = str(tmp_path / "out"), str(tmp_path / "pause")
    args = tiny_args(data_path, out, gradient_accumulation_steps=4, **DDP_RUN) + ["--init_from=auto"]
    proc = start_torchrun(args, TEST_PAUSE=f"1:4:{pause}")
    try:
        seen = wait_for_line(proc, "paused before step 4", timeout=240)
        rank_1 = int(seen.rsplit("(pid ", 1)[1].split(")")[0])
        os.kill(rank_1, signal.SIGTERM)
        open(f"{pause}.4", "w").close()
        output = seen + proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            kill_job(proc)  # the agent and its ranks (each in a session of its own)
    assert proc.returncode == 0, output
    ckpt = os.path.join(out, "ckpt.pt")
    assert f"stopped by SIGTERM after iter 5: {ckpt} holds it; run the same command to continue" in output
    assert output.count("stopped by SIGTERM") == 1 and "Traceback" not in output and "iter 6:" not in output
    assert torch.load(ckpt, weights_only=True)["progress"]["iter_num"] == 5
    torchrun(args)
    assert_same_run(out, ddp_run[0])


def test_sighup_to_torchrun_stops_every_rank_at_one_checkpoint_and_the_job_resumes_identical(
    data_path, ddp_run, tmp_path
):
    """The ssh session of a torchrun job drops: torchrun gets SIGHUP and passes it on to each rank (they run in
    sessions of their own), which stop as for SIGTERM -- rank 1 was paused before step 4: the step, one
    checkpoint after iter 5 -- and exit 0 (torchrun itself ends with its SignalException). The same command
    then ends where the job left alone ends."""
    out, pause = str(tmp_path / "out"), str(tmp_path / "pause")
    args = tiny_args(data_path, out, gradient_accumulation_steps=4, **DDP_RUN) + ["--init_from=auto"]
    proc = start_torchrun(args, TEST_PAUSE=f"1:4:{pause}")
    try:
        seen = wait_for_line(proc, "paused before step 4", timeout=240)
        proc.send_signal(signal.SIGHUP)
        output = seen + proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            kill_job(proc)
    ckpt = os.path.join(out, "ckpt.pt")
    assert f"stopped by SIGHUP after iter 5: {ckpt} holds it; run the same command to continue" in output, output
    assert "SignalException" in output and "iter 6:" not in output  # torchrun's own report of the SIGHUP
    assert torch.load(ckpt, weights_only=True)["progress"]["iter_num"] == 5
    torchrun(args)
    assert_same_run(out, ddp_run[0])


def test_a_hung_rank_times_out_instead_of_hanging(data_path, tmp_path):
    out = str(tmp_path / "out")
    with rendezvous() as env:
        rank0, rank1 = launch_ranks(env, tiny_args(data_path, out, **DDP_RUN), fail="1:2:hang", timeout_s=5)
        try:
            output = rank0.communicate(timeout=90)[0]
            assert rank0.returncode == 1, output
            assert "error: rank 0: a collective timed out after ddp_timeout_s=5 s" in output, output
        finally:
            rank1.kill()
            rank1.communicate()


def gpt2_token_data(root):
    """A GPT-2-tokenized dataset 'bpe' (no meta.pkl) and a one-example HellaSwag file under root."""
    from marsgpt.tokens import write_bin

    os.makedirs(os.path.join(root, "bpe"))
    ids = torch.randint(0, 50257, (4000,), generator=torch.Generator().manual_seed(0)).numpy()
    write_bin(os.path.join(root, "bpe", "train.bin"), ids)
    write_bin(os.path.join(root, "bpe", "val.bin"), ids[:1000])
    example = dict(ctx="A man is sitting on a roof. He", label=1, endings=["waves.", "falls.", "sings.", "naps."])
    path = os.path.join(root, "hellaswag.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps(example) + "\n")
    return path


@pytest.mark.parametrize("what", ["checkpoint", "hellaswag"])
def test_a_file_one_rank_cannot_read_stops_every_rank_at_once(data_path, tmp_path, what):
    """Setup decisions are agreed: when rank 1 cannot see a file rank 0 reads (a node without the shared
    file system), both ranks exit with the same one-line error long before the collective timeout."""
    out = str(tmp_path / "out")
    if what == "checkpoint":
        assert train.main(tiny_args(data_path, out, **dict(DDP_RUN, max_iters=3))) == 0
        args = tiny_args(data_path, out, gradient_accumulation_steps=4, **DDP_RUN) + ["--init_from=resume"]
        hidden, message = os.path.join(out, "ckpt.pt"), f"error: rank 1: no checkpoint at {out}/ckpt.pt"
    else:
        hidden = gpt2_token_data(str(tmp_path))
        args = tiny_args(str(tmp_path), out, dataset="bpe", n_embd=32, max_iters=2, eval_interval=2)
        args += ["--hellaswag_interval=2", f"--hellaswag_path={hidden}", "--gradient_accumulation_steps=2"]
        message = "error: rank 1: [Errno 2] No such file or directory"
    with rendezvous() as env:
        procs = launch_ranks(env, args, fail="", timeout_s=600, unreadable=f"1:{hidden}")
        outputs = [proc.communicate(timeout=240)[0] for proc in procs]  # 600 s would mean a hang
    assert all(proc.returncode == 2 for proc in procs), outputs
    assert message in outputs[0] and "Traceback" not in "".join(outputs), outputs
