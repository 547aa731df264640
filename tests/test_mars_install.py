"""The optimizer as a distribution of its own (pyproject.toml's [project], issue 29): `pip install <checkout>`
gives the module mars, with its version, mars_triton, fused=True's kernel, and mars_sharded, the step of DTensor
parameters, requiring torch and nothing of the trainer; and mars.py copied alone steps on every path but fused=True
and DTensor parameters, which it refuses saying what is missing."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch
from train_helpers import ROOT, subprocess_env

import mars


def checkout_copy(destination):
    """The working tree's files as a checkout holds them (tracked, and new ones git does not ignore)."""
    try:
        listed = subprocess.run(
            ["git", "-C", ROOT, "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs git to list the checkout's files")
    for name in filter(None, listed.decode().split("\0")):
        source = os.path.join(ROOT, name)
        if os.path.isfile(source):  # a file deleted from the working tree but still tracked is not there
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


@pytest.mark.slow
def test_pip_installs_the_optimizer_alone_with_its_version(tmp_path):
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("needs setuptools, the build backend pyproject.toml names (installed offline, no build isolation)")
    checkout, site = tmp_path / "checkout", tmp_path / "site"
    checkout_copy(checkout)
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index"]
    run = subprocess.run(
        [*install, "--quiet", "--target", str(site), str(checkout)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout + run.stderr
    installed = sorted(p.name for p in site.iterdir() if p.name != "__pycache__")
    assert installed == [
        "mars.py",
        f"mars_optimizer-{mars.__version__}.dist-info",
        "mars_sharded.py",
        "mars_triton.py",
    ]

    probe = (
        "import importlib.metadata as metadata, mars; "
        "print(mars.__file__); print(mars.__version__); "
        "print(metadata.version('mars-optimizer')); print(metadata.requires('mars-optimizer')); "
        "from mars import MARS; print(MARS.__name__); "
        "import mars_triton; print(mars_triton.__file__); import mars_sharded; print(mars_sharded.__file__)"
    )
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"}
    imported = subprocess.run([sys.executable, "-c", probe], cwd=empty, env=env, capture_output=True, text=True)
    assert imported.returncode == 0, imported.stderr
    where, version, distribution_version, requires, name, kernel_where, sharded_where = imported.stdout.splitlines()
    assert where == str(site / "mars.py") and kernel_where == str(site / "mars_triton.py")
    assert sharded_where == str(site / "mars_sharded.py")
    assert version == distribution_version == mars.__version__
    assert requires == "['torch>=2.9']" and name == "MARS"


# Steps MARS three times per rule on the multi-tensor and single-tensor paths and saves the parameters (argv[1]);
# prints whether mars_triton can be imported and what MARS(fused=True) answers.
STEP_EACH_PATH = """
import importlib.util, sys
import torch
import mars

print(importlib.util.find_spec("mars_triton") is not None)
results = {}
for mars_type in mars.MARS_TYPES:
    for foreach in (None, False):
        generator = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(6, 4), (4,)]]
        results["start"] = [p.detach().clone() for p in params]
        optimizer = mars.MARS(params, lr=1e-2, mars_type=mars_type, weight_decay=0.1, foreach=foreach)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator)
            optimizer.step()
        results[(mars_type, foreach)] = [p.detach() for p in params]
torch.save(results, sys.argv[1])
try:
    mars.MARS(params, fused=True)
    print("constructed")
except ValueError as error:
    print(f"ValueError: {error}")
"""


@pytest.mark.slow
def test_mars_py_copied_alone_steps_every_default_path_and_refuses_fused_true_saying_what_is_missing(tmp_path):
    """mars.py in an empty directory, without mars_triton.py: it imports, and every rule steps on both default
    paths as in the repository, bit for bit (the same code and kernels on the same inputs, one thread each);
    fused=True fails at construction in one line naming the missing file and the way out."""
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy2(os.path.join(ROOT, "mars.py"), alone)
    runs = {}
    for where, path in (("alone", alone), ("repository", ROOT)):
        saved = tmp_path / f"{where}.pt"
        env = {**subprocess_env(), "PYTHONPATH": str(path)}
        run = subprocess.run(
            [sys.executable, "-c", STEP_EACH_PATH, str(saved)], cwd=path, env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        runs[where] = run.stdout.splitlines(), torch.load(saved)
    (kernel_found, fused), alone_params = runs["alone"]
    assert kernel_found == "False"
    assert fused == (
        "ValueError: fused=True needs mars_triton.py beside mars.py (pip install <this repository> installs both); "
        "without it, use fused=None (the default path)"
    )
    (kernel_found, _), repository_params = runs["repository"]
    assert kernel_found == "True"
    start = alone_params.pop("start")
    assert alone_params.keys() == repository_params.keys() - {"start"} and len(alone_params) == 2 * len(mars.MARS_TYPES)
    for key, params in alone_params.items():
        assert all(torch.equal(a, b) for a, b in zip(params, repository_params[key], strict=True)), key
        assert all(not torch.equal(a, b) for a, b in zip(params, start)), key  # it stepped


@pytest.mark.slow
def test_mars_copied_into_a_package_finds_its_kernel_beside_it(tmp_path):
    """mars.py and mars_triton.py copied into a package of the user's (myproject/optim/): fused=True finds the
    kernel module beside mars.py, not only on sys.path; with mars.py alone there it says the file is missing."""
    package = tmp_path / "myproject" / "optim"
    package.mkdir(parents=True)
    for folder in (package.parent, package):
        (folder / "__init__.py").write_text("")
    shutil.copy2(os.path.join(ROOT, "mars.py"), package)
    probe = (
        "import torch\n"
        "from myproject.optim.mars import MARS\n"
        "try:\n"
        "    MARS([torch.nn.Parameter(torch.zeros(2, 2))], fused=True)\n"
        "    print('constructed')\n"
        "except ValueError as error:\n"
        "    print(f'ValueError: {error}')\n"
    )
    env = {**subprocess_env(), "PYTHONPATH": str(tmp_path)}

    def answer():
        run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    assert answer().startswith("ValueError: fused=True needs mars_triton.py beside mars.py")
    shutil.copy2(os.path.join(ROOT, "mars_triton.py"), package)
    found = answer()  # the module found; it then checks Triton, as it does beside a top-level mars.py
    if importlib.util.find_spec("triton") is not None:
        assert found == "constructed"
    else:
        assert found.startswith("ValueError: fused=True runs MARS's step as a Triton kernel, and Triton cannot be")


# A DTensor parameter on a mesh of this one process (gloo): MARS-Shampoo over it, three steps, saved to argv[2];
# prints what MARS answers where mars.py's sibling mars_sharded.py is missing. argv[1]: how to import mars.
STEP_A_DTENSOR = """
import sys, tempfile
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

exec(f"from {sys.argv[1]} import MARS")
dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
weight = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
param = torch.nn.Parameter(distribute_tensor(weight, init_device_mesh("cpu", (1,)), [Shard(0)]))
try:
    optimizer = MARS([param], lr=1e-2, mars_type="mars-shampoo")
except ValueError as error:
    print(f"ValueError: {error}")
    sys.exit(0)
for _ in range(3):
    param.grad = distribute_tensor(torch.ones(6, 4), param.device_mesh, [Shard(0)])
    optimizer.step()
torch.save(param.to_local(), sys.argv[2])
print("stepped")
"""


@pytest.mark.slow
def test_a_dtensor_without_mars_sharded_beside_mars_py_is_refused_in_one_line_and_steps_with_it(tmp_path):
    """mars.py copied alone (top level, and into a package of the user's) refuses DTensor parameters at
    construction in one line naming the missing file; with mars_sharded.py copied beside it the same parameter,
    on a mesh of one (which still runs the owner exchange), steps as a plain tensor does (one process's step: the
    same rule, to float32 rounding)."""
    package = tmp_path / "myproject" / "optim"
    package.mkdir(parents=True)
    for folder in (package.parent, package):
        (folder / "__init__.py").write_text("")
    alone = tmp_path / "alone"
    alone.mkdir()
    places = {"mars": alone, "myproject.optim.mars": package}
    for where in places.values():
        shutil.copy2(os.path.join(ROOT, "mars.py"), where)

    def run(module, saved):
        env = {**subprocess_env(), "PYTHONPATH": f"{alone}{os.pathsep}{tmp_path}"}
        command = [sys.executable, "-c", STEP_A_DTENSOR, module, str(saved)]
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    for module in places:
        assert run(module, tmp_path / "none.pt") == (
            "ValueError: DTensor (FSDP2, HSDP) parameters need mars_sharded.py beside mars.py (pip install <this "
            "repository> installs both); copy it there, or step unsharded parameters"
        )
    weight = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    plain = torch.nn.Parameter(weight.clone())
    optimizer = mars.MARS([plain], lr=1e-2, mars_type="mars-shampoo")
    for _ in range(3):
        plain.grad = torch.ones(6, 4)
        optimizer.step()
    for module, where in places.items():
        shutil.copy2(os.path.join(ROOT, "mars_sharded.py"), where)
        saved = tmp_path / f"{module}.pt"
        assert run(module, saved) == "stepped"
        torch.testing.assert_close(torch.load(saved), plain.detach(), rtol=1e-5, atol=1e-6)
        assert not torch.equal(torch.load(saved), weight)
