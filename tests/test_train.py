"""train.py in one process on the CPU: learning, metrics, exact MARS, wandb, divergence guard, bad input."""

import dataclasses
import glob
import io
import json
import math
import os
import re
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from train_helpers import ROOT, diverging_from, make_char_data, tiny_args

import train
from bench.common import rendezvous
from marsgpt import checkpoint, checkpoint_parts, memory_plan, runtime, shards, trained_model
from marsgpt.config import TrainConfig
from marsgpt.config_schema import config_to_dict
from marsgpt.optimizers import scheduled_lr
from marsgpt.parallel import Parallelism
from marsgpt.tokens import TokenData, write_shard
from marsgpt.training_optimizer import build_optimizer
from model import GPT, GPTConfig, model_args_from_config

pytestmark = pytest.mark.usefixtures("one_thread")


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_ok(argv, capsys=None):
    rc = train.main(argv)
    if rc != 0 and capsys is not None:
        pytest.fail(capsys.readouterr().err)
    assert rc == 0


def test_twenty_steps_learn_and_record_metrics(data_path, tmp_path, capsys):
    out = str(tmp_path / "out")
    run_ok(tiny_args(data_path, out), capsys)
    printed = capsys.readouterr().out
    assert "tokens per optimizer step: 256 = batch_size 4 x gradient_accumulation_steps 2 x block_size 32" in printed
    assert "total tokens: 5,120" in printed
    assert json.load(open(os.path.join(out, "config.json")))["n_embd"] == 64

    records = read_metrics(out)
    train_lines = [r for r in records if "train/loss" in r]
    eval_lines = [r for r in records if "val/loss" in r]
    assert [r["iter"] for r in train_lines] == list(range(1, 21))
    assert [r["iter"] for r in eval_lines] == [0, 5, 10, 15, 20]
    for r in train_lines:
        assert r["tokens"] == r["iter"] * 256
        assert {
            "time_s",
            "lr",
            "grad_norm",
            "clip_rate",
            "tokens_per_sec",
            "step_ms",
            "mfu",
            "param_norm",
            "momentum_norm",
            "momentum_norm_sq",
            "momentum_div",
        } <= set(r)
        assert r["mfu"] is None and 0 <= r["clip_rate"] <= 1 and r["tokens_per_sec"] > 0
    assert all("eval/train_loss" in r for r in eval_lines)
    times = [r["time_s"] for r in records]
    assert times == sorted(times)
    # it learns: validation loss and the smoothed training loss both fall well below the start
    assert eval_lines[-1]["val/loss"] < eval_lines[0]["val/loss"] - 0.5
    assert sum(r["train/loss"] for r in train_lines[-5:]) < sum(r["train/loss"] for r in train_lines[:5]) - 2.5

    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    progress = ckpt["progress"]
    assert progress["iter_num"] == 20 and progress["tokens"] == 20 * 256
    assert progress["best_val_loss"] == min(r["val/loss"] for r in eval_lines)
    assert not any(k.startswith("_orig_mod.") for k in ckpt["model"])
    assert os.path.exists(os.path.join(out, "best.pt"))


def test_schedule_reaches_every_group_and_clip_rate_counts(data_path, tmp_path):
    out = str(tmp_path / "out")
    run_ok(tiny_args(data_path, out, max_iters=4, eval_interval=4, grad_clip=1e-3, warmup_iters=2))
    lines = [r for r in read_metrics(out) if "train/loss" in r]
    # lr is read after step it: warmup 0 -> 1.5e-3 -> 3e-3, then cosine
    assert [round(r["lr"], 9) for r in lines[:2]] == [0.0, 1.5e-3]
    assert all(r["clip_rate"] == 1.0 for r in lines)  # every norm exceeds 1e-3


def test_eval_windows_are_fixed(data_path, tmp_path):
    data = TokenData(os.path.join(data_path, "tiny"), "val")
    first, second = data.eval_batches(1, 3, 4, 32), data.eval_batches(1, 3, 4, 32)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, second))
    # and so two evaluations of the same weights agree exactly: eval_only twice
    for name in ("a", "b"):
        run_ok(tiny_args(data_path, str(tmp_path / name), eval_only=True))
    assert read_metrics(tmp_path / "a") == [
        dict(r, time_s=read_metrics(tmp_path / "a")[0]["time_s"]) for r in read_metrics(tmp_path / "b")
    ]
    assert not os.path.exists(tmp_path / "a" / "ckpt.pt")  # eval_only writes no checkpoint


def test_exact_mars_stores_the_next_batch_gradient_at_the_current_weights(data_path, tmp_path):
    """After step 0, MARS's g_{t-1} is the clipped mean gradient of step 1's batches at the step-0 weights."""
    out = str(tmp_path / "out")
    argv = tiny_args(data_path, out, max_iters=1, eval_interval=1, is_approx=False, grad_clip=0.5)
    run_ok(argv)
    cfg = train.load_config(argv)
    data = TokenData(os.path.join(data_path, "tiny"), "train")
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**model_args_from_config(cfg, data.vocab_size)))  # the step-0 weights
    for k in range(cfg.gradient_accumulation_steps):
        x, y = data.get_batch(cfg.seed, 1, k, cfg.batch_size, cfg.block_size)
        (model(x, y)[1] / cfg.gradient_accumulation_steps).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)

    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    state = ckpt["optimizer"]["state"]
    group_params = [i for g in ckpt["optimizer"]["param_groups"] for i in g["params"]]
    order = dict(
        zip(
            group_params,
            [p for g in build_optimizer(model, cfg, Parallelism.single()).param_groups for p in g["params"]],
        )
    )
    by_param = {id(p): n for n, p in model.named_parameters()}
    checked = 0
    for index, s in state.items():
        if "last_grad" in s:
            p = order[index]
            name = by_param[id(p)]
            torch.testing.assert_close(
                s["last_grad"], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
            )
            checked += 1
    assert checked == sum(p.ndim >= 2 for p in model.parameters())


