"""A CPU-sized look at the paper's open question: MARS on the convolutions vs MARS as the paper routes it.

    python -m vision.cpu_study [--out=out-cifar-study] [--epochs=15] [--plot=PNG] [--fashion_mnist_dir=DIR]

CIFAR-10 cannot be downloaded on the machine this was written on, and no Python package ships it, so
the images are Fashion-MNIST's (Debian's dataset-fashion-mnist package puts its IDX files in
/usr/share/datasets/fashion-mnist): a class-balanced subset of 5,000 training and 2,000 test images
(the first of each class in the official splits), zero-padded from 28x28 to 32x32 and repeated over 3
channels, written as CIFAR-10's binary distribution so that vision/train_cifar.py reads it through its
ordinary --dataset=cifar10 path (and normalises it with CIFAR-10's constants; BatchNorm follows the stem).
These are NOT CIFAR results.

Three runs, identical but for the optimizer: a narrow ResNet-18 (width 8, 0.18M parameters), batch 128,
--epochs epochs with the reference's MultiStepLR (x0.1 at 1/2 and 3/4), seed 0, and one learning rate,
3e-3, for every tensor of every run (the reference's lr_1d, so MARS's two halves share it):
  adamw    torch AdamW, betas (0.9, 0.999), weight decay 0 (the reference's AdamW baseline)
  mars-2d  MARS as the paper's code routes it: the classifier weight takes MARS, the convolution kernels
           and BatchNorm parameters AdamW with betas (0.9, 0.95) and weight decay 0.1
  mars-nd  MARS on the convolution kernels too (and the classifier); BatchNorm as in mars-2d
No learning-rate grid (the paper's best-of-grid needs ~5x the budget): a comparison at one shared lr.

Resumable: a finished run is kept, an interrupted one resumes from its checkpoint. Writes
OUT/results.md (the table) and the plot (test accuracy, test loss and train loss per epoch) to --plot
(default OUT/curves.png). docs/vision.md shows assets/vision_cpu_study.png, made with
--plot=assets/vision_cpu_study.png.
"""

import gzip
import os
import sys

import numpy as np

from marsgpt.metrics import read_records
from vision import train_cifar
from vision.cifar import write_binary_split
from vision.cli import ArgumentParser, UsageError

RUNS = {
    "adamw": ["--optimizer_name=adamw"],
    "mars-2d": ["--optimizer_name=mars", "--mars_routing=2d"],
    "mars-nd": ["--optimizer_name=mars", "--mars_routing=nd"],
}
LEARNING_RATE = 3e-3
TRAIN_PER_CLASS, TEST_PER_CLASS = 500, 200
IDX_FILES = tuple(
    f"{prefix}-{kind}-idx{ndim}-ubyte.gz"
    for prefix in ("train", "t10k")
    for kind, ndim in (("images", 3), ("labels", 1))
)


