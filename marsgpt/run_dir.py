"""The run directory (out_dir): its layout, what a launch does there, and the requests that end a run early -- the
rules that keep a run's files through the accidents of a shared cluster: preemption, a second launch, a full disk,
a damaged or deleted file, divergence, a requeue on another node. docs/training.md has the table of what survives
what, and of what each file is ("What a run directory holds").

    ckpt.pt, best.pt, ckpt_<iter>.pt, previous.pt, shards/, checkpoints.jsonl
                       the checkpoints and their record (marsgpt/checkpointer.py)
    metrics.jsonl      the run's records (marsgpt/metrics.py)
    config.json        the run's configuration and its data's fingerprint: written when it starts and when a
                       resume changes either
    run.lock           who holds the directory (marsgpt/run_lock.py)
    compile_cache.bin  what a compiled run compiled, signed with this user's key (marsgpt/compile_cache.py)

The rules here, each in one place:
- Every file here is data. Nothing read from out_dir runs code: checkpoints through torch.load(weights_only=True),
  a sharded checkpoint's dcp metadata through an unpickler that finds only dcp's classes, the compile cache only
  when this user's key signed it. A name of the run's holding something it can neither read nor replace (a
  directory, a dangling symlink) is refused in one line (refuse_misplaced).
- What a launch does there (decide_start), before anything in it changes. init_from=auto resumes the newest
  intact checkpoint (ckpt.pt, else the newest of the others) and never starts over on top of a run's files,
  unless that run never completed a checkpoint (nothing to continue: the same command starts it over); nothing
  else of an earlier run is deleted or overwritten without --overwrite=True. A damaged checkpoint is named and
  passed over for the newest intact one.
- The requests every rank agrees on at each step (RunDir.requests, agree): a stop signal (marsgpt/stop_signals.py)
  ends the run at the next step boundary with a checkpoint and exit status 0; a failed write (a checkpoint, a copy,
  metrics.jsonl: reported at once in one line naming the file and the OS reason) stops it with 1, as training on
  without checkpoints burns GPU hours the next preemption takes back; a lock another launch took stops it without
  writing more. Each stop ends with one line saying where the run continues.
- copy_run copies a whole run directory so that the copy resumes, also while a run trains in it.
"""

import contextlib
import dataclasses
import json
import math
import os
import shlex
import shutil
import signal
import sys

import torch

from marsgpt import checkpoint, compile_cache, metrics, shards
from marsgpt.checkpoint import CKPT_NAME, RESUME_ADVICE, CheckpointError, DamagedCheckpoint
from marsgpt.checkpointer import (
    BEST_NAME,
    CHECKPOINT_NAMES,
    DATA_FINGERPRINT,
    KEPT_NAME,
    SAVES_NAME,
    Checkpointer,
    checkpoint_files,
    is_checkpoint,
)
from marsgpt.config_schema import ConfigError, config_to_dict
from marsgpt.files import atomic_writer, copy_file, os_reason, remove_stale_temporaries
from marsgpt.run_lock import LockError, RunLock
from marsgpt.stop_signals import StopSignals

CONFIG_NAME = "config.json"
# The files that make out_dir a run (with the kept ckpt_<iter>.pt copies): a fresh start does not replace them
# unless told to, or unless the run never completed a checkpoint (no checkpoints.jsonl).
RUN_FILE_NAMES = (*CHECKPOINT_NAMES, metrics.FILE_NAME, SAVES_NAME)


class RunDirError(Exception):
    """out_dir cannot be used as asked (another run holds it, it cannot be written); the message is the one line
    the user sees."""


class RunStopped(Exception):
    """The run ends before max_iters at a step boundary (a signal, a failed write, a lost lock) with exit
    `status`; `line`, on rank 0, says what happened and where the run continues from."""

    def __init__(self, status, line=None):
        Exception.__init__(self, line or "")
        self.status, self.line = status, line


def run_files(out_dir, names=RUN_FILE_NAMES):
    """The files in out_dir that belong to a run: those of `names` there are, and the kept ckpt_<iter>.pt."""
    if not os.path.isdir(out_dir):
        return []
    found = [os.path.join(out_dir, n) for n in names if os.path.isfile(os.path.join(out_dir, n))]
    kept = sorted(n for n in os.listdir(out_dir) if KEPT_NAME.fullmatch(n))
    return found + [os.path.join(out_dir, n) for n in kept]


