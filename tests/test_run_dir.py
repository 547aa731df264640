"""marsgpt/run_dir.py through train.py's command line: what survives what in out_dir.

Each numbered point of the issue ("Nothing a run has written is lost") has its test here or in
tests/test_train_faults.py (signals, kill -9 and torchrun): an init_from=auto relaunch never starts over on a
run's files (1), one launch per out_dir (2), copies independent of ckpt.pt (3), checksums (4), divergence
(5), failed writes on a tmpfs that fills (7), meta.pkl read as data (8), and the smaller items (9). Issue 38
("every way a run can stop leaves a directory the same command continues") adds: launches at the same moment
and full disks that name the holder or leave no lock, copies of a live run, what a run trains on (the data's
fingerprint), and metrics.jsonl as a crash leaves it; its kill -9, Ctrl-C and SIGHUP tests are in
tests/test_train_faults.py and tests/test_fsdp.py.
"""

import json
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
import zipfile

import numpy as np
import pytest
import torch
from train_helpers import (
    ROOT,
    diverging_from,
    fill,
    launch,
    make_char_data,
    subprocess_env,
    tiny_args,
    tmpfs,
    wait_for_line,
)

import sample
import train
from bench.common import rendezvous
from marsgpt import checkpoint, export_hf, hellaswag, metrics, run_dir, run_lock, shards, tokens
from marsgpt.tokens import TokenData, write_meta, write_shard

pytestmark = pytest.mark.usefixtures("one_thread")


def run(argv, capsys):
    """train.main(argv) in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    status = train.main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def records(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def file_bytes(out_dir):
    return {name: open(os.path.join(out_dir, name), "rb").read() for name in sorted(os.listdir(out_dir))}


def iteration_of(path):
    return shards.load_checkpoint(path)["progress"]["iter_num"]


def one_error_line(err, *parts):
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for part in parts:
        assert part in err, err


def flip_bytes_inside_a_tensor(path, count=16):
    """Invert `count` bytes in the middle of the first tensor a checkpoint stores (the model's first weight);
    the zip archive around it stays intact, so only a checksum can tell."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(next(n for n in archive.namelist() if n.endswith("/data/0")))
    with open(path, "r+b") as f:
        f.seek(info.header_offset)
        name_length, extra_length = struct.unpack("<HH", f.read(30)[26:30])
        offset = info.header_offset + 30 + name_length + extra_length + info.file_size // 2
        f.seek(offset)
        original = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in original))


@pytest.fixture
def start():
    """launch() for the test, whose processes are killed when it ends (a failed test leaves none paused)."""
    procs = []

    def start_process(args, **env):
        procs.append(launch(args, env=subprocess_env(**env)))
        return procs[-1]

    yield start_process
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture
def finished_run(data_path, tmp_path, capsys):
    """A run of 10 steps with evaluations at 0, 5, 10, each kept: ckpt.pt, best.pt, ckpt_0000005.pt, ckpt_0000010.pt."""
    out = str(tmp_path / "out")
    args = tiny_args(data_path, out, max_iters=10, eval_interval=5, keep_every_n_evals=1)
    assert run(args, capsys)[0] == 0
    return out, args


# ---------------------------------------------------------------------------------------------------
# 1. init_from=auto never starts over on top of a run.


def test_auto_resumes_the_newest_intact_copy_when_ckpt_pt_is_deleted_and_keeps_every_file(finished_run, capsys):
    out, args = finished_run
    os.remove(os.path.join(out, "ckpt.pt"))
    before = file_bytes(out)
    status, printed, _ = run(args + ["--init_from=auto"], capsys)
    assert status == 0
    assert f"{out}/ckpt.pt is missing; resuming the newest intact checkpoint instead" in printed
    assert "at iter 10" in printed and "nothing to train" in printed
    after = file_bytes(out)
    assert {name: after[name] for name in before} == before  # metrics, best.pt and the kept copies as they were
    status, printed, _ = run(args[:-1] + ["--max_iters=12", "--init_from=auto"], capsys)  # and it continues
    assert status == 0 and [r["iter"] for r in records(out) if "val/loss" in r] == [0, 5, 10, 12]


def test_auto_refuses_when_no_checkpoint_is_intact_and_changes_nothing(finished_run, capsys):
    out, args = finished_run
    for name in ("ckpt.pt", "best.pt", "ckpt_0000005.pt", "ckpt_0000010.pt"):
        os.truncate(os.path.join(out, name), 1000)
    before = file_bytes(out)
    status, printed, err = run(args + ["--init_from=auto"], capsys)
    assert status == 2 and printed == ""
    one_error_line(err, f"out_dir {out} holds no intact checkpoint", "--overwrite=True")
    assert file_bytes(out) == before


