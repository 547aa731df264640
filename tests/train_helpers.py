"""Shared by the train.py tests: a tiny character corpus, tiny-run arguments, and a fault-injecting launcher.

    python tests/train_helpers.py [train.py arguments]

runs train.main with the faults the environment asks for -- test-only hooks patched in from outside,
so train.py and marsgpt/checkpoint.py carry no test code:

    TEST_HOLD_SAVE=N:PATH  the N-th rename of a finished ckpt.pt (in a sharded save: once its shard directory
                           is complete) prints 'renaming <path>' and waits until the file PATH exists:
                           meanwhile the test kills the process, interrupts it, copies out_dir
                           (and the main thread, when it then waits for that save to finish, prints 'waiting on the
                           held save': the next save is due, as on storage slower than the run's checkpoints)
    TEST_FAIL=RANK:ITER:MODE   on rank RANK, just before step ITER: MODE 'raise' (the rank dies)
                           or 'hang' (prints 'hanging before step ITER' and stops: no more steps,
                           no answer to collectives)
    TEST_UNREADABLE=RANK:PATH  on rank RANK the file PATH does not exist (a node without the shared
                           file system): os.path.isfile says False and open raises FileNotFoundError
    TEST_COMPILE_BACKEND=B torch.compile with backend B (aot_eager: dynamo's graphs without inductor's build)
    TEST_MKLDNN=0          torch.backends.mkldnn off (as in the tests' own process: conftest.py; with
                           ATEN_CPU_CAPABILITY, choose_kernels also holds oneDNN and inductor's cache to it)
    TEST_PAUSE=RANK:ITERS:PATH  on rank RANK, just before each step of ITERS (comma-separated), waits for
                           the checkpoint in flight, prints 'paused before step ITER (pid P)' and waits
                           until the file PATH.ITER exists or a stop signal has arrived: meanwhile the test
                           sends a signal, fills the disk, launches a second run, copies out_dir
"""

import builtins
import contextlib
import math
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = (
    "def",
    "return",
    "self",
    "import",
    "class",
    "for",
    "in",
    "if",
    "else",
    "None",
    "True",
    "x",
    "y",
    "print",
    "(",
    ")",
    ":",
    "=",
    "+",
    "lambda",
    "with",
    "as",
    "yield",
)