def read_idx(path):
    """An IDX file (the MNIST family's format): big-endian magic, dimensions, then uint8 values."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
        ndim = data[3]
        shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
        return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)
    except (OSError, EOFError, IndexError, ValueError) as e:  # unreadable, not gzip, truncated
        raise UsageError(
            f"{path} is not a readable gzipped IDX file ({type(e).__name__}: {e}); reinstall dataset-fashion-mnist"
        ) from None


def balanced_subset(images, labels, per_class):
    """The first per_class images of every class, in their original order."""
    keep = np.sort(np.concatenate([np.flatnonzero(labels == k)[:per_class] for k in range(10)]))
    return images[keep], labels[keep]


def as_cifar_images(gray):
    """[N, 28, 28] gray -> [N, 3, 32, 32]: zero-padded by 2 pixels, the same plane in R, G and B."""
    padded = np.pad(gray, ((0, 0), (2, 2), (2, 2)))
    return np.repeat(padded[:, None], 3, axis=1)


def write_data(fashion_mnist_dir, data_dir):
    folder = os.path.join(data_dir, "cifar-10-batches-bin")
    if os.path.isfile(os.path.join(folder, "test_batch.bin")):
        return
    os.makedirs(folder, exist_ok=True)
    splits = {}
    for split, prefix, per_class in (("train", "train", TRAIN_PER_CLASS), ("test", "t10k", TEST_PER_CLASS)):
        images = read_idx(os.path.join(fashion_mnist_dir, f"{prefix}-images-idx3-ubyte.gz"))
        labels = read_idx(os.path.join(fashion_mnist_dir, f"{prefix}-labels-idx1-ubyte.gz"))
        splits[split] = balanced_subset(images, labels, per_class)
    images, labels = splits["train"]
    for i, part in enumerate(np.array_split(np.arange(len(labels)), 5), 1):  # CIFAR's five training files
        write_binary_split(os.path.join(folder, f"data_batch_{i}.bin"), as_cifar_images(images[part]), labels[part])
    images, labels = splits["test"]
    write_binary_split(os.path.join(folder, "test_batch.bin"), as_cifar_images(images), labels)


def run(name, args, data_dir, out):
    out_dir = os.path.join(out, name)
    argv = [
        f"--data_dir={data_dir}",
        f"--out_dir={out_dir}",
        "--dataset=cifar10",
        "--net=resnet18",
        "--width=8",
        f"--epochs={args.epochs}",
        f"--learning_rate={LEARNING_RATE}",
        f"--lr_1d={LEARNING_RATE}",
        "--device=cpu",
        *RUNS[name],
    ]
    if os.path.exists(os.path.join(out_dir, "ckpt.pt")):
        done = [r for r in read_records(out_dir) if r["epoch"] == args.epochs]
        if done:
            return 0
        argv.append("--init_from=resume")
    print(f"== {name}: python -m vision.train_cifar {' '.join(argv)}", flush=True)
    return train_cifar.main(argv)  # it printed its one line when it failed


def summarize(out, epochs, plot_path):
    rows = ["| run | best test acc (%) | final test acc (%) | final test loss | final train loss | s/epoch |"]
    rows.append("| --- | --- | --- | --- | --- | --- |")
    curves = {}
    for name in RUNS:
        records = read_records(os.path.join(out, name))
        curves[name] = records
        last = records[-1]
        seconds = last["time_s"] / len(records)
        rows.append(
            f"| {name} | {last['test/best_acc']:.2f} | {last['test/acc']:.2f} | {last['test/loss']:.4f} "
            f"| {last['train/loss']:.4f} | {seconds:.0f} |"
        )
    table = "\n".join(rows)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    plot_curves(curves, plot_path, epochs)


def plot_curves(curves, path, epochs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = (("test/acc", "test accuracy (%)"), ("test/loss", "test loss"), ("train/loss", "train loss"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, label) in zip(axes, series):
        for name, records in curves.items():
            ax.plot([r["epoch"] for r in records], [r[key] for r in records], marker=".", label=name)
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        for milestone in (epochs // 2, 3 * epochs // 4):
            ax.axvline(milestone - 0.5, color="grey", lw=0.6, ls=":")  # lr x0.1 from this epoch on
    axes[0].legend()
    fig.suptitle(
        "ResNet-18 width 8 on a 5k/2k Fashion-MNIST subset (32x32, 3 channels), CPU, lr 3e-3 for all "
        "-- not CIFAR, not the paper's regime",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def parse_args(argv):
    """The arguments, checked before anything is written: a mistake is a UsageError naming it."""
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out-cifar-study")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--plot", help="where to write the plot (default OUT/curves.png)")
    parser.add_argument("--fashion_mnist_dir", default="/usr/share/datasets/fashion-mnist")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        raise UsageError(f"--epochs={args.epochs}: it must be at least 1")
    missing = [name for name in IDX_FILES if not os.path.isfile(os.path.join(args.fashion_mnist_dir, name))]
    if missing:
        raise UsageError(
            f"no Fashion-MNIST IDX file {missing[0]} in {args.fashion_mnist_dir}; install Debian's "
            f"dataset-fashion-mnist package or pass --fashion_mnist_dir=DIR"
        )
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out={args.out} is a file, not a folder; pass a folder for the study's runs")
    return args


def main(argv=None):
    try:
        args = parse_args(argv)
        data_dir = os.path.join(args.out, "data")
        write_data(args.fashion_mnist_dir, data_dir)
        for name in RUNS:
            status = run(name, args, data_dir, args.out)
            if status:
                return status  # 2: bad input, 130: interrupted (rerunning this command resumes the study)
        summarize(args.out, args.epochs, args.plot or os.path.join(args.out, "curves.png"))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to continue the study where it stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
