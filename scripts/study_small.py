"""A small-scale optimizer study on CPU whose table is evidence: every optimizer at a learning rate its grid
brackets, several seeds there, at two token budgets, on the offline stdlib_char corpus with a tiny GPT.

    bash scripts/study_small.sh                      # the whole study (prepares the corpus first)
    python -m scripts.study_small --only AdamW --budgets 120 --seeds 1 --max_step 0 --out /tmp/probe   # one run
    python -m scripts.study_small --dry_run          # the train.py commands the study needs next

The method, per optimizer and budget (a budget is a number of steps of the same batch):
- Learning rates sit on a factor-of-2 ladder around the optimizer's recommended values: step k scales ALL
  of its learning rates by 2**k (MARS: lr and lr_1d; Muon: muon_lr and muon_adamw_lr), keeping their ratio.
- The grid (first seed only) starts at k = -1, 0, 1 for the first budget; each longer budget starts at the
  previous budget's best k and the step below it. While the best k has no neighbour on one side, the grid
  grows by one step on that side, up to |k| <= max_step; a best value left at the cap is reported as such.
  A run that diverges (train.py stops on non-finite steps) counts as an infinite loss.
- At the bracketed best k, the other seeds run. A seed (train.py's --seed) changes the initial weights,
  the training windows, the dropout masks (none here) and the evaluation windows together.
- The score is the validation loss at the last step. Per budget the optimizers are ranked by their mean over
  seeds; two whose means differ by less than the larger of their seed ranges (max - min) are a tie. An
  optimizer's rank is one more than the number of optimizers better than it by more than that.

Every run has the same model, batch and schedule shape (linear warmup over a tenth of the steps, cosine to
a tenth of the peak at the last step). Runs go to OUT/<steps>steps/<optimizer>_x<factor>_s<seed>/
(train.py's out_dir, log in train.log); `--jobs` of them train at once, each on cpu_count/jobs threads.

Resumable: a finished run is skipped, an interrupted one resumes from its checkpoint, a diverged one is
remembered, so rerunning the same command continues, also with optimizers added to CONTENDERS. After each
run OUT/results.md is rewritten (per budget: best lr, mean val loss and spread over seeds, rank and ties;
whether the order moves with the budget; every run); at the end OUT/loss_curves_<steps>steps.png (each
optimizer at its best lr, first seed) too.
"""

import argparse
import contextlib
import dataclasses
import fcntl
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

from marsgpt import plot
from marsgpt.config import load_config
from marsgpt.config_schema import ConfigError
from marsgpt.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAIN_PY = os.path.join(REPO, "train.py")

# The paper's GPT-2 small values (config/train_gpt2_small_*.py); MARS-M's and Moonlight's are the MARS-M
# reference's small configs. The MARS reference tunes only MARS-AdamW; MARS-Lion's and MARS-Shampoo's values
# are the repository's untuned starting points. `lrs` are what a ladder step scales together.
CONTENDERS = {
    "MARS-AdamW": dict(
        args=["--optimizer_name=mars", "--mars_type=mars-adamw", "--weight_decay=1e-2", "--beta1=0.95", "--beta2=0.99"],
        lrs=dict(learning_rate=6e-3, lr_1d=3e-3),
    ),
    "MARS-Lion": dict(
        args=["--optimizer_name=mars", "--mars_type=mars-lion", "--weight_decay=1e-1", "--beta1=0.95", "--beta2=0.99"],
        lrs=dict(learning_rate=6e-4, lr_1d=3e-3),
    ),
    "MARS-Shampoo": dict(
        args=[
            "--optimizer_name=mars",
            "--mars_type=mars-shampoo",
            "--weight_decay=0.0",
            "--beta1=0.95",
            "--beta2=0.99",
        ],
        lrs=dict(learning_rate=2e-2, lr_1d=3e-3),
    ),
    "MARS-M": dict(
        args=[
            "--optimizer_name=mars",
            "--mars_type=mars-m",
            "--weight_decay=1e-2",
            "--beta1=0.95",
            "--beta2=0.99",
            "--gamma=0.025",
        ],
        lrs=dict(learning_rate=6e-3),
    ),
    "AdamW": dict(
        args=["--optimizer_name=adamw", "--weight_decay=1e-1", "--beta1=0.9", "--beta2=0.95"],
        lrs=dict(learning_rate=6e-4),
    ),
    # learning_rate is only the reference min_lr is a fraction of; Muon's own lrs are the other two.
    "Muon": dict(
        args=["--optimizer_name=muon", "--weight_decay=1e-1", "--beta1=0.9", "--beta2=0.95"],
        lrs=dict(muon_lr=2e-2, muon_adamw_lr=3e-3, learning_rate=3e-3),
    ),
    "Moonlight": dict(
        args=["--optimizer_name=moonlight", "--weight_decay=1e-1", "--beta1=0.95", "--beta2=0.99"],
        lrs=dict(learning_rate=6e-3),
    ),
}
LADDER = 2.0  # the factor between neighbouring learning rates of a grid
FIRST_GRID = (-1, 0, 1)
MAX_STEP = 5  # the grid never leaves 2**-5 .. 2**5 times the recommended values
SEEDS = (1337, 1338, 1339)
BUDGETS = (120, 480)  # steps; 2,048 tokens each
MIN_LR_FRACTION = 0.1

