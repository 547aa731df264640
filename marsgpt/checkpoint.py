"""Checkpoint files: written atomically in the background with a checksum taken as the bytes are written, and
verified and read through one open file without running code.

A checkpoint is one torch.save'd dict that torch.load(weights_only=True) accepts, so loading one cannot
run code: every value is a tensor, a number, a string or a list/tuple/dict of them. It holds

    model_args    the GPTConfig fields the model was built with
    config        the run's full configuration (config.config_to_dict)
    vocabulary    the fingerprint of the data's character vocabulary (tokens.TokenData.vocabulary)
    data_fingerprint  every data file's size and SHA-256 (tokens.fingerprint), metrics_size the size of the
                  run's metrics.jsonl, synced, as the checkpoint was written (marsgpt/checkpointer.py adds both)
    <part>        the state_dict() of each stateful part train.py hands to marsgpt/checkpointer.py: model,
                  optimizer, scaler, rng, progress, log_window (marsgpt/checkpoint_parts.py adapts those that are
                  not objects of their own); the optimizer's is the unsharded optimizer's format also under ZeRO-1
                  (zero.ShardedOptimizer gathers every rank's share on rank 0), so any number of ranks, sharded or
                  not, resumes it

and nothing else: what a resume restores is exactly what was saved, part by part. The batches need no
state of their own: tokens.TokenData.get_batch is a pure function of (seed, step, micro_step), so the
progress's iter_num and the config are all the sampler needs. A sharded run (zero_stage=3) writes the same dict
with a placeholder for each sharded tensor and a directory of their rows beside it (marsgpt/shards.py, which also
reads a checkpoint of either format).

Integrity. After torch.save's bytes the file ends with a short trailer: a JSON record (the SHA-256 of those
bytes, their count, the checkpoint's iteration) and a fixed-size footer that says how long the record is.
The hash is taken as torch.save writes (HashingFile, in a second thread), so saving reads nothing back; a
load hashes the bytes once before torch.load reads them (from the page cache by then), through the same open
file, so a file renamed over the path meanwhile cannot be taken for damage. The trailer is inside the file, so the
file and its checksum are renamed into place together: no crash can pair a new file with an old checksum, and a
copy taken anywhere (cp, rsync) carries its own. torch.load ignores bytes after the zip archive's end record, so
the file stays a plain torch checkpoint. A file without a trailer (written before checksums, or by another
program) loads unverified, and callers say so.

SHA-256 because it is the fastest of hashlib's candidates on CPUs with SHA extensions (bench/bench_run_dir.py
measures them) and `sha256sum` can check it by hand: `head -c <size> ckpt.pt | sha256sum`.
"""

import concurrent.futures
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import pickle
import threading
import weakref
import zipfile

import torch

from marsgpt.files import DIGEST, atomic_writer, copy_file, open_file_digest, os_reason

CKPT_NAME = "ckpt.pt"  # the checkpoint a run directory resumes from (marsgpt/run_dir.py names the rest)

REQUIRED_KEYS = ("model", "model_args")  # what the tools after training (sample, hellaswag, export) read

# The last bytes of a checkpoint with a checksum: this prefix, the JSON record's length in 10 digits, "\n".
FOOTER_PREFIX = b"\n#marsgpt checksum record of "
FOOTER_SIZE = len(FOOTER_PREFIX) + 11


class CheckpointError(Exception):
    """A missing, corrupt or mismatching checkpoint; the message is the one line the user sees."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint file that cannot be what was written: its bytes do not match its checksum, or torch cannot
    read it. run_dir falls back to an older checkpoint past one of these; the tools refuse it."""


def checkpoint_path(path):
    """`path` itself when it names a file, else the checkpoint a resume continues in the run directory `path`
    (the run directory's other files are marsgpt/run_dir.py's)."""
    return os.path.join(path, CKPT_NAME) if os.path.isdir(path) else path