# ---------------------------------------------------------------------------------------------------
# What a launch does in out_dir.


@dataclasses.dataclass
class LaunchDecision:
    """What a launch does in out_dir, decided before anything there changes (picklable: rank 0 decides)."""

    init_from: str  # scratch, resume or gpt2*: never auto
    path: str | None = None  # the checkpoint to resume
    iteration: int | None = None  # its iteration
    verified: bool = False  # its checksum matched (False: it has none to check)
    notes: tuple = ()  # the checkpoints passed over, and why: printed once the launch goes ahead
    data: dict | None = None  # the fingerprint of the data this launch trains on (tokens.fingerprint)
    data_change: str = ""  # how the data differs from the resumed checkpoint's, when allow_data_change let it


def what_is_at(path):
    """'a directory', 'a dangling symlink' or 'not a regular file' for what is at `path` (symlinks followed)."""
    if os.path.isdir(path):
        return "a directory"
    if os.path.islink(path) and not os.path.exists(path):
        return "a dangling symlink"
    return "not a regular file"


def refuse_misplaced(out_dir):
    """RunDirError naming the first of the run's own names in out_dir that holds something a run can neither read
    nor replace -- a directory or a dangling symlink where a file goes, a file where shards/ goes -- before anything
    there changes: a resume would otherwise train until its first write into it fails, or write through a symlink
    to wherever it points."""
    if not os.path.isdir(out_dir):
        return
    files = {*RUN_FILE_NAMES, CONFIG_NAME, compile_cache.FILE_NAME}
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name)
        if (name in files or KEPT_NAME.fullmatch(name)) and not os.path.isfile(path):
            raise RunDirError(
                f"{path} is {what_is_at(path)}, not the file a run keeps under that name: move it away or remove "
                "it, then launch again"
            )
        if name == shards.SHARDS_DIR and not os.path.isdir(path):
            raise RunDirError(
                f"{path} is not a directory, where a sharded run keeps its checkpoints' shards: move it away or "
                "remove it, then launch again"
            )


def decide_start(cfg, names=RUN_FILE_NAMES):
    """What init_from means for this launch in out_dir (a LaunchDecision): 'auto' resumes when out_dir holds a
    checkpoint, else starts fresh; 'resume' resumes (the newest intact checkpoint: choose_checkpoint) or fails.

    A fresh start into an out_dir that holds a run (run_files with `names`) is refused unless overwrite is
    set: a relaunch that forgot --init_from=resume must not erase days of training. The one exception is a
    training run that never completed a checkpoint (out_dir has no checkpoints.jsonl, the record of every
    checkpoint written): killed or stopped before its first save was on disk, it saved nothing a relaunch
    could continue, so the same command starts it over (and says so) instead of being refused forever. An
    eval_only run's records are its result: they stay.
    """
    refuse_misplaced(cfg.out_dir)
    previous = run_files(cfg.out_dir, names)
    checkpoints = [path for path in previous if is_checkpoint(path)]
    if cfg.init_from in ("resume", "auto") and checkpoints:
        return choose_checkpoint(cfg.out_dir, checkpoints)
    if cfg.init_from == "resume":
        raise CheckpointError(f"no checkpoint at {os.path.join(cfg.out_dir, CKPT_NAME)}; {RESUME_ADVICE}")
    init_from = "scratch" if cfg.init_from == "auto" else cfg.init_from
    if not previous or cfg.overwrite:
        return LaunchDecision(init_from)
    if not checkpoints and SAVES_NAME not in map(os.path.basename, previous) and not evaluated_only(cfg.out_dir):
        return LaunchDecision(init_from, notes=(nothing_saved(cfg.out_dir),))
    if not checkpoints:  # the checkpoints deleted: the records are all that is left of the run
        raise ConfigError(
            f"out_dir {cfg.out_dir} holds {os.path.basename(previous[0])} but no {CKPT_NAME} to "
            f"resume; start elsewhere with a new --out_dir, or replace it with --overwrite=True"
        )
    raise ConfigError(
        f"out_dir {cfg.out_dir} already holds a run ({os.path.basename(previous[0])}); continue it with "
        f"--init_from=resume (or auto), start elsewhere with a new --out_dir, or delete it with --overwrite=True"
    )


