"""The run's checkpoints: the stateful parts handed over once; a checkpoint of them written in the background at the
step boundaries where one is due (never from a suspect state), copied (best.pt, kept ckpt_<iter>.pt), recorded in
checkpoints.jsonl, rotated (a sharded run's directories), and restored part by part on a resume.

    ckpt.pt            the newest checkpoint: what a resume continues
    best.pt            the checkpoint of the best evaluation so far (save_best)
    ckpt_<iter>.pt     a checkpoint kept every keep_every_n_evals evaluations
    previous.pt        a sharded run's ckpt.pt before its newest save, kept until the next (shards.PREVIOUS_NAME)
    shards/            a sharded run's (zero_stage=3): the directory of each checkpoint above (marsgpt/shards.py)
    checkpoints.jsonl  a line for each checkpoint written: the run's record that it saved something

When one is written (save_if_due): after every evaluation, every checkpoint_interval steps, every
checkpoint_minutes minutes (the ranks agree on rank 0's clock), and when a signal stops the run (save_at_stop) --
never while steps are being skipped as non-finite, from non-finite weights or after a non-finite evaluation (held
back, with a line, until a step boundary where the state is sound). What a launch does with these files, and the
rest of out_dir, is marsgpt/run_dir.py's; the file formats are marsgpt/checkpoint.py's and marsgpt/shards.py's.
"""

import contextlib
import datetime
import json
import math
import os
import re
import sys
import time

import torch
import torch.distributed as dist

from marsgpt import checkpoint, checkpoint_parts, shards
from marsgpt.checkpoint import CKPT_NAME, CheckpointError, CheckpointWriter
from marsgpt.files import os_reason
from marsgpt.run_lock import LockLost
from marsgpt.stop_signals import say

BEST_NAME = "best.pt"
KEPT_NAME = re.compile(r"ckpt_(\d+)\.pt")
SAVES_NAME = "checkpoints.jsonl"
CHECKPOINT_NAMES = (CKPT_NAME, BEST_NAME, shards.PREVIOUS_NAME)  # and the kept ones, KEPT_NAME
# What a checkpoint records beside its parts: the data's fingerprint (tokens.fingerprint), and metrics.jsonl's size
# once synced as the checkpoint was written (MetricsLog.sync).
DATA_FINGERPRINT, METRICS_SIZE = "data_fingerprint", "metrics_size"


def kept_name(iteration):
    return f"ckpt_{iteration:07d}.pt"


def is_checkpoint(path):
    name = os.path.basename(path)
    return name in CHECKPOINT_NAMES or KEPT_NAME.fullmatch(name) is not None


def checkpoint_files(out_dir):
    """The checkpoint files in out_dir: ckpt.pt, best.pt, a sharded run's previous.pt and the kept ckpt_<iter>.pt
    there are."""
    if not os.path.isdir(out_dir):
        return []
    found = [os.path.join(out_dir, n) for n in CHECKPOINT_NAMES if os.path.isfile(os.path.join(out_dir, n))]
    kept = sorted(n for n in os.listdir(out_dir) if KEPT_NAME.fullmatch(n) and os.path.isfile(os.path.join(out_dir, n)))
    return found + [os.path.join(out_dir, n) for n in kept]


