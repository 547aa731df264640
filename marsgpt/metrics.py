"""The run's metrics: the record names (defined here once), out_dir/metrics.jsonl, wandb, and its readers.

train.py writes the records; marsgpt/plot.py and scripts/study_small.py read them back with read_metrics,
scripts/gpu_check.py and vision/cpu_study.py with read_records. Every record has `iter`, `tokens` and
`time_s` (the x axes) and some of the names below; the same records go to wandb, plotted against `iter`.
"""

import collections
import dataclasses
import json
import math
import os
import shlex
import sys
import time

import torch

from marsgpt.files import atomic_writer, os_reason

# The x axes, in every record.
ITER, TOKENS, TIME_S = "iter", "tokens", "time_s"
# An evaluation.
VAL_LOSS, EVAL_TRAIN_LOSS, HELLASWAG = "val/loss", "eval/train_loss", "hellaswag/acc_norm"
# A train line: the mean loss of the steps since the previous one, and how they went.
TRAIN_LOSS, LR, GRAD_NORM, CLIP_RATE = "train/loss", "lr", "grad_norm", "clip_rate"
# mfu: model FLOPs utilisation in percent as PaLM and nanoGPT count the FLOPs, mfu_llmc as llm.c counts them
# (model.GPT.flops_per_token).
TOKENS_PER_SEC, STEP_MS, MFU, MFU_LLMC, PARAM_NORM, SKIPPED_STEPS = (
    "tokens_per_sec",
    "step_ms",
    "mfu",
    "mfu_llmc",
    "param_norm",
    "skipped_steps",
)
# MARS only: the norms of its moments, as the reference train_mars.py logs them.
MOMENTUM_NORM, MOMENTUM_NORM_SQ, MOMENTUM_DIV = "momentum_norm", "momentum_norm_sq", "momentum_div"
# A compiled model's timings: the seconds each evaluation took (on its validation record) and the process's
# first optimizer step took (a record of its own); the first of each includes compiling its graph.
EVAL_S, FIRST_STEP_S = "eval_s", "first_step_s"
# On the first step's record: the graphs inductor had compiled in the process by then, and those it found in its
# cache (marsgpt/compile_cache.py: a resume loads what the run compiled before).
GRAPHS_COMPILED, GRAPHS_FROM_CACHE = "graphs_compiled", "graphs_from_cache"
# Notes a resume records at its step, in words: the data changed there (allow_data_change=True); records of the
# steps before it were lost (the file was cut short by a crash, or damaged).
DATA_CHANGE, LOST_RECORDS = "data_change", "lost_records"

LOSS_SERIES = (TRAIN_LOSS, VAL_LOSS)  # what marsgpt/plot.py draws
FILE_NAME = "metrics.jsonl"
STOPPED = "stopped"  # a record's line saying what stopped the run early and where it continues (exits.say_stop)


class MetricsError(ValueError):
    """metrics.jsonl cannot be read or written (a full disk, a read-only file system); one line for the user."""


def _json_number(value):
    return value if value is None or math.isfinite(value) else None  # JSON has no NaN / inf