# Sized so the whole study (7 optimizers, about 15 runs each at two budgets) fits in about 40 minutes on 2
# idle CPU cores, two runs at a time. A tiny model's step is mostly per-operation overhead, and
# torch.optim.Muon runs its Newton-Schulz iteration in bfloat16, which CPUs without bf16 matmul units run
# slowly: single-threaded, 100 steps cost about 11 s with AdamW and 19 s with Muon, plus 3.5 s to start.
# 2 layers x 64 wide: 0.10M parameters in the blocks (0.11M with the embeddings).
COMMON = [
    "--dataset=stdlib_char",
    "--n_layer=2",
    "--n_head=4",
    "--n_embd=64",
    "--block_size=64",
    "--bias=False",
    "--dropout=0.0",
    "--batch_size=32",
    "--gradient_accumulation_steps=1",
    "--schedule=cosine",
    "--decay_lr=True",
    "--grad_clip=1.0",
    "--eval_iters=16",
    "--log_interval=10",
    "--device=cpu",
    "--dtype=float32",
    "--compile=False",
    "--wandb_log=False",
    "--save_best=False",
]
# What the study sets per run; an override of one of these would silently break the method.
STUDY_KEYS = {"max_iters", "lr_decay_iters", "warmup_iters", "eval_interval", "seed", "out_dir", "min_lr", "init_from"}


@dataclasses.dataclass(frozen=True)
class Run:
    optimizer: str
    steps: int
    k: int  # ladder step: every learning rate is LADDER**k times the recommended one
    seed: int


def factor_label(k):
    return f"x{LADDER**k:g}"


def run_dir(out_root, run):
    return os.path.join(out_root, f"{run.steps}steps", f"{run.optimizer}_{factor_label(run.k)}_s{run.seed}")


def scaled_lrs(optimizer, k):
    return {name: value * LADDER**k for name, value in CONTENDERS[optimizer]["lrs"].items()}


def run_args(run, out_dir, extra):
    lrs = scaled_lrs(run.optimizer, run.k)
    return (
        COMMON
        + CONTENDERS[run.optimizer]["args"]
        + [f"--{name}={value:.4g}" for name, value in lrs.items()]
        + [
            f"--max_iters={run.steps}",
            f"--lr_decay_iters={run.steps}",  # cosine reaches min_lr at the last step
            f"--warmup_iters={run.steps // 10}",
            f"--eval_interval={max(40, run.steps // 6)}",
            f"--min_lr={lrs['learning_rate'] * MIN_LR_FRACTION:.4g}",
            f"--seed={run.seed}",
            f"--out_dir={out_dir}",
        ]
        + extra
    )


def unsupported(optimizer):
    """Why train.py would refuse this optimizer's arguments (an older train.py), or None."""
    try:
        load_config(COMMON + CONTENDERS[optimizer]["args"])
    except ConfigError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------------
# Outcomes of runs on disk

