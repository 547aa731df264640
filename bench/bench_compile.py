"""Compile seconds of a 12-layer GPT: train.py's per-block compile (model.GPT.compile_blocks: one block graph every
layer runs, the loss's chunk compiled on its own) against torch.compile of the whole model (train.py's path until
2026-12-04, and the paper's trainer's), with inductor's cache cold and then warm.

    python -m bench.bench_compile            # 12 layers of width 64, 4 x 64 tokens
    python -m bench.bench_compile --quick    # width 32, 2 x 32 tokens (compile time barely depends on width)

Each measurement is a process of its own (dynamo's in-memory caches start empty): the first training step
(forward and backward: each compiles its graphs) and then the first evaluation under torch.no_grad (its graphs
compile anew). Cold: a new, empty TORCHINDUCTOR_CACHE_DIR; warm: a second process with the same directory, as a
relaunched job finds it (docs/training.md, "Compiling"). The loss takes as many chunks as GPT-2 small's 30 x 1024
micro-batch does (47; compiled per block, 12), so the whole model's graph unrolls as many. On a CPU this is a
proxy: inductor builds C++ kernels there, Triton kernels on a GPU, where gpu_check's small_mars rows measure the
paper config itself. Target: per block no slower (ratio <= 1).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.common import print_table, row

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS, VOCABULARY = 12, 512
SHAPES = {  # by quick
    False: dict(n_embd=64, n_head=4, block_size=64, batch_size=4),
    True: dict(n_embd=32, n_head=2, block_size=32, batch_size=2),
}
GPT2_SMALL_CHUNKS = 47  # the chunks of a 30 x 1024 micro-batch at model.LOSS_CHUNK_SCORES (50,304-way scores)
MODES = ("blocks", "whole")


def measure(mode, quick):
    """(first step s, first evaluation s, graphs compiled) in this process: mode 'blocks' or 'whole'."""
    import torch
    from torch._dynamo.utils import counters

    import model as model_module
    from model import GPT, GPTConfig

    shape = SHAPES[quick]
    tokens = shape["batch_size"] * shape["block_size"]
    model_module.LOSS_CHUNK_SCORES = -(-tokens // GPT2_SMALL_CHUNKS) * VOCABULARY
    model_module.COMPILED_LOSS_CHUNK_SCORES = 4 * model_module.LOSS_CHUNK_SCORES
    torch.manual_seed(0)
    config = GPTConfig(
        n_layer=LAYERS,
        n_head=shape["n_head"],
        n_embd=shape["n_embd"],
        block_size=shape["block_size"],
        vocab_size=VOCABULARY,
        scale_attn_by_inverse_layer_idx=True,
    )
    model = GPT(config)
    x = torch.randint(0, VOCABULARY, (shape["batch_size"], shape["block_size"]))
    t0 = time.perf_counter()
    if mode == "blocks":
        model.compile_blocks()
        compiled = model
    else:
        compiled = torch.compile(model)
    compiled(x, torch.roll(x, -1, 1), return_logits=False)[1].backward()
    step_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        compiled.eval()
        compiled(x, torch.roll(x, -1, 1), return_logits=False)
    return step_s, time.perf_counter() - t0, counters["stats"]["unique_graphs"]


def in_a_process(mode, quick, cache_dir):
    argv = [sys.executable, "-m", "bench.bench_compile", "--measure", mode, *(["--quick"] if quick else [])]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick=False):
    results = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory(prefix="bench_compile_") as cache_dir:
            results[mode] = [in_a_process(mode, quick, cache_dir) for _ in ("cold", "warm")]
    shape = SHAPES[quick]
    size = f"{LAYERS} layers x {shape['n_embd']}, {shape['batch_size']}x{shape['block_size']} tokens"
    graphs = f"graphs: per block {results['blocks'][0]['graphs']}, whole {results['whole'][0]['graphs']}"
    rows = []
    for i, cache in enumerate(("cold", "warm")):
        for key, what in (("step_s", "first training step"), ("eval_s", "first evaluation")):
            ours, reference = results["blocks"][i][key], results["whole"][i][key]
            rows.append(
                row(
                    f"{what} (compiles), {cache} cache: per block vs whole model, {size}",
                    ours,
                    reference,
                    unit="s",
                    target="<= 1",
                    note=graphs,
                )
            )
    return rows


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="width 32, 2 x 32 tokens")
    p.add_argument("--measure", choices=MODES, help=argparse.SUPPRESS)  # one measurement, in_a_process's
    args = p.parse_args(argv)
    if args.measure:
        step_s, eval_s, graphs = measure(args.measure, args.quick)
        print(json.dumps(dict(step_s=step_s, eval_s=eval_s, graphs=graphs)))
        return 0
    print_table(run(quick=args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
