"""MARS step time, memory traffic and optimizer-state memory on GPT-2 small's real parameter shapes.

    python -m bench.bench_mars            # full: more repeats
    python -m bench.bench_mars --quick    # fewer repeats

Shapes: on CPU the embeddings and 4 of GPT-2 small's 12 blocks (67.7M parameters, as issue 13 measured
there); on CUDA all 12 blocks (124M). Every optimizer steps over the same parameters and gradients, one
step each per round, in one process. Each row has the median of its steps and the median of its
per-round ratios to torch.optim.AdamW(fused=True), the fastest AdamW torch offers (issue 13's targets:
MARS-AdamW <= 1.7x, MARS-Lion <= 1.4x, from about 11 and 9 tensor passes against fused AdamW's 7).

The bandwidth column: the bytes a step must move (each tensor the rule reads or writes, once) over its
time, and that as a fraction of a plain copy's bandwidth, timed in the same rounds (copy row: 2 x the
parameter bytes, read and written; in-place updates can beat it, since a copy also reads its
destination). Then the bytes it must read over its time, as a fraction of a plain read's (the sum row:
torch.sum over the parameter bytes). On a CPU where writes overlap with reads, a step that reads at a plain
read's rate is at its memory limit, and its floor against fused AdamW is the ratio of the bytes they read:
MARS-AdamW reads 7 tensor passes (g, g_prev for the norm; g, g_prev, m, v, p), AdamW 4 (1.75x); MARS-Lion 6
(1.5x). MARS-Shampoo is bound by Newton-Schulz's matmuls instead: its row compares the step with
those FLOPs at this machine's measured matmul rate (on CPU over one block's four matrices: the whole
model is ~2.9 TFLOP, minutes on 2 cores). On CUDA the rows also say whether each path steps without a
host sync (torch.cuda.set_sync_debug_mode("error") stays silent).

fused=True, MARS's Triton kernel, runs on CUDA only (the tests run it on CPU tensors in Triton's interpreter). On
CUDA the bench first checks it against the default path on these parameters (its parameters after a few steps,
their difference per unit of update), then times it beside the default path, with issue 35's target (<= 1.2x
fused AdamW), its first step (Triton compiles) and its host time per step on tiny tensors (the calls alone).
On a CPU only that host time is measured, apart from the two launches (the table the kernel reads).
"""

import contextlib
import functools
import gc
import statistics
import sys
import time

import torch

import mars_triton
from bench.common import print_table, quick_flag, row, time_it
from mars import MARS


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


