"""What a compiled run compiled, kept in its run directory, so that a resume on another node compiles nothing again.

torch keeps inductor's compiled graphs (and AOTAutograd's entries around them, and on CUDA the Triton kernels) in
a cache directory, by default each node's /tmp: a job a cluster requeues onto other nodes finds it empty and
compiles again (GPT-2 small's whole model took 78.5 s on an H200, docs/gpu.md). torch.compiler's portable caches
serialize every artifact a process compiled or found in its cache into one blob, and put a blob's artifacts into
another process's cache directory, where the compile finds them by key like its own. A compiled process writes
that blob to out_dir/compile_cache.bin with its first checkpoint after it trained, and a resume loads it before
its first compile. The artifacts are keyed by the graph, the torch version, the device and the compile settings:
a blob from another configuration or another torch is loaded and never used. On the CPU, inductor's C++ kernels
are not in it (a resume finds every graph and builds their kernels again). The file is a cache: deleting it
costs only the compile (docs/training.md, "Compiling").
"""

import os
import sys

import torch

from marsgpt import metrics
from marsgpt.files import atomic_write_bytes, os_reason

FILE_NAME = "compile_cache.bin"


def artifact_keys(info):
    """The (kind, key) of every artifact a torch.compiler CacheInfo lists."""
    return frozenset((kind, key) for kind, keys in info.artifacts.items() for key in keys)


class CompileCache:
    """out_dir/compile_cache.bin: loaded by every rank of a resumed run before it compiles (load), written by rank 0
    once a process has trained (save). `announce`: this rank prints what it loaded and a failed read or write (rank
    0); `start_iter`: the iteration the process starts training at."""

    def __init__(self, out_dir, announce=True, start_iter=0):
        self.path = os.path.join(out_dir, FILE_NAME)
        self.announce, self.start_iter = announce, start_iter
        self.held = frozenset()  # the artifacts the file holds, as far as this process knows
        self.saved = False

    def load(self):
        """Fill this process's compile cache from the file, when there is one, and say what it held; one that
        cannot be read gets a warning, and the run compiles afresh."""
        try:
            with open(self.path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return
        except OSError as e:
            self._say(f"warning: cannot read {self.path}: {os_reason(e)}; compiling afresh", sys.stderr)
            return
        info = torch.compiler.load_cache_artifacts(blob)
        if info is None:
            self._say(f"warning: {self.path} holds nothing this torch can load; compiling afresh", sys.stderr)
            return
        self.held = artifact_keys(info)
        self._say(f"compile cache: {len(info.inductor_artifacts)} compiled graphs from {self.path}", sys.stdout)

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
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        blob, info = saved
        if artifact_keys(info) <= self.held:
            return
        try:
            atomic_write_bytes(self.path, blob)
        except OSError as e:
            self._say(f"warning: cannot write {self.path}: {os_reason(e)}; a resume will compile again", sys.stderr)

    def _say(self, line, stream):
        if self.announce:
            print(line, file=stream, flush=True)


def compile_counts():
    """The graphs inductor compiled in this process so far, and those it found in its cache: a compiled run's
    first-step record (metrics.GRAPHS_COMPILED, metrics.GRAPHS_FROM_CACHE)."""
    from torch._dynamo.utils import counters  # here: importing dynamo takes a second a run_dir reader need not pay

    inductor = counters["inductor"]
    return {  # a bypass: a graph inductor compiled without its cache (one it cannot key, or caches turned off)
        metrics.GRAPHS_COMPILED: inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"],
        metrics.GRAPHS_FROM_CACHE: inductor["fxgraph_cache_hit"],
    }
