"""marsgpt/metrics.py: metrics.jsonl as a crash leaves it -- cut short, unsynced, garbage at the end -- is read
without a crash, repaired on resume and its losses named; what an evaluation appends stays readable. And its
reading aids: durations, the progress a train line reports, the summary that ends a run."""

import json
import os
import types

import pytest
import torch
from train_helpers import tiny_args

import train
from marsgpt import metrics


def row(iteration, **values):
    record = {"iter": iteration, "tokens": iteration * 10, "time_s": iteration / 2, **values}
    return (json.dumps(record) + "\n").encode()


def write(out_dir, *chunks):
    """metrics.jsonl in out_dir made of these bytes; the size of each prefix, chunk by chunk."""
    os.makedirs(out_dir, exist_ok=True)
    sizes, data = [], b""
    for chunk in chunks:
        data += chunk
        sizes.append(len(data))
    with open(os.path.join(out_dir, metrics.FILE_NAME), "wb") as f:
        f.write(data)
    return sizes


def open_log(out_dir, resume_iter, synced_size=None, truncate=True):
    cfg = types.SimpleNamespace(out_dir=str(out_dir), wandb_log=False)
    return metrics.MetricsLog(cfg, True, resume_iter, "", {}, truncate=truncate, synced_size=synced_size)


GARBAGE = b"\xff\xfe{\n\x00\x00\x00\x9c"  # not UTF-8, with a newline inside: what a lost node may leave


def test_a_resume_keeps_the_whole_records_up_to_its_step_and_drops_the_garbage_a_crash_left(tmp_path):
    sizes = write(tmp_path, row(0, **{"val/loss": 3.0}), row(1, **{"train/loss": 3.1}), row(2), GARBAGE)
    log = open_log(tmp_path, resume_iter=1, synced_size=sizes[1])
    log.write({"iter": 2, "tokens": 20, "time_s": 1.0, "train/loss": 2.9})
    log.close()
    assert [(r["iter"], sorted(r)[-1]) for r in metrics.read_records(tmp_path)] == [
        (0, "val/loss"),
        (1, "train/loss"),
        (2, "train/loss"),
    ]
    assert log.lost is None  # the records up to the checkpoint's step all survived
    (repair,) = log.repairs
    assert "dropped 2 line(s) that are not whole records" in repair and "line 4" in repair
    assert "not UTF-8 text" in repair


def test_records_lost_before_the_checkpoint_are_named_and_a_torn_evaluation_row_goes(tmp_path):
    """The node was lost after the checkpoint at iter 2: the evaluation row of iter 2, which the checkpoint saw
    synced, survived only in part. The resume keeps what is whole and names the gap."""
    sizes = write(tmp_path, row(0), row(1), row(2, **{"val/loss": 2.5}))
    with open(tmp_path / metrics.FILE_NAME, "r+b") as f:
        f.truncate(sizes[2] - 7)
    log = open_log(tmp_path, resume_iter=2, synced_size=sizes[2])
    log.close()
    assert [r["iter"] for r in metrics.read_records(tmp_path)] == [0, 1]
    assert log.lost == (
        f"{tmp_path / metrics.FILE_NAME} holds {sizes[1]:,} intact bytes of the {sizes[2]:,} it held when the "
        "checkpoint was written: records of the steps before it were lost"
    )
    assert "line 3" in log.repairs[0] and "cut short" in log.repairs[0]


def test_sync_returns_the_size_on_disk_that_the_checkpoint_records(tmp_path):
    log = open_log(tmp_path, resume_iter=None)
    log.write({"iter": 0, "tokens": 0, "time_s": 0.0, "val/loss": 3.0})
    size = log.sync()
    log.close()
    assert size == os.path.getsize(tmp_path / metrics.FILE_NAME) > 0
    log = open_log(tmp_path, resume_iter=0, synced_size=size)
    assert log.lost is None and log.repairs == []


def test_an_evaluation_appended_after_a_torn_line_is_readable(tmp_path):
    """eval_only (truncate=False) appends to the file as it is: the torn line goes first, or the new record would
    continue it and read_metrics refuse the file."""
    write(tmp_path, row(0, **{"val/loss": 3.0}), b'{"iter": 1, "tokens": 1')
    log = open_log(tmp_path, resume_iter=1, truncate=False)
    log.write({"iter": 1, "tokens": 10, "time_s": 0.5, "val/loss": 2.8, "eval/train_loss": 2.7})
    log.close()
    assert [point[3] for point in metrics.read_metrics(tmp_path)["val/loss"]] == [3.0, 2.8]


