"""CIFAR-10/100 from the standard distributions, held on the training device and augmented there.

Both distributions of https://www.cs.toronto.edu/~kriz/cifar.html are read, from `data_dir`, either
extracted or as the downloaded .tar.gz (members are read straight from the archive, nothing is unpacked):

* python: cifar-10-batches-py/{data_batch_1..5,test_batch}, cifar-100-python/{train,test}. Each file is
  a pickle (a dict of bytes keys, lists of ints and bytes, and one uint8 numpy array). They are read by
  a restricted unpickler that resolves only numpy's three array-reconstruction names, so a file cannot
  run code when it is read; anything else it names is refused.
* binary: cifar-10-batches-bin/{data_batch_1..5,test_batch}.bin, cifar-100-binary/{train,test}.bin:
  fixed records of label byte(s) and 3072 pixel bytes. CIFAR-100 records hold (coarse, fine) labels;
  the fine one (100 classes) is used, as torchvision's CIFAR100 does.

When none is there, the python archive is downloaded into data_dir (what torchvision, and hence the
reference trainer, uses) and its MD5 checked before it gets its final name.

The whole split lives as one uint8 tensor [N, 3, 32, 32] on the device. Each training batch is a
random crop of the image zero-padded by 4 pixels and a horizontal flip with probability 1/2, done as one
gather for the whole batch, then ToTensor's scaling to [0, 1] and the per-channel normalisation of the
reference (MARS/utils/cv_utils.py). The batch order and augmentation of epoch e are a pure function of
(seed, e), so a resumed run sees exactly the batches an uninterrupted one would.
"""

import dataclasses
import hashlib
import io
import os
import pickle
import tarfile
import urllib.parse
import urllib.request

import numpy as np
import torch
import torch.nn.functional as F

from marsgpt.files import atomic_writer
from marsgpt.runtime import network_reachable
from marsgpt.tokens import DataError

IMAGE_SHAPE = (3, 32, 32)
IMAGE_BYTES = 3 * 32 * 32
CROP_PADDING = 4  # torchvision RandomCrop(32, padding=4), as the reference


@dataclasses.dataclass(frozen=True)
class Distribution:
    """One on-disk form of a data set: its folder (also its folder inside the archive) and file names."""

    archive: str
    folder: str
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class CifarSpec:
    num_classes: int
    python: Distribution
    binary: Distribution
    label_key: bytes  # the python distribution's key of the labels used
    label_offset: int  # the binary distribution: labels used are byte label_offset of each record
    label_bytes: int  # the binary distribution: label bytes before the pixels of each record
    url: str  # the python archive, downloaded when nothing is in data_dir
    md5: str
    mean: tuple[float, float, float]  # per-channel normalisation of the reference's transforms
    std: tuple[float, float, float]


_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
DATASETS = {
    "cifar10": CifarSpec(
        num_classes=10,
        python=Distribution("cifar-10-python.tar.gz", "cifar-10-batches-py", _BATCHES, ("test_batch",)),
        binary=Distribution(
            "cifar-10-binary.tar.gz",
            "cifar-10-batches-bin",
            tuple(f"{name}.bin" for name in _BATCHES),
            ("test_batch.bin",),
        ),
        label_key=b"labels",
        label_offset=0,
        label_bytes=1,
        url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        md5="c58f30108f718f92721af3b95e74349a",
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2023, 0.1994, 0.2010),
    ),
    "cifar100": CifarSpec(
        num_classes=100,
        python=Distribution("cifar-100-python.tar.gz", "cifar-100-python", ("train",), ("test",)),
        binary=Distribution("cifar-100-binary.tar.gz", "cifar-100-binary", ("train.bin",), ("test.bin",)),
        label_key=b"fine_labels",
        label_offset=1,
        label_bytes=2,
        url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        md5="eb9058c3a382ffc7106e4002c42a8d85",
        mean=(0.507, 0.487, 0.441),
        std=(0.267, 0.256, 0.276),
    ),
}


# ---------------------------------------------------------------------------------------------------
# Reading