def make_params(device, shapes, dtype=torch.float32):
    """Parameters with fixed random gradients (std 0.01: a typical GPT-2 small gradient scale)."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=device, dtype=dtype) * 0.02)
        p.grad = torch.randn(shape, generator=gen, device=device, dtype=dtype) * 0.01
        params.append(p)
    return params


def state_bytes(optimizer):
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


def bytes_moved(params, passes_2d, last_grad_passes, last_grad_bytes, passes_1d):
    """Bytes a step must touch: `passes_2d` parameter-sized passes over each 2-D (MARS) tensor, of which
    `last_grad_passes` touch the stored gradient (last_grad_bytes per element); `passes_1d` on the rest."""
    total = 0
    for p in params:
        if p.ndim == 2:
            other = passes_2d - last_grad_passes
            total += p.numel() * (other * p.element_size() + last_grad_passes * last_grad_bytes)
        else:
            total += p.numel() * passes_1d * p.element_size()
    return total


# Passes over a 2-D tensor, (reads + writes, of them on g_prev) and (reads, of them on g_prev): AdamW reads
# p, g, m, v and writes p, m, v. MARS reads g and g_prev for c's norm, then g, g_prev, m, (v,) p, and writes
# m, (v,) p and g_prev.
PASSES = {"adamw": (7, 0), "mars-adamw": (11, 3), "mars-lion": (9, 3)}
READS = {"adamw": (4, 0), "mars-adamw": (7, 2), "mars-lion": (6, 2)}


def traffic(params, rule, last_grad_bytes=4):
    """(bytes moved, bytes read) by one step of `rule` over params (1-D tensors take AdamW)."""
    moved = bytes_moved(params, *PASSES[rule], last_grad_bytes, passes_1d=PASSES["adamw"][0])
    read = bytes_moved(params, *READS[rule], last_grad_bytes, passes_1d=READS["adamw"][0])
    return moved, read


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


def _matmul_flops_per_s(device, dtype, n_embd=768):
    """The machine's matmul rate on Newton-Schulz's shapes (a 768x768 Gram matrix times a 768x3072 X)."""
    gen = torch.Generator(device=device).manual_seed(0)
    A = torch.randn(n_embd, n_embd, generator=gen, device=device).to(dtype)
    X = torch.randn(n_embd, 4 * n_embd, generator=gen, device=device).to(dtype)
    return 2 * n_embd * n_embd * 4 * n_embd / time_it(lambda: A @ X, warmup=2, repeats=7)


def newton_schulz_flops(shapes, steps=5):
    """Per iteration X Xᵀ, A X and A B, each 2·s²·L for an s x L matrix (s the smaller side)."""
    return sum(steps * 3 * 2 * min(s) ** 2 * max(s) for s in shapes if len(s) == 2)


BASELINE = "AdamW(fused=True)"
# The MARS rules timed on both paths, the default (foreach) and fused=True (the Triton kernel, CUDA only), with
# issue 35's target for the kernel's step against the baseline.
RULES = (("mars-adamw", "MARS-AdamW", "<= 1.2"), ("mars-lion", "MARS-Lion", "<= 1.2"))
# The kernel's contenders beyond RULES' fused=True ones, with their settings.
KERNEL_VARIANTS = {"MARS-AdamW (fused=True, bfloat16 last_grad)": dict(last_grad_dtype=torch.bfloat16)}
# How far from the default path's the kernel's parameters may end up, per unit of update: both round in float32
# in their own order (about 1e-6 of an update apart on the CPU, in Triton's interpreter); a wrong rule is ~1 apart.
EQUALITY_TARGET = "<= 1e-4"


def path_name(label, fused):
    return f"{label} ({'fused=True' if fused else 'foreach'})"


def step_row_name(name):
    return f"{name} step vs {BASELINE}"


def sync_row_name(name):
    return f"{name} step without host sync"


def compile_row_name(name):
    return f"{name} first step (compiles)"


def equality_row_name(name):
    return f"{name} against the default path: difference per unit of update"


OVERHEAD_ROW = "MARS-AdamW (fused=True) host time per step at width 8 (the calls alone)"
TABLE_ROW = "MARS-AdamW (fused=True) host time per step at width 8, its two launches left out (the table)"
SHAMPOO_ROW = "mars-shampoo step vs its Newton-Schulz FLOPs at the matmul rate"


def kernel_settings():
    """name -> MARS settings of every fused=True contender."""
    settings = {path_name(label, True): dict(mars_type=mars_type) for mars_type, label, _ in RULES}
    return settings | KERNEL_VARIANTS


def make_contenders(params, hyper, kernel=True):
    """name -> (optimizer, (bytes its step must move, bytes it must read), target ratio to the baseline);
    kernel: with the fused=True contenders (CUDA)."""
    adamw = traffic(params, "adamw")
    contenders = {
        BASELINE: (torch.optim.AdamW(params, fused=True, **hyper), adamw, ""),
        "AdamW(foreach=True)": (torch.optim.AdamW(params, foreach=True, **hyper), adamw, ""),
    }
    for mars_type, label, _ in RULES:
        optimizer = MARS(params, mars_type=mars_type, **hyper)
        contenders[path_name(label, False)] = (optimizer, traffic(params, mars_type), "")
    targets = {path_name(label, True): target for _, label, target in RULES}
    for name, settings in kernel_settings().items() if kernel else ():
        last_grad_bytes = 2 if settings.get("last_grad_dtype") == torch.bfloat16 else 4
        moved = traffic(params, settings.get("mars_type", "mars-adamw"), last_grad_bytes)
        contenders[name] = (MARS(params, fused=True, **settings, **hyper), moved, targets.get(name, ""))
    return contenders


def fused(optimizer):
    return isinstance(optimizer, MARS) and optimizer.defaults["fused"]


def equality_rows(device, shapes, hyper, steps=3):
    """Each fused=True contender against the default path, from the same parameters and the same gradients
    (new ones each step, so the correction is at work): Σ|fused - default| / Σ|default - start| after `steps`."""
    rows = []
    for name, settings in kernel_settings().items():
        start = make_params(device, shapes)
        ends = []
        for on_kernel in (False, True):
            params = [torch.nn.Parameter(p.detach().clone()) for p in start]
            optimizer = MARS(params, fused=on_kernel, **settings, **hyper)
            gen = torch.Generator(device=device).manual_seed(1)
            for _ in range(steps):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen, device=device) * 0.01
                optimizer.step()
            ends.append(params)
            del optimizer
        default, kernel = ends
        difference = sum((a - b).double().abs().sum() for a, b in zip(kernel, default))
        update = sum((b - s).double().abs().sum() for b, s in zip(default, start))
        note = f"{steps} steps from the same parameters and gradients; {len(start)} tensors"
        rows.append(
            row(equality_row_name(name), (difference / update).item(), unit="rel", target=EQUALITY_TARGET, note=note)
        )
        del start, ends, default, kernel
        gc.collect()
    return rows


def sync_rows(contenders):
    """CUDA only: 1 for each MARS contender whose step raises nothing under set_sync_debug_mode('error')."""
    rows = []
    for name, (opt, _, _) in contenders.items():
        if isinstance(opt, MARS):
            rows.append(row(sync_row_name(name), int(_sync_free(opt)), unit="bool", target="1"))
    return rows


def run(quick=False, n_embd=768):
    """The table. n_embd: GPT-2 small's 768, or a smaller width for a quick test of the whole bench."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n_layer = 12 if device == "cuda" else 4
    warmup, repeats = (2, 7) if quick else (2, 15)
    params = make_params(device, gpt2_small_shapes(n_layer=n_layer, n_embd=n_embd))
    n_params = sum(p.numel() for p in params)
    param_bytes = n_params * 4
    note = f"GPT-2 small, {n_layer} blocks: {n_params / 1e6:.1f}M params, fp32, {device}, {repeats} rounds"
    hyper = dict(lr=6e-3, weight_decay=0.1)
    shapes = [tuple(p.shape) for p in params]
    rows = equality_rows(device, shapes, hyper) if device == "cuda" else []  # first: is the kernel right here
    contenders = make_contenders(params, hyper, kernel=device == "cuda")
    adamw = contenders[BASELINE][1]

    # A plain copy and a plain read of the parameter bytes, timed in the same rounds: the bandwidth references.
    source = torch.empty(n_params, device=device).normal_()
    copy = functools.partial(torch.empty_like(source).copy_, source)
    steps = {"copy": copy, "sum": source.sum} | {name: opt.step for name, (opt, _, _) in contenders.items()}
    times, first = {name: [] for name in steps}, {}
    for i in range(warmup + repeats):  # the first rounds allocate state and compile
        for name, step in steps.items():
            seconds = time_it(step, warmup=0, repeats=1)
            if i >= warmup:
                times[name].append(seconds)
            elif i == 0:
                first[name] = seconds
    copy_bandwidth = 2 * param_bytes / statistics.median(times["copy"])
    read_bandwidth = param_bytes / statistics.median(times["sum"])
    rows += [
        row(
            "copy of the parameter bytes (bandwidth reference)",
            copy_bandwidth / 1e9,
            unit="GB/s",
            note=f"{2 * param_bytes / 1e9:.2f} GB read + written, median of {repeats}",
        ),
        row(
            "read of the parameter bytes (torch.sum, read reference)",
            read_bandwidth / 1e9,
            unit="GB/s",
            note=f"{param_bytes / 1e9:.2f} GB read, median of {repeats}",
        ),
    ]
    base = times[BASELINE]
    for name, (_, (moved, read), target) in contenders.items():
        t = statistics.median(times[name])
        bandwidth, reads = moved / t, read / t
        floor = read / adamw[1]  # where reads bound both steps
        # Each round's ratio compares two steps taken moments apart: robust to load that comes and goes.
        ratio = statistics.median(a / b for a, b in zip(times[name], base))
        rows.append(
            row(
                step_row_name(name),
                t * 1e3,
                statistics.median(base) * 1e3,
                unit="ms",
                ratio=ratio,
                target=target,
                note=f"{note}; ratio: median of the rounds' ratios; read floor {floor:.2f}",
                bandwidth=(
                    f"{bandwidth / 1e9:.0f} GB/s = {bandwidth / copy_bandwidth:.2f} copy; "
                    f"reads {reads / 1e9:.0f} GB/s = {reads / read_bandwidth:.2f} sum"
                ),
            )
        )

    for name, (opt, _, _) in contenders.items():
        if fused(opt):
            what = "the first round's step: state allocation, and Triton compiling the kernel's variant"
            rows.append(row(compile_row_name(name), first[name], unit="s", note=what))
    if device == "cuda":
        rows += sync_rows(contenders)
    del contenders, steps, times, source, copy
    gc.collect()

    rows += call_overhead_rows(device, quick)
    rows += _shampoo_rows(device, params, n_layer, n_embd, hyper, quick)
    rows += _mars_m_rows(device, n_layer, n_embd, hyper, quick)

    state_kinds = [("mars-adamw", None), ("mars-lion", None), ("mars-shampoo", None), ("mars-m", None)]
    state_kinds.append(("mars-adamw", torch.bfloat16))
    for mars_type, last_grad_dtype in state_kinds:
        # One step on the meta device allocates the state a real step does, without the arithmetic.
        meta = [torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in params]
        for p in meta:
            p.grad = torch.empty_like(p)
        opt = MARS(meta, mars_type=mars_type, last_grad_dtype=last_grad_dtype, **hyper)
        opt.step()
        suffix = ", last_grad_dtype=bfloat16" if last_grad_dtype else ""
        rows.append(
            row(
                f"{mars_type}{suffix} state",
                state_bytes(opt) / 2**20,
                reference=param_bytes / 2**20,
                unit="MiB",
                note="reference = one fp32 copy of the parameters",
            )
        )
        del opt
        gc.collect()
    return rows