@pytest.mark.slow
def test_mars_fused_trains_through_the_kernel(data_path, tmp_path, capsys, monkeypatch):
    """--mars_fused=True gives MARS fused=True: every step's tensors go through MARS's Triton kernel (on a CPU in
    Triton's interpreter: tests/conftest.py), and it trains as the default path does, to float32 rounding."""
    pytest.importorskip("triton", reason="fused=True runs a Triton kernel: pip install -r requirements-test.txt")
    import mars_triton

    default, fused = str(tmp_path / "default"), str(tmp_path / "fused")
    run_ok(tiny_args(data_path, default, max_iters=4), capsys)
    steps, left = [], []
    fused_step = mars_triton.step

    def counted(parts, **helpers):
        rest = fused_step(parts, **helpers)
        steps.append(sum(len(part.params) for part in parts))
        left.extend(rest)
        return rest

    monkeypatch.setattr(mars_triton, "step", counted)
    run_ok(tiny_args(data_path, fused, max_iters=4, mars_fused=True), capsys)
    assert len(steps) == 4 and all(n > 0 for n in steps) and not left
    losses = {out: [r["train/loss"] for r in read_metrics(out) if "train/loss" in r] for out in (default, fused)}
    assert len(losses[fused]) == 4 and losses[fused] == pytest.approx(losses[default], rel=1e-5)
    groups = torch.load(os.path.join(fused, "ckpt.pt"), weights_only=True)["optimizer"]["param_groups"]
    assert [g["fused"] for g in groups] == [True, True]


def test_grad_multiplier_scales_the_gradient_not_the_loss(data_path, tmp_path):
    """The paper's configs reproduce its summed (not averaged) micro-batch gradients with grad_multiplier."""
    first_lines = {}
    for multiplier in (1, 4):
        out = str(tmp_path / f"x{multiplier}")
        run_ok(tiny_args(data_path, out, max_iters=1, eval_interval=1, grad_clip=0.0, grad_multiplier=multiplier))
        first_lines[multiplier] = next(r for r in read_metrics(out) if "train/loss" in r)
    assert first_lines[4]["train/loss"] == first_lines[1]["train/loss"]
    assert first_lines[4]["grad_norm"] == pytest.approx(4 * first_lines[1]["grad_norm"], rel=1e-5)


def wandb_runs(out_dir):
    """{run id: [offline run folders]} under out_dir/wandb, by the run-<id>.wandb file wandb writes in each
    (the folder names carry a timestamp, and a suffix when two runs start within the same second)."""
    runs = {}
    for folder in sorted(glob.glob(os.path.join(out_dir, "wandb", "*run-*"))):
        for name in os.listdir(folder):
            if name.startswith("run-") and name.endswith(".wandb") and os.path.getsize(os.path.join(folder, name)):
                runs.setdefault(name[len("run-") : -len(".wandb")], []).append(folder)
    return runs


