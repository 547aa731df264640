import json
import os
import sys

import pytest

from marsgpt import metrics, plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir, losses, eval_every=5, tokens_per_iter=1000, s_per_iter=0.5, extra_lines=()):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for it, loss in enumerate(losses):
            base = dict(iter=it, tokens=it * tokens_per_iter, time_s=it * s_per_iter)
            f.write(json.dumps({**base, "train/loss": loss, "lr": 1e-3}) + "\n")
            if it % eval_every == 0:
                f.write(json.dumps({**base, "val/loss": loss + 0.1, "eval/train_loss": loss}) + "\n")
        for line in extra_lines:
            f.write(line)


def assert_png(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000


def test_two_runs_render_with_every_run_in_every_panel(tmp_path):
    write_run(tmp_path / "mars", [4.0 - 0.1 * i for i in range(20)])
    write_run(tmp_path / "adamw", [4.0 - 0.05 * i for i in range(20)], s_per_iter=0.4)
    out = tmp_path / "fig.png"
    fig = plot.plot_runs([tmp_path / "mars", tmp_path / "adamw"], out)
    assert_png(out)
    axes = fig.axes
    assert len(axes) == 4
    for ax in axes:
        assert [line.get_label() for line in ax.get_lines()] == ["mars", "adamw"]
    # x axes: tokens (millions) on the left, minutes on the right; y is the loss itself
    train_tokens, train_time = axes[0].get_lines()[0], axes[1].get_lines()[0]
    assert train_tokens.get_xdata()[-1] == pytest.approx(19 * 1000 / 1e6)
    assert train_time.get_xdata()[-1] == pytest.approx(19 * 0.5 / 60)
    assert train_tokens.get_ydata()[-1] == pytest.approx(4.0 - 1.9)
    val = axes[2].get_lines()[1]
    assert list(val.get_ydata()) == pytest.approx([4.1, 3.85, 3.6, 3.35])


@pytest.mark.slow
def test_labels_and_cli(tmp_path, capsys):
    write_run(tmp_path / "a", [3.0, 2.5, 2.0])
    write_run(tmp_path / "b", [3.0, 2.8, 2.6])
    out = tmp_path / "cli.png"
    assert plot.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), "--labels", "MARS", "AdamW"]) == 0
    assert_png(out)
    fig = plot.plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "x.png", labels=["MARS", "AdamW"])
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["MARS", "AdamW"]
    assert plot.main([str(tmp_path / "a"), "--out", str(out), "--labels", "one", "two"]) == 2
    assert "2 labels for 1 runs" in capsys.readouterr().err
    assert plot.main([str(tmp_path / "a"), "--out", str(out), "--ylim", "3", "2"]) == 2
    assert "LOW must be below HIGH" in capsys.readouterr().err
    # No extension: the PNG matplotlib writes gets .png, and the printed name is that file's.
    assert plot.main([str(tmp_path / "a"), "--out", str(tmp_path / "curves")]) == 0
    assert f"wrote {tmp_path / 'curves.png'}" in capsys.readouterr().out
    assert_png(tmp_path / "curves.png")


def test_resumed_run_keeps_the_latest_record_of_each_iteration(tmp_path):
    resumed = [json.dumps({"iter": i, "tokens": i * 10, "time_s": 100 + i, "train/loss": 1.0}) + "\n" for i in (3, 4)]
    write_run(tmp_path / "r", [5.0, 4.0, 3.0, 2.0, 1.5], extra_lines=resumed)
    series = plot.read_metrics(tmp_path / "r")
    assert [p[0] for p in series["train/loss"]] == [0, 1, 2, 3, 4]
    assert [p[3] for p in series["train/loss"]] == [5.0, 4.0, 3.0, 1.0, 1.0]


def test_half_written_last_line_is_ignored(tmp_path):
    write_run(tmp_path / "k", [3.0, 2.0], extra_lines=['{"iter": 2, "tokens": 20'])
    assert len(plot.read_metrics(tmp_path / "k")["train/loss"]) == 2


def test_read_records_returns_every_record_but_a_half_written_last_line(tmp_path):
    write_run(tmp_path / "k", [3.0, 2.0], extra_lines=['{"iter": 2, "tokens": 20'])
    records = metrics.read_records(tmp_path / "k")
    assert [(r["iter"], "val/loss" in r) for r in records] == [(0, False), (0, True), (1, False)]
    (tmp_path / "k" / "metrics.jsonl").write_text('{"iter": 0}\n{"iter": 1\n{"iter": 2}\n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        metrics.read_records(tmp_path / "k")


def test_missing_empty_and_corrupt_metrics_are_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="metrics.jsonl does not exist"):
        plot.read_metrics(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no train/loss or val/loss records"):
        plot.read_metrics(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"iter": 0}\nnot json\n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        plot.read_metrics(tmp_path / "bad")
    assert plot.main([str(tmp_path / "empty"), "--out", str(tmp_path / "e.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert not (tmp_path / "e.png").exists()


def test_without_matplotlib_the_plot_command_names_the_requirement(tmp_path, monkeypatch, capsys):
    """A train-only set-up (requirements.txt) has no matplotlib: the plot command every finished run prints is one
    line naming what to install, exit 2, no file."""
    write_run(tmp_path / "a", [3.0, 2.0])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert plot.main([str(tmp_path / "a"), "--out", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err
    assert (
        err == "error: plots need matplotlib, one of the optional requirements: pip install -r "
        "requirements-extra.txt -c constraints.txt\n"
    )
    assert not (tmp_path / "a.png").exists()