def host_time(step, steps):
    """Median over 5 rounds of the calling thread's CPU seconds per step, `steps` steps a round, the device
    synchronized only between rounds: the host's cost of issuing a step, whatever else runs on the machine."""
    rounds = []
    for _ in range(6):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.thread_time()
        for _ in range(steps):
            step()
        rounds.append((time.thread_time() - t0) / steps)
    return statistics.median(rounds[1:])  # the first round warms up (and compiles)


def call_overhead_rows(device, quick=True):
    """The host's cost of a step: GPT-2 small's 75 tensors at width 8, where the arithmetic is negligible, so
    what is left is issuing the work. On CUDA, fused=True's whole step (its table and two launches) against
    AdamW(fused=True)'s; a step whose host time exceeds its GPU time is launch-bound. On a CPU the kernel does not
    run: the step with its two launches left out, what mars.py and mars_triton.py add to Triton's own cost of a
    launch (not measured here). Both against the default path's too, in the note."""
    shapes = gpt2_small_shapes(n_embd=8, vocab_size=8, block_size=8)
    steps = 10 if quick else 40
    cpu = device != "cuda"
    try:
        optimizer = MARS(make_params(device, shapes), fused=True, lr=6e-3, weight_decay=0.1)
    except ValueError as error:  # no Triton here: the row says so and is not measured
        return [row(TABLE_ROW if cpu else OVERHEAD_ROW, None, unit="us", note=str(error))]
    with _launches_left_out() if cpu else contextlib.nullcontext():
        kernel = host_time(optimizer.step, steps)
    default = host_time(MARS(make_params(device, shapes), lr=6e-3, weight_decay=0.1).step, steps)
    adamw = host_time(torch.optim.AdamW(make_params(device, shapes), fused=True, lr=6e-3, weight_decay=0.1).step, steps)
    note = f"thread CPU time per step over GPT-2 small's {len(shapes)} tensors, 8 wide; reference: "
    note += f"AdamW(fused=True)'s; the default (foreach) path: {default * 1e6:.0f} us"
    return [row(TABLE_ROW if cpu else OVERHEAD_ROW, kernel * 1e6, adamw * 1e6, unit="us", note=note)]