class Checkpointer:
    """The checkpoints of one run in `path` (its out_dir): every rank takes part (the optimizer and RNG parts gather
    across ranks, a sharded run's ranks write their rows); rank 0 writes the files. `signals`: the run's StopSignals
    (a Ctrl-C inside a save waits until the state is handed over); `guard`: called before each file is committed
    (the run's lock still its own); `given_init_from`: init_from as the launch was given it (the advice a stopped
    run prints)."""

    def __init__(self, cfg, dist_info, path, signals, guard, given_init_from):
        self.cfg, self.dist, self.path = cfg, dist_info, path
        self.ckpt_path = os.path.join(path, CKPT_NAME)
        self.signals, self.guard, self.given_init_from = signals, guard, given_init_from
        self.writer = CheckpointWriter(on_saved=self._saved, on_error=self._write_failed, guard=guard)
        self.parallel = None  # the run's parallel.Parallelism (register): whether its checkpoints are sharded
        self.sharded = False  # every rank writes its rows of each checkpoint (shards.py), not rank 0 one file
        self.parts, self.extras = {}, {}
        self.metrics = None  # the run's MetricsLog, synced before each checkpoint (rank 0)
        self.compile_cache = None  # a compiled run's compile_cache.CompileCache, saved with a checkpoint (rank 0)
        self.data = None  # the fingerprint of the data (rank 0, from the launch's LaunchDecision)
        self.latest = None  # (path, iteration) of the newest intact checkpoint on disk (rank 0)
        self.saved_iter = None  # the iteration of the newest checkpoint written or resumed
        self.held_back = None  # why a due checkpoint was not written (a suspect state), until one is
        self.write_failed = False  # a checkpoint, a copy or its record could not be written
        self.clock = time.monotonic()  # when the last checkpoint was written (rank 0's checkpoint_minutes)
        self._save_began = 0.0  # when the save in flight began

    def register(self, cfg, parts, extras, parallel):
        """Every rank: the run's configuration (init_from decided), its stateful parts (name -> an object with
        state_dict() and load_state_dict(state); marsgpt/checkpoint_parts.py adapts those that are not), handed over
        once: what a checkpoint holds is these and the plain values every checkpoint records beside them
        (`extras`). `parallel`: the run's parallel.Parallelism; where it writes sharded checkpoints (FSDP2's
        DTensors) every rank writes its rows of each checkpoint (shards.ShardedCheckpointWriter), the background
        writes' collectives on a gloo process group of their own (a collective, made here)."""
        self.cfg, self.parts, self.extras, self.parallel = cfg, parts, extras, parallel
        self.sharded = parallel.writes_sharded_checkpoints
        if self.sharded:
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.ddp_timeout_s))
            self.writer = shards.ShardedCheckpointWriter(
                self.dist.rank,
                group,
                shards.new_token(group),
                on_saved=self._saved,
                on_error=self._write_failed,
                guard=self.guard,
            )

    def resumed(self, path, iteration):
        """Rank 0: the launch resumes the checkpoint at `path`, of `iteration`: the newest on disk until one is
        written."""
        self.latest, self.saved_iter = (path, iteration), iteration

    def restore(self, ckpt, path):
        """Load every part from the checkpoint `ckpt` (read from `path`). A part it does not hold is given None: a
        part added since older checkpoints were written starts afresh in its own load_state_dict, and any other
        raises checkpoint_parts.MissingPart; the checkpoint is then refused, naming every part it lacks, before any
        part changes. A sharded checkpoint's tensors are read here, into what the run's parallelism makes of each
        (empty_like: this rank's rows of a DTensor under FSDP2; an unsharded run read them whole already)."""
        missing = []
        for name, part in self.parts.items():
            if name not in ckpt:
                try:
                    part.load_state_dict(None)
                except checkpoint_parts.MissingPart:
                    missing.append(name)
        if missing:
            raise CheckpointError(
                f"{path} lacks {', '.join(missing)}: it was not written by this train.py, so it cannot be resumed "
                "(init_from=resume); start a new run from its weights instead"
            )
        if shards.has_shards(ckpt):
            ckpt = shards.read_shards(ckpt, self.parallel.empty_like)
        for name, part in self.parts.items():
            if name in ckpt:
                part.load_state_dict(ckpt[name])
        self.saved_iter = checkpoint.iteration(ckpt)

    # --- when to save

    def clock_due(self):
        """Rank 0: checkpoint_minutes have passed since the last checkpoint (a request the ranks agree on)."""
        minutes = self.cfg.checkpoint_minutes
        return self.dist.is_master and minutes > 0 and time.monotonic() - self.clock >= 60 * minutes

    def save_if_due(self, progress, time_s, val_loss=None, clock=False):
        """At a step boundary, after the evaluations due there (`val_loss`: the validation loss of one that ran
        now): write a checkpoint when one is due -- after an evaluation (best.pt and the kept copies come only
        from these), every checkpoint_interval steps, when the agreed `clock` asks, or when an earlier one was
        held back -- unless the state is suspect; then it is held back (one line) until a step boundary where
        it is not. Every rank calls this at the same boundaries and decides the same."""
        it, cfg = progress.iter_num, self.cfg
        interval = cfg.checkpoint_interval > 0 and it % cfg.checkpoint_interval == 0
        due = val_loss is not None or self.held_back or ((interval or clock) and self.saved_iter != it)
        if not due:
            return
        problem = self.suspect(progress, val_loss)
        if problem is not None:
            if self.held_back is None and self.dist.is_master:
                print(f"iter {it}: checkpoint held back: {problem}; {self.resume_advice()}", flush=True)
            self.held_back = problem
            return
        self.held_back = None
        is_best = val_loss is not None and val_loss < progress.best_val_loss
        if is_best:
            progress.best_val_loss = val_loss
        self._save(progress, time_s, is_best, at_evaluation=val_loss is not None)

    def save_at_stop(self, progress, time_s):
        """A stop signal at this step boundary: a checkpoint of it, unless there is one or the state is suspect (the
        reason, returned); on disk (or failed) when this returns."""
        problem = self.suspect(progress) if self.saved_iter != progress.iter_num else None
        if self.saved_iter != progress.iter_num and problem is None:
            self._save(progress, time_s, is_best=False, at_evaluation=False)
        self.wait()
        return problem

    def suspect(self, progress, val_loss=None):
        """Why the state must not become a checkpoint, or None: never while steps are being skipped as
        non-finite (float16's GradScaler skips some as it searches its loss scale: the save waits for the next
        step that is not skipped), from non-finite weights or after a non-finite evaluation."""
        if progress.bad_steps:
            return f"the last {progress.bad_steps} step(s) were skipped as non-finite"
        if val_loss is not None and not math.isfinite(val_loss):
            return f"the validation loss is {val_loss}"
        weights = list(self.parts["model"].model.parameters())
        largest = torch.nn.utils.get_total_norm(weights, norm_type=math.inf)
        if not math.isfinite(largest.item()):
            return "the weights are not finite"
        return None

    # --- writing

    def _save(self, progress, time_s, is_best, at_evaluation):
        """Hand the state at this step boundary to the writer; a Ctrl-C meanwhile waits until it is handed over
        (stop_signals.StopSignals.deferred_interrupt), so the checkpoint the way out waits for is this one."""
        with self.signals.deferred_interrupt(progress.iter_num):
            self._hand_over(progress, time_s, is_best, at_evaluation)

    def _hand_over(self, progress, time_s, is_best, at_evaluation):
        progress.elapsed_s = time_s
        state = {name: part.state_dict() for name, part in self.parts.items()}  # every rank: the parts gather
        self.saved_iter, self.clock = progress.iter_num, time.monotonic()
        if not self.dist.is_master and not self.sharded:  # one file, rank 0's; sharded: every rank writes
            return
        state.update(self.extras)
        copies = []
        if is_best and self.cfg.save_best:
            copies.append(os.path.join(self.path, BEST_NAME))
        evals, keep = progress.iter_num // self.cfg.eval_interval, self.cfg.keep_every_n_evals
        if (
            at_evaluation
            and keep
            and progress.iter_num > 0
            and evals % keep == 0
            and progress.iter_num % self.cfg.eval_interval == 0
        ):
            copies.append(os.path.join(self.path, kept_name(progress.iter_num)))
        self.wait()  # a failure of the last write was reported; this one may find room again
        if self.dist.is_master:  # the records up to this step on disk first, and how long they are
            state.update({DATA_FINGERPRINT: self.data, METRICS_SIZE: self.metrics.sync()})
        self._save_began = time.monotonic()
        self.writer.save(self.ckpt_path, state, copies)
        if self.compile_cache is not None and self.dist.is_master:
            self.compile_cache.save(progress.iter_num)

    def _saved(self, path, iteration, copies):  # the writer's thread
        self.latest = (path, iteration)
        if not self.dist.is_master:
            return
        self._record_save(path, iteration, copies)
        if self.sharded:  # the directory the replaced previous.pt named goes
            shards.remove_unreferenced(self.path, checkpoint_files(self.path))

    def _record_save(self, path, iteration, copies):
        """Rank 0, once a checkpoint is on disk: a line in checkpoints.jsonl (the file, the copies made of it, its
        iteration, when, and how long the write took), the run's record that it has saved something (a launch
        starts over only a run that has none: run_dir.decide_start)."""
        entry = dict(
            iter=iteration,
            file=os.path.basename(path),
            copies=[os.path.basename(copy) for copy in copies],
            saved_at=datetime.datetime.now().isoformat(timespec="seconds"),
            write_s=round(time.monotonic() - self._save_began, 3),
        )
        record = os.path.join(self.path, SAVES_NAME)
        try:
            self.guard()
            with open(record, "a") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            self._write_failed(f"cannot append to {record}: {os_reason(e)}")
        except LockLost as e:
            self._write_failed(e)

    def _write_failed(self, error):  # the writer's thread: reported at once, acted on at the next step
        """A failed write: reported at once on rank 0 (a sharded save fails on every rank), acted on at the next
        step boundary. One the run's lost lock refused is not reported here: the stop says so."""
        self.write_failed = True
        lost = isinstance(error, LockLost) or isinstance(getattr(error, "__cause__", None), LockLost)
        if self.dist.is_master and not lost:
            sys.stderr.write(f"error: {error}\n")  # one write: no other thread's output lands inside the line
            sys.stderr.flush()

    # --- what is on disk

    def wait(self, why=None):
        """Block until the checkpoint in flight is on disk (a failure was reported the moment it happened). `why`
        (e.g. 'interrupted'): rank 0 first says that it waits, when a checkpoint is in flight."""
        if why and self.dist.is_master and self.writer.in_flight:
            say(
                f"{why}: waiting for the checkpoint of iter {self.writer.iteration} to reach the disk (a third "
                "signal, or Ctrl-\\, quits at once, losing it)",
                to_terminal=True,
            )
        with contextlib.suppress(CheckpointError):
            self.writer.wait()

    def holder(self):
        """The newest checkpoint file on disk (ckpt.pt when none is yet)."""
        return self.latest[0] if self.latest is not None else self.ckpt_path

    def newest(self):
        """'<path> (iter N)': the newest intact checkpoint (rank 0), or None when there is none yet."""
        return None if self.latest is None else f"{self.latest[0]} (iter {self.latest[1]:,})"

    def resume_advice(self):
        """Where a stopped run continues: the newest intact checkpoint and its iteration, or starting over. The
        checkpoint in flight reaches the disk first: the writer's thread records it, and until then the advice
        would name an older one, or none, depending on how fast the disk is."""
        self.wait()
        if self.latest is not None:
            return f"resume from {self.newest()} with --init_from=resume (or auto)"
        if not self.dist.is_master and os.path.isfile(self.ckpt_path):  # rank 0 keeps count of the saves
            return f"resume from {self.ckpt_path} with --init_from=resume (or auto)"
        if self.given_init_from == "resume":  # run_dir.decide_start refuses to start over under resume
            return "no checkpoint was written yet: run the same command without --init_from=resume to start over"
        return "no checkpoint was written yet: run the same command again to start over"  # run_dir.decide_start
