"""Pretrain GPT-2 with MARS (or AdamW / Muon): nanoGPT's training loop as small functions main() composes.

    python train.py [config/a.py ...] [--key=value ...]              # one process: CPU or one GPU
    torchrun --standalone --nproc_per_node=8 train.py config/...     # DDP on one node
    python train.py --help                                           # every key

The configuration (marsgpt/config.py) is checked, and so are the data, the world size, out_dir and any
checkpoint, before any work starts; a mistake prints `error: ...` and exits 2, on every rank at once.
What init_from, resume and relaunch mean for out_dir, when a checkpoint is written and what stops a run
early (a signal, a failed write) is marsgpt/run_dir.py's; this file is the run: its state, one optimizer
step, evaluation, the loop and main().

Data parallelism: DDP (zero_stage 0), ZeRO-1 (1: the optimizer state sharded) or FSDP2 / HSDP (3: parameters,
gradients and optimizer state sharded, marsgpt/fsdp.py). gradient_accumulation_steps counts the micro-batches
of one optimizer step across ALL ranks. Micro-batch k of step s is TokenData.get_batch(seed, s, k) wherever it
runs; rank r takes k = r, r + world_size, ... . So the windows, and up to float rounding the model, do not
depend on the number of GPUs, and a run can resume on a different number of GPUs.

Exact resume: checkpoints are written at step boundaries, holding everything the next steps depend on (the
parts setup hands to the run directory), including which evaluations of their step are done; batches and
dropout masks are pure functions of (seed, step, micro-batch); evaluation windows are fixed. A run killed at any moment
and restarted with --init_from=resume ends with the same losses and parameters as one left alone (bit for
bit on CPU; on CUDA with --deterministic=True, see runtime.set_deterministic).
"""

import contextlib
import dataclasses
import math
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from marsgpt import checkpoint, launch, memory_plan, metrics
from marsgpt.checkpoint import RNGState
from marsgpt.config import config_to_dict, load_config, print_help, wants_help
from marsgpt.launch import USER_ERRORS
from marsgpt.memory_plan import MemoryPlan
from marsgpt.metrics import LogWindow, MetricsLog
from marsgpt.optimizers import OPTIMIZERS, TrainingOptimizer, build_optimizer
from marsgpt.parallel import Parallelism
from marsgpt.run_dir import RunDir, RunStopped, StopSignals
from marsgpt.runtime import (
    SetupError,
    agree,
    exit_process,
    resolve_compile,
    resolve_dtype,
    set_deterministic,
    setup_distributed,
    setup_precision,
)
from marsgpt.tokens import TokenData


@dataclasses.dataclass
class Progress(checkpoint.DataclassState):
    """What the loop carries from step to step (a checkpoint part)."""

    iter_num: int = 0  # also the data's position: batches are a function of the step
    evaluated_iter: int = -1  # the step whose evaluations are done and recorded (the metrics' cursor)
    best_val_loss: float = math.inf
    tokens: int = 0
    elapsed_s: float = 0.0
    bad_steps: int = 0  # consecutive skipped steps
    skipped_steps: int = 0
    clip_count: int = 0
    wandb_run_id: str = ""

    def load_state_dict(self, state):
        super().load_state_dict(state)
        if "evaluated_iter" not in state:  # written before the field: always right after its step's evaluation
            self.evaluated_iter = self.iter_num
        self.bad_steps = 0  # a resume (with a lower learning rate, say) starts with a clean count


# The steps after which a CUDA run prints its measured peak memory beside the plan: by then the optimizer
# state exists and a step has run with it.
MEMORY_REPORT_STEP = 2