def test_auto_starts_over_only_on_a_run_stopped_before_its_first_checkpoint(data_path, tmp_path, capsys):
    out = str(tmp_path / "out")
    os.makedirs(out)
    stopped = {"iter": 0, "tokens": 0, "time_s": 1.0, "val/loss": 3.4}
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write(json.dumps(stopped) + "\n")
    args = tiny_args(data_path, out, max_iters=2, eval_interval=2, init_from="auto")
    assert run(args, capsys)[0] == 0  # what a new run writes again
    os.remove(os.path.join(out, "ckpt.pt"))
    os.remove(os.path.join(out, "best.pt"))
    before = file_bytes(out)  # metrics up to iter 2, no checkpoint: a run's records, not to be replaced
    status, _, err = run(args, capsys)
    assert status == 2
    one_error_line(err, "holds metrics.jsonl but no ckpt.pt to resume")
    assert file_bytes(out) == before


# ---------------------------------------------------------------------------------------------------
# 2. One run per out_dir.


def release(pause, iteration):
    open(f"{pause}.{iteration}", "w").close()


@pytest.mark.slow
def test_a_second_launch_is_refused_while_a_run_holds_out_dir_and_a_dead_run_s_lock_is_taken_over(
    data_path, tmp_path, start
):
    out, pause = str(tmp_path / "out"), str(tmp_path / "pause")
    args = tiny_args(data_path, out, max_iters=6, eval_interval=3)
    first = start(args + ["--init_from=auto"], TEST_PAUSE=f"0:4:{pause}")
    wait_for_line(first, "paused before step 4")
    before = file_bytes(out)
    second = start(args + ["--init_from=auto", "--learning_rate=0.1"])
    output, _ = second.communicate(timeout=120)
    assert second.returncode == 2, output
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    assert lines == [
        f"error: out_dir {out} is in use by the run of pid {first.pid} on {socket.gethostname()} since "
        + lines[0].split(" since ")[1]
    ], output
    assert "wait for it to end or stop it, or use another --out_dir" in lines[0]
    assert file_bytes(out) == before  # the refused launch wrote nothing
    release(pause, 4)
    output, _ = first.communicate(timeout=120)
    assert first.returncode == 0, output
    assert shards.load_checkpoint(out)["config"]["learning_rate"] == 3e-3  # the first run's, to the end
    assert not os.path.exists(os.path.join(out, "run.lock"))

    # a run killed with kill -9 leaves its lock; the next launch on this machine takes it over
    third = start(args + ["--init_from=auto", "--max_iters=9"], TEST_PAUSE=f"0:7:{pause}")
    wait_for_line(third, "paused before step 7")
    third.kill()
    third.wait()
    assert json.load(open(os.path.join(out, "run.lock")))["pid"] == third.pid
    fourth = start(args + ["--init_from=auto", "--max_iters=9"])
    output, _ = fourth.communicate(timeout=120)
    assert fourth.returncode == 0, output
    assert f"took over the lock of pid {third.pid} on {socket.gethostname()}" in output
    assert "its process is gone" in output and iteration_of(out) == 9