DIVERGED = "diverged.json"  # written when train.py stopped on non-finite steps: the run is over


def outcome(out_dir, steps):
    """The validation loss at the last step; math.inf for a diverged run; None while unfinished."""
    if os.path.isfile(os.path.join(out_dir, DIVERGED)):
        return math.inf
    try:
        series = read_metrics(out_dir)
    except ValueError:
        return None
    last = [p[3] for p in series["val/loss"] if p[0] == steps]
    return last[0] if last else None


def read_outcomes(out_root, runs):
    return {run: loss for run in runs if (loss := outcome(run_dir(out_root, run), run.steps)) is not None}


# ---------------------------------------------------------------------------------------------------
# The plan: which runs the results so far call for. Pure functions of the losses, so a rerun of the
# study makes the same decisions from what is on disk.


@dataclasses.dataclass
class Bracket:
    losses: dict  # k -> validation loss (first seed)
    best: int
    capped: bool  # the best k is at the cap, with no neighbour beyond it


def bracket(losses, start, max_step):
    """(ladder steps still to run, Bracket or None): widen the grid one step towards a best k at its edge."""
    start = [k for k in start if -max_step <= k <= max_step] or [max(-max_step, min(max_step, start[0]))]
    missing = [k for k in start if k not in losses]
    if missing:
        return missing, None
    grid = sorted(losses)
    best = min(grid, key=lambda k: losses[k])
    if best == grid[0] and best > -max_step:
        return [best - 1], None
    if best == grid[-1] and best < max_step:
        return [best + 1], None
    return [], Bracket(dict(losses), best, best in (grid[0], grid[-1]))


def plan(optimizer, losses, budgets, seeds, max_step):
    """(runs to start now, {steps: Bracket} of the budgets whose grid is settled) for one optimizer.

    `losses` maps Run -> validation loss for the finished runs. A budget's grid starts once the previous
    budget's grid is settled; the seeds run as soon as their budget's best learning rate is known.
    """
    todo, brackets = [], {}
    start = FIRST_GRID
    for steps in budgets:
        grid = {
            r.k: loss for r, loss in losses.items() if (r.optimizer, r.steps, r.seed) == (optimizer, steps, seeds[0])
        }
        ks, found = bracket(grid, start, max_step)
        todo += [Run(optimizer, steps, k, seeds[0]) for k in ks]
        if found is None:
            break
        brackets[steps] = found
        todo += [r for seed in seeds[1:] if (r := Run(optimizer, steps, found.best, seed)) not in losses]
        start = (found.best - 1, found.best)
    return todo, brackets


# ---------------------------------------------------------------------------------------------------
# The verdict: spread over seeds, ranks and ties


@dataclasses.dataclass
class Score:
    losses: list  # one per seed

    @property
    def mean(self):
        return statistics.fmean(self.losses)

    @property
    def spread(self):
        return max(self.losses) - min(self.losses)

    @property
    def std(self):
        return statistics.stdev(self.losses) if len(self.losses) > 1 else 0.0


def tie(a, b):
    """A difference of means smaller than the larger seed range is no evidence of an order."""
    return abs(a.mean - b.mean) < max(a.spread, b.spread)


def ranks(scores):
    """{name: (rank, [names it ties with])}: rank = 1 + how many are better by more than the spread."""
    result = {}
    for name, score in scores.items():
        better = [o for o, s in scores.items() if s.mean < score.mean and not tie(s, score)]
        ties = [o for o, s in scores.items() if o != name and tie(s, score)]
        result[name] = (1 + len(better), sorted(ties, key=lambda o: scores[o].mean))
    return result


def order_changes(short, long):
    """Pairs whose verdict (better, tie, worse) differs between two budgets' scores."""

    def verdict(scores, a, b):
        return "=" if tie(scores[a], scores[b]) else "<" if scores[a].mean < scores[b].mean else ">"

    both = [o for o in short if o in long]
    return [
        (a, b, verdict(short, a, b), verdict(long, a, b))
        for a, b in itertools.combinations(both, 2)
        if verdict(short, a, b) != verdict(long, a, b)
    ]


# ---------------------------------------------------------------------------------------------------
# Training runs