@pytest.mark.slow
def test_wandb_offline_writes_its_run_and_resume_continues_it(data_path, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = str(tmp_path / "out")
    run_ok(tiny_args(data_path, out, max_iters=3, eval_interval=3, wandb_log=True, wandb_project="test"))
    run_id = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["progress"]["wandb_run_id"]
    assert run_id
    args = tiny_args(data_path, out, max_iters=6, eval_interval=3, wandb_log=True, wandb_project="test")
    run_ok(args + ["--init_from=resume"])
    runs = wandb_runs(out)
    assert list(runs) == [run_id] and len(runs[run_id]) == 2  # the resume continued the same run


@pytest.mark.slow
def test_wandb_without_a_login_logs_offline_with_one_warning(data_path, tmp_path, monkeypatch, capsys):
    """A node without `wandb login` (no key anywhere, WANDB_MODE unset) must neither prompt nor fail."""
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # a prompt would read from here and fail
    out = str(tmp_path / "out")
    run_ok(tiny_args(data_path, out, max_iters=2, eval_interval=2, wandb_log=True, wandb_project="test"), capsys)
    err = capsys.readouterr().err
    assert err.count("warning: wandb_log=True but wandb has no login") == 1
    assert len(wandb_runs(out)) == 1


@pytest.mark.parametrize("is_approx", [True, False])
def test_non_finite_step_changes_nothing(data_path, tmp_path, monkeypatch, capsys, is_approx):
    """NaN gradients from step 3's batch skip the update: weights and optimizer state stay as they were.

    Exact MARS meets step 3's batch one step early (its look-ahead gradient), so it skips steps 2 and 3;
    MARS's previous_grad is scratch, rewritten before every use, and not compared.
    """
    real_forward_backward, real_train_step = train.forward_backward, train.train_step
    bad_batch = 3
    expected_skips = [3] if is_approx else [2, 3]

    def poisoned_forward_backward(run, step):
        loss = real_forward_backward(run, step)
        if step == bad_batch:
            loss = loss * math.nan
            for p in run.model.parameters():
                p.grad.fill_(math.nan)
        return loss

    def snapshot(run):
        params = [p.detach().clone() for p in run.model.parameters()]
        state = {
            id(p): {k: torch.as_tensor(v).clone() for k, v in s.items() if k != "previous_grad"}
            for p, s in run.optimizer.state.items()
        }
        return params, state

    skipped = []

    def checking_train_step(run, it):
        before = snapshot(run)
        result = real_train_step(run, it)
        if result.skipped:
            params, state = snapshot(run)
            assert all(torch.equal(a, b) for a, b in zip(before[0], params))
            assert before[1].keys() == state.keys()
            for key, values in before[1].items():
                assert values.keys() == state[key].keys()
                assert all(torch.equal(v, state[key][name]) for name, v in values.items())
            skipped.append(it)
        return result

    monkeypatch.setattr(train, "forward_backward", poisoned_forward_backward)
    monkeypatch.setattr(train, "train_step", checking_train_step)
    out = str(tmp_path / "out")
    run_ok(tiny_args(data_path, out, max_iters=6, is_approx=is_approx))
    assert skipped == expected_skips
    # the skip line (numbered after the step, as train lines are) names the norm that is not finite
    printed = capsys.readouterr().out
    if not is_approx:  # step 2's look-ahead pass met step 3's batch
        assert "iter 3: non-finite loss or look-ahead gradient norm nan; step skipped" in printed
    assert "iter 4: non-finite loss or gradient norm nan; step skipped" in printed
    records = read_metrics(out)
    skip_lines = [r for r in records if "train/loss" not in r and "val/loss" not in r]
    assert [r["iter"] for r in skip_lines] == [it + 1 for it in expected_skips]
    train_lines = [r for r in records if "train/loss" in r]
    assert train_lines[-1]["skipped_steps"] == len(expected_skips)
    # a log window of only skipped steps has no loss (null), never NaN
    assert [r["iter"] for r in train_lines if r["train/loss"] is None] == [it + 1 for it in expected_skips]


def test_consecutive_non_finite_steps_stop_the_run_keeping_the_last_checkpoint(
    data_path, tmp_path, monkeypatch, capsys
):
    def nan_after_six(run, step):
        loss = real(run, step)
        if step >= 6:
            for p in run.model.parameters():
                p.grad.fill_(math.inf)
        return loss

    real = train.forward_backward
    monkeypatch.setattr(train, "forward_backward", nan_after_six)
    out = str(tmp_path / "out")
    assert train.main(tiny_args(data_path, out, max_bad_steps=3)) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: 3 consecutive steps (up to iter 9)") and "Traceback" not in err
    assert shards.load_checkpoint(out)["progress"]["iter_num"] == 5  # the evaluation before the bad steps


@pytest.mark.slow
def test_hellaswag_in_the_loop_on_gpt2_tokens(tmp_path, capsys):
    from marsgpt.tokens import write_bin

    data_dir = tmp_path / "bpe"
    data_dir.mkdir()
    ids = torch.randint(0, 50257, (4000,), generator=torch.Generator().manual_seed(0)).numpy()
    write_bin(data_dir / "train.bin", ids)
    write_bin(data_dir / "val.bin", ids[:1000])
    examples = tmp_path / "hellaswag.jsonl"
    example = dict(
        ctx="A man is sitting on a roof. He",
        label=1,
        endings=[
            "is using wrap to wrap a pair of skis.",
            "is ripping level tiles off.",
            "is holding a rubik's cube.",
            "starts pulling up roofing on a roof.",
        ],
    )
    rotations = [dict(example, endings=example["endings"][i:] + example["endings"][:i], label=i) for i in range(4)]
    examples.write_text("".join(json.dumps(e) + "\n" for e in rotations + [dict(e, label=3) for e in rotations]))
    out = str(tmp_path / "out")
    run_ok(
        tiny_args(
            str(tmp_path),
            out,
            dataset="bpe",
            n_embd=32,
            max_iters=2,
            eval_interval=2,
            hellaswag_interval=2,
            hellaswag_path=str(examples),
        ),
        capsys,
    )
    scores = [r for r in read_metrics(out) if "hellaswag/acc_norm" in r]
    assert [r["iter"] for r in scores] == [0, 2]
    # the score at step 2 is the one marsgpt/hellaswag.py gives the model the step-2 checkpoint holds
    from marsgpt import hellaswag

    model, _ = trained_model.load_model(out)
    expected = hellaswag.evaluate(model, hellaswag.load_examples(str(examples)), "cpu")
    assert scores[-1]["hellaswag/acc_norm"] == expected["acc_norm"] and expected["n"] == 8


def test_hellaswag_on_a_char_dataset_warns_once_and_trains(data_path, tmp_path, capsys):
    run_ok(tiny_args(data_path, str(tmp_path / "out"), max_iters=2, hellaswag_interval=1), capsys)
    err = capsys.readouterr().err
    assert err.count("warning: HellaSwag evaluation disabled: the dataset tiny is not GPT-2-tokenized") == 1


# ---------------------------------------------------------------------------------------------------
# Bad input: one line on stderr, exit 2, before any work.


def truncated_shard_data(tmp_path):
    data_dir = tmp_path / "shards"
    data_dir.mkdir()
    write_shard(data_dir / "fineweb_train_000001.bin", [1, 2, 3] * 100)
    write_shard(data_dir / "fineweb_val_000000.bin", [1, 2, 3] * 100)
    with open(data_dir / "fineweb_train_000001.bin", "r+b") as f:
        f.truncate(1024 + 100)
    return dict(data_path=str(tmp_path), dataset="shards")


def out_of_vocab_data(tmp_path):
    make_char_data(tmp_path, name="tiny")
    from marsgpt.tokens import write_bin

    write_bin(tmp_path / "tiny" / "val.bin", [0, 1, 2, 200] * 50)
    return dict(data_path=str(tmp_path), dataset="tiny")


def mismatching_checkpoint(tmp_path):
    make_char_data(tmp_path, name="tiny")
    args = tiny_args(str(tmp_path), str(tmp_path / "out"), max_iters=1, eval_interval=1)
    assert train.main(args) == 0
    return dict(data_path=str(tmp_path), out_dir=str(tmp_path / "out"), init_from="resume", n_layer=3)


def foreign_checkpoint(tmp_path):
    """A checkpoint as the reference train_mars.py writes one: weights, no resume state."""
    make_char_data(tmp_path, name="tiny")
    assert train.main(tiny_args(str(tmp_path), str(tmp_path / "out"), max_iters=1, eval_interval=1)) == 0
    ckpt = shards.load_checkpoint(str(tmp_path / "out"))
    keep = ("model", "model_args", "optimizer", "config")
    torch.save({k: ckpt[k] for k in keep} | {"iter_num": 1}, tmp_path / "out" / "ckpt.pt")
    return dict(data_path=str(tmp_path), out_dir=str(tmp_path / "out"), init_from="resume")


def broken_meta(tmp_path):
    make_char_data(tmp_path, name="tiny")
    (tmp_path / "tiny" / "meta.pkl").write_bytes(b"garbage\n")
    return dict(data_path=str(tmp_path), dataset="tiny")


def meta_directory(tmp_path):
    make_char_data(tmp_path, name="tiny")
    os.remove(tmp_path / "tiny" / "meta.pkl")
    (tmp_path / "tiny" / "meta.pkl").mkdir()
    return dict(data_path=str(tmp_path), dataset="tiny")


def corrupt_checkpoint(tmp_path):
    make_char_data(tmp_path, name="tiny")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "ckpt.pt").write_bytes(b"PK\x03\x04 not really a zip")
    return dict(data_path=str(tmp_path), out_dir=str(tmp_path / "out"), init_from="resume")