def foreign_lock(out, age_s, pid=4242):
    """A lock as a run on another machine writes it, last refreshed `age_s` seconds ago."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "run.lock")
    holder = dict(host="node-elsewhere", machine="other-boot/1", pid=pid, process_start=1, since=time.time() - 3600)
    with open(path, "w") as f:
        json.dump(dict(holder, token="theirs"), f)
    os.utime(path, (time.time() - age_s,) * 2)
    return path


@pytest.mark.slow
def test_a_lock_from_another_machine_is_judged_by_its_heartbeat(data_path, tmp_path, capsys):
    """Across nodes a pid says nothing: a lock whose heartbeat stopped longer than lock_timeout_s ago is taken
    over at once; a younger one is watched, and refused when it moves."""
    out = str(tmp_path / "out")
    args = tiny_args(data_path, out, max_iters=2, eval_interval=2, lock_timeout_s=10)
    foreign_lock(out, age_s=3600)
    status, printed, _ = run(args, capsys)
    assert status == 0
    assert "took over the lock of pid 4242 on node-elsewhere since" in printed and "its heartbeat stopped" in printed

    lock = foreign_lock(str(tmp_path / "live"), age_s=0)
    beating = threading.Event()

    def heartbeat():  # the holder on the other machine, alive
        while not beating.wait(0.2):
            os.utime(lock)

    thread = threading.Thread(target=heartbeat)
    thread.start()
    try:
        status, printed, err = run(tiny_args(data_path, str(tmp_path / "live"), max_iters=2, lock_timeout_s=10), capsys)
    finally:
        beating.set()
        thread.join()
    assert status == 2 and "watching for" in printed
    one_error_line(err, "is in use by the run of pid 4242 on node-elsewhere")
    assert json.load(open(lock))["token"] == "theirs"

    foreign_lock(str(tmp_path / "dead"), age_s=8)  # silent: taken over once it is 10 s old
    status, printed, _ = run(tiny_args(data_path, str(tmp_path / "dead"), max_iters=2, lock_timeout_s=10), capsys)
    assert status == 0 and "its heartbeat stopped for lock_timeout_s=10 s" in printed


@pytest.mark.slow
def test_under_ddp_rank_0_holds_the_lock_and_every_rank_learns_the_refusal(data_path, tmp_path):
    """The test process plays the live holder: both ranks exit 2 at once, rank 0 saying why in one line."""
    from test_train_faults import launch_ranks

    out = str(tmp_path / "out")
    os.makedirs(out)
    holder = dict(
        host=socket.gethostname(),
        machine=run_lock._machine(),
        pid=os.getpid(),
        process_start=run_lock._process_start(os.getpid()),
        since=time.time(),
        token="mine",
    )
    with open(os.path.join(out, "run.lock"), "w") as f:
        json.dump(holder, f)
    with rendezvous() as env:
        procs = launch_ranks(
            env, tiny_args(data_path, out, max_iters=2, gradient_accumulation_steps=4), fail="", timeout_s=120
        )
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [2, 2], outputs
    assert f"is in use by the run of pid {os.getpid()}" in outputs[0] and "Traceback" not in "".join(outputs)
    assert json.load(open(os.path.join(out, "run.lock")))["token"] == "mine"


@pytest.mark.slow
def test_two_launches_at_the_same_moment_on_a_dangling_symlink_out_dir_one_runs_and_the_other_names_it(
    data_path, tmp_path, start
):
    """out_dir a symlink to a directory not made yet (scratch space): both launches make it at once; one takes the
    lock and the other is refused in one line naming it -- never "[EEXIST] File exists" -- whichever wins."""
    for round_ in range(3):
        out, pause = str(tmp_path / f"out{round_}"), str(tmp_path / f"pause{round_}")
        os.symlink(tmp_path / f"scratch{round_}" / "run", out)
        args = tiny_args(data_path, out, max_iters=2, eval_interval=2)
        both = [start(args, TEST_PAUSE=f"0:1:{pause}") for _ in range(2)]
        outputs = {}
        for proc in both:  # the refused one ends by itself; the other pauses before its step 1
            for line in proc.stdout:
                outputs[proc] = outputs.get(proc, "") + line
                if line.startswith("paused before step 1"):
                    break
        winner = next(proc for proc in both if "paused before step 1" in outputs[proc])
        loser = next(proc for proc in both if proc is not winner)
        output = outputs[loser] + loser.communicate(timeout=120)[0]
        assert loser.returncode == 2, output
        refusal = f"error: out_dir {out} is in use by the run of pid {winner.pid} on {socket.gethostname()} since "
        assert refusal in output and "EEXIST" not in output, output
        release(pause, 1)
        assert winner.wait(timeout=120) == 0 and iteration_of(out) == 2


@pytest.mark.slow
def test_a_full_disk_leaves_no_lock_behind_and_an_empty_one_is_taken_over_at_once(data_path, tmp_path, capsys):
    """A launch on a full disk is one line and leaves no run.lock (it left an empty one, which made the next
    launch watch it for lock_timeout_s, 120 s); an empty run.lock (as an older version left it, or a launch killed
    between creating and writing it) is taken over at once, whoever's it was."""
    with tmpfs(str(tmp_path / "disk")) as disk:
        out = os.path.join(disk, "out")
        args = tiny_args(data_path, out, max_iters=2, eval_interval=2)
        filler = fill(disk)
        status, printed, err = run(args, capsys)
        assert status == 2 and printed == ""
        one_error_line(err, f"cannot write in out_dir {out}: [ENOSPC] No space left on device")
        assert not os.path.exists(os.path.join(out, "run.lock"))
        os.remove(filler)
        status, printed, _ = run(args, capsys)
        assert status == 0 and "watching" not in printed and "took over" not in printed
    out = str(tmp_path / "empty")
    os.makedirs(out)
    open(os.path.join(out, "run.lock"), "w").close()
    status, printed, _ = run(tiny_args(data_path, out, max_iters=2, eval_interval=2), capsys)
    assert status == 0 and "watching" not in printed
    assert (
        f"out_dir {out}: took over the lock of an unknown holder (its record cannot be read): the lock is empty"
        in printed
    )


# ---------------------------------------------------------------------------------------------------
# 3. and 4. Copies that are copies; checksums that every load verifies.


def test_damaging_ckpt_pt_in_place_leaves_best_pt_and_the_kept_copies_whole(finished_run, capsys):
    out, args = finished_run
    copies = ("best.pt", "ckpt_0000005.pt", "ckpt_0000010.pt")
    before = {name: open(os.path.join(out, name), "rb").read() for name in copies}
    assert all(os.stat(os.path.join(out, name)).st_nlink == 1 for name in (*copies, "ckpt.pt"))
    ckpt = os.path.join(out, "ckpt.pt")
    os.truncate(ckpt, 4096)
    subprocess.run(["cp", os.path.join(out, "ckpt_0000005.pt"), ckpt], check=True)  # writes into ckpt.pt's inode
    subprocess.run(["truncate", "-s", "100", ckpt], check=True)
    assert {name: open(os.path.join(out, name), "rb").read() for name in copies} == before
    status, printed, _ = run(args + ["--init_from=auto"], capsys)
    assert status == 0
    assert f"{ckpt} is not a readable checkpoint" in printed  # truncated: no checksum left, no zip directory
    assert "resuming the newest intact checkpoint instead" in printed


