"""marsgpt/files.py: a file appears under its final name only when it is complete; copies are copies; a failed
write names its OS reason."""

import errno
import os
import subprocess
import sys

import pytest

from marsgpt.files import atomic_write_bytes, atomic_writer, copy_file, os_reason, remove_stale_temporaries


def test_stale_temporaries_are_files_of_dead_processes_only(tmp_path):
    """kill -9 during a write leaves <name>.tmp.<pid>; a live process's, a folder (marsgpt/export_hf.py's temporary
    export) and other names stay."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"ckpt.pt.tmp.{dead.pid}").write_bytes(b"half")
    (tmp_path / f"ckpt.pt.tmp.{os.getpid()}").write_bytes(b"being written")
    (tmp_path / f"hf.tmp.{dead.pid}").mkdir()
    (tmp_path / "notes.tmp.txt").write_bytes(b"mine")
    assert remove_stale_temporaries(tmp_path) == [f"ckpt.pt.tmp.{dead.pid}"]
    assert sorted(os.listdir(tmp_path)) == sorted([f"ckpt.pt.tmp.{os.getpid()}", f"hf.tmp.{dead.pid}", "notes.tmp.txt"])


def test_interrupted_write_leaves_no_file_and_keeps_the_previous_one(tmp_path):
    path = tmp_path / "train.bin"
    with pytest.raises(RuntimeError):
        with atomic_writer(path) as f:
            f.write(b"partial")
            raise RuntimeError("killed")
    assert os.listdir(tmp_path) == []
    atomic_write_bytes(path, b"complete")
    with pytest.raises(RuntimeError):
        with atomic_writer(path, "w") as f:
            f.write("partial")
            raise RuntimeError("killed")
    assert os.listdir(tmp_path) == ["train.bin"] and path.read_bytes() == b"complete"


def test_the_file_appears_only_when_the_writer_closes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with atomic_writer(path, "w") as f:
        f.write("line\n")
        assert not path.exists()
    assert path.read_text() == "line\n"


def test_a_copy_shares_nothing_with_its_source(tmp_path):
    """copy_file's copy is a file of its own: writing into the source's inode, or truncating it, leaves it."""
    source, copy = tmp_path / "ckpt.pt", tmp_path / "best.pt"
    source.write_bytes(os.urandom(3 << 20))
    original = source.read_bytes()
    copy_file(str(source), str(copy))
    assert copy.read_bytes() == original and os.stat(copy).st_nlink == 1 and not os.path.samefile(source, copy)
    with open(source, "r+b") as f:
        f.write(b"overwritten in place")
    os.truncate(source, 10)
    assert copy.read_bytes() == original
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "ckpt.pt"]  # no temporary file left


def test_a_failed_write_is_worded_with_its_os_reason():
    assert os_reason(OSError(errno.ENOSPC, "No space left on device")) == "[ENOSPC] No space left on device"
    assert os_reason(OSError(errno.EDQUOT, "Disk quota exceeded")) == "[EDQUOT] Disk quota exceeded"
    assert os_reason(OSError(errno.EROFS, "Read-only file system")) == "[EROFS] Read-only file system"
    assert os_reason(RuntimeError("unexpected pos 1 vs 2")) == "unexpected pos 1 vs 2"