def evaluated_only(out_dir):
    """Whether out_dir's config.json is an eval_only run's (False when there is none, or it cannot be read)."""
    try:
        with open(os.path.join(out_dir, CONFIG_NAME), "rb") as f:
            return json.load(f).get("eval_only") is True
    except (OSError, ValueError, AttributeError):
        return False


def nothing_saved(out_dir):
    """The line a launch prints as it starts over a run that never completed a checkpoint."""
    try:
        last = metrics.last_iteration(out_dir)
    except (OSError, ValueError):  # no records, or damaged ones: what they held does not change the decision
        last = None
    held = "" if last is None else f" (its {metrics.FILE_NAME} reaches iter {last:,})"
    return (
        f"out_dir {out_dir} holds a run stopped before its first checkpoint was complete{held}: nothing was "
        "saved, so it starts over"
    )


def checkpoint_order(path):
    """Sort key of the checkpoints a resume may continue: ckpt.pt first (it is what the run wrote last, or what
    the user put there to go back to), then the others newest first (by their checksum record, else by name)."""
    name = os.path.basename(path)
    if name == CKPT_NAME:
        return (0, 0)
    try:
        trailer = checkpoint.read_trailer(path)
    except (OSError, DamagedCheckpoint):
        trailer = None
    kept = KEPT_NAME.fullmatch(name)
    iteration = trailer.iter if trailer and trailer.iter is not None else int(kept.group(1)) if kept else -1
    return (1, -iteration)


def choose_checkpoint(out_dir, paths):
    """The LaunchDecision that resumes the newest intact checkpoint among `paths` (in checkpoint_order). A file is
    intact when its bytes match its checksum and torch reads it (memory-mapped: its tensors are not read).
    The files passed over, and why, become the LaunchDecision's notes; CheckpointError when none is intact."""
    passed = []
    for path in sorted(paths, key=checkpoint_order):
        try:
            ckpt, trailer = shards.read_checkpoint(path, mmap=True, whole=False)
        except CheckpointError as e:  # damaged, gone meanwhile, unreadable, not a training checkpoint
            passed.append(str(e))
            continue
        if os.path.basename(path) != CKPT_NAME and CKPT_NAME not in map(os.path.basename, paths):
            passed.insert(0, f"{os.path.join(out_dir, CKPT_NAME)} is missing")
        notes = tuple(f"{note}; resuming the newest intact checkpoint instead" for note in passed)
        return LaunchDecision("resume", path, checkpoint.iteration(ckpt), trailer is not None, notes)
    if len(passed) == 1:
        raise DamagedCheckpoint(f"{passed[0]}; start a new run with --overwrite=True or in a new --out_dir")
    raise CheckpointError(
        f"out_dir {out_dir} holds no intact checkpoint ({'; '.join(passed)}); start a new run with "
        "--overwrite=True or in a new --out_dir"
    )


def prepare_out_dir(cfg, start, ckpt=None, changes=(), at=None):
    """Rank 0, once every check has passed: the first changes to out_dir. What a killed save left goes,
    --overwrite=True removes the old run, and a resume says which checkpoint it continues and why (the
    files passed over), where (`at`; by default the checkpoint's iteration) and what its configuration
    changes (`changes`: resume.config_changes' lines)."""
    remove_stale_temporaries(cfg.out_dir)
    if cfg.overwrite and start.init_from != "resume":
        for path in run_files(cfg.out_dir):
            os.remove(path)
        with contextlib.suppress(FileNotFoundError):  # what the old run compiled: this one may compile otherwise
            os.remove(os.path.join(cfg.out_dir, compile_cache.FILE_NAME))
    shards.remove_unreferenced(cfg.out_dir, checkpoint_files(cfg.out_dir), announce=True)
    for note in start.notes:
        print(note, flush=True)
    if ckpt is not None:
        at = at or f"iter {checkpoint.iteration(ckpt):,}"
        unverified = "" if start.verified else " (it has no checksum to verify: written before checksums)"
        print(f"resuming {start.path} at {at}{unverified}", flush=True)
        for line in changes:
            print(line, flush=True)
        if start.data_change:
            print(f"resume: the data changed: {start.data_change} (allow_data_change=True)", flush=True)


