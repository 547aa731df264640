"""vision/: CIFAR reading (both distributions, offline), on-device augmentation, the trainer end to end.

The data sets are written here in the standard on-disk formats: the python distribution as Python 2's
cPickle wrote it (protocol 2, str objects as BINSTRING, numpy.core.multiarray names) and the binary one.
Images are tiny-net-learnable: each class has its own colour.
"""

import dataclasses
import gzip
import io
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import tarfile
import typing

import numpy as np
import pytest
import torch
from PIL import Image
from train_helpers import wait_for_line

from marsgpt import checkpoint
from marsgpt.config_schema import load_config
from vision import bench_loader, cifar, cpu_study, train_cifar
from vision.bench_loader import PerImageCifar, pil_crop_and_flip, pil_to_normalized_tensor
from vision.cifar import DATASETS, CifarData, crop_and_flip, read_cifar, write_binary_split
from vision.muon import Muon
from vision.resnet import ResNet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------------
# Writing the standard formats


class _Python2Pickler(pickle._Pickler):
    """Pickles bytes as Python 2 str objects (SHORT_BINSTRING / BINSTRING), as the CIFAR files hold them."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_python2_str(self, obj):
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_python2_str


def python2_pickle(obj):
    buffer = io.BytesIO()
    _Python2Pickler(buffer, protocol=2).dump(obj)
    # numpy 2 names its array reconstructor numpy._core.multiarray; the CIFAR files name numpy.core's.
    return buffer.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")


def toy_split(n, seed, num_classes=10):
    """n images; class k is a fixed colour plus noise, so colour alone separates the classes."""
    rng = np.random.default_rng(seed)
    # Ten colours far apart (the RGB cube's corners and two more); CIFAR-100 cycles through them.
    corners = [(r, g, b) for r in (0, 255) for g in (0, 255) for b in (0, 255)]
    colours = np.array((corners + [(128, 128, 128), (128, 0, 255)]) * (num_classes // 10))
    labels = np.arange(n) % num_classes
    noise = rng.normal(0, 20, (n, 3, 32, 32))
    images = np.clip(colours[labels][:, :, None, None] + noise, 0, 255).astype(np.uint8)
    return images, labels.astype(np.int64)


def write_python_cifar10(data_dir, train_per_batch=8, test=40):
    folder = os.path.join(data_dir, "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)
    splits = {name: toy_split(train_per_batch, seed=i) for i, name in enumerate(DATASETS["cifar10"].python.train_files)}
    splits["test_batch"] = toy_split(test, seed=99)
    for name, (images, labels) in splits.items():
        batch = {
            b"batch_label": name.encode(),
            b"labels": [int(label) for label in labels],
            b"data": images.reshape(len(labels), -1),
            b"filenames": [f"img_{i}.png".encode() for i in range(len(labels))],
        }
        with open(os.path.join(folder, name), "wb") as f:
            f.write(python2_pickle(batch))
    train = [splits[name] for name in DATASETS["cifar10"].python.train_files]
    return (np.concatenate([i for i, _ in train]), np.concatenate([y for _, y in train])), splits["test_batch"]


def write_binary_cifar100(data_dir, train=30, test=10):
    folder = os.path.join(data_dir, "cifar-100-binary")
    os.makedirs(folder, exist_ok=True)
    splits = {"train.bin": toy_split(train, seed=1, num_classes=100), "test.bin": toy_split(test, seed=2)}
    for name, (images, labels) in splits.items():
        # records: coarse label, fine label, pixels; the coarse one is deliberately different
        write_binary_split(os.path.join(folder, name), images, labels, label_bytes=2, label_offset=1)
        with open(os.path.join(folder, name), "r+b") as f:
            raw = bytearray(f.read())
            for i in range(len(labels)):
                raw[i * (2 + 3072)] = 7
            f.seek(0)
            f.write(raw)
    return splits["train.bin"], splits["test.bin"]


def tar_folder(data_dir, folder, archive):
    with tarfile.open(os.path.join(data_dir, archive), "w:gz") as tar:
        tar.add(os.path.join(data_dir, folder), arcname=folder)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors: one thread is as fast, and far faster when other jobs hold the cores (OpenMP waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cifar10_dir(tmp_path):
    data_dir = tmp_path / "cifar"
    write_python_cifar10(str(data_dir))
    return str(data_dir)


def assert_splits_equal(got, want):
    for (got_images, got_labels), (want_images, want_labels) in zip(got, want):
        np.testing.assert_array_equal(got_images, want_images)
        np.testing.assert_array_equal(got_labels, want_labels)


# ---------------------------------------------------------------------------------------------------
# Reading


@pytest.mark.parametrize(
    "dataset, form, write",
    [("cifar10", "python", write_python_cifar10), ("cifar100", "binary", write_binary_cifar100)],
)
def test_each_distribution_reads_from_its_folder_and_from_its_archive(tmp_path, dataset, form, write):
    """CIFAR-10 as pickles, CIFAR-100 as records (with the fine label, not the coarse one, as the label)."""
    data_dir = str(tmp_path / "d")
    want = write(data_dir)
    assert_splits_equal(read_cifar(dataset, data_dir), want)
    distribution = getattr(DATASETS[dataset], form)
    tar_folder(data_dir, distribution.folder, distribution.archive)
    os.rename(os.path.join(data_dir, distribution.folder), os.path.join(data_dir, "moved"))
    assert_splits_equal(read_cifar(dataset, data_dir), want)


class _RunsCode:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_a_pickle_that_would_run_code_is_refused_without_running_it(cifar10_dir, tmp_path):
    marker = str(tmp_path / "created_by_the_pickle")
    payload = {b"data": np.zeros((1, 3072), np.uint8), b"labels": [0], b"x": _RunsCode(marker)}
    with open(os.path.join(cifar10_dir, "cifar-10-batches-py", "data_batch_2"), "wb") as f:
        f.write(python2_pickle(payload))
    with pytest.raises(cifar.DataError, match=r"data_batch_2 is not a CIFAR python batch .*names posix\.mkdir"):
        read_cifar("cifar10", cifar10_dir)
    assert not os.path.exists(marker)


def test_no_data_and_no_network_names_data_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(cifar, "network_reachable", lambda host: False)
    data_dir = str(tmp_path / "empty")
    with pytest.raises(cifar.DataError, match=rf"unreachable; .*--data_dir={data_dir}$"):
        read_cifar("cifar10", data_dir)


class _Response(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_download_with_a_wrong_checksum_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(cifar, "network_reachable", lambda host: True)
    monkeypatch.setattr(cifar.urllib.request, "urlopen", lambda url, timeout: _Response(b"not the archive"))
    data_dir = tmp_path / "d"
    with pytest.raises(cifar.DataError, match="MD5 .* not c58f30108f718f92721af3b95e74349a"):
        read_cifar("cifar10", str(data_dir))
    assert os.listdir(data_dir) == []


def test_a_downloaded_archive_whose_checksum_matches_is_read(tmp_path, monkeypatch):
    source = str(tmp_path / "source")
    want = write_python_cifar10(source)
    tar_folder(source, "cifar-10-batches-py", "cifar-10-python.tar.gz")
    with open(os.path.join(source, "cifar-10-python.tar.gz"), "rb") as f:
        archive = f.read()
    import hashlib

    spec = dataclasses.replace(DATASETS["cifar10"], md5=hashlib.md5(archive).hexdigest())
    monkeypatch.setitem(DATASETS, "cifar10", spec)
    monkeypatch.setattr(cifar, "network_reachable", lambda host: True)
    requested = []
    monkeypatch.setattr(
        cifar.urllib.request, "urlopen", lambda url, timeout: requested.append(url) or _Response(archive)
    )
    data_dir = str(tmp_path / "d")
    assert_splits_equal(read_cifar("cifar10", data_dir), want)
    assert requested == ["https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"]
    assert os.listdir(data_dir) == ["cifar-10-python.tar.gz"]


def test_an_unreadable_batch_file_is_a_data_error_naming_it(cifar10_dir, monkeypatch):
    """A directory in a batch file's place, or a file it may not read, is a DataError, not an OSError."""
    folder = os.path.join(cifar10_dir, "cifar-10-batches-py")
    os.remove(os.path.join(folder, "data_batch_2"))
    os.mkdir(os.path.join(folder, "data_batch_2"))
    with pytest.raises(cifar.DataError, match=r"cannot read .*data_batch_2 \(Is a directory\)"):
        read_cifar("cifar10", cifar10_dir)
    os.rmdir(os.path.join(folder, "data_batch_2"))
    write_python_cifar10(cifar10_dir)

    def no_permission(path, mode="r"):  # as root, chmod 000 would not stop the read
        if path.endswith("data_batch_4"):
            raise PermissionError(13, "Permission denied", path)
        return open(path, mode)

    monkeypatch.setattr(cifar, "open", no_permission, raising=False)
    with pytest.raises(cifar.DataError, match=r"cannot read .*data_batch_4 \(Permission denied\)"):
        read_cifar("cifar10", cifar10_dir)


