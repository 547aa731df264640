"""Sharded checkpoints: what a zero_stage=3 (FSDP2) run saves -- every rank its own rows, nothing gathered on one
rank -- and how any checkpoint is read back, as this rank's rows on any number of ranks or as whole tensors.

A sharded checkpoint is a checkpoint file and a directory beside it, in out_dir:

    ckpt.pt          a checkpoint file as marsgpt/checkpoint.py writes every checkpoint (checksum trailer, renamed
                     into place whole), holding everything but the sharded tensors: each of those is a meta tensor
                     there (its shape and dtype, no values), and the record `sharded` says where they are: the
                     directory, the SHA-256 and size of each of its files, and each meta tensor's name in them
    shards/<name>/   torch.distributed.checkpoint's files: .metadata and one __<rank>_0.distcp per rank, holding
                     each rank's rows of every sharded tensor (the parameters and the optimizer state)
    previous.pt      the checkpoint file ckpt.pt was before the newest save, with the directory it names, kept until
                     the next: a plain copy of out_dir taken mid-save holds one of the two whole

best.pt and the kept ckpt_<iter>.pt are checkpoint files of their own, each naming a directory of its own (a copy):
they share nothing with ckpt.pt, as in the one-file format. A sharded tensor met twice (the tied token embedding
and output head) is written once, under one name.

Writing (ShardedCheckpointWriter, on every rank): the rank copies its rows to host memory at once, then a
background thread writes them with dcp.save into shards/<name>.tmp -- each file hashed as it is written
(HashingFileSystem) -- the ranks' checksums are gathered on rank 0, which renames the directory to shards/<name>
and only then writes the checkpoint file naming it over the previous one (an atomic rename). The ranks' own
collectives for this run on a process group of their own (gloo), so the background write never meets the
training's collectives. A crash or kill -9 at any moment leaves the previous checkpoint file and the complete
directory it names: the new directory is complete before any file names it, and an unfinished or unnamed one is
removed at the next save or launch (run_dir). A failed write on any rank fails the save on every rank (dcp
reports every rank's failure to all), and the previous checkpoint stays.

Reading (read_checkpoint: a checkpoint of either format): the file as marsgpt/checkpoint.py reads it, then each
file of its directory verified against its recorded checksum; read_shards loads the sharded tensors into tensors
a caller makes for each -- this rank's DTensor rows when a sharded run resumes (only those rows are read), or whole
tensors for a tool or an unsharded run. dcp.load runs with no_dist=True: each rank reads on its own, with no
collective a failing rank could leave the others waiting in; its .metadata is read as data (MetadataUnpickler).
"""

import contextlib
import os
import pickle
import shutil
import sys
import warnings

import torch

from marsgpt import checkpoint
from marsgpt.checkpoint import RESUME_ADVICE, CheckpointError, CheckpointWriter, DamagedCheckpoint, no_space
from marsgpt.files import DIGEST, copy_file, file_digest, fsync_directory, os_reason

SHARDS_DIR = "shards"  # beside the checkpoint files: one directory per sharded checkpoint
# The checkpoint file ckpt.pt was before the newest save, kept (with the directory it names) until the next one: a
# plain copy of out_dir (cp -r, rsync) taken while a save replaces ckpt.pt and its directory holds it whole.
PREVIOUS_NAME = "previous.pt"
SHARDS_KEY = "sharded"  # a sharded checkpoint's record of the directory holding its sharded tensors


def _is_dtensor(tensor):
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def split(state):
    """(state with a meta tensor in place of each DTensor, {name: the DTensor copied to host memory},
    {path name: name}). A DTensor met twice is one name, the first path's."""
    shards, names, seen = {}, {}, {}

    def take(path, tensor):
        if not _is_dtensor(tensor):
            return tensor
        name = seen.setdefault(id(tensor), path_name(path))
        if name not in shards:
            shards[name] = tensor.detach().to("cpu", copy=True)
        names[path_name(path)] = name
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

    return walk(state, take), shards, names


# ---------------------------------------------------------------------------------------------------
# Writing.