@contextlib.contextmanager
def _launches_left_out():
    """fused=True on a CPU with the kernels' launches doing nothing (in Triton's interpreter they would time
    numpy): what is timed is the rest of the step."""

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **constants: None

    kernels, interpreted = mars_triton._kernels, mars_triton._kernels_interpreted
    mars_triton._kernels, mars_triton._kernels_interpreted = (lambda: (NoLaunch(), NoLaunch())), (lambda: True)
    try:
        yield
    finally:
        mars_triton._kernels, mars_triton._kernels_interpreted = kernels, interpreted


def _shampoo_rows(device, params, n_layer, n_embd, hyper, quick):
    """MARS-Shampoo's step against its Newton-Schulz FLOPs at this machine's matmul rate."""
    if device == "cuda":
        shampoo_params, what = params, f"GPT-2 small, {n_layer} blocks"
    else:
        block_matrices = [s for s in gpt2_small_shapes(n_layer=1, n_embd=n_embd)[2:] if len(s) == 2]
        shampoo_params, what = make_params(device, block_matrices), "one GPT-2 small block's 4 matrices"
    ns_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    flops = newton_schulz_flops([tuple(p.shape) for p in shampoo_params])
    bound = flops / _matmul_flops_per_s(device, ns_dtype, n_embd)
    opt = MARS(shampoo_params, mars_type="mars-shampoo", **hyper)
    step_time = time_it(opt.step, warmup=1, repeats=2 if quick else 5)
    return [
        row(
            SHAMPOO_ROW,
            step_time * 1e3,
            bound * 1e3,
            unit="ms",
            target="<= 4 (issue: 15 ms vs 3.7 ms on H200)",
            note=f"{what}, {flops / 1e12:.2f} TFLOP in {str(ns_dtype).removeprefix('torch.')}, batched per shape",
        )
    ]


