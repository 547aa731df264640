"""marsgpt/compile_cache.py: a compiled run keeps what it compiled in out_dir/compile_cache.bin, and a resume on a
node whose inductor cache is empty (a requeued job elsewhere) compiles none of its graphs again."""

import os

import pytest
import torch
from train_helpers import launch, make_char_data, subprocess_env, tiny_args

from marsgpt import compile_cache, metrics
from marsgpt.compile_cache import CompileCache


@pytest.fixture
def data_path(tmp_path):
    return make_char_data(str(tmp_path / "data"))


def train(args, inductor_cache):
    """train.py through its command line, with its own inductor cache directory (a node's /tmp); its output."""
    proc = launch(args, env=subprocess_env(TORCHINDUCTOR_CACHE_DIR=str(inductor_cache)))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    return out


def first_steps(out_dir):
    return [r for r in metrics.read_records(out_dir) if metrics.FIRST_STEP_S in r]


@pytest.mark.slow
def test_a_resume_with_an_empty_inductor_cache_compiles_no_graph_again(data_path, tmp_path):
    """The first launch compiles every graph (inductor's C++ kernels, as on a GPU its Triton ones) and writes
    compile_cache.bin with its checkpoint; the resume, its inductor cache directory empty, loads every graph the
    first compiled and compiles none."""
    out = str(tmp_path / "out")
    args = tiny_args(data_path, out, compile=True, max_iters=2, eval_interval=2, eval_iters=2, lr_decay_iters=4)
    train(args, tmp_path / "node_a")
    path = os.path.join(out, compile_cache.FILE_NAME)
    assert os.path.isfile(path)

    log = train([*args, "--max_iters=4", "--init_from=resume"], tmp_path / "node_b")

    cold, resumed = first_steps(out)
    assert resumed[metrics.GRAPHS_COMPILED] == 0 and resumed[metrics.GRAPHS_FROM_CACHE] > 0, resumed
    assert cold[metrics.GRAPHS_COMPILED] > 0
    assert f"compile cache: {cold[metrics.GRAPHS_COMPILED]} compiled graphs from {path}\n" in log, log


class Saved:
    """torch.compiler.save_cache_artifacts as a process that compiled `keys` returns it: (its blob, a CacheInfo)."""

    def __init__(self, keys):
        self.keys, self.calls = keys, 0

    def __call__(self):
        self.calls += 1
        info = torch.compiler._cache.CacheInfo()
        info.artifacts["inductor"].extend(self.keys)
        return b"blob of " + ",".join(self.keys).encode(), info


def test_the_file_is_written_once_a_process_has_trained_and_only_once(tmp_path, monkeypatch):
    """torch 2.13 loads only the last batch of each kind from a blob that save_cache_artifacts() built over
    several calls (each call's new artifacts are a batch): one call per process, after its first step."""
    saved = Saved(["f1", "f2"])
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", saved)
    cache = CompileCache(str(tmp_path), start_iter=7)
    cache.save(7)  # the resumed iteration's checkpoint: nothing trained yet, the training graphs not compiled
    assert saved.calls == 0 and not os.path.exists(cache.path)
    cache.save(8)
    saved.keys = ["f1", "f2", "f3"]
    cache.save(9)
    assert saved.calls == 1
    with open(cache.path, "rb") as f:
        assert f.read() == b"blob of f1,f2"


def test_a_process_that_compiled_nothing_new_leaves_the_file_as_it_is(tmp_path, monkeypatch):
    path = tmp_path / compile_cache.FILE_NAME
    path.write_bytes(b"the earlier launch's")
    cache = CompileCache(str(tmp_path))
    cache.held = frozenset({("inductor", "f1"), ("inductor", "f2")})  # what load() found in it
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", Saved(["f2"]))
    cache.save(1)
    assert path.read_bytes() == b"the earlier launch's"


def test_a_failed_write_is_one_warning_line_naming_the_file_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    os.mkdir(tmp_path / compile_cache.FILE_NAME)  # the rename over it fails: [EISDIR]
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", Saved(["f1"]))
    cache = CompileCache(str(tmp_path))
    cache.save(1)
    err = capsys.readouterr().err
    path = os.path.join(tmp_path, compile_cache.FILE_NAME)
    assert err == f"warning: cannot write {path}: [EISDIR] Is a directory; a resume will compile again\n"
    assert os.listdir(tmp_path) == [compile_cache.FILE_NAME]  # no temporary file left beside it


def test_a_file_torch_cannot_load_is_a_warning_and_the_run_compiles_afresh(tmp_path, capsys):
    path = tmp_path / compile_cache.FILE_NAME
    path.write_bytes(b"\x00not a blob of compile artifacts")
    cache = CompileCache(str(tmp_path))
    cache.load()
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"warning: {path} holds nothing this torch can load; compiling afresh"
    )
    assert cache.held == frozenset()
    CompileCache(str(tmp_path / "elsewhere")).load()  # no file: nothing to say
    assert capsys.readouterr() == ("", "")
