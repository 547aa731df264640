"""Training-step throughput: train.py's loop against a loop built like the paper's reference train_mars.py.

    python -m bench.bench_train            # CPU rows (8 rounds of 10 steps), CUDA rows when a GPU is present
    python -m bench.bench_train --quick    # 2 rounds

CPU, a 3.2M-parameter character GPT (config/quickstart.py's settings at 4 layers, 256 wide, 8 x 256 tokens
a micro-batch, MARS) with 2 micro-batches a step, on a synthetic character corpus:
  * ours: train.step_and_log -- exactly what train.fit runs between evaluations, logging every 10 steps;
  * reference-style loop, same model: the structure of MARS/train_mars.py rewritten here -- the next step's
    micro-batches drawn with torch.randint into a deque, the loss backpropagated unscaled per micro-step,
    the clipped norm read with .item() every step, scaler.step, zero_grad, update_last_grad, and every
    10 steps the loss read plus its diagnostics: the parameter norm with one .item() per tensor and the
    momentum norms through optimizer.state_dict() called for every tensor;
  * the same loop with the reference model's explicit-softmax attention (bench_model.py's variant).
Ours and the reference alternate round by round; each reports its fastest round, the estimate least
disturbed by other processes on shared cores. Target: ours not slower (ratio >= 1).

CUDA (when present), GPT-2 small (124M) at 16 x 1024 tokens a step, bfloat16 autocast, torch.compile:
tokens/s and MFU with MARS and with AdamW, and the share of the step the optimizer takes.
"""

import contextlib
import math
import os
import tempfile
import time
from collections import deque

import numpy as np
import torch

import train
from bench.bench_model import with_explicit_attention
from bench.common import print_table, quick_flag, row, time_it
from marsgpt.config import load_config
from marsgpt.optimizers import scheduled_lr
from marsgpt.tokens import write_bin, write_meta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOG_INTERVAL = 10