ARGS_NAME = "study_args.json"  # the train.py arguments a run folder was started with


def check_settings(run, out_root, extra):
    """The run's train.py arguments; exits when its folder was started with others (a changed setting)."""
    out_dir = run_dir(out_root, run)
    args = run_args(run, out_dir, extra)
    recorded = os.path.join(out_dir, ARGS_NAME)
    if os.path.exists(recorded):
        with open(recorded) as f:
            if json.load(f) != args:
                sys.exit(f"error: {out_dir} was trained with other settings; use a fresh --out or delete it")
    return args


def start_run(run, out_root, extra, train_py, threads, dry_run, lock_fd=None):
    """Start (or resume) one run's train.py; returns the Popen, or None for a dry run."""
    out_dir = run_dir(out_root, run)
    args = check_settings(run, out_root, extra)
    resume = os.path.exists(os.path.join(out_dir, "ckpt.pt"))
    command = [sys.executable, train_py] + args + (["--init_from=resume"] if resume else [])
    if dry_run:
        print(" ".join(command))
        return None
    if not resume and os.path.isdir(out_dir):
        shutil.rmtree(out_dir)  # stopped before its first checkpoint: nothing to keep
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, ARGS_NAME), "w") as f:
        json.dump(args, f, indent=1)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    log = open(os.path.join(out_dir, "train.log"), "a")
    # Its own session: a Ctrl-C reaches the study, which stops its runs in order. It holds the study's lock,
    # so a study restarted while an orphaned run still trains is refused instead of training beside it.
    process = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=env,
        start_new_session=True,
        pass_fds=() if lock_fd is None else (lock_fd,),
    )
    log.close()
    process.study_resumed = resume
    process.study_t0 = time.time()
    return process


def finish_run(run, out_root, rc):
    """'ok', 'diverged' (remembered in the run's folder) or 'failed' from train.py's exit status."""
    out_dir = run_dir(out_root, run)
    if rc == 0:
        return "ok"
    with open(os.path.join(out_dir, "train.log")) as f:
        tail = f.read()[-2000:]
    if rc == 1 and "non-finite" in tail:
        with open(os.path.join(out_dir, DIVERGED), "w") as f:
            json.dump({"message": tail.strip().splitlines()[-1]}, f)
        return "diverged"
    return "failed"


class Stop(Exception):
    """SIGTERM, handled like Ctrl-C: the runs in flight are stopped at a checkpoint-safe point."""


def _raise_stop(signum, frame):
    raise Stop


def describe(run):
    return f"{run.optimizer} {run.steps} steps {factor_label(run.k)} seed {run.seed}"


