"""The run directory's promise, tested as a property: every file a run directory (and its data folder) can hold,
damaged each way a disk, a crash, a colleague or an attacker can damage it, then the same command relaunched with
--init_from=auto through the command line. The relaunch either resumes exactly from an intact checkpoint (it says
which, and ends where the relaunch of the undamaged directory ends, bit for bit) or refuses in one line with exit
status 2 -- never a traceback, never code from a file run (each damage that is a pickle creates a marker file when
unpickled), never a start over a resumable checkpoint. Which of the two each case gives is fixed here
(EXPECTED), and docs/training.md ("What a run directory holds") lists it with what each file is.

The slow tier runs every case as a process; the quick tier runs a representative few (every damage to ckpt.pt,
every file as a pickle) through train.main in this process.
"""

import os
import pickle
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from train_helpers import ROOT, Payload, make_char_data, start_torchrun, subprocess_env, tiny_args

import train
from marsgpt import compile_cache, run_lock, shards
from marsgpt.tokens import write_manifest

DAMAGES = (
    "deleted",
    "empty",
    "truncated",
    "random bytes",
    "non-UTF-8 text",
    "a pickle of a callable",
    "a directory",
    "a dangling symlink",
    "an mtime in the future",
)
# Where each file lives: in out_dir, or in the data folder (data/<dataset>). A name with <pid> is a temporary file
# a killed writer left; <ckpt.pt's> is the shard directory ckpt.pt names.
PLAIN_FILES = {
    "ckpt.pt": "out",
    "best.pt": "out",
    "ckpt_0000002.pt": "out",
    "metrics.jsonl": "out",
    "checkpoints.jsonl": "out",
    "config.json": "out",
    "run.lock": "out",
    "run.lock.takeover": "out",
    "ckpt.pt.tmp.<pid>": "out",
    "meta.pkl": "data",
    "manifest.json": "data",
}
COMPILED_FILES = {"compile_cache.bin": "out", "compile_cache.bin.tmp.<pid>": "out"}
SHARDED_FILES = {"previous.pt": "out", "shards/<ckpt.pt's>/.metadata": "out", "shards/<ckpt.pt's>/__0_0.distcp": "out"}

# What each damaged file makes of the relaunch; any case not named is "resumed" (from ckpt.pt).
REFUSED, RESUMED, OLDER = "refused", "resumed", "resumed from an older checkpoint"
CHECKPOINT_BROKEN = {
    "deleted": OLDER,
    "empty": OLDER,
    "truncated": OLDER,
    "random bytes": OLDER,
    "non-UTF-8 text": OLDER,
    "a pickle of a callable": OLDER,
    "a directory": REFUSED,
    "a dangling symlink": REFUSED,
}
A_FILE_IN_ITS_PLACE = {"a directory": REFUSED, "a dangling symlink": REFUSED}
DATA_CHANGED = {damage: REFUSED for damage in DAMAGES if damage != "an mtime in the future"}
EXPECTED = {
    "ckpt.pt": CHECKPOINT_BROKEN,
    "best.pt": A_FILE_IN_ITS_PLACE,
    "ckpt_0000002.pt": A_FILE_IN_ITS_PLACE,
    "metrics.jsonl": A_FILE_IN_ITS_PLACE,
    "checkpoints.jsonl": A_FILE_IN_ITS_PLACE,
    "config.json": A_FILE_IN_ITS_PLACE,
    "run.lock": A_FILE_IN_ITS_PLACE,
    "run.lock.takeover": A_FILE_IN_ITS_PLACE,
    "ckpt.pt.tmp.<pid>": {},
    "meta.pkl": DATA_CHANGED,
    "manifest.json": {},  # a record of the data files' hashes: without it they are hashed again
    "compile_cache.bin": A_FILE_IN_ITS_PLACE,
    "compile_cache.bin.tmp.<pid>": {},
    "previous.pt": A_FILE_IN_ITS_PLACE,
    "shards/<ckpt.pt's>/.metadata": {**CHECKPOINT_BROKEN, "a directory": OLDER, "a dangling symlink": OLDER},
    "shards/<ckpt.pt's>/__0_0.distcp": {**CHECKPOINT_BROKEN, "a directory": OLDER, "a dangling symlink": OLDER},
}
BASE = dict(max_iters=4, eval_interval=2, keep_every_n_evals=1, lr_decay_iters=6, log_interval=2)
RELAUNCH = dict(BASE, max_iters=6, init_from="auto")
A_DEAD_PID = 2**22 + 17  # above the default pid_max: no process has it