class HashingFile:
    """A binary file that hashes what is written through it, and keeps the first OSError a write raised.

    A large write is hashed by a second thread while this one writes it: both let go of the GIL, so the
    checksum costs little more time than the write alone (bench/bench_run_dir.py). The write returns only
    once its bytes are hashed too, as torch.save may reuse its buffer after that. torch.save turns an error
    of its file object into "unexpected pos 704 vs 598" (the bytes it expected to have written); the OSError
    kept here is the reason to report: [ENOSPC] No space left on device."""

    PARALLEL_BYTES = 1 << 20  # smaller writes (zip headers, small tensors) are hashed in line

    def __init__(self, file):
        self.file, self.hash, self.size, self.error = file, hashlib.new(DIGEST), 0, None
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint hash")

    def write(self, data):
        size = memoryview(data).nbytes
        hashing = self._hasher.submit(self.hash.update, data) if size >= self.PARALLEL_BYTES else None
        try:
            written = self.file.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        finally:
            if hashing is not None:
                hashing.result()
        if hashing is None:
            self.hash.update(data)
        self.size += size
        return written

    def flush(self):
        self.file.flush()

    def tell(self):  # written from the file's start, in order (torch.save; dcp's writer)
        return self.size

    def fileno(self):  # dcp's writer fsyncs each file it writes
        return self.file.fileno()

    def close(self):
        self._hasher.shutdown()


def iteration(ckpt):
    """The step a checkpoint was saved after (its progress part's iter_num), or None when it has none."""
    progress = ckpt.get("progress")
    return progress.get("iter_num") if isinstance(progress, dict) else None


def save_checkpoint(path, state, guard=None):
    """Write `state` to `path` atomically, with its checksum trailer: a crash, kill -9 or full disk leaves any
    previous file intact. A failure raises CheckpointError naming the file and the OS reason. `guard`: called
    before the file is renamed into place (files.atomic_writer); what it raises leaves the previous file."""
    try:
        with atomic_writer(path, guard=guard) as f, contextlib.closing(HashingFile(f)) as hashing:
            try:
                torch.save(state, hashing)
            except RuntimeError:
                if hashing.error is not None:  # the OS's reason, not torch's "unexpected pos"
                    raise hashing.error from None
                raise
            record = json.dumps({DIGEST: hashing.hash.hexdigest(), "size": hashing.size, "iter": iteration(state)})
            f.write(record.encode() + FOOTER_PREFIX + b"%010d\n" % len(record))
    except (OSError, RuntimeError) as e:
        advice = f" (free space in {os.path.dirname(os.path.abspath(path))})" if no_space(e) else ""
        raise CheckpointError(
            f"cannot write checkpoint {path}: {os_reason(e)}; the previous one is kept{advice}"
        ) from None


def no_space(error):
    return getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT)


def keep_copy(src, dst, guard=None):
    """Make `dst` an independent copy of the finished checkpoint `src` (best.pt, kept ckpt_<iter>.pt): damage
    done to one file later never reaches the other (files.copy_file). Its trailer comes along, so the copy
    verifies on its own."""
    try:
        copy_file(src, dst, guard)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {dst}: {os_reason(e)}") from None


@dataclasses.dataclass
class Trailer:
    """What a checkpoint's trailer records: the checksum of the `size` bytes before it, and the iteration."""

    digest: str
    size: int
    iter: int | None


def read_trailer(path):
    """The Trailer at the end of the checkpoint file `path`, or None when it has none (a file from before
    checksums, or another program's). DamagedCheckpoint when the file's end is a trailer that cannot be the
    one written (its length does not fit the file's)."""
    with open(path, "rb") as f:
        return trailer_of(f, path)


def trailer_of(f, path):
    """read_trailer of the checkpoint open as `f` (binary), read through its descriptor; `path` names it."""
    file_size = os.fstat(f.fileno()).st_size
    if file_size < FOOTER_SIZE:
        return None
    footer = os.pread(f.fileno(), FOOTER_SIZE, file_size - FOOTER_SIZE)
    if not (footer.startswith(FOOTER_PREFIX) and footer[-11:-1].isdigit()):
        return None
    record_size = int(footer[-11:-1])
    try:
        record = json.loads(os.pread(f.fileno(), record_size, max(file_size - FOOTER_SIZE - record_size, 0)))
        trailer = Trailer(record[DIGEST], int(record["size"]), record["iter"])
    except (ValueError, KeyError, TypeError):
        raise DamagedCheckpoint(f"{path} is damaged: its checksum record cannot be read") from None
    if trailer.size + record_size + FOOTER_SIZE != file_size:
        raise DamagedCheckpoint(
            f"{path} is damaged: it has {file_size:,} bytes but was written with "
            f"{trailer.size + record_size + FOOTER_SIZE:,}"
        )
    return trailer


def verify(path):
    """Check the checkpoint file `path` against its checksum, reading it once; return its Trailer, or None when
    it has none (nothing to check against). DamagedCheckpoint, naming the file, when the bytes differ."""
    with open(path, "rb") as f:
        return verified_trailer(f, path)