@dataclasses.dataclass
class Run:
    """The objects one training run is built from."""

    cfg: object
    dist: object  # runtime.Dist
    parallel: Parallelism  # how the run is spread over its ranks: DDP, ZeRO-1 or FSDP2
    model: torch.nn.Module  # the GPT (its blocks compiled, under FSDP2 sharded, in place): what evaluation runs
    train_model: torch.nn.Module  # what the training forward goes through: the model, or DDP's wrapper of it
    compiled: bool  # torch.compile: each block and the loss (model.GPT.compile_blocks)
    model_args: dict
    optimizer: TrainingOptimizer
    scaler: torch.amp.GradScaler
    autocast: object
    train_data: TokenData
    val_batches: list  # this rank's share of the fixed evaluation windows
    train_batches: list
    hellaswag_examples: list | None
    metrics: MetricsLog
    window: LogWindow  # the steps since the last train line
    directory: RunDir
    memory_plan: MemoryPlan | None = None  # rank 0's, printed by launch.describe()

    @property
    def tokens_per_step(self):
        return self.cfg.batch_size * self.cfg.gradient_accumulation_steps * self.cfg.block_size


def setup(cfg, dist_info, directory=None):
    """(Run, Progress, resumed): everything checked and built, and a resumed run's every part restored, before the
    first change to out_dir (`directory`, a run_dir.RunDir, held; main's handles the stop signals); nothing
    trained yet."""
    parallel = Parallelism.of(cfg, dist_info)
    directory = directory or RunDir(cfg, dist_info)
    train_data, val_data, vocab_size = agree(dist_info, lambda: launch.load_data(cfg), USER_ERRORS)
    cfg, start, ckpt = launch.resolve_run(cfg, dist_info, directory, train_data.vocabulary, parallel)
    hellaswag_examples = launch.setup_hellaswag(cfg, train_data, dist_info)
    model, model_args = agree(dist_info, lambda: launch.build_model(cfg, vocab_size, ckpt), USER_ERRORS)
    set_deterministic(cfg.deterministic, dist_info.device_type)
    model.to(dist_info.device)
    model.activation_checkpointing = cfg.activation_checkpointing
    autocast, scaler = setup_precision(cfg.dtype, dist_info.device_type)
    compile_model = resolve_compile(cfg.compile, dist_info.device_type)
    run = Run(
        cfg=cfg,
        dist=dist_info,
        parallel=parallel,
        model=model,
        train_model=parallel.wrap(model, compile_model, resolve_dtype(cfg.dtype, dist_info.device_type)),
        compiled=compile_model,
        model_args=model_args,
        optimizer=build_optimizer(model, cfg, parallel),
        scaler=scaler,
        autocast=autocast,
        train_data=train_data,
        val_batches=launch.eval_windows(cfg, val_data, dist_info),
        train_batches=launch.eval_windows(cfg, train_data, dist_info),
        hellaswag_examples=hellaswag_examples,
        metrics=None,
        window=LogWindow(
            device=dist_info.device,
            rank=dist_info.rank,
            world_size=dist_info.world_size,
            gather=launch.gather_by_rank(dist_info),
        ),
        directory=directory,
        memory_plan=memory_plan.plan_memory(cfg, dist_info, model_args) if dist_info.is_master else None,
    )
    progress = Progress()
    # What a checkpoint holds: each stateful part, restored by its own load_state_dict (checkpoint.ModelState's
    # places the weights as the parallelism keeps them), and the values every checkpoint records beside them.
    parts = dict(
        model=checkpoint.ModelState(model, parallel.place_state, checkpoint.checkpoint_path(cfg.out_dir)),
        optimizer=run.optimizer,
        scaler=checkpoint.ScalerState(scaler),
        rng=RNGState(dist_info.rank, dist_info.world_size, launch.gather_rng(dist_info)),
        progress=progress,
        log_window=run.window,
    )
    extras = dict(model_args=model_args, config=config_to_dict(cfg), vocabulary=train_data.vocabulary)
    directory.register(cfg, parts, extras, parallel)
    if ckpt is not None:
        agree(dist_info, lambda: directory.restore(ckpt, start.path), USER_ERRORS)
    if dist_info.is_master:
        changes = launch.config_changes(ckpt["config"], cfg, OPTIMIZERS) if ckpt else []
        directory.prepare(cfg, start, ckpt, changes)
    run.metrics = directory.metrics = launch.open_metrics(cfg, dist_info, progress, start, ckpt)
    return run, progress, ckpt is not None