# numpy pickles an array as _reconstruct(ndarray, shape, dtype) plus its raw bytes; the function lives in
# numpy.core.multiarray (numpy 1, what the CIFAR files name) or numpy._core.multiarray (numpy 2).
_RECONSTRUCT = np.ndarray.__reduce__(np.zeros(0))[0]
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class _BatchUnpickler(pickle.Unpickler):
    """Builds plain containers, numbers, bytes and numpy arrays; any other global is refused."""

    def find_class(self, module, name):
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR batch never holds") from None


def _read_pickled_batch(data, name, label_key):
    try:
        # The files were written by Python 2: 'bytes' keeps its str objects (keys, pixel data) as bytes.
        batch = _BatchUnpickler(io.BytesIO(data), encoding="bytes").load()
    except Exception as e:  # a truncated or foreign file can fail in many ways inside pickle
        raise DataError(f"{name} is not a CIFAR python batch ({type(e).__name__}: {e}); {_REFETCH}") from None
    if not isinstance(batch, dict):
        raise DataError(f"{name} is not a CIFAR python batch (it holds a {type(batch).__name__}); {_REFETCH}")
    batch = {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}
    key = label_key.decode()
    pixels, labels = batch.get("data"), batch.get(key)
    if not (isinstance(pixels, np.ndarray) and pixels.dtype == np.uint8 and pixels.ndim == 2):
        raise DataError(f"{name} has no 'data' array of uint8 pixel rows; {_REFETCH}")
    if not isinstance(labels, list) or not all(type(label) is int for label in labels):
        raise DataError(f"{name} has no '{key}' list of integer labels; {_REFETCH}")
    return _checked_split(pixels, np.asarray(labels, dtype=np.int64), name)


def _read_binary_batch(data, name, spec):
    record = spec.label_bytes + IMAGE_BYTES
    if len(data) == 0 or len(data) % record:
        raise DataError(f"{name} has {len(data)} bytes, not a whole number of {record}-byte CIFAR records; {_REFETCH}")
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, record)
    return _checked_split(records[:, spec.label_bytes :], records[:, spec.label_offset].astype(np.int64), name)


def _checked_split(pixels, labels, name):
    if pixels.shape[1] != IMAGE_BYTES or len(pixels) != len(labels) or len(pixels) == 0:
        raise DataError(
            f"{name} holds {pixels.shape[0]} rows of {pixels.shape[1]} pixel bytes and {len(labels)} labels "
            f"(expected equal counts of {IMAGE_BYTES}-byte 32x32 RGB images); {_REFETCH}"
        )
    return pixels.reshape(-1, *IMAGE_SHAPE), labels


_REFETCH = "delete it and let the trainer download the data set again, or replace it with an intact copy"


class _Source:
    """Files of one distribution, from its extracted folder or its .tar.gz, as bytes."""

    def __init__(self, data_dir, distribution):
        self.folder = os.path.join(data_dir, distribution.folder)
        self.archive = os.path.join(data_dir, distribution.archive)
        self.extracted = os.path.isdir(self.folder)
        self.where = self.folder if self.extracted else self.archive

    def exists(self):
        return self.extracted or os.path.isfile(self.archive)

    def read_all(self, names):
        if self.extracted:
            return [self._read_file(name) for name in names]
        try:
            with tarfile.open(self.archive, "r:gz") as tar:
                return [self._read_member(tar, name) for name in names]
        except (tarfile.TarError, OSError, EOFError) as e:
            raise DataError(f"{self.archive} is not a readable .tar.gz ({e}); {_REFETCH}") from None

    def _read_file(self, name):
        path = os.path.join(self.folder, name)
        try:
            with open(path, "rb") as f:
                return path, f.read()
        except FileNotFoundError:
            raise DataError(
                f"{path} is missing: {self.folder} is incomplete; restore the file, or delete the folder and "
                f"let the trainer download the data set again"
            ) from None
        except OSError as e:  # a directory in its place, no read permission, an I/O error
            raise DataError(f"cannot read {path} ({e.strerror or e}); {_REFETCH}") from None

    def _read_member(self, tar, name):
        member = f"{os.path.basename(self.folder)}/{name}"
        label = f"{self.archive}:{member}"
        try:
            f = tar.extractfile(member)
        except KeyError:
            f = None
        if f is None:
            raise DataError(f"{label} is missing from the archive; {_REFETCH}")
        return label, f.read()


