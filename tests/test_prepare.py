import filecmp
import importlib.util
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tokens
from tokens import EOT_TOKEN, DataError, TokenData, read_shard

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
    stream = np.concatenate([read_shard(tmp_path / "out" / n) for n in names])
    assert all(len(read_shard(tmp_path / "out" / n)) == 2000 for n in names[:-1])
    # <|endoftext|> precedes every document, in order; the documents decode back exactly.
    assert stream[0] == EOT_TOKEN and np.count_nonzero(stream == EOT_TOKEN) == len(texts)
    decoded = tokens.get_gpt2_encoding().decode(stream.tolist())
    assert decoded == "".join("<|endoftext|>" + t for t in texts)
    assert TokenData(str(tmp_path / "out"), "val").num_tokens == 2000
    assert TokenData(str(tmp_path / "out"), "train").num_tokens == len(stream) - 2000


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
    assert sorted(os.listdir(tmp_path / "resumed")) == sorted(reference + ["progress.json"])  # no .tmp
    assert filecmp.cmpfiles(tmp_path / "reference", tmp_path / "resumed", reference, shallow=False)[0] == reference

    # A finished run is left alone; a lost shard is rebuilt; other flags are refused.
    os.remove(tmp_path / "resumed" / reference[-2])
    run_fineweb(files, tmp_path / "resumed")
    assert filecmp.cmp(tmp_path / "reference" / reference[-2], tmp_path / "resumed" / reference[-2], shallow=False)
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


def run_openwebtext(tmp_path, texts):
    """data/openwebtext/prepare.py on a local parquet file of texts, offline, in a subprocess."""
    pq.write_table(pa.table(dict(text=texts)), tmp_path / "owt.parquet")
    env = dict(os.environ, HF_DATASETS_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    script = os.path.join(REPO, "data", "openwebtext", "prepare.py")
    args = ["--data_files", str(tmp_path / "owt.parquet"), "--output_dir", str(tmp_path / "out"), "--num_proc", "1"]
    return subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True)


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