# ---------------------------------------------------------------------------------------------------
# One optimizer step.


def to_device(x, y, device):
    if torch.device(device).type == "cuda":  # pinned memory lets the copy overlap the running kernels
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def dropout_seed(seed, step, micro_step):
    """Dropout masks, like the windows, depend only on (seed, step, micro-batch): not on rank or resume."""
    return int(np.random.SeedSequence([seed, step, micro_step, 2]).generate_state(1)[0])


def forward_backward(run, step):
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
            run.scaler.scale(loss * cfg.grad_multiplier).backward()
        loss_sum += loss.detach()
    return loss_sum


def clip_gradients(run):
    """The global gradient norm before clipping (a tensor); clips to grad_clip when it is > 0. Under FSDP2 the
    norm of the sharded gradients takes one all-reduce of the shards' sums of squares."""
    params = [p for p in run.model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if run.cfg.grad_clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, run.cfg.grad_clip, norm)
    return run.parallel.whole(norm)


@dataclasses.dataclass
class StepResult:
    loss: torch.Tensor  # this rank's mean loss over the step's micro-batches
    grad_norm: float  # pre-clip global norm
    skipped: bool  # non-finite loss or gradient: nothing changed
    clipped: bool
    non_finite: str = ""  # when skipped: which norm, e.g. "look-ahead gradient norm nan" (exact MARS)


def train_step(run, it):
    """Optimizer step `it`: gradients of its micro-batches, clipping, and the update.

    With a look-ahead (exact MARS: optimizers.TrainingOptimizer.look_ahead) the NEXT step's batch goes first, at
    the current parameters, and its clipped gradient is kept before this step's own backward pass.

    A non-finite gradient norm (from a non-finite loss, or an overflow) skips the update: parameters,
    optimizer state and MARS's last gradient stay as they were. The decision uses the all-reduced norm,
    so every rank takes the same one. This reads the norms from the device once per step, and the ranks'
    agreed requests (a signal, a save the clock asks for: run_dir.RunDir.with_requests) come with them.
    """
    cfg, optimizer, scaler = run.cfg, run.optimizer, run.scaler
    optimizer.set_lr(it)
    norms = []
    if optimizer.look_ahead is not None:
        forward_backward(run, it + 1)
        optimizer.unscale(scaler, look_ahead=True)
        norms.append(clip_gradients(run))
        optimizer.keep_look_ahead_gradient()
        optimizer.zero_grad()
    loss = forward_backward(run, it)
    optimizer.unscale(scaler)
    norms.append(clip_gradients(run))
    directory = run.directory  # the ranks' agreed requests (a signal, the checkpoint clock) come with the read
    norm_values = directory.receive(directory.with_requests(torch.stack(norms)).tolist())  # the per-step sync
    grad_norm = norm_values[-1]
    skipped = not all(math.isfinite(n) for n in norm_values)
    if skipped:
        optimizer.skip(scaler, own_gradient_finite=math.isfinite(grad_norm))
    else:
        optimizer.step(scaler)
    optimizer.zero_grad()
    clipped = not skipped and cfg.grad_clip > 0 and grad_norm > cfg.grad_clip
    non_finite = non_finite_norms(norm_values) if skipped else ""
    return StepResult(loss=loss, grad_norm=grad_norm, skipped=skipped, clipped=clipped, non_finite=non_finite)


def non_finite_norms(norm_values):
    """e.g. 'look-ahead gradient norm nan, gradient norm inf': the norms of a skipped step that are not finite."""
    names = ["look-ahead gradient", "gradient"][-len(norm_values) :]
    return ", ".join(f"{name} norm {n}" for name, n in zip(names, norm_values) if not math.isfinite(n))