def test_a_data_dir_that_is_a_file_is_an_error_line_before_any_download(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cifar, "network_reachable", lambda host: True)
    monkeypatch.setattr(cifar.urllib.request, "urlopen", lambda url, timeout: pytest.fail("downloaded"))
    data_dir = tmp_path / "cifar"
    data_dir.write_text("not a folder")
    out = str(tmp_path / "out")
    assert train_cifar.main(tiny_args(str(data_dir), out)) == 2
    err = capsys.readouterr().err
    assert (
        err == f"error: --data_dir={data_dir} is a file, not a folder; pass the folder that holds (or is to "
        "receive) the CIFAR data\n"
    )
    assert data_dir.read_text() == "not a folder" and not os.path.exists(out)


# ---------------------------------------------------------------------------------------------------
# Augmentation


def test_on_device_crop_and_flip_equal_the_per_image_pil_pipeline():
    images, labels = toy_split(12, seed=5)
    data = CifarData("cifar10", (images, labels), (images, labels), "cpu")
    tops = torch.tensor([0, 8, 3, 4, 0, 8, 1, 2, 5, 6, 7, 4])
    lefts = torch.tensor([0, 8, 5, 4, 8, 0, 2, 1, 6, 7, 3, 4])
    flips = torch.tensor([False, True, True, False, True, False, True, False, True, True, False, False])
    padded = torch.nn.functional.pad(torch.from_numpy(images), (4, 4, 4, 4))
    ours = data.normalize(crop_and_flip(padded, tops, lefts, flips))
    per_image = PerImageCifar(images, labels)
    for i in range(len(labels)):
        image = pil_crop_and_flip(Image.fromarray(per_image.images[i]), int(tops[i]), int(lefts[i]), bool(flips[i]))
        torch.testing.assert_close(ours[i], pil_to_normalized_tensor(image, per_image.mean, per_image.std))
    assert not torch.equal(ours[1], ours[1].flip(-1))  # the flips and crops are not trivially equal


