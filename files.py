"""Atomic file writes: a file appears under its final name only when it is complete.

Every writer in the repository (token shards, checkpoints, downloads, metrics.jsonl's truncation) goes
through atomic_writer, so a crash, kill -9 or full disk leaves either the previous file or none, never a
truncated one under the final name.
"""

import contextlib
import os


@contextlib.contextmanager
def atomic_writer(path, mode="wb"):
    """Open `path` for writing under a temporary name in the same directory; rename over `path` on success.

    The bytes are flushed and fsync'ed before the rename (the temporary file sits beside `path`, so the
    rename cannot cross filesystems), and the directory is fsync'ed after it, so the rename itself
    survives a power loss. An interrupted writer leaves only ``<path>.tmp.<pid>`` behind (removed when
    the interruption is an exception).
    """
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_directory(os.path.dirname(os.path.abspath(path)))


def atomic_write_bytes(path, data):
    with atomic_writer(path) as f:
        f.write(data)


def fsync_directory(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
