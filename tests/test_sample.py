import os
import pickle

import pytest
import torch

import sample
from marsgpt.checkpoint import save_checkpoint
from marsgpt.tokens import get_gpt2_encoding, write_meta

CHARS = sorted(set("def main():\n    return 42\n"))


@pytest.fixture
def char_run(tmp_path, tiny_checkpoint):
    os.makedirs(tmp_path / "data" / "tiny_char")
    write_meta(tmp_path / "data" / "tiny_char" / "meta.pkl", CHARS)
    tiny_checkpoint(tmp_path / "out", len(CHARS), tmp_path / "data", "tiny_char")
    return tmp_path / "out"


def test_char_checkpoint_samples_in_its_vocabulary(char_run, capsys):
    args = ["--out_dir", str(char_run), "--start", "def", "--num_samples", "2", "--max_new_tokens", "20"]
    assert sample.main(args) == 0
    out = capsys.readouterr().out
    samples = out.split("---------------\n")[:-1]
    assert len(samples) == 2
    for text in samples:
        assert text.startswith("def") and len(text) == len("def") + 20 + 1  # + print's newline
        assert set(text[:-1]) <= set(CHARS)


def test_seed_makes_samples_reproducible(char_run):
    args = sample.parse_args(
        [
            "--out_dir",
            str(char_run),
            "--start",
            "main",
            "--max_new_tokens",
            "30",
            "--num_samples",
            "1",
            "--temperature",
            "2.0",
        ]
    )
    first, again = sample.generate(args), sample.generate(args)
    args.seed += 1
    assert first == again and sample.generate(args) != first


def test_prompt_from_file_and_top_k_one_is_greedy(char_run, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("return ")
    args = sample.parse_args(
        [
            "--out_dir",
            str(char_run),
            "--start",
            f"FILE:{prompt}",
            "--top_k",
            "1",
            "--max_new_tokens",
            "10",
            "--num_samples",
            "2",
        ]
    )
    first, second = sample.generate(args)
    assert first.startswith("return ") and first == second  # top_k=1 leaves no randomness


def test_bpe_checkpoint_decodes_with_gpt2(tmp_path, tiny_checkpoint):
    tiny_checkpoint(tmp_path / "out", 50304)  # no dataset meta.pkl: GPT-2 BPE
    args = sample.parse_args(
        ["--out_dir", str(tmp_path / "out"), "--start", "Hello world", "--max_new_tokens", "5", "--num_samples", "1"]
    )
    [text] = sample.generate(args)
    assert text.startswith("Hello world")
    assert get_gpt2_encoding().encode_ordinary(text)[:2] == [15496, 995]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--out_dir", "{tmp}/nowhere"], "no checkpoint at"),
        (["--start", "FILE:{tmp}/missing.txt"], "prompt file"),
        (["--start", "xyz"], "outside the dataset's vocabulary: ['x', 'y', 'z']"),
    ],
)
def test_errors_are_one_line_and_exit_2(char_run, tmp_path, capsys, args, message):
    argv = ["--out_dir", str(char_run)] + [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert sample.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_a_missing_checkpoint_gives_advice_for_sample_py(tmp_path, capsys):
    assert sample.main(["--out_dir", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: no checkpoint at {tmp_path / 'nope'}; train a model first (python train.py ...), "
        "or pass --out_dir of a trained run\n"
    )


@pytest.mark.parametrize(
    "meta, message",
    [
        (b"garbage", "is not a readable meta.pkl"),
        (b"", "is not a readable meta.pkl"),
        (pickle.dumps({"vocab_size": 3}), "has no character vocabulary ('stoi' and 'itos')"),
        (pickle.dumps([1, 2]), "has no vocab_size: not a dataset's meta.pkl"),
    ],
    ids=["garbage", "empty", "no-stoi", "a-list"],
)
def test_a_broken_meta_pkl_is_one_line_and_exit_2(char_run, tmp_path, capsys, meta, message):
    (tmp_path / "data" / "tiny_char" / "meta.pkl").write_bytes(meta)
    assert sample.main(["--out_dir", str(char_run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c["model_args"].update(num_classes=10), "is not a checkpoint of this repository's GPT"),
        (lambda c: c.update(model_args=[1, 2]), "is not a training checkpoint"),
        (lambda c: c.update(model=5), "is not a training checkpoint"),
        (lambda c: c.update(config=5), "meta.pkl was not found"),  # no dataset to read: the vocabulary decides
    ],
    ids=["foreign-model_args", "model_args-list", "model-int", "config-int"],
)
def test_a_checkpoint_of_another_shape_is_one_line_and_exit_2(char_run, capsys, change, message):
    ckpt = torch.load(char_run / "ckpt.pt", weights_only=True)
    change(ckpt)
    save_checkpoint(str(char_run / "ckpt.pt"), ckpt)
    assert sample.main(["--out_dir", str(char_run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_char_model_without_its_meta_is_refused(tmp_path, capsys, tiny_checkpoint):
    tiny_checkpoint(tmp_path / "out", len(CHARS), tmp_path / "gone", "tiny_char")
    assert sample.main(["--out_dir", str(tmp_path / "out")]) == 2
    assert "meta.pkl was not found" in capsys.readouterr().err


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        sample.parse_args(["--temperature", "0"])
    assert e.value.code == 2