def write_binary_split(path, images, labels, label_bytes=1, label_offset=0):
    """Write uint8 images [N,3,32,32] and labels [N] as a file of the binary distribution's records."""
    records = np.zeros((len(labels), label_bytes + IMAGE_BYTES), dtype=np.uint8)
    records[:, label_offset] = labels
    records[:, label_bytes:] = np.asarray(images, dtype=np.uint8).reshape(len(labels), IMAGE_BYTES)
    with atomic_writer(path) as f:
        f.write(records.tobytes())


def _download(spec, data_dir):
    """Fetch spec's python archive into data_dir; it appears under its final name only once its MD5 matches."""
    host = urllib.parse.urlparse(spec.url).hostname
    archive = os.path.join(data_dir, spec.python.archive)
    by_hand = (
        f"download {spec.url} elsewhere and put it (or its extracted {spec.python.folder}/, or the binary "
        f"distribution {spec.binary.archive}) into --data_dir={data_dir}"
    )
    if not network_reachable(host):
        raise DataError(f"no {spec.python.folder} data in --data_dir={data_dir} and {host} is unreachable; {by_hand}")
    try:
        os.makedirs(data_dir, exist_ok=True)
    except OSError as e:  # a file on the way, no write permission
        raise DataError(
            f"cannot create --data_dir={data_dir} ({e.strerror or e}); pass a folder it can write to"
        ) from None
    print(f"downloading {spec.url} to {archive}")
    md5 = hashlib.md5()
    try:
        with urllib.request.urlopen(spec.url, timeout=60) as response, atomic_writer(archive) as f:
            for chunk in iter(lambda: response.read(1 << 20), b""):
                md5.update(chunk)
                f.write(chunk)
            if md5.hexdigest() != spec.md5:
                raise DataError(
                    f"the download of {spec.url} has MD5 {md5.hexdigest()}, not {spec.md5} (a broken transfer "
                    f"or a changed file); nothing was kept; retry, or {by_hand}"
                )
    except OSError as e:
        raise DataError(f"cannot download {spec.url} ({e}); {by_hand}") from None


def read_cifar(dataset, data_dir):
    """((train_images, train_labels), (test_images, test_labels)) as uint8 [N,3,32,32] and int64 [N] numpy arrays.

    Looks in data_dir for the python distribution, then the binary one (each extracted, then archived);
    downloads the python archive when there is neither.
    """
    if dataset not in DATASETS:
        raise DataError(f"dataset={dataset!r} is not one of: {', '.join(DATASETS)}")
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise DataError(
            f"--data_dir={data_dir} is a file, not a folder; pass the folder that holds (or is to receive) the "
            f"CIFAR data"
        )
    spec = DATASETS[dataset]
    sources = [(form, _Source(data_dir, getattr(spec, form))) for form in ("python", "binary")]
    sources.sort(key=lambda item: not item[1].extracted)  # an extracted folder first, then an archive
    found = [(form, source) for form, source in sources if source.exists()]
    if not found:
        _download(spec, data_dir)
        found = [("python", _Source(data_dir, spec.python))]
    form, source = found[0]
    distribution = getattr(spec, form)
    splits = []
    for names in (distribution.train_files, distribution.test_files):
        parts = []
        for name, data in source.read_all(names):
            if form == "python":
                parts.append(_read_pickled_batch(data, name, spec.label_key))
            else:
                parts.append(_read_binary_batch(data, name, spec))
        images = np.concatenate([images for images, _ in parts])
        labels = np.concatenate([labels for _, labels in parts])
        if labels.min() < 0 or labels.max() >= spec.num_classes:
            raise DataError(
                f"{source.where} has labels outside 0..{spec.num_classes - 1}: is it {dataset}? "
                f"(--dataset names which CIFAR it is)"
            )
        splits.append((images, labels))
    return tuple(splits)


# ---------------------------------------------------------------------------------------------------
# On the device