def damage(path, how, marker):
    """Damage the file `path` (made first where the directory holds none, e.g. run.lock) as `how` says."""
    original = b""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            original = f.read()
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
    if how == "deleted":
        return
    if how == "a directory":
        os.makedirs(os.path.join(path, "inside"))
        return
    if how == "a dangling symlink":
        os.symlink(path + ".nowhere", path)
        return
    content = {
        "empty": b"",
        "truncated": original[: len(original) // 2],
        "random bytes": os.urandom(max(len(original), 64)),
        "non-UTF-8 text": b"\xff\xfe\xfa not text \x80\x81" * 8,
        "a pickle of a callable": pickle.dumps(Payload(marker)),
        "an mtime in the future": original,
    }[how]
    with open(path, "wb") as f:
        f.write(content)
    if how == "an mtime in the future":
        os.utime(path, (time.time() + 86400,) * 2)


def lock_record(out):
    """run.lock as a run that died on this machine left it (its pid is no process's), or a takeover claim's."""
    import json
    import socket

    return json.dumps(
        dict(
            host=socket.gethostname(),
            machine=run_lock._machine(),
            pid=A_DEAD_PID,
            process_start=1,
            since=time.time() - 60,
            token="dead",
            directory=os.path.realpath(out),
            inode=os.stat(out).st_ino,
            timeout_s=120,
        )
    )


def prepare_case(base, tmp_path, name, where, how):
    """A copy of the base run (out_dir and data folder) with `name` damaged `how`: (out_dir, data_path, marker)."""
    out, data_path = str(tmp_path / "out"), str(tmp_path / "data")
    shutil.copytree(base["out"], out, symlinks=True)
    shutil.copytree(base["data"], data_path, symlinks=True)
    marker = str(tmp_path / "code ran")
    if name in ("run.lock", "run.lock.takeover"):
        with open(os.path.join(out, name), "w") as f:
            f.write(lock_record(out))
    name = name.replace("<pid>", str(A_DEAD_PID))
    if name.startswith("ckpt.pt.tmp") or name.startswith("compile_cache.bin.tmp"):
        shutil.copy(os.path.join(out, name.split(".tmp")[0]), os.path.join(out, name))
    if "<ckpt.pt's>" in name:
        directory = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)[shards.SHARDS_KEY]["directory"]
        name = name.replace("shards/<ckpt.pt's>", directory)
    folder = out if where == "out" else os.path.join(data_path, "tiny")
    damage(os.path.join(folder, name), how, marker)
    return out, data_path, marker


def outcome(status, stdout, stderr, out, reference, marker):
    """What the relaunch did -- RESUMED (from ckpt.pt), OLDER (from another checkpoint) or REFUSED -- once it is
    checked to be one of them: no traceback, no code run, a refusal one line with status 2, a resume saying what it
    resumed and ending where the undamaged relaunch ends."""
    output = stdout + stderr
    assert "Traceback" not in output, output
    assert not os.path.exists(marker), f"a damaged file ran code:\n{output}"
    if status == 2:
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]), stderr
        return REFUSED
    assert status == 0, output
    resumed = re.search(r"^resuming (\S+) at iter \d+", stdout, re.M)
    assert resumed, f"exit 0 without resuming: a start over a resumable run?\n{output}"
    ended, expected = final_state(out), final_state(reference)
    assert ended.keys() == expected.keys() and all(torch.equal(ended[k], expected[k]) for k in expected)
    return RESUMED if os.path.basename(resumed.group(1)) == "ckpt.pt" else OLDER


def final_state(out):
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    if shards.SHARDS_KEY in ckpt:
        ckpt = shards.load_checkpoint(os.path.join(out, "ckpt.pt"))
    assert ckpt["progress"]["iter_num"] == RELAUNCH["max_iters"]
    optimizer = {
        f"{i}/{k}": v for i, s in ckpt["optimizer"]["state"].items() for k, v in s.items() if torch.is_tensor(v)
    }
    return {**ckpt["model"], **optimizer}


def relaunch(out, data_path, **extra):
    """The same command again (RELAUNCH: --init_from=auto, 2 more steps): python train.py, its exit status and
    output."""
    args = tiny_args(data_path, out, **RELAUNCH, **extra)
    done = subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True
    )
    return done.returncode, done.stdout, done.stderr