def test_readers_skip_a_last_line_cut_short_and_name_any_other_damaged_line(tmp_path):
    write(tmp_path, row(0), b"\x00\x00\x9c")  # no newline: a write cut short, whatever its bytes
    assert [r["iter"] for r in metrics.read_records(tmp_path)] == [0]
    write(tmp_path, row(0), GARBAGE, row(1))
    with pytest.raises(ValueError, match="line 2: not UTF-8 text"):
        metrics.read_records(tmp_path)


@pytest.mark.parametrize(
    "seconds, text",
    [(0, "0 s"), (44.6, "45 s"), (60, "1 min"), (877, "14 min 37 s"), (3600, "1 h"), (11_530, "3 h 12 min")],
)
def test_durations_read_in_two_units_at_most(seconds, text):
    assert metrics.format_duration(seconds) == text
    assert metrics.format_duration(2 * 86_400 + 5 * 3600 + 59) == "2 d 5 h"


def test_progress_goes_by_the_pace_of_the_recent_train_lines(monkeypatch):
    """The first line has only its own steps to go by; later lines the time since the oldest line of the last
    PACE_WINDOW_S seconds (an evaluation between lines counted), so when the machine slows down the time left
    follows the new pace within the window, not the average since the run began."""
    now = [110.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    window = metrics.LogWindow(t0=100.0)
    for _ in range(10):
        window.add(torch.tensor(1.0), skipped=False)
    assert window.progress(10, 1000) == "1.0% done, 16 min 30 s left"  # 1 s a step, 990 steps left
    window.restart()
    now[0] = 130.0
    assert window.progress(20, 1000) == "2.0% done, 32 min 40 s left"  # 20 s over 10 steps: 2 s a step
    for it in range(30, 210, 10):  # steady at 2 s a step: 180 steps, 360 s
        now[0] += 20.0
        window.progress(it, 1000)
    for it in range(210, 410, 10):  # then 6 s a step (other work took the cores): 200 steps, 1200 s
        now[0] += 60.0
        line = window.progress(it, 1000)
    assert line == "40.0% done, 1 h left"  # 600 steps at 6 s, not the 4.2 s a step since iter 10
    assert now[0] - window.lines[1][1] < metrics.PACE_WINDOW_S <= now[0] - window.lines[0][1]


def write_records(out_dir, records):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, metrics.FILE_NAME), "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


def test_the_summary_names_the_best_evaluation_the_run_s_size_and_the_plot_command(tmp_path):
    out = str(tmp_path / "out")
    losses = {0: 4.0, 100: 2.5, 200: 2.25, 300: 2.3}
    write_records(
        out, [{"iter": i, "tokens": 10 * i, "time_s": i / 10, metrics.VAL_LOSS: v} for i, v in losses.items()]
    )
    lines = metrics.summary_lines(out, tokens=3000, time_s=95, best_checkpoint=f"{out}/best.pt")
    assert lines == [
        f"best val loss 2.2500 at iter 200 ({out}/best.pt holds it); trained 3,000 tokens in 1 min 35 s",
        f"metrics: {out}/metrics.jsonl; plot them: python -m marsgpt.plot {out} --out {out}/loss.png",
    ]


def test_a_summary_without_evaluations_says_what_was_trained(tmp_path):
    out = str(tmp_path / "out")
    write_records(out, [{"iter": 1, "tokens": 10, "time_s": 0.1, metrics.TRAIN_LOSS: 3.0}])
    assert metrics.summary_lines(out, tokens=10, time_s=0.1)[0] == "trained 10 tokens in 0 s"


@pytest.mark.slow
def test_a_run_reports_its_progress_and_ends_with_its_summary(data_path, tmp_path, capsys, one_thread):
    out = str(tmp_path / "out")
    assert train.main(tiny_args(data_path, out, max_iters=8, eval_interval=4, log_interval=4)) == 0
    printed = capsys.readouterr().out.splitlines()
    train_lines = [line for line in printed if line.startswith("iter ")]
    assert [line.split("; ")[-1].split(",")[0] for line in train_lines] == ["50.0% done", "100.0% done"]
    assert train_lines[-1].endswith(", 0 s left")
    best = min(r[metrics.VAL_LOSS] for r in metrics.read_records(out) if metrics.VAL_LOSS in r)
    assert printed[-2].startswith(f"best val loss {best:.4f} at iter ") and "trained 2,048 tokens in " in printed[-2]
    assert printed[-1] == f"metrics: {out}/metrics.jsonl; plot them: python -m marsgpt.plot {out} --out {out}/loss.png"