@pytest.mark.slow
def test_a_copy_of_a_live_run_taken_during_a_save_resumes_taking_over_the_copied_lock(data_path, tmp_path, start):
    """`cp -r` of out_dir while the run trains and writes its iter-6 checkpoint (held before its rename): the copy
    holds run.lock, ckpt.pt (iter 3) and the temporary file of the save in flight. Launched on the copy, the
    same command takes the lock over at once -- it names the directory it guards, the original -- and resumes
    ckpt.pt (iter 3), while the original run holds its own lock and finishes undisturbed."""
    out, copy, held = str(tmp_path / "out"), str(tmp_path / "copy"), str(tmp_path / "held")
    args = tiny_args(data_path, out, max_iters=9, eval_interval=3) + ["--init_from=auto"]
    original = start(args, TEST_HOLD_SAVE=f"3:{held}")
    wait_for_line(original, "renaming")
    shutil.copytree(out, copy, symlinks=True)
    assert {"run.lock", "ckpt.pt", f"ckpt.pt.tmp.{original.pid}"} <= set(os.listdir(copy))
    in_copy = [arg.replace(out, copy) for arg in args]
    resumed = start(in_copy)
    output, _ = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, output
    holder = f"pid {original.pid} on {socket.gethostname()} since "
    assert f"out_dir {copy}: took over the lock of {holder}" in output
    assert f": it guards {out}; this out_dir is a copy of that run's" in output
    assert f"resuming {copy}/ckpt.pt at iter 3" in output and iteration_of(copy) == 9
    open(held, "w").close()
    output, _ = original.communicate(timeout=120)
    assert original.returncode == 0 and iteration_of(out) == 9, output


