"""The one run to make when a GPU is lent: every launch path, GPT-2 small on the path a paper run takes
(compiled, DDP: its compile cold and warm, graph breaks and recompiles, throughput, MFU, memory against the
plan, attention kernel) with MARS and --deterministic=True, the MARS CUDA step, FSDP2, a kill -9 and resume,
peak memory against the plan, sampling and HellaSwag, and the quickstart, printed as one table.

    bash scripts/gpu_first10.sh                       # the checks that decide the most (< 8 min on one H200)
    bash scripts/gpu_check.sh                         # every check on this node's GPUs (< 14 min on one H200)
    bash scripts/gpu_check.sh --only resume sample    # some checks (and the checks they need)
    bash scripts/gpu_check.sh --device=cpu            # the plumbing on tiny models, no GPU; numbers mean nothing

No network: the token data are uniform random GPT-2 ids and the HellaSwag file a few made-up examples,
both written into a temporary folder with the runs. A warm-up loads every module and wakes every GPU
first, so the device read and the checks after it start warm. Every check after the data runs in
processes of its own under a time budget (Check.budget_s, TOTAL_BUDGET_S in all); one that fails or runs
out of time is a failed row that still says what it measured, and the others still run. Every pass or fail
of a train.py run is read from its metrics.jsonl, of a measurement from its worker's JSON. Writes
<out>/gpu_check.md (the table), <out>/gpu_check.json (the table and every number behind it) and
<out>/logs/<check>.log (each command's full output); both files are rewritten after every check and say
"in progress" until the last one. Exit status: 0 when no row failed, 1 when one did, 2 for bad arguments or
no GPU. docs/gpu.md says what each check runs and records the results.
"""

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from bench import bench_mars
from marsgpt import compile_cache, metrics
from marsgpt.checkpoint import CKPT_NAME, CheckpointError
from marsgpt.files import atomic_writer, copy_file
from marsgpt.shards import SHARDS_KEY, load_checkpoint, read_whole
from marsgpt.tokens import write_bin
from model import GPT2_VOCAB_SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = ["-m", "scripts.gpu_check_worker"]  # run from ROOT, as every command here
PASS, FAIL, SKIP = "pass", "fail", "skip"
DATASET = "synthetic"  # <work>/data/synthetic: train.bin and val.bin
TRAIN_TOKENS, VAL_TOKENS = 2_000_000, 200_000
HELLASWAG_EXAMPLES = 8
# --device=cpu shrinks every run to this, not compiled, one micro-batch a step, so the plumbing runs on a CPU.
TINY = dict(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=2, compile=False)
TINY |= dict(gradient_accumulation_steps=1, eval_iters=1)
# Every train.py command gets these (docs/gpu.md says so once); the table's commands leave them out.
COMMON_KEYS = ("data_path", "dataset", "out_dir", "wandb_log")
# --device=cpu: budgets x this. A shared CI CPU starts processes and compiles far slower than a GPU node.
CPU_BUDGET_FACTOR = 3

# Kill and resume: dropout on, so the per-step dropout seeds (CUDA generator) are covered too. The run is
# killed as soon as it logs step 14, normally after the checkpoint at 8 is on disk (the row says which one
# it resumed from), with 26 steps to go: it cannot finish in the moment the kill takes. Evaluations of 10
# windows, not the quickstart's 100: each of the three runs evaluates 6 times.
RESUME_RUN = dict(max_iters=40, eval_interval=8, log_interval=1, dropout=0.1, deterministic=True, eval_iters=10)
RESUME_KILL_AT = "iter 14:"
# --deterministic=True makes every CUDA kernel reproducible, so the resumed losses must be the same floats.
RESUME_TOLERANCE = 0.0
LOSS_KEYS = (metrics.TRAIN_LOSS, metrics.VAL_LOSS, metrics.EVAL_TRAIN_LOSS)
# Measured peak memory against the memory plan, either way (issue 35's goal for the compiled run; GPT-2 XL's
# uncompiled peak was within 1% on an H200).
PLAN_TOLERANCE = 0.05
GIB = 2**30


class UsageError(Exception):
    """Bad command-line input: main prints it as one `error:` line and exits 2."""


# ---------------------------------------------------------------------------------------------------
# Rows and the report.


@dataclasses.dataclass
class Row:
    what: str
    command: str
    result: str
    status: str  # PASS, FAIL or SKIP
    details: dict = dataclasses.field(default_factory=dict)  # the numbers behind the result, for the JSON
    check: str = ""
    seconds: float = 0.0


def exit_status(rows):
    return 1 if any(row.status == FAIL for row in rows) else 0


def _cell(text):
    return str(text).replace("\n", " ").replace("|", "\\|")


def render_markdown(header, rows, title="GPU check"):
    """The report: a title, a few header lines, then one table of what, command, result, pass/fail and seconds."""
    lines = [f"# {title}", ""]
    lines += [f"- {key}: {value}" for key, value in header.items()]
    lines += ["", "| what | command | result | pass | seconds |", "|---|---|---|---|---|"]
    for row in rows:
        cells = (row.what, f"`{row.command}`" if row.command else "", row.result, row.status, f"{row.seconds:.0f}")
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def summary(rows, checks_run, checks_total, seconds):
    counts = {status: sum(row.status == status for row in rows) for status in (PASS, FAIL, SKIP)}
    state = "complete" if checks_run == checks_total else f"in progress, {checks_run} of {checks_total} checks run"
    return f"{state}: {counts[PASS]} pass, {counts[FAIL]} fail, {counts[SKIP]} skipped, {seconds:.0f} s"