def test_epoch_batches_are_a_function_of_seed_and_epoch():
    images, labels = toy_split(50, seed=0)
    data = CifarData("cifar10", (images, labels), (images[:10], labels[:10]), "cpu")

    def epoch(seed, e):
        return list(data.train_batches(seed, e, batch_size=16))

    first, again, other = epoch(0, 1), epoch(0, 1), epoch(0, 2)
    assert [len(y) for _, y in first] == [16, 16, 16, 2]  # every image once, the last batch smaller
    assert sorted(torch.cat([y for _, y in first]).tolist()) == sorted(labels.tolist())
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    assert not torch.equal(first[0][0], other[0][0])
    assert not torch.equal(first[0][0], epoch(1, 1)[0][0])


# ---------------------------------------------------------------------------------------------------
# Optimizers


def test_muon_on_a_matrix_matches_torch_muon_and_flattens_kernels():
    torch.manual_seed(0)
    matrix = torch.nn.Parameter(torch.randn(16, 8))
    kernel = torch.nn.Parameter(matrix.detach().clone().view(16, 2, 2, 2))
    reference = torch.nn.Parameter(matrix.detach().clone())
    ours = Muon([matrix, kernel], lr=0.05, weight_decay=0.1)
    theirs = torch.optim.Muon([reference], lr=0.05, weight_decay=0.1, adjust_lr_fn="original")
    for _ in range(3):
        grad = torch.randn(16, 8)
        matrix.grad, kernel.grad, reference.grad = grad.clone(), grad.view(16, 2, 2, 2).clone(), grad.clone()
        ours.step()
        theirs.step()
    assert torch.equal(kernel.detach().view(16, 8), matrix.detach())
    torch.testing.assert_close(matrix.detach(), reference.detach(), atol=2e-3, rtol=0)  # torch's NS is bfloat16


