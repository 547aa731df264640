"""Loss curves of one or more runs from their metrics.jsonl: training and validation loss against
tokens and against wall-clock time, one line per run -- the figures the MARS paper compares optimizers by.

    python -m marsgpt.plot out_mars out_adamw --out curves.png [--labels MARS AdamW] [--ylim 1.0 2.5]
"""

import argparse
import os
import sys

from marsgpt.metrics import LOSS_SERIES as SERIES
from marsgpt.metrics import read_metrics


def pyplot():
    """matplotlib.pyplot, drawing into files only (no display needed on a cluster node). matplotlib is an optional
    requirement, which a train-only set-up does not install: its absence is an ImportError that says so."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "plots need matplotlib, one of the optional requirements: pip install -r requirements-extra.txt "
            "-c constraints.txt"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def default_labels(run_dirs):
    """Each run's directory name; the whole path where two runs share a name."""
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    return names if len(set(names)) == len(names) else [os.path.normpath(d) for d in run_dirs]


def plot_runs(run_dirs, out, labels=None, ylim=None):
    """Write the PNG and return the figure: a 2x2 grid, rows train/val loss, columns tokens/time."""
    if not run_dirs:
        raise ValueError("give at least one run directory")
    if ylim and not ylim[0] < ylim[1]:
        raise ValueError(f"--ylim {ylim[0]:g} {ylim[1]:g}: LOW must be below HIGH")
    labels = list(labels) if labels else default_labels(run_dirs)
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs; give one label per run")
    runs = [read_metrics(d) for d in run_dirs]
    fig, axes = pyplot().subplots(2, 2, figsize=(12, 8), sharex="col", squeeze=False)
    for row, name in enumerate(SERIES):
        for col, (x_index, x_label, scale) in enumerate([(1, "tokens (M)", 1e-6), (2, "time (min)", 1 / 60)]):
            ax = axes[row][col]
            for series, label in zip(runs, labels):
                points = series[name]
                if points:
                    ax.plot(
                        [p[x_index] * scale for p in points],
                        [p[3] for p in points],
                        label=label,
                        marker="o" if name == "val/loss" and len(points) < 30 else None,
                        markersize=3,
                    )
            ax.set_title(f"{name} vs {x_label.split()[0]}")
            ax.set_ylabel(name)
            if row == len(SERIES) - 1:
                ax.set_xlabel(x_label)
            if ylim:
                ax.set_ylim(*ylim)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return fig


def main(argv=None):
    p = argparse.ArgumentParser(description="Plot training and validation loss of runs (their metrics.jsonl).")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="out_dir of a training run")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--labels", nargs="+", help="one legend label per run (default: directory names)")
    p.add_argument("--ylim", nargs=2, type=float, metavar=("LOW", "HIGH"), help="loss axis range")
    args = p.parse_args(argv)
    if not os.path.splitext(args.out)[1]:
        args.out += ".png"  # what matplotlib would write: say the name it gets
    try:
        plot_runs(args.run_dirs, args.out, args.labels, args.ylim)
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