def make_char_data(root, name="tiny", train_chars=40_000, val_chars=6_000, seed=0):
    """A word-salad character corpus in nanoGPT's layout (train.bin, val.bin, meta.pkl) under root/name."""
    from marsgpt.tokens import write_bin, write_meta  # the repository root is on sys.path: pyproject, or PYTHONPATH

    rng = np.random.default_rng(seed)
    text = " ".join(rng.choice(WORDS, size=(train_chars + val_chars) // 3))
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    data_dir = os.path.join(root, name)
    os.makedirs(data_dir, exist_ok=True)
    write_bin(os.path.join(data_dir, "train.bin"), ids[:train_chars])
    write_bin(os.path.join(data_dir, "val.bin"), ids[train_chars : train_chars + val_chars])
    write_meta(os.path.join(data_dir, "meta.pkl"), chars)
    return str(root)


def tiny_args(data_path, out_dir, **overrides):
    """train.py arguments for a 2-layer, 64-wide model on make_char_data's corpus: ~20 ms a step."""
    args = dict(
        data_path=data_path,
        dataset="tiny",
        out_dir=out_dir,
        n_layer=2,
        n_head=2,
        n_embd=64,
        block_size=32,
        batch_size=4,
        gradient_accumulation_steps=2,
        max_iters=20,
        eval_interval=5,
        eval_iters=4,
        log_interval=1,
        learning_rate=3e-3,
        lr_1d=3e-3,
        warmup_iters=2,
        lr_decay_iters=20,
        min_lr=3e-4,
        device="cpu",
        compile=False,
        seed=1,
    )
    args.update(overrides)
    return [f"--{k}={v}" for k, v in args.items()]


def subprocess_env(**extra):
    """One thread per process: the numbers do not depend on the thread count, and 2 shared cores stay usable."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **extra)
    return env


# Every process launch() and start_torchrun() started: tests/conftest.py ends any still running after its test, so a
# test that fails while a run waits (held, or hanging by TEST_FAIL) leaves nothing behind.
LAUNCHED = []


def launch(args, env=None, **popen):
    """Start `python tests/train_helpers.py args` (train.py under the hooks) in the repository root."""
    return started(
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *args],
            cwd=ROOT,
            env=env or subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            **popen,
        )
    )


def started(proc):
    LAUNCHED.append(proc)
    return proc


def torchrun_command(args, nproc=2):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, os.path.join(ROOT, "tests", "train_helpers.py"), *args]


def start_torchrun(args, **env):
    """The torchrun job of 2 ranks, started (its output one pipe), with test hooks from `env`."""
    pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return started(subprocess.Popen(torchrun_command(args), cwd=ROOT, env=subprocess_env(**env), **pipe))


def wait_for_line(proc, prefix, timeout=120):
    """Read proc's output until a line holds `prefix` (a line's start, or after another process's text: torchrun's
    ranks print unbuffered, each print's text and newline in two writes, so two ranks' lines can share one);
    return everything read."""
    seen = []
    # A process that prints nothing more would hold the read below forever: at the deadline it is killed, which
    # ends its output, and the test fails saying what it saw.
    killer = threading.Timer(timeout, kill_tree, (proc,))
    killer.start()
    try:
        for line in proc.stdout:
            seen.append(line)
            if prefix in line:
                return "".join(seen)
    finally:
        killer.cancel()
    raise AssertionError(f"no line starting with {prefix!r} within {timeout} s in:\n{''.join(seen)}")


@contextlib.contextmanager
def tmpfs(path, size="32m", read_only=False):
    """A tmpfs of `size` mounted at `path` (root only: the test is skipped, saying why, where mounting is refused)."""
    import pytest

    os.makedirs(path, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command here: a full or read-only file system cannot be made for the test")
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here (mounting needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=True)


def fill(directory, leave_bytes=0):
    """Fill the file system of `directory` but `leave_bytes` (0: to the last byte) with one file; its path."""
    filler = os.path.join(directory, "filler")
    stat = os.statvfs(directory)
    to_write = stat.f_bavail * stat.f_frsize - leave_bytes
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):  # ENOSPC: full
        while leave_bytes == 0 or to_write > 0:
            to_write -= f.write(b"\0" * (min(to_write, 1 << 16) if leave_bytes else 1 << 16))
    return filler


def children(pid):
    """The ids of the processes whose parent is `pid` (from /proc: torchrun starts each rank in a session of its
    own, so a signal to the agent's process group does not reach them)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def kill_tree(proc):
    """kill -9 `proc` and every process below it (torchrun's ranks hold its output open after it is gone)."""
    pids, seen = [proc.pid], []
    while pids:
        pid = pids.pop()
        seen.append(pid)
        pids += children(pid)
    for pid in seen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def kill_job(proc, timeout=60):
    """kill -9 torchrun's agent `proc` and its ranks at once, as a scheduler ends a job; return once all are gone
    (rank 0 holds the run's lock until it is)."""
    pids = [*children(proc.pid), proc.pid]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{pid}") for pid in pids):
        assert time.monotonic() < deadline, f"processes {pids} outlived kill -9 by {timeout} s"
        time.sleep(0.05)


class Payload:
    """Unpickled, it creates the file `marker`: what a hostile pickle could do instead (the run directory's and the
    data folder's files are data: a test holds that none of them is unpickled into running this)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def diverging_from(forward_backward, first_step):
    """train.forward_backward whose every step from `first_step` on ends with infinite gradients: divergence
    injected at a chosen step, so the steps a test asserts follow from the injection, not from where one
    processor's float arithmetic happens to overflow (tests monkeypatch train.forward_backward with it)."""

    def diverging(run, step):
        loss = forward_backward(run, step)
        if step >= first_step:
            for p in run.model.parameters():
                p.grad.fill_(math.inf)
        return loss

    return diverging


# ATEN_CPU_CAPABILITY's instruction sets as oneDNN names them (ONEDNN_MAX_CPU_ISA)
ONEDNN_ISA = {"default": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE"}


def choose_kernels():
    """TEST_MKLDNN=0: oneDNN's matmul and convolution kernels off, another arithmetic path. With
    ATEN_CPU_CAPABILITY=default (torch's baseline kernels) and MKL_CBWR=COMPATIBLE (MKL's processor-independent
    path) it shows which tests hold two code paths bit-equal only by the luck of one processor's kernels.

    ATEN_CPU_CAPABILITY limits torch's own kernels only; oneDNN asks the processor. On this repository's machine
    (AMX) torch then asks oneDNN whether to pack bfloat16 blocks for AMX, oneDNN says yes, and torch's packing
    kernel for the capability it was given raises ("pack_vnni2 is only supported when avx512 is supported", in
    the CPU's flash attention): a processor with AMX and no AVX, which does not exist. So oneDNN is held to the
    same instruction set (ONEDNN_MAX_CPU_ISA, unless set), and the two make one processor that does. And
    inductor's on-disk cache does not key a graph by the instruction set its C++ was written for: a graph
    cached by a run with AVX-512 comes back to a baseline run, whose compiler flags lack it, and does not
    compile ("'at::vec' has not been declared"), so the capability gets a cache of its own
    (TORCHINDUCTOR_CACHE_DIR, unless set). Both are set in os.environ,
    where oneDNN and inductor read them when first used, and the subprocesses a test launches inherit them."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability in ONEDNN_ISA:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ONEDNN_ISA[capability])
    if capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}-{capability}"
    if os.environ.get("TEST_MKLDNN") == "0":
        import torch

        torch.backends.mkldnn.enabled = False


def _install_hooks():
    choose_kernels()
    import train
    from marsgpt import checkpoint, run_dir

    if os.environ.get("TEST_HOLD_SAVE"):
        hold, release = os.environ["TEST_HOLD_SAVE"].split(":", 1)
        real_replace, renames = os.replace, [0]

        def replace(src, dst):
            if str(dst).endswith(run_dir.CKPT_NAME):
                renames[0] += 1
                if renames[0] == int(hold):
                    print(f"renaming {dst}", flush=True)
                    while not os.path.exists(release):
                        time.sleep(0.05)
            real_replace(src, dst)

        checkpoint.os.replace = replace  # the os module: only this process, only for this test
        real_start, real_wait, saves = checkpoint.CheckpointWriter._start, checkpoint.CheckpointWriter.wait, [0]

        def start(writer, path, write, iteration):
            saves[0] += str(path).endswith(run_dir.CKPT_NAME)  # the N-th save of ckpt.pt makes its N-th rename
            return real_start(writer, path, write, iteration)

        def wait(writer):
            # by the save, not by the renames counted so far: on a loaded machine the writer's thread may not have
            # reached the held rename yet when the next save starts to wait for it (the renames it has made: the
            # process that renames ckpt.pt, not another rank)
            held = saves[0] == int(hold) and renames[0] >= int(hold) - 1
            if writer.in_flight and held and not os.path.exists(release):
                print("waiting on the held save", flush=True)
            return real_wait(writer)

        checkpoint.CheckpointWriter._start = start
        checkpoint.CheckpointWriter.wait = wait

    if os.environ.get("TEST_FAIL"):
        rank, fail_iter, mode = os.environ["TEST_FAIL"].split(":")
        real_step = train.train_step

        def train_step(run, it):
            if run.dist.rank == int(rank) and it == int(fail_iter):
                if mode == "raise":
                    raise RuntimeError(f"injected failure on rank {rank} at step {it}")
                print(f"hanging before step {it}", flush=True)
                time.sleep(3600)
            return real_step(run, it)

        train.train_step = train_step

    if os.environ.get("TEST_PAUSE"):
        rank, iters, until = os.environ["TEST_PAUSE"].split(":", 2)
        real_pause_step = train.train_step

        def paused_train_step(run, it):
            if run.dist.rank == int(rank) and str(it) in iters.split(","):
                run.directory.checkpoints.wait()  # nothing in flight while the test looks
                print(f"paused before step {it} (pid {os.getpid()})", flush=True)
                while not (os.path.exists(f"{until}.{it}") or run.directory.signals.received):
                    time.sleep(0.05)
            return real_pause_step(run, it)

        train.train_step = paused_train_step

    if os.environ.get("TEST_COMPILE_BACKEND"):
        import functools

        import torch

        # torch.compile (and Module.compile, which calls it) with this backend: aot_eager traces what inductor
        # would (dynamo's graphs, breaks and recompiles do not depend on the backend) without building C++ kernels
        torch.compile = functools.partial(torch.compile, backend=os.environ["TEST_COMPILE_BACKEND"])

    if os.environ.get("TEST_UNREADABLE"):
        rank, hidden = os.environ["TEST_UNREADABLE"].split(":", 1)
        if os.environ.get("RANK", "0") == rank:
            real_open, real_isfile = builtins.open, os.path.isfile

            def is_hidden(path):
                return isinstance(path, (str, os.PathLike)) and os.path.abspath(path) == os.path.abspath(hidden)

            def open_(path, *args, **kwargs):
                if is_hidden(path):
                    raise FileNotFoundError(2, "No such file or directory", str(path))
                return real_open(path, *args, **kwargs)

            builtins.open = open_
            os.path.isfile = lambda path: not is_hidden(path) and real_isfile(path)


if __name__ == "__main__":  # started by launch() with PYTHONPATH=ROOT (subprocess_env)
    _install_hooks()
    import train

    train.cli()
