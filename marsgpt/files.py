"""Atomic file writes and copies, file checksums, how a failed write is worded, and the JSON-lines reader that the
HellaSwag loader and the prepare scripts share.

Every writer in the repository (token shards, checkpoints and their copies, downloads, metrics.jsonl's
truncation) goes through atomic_writer, so a crash, kill -9 or full disk leaves either the previous file or
none, never a truncated one under the final name.
"""

import contextlib
import errno
import hashlib
import json
import os
import shutil


@contextlib.contextmanager
def atomic_writer(path, mode="wb", guard=None):
    """Open `path` for writing under a temporary name in the same directory; rename over `path` on success.

    The bytes are flushed and fsync'ed before the rename (the temporary file sits beside `path`, so the
    rename cannot cross filesystems), and the directory is fsync'ed after it, so the rename itself
    survives a power loss. An interrupted writer leaves only ``<path>.tmp.<pid>`` behind (removed when
    the interruption is an exception). `guard`: called just before the rename; what it raises leaves `path` as
    it was (a run checks there that it still holds its directory's lock).
    """
    with atomic_path(path, guard) as tmp, open(tmp, mode) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path, guard=None):
    """The temporary name beside `path` to create a complete file under (its bytes already on disk), renamed
    over `path` on success -- once guard() returned, when given -- then the directory fsync'ed; removed when the
    body or the guard raises (atomic_writer's renaming)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        yield tmp
        if guard is not None:
            guard()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_directory(os.path.dirname(os.path.abspath(path)))


def remove_stale_temporaries(directory):
    """Remove the ``<name>.tmp.<pid>`` files in `directory` that a killed writer left (kill -9 during a
    checkpoint save leaves one as large as the checkpoint), skipping any whose process is alive here.
    Prints a line for each and returns the names removed."""
    removed = []
    if not os.path.isdir(directory):
        return removed
    for name in sorted(os.listdir(directory)):
        stem, sep, pid = name.rpartition(".tmp.")
        path = os.path.join(directory, name)
        # Files only: marsgpt/export_hf.py's temporary folder beside its export is its own to clean up.
        if not (stem and sep and pid.isdigit()) or not os.path.isfile(path) or process_alive(int(pid)):
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove: left as it is
            os.remove(path)
            removed.append(name)
            print(f"removed {path}, left by an interrupted write", flush=True)
    return removed


def process_alive(pid):
    """Whether process `pid` exists on this machine (in this pid namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def copy_file(src, dst, guard=None):
    """Make `dst` a copy of `src` that shares nothing with it, written atomically and made durable.

    A hard link would cost nothing, but it is the same file: `truncate` or `cp other.pt src` (which writes into
    src's existing inode) would damage both. copy_file_range lets the kernel copy without passing the bytes
    through Python, and where the filesystem can clone (XFS and btrfs reflinks, NFS 4.2's server-side copy)
    the copy costs no data I/O and still shares nothing writable: a write into either file gives it blocks
    of its own. Elsewhere it falls back to a plain read and write. `guard`: as for atomic_writer.
    """
    with open(src, "rb") as source, atomic_writer(dst, guard=guard) as target:
        remaining = os.fstat(source.fileno()).st_size
        try:
            while remaining > 0:
                copied = os.copy_file_range(source.fileno(), target.fileno(), remaining)
                if copied == 0:
                    break
                remaining -= copied
        except (AttributeError, OSError) as e:  # no copy_file_range here (not Linux), or not between these two
            if isinstance(e, OSError) and e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            remaining = -1
        if remaining:
            source.seek(0)
            target.seek(0)
            target.truncate()
            shutil.copyfileobj(source, target, 16 << 20)


DIGEST = "sha256"  # checkpoints, their shard files and the data's fingerprint (marsgpt/tokens.py) record it
HASH_CHUNK = 16 << 20  # bytes hashed per read


def file_digest(path, size=None):
    """The hex SHA-256 of the first `size` bytes of the file `path` (all of it by default), or None when it has
    fewer."""
    with open(path, "rb", buffering=0) as f:
        return open_file_digest(f, size)


def open_file_digest(f, size=None):
    """file_digest of the file open as `f` (binary), read from its start through its own descriptor: what it hashes
    is that file, whatever is renamed over its path meanwhile."""
    digest, buffer = hashlib.new(DIGEST), bytearray(HASH_CHUNK)
    fd = f.fileno()
    remaining = os.fstat(fd).st_size if size is None else size
    offset = 0
    while remaining:
        read = os.preadv(fd, [memoryview(buffer)[: min(remaining, HASH_CHUNK)]], offset)
        if not read:
            return None
        digest.update(memoryview(buffer)[:read])
        remaining -= read
        offset += read
    return digest.hexdigest()


def os_reason(error):
    """A failed write's OS reason in one line: '[ENOSPC] No space left on device' (the symbol names it for
    grep, the text for people), or the error's own text when it carries no errno."""
    code = getattr(error, "errno", None)
    if code is None or not getattr(error, "strerror", None):
        return str(error) or type(error).__name__
    return f"[{errno.errorcode.get(code, code)}] {error.strerror}"


def atomic_write_bytes(path, data):
    with atomic_writer(path) as f:
        f.write(data)


def fsync_directory(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JSONLineError(ValueError):
    """Line `number` (from 1) of a JSON-lines file is not JSON: `reason` is the JSON parser's, or None when
    the line is not even UTF-8 text. Each reader words the message its user sees from these two."""

    def __init__(self, number, reason):
        super().__init__(f"line {number}: {reason or 'not UTF-8 text'}")
        self.number, self.reason = number, reason


def json_lines(file):
    """(line number from 1, JSON value) for each non-blank line of the JSON-lines file `file`, open in binary
    mode; the first line that is not UTF-8 JSON raises JSONLineError. What a value must hold is the caller's."""
    for number, raw in enumerate(file, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise JSONLineError(number, None) from None
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise JSONLineError(number, e.msg) from None
        yield number, value
