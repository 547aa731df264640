"""The byte counts behind bench/bench_mars.py's bandwidth column and read floors."""

import torch

from bench.bench_mars import traffic


def test_traffic_counts_each_rule_s_passes_and_gives_1d_tensors_adamw_s():
    params = [torch.zeros(10, 10), torch.zeros(10)]  # 100 MARS elements, 10 AdamW elements, 4 bytes each

    assert traffic(params, "adamw") == (4 * (7 * 100 + 7 * 10), 4 * (4 * 100 + 4 * 10))
    assert traffic(params, "mars-adamw") == (4 * (11 * 100 + 7 * 10), 4 * (7 * 100 + 4 * 10))
    assert traffic(params, "mars-lion") == (4 * (9 * 100 + 7 * 10), 4 * (6 * 100 + 4 * 10))
    # A bfloat16 g_prev halves its 3 passes (2 of them reads): 11 -> 9.5 passes moved, 7 -> 6 read.
    moved, read = traffic(params, "mars-adamw", last_grad_bytes=2)
    assert (moved, read) == (100 * (8 * 4 + 3 * 2) + 10 * 7 * 4, 100 * (5 * 4 + 2 * 2) + 10 * 4 * 4)