def wandb_credentials_present():
    """Whether wandb can log in without asking: an API key in the environment, its settings or ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import wandb

    try:
        return bool(wandb.login(prompt=False, verify=False))  # reads the stored key; never prompts
    except Exception:  # an unreadable settings file or netrc counts as no login
        return False


def wandb_mode():
    """WANDB_MODE when the user set it; else 'online' with credentials, 'offline' (with a warning) without.

    A node without a login must never stop at wandb's interactive prompt, nor raise: the other ranks
    would wait in a collective until the timeout. Offline runs are synced later with `wandb sync`.
    """
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if wandb_credentials_present():
        return "online"
    print(
        "warning: wandb_log=True but wandb has no login on this machine (no WANDB_API_KEY, no `wandb login`): "
        "logging offline; upload later with `wandb sync <out_dir>/wandb/offline-run-*`",
        file=sys.stderr,
        flush=True,
    )
    return "offline"


class MetricsLog:
    """out_dir/metrics.jsonl (always) and wandb (when cfg.wandb_log): the same records, from rank 0 only.

    On resume the file is cut back to the checkpoint's iteration, so the steps redone after a crash are
    not recorded twice (truncate=False appends without cutting: an evaluation that trains nothing); wandb
    continues the checkpoint's run (its id is in every checkpoint). Whatever a crash or a lost node left in the
    file that is not a whole record -- a line cut short, bytes that are not JSON or not even text -- is dropped
    first (`repairs` says what went), and records written before the checkpoint that did not survive are
    named (`lost`): the checkpoint records how long the file was (`sync`, before each checkpoint), so a
    shorter intact file is a gap, not a silent loss.

    A record that cannot be written (a full disk, a quota) is reported at once in one line naming the file
    and the OS reason; `failed` then holds that line, nothing more is written, and train.py stops the run at
    its next step (marsgpt/run_dir.py): every rank, not only the one that writes.
    """

    def __init__(self, cfg, is_master, resume_iter, wandb_run_id, config, truncate=True, synced_size=None):
        self.enabled = is_master
        self.wandb = None
        self.wandb_run_id = wandb_run_id
        self.failed = None
        self.guard = None  # called before each record is written: what it raises skips the record (a lost lock)
        self.repairs, self.lost = [], None
        if not self.enabled:
            return
        self.path = os.path.join(cfg.out_dir, FILE_NAME)
        try:
            os.makedirs(cfg.out_dir, exist_ok=True)
            if resume_iter is not None:
                self._repair(resume_iter if truncate else None, synced_size)
            elif os.path.exists(self.path):
                os.remove(self.path)  # a fresh run where marsgpt/run_dir.py allowed one (nothing was saved)
            self.file = open(self.path, "a")
        except OSError as e:
            raise MetricsError(f"cannot write {self.path}: {os_reason(e)}") from None
        if cfg.wandb_log:
            import wandb

            try:
                self.wandb = wandb.init(
                    project=cfg.wandb_project,
                    name=cfg.wandb_run_name,
                    id=wandb_run_id or None,
                    resume="allow",
                    config=config,
                    dir=cfg.out_dir,
                    mode=wandb_mode(),
                )
            except Exception as e:  # wandb's own error types differ between releases
                self.file.close()
                raise ValueError(
                    f"wandb could not start ({type(e).__name__}: {e}); fix it, set WANDB_MODE=offline, "
                    "or train without --wandb_log"
                ) from None
            self.wandb_run_id = self.wandb.id
            self.wandb.define_metric(ITER)
            self.wandb.define_metric("*", step_metric=ITER)

    def _repair(self, cut_after, synced_size):
        """Keep only the file's whole records, and with `cut_after` (an iteration) only those up to it; name what
        went (repairs) and, when the intact records end before the `synced_size` bytes the checkpoint saw
        synced, the gap (lost)."""
        lines = list(_lines(self.path)) if os.path.exists(self.path) else []
        damaged = [line for line in lines if line.problem]
        intact = damaged[0].start if damaged else (lines[-1].end if lines else 0)
        if synced_size is not None and intact < synced_size:
            self.lost = (
                f"{self.path} holds {intact:,} intact bytes of the {synced_size:,} it held when the checkpoint was "
                "written: records of the steps before it were lost"
            )
        if damaged:
            first = damaged[0]
            self.repairs.append(
                f"{self.path}: dropped {len(damaged)} line(s) that are not whole records (line {first.number}, "
                f"byte {first.start:,}: {first.problem})"
            )
        kept = [
            line.raw
            for line in lines
            if not line.problem and (cut_after is None or line.record.get(ITER, math.inf) <= cut_after)
        ]
        if len(kept) < len(lines):
            with atomic_writer(self.path, "wb") as f:
                f.writelines(kept)

    def write(self, record):
        if not self.enabled or self.failed:
            return
        record = {k: _json_number(v) if isinstance(v, float) else v for k, v in record.items()}
        if self.guard is not None:
            try:
                self.guard()
            except Exception:  # another launch holds out_dir now: the run stops at its next step boundary
                return
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:
            self._fail(f"cannot append to {self.path}: {os_reason(e)}")
            return
        if self.wandb is not None:
            self.wandb.log(record)

    def sync(self):
        """Put the records written so far on disk (fsync) and return the file's size, which the checkpoint about
        to be written records: no record it covers can then be lost with a node's page cache, and a resume that
        finds fewer bytes names the gap. None on a rank that writes no records, or when the sync failed (then
        reported as a failed write)."""
        if not self.enabled or self.failed:
            return None
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            return os.fstat(self.file.fileno()).st_size
        except OSError as e:
            self._fail(f"cannot sync {self.path}: {os_reason(e)}")
            return None

    def _fail(self, line):
        self.failed = line
        sys.stderr.write(f"error: {line}\n")
        sys.stderr.flush()

    def close(self):
        if self.enabled:
            try:
                self.file.close()
            except OSError:  # the buffered tail of a failed write: reported when it failed
                pass
            if self.wandb is not None:
                self.wandb.finish()


def format_duration(seconds):
    """'45 s', '14 min 37 s', '3 h 12 min', '2 d 5 h': two units at most, for a person to read."""
    seconds = round(seconds)
    for unit, size, smaller, smaller_size in (("d", 86400, "h", 3600), ("h", 3600, "min", 60), ("min", 60, "s", 1)):
        if seconds >= size:
            rest = (seconds % size) // smaller_size
            return f"{seconds // size} {unit} {rest} {smaller}" if rest else f"{seconds // size} {unit}"
    return f"{seconds} s"


PACE_WINDOW_S = 300  # the time left goes by the pace of the last 5 minutes' train lines (LogWindow.progress)


@dataclasses.dataclass
class LogWindow:
    """Steps since the last train line: their losses (on the device) and wall-clock time.

    A checkpoint part, the metrics' cursor within a train line: a run resumed between two train lines averages
    the same steps' losses into the next one as the run left alone. Each rank's sum is its own (the train line
    all-reduces them), so state_dict() takes every rank's (gathered by `gather`, a collective under DDP) and
    load_state_dict() gives each rank its own when the world size (this run's world_size ranks) is the same, else
    the total to rank 0.
    The timing restarts with the process, and so does the pace that progress() measures."""

    loss_sum: torch.Tensor | None = None
    losses: int = 0
    steps: int = 0
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    device: str = "cpu"
    rank: int = 0
    world_size: int = 1
    gather: object = None  # this rank's loss sum -> every rank's
    # (iter, time) of this process's recent train lines, the oldest PACE_WINDOW_S or more before the newest: the pace
    lines: collections.deque = dataclasses.field(default_factory=collections.deque)

    def add(self, loss, skipped):
        self.steps += 1
        if not skipped:
            self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
            self.losses += 1

    def restart(self):
        self.loss_sum, self.losses, self.steps, self.t0 = None, 0, 0, time.perf_counter()

    def mean_loss(self, sum_over_ranks):
        """The mean loss of the window's counted steps over every rank (a 0-d tensor on the device; nan when every
        step was skipped): each rank's mean, added up by `sum_over_ranks` -- the run's all-reduce, which every rank
        joins -- over the world size."""
        if not self.losses:
            return torch.full((), math.nan, device=self.device)
        return sum_over_ranks(self.loss_sum / self.losses) / self.world_size

    def progress(self, iter_num, max_iters):
        """'3.6% done, 14 min 37 s left' for the train line at iter_num (before restart()). The pace is this
        process's over its recent train lines, the last PACE_WINDOW_S seconds of them (from the line before, when
        that was longer ago): evaluations and checkpoints between them are counted, neither a compiled model's
        first step (it compiles) nor a resume's start weighs on it, and when other work slows the machine down,
        or stops doing so, the estimate follows within that window. The first line, with nothing before it, goes
        by its own steps."""
        now = time.perf_counter()
        self.lines.append((iter_num, now))
        while len(self.lines) > 2 and now - self.lines[1][1] >= PACE_WINDOW_S:
            self.lines.popleft()
        if len(self.lines) == 1:
            step_s = (now - self.t0) / self.steps
        else:
            step_s = (now - self.lines[0][1]) / (iter_num - self.lines[0][0])
        left = max(max_iters - iter_num, 0) * step_s
        return f"{iter_num / max_iters:.1%} done, {format_duration(left)} left"

    def state_dict(self):
        mine = 0.0 if self.loss_sum is None else self.loss_sum.item()  # a float32 value: exact as a float
        return {"loss_sums": self.gather(mine) if self.gather else [mine], "losses": self.losses}

    def load_state_dict(self, state):
        """The window a checkpoint holds; None (a checkpoint written before the window was one of its parts, always
        right after an evaluation, where the window is empty): an empty window."""
        self.restart()
        if state is None:
            return
        sums = state["loss_sums"]
        mine = sums[self.rank] if len(sums) == self.world_size else sum(sums) if self.rank == 0 else 0.0
        self.losses = state["losses"]
        if self.losses:
            self.loss_sum = torch.tensor(mine, dtype=torch.float32, device=self.device)


def record_axes(iter_num: int, tokens: int, time_s: float) -> dict:
    """The x axes every record carries."""
    return {ITER: iter_num, TOKENS: tokens, TIME_S: time_s}


@dataclasses.dataclass
class TrainLine:
    """A train line: how the steps since the previous one went (`at`: their last step's record_axes), as the record
    metrics.jsonl holds and the line printed for it."""

    at: dict
    loss: float  # the mean loss of the window's steps that were not skipped (NaN: none was)
    lr: float
    grad_norm: float  # the last step's, before clipping
    clip_rate: float  # the fraction of the run's steps so far that were clipped
    param_norm: float
    skipped_steps: int  # in the run so far
    tokens_per_sec: float
    step_s: float  # the window's seconds per step
    mfu: tuple  # (PaLM's, llm.c's) model FLOPs utilisation as fractions, each None off a GPU of known peak
    state_norms: dict  # {name: value}: the optimizer's (training_optimizer.TrainingOptimizer.state_norms)

    def record(self) -> dict:
        mfu, mfu_llmc = (None if m is None else m * 100 for m in self.mfu)
        return {
            **self.at,
            TRAIN_LOSS: self.loss,
            LR: self.lr,
            GRAD_NORM: self.grad_norm,
            CLIP_RATE: self.clip_rate,
            TOKENS_PER_SEC: self.tokens_per_sec,
            STEP_MS: self.step_s * 1000,
            MFU: mfu,
            MFU_LLMC: mfu_llmc,
            PARAM_NORM: self.param_norm,
            SKIPPED_STEPS: self.skipped_steps,
            **self.state_norms,
        }

    def text(self, progress: str) -> str:
        """'iter 250: loss 2.1234, lr ..., 12.3 ms/step, ... tok/s, mfu ...; <progress>' (LogWindow.progress)."""
        mfu, mfu_llmc = self.mfu
        mfu_text = "" if mfu is None else f", mfu {mfu * 100:.1f}% (llm.c's count {mfu_llmc * 100:.1f}%)"
        return (
            f"iter {self.at[ITER]}: loss {self.loss:.4f}, lr {self.lr:.3e}, grad_norm {self.grad_norm:.3f}, "
            f"{self.step_s * 1000:.1f} ms/step, {self.tokens_per_sec:,.0f} tok/s{mfu_text}; {progress}"
        )


CUT_SHORT = "cut short"  # a last line without its newline


@dataclasses.dataclass
class _Line:
    """One line of a metrics.jsonl: where it is, its bytes, and its record or why it is none."""

    number: int  # from 1
    start: int  # its first byte's offset
    raw: bytes  # with its newline
    record: dict | None = None
    problem: str = ""  # why it is not a record: cut short, not UTF-8 text, not valid JSON, not an object

    @property
    def end(self):
        return self.start + len(self.raw)


def _lines(path):
    """Every non-blank line of a metrics.jsonl, read as bytes: a node lost mid-write can leave any bytes at the
    end (a line cut short, zeros, garbage that is not text)."""
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line, offset = _Line(number, offset, raw), offset + len(raw)
            if not raw.strip():
                continue
            if not raw.endswith(b"\n"):
                line.problem = CUT_SHORT
            else:
                try:
                    line.record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    line.problem = "not UTF-8 text"
                except json.JSONDecodeError as e:
                    line.problem = f"not valid JSON ({e.msg})"
                else:
                    if not isinstance(line.record, dict):
                        line.record, line.problem = None, "not a JSON object"
            yield line


def _numbered_records(path):
    """(line number, record) for each record of a metrics.jsonl. A last line cut short (the run was killed
    mid-write) is skipped; any other line that is not a record raises ValueError naming it (train.py drops such
    lines when it resumes the run)."""
    for line in _lines(path):
        if not line.problem:
            yield line.number, line.record
        elif line.problem != CUT_SHORT:
            raise ValueError(f"{path}, line {line.number}: {line.problem}")


def last_iteration(run_dir):
    """The highest `iter` of run_dir/metrics.jsonl's records, or None when it holds none; ValueError naming a
    malformed line, OSError when it cannot be read."""
    records = _numbered_records(os.path.join(run_dir, FILE_NAME))
    return max((record.get(ITER, 0) for _, record in records), default=None)


def read_records(run_dir):
    """Every record of run_dir/metrics.jsonl, in file order, as dicts.

    A half-written last line (the run was killed mid-write) is skipped; any other malformed line raises
    ValueError naming the file and line, and a missing file FileNotFoundError.
    """
    return [record for _, record in _numbered_records(os.path.join(run_dir, FILE_NAME))]


def summary_lines(run_dir, tokens, time_s, best_checkpoint=None):
    """The lines that end a finished run: its best validation loss and the iteration it came at (every
    launch's evaluations, from run_dir/metrics.jsonl), the tokens and wall-clock time it trained (`tokens`,
    `time_s`: every launch's), where its metrics are and the command that plots them. `best_checkpoint`: the
    file holding the best evaluation's weights (best.pt), when there is one."""
    try:
        evaluations = read_metrics(run_dir, (VAL_LOSS,))[VAL_LOSS]
    except (OSError, ValueError):  # no evaluation recorded (or an unreadable file: reported when written)
        evaluations = []
    trained = f"{tokens:,} tokens in {format_duration(time_s)}"
    lines = [f"trained {trained}"]
    if evaluations:
        iteration, _, _, loss = min(evaluations, key=lambda point: point[3])
        held = f" ({best_checkpoint} holds it)" if best_checkpoint else ""
        lines = [f"best val loss {loss:.4f} at iter {iteration:,}{held}; trained {trained}"]
    plot = shlex.join(["python", "-m", "marsgpt.plot", run_dir, "--out", os.path.join(run_dir, "loss.png")])
    lines.append(f"metrics: {os.path.join(run_dir, FILE_NAME)}; plot them: {plot}")
    return lines


def read_metrics(run_dir, series=LOSS_SERIES):
    """{name: [(iter, tokens, time_s, value), ...]} for each name in `series`, from run_dir/metrics.jsonl.

    A resumed run logs again the iterations after its checkpoint; the latest record of an iteration wins.
    Raises ValueError naming the file and line when it is missing, malformed or has none of `series`.
    """
    path = os.path.join(run_dir, FILE_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"{path} does not exist: is {run_dir!r} a training run's out_dir?")
    latest = {name: {} for name in series}
    for lineno, record in _numbered_records(path):
        for name in series:
            if record.get(name) is None:
                continue
            missing = [k for k in (ITER, TOKENS, TIME_S) if k not in record]
            if missing:
                raise ValueError(f"{path}, line {lineno}: a {name} record without {', '.join(missing)}")
            latest[name][record[ITER]] = (record[ITER], record[TOKENS], record[TIME_S], record[name])
    result = {name: [points[i] for i in sorted(points)] for name, points in latest.items()}
    if not any(result.values()):
        raise ValueError(f"{path} has no {' or '.join(series)} records yet")
    return result
