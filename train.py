"""Pretrain GPT-2 with MARS (or AdamW / Muon): nanoGPT's training loop as small functions main() composes.

    python train.py [config/a.py ...] [--key=value ...]              # one process: CPU or one GPU
    torchrun --standalone --nproc_per_node=8 train.py config/...     # DDP on one node
    python train.py --help                                           # every key

This file is the loop: one optimizer step, evaluation and the train line, fit and main(). What the loop holds does
its own work. launch.setup checks the configuration, the data, the world size, out_dir and any checkpoint before
any work starts (a mistake prints `error: ...` and exits 2, on every rank at once) and builds the run (launch.Run):
the optimizer (training_optimizer.TrainingOptimizer: the schedule, exact MARS's look-ahead, the state norms), the
parallelism (parallel.Parallelism: DDP, ZeRO-1 or FSDP2 / HSDP, which wraps the model and says how gradients and
evaluations sync) and the run directory (run_dir.RunDir: out_dir, the checkpoints of the parts setup hands it,
the requests that stop a run early).

gradient_accumulation_steps counts the micro-batches of one optimizer step across ALL ranks. Micro-batch k of
step s is TokenData.get_batch(seed, s, k) wherever it runs; rank r takes k = r, r + world_size, ... . So the
windows, and up to float rounding the model, do not depend on the number of GPUs, and a run can resume on a
different number of GPUs. Exact resume: checkpoints are written at step boundaries, holding everything the next
steps depend on; batches and dropout masks are pure functions of (seed, step, micro-batch); evaluation windows
are fixed. A run killed at any moment and restarted with --init_from=resume ends with the same losses and
parameters as one left alone (bit for bit on CPU; on CUDA with --deterministic=True, runtime.set_deterministic).
"""

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from marsgpt import exits, launch, memory_plan, metrics
from marsgpt.compile_cache import compile_counts
from marsgpt.config import load_config, print_help
from marsgpt.config_schema import wants_help
from marsgpt.launch import Progress, Run, setup
from marsgpt.metrics import LogWindow
from marsgpt.run_dir import RunStopped
from marsgpt.runtime import exit_process, leave_process_group, setup_distributed
from marsgpt.stop_signals import StopSignals

# The steps after which a CUDA run prints its measured peak memory beside the plan: by then the optimizer
# state exists and a step has run with it.
MEMORY_REPORT_STEP = 2


# ---------------------------------------------------------------------------------------------------
# One optimizer step.