def epoch_generator(seed, epoch, device):
    """The generator of epoch `epoch`'s batch order and augmentation: a pure function of (seed, epoch)."""
    state = np.random.SeedSequence([seed, epoch]).generate_state(1, np.uint64)[0]
    generator = torch.Generator(device=device)
    generator.manual_seed(int(state))
    return generator


def crop_and_flip(padded, tops, lefts, flips):
    """Crops [N,C,H,W] images out of `padded` at (tops, lefts), mirrored left-right where `flips`, in one gather.

    padded: [N, C, H + 2p, W + 2p]; tops, lefts: int [N] in [0, 2p]; flips: bool [N]. Output pixel (y, x)
    of image i is padded pixel (tops[i] + y, lefts[i] + x), or (tops[i] + y, lefts[i] + W - 1 - x) when
    flipped; the gather reads them through one flat index per image, shared by the channels.
    """
    n, c, padded_h, padded_w = padded.shape
    h, w = padded_h - 2 * CROP_PADDING, padded_w - 2 * CROP_PADDING
    device = padded.device
    columns = torch.arange(w, device=device)
    columns = lefts[:, None] + torch.where(flips[:, None], columns.flip(0), columns)
    rows = tops[:, None] + torch.arange(h, device=device)
    flat_index = (rows[:, :, None] * padded_w + columns[:, None, :]).view(n, 1, h * w).expand(n, c, h * w)
    return torch.gather(padded.reshape(n, c, padded_h * padded_w), 2, flat_index).view(n, c, h, w)


def random_crop_and_flip(images, generator):
    """RandomCrop(32, padding=4) (zero fill) then RandomHorizontalFlip(), for a uint8 batch on its device."""
    n = images.shape[0]
    device = images.device
    padded = F.pad(images, (CROP_PADDING,) * 4)
    tops = torch.randint(0, 2 * CROP_PADDING + 1, (n,), generator=generator, device=device)
    lefts = torch.randint(0, 2 * CROP_PADDING + 1, (n,), generator=generator, device=device)
    flips = torch.rand(n, generator=generator, device=device) < 0.5
    return crop_and_flip(padded, tops, lefts, flips)


class CifarData:
    """Both splits of one data set as tensors on `device`, with the training and test batch iterators."""

    def __init__(self, dataset, train, test, device):
        """train, test: (uint8 images [N,3,32,32], int64 labels [N]) numpy arrays, as read_cifar returns."""
        (train_images, train_labels), (test_images, test_labels) = train, test
        spec = DATASETS[dataset]
        self.num_classes = spec.num_classes
        self.train_images = torch.from_numpy(train_images).to(device)
        self.train_labels = torch.from_numpy(train_labels).to(device)
        self.test_images = torch.from_numpy(test_images).to(device)
        self.test_labels = torch.from_numpy(test_labels).to(device)
        self.mean = torch.tensor(spec.mean, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(spec.std, device=device).view(1, 3, 1, 1)

    @classmethod
    def from_dir(cls, dataset, data_dir, device):
        return cls(dataset, *read_cifar(dataset, data_dir), device)

    def normalize(self, images):
        """ToTensor's uint8 -> [0, 1], then Normalize(mean, std)."""
        return (images.float() / 255.0 - self.mean) / self.std

    def train_batches_per_epoch(self, batch_size):
        return -(-len(self.train_labels) // batch_size)

    def train_batches(self, seed, epoch, batch_size):
        """One epoch: a fresh permutation, the last batch smaller when batch_size does not divide N (as DataLoader)."""
        generator = epoch_generator(seed, epoch, self.train_images.device)
        order = torch.randperm(len(self.train_labels), generator=generator, device=self.train_images.device)
        for start in range(0, len(order), batch_size):
            index = order[start : start + batch_size]
            images = random_crop_and_flip(self.train_images[index], generator)
            yield self.normalize(images), self.train_labels[index]

    def test_batches(self, batch_size):
        for start in range(0, len(self.test_labels), batch_size):
            end = start + batch_size
            yield self.normalize(self.test_images[start:end]), self.test_labels[start:end]