def run_study(
    optimizers, out_root, budgets, seeds, max_step, extra, jobs, train_py=TRAIN_PY, dry_run=False, lock_fd=None
):
    """Plan, train and re-plan until every optimizer's plan is complete; returns (losses, failed runs)."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    running, failed, done_now = {}, set(), 0
    t0 = time.time()

    def losses_on_disk():
        known = [r for o in optimizers for r in all_runs(out_root, o)]
        for run in known:
            check_settings(run, out_root, extra)  # a result is only used under the settings it was trained with
        return read_outcomes(out_root, known)

    # A shell starts a background job with SIGINT ignored, and its children inherit that: with a handler of
    # our own, the study's train.py runs start with the default one, so the SIGINT that stops them works.
    previous = signal.signal(signal.SIGTERM, _raise_stop), signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            losses = losses_on_disk()
            todo = [r for o in optimizers for r in plan(o, losses, budgets, seeds, max_step)[0]]
            # cheap runs first: a short budget's results unblock the rest of its optimizer's plan
            todo = sorted((r for r in todo if r not in running and r not in failed), key=lambda r: r.steps)
            if dry_run:
                for run in todo:
                    start_run(run, out_root, extra, train_py, threads, dry_run=True)
                return losses, failed
            while todo and len(running) < jobs:
                run = todo.pop(0)
                running[run] = start_run(run, out_root, extra, train_py, threads, False, lock_fd)
                verb = "resuming" if running[run].study_resumed else "training"
                print(f"{describe(run)}: {verb} -> {run_dir(out_root, run)}", flush=True)
            if not running:
                return losses, failed
            finished = []
            while not finished:
                time.sleep(0.2)
                finished = [(r, p) for r, p in running.items() if p.poll() is not None]
            for run, process in finished:
                del running[run]
                status = finish_run(run, out_root, process.returncode)
                seconds = time.time() - process.study_t0
                if status == "failed":
                    failed.add(run)
                    log = os.path.join(run_dir(out_root, run), "train.log")
                    print(f"{describe(run)}: train.py exited {process.returncode}; see {log}", flush=True)
                    continue
                done_now += 1
                loss = outcome(run_dir(out_root, run), run.steps)
                print(
                    f"{describe(run)}: {status}, val loss {loss:.4f}, {seconds:.0f}s "
                    f"({done_now} runs done in {(time.time() - t0) / 60:.1f} min)",
                    flush=True,
                )
            write_results(optimizers, out_root, budgets, seeds, max_step, losses_on_disk(), extra, plots=False)
    except (KeyboardInterrupt, Stop):
        for process in running.values():
            process.send_signal(signal.SIGINT)  # train.py finishes a checkpoint in flight, then exits
        for process in running.values():
            process.wait()
        stopped = [r for r in running if outcome(run_dir(out_root, r), r.steps) is None]
        print(f"study: stopped; {len(stopped)} unfinished runs will resume when it is run again", file=sys.stderr)
        raise KeyboardInterrupt from None
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def all_runs(out_root, optimizer):
    """Every run of this optimizer with a folder in out_root (finished or not)."""
    runs = []
    for budget_dir in sorted(os.listdir(out_root)) if os.path.isdir(out_root) else []:
        if not budget_dir.endswith("steps") or not budget_dir[: -len("steps")].isdigit():
            continue
        steps = int(budget_dir[: -len("steps")])
        for name in os.listdir(os.path.join(out_root, budget_dir)):
            head, _, seed = name.rpartition("_s")
            opt, _, factor = head.rpartition("_x")
            with contextlib.suppress(ValueError):  # a folder the study did not name is not one of its runs
                run = Run(optimizer, steps, round(math.log(float(factor), LADDER)), int(seed))
                if opt == optimizer and run_dir(out_root, run) == os.path.join(out_root, budget_dir, name):
                    runs.append(run)
    return runs


# ---------------------------------------------------------------------------------------------------
# The report


def fmt_loss(loss):
    return "diverged" if loss == math.inf else f"{loss:.4f}"


def lrs_text(optimizer, k):
    lrs = scaled_lrs(optimizer, k)
    if "muon_lr" in lrs:
        del lrs["learning_rate"]  # Muon's learning_rate only anchors min_lr: not worth showing
    return ", ".join(f"{name}={value:.3g}" for name, value in lrs.items())


def budget_scores(optimizers, losses, steps, seeds, brackets):
    """{optimizer: Score} for the optimizers whose every seed has run at this budget's best lr."""
    scores = {}
    for o in optimizers:
        if steps in brackets[o]:
            seed_losses = [losses.get(Run(o, steps, brackets[o][steps].best, s)) for s in seeds]
            if None not in seed_losses:
                scores[o] = Score(seed_losses)
    return scores


