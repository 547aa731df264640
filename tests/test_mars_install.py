"""The optimizer as a distribution of its own (pyproject.toml's [project], issue 29): `pip install <checkout>`
gives the single module mars, with its version, requiring torch and nothing of the trainer."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
from train_helpers import ROOT

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
    assert installed == ["mars.py", f"mars_optimizer-{mars.__version__}.dist-info"]

    probe = (
        "import importlib.metadata as metadata, mars; "
        "print(mars.__file__); print(mars.__version__); "
        "print(metadata.version('mars-optimizer')); print(metadata.requires('mars-optimizer')); "
        "from mars import MARS; print(MARS.__name__)"
    )
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"}
    imported = subprocess.run([sys.executable, "-c", probe], cwd=empty, env=env, capture_output=True, text=True)
    assert imported.returncode == 0, imported.stderr
    where, version, distribution_version, requires, name = imported.stdout.splitlines()
    assert where == str(site / "mars.py")
    assert version == distribution_version == mars.__version__
    assert requires == "['torch>=2.9']" and name == "MARS"
