"""files.py: a file appears under its final name only when it is complete."""

import os

import pytest

from files import atomic_write_bytes, atomic_writer


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
