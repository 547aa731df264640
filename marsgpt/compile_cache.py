"""What a compiled run compiled, kept in its run directory, so that a resume on another node compiles nothing again.

torch keeps inductor's compiled graphs (and AOTAutograd's entries around them, and on CUDA the Triton kernels) in
a cache directory, by default each node's /tmp: a job a cluster requeues onto other nodes finds it empty and
compiles again. torch.compiler's portable caches serialize every artifact a process compiled or found in its cache
into one blob, and put a blob's artifacts into another process's cache directory, where the compile finds them by
key like its own. A compiled process writes that blob to out_dir/compile_cache.bin with its first checkpoint after
it trained, and a resume loads it before its first compile.

Loading the blob unpickles it, which can run any code, so the file is loaded only when it proves two things, both
checked before torch reads a byte of it: that this user's runs wrote it (its HMAC under the user's key,
marsgpt/user_key.py) and that it was written by this torch and Triton for this device. Anything else -- another
user's file, one from another torch release, a damaged one -- is skipped with one line and the run compiles as it
would without it; so is any error torch raises while loading it. The file is a cache: deleting it costs only the
compile (docs/training.md, "Compiling").
"""

import contextlib
import importlib.metadata
import json
import logging
import os
import sys

import torch

from marsgpt import metrics, user_key
from marsgpt.files import atomic_write_bytes, os_reason

FILE_NAME = "compile_cache.bin"
MAGIC = b"marsgpt compile cache 2\n"  # then one line of JSON (Header), then the blob
SIGNATURE = "signature"


def artifact_keys(info):
    """The (kind, key) of every artifact a torch.compiler CacheInfo lists."""
    return frozenset((kind, key) for kind, keys in info.artifacts.items() for key in keys)


def identity(device):
    """What a blob is only good for: the torch and Triton that compiled it and the device it compiled for."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where = f"cuda {torch.cuda.get_device_name(device)} sm_{major}{minor}"
    else:
        where = f"{device.type} {torch.backends.cpu.get_cpu_capability()}"
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    return {"torch": torch.__version__, "triton": triton, "device": where}


def describe(who):
    triton = f", Triton {who.get('triton')}" if who.get("triton") else ""
    return f"torch {who.get('torch')}{triton} on {who.get('device')}"


@contextlib.contextmanager
def quiet_torch_logs():
    """torch logs a failed (de)serialization as a warning with its traceback; the one line here says it instead."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


class CompileCache:
    """out_dir/compile_cache.bin: loaded by every rank of a resumed run before it compiles (load), written by rank 0
    once a process has trained (save). `device`: the run's; `announce`: this rank prints what it loaded and a file
    it skipped or could not write (rank 0); `start_iter`: the iteration the process starts training at."""

    def __init__(self, out_dir, device="cpu", announce=True, start_iter=0):
        self.path = os.path.join(out_dir, FILE_NAME)
        self.device, self.announce, self.start_iter = device, announce, start_iter
        self.held = frozenset()  # the artifacts the file holds, as far as this process knows
        self.saved = False

    def load(self):
        """Fill this process's compile cache from the file, when there is one this user's runs wrote for this torch
        and device; anything else is skipped with a line, and the run compiles afresh."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return
        except OSError as e:
            return self._warn(f"cannot read {self.path}: {os_reason(e)}")
        blob = self._verified_blob(data)
        if blob is None:
            return
        try:
            with quiet_torch_logs():
                info = torch.compiler.load_cache_artifacts(blob)
        except Exception as e:  # another torch's classes, a half-compatible entry: torch's own errors, any
            return self._warn(f"torch could not load {self.path} ({type(e).__name__}: {first_line(e)})")
        if info is None:
            return self._warn(f"{self.path} holds nothing this torch can load")
        self.held = artifact_keys(info)
        self._say(f"compile cache: {len(info.inductor_artifacts)} compiled graphs from {self.path}", sys.stdout)

    def _verified_blob(self, data):
        """The blob in the file's bytes `data` when this user's runs wrote it for this torch and device; else None,
        after the line saying why it is skipped."""
        head, newline, rest = data[len(MAGIC) :].partition(b"\n")
        try:
            header = json.loads(head) if data.startswith(MAGIC) and newline else None
        except ValueError:
            header = None
        if not isinstance(header, dict) or not isinstance(header.get("bytes"), int):
            return self._warn(f"{self.path} is not a compile cache this program wrote")
        if header["bytes"] != len(rest):
            return self._warn(f"{self.path} is damaged: it holds {len(rest):,} bytes of {header['bytes']:,}")
        try:
            key = user_key.user_key()
        except user_key.UserKeyError as e:
            return self._warn(f"{self.path} cannot be verified: {e}")
        fields = {k: v for k, v in header.items() if k != SIGNATURE}
        if not user_key.signed_by(key, header.get(SIGNATURE), canonical(fields), rest):
            return self._warn(
                f"{self.path} was not written by this user's runs (its signature does not match "
                f"{user_key.key_path()}), so it is not loaded"
            )
        mine = identity(self.device)
        if {k: fields.get(k) for k in mine} != mine:
            return self._warn(f"{self.path} was written by {describe(fields)}; this run is {describe(mine)}")
        return rest

    def save(self, iteration):
        """Rank 0, at the checkpoint of `iteration`: at the process's first checkpoint after it trained (its training
        and evaluation graphs compiled by then), write what it compiled or took from its cache when the file lacks
        any of it. Once per process: torch 2.13 serializes each call's new artifacts as a batch of their own, and
        its loader keeps only the last batch of each kind, so a second save_cache_artifacts() would lose the
        first's (graphs a process compiles later, HellaSwag's, are compiled again by a resume). A failed write
        gets a warning and the run goes on (a resume compiles again)."""
        if self.saved or iteration <= self.start_iter:
            return
        self.saved = True
        try:
            with quiet_torch_logs():
                saved = torch.compiler.save_cache_artifacts()
        except Exception as e:
            saved = None
            self._say(f"warning: torch could not serialize its compile cache ({first_line(e)})", sys.stderr)
        if saved is None:
            return
        blob, info = saved
        if artifact_keys(info) <= self.held:
            return
        try:
            key = user_key.user_key()
        except user_key.UserKeyError as e:
            return self._say(f"warning: {self.path} not written: {e}; a resume will compile again", sys.stderr)
        fields = {**identity(self.device), "bytes": len(blob)}
        header = {**fields, SIGNATURE: user_key.signature(key, canonical(fields), blob)}
        try:
            atomic_write_bytes(self.path, MAGIC + canonical(header) + b"\n" + blob)
        except OSError as e:
            self._say(f"warning: cannot write {self.path}: {os_reason(e)}; a resume will compile again", sys.stderr)

    def _warn(self, why):
        self._say(f"warning: {why}; compiling afresh", sys.stderr)

    def _say(self, line, stream):
        if self.announce:
            print(line, file=stream, flush=True)


def canonical(value):
    return json.dumps(value, sort_keys=True).encode()


def first_line(error):
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def compile_counts():
    """The graphs inductor compiled in this process so far, and those it found in its cache: a compiled run's
    first-step record (metrics.GRAPHS_COMPILED, metrics.GRAPHS_FROM_CACHE)."""
    from torch._dynamo.utils import counters  # here: importing dynamo takes a second a run_dir reader need not pay

    inductor = counters["inductor"]
    return {  # a bypass: a graph inductor compiled without its cache (one it cannot key, or caches turned off)
        metrics.GRAPHS_COMPILED: inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"],
        metrics.GRAPHS_FROM_CACHE: inductor["fxgraph_cache_hit"],
    }