@pytest.mark.parametrize(
    "make_input, message",
    [
        (lambda p: dict(bogus=1), "unknown config key 'bogus'"),
        (lambda p: dict(batch_size="many"), "batch_size must be int"),
        (
            lambda p: dict(data_path=str(p), dataset="openwebtext"),
            "openwebtext not found; run: python -m data.openwebtext.prepare",
        ),
        (truncated_shard_data, "fineweb_train_000001.bin: header says 300 tokens"),
        (out_of_vocab_data, "token id 200 at position 3 is >= the model's vocabulary size"),
        (lambda p: dict(init_from="resume"), "no checkpoint at"),
        (broken_meta, "meta.pkl is not a readable meta.pkl"),
        (meta_directory, "meta.pkl is not a readable meta.pkl (IsADirectoryError)"),
        (corrupt_checkpoint, "ckpt.pt is not a readable checkpoint"),
        (mismatching_checkpoint, "was trained with n_layer=2 but the config gives n_layer=3; a resumed run cannot"),
        (foreign_checkpoint, "ckpt.pt lacks scaler, rng, progress: it was not written by this train.py"),
    ],
    ids=[
        "unknown-key",
        "wrong-type",
        "missing-data",
        "truncated-shard",
        "token-beyond-vocab",
        "resume-without-checkpoint",
        "broken-meta",
        "meta-directory",
        "corrupt-checkpoint",
        "shape-mismatch",
        "foreign-checkpoint",
    ],
)
def test_bad_input_is_one_line_and_exit_2(make_input, message, data_path, tmp_path, capsys):
    overrides = make_input(tmp_path)
    argv = tiny_args(
        overrides.pop("data_path", data_path), overrides.pop("out_dir", str(tmp_path / "new")), **overrides
    )
    capsys.readouterr()
    assert train.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and message in captured.err, captured.err
    assert captured.err.count("\n") == 1 and captured.out == ""  # nothing started


def test_world_size_must_divide_the_global_batch(data_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")  # checked before joining any process group
    assert train.main(tiny_args(data_path, str(tmp_path / "out"), gradient_accumulation_steps=4)) == 2
    assert (
        "gradient_accumulation_steps=4 (micro-batches per step across all ranks) is not divisible by the "
        "world size 3" in capsys.readouterr().err
    )


def test_a_checkpoint_from_before_a_part_was_added_resumes_it_afresh(data_path, tmp_path):
    """A part added since older checkpoints were written starts afresh in its own load_state_dict: a checkpoint
    without the log window (written, as every such one was, right after an evaluation) resumes and trains on."""
    out = str(tmp_path / "out")
    run_ok(tiny_args(data_path, out, max_iters=4, eval_interval=4))
    path = os.path.join(out, "ckpt.pt")
    ckpt = shards.load_checkpoint(path)
    del ckpt["log_window"]
    checkpoint.save_checkpoint(path, ckpt)
    run_ok(tiny_args(data_path, out, max_iters=6, eval_interval=4, init_from="resume"))
    assert shards.load_checkpoint(out)["progress"]["iter_num"] == 6
    assert [r["iter"] for r in read_metrics(out) if "train/loss" in r] == list(range(1, 7))


def test_shape_mismatch_names_the_tensor(tmp_path):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=40))
    state = {k: v[..., :1] if k == "transformer.h.0.mlp.c_fc.weight" else v for k, v in model.state_dict().items()}
    with pytest.raises(checkpoint.CheckpointError, match=r"'transformer.h.0.mlp.c_fc.weight' has shape \(128, 1\)"):
        checkpoint_parts.load_model_state(model, state, "x.pt")