def test_routings_differ_only_in_the_convolution_kernels_updates():
    """One step from the same weights and batch: '2d' and 'nd' move every tensor but the kernels identically."""
    cfg = train_cifar.CifarConfig(net="resnet10", width=4, learning_rate=1e-2)
    torch.manual_seed(0)
    start = ResNet(num_classes=10, width=4, blocks=(1, 1, 1, 1))
    images, labels = torch.randn(8, 3, 32, 32), torch.arange(8)
    stepped = {}
    for routing in ("2d", "nd"):
        model = ResNet(num_classes=10, width=4, blocks=(1, 1, 1, 1))
        model.load_state_dict(start.state_dict())
        optimizer = train_cifar.build_optimizer(model, dataclasses.replace(cfg, mars_routing=routing))
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        stepped[routing] = {name: p.detach() for name, p in model.named_parameters()}
    kernels = [name for name, p in start.named_parameters() if p.ndim == 4]
    assert len(kernels) == 12  # stem, two per block, three 1x1 shortcuts
    for name, before in start.named_parameters():
        assert not torch.equal(stepped["2d"][name], before.detach()), f"{name} did not move"
        if name in kernels:
            assert not torch.allclose(stepped["2d"][name], stepped["nd"][name]), name
        else:
            assert torch.equal(stepped["2d"][name], stepped["nd"][name]), name

    # '2d' trains a kernel with AdamW at lr_1d, betas_1d, weight_decay_1d: the paper code's rule.
    model = ResNet(num_classes=10, width=4, blocks=(1, 1, 1, 1))
    model.load_state_dict(start.state_dict())
    adamw = torch.optim.AdamW(
        [model.conv1.weight], lr=cfg.lr_1d, betas=cfg.betas_1d, weight_decay=cfg.weight_decay_1d, eps=1e-8
    )
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    adamw.step()
    torch.testing.assert_close(stepped["2d"]["conv1.weight"], model.conv1.weight.detach())


# ---------------------------------------------------------------------------------------------------
# The trainer


def tiny_args(data_dir, out_dir, **overrides):
    args = dict(
        data_dir=data_dir,
        out_dir=out_dir,
        net="resnet10",
        width=4,
        epochs=3,
        batch_size=8,
        eval_batch_size=8,
        learning_rate=1e-2,
        device="cpu",
    )
    args.update(overrides)
    return [f"--{key}={value}" for key, value in args.items()]


def records(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def final_state(out_dir):
    return torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["2d", "nd"])
def test_learns_the_separable_toy_set(cifar10_dir, tmp_path, routing):
    out = str(tmp_path / "out")
    args = tiny_args(cifar10_dir, out, width=8, epochs=8, schedule="constant", mars_routing=routing)
    assert train_cifar.main(args) == 0
    log = records(out)
    assert [r["epoch"] for r in log] == list(range(1, 9))
    assert all(k in r for r in log for k in ("train/loss", "test/loss", "test/acc"))
    assert log[-1]["train/loss"] < log[0]["train/loss"]
    assert log[-1]["test/acc"] >= 40.0  # 10 classes: chance is 10 %


class Killed(Exception):
    pass


def _dies_mid_epoch_2(monkeypatch):
    real_batches = CifarData.train_batches

    def batches(self, seed, epoch, batch_size):
        for step, batch in enumerate(real_batches(self, seed, epoch, batch_size)):
            if epoch == 2 and step == 2:
                raise Killed  # two optimizer steps of epoch 2 done, in memory only
            yield batch

    monkeypatch.setattr(CifarData, "train_batches", batches)


def _dies_saving_epoch_2(monkeypatch):
    real_save = checkpoint.save_checkpoint

    def save(path, state, guard=None):
        if state["progress"]["epoch"] == 2:
            raise Killed  # epoch 2's metrics record is written, its checkpoint is not
        real_save(path, state, guard)

    monkeypatch.setattr(checkpoint, "save_checkpoint", save)


