"""marsgpt/run_lock.py: one run per out_dir. The lock on its own (a heartbeat, a takeover, what is in run.lock's
place), then through train.py's command line: a holder in another pid namespace (another machine, as the lock sees
it) keeps its lock against a launch with a shorter lock_timeout_s, and a holder whose lock was taken writes nothing
more."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from train_helpers import ROOT, launch, subprocess_env, tiny_args, wait_for_line

from marsgpt import checkpoint, run_lock
from marsgpt.run_lock import LockError, LockLost, RunLock


def write_lock(directory, age_s=0.0, **fields):
    """run.lock as a holder on another machine writes it, last refreshed `age_s` seconds ago (negative: ahead)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "run.lock")
    holder = dict(host="node-elsewhere", machine="other-boot/1", pid=4242, process_start=1, since=time.time() - 60)
    with open(path, "w") as f:
        json.dump(dict(holder, token="theirs", **fields), f)
    os.utime(path, (time.time() - age_s,) * 2)
    return path


def test_the_lock_notices_when_another_launch_takes_it_and_releases_only_its_own(tmp_path):
    lock = RunLock.acquire(str(tmp_path), timeout_s=0.4, wait_limit_s=1)
    path = tmp_path / "run.lock"
    assert json.load(open(path))["pid"] == os.getpid() and lock.lost is None
    assert json.load(open(path))["timeout_s"] == 0.4  # what a launch with a shorter timeout judges it by
    lock.check()
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": 0, "token": "theirs"}))
    deadline = time.monotonic() + 60
    while lock.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lock.lost.startswith(f"the lock on its out_dir ({path}) was taken by pid 1 on elsewhere since ")
    with pytest.raises(LockLost):
        lock.check()
    lock.release()
    assert json.load(open(path))["token"] == "theirs"  # not ours to remove


def test_the_guard_reads_the_lock_now_not_at_the_last_heartbeat(tmp_path):
    lock = RunLock.acquire(str(tmp_path), timeout_s=3600, wait_limit_s=1)  # no heartbeat for an hour
    try:
        (tmp_path / "run.lock").write_bytes(b"\xff\xfe garbage")
        with pytest.raises(LockLost, match="overwritten with bytes that are not a lock record"):
            lock.check()
    finally:
        lock.release()


def test_a_shorter_timeout_judges_a_holder_by_the_holder_s_own(tmp_path, capsys):
    """The holder beats every 4 s / 4; its heartbeat is 1.5 s old, older than this launch's 0.5 s: judged by the
    holder's 4 s, it is watched, seen to move, and refused -- never taken."""
    path = write_lock(str(tmp_path), age_s=1.5, timeout_s=4)
    os.utime(path, (time.time() - 1.5,) * 2)
    beats = subprocess.Popen([sys.executable, "-c", f"import os,time\ntime.sleep(1)\nos.utime({path!r})"])
    try:
        with pytest.raises(LockError, match="is in use by the run of pid 4242 on node-elsewhere"):
            RunLock.acquire(str(tmp_path), timeout_s=0.5)
    finally:
        beats.wait()
    assert "last refreshed 2 s ago: watching for" in capsys.readouterr().out
    assert json.load(open(path))["token"] == "theirs"


def test_a_watch_cut_short_refuses_naming_the_holder_s_timeout(tmp_path):
    write_lock(str(tmp_path), age_s=1, timeout_s=30)
    with pytest.raises(LockError, match=r"it is taken over once it is lock_timeout_s=30 \(the holder's\) s old"):
        RunLock.acquire(str(tmp_path), timeout_s=0.5, wait_limit_s=0.2)


@pytest.mark.parametrize(
    "content", [b"\xff\xfe\x00\x80 not text", b'{"host": "node-elsew', b"[1, 2, 3]", b"\x80\x04\x95 a pickle"]
)
def test_a_lock_that_holds_no_record_is_taken_over_with_one_line(tmp_path, capsys, content):
    """Not UTF-8, cut short, JSON but not a record, a pickle: no live holder's lock reads so (a holder never
    rewrites its record, and stops writing when it finds it unreadable). Taken over after the short wait for a
    record being written, with one line -- never a traceback, never a refusal."""
    (tmp_path / "run.lock").write_bytes(content)
    lock = RunLock.acquire(str(tmp_path), timeout_s=3600)
    lock.release()
    out = capsys.readouterr().out
    assert out == (
        f"out_dir {tmp_path}: took over the lock of an unknown holder (its record cannot be read): the lock holds "
        f"{len(content)} bytes that are not a lock record (a power loss or a disk error); no live run's lock reads so\n"
    )


def test_a_heartbeat_ahead_of_this_machine_s_clock_ages_from_now(tmp_path, capsys):
    """Clock skew: a dead holder's heartbeat stamped 30 minutes ahead is set to now, so it ages by this machine's
    clock; watched for the holder's timeout it does not move and is taken over (once, not when the clock catches
    up)."""
    write_lock(str(tmp_path), age_s=-1800, timeout_s=1)
    lock = RunLock.acquire(str(tmp_path), timeout_s=1)
    lock.release()
    out = capsys.readouterr().out
    assert "was 1800 s ahead of this machine's clock (another node's clock): it now ages from this machine's" in out
    assert "took over the lock of pid 4242 on node-elsewhere" in out and "its heartbeat stopped" in out
    assert " -" not in out  # no negative age