def test_bytes_flipped_inside_a_weight_are_refused_by_resume_and_by_every_tool(data_path, tmp_path, capsys):
    out = str(tmp_path / "out")
    args = tiny_args(data_path, out, max_iters=4, eval_interval=2, save_best=False)
    assert run(args, capsys)[0] == 0
    ckpt = os.path.join(out, "ckpt.pt")
    flip_bytes_inside_a_tensor(ckpt)
    torch.load(ckpt, weights_only=True)  # torch reads it without complaint: only the checksum tells
    damaged = f"{ckpt} is damaged: its bytes do not match the sha256 recorded when it was written"
    status, printed, err = run(args + ["--init_from=resume", "--max_iters=6"], capsys)
    assert status == 2 and printed == ""
    one_error_line(err, damaged)
    tools = {
        sample.main: [f"--out_dir={out}", "--max_new_tokens=2", "--device=cpu"],
        hellaswag.main: ["--ckpt", out, "--device=cpu"],
        export_hf.main: [ckpt, str(tmp_path / "hf")],
    }
    for tool, argv in tools.items():
        assert tool(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        one_error_line(captured.err, damaged)


def test_a_checkpoint_without_a_checksum_still_resumes_and_says_it_was_not_verified(finished_run, capsys):
    """Checkpoints written before checksums (or by another program) load unverified, and the resume says so."""
    out, args = finished_run
    ckpt = os.path.join(out, "ckpt.pt")
    torch.save(torch.load(ckpt, weights_only=True), ckpt)
    status, printed, _ = run(args + ["--init_from=resume", "--max_iters=11"], capsys)
    assert status == 0
    assert f"resuming {ckpt} at iter 10 (it has no checksum to verify: written before checksums)" in printed


# ---------------------------------------------------------------------------------------------------
# 5. Divergence: no checkpoint from a suspect state.


def test_a_diverged_run_keeps_its_last_good_checkpoint_names_it_and_resumes_with_a_clean_count(
    data_path, tmp_path, capsys, monkeypatch
):
    """Every step from step 3 on has infinite gradients (injected: where a learning rate would make float
    arithmetic overflow depends on the processor's kernels), so steps are skipped as non-finite from step 3 on,
    across the evaluations of iters 5 and 10. No checkpoint is written from that state; the stop names the
    iter-0 checkpoint; a resume at a lower learning rate trains to the end (the count of bad steps restarts)."""
    out = str(tmp_path / "out")
    real = train.forward_backward
    monkeypatch.setattr(train, "forward_backward", diverging_from(real, first_step=3))
    status, printed, err = run(tiny_args(data_path, out, keep_every_n_evals=1), capsys)
    assert status == 1
    assert "iter 5: checkpoint held back: the last 2 step(s) were skipped as non-finite" in printed
    one_error_line(
        err,
        "10 consecutive steps (up to iter 13)",
        f"The newest checkpoint, written before the trouble, is {out}/ckpt.pt (iter 0): resume it with "
        "--init_from=resume and a lower learning_rate (now 0.003",
    )
    assert iteration_of(os.path.join(out, "ckpt.pt")) == 0 and iteration_of(os.path.join(out, "best.pt")) == 0
    assert not any(name.startswith("ckpt_") for name in os.listdir(out))
    monkeypatch.setattr(train, "forward_backward", real)
    status, printed, err = run(tiny_args(data_path, out, learning_rate=1e-3, init_from="auto"), capsys)
    assert status == 0, err
    assert "resume: learning_rate 0.003 -> 0.001" in printed and iteration_of(out) == 20


def test_a_resume_counts_bad_steps_anew(data_path, tmp_path, capsys):
    """A checkpoint written during a streak of skipped steps (as they were before checkpoints were held back)
    carries its count; resumed in float16, whose GradScaler skips the first 7 steps here, the run goes on
    instead of stopping at the first skip as the 10th in a row."""
    out = str(tmp_path / "out")
    assert run(tiny_args(data_path, out, max_iters=2, eval_interval=2), capsys)[0] == 0
    ckpt = shards.load_checkpoint(out)
    ckpt["progress"]["bad_steps"] = 9
    checkpoint.save_checkpoint(os.path.join(out, "ckpt.pt"), ckpt)
    args = tiny_args(data_path, out, dtype="float16", grad_multiplier=1000, max_iters=12, init_from="resume")
    status, printed, err = run(args, capsys)
    assert status == 0, err
    assert "iter 3: non-finite loss or gradient norm nan; step skipped (1 in a row" in printed


@pytest.mark.slow
def test_float16_s_skipped_first_steps_hold_a_checkpoint_back_only_until_a_step_succeeds(
    data_path, tmp_path, capsys, monkeypatch
):
    """The GradScaler starts at a loss scale that overflows here (grad_multiplier=1000) and skips the first steps
    as it lowers the scale: the checkpoints due meanwhile are held back, then written as training goes on. The
    line names the checkpoint a resume reads however slow the disk: here every write takes half a second, so
    iter 0's is still in flight when iter 1's is held back (on a fast machine the line once named none)."""
    save = checkpoint.save_checkpoint

    def slow_save(*args, **kwargs):
        time.sleep(0.5)
        return save(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_checkpoint", slow_save)
    out = str(tmp_path / "out")
    args = tiny_args(data_path, out, dtype="float16", grad_multiplier=1000, max_iters=12, eval_interval=4)
    status, printed, err = run(args + ["--checkpoint_interval=1"], capsys)
    assert status == 0, err
    held = f"iter 1: checkpoint held back: the last 1 step(s) were skipped as non-finite; resume from {out}/ckpt.pt"
    assert held + " (iter 0)" in printed
    assert iteration_of(out) == 12 and iteration_of(os.path.join(out, "best.pt")) > 0


# ---------------------------------------------------------------------------------------------------
# 7. and 9. Failed writes: a tmpfs that fills, a read-only file system.


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["its own stop", "SIGTERM", "Ctrl-C"])
def test_a_full_disk_is_reported_at_once_with_the_os_reason(data_path, tmp_path, start, ending):
    """The disk fills while the run trains (the test fills it at step 8, leaving room for metrics lines but
    not for a checkpoint). The iter-10 save fails: one line at once naming the file and ENOSPC (not torch's
    "unexpected pos"), and the run ends with a line naming the checkpoint to resume and its iteration.
    Once there is room again, the same command continues from it."""
    with tmpfs(str(tmp_path / "disk")) as disk:
        out, pause = os.path.join(disk, "out"), str(tmp_path / "pause")
        args = tiny_args(data_path, out, max_iters=14, eval_interval=5)
        proc = start(args + ["--init_from=auto"], TEST_PAUSE=f"0:8,10:{pause}")
        wait_for_line(proc, "paused before step 8")
        filler = fill(disk, leave_bytes=256 << 10)
        seen = ""
        if ending == "SIGTERM":  # the run stops after step 8 and its save fails
            proc.send_signal(signal.SIGTERM)
        release(pause, 8)
        if ending != "SIGTERM":  # the iter-10 save failed, and said so, before step 10 begins
            seen = wait_for_line(proc, "paused before step 10")
            assert "error: cannot write" in seen, seen
            if ending == "Ctrl-C":
                proc.send_signal(signal.SIGINT)
            else:
                release(pause, 10)
        output = seen + proc.communicate(timeout=120)[0]
        failure = f"error: cannot write checkpoint {out}/ckpt.pt: [ENOSPC] No space left on device; the previous one"
        assert failure in output and "unexpected pos" not in output and "Traceback" not in output, output
        resume = f"resume from {out}/ckpt.pt (iter 5) with --init_from=resume (or auto)"
        expected = {
            "its own stop": (1, f"stopped at iter 11: a write failed (above); {resume} once {out} has room"),
            "SIGTERM": (1, f"stopped by SIGTERM at iter 9: a write failed (above); {resume} once {out} has room"),
            "Ctrl-C": (130, f"interrupted at iter 10; {resume}"),
        }[ending]
        assert proc.returncode == expected[0] and expected[1] in output, output
        assert output.index(failure) < output.index(expected[1])
        assert iteration_of(os.path.join(out, "ckpt.pt")) == 5
        os.remove(filler)
        proc = start(args + ["--init_from=auto"])
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and f"resuming {out}/ckpt.pt at iter 5" in output, output
        assert iteration_of(os.path.join(out, "ckpt.pt")) == 14


def test_a_copy_that_fails_after_its_checkpoint_was_written_names_that_checkpoint(
    data_path, tmp_path, capsys, monkeypatch
):
    """The disk fills between ckpt.pt and best.pt's copy at iter 5: the stop line and checkpoints.jsonl named iter 0
    while ckpt.pt held iter 5. Now both name iter 5, the copy that failed is named once, and best.pt stays as it was
    (iter 0's)."""
    real_copy = checkpoint.keep_copy

    def full_for_best(src, dst, guard=None):
        if dst.endswith("best.pt") and checkpoint.read_trailer(src).iter == 5:
            raise checkpoint.CheckpointError(f"cannot write checkpoint {dst}: [ENOSPC] No space left on device")
        return real_copy(src, dst, guard)

    monkeypatch.setattr(checkpoint, "keep_copy", full_for_best)
    out = str(tmp_path / "out")
    status, printed, err = run(tiny_args(data_path, out, max_iters=10, eval_interval=5), capsys)
    assert status == 1
    ckpt = os.path.join(out, "ckpt.pt")
    assert err.count("error: ") == 1 and f"error: cannot write checkpoint {out}/best.pt: [ENOSPC]" in err, err
    assert f"a write failed (above); resume from {ckpt} (iter 5) with --init_from=resume (or auto)" in err, err
    with open(os.path.join(out, "checkpoints.jsonl")) as f:
        saves = [json.loads(line) for line in f]
    assert [(save["iter"], save["copies"]) for save in saves] == [(0, ["best.pt"]), (5, [])]
    assert iteration_of(ckpt) == 5 and iteration_of(os.path.join(out, "best.pt")) == 0


@pytest.mark.slow
def test_a_full_disk_while_appending_metrics_is_one_line_and_stops_the_run(data_path, tmp_path, start):
    with tmpfs(str(tmp_path / "disk"), size="8m") as disk:
        out, pause = os.path.join(disk, "out"), str(tmp_path / "pause")
        args = tiny_args(data_path, out, max_iters=400, eval_interval=1000, checkpoint_minutes=0)
        proc = start(args, TEST_PAUSE=f"0:2:{pause}")
        wait_for_line(proc, "paused before step 2")
        fill(disk)
        release(pause, 2)
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 1 and "Traceback" not in output, output
        failure = f"error: cannot append to {out}/metrics.jsonl: [ENOSPC] No space left on device"
        assert failure in output and "a write failed (above); resume from" in output, output
        assert "(iter 0)" in output


def test_a_read_only_out_dir_is_one_line(data_path, tmp_path, capsys):
    with tmpfs(str(tmp_path / "ro"), size="1m", read_only=True) as read_only:
        status, printed, err = run(tiny_args(data_path, read_only, max_iters=1), capsys)
    assert status == 2 and printed == ""
    one_error_line(err, f"cannot write in out_dir {read_only}: [EROFS] Read-only file system")


# ---------------------------------------------------------------------------------------------------
# 8. and 9. meta.pkl is data; the smaller items.


def test_a_meta_pkl_that_would_run_code_is_refused_unread(tmp_path, capsys):
    data_path = make_char_data(tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(tmp_path / "tiny" / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 23, "itos": Payload()}, f)
    status, printed, err = run(tiny_args(data_path, str(tmp_path / "out"), max_iters=1), capsys)
    assert status == 2 and printed == "" and not marker.exists()
    one_error_line(err, "meta.pkl asks to call posix.system while unpickling", "refused unread")


def test_a_resume_on_data_with_another_character_mapping_of_the_same_size_is_refused(tmp_path, capsys):
    data_path = make_char_data(tmp_path)
    out = str(tmp_path / "out")
    assert run(tiny_args(data_path, out, max_iters=2, eval_interval=2), capsys)[0] == 0
    meta = os.path.join(data_path, "tiny", "meta.pkl")
    itos = pickle.load(open(meta, "rb"))["itos"]
    write_meta(meta, [itos[i] for i in reversed(range(len(itos)))])  # the same ids, other characters
    before = file_bytes(out)
    status, printed, err = run(tiny_args(data_path, out, max_iters=4, init_from="resume"), capsys)
    assert status == 2 and printed == ""
    one_error_line(err, "ckpt.pt was trained on another vocabulary than", "was the dataset prepared again")
    assert file_bytes(out) == before


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_a_seed_outside_64_bits_is_one_line(data_path, tmp_path, capsys, seed):
    status, printed, err = run(tiny_args(data_path, str(tmp_path / "out"), seed=seed), capsys)
    assert status == 2 and printed == ""
    one_error_line(err, "seed must be in [0, 2**64)", f"got {seed}")


def test_an_eval_only_relaunch_changes_neither_config_json_nor_the_records(finished_run, capsys):
    out, args = finished_run
    before = file_bytes(out)
    status, printed, _ = run(args + ["--init_from=resume", "--eval_only=True"], capsys)
    assert status == 0 and "step 10: train loss" in printed  # evaluated and printed ...
    assert file_bytes(out) == before  # ... but config.json says eval_only=False still, and no second row


def test_config_json_is_the_run_s_and_follows_a_resume_that_changes_it(finished_run, capsys):
    out, args = finished_run
    config = os.path.join(out, "config.json")
    before = open(config, "rb").read()
    assert run(args + ["--init_from=resume"], capsys)[0] == 0  # the same configuration: left as it was
    assert open(config, "rb").read() == before
    assert run(args + ["--init_from=resume", "--max_iters=12", "--learning_rate=1e-3"], capsys)[0] == 0
    assert json.load(open(config))["learning_rate"] == 1e-3


# ---------------------------------------------------------------------------------------------------
# What a run trains on: the data's fingerprint.


def shard_dataset(root):
    """make_char_data's corpus as llm.c shards under root/tiny (a val shard, two train shards) with its meta.pkl."""
    data_path = make_char_data(root)
    data_dir = os.path.join(data_path, "tiny")
    ids = {split: np.fromfile(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16) for split in ("train", "val")}
    for split in ("train", "val"):
        os.remove(os.path.join(data_dir, f"{split}.bin"))
    write_shard(os.path.join(data_dir, "fineweb_val_000000.bin"), ids["val"])
    half = len(ids["train"]) // 2
    write_shard(os.path.join(data_dir, "fineweb_train_000001.bin"), ids["train"][:half])
    write_shard(os.path.join(data_dir, "fineweb_train_000002.bin"), ids["train"][half:])
    return data_path, data_dir


DATA_CHANGES = {
    # prepared again from other text: the same size, other tokens
    "replaced": ("fineweb_train_000002.bin", lambda ids: ids[::-1], "changed (same size, other bytes)"),
    # overwritten with more tokens
    "overwritten": (
        "fineweb_train_000002.bin",
        lambda ids: np.concatenate([ids, ids]),
        "changed (41,024 -> 81,024 bytes)",
    ),
    # a colleague's new shard
    "added": ("fineweb_train_000003.bin", lambda ids: ids, "is new"),
}


@pytest.mark.parametrize("change", DATA_CHANGES)
def test_a_resume_on_changed_data_is_refused_naming_the_change_and_continues_on_purpose(tmp_path, capsys, change):
    data_path, data_dir = shard_dataset(tmp_path)
    out = str(tmp_path / "out")
    assert run(tiny_args(data_path, out, max_iters=4, eval_interval=2), capsys)[0] == 0
    recorded = json.load(open(os.path.join(out, "config.json")))["data_fingerprint"]
    assert shards.load_checkpoint(out)["data_fingerprint"] == recorded == tokens.fingerprint(data_dir)[0]
    name, tokens_of, said = DATA_CHANGES[change]
    shard = TokenData(data_dir, "train")
    write_shard(os.path.join(data_dir, name), tokens_of(shard.read(1, 0, np.empty(shard.lengths[1], np.uint16))))
    before = file_bytes(out)
    resume = tiny_args(data_path, out, max_iters=6, eval_interval=2, init_from="auto")
    status, printed, err = run(resume, capsys)
    assert status == 2 and printed == ""
    one_error_line(
        err, f"ckpt.pt was trained on other data than {data_dir} holds now ({name} {said}", "--allow_data_change=True"
    )
    assert file_bytes(out) == before
    status, printed, _ = run(resume + ["--allow_data_change=True"], capsys)
    assert status == 0 and f"resume: the data changed: {name} {said}" in printed
    (note,) = [r for r in records(out) if metrics.DATA_CHANGE in r]
    assert note["iter"] == 4 and note[metrics.DATA_CHANGE].startswith(f"{name} {said}")
    assert json.load(open(os.path.join(out, "config.json")))["data_fingerprint"] == tokens.fingerprint(data_dir)[0]
    assert run(resume[:-3] + ["--max_iters=8", "--init_from=auto"], capsys)[0] == 0  # recorded: no longer a change


# ---------------------------------------------------------------------------------------------------
# metrics.jsonl as a crash leaves it.


def test_garbage_at_the_end_of_metrics_jsonl_is_dropped_and_the_run_resumes(finished_run, capsys):
    """A node lost mid-write can leave any bytes at the end of metrics.jsonl (here some that are not text, with a
    newline inside: the resume crashed with a UnicodeDecodeError). The resume names and drops them and goes on."""
    out, args = finished_run
    with open(os.path.join(out, "metrics.jsonl"), "ab") as f:
        f.write(b'{"iter": 11, "tok\xff\xfe\n\x00\x00\x9c')
    status, printed, _ = run(args[:-1] + ["--max_iters=12", "--init_from=auto"], capsys)
    assert status == 0
    assert f"note: {out}/metrics.jsonl: dropped 2 line(s) that are not whole records" in printed
    assert [r["iter"] for r in metrics.read_records(out) if "val/loss" in r] == [0, 5, 10, 12]
    assert not any(metrics.LOST_RECORDS in r for r in records(out))


def test_records_lost_before_the_checkpoint_are_noted_and_its_evaluation_recorded_again(finished_run, capsys):
    """The records up to a checkpoint are synced before it is written, but a file system may still lose them
    (here the last one, the iter-10 evaluation, is cut in half): the resume notes the gap at iter 10, in one
    line and a lost_records record, and runs that step's evaluation again to record it."""
    out, args = finished_run
    path = os.path.join(out, "metrics.jsonl")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 20)
    status, printed, _ = run(args[:-1] + ["--max_iters=12", "--init_from=auto"], capsys)
    assert status == 0
    lost = [r for r in records(out) if metrics.LOST_RECORDS in r]
    assert [r["iter"] for r in lost] == [10] and "records of the steps before it were lost" in printed
    assert f"intact bytes of the {size:,} it held when the checkpoint was written" in lost[0][metrics.LOST_RECORDS]
    assert [r["iter"] for r in records(out) if "val/loss" in r] == [0, 5, 10, 12]