@pytest.mark.slow
@pytest.mark.parametrize("kill", [_dies_mid_epoch_2, _dies_saving_epoch_2])
def test_a_killed_run_resumes_to_the_same_parameters_and_records(cifar10_dir, tmp_path, monkeypatch, kill):
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    assert train_cifar.main(tiny_args(cifar10_dir, whole)) == 0
    with monkeypatch.context() as patch:
        kill(patch)
        with pytest.raises(Killed):
            train_cifar.main(tiny_args(cifar10_dir, killed))
    assert final_state(killed)["progress"]["epoch"] == 1
    assert train_cifar.main(tiny_args(cifar10_dir, killed, init_from="resume")) == 0

    a, b = final_state(whole), final_state(killed)
    assert a["progress"]["epoch"] == b["progress"]["epoch"] == 3
    assert a["progress"]["iter_num"] == b["progress"]["iter_num"] == 15
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    timing = ("time_s", "images_per_s")
    strip = [{k: v for k, v in r.items() if k not in timing} for r in records(whole)]
    assert strip == [{k: v for k, v in r.items() if k not in timing} for r in records(killed)]


def test_a_fresh_run_refuses_an_out_dir_holding_a_checkpoint(cifar10_dir, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=1)) == 0
    before = final_state(out)["model"]
    capsys.readouterr()
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=1)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--init_from=resume" in err and "new --out_dir" in err
    after = final_state(out)["model"]
    assert all(torch.equal(before[k], after[k]) for k in before)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _batch_is_a_directory(data_dir):
    path = os.path.join(data_dir, "cifar-10-batches-py", "data_batch_5")
    os.remove(path)
    os.mkdir(path)


@pytest.mark.parametrize(
    "break_data, override, message",
    [
        (lambda d: _truncate(os.path.join(d, "cifar-10-batches-py", "data_batch_3")), {}, "data_batch_3 is not a"),
        (_batch_is_a_directory, {}, "data_batch_5 (Is a directory)"),
        (lambda d: os.remove(os.path.join(d, "cifar-10-batches-py", "test_batch")), {}, "test_batch is missing"),
        (lambda d: None, {"dataset": "cifar1000"}, "dataset='cifar1000' is not one of: cifar10, cifar100"),
        (lambda d: None, {"mars_routing": "3d"}, "mars_routing='3d' is not one of: 2d, nd"),
        (lambda d: None, {"device": "mps"}, "device='mps' is not one of: auto, cpu, cuda, cuda:N"),
        (lambda d: None, {"init_from": "resume"}, "no checkpoint at"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(cifar10_dir, tmp_path, capsys, break_data, override, message):
    break_data(cifar10_dir)
    out = str(tmp_path / "out")
    assert train_cifar.main(tiny_args(cifar10_dir, out, **override)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not os.path.exists(os.path.join(out, "ckpt.pt"))


@pytest.mark.slow
def test_the_module_reports_a_bad_key_in_one_line():
    """python -m vision.train_cifar from the repository root: a wrong value is one error line."""
    result = subprocess.run(
        [sys.executable, "-m", "vision.train_cifar", "--dataset=mnist"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == "error: dataset='mnist' is not one of: cifar10, cifar100\n"


class _FakeWandb:
    """Records what the trainer sends to wandb (no network, no background process)."""

    def __init__(self):
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class _Run:
            id = kwargs["id"] or "run123"

            def define_metric(self, *args, **kw):
                pass

            def log(self, record):
                fake.logged.append(record)

            def finish(self):
                fake.finished += 1

        return _Run()


def test_wandb_gets_every_epoch_record_and_resume_continues_the_run(cifar10_dir, tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = str(tmp_path / "out")
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=2, wandb_log=True)) == 0
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=3, wandb_log=True, init_from="resume")) == 0
    assert [i["id"] for i in fake.inits] == [None, "run123"]
    assert fake.inits[0]["name"] == "cifar10_resnet10_mars_0.01" and fake.inits[0]["project"] == "CV"
    assert fake.inits[0]["mode"] == "offline" and final_state(out)["progress"]["wandb_run_id"] == "run123"
    assert fake.logged == records(out) and [r["epoch"] for r in fake.logged] == [1, 2, 3]
    assert fake.finished == 2


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_lr_schedule_is_multisteplr_stepped_at_each_epochs_start():
    for epochs in (1, 2, 3, 7, 200):
        cfg = train_cifar.CifarConfig(epochs=epochs)
        param = torch.nn.Parameter(torch.zeros(1))
        sgd = torch.optim.SGD([param], lr=1.0)
        scheduler = torch.optim.lr_scheduler.MultiStepLR(sgd, milestones=[epochs // 2, epochs * 3 // 4], gamma=0.1)
        for epoch in range(1, epochs + 1):
            scheduler.step()  # as train_CV.py: before the epoch's training
            assert train_cifar.lr_factor(epoch, cfg) == pytest.approx(sgd.param_groups[0]["lr"]), (epochs, epoch)
    assert train_cifar.lr_factor(5, train_cifar.CifarConfig(schedule="constant", epochs=6)) == 1.0


def test_init_from_auto_starts_then_continues(cifar10_dir, tmp_path):
    out = str(tmp_path / "out")
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=1, init_from="auto")) == 0
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=2, init_from="auto")) == 0
    assert [r["epoch"] for r in records(out)] == [1, 2] and final_state(out)["progress"]["iter_num"] == 10


def test_config_choices_match_what_the_code_builds(capsys):
    hints = typing.get_type_hints(train_cifar.CifarConfig)
    assert typing.get_args(hints["dataset"]) == tuple(DATASETS)
    assert typing.get_args(hints["net"]) == tuple(train_cifar.NETS)
    assert train_cifar.main(["--help"]) == 0
    shown = capsys.readouterr().out
    assert all(f"--{f.name}=" in shown for f in dataclasses.fields(train_cifar.CifarConfig))


def test_run_cifar_sh_runs_the_paper_grid_with_valid_keys():
    script = os.path.join(ROOT, "scripts", "run_cifar.sh")
    env = dict(os.environ, DRY_RUN="1")
    result = subprocess.run(
        ["bash", script, "mars-nd", "cifar100", "--device=cuda:1"], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    commands = [line.split() for line in result.stdout.splitlines()]
    assert [c[:3] for c in commands] == [["python", "-m", "vision.train_cifar"]] * 5
    configs = [load_config(c[3:], train_cifar.CifarConfig) for c in commands]
    assert [c.learning_rate for c in configs] == [1e-5, 1e-4, 1e-3, 1e-2, 1e-1]
    assert {(c.dataset, c.optimizer_name, c.mars_routing, c.init_from, c.device, c.epochs) for c in configs} == {
        ("cifar100", "mars", "nd", "auto", "cuda:1", 200)
    }
    assert len({c.out_dir for c in configs}) == 5

    result = subprocess.run(["bash", script, "sgd"], env=env, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


def test_resume_refuses_a_different_routing(cifar10_dir, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=1)) == 0
    capsys.readouterr()
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=2, init_from="resume", mars_routing="nd")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trained with mars_routing='2d', not 'nd'" in err and "--mars_routing=2d" in err
    assert [r["epoch"] for r in records(out)] == [1]


def test_a_relaunch_removes_what_a_killed_save_left(cifar10_dir, tmp_path, capsys):
    """kill -9 during a save leaves ckpt.pt.tmp.<pid>, as large as the checkpoint; the next launch removes it
    (not one whose process is alive), as train.py does."""
    out = str(tmp_path / "out")
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=1)) == 0
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = os.path.join(out, f"ckpt.pt.tmp.{dead.pid}")
    alive = os.path.join(out, f"ckpt.pt.tmp.{os.getppid()}")  # not ours: this process's own saves use that name
    for path in (stale, alive):
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
    capsys.readouterr()
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=2, init_from="resume")) == 0
    assert f"removed {stale}, left by an interrupted write\n" in capsys.readouterr().out
    assert not os.path.exists(stale) and os.path.exists(alive)