def test_a_takeover_claim_whose_taker_died_here_is_removed_at_once(tmp_path, capsys):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    write_lock(str(tmp_path), age_s=3600, timeout_s=1)
    taker = dict(host=socket.gethostname(), machine=run_lock._machine(), pid=dead_pid, process_start=1)
    (tmp_path / "run.lock.takeover").write_text(json.dumps(taker))
    t0 = time.monotonic()
    RunLock.acquire(str(tmp_path), timeout_s=1).release()
    assert time.monotonic() - t0 < 2
    out = capsys.readouterr().out
    assert (
        f"removed {tmp_path / 'run.lock.takeover'}, left by a launch that died taking the lock over: its taker" in out
    )
    assert "took over the lock of pid 4242" in out and not (tmp_path / "run.lock.takeover").exists()


@pytest.mark.slow
def test_a_takeover_claim_from_another_machine_is_removed_once_it_stays_unchanged(tmp_path, capsys):
    write_lock(str(tmp_path), age_s=3600, timeout_s=1)
    (tmp_path / "run.lock.takeover").write_text("")  # as an older version left it
    RunLock.acquire(str(tmp_path), timeout_s=1).release()
    out = capsys.readouterr().out
    assert "left by a launch that died taking the lock over: it stayed unchanged for 5 s" in out
    assert "took over the lock of pid 4242" in out


@pytest.mark.parametrize("what", ["a directory", "a dangling symlink"])
@pytest.mark.parametrize("name", ["run.lock", "run.lock.takeover"])
def test_something_else_in_the_lock_s_place_is_one_line(tmp_path, what, name):
    path = tmp_path / name
    if what == "a directory":
        path.mkdir()
    else:
        path.symlink_to(tmp_path / "nowhere")
    with pytest.raises(LockError) as refused:
        RunLock.acquire(str(tmp_path), timeout_s=1)
    assert str(refused.value) == f"{path} is {what}, not a lock file this program writes: remove it, then launch again"


# ---------------------------------------------------------------------------------------------------
# Through the command line.


def in_another_pid_namespace(command):
    """`command` in a pid namespace of its own (unshare, root only): its lock names another machine."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare command here")
    probe = subprocess.run(["unshare", "-pf", "--mount-proc", "true"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"cannot make a pid namespace here (it needs root): {probe.stderr.strip()}")
    return ["unshare", "-pf", "--mount-proc", *command]


@pytest.mark.slow
def test_a_launch_with_a_shorter_lock_timeout_does_not_take_a_live_run_s_lock(data_path, tmp_path):
    """The holder runs in another pid namespace (another machine, as the lock sees it) with lock_timeout_s=20: it
    beats every 5 s. A relaunch with lock_timeout_s=2 found its heartbeat 2 s old and took the lock, and both
    trained in out_dir; now it judges by the holder's 20 s, sees the heartbeat move, and is refused in one line.
    Then the lock is taken from the holder behind its back: the holder writes nothing more and stops in one line."""
    out, pause = str(tmp_path / "out"), str(tmp_path / "pause")
    args = tiny_args(data_path, out, max_iters=6, eval_interval=3, lock_timeout_s=20)
    helper = os.path.join(ROOT, "tests", "train_helpers.py")
    holder = subprocess.Popen(
        in_another_pid_namespace([sys.executable, helper, *args]),
        cwd=ROOT,
        env=subprocess_env(TEST_PAUSE=f"0:4:{pause}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = wait_for_line(holder, "paused before step 4")
        lock = os.path.join(out, "run.lock")
        assert json.load(open(lock))["machine"] != run_lock._machine()
        time.sleep(2.5)  # the heartbeat is older than the relaunch's own timeout
        relaunch = launch([*args[:-1], "--lock_timeout_s=2", "--init_from=auto"])
        output, _ = relaunch.communicate(timeout=120)
        assert relaunch.returncode == 2, output
        assert "error: out_dir" in output and "is in use by the run of pid 1 on" in output, output
        assert "Traceback" not in output and json.load(open(lock))["pid"] == 1

        before = {name: os.path.getsize(os.path.join(out, name)) for name in ("metrics.jsonl", "checkpoints.jsonl")}
        saved = checkpoint.read_trailer(os.path.join(out, "ckpt.pt")).iter
        write_lock(out, timeout_s=20)  # another launch's now
        open(f"{pause}.4", "w").close()
        rest, _ = holder.communicate(timeout=120)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate()
    assert holder.returncode == 1, seen + rest
    stop = f"error: the lock on its out_dir ({lock}) was taken by pid 4242 on node-elsewhere since "
    assert stop in rest and "without writing more" in rest and "Traceback" not in rest, rest
    assert rest.count("error:") == 1, rest
    after = {name: os.path.getsize(os.path.join(out, name)) for name in before}
    assert after == before and checkpoint.read_trailer(os.path.join(out, "ckpt.pt")).iter == saved
    assert json.load(open(lock))["token"] == "theirs"
