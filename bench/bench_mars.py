"""MARS step time and optimizer-state memory on GPT-2 small's real parameter shapes (124M).

    python bench/bench_mars.py            # full: every measurement below
    python bench/bench_mars.py --quick    # fewer repeats

Rows: one MARS-AdamW step vs torch.optim.AdamW(foreach=True) in the same process (target <= 1.3x on
CPU); on CUDA also vs fused AdamW (target <= 1.5x) and whether the step syncs with the host
(torch.cuda.set_sync_debug_mode("error") must stay silent); then the step time and state bytes of
mars-adamw, mars-lion and mars-shampoo.
"""

import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import print_table, row, time_it  # noqa: E402
from mars import MARS  # noqa: E402


def gpt2_small_shapes(n_layer=12, n_embd=768, vocab_size=50304, block_size=1024):
    """nanoGPT's GPT-2 small with bias=False: nn.Linear weights are (out, in); lm_head is tied to wte."""
    shapes = [(vocab_size, n_embd), (block_size, n_embd)]
    for _ in range(n_layer):
        shapes += [
            (n_embd,),
            (3 * n_embd, n_embd),
            (n_embd, n_embd),  # ln_1, c_attn, c_proj
            (n_embd,),
            (4 * n_embd, n_embd),
            (n_embd, 4 * n_embd),
        ]  # ln_2, c_fc, c_proj
    return shapes + [(n_embd,)]  # ln_f


def make_params(device, dtype=torch.float32):
    """Parameters with fixed random gradients (std 0.01: a typical GPT-2 small gradient scale)."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for shape in gpt2_small_shapes():
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=device, dtype=dtype) * 0.02)
        p.grad = torch.randn(shape, generator=gen, device=device, dtype=dtype) * 0.01
        params.append(p)
    return params


def state_bytes(optimizer):
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


def _sync_free(optimizer):
    """True when a step runs under set_sync_debug_mode('error') without raising."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        optimizer.step()
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode(0)


def run(quick=False):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    warmup, repeats = (1, 3) if quick else (2, 8)
    params = make_params(device)
    n_params = sum(p.numel() for p in params)
    note = f"GPT-2 small shapes, {n_params / 1e6:.1f}M params, fp32, {device}"
    rows = []

    def step_time(optimizer):
        return time_it(optimizer.step, warmup=warmup, repeats=repeats)

    # The two optimizers share the parameters and their steps alternate, one at a time; the fastest of
    # each is reported, the estimate least disturbed by other processes on shared cores.
    mars = MARS(params, lr=6e-3, weight_decay=0.1)
    adamw = torch.optim.AdamW(params, lr=6e-3, weight_decay=0.1, foreach=True)
    t_mars, t_adamw = [], []
    for _ in range(warmup + repeats):
        t_mars.append(time_it(mars.step, warmup=0, repeats=1))
        t_adamw.append(time_it(adamw.step, warmup=0, repeats=1))
    t_mars, t_adamw = min(t_mars[warmup:]), min(t_adamw[warmup:])
    rows.append(
        row(
            "MARS-AdamW step vs AdamW(foreach=True)",
            t_mars * 1e3,
            t_adamw * 1e3,
            unit="ms",
            target="<= 1.3 (CPU)",
            note=note + ", fastest of " + str(repeats),
        )
    )
    del adamw
    if device == "cuda":
        fused = torch.optim.AdamW(params, lr=6e-3, weight_decay=0.1, fused=True)
        rows.append(
            row(
                "MARS-AdamW step vs AdamW(fused=True)",
                step_time(mars) * 1e3,
                step_time(fused) * 1e3,
                unit="ms",
                target="<= 1.5 (CUDA)",
                note=note,
            )
        )
        del fused
        for mars_type in ("mars-adamw", "mars-lion", "mars-shampoo"):
            opt = MARS(params, lr=6e-3, weight_decay=0.1, mars_type=mars_type)
            opt.step()  # the first step allocates state: time the steady state
            rows.append(
                row(
                    f"{mars_type} step without host sync",
                    int(_sync_free(opt)),
                    unit="bool",
                    target="1",
                    note="torch.cuda.set_sync_debug_mode('error')",
                )
            )
            del opt
    del mars
    gc.collect()

    for mars_type in ("mars-adamw", "mars-lion", "mars-shampoo"):
        opt = MARS(params, lr=6e-3, weight_decay=0.1, mars_type=mars_type)
        if mars_type == "mars-shampoo" and device == "cpu":
            # Five Newton-Schulz iterations on every matrix (the 50304x768 embedding alone is ~0.9
            # TFLOP) make one 124M step tens of seconds on 2 CPU cores, too long to repeat here.
            rows.append(
                row(
                    f"{mars_type} step",
                    None,
                    unit="ms",
                    note="not timed on CPU: ~2.9 TFLOP of Newton-Schulz a step; time it on CUDA",
                )
            )
            for group in opt.param_groups:
                for p in group["params"]:
                    opt._init_state(p, group)
        else:
            rows.append(row(f"{mars_type} step", step_time(opt) * 1e3, unit="ms", note=note))
        rows.append(
            row(
                f"{mars_type} state",
                state_bytes(opt) / 2**20,
                reference=n_params * 4 / 2**20,
                unit="MiB",
                note="reference = one fp32 copy of the parameters",
            )
        )
        del opt
        gc.collect()
    return rows


if __name__ == "__main__":
    print_table(run(quick="--quick" in sys.argv))