def test_a_resume_says_where_it_resumes_and_when_there_is_nothing_to_train(cifar10_dir, tmp_path, capsys):
    out = str(tmp_path / "out")
    ckpt = os.path.join(out, "ckpt.pt")
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=1)) == 0
    assert "resuming" not in capsys.readouterr().out
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=2, init_from="auto")) == 0
    printed = capsys.readouterr().out
    assert f"resuming {ckpt} at epoch 1\n" in printed and "nothing to train" not in printed
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=2, init_from="resume")) == 0
    printed = capsys.readouterr().out
    assert f"resuming {ckpt} at epoch 2\n" in printed
    assert "nothing to train: the run is at epoch 2 and epochs is 2; raise --epochs to train further\n" in printed
    assert [r["epoch"] for r in records(out)] == [1, 2]


def _interrupted_in_epoch(epoch, monkeypatch):
    real_batches = CifarData.train_batches

    def batches(self, seed, e, batch_size):
        for step, batch in enumerate(real_batches(self, seed, e, batch_size)):
            if e == epoch and step == 2:
                raise KeyboardInterrupt  # what Ctrl-C raises: two steps of the epoch done, in memory only
            yield batch

    monkeypatch.setattr(CifarData, "train_batches", batches)


def _main_not_raising_keyboard_interrupt(args):
    try:
        return train_cifar.main(args)
    except KeyboardInterrupt:  # escaping, it would stop pytest itself
        pytest.fail("KeyboardInterrupt escaped train_cifar.main")


