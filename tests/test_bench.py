"""The byte counts behind bench/bench_mars.py's bandwidth column and read floors, and its check of the kernel; every
benchmark's --help."""

import glob
import os
import subprocess
import sys

import pytest
import torch

import mars_triton
from bench import bench_mars
from bench.bench_mars import traffic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_traffic_counts_each_rule_s_passes_and_gives_1d_tensors_adamw_s():
    params = [torch.zeros(10, 10), torch.zeros(10)]  # 100 MARS elements, 10 AdamW elements, 4 bytes each

    assert traffic(params, "adamw") == (4 * (7 * 100 + 7 * 10), 4 * (4 * 100 + 4 * 10))
    assert traffic(params, "mars-adamw") == (4 * (11 * 100 + 7 * 10), 4 * (7 * 100 + 4 * 10))
    assert traffic(params, "mars-lion") == (4 * (9 * 100 + 7 * 10), 4 * (6 * 100 + 4 * 10))
    # A bfloat16 g_prev halves its 3 passes (2 of them reads): 11 -> 9.5 passes moved, 7 -> 6 read.
    moved, read = traffic(params, "mars-adamw", last_grad_bytes=2)
    assert (moved, read) == (100 * (8 * 4 + 3 * 2) + 10 * 7 * 4, 100 * (5 * 4 + 2 * 2) + 10 * 4 * 4)


@pytest.mark.slow
def test_the_kernel_check_is_rounding_for_the_kernel_and_large_for_a_wrong_rule(monkeypatch):
    """bench_mars's first rows on CUDA, here on CPU tensors in Triton's interpreter: each fused=True contender's
    parameters against the default path's, per unit of update, within the target; a kernel taking Lion's rule
    for MARS-AdamW's tensors is far outside it (the check can fail)."""
    pytest.importorskip("triton", reason="fused=True runs a Triton kernel: pip install -r requirements-test.txt")
    shapes, hyper = [(32, 16), (16,)], dict(lr=6e-3, weight_decay=0.1)
    rows = bench_mars.equality_rows("cpu", shapes, hyper)
    assert [r["benchmark"] for r in rows] == [bench_mars.equality_row_name(n) for n in bench_mars.kernel_settings()]
    assert all(0 <= r["ours"] <= 1e-4 and r["target"] == bench_mars.EQUALITY_TARGET for r in rows)
    monkeypatch.setitem(mars_triton._KERNEL_RULES, "adamw", mars_triton._KERNEL_RULES["lion"])
    assert bench_mars.equality_rows("cpu", shapes, hyper)[0]["ours"] > 0.1


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "bench", "bench_*.py")))
)
def test_every_benchmark_s_help_prints_its_usage_and_runs_nothing(name):
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: "), done.stdout + done.stderr
    assert "|" not in done.stdout  # no table: nothing was measured