def write_report(out, header, rows, checks_run, checks_total, seconds, title="GPU check"):
    """<out>/gpu_check.md and <out>/gpu_check.json, each replaced whole (never half-written)."""
    header = dict(header, status=summary(rows, checks_run, checks_total, seconds))
    with atomic_writer(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(render_markdown(header, rows, title))
    report = dict(
        header,
        complete=checks_run == checks_total,
        checks_run=checks_run,
        checks_total=checks_total,
        rows=[dataclasses.asdict(row) for row in rows],
    )
    with atomic_writer(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    return header


# ---------------------------------------------------------------------------------------------------
# Running commands.


@dataclasses.dataclass
class Finished:
    """How a command ended: exit status (negative: the signal that killed it), output, and whether it was
    killed for running past its budget (timed_out) or on purpose at a line (stopped)."""

    returncode: int
    output: str
    timed_out: bool = False
    stopped: bool = False

    @property
    def ok(self):
        return self.returncode == 0 and not self.timed_out


def kill_group(proc):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_command(argv, log_path, timeout_s, stop_at=None, env=None):
    """Run argv in the repository root, its output (stdout and stderr) appended to log_path and returned;
    env: variables added to this process's environment.

    The command gets a process group of its own: after timeout_s, or as soon as a line starts with
    stop_at, the whole group (torchrun's ranks too) is killed with SIGKILL.
    """
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(argv)}\n")
        log.flush()
        pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        environment = {**os.environ, **(env or {})}
        proc = subprocess.Popen(argv, cwd=ROOT, start_new_session=True, env=environment, **pipe)
        timed_out = threading.Event()

        def on_timeout():
            timed_out.set()
            kill_group(proc)

        timer = threading.Timer(max(timeout_s, 0.0), on_timeout)
        timer.start()
        lines, stopped = [], False
        try:
            for line in proc.stdout:
                log.write(line)
                lines.append(line)
                if stop_at is not None and not stopped and line.startswith(stop_at):
                    kill_group(proc)
                    stopped = True
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:  # interrupted (Ctrl-C): leave nothing running
                kill_group(proc)
                proc.wait()
    return Finished(proc.returncode, "".join(lines), timed_out.is_set(), stopped)


def last_error_line(output):
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:") or "Error" in line]
    line = (errors or lines or ["no output"])[-1]
    return line if len(line) <= 200 else line[:197] + "..."


def failure(finished, budget_s, records=None):
    """Why a command failed, in one line; for a train.py run (its metrics.jsonl records), how far it got."""
    if finished.timed_out:
        text = f"timed out: still running at the end of its {budget_s} s budget"
    elif finished.returncode < 0:
        text = f"killed by {signal.Signals(-finished.returncode).name}: {last_error_line(finished.output)}"
    else:
        text = f"exit {finished.returncode}: {last_error_line(finished.output)}"
    return text if records is None else f"{text}; {progress(records)}"


def progress(records):
    """What a run's metrics.jsonl records say it measured: how far it got, its last speed."""
    if not records:
        return "metrics.jsonl has no record yet"
    parts = [f"metrics.jsonl to iter {records[-1][metrics.ITER]}"]
    lines = [r for r in records if finite(r.get(metrics.TOKENS_PER_SEC))]
    if lines:
        parts.append(f"{lines[-1][metrics.TOKENS_PER_SEC]:,.0f} tokens/s at iter {lines[-1][metrics.ITER]}")
    return ", ".join(parts)


def short_command(argv, work):
    """argv as the table shows it: `python`, paths relative to the repository or <work>, no COMMON_KEYS."""
    words = [word for word in argv if not (word.startswith("--") and word[2:].partition("=")[0] in COMMON_KEYS)]
    words = ["python" if word == sys.executable else word.replace(work, "<work>") for word in words]
    return " ".join(word.replace(ROOT + os.sep, "") for word in words)


def read_records(out_dir):
    """metrics.jsonl of a run as a list of dicts ([] when there is none)."""
    try:
        return metrics.read_records(out_dir)
    except FileNotFoundError:
        return []


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def finite(value):
    return isinstance(value, (int, float)) and math.isfinite(value)


# ---------------------------------------------------------------------------------------------------
# What the checks share.


@dataclasses.dataclass
class Context:
    device: str  # 'cuda', or 'cpu' for the tiny plumbing run
    work: str  # the temporary folder: data, runs, worker results
    logs: str  # <out>/logs
    gpus: int = 1  # processes for torchrun
    check: "Check" = None  # the check running now: its name (log file), description and budget
    deadline: float = 0.0  # time.monotonic() at the end of its budget

    @property
    def cuda(self):
        return self.device == "cuda"

    @property
    def budget_s(self):
        return self.check.budget_s * (1 if self.cuda else CPU_BUDGET_FACTOR)

    @property
    def data_path(self):
        return os.path.join(self.work, "data")

    @property
    def hellaswag_path(self):
        return os.path.join(self.work, "hellaswag_tiny.jsonl")

    @property
    def log(self):
        return os.path.join(self.logs, f"{self.check.name}.log")

    def out_dir(self, name):
        return os.path.join(self.work, "runs", name)

    @property
    def result_path(self):
        """Where the check's worker writes its JSON."""
        return os.path.join(self.work, f"{self.check.name}.json")

    def train_args(self, run_name, configs, keep=(), **overrides):
        """train.py's arguments: config files, the synthetic data, out_dir runs/<run_name>, no wandb, the
        overrides, and with --device=cpu the TINY shapes last (but for the overrides named in `keep`)."""
        values = dict(data_path=self.data_path, dataset=DATASET, out_dir=self.out_dir(run_name), wandb_log=False)
        values.update(overrides)
        if not self.cuda:
            values.update({key: value for key, value in TINY.items() if key not in keep})
        return [*configs, *(f"--{key}={value}" for key, value in values.items())]

    def train_py(self, run_name, configs, **overrides):
        return ["train.py", *self.train_args(run_name, configs, **overrides)]

    def run(self, argv, stop_at=None, env=None):
        """run_command within what is left of the check's budget."""
        return run_command(argv, self.log, self.deadline - time.monotonic(), stop_at, env)

    def short(self, argv):
        return short_command(argv, self.work)


# ---------------------------------------------------------------------------------------------------
# Synthetic data.


def make_synthetic_data(data_dir, train_tokens=TRAIN_TOKENS, val_tokens=VAL_TOKENS, seed=0):
    """train.bin and val.bin of uniform random GPT-2 token ids (no meta.pkl: train.py takes GPT-2's
    vocabulary, padded to 50304). Speed and memory do not depend on the text."""
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    write_bin(os.path.join(data_dir, "train.bin"), rng.integers(0, GPT2_VOCAB_SIZE, size=train_tokens))
    write_bin(os.path.join(data_dir, "val.bin"), rng.integers(0, GPT2_VOCAB_SIZE, size=val_tokens))


SUBJECTS = ("A man", "A woman", "The child", "An old farmer", "The cook", "A student", "The driver", "A dog")
PLACES = ("kitchen", "garden", "station", "library", "market", "river bank", "office", "gym")
VERBS, THINGS = (
    ("opens", "paints", "lifts", "drops"),
    ("the window.", "a red fence.", "the heavy box.", "a long letter."),
)


def write_hellaswag_file(path, num_examples=HELLASWAG_EXAMPLES, seed=0):
    """A tiny file in the official HellaSwag format (activity_label, ctx_a, ctx_b, ctx, four endings, label) of
    made-up sentences: enough to run marsgpt/hellaswag.py end to end, not to measure anything."""
    rng = np.random.default_rng(seed)
    endings = [f"{verb} {thing}" for verb in VERBS for thing in THINGS]
    with atomic_writer(path, "w") as f:
        for i in range(num_examples):
            subject = SUBJECTS[i % len(SUBJECTS)]
            ctx_a, ctx_b = f"{subject} walks into the {PLACES[i % len(PLACES)]}.", f"then {subject.lower()}"
            four = [endings[j] for j in rng.choice(len(endings), size=4, replace=False)]
            example = dict(activity_label="Walking", ctx_a=ctx_a, ctx_b=ctx_b, ctx=f"{ctx_a} {ctx_b}")
            f.write(json.dumps(dict(example, endings=four, label=int(rng.integers(4)))) + "\n")


def check_data(ctx):
    from marsgpt.tokens import TokenData
    from model import model_vocab_size

    data_dir = os.path.join(ctx.data_path, DATASET)
    make_synthetic_data(data_dir)
    write_hellaswag_file(ctx.hellaswag_path)
    train_data = TokenData(data_dir, "train")  # as launch.load_data reads it
    train_data.check_vocab(model_vocab_size(train_data))
    text = f"{train_data.num_tokens:,} train + {VAL_TOKENS:,} val tokens (uniform random GPT-2 ids), "
    text += f"{HELLASWAG_EXAMPLES} made-up HellaSwag examples"
    details = dict(train_tokens=train_data.num_tokens, val_tokens=VAL_TOKENS)
    return [Row(ctx.check.what, "gpu_check.make_synthetic_data, write_hellaswag_file", text, PASS, details)]


# ---------------------------------------------------------------------------------------------------
# Launch paths: each trains a few steps of config/quickstart.py (not compiled) on the synthetic data.


def launch_row(what, command, finished, budget_s, records, device_line):
    """Pass when the run exited 0, says it ran where it should (`world size N on cuda:0`: the one fact
    metrics.jsonl does not hold, read from the console) and evaluated."""
    if not finished.ok:
        return Row(what, command, failure(finished, budget_s, records), FAIL)
    if device_line not in finished.output:
        return Row(what, command, f"exit 0, but its output never says '{device_line}'", FAIL)
    val = [r[metrics.VAL_LOSS] for r in records if metrics.VAL_LOSS in r]
    if not val or not all(finite(v) for v in val):
        return Row(what, command, f"exit 0, but metrics.jsonl has no finite val loss ({val})", FAIL)
    steps = max(r[metrics.ITER] for r in records)
    text = f"exit 0; {device_line}; {steps} steps, val loss {val[0]:.3f} -> {val[-1]:.3f}"
    return Row(what, command, text, PASS, dict(steps=steps, val_losses=val))


def check_launch(torchrun, ctx):
    """train.py in one process (device auto) or under torchrun with one process per GPU."""
    n = ctx.gpus if torchrun else 1
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"] if torchrun else []
    run = dict(max_iters=10, eval_interval=10, log_interval=5) | (
        dict(gradient_accumulation_steps=n) if torchrun else {}
    )
    argv = [sys.executable, *launcher, *ctx.train_py(ctx.check.name, ["config/quickstart.py"], **run)]
    finished = ctx.run(argv)
    what = f"torchrun, {n} process{'es' if n > 1 else ''} (one per GPU)" if torchrun else ctx.check.what
    line = f"world size {n} on {'cuda:0' if ctx.cuda else 'cpu'}"
    return [launch_row(what, ctx.short(argv), finished, ctx.budget_s, read_records(ctx.out_dir(ctx.check.name)), line)]


# ---------------------------------------------------------------------------------------------------
# The path a paper run takes on a GPU: its config's shapes, the compiled model under DDP through torchrun (one
# rank), on the synthetic data, in scripts/gpu_check_worker.py's compiled_run. Its rows: the compile, graph
# breaks and recompiles, tokens/s and MFU, peak memory against the plan, the attention kernel.

# compiled, and 8 micro-batches (DDP's no_sync ones, then the one that all-reduces), on --device=cpu too
COMPILED_RUN = dict(compile=True, gradient_accumulation_steps=8, eval_iters=2)
TIMED_STEPS = 10
# small_mars's steps under torch.profiler after its timed ones: what the GPU ran, by kind, and how busy it was
PROFILED_STEPS = 2
# TORCH_LOGS for the compiled run: every recompile and graph break, with its reason, in the check's log
COMPILE_LOGS = "recompiles,graph_breaks"
# The compiled runs' inductor cache (and Triton's, inside it): empty for small_mars, whose compile is a cold
# start; small_mars_warm, a job requeued onto another node, starts on another empty one with the
# compile_cache.bin small_mars wrote in its out_dir (marsgpt/compile_cache.py, docs/training.md)
COMPILE_CACHE, REQUEUED_COMPILE_CACHE = "compile_cache", "compile_cache_requeued"
# Issue 35's goals for a cold start of the paper config, each compiling its graphs (judged on CUDA only)
COLD_START_TARGETS_S = dict(first_step_s=30, eval_s=10)
COMPILE_TIMES = (("first_step_s", "first step"), ("eval_s", "first evaluation"))
FUSED_KERNELS = ("flash", "memory-efficient", "cuDNN")


def gib(n):
    return f"{n / GIB:.1f} GiB"


def compile_times(result):
    """'first step 12.3 s, first evaluation 4.5 s' of a compiled run's result."""
    return ", ".join(
        f"{label} {result[key]:.1f} s" if finite(result.get(key)) else f"{label} not reached"
        for key, label in COMPILE_TIMES
    )


def compile_rows(what, command, result, cuda=False, targets=None):
    """The compile (the first step's and the first evaluation's seconds: pass when both are measured and, on
    CUDA, within `targets`, {key: seconds}), and the graphs: pass when no graph broke and nothing recompiled
    after the warm-up."""
    times = {key: result.get(key) for key, _ in COMPILE_TIMES}
    backend = f" ({result['backend']})" if result.get("backend") != "inductor" else ""
    text, status = f"{compile_times(result)}, each compiling its graphs{backend}", PASS
    if not all(finite(v) for v in times.values()):
        status = FAIL
    elif targets:
        limits = " and ".join(f"{label} <= {targets[key]} s" for key, label in COMPILE_TIMES)
        text += f"; target {limits}, cold" + ("" if cuda else " (judged on CUDA only)")
        if cuda and any(times[key] > targets[key] for key in targets):
            status = FAIL
    rows = [Row(f"{what}: compile", command, text, status, times)]
    breaks, recompiled = result.get("graph_breaks", {}), "recompile" in result.get("error", "").lower()
    warm, graphs = result.get("graphs_after_warm_up"), result.get("graphs")
    details = dict(graph_breaks=breaks, graphs_after_warm_up=warm, graphs=graphs, error=result.get("error", ""))
    if breaks:
        text, status = f"{sum(breaks.values())} graph break(s): {'; '.join(breaks)}", FAIL
    elif recompiled:
        text, status = f"recompiled after the warm-up: {result['error']}", FAIL
    elif warm is None or graphs != warm:
        text, status = f"graphs after the warm-up {warm}, at the end {graphs}: not measured to the end", FAIL
    else:
        text = f"no graph break; {graphs} graph(s) compiled in the warm-up, no recompile after it (forbidden)"
        status = PASS
    rows.append(Row(f"{what}: graph breaks and recompiles", command, text, status, details))
    return rows


def throughput_result_row(what, command, result):
    """tokens/s and MFU (both conventions) of the timed steps, on the path a real run takes (compiled, DDP)."""
    tokens_per_sec = result.get("tokens_per_sec")
    if result.get("error") or not finite(tokens_per_sec):
        return Row(what, command, f"not measured: {result.get('error') or 'no timed step'}", FAIL, result)
    if not (result["compiled"] and result["ddp"]):
        return Row(what, command, f"compiled {result['compiled']}, DDP {result['ddp']}: not the real path", FAIL)
    mfu, mfu_llmc = result.get("mfu"), result.get("mfu_llmc")
    mfu_text = (
        f"MFU {mfu:.1f}% ({mfu_llmc:.1f}% as llm.c counts)"
        if finite(mfu) and finite(mfu_llmc)
        else "MFU n/a (no peak FLOP/s known for this device)"
    )
    text = (
        f"{tokens_per_sec:,.0f} tokens/s, {mfu_text}, {result['step_s'] * 1000:.0f} ms/step of "
        f"{result['tokens_per_step']:,} tokens ({result['steps']} steps; compiled, DDP over 1 rank)"
    )
    keys = ("tokens_per_sec", "mfu", "mfu_llmc", "step_s", "tokens_per_step", "steps", "skipped")
    return Row(what, command, text, PASS, {key: result.get(key) for key in keys})


def compiled_memory_row(what, command, result):
    """Peak memory of the compiled run beside the memory plan train.py printed (the compiled model's): pass when
    the peak is within PLAN_TOLERANCE of it."""
    plan = result.get("plan_bytes")
    keys = ("peak_allocated_bytes", "peak_reserved_bytes", "total_bytes", "peak_rss_bytes", "plan_bytes")
    details = {key: result[key] for key in keys if key in result}
    if "peak_allocated_bytes" not in result:
        return Row(what, command, f"peak resident set {gib(result['peak_rss_bytes'])} (host memory)", PASS, details)
    ratio = result["peak_allocated_bytes"] / plan
    text = (
        f"peak {gib(result['peak_allocated_bytes'])} allocated, {gib(result['peak_reserved_bytes'])} reserved, "
        f"of {gib(result['total_bytes'])}; plan {gib(plan)} (compiled), measured/plan {ratio:.2f} "
        f"(tolerance {PLAN_TOLERANCE:.0%})"
    )
    status = PASS if abs(ratio - 1) <= PLAN_TOLERANCE else FAIL
    return Row(what, command, text, status, dict(details, ratio=ratio))


def attention_row(what, command, result, cuda):
    """Which attention kernel ran: on CUDA a fused one, or the math kernel when the run is deterministic."""
    kernel, deterministic = result["attention_kernel"], result.get("deterministic", False)
    expected = "math" if deterministic else "a fused kernel (" + ", ".join(FUSED_KERNELS) + ")"
    ok = kernel == "math" if deterministic else kernel in FUSED_KERNELS
    if not cuda:
        return Row(what, command, f"{kernel} (on CUDA: {expected})", PASS, dict(kernel=kernel))
    return Row(what, command, f"{kernel}; expected {expected}", PASS if ok else FAIL, dict(kernel=kernel))


def compiled_rows(what, command, finished, budget_s, result, cuda, targets=None, profiled=False):
    """The rows of one compiled run (scripts/gpu_check_worker.py compiled_run), or one failed row when the
    worker wrote no result. targets: its compile's (compile_rows); profiled: a profile was asked for."""
    if not result:
        return [Row(what, command, failure(finished, budget_s), FAIL)]
    rows = compile_rows(what, command, result, cuda, targets)
    rows.append(throughput_result_row(what, command, result))
    rows.append(compiled_memory_row(f"{what}: peak memory", command, result))
    rows.append(attention_row(f"{what}: attention kernel", command, result, cuda))
    if profiled:
        rows.append(profile_row(f"{what}: profile", command, result, cuda))
    if not finished.ok:  # the worker wrote its result and then failed: say how
        rows.append(Row(what, command, failure(finished, budget_s), FAIL))
    return rows


def compiled_argv(ctx, config, steps, profiled=0, **overrides):
    """(argv of the compiled worker through torchrun on one rank, the train.py command the table shows)."""
    train_args = ctx.train_args(ctx.check.name, [config], keep=COMPILED_RUN.keys(), **COMPILED_RUN, **overrides)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    argv = [sys.executable, *launcher, *WORKER, "compiled", ctx.result_path, str(steps), str(profiled), *train_args]
    return argv, "torchrun --nproc_per_node=1 " + ctx.short(["train.py", *train_args])


def compile_env(ctx, cache=COMPILE_CACHE):
    return dict(TORCH_LOGS=COMPILE_LOGS, TORCHINDUCTOR_CACHE_DIR=os.path.join(ctx.work, cache))


def profile_row(what, command, result, cuda):
    """What the device ran in the profiled steps (scripts/gpu_check_worker.py profile_steps): how busy it was from
    its first kernel to its last (a gap is the device waiting for the host) and each kind of kernel's share of its
    time; the trace's file. Fails when there is no profile."""
    profile = result.get("profile")
    if not profile:
        return Row(what, command, f"not measured: {result.get('error') or 'the run ended before its profile'}", FAIL)
    kinds = ", ".join(f"{kind} {share:.0%}" for kind, share in sorted(profile["kinds"].items(), key=lambda k: -k[1]))
    text = (
        f"{profile['steps']} steps over {profile['span_s']:.2f} s: {'the GPU' if cuda else 'the CPU operators'} "
        f"busy {profile['busy']:.0%} of it; by kind: {kinds}; trace {profile['trace']}"
    )
    return Row(what, command, text, PASS, profile)


def check_compiled(config, ctx, **overrides):
    profiled = 0 if overrides else PROFILED_STEPS  # the paper config's own path
    argv, command = compiled_argv(ctx, config, TIMED_STEPS, profiled, **overrides)
    finished = ctx.run(argv, env=compile_env(ctx))
    result = read_json(ctx.result_path) if os.path.isfile(ctx.result_path) else {}
    if result.get("profile"):  # its trace beside the logs, which outlive <work>
        kept = os.path.join(ctx.logs, os.path.basename(result["profile"]["trace"]))
        shutil.move(result["profile"]["trace"], kept)
        result["profile"]["trace"] = os.path.join(os.path.basename(ctx.logs), os.path.basename(kept))
    targets = None if overrides else COLD_START_TARGETS_S
    rows = compiled_rows(ctx.check.what, command, finished, ctx.budget_s, result, ctx.cuda, targets, profiled > 0)
    reference = os.path.join(ctx.work, f"{DETERMINISM_BASELINE}.json")
    if overrides.get("deterministic") and os.path.isfile(reference):
        rows.append(determinism_row(f"{ctx.check.what}: against the default", command, result, read_json(reference)))
    return rows


# --deterministic=True's cost: the same run with and without it; a relaunch's compile: small_mars's again
DETERMINISM_BASELINE = COLD_RUN = "small_mars"


def warm_compile_row(what, command, finished, budget_s, result, cold, cuda):
    """The compile seconds of a requeued job (the run again, its inductor cache empty, with the compile_cache.bin
    the first run left): pass when measured and, on CUDA, every graph found in the cache and the first step
    shorter than the cold run's."""
    if not result:
        return Row(what, command, failure(finished, budget_s), FAIL)
    times = {key: result.get(key) for key, _ in COMPILE_TIMES}
    if not all(finite(v) for v in times.values()):
        return Row(what, command, f"{compile_times(result)}: not measured", FAIL, times)
    counts = {key: result.get(key) for key in (metrics.GRAPHS_COMPILED, metrics.GRAPHS_FROM_CACHE)}
    text = (
        f"{compile_times(result)} from the compile_cache.bin the first run left, the inductor cache empty "
        f"({counts[metrics.GRAPHS_COMPILED]} graphs compiled, {counts[metrics.GRAPHS_FROM_CACHE]} from the cache); "
        f"cold: {compile_times(cold) if cold else 'not measured'}"
    )
    if not cuda:
        return Row(what, command, f"{text} ({result.get('backend')}: no inductor cache to reuse)", PASS, times)
    faster = finite(cold.get("first_step_s")) and times["first_step_s"] < cold["first_step_s"]
    status = PASS if faster and counts[metrics.GRAPHS_COMPILED] == 0 else FAIL
    return Row(what, command, text, status, dict(times, **counts, cold=cold))


def check_compile_warm(config, ctx):
    """A requeued job's compile: the compiled run again on an empty inductor cache, as on another node, with the
    compile_cache.bin the cold run wrote copied into its out_dir; its compile seconds alone (no timed steps)."""
    left = os.path.join(ctx.out_dir(COLD_RUN), compile_cache.FILE_NAME)
    if os.path.isfile(left):
        os.makedirs(ctx.out_dir(ctx.check.name), exist_ok=True)
        copy_file(left, os.path.join(ctx.out_dir(ctx.check.name), compile_cache.FILE_NAME))
    argv, command = compiled_argv(ctx, config, 0)
    finished = ctx.run(argv, env=compile_env(ctx, REQUEUED_COMPILE_CACHE))
    result = read_json(ctx.result_path) if os.path.isfile(ctx.result_path) else {}
    cold_path = os.path.join(ctx.work, f"{COLD_RUN}.json")
    cold = read_json(cold_path) if os.path.isfile(cold_path) else {}
    return [warm_compile_row(ctx.check.what, command, finished, ctx.budget_s, result, cold, ctx.cuda)]


def determinism_row(what, command, result, baseline):
    """The deterministic run's tokens/s and peak memory as fractions of the default run's."""
    if not (finite(result.get("tokens_per_sec")) and finite(baseline.get("tokens_per_sec"))):
        return Row(what, command, "not measured: one of the two runs has no tokens/s", FAIL)
    speed = result["tokens_per_sec"] / baseline["tokens_per_sec"]
    memory_key = "peak_allocated_bytes" if "peak_allocated_bytes" in result else "peak_rss_bytes"
    memory = result[memory_key] / baseline[memory_key]
    text = f"{speed:.2f}x the default run's tokens/s, {memory:.2f}x its peak memory"
    return Row(what, command, text, PASS, dict(speed_ratio=speed, memory_ratio=memory))


# ---------------------------------------------------------------------------------------------------
# The MARS step: bench/bench_mars.py's rows, found by the names bench_mars gives them.
# optimizer_rows is the one reader of its row format.

OPTIMIZER_WIDTH_CPU = 32  # --device=cpu: bench_mars on GPT-2 small's shapes at this width, not 768
TIMING_UNITS = ("ms", "us", "s")  # the bench's rows of times (its bandwidth and state-memory rows are in the JSON)


def _target_limit(target):
    """X from a bench target written '<= X ...', or None."""
    found = re.search(r"<=\s*([0-9.]+(?:e-?[0-9]+)?)", str(target or ""))
    return float(found.group(1)) if found else None


def _time(bench):
    """'4.33 ms = 3.05x' of a measured bench row, else None."""
    if bench is None or not finite(bench.get("ours")) or (bench.get("reference") and not finite(bench["ratio"])):
        return None
    return f"{bench['ours']:.3g} {bench['unit']}" + (f" = {bench['ratio']:.2f}x" if bench.get("reference") else "")


def _judged(what, command, text, ratio, target, cuda, details):
    """Pass when ratio is within a target '<= X' (on CUDA; on CPU the numbers mean nothing: measured is enough)."""
    limit = _target_limit(target)
    if limit is None:
        return Row(what, command, f"{text} (the bench states no target)", PASS, details)
    if not cuda:
        return Row(what, command, f"{text}; target <= {limit} (judged on CUDA only)", PASS, details)
    return Row(what, command, f"{text}; target <= {limit}", PASS if ratio <= limit else FAIL, details)


def step_path_row(label, target, by_name, command, cuda):
    """The rule's step on fused=True (MARS's Triton kernel) and on the default path, side by side against the
    baseline: pass when the kernel's step is within the rule's target (docs/gpu.md: then the kernel becomes the
    default on CUDA). On a CPU the kernel does not run: the default path's, measured."""
    paths = [bench_mars.path_name(label, fused) for fused in (True, False)]
    names = [bench_mars.step_row_name(path) for path in paths] + [bench_mars.compile_row_name(paths[0])]
    kernel, default, first = (by_name.pop(name, None) for name in names)
    what = f"{label} step vs {bench_mars.BASELINE}: fused=True (the kernel) and the default path"
    details = dict(kernel=kernel, default=default, first_step=first)
    if _time(default) is None or (cuda and _time(kernel) is None):
        return Row(what, command, "not measured: bench_mars gave no time for one of the two paths", FAIL, details)
    if not cuda:
        text = f"default (foreach) {_time(default)}; fused=True runs on CUDA only"
        return Row(what, command, text, PASS, details)
    text = f"fused=True {_time(kernel)}" + (f" (first step {first['ours']:.1f} s: compiling)" if _time(first) else "")
    return _judged(what, command, f"{text}, default (foreach) {_time(default)}", kernel["ratio"], target, cuda, details)


def equality_row(bench, command):
    """A fused=True contender's parameters against the default path's on the GPU (bench_mars.equality_rows):
    pass when their difference per unit of update is within the bench's target."""
    limit = _target_limit(bench.get("target"))
    if not finite(bench.get("ours")) or limit is None:
        return Row(bench["benchmark"], command, f"not measured: {bench.get('note', '')}", FAIL, bench)
    text = f"{bench['ours']:.2g} (target <= {limit:g}; {bench.get('note', '')})"
    return Row(bench["benchmark"], command, text, PASS if bench["ours"] <= limit else FAIL, bench)


def timing_row(bench, command, cuda, with_note=False):
    """A bench row of a time as a table row: failed when not measured, else judged by its target (_judged);
    with_note: the bench's note after the numbers."""
    name = bench["benchmark"]
    if _time(bench) is None:
        return Row(name, command, f"not measured: {bench.get('note', '')}", FAIL, bench)
    text = _time(bench) + (f" of {bench['reference']:.3g} {bench['unit']}" if bench.get("reference") else "")
    text += f"; {bench.get('note', '')}" if with_note else ""
    return _judged(name, command, text, bench.get("ratio"), bench.get("target"), cuda, bench)


def optimizer_rows(bench_rows, command, cuda=True):
    """Table rows from bench_mars.run(quick=True)'s rows.

    First (CUDA only), whether fused=True, MARS's Triton kernel, computes what the default path computes there:
    one row per kernel contender (equality_row), and a failed row where the bench gave none. Then one row per
    rule of bench_mars.RULES: its fused=True and default steps side by side (step_path_row). Then each other time
    the bench gives, but the baseline's own step: judged by its target where it states one as '<= X', else
    passing when measured. Then the host-sync rows (CUDA only): one row, pass when every MARS step ran under
    torch.cuda.set_sync_debug_mode('error') without raising.
    """
    by_name = {r["benchmark"]: r for r in bench_rows}
    by_name.pop(bench_mars.step_row_name(bench_mars.BASELINE), None)
    rows = []
    for name in bench_mars.kernel_settings() if cuda else ():
        bench = by_name.pop(bench_mars.equality_row_name(name), None)
        missing = Row(bench_mars.equality_row_name(name), command, "bench_mars gave no such row", FAIL)
        rows.append(missing if bench is None else equality_row(bench, command))
    rows += [step_path_row(label, target, by_name, command, cuda) for _, label, target in bench_mars.RULES]
    rows += [timing_row(bench, command, cuda) for bench in by_name.values() if bench.get("unit") in TIMING_UNITS]
    sync = [r for r in bench_rows if r.get("unit") == "bool"]
    what = "MARS steps under set_sync_debug_mode('error')"
    if not cuda:
        rows.append(Row(what, command, "skipped: a host sync exists only on CUDA", SKIP))
    elif not sync:
        rows.append(Row(what, command, "bench_mars gave no host-sync row", FAIL))
    else:
        syncing = [r["benchmark"] for r in sync if r.get("ours") != 1]
        result = f"host sync in: {', '.join(syncing)}" if syncing else f"no host sync in any of {len(sync)} steps"
        rows.append(Row(what, command, result, FAIL if syncing else PASS, dict(rows=sync)))
    return rows


def check_optimizer(ctx):
    argv = [sys.executable, *WORKER, "optimizer", ctx.result_path]
    argv += [] if ctx.cuda else [str(OPTIMIZER_WIDTH_CPU)]
    finished = ctx.run(argv)
    command = "bench_mars.run(quick=True" + ("" if ctx.cuda else f", n_embd={OPTIMIZER_WIDTH_CPU}") + ")"
    if not finished.ok:
        return [Row(ctx.check.what, command, failure(finished, ctx.budget_s), FAIL)]
    return optimizer_rows(read_json(ctx.result_path)["rows"], command, ctx.cuda)


# ---------------------------------------------------------------------------------------------------
# FSDP2 (zero_stage=3): train.py sharded over every GPU, then the sharded MARS steps against FSDP2 + AdamW.

# 2 micro-batches per rank: the first one's gradients stay unsharded and unreduced (no_gradient_sync)
FSDP_RUN = dict(max_iters=10, eval_interval=10, log_interval=5, zero_stage=3)
FSDP_CPU_RANKS = 2  # --device=cpu: two gloo ranks, so the shards and their collectives are real


def fsdp_launch_row(what, command, finished, budget_s, records, ranks, out_dir, cuda):
    """launch_row's conditions, and: it says it shards over `ranks` (FSDP2), and its last checkpoint is sharded,
    one file per rank, and reads back whole (every file's checksum verified) with finite weights."""
    device_line = f"world size {ranks} on {'cuda:0' if cuda else 'cpu'}"
    row = launch_row(what, command, finished, budget_s, records, device_line)
    if row.status == FAIL:
        return row
    sharding = f"FSDP2 over {ranks} GPU{'s' * (ranks != 1)}"
    if sharding not in finished.output:
        return Row(what, command, f"exit 0, but its output never says '{sharding}'", FAIL, row.details)
    try:  # read and verified once: the shard directory's files are checked before they are read whole
        ckpt = load_checkpoint(os.path.join(out_dir, CKPT_NAME), whole=False)
        record = ckpt.get(SHARDS_KEY)
        weights = (read_whole(ckpt) if record else ckpt)["model"]
    except (OSError, CheckpointError) as e:
        return Row(what, command, f"{row.result}; its checkpoint: {e}", FAIL, row.details)
    shard_files = [name for name in (record or {}).get("files", ()) if name.endswith(".distcp")]
    if len(shard_files) != ranks:
        text = f"{row.result}; its checkpoint is not sharded one file per rank ({len(shard_files)} .distcp files)"
        return Row(what, command, text, FAIL, row.details)
    if not all(torch.isfinite(value).all() for value in weights.values() if value.is_floating_point()):
        return Row(what, command, f"{row.result}; its checkpoint holds non-finite weights", FAIL, row.details)
    text = f"{row.result}; {sharding}; checkpoint of {ranks} shard files read back whole"
    return Row(what, command, text, PASS, dict(row.details, shard_files=len(shard_files)))


def fsdp_step_rows(bench_rows, command, cuda):
    """bench/bench_fsdp.py's step_rows as table rows: each time judged as the optimizer row judges bench_mars's
    (no target stated: measured is enough), each count of bytes sent with its collectives."""
    rows = []
    for bench in bench_rows:
        name = bench["benchmark"]
        if bench.get("unit") in TIMING_UNITS:
            rows.append(timing_row(bench, command, cuda, with_note=True))
        elif finite(bench.get("ours")):
            sent = bench["ours"] * 2**10 if bench["unit"] == "KiB" else None
            amount = (
                f"{sent:,.0f} bytes" if sent is not None and sent < 2**10 else f"{bench['ours']:,.1f} {bench['unit']}"
            )
            text = f"{amount}: {bench.get('note', '')}"
            rows.append(Row(name, command, text, PASS, bench))
        else:
            rows.append(Row(name, command, "not measured", FAIL, bench))
    return rows or [Row("FSDP2 steps (bench/bench_fsdp.py)", command, "the bench gave no row", FAIL)]


def check_fsdp(ctx):
    ranks = ctx.gpus if ctx.cuda else FSDP_CPU_RANKS
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    run = dict(FSDP_RUN, gradient_accumulation_steps=2 * ranks)
    keep = ("gradient_accumulation_steps",)
    argv = [*launcher, *ctx.train_py(ctx.check.name, ["config/quickstart.py"], keep=keep, **run)]
    finished = ctx.run(argv)
    records = read_records(ctx.out_dir(ctx.check.name))
    what = f"FSDP2: train.py --zero_stage=3 under torchrun, {ranks} processes"
    out_dir = ctx.out_dir(ctx.check.name)
    rows = [fsdp_launch_row(what, ctx.short(argv), finished, ctx.budget_s, records, ranks, out_dir, ctx.cuda)]
    argv = [*launcher, *WORKER, "fsdp", ctx.result_path, ctx.device]
    finished = ctx.run(argv)
    command = ctx.short(argv)
    if not finished.ok or not os.path.isfile(ctx.result_path):
        return rows + [Row("FSDP2 steps (bench/bench_fsdp.py)", command, failure(finished, ctx.budget_s), FAIL)]
    return rows + fsdp_step_rows(read_json(ctx.result_path)["rows"], command, ctx.cuda)


MESH_OF_ONE = "MARS-Shampoo and MARS-M sharded on one GPU (bench_fsdp.mesh_of_one)"


def check_mesh_of_one(ctx):
    """MARS-Shampoo's and MARS-M's sharded step on a mesh of one (GPT-2 small on one GPU; the CPU: the bench's
    quick shapes on one gloo rank) against the unsharded step: its time, parameters and peak memory."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    argv += [*WORKER, "mesh_of_one", ctx.result_path, ctx.device]
    finished = ctx.run(argv)
    command = ctx.short(argv)
    if not finished.ok or not os.path.isfile(ctx.result_path):
        return [Row(MESH_OF_ONE, command, failure(finished, ctx.budget_s), FAIL)]
    return mesh_of_one_rows(read_json(ctx.result_path)["rows"], command, ctx.cuda)


def mesh_of_one_rows(bench_rows, command, cuda):
    """bench_fsdp.mesh_of_one_rows as table rows: times measured; the parameters against the unsharded step's and
    the peak memory against the plan judged by the bench's targets (on CUDA; a CPU has no allocator peak here)."""
    rows = []
    for bench in bench_rows:
        name = bench["benchmark"]
        if bench.get("unit") in TIMING_UNITS:
            rows.append(timing_row(bench, command, cuda, with_note=True))
        elif not finite(bench.get("ours")):
            status = FAIL if cuda else PASS  # the CPU has no peak to give
            rows.append(Row(name, command, f"not measured: {bench.get('note', '')}", status, bench))
        else:
            text = f"{bench['ours']:.3g} {bench['unit']}"
            if bench.get("reference"):
                text += f" of {bench['reference']:.3g} {bench['unit']} planned"
            text += f"; {bench.get('note', '')}"
            rows.append(_judged(name, command, text, bench["ratio"], bench.get("target"), cuda, bench))
    return rows or [Row(MESH_OF_ONE, command, "the bench gave no row", FAIL)]


# ---------------------------------------------------------------------------------------------------
# Kill -9 and resume.


def compare_losses(reference, resumed, tolerance):
    """(number of losses compared, largest difference, first mismatch or None) between two metrics.jsonl.

    Every train, validation and train-estimate loss, by iteration; a resumed run's file holds the
    killed run's records up to its checkpoint and the resumed run's after it.
    """

    def losses(records):
        return {(r[metrics.ITER], key): r[key] for r in records for key in LOSS_KEYS if key in r}

    a, b = losses(reference), losses(resumed)
    if a.keys() != b.keys():
        missing = sorted(a.keys() ^ b.keys())[0]
        return len(a), math.inf, f"{missing[1]} at iter {missing[0]} is in one run only"
    largest = 0.0
    for key in sorted(a):
        if a[key] == b[key]:
            continue
        difference = abs(a[key] - b[key]) if finite(a[key]) and finite(b[key]) else math.inf
        largest = max(largest, difference)
        if difference > tolerance:
            return len(a), largest, f"{key[1]} at iter {key[0]}: {a[key]!r} vs {b[key]!r}"
    return len(a), largest, None


def resume_row(what, command, budget_s, reference, killed, resumed_from, resumed, reference_records, records):
    if not reference.ok:
        return Row(what, command, f"uninterrupted run: {failure(reference, budget_s)}", FAIL)
    if not killed.stopped:
        ending = "finished" if killed.ok else failure(killed, budget_s)
        return Row(what, command, f"never killed: the run {ending} before logging '{RESUME_KILL_AT}'", FAIL)
    if resumed_from is None:
        return Row(what, command, "killed before its first checkpoint: nothing to resume", FAIL)
    if not resumed.ok:
        return Row(what, command, f"resume from iter {resumed_from}: {failure(resumed, budget_s)}", FAIL)
    count, largest, mismatch = compare_losses(reference_records, records, RESUME_TOLERANCE)
    details = dict(resumed_from=resumed_from, losses=count, max_abs_difference=largest, tolerance=RESUME_TOLERANCE)
    tolerance = "bitwise" if RESUME_TOLERANCE == 0 else f"tolerance {RESUME_TOLERANCE}"
    if mismatch is not None or count == 0:
        return Row(what, command, f"resumed from iter {resumed_from}; differs ({tolerance}): {mismatch}", FAIL, details)
    result = (
        f"SIGKILL at '{RESUME_KILL_AT.rstrip(':')}', resumed from iter {resumed_from}: all {count} losses equal "
        f"the uninterrupted run's ({tolerance}, largest difference {largest:g})"
    )
    return Row(what, command, result, PASS, details)


def check_resume(ctx):
    reference_argv = [sys.executable, *ctx.train_py("resume_reference", ["config/quickstart.py"], **RESUME_RUN)]
    argv = [sys.executable, *ctx.train_py("resume", ["config/quickstart.py"], **RESUME_RUN)]
    reference = ctx.run(reference_argv)
    killed = ctx.run(argv, stop_at=RESUME_KILL_AT) if reference.ok else reference
    checkpoint = os.path.join(ctx.out_dir("resume"), CKPT_NAME)
    resumed_from = None
    if killed.stopped and os.path.isfile(checkpoint):
        resumed_from = load_checkpoint(checkpoint, mmap=True)["progress"]["iter_num"]
    resumed = ctx.run(argv + ["--init_from=resume"]) if resumed_from is not None else killed
    command = f"{ctx.short(argv)}; SIGKILL at '{RESUME_KILL_AT}'; again with --init_from=resume"
    records = [read_records(ctx.out_dir(name)) for name in ("resume_reference", "resume")]
    return [resume_row(ctx.check.what, command, ctx.budget_s, reference, killed, resumed_from, resumed, *records)]


# ---------------------------------------------------------------------------------------------------
# Peak memory: 2 steps of a paper config at its micro-batch, not compiled (as issue 12 measured XL).


def memory_row(what, command, finished, budget_s, result):
    """Pass when the steps ran without running out of memory, and (once a memory plan exists) the measured
    peak is within PLAN_TOLERANCE of the plan's."""
    if not finished.ok:
        return Row(what, command, failure(finished, budget_s), FAIL)
    if result["oom"]:
        total = result.get("total_bytes", 0) / GIB
        return Row(what, command, f"out of memory on a {total:.1f} GiB GPU: {result['oom']}", FAIL, result)
    plan_bytes, plan_note = result.get("plan_bytes"), result.get("plan_note", "")
    if "peak_allocated_bytes" not in result:
        rss = result["peak_rss_bytes"] / GIB
        return Row(what, command, f"peak resident set {rss:.2f} GiB (host memory, not a GPU's)", PASS, result)
    peak, reserved, total = (
        result[key] / GIB for key in ("peak_allocated_bytes", "peak_reserved_bytes", "total_bytes")
    )
    text = f"peak {peak:.1f} GiB allocated, {reserved:.1f} GiB reserved, of {total:.1f} GiB"
    if plan_bytes is None:
        status = FAIL if result.get("plan_error") else PASS
        return Row(what, command, f"{text}; plan: {plan_note}", status, result)
    ratio = result["peak_allocated_bytes"] / plan_bytes
    status = PASS if abs(ratio - 1) <= PLAN_TOLERANCE else FAIL
    text += f"; plan {plan_bytes / GIB:.1f} GiB, measured/plan {ratio:.2f} (tolerance {PLAN_TOLERANCE:.0%})"
    return Row(what, command, text, status, result)


def check_memory(config, ctx):
    name = ctx.check.name
    train_args = ctx.train_args(name, [config], gradient_accumulation_steps=2, compile=False, eval_iters=1)
    argv = [sys.executable, *WORKER, "memory", ctx.result_path, *train_args]
    finished = ctx.run(argv)
    result = read_json(ctx.result_path) if finished.ok else {}
    command = "2 steps of " + ctx.short(["train.py", *train_args])
    return [memory_row(ctx.check.what, command, finished, ctx.budget_s, result)]


# ---------------------------------------------------------------------------------------------------
# The tools after training, on the one-process run's model.

SAMPLE_SEPARATOR = "---------------"  # sample.py prints it after each sample
HELLASWAG_LINE = re.compile(r"hellaswag: n=(\d+) acc=([0-9.]+) acc_norm=([0-9.]+)")


def sample_row(what, command, finished, budget_s):
    if not finished.ok:
        return Row(what, command, failure(finished, budget_s), FAIL)
    text = finished.output.split(SAMPLE_SEPARATOR)[0].strip() if SAMPLE_SEPARATOR in finished.output else ""
    if not text:
        return Row(what, command, "exit 0, but no sample in its output", FAIL)
    return Row(what, command, f"exit 0; a sample of {len(text)} characters", PASS, dict(characters=len(text)))


def hellaswag_row(what, command, finished, budget_s, expected):
    if not finished.ok:
        return Row(what, command, failure(finished, budget_s), FAIL)
    found = HELLASWAG_LINE.search(finished.output)
    if not found or int(found.group(1)) != expected:
        return Row(what, command, f"exit 0, but no 'hellaswag: n={expected} ...' line", FAIL)
    acc_norm = float(found.group(3))
    result = f"acc_norm {acc_norm:.3f} on {expected} made-up examples (an untrained model: about 0.25)"
    return Row(what, command, result, PASS, dict(n=expected, acc=float(found.group(2)), acc_norm=acc_norm))


def check_sample(ctx):
    argv = [sys.executable, "sample.py", f"--out_dir={ctx.out_dir('single')}", "--start=The", "--device=auto"]
    argv += ["--num_samples=1", "--max_new_tokens=32"]
    finished = ctx.run(argv)
    return [sample_row(ctx.check.what, ctx.short(argv), finished, ctx.budget_s)]


def check_hellaswag(ctx):
    argv = [sys.executable, "-m", "marsgpt.hellaswag", "--ckpt", ctx.out_dir("single"), "--data", ctx.hellaswag_path]
    argv += ["--device", "auto"]
    finished = ctx.run(argv)
    return [hellaswag_row(ctx.check.what, ctx.short(argv), finished, ctx.budget_s, HELLASWAG_EXAMPLES)]


# ---------------------------------------------------------------------------------------------------
# The quickstart: scripts/quickstart.sh's three commands, its corpus and run in <work>.

QUICKSTART_TARGET_S = 30  # issue 35's goal on a GPU: the corpus, 7,000 steps with their evaluations, the sample
# --device=cpu: the quickstart takes minutes on a CPU; 100 steps of it run the same commands
QUICKSTART_CPU = dict(max_iters=100, eval_interval=50, eval_iters=10, log_interval=50)


def quickstart_commands(ctx):
    """(name, argv) of each of the quickstart's three steps (scripts/quickstart.py runs them in one process; here each
    is a command of its own, timed on its own), writing into <work>: the corpus, the run, the sample."""
    data_path, out_dir = os.path.join(ctx.work, "quickstart_data"), ctx.out_dir("quickstart")
    train = [f"--data_path={data_path}", f"--out_dir={out_dir}", "--wandb_log=False"]
    train += [] if ctx.cuda else [f"--{key}={value}" for key, value in QUICKSTART_CPU.items()]
    from data.stdlib_char import prepare
    from scripts import quickstart

    return [
        ("prepare", [sys.executable, "-m", prepare.__name__, f"--output_dir={data_path}/stdlib_char"]),
        ("train", [sys.executable, "train.py", quickstart.CONFIG, *train]),
        ("sample", [sys.executable, "sample.py", f"--out_dir={out_dir}", *quickstart.SAMPLE]),
    ]


def quickstart_row(what, command, runs, budget_s, records, cuda):
    """runs: [(name, Finished, seconds)] in order. Pass when every command exited 0 and sample.py sampled, and, on
    CUDA, all of it took at most QUICKSTART_TARGET_S."""
    for name, finished, _ in runs:
        if not finished.ok:
            text = failure(finished, budget_s, records if name == "train" else None)
            return Row(what, command, f"{name}: {text}", FAIL)
    if SAMPLE_SEPARATOR not in runs[-1][1].output:
        return Row(what, command, "exit 0, but no sample in sample.py's output", FAIL)
    seconds = {name: s for name, _, s in runs}
    lines = [r for r in records if finite(r.get(metrics.STEP_MS))]
    steps = max((r[metrics.ITER] for r in records), default=0)
    step_ms = f", {lines[-1][metrics.STEP_MS]:.1f} ms/step at the end" if lines else ""
    text = (
        f"{sum(seconds.values()):.1f} s: corpus {seconds['prepare']:.1f} s, {steps:,} steps {seconds['train']:.1f} s"
        f"{step_ms}, sample {seconds['sample']:.1f} s; target <= {QUICKSTART_TARGET_S} s"
    )
    details = dict(seconds=seconds, steps=steps)
    if not cuda:
        return Row(what, command, f"{text} (judged on CUDA only; {steps} steps on the CPU)", PASS, details)
    return Row(what, command, text, PASS if sum(seconds.values()) <= QUICKSTART_TARGET_S else FAIL, details)


def check_quickstart(ctx):
    runs = []
    for name, argv in quickstart_commands(ctx):
        t0 = time.monotonic()
        env = dict(TORCHINDUCTOR_CACHE_DIR=os.path.join(ctx.work, "quickstart_cache")) if name == "train" else None
        finished = ctx.run(argv, env=env)
        runs.append((name, finished, time.monotonic() - t0))
        if not finished.ok:
            break
    command = "; ".join(ctx.short(argv) for _, argv in quickstart_commands(ctx))
    records = read_records(ctx.out_dir("quickstart"))
    return [quickstart_row(ctx.check.what, command, runs, ctx.budget_s, records, ctx.cuda)]


# ---------------------------------------------------------------------------------------------------
# The checks, in the order they run.


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    what: str
    budget_s: int  # on one H200; a command still running at the end is killed and the row fails
    run: Callable  # (Context) -> [Row]
    needs: tuple = ()
    cuda_only: bool = False


# The order gives the most if a run is cut short: the cheap paths no GPU has run yet first (launch, NCCL,
# checkpoints and resume, the tools), then the optimizer row that decides train.py's step path and FSDP2's
# sharded run and steps, then the paper config on the path a real run takes (compiled, DDP) and its throughput,
# the peak memory against the plan, a relaunch's compile, what determinism costs, and the quickstart. AdamW's
# compiled throughput is not a check of its own: the optimizer row's step times against AdamW(fused=True) predict
# it, as AdamW's and MARS's paper configs differ only in the step. Budgets are for one H200 (8 GPUs for torchrun),
# from the seconds each check took there on 2026-12-04 (docs/gpu.md, "Results"), with a quarter or more to spare
# for a cold node: there each new process spent about 20 s starting. Checks no GPU has run yet: 20 s per process,
# plus an estimate of its work.
DATA = ("data",)
SMALL_MARS, XL_MARS = (f"config/train_gpt2_{n}.py" for n in ("small_mars", "xl_mars"))
CHECKS = (
    Check("data", "synthetic token data and a tiny HellaSwag file", 5, check_data),  # 0 s
    Check("single", "one process: python train.py, device auto", 35, partial(check_launch, False), DATA),
    Check("torchrun", "torchrun, one process per GPU", 45, partial(check_launch, True), DATA),
    # three processes (about 20 s each to start: its 45 s ran out on the H200) of 40 steps each
    Check("resume", "killed with SIGKILL and resumed (not compiled, --deterministic=True)", 85, check_resume, DATA),
    Check("sample", "sample.py on the one-process run's model", 30, check_sample, ("single",)),
    Check("hellaswag", "marsgpt/hellaswag.py --data on a tiny local file", 30, check_hellaswag, ("single",)),
    # 32 s on the H200 when fused=True compiled per tensor (13.6 s of it torch.compile's first steps); now the
    # kernel's check against the default path first (three contenders, three steps each), and Triton compiles in
    # seconds (estimated)
    Check("optimizer", "MARS step (bench/bench_mars.py)", 40, check_optimizer),
    # two torchrun launches: 10 sharded steps of config/quickstart.py and a sharded save; bench_fsdp's GPT-2 small:
    # 44 s on the H200
    Check("fsdp", "FSDP2: train.py --zero_stage=3, and MARS's sharded steps", 55, check_fsdp, DATA),
    # one process start (about 20 s) and 2 rules x 4 steps of GPT-2 small, sharded and not (estimated)
    Check("mesh_of_one", "MARS-Shampoo and MARS-M sharded on one GPU vs unsharded", 30, check_mesh_of_one),
    # the first compile, cold, then 10 steps of 245,760 tokens: 142 s on the H200 (and out of its 120 s) when the
    # whole model compiled, its first step 78.5 s and first evaluation 33.8 s; train.py now compiles per block
    Check(
        "small_mars", "GPT-2 small, MARS (paper config, compiled, DDP)", 150, partial(check_compiled, SMALL_MARS), DATA
    ),
    # the same run's compile again, its cache warm: a process start and the graphs read back (the paper's trainer:
    # 22 s warm against 74.6 s cold on the H200)
    Check(
        "small_mars_warm",
        "GPT-2 small, MARS (paper config, compiled, DDP): compile, requeued elsewhere",
        45,
        partial(check_compile_warm, SMALL_MARS),
        DATA,
    ),
    Check("memory_small", "peak memory: GPT-2 small, MARS, 30 x 1024", 35, partial(check_memory, SMALL_MARS), DATA),
    Check("memory_xl", "peak memory: GPT-2 XL, MARS, 5 x 1024", 25, partial(check_memory, XL_MARS), DATA),  # 14 s
    # the attention kernels change, and with them the block's graphs: a compile of its own
    Check(
        "small_deterministic",
        "GPT-2 small, MARS, --deterministic=True (compiled, DDP)",
        120,
        partial(check_compiled, SMALL_MARS, deterministic=True),
        DATA,
    ),
    # its target is 30 s; three process starts
    Check("quickstart", "the quickstart: scripts/quickstart.sh's commands", 40, check_quickstart),
)
CHECKS_BY_NAME = {check.name: check for check in CHECKS}
# Before the device read: every module imported, a context and cuBLAS on every GPU (6 s on the H200, warm)
WARM_UP_BUDGET_S = 50
DEVICE_INFO_BUDGET_S = 10  # the worker that reads torch's version and the GPUs, warm
TIME_LIMIT_S = 14 * 60

# scripts/gpu_first10.sh: for the first minutes of a GPU, the checks that decide the most, in this order: the
# paper config on the real path (throughput, MFU, compile, graph breaks, memory against the plan, the attention
# kernel) and a relaunch's compile, MARS's kernel (fused=True) against the default path and their host syncs, FSDP2
# (its bfloat16 mixed precision, NCCL's DTensor collectives, a sharded save; the sharded steps' times), a bitwise
# resume, the quickstart. GPT-2 XL's peak memory (within 1% of the plan on the H200) and what determinism costs are
# in the full check only.
FIRST_TEN_MINUTES = ("data", "small_mars", "small_mars_warm", "optimizer", "fsdp", "resume", "quickstart")
FIRST_TEN_MINUTES_LIMIT_S = 8 * 60  # in a 10-minute lease, with time to start the machine and read the table


def budget_of(checks):
    return WARM_UP_BUDGET_S + DEVICE_INFO_BUDGET_S + sum(check.budget_s for check in checks)


TOTAL_BUDGET_S = budget_of(CHECKS)  # 830 s, within TIME_LIMIT_S; FIRST_TEN_MINUTES': 480 s


def with_needs(names, order=None):
    """The checks to run for `names`, each with the checks it needs, in the order of `order` (check names;
    default CHECKS's)."""
    order = order or tuple(CHECKS_BY_NAME)
    wanted = set()

    def add(name):
        if name not in wanted:
            wanted.add(name)
            for need in CHECKS_BY_NAME[name].needs:
                add(need)

    for name in names:
        add(name)
    return [CHECKS_BY_NAME[name] for name in sorted(wanted, key=order.index)]


def run_check(check, ctx, failed):
    """The check's rows, timed; a check that needs a failed one, or raises, is one failed row."""
    t0 = time.monotonic()
    ctx.check = check
    ctx.deadline = t0 + ctx.budget_s
    missing = [name for name in check.needs if name in failed]
    if check.cuda_only and not ctx.cuda:
        rows = [Row(check.what, "", "skipped: needs CUDA", SKIP)]
    elif missing:
        rows = [Row(check.what, "", f"not run: it needs {', '.join(missing)}, which failed", FAIL)]
    else:
        try:
            rows = check.run(ctx)
        except Exception as e:  # one broken check must not hide the others' rows
            with open(ctx.log, "a", encoding="utf-8") as log:
                traceback.print_exc(file=log)
            rows = [Row(check.what, "", f"{type(e).__name__}: {e}", FAIL)]
    for row in rows:
        row.check, row.seconds = check.name, time.monotonic() - t0
    return rows


# ---------------------------------------------------------------------------------------------------
# The command line.


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_args(argv):
    names = ", ".join(CHECKS_BY_NAME)
    p = ArgumentParser(
        prog="scripts/gpu_check.sh",
        description="Check the repository on this node's GPUs and print one table (docs/gpu.md).",
        epilog=f"checks, in order: {names}; --first10: {', '.join(FIRST_TEN_MINUTES)}",
    )
    p.add_argument("--out", help="folder for gpu_check.md, gpu_check.json and logs/ (default out-gpu-check)")
    selection = p.add_mutually_exclusive_group()
    selection.add_argument("--only", nargs="+", metavar="CHECK", help="run these checks (and those they need) only")
    first10_help = "the checks that decide the most, for a GPU's first minutes (scripts/gpu_first10.sh)"
    selection.add_argument("--first10", action="store_true", help=first10_help)
    cpu_help = "cpu: run the plumbing on tiny models without a GPU (a test; the numbers mean nothing)"
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=cpu_help)
    args = p.parse_args(argv)
    unknown = [name for name in args.only or () if name not in CHECKS_BY_NAME]
    if unknown:
        raise UsageError(f"no check named {', '.join(unknown)}; the checks are: {names}")
    args.out = args.out or ("out-gpu-first10" if args.first10 else "out-gpu-check")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out {args.out} is a file; give a folder (it is created if missing)")
    return args