@pytest.mark.slow
def test_ctrl_c_is_one_line_exit_130_and_the_run_resumes_to_the_same_parameters(
    cifar10_dir, tmp_path, monkeypatch, capsys
):
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    assert train_cifar.main(tiny_args(cifar10_dir, whole)) == 0
    with monkeypatch.context() as patch:
        _interrupted_in_epoch(1, patch)
        capsys.readouterr()
        assert _main_not_raising_keyboard_interrupt(tiny_args(cifar10_dir, cut)) == 130
    assert capsys.readouterr().err == (
        "interrupted at epoch 1/3, before any checkpoint was written; rerun the same command to start again\n"
    )
    with monkeypatch.context() as patch:
        _interrupted_in_epoch(2, patch)
        assert _main_not_raising_keyboard_interrupt(tiny_args(cifar10_dir, cut)) == 130
    ckpt = os.path.join(cut, "ckpt.pt")
    assert capsys.readouterr().err == (
        f"interrupted at epoch 2/3; {ckpt} holds epoch 1: resume with --init_from=resume (or auto)\n"
    )
    assert train_cifar.main(tiny_args(cifar10_dir, cut, init_from="resume")) == 0
    a, b = final_state(whole), final_state(cut)
    assert a["progress"]["iter_num"] == b["progress"]["iter_num"] == 15
    assert all(torch.equal(value, b["model"][key]) for key, value in a["model"].items())