# ---------------------------------------------------------------------------------------------------
# Signals, and the requests every rank agrees on at each step.


@dataclasses.dataclass
class Requests:
    """What the ranks agreed, at the last step, that the run must do at the next step boundary."""

    signal: int = 0  # the number of a stop signal some rank received
    clock: bool = False  # checkpoint_minutes have passed since the last checkpoint (rank 0's clock)
    write_failed: bool = False  # a checkpoint, copy or metrics record could not be written (rank 0)
    lock_lost: bool = False  # another launch took out_dir's lock (rank 0)


# ---------------------------------------------------------------------------------------------------
# The run's directory, as train.py uses it.


def continue_advice(argv, init_from, launched_by_torchrun):
    """How a run launched with train.py's arguments `argv` and `init_from` as given (before auto is decided)
    continues once it has stopped with a checkpoint. The same command does when it asks to resume (auto or
    resume: every run_*.sh and quickstart.sh pass auto); a fresh start's command would be refused, or with
    --overwrite=True delete the run, so one process is told the command in full, --init_from=resume in place
    of its --init_from and --overwrite. A torchrun launch is told what to add: train.py does not know
    torchrun's own arguments; so is a RunDir built outside train.main (`argv` None)."""
    if init_from in ("auto", "resume"):
        return "run the same command to continue"
    if launched_by_torchrun or argv is None:
        return "continue with the same command and --init_from=resume at its end"
    train_py = os.path.relpath(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py"))
    kept = [arg for arg in argv if not arg.startswith(("--init_from=", "--overwrite="))]
    return f"continue with: {shlex.join(['python', train_py, *kept, '--init_from=resume'])}"


class RunDir:
    """out_dir for one training run: rank 0 holds its lock (marsgpt/run_lock.py), decides what the launch does there
    and writes config.json; every rank takes part in its checkpoints (marsgpt/checkpointer.py) and agrees, at each
    step, on the requests that end a run early (a signal, a failed write, a lost lock) and on when the clock asks
    for a checkpoint. `argv`: train.py's arguments, for the command a stopped run prints (continue_advice)."""

    def __init__(self, cfg, dist_info, signals=None, argv=None):
        self.cfg, self.dist = cfg, dist_info
        self.continue_advice = continue_advice(argv, cfg.init_from, launched_by_torchrun=dist_info.torchrun)
        self.path = cfg.out_dir
        self.lock = None  # rank 0's, from start()
        self.created = False  # out_dir was made by this launch (removed again if it ends empty)
        self.signals = signals or StopSignals()  # installed by train.py's command line: a stop signal ends the run
        self.signals.speaks = dist_info.is_master
        self.checkpoints = Checkpointer(cfg, dist_info, self.path, self.signals, self.guard, cfg.init_from)
        self.metrics = None  # the run's MetricsLog, whose failed writes stop the run too
        self.agreed = Requests()

    # --- the launch

    def start(self, cfg):
        """Rank 0: hold out_dir (its lock), then decide what this launch does there (decide_start)."""
        self.cfg = cfg
        try:
            # through a symlink to a directory not made yet, its target; a launch at the same moment may make it
            with contextlib.suppress(FileExistsError):
                os.makedirs(os.path.realpath(self.path))
                self.created = True
            # Under DDP the other ranks wait for this decision for at most ddp_timeout_s.
            wait_limit = math.inf if self.dist.world_size == 1 else cfg.ddp_timeout_s / 2
            self.lock = RunLock.acquire(self.path, cfg.lock_timeout_s, wait_limit)
        except LockError as e:
            raise RunDirError(str(e)) from None
        except OSError as e:
            raise RunDirError(
                f"cannot write in out_dir {self.path}: {os_reason(e)}; give an --out_dir on a writable file system"
            ) from None
        return decide_start(cfg)

    def prepare(self, cfg, start, ckpt, changes):
        """Rank 0: prepare_out_dir, then config.json: the configuration of the run and the fingerprint of its data,
        written when it starts and when a resume that trains changes either (an eval_only launch leaves it as it
        is)."""
        self.cfg, self.checkpoints.data = cfg, start.data
        prepare_out_dir(cfg, start, ckpt, changes)
        if start.path is not None:
            self.checkpoints.resumed(start.path, start.iteration)
        changed = changes or start.data_change or (ckpt is not None and DATA_FINGERPRINT not in ckpt)
        if ckpt is None or (changed and not cfg.eval_only):
            with atomic_writer(os.path.join(self.path, CONFIG_NAME), "w", guard=self.guard) as f:
                json.dump({**config_to_dict(cfg), DATA_FINGERPRINT: start.data}, f, indent=1)

    def guard(self):
        """Before each write this run commits to out_dir (rank 0's): LockLost unless it still holds the lock."""
        if self.lock is not None:
            self.lock.check()

    def use_metrics(self, metrics_log):
        """The run's MetricsLog: its failed writes stop the run too, it writes only while the run holds out_dir,
        and each checkpoint records how much of it was on disk."""
        self.metrics = self.checkpoints.metrics = metrics_log
        metrics_log.guard = self.guard
        return metrics_log

    # --- every step boundary

    def requests(self):
        """This rank's requests for the next step boundary, as numbers the ranks max-reduce with the step's values
        (parallel.Parallelism.read_agreed; Requests, in order): a stop signal, and rank 0's checkpoint clock,
        failed write and lost lock."""
        master = self.dist.is_master
        failed = self.checkpoints.write_failed or (master and bool(self.metrics is not None and self.metrics.failed))
        return [
            float(self.signals.received),
            float(self.checkpoints.clock_due()),
            float(failed),
            float(master and self.lock is not None and self.lock.lost is not None),
        ]

    def agree(self, agreed):
        """The requests every rank agreed on at the last step (requests(), max-reduced), for the next boundary."""
        self.agreed = Requests(int(agreed[0]), bool(agreed[1]), bool(agreed[2]), bool(agreed[3]))

    def check_requests(self, progress, time_s):
        """At a step boundary: end the run when the last step's agreed requests say so (RunStopped). A lost lock
        stops it without a checkpoint (the run now holding out_dir writes there), a failed write at once, a
        signal after a checkpoint of this step boundary (exit status 0: nothing failed)."""
        agreed, it = self.agreed, progress.iter_num
        if agreed.lock_lost:
            lost = self.lock.lost if self.lock is not None else "the lock on out_dir was lost"
            raise RunStopped(1, self._master_line(f"error: {lost}; stopped at iter {it} without writing more"))
        if agreed.write_failed:
            raise RunStopped(1, self._master_line(self._failed_write_line(f"stopped at iter {it}")))
        if not agreed.signal:
            return
        name = signal.Signals(agreed.signal).name
        problem = self.checkpoints.save_at_stop(progress, time_s)
        if self.checkpoints.write_failed:
            raise RunStopped(1, self._master_line(self._failed_write_line(f"stopped by {name} at iter {it}")))
        if problem is not None:
            advice = self.checkpoints.resume_advice()
            line = f"stopped by {name} at iter {it} without a new checkpoint ({problem}); {advice}"
        else:
            line = f"stopped by {name} after iter {it}: {self.checkpoints.holder()} holds it; {self.continue_advice}"
        raise RunStopped(0, self._master_line(line))

    def save_if_due(self, progress, time_s, val_loss=None):
        """The checkpoint due at this step boundary, if any (Checkpointer.save_if_due, with the agreed clock)."""
        clock, self.agreed.clock = self.agreed.clock, False
        self.checkpoints.save_if_due(progress, time_s, val_loss, clock)

    # --- how the run ends

    def _master_line(self, line):
        return line if self.dist.is_master else None

    def _failed_write_line(self, what):
        if self.lock is not None and self.lock.lost is not None:  # not a failure of the disk: another launch's
            return f"error: {self.lock.lost}; {what} without writing more"
        return f"{what}: a write failed (above); {self.checkpoints.resume_advice()} once {self.path} has room"

    def record_stop(self, line, progress):
        """Rank 0: the line that stopped the run, as a record of metrics.jsonl (metrics.STOPPED)."""
        if self.dist.is_master and self.metrics is not None:
            axes = metrics.record_axes(progress.iter_num, progress.tokens, progress.elapsed_s)
            self.metrics.write({**axes, metrics.STOPPED: line})

    def finish(self, progress):
        """The end of a run that reached max_iters (or evaluated, eval_only): its exit status once the last
        checkpoint is on disk, and a line saying what it holds; 1, with a line, when a write failed."""
        checkpoints = self.checkpoints
        checkpoints.wait()
        failed = checkpoints.write_failed or bool(self.metrics is not None and self.metrics.failed)
        if self.dist.is_master and failed:
            print(self._failed_write_line(f"finished at iter {progress.iter_num}"), file=sys.stderr, flush=True)
        elif self.dist.is_master and not self.cfg.eval_only:
            best = os.path.join(self.path, BEST_NAME)
            best = best if self.cfg.save_best and os.path.isfile(best) else None
            print("\n".join(metrics.summary_lines(self.path, progress.tokens, progress.elapsed_s, best)), flush=True)
            held = checkpoints.saved_iter == progress.iter_num and checkpoints.latest is not None
            where = f"{checkpoints.holder()} holds it" if held else checkpoints.resume_advice()
            print(f"finished at iter {progress.iter_num:,}; {where}", file=sys.stderr, flush=True)
        return 1 if failed else 0

    def close(self):
        """Whatever ended the run: the checkpoint in flight reaches the disk, metrics.jsonl is closed, the lock
        is released; an out_dir this launch made and left empty goes. The signal handlers stay (their owner
        restores them): a stop signal that arrives after this is answered, not the default that kills."""
        self.checkpoints.wait()
        if self.metrics is not None:
            self.metrics.close()
        if self.lock is not None:
            self.lock.release()
        if self.created:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.realpath(self.path))  # only if empty