# ---------------------------------------------------------------------------------------------------
# Runs and out_dir: a relaunch never destroys a run; a resume applies the configuration it is given.


def file_bytes(out_dir):
    return {name: open(os.path.join(out_dir, name), "rb").read() for name in sorted(os.listdir(out_dir))}


@pytest.mark.parametrize("init_from", ["scratch", "gpt2"])
def test_a_fresh_start_into_an_existing_run_is_refused_and_changes_nothing(data_path, tmp_path, capsys, init_from):
    out = str(tmp_path / "out")
    run_ok(tiny_args(data_path, out, max_iters=4, eval_interval=2))
    before = file_bytes(out)
    capsys.readouterr()
    assert train.main(tiny_args(data_path, out, max_iters=1, init_from=init_from)) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: out_dir {out} already holds a run (ckpt.pt)"), captured.err
    assert "--init_from=resume" in captured.err and "--overwrite=True" in captured.err
    assert captured.err.count("\n") == 1 and captured.out == ""
    assert file_bytes(out) == before


def test_an_out_dir_without_a_checkpoint_is_not_sent_to_resume(data_path, tmp_path, capsys):
    """An eval_only run leaves metrics.jsonl but no ckpt.pt: the refusal must not suggest --init_from=resume,
    which would then fail for want of a checkpoint."""
    out = str(tmp_path / "out")
    run_ok(tiny_args(data_path, out, eval_only=True))
    assert not os.path.exists(os.path.join(out, "ckpt.pt"))
    capsys.readouterr()
    assert train.main(tiny_args(data_path, out, max_iters=1)) == 2
    err = capsys.readouterr().err
    assert "no ckpt.pt to resume" in err and "--overwrite=True" in err and "--init_from=resume" not in err, err


def test_init_from_gpt2_refuses_a_dataset_with_its_own_vocabulary_before_downloading(
    data_path, tmp_path, monkeypatch, capsys
):
    def no_download(*args):
        raise AssertionError("GPT-2 was downloaded for a character-level dataset")

    monkeypatch.setattr(GPT, "from_pretrained", no_download)
    assert train.main(tiny_args(data_path, str(tmp_path / "out"), init_from="gpt2")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: init_from=gpt2 needs GPT-2-tokenized data") and err.count("\n") == 1, err


def test_a_relaunch_removes_what_a_killed_save_left_and_says_where_it_resumes(data_path, tmp_path, capsys):
    """kill -9 during a save leaves ckpt.pt.tmp.<pid>, as large as the checkpoint; the next launch removes
    it (not one whose process is alive), says which checkpoint and iteration it resumes, and says when
    there is nothing left to train."""
    out = str(tmp_path / "out")
    run_ok(tiny_args(data_path, out, max_iters=4, eval_interval=2))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = os.path.join(out, f"ckpt.pt.tmp.{dead.pid}")
    alive = os.path.join(out, f"ckpt.pt.tmp.{os.getpid()}")
    for path in (stale, alive):
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
    capsys.readouterr()
    run_ok(tiny_args(data_path, out, max_iters=4, eval_interval=2, init_from="resume"))
    printed = capsys.readouterr().out
    assert not os.path.exists(stale) and os.path.exists(alive)
    assert f"removed {stale}, left by an interrupted write" in printed
    assert f"resuming {os.path.join(out, 'ckpt.pt')} at iter 4" in printed
    assert "nothing to train: the run is at iter 4 and max_iters is 4" in printed


def test_keys_the_optimizer_does_not_read_are_named_not_silently_ignored(data_path, tmp_path, capsys):
    """Muon's AdamW part takes muon_adamw_lr: a --learning_rate given to a Muon run changes nothing, and the
    start says so; a resume names such a change as unused, and does not refuse a MARS-only fixed key."""
    out = str(tmp_path / "out")
    run_ok(tiny_args(data_path, out, optimizer="muon", learning_rate=1.0, gamma=0.5, max_iters=2), capsys)
    printed = capsys.readouterr().out
    assert "note: optimizer=muon does not use gamma=0.5, learning_rate=1.0 (Muon's lrs are" in printed
    resume = tiny_args(data_path, out, optimizer="muon", learning_rate=2.0, is_approx=False, max_iters=3)
    run_ok(resume + ["--init_from=resume"], capsys)
    printed = capsys.readouterr().out
    assert "resume: learning_rate 1.0 -> 2.0 (not used by optimizer=muon)" in printed
    assert "resume: is_approx True -> False (not used by optimizer=muon)" in printed


@pytest.mark.parametrize("optimizer", ["mars-adamw", "mars-lion"])
def test_momentum_metrics_compare_the_same_tensors(data_path, tmp_path, optimizer):
    """momentum_norm_sq (v's norm) and momentum_div exist only where MARS's matrices keep a v: for Lion and
    Shampoo they would be the 1-D AdamW tensors' v against every tensor's m."""
    out = str(tmp_path / "out")
    run_ok(tiny_args(data_path, out, optimizer=optimizer, max_iters=2))
    train_records = [r for r in read_metrics(out) if "train/loss" in r]
    assert train_records and all("momentum_norm" in r for r in train_records)
    assert all(("momentum_div" in r) == (optimizer == "mars-adamw") for r in train_records)


def test_overwrite_replaces_the_previous_run(data_path, tmp_path):
    out = str(tmp_path / "out")
    run_ok(tiny_args(data_path, out, max_iters=4, eval_interval=2, keep_every_n_evals=1))
    assert os.path.exists(os.path.join(out, "ckpt_0000002.pt"))
    run_ok(tiny_args(data_path, out, max_iters=1, overwrite=True))
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["progress"]["iter_num"] == 1
    assert not os.path.exists(os.path.join(out, "ckpt_0000002.pt"))
    assert max(r["iter"] for r in read_metrics(out)) == 1


def test_init_from_auto_starts_fresh_then_continues_exactly(data_path, tmp_path):
    """A preempted job relaunched with the same command continues: auto = resume when a checkpoint exists."""
    whole, pieces = str(tmp_path / "whole"), str(tmp_path / "pieces")
    run_ok(tiny_args(data_path, whole, max_iters=8, eval_interval=4))
    run_ok(tiny_args(data_path, pieces, max_iters=4, eval_interval=4, init_from="auto"))
    run_ok(tiny_args(data_path, pieces, max_iters=8, eval_interval=4, init_from="auto"))
    timing = {"time_s", "tokens_per_sec", "step_ms"}
    assert [{k: v for k, v in r.items() if k not in timing} for r in read_metrics(pieces)] == [
        {k: v for k, v in r.items() if k not in timing} for r in read_metrics(whole)
    ]
    assert json.load(open(os.path.join(pieces, "config.json")))["init_from"] == "resume"


def gpt2_tokenized_data(root, name="bpe"):
    """A dataset of random GPT-2 token ids (no meta.pkl: the GPT-2 vocabulary), under root/name."""
    from marsgpt.tokens import write_bin

    (root / name).mkdir()
    ids = torch.randint(0, 50257, (3000,), generator=torch.Generator().manual_seed(0)).numpy()
    write_bin(root / name / "train.bin", ids)
    write_bin(root / name / "val.bin", ids[:1000])
    return str(root)


@pytest.mark.slow
def test_init_from_gpt2_without_the_network_or_the_cache_is_one_error_line(tmp_path):
    """`python train.py --init_from=gpt2` on a machine that cannot download GPT-2 (HF_HUB_OFFLINE=1, Hugging Face's
    own switch, stands for no network) and has no copy in its cache: one line, exit 2, out_dir left as it was."""
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    args = tiny_args(gpt2_tokenized_data(tmp_path), str(out), dataset="bpe", init_from="gpt2", max_iters=1)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "empty_cache"), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: gpt2 is not in the local Hugging Face cache") and done.stderr.count("\n") == 1
    assert "load it once on a machine online" in done.stderr and not out.exists()