def verified_trailer(f, path):
    """verify of the checkpoint open as `f`: its trailer and its hash read through one descriptor, so a file renamed
    over `path` meanwhile does not make this one look damaged."""
    trailer = trailer_of(f, path)
    if trailer is not None and open_file_digest(f, trailer.size) != trailer.digest:
        raise DamagedCheckpoint(f"{path} is damaged: its bytes do not match the {DIGEST} recorded when it was written")
    return trailer


_handed_over = weakref.WeakValueDictionary()  # id -> CPU tensor that hand_over gave to the next cpu_copy


def hand_over(state):
    """Give the CPU tensors of `state`, private copies their maker keeps no reference to (the ZeRO-1
    optimizer's gathered state), to the next cpu_copy that meets them: it takes their storage as it is
    instead of copying it again. Returns `state`. Each tensor is handed over once, so a tensor that later
    becomes live (loaded into an optimizer, say) is copied like any other at the next save."""
    for tensor in tensors_of(state):
        if tensor.device.type == "cpu":
            _handed_over[id(tensor)] = tensor
    return state


def map_tensors(value, fn):
    """A state tree (dicts, lists and tuples) with fn(tensor) in place of each tensor, depth first."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def tensors_of(value):
    """Every tensor of a state tree, in map_tensors' order."""
    found = []
    map_tensors(value, found.append)
    return found


def cpu_copy(value):
    """A deep copy of a state tree with every tensor copied to the CPU: what the background write
    serialises while training goes on changing the live tensors (and the live lr values).

    Tensors that share storage share it in the copy too, as torch.save keeps them: the tied token embedding
    and output head are one matrix in the checkpoint, not two. Each storage is copied once and whole (what
    torch.save writes of it anyway). The storage of a CPU tensor given to hand_over is taken as it is. Meta
    tensors (a sharded checkpoint's placeholders) have nothing to copy and stay.
    """
    storages = {}  # (device, address) of each storage met so far -> its CPU copy

    def copy(tensor):
        if tensor.is_meta:
            return tensor
        handed_over = _handed_over.pop(id(tensor), None) is tensor
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if key not in storages:
            if handed_over:
                storages[key] = storage
            else:
                storages[key] = storage.clone() if tensor.device.type == "cpu" else storage.cpu()
        view = torch.empty(0, dtype=tensor.dtype)
        return view.set_(storages[key], tensor.storage_offset(), tensor.size(), tensor.stride())

    return map_tensors(value, copy)


class CheckpointWriter:
    """Writes checkpoints in a background thread, so training goes on while the bytes reach storage.

    save() takes a CPU copy of the state at once (the checkpoint is exactly the state at that moment),
    then a thread writes it atomically and makes its copies (best.pt, kept ones). One write is in flight
    at a time: the next save, or wait(), first waits for it and raises its error, if any (always a
    CheckpointError, whatever went wrong). The thread also hands each outcome to its caller the moment it
    is known: on_saved(path, iteration, copies) once the file is in place (`copies`: those made; a copy that
    fails does not unmake the file), on_error(error) after a failure, so a failed write is reported at once
    rather than at the next save. `guard` is called before each file is renamed into place (save_checkpoint).
    With a GPT-2 XL checkpoint (~25 GB) on storage at 40 MB/s a synchronous save would stall every rank for ten
    minutes and trip the collective timeout; here it costs the device-to-host copy. The cost is host memory for
    one copy of the state on the saving rank.
    """

    def __init__(self, on_saved=None, on_error=None, guard=None):
        self._done = threading.Event()  # no write in flight
        self._done.set()
        self._error = None
        self.on_saved, self.on_error, self.guard = on_saved, on_error, guard
        self.iteration = None  # the iteration of the checkpoint in flight, or of the last one started

    def save(self, path, state, copies=()):
        self.wait()
        snapshot = cpu_copy(state)

        def write():
            save_checkpoint(path, snapshot, self.guard)
            return self.make_copies(copies, lambda dst: keep_copy(path, dst, self.guard))

        self._start(path, write, iteration(state))

    @staticmethod
    def make_copies(copies, copy):
        """copy(dst) for each of `copies` until one fails: (the copies made, the CheckpointError or None)."""
        made = []
        for dst in copies:
            try:
                copy(dst)
            except CheckpointError as e:
                return made, e
            made.append(dst)
        return made, None

    def _start(self, path, write, iteration):
        """Run write() in the writer's thread: it writes the file (raising when that fails) and returns what
        make_copies returns. The outcome goes to on_saved(path, iteration, copies made) and on_error."""
        self._done.clear()
        self.iteration = iteration
        threading.Thread(target=self._write, args=(path, write, iteration), daemon=False).start()

    def _write(self, path, write, iteration):
        try:
            written = False
            try:
                made, error = write()
                written = True
            except CheckpointError as e:
                error = e
            except Exception as e:  # anything else would end the thread unseen, and training would go on unsaved
                error = CheckpointError(f"cannot write checkpoint {path}: {type(e).__name__}: {e}")
                error.__cause__ = e
            if written and self.on_saved is not None:
                self.on_saved(path, iteration, made)
            if error is not None:
                self._error = error
                if self.on_error is not None:
                    self.on_error(error)
        finally:
            self._done.set()

    @property
    def in_flight(self):
        return not self._done.is_set()

    def wait(self):
        """Block until the write in flight is on disk; raise its error, if it had one.

        It waits on an Event, not on Thread.join: a KeyboardInterrupt (Ctrl-C) that arrives inside join() makes
        Python 3.11 mark the thread as stopped while it still writes, so every later join() -- the one on the
        way out, the interpreter's own at exit -- returns at once and the process ends mid-write. An
        interrupted Event.wait() leaves the Event as it was: the next wait() still waits."""
        self._done.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error