def write_results(optimizers, out_root, budgets, seeds, max_step, losses, extra, plots=True, notes=()):
    brackets = {o: plan(o, losses, budgets, seeds, max_step)[1] for o in optimizers}
    lines = ["# Small-scale optimizer study", ""]
    lines += [f"- {note}" for note in notes]
    lines += [
        f"- Seeds {', '.join(map(str, seeds))} at each best learning rate; score: validation loss at the last step,"
        " mean over seeds (spread = max - min). A difference of means smaller than the larger spread is a tie (=).",
        f"- Learning rates: ×{LADDER:g} ladder around the recommended values, widened until the best has a neighbour"
        f" on both sides, at most ×{LADDER**max_step:g} either way; the grid column shows the first seed's losses.",
    ]
    if len(seeds) < 2:
        lines.append("- One seed: there is no spread, so no difference can be called a tie.")
    per_budget = {}
    for steps in budgets:
        scores = budget_scores(optimizers, losses, steps, seeds, brackets)
        per_budget[steps] = scores
        ranking = ranks(scores)
        lines += [
            "",
            f"## {steps} steps ({steps * tokens_per_step(extra):,} tokens per run)",
            "",
            "| rank | optimizer | best lr | val loss mean ± std | min – max | ties with | lr grid (first seed) |",
            "|---|---|---|---|---|---|---|",
        ]
        for o in sorted(optimizers, key=lambda o: scores[o].mean if o in scores else math.inf):
            found = brackets[o].get(steps)
            if found is None:
                lines.append(f"| - | {o} | (grid not settled yet) | | | | |")
                continue
            grid = ", ".join(
                f"**{factor_label(k)} {fmt_loss(v)}**" if k == found.best else f"{factor_label(k)} {fmt_loss(v)}"
                for k, v in sorted(found.losses.items())
            )
            if found.capped:
                grid += f" (best at the cap ×{LADDER**found.best:g}: not bracketed)"
            lr = f"{factor_label(found.best)}: {lrs_text(o, found.best)}"
            if o not in scores:
                lines.append(f"| - | {o} | {lr} | (seeds running) | | | {grid} |")
                continue
            s, (rank, ties) = scores[o], ranking[o]
            lines.append(
                f"| {rank}{'=' if ties else ''} | {o} | {lr} | {fmt_loss(s.mean)} ± {s.std:.4f} | "
                f"{fmt_loss(min(s.losses))} – {fmt_loss(max(s.losses))} | {', '.join(ties) or '-'} | {grid} |"
            )
    if len(budgets) > 1:
        lines += ["", f"## Does the order move between {budgets[0]} and {budgets[-1]} steps?", ""]
        changes = order_changes(per_budget[budgets[0]], per_budget[budgets[-1]])
        compared = [o for o in per_budget[budgets[0]] if o in per_budget[budgets[-1]]]
        if len(compared) < 2:
            lines.append("Not yet: fewer than two optimizers have finished both budgets.")
        elif not changes:
            lines.append(f"No: every pair of {', '.join(compared)} keeps its verdict (better, tie or worse).")
        else:
            lines += [f"{len(changes)} of {len(compared) * (len(compared) - 1) // 2} pairs change verdict:", ""]
            lines += [
                f"- {a} vs {b}: {a} {v1} {b} at {budgets[0]} steps, {a} {v2} {b} at {budgets[-1]}"
                for a, b, v1, v2 in changes
            ]
    lines += [
        "",
        "## Every run",
        "",
        "| steps | optimizer | lr step | learning rates | seed | final val loss | best val loss | minutes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in optimizers:
        for run in sorted(all_runs(out_root, o), key=lambda r: (r.steps, r.k, r.seed)):
            best, minutes = run_summary(out_root, run)
            final_text = "unfinished" if run not in losses else fmt_loss(losses[run])
            lines.append(
                f"| {run.steps} | {o} | {factor_label(run.k)} | {lrs_text(o, run.k)} | {run.seed} | {final_text} | "
                f"{best} | {minutes} |"
            )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_root, "results.md"), "w") as f:
        f.write(text)
    if plots:
        for steps in budgets:
            settled = [o for o in optimizers if steps in brackets[o]]
            if not settled:
                continue
            dirs = [run_dir(out_root, Run(o, steps, brackets[o][steps].best, seeds[0])) for o in settled]
            png = os.path.join(out_root, f"loss_curves_{steps}steps.png")
            newest = max(os.path.getmtime(os.path.join(d, "metrics.jsonl")) for d in dirs)
            if os.path.exists(png) and os.path.getmtime(png) > newest:
                continue  # drawn from these very runs already; a plot costs seconds on a busy CPU
            floor = min(brackets[o][steps].losses[brackets[o][steps].best] for o in settled)
            fig = plot.plot_runs(
                dirs,
                png,
                labels=[f"{o} ({lrs_text(o, brackets[o][steps].best)})" for o in settled],
                ylim=(floor - 0.3, floor + 1.2) if math.isfinite(floor) else None,
            )
            plot.pyplot().close(fig)
    return text


