"""marsgpt/compile_cache.py: a compiled run keeps what it compiled in out_dir/compile_cache.bin, and a resume on a
node whose inductor cache is empty (a requeued job elsewhere) compiles none of its graphs again."""

import os
import pickle
import shutil

import pytest
import torch
from train_helpers import Payload, launch, make_char_data, subprocess_env, tiny_args

from marsgpt import compile_cache, metrics, user_key
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
    assert blob_in(cache.path) == b"blob of f1,f2"


def blob_in(path):
    """The blob compile_cache.bin holds after its magic line and header line."""
    with open(path, "rb") as f:
        data = f.read()
    assert data.startswith(compile_cache.MAGIC)
    return data[len(compile_cache.MAGIC) :].partition(b"\n")[2]


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


def hostile_blob(marker):
    """torch's own portable-cache framing around one inductor artifact whose content is Payload's pickle."""
    from torch._inductor.codecache import InductorCacheArtifact
    from torch.compiler._cache import _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    serializer.extend([("inductor", [InductorCacheArtifact("fkey", pickle.dumps(Payload(str(marker))))])])
    return serializer.to_bytes()


def signed_file(blob, key, **fields):
    """compile_cache.bin as CompileCache.save writes it around `blob`, signed with `key`, its header's identity
    fields overridden by `fields`."""
    header = {**compile_cache.identity("cpu"), "bytes": len(blob), **fields}
    header[compile_cache.SIGNATURE] = user_key.signature(key, compile_cache.canonical(header), blob)
    return compile_cache.MAGIC + compile_cache.canonical(header) + b"\n" + blob


def test_the_hostile_blob_runs_its_code_when_torch_is_handed_it(tmp_path):
    """What the cases below guard against is real: torch's loader unpickles the artifact as it loads it."""
    marker = tmp_path / "ran"
    with compile_cache.quiet_torch_logs(), pytest.raises(AttributeError):
        torch.compiler.load_cache_artifacts(hostile_blob(marker))
    assert marker.exists()


@pytest.mark.parametrize(
    "case",
    ["torch's bare blob", "signed with another user's key", "another torch's, signed with this user's key", "garbage"],
)
def test_a_file_this_user_s_runs_did_not_write_for_this_torch_is_skipped_unread(case, tmp_path, capfd):
    """A copied or shared run directory's compile_cache.bin: nothing in it runs, one warning line says why it is
    skipped, torch prints nothing, and the run compiles afresh (held is empty, so this process writes its own)."""
    marker, path = tmp_path / "ran", tmp_path / compile_cache.FILE_NAME
    blob = hostile_blob(marker)
    data = {
        "torch's bare blob": blob,
        "signed with another user's key": signed_file(blob, os.urandom(32)),
        "another torch's, signed with this user's key": signed_file(blob, user_key.user_key(), torch="2.12.0"),
        "garbage": compile_cache.MAGIC + b'{"bytes": 3}\n\xff\xfe\x00',
    }[case]
    path.write_bytes(data)
    cache = CompileCache(str(tmp_path))
    cache.load()
    out, err = capfd.readouterr()
    why = {
        "torch's bare blob": "is not a compile cache this program wrote",
        "signed with another user's key": "was not written by this user's runs",
        "another torch's, signed with this user's key": "was written by torch 2.12.0",
        "garbage": "was not written by this user's runs",
    }[case]
    assert out == "" and len(err.splitlines()) == 1 and err.startswith(f"warning: {path} {why}"), err
    assert err.rstrip().endswith("; compiling afresh")
    assert not marker.exists() and cache.held == frozenset()


def test_whatever_torch_raises_loading_a_verified_file_is_one_warning_line(tmp_path, capfd):
    """This user's own file, for this torch, that torch cannot load (here its artifact is not a compiled graph):
    one line, not torch's traceback; the run compiles afresh."""
    path = tmp_path / compile_cache.FILE_NAME
    path.write_bytes(signed_file(hostile_blob(tmp_path / "ran"), user_key.user_key()))
    cache = CompileCache(str(tmp_path))
    cache.load()
    out, err = capfd.readouterr()
    assert (
        out == ""
        and err
        == f"warning: torch could not load {path} (AttributeError: '_io.TextIOWrapper' object \
has no attribute '_triton_bundle'); compiling afresh\n"
    )
    CompileCache(str(tmp_path / "elsewhere")).load()  # no file: nothing to say
    assert capfd.readouterr() == ("", "")


def test_what_save_writes_load_verifies_and_a_changed_byte_is_refused(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", Saved(["f1"]))
    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: loaded.append(blob))
    CompileCache(str(tmp_path)).save(1)
    CompileCache(str(tmp_path)).load()
    assert loaded == [b"blob of f1"]
    path = tmp_path / compile_cache.FILE_NAME
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    CompileCache(str(tmp_path)).load()
    assert loaded == [b"blob of f1"] and "was not written by this user's runs" in capfd.readouterr().err


def test_the_key_is_made_once_only_its_owner_reads_it_and_a_readable_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    key = user_key.user_key()
    path = user_key.key_path()
    assert len(key) == 32 and user_key.user_key() == key
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    os.chmod(path, 0o644)
    with pytest.raises(user_key.UserKeyError, match="chmod 600 it"):
        user_key.user_key()


def test_a_key_that_cannot_be_made_skips_the_cache_with_one_line(tmp_path, monkeypatch, capfd):
    blocked = tmp_path / "not a directory"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(blocked))
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", Saved(["f1"]))
    cache = CompileCache(str(tmp_path))
    cache.save(1)
    err = capfd.readouterr().err
    assert err.startswith(f"warning: {cache.path} not written: cannot make or open {user_key.key_path()}: [ENOTDIR]")
    assert not os.path.exists(cache.path)


@pytest.mark.slow
def test_a_copied_run_directory_s_hostile_cache_runs_nothing_and_the_resume_equals_one_without_it(data_path, tmp_path):
    """Through the command line: a compiled run's out_dir copied, its compile_cache.bin replaced by a hostile blob in
    this program's framing signed with another user's key; the resume runs nothing, says so in one line, and ends
    exactly where the same resume without the file ends."""
    out = str(tmp_path / "out")
    args = tiny_args(data_path, out, compile=True, max_iters=2, eval_interval=2, eval_iters=2, lr_decay_iters=4)
    train(args, tmp_path / "node_a")
    copies = {}
    for name in ("hostile", "none"):
        copies[name] = str(tmp_path / name)
        shutil.copytree(out, copies[name])
    marker = tmp_path / "ran"
    with open(os.path.join(copies["hostile"], compile_cache.FILE_NAME), "wb") as f:
        f.write(signed_file(hostile_blob(marker), os.urandom(32)))
    os.remove(os.path.join(copies["none"], compile_cache.FILE_NAME))
    ends = {}
    for name, copy in copies.items():
        log = train(
            [
                *tiny_args(data_path, copy, compile=True, max_iters=4, eval_interval=2, eval_iters=2, lr_decay_iters=4),
                "--init_from=auto",
            ],
            tmp_path / f"node_{name}",
        )
        ends[name] = torch.load(os.path.join(copy, "ckpt.pt"), weights_only=True)["model"]
        if name == "hostile":
            assert "was not written by this user's runs" in log and "Traceback" not in log, log
    assert not marker.exists()
    assert all(torch.equal(ends["hostile"][k], ends["none"][k]) for k in ends["none"])
