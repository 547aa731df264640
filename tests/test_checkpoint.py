"""marsgpt/checkpoint.py: atomic and background saves, checksums, independent copies, safe and memory-mapped
loads, the RNG part."""

import contextlib
import dataclasses
import errno
import hashlib
import os
import pickle
import random
import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch
from train_helpers import Payload

from marsgpt import checkpoint, checkpoint_parts, shards, trained_model
from marsgpt.files import file_digest
from marsgpt.parallel import Parallelism


def state(value, iter_num=0):
    return {"model": {"w": torch.full((3,), float(value))}, "model_args": {}, "progress": {"iter_num": iter_num}}


def test_save_interrupted_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save_checkpoint(path, state(1, iter_num=1))

    def disk_full(obj, f):
        f.write(b"partial bytes")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    with pytest.raises(checkpoint.CheckpointError, match="No space left on device; the previous one is kept"):
        checkpoint.save_checkpoint(path, state(2, iter_num=2))
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left
    assert shards.load_checkpoint(path)["progress"]["iter_num"] == 1


def test_checkpoints_load_without_running_code(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = tmp_path / "evil.pt"
    torch.save({"model": Payload(), "model_args": {}}, path)
    with pytest.raises(checkpoint.CheckpointError, match="not a readable checkpoint"):
        shards.load_checkpoint(str(path))


def test_memory_mapped_load_equals_a_plain_load(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    saved = {"model": {"w": torch.randn(64, 32)}, "model_args": {"n": 1}, "optimizer": {"m": torch.randn(7)}}
    checkpoint.save_checkpoint(path, saved)
    plain, mapped = shards.load_checkpoint(path), shards.load_checkpoint(path, mmap=True)
    assert torch.equal(plain["model"]["w"], mapped["model"]["w"])
    assert torch.equal(plain["optimizer"]["m"], mapped["optimizer"]["m"]) and mapped["model_args"] == {"n": 1}


def test_writer_saves_the_state_as_it_was_when_save_was_called(tmp_path, monkeypatch):
    """Training goes on changing the live tensors while the background thread writes: the file must hold
    the values at the moment of save(), and the copies (best.pt) the same bytes."""
    gate, real_save = threading.Event(), checkpoint.torch.save

    def slow_save(obj, f):
        assert gate.wait(10)
        real_save(obj, f)

    monkeypatch.setattr(checkpoint.torch, "save", slow_save)
    live = {"model": {"w": torch.ones(4)}, "model_args": {}, "optimizer": {"param_groups": [{"lr": 0.1}]}}
    writer = checkpoint.CheckpointWriter()
    path, best = str(tmp_path / "ckpt.pt"), str(tmp_path / "best.pt")
    writer.save(path, live, copies=[best])
    live["model"]["w"].add_(5.0)  # the next training step, while the write is in flight
    live["optimizer"]["param_groups"][0]["lr"] = 0.2
    assert not os.path.exists(path)
    gate.set()
    writer.wait()
    for saved in (shards.load_checkpoint(path), shards.load_checkpoint(best)):
        assert torch.equal(saved["model"]["w"], torch.ones(4))
        assert saved["optimizer"]["param_groups"][0]["lr"] == 0.1


def tensors(state):
    """Every tensor of a state tree, depth first."""
    if torch.is_tensor(state):
        return [state]
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else []
    return [t for v in values for t in tensors(v)]


def tied_gpt(seed=0):
    """A 1-layer GPT whose tied embedding (1024 x 32) is most of its bytes."""
    from model import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=1024))