@pytest.mark.slow
def test_the_offline_hint_a_local_hugging_face_folder_trains(tmp_path, tiny_checkpoint):
    """The offline error offers --init_from=PATH: a Hugging Face GPT-2 folder (here python -m marsgpt.export_hf's
    of a one-layer GPT-2-vocabulary model) starts a run from its weights with the hub off, as --dry_run plans it;
    a folder that is not one is refused in one line before any work."""
    pytest.importorskip("transformers")
    tiny_checkpoint(tmp_path / "pretrained", 50257, block_size=64)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "empty_cache"), OMP_NUM_THREADS="1")
    hf = str(tmp_path / "hf")
    command = [sys.executable, "-m", "marsgpt.export_hf", str(tmp_path / "pretrained"), hf]
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    out = tmp_path / "out"
    args = tiny_args(gpt2_tokenized_data(tmp_path), str(out), dataset="bpe", init_from=hf, max_iters=2, eval_interval=2)
    done = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"start: init_from={hf}: a new run from its weights" in done.stdout
    assert "0.81M parameters, 1 layers x 16 wide, 2 heads" in done.stdout  # the folder's, not tiny_args' 2 x 64
    plan = train.main([*args, "--dry_run=True"])
    assert plan == 0
    refused = subprocess.run(
        [sys.executable, "train.py", *tiny_args(str(tmp_path), str(tmp_path / "o"), init_from=str(tmp_path))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "nor a local Hugging Face GPT-2 folder" in refused.stderr


@pytest.mark.slow
def test_a_run_started_from_gpt2_resumes_exactly(tmp_path, monkeypatch):
    """init_from=gpt2 builds OpenAI's shape (biases, the unpadded 50257 tokens), not the configuration's: a
    resume rebuilds the checkpoint's model. A tiny stand-in for GPT-2 replaces the download."""

    def tiny_gpt2(name, override_args, offline):
        assert offline  # the hub is unreachable (below): the cache at once, no retries
        torch.manual_seed(0)
        config = GPTConfig(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=16, bias=True)
        return GPT(GPTConfig(**{**dataclasses.asdict(config), **override_args}))

    monkeypatch.setattr(GPT, "from_pretrained", tiny_gpt2)
    monkeypatch.setattr(runtime, "network_reachable", lambda host: False)
    data_path = gpt2_tokenized_data(tmp_path)
    whole, pieces = str(tmp_path / "whole"), str(tmp_path / "pieces")
    args = dict(dataset="bpe", max_iters=4, eval_interval=2, init_from="gpt2")
    run_ok(tiny_args(data_path, whole, **args))
    run_ok(tiny_args(data_path, pieces, **{**args, "max_iters": 2}))
    run_ok(tiny_args(data_path, pieces, **{**args, "init_from": "resume"}))
    timing = {"time_s", "tokens_per_sec", "step_ms"}
    assert [{k: v for k, v in r.items() if k not in timing} for r in read_metrics(pieces)] == [
        {k: v for k, v in r.items() if k not in timing} for r in read_metrics(whole)
    ]
    resumed, uninterrupted = shards.load_checkpoint(pieces), shards.load_checkpoint(whole)
    assert resumed["model_args"]["vocab_size"] == 50257 and resumed["model_args"]["bias"] is True
    assert resumed["model_args"] == uninterrupted["model_args"]
    for key, value in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][key], value), key