# ---------------------------------------------------------------------------------------------------
# Evaluation, checkpoints, metrics.


@torch.no_grad()
def evaluate(run, batches):
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


def stamp(progress, time_s):
    """The x axes every metrics record carries."""
    return {metrics.ITER: progress.iter_num, metrics.TOKENS: progress.tokens, metrics.TIME_S: time_s}


def step_mfu(run, step_s):
    """(PaLM's, llm.c's) model FLOPs utilisation of steps of step_s seconds each (model.GPT.flops_per_token), or
    None each off a GPU of known peak. Exact MARS's look-ahead adds a forward and backward pass per step."""
    passes = 2 if run.optimizer.look_ahead is not None else 1
    tokens_per_rank = run.tokens_per_step // run.dist.world_size * passes
    return tuple(run.model.estimate_mfu(tokens_per_rank, step_s, convention) for convention in ("palm", "llm.c"))


def log_train(run, progress, window, result, time_s):
    """A train line: mean loss of the window's steps (all ranks take part in its all-reduce), and the norms
    the optimizer logs (its registry entry's state_norms)."""
    loss = None
    if window.losses:
        loss = run.parallel.all_reduce_sum(window.loss_sum / window.losses) / run.dist.world_size
    state_norms, param_norm = run.optimizer.state_norms(), None  # a collective where the state is sharded
    if run.parallel.norms_are_collective or run.dist.is_master:
        param_norm = run.parallel.whole(torch.nn.utils.get_total_norm(list(run.model.parameters())))
    if not run.dist.is_master:
        return
    cfg = run.cfg
    dt = (time.perf_counter() - window.t0) / window.steps
    if loss is None:
        loss = torch.full((), math.nan, device=run.dist.device)
    values = torch.stack([v.float() for v in (loss, param_norm, *state_norms.values())]).tolist()
    mfu, mfu_llmc = step_mfu(run, dt)
    record = {
        **stamp(progress, time_s),
        metrics.TRAIN_LOSS: values[0],
        metrics.LR: run.optimizer.lr,
        metrics.GRAD_NORM: result.grad_norm,
        metrics.CLIP_RATE: progress.clip_count / progress.iter_num,
        metrics.TOKENS_PER_SEC: run.tokens_per_step / dt,
        metrics.STEP_MS: dt * 1000,
        metrics.MFU: None if mfu is None else mfu * 100,
        metrics.MFU_LLMC: None if mfu_llmc is None else mfu_llmc * 100,
        metrics.PARAM_NORM: values[1],
        metrics.SKIPPED_STEPS: progress.skipped_steps,
        **dict(zip(state_norms, values[2:])),
    }
    mfu_text = "" if mfu is None else f", mfu {mfu * 100:.1f}% (llm.c's count {mfu_llmc * 100:.1f}%)"
    print(
        f"iter {progress.iter_num}: loss {values[0]:.4f}, lr {record[metrics.LR]:.3e}, "
        f"grad_norm {result.grad_norm:.3f}, {dt * 1000:.1f} ms/step, "
        f"{record[metrics.TOKENS_PER_SEC]:,.0f} tok/s{mfu_text}; {window.progress(progress.iter_num, cfg.max_iters)}",
        flush=True,
    )
    run.metrics.write(record)


