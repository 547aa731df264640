"""train.py's float16 path, the one dtype=auto takes on GPUs without native bfloat16 (V100, T4), run on the
CPU: the GradScaler, the steps it skips, exact MARS's look-ahead gradient unscaled by hand, and the
scaler's state across a kill -9 and resume, bit for bit.

The runs start at the GradScaler's initial scale (65,536) with grad_multiplier=1000, so the scaled
gradients of their first steps overflow float16, as a float16 run's first steps can: the scaler lowers its
scale on each, the step is skipped, and the run trains once the scale fits."""

import math
import os
import signal

import pytest
import torch
from test_train_faults import assert_same_run, run_to_end
from train_helpers import launch, subprocess_env, tiny_args, wait_for_line

import train
from marsgpt import metrics
from marsgpt.config import load_config
from marsgpt.runtime import Dist

INITIAL_SCALE = torch.amp.GradScaler("cpu").get_scale()
# grad_clip above the gradients' norms (about 2,000 with this multiplier): the clip runs and changes nothing, so
# a look-ahead gradient left scaled (65,536 x) shows; clipped to a norm both exceed, the two would be equal.
FLOAT16_RUN = dict(
    dtype="float16", is_approx=False, grad_multiplier=1000, grad_clip=1e4, max_bad_steps=20, log_interval=1
)
# checkpoints at 0, 5, 10, 15, 20; the run is killed at step 13, after the one at 10
RESUMED_RUN = dict(FLOAT16_RUN, max_iters=20, eval_interval=5)


def records(out_dir):
    return metrics.read_records(out_dir)


def saved_scale(out_dir):
    return torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)["scaler"]["scale"]


@pytest.mark.slow
def test_a_float16_exact_mars_run_skips_its_overflowing_steps_and_resumes_bit_exact(data_path, tmp_path):
    reference = str(tmp_path / "uninterrupted")
    run_to_end(tiny_args(data_path, reference, **RESUMED_RUN))
    skips = [r for r in records(reference) if metrics.SKIPPED_STEPS in r and metrics.TRAIN_LOSS not in r]
    assert skips and skips[0][metrics.ITER] == 1  # the first steps overflow, and the lowered scale then fits
    trained = [r[metrics.ITER] for r in records(reference) if math.isfinite(r.get(metrics.TRAIN_LOSS) or math.nan)]
    assert len(trained) >= 10 and trained[-1] == 20
    assert saved_scale(reference) < INITIAL_SCALE

    out, pause = str(tmp_path / "killed"), str(tmp_path / "pause")
    args = tiny_args(data_path, out, **RESUMED_RUN)
    proc = launch(args, env=subprocess_env(TEST_PAUSE=f"0:13:{pause}"))  # killed where it waits: not past 15
    wait_for_line(proc, "paused before step 13")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    checkpoint = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert checkpoint["progress"]["iter_num"] == 10 and checkpoint["scaler"]["scale"] < INITIAL_SCALE
    run_to_end(args + ["--init_from=resume"])
    assert_same_run(out, reference)  # losses, skipped steps, weights and optimizer state
    assert saved_scale(out) == saved_scale(reference)


# ---------------------------------------------------------------------------------------------------
# train.train_step against the protocol docs/mars.md ("With a GradScaler") and train_step's docstring
# describe, written out here with the GradScaler's and MARS's public calls.