def test_the_start_is_a_short_summary_of_what_the_launch_decided_and_verbose_prints_every_key(
    data_path, tmp_path, capsys
):
    """Before the first evaluation a few lines: how the run starts (init_from as given, and what auto decided),
    model, data, optimizer, batch, schedule, out_dir; every key is in config.json, and on the terminal only with
    --verbose=True."""
    out = str(tmp_path / "out")
    run_ok(tiny_args(data_path, out, init_from="auto", max_iters=2, eval_interval=2), capsys)
    head = capsys.readouterr().out.split("step 0:")[0].splitlines()
    assert len(head) <= 12, head
    assert head[0] == "start: init_from=auto -> scratch: a new run"
    assert not [line for line in head if re.match(r"\w+ = ", line)]
    assert f"out_dir: {out} (every key in its config.json; --verbose=True prints them here)" in head
    keys = set(config_to_dict(TrainConfig()))
    assert keys <= set(json.load(open(os.path.join(out, "config.json"))))
    run_ok(tiny_args(data_path, out, init_from="auto", max_iters=4, eval_interval=2, verbose=True), capsys)
    printed = capsys.readouterr().out
    assert "start: init_from=auto -> resume: continues at iter 2 of 4" in printed
    assert all(f"\n{key} = " in printed for key in keys)


def test_a_run_shorter_than_its_schedule_is_warned_and_scale_schedule_fits_it(data_path, tmp_path, capsys):
    """tiny_args' schedule: warmup 2, cosine to 20 steps. Run for 8 it warns (the lr never decays to min_lr);
    with scale_schedule the schedule is fitted to the 8 steps, and the lr follows the fitted one."""
    args = tiny_args(data_path, str(tmp_path / "cut"), max_iters=8, eval_interval=8)
    run_ok(args, capsys)
    warning = "warning: max_iters=8 stops the cosine decay (lr_decay_iters=20) at 28% of its length"
    assert warning in capsys.readouterr().err
    out = str(tmp_path / "fitted")
    run_ok(tiny_args(data_path, out, max_iters=8, eval_interval=8, scale_schedule=True), capsys)
    captured = capsys.readouterr()
    assert "warning: max_iters" not in captured.err
    assert "schedule fitted to max_iters (scale_schedule): warmup 1, decay to 8\n" in captured.out
    cfg = train.load_config(tiny_args(data_path, out, max_iters=8, warmup_iters=1, lr_decay_iters=8))
    for r in (r for r in read_metrics(out) if "lr" in r):  # a record at iter i was logged after step i - 1
        assert r["lr"] == pytest.approx(scheduled_lr(r["iter"] - 1, cfg, 3e-3), rel=1e-12)


@pytest.mark.slow
def test_divergence_then_resume_with_a_lower_learning_rate_trains_at_the_new_one(
    data_path, tmp_path, monkeypatch, capsys
):
    """The scenario the divergence message describes: non-finite steps stop the run; a resume with a lower
    learning_rate (and lr_1d, min_lr, weight decay, betas) trains with those values, and says so."""
    real = train.forward_backward
    monkeypatch.setattr(train, "forward_backward", diverging_from(real, first_step=6))
    out = str(tmp_path / "out")
    assert train.main(tiny_args(data_path, out, max_iters=20, max_bad_steps=3, learning_rate=1e-2)) == 1
    assert "resume it with --init_from=resume and a lower learning_rate" in capsys.readouterr().err
    monkeypatch.setattr(train, "forward_backward", real)

    changes = dict(learning_rate=1e-4, lr_1d=5e-5, min_lr=1e-5, weight_decay=0.05, beta2=0.98, grad_clip=0.5)
    argv = tiny_args(data_path, out, max_iters=20, max_bad_steps=3, **changes) + ["--init_from=resume"]
    run_ok(argv, capsys)
    out_text = capsys.readouterr().out
    assert "resume: learning_rate 0.01 -> 0.0001\n" in out_text
    assert "resume: lr_1d 0.003 -> 5e-05\n" in out_text and "resume: beta2 0.99 -> 0.98\n" in out_text
    cfg = train.load_config(argv)
    resumed = [r for r in read_metrics(out) if "train/loss" in r and r["iter"] > 5]
    assert [r["iter"] for r in resumed] == list(range(6, 21))
    for r in resumed:  # a record at iter i was logged after step i - 1
        assert r["lr"] == pytest.approx(scheduled_lr(r["iter"] - 1, cfg, 1e-4), rel=1e-12)
        assert math.isfinite(r["train/loss"])
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    groups = ckpt["optimizer"]["param_groups"]
    assert {g["initial_lr"] for g in groups} == {1e-4}
    assert {g["weight_decay"] for g in groups} == {0.05, 0.0} and {g["betas"] for g in groups} == {(0.95, 0.98)}
    assert {g["lr_1d_factor"] for g in groups} == {0.5}


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(optimizer="adamw"),
            "was trained with optimizer='mars-adamw' but the config gives optimizer='adamw'",
        ),
        (dict(mars_type="mars-lion"), "optimizer='mars-adamw' but the config gives optimizer='mars-lion'"),
        (dict(is_approx=False), "is_approx=True but the config gives is_approx=False"),
        (dict(optimize_1d=True), "optimize_1d=False but the config gives optimize_1d=True"),
        (dict(n_embd=32), "n_embd=64 but the config gives n_embd=32"),
    ],
)
def test_resume_refuses_keys_a_run_cannot_change(data_path, tmp_path, capsys, change, message):
    out = str(tmp_path / "out")
    run_ok(tiny_args(data_path, out, max_iters=2, eval_interval=2))
    before = file_bytes(out)
    capsys.readouterr()
    assert train.main(tiny_args(data_path, out, max_iters=4, init_from="resume", **change)) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and message in captured.err and "a resumed run cannot" in captured.err
    assert captured.err.count("\n") == 1 and captured.out == ""
    assert file_bytes(out) == before