def test_an_evaluation_of_a_run_whose_records_end_in_a_torn_line_stays_readable(finished_run, capsys):
    """eval_only appended its record to a torn last line, and read_metrics then refused the file."""
    out, args = finished_run
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"iter": 11, "tokens"')
    status, _, _ = run(args + ["--init_from=resume", "--eval_only=True", "--eval_iters=2"], capsys)
    assert status == 0
    assert [point[0] for point in metrics.read_metrics(out)["val/loss"]] == [0, 5, 10]


# ---------------------------------------------------------------------------------------------------
# The run directory's pieces, on their own.


@pytest.mark.parametrize(
    "argv, init_from, torchrun, advice",
    [
        (["config/quickstart.py", "--init_from=auto"], "auto", False, "run the same command to continue"),
        (["--init_from=resume"], "resume", True, "run the same command to continue"),
        (  # a fresh start: its --init_from and --overwrite give way to --init_from=resume, paths keep their quotes
            ["config/a b.py", "--init_from=scratch", "--overwrite=True", "--max_iters=9"],
            "scratch",
            False,
            "continue with: python train.py 'config/a b.py' --max_iters=9 --init_from=resume",
        ),
        (["config/x.py"], "scratch", True, "continue with the same command and --init_from=resume at its end"),
        (None, "gpt2", False, "continue with the same command and --init_from=resume at its end"),
    ],
)
def test_the_advice_after_a_stop_is_the_command_that_continues(monkeypatch, argv, init_from, torchrun, advice):
    monkeypatch.chdir(ROOT)  # where the README runs everything: train.py's path is relative to the cwd
    assert run_dir.continue_advice(argv, init_from, launched_by_torchrun=torchrun) == advice


