"""Images per second: the trainer's on-device augmentation vs a torchvision-style DataLoader pipeline.

    python -m vision.bench_loader [--device=cpu|cuda] [--images=10000] [--rounds=5] [--workers=N] [--threads=N]

Both produce the same training batches (normalised float [128, 3, 32, 32] with labels, on --device):

* on-device (vision/cifar.py): the split is one uint8 tensor on the device; each batch is an index, one
  gather for crop and flip, and the normalisation.
* per-image: what the reference trainer runs (torchvision's CIFAR10 with RandomCrop(32, padding=4),
  RandomHorizontalFlip, ToTensor, Normalize, in a DataLoader with shuffling and worker processes).
  torchvision cannot be installed beside this torch build, so PerImageCifar does the same steps with
  PIL the way torchvision's transforms do (ImageOps.expand with fill 0, Image.crop, Image.transpose,
  np.asarray -> float / 255, (x - mean) / std); tests/test_vision.py holds the two to equal outputs.

The pixels are random (the cost of both pipelines does not depend on them). The two alternate for
--rounds epochs each in one process; the table gives the median images/s of each and their ratio.
--threads sets torch's intra-op threads in the main process (DataLoader workers use one each): on a
CPU shared with other jobs, torch's default of one thread per core can be many times slower than one.
"""

import os
import statistics
import sys
import time

import numpy as np
import torch
from PIL import Image, ImageOps

from marsgpt.config_schema import device_check
from marsgpt.runtime import resolve_device
from vision.cifar import CROP_PADDING, DATASETS, CifarData
from vision.cli import ArgumentParser, UsageError


def pil_crop_and_flip(image, top, left, flip):
    """RandomCrop(32, padding=4)'s and RandomHorizontalFlip's PIL operations, for given draws."""
    width, height = image.size
    padded = ImageOps.expand(image, border=CROP_PADDING, fill=0)
    image = padded.crop((left, top, left + width, top + height))
    return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else image


def pil_to_normalized_tensor(image, mean, std):
    """ToTensor (HWC uint8 -> CHW float in [0, 1]) then Normalize(mean, std)."""
    chw = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)
    return (chw.float() / 255.0 - mean) / std


class PerImageCifar(torch.utils.data.Dataset):
    """torchvision's CIFAR10 dataset with the reference's training transforms, one PIL image at a time."""

    def __init__(self, images, labels, dataset="cifar10"):
        self.images = np.ascontiguousarray(images.transpose(0, 2, 3, 1))  # HWC, as torchvision keeps CIFAR
        self.labels = labels
        spec = DATASETS[dataset]
        self.mean = torch.tensor(spec.mean).view(3, 1, 1)
        self.std = torch.tensor(spec.std).view(3, 1, 1)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = Image.fromarray(self.images[index])
        top, left = torch.randint(0, 2 * CROP_PADDING + 1, (2,)).tolist()  # RandomCrop.get_params
        flip = torch.rand(1).item() < 0.5  # RandomHorizontalFlip
        image = pil_crop_and_flip(image, top, left, flip)
        return pil_to_normalized_tensor(image, self.mean, self.std), int(self.labels[index])


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_on_device(data, epoch, batch_size, device):
    t0 = time.perf_counter()
    for _ in data.train_batches(0, epoch, batch_size):
        pass
    _sync(device)
    return time.perf_counter() - t0


def time_data_loader(loader, device):
    t0 = time.perf_counter()
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
    _sync(device)
    return time.perf_counter() - t0


def parse_args(argv):
    """The arguments, checked: a value no run could use is a UsageError naming it (before any work starts)."""
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--images", type=int, default=10000)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count()), help="the reference uses 4")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    args = parser.parse_args(argv)
    for name, least in (("images", 1), ("batch_size", 1), ("rounds", 1), ("workers", 0), ("threads", 1)):
        if getattr(args, name) < least:
            raise UsageError(f"--{name}={getattr(args, name)}: it must be at least {least}")
    problem = device_check("cpu", "cuda")(args.device)
    if problem:
        raise UsageError(f"--device={args.device} {problem}")
    try:
        args.device = resolve_device(args.device)
    except ValueError as e:  # CUDA asked for where there is none
        raise UsageError(str(e).replace("device=", "--device=", 1)) from None
    return args


def main(argv=None):
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (args.images, 3, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, args.images).astype(np.int64)

    on_device = CifarData("cifar10", (images, labels), (images[:1], labels[:1]), args.device)
    loader = torch.utils.data.DataLoader(
        PerImageCifar(images, labels),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=args.device.startswith("cuda"),
        persistent_workers=args.workers > 0,  # worker start-up is not counted against the loader
    )
    time_on_device(on_device, 0, args.batch_size, args.device)  # warm-up: allocator, kernels, workers
    time_data_loader(loader, args.device)
    device_s, loader_s = [], []
    for epoch in range(1, args.rounds + 1):
        device_s.append(time_on_device(on_device, epoch, args.batch_size, args.device))
        loader_s.append(time_data_loader(loader, args.device))
    device_rate = args.images / statistics.median(device_s)
    loader_rate = args.images / statistics.median(loader_s)
    print(
        f"{args.images} images, batch {args.batch_size}, {args.rounds} alternating epochs each, on {args.device}, "
        f"{args.threads} torch thread(s) in the main process"
    )
    print("| pipeline | images/s (median) |\n| --- | --- |")
    print(f"| on-device gather (vision/cifar.py) | {device_rate:,.0f} |")
    print(f"| per-image PIL + DataLoader, {args.workers} workers | {loader_rate:,.0f} |")
    print(f"on-device / DataLoader: {device_rate / loader_rate:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