def cuda_available():
    import torch

    return torch.cuda.is_available()


def git_commit():
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        changes = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "unknown (no git)"
    if commit.returncode:
        return "unknown (not a git checkout)"
    return commit.stdout.strip() + (" with local changes" if changes.stdout.strip() else "")


def describe_device(ctx, info):
    if not ctx.cuda:
        return (
            f"cpu (--device=cpu: tiny models, a test of the plumbing; the numbers mean nothing), torch {info['torch']}"
        )
    return (
        f"{info['gpus']} x {info['name']} ({info['memory_bytes'] / GIB:.1f} GiB, bf16 "
        f"{'yes' if info['bf16'] else 'no'}), torch {info['torch']}, CUDA {info['cuda']}"
    )


def warm_up(work, logs, budget_s):
    """The warm-up worker, before the device read and the checks, as the table's first row; a warm-up that
    fails or runs out of time is a failed row, and the checks still run."""
    path, t0 = os.path.join(work, "warm.json"), time.monotonic()
    argv = [sys.executable, *WORKER, "warm", path]
    finished = run_command(argv, os.path.join(logs, "warm.log"), budget_s)
    what = "warm-up: the modules imported, a CUDA context and cuBLAS on every GPU"
    command = short_command(argv, work)
    if finished.ok:
        result = read_json(path)
        text = f"{result['seconds']:.1f} s ({result['import_s']:.1f} s importing), on {', '.join(result['devices'])}"
        row = Row(what, command, text, PASS, result)
    else:
        row = Row(what, command, failure(finished, budget_s), FAIL)
    row.check, row.seconds = "warm", time.monotonic() - t0
    return row


