"""This user's signing key: a secret outside every run directory that proves a file in one was written by this
user's own runs, for the one file a run directory holds whose loading runs code (the compile cache).

A run directory is data that anyone who can write it can change: a copy from a colleague, a shared file system
writable by a group. A checkpoint is read without running code (torch.load with weights_only=True), but torch's
compile cache is a pickle, so it is loaded only when its HMAC-SHA256 under this key matches. The key is 32 random
bytes in $XDG_CONFIG_HOME/marsgpt/signing.key (~/.config by default), mode 0600 in a 0700 directory, made on first
use. A cluster's home directory is the same file on every node, so a job requeued elsewhere verifies what it
signed before; a key another user can read or write is not used (anyone able to read it could sign a file).
"""

import contextlib
import hashlib
import hmac
import os
import stat

from marsgpt.files import fsync_directory, os_reason

KEY_BYTES = 32


class UserKeyError(Exception):
    """The key cannot be made or used; the message names the file and the reason."""


def key_path():
    config_home = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(config_home, "marsgpt", "signing.key")


def user_key():
    """The key's bytes, made now when there is none (two processes making it at once agree on one: the file
    appears whole, by a hard link, or not at all). UserKeyError when it cannot be made or read, or another user
    could read or change it."""
    path = key_path()
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            _create(path)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise UserKeyError(f"cannot make or open {path}: {os_reason(e)}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise UserKeyError(
                f"{path} is not a file only its owner can read (mode {stat.filemode(info.st_mode)}): "
                f"chmod 600 it, or remove it to make a new one"
            )
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise UserKeyError(f"{path} holds {len(key)} bytes, not a {KEY_BYTES}-byte key: remove it to make a new one")
    return key


def _create(path):
    """Write a new key under a temporary name, then link it to `path`: FileExistsError when one is there."""
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
    finally:
        os.remove(tmp)
    fsync_directory(os.path.dirname(path))


def signature(key, *parts):
    """The hex HMAC-SHA256 of the byte strings `parts`, each length-prefixed (no two splits sign alike)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.hexdigest()


def signed_by(key, expected, *parts):
    return isinstance(expected, str) and hmac.compare_digest(signature(key, *parts), expected)