def synthetic_data(root, vocab_size, num_tokens, char_level):
    """Random token ids in nanoGPT's layout (speed does not depend on the text)."""
    data_dir = os.path.join(root, "bench")
    os.makedirs(data_dir, exist_ok=True)
    ids = np.random.default_rng(0).integers(0, vocab_size, size=num_tokens, dtype=np.uint16)
    write_bin(os.path.join(data_dir, "train.bin"), ids)
    write_bin(os.path.join(data_dir, "val.bin"), ids[: num_tokens // 10])
    if char_level:
        write_meta(os.path.join(data_dir, "meta.pkl"), [chr(32 + i) for i in range(vocab_size)])
    return root


def build_run(argv):
    cfg = load_config(argv)
    dist_info = train.setup_distributed(cfg)
    run, progress, _ = train.setup(cfg, dist_info)
    return run, progress


def time_ours(run, progress, steps):
    """Seconds per step of train.step_and_log over `steps` steps; its console lines go to /dev/null."""
    window = train.LogWindow()
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        t0 = time.perf_counter()
        for _ in range(steps):
            train.step_and_log(run, progress, window, lambda: 0.0)
        return (time.perf_counter() - t0) / steps


class ReferenceStyleLoop:
    """MARS/train_mars.py's per-step structure around a model and optimizer (see the module docstring)."""

    def __init__(self, model, optimizer, cfg, data_path):
        self.model, self.optimizer, self.cfg = model, optimizer, cfg
        self.data = np.memmap(os.path.join(data_path, cfg.dataset, "train.bin"), dtype=np.uint16, mode="r")
        self.scaler = torch.amp.GradScaler("cpu", enabled=False)
        self.batches = deque(self.get_batch() for _ in range(cfg.gradient_accumulation_steps))
        self.iter_num, self.clip_time = 0, 0

    def get_batch(self):
        T = self.cfg.block_size
        ix = torch.randint(len(self.data) - T, (self.cfg.batch_size,))
        x = torch.stack([torch.from_numpy(self.data[i : i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(self.data[i + 1 : i + 1 + T].astype(np.int64)) for i in ix])
        return x, y

    def step(self):
        cfg, optimizer = self.cfg, self.optimizer
        lr = scheduled_lr(self.iter_num, cfg, cfg.learning_rate)
        for group in optimizer.param_groups:
            group["lr"] = lr
        current = [self.batches.popleft() for _ in range(cfg.gradient_accumulation_steps)]
        self.batches.extend(self.get_batch() for _ in range(cfg.gradient_accumulation_steps))
        for x, y in current:
            _, loss = self.model(x, y)
            self.scaler.scale(loss).backward()
        self.scaler.unscale_(optimizer)
        total_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if total_norm.item() > cfg.grad_clip:
            self.clip_time += 1
        self.scaler.step(optimizer)
        self.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        optimizer.update_last_grad()
        if self.iter_num % LOG_INTERVAL == 0:
            self.log(loss)
        self.iter_num += 1

    def log(self, loss):
        loss.item()
        param_norm = math.sqrt(sum(p.data.norm(2).item() ** 2 for p in self.model.parameters()))
        momentum_norm = momentum_norm_sq = 0
        for j in range(len(self.optimizer.state_dict()["state"])):
            momentum_norm += self.optimizer.state_dict()["state"][j]["exp_avg"].norm(2) ** 2
            momentum_norm_sq += self.optimizer.state_dict()["state"][j]["exp_avg_sq"].norm(2) ** 2
        return param_norm, torch.sqrt(momentum_norm).item(), torch.sqrt(momentum_norm_sq).item()

    def seconds_per_step(self, steps):
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - t0) / steps


def cpu_rows(quick, tmp):
    steps = LOG_INTERVAL  # one log line per round for both loops
    rounds = 2 if quick else 8
    data_path = synthetic_data(tmp, vocab_size=96, num_tokens=2_000_000, char_level=True)
    argv = [
        os.path.join(REPO, "config", "quickstart.py"),
        f"--data_path={data_path}",
        "--dataset=bench",
        "--n_layer=4",
        "--n_head=4",
        "--n_embd=256",
        "--block_size=256",
        "--batch_size=8",
        "--device=cpu",
        "--gradient_accumulation_steps=2",
        "--eval_iters=1",
        f"--log_interval={LOG_INTERVAL}",
        "--max_iters=100000",
        "--lr_decay_iters=100000",
    ]
    run, progress = build_run(argv + [f"--out_dir={os.path.join(tmp, 'ours')}"])
    tokens_per_step = run.tokens_per_step
    loops = {}
    for name, explicit in (("same model", False), ("explicit attention", True)):
        ref_run, _ = build_run(argv + [f"--out_dir={os.path.join(tmp, 'reference-' + str(explicit))}"])
        if explicit:
            with_explicit_attention(ref_run.model)
        loops[name] = ReferenceStyleLoop(ref_run.model, ref_run.optimizer.torch_optimizer, ref_run.cfg, data_path)
    ours, theirs = [], {name: [] for name in loops}
    time_ours(run, progress, LOG_INTERVAL)  # warm-up
    for loop in loops.values():
        loop.seconds_per_step(2)
    for _ in range(rounds):
        ours.append(time_ours(run, progress, steps))
        for name, loop in loops.items():
            theirs[name].append(loop.seconds_per_step(steps))
    note = (
        f"4x256 char GPT, {tokens_per_step} tokens/step, MARS, {torch.get_num_threads()} threads, "
        f"best of {rounds} rounds x {steps} steps"
    )
    return [
        row(
            f"train step tokens/s vs reference-style loop, {name} (CPU)",
            tokens_per_step / min(ours),
            tokens_per_step / min(times),
            unit="tokens/s",
            target="ratio >= 1",
            note=note,
        )
        for name, times in theirs.items()
    ]


def cuda_rows(quick, tmp):
    steps = 10 if quick else 30
    data_path = synthetic_data(tmp, vocab_size=50257, num_tokens=8_000_000, char_level=False)
    rows = []
    for optimizer_name, config in (("mars", "train_gpt2_small_mars.py"), ("adamw", "train_gpt2_small_adamw.py")):
        argv = [
            os.path.join(REPO, "config", config),
            f"--data_path={data_path}",
            "--dataset=bench",
            f"--out_dir={os.path.join(tmp, 'out-' + optimizer_name)}",
            "--batch_size=16",
            "--gradient_accumulation_steps=1",
            "--eval_iters=1",
            f"--log_interval={LOG_INTERVAL}",
            "--wandb_log=False",
            "--dtype=bfloat16",
            "--compile=True",
        ]
        run, progress = build_run(argv)
        time_ours(run, progress, 2 * LOG_INTERVAL)  # compile and warm up
        torch.cuda.synchronize()
        seconds = time_ours(run, progress, steps)
        torch.cuda.synchronize()
        mfu = run.model.estimate_mfu(run.tokens_per_step, seconds)
        train.forward_backward(run, 0)  # gradients for the optimizer to step on (step_and_log cleared them)
        optimizer_seconds = time_it(run.optimizer.step, warmup=2, repeats=10)
        note = f"GPT-2 small, {run.tokens_per_step} tokens/step, bf16, compiled, {torch.cuda.get_device_name()}"
        rows += [
            row(
                f"train step tokens/s, {optimizer_name} (CUDA)",
                run.tokens_per_step / seconds,
                unit="tokens/s",
                note=note,
            ),
            row(f"MFU, {optimizer_name} (CUDA)", None if mfu is None else mfu * 100, unit="%", note=note),
            row(
                f"optimizer share of the step, {optimizer_name} (CUDA)",
                100 * optimizer_seconds / seconds,
                unit="%",
                note=f"optimizer.step {optimizer_seconds * 1e3:.1f} ms of {seconds * 1e3:.1f} ms",
            ),
        ]
        del run
        torch.cuda.empty_cache()
    return rows


def run(quick=False):
    with tempfile.TemporaryDirectory() as tmp:
        rows = cpu_rows(quick, tmp)
        if torch.cuda.is_available():
            rows += cuda_rows(quick, tmp)
    return rows


if __name__ == "__main__":
    print_table(run(quick=quick_flag(__doc__)))