@pytest.mark.slow
def test_sigint_to_the_script_prints_no_traceback(cifar10_dir, tmp_path):
    """A real Ctrl-C (SIGINT) to python -m vision.train_cifar, after its first epoch: one line, status 130."""
    out = str(tmp_path / "out")
    trainer = subprocess.Popen(
        [sys.executable, "-m", "vision.train_cifar", *tiny_args(cifar10_dir, out, epochs=1000)],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_line(trainer, "epoch 2/1000:")  # epoch 1's checkpoint is written by now
        trainer.send_signal(signal.SIGINT)
        _, err = trainer.communicate(timeout=60)
    finally:
        trainer.kill()
    assert trainer.returncode == 130, err
    assert err.startswith("interrupted at epoch ") and err.count("\n") == 1, err
    assert f"{os.path.join(out, 'ckpt.pt')} holds epoch " in err and "--init_from=resume (or auto)" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--images=0"], "error: --images=0: it must be at least 1\n"),
        (["--rounds=-1"], "error: --rounds=-1: it must be at least 1\n"),
        (["--device=tpu"], "error: --device=tpu is not one of: auto, cpu, cuda, cuda:N\n"),
        (["--device=cuda:99"], "error: --device='cuda:99' but "),
        pytest.param(
            ["--device=cuda"],
            "error: --device='cuda' but CUDA is not available; use --device=cpu\n",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here"),
        ),
    ],
)
def test_bench_loader_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert bench_loader.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_bench_loader_a_value_argparse_refuses_is_one_line_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_loader.main(["--images=many"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "error: argument --images: invalid int value: 'many'; see --help\n"


def _write_idx(path, array):
    header = bytes([0, 0, 8, array.ndim]) + b"".join(n.to_bytes(4, "big") for n in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def fashion_mnist_dir(tmp_path):
    """Fashion-MNIST's four IDX files, 20 images each split."""
    folder = tmp_path / "fashion"
    folder.mkdir()
    for prefix in ("train", "t10k"):
        _write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", np.zeros((20, 28, 28)))
        _write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", np.arange(20) % 10)
    return str(folder)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--epochs=0"], "error: --epochs=0: it must be at least 1\n"),
        (["--fashion_mnist_dir=/nonexistent"], "error: no Fashion-MNIST IDX file train-images-idx3-ubyte.gz in "),
    ],
)
def test_cpu_study_bad_input_is_one_line_exit_2_and_writes_nothing(fashion_mnist_dir, tmp_path, capsys, argv, message):
    out = str(tmp_path / "study")
    assert cpu_study.main([f"--out={out}", f"--fashion_mnist_dir={fashion_mnist_dir}", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not os.path.exists(out)


def test_run_cifar_sh_help_and_a_wrong_dataset(tmp_path):
    script = os.path.join(ROOT, "scripts", "run_cifar.sh")
    env = dict(os.environ, DRY_RUN="1", LRS="1e-3")
    for flag in ("--help", "-h"):
        result = subprocess.run(["bash", script, flag], env=env, capture_output=True, text=True)
        assert result.returncode == 0 and result.stderr == "", result.stderr
        assert "bash scripts/run_cifar.sh mars|mars-nd|adamw|muon [cifar10|cifar100]" in result.stdout
        assert "DRY_RUN=1" in result.stdout and "#" not in result.stdout

    result = subprocess.run(["bash", script, "mars", "cifar1000"], env=env, capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: the second argument 'cifar1000' is neither a dataset (cifar10 or cifar100)")
    assert result.stderr.count("\n") == 1

    # a config file (named from the repository root, where the runs start) is not a dataset, and is passed on
    result = subprocess.run(["bash", script, "adamw", "pyproject.toml"], env=env, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.split()[-1] == "pyproject.toml", result.stderr


# ---------------------------------------------------------------------------------------------------
# Runs and out_dir: marsgpt/launch.py's policy, as train.py applies it


@pytest.fixture
def data_and_out(cifar10_dir, tmp_path):
    return cifar10_dir, str(tmp_path / "out")


@pytest.mark.parametrize("optimizer_name", ["mars", "muon"])
def test_a_resume_applies_changed_hyperparameters(data_and_out, capsys, optimizer_name):
    """A resume trains at the learning rates it is given (each change printed), not at the checkpoint's."""
    cifar10_dir, out = data_and_out
    first = dict(optimizer_name=optimizer_name, schedule="constant", lr_1d=3e-3)
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=1, **first)) == 0
    capsys.readouterr()
    changed = dict(first, learning_rate=1e-3, lr_1d=1e-4, init_from="resume")
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=2, **changed)) == 0
    printed = capsys.readouterr().out
    assert "resume: learning_rate 0.01 -> 0.001\n" in printed and "resume: lr_1d 0.003 -> 0.0001\n" in printed
    assert [r["lr"] for r in records(out)] == [1e-2, 1e-3]
    groups = final_state(out)["optimizer"]
    if optimizer_name == "muon":
        groups = [g for opt in groups["optimizers"] for g in opt["param_groups"]]
        assert [(g["name"], g["lr"], g["initial_lr"]) for g in groups] == [("muon", 1e-3, 1e-3), ("adamw", 1e-4, 1e-4)]
    else:
        (group,) = groups["param_groups"]
        assert (group["lr"], group["lr_1d"]) == (1e-3, 1e-4)
        assert group["lr_1d_factor"] == pytest.approx(0.1)  # the AdamW-rule tensors train at lr_1d


def test_a_fixed_key_the_optimizer_does_not_read_may_change_on_resume(data_and_out, capsys):
    cifar10_dir, out = data_and_out
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=1, optimizer_name="adamw")) == 0
    capsys.readouterr()
    resume = tiny_args(cifar10_dir, out, epochs=2, optimizer_name="adamw", mars_routing="nd", init_from="resume")
    assert train_cifar.main(resume) == 0
    assert "resume: mars_routing '2d' -> 'nd' (not used by optimizer_name=adamw)\n" in capsys.readouterr().out
    assert [r["epoch"] for r in records(out)] == [1, 2]


def test_overwrite_replaces_the_previous_run(data_and_out, capsys):
    cifar10_dir, out = data_and_out
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=2)) == 0
    capsys.readouterr()
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=1)) == 2
    assert "delete it with --overwrite=True" in capsys.readouterr().err
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=1, overwrite=True)) == 0
    assert [r["epoch"] for r in records(out)] == [1] and final_state(out)["progress"]["epoch"] == 1


def test_a_checkpoint_lacking_a_part_is_one_line_and_exit_2(data_and_out, capsys):
    cifar10_dir, out = data_and_out
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=1)) == 0
    state = final_state(out)
    del state["rng"]
    torch.save(state, os.path.join(out, "ckpt.pt"))
    capsys.readouterr()
    assert train_cifar.main(tiny_args(cifar10_dir, out, epochs=2, init_from="resume")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "ckpt.pt lacks rng: it was not written by" in err