def evaluate_all(run, progress, time_s):
    """The evaluations due at progress.iter_num: validation and train-estimate losses every eval_interval steps,
    at the end and for eval_only (now), HellaSwag every hellaswag_interval steps. Each is recorded once: an
    evaluation its step already has in metrics.jsonl (an eval_only relaunch) is printed, not recorded again.
    Returns the validation loss, or None when it was not due."""
    cfg, it = run.cfg, progress.iter_num
    record, val_loss = progress.evaluated_iter != it, None
    if cfg.eval_only or it % cfg.eval_interval == 0 or it == cfg.max_iters:
        t0 = time.perf_counter()
        val_loss = evaluate(run, run.val_batches)
        train_loss = evaluate(run, run.train_batches)
        eval_s = time.perf_counter() - t0  # a compiled model's first evaluation includes compiling its graph
        if run.dist.is_master:
            print(f"step {it}: train loss {train_loss:.4f}, val loss {val_loss:.4f}", flush=True)
            entry = {**stamp(progress, time_s), metrics.VAL_LOSS: val_loss, metrics.EVAL_TRAIN_LOSS: train_loss}
            if run.compiled:
                entry[metrics.EVAL_S] = eval_s
            if record:
                run.metrics.write(entry)
    if run.hellaswag_examples and it % cfg.hellaswag_interval == 0 and not cfg.eval_only:
        evaluate_hellaswag(run, progress, time_s)
    progress.evaluated_iter = it
    return val_loss


def evaluate_hellaswag(run, progress, time_s):
    from marsgpt import hellaswag

    result = hellaswag.evaluate(
        run.model,
        run.hellaswag_examples,
        run.dist.device,
        rank=run.dist.rank,
        world_size=run.dist.world_size,
        ctx=run.autocast,
        lockstep=run.parallel.lockstep,
    )
    if run.dist.is_master:
        print(
            f"step {progress.iter_num}: hellaswag acc_norm {result['acc_norm']:.4f} (lm-eval's, per character), "
            f"acc {result['acc']:.4f}, acc_norm_tokens {result['acc_norm_tokens']:.4f} (n={result['n']})",
            flush=True,
        )
        run.metrics.write({**stamp(progress, time_s), metrics.HELLASWAG: result["acc_norm"]})


# ---------------------------------------------------------------------------------------------------
# The loop.


def fit(run, progress):
    """Train from progress.iter_num to max_iters: the evaluations due at each step boundary (evaluate_all), the
    checkpoints run_dir says are due there, and an early end when it says so (a signal, a failed write)."""
    cfg, directory = run.cfg, run.directory
    start_iter, start_elapsed, t_start = progress.iter_num, progress.elapsed_s, time.perf_counter()

    def time_s():
        return start_elapsed + time.perf_counter() - t_start

    while True:
        it = progress.iter_num
        directory.check_requests(progress, time_s())
        evaluation_due = it % cfg.eval_interval == 0 or it == cfg.max_iters
        hellaswag_due = run.hellaswag_examples and it % cfg.hellaswag_interval == 0
        val_loss = None
        if cfg.eval_only or ((evaluation_due or hellaswag_due) and progress.evaluated_iter != it):
            val_loss = evaluate_all(run, progress, time_s())
            run.window.restart()
            if cfg.eval_only:
                break
        directory.save_if_due(progress, time_s(), val_loss)
        if it >= cfg.max_iters:
            break
        step_and_log(run, progress, run.window, time_s, first=it == start_iter)


def step_and_log(run, progress, window, time_s, first=False):
    """Optimizer step progress.iter_num, its bookkeeping, and a train line every log_interval steps. With a
    compiled model, the first step of a process (`first`) is timed on its own: it includes the compile."""
    t0 = time.perf_counter()
    result = train_step(run, progress.iter_num)
    progress.iter_num += 1
    progress.tokens += run.tokens_per_step
    progress.clip_count += result.clipped
    window.add(result.loss, result.skipped)
    if first and run.compiled and run.dist.is_master:
        run.metrics.write({**stamp(progress, time_s()), metrics.FIRST_STEP_S: time.perf_counter() - t0})
    if result.skipped:
        record_skip(run, progress, result, time_s())
    else:
        progress.bad_steps = 0
    if progress.iter_num % run.cfg.log_interval == 0:
        log_train(run, progress, window, result, time_s())
        window.restart()
    if progress.iter_num == MEMORY_REPORT_STEP and run.memory_plan and run.dist.device_type == "cuda":
        print(memory_plan.measured_peak(run.memory_plan, MEMORY_REPORT_STEP), flush=True)