def to_device(x: torch.Tensor, y: torch.Tensor, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.device(device).type == "cuda":  # pinned memory lets the copy overlap the running kernels
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def dropout_seed(seed: int, step: int, micro_step: int) -> int:
    """Dropout masks, like the windows, depend only on (seed, step, micro-batch): not on rank or resume."""
    return int(np.random.SeedSequence([seed, step, micro_step, 2]).generate_state(1)[0])


def forward_backward(run: Run, step: int) -> torch.Tensor:
    """Accumulate this rank's gradients for step `step`; return its mean micro-batch loss (a tensor).

    Each loss is divided by this rank's number of micro-batches and DDP (or FSDP2) averages across ranks, so
    the gradient is the mean over all gradient_accumulation_steps micro-batches, times grad_multiplier (the
    paper's gradient scale, see marsgpt/config.py; the returned loss stays the mean). The gradients are reduced
    across ranks only in the last micro-batch's backward (Parallelism.gradients_stay_local before it). Nothing
    here waits for the device.
    """
    cfg, info = run.cfg, run.dist
    micro_steps = range(info.rank, cfg.gradient_accumulation_steps, info.world_size)
    loss_sum = torch.zeros((), device=info.device)

    def fetch(k):
        x, y = run.train_data.get_batch(cfg.seed, step, k, cfg.batch_size, cfg.block_size, cfg.windows_per_stream)
        return to_device(x, y, info.device)

    x, y = fetch(micro_steps[0])
    for i, k in enumerate(micro_steps):
        last = i == len(micro_steps) - 1
        with contextlib.nullcontext() if last else run.parallel.gradients_stay_local(run.train_model):
            if cfg.dropout > 0:
                torch.manual_seed(dropout_seed(cfg.seed, step, k))
            with run.autocast:
                # only the loss: the (micro-batch, block, vocabulary) logits never exist (model.cross_entropy_in_chunks)
                loss = run.train_model(x, y, return_logits=False)[1] / len(micro_steps)
            if not last:
                x, y = fetch(micro_steps[i + 1])  # while the device works on this forward
            run.optimizer.scale(loss * cfg.grad_multiplier).backward()
        loss_sum += loss.detach()
    return loss_sum


def clip_gradients(run: Run) -> torch.Tensor:
    """The global gradient norm before clipping (a tensor); clips to grad_clip when it is > 0. Under FSDP2 the
    norm of the sharded gradients takes one all-reduce of the shards' sums of squares."""
    params = [p for p in run.model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if run.cfg.grad_clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, run.cfg.grad_clip, norm)
    return run.parallel.full_tensor(norm)


@dataclasses.dataclass
class StepResult:
    loss: torch.Tensor  # this rank's mean loss over the step's micro-batches
    grad_norm: float  # pre-clip global norm
    skipped: bool  # non-finite loss or gradient: nothing changed
    clipped: bool
    non_finite: str = ""  # when skipped: which norm, e.g. "look-ahead gradient norm nan" (exact MARS)


def train_step(run: Run, it: int) -> StepResult:
    """Optimizer step `it`: gradients of its micro-batches, clipping, and the update.

    With a look-ahead (exact MARS: training_optimizer.TrainingOptimizer.look_ahead) the NEXT step's batch goes first, at
    the current parameters, and its clipped gradient is kept before this step's own backward pass.

    A non-finite gradient norm (from a non-finite loss, or an overflow) skips the update: parameters,
    optimizer state and MARS's last gradient stay as they were. The decision uses the all-reduced norm,
    so every rank takes the same one. The norms are read from the device once per step, and the ranks' requests for
    the next step boundary (a signal, a save the clock asks for: run_dir.RunDir.requests) are agreed on the way
    (parallel.Parallelism.read_agreed).
    """
    cfg, optimizer = run.cfg, run.optimizer
    optimizer.set_lr(it)
    norms = []
    if optimizer.look_ahead is not None:
        forward_backward(run, it + 1)
        optimizer.unscale(look_ahead=True)
        norms.append(clip_gradients(run))
        optimizer.keep_look_ahead_gradient()
        optimizer.zero_grad()
    loss = forward_backward(run, it)
    optimizer.unscale()
    norms.append(clip_gradients(run))
    norm_values, agreed = run.parallel.read_agreed(torch.stack(norms), run.directory.requests())  # the step's sync
    run.directory.agree(agreed)
    grad_norm = norm_values[-1]
    skipped = not all(math.isfinite(n) for n in norm_values)
    if skipped:
        optimizer.skip(own_gradient_finite=math.isfinite(grad_norm))
    else:
        optimizer.step()
    optimizer.zero_grad()
    clipped = not skipped and cfg.grad_clip > 0 and grad_norm > cfg.grad_clip
    non_finite = non_finite_norms(norm_values) if skipped else ""
    return StepResult(loss=loss, grad_norm=grad_norm, skipped=skipped, clipped=clipped, non_finite=non_finite)


def non_finite_norms(norm_values: list[float]) -> str:
    """e.g. 'look-ahead gradient norm nan, gradient norm inf': the norms of a skipped step that are not finite."""
    names = ["look-ahead gradient", "gradient"][-len(norm_values) :]
    return ", ".join(f"{name} norm {n}" for name, n in zip(names, norm_values) if not math.isfinite(n))


# ---------------------------------------------------------------------------------------------------
# Evaluation and the train line.


@torch.no_grad()
def evaluate(run: Run, batches: list) -> float:
    """Mean loss over the fixed windows (`batches` is this rank's share of cfg.eval_iters of them). Under FSDP2
    every forward pass is a collective (its all-gathers), so a rank with one window fewer than others runs one
    more pass, on zeros, whose loss it does not count."""
    cfg = run.cfg
    run.model.eval()
    loss_sum = torch.zeros((), device=run.dist.device)
    missing = run.parallel.evaluation_padding(len(batches), cfg.eval_iters)
    zeros = torch.zeros(cfg.batch_size, cfg.block_size, dtype=torch.long)
    for i, (x, y) in enumerate([*batches, *[(zeros, zeros)] * missing]):
        x, y = to_device(x, y, run.dist.device)
        with run.autocast:
            _, loss = run.model(x, y, return_logits=False)
        if i < len(batches):
            loss_sum += loss.float()
    run.model.train()
    return run.parallel.all_reduce_sum(loss_sum).item() / run.cfg.eval_iters


def axes(progress: Progress, time_s: float) -> dict:
    """The x axes of a record made at this step boundary."""
    return metrics.record_axes(progress.iter_num, progress.tokens, time_s)


def step_mfu(run: Run, step_s: float) -> tuple[float | None, float | None]:
    """(PaLM's, llm.c's) model FLOPs utilisation of steps of step_s seconds each (model.GPT.flops_per_token), or
    None each off a GPU of known peak. Exact MARS's look-ahead adds a forward and backward pass per step."""
    passes = 2 if run.optimizer.look_ahead is not None else 1
    tokens_per_rank = run.tokens_per_step // run.dist.world_size * passes
    return tuple(run.model.estimate_mfu(tokens_per_rank, step_s, convention) for convention in ("palm", "llm.c"))


def log_train(run: Run, progress: Progress, window: LogWindow, result: StepResult, time_s: float) -> None:
    """A train line (metrics.TrainLine): the mean loss of the window's steps, the parameters' norm and the
    optimizer's state norms -- each a collective every rank joins where the run makes it one (the parallelism's
    all-reduce, FSDP2's and the sharded state's norms)."""
    loss = window.mean_loss(run.parallel.all_reduce_sum)
    state_norms = run.optimizer.state_norms()
    param_norm = run.parallel.parameter_norm(run.model)
    if not run.dist.is_master:
        return
    step_s = (time.perf_counter() - window.t0) / window.steps
    values = torch.stack([v.float() for v in (loss, param_norm, *state_norms.values())]).tolist()
    line = metrics.TrainLine(
        at=axes(progress, time_s),
        loss=values[0],
        lr=run.optimizer.lr,
        grad_norm=result.grad_norm,
        clip_rate=progress.clip_count / progress.iter_num,
        param_norm=values[1],
        skipped_steps=progress.skipped_steps,
        tokens_per_sec=run.tokens_per_step / step_s,
        step_s=step_s,
        mfu=step_mfu(run, step_s),
        state_norms=dict(zip(state_norms, values[2:])),
    )
    print(line.text(window.progress(progress.iter_num, run.cfg.max_iters)), flush=True)
    run.metrics.write(line.record())


def evaluations_due(run: Run, it: int) -> tuple[bool, bool]:
    """(the losses, HellaSwag): which evaluations are due at step boundary `it`. The validation and train-estimate
    losses every eval_interval steps, at the end and for eval_only (at once); HellaSwag every hellaswag_interval
    steps, when the run has its examples (not for eval_only)."""
    cfg = run.cfg
    losses = cfg.eval_only or it % cfg.eval_interval == 0 or it == cfg.max_iters
    hellaswag = bool(run.hellaswag_examples) and it % cfg.hellaswag_interval == 0 and not cfg.eval_only
    return losses, hellaswag


def evaluate_all(run: Run, progress: Progress, time_s: float, losses: bool, hellaswag: bool) -> float | None:
    """The evaluations due at progress.iter_num (evaluations_due: `losses`, `hellaswag`). Each is recorded once: an
    evaluation its step already has in metrics.jsonl (an eval_only relaunch) is printed, not recorded again.
    Returns the validation loss, or None when it was not due."""
    it, master = progress.iter_num, run.dist.is_master
    record, val_loss = progress.evaluated_iter != it, None
    if losses:
        t0 = time.perf_counter()
        val_loss = evaluate(run, run.val_batches)
        train_loss = evaluate(run, run.train_batches)
        eval_s = time.perf_counter() - t0  # a compiled model's first evaluation includes compiling its graph
        if master:
            print(f"step {it}: train loss {train_loss:.4f}, val loss {val_loss:.4f}", flush=True)
            entry = {**axes(progress, time_s), metrics.VAL_LOSS: val_loss, metrics.EVAL_TRAIN_LOSS: train_loss}
            if run.compiled:
                entry[metrics.EVAL_S] = eval_s
            if record:
                run.metrics.write(entry)
    if hellaswag:
        from marsgpt import hellaswag as benchmark  # here: its data and tokenizer are loaded only when asked for

        info = run.dist
        result = benchmark.evaluate(
            run.model,
            run.hellaswag_examples,
            info.device,
            rank=info.rank,
            world_size=info.world_size,
            ctx=run.autocast,
            lockstep=run.parallel.lockstep,
        )
        if master:
            print(
                f"step {it}: hellaswag acc_norm {result['acc_norm']:.4f} (lm-eval's, per character), "
                f"acc {result['acc']:.4f}, acc_norm_tokens {result['acc_norm_tokens']:.4f} (n={result['n']})",
                flush=True,
            )
            run.metrics.write({**axes(progress, time_s), metrics.HELLASWAG: result["acc_norm"]})
    progress.evaluated_iter = it
    return val_loss


# ---------------------------------------------------------------------------------------------------
# The loop.


def fit(run: Run, progress: Progress) -> None:
    """Train from progress.iter_num to max_iters: the evaluations due at each step boundary (evaluate_all), the
    checkpoints run_dir says are due there, and an early end when it says so (a signal, a failed write); on a GPU,
    after step MEMORY_REPORT_STEP, the measured peak memory beside the plan."""
    cfg, directory = run.cfg, run.directory
    start_iter, start_elapsed, t_start = progress.iter_num, progress.elapsed_s, time.perf_counter()

    def time_s():
        return start_elapsed + time.perf_counter() - t_start

    while True:
        it = progress.iter_num
        directory.check_requests(progress, time_s())
        losses_due, hellaswag_due = evaluations_due(run, it)
        val_loss = None
        if cfg.eval_only or ((losses_due or hellaswag_due) and progress.evaluated_iter != it):
            val_loss = evaluate_all(run, progress, time_s(), losses_due, hellaswag_due)
            run.window.restart()
            if cfg.eval_only:
                break
        directory.save_if_due(progress, time_s(), val_loss)
        if it >= cfg.max_iters:
            break
        step_and_log(run, progress, run.window, time_s, first=it == start_iter)
        if progress.iter_num == MEMORY_REPORT_STEP and run.memory_plan and run.dist.device_type == "cuda":
            print(memory_plan.measured_peak(run.memory_plan, MEMORY_REPORT_STEP), flush=True)


def step_and_log(
    run: Run, progress: Progress, window: LogWindow, time_s: Callable[[], float], first: bool = False
) -> None:
    """Optimizer step progress.iter_num, its bookkeeping, and a train line every log_interval steps. With a
    compiled model, the first step of a process (`first`) is timed on its own: it includes the compile, whose
    graphs it counts (compiled, or found in the compile cache)."""
    t0 = time.perf_counter()
    result = train_step(run, progress.iter_num)
    progress.iter_num += 1
    progress.tokens += run.tokens_per_step
    progress.clip_count += result.clipped
    window.add(result.loss, result.skipped)
    if first and run.compiled and run.dist.is_master:
        first_step = {metrics.FIRST_STEP_S: time.perf_counter() - t0, **compile_counts()}
        run.metrics.write({**axes(progress, time_s()), **first_step})
    if result.skipped:
        record_skip(run, progress, result, time_s())
    else:
        progress.bad_steps = 0
    if progress.iter_num % run.cfg.log_interval == 0:
        log_train(run, progress, window, result, time_s())
        window.restart()


def record_skip(run: Run, progress: Progress, result: StepResult, time_s: float) -> None:
    """A skipped step's line and record, and the divergence rule: after max_bad_steps of them in a row the run stops
    (RunStopped, status 1) naming the newest checkpoint -- one from before the trouble, since none is written while
    steps are skipped (checkpointer.Checkpointer.suspect)."""
    progress.bad_steps += 1
    progress.skipped_steps += 1
    if run.dist.is_master:
        print(
            f"iter {progress.iter_num}: non-finite loss or {result.non_finite}; step skipped "
            f"({progress.bad_steps} in a row, {progress.skipped_steps} in the run)",
            flush=True,
        )
        run.metrics.write({**axes(progress, time_s), metrics.SKIPPED_STEPS: progress.skipped_steps})
    if progress.bad_steps < run.cfg.max_bad_steps:
        return
    checkpoints, lr = run.directory.checkpoints, run.cfg.learning_rate
    checkpoints.wait()  # the checkpoint named is on disk
    if checkpoints.latest is not None:
        advice = (
            f"The newest checkpoint, written before the trouble, is {checkpoints.newest()}: resume it with "
            f"--init_from=resume and a lower learning_rate (now {lr}; auto resumes it too, counting bad steps anew)"
        )
    else:
        advice = f"No checkpoint was written before the trouble: start over with a lower learning_rate (now {lr})"
    line = (
        f"error: {progress.bad_steps} consecutive steps (up to iter {progress.iter_num}) had a non-finite loss or "
        f"gradient norm (max_bad_steps={run.cfg.max_bad_steps}); stopped. {advice}, or check the data"
    )
    raise RunStopped(1, line if run.dist.is_master else None)


# ---------------------------------------------------------------------------------------------------
# main(): one run, and the exit status of whatever ended it.


def main(argv: list[str] | None = None, signals: StopSignals | None = None) -> int:
    """Train as `argv` (train.py's arguments) configures; the exit status (exits.exit_status: the one line on
    stderr and the status of whatever ended the run). `signals`: the StopSignals the caller installed and keeps
    (the command line's, until the process exits: a signal that arrives as it ends is answered, not fatal); by
    default main installs its own and puts the previous handlers back as it returns."""
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print_help()
        return 0
    own_signals = signals is None
    signals = StopSignals().install() if own_signals else signals
    cfg = dist_info = directory = progress = status = None
    try:
        cfg = load_config(argv)
        if cfg.dry_run:
            return memory_plan.dry_run(cfg)
        dist_info = setup_distributed(cfg)
        directory = launch.open_directory(cfg, dist_info, signals, argv)
        run, progress, _ = setup(cfg, dist_info, directory)
        if dist_info.is_master:
            launch.describe(run, progress, cfg)
        fit(run, progress)
        status = directory.finish(progress)
    except BaseException as e:
        status = exits.exit_status(e, cfg, dist_info, directory, progress)
        if status is None:
            raise
    finally:
        if directory is not None:
            directory.close()  # the checkpoint in flight on disk, the lock released
        leave_process_group(dist_info, timed_out=status == exits.TIMED_OUT)
        if own_signals:
            signals.restore()
    return status


def cli() -> None:
    """`python train.py ...`: main with the stop signals taken over until the process exits."""
    signals = StopSignals().install()
    status = main(sys.argv[1:], signals)
    signals.ignore_from_now()
    exit_process(status)


if __name__ == "__main__":
    cli()
