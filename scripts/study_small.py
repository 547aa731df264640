"""A small-scale optimizer study on CPU: MARS-AdamW, MARS-Lion, MARS-Shampoo, AdamW and Muon, each at
3 learning rates around its recommended value, on the offline stdlib_char corpus with a small GPT.

    bash scripts/study_small.sh                       # the whole grid (prepares the corpus first)
    python scripts/study_small.py --only AdamW --factors 1 --out /tmp/probe   # one run, to time it
    python scripts/study_small.py --dry_run           # print the train.py commands only

Every run sees the same tokens in the same order (same seed and data windows), the same model and the
same schedule (linear warmup, cosine to a tenth of the peak); only the optimizer and its learning rate
differ. A learning-rate factor scales ALL of an optimizer's learning rates together (MARS: lr and lr_1d;
Muon: muon_lr and muon_adamw_lr), so each optimizer's recommended ratio between them is kept.

Runs go to OUT/<optimizer>_x<factor>/ (train.py's out_dir, log in train.log). The study is resumable:
a finished run (its metrics.jsonl has the final validation loss) is skipped, an interrupted one resumes
from its checkpoint. At the end it writes OUT/results.md (best validation loss per optimizer and the
learning rate that gave it, then every run) and OUT/loss_curves.png (each optimizer at its best lr).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import plot  # noqa: E402
from metrics import read_metrics  # noqa: E402

# The paper's GPT-2 small values (config/train_gpt2_small_*.py). The reference tunes only MARS-AdamW;
# MARS-Lion's and MARS-Shampoo's values are the repository's untuned starting points.
OPTIMIZERS = {
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
    "AdamW": dict(
        args=["--optimizer_name=adamw", "--weight_decay=1e-1", "--beta1=0.9", "--beta2=0.95"],
        lrs=dict(learning_rate=6e-4),
    ),
    # learning_rate is only the reference min_lr is a fraction of; Muon's own lrs are the other two.
    "Muon": dict(
        args=["--optimizer_name=muon", "--weight_decay=1e-1", "--beta1=0.9", "--beta2=0.95"],
        lrs=dict(muon_lr=2e-2, muon_adamw_lr=3e-3, learning_rate=3e-3),
    ),
}
FACTORS = (1 / 3, 1.0, 3.0)
MIN_LR_FRACTION = 0.1

# Sized so the 15 runs fit in well under an hour on 2 CPU cores (10 minutes idle). The width is set by Muon:
# torch.optim.Muon runs its Newton-Schulz iteration in bfloat16, which CPUs without bf16 matmul units run
# many times slower than float32: measured here, a Muon step costs 3.4x an AdamW step at 4x128 and 7 s
# (vs 2.3 s) at 4x192.
# 160 steps x 32 sequences x 128 tokens = 655,360 tokens per run.
COMMON = [
    "--dataset=stdlib_char",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--block_size=128",
    "--bias=False",
    "--dropout=0.0",
    "--batch_size=32",
    "--gradient_accumulation_steps=1",
    "--max_iters=160",
    "--warmup_iters=16",
    "--schedule=cosine",
    "--decay_lr=True",
    "--grad_clip=1.0",
    "--eval_interval=20",
    "--eval_iters=8",
    "--log_interval=20",
    "--seed=1337",
    "--device=cpu",
    "--dtype=float32",
    "--compile=False",
    "--wandb_log=False",
    "--save_best=False",
]


def lr_label(factor):
    return {1 / 3: "x0.33", 1.0: "x1", 3.0: "x3"}.get(factor, f"x{factor:g}")


def run_args(optimizer, factor, out_dir, extra):
    spec = OPTIMIZERS[optimizer]
    lrs = {k: v * factor for k, v in spec["lrs"].items()}
    # cosine reaches min_lr at the last step, also when --max_iters is overridden
    return (
        COMMON
        + spec["args"]
        + [f"--{k}={v:.4g}" for k, v in lrs.items()]
        + [
            f"--min_lr={lrs['learning_rate'] * MIN_LR_FRACTION:.4g}",
            f"--out_dir={out_dir}",
            f"--lr_decay_iters={max_iters_of(COMMON + extra)}",
        ]
        + extra
    )


def max_iters_of(args):
    return int([a for a in args if a.startswith("--max_iters=")][-1].split("=", 1)[1])


def finished(out_dir, max_iters):
    """Whether the run logged its final validation loss (train.py evaluates at max_iters, then stops)."""
    try:
        series = read_metrics(out_dir)
    except ValueError:
        return False
    return any(point[0] == max_iters for point in series["val/loss"])


def train(optimizer, factor, out_root, extra, dry_run):
    """Run (or resume, or skip) one grid point; returns (out_dir, ok)."""
    out_dir = os.path.join(out_root, f"{optimizer}_{lr_label(factor)}")
    args = run_args(optimizer, factor, out_dir, extra)
    recorded = os.path.join(out_dir, "study_args.json")
    if os.path.exists(recorded):
        with open(recorded) as f:
            if json.load(f) != args:
                sys.exit(f"error: {out_dir} was trained with other settings; use a fresh --out or delete it")
    if finished(out_dir, max_iters_of(args)):
        print(f"{optimizer} {lr_label(factor)}: done, skipped", flush=True)
        return out_dir, True
    resume = os.path.exists(os.path.join(out_dir, "ckpt.pt"))
    command = [sys.executable, os.path.join(REPO, "train.py")] + args
    if resume:
        command.append("--init_from=resume")
    if dry_run:
        print(" ".join(command))
        return out_dir, True
    if not resume and os.path.isdir(out_dir):
        shutil.rmtree(out_dir)  # killed before its first checkpoint: nothing to keep
    os.makedirs(out_dir, exist_ok=True)
    with open(recorded, "w") as f:
        json.dump(args, f, indent=1)
    t0 = time.time()
    print(f"{optimizer} {lr_label(factor)}: {'resuming' if resume else 'training'} -> {out_dir}", flush=True)
    with open(os.path.join(out_dir, "train.log"), "a") as log:
        rc = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    if rc != 0:
        print(f"{optimizer} {lr_label(factor)}: train.py exited {rc}; see {out_dir}/train.log", flush=True)
    else:
        print(f"{optimizer} {lr_label(factor)}: {time.time() - t0:.0f}s", flush=True)
    return out_dir, rc == 0


def summarize(optimizer, factor, out_dir):
    spec = OPTIMIZERS[optimizer]
    is_muon = "muon_lr" in spec["lrs"]  # its learning_rate only anchors min_lr: not worth showing
    shown = {k: v * factor for k, v in spec["lrs"].items() if not (is_muon and k == "learning_rate")}
    row = dict(
        optimizer=optimizer,
        factor=factor,
        out_dir=out_dir,
        lrs=", ".join(f"{k}={v:.3g}" for k, v in shown.items()),
        lr=next(iter(shown.values())),
        best=None,
        final=None,
        minutes=None,
        tokens=None,
    )
    try:
        series = read_metrics(out_dir)
    except ValueError:
        return row
    val = series["val/loss"]
    if val:
        row.update(best=min(p[3] for p in val), final=val[-1][3], tokens=val[-1][1])
    last = max(val + series["train/loss"], key=lambda p: p[0])
    row["minutes"] = last[2] / 60
    return row


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def write_results(rows, out_root, max_iters):
    best = {}
    for r in rows:
        if r["best"] is not None and (r["optimizer"] not in best or r["best"] < best[r["optimizer"]]["best"]):
            best[r["optimizer"]] = r
    lines = [
        "## Best validation loss per optimizer",
        "",
        "| optimizer | best val loss | at lr | lr grid tried | best lr at grid edge? |",
        "|---|---|---|---|---|",
    ]
    for optimizer, r in sorted(best.items(), key=lambda kv: kv[1]["best"]):
        tried = sorted(x["lr"] for x in rows if x["optimizer"] == optimizer)
        edge = "yes" if r["lr"] in (tried[0], tried[-1]) and len(tried) > 1 else "no"
        lines.append(
            f"| {optimizer} | {r['best']:.4f} | {r['lrs']} | {', '.join(f'{lr:.3g}' for lr in tried)} | {edge} |"
        )
    lines += [
        "",
        "## All runs",
        "",
        "| optimizer | lr factor | learning rates | best val loss | final val loss | tokens | train time (min) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        done = r["tokens"] is not None and finished(r["out_dir"], max_iters)
        lines.append(
            f"| {r['optimizer']} | {lr_label(r['factor'])} | {r['lrs']} | {fmt(r['best'], '.4f')} | "
            f"{fmt(r['final'], '.4f')} | {fmt(r['tokens'], ',')}{'' if done else ' (unfinished)'} | "
            f"{fmt(r['minutes'], '.1f')} |"
        )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_root, "results.md"), "w") as f:
        f.write(text)
    if best:
        winners = sorted(best.values(), key=lambda r: r["best"])
        floor = winners[0]["best"]
        fig = plot.plot_runs(
            [r["out_dir"] for r in winners],
            os.path.join(out_root, "loss_curves.png"),
            labels=[f"{r['optimizer']} ({r['lrs']})" for r in winners],
            ylim=(floor - 0.1, floor + 1.2),
        )
        plot.plt.close(fig)
    return text


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Other --key=value arguments go to every train.py run."
    )
    p.add_argument("--out", default=os.path.join(REPO, "study_small"), help="root of the runs' out_dirs")
    p.add_argument(
        "--only", nargs="+", choices=list(OPTIMIZERS), metavar="OPTIMIZER", help=f"a subset of {', '.join(OPTIMIZERS)}"
    )
    p.add_argument(
        "--factors",
        nargs="+",
        type=float,
        default=list(FACTORS),
        help="learning-rate multiples of the recommended values (default: 1/3 1 3)",
    )
    p.add_argument("--dry_run", action="store_true", help="print the train.py commands, run nothing")
    args, extra = p.parse_known_args(argv)
    bad = [a for a in extra if not (a.startswith("--") and "=" in a)]
    if bad:
        p.error(f"unrecognised arguments {bad}; train.py overrides look like --key=value")
    factors = [1 / 3 if abs(f - 1 / 3) < 1e-3 else f for f in args.factors]  # "0.333" names the x0.33 run
    optimizers = args.only or list(OPTIMIZERS)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    grid = [(o, f, *train(o, f, args.out, extra, args.dry_run)) for o in optimizers for f in factors]
    if args.dry_run:
        return 0
    max_iters = max_iters_of(COMMON + extra)
    print(write_results([summarize(o, f, d) for o, f, d, _ in grid], args.out, max_iters))
    failed = [f"{o} {lr_label(f)}" for o, f, _, ok in grid if not ok]
    print(
        f"study: {len(grid)} runs, {(time.time() - t0) / 60:.1f} min this invocation; "
        f"{args.out}/results.md, {args.out}/loss_curves.png"
    )
    if failed:
        print(f"error: {len(failed)} runs failed ({', '.join(failed)}); see their train.log", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