def test_writer_saves_the_tied_embedding_and_output_head_once_and_loads_them_tied(tmp_path):
    model = tied_gpt()
    sd = model.state_dict()
    wte, head = sd["transformer.wte.weight"], sd["lm_head.weight"]
    assert wte.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()  # one matrix in the model
    tied_bytes = wte.numel() * wte.element_size()
    path = str(tmp_path / "ckpt.pt")
    writer = checkpoint.CheckpointWriter()
    writer.save(path, {"model": sd, "model_args": dataclasses.asdict(model.config)})
    writer.wait()
    unique_bytes = sum(t.numel() * t.element_size() for t in model.parameters())  # the tie counted once
    assert unique_bytes < os.path.getsize(path) < unique_bytes + tied_bytes / 4
    saved = shards.load_checkpoint(path)["model"]
    assert (
        saved["transformer.wte.weight"].untyped_storage().data_ptr()
        == saved["lm_head.weight"].untyped_storage().data_ptr()
    )
    loaded, _ = trained_model.load_model(path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert torch.equal(loaded.lm_head.weight, head)


def test_a_checkpoint_with_two_copies_of_the_tied_matrix_still_loads_tied(tmp_path):
    """Checkpoints written before the copy kept the tie hold the embedding and the head as two equal tensors."""
    model = tied_gpt()
    sd = {k: v.clone() for k, v in model.state_dict().items()}  # every entry its own storage, as they were
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save_checkpoint(path, {"model": sd, "model_args": dataclasses.asdict(model.config)})
    loaded, _ = trained_model.load_model(path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert all(torch.equal(v, sd[k]) for k, v in loaded.state_dict().items())


@pytest.mark.parametrize("optimizer", ["mars-adamw", "adamw", "muon"])
def test_the_copy_shares_storage_exactly_where_the_training_state_does(optimizer):
    """The model's tie is kept; the optimizer's state (which never aliases a parameter) stays apart."""
    from marsgpt.config import TrainConfig
    from marsgpt.training_optimizer import build_optimizer

    model = tied_gpt()
    cfg = dataclasses.replace(TrainConfig(), optimizer=optimizer, n_layer=1, n_head=2, n_embd=32)
    optimizer = build_optimizer(model, cfg, Parallelism.single())
    x = torch.randint(0, 1024, (2, 16))
    model(x, x)[1].backward()
    optimizer.step()
    live = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    copy = checkpoint.cpu_copy(live)

    def storages(state):
        return [t.untyped_storage().data_ptr() for t in tensors(state) if t.numel()]

    live_storages, copied_storages = storages(live), storages(copy)
    assert len(set(live_storages)) == len(live_storages) - 1  # the tie, and nothing else
    assert [live_storages.index(s) for s in live_storages] == [copied_storages.index(s) for s in copied_storages]
    assert not set(live_storages) & set(copied_storages)  # a copy: training goes on changing the live tensors
    assert all(torch.equal(a, b) for a, b in zip(tensors(live), tensors(copy)))


def test_a_handed_over_state_is_taken_once_as_it_is_and_copied_after():
    """The ZeRO-1 optimizer's gathered state is a private host copy: the save takes it without a second copy.
    A live CPU tensor is copied, and so is a handed-over one at the next save (it may be live by then)."""
    gathered, live = torch.randn(8), torch.randn(8)
    state = {"optimizer": checkpoint.hand_over({"m": gathered}), "model": {"w": live}}
    first, second = checkpoint.cpu_copy(state), checkpoint.cpu_copy(state)
    assert first["optimizer"]["m"].data_ptr() == gathered.data_ptr()
    assert second["optimizer"]["m"].data_ptr() != gathered.data_ptr()
    assert first["model"]["w"].data_ptr() != live.data_ptr()
    assert torch.equal(second["optimizer"]["m"], gathered) and torch.equal(first["model"]["w"], live)


def test_writer_reports_a_failed_write_at_the_next_wait(tmp_path, monkeypatch):
    def disk_full(obj, f):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    writer = checkpoint.CheckpointWriter()
    writer.save(str(tmp_path / "ckpt.pt"), state(1))
    with pytest.raises(checkpoint.CheckpointError, match="No space left on device"):
        writer.wait()
    writer.wait()  # reported once
    assert os.listdir(tmp_path) == []


def test_writer_reports_any_failure_of_its_thread_as_a_checkpoint_error(tmp_path, monkeypatch):
    """An error save_checkpoint does not translate (here a state torch.save cannot pickle) must not end the
    thread unseen, leaving training to go on as if the checkpoint were on disk."""

    def unpicklable(obj, f):
        raise TypeError("cannot pickle 'generator' object")

    monkeypatch.setattr(checkpoint.torch, "save", unpicklable)
    writer = checkpoint.CheckpointWriter()
    writer.save(str(tmp_path / "ckpt.pt"), state(1))
    with pytest.raises(checkpoint.CheckpointError, match="cannot pickle 'generator' object") as raised:
        writer.wait()
    assert isinstance(raised.value.__cause__, TypeError)
    writer.wait()  # reported once
    assert os.listdir(tmp_path) == []


def interrupt_once_waiting(thread):
    """Raise KeyboardInterrupt in `thread` (the main thread) as Ctrl-C does, once it is blocked inside
    CheckpointWriter.wait (in an Event's Condition.wait, or a Thread.join's lock)."""
    blocking = (threading.Condition.wait.__code__, threading.Thread._wait_for_tstate_lock.__code__)

    def calls(frame):
        while frame is not None:
            yield frame.f_code
            frame = frame.f_back

    while True:
        stack = list(calls(sys._current_frames()[thread.ident]))
        if stack[0] in blocking and checkpoint.CheckpointWriter.wait.__code__ in stack:
            break
        time.sleep(0.001)
    signal.pthread_kill(thread.ident, signal.SIGINT)


def test_a_wait_interrupted_by_ctrl_c_still_waits_for_the_write_the_next_time(tmp_path, monkeypatch):
    """Ctrl-C lost the checkpoint in flight because Python 3.11's Thread.join, interrupted by KeyboardInterrupt,
    marks the still-running thread as stopped: the next join (train.py's way out, the interpreter's at exit)
    returned at once and the process ended mid-write. The writer waits on an Event instead: after an
    interrupted wait, the next one still waits until the file is written."""
    release, real_save = threading.Event(), checkpoint.save_checkpoint

    def held_save(path, snapshot, guard=None):
        release.wait()
        real_save(path, snapshot, guard)

    monkeypatch.setattr(checkpoint, "save_checkpoint", held_save)
    writer = checkpoint.CheckpointWriter()
    writer.save(str(tmp_path / "ckpt.pt"), state(1, iter_num=8))
    threading.Thread(target=interrupt_once_waiting, args=(threading.main_thread(),)).start()
    with pytest.raises(KeyboardInterrupt):
        writer.wait()
    assert writer.in_flight
    threading.Thread(target=lambda: (interrupt_once_waiting(threading.main_thread()), release.set())).start()
    with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C, while the write goes on
        writer.wait()
    writer.wait()  # returns only once the held write is done
    assert shards.load_checkpoint(tmp_path / "ckpt.pt")["progress"]["iter_num"] == 8


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_kept_copies_are_independent_of_the_checkpoint(tmp_path, monkeypatch, kernel_copy):
    """best.pt and ckpt_<iter>.pt share nothing with ckpt.pt: truncating it, or `cp other.pt ckpt.pt` (which
    writes into its inode), leaves them whole and verifiable. Where copy_file_range cannot copy between the
    two files, a plain copy does the same."""
    if not kernel_copy:

        def cross_device(*args):
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", cross_device)
    path, other = str(tmp_path / "ckpt.pt"), str(tmp_path / "other.pt")
    checkpoint.save_checkpoint(path, state(1))
    checkpoint.save_checkpoint(other, state(2))
    copies = [str(tmp_path / "best.pt"), str(tmp_path / "ckpt_0000002.pt")]
    for copy in copies:
        checkpoint.keep_copy(path, copy)
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "ckpt.pt", "ckpt_0000002.pt", "other.pt"]  # no temporary file
    original = open(path, "rb").read()
    assert all(open(copy, "rb").read() == original for copy in copies)
    assert all(os.stat(copy).st_nlink == 1 and not os.path.samefile(path, copy) for copy in copies)
    os.truncate(path, 100)
    with open(other, "rb") as source, open(path, "r+b") as target:  # what cp does: the same inode, new bytes
        target.write(source.read())
    for copy in copies:
        assert open(copy, "rb").read() == original
        assert shards.load_checkpoint(copy)["model"]["w"][0] == 1.0


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    path = str(tmp_path / "rng.pt")
    rng = checkpoint_parts.RNGState()
    checkpoint.save_checkpoint(path, {"model": {}, "model_args": {}, "rng": rng.state_dict()})
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    rng.load_state_dict(shards.load_checkpoint(path)["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_rng_part_holds_every_rank_s_cuda_state_and_gives_each_rank_its_own(monkeypatch):
    """Each rank's CUDA generators are saved (gathered by rank) and restored on the same rank."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.tensor([7], dtype=torch.uint8)])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.append(states[0].item()))
    per_rank = [[torch.tensor([10 + r], dtype=torch.uint8)] for r in range(3)]
    saved = checkpoint_parts.RNGState(rank=0, gather=lambda mine: per_rank).state_dict()
    assert [s[0].item() for s in saved["cuda_by_rank"]] == [10, 11, 12]
    checkpoint_parts.RNGState(rank=2, world_size=3).load_state_dict(saved)
    assert restored == [12]
    checkpoint_parts.RNGState(rank=1, world_size=2).load_state_dict(saved)  # another world size: fresh seeds kept
    assert restored == [12]


def test_iteration_reads_the_progress_part_train_py_saves():
    assert checkpoint.iteration(state(0, iter_num=7)) == 7
    assert checkpoint.iteration({"model": {}, "model_args": {}}) is None  # not written by train.py


def test_a_missing_checkpoint_gives_each_caller_its_advice(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="train with --init_from=scratch first"):
        shards.load_checkpoint(tmp_path)  # train.py's resume
    with pytest.raises(checkpoint.CheckpointError, match=r"no checkpoint at .*; train a model first \(python train"):
        trained_model.load_model(tmp_path)  # the tools after training
    with pytest.raises(checkpoint.CheckpointError, match="; do this$"):
        trained_model.load_model(tmp_path, missing_advice="do this")


def test_load_model_refuses_a_checkpoint_of_another_model(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save_checkpoint(path, {"model": {}, "model_args": {"num_classes": 10}})  # a vision/ checkpoint
    with pytest.raises(checkpoint.CheckpointError, match="is not a checkpoint of this repository's GPT"):
        trained_model.load_model(path)
    checkpoint.save_checkpoint(path, {"model": [], "model_args": {}})
    with pytest.raises(checkpoint.CheckpointError, match="is not a training checkpoint"):
        trained_model.load_model(path)


def test_every_checkpoint_carries_the_checksum_of_its_bytes_and_a_load_checks_it(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save_checkpoint(path, state(1, iter_num=7))
    trailer = checkpoint.read_trailer(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read(trailer.size)).hexdigest() == trailer.digest  # what sha256sum would say
    assert trailer.iter == 7 and trailer.size < size and checkpoint.verify(path) == trailer
    assert torch.equal(torch.load(path, weights_only=True)["model"]["w"], torch.ones(3))  # still a torch file
    with open(path, "r+b") as f:  # one bit of the tensor's bytes
        data = bytearray(f.read(trailer.size))
        offset = data.index(torch.ones(3).numpy().tobytes())
        f.seek(offset)
        f.write(bytes([data[offset] ^ 1]))
    with pytest.raises(checkpoint.DamagedCheckpoint, match="ckpt.pt is damaged: its bytes do not match the sha256"):
        shards.load_checkpoint(path)
    os.truncate(path, trailer.size // 2)  # cut in half: no trailer to check, and no zip directory either
    assert checkpoint.read_trailer(path) is None
    with pytest.raises(checkpoint.DamagedCheckpoint, match="is not a readable checkpoint"):
        shards.load_checkpoint(path)


def test_a_checkpoint_longer_or_shorter_than_written_is_damaged(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save_checkpoint(path, state(1))
    with open(path, "rb") as f:
        data = f.read()
    footer = data[-checkpoint.FOOTER_SIZE :]
    with open(path, "wb") as f:  # bytes lost from the middle, the trailer intact
        f.write(data[:100] + data[200:])
    with pytest.raises(checkpoint.DamagedCheckpoint, match=r"has [\d,]+ bytes but was written with"):
        checkpoint.verify(path)
    assert footer.startswith(checkpoint.FOOTER_PREFIX)


def test_a_write_error_inside_torch_save_is_reported_with_the_os_reason(tmp_path, monkeypatch):
    """torch.save turns its file's OSError into 'unexpected pos ...'; the save reports the OS's reason."""

    class FullDisk:  # a file on a disk with 1000 bytes free
        def __init__(self, file):
            self.file, self.written = file, 0

        def write(self, data):
            self.written += memoryview(data).nbytes
            if self.written > 1000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.file.write(data)

        def flush(self):
            self.file.flush()

    real_init = checkpoint.HashingFile.__init__
    monkeypatch.setattr(checkpoint.HashingFile, "__init__", lambda self, file: real_init(self, FullDisk(file)))
    with pytest.raises(checkpoint.CheckpointError) as raised:
        checkpoint.save_checkpoint(str(tmp_path / "ckpt.pt"), {"model": {"w": torch.randn(1000)}, "model_args": {}})
    assert "[ENOSPC] No space left on device; the previous one is kept (free space in" in str(raised.value)
    assert "unexpected pos" not in str(raised.value) and os.listdir(tmp_path) == []


def test_a_failed_background_write_is_handed_over_at_once(tmp_path, monkeypatch):
    """The writer reports a failure the moment its thread meets it (run_dir prints it then), not at the next
    save; a success hands over the path and iteration."""
    failed, saved, happened = [], [], threading.Event()

    def on_error(error):
        failed.append(error)
        happened.set()

    writer = checkpoint.CheckpointWriter(on_saved=lambda *a: saved.append(a), on_error=on_error)
    writer.save(str(tmp_path / "ckpt.pt"), state(1, iter_num=3))
    writer.wait()
    assert saved == [(str(tmp_path / "ckpt.pt"), 3, [])]
    monkeypatch.setattr(checkpoint.torch, "save", lambda obj, f: (_ for _ in ()).throw(OSError(errno.EROFS, "RO")))
    writer.save(str(tmp_path / "ckpt.pt"), state(2))
    assert happened.wait(60)  # without wait(): the thread said so itself
    assert "cannot write checkpoint" in str(failed[0]) and "[EROFS] RO" in str(failed[0])
    with pytest.raises(checkpoint.CheckpointError):
        writer.wait()


def test_a_copy_that_fails_does_not_unmake_the_checkpoint_it_copies(tmp_path):
    """best.pt's copy meets a directory in its place: ckpt.pt is on disk and handed over as saved (with the copies
    that were made), then the copy's failure -- so a stop line names the checkpoint that is on disk."""
    events = []
    writer = checkpoint.CheckpointWriter(
        on_saved=lambda *a: events.append(("saved", *a)), on_error=lambda e: events.append(("error", str(e)))
    )
    os.mkdir(tmp_path / "best.pt")
    kept, best, ckpt = (str(tmp_path / name) for name in ("ckpt_0000005.pt", "best.pt", "ckpt.pt"))
    writer.save(ckpt, state(1, iter_num=5), copies=[kept, best])
    with pytest.raises(checkpoint.CheckpointError):
        writer.wait()
    assert events[0] == ("saved", ckpt, 5, [kept])
    assert events[1][0] == "error" and f"cannot write checkpoint {best}: [EISDIR]" in events[1][1]
    assert checkpoint.verify(ckpt).iter == 5 and checkpoint.verify(kept).iter == 5


def test_a_guard_that_raises_leaves_the_previous_checkpoint_in_place(tmp_path):
    """save_checkpoint's guard runs just before the rename (a run checks its lock there): what it raises leaves
    the previous file and no temporary one."""
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save_checkpoint(path, state(1, iter_num=1))

    class Taken(Exception):
        pass

    def taken():
        raise Taken("the lock was taken")

    with pytest.raises(Taken):
        checkpoint.save_checkpoint(path, state(2, iter_num=2), guard=taken)
    assert checkpoint.verify(path).iter == 1 and os.listdir(tmp_path) == ["ckpt.pt"]


@pytest.mark.parametrize("how", ["a small write", "torch.save"])
def test_a_shard_file_that_meets_a_full_disk_names_itself_and_the_os_reason(tmp_path, how):
    """shards' writer (torch.distributed.checkpoint's FileSystemWriter, hashing what it writes): wherever the disk
    turns out full -- a write torch.save makes, or the flush when the file is closed -- the error is the OS's,
    naming the file (not torch.save's "unexpected pos", nor a reason without a file)."""
    from train_helpers import fill, tmpfs

    from marsgpt import shards

    with tmpfs(str(tmp_path / "disk"), size="1m") as disk:
        fill(disk)
        writer = shards._hashing_writer(disk)
        with pytest.raises(OSError) as raised:
            with writer.fs.create_stream(os.path.join(disk, "__0_0.distcp"), "wb") as stream:
                if how == "a small write":
                    stream.write(b"\0" * 10)  # buffered: the disk is found full at the close
                else:
                    torch.save(torch.zeros(3 << 20, dtype=torch.uint8), stream)
        assert raised.value.errno == errno.ENOSPC and raised.value.filename == "__0_0.distcp", raised.value


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize("moment", ["before its hash", "before torch reads it"])
def test_a_checkpoint_renamed_over_while_a_reader_reads_it_is_read_whole_not_called_damaged(
    tmp_path, monkeypatch, moment, mmap
):
    """A reader of a live run (sample.py, hellaswag, export_hf: trained_model.load_model) meets the run's next save
    renamed over ckpt.pt between reading the trailer and hashing the bytes, or between the hash and torch.load: it
    reads the file it opened, whole (the trailer, the hash and torch.load go through one open file). Before, the
    trailer and the bytes came from two opens and a healthy file was called damaged."""
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save_checkpoint(path, state(1, iter_num=1))
    newer = str(tmp_path / "newer.pt")
    checkpoint.save_checkpoint(newer, {**state(2, iter_num=2), "padding": torch.zeros(999)})
    real = {"before its hash": checkpoint.open_file_digest, "before torch reads it": checkpoint.torch.load}[moment]
    name = {"before its hash": "open_file_digest", "before torch reads it": "load"}[moment]
    owner = checkpoint if name == "open_file_digest" else checkpoint.torch

    def renamed_first(*args, **kwargs):
        if os.path.exists(newer):
            os.replace(newer, path)  # the run's save lands this moment
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, renamed_first)
    ckpt, trailer = shards.read_checkpoint(path, mmap=mmap)
    assert trailer.iter == 1 and ckpt["progress"]["iter_num"] == 1 and torch.equal(ckpt["model"]["w"], torch.ones(3))
    assert not os.path.exists(newer) and checkpoint.verify(path).iter == 2  # the rename did land


def sharded_checkpoint(out_dir, weights):
    """A checkpoint file in the sharded format (shards.py's), its tensor `weights` in shards/s/ written by dcp (one
    process, plain tensors: what a reader meets, whatever wrote the rows), with its record of names and checksums."""
    import torch.distributed.checkpoint as dcp

    directory = os.path.join(out_dir, "shards", "s")
    dcp.save({"model/w": weights}, checkpoint_id=directory, no_dist=True)
    files = {name: file_record(os.path.join(directory, name)) for name in os.listdir(directory)}
    record = {"directory": "shards/s", "files": files, "names": {"model/w": "model/w"}}
    tree = {"model": {"w": torch.empty(weights.shape, device="meta")}, "model_args": {}, "progress": {"iter_num": 3}}
    path = os.path.join(out_dir, "ckpt.pt")
    checkpoint.save_checkpoint(path, {**tree, shards.SHARDS_KEY: record})
    return path, directory, tree, record


def file_record(path):
    return {"sha256": file_digest(path), "size": os.path.getsize(path)}


def test_a_sharded_checkpoint_s_dcp_metadata_is_read_as_data(tmp_path):
    """dcp's .metadata is a pickle. Replaced by one that runs code, its checksum recomputed into the checkpoint file
    as someone who can write the run directory would: torch's own reader runs it; the checkpoint's reader refuses
    the file in one line and runs nothing. The genuine file reads whole."""
    import torch.distributed.checkpoint as dcp

    weights = torch.arange(6.0).reshape(2, 3)
    path, directory, tree, record = sharded_checkpoint(str(tmp_path), weights)
    assert torch.equal(shards.load_checkpoint(path)["model"]["w"], weights)

    marker = tmp_path / "ran"
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        pickle.dump(Payload(str(marker)), f)
    files = dict(record["files"], **{".metadata": file_record(os.path.join(directory, ".metadata"))})
    checkpoint.save_checkpoint(path, {**tree, shards.SHARDS_KEY: dict(record, files=files)})
    with pytest.raises(checkpoint.CheckpointError) as refused:
        shards.load_checkpoint(path)
    assert not marker.exists()
    assert str(refused.value) == (
        f"{directory}/.metadata cannot be read as dcp's metadata: it names io.open, which dcp's metadata never holds"
    )
    assert isinstance(refused.value, checkpoint.DamagedCheckpoint)  # a resume passes over it
    with contextlib.suppress(Exception, dcp.api.CheckpointException):  # what the guard is for: torch unpickles it
        dcp.load({"model/w": torch.empty(2, 3)}, checkpoint_id=directory, no_dist=True)
    assert marker.exists()
