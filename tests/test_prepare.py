import filecmp
import http.client
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
import urllib.error

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.prepare_common import write_char_corpus
from marsgpt import tokens
from marsgpt.tokens import EOT_TOKEN, DataError, TokenData

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"prepare_{name}", os.path.join(REPO, "data", name, "prepare.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so worker processes can unpickle its functions
    spec.loader.exec_module(module)
    return module


fineweb = load_script("fineweb_edu")


def documents(n=120):
    """Deterministic documents of varied length, with some non-ASCII text."""
    rng = np.random.default_rng(0)
    words = ["the", "model", "learns", "Köln", "naïve", "数据", "tokens", "\n\n", "GPT-2", "é", "42", "!"]
    return [f"Doc {i}: " + " ".join(rng.choice(words, size=int(rng.integers(5, 400)))) for i in range(n)]


def write_fineweb_parquet(path, texts, row_group_size=16):
    n = len(texts)
    table = pa.table(
        dict(
            text=texts,
            id=[f"<urn:uuid:{i}>" for i in range(n)],
            dump=["CC-MAIN-2024-10"] * n,
            url=[f"https://example.com/{i}" for i in range(n)],
            file_path=["s3://commoncrawl/x.warc.gz"] * n,
            language=["en"] * n,
            language_score=[0.95] * n,
            token_count=[len(t) // 4 for t in texts],
            score=[3.2] * n,
            int_score=[3] * n,
        )
    )
    pq.write_table(table, path, row_group_size=row_group_size)


def run_fineweb(files, out, shard_size=2000, num_proc=1):
    return fineweb.main(
        [
            "--data_files",
            *map(str, files),
            "--output_dir",
            str(out),
            "--shard_size",
            str(shard_size),
            "--num_proc",
            str(num_proc),
        ]
    )


def shard_tokens(out, split):
    """The tokens of each shard of `split` in `out`, read as train.py reads them."""
    data = TokenData(str(out), split)
    return [data.read(i, 0, np.empty(n, dtype=np.uint16)) for i, n in enumerate(data.lengths)]


def assert_manifest_records_the_files(out):
    """out's manifest.json spares the fingerprint from reading the data, and records what hashing them gives."""
    recorded, hashed = tokens.fingerprint(str(out))
    assert hashed == 0 and recorded["files"]
    os.rename(os.path.join(out, tokens.MANIFEST_NAME), os.path.join(out, "aside.json"))
    assert tokens.fingerprint(str(out)) == (recorded, sum(entry["size"] for entry in recorded["files"].values()))
    os.rename(os.path.join(out, "aside.json"), os.path.join(out, tokens.MANIFEST_NAME))


def shard_files(out):
    return sorted((f for f in os.listdir(out) if f.endswith(".bin")), key=lambda f: f[-10:])  # by index


@pytest.fixture
def corpus(tmp_path):
    texts = documents()
    write_fineweb_parquet(tmp_path / "part0.parquet", texts[:70])
    write_fineweb_parquet(tmp_path / "part1.parquet", texts[70:])
    return texts, [tmp_path / "part0.parquet", tmp_path / "part1.parquet"]


def test_fineweb_parquet_to_shards_decodes_back(tmp_path, corpus):
    texts, files = corpus
    run_fineweb(files, tmp_path / "out")
    names = shard_files(tmp_path / "out")
    assert names[0] == "fineweb_val_000000.bin" and names[1] == "fineweb_train_000001.bin"
    assert all(n == fineweb.shard_name(i) for i, n in enumerate(names))
    shards = shard_tokens(tmp_path / "out", "val") + shard_tokens(tmp_path / "out", "train")
    stream = np.concatenate(shards)
    assert len(shards) == len(names) and all(len(shard) == 2000 for shard in shards[:-1])
    # <|endoftext|> precedes every document, in order; the documents decode back exactly.
    assert stream[0] == EOT_TOKEN and np.count_nonzero(stream == EOT_TOKEN) == len(texts)
    decoded = tokens.get_gpt2_encoding().decode(stream.tolist())
    assert decoded == "".join("<|endoftext|>" + t for t in texts)
    assert TokenData(str(tmp_path / "out"), "val").num_tokens == 2000
    assert TokenData(str(tmp_path / "out"), "train").num_tokens == len(stream) - 2000
    assert_manifest_records_the_files(tmp_path / "out")


@pytest.mark.slow
def test_jsonl_input_and_parallel_workers_give_the_same_shards(tmp_path, corpus):
    texts, files = corpus
    run_fineweb(files, tmp_path / "serial")
    with open(tmp_path / "docs.jsonl", "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps(dict(text=text, id=str(i))) + "\n")
    run_fineweb([tmp_path / "docs.jsonl"], tmp_path / "jsonl")
    fineweb.CHUNK_CHARS, saved = 3000, fineweb.CHUNK_CHARS  # many small tasks across the workers
    try:
        run_fineweb(files, tmp_path / "parallel", num_proc=2)
    finally:
        fineweb.CHUNK_CHARS = saved
    names = shard_files(tmp_path / "serial")
    for other in ("jsonl", "parallel"):
        assert shard_files(tmp_path / other) == names
        assert filecmp.cmpfiles(tmp_path / "serial", tmp_path / other, names, shallow=False)[0] == names


def test_interrupted_prepare_resumes_byte_identical(tmp_path, corpus, monkeypatch):
    texts, files = corpus
    run_fineweb(files, tmp_path / "reference")
    reference = shard_files(tmp_path / "reference")
    assert len(reference) >= 5

    real_write_shard, written = fineweb.write_shard, []

    def write_then_die(path, data):
        if len(written) == 3:
            with open(f"{path}.tmp.999", "wb") as f:  # what a SIGKILL mid-write leaves behind
                f.write(b"partial")
            raise KeyboardInterrupt
        written.append(path)
        real_write_shard(path, data)

    monkeypatch.setattr(fineweb, "write_shard", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        run_fineweb(files, tmp_path / "resumed")
    assert shard_files(tmp_path / "resumed") == reference[:3]  # only complete shards have final names
    progress = json.loads((tmp_path / "resumed" / "progress.json").read_text())
    assert not progress["done"] and progress["shards"][-1]["doc_offset"] > 0  # stopped mid-document

    monkeypatch.setattr(fineweb, "write_shard", real_write_shard)
    run_fineweb(files, tmp_path / "resumed")
    assert sorted(os.listdir(tmp_path / "resumed")) == sorted(reference + ["manifest.json", "progress.json"])
    assert filecmp.cmpfiles(tmp_path / "reference", tmp_path / "resumed", reference, shallow=False)[0] == reference

    # A finished run is left alone; a lost shard is rebuilt; other flags are refused.
    os.remove(tmp_path / "resumed" / reference[-2])
    run_fineweb(files, tmp_path / "resumed")
    assert filecmp.cmp(tmp_path / "reference" / reference[-2], tmp_path / "resumed" / reference[-2], shallow=False)
    assert_manifest_records_the_files(tmp_path / "resumed")  # the rebuilt shard's entry too
    with pytest.raises(DataError, match="holds shards of another run"):
        run_fineweb(files, tmp_path / "resumed", shard_size=3000)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """Six local parquet files stand in for a subset's files on the Hub: the listing and the opener of
    the hub path are replaced, the rest of it runs. Every file opened is recorded."""
    texts = documents()
    files = []
    for k in range(6):
        path = tmp_path / "hub" / f"{k:03d}_00000.parquet"
        path.parent.mkdir(exist_ok=True)
        write_fineweb_parquet(path, texts[20 * k : 20 * (k + 1)], row_group_size=4)
        files.append(str(path))
    opened = []

    def open_recorded(name):
        opened.append(name)
        return open(name, "rb")

    monkeypatch.setattr(fineweb, "network_reachable", lambda host: True)
    monkeypatch.setattr(fineweb, "hub_files", lambda subset: list(files))
    monkeypatch.setattr(fineweb, "open_hub_file", open_recorded)
    return texts, files, opened


def run_hub(out, shard_size):
    args = ["--subset", "sample-10BT", "--output_dir", str(out), "--shard_size", str(shard_size), "--num_proc", "1"]
    return fineweb.main(args)


def run_hub_interrupted(out, shard_size, shards_before, monkeypatch):
    """run_hub, killed while writing shard `shards_before` (the first ones are complete)."""
    real_write_shard, written = fineweb.write_shard, []

    def write_then_die(path, data):
        if len(written) == shards_before:
            raise KeyboardInterrupt
        written.append(path)
        real_write_shard(path, data)

    monkeypatch.setattr(fineweb, "write_shard", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        run_hub(out, shard_size)
    monkeypatch.setattr(fineweb, "write_shard", real_write_shard)
    return json.loads((out / "progress.json").read_text())


def test_hub_resume_opens_only_the_unfinished_source_files(tmp_path, hub, monkeypatch):
    texts, files, opened = hub
    run_hub(tmp_path / "reference", shard_size=1500)
    assert opened == files  # one file at a time, in order, each once
    reference = shard_files(tmp_path / "reference")
    finished = json.loads((tmp_path / "reference" / "progress.json").read_text())
    assert finished["files"] == files and finished["done"]
    run_fineweb(files, tmp_path / "local", shard_size=1500)  # the same files given locally: the same shards
    assert filecmp.cmpfiles(tmp_path / "reference", tmp_path / "local", reference, shallow=False)[0] == reference

    # Stop after the first shard that ends in the middle of a document of the third file or later.
    stop = 1 + next(
        i
        for i, shard in enumerate(finished["shards"])
        if files.index(shard["next_file"]) >= 2 and shard["next_row"] > 0 and shard["doc_offset"] > 0
    )
    progress = run_hub_interrupted(tmp_path / "resumed", 1500, stop, monkeypatch)
    assert progress["shards"] == finished["shards"][:stop]
    resume_at = files.index(progress["shards"][-1]["next_file"])
    opened.clear()
    run_hub(tmp_path / "resumed", shard_size=1500)
    assert opened == files[resume_at:]  # the finished source files are never opened again
    assert shard_files(tmp_path / "resumed") == reference
    assert filecmp.cmpfiles(tmp_path / "reference", tmp_path / "resumed", reference, shallow=False)[0] == reference


def test_a_shard_ending_with_a_source_file_resumes_at_the_next_file(tmp_path, hub, monkeypatch):
    texts, files, opened = hub
    enc = tokens.get_gpt2_encoding()
    first_file_tokens = sum(len(enc.encode_ordinary(text)) + 1 for text in texts[:20])  # <|endoftext|> each
    run_hub(tmp_path / "reference", shard_size=first_file_tokens)
    progress = run_hub_interrupted(tmp_path / "resumed", first_file_tokens, 1, monkeypatch)
    assert progress["shards"][0] | dict(name=None, tokens=None) == dict(
        name=None, tokens=None, next_doc=20, next_file=files[1], next_row=0, doc_offset=0
    )
    opened.clear()
    run_hub(tmp_path / "resumed", shard_size=first_file_tokens)
    assert opened == files[1:]
    reference = shard_files(tmp_path / "reference")
    assert filecmp.cmpfiles(tmp_path / "reference", tmp_path / "resumed", reference, shallow=False)[0] == reference


def test_hub_files_resolves_a_subset_as_datasets_does(tmp_path, monkeypatch):
    """hub_files' own call, pointed at a local folder laid out like the dataset repository."""
    datasets = pytest.importorskip("datasets")
    repo = tmp_path / "fineweb-edu"
    (repo / "README.md").parent.mkdir()
    (repo / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: sample-10BT\n  data_files:\n  - split: train\n    path: sample/10BT/*\n"
        "- config_name: CC-MAIN-2024-10\n  data_files:\n  - split: train\n    path: data/CC-MAIN-2024-10/*\n"
        "---\n"
    )
    for name in ("sample/10BT/001_00000.parquet", "sample/10BT/000_00000.parquet", "data/CC-MAIN-2024-10/0.parquet"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        write_fineweb_parquet(repo / name, ["text"])
    monkeypatch.setattr(fineweb, "HUB_DATASET", str(repo))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    assert fineweb.hub_files("sample-10BT") == [str(repo / f"sample/10BT/00{i}_00000.parquet") for i in (0, 1)]
    with pytest.raises(DataError, match="has no subset 'sample-1BT'"):
        fineweb.hub_files("sample-1BT")


def test_fineweb_errors(tmp_path, monkeypatch):
    pq.write_table(pa.table(dict(content=["x"])), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="no 'text' column"):
        run_fineweb([tmp_path / "bad.parquet"], tmp_path / "out")
    with pytest.raises(DataError, match="no such file"):
        run_fineweb([tmp_path / "missing.parquet"], tmp_path / "out")
    monkeypatch.setattr(fineweb, "network_reachable", lambda host: False)
    with pytest.raises(DataError, match="cannot reach huggingface.co.*--data_files"):
        fineweb.main(["--output_dir", str(tmp_path / "hub")])


def test_stdlib_char_quickstart(tmp_path):
    load_script("stdlib_char").main(["--output_dir", str(tmp_path), "--chars", "200000"])
    assert_manifest_records_the_files(tmp_path)
    with open(tmp_path / "meta.pkl", "rb") as f:
        meta = pickle.load(f)
    train, val = TokenData(str(tmp_path), "train"), TokenData(str(tmp_path), "val")
    assert train.num_tokens == 180_000 and val.num_tokens == 20_000
    assert train.vocab_size == meta["vocab_size"] < 128
    text = "".join(meta["itos"][i] for i in np.fromfile(tmp_path / "train.bin", dtype=np.uint16, count=50_000))
    assert "def " in text and "import" in text


def test_shakespeare_char_from_a_local_file(tmp_path):
    (tmp_path / "input.txt").write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 50)
    load_script("shakespeare_char").main(["--input", str(tmp_path / "input.txt"), "--output_dir", str(tmp_path)])
    data = TokenData(str(tmp_path), "train")
    first = data.read(0, 0, np.empty(14, dtype=np.uint16))
    assert "".join(data.meta["itos"][i] for i in first) == "First Citizen:"


@pytest.mark.slow
def test_each_script_runs_by_its_path_from_any_folder_as_with_python_m(tmp_path, corpus):
    """python data/<name>/prepare.py, as nanoGPT users type it, from another folder too: the same files as
    python -m data.<name>.prepare writes (fineweb_edu with worker processes, which import the script again)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "cache"))
    runs = {
        "stdlib_char": ["--chars", "20000"],
        "fineweb_edu": ["--data_files", *map(str, corpus[1]), "--shard_size", "2000", "--num_proc", "2"],
    }
    for name, args in runs.items():
        script = os.path.join(REPO, "data", name, "prepare.py")
        for how, argv, cwd in (
            ("path", [script], tmp_path),
            ("module", ["-m", f"data.{name}.prepare"], REPO),
        ):
            command = [sys.executable, *argv, *args, "--output_dir", str(tmp_path / name / how)]
            done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
        by_path, by_module = tmp_path / name / "path", tmp_path / name / "module"
        names = sorted(f for f in os.listdir(by_module) if f.endswith((".bin", ".pkl")))
        assert names and sorted(f for f in os.listdir(by_path) if f.endswith((".bin", ".pkl"))) == names
        assert filecmp.cmpfiles(by_path, by_module, names, shallow=False)[0] == names


def run_openwebtext(tmp_path, texts):
    """data/openwebtext/prepare.py on a local parquet file of texts, offline, in a subprocess."""
    pq.write_table(pa.table(dict(text=texts)), tmp_path / "owt.parquet")
    env = dict(os.environ, HF_DATASETS_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    args = ["--data_files", str(tmp_path / "owt.parquet"), "--output_dir", str(tmp_path / "out"), "--num_proc", "1"]
    command = [sys.executable, "-m", "data.openwebtext.prepare", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)


@pytest.mark.slow
def test_openwebtext_local_files_nanogpt_split(tmp_path):
    texts = [f"Document {i} says hello." for i in range(4000)]
    assert run_openwebtext(tmp_path, texts).returncode == 0
    enc = tokens.get_gpt2_encoding()
    val = np.fromfile(tmp_path / "out" / "val.bin", dtype=np.uint16)
    train = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)
    docs = enc.decode(val.tolist()).split("<|endoftext|>")
    assert len(docs) == 3 and docs[-1] == ""  # ceil(4000 * 0.0005) = 2 val documents, EOT after each
    assert val[-1] == train[-1] == EOT_TOKEN
    assert np.count_nonzero(train == EOT_TOKEN) == 3998
    assert_manifest_records_the_files(tmp_path / "out")
    assert sorted(docs[:2] + enc.decode(train.tolist()).split("<|endoftext|>")[:-1]) == sorted(texts)


@pytest.mark.slow
def test_openwebtext_corpus_too_small_to_split_is_one_error_line(tmp_path):
    result = run_openwebtext(tmp_path, ["The only document."])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (  # after datasets' progress bars
        "error: the corpus has 1 document(s); nanoGPT's split needs at least 2, one for val.bin and one for "
        "train.bin: pass more --data_files"
    )
    assert not os.path.exists(tmp_path / "out") or os.listdir(tmp_path / "out") == []


# ---------------------------------------------------------------------------------------------------
# Bad input: one `error: ...` line and exit status 2 (prepare_common.run_prepare), never a traceback, and no
# output that looks complete.


def run_script(tmp_path, name, *args):
    """data/<name>/prepare.py in a subprocess, offline, with datasets' cache under tmp_path."""
    env = dict(os.environ, HF_DATASETS_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", f"data.{name}.prepare", *map(str, args)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)


def assert_error_line(result, *parts):
    """The run failed with status 2 and an `error:` last line holding each of parts, after no traceback."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]  # after any progress bars
    assert last.startswith("error: ") and all(part in last for part in parts), last


@pytest.mark.slow
def test_a_manifest_for_data_prepared_elsewhere_is_one_command(tmp_path):
    """nanoGPT's bins, without a manifest: `python -m data.manifest <dir>` writes one; a folder that holds no
    dataset is one error line."""
    tokens.write_bin(tmp_path / "train.bin", np.arange(1000))
    tokens.write_bin(tmp_path / "val.bin", np.arange(100))
    command = [sys.executable, "-m", "data.manifest"]
    done = subprocess.run([*command, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == f"wrote {tmp_path / tokens.MANIFEST_NAME}\n", done.stderr
    assert_manifest_records_the_files(tmp_path)
    assert_error_line(
        subprocess.run([*command, str(tmp_path / "none")], cwd=REPO, capture_output=True, text=True),
        "holds no token files",
    )


@pytest.mark.slow
def test_shakespeare_char_refuses_non_utf8_input_and_a_directory(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("First Citizen:\nCaf\xe9\n".encode("latin-1"))
    result = run_script(
        tmp_path, "shakespeare_char", "--input", tmp_path / "latin1.txt", "--output_dir", tmp_path / "out"
    )
    assert_error_line(result, f"--input: {tmp_path / 'latin1.txt'} is not UTF-8 text (byte 18", "UTF-8")
    result = run_script(tmp_path, "shakespeare_char", "--input", tmp_path, "--output_dir", tmp_path / "out")
    assert_error_line(result, f"--input: {tmp_path} is a directory")
    assert not os.path.exists(tmp_path / "out")


def test_shakespeare_char_failed_download_is_one_error_and_leaves_no_input_txt(tmp_path, monkeypatch):
    shakespeare = load_script("shakespeare_char")
    monkeypatch.setattr(shakespeare, "network_reachable", lambda host: True)

    class Truncated:  # the connection drops mid-body
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            raise http.client.IncompleteRead(b"First Citizen:", 1_100_000)

    def refused(url, timeout):
        raise urllib.error.URLError("connection refused")

    for opener in (refused, lambda url, timeout: Truncated()):
        monkeypatch.setattr(shakespeare.urllib.request, "urlopen", opener)
        with pytest.raises(DataError, match="downloading https://.*input.txt failed .*pass --input PATH"):
            shakespeare.download(str(tmp_path / "input.txt"))
        assert os.listdir(tmp_path) == []


def test_char_corpus_too_varied_or_empty_is_refused_before_writing(tmp_path):
    symbols = [chr(0x10000 + i) for i in range(65537)]  # outside the BMP: every one a distinct character
    with pytest.raises(DataError, match=r"65,537 distinct characters, more than the 65,536 ids"):
        write_char_corpus(tmp_path / "out", "".join(symbols))
    assert not os.path.exists(tmp_path / "out")
    with pytest.raises(DataError, match="the text is empty"):
        write_char_corpus(tmp_path / "out", "")
    assert not os.path.exists(tmp_path / "out")
    # 65,536 symbols still fit: ids 0..65535, none wrapped
    write_char_corpus(tmp_path / "fits", "".join(symbols[:65536]))
    data = TokenData(str(tmp_path / "fits"), "train")
    assert data.vocab_size == 65536
    data.check_vocab(65536)
    train_tail = [data.meta["itos"][i] for i in np.fromfile(tmp_path / "fits" / "train.bin", dtype=np.uint16)[-3:]]
    assert train_tail == symbols[int(0.9 * 65536) - 3 : int(0.9 * 65536)]


def test_character_corpora_refuse_bad_arguments(tmp_path):
    (tmp_path / "input.txt").write_text("hello world\n" * 10)
    (tmp_path / "taken").write_text("a file")
    shakespeare = load_script("shakespeare_char")
    with pytest.raises(DataError, match="--output_dir: .*taken is a file, not a directory"):
        shakespeare.main(["--input", str(tmp_path / "input.txt"), "--output_dir", str(tmp_path / "taken")])
    stdlib = load_script("stdlib_char")
    for chars in ("0", "-5"):  # -5 used to write the first source file less its last 5 characters
        with pytest.raises(DataError, match=f"--chars must be positive, got {chars}"):
            stdlib.main(["--output_dir", str(tmp_path / "out"), "--chars", chars])
    assert not os.path.exists(tmp_path / "out")


def write_bad_data_files(tmp_path):
    """{name: (path, what the error says)} for files neither GPT-2 prepare script can read."""
    files = {
        "no_text.jsonl": (b'{"content": "a document"}\n', "no_text.jsonl: line 1 has no 'text' key (keys: content)"),
        "garbage.jsonl": (b"<html>404</html>\n", "garbage.jsonl could not be read as JSON lines: line 1 is not JSON"),
        "latin1.jsonl": (
            b'\n{"text": "caf\xe9"}\n',
            "latin1.jsonl could not be read as JSON lines: line 2 is not UTF-8",
        ),
        "null_text.jsonl": (b'{"text": null}\n', "null_text.jsonl: line 1's 'text' is null, not a string"),
        "garbage.parquet": (b"<html>404</html>\n", "garbage.parquet could not be read as parquet (Parquet magic bytes"),
        "empty.parquet": (b"", "empty.parquet could not be read as parquet"),
        "notes.txt": (b"text\n", "--data_files takes .parquet or .jsonl files, got"),
    }
    paths = {}
    for name, (content, message) in files.items():
        (tmp_path / name).write_bytes(content)
        paths[name] = (tmp_path / name, message)
    pq.write_table(pa.table(dict(text=[1, 2])), tmp_path / "numbers.parquet")
    paths["numbers.parquet"] = (tmp_path / "numbers.parquet", "numbers.parquet: the 'text' column holds int64")
    pq.write_table(pa.table(dict(content=["x"])), tmp_path / "no_text.parquet")
    paths["no_text.parquet"] = (tmp_path / "no_text.parquet", "no_text.parquet: no 'text' column (columns: content)")
    (tmp_path / "folder").mkdir()
    paths["folder"] = (tmp_path / "folder", f"--data_files: {tmp_path / 'folder'} is a directory")
    return paths


@pytest.mark.parametrize("name", ["fineweb_edu", "openwebtext"])
def test_unreadable_data_files_are_refused_by_name_before_any_work(tmp_path, name):
    script = load_script(name)
    write_fineweb_parquet(tmp_path / "good.parquet", documents(3))
    for bad, message in write_bad_data_files(tmp_path).values():
        out = tmp_path / f"out_{bad.name}"
        with pytest.raises(DataError) as excinfo:  # the good file first: the bad one is still named
            script.main(["--data_files", str(tmp_path / "good.parquet"), str(bad), "--output_dir", str(out)])
        assert message in str(excinfo.value) and "\n" not in str(excinfo.value)
        assert not os.path.exists(out) or not [f for f in os.listdir(out) if f.endswith(".bin")]


@pytest.mark.slow
def test_a_bad_row_deep_inside_a_fineweb_file_is_named(tmp_path):
    good = [json.dumps(dict(text=text)) + "\n" for text in documents(40)]
    cases = {
        "late_no_text.jsonl": (b'{"id": 7}\n', "late_no_text.jsonl: line 41 has no 'text' key (keys: id)"),
        "late_garbage.jsonl": (b"{truncated\n", "late_garbage.jsonl could not be read as JSON lines: line 41"),
        "late_latin1.jsonl": (b'{"text": "caf\xe9"}\n', "late_latin1.jsonl could not be read as JSON lines: line 41"),
    }
    for name, (bad_line, message) in cases.items():
        (tmp_path / name).write_bytes("".join(good).encode() + bad_line)
        with pytest.raises(DataError, match=re.escape(message)):
            run_fineweb([tmp_path / name], tmp_path / name.replace(".", "_"))
        assert not [f for f in os.listdir(tmp_path / name.replace(".", "_")) if ".tmp." in f]  # finished shards only
    pq.write_table(pa.table(dict(text=["a document", None])), tmp_path / "null.parquet")
    with pytest.raises(DataError, match="null.parquet: row group 0 has a null 'text'"):
        run_fineweb([tmp_path / "null.parquet"], tmp_path / "null")
    write_corrupt_parquet(tmp_path / "corrupt.parquet")
    result = run_script(tmp_path, "fineweb_edu", "--data_files", tmp_path / "corrupt.parquet", "--num_proc", "1")
    assert_error_line(result, "corrupt.parquet could not be read as parquet (Couldn't deserialize thrift")


def write_corrupt_parquet(path):
    """A parquet file whose footer reads but whose first page header is garbage."""
    pq.write_table(pa.table(dict(text=[f"Document {i} says hello." for i in range(100)])), path)
    data = bytearray(path.read_bytes())
    data[4:24] = b"\xff" * 20  # just after the leading magic bytes
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_openwebtext_unreadable_data_inside_a_file_is_one_error_line(tmp_path):
    good = "".join(json.dumps(dict(text=f"Document {i}.")) + "\n" for i in range(20))
    (tmp_path / "late_garbage.jsonl").write_text(good + "{truncated\n")
    (tmp_path / "good.jsonl").write_text(good)
    (tmp_path / "late_no_text.jsonl").write_text(good + '{"id": 7}\n')
    write_corrupt_parquet(tmp_path / "corrupt.parquet")
    out = tmp_path / "out"
    cases = [
        (["late_garbage.jsonl"], ["late_garbage.jsonl could not be read as JSON lines (JSON parse error"]),
        (["good.jsonl", "late_garbage.jsonl"], ["one of the 2 --data_files", "could not be read as JSON lines"]),
        (["corrupt.parquet"], ["corrupt.parquet could not be read as parquet (Couldn't deserialize thrift"]),
        (["late_no_text.jsonl"], ["late_no_text.jsonl: 1 document(s) have no 'text'", "the first at row 20"]),
    ]
    for files, parts in cases:
        result = run_script(
            tmp_path, "openwebtext", "--data_files", *[tmp_path / f for f in files], "--output_dir", out
        )
        assert_error_line(result, *parts)
        assert files[-1] in result.stderr  # one of several: datasets' log line above the error names it
        assert os.listdir(out) == []


def test_openwebtext_data_files_that_cannot_go_into_one_dataset(tmp_path):
    owt = load_script("openwebtext")
    write_fineweb_parquet(tmp_path / "a.parquet", documents(3))
    (tmp_path / "b.jsonl").write_text(json.dumps(dict(text="a document")) + "\n")
    (tmp_path / "empty.jsonl").write_text("\n\n")  # datasets' json loader raises StopIteration on these
    (tmp_path / "empty2.jsonl").write_text("")
    args = ["--output_dir", str(tmp_path / "out"), "--data_files"]
    with pytest.raises(DataError, match="pass only .parquet or only .jsonl files, got .*a.parquet and .*b.jsonl"):
        owt.main([*args, str(tmp_path / "a.parquet"), str(tmp_path / "b.jsonl")])
    with pytest.raises(DataError, match="the --data_files hold no documents"):
        owt.main([*args, str(tmp_path / "empty.jsonl"), str(tmp_path / "empty2.jsonl")])
    for script in (owt, fineweb):
        with pytest.raises(DataError, match="--num_proc must be positive, got 0"):
            script.main([*args, str(tmp_path / "a.parquet"), "--num_proc", "0"])


@pytest.mark.parametrize(
    "name, documented",
    [
        ("shakespeare_char", ["--output_dir", "(default: data/shakespeare_char/", "--input", "(default: download"]),
        ("stdlib_char", ["(default: data/stdlib_char/", "--chars", "(default: 5000000)"]),
        ("openwebtext", ["(default: data/openwebtext/", "(default: download", "from the Hugging Face hub"]),
        ("fineweb_edu", ["(default: data/fineweb_edu/", "(default: sample-10BT", "(default: stream --subset"]),
    ],
)
def test_help_documents_every_default(name, documented, capsys):
    with pytest.raises(SystemExit) as excinfo:
        load_script(name).main(["--help"])
    assert excinfo.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines wherever the terminal ends
    assert all(part in text for part in documented), text