# ---------------------------------------------------------------------------------------------------
# A consistent copy of a run directory, also of one a run is training in.

COPY_ATTEMPTS = 100  # a sharded checkpoint copied again after the run replaced it meanwhile, at most this often


def copy_run(source, destination):
    """Copy the run directory `source` into the new directory `destination` so that the copy resumes from
    intact checkpoints even while a run trains in `source`: each checkpoint file, then exactly the shard
    directory it names (a sharded one), then metrics.jsonl, checkpoints.jsonl and config.json -- after the
    checkpoints, so that they hold every record a checkpoint covers (MetricsLog.sync) -- and compile_cache.bin.
    run.lock and the temporary files of a save in flight stay behind. A checkpoint file is only ever replaced
    whole (a rename), so the copy of one is some version of it; a shard directory goes once no checkpoint file
    names it, so when one vanishes during its copy the run has written a newer checkpoint, which is copied
    instead. Returns the names of the checkpoint files copied."""
    if os.path.lexists(destination):
        raise RunDirError(f"{destination} exists: give a new directory to copy {source} into")
    os.makedirs(destination)
    copied = []
    for path in checkpoint_files(source):
        for _attempt in range(COPY_ATTEMPTS):
            try:
                if _copy_checkpoint(path, os.path.join(destination, os.path.basename(path))):
                    copied.append(os.path.basename(path))
                break
            except FileNotFoundError:  # its shard directory was replaced meanwhile: the file names a newer one
                continue
        else:
            raise RunDirError(f"{path} was replaced {COPY_ATTEMPTS} times while it was copied; copy again")
    for name in (metrics.FILE_NAME, SAVES_NAME, CONFIG_NAME, compile_cache.FILE_NAME):
        with contextlib.suppress(FileNotFoundError):
            copy_file(os.path.join(source, name), os.path.join(destination, name))
    return copied


def _copy_checkpoint(path, target):
    """The checkpoint file `path` as `target`, then the files of the shard directory it names, if any; False when
    the file is gone (deleted meanwhile). FileNotFoundError when a shard file is gone (the target's shard
    directory is removed again)."""
    try:
        copy_file(path, target)
    except FileNotFoundError:
        return False
    record = torch.load(target, map_location="cpu", weights_only=True, mmap=True).get(shards.SHARDS_KEY)
    if record is None:
        return True
    directory = os.path.join(os.path.dirname(target), record["directory"])
    os.makedirs(directory, exist_ok=True)
    try:
        for name in record["files"]:
            copy_file(os.path.join(os.path.dirname(path), record["directory"], name), os.path.join(directory, name))
    except FileNotFoundError:
        shutil.rmtree(directory)
        os.remove(target)
        raise
    return True