def _mars_m_rows(device, n_layer, n_embd, hyper, quick):
    """MARS-M's step on the blocks' matrices against fused AdamW's and (on CUDA) Muon's on the same matrices:
    torch.optim.Muon at Moonlight's update scale, the MARS-M paper's baseline. MARS-M is Muon's work plus the
    pass over c_t. Not Muon on CPU: its Newton-Schulz runs in bfloat16 there too, which this repository's CPU
    computes at about 0.4 GFLOP/s (63 s for one 3072x768 matrix, where MARS-M's float32 step took 4.4 s)."""
    blocks = n_layer if device == "cuda" else 1
    shapes = [s for s in gpt2_small_shapes(n_layer=blocks, n_embd=n_embd)[2:] if len(s) == 2]
    what = f"{blocks} blocks' matrices" if blocks > 1 else "one block's 4 matrices"
    what = f"GPT-2 small's {what}" if n_embd == 768 else f"{what}, {n_embd} wide"
    matrices = make_params(device, shapes)
    steps = {
        "mars-m": MARS(matrices, mars_type="mars-m", **hyper).step,
        "AdamW(fused=True)": torch.optim.AdamW(matrices, fused=True, **hyper).step,
    }
    if device == "cuda":
        steps["Muon(match_rms_adamw)"] = torch.optim.Muon(matrices, adjust_lr_fn="match_rms_adamw", **hyper).step
    times = {name: time_it(step, warmup=1, repeats=2 if quick else 5) for name, step in steps.items()}
    note = f"{what}; Newton-Schulz in {'bfloat16' if device == 'cuda' else 'float32'}"
    return [
        row(f"mars-m step vs {name}", times["mars-m"] * 1e3, times[name] * 1e3, unit="ms", note=note)
        for name in steps
        if name != "mars-m"
    ]


if __name__ == "__main__":
    t0 = time.perf_counter()
    print_table(run(quick=quick_flag(__doc__)))
    print(f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