@pytest.mark.slow
def test_a_run_directory_written_before_it_was_split_into_lock_checkpointer_and_layout_resumes(tmp_path, capsys):
    """tests/fixtures/run_of_107abb0: a run of 4 steps written by this repository at 107abb0, before run_dir.py became
    run_lock.py, checkpointer.py and run_dir.py (tiny_args with n_layer=1, n_head=2, n_embd=16, block_size=16,
    max_iters=4, eval_interval=2, eval_iters=2, lr_decay_iters=6 on make_char_data's corpus). The same command with
    max_iters=6 resumes its ckpt.pt -- its parts, its records, its data's fingerprint -- and trains on."""
    data_path = make_char_data(tmp_path / "data")
    out = str(tmp_path / "out")
    shutil.copytree(os.path.join(os.path.dirname(__file__), "fixtures", "run_of_107abb0"), out)
    shape = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, eval_interval=2, eval_iters=2, lr_decay_iters=6)
    status, printed, err = run(tiny_args(data_path, out, **shape, max_iters=6, init_from="auto"), capsys)
    assert status == 0, printed + err
    assert f"resuming {out}/ckpt.pt at iter 4" in printed and "Traceback" not in err
    assert iteration_of(os.path.join(out, "ckpt.pt")) == 6
    assert [r["iter"] for r in records(out) if "val/loss" in r] == [0, 2, 4, 6]