def record_skip(run, progress, result, time_s):
    progress.bad_steps += 1
    progress.skipped_steps += 1
    it = progress.iter_num
    if run.dist.is_master:
        print(
            f"iter {it}: non-finite loss or {result.non_finite}; step skipped "
            f"({progress.bad_steps} in a row, {progress.skipped_steps} in the run)",
            flush=True,
        )
        run.metrics.write({**stamp(progress, time_s), metrics.SKIPPED_STEPS: progress.skipped_steps})
    if progress.bad_steps >= run.cfg.max_bad_steps:
        raise run.directory.diverged(progress)


# ---------------------------------------------------------------------------------------------------
# main(): one run, and the exit status of whatever ended it.


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print_help()
        return 0
    cfg = dist_info = directory = progress = status = None
    try:
        cfg = load_config(argv)
        if cfg.dry_run:
            return memory_plan.dry_run(cfg)
        dist_info = setup_distributed(cfg)
        directory = RunDir(cfg, dist_info, StopSignals().install(), argv)
        run, progress, _ = setup(cfg, dist_info, directory)
        if dist_info.is_master:
            launch.describe(run, progress)
        fit(run, progress)
        status = directory.finish(progress)
    except BaseException as e:
        status = exit_status(e, cfg, dist_info, directory, progress)
        if status is None:
            raise
    finally:
        if directory is not None:
            directory.close()  # the checkpoint in flight on disk, the lock released
        # After a collective timed out the process group cannot be torn down: destroying it waits on the
        # dead peer (exit_process then leaves at once).
        if dist_info is not None and dist_info.ddp and dist.is_initialized() and status != TIMED_OUT:
            dist.destroy_process_group()
    return status


TIMED_OUT = 1  # the exit status after a collective timed out


def is_collective_timeout(e, dist_info):
    """A gloo collective that waited ddp_timeout_s in vain. (A timed-out NCCL collective never gets here: its
    watchdog ends the process, as runtime.setup_distributed chooses; docs/training.md says why.)"""
    return isinstance(e, RuntimeError) and dist_info is not None and dist_info.ddp and "timed out" in str(e).lower()


def exit_status(e, cfg, dist_info, directory, progress):
    """The exit status for the exception that ended main(), after its one line on stderr; None for an
    exception that is not one of this repository's (it keeps its traceback)."""
    master = dist_info is None or dist_info.is_master
    if isinstance(e, USER_ERRORS):
        # a setup decision every rank took together fails on every rank: rank 0 says it once
        if master or not isinstance(e, SetupError):
            print(f"error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, RunStopped):  # a signal, divergence, a failed write: rank 0 knows the checkpoints
        if e.line:
            print(e.line, file=sys.stderr)
        return e.status
    if isinstance(e, KeyboardInterrupt):  # Ctrl-C (torchrun passes it to every rank): one line, not a traceback
        if master and directory is None:  # while reading the configuration or joining the ranks
            print("interrupted before the run started", file=sys.stderr)
        elif master:
            directory.wait_for_writes("interrupted")  # a save in flight is the newest checkpoint
            where = "before the first step" if progress is None else f"at iter {progress.iter_num}"
            print(f"interrupted {where}; {directory.resume_advice()}", file=sys.stderr)
        return 130
    if is_collective_timeout(e, dist_info):
        print(
            f"error: rank {dist_info.rank}: a collective timed out after ddp_timeout_s={cfg.ddp_timeout_s} s "
            f"(another rank died or hangs); {directory.resume_advice()}",
            file=sys.stderr,
        )
        return TIMED_OUT
    return None


if __name__ == "__main__":
    exit_process(main())