RESUME_ADVICE = "train with --init_from=scratch first, or point out_dir at the run to resume"  # train.py's


READ_ATTEMPTS = 5  # a reader of a live run's checkpoint that a save keeps replacing tries this often


def read_file(path, mmap=False, missing_advice=RESUME_ADVICE, verify_checksum=True, then=None):
    """(then(the checkpoint dict) -- by default the dict --, its Trailer or None) of the checkpoint file at `path` (a
    file, or a run directory's ckpt.pt), checked against its checksum and loaded onto the CPU. DamagedCheckpoint names
    a file whose bytes are not the ones written, or that torch cannot read.

    The trailer, the hash and torch.load read one open file, so a reader of a live run (sample.py, hellaswag, an
    export) gets the file it opened whole even when the run renames a newer one over it meanwhile. `then` runs while
    the file is open (a sharded checkpoint's directory is verified and read there: shards.read_checkpoint); when
    the read or `then` raises a CheckpointError and `path` names another file by then, the newer one is read.

    mmap=True maps the file instead of reading it: the tensors are paged in from the page cache as they
    are copied to their device, so the 8 ranks of a node resuming a GPT-2 XL run share one copy of the
    file in memory instead of holding 8 (about 200 GB). The mapping is private (copy-on-write), and
    checkpoints are only ever replaced by a rename, which leaves a mapped file intact. `missing_advice`
    ends the error for a missing file: what the user of this tool should do. verify_checksum=False skips the
    hashing passes, for a file this process has just verified.
    """
    path = checkpoint_path(path)
    for attempt in range(READ_ATTEMPTS):
        try:
            f = open(path, "rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise CheckpointError(f"no checkpoint at {path}; {missing_advice}") from None
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {os_reason(e)}") from None
        with f:
            try:
                ckpt, trailer = _read_open(f, path, mmap, verify_checksum)
                return (ckpt if then is None else then(ckpt)), trailer
            except CheckpointError:
                if attempt + 1 == READ_ATTEMPTS or not replaced(path, f):
                    raise


def replaced(path, f):
    """Whether `path` names another file now than the one open as `f` (a rename over it)."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    opened = os.fstat(f.fileno())
    return (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino)


def _read_open(f, path, mmap, verify_checksum):
    trailer = verified_trailer(f, path) if verify_checksum else trailer_of(f, path)
    # torch maps a path, not a file object: /proc/self/fd/<n> is the path of the file open as f (Linux)
    source = f"/proc/self/fd/{f.fileno()}" if os.path.isdir("/proc/self/fd") else path
    try:
        ckpt = torch.load(source if mmap else f, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DamagedCheckpoint(
            f"{path} is not a readable checkpoint ({reason}); it may be truncated or from an incompatible version"
        ) from None
    if mmap and source == path and replaced(path, f):
        raise DamagedCheckpoint(f"{path} was replaced while it was read")
    if not isinstance(ckpt, dict) or any(key not in ckpt for key in REQUIRED_KEYS):
        raise CheckpointError(f"{path} is not a training checkpoint (expected the keys {', '.join(REQUIRED_KEYS)})")
    return ckpt, trailer