def _hashing_writer(path):
    """dcp's FileSystemWriter into `path`, whose files are hashed as they are written: .written maps each file's
    name to (its SHA-256, its size) once it is complete."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        def __init__(self):
            super().__init__()
            self.written = {}

        @contextlib.contextmanager
        def create_stream(self, path, mode):
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            try:
                with super().create_stream(path, mode) as stream:
                    hashing = checkpoint.HashingFile(stream)
                    try:
                        yield hashing
                    except RuntimeError:  # torch.save's "unexpected pos 704 vs 598": the OS's reason instead
                        if hashing.error is None:
                            raise
                        raise hashing.error from None
                    finally:
                        hashing.close()
            except OSError as error:  # in a write, a flush, the fsync or the close: name the file
                if error.errno is None or error.filename is not None:
                    raise
                raise OSError(error.errno, error.strerror, os.path.basename(path)) from None
            self.written[os.path.basename(path)] = (hashing.hash.hexdigest(), hashing.size)

        def rename(self, path, new_path):  # dcp writes .metadata under a temporary name first
            super().rename(path, new_path)
            self.written[os.path.basename(new_path)] = self.written.pop(os.path.basename(path))

    writer = FileSystemWriter(path, sync_files=True, overwrite=False)
    writer.fs = HashingFileSystem()
    return writer


def write(pointer, tree, shards, names, name, group, rank, guard=None):
    """Every rank: dcp.save its rows of `shards` into shards/<name>.tmp beside `pointer`; rank 0 then renames the
    directory to shards/<name>, copies the checkpoint file `pointer` was to previous.pt beside it, and writes `tree`
    with the record of the directory to `pointer`, and returns the record (the other ranks None). A failure on any
    rank raises CheckpointError on every rank, naming the directory and the first rank's OS reason."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    root = os.path.join(os.path.dirname(os.path.abspath(pointer)), SHARDS_DIR)
    directory, staging = os.path.join(root, name), os.path.join(root, name + ".tmp")
    writer = _hashing_writer(staging)
    try:
        dcp.save(shards, storage_writer=writer, process_group=group)
    except (Exception, dcp.api.CheckpointException) as e:  # CheckpointException is a BaseException
        if rank == 0:
            with contextlib.suppress(OSError):
                shutil.rmtree(staging)
        reason, no_space = dcp_failure(e)
        advice = f" (free space in {root})" if no_space else ""
        kept = f"the previous one is kept{advice}"
        raise CheckpointError(f"cannot write checkpoint {staging}: {reason}; {kept}") from None
    written = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(writer.fs.written, written, dst=dist.get_global_rank(group, 0), group=group)
    if rank != 0:
        return None
    files = {file: {"sha256": digest, "size": size} for ranks in written for file, (digest, size) in ranks.items()}
    try:
        os.replace(staging, directory)
        fsync_directory(root)
    except OSError as e:
        kept = "the previous one is kept"
        raise CheckpointError(f"cannot write checkpoint {directory}: {os_reason(e)}; {kept}") from None
    record = {"directory": f"{SHARDS_DIR}/{name}", "files": files, "names": names}
    previous = os.path.join(os.path.dirname(os.path.abspath(pointer)), PREVIOUS_NAME)
    try:
        with contextlib.suppress(FileNotFoundError):  # the first save: nothing before it
            copy_file(pointer, previous, guard)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {previous}: {os_reason(e)}; the previous one is kept") from None
    checkpoint.save_checkpoint(pointer, {**tree, SHARDS_KEY: record}, guard)
    return record


def copy(tree, record, dst, guard=None):
    """Make the checkpoint file `dst` (best.pt, a kept ckpt_<iter>.pt) a copy of the sharded checkpoint whose
    contents are `tree` and `record` (as write returned it, in the same directory) that shares nothing with it:
    its directory copied file by file (files.copy_file) under a name of its own, then `dst` naming it."""
    root = os.path.join(os.path.dirname(os.path.abspath(dst)), SHARDS_DIR)
    source = os.path.join(root, os.path.basename(record["directory"]))
    name = f"{os.path.basename(source)}.{os.path.splitext(os.path.basename(dst))[0]}"
    directory, staging = os.path.join(root, name), os.path.join(root, name + ".tmp")
    try:
        os.makedirs(staging, exist_ok=True)
        for file in record["files"]:
            copy_file(os.path.join(source, file), os.path.join(staging, file))
        os.replace(staging, directory)
        fsync_directory(root)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {directory}: {os_reason(e)}") from None
    checkpoint.save_checkpoint(dst, {**tree, SHARDS_KEY: dict(record, directory=f"{SHARDS_DIR}/{name}")}, guard)