# --- DDP's gradient buckets


def bucket_worker(rank, rendezvous_env, data_path, out, report_path):
    """Two gloo ranks through train.setup and train.train_step: after each backward pass, how many storages
    hold the gradients (a no_sync micro-batch, then the synced one, step after step)."""
    os.environ.update(rendezvous_env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    cfg = train.load_config(tiny_args(data_path, out, gradient_accumulation_steps=4, max_iters=3, eval_interval=3))
    dist_info = train.setup_distributed(cfg)
    run, _, _ = train.setup(cfg, dist_info)
    params = list(run.model.parameters())
    storages = []  # per backward pass: the distinct storages of the gradients and their bytes

    def count(*_):
        grads = [p.grad for p in params]
        ptrs = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
        storages.append((len(ptrs), sum(ptrs.values())))

    real_forward_backward = train.forward_backward

    def forward_backward(run, step):
        loss = real_forward_backward(run, step)
        count()
        return loss

    def before_forward(*_):  # from the second micro-batch on: after the no_sync micro-batch's backward pass
        if torch.is_grad_enabled() and params[0].grad is not None:
            count()

    run.model.register_forward_pre_hook(before_forward)
    train.forward_backward = forward_backward
    for it in range(3):
        train.train_step(run, it)
    plan = memory_plan.plan(cfg, 2, model_args=run.model_args)
    report = dict(storages=storages, n_params=len(params), plan_gradient_bytes=plan.gradient_bytes)
    torch.save(report, f"{report_path}.{rank}")
    # Leave without tearing the gloo group down: its destructor can deadlock with its own thread at exit
    # (seen in this test under load), and the report is on disk already.
    os._exit(0)


@pytest.mark.slow
def test_ddp_gradients_stay_in_the_buckets_through_accumulation(data_path, tmp_path):
    """gradient_as_bucket_view saves a gradient copy only while the gradients are DDP's bucket views: after
    the no_sync micro-batch and after the synced one, in the first step and every later one, the gradients
    live in one storage per bucket, as many bytes as the memory plan's gradient term."""
    path = str(tmp_path / "report")
    with rendezvous() as env:
        torch.multiprocessing.spawn(bucket_worker, args=(env, data_path, str(tmp_path / "out"), path), nprocs=2)
    for rank in range(2):
        report = torch.load(f"{path}.{rank}", weights_only=False)
        # each of the 3 steps: after the no_sync micro-batch's backward pass and after the synced one's
        assert len(report["storages"]) >= 6
        assert report["n_params"] > 4
        for n_storages, nbytes in report["storages"]:
            assert n_storages <= 2  # DDP's first bucket is small, the rest one: never one per parameter
            assert nbytes == report["plan_gradient_bytes"]


def test_ddp_syncs_no_buffer_before_a_forward_pass_and_warns_nothing(monkeypatch):
    """wrap_ddp: the GPT's buffers (the per-layer attention factors) are the same constants on every rank, so DDP
    syncs none before each forward pass; on torch 2.13 through forward_sync_buffers=False, where
    broadcast_buffers=False printed a FutureWarning on every launch."""
    import torch.distributed as dist

    from marsgpt import parallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            ddp = parallel.wrap_ddp(torch.nn.Linear(2, 2), SimpleNamespace(device_type="cpu", local_rank=0))
        assert getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None)) is False
        # a torch whose DDP does not know forward_sync_buffers (2.11, the H200's image) gets broadcast_buffers=False
        monkeypatch.setattr(parallel, "DDP_KEYWORDS", {})
        with pytest.warns(FutureWarning, match="`broadcast_buffers` is deprecated"):
            ddp = parallel.wrap_ddp(torch.nn.Linear(2, 2), SimpleNamespace(device_type="cpu", local_rank=0))
        assert ddp.forward_sync_buffers is False
    finally:
        dist.destroy_process_group()


def test_an_error_that_is_not_the_repositorys_keeps_its_traceback(data_path, tmp_path, monkeypatch):
    """A ValueError or OSError from a researcher's own change is a bug to see whole, not an `error:` line."""
    from marsgpt import launch

    def broken_build_model(cfg, vocab_size, ckpt):
        raise ValueError("a bug in my model change")

    monkeypatch.setattr(launch, "build_model", broken_build_model)
    with pytest.raises(ValueError, match="a bug in my model change"):
        train.main(tiny_args(data_path, str(tmp_path / "out")))