def read_device_info(work, logs, budget_s):
    """torch's versions and the GPUs, read in a worker (the driver itself never touches a GPU)."""
    path = os.path.join(work, "device.json")
    finished = run_command([sys.executable, *WORKER, "device", path], os.path.join(logs, "device.log"), budget_s)
    if not finished.ok:
        raise RuntimeError(f"reading the device failed: {failure(finished, budget_s)}")
    return read_json(path)


def main(argv=None):
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not cuda_available():
        advice = "run it on a GPU node (or --device=cpu to test its plumbing on tiny models)"
        print(f"error: gpu_check needs a CUDA GPU and torch sees none; {advice}", file=sys.stderr)
        return 2
    selected = FIRST_TEN_MINUTES if args.first10 else args.only or CHECKS_BY_NAME
    checks = with_needs(selected, FIRST_TEN_MINUTES if args.first10 else None)
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    for name in ["warm", "device", *CHECKS_BY_NAME]:  # last time's logs would be appended to
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(logs, f"{name}.log"))
    factor = 1 if args.device == "cuda" else CPU_BUDGET_FACTOR
    title = "GPU check: the first ten minutes" if args.first10 else "GPU check"
    t0, failed = time.monotonic(), set()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        rows = [warm_up(work, logs, WARM_UP_BUDGET_S * factor)]
        try:
            info = read_device_info(work, logs, DEVICE_INFO_BUDGET_S * factor)
        except (RuntimeError, OSError, ValueError) as e:
            print(f"error: {e} (see {os.path.join(logs, 'device.log')})", file=sys.stderr)
            return 1
        ctx = Context(device=args.device, work=work, logs=logs)
        ctx.gpus = max(1, info["gpus"]) if ctx.cuda else 1
        header = dict(
            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            device=describe_device(ctx, info),
            commit=git_commit(),
            budget=f"{budget_of(checks)} s" + (" (--first10)" if args.first10 else ""),
        )
        write_report(args.out, header, rows, 0, len(checks), 0, title)
        for done, check in enumerate(checks, 1):
            check_rows = run_check(check, ctx, failed)
            rows += check_rows
            if any(row.status == FAIL for row in check_rows):
                failed.add(check.name)
            statuses = ", ".join(row.status for row in check_rows)
            print(f"gpu_check: {check.name}: {statuses} ({check_rows[0].seconds:.0f} s)", file=sys.stderr, flush=True)
            header = write_report(args.out, header, rows, done, len(checks), time.monotonic() - t0, title)
    print(render_markdown(header, rows, title), end="")
    print(f"written: {os.path.join(args.out, 'gpu_check.md')}, gpu_check.json, logs/", file=sys.stderr)
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
