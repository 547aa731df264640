"""Checkpoint files: written atomically in the background with a checksum taken as the bytes are written,
verified on every load, read without running code; and the model loader the tools share.

A checkpoint is one torch.save'd dict that torch.load(weights_only=True) accepts, so loading one cannot
run code: every value is a tensor, a number, a string or a list/tuple/dict of them. It holds

    model_args    the GPTConfig fields the model was built with
    config        the run's full configuration (config.config_to_dict)
    vocabulary    the fingerprint of the data's character vocabulary (tokens.TokenData.vocabulary)
    data_fingerprint  every data file's size and SHA-256 (tokens.fingerprint), metrics_size the size of the
                  run's metrics.jsonl, synced, as the checkpoint was written (marsgpt/run_dir.py adds both)
    <part>        the state_dict() of each stateful part train.py hands to marsgpt/run_dir.py: model,
                  optimizer, scaler, rng (RNGState), progress (train.Progress); the optimizer's is the
                  unsharded optimizer's format also under ZeRO-1 (zero.ShardedOptimizer gathers every
                  rank's share on rank 0), so any number of ranks, sharded or not, resumes it

and nothing else: what a resume restores is exactly what was saved, part by part. The batches need no
state of their own: tokens.TokenData.get_batch is a pure function of (seed, step, micro_step), so the
progress's iter_num and the config are all the sampler needs.

A sharded run (zero_stage=3, FSDP2) writes the same dict with its sharded tensors -- the parameters and the
optimizer state, each rank's rows -- in a directory beside the file, every rank its part, and a meta tensor
(shape and dtype) in their place in the file, which records the directory and its files' checksums
(marsgpt/shards.py). load_checkpoint reads them back whole, so every reader above gets the dict it knows;
a sharded run that resumes reads only its rows.

Integrity. After torch.save's bytes the file ends with a short trailer: a JSON record (the SHA-256 of those
bytes, their count, the checkpoint's iteration) and a fixed-size footer that says how long the record is.
The hash is taken as torch.save writes (HashingFile, in a second thread), so saving reads nothing back; a
load hashes the bytes once before torch.load reads them (from the page cache by then). The trailer is inside
the file, so the file and its checksum are renamed into place together: no crash can pair a new file with
an old checksum, and a copy taken anywhere (cp, rsync) carries its own. torch.load ignores bytes after the
zip archive's end record, so the file stays a plain torch checkpoint. A file without a trailer (written
before checksums, or by another program) loads unverified, and callers say so.

SHA-256 because it is the fastest of hashlib's candidates on CPUs with SHA extensions (bench/bench_checkpoint.py
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
import random
import sys
import threading
import warnings
import weakref
import zipfile

import numpy as np
import torch

from marsgpt.files import DIGEST, atomic_writer, copy_file, file_digest, open_file_digest, os_reason

CKPT_NAME = "ckpt.pt"  # the checkpoint a run directory resumes from (marsgpt/run_dir.py names the rest)
COMPILE_PREFIX = "_orig_mod."  # torch.compile's wrapper names every parameter with this prefix

REQUIRED_KEYS = ("model", "model_args")  # what the tools after training (sample, hellaswag, export) read
SHARDS_KEY = "sharded"  # a sharded checkpoint's record of the directory holding its sharded tensors (shards.py)

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


class MissingPart(CheckpointError):
    """A checkpoint lacks a part the run cannot start without: a part's load_state_dict(None) raises it
    (run_dir.RunDir.restore offers None for a part the checkpoint does not hold, and names every such part)."""


class DataclassState:
    """state_dict()/load_state_dict() for a dataclass of plain values (a run's progress counters), so it is
    a checkpoint part like the model and the optimizer."""

    def state_dict(self):
        return dataclasses.asdict(self)

    def load_state_dict(self, state):
        """Every field the state holds; a field added since the checkpoint was written keeps its value."""
        if state is None:
            raise MissingPart(type(self).__name__)
        for f in dataclasses.fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])


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
TOOL_ADVICE = "train a model first (python train.py ...), or give the out_dir of a trained run"  # the tools'


def has_shards(ckpt):
    """Whether a checkpoint dict holds placeholders for tensors in a shard directory (zero_stage=3's format)."""
    return SHARDS_KEY in ckpt


# ---------------------------------------------------------------------------------------------------
# A sharded checkpoint's tensors, read back (marsgpt/shards.py writes them): every load verifies each file of its
# directory against its recorded checksum, as for a one-file checkpoint; read_shards loads the sharded tensors into
# tensors a caller makes for each -- this rank's DTensor rows when a sharded run resumes (only those rows are read,
# on any number of ranks), or whole tensors for a tool or an unsharded run. dcp.load runs with no_dist=True: each
# rank reads on its own, with no collective a failing rank could leave the others waiting in.


def walk(value, fn, path=()):
    """map_tensors with the place of each tensor: fn(path, tensor), path a tuple of the keys and list indices that
    lead to it."""
    if isinstance(value, torch.Tensor):
        return fn(path, value)
    if isinstance(value, dict):
        return {k: walk(v, fn, (*path, k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(walk(v, fn, (*path, i)) for i, v in enumerate(value))
    return value


def path_name(path):
    """A tensor's name in the shard files: its path, e.g. 'optimizer/state/3/exp_avg' (no key holds a '/')."""
    return "/".join(map(str, path))


def dcp_failure(error):
    """(A failed torch.distributed.checkpoint save or load in one line: the first rank's file and OS reason,
    whether it was a full disk). CheckpointException holds every rank's error."""
    failures = getattr(error, "failures", None)
    if not failures:
        return os_reason(error), no_space(error)
    rank, (first, _) = min(failures.items())
    file = f"{first.filename}: " if getattr(first, "filename", None) else ""
    return f"rank {rank}: {file}{os_reason(first)}", no_space(first)


def verify_shards(ckpt):
    """Check every file of a sharded checkpoint's directory (ckpt as load_checkpoint returns it, the directory's
    path made whole) against the size and SHA-256 recorded as it was written; DamagedCheckpoint naming the first
    that is missing or differs."""
    record = ckpt[SHARDS_KEY]
    directory = record["directory"]
    for file, expected in record["files"].items():
        path = os.path.join(directory, file)
        if not os.path.isfile(path):
            raise DamagedCheckpoint(f"{path} is missing (a file of the sharded checkpoint {directory})")
        if os.path.getsize(path) != expected["size"] or file_digest(path) != expected["sha256"]:
            raise DamagedCheckpoint(
                f"{path} is damaged: its bytes do not match the {DIGEST} recorded when it was written"
            )


class MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint's .metadata read as data: its format is a pickle, which could run any code, so
    only the classes that metadata is made of are found (dcp's metadata dataclasses and storage records, torch's
    dtypes, Size and layouts, paths); anything else is an UnpicklingError, as torch.load(weights_only=True) refuses
    a checkpoint file that names other classes. The checksum in the checkpoint file catches damage; this holds
    against a file someone wrote to run code, with a checksum recomputed to match."""

    ALLOWED = {
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"PosixPath", "PurePosixPath", "Path"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module, name):
        import torch.distributed.checkpoint.metadata as metadata

        found = getattr(metadata, name, None) if module == metadata.__name__ else None
        if isinstance(found, type) and found.__module__ == module:  # a class dcp's metadata module defines
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in self.ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which dcp's metadata never holds")


def _metadata_as_data(directory):
    """dcp's FileSystemReader for `directory`, its .metadata read through MetadataUnpickler here and now:
    DamagedCheckpoint, naming the file, when it is not dcp's metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    path = os.path.join(directory, ".metadata")
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not dcp's Metadata")
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise DamagedCheckpoint(f"{path} cannot be read as dcp's metadata: {e}") from None

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(directory)


def read_shards(ckpt, make):
    """The checkpoint dict `ckpt` (as load_checkpoint returns it, its directory verified) with each meta tensor
    replaced by the tensor make(meta) returns, filled from the shard files: a DTensor gets this rank's rows, a
    plain tensor the whole. Tensors of one name (the tied matrix) are one tensor again."""
    import torch.distributed.checkpoint as dcp  # here: only sharded checkpoints need it

    record = ckpt[SHARDS_KEY]
    names, buffers = record["names"], {}

    def fill(path, tensor):
        if not tensor.is_meta:
            return tensor
        name = names.get(path_name(path))
        if name is None:
            raise DamagedCheckpoint(f"{record['directory']}: no sharded tensor is recorded for {path_name(path)}")
        if name not in buffers:
            buffers[name] = make(tensor)
        return buffers[name]

    tree = walk({k: v for k, v in ckpt.items() if k != SHARDS_KEY}, fill)
    reader = _metadata_as_data(record["directory"])
    try:
        with warnings.catch_warnings():  # no_dist's note that it reads in one process: what it is asked to do
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(buffers, storage_reader=reader, no_dist=True)
    except (Exception, dcp.api.CheckpointException) as e:
        raise CheckpointError(f"{record['directory']} cannot be read: {dcp_failure(e)[0]}") from None
    return tree


def read_whole(ckpt):
    """The checkpoint with every sharded tensor read whole onto the CPU: a one-file checkpoint's dict."""
    return read_shards(ckpt, lambda meta: torch.empty(meta.shape, dtype=meta.dtype))


def load_checkpoint(path, mmap=False, missing_advice=RESUME_ADVICE, verify_checksum=True, whole=True):
    """read_checkpoint's checkpoint dict alone."""
    return read_checkpoint(path, mmap, missing_advice, verify_checksum, whole)[0]


READ_ATTEMPTS = 5  # a reader of a live run's checkpoint that a save keeps replacing tries this often


def read_checkpoint(path, mmap=False, missing_advice=RESUME_ADVICE, verify_checksum=True, whole=True):
    """(the checkpoint dict at `path` (a file, or a run directory), its Trailer or None): checked against its
    checksum and loaded onto the CPU. DamagedCheckpoint names a file whose bytes are not the ones written, or that
    torch cannot read.

    The trailer, the hash and torch.load read one open file, so a reader of a live run (sample.py, hellaswag, an
    export) gets the file it opened whole even when the run renames a newer one over it meanwhile. A sharded
    checkpoint's directory is checked file by file too, and its tensors read whole (whole=False: left as
    placeholders, with the directory's path made absolute, for a sharded run to read its rows of with read_shards);
    when it turns out gone or changed because the run replaced the checkpoint meanwhile, the newer one is read.

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
                return _read_open(f, path, mmap, verify_checksum, whole)
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


def _read_open(f, path, mmap, verify_checksum, whole):
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
    if has_shards(ckpt):
        record = ckpt[SHARDS_KEY]
        folder = os.path.dirname(os.path.abspath(path))
        ckpt[SHARDS_KEY] = dict(record, directory=os.path.join(folder, record["directory"]))
        if verify_checksum:
            verify_shards(ckpt)
        if whole:
            ckpt = read_whole(ckpt)
    return ckpt, trailer


def strip_compile_prefix(state_dict):
    return {k.removeprefix(COMPILE_PREFIX): v for k, v in state_dict.items()}


def is_reference_mask(key):
    """The paper's code saves each layer's causal mask as a buffer 'attn.bias'; our SDPA model has none."""
    return key.endswith(".attn.bias")


def load_model_state(model, state_dict, path):
    """Load `state_dict` into `model`, naming the first key whose presence or shape does not match."""
    state_dict = strip_compile_prefix(state_dict)
    expected = model.state_dict()
    for key, value in expected.items():
        if key not in state_dict:
            raise CheckpointError(
                f"{path}: the checkpoint has no '{key}' (the model was built with a "
                f"different shape; resume with the config it was trained with)"
            )
        if tuple(state_dict[key].shape) != tuple(value.shape):
            raise CheckpointError(
                f"{path}: '{key}' has shape {tuple(state_dict[key].shape)} in the "
                f"checkpoint but {tuple(value.shape)} in the model built from the config"
            )
    extra = [key for key in state_dict if key not in expected and not is_reference_mask(key)]
    if extra:
        raise CheckpointError(
            f"{path}: the checkpoint has '{extra[0]}', which the model built from the "
            f"config lacks (a different number of layers?)"
        )
    model.load_state_dict(state_dict)


def load_pretrained(name, override_args=None):
    """GPT.from_pretrained(name) for train.py, sample.py and marsgpt/hellaswag.py: where the Hugging Face hub cannot
    be reached (a compute node without internet) or is not to be (HF_HUB_OFFLINE=1, Hugging Face's own switch),
    the local cache at once instead of retries. Weights that cannot be loaded (not cached offline, a failed
    download, an unknown name, no transformers) are a CheckpointError: one line in every tool."""
    from marsgpt.runtime import network_reachable
    from model import GPT, HF_CHECKPOINTS, HF_HUB_HOST  # here, as in load_model

    hub_off = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")  # huggingface_hub's values
    offline = name in HF_CHECKPOINTS and (hub_off or not network_reachable(HF_HUB_HOST))
    try:
        return GPT.from_pretrained(name, override_args, offline=offline)
    except (ValueError, ImportError) as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:  # online: the hub's or the file system's own error, on one line
        raise CheckpointError(f"cannot load {name}: {' '.join(str(e).split())}") from None


def load_model(path_or_out_dir, device="cpu", missing_advice=TOOL_ADVICE):
    """(GPT, checkpoint dict): the trained model in eval mode, for sample.py and the hellaswag and export_hf tools."""
    from model import GPT, GPTConfig  # here, so this module stays importable without model.py's cost

    path = checkpoint_path(path_or_out_dir)
    ckpt, trailer = read_checkpoint(path, missing_advice=missing_advice)
    if trailer is None:
        print(
            f"note: {path} has no checksum (written before checksums, or by another program): not verified",
            file=sys.stderr,
        )
    if not isinstance(ckpt["model"], dict) or not isinstance(ckpt["model_args"], dict):
        raise CheckpointError(f"{path} is not a training checkpoint (its model and model_args are not dicts)")
    try:
        config = GPTConfig(**ckpt["model_args"])
    except TypeError as e:  # another model's arguments (a vision/ checkpoint) or a newer model.py's
        raise CheckpointError(f"{path} is not a checkpoint of this repository's GPT ({e})") from None
    model = GPT(config)
    load_model_state(model, ckpt["model"], path)
    model.to(device)
    model.eval()
    return model, ckpt


# ---------------------------------------------------------------------------------------------------
# The parts of a run that are not stateful objects of their own as a checkpoint holds them: the model (its
# weights checked and placed), the GradScaler, the random number generators.


class ModelState:
    """A model as a checkpoint part: its state_dict, and a load_state_dict that places the checkpoint's tensors
    where the model keeps them (`place`: parallel.Parallelism.place_state, FSDP2's rows of a one-file checkpoint's
    whole tensors) and names the first key whose presence or shape does not match (load_model_state; `path` is
    the checkpoint the message names)."""

    def __init__(self, model, place, path):
        self.model, self.place, self.path = model, place, path

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, state):
        if state is None:
            raise MissingPart("model")
        load_model_state(self.model, self.place(state), self.path)


class ScalerState:
    """A torch.amp.GradScaler as a checkpoint part, restored where float16 enables it: a run resumed in bfloat16 or
    float32 drops a float16 run's scale, and one resumed in float16 from a run without a scaler starts afresh."""

    def __init__(self, scaler):
        self.scaler = scaler

    def state_dict(self):
        return self.scaler.state_dict()

    def load_state_dict(self, state):
        if state is None:
            raise MissingPart("scaler")
        if self.scaler.is_enabled() and state:
            self.scaler.load_state_dict(state)


# Random number generator states, in forms weights_only loading accepts (numpy's array becomes a tensor).


class RNGState:
    """The Python, numpy and torch generators of this process, and the CUDA generators of every rank.

    Each rank's CUDA generators differ (they are seeded per device), so state_dict() takes every rank's
    (gathered by the caller: `cuda_by_rank`) and load_state_dict() gives each rank its own when the world
    size (this run's `world_size` ranks) is the same; on a different world size the CUDA generators keep their
    fresh seeds. Nothing in training draws from them between checkpoints except dropout, which is reseeded every
    micro-batch.
    """

    def __init__(self, rank=0, world_size=1, gather=None):
        self.rank, self.world_size = rank, world_size
        self.gather = gather or (lambda state: [state])  # this rank's CUDA state -> every rank's

    def state_dict(self):
        np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return {
            "python": random.getstate(),
            "numpy": {
                "name": np_name,
                "keys": torch.from_numpy(np_keys.astype(np.int64)),
                "pos": int(np_pos),
                "has_gauss": int(np_has_gauss),
                "cached_gaussian": float(np_gauss),
            },
            "torch": torch.get_rng_state(),
            "cuda_by_rank": self.gather(cuda),
        }

    def load_state_dict(self, state):
        if state is None:
            raise MissingPart("rng")
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
        np_state = state["numpy"]
        np.random.set_state(
            (
                np_state["name"],
                np_state["keys"].numpy().astype(np.uint32),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["cached_gaussian"],
            )
        )
        torch.set_rng_state(state["torch"])
        cuda_by_rank = state.get("cuda_by_rank", [])
        if len(cuda_by_rank) == self.world_size and torch.cuda.is_available():
            mine = cuda_by_rank[self.rank]
            if len(mine) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(mine)