def base_run(tmp_path_factory, name, **extra):
    """A finished run of BASE (checkpoints at 0, 2, 4, each kept) on a data folder with a manifest, and the
    relaunch of an undamaged copy of it: {"out", "data", "reference"}."""
    root = tmp_path_factory.mktemp(name)
    data_path = make_char_data(str(root / "data"))
    write_manifest(os.path.join(data_path, "tiny"))
    out = str(root / "out")
    done = subprocess.run(
        [sys.executable, "train.py", *tiny_args(data_path, out, **BASE, **extra)],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    reference = str(root / "reference")
    shutil.copytree(out, reference)
    status, stdout, stderr = relaunch(reference, data_path, **extra)
    assert status == 0 and f"resuming {reference}/ckpt.pt at iter 4" in stdout, stdout + stderr
    return {"out": out, "data": data_path, "reference": reference}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return base_run(tmp_path_factory, "plain")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    base = base_run(tmp_path_factory, "compiled", compile=True)
    assert os.path.isfile(os.path.join(base["out"], compile_cache.FILE_NAME))
    return base


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """BASE under torchrun on 2 ranks with zero_stage=3: sharded checkpoints, previous.pt among them (the relaunch,
    and its reference, resume them in one process)."""
    root = tmp_path_factory.mktemp("sharded")
    data_path = make_char_data(str(root / "data"))
    write_manifest(os.path.join(data_path, "tiny"))
    out = str(root / "out")
    shape = dict(BASE, zero_stage=3, gradient_accumulation_steps=4, checkpoint_interval=1)
    proc = start_torchrun(tiny_args(data_path, out, **shape))
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    assert os.path.isfile(os.path.join(out, "previous.pt"))
    reference = str(root / "reference")
    shutil.copytree(out, reference)
    status, stdout, stderr = relaunch(reference, data_path, gradient_accumulation_steps=4)
    assert status == 0 and f"resuming {reference}/ckpt.pt at iter 4" in stdout, stdout + stderr
    return {"out": out, "data": data_path, "reference": reference}


def check_case(base, tmp_path, name, where, how, **extra):
    out, data_path, marker = prepare_case(base, tmp_path, name, where, how)
    got = outcome(*relaunch(out, data_path, **extra), out, base["reference"], marker)
    assert got == EXPECTED[name].get(how, RESUMED)


@pytest.mark.slow
@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("name", PLAIN_FILES)
def test_a_damaged_file_of_a_run_is_resumed_past_or_refused_in_one_line(plain, tmp_path, name, how):
    check_case(plain, tmp_path, name, PLAIN_FILES[name], how)


@pytest.mark.slow
@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("name", COMPILED_FILES)
def test_a_damaged_compile_cache_is_skipped_and_the_compiled_resume_is_exact(compiled, tmp_path, name, how):
    check_case(compiled, tmp_path, name, COMPILED_FILES[name], how, compile=True)


@pytest.mark.slow
@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("name", SHARDED_FILES)
def test_a_damaged_file_of_a_sharded_run_is_resumed_past_or_refused_in_one_line(sharded, tmp_path, name, how):
    check_case(sharded, tmp_path, name, SHARDED_FILES[name], how, gradient_accumulation_steps=4)


QUICK_CASES = [("ckpt.pt", how) for how in ("deleted", "random bytes", "a directory", "a dangling symlink")] + [
    (name, "a pickle of a callable") for name in ("ckpt.pt", "meta.pkl", "run.lock", "metrics.jsonl", "manifest.json")
]


@pytest.mark.parametrize("name, how", QUICK_CASES)
def test_the_quick_tier_of_the_damage_matrix_in_this_process(plain_in_process, tmp_path, capsys, one_thread, name, how):
    """The same cases through train.main in this process (its launch, resume and two steps): the quick tier's."""
    out, data_path, marker = prepare_case(plain_in_process, tmp_path, name, PLAIN_FILES[name], how)
    capsys.readouterr()
    status = train.main(tiny_args(data_path, out, **RELAUNCH))
    captured = capsys.readouterr()
    got = outcome(status, captured.out, captured.err, out, plain_in_process["reference"], marker)
    assert got == EXPECTED[name].get(how, RESUMED)


@pytest.fixture(scope="module")
def plain_in_process(tmp_path_factory):
    """BASE trained by train.main in this process, and its undamaged relaunch there (the quick tier's reference:
    this process's kernels)."""
    root = tmp_path_factory.mktemp("in_process")
    data_path = make_char_data(str(root / "data"))
    write_manifest(os.path.join(data_path, "tiny"))
    out, reference = str(root / "out"), str(root / "reference")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train.main(tiny_args(data_path, out, **BASE)) == 0
        shutil.copytree(out, reference)
        assert train.main(tiny_args(data_path, reference, **RELAUNCH)) == 0
    finally:
        torch.set_num_threads(threads)
    return {"out": out, "data": data_path, "reference": reference}


@pytest.mark.slow
def test_every_file_a_run_writes_is_in_the_matrix(plain, sharded, compiled):
    """What the base runs wrote, each named in the matrix (a file added to the run directory joins it)."""
    written = set()
    for base in (plain, sharded, compiled):
        for name in os.listdir(base["out"]):
            written.add("shards/<ckpt.pt's>" if name == "shards" else name)
    named = {*PLAIN_FILES, *COMPILED_FILES, *SHARDED_FILES, "shards/<ckpt.pt's>", "ckpt_0000000.pt", "ckpt_0000004.pt"}
    assert written <= named, written - named
