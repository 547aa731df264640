"""marsgpt/metrics.py's reading aids: durations, the progress a train line reports, the summary that ends a run."""

import json
import os

import pytest
import torch
from train_helpers import tiny_args

import train
from marsgpt import metrics


@pytest.mark.parametrize(
    "seconds, text",
    [(0, "0 s"), (44.6, "45 s"), (60, "1 min"), (877, "14 min 37 s"), (3600, "1 h"), (11_530, "3 h 12 min")],
)
def test_durations_read_in_two_units_at_most(seconds, text):
    assert metrics.format_duration(seconds) == text
    assert metrics.format_duration(2 * 86_400 + 5 * 3600 + 59) == "2 d 5 h"


def test_progress_goes_by_the_pace_since_the_first_train_line(monkeypatch):
    """The first line has only its own steps to go by; later lines the whole time since the first, so a slow first
    step (a compile) or an evaluation between lines weighs as much as it will over the rest of the run."""
    clock = iter([110.0, 110.0, 130.0])  # the line at iter 10, the window's restart, the line at iter 20
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    window = metrics.LogWindow(t0=100.0)
    for _ in range(10):
        window.add(torch.tensor(1.0), skipped=False)
    assert window.progress(10, 1000) == "1.0% done, 16 min 30 s left"  # 1 s a step, 990 steps left
    window.restart()
    assert window.progress(20, 1000) == "2.0% done, 32 min 40 s left"  # 20 s over 10 steps: 2 s a step


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