def documented_step(run, it):
    """Exact MARS under a GradScaler, with clipping: the next batch's gradient at the current parameters,
    unscaled by hand (scaler.unscale_ may run once per step, and the step's own gradient needs it), clipped,
    and kept as the look-ahead; then the step's own gradient, unscaled by the scaler and clipped. A step
    with a non-finite norm is skipped, and the scaler still updates its scale (it lowers it when the step's
    own gradient overflowed), as scaler.step and scaler.update would."""
    cfg, optimizer, scaler, mars = (
        run.cfg,
        run.optimizer.torch_optimizer,
        run.optimizer.scaler,
        run.optimizer.look_ahead,
    )
    parameters = list(run.model.parameters())
    run.optimizer.set_lr(it)
    train.forward_backward(run, it + 1)
    for p in parameters:
        p.grad.mul_(1.0 / scaler.get_scale())
    look_ahead_norm = torch.nn.utils.clip_grad_norm_(parameters, cfg.grad_clip)
    mars.update_previous_grad()
    optimizer.zero_grad(set_to_none=True)
    train.forward_backward(run, it)
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(parameters, cfg.grad_clip)
    skipped = not (math.isfinite(look_ahead_norm.item()) and math.isfinite(norm.item()))
    if skipped and math.isfinite(norm.item()):  # the look-ahead alone overflowed: the scaler did not see it
        scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
    elif skipped:
        scaler.update()
    else:
        scaler.step(optimizer)
        scaler.update()
        mars.update_last_grad()
    optimizer.zero_grad(set_to_none=True)
    return skipped


@pytest.mark.slow
def test_train_step_is_the_documented_float16_exact_mars_protocol(data_path, tmp_path, request):
    runs = []
    for name in ("train_step", "documented"):
        cfg = load_config(tiny_args(data_path, str(tmp_path / name), **FLOAT16_RUN))
        run, _, _ = train.setup(cfg, Dist())
        request.addfinalizer(run.metrics.close)
        runs.append(run)
    ours, documented = runs
    assert ours.optimizer.scaler.is_enabled() and ours.optimizer.look_ahead is not None
    skipped = []
    for it in range(20):
        result = train.train_step(ours, it)
        assert result.skipped == documented_step(documented, it), it
        skipped.append(result.skipped)
        assert ours.optimizer.scaler.state_dict() == documented.optimizer.scaler.state_dict(), it
        for p, q in zip(ours.model.parameters(), documented.model.parameters(), strict=True):
            assert torch.equal(p, q), it
        for p, q in zip(ours.model.parameters(), documented.model.parameters(), strict=True):
            for key, value in ours.optimizer.state[p].items():  # a skipped look-ahead leaves its NaN in previous_grad
                expected = documented.optimizer.state[q][key]
                torch.testing.assert_close(value, expected, rtol=0, atol=0, equal_nan=True, msg=f"{key} at {it}")
    assert skipped[0] and not skipped[-1]  # overflows at the initial scale, then steps
    assert ours.optimizer.scaler.get_scale() < INITIAL_SCALE


def test_an_overflow_in_the_look_ahead_alone_lowers_the_loss_scale(data_path, tmp_path, request, monkeypatch):
    """The GradScaler sees the step's own gradient only. A look-ahead gradient that overflows while the step's
    own does not skips the step and lowers the scale all the same: left as it was, the next look-ahead would
    overflow again, step after step, until max_bad_steps stops the run."""
    run, _, _ = train.setup(load_config(tiny_args(data_path, str(tmp_path / "out"), **FLOAT16_RUN)), Dist())
    request.addfinalizer(run.metrics.close)
    it = 0
    while train.train_step(run, it).skipped:  # past the first steps' overflows, to a scale that fits
        it += 1
    real_forward_backward = train.forward_backward
    calls = []

    def overflowing_look_ahead(run, step):
        loss = real_forward_backward(run, step)
        calls.append(step)
        if calls == [it + 2]:  # the first pass of step it + 1: its look-ahead
            next(run.model.parameters()).grad.view(-1)[0] = math.inf
        return loss

    monkeypatch.setattr(train, "forward_backward", overflowing_look_ahead)
    scale = run.optimizer.scaler.get_scale()
    result = train.train_step(run, it + 1)
    assert result.skipped and result.non_finite == "look-ahead gradient norm inf"
    assert run.optimizer.scaler.get_scale() == scale * run.optimizer.scaler.get_backoff_factor()
    assert not train.train_step(run, it + 2).skipped