class ShardedCheckpointWriter(CheckpointWriter):
    """CheckpointWriter for a sharded run: every rank calls save() with its state (the same checkpoints, in the
    same order), whose DTensors each rank writes its rows of; rank 0 writes the checkpoint file and its copies.
    `group`: a process group of every rank for the background writes' own collectives; `token`: the same
    string on every rank, unique to this launch, in the names of its directories."""

    def __init__(self, rank, group, token, on_saved=None, on_error=None, guard=None):
        super().__init__(on_saved=on_saved, on_error=on_error, guard=guard)
        self.rank, self.group, self.token, self.saves = rank, group, token, 0

    def save(self, path, state, copies=()):
        self.wait()
        tree, shards, names = split(state)
        tree = checkpoint.cpu_copy(tree) if self.rank == 0 else None
        self.saves += 1
        name = f"{checkpoint.iteration(state):07d}.{self.token}.{self.saves}"

        def write_all():
            record = write(path, tree, shards, names, name, self.group, self.rank, self.guard)
            return self.make_copies(copies if self.rank == 0 else (), lambda dst: copy(tree, record, dst, self.guard))

        self._start(path, write_all, checkpoint.iteration(state))


def remove_unreferenced(out_dir, checkpoints, announce=False):
    """Remove the directories in out_dir/shards that none of the checkpoint files `checkpoints` names (one a crash
    left before its checkpoint file was written, one whose checkpoint file was replaced, a .tmp an interrupted
    write left). Nothing goes when a checkpoint file cannot be read: it might name any of them."""
    root = os.path.join(out_dir, SHARDS_DIR)
    if not os.path.isdir(root):
        return
    named = set()
    for path in checkpoints:
        try:
            record = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get(SHARDS_KEY)
        except Exception:  # damaged, half-written, another program's: it may name any directory
            return
        if record is not None:
            named.add(os.path.basename(record["directory"]))
    for name in sorted(set(os.listdir(root)) - named):
        with contextlib.suppress(OSError):
            shutil.rmtree(os.path.join(root, name))
            if announce:
                print(f"removed {os.path.join(root, name)}, a sharded checkpoint no checkpoint file names", flush=True)


# ---------------------------------------------------------------------------------------------------
# Reading.


def has_shards(ckpt):
    """Whether a checkpoint dict holds placeholders for tensors in a shard directory (zero_stage=3's format)."""
    return SHARDS_KEY in ckpt


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


def read_checkpoint(path, mmap=False, missing_advice=RESUME_ADVICE, verify_checksum=True, whole=True):
    """(the checkpoint dict, its Trailer or None) of the checkpoint at `path` (a file, or a run directory's ckpt.pt)
    in either format: the file as checkpoint.read_file reads it, and a sharded one's directory verified file by file
    (verify_checksum) and its tensors read whole (whole=False: left as placeholders, the directory's path made
    absolute, for a sharded run to read its rows of with read_shards). A directory a save replaced meanwhile is no
    damage: the newer checkpoint is read (checkpoint.read_file)."""
    file = checkpoint.checkpoint_path(path)

    def with_shards(ckpt):
        if not has_shards(ckpt):
            return ckpt
        record = ckpt[SHARDS_KEY]
        ckpt[SHARDS_KEY] = dict(
            record, directory=os.path.join(os.path.dirname(os.path.abspath(file)), record["directory"])
        )
        if verify_checksum:
            verify_shards(ckpt)
        return read_whole(ckpt) if whole else ckpt

    return checkpoint.read_file(file, mmap, missing_advice, verify_checksum, then=with_shards)


def load_checkpoint(path, mmap=False, missing_advice=RESUME_ADVICE, verify_checksum=True, whole=True):
    """read_checkpoint's checkpoint dict alone."""
    return read_checkpoint(path, mmap, missing_advice, verify_checksum, whole)[0]


def new_token(group):
    """A string every rank of `group` agrees on, unique to this launch (rank 0's random one)."""
    import uuid

    import torch.distributed as dist

    token = [uuid.uuid4().hex[:8]]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    return token[0]
