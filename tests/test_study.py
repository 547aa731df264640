"""scripts/study_small.py: the learning-rate grid widens until it brackets the best value (or reports its
cap), the seeds and the longer budget follow from it, the tie rule and ranks, and the study resumes from
what is on disk. A stand-in train.py writes the metrics a run would, from a known loss landscape."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from scripts import study_small as study
from scripts.study_small import Bracket, Run, Score, bracket, order_changes, plan, ranks


def settle(optimizer, loss_of, budgets=(10, 40), seeds=(1, 2, 3), max_step=5):
    """Run the plan to completion with losses from loss_of(run); returns (losses, brackets, rounds)."""
    losses, rounds = {}, 0
    while True:
        todo, brackets = plan(optimizer, losses, budgets, seeds, max_step)
        if not todo:
            return losses, brackets, rounds
        assert not set(todo) & set(losses), "a finished run was planned again"
        rounds += 1
        for run in todo:
            losses[run] = loss_of(run)


def valley(best_k_by_steps):
    """A loss landscape with its minimum at ladder step best_k_by_steps[steps]; seeds add a small offset."""
    return lambda r: 2.0 + 0.01 * (r.k - best_k_by_steps[r.steps]) ** 2 + 0.001 * r.seed - 0.1 * (r.steps > 10)


# ---------------------------------------------------------------------------------------------------
# Bracketing


def test_a_best_value_inside_the_first_grid_needs_no_widening():
    assert bracket({}, (-1, 0, 1), 5) == ([-1, 0, 1], None)
    assert bracket({-1: 2.1, 0: 2.0, 1: 2.2}, (-1, 0, 1), 5) == ([], Bracket({-1: 2.1, 0: 2.0, 1: 2.2}, 0, False))


@pytest.mark.parametrize("losses, more", [({-1: 2.0, 0: 2.1, 1: 2.2}, [-2]), ({-1: 2.2, 0: 2.1, 1: 2.0}, [2])])
def test_a_best_value_at_an_edge_widens_the_grid_on_that_side(losses, more):
    assert bracket(losses, (-1, 0, 1), 5) == (more, None)


def test_the_grid_widens_step_by_step_until_the_best_has_two_neighbours():
    losses, brackets, _ = settle("AdamW", valley({10: 3, 40: 2}))
    short = brackets[10]
    assert short.best == 3 and not short.capped
    assert sorted(short.losses) == [-1, 0, 1, 2, 3, 4]  # one step past the best, and no further
    # the longer budget starts at the short best and the step below, then widens the same way
    assert sorted(brackets[40].losses) == [1, 2, 3] and brackets[40].best == 2
    seeds_run = sorted(r.seed for r in losses if r.k == brackets[40].best and r.steps == 40)
    assert seeds_run == [1, 2, 3]
    assert sorted(r.seed for r in losses if r.steps == 10 and r.k == 3) == [1, 2, 3]
    assert all(r.seed == 1 for r in losses if r.k != brackets[r.steps].best)  # other lrs: first seed only


def test_a_best_value_beyond_the_cap_is_reported_as_not_bracketed():
    losses, brackets, _ = settle("AdamW", valley({10: 9, 40: 9}), max_step=3)
    assert brackets[10].best == 3 and brackets[10].capped
    assert max(r.k for r in losses) == 3
    assert brackets[40].capped


def test_a_diverged_run_counts_as_worse_than_any_loss():
    def loss_of(r):
        return math.inf if r.k >= 1 else valley({10: 1, 40: 1})(r)

    _, brackets, _ = settle("AdamW", loss_of)
    assert brackets[10].best == 0 and not brackets[10].capped


# ---------------------------------------------------------------------------------------------------
# Ties and ranks


def test_a_difference_smaller_than_the_seed_spread_is_a_tie():
    scores = {
        "A": Score([2.00, 2.02, 2.01]),  # spread 0.02
        "B": Score([2.015, 2.025, 2.02]),  # 0.01 worse than A: within A's spread
        "C": Score([2.10, 2.11, 2.12]),
    }
    result = ranks(scores)
    assert result["A"] == (1, ["B"])
    assert result["B"] == (1, ["A"])
    assert result["C"] == (3, [])
    assert study.tie(scores["A"], scores["B"]) and not study.tie(scores["B"], scores["C"])


def test_order_changes_lists_the_pairs_whose_verdict_differs():
    short = {"A": Score([2.0, 2.01]), "B": Score([2.1, 2.11]), "C": Score([2.2, 2.21])}
    long = {"A": Score([1.9, 1.91]), "B": Score([1.85, 1.86]), "C": Score([1.905, 1.906])}
    # A falls behind B, and level with C (0.0005 apart, spread 0.01); B stays ahead of C
    assert order_changes(short, long) == [("A", "B", "<", ">"), ("A", "C", "<", "=")]


# ---------------------------------------------------------------------------------------------------
# The study end to end, with a stand-in train.py

FAKE_TRAIN = textwrap.dedent(
    """
    import json, math, os, sys, time
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
    with open(os.environ["FAKE_CALLS"], "a") as f:
        f.write(json.dumps(args) + "\\n")
    lr = float(args.get("muon_lr", args["learning_rate"]))
    recommended = {"adamw": 6e-4, "muon": 2e-2, "mars": 6e-4}[args["optimizer_name"]]
    k = math.log2(lr / recommended)
    steps, seed = int(args["max_iters"]), int(args["seed"])
    if os.environ.get("FAKE_HANG"):  # a long run: its first checkpoint, then training until Ctrl-C
        open(os.path.join(args["out_dir"], "ckpt.pt"), "w").close()
        try:
            with open(os.environ["FAKE_CALLS"], "a") as f:
                f.write(json.dumps({"training": args["out_dir"]}) + "\\n")
            time.sleep(60)
        except KeyboardInterrupt:
            with open(os.environ["FAKE_CALLS"], "a") as f:
                f.write(json.dumps({"interrupted": args["out_dir"]}) + "\\n")
            sys.exit(130)
    if k > float(os.environ.get("FAKE_DIVERGE_ABOVE", "99")):
        print("error: 10 consecutive steps had a non-finite loss or gradient norm; stopped")
        sys.exit(1)
    best_k = {"adamw": 2, "muon": -1, "mars": 0}[args["optimizer_name"]] - (steps > 10)
    loss = 2.0 + 0.01 * (k - best_k) ** 2 + 0.001 * (seed % 7) - 0.2 * (steps > 10)
    loss += {"adamw": 0.0, "muon": 0.05, "mars": 0.0004}[args["optimizer_name"]]
    with open(os.path.join(args["out_dir"], "metrics.jsonl"), "a") as f:
        for it in (0, steps):
            record = {"iter": it, "tokens": it * 2048, "time_s": 0.01 * it, "val/loss": loss + (it == 0)}
            f.write(json.dumps(record) + "\\n")
    """
)


@pytest.fixture
def fake_train(tmp_path, monkeypatch):
    path = tmp_path / "fake_train.py"
    path.write_text(FAKE_TRAIN)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_CALLS", str(calls))

    def run(*argv):
        before = calls.read_text().splitlines() if calls.exists() else []
        rc = study.main([f"--out={tmp_path / 'out'}", "--budgets", "10", "40", "--seeds", "2", *argv], str(path))
        after = calls.read_text().splitlines() if calls.exists() else []
        return rc, [json.loads(line) for line in after[len(before) :]]

    return run


def results(tmp_path):
    return (tmp_path / "out" / "results.md").read_text()


@pytest.mark.slow
def test_the_study_brackets_ranks_and_marks_ties(fake_train, tmp_path):
    rc, calls = fake_train("--only", "AdamW", "Muon", "MARS-Lion")
    assert rc == 0
    text = results(tmp_path)
    short = text.split("## 10 steps")[1].split("## 40 steps")[0]
    rows = {line.split(" | ")[1]: line for line in short.splitlines() if line.startswith("| ") and "---" not in line}
    # AdamW's best is 2 ladder steps above its recommended lr (x4): found by widening, with x8 beside it
    assert "x4: learning_rate=0.0024" in rows["AdamW"] and "x8 " in rows["AdamW"] and "x16" not in rows["AdamW"]
    assert "**x4 2.0000**" in rows["AdamW"]
    # MARS-Lion is 0.0004 worse than AdamW, less than their seed spread (0.001): a tie, sharing rank 1
    assert rows["AdamW"].startswith("| 1= | AdamW") and rows["MARS-Lion"].startswith("| 1= | MARS-Lion")
    assert rows["AdamW"].split(" | ")[5] == "MARS-Lion" and rows["MARS-Lion"].split(" | ")[5] == "AdamW"
    assert rows["Muon"].startswith("| 3 | Muon") and rows["Muon"].split(" | ")[5] == "-"
    assert "No: every pair" in text
    # seeds 1337 and 1338 ran at each best lr of each budget, and nowhere else
    seeds = sorted((c["optimizer_name"], c["max_iters"], c["seed"]) for c in calls if c["seed"] != "1337")
    assert seeds == [(name, steps, "1338") for name in ("adamw", "mars", "muon") for steps in ("10", "40")]
    assert all(c["min_lr"] == f"{float(c['learning_rate']) * 0.1:.4g}" for c in calls)
    assert (tmp_path / "out" / "loss_curves_10steps.png").exists()
    assert (tmp_path / "out" / "loss_curves_40steps.png").exists()


@pytest.mark.slow
def test_a_rerun_skips_finished_runs_and_adds_only_a_new_optimizer_s(fake_train):
    assert fake_train("--only", "AdamW")[0] == 0
    rc, calls = fake_train("--only", "AdamW")
    assert rc == 0 and calls == []
    rc, calls = fake_train("--only", "AdamW", "Muon")
    assert rc == 0 and calls and {c["optimizer_name"] for c in calls} == {"muon"}


@pytest.mark.slow
def test_an_interrupted_run_resumes_from_its_checkpoint(fake_train, tmp_path):
    assert fake_train("--only", "AdamW")[0] == 0
    run_dir = study.run_dir(str(tmp_path / "out"), Run("AdamW", 40, 1, 1338))
    metrics = os.path.join(run_dir, "metrics.jsonl")
    with open(metrics) as f:
        first = f.readline()
    with open(metrics, "w") as f:
        f.write(first)  # stopped after its first evaluation, which wrote ckpt.pt
    open(os.path.join(run_dir, "ckpt.pt"), "w").close()
    rc, calls = fake_train("--only", "AdamW")
    assert rc == 0
    assert [(c["out_dir"], c.get("init_from")) for c in calls] == [(run_dir, "resume")]


@pytest.mark.slow
def test_a_diverged_run_is_remembered_and_not_retried(fake_train, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_DIVERGE_ABOVE", "2.5")  # AdamW's x8 diverges; its best stays x4
    rc, calls = fake_train("--only", "AdamW")
    assert rc == 0
    assert "**x4 2.0000**" in results(tmp_path) and "x8 diverged" in results(tmp_path)
    assert fake_train("--only", "AdamW") == (0, [])


@pytest.mark.slow
def test_a_stopped_study_stops_its_runs_also_when_started_in_the_background(tmp_path, capsys):
    """SIGTERM stops the runs in flight with a SIGINT, which they honour although a shell's background job
    (nohup ... &) starts with SIGINT ignored; the rerun resumes them."""
    (tmp_path / "fake_train.py").write_text(FAKE_TRAIN)
    calls = tmp_path / "calls.jsonl"
    env = dict(
        os.environ, FAKE_CALLS=str(calls), FAKE_HANG="1", PYTHONPATH=os.path.dirname(os.path.dirname(study.__file__))
    )
    argv = [f"--out={tmp_path / 'out'}", "--only", "AdamW"]
    script = (
        f"import sys; from scripts import study_small; "
        f"sys.exit(study_small.main({argv!r}, {str(tmp_path / 'fake_train.py')!r}))"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # what bash does to `cmd &`
    )

    def records(kind):
        return [record for record in map(json.loads, calls.read_text().splitlines()) if kind in record]

    deadline = time.time() + 120
    while not (calls.exists() and len(records("training")) == 2) and time.time() < deadline:
        time.sleep(0.1)  # both runs are in their training loop, where Ctrl-C is handled
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130
    assert len(records("interrupted")) == 2
    assert "study: stopped; 2 unfinished runs will resume" in err
    assert study.main(argv + ["--dry_run"]) == 0
    resumed = [line for line in capsys.readouterr().out.splitlines() if line.endswith("--init_from=resume")]
    assert len(resumed) == 2


@pytest.mark.slow
def test_settings_changed_under_a_run_are_refused(fake_train, tmp_path):
    assert fake_train("--only", "AdamW")[0] == 0
    with pytest.raises(SystemExit, match="was trained with other settings"):
        fake_train("--only", "AdamW", "--weight_decay=0.5")


@pytest.mark.slow
def test_an_optimizer_train_py_refuses_is_skipped_or_refused(fake_train, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(study.CONTENDERS, "Nadam", dict(args=["--optimizer_name=nadam"], lrs=dict(learning_rate=1e-3)))
    rc, calls = fake_train("--only", "Nadam")
    assert rc == 2 and calls == []
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: Nadam: this train.py refuses its arguments") and "\n" not in err
    monkeypatch.setattr(study, "CONTENDERS", {k: study.CONTENDERS[k] for k in ("AdamW", "Nadam")})
    rc, calls = fake_train()
    assert rc == 0 and {c["optimizer_name"] for c in calls} == {"adamw"}
    assert "Nadam skipped: this train.py does not accept it yet" in results(tmp_path)


def test_a_second_study_on_the_same_out_is_refused(fake_train, tmp_path, capsys):
    import fcntl

    os.makedirs(tmp_path / "out")
    with open(tmp_path / "out" / "study.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        rc, calls = fake_train("--only", "AdamW")
    assert rc == 2 and calls == []
    assert "error: another study" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [(["--max_iters=5"], "the study sets max_iters itself"), (["--budgets", "10", "10"], "distinct positive")],
)
def test_bad_arguments_are_one_line(fake_train, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        fake_train(*argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_the_study_s_arguments_train_for_real(tmp_path, data_path):
    """One tiny run through the real train.py: the arguments the study builds are ones it accepts."""
    out = tmp_path / "out"
    argv = [f"--out={out}", "--only", "AdamW", "--budgets", "6", "--seeds", "1", "--max_step", "0"]
    tiny = [f"--data_path={data_path}", "--dataset=tiny", "--block_size=16", "--n_embd=16", "--n_layer=1"]
    assert study.main(argv + tiny) == 0
    text = (out / "results.md").read_text()
    assert "(best at the cap ×1: not bracketed)" in text and "| 6 | AdamW | x1 |" in text
    assert study.outcome(study.run_dir(str(out), Run("AdamW", 6, 0, 1337)), 6) < 5.0