def tokens_per_step(extra):
    values = dict(a[2:].split("=", 1) for a in COMMON + extra)
    return int(values["batch_size"]) * int(values["block_size"]) * int(values["gradient_accumulation_steps"])


def run_summary(out_root, run):
    """(best val loss, minutes trained) of one run folder as text, '-' where it has no records yet."""
    try:
        series = read_metrics(run_dir(out_root, run))
    except ValueError:
        return "-", "-"
    val = series["val/loss"]
    best = f"{min(p[3] for p in val):.4f}" if val else "-"
    return best, f"{max(val + series['train/loss'], key=lambda p: p[0])[2] / 60:.1f}"


# ---------------------------------------------------------------------------------------------------


def main(argv=None, train_py=TRAIN_PY):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Other --key=value arguments go to every train.py run."
    )
    p.add_argument("--out", default=os.path.join(REPO, "study_small"), help="root of the runs' out_dirs")
    p.add_argument(
        "--only", nargs="+", choices=list(CONTENDERS), metavar="OPTIMIZER", help=f"a subset of {', '.join(CONTENDERS)}"
    )
    p.add_argument("--budgets", nargs="+", type=int, default=list(BUDGETS), help="steps per run, one per budget")
    p.add_argument("--seeds", type=int, default=len(SEEDS), help=f"seeds at each best lr (default {len(SEEDS)})")
    p.add_argument("--max_step", type=int, default=MAX_STEP, help=f"the grid stays within ×{LADDER:g}**±this")
    p.add_argument("--jobs", type=int, default=2, help="runs training at once (default 2, one thread each)")
    p.add_argument("--dry_run", action="store_true", help="print the train.py commands the study needs next")
    args, extra = p.parse_known_args(argv)
    bad = [a for a in extra if not (a.startswith("--") and "=" in a)]
    if bad:
        p.error(f"unrecognised arguments {bad}; train.py overrides look like --key=value")
    owned = sorted({a[2:].split("=", 1)[0] for a in extra} & STUDY_KEYS)
    if owned:
        p.error(f"the study sets {', '.join(owned)} itself; change --budgets or the seeds instead")
    if any(b <= 0 for b in args.budgets) or len(set(args.budgets)) != len(args.budgets):
        p.error(f"--budgets {' '.join(map(str, args.budgets))}: give distinct positive step counts")
    if not 1 <= args.seeds <= 100 or args.max_step < 0 or args.jobs < 1:
        p.error("--seeds must be 1..100, --max_step >= 0 and --jobs >= 1")
    seeds = tuple(SEEDS[0] + i for i in range(args.seeds))
    budgets = sorted(args.budgets)
    notes = []
    optimizers = []
    for o in args.only or CONTENDERS:
        why = unsupported(o)
        if why is None:
            optimizers.append(o)
        elif args.only:
            print(f"error: {o}: this train.py refuses its arguments ({why}); leave it out of --only", file=sys.stderr)
            return 2
        else:
            notes.append(f"{o} skipped: this train.py does not accept it yet ({why}).")
            print(f"study: {notes[-1]}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    lock = open(os.path.join(args.out, "study.lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        print(
            f"error: another study (pid {lock.read().strip()}) or a run it started is training in {args.out}; "
            "wait for it to end or stop it",
            file=sys.stderr,
        )
        return 2
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    t0 = time.time()
    try:
        losses, failed = run_study(
            optimizers, args.out, budgets, seeds, args.max_step, extra, args.jobs, train_py, args.dry_run, lock.fileno()
        )
    except KeyboardInterrupt:
        return 130
    if args.dry_run:
        return 0
    print(write_results(optimizers, args.out, budgets, seeds, args.max_step, losses, extra, notes=notes))
    print(f"study: {(time.time() - t0) / 60:.1f} min this invocation; {args.out}/results.md, loss_curves_*.png")
    if failed:
        names = ", ".join(describe(r) for r in sorted(failed, key=lambda r: (r.optimizer, r.steps, r.k, r.seed)))
        print(f"error: {len(failed)} runs failed ({names}); see their train.log", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
