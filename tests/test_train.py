"""train.py in one process on the CPU: learning, metrics, exact MARS, wandb, divergence guard, bad input."""

import json
import math
import os

import pytest
import torch
from train_helpers import make_char_data, tiny_args

import checkpoint
import train
from model import GPT, GPTConfig
from tokens import TokenData, write_shard


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models run faster single-threaded on shared cores
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return make_char_data(tmp_path_factory.mktemp("data"))


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
    assert ckpt["iter_num"] == 20 and ckpt["tokens"] == 20 * 256
    assert ckpt["best_val_loss"] == min(r["val/loss"] for r in eval_lines)
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
    model = GPT(GPTConfig(**train.model_args_from_config(cfg, data.vocab_size)))  # the step-0 weights
    for k in range(cfg.gradient_accumulation_steps):
        x, y = data.get_batch(cfg.seed, 1, k, cfg.batch_size, cfg.block_size)
        (model(x, y)[1] / cfg.gradient_accumulation_steps).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)

    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    state = ckpt["optimizer"]["state"]
    group_params = [i for g in ckpt["optimizer"]["param_groups"] for i in g["params"]]
    order = dict(
        zip(group_params, [p for g in train.build_optimizer(model, cfg, "cpu").param_groups for p in g["params"]])
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


def test_grad_multiplier_scales_the_gradient_not_the_loss(data_path, tmp_path):
    """The paper's configs reproduce its summed (not averaged) micro-batch gradients with grad_multiplier."""
    first_lines = {}
    for multiplier in (1, 4):
        out = str(tmp_path / f"x{multiplier}")
        run_ok(tiny_args(data_path, out, max_iters=1, eval_interval=1, grad_clip=0.0, grad_multiplier=multiplier))
        first_lines[multiplier] = next(r for r in read_metrics(out) if "train/loss" in r)
    assert first_lines[4]["train/loss"] == first_lines[1]["train/loss"]
    assert first_lines[4]["grad_norm"] == pytest.approx(4 * first_lines[1]["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_wandb_offline_writes_its_run_and_resume_continues_it(data_path, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = str(tmp_path / "out")
    run_ok(tiny_args(data_path, out, max_iters=3, eval_interval=3, wandb_log=True, wandb_project="test"))
    run_id = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["wandb_run_id"]
    assert run_id
    run_ok(
        tiny_args(
            data_path, out, max_iters=6, eval_interval=3, wandb_log=True, wandb_project="test", init_from="resume"
        )
    )
    runs = sorted(os.listdir(tmp_path / "wandb"))
    offline = [r for r in runs if r.startswith("offline-run-")]
    assert len(offline) == 2 and all(r.endswith(run_id) for r in offline)
    for r in offline:
        assert any(
            f.endswith(".wandb") and os.path.getsize(tmp_path / "wandb" / r / f) > 0
            for f in os.listdir(tmp_path / "wandb" / r)
        )


@pytest.mark.parametrize("is_approx", [True, False])
def test_non_finite_step_changes_nothing(data_path, tmp_path, monkeypatch, is_approx):
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
    assert checkpoint.load_checkpoint(out)["iter_num"] == 5  # the evaluation before the bad steps


def test_save_interrupted_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save_checkpoint(path, {"model": {"w": torch.ones(3)}, "model_args": {}, "iter_num": 1})

    def disk_full(obj, f):
        f.write(b"partial bytes")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    with pytest.raises(checkpoint.CheckpointError, match="No space left on device; the previous one is kept"):
        checkpoint.save_checkpoint(path, {"model": {"w": torch.zeros(3)}, "model_args": {}, "iter_num": 2})
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left
    assert checkpoint.load_checkpoint(path)["iter_num"] == 1


def test_checkpoints_load_without_running_code(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = tmp_path / "evil.pt"
    torch.save({"model": Payload(), "model_args": {}, "iter_num": 0}, path)
    with pytest.raises(checkpoint.CheckpointError, match="not a readable checkpoint"):
        checkpoint.load_checkpoint(str(path))


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    import random

    import numpy as np

    path = str(tmp_path / "rng.pt")
    checkpoint.save_checkpoint(path, {"model": {}, "model_args": {}, "iter_num": 0, "rng": checkpoint.rng_state()})
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.set_rng_state(checkpoint.load_checkpoint(path)["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


@pytest.mark.slow
def test_hellaswag_in_the_loop_on_gpt2_tokens(tmp_path, capsys):
    from tokens import write_bin

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
    examples.write_text(json.dumps(example) + "\n" + json.dumps(dict(example, label=3)) + "\n")
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
    assert all(r["hellaswag/acc_norm"] in (0.0, 0.5, 1.0) for r in scores)


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
    from tokens import write_bin

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
    ckpt = checkpoint.load_checkpoint(str(tmp_path / "out"))
    keep = ("model", "model_args", "optimizer", "iter_num", "best_val_loss", "config")
    torch.save({k: ckpt[k] for k in keep}, tmp_path / "out" / "ckpt.pt")
    return dict(data_path=str(tmp_path), out_dir=str(tmp_path / "out"), init_from="resume")


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
            "openwebtext not found; run: python data/openwebtext/prepare.py",
        ),
        (truncated_shard_data, "fineweb_train_000001.bin: header says 300 tokens"),
        (out_of_vocab_data, "token id 200 at position 3 is >= the model's vocabulary size"),
        (lambda p: dict(init_from="resume"), "no checkpoint at"),
        (corrupt_checkpoint, "ckpt.pt is not a readable checkpoint"),
        (mismatching_checkpoint, "was trained with n_layer=2 but the config gives n_layer=3"),
        (foreign_checkpoint, "ckpt.pt lacks scaler, rng, tokens"),
    ],
    ids=[
        "unknown-key",
        "wrong-type",
        "missing-data",
        "truncated-shard",
        "token-beyond-vocab",
        "resume-without-checkpoint",
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


def test_shape_mismatch_names_the_tensor(tmp_path):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=40))
    state = {k: v[..., :1] if k == "transformer.h.0.mlp.c_fc.weight" else v for k, v in model.state_dict().items()}
    with pytest.raises(checkpoint.CheckpointError, match=r"'transformer.h.0.mlp.c_fc.weight' has shape \(128, 1\)"):
        checkpoint.load_model_state(model, state, "x.pt")
