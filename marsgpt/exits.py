"""How a run ends: the one line on stderr and the exit status of whatever ended train.main -- a user's mistake (2),
a stop (a signal 0, a failed write or a divergence 1), Ctrl-C (130), a collective that timed out (1); any other
exception keeps its traceback. The line of a stop also goes into metrics.jsonl (metrics.STOPPED).
"""

import sys

from marsgpt.checkpoint import CheckpointError
from marsgpt.config import TrainConfig
from marsgpt.config_schema import ConfigError
from marsgpt.metrics import MetricsError
from marsgpt.run_dir import RunDir, RunDirError, RunStopped
from marsgpt.runtime import Dist, SetupError, is_collective_timeout
from marsgpt.stop_signals import say
from marsgpt.tokens import DataError

# The errors a user's input, a missing or damaged file or an unusable out_dir can cause: each is one `error:`
# line and exit status 2.
USER_ERRORS = (ConfigError, DataError, CheckpointError, SetupError, RunDirError, MetricsError)

TIMED_OUT = 1  # the exit status after a collective timed out


def say_stop(line, directory, progress, interrupted=False):
    """The line that ends a run early, on stderr (stop_signals.say: after a Ctrl-C, `interrupted`, on the terminal
    too) and in metrics.jsonl (metrics.STOPPED), where it stays with the run."""
    say(line, to_terminal=interrupted)
    if directory is not None and progress is not None:
        directory.record_stop(line, progress)


def exit_status(
    error: BaseException,
    cfg: TrainConfig | None,
    dist_info: Dist | None,
    directory: RunDir | None,
    progress: object | None,
) -> int | None:
    """The exit status for the exception that ended train.main (`directory`, `progress`: the run's RunDir and
    launch.Progress, None before they exist), after its one line on stderr; None for an exception that is not one
    of this repository's (it keeps its traceback)."""
    master = dist_info is None or dist_info.is_master
    if isinstance(error, USER_ERRORS):
        # a setup decision every rank took together fails on every rank: rank 0 says it once
        if master or not isinstance(error, SetupError):
            print(f"error: {error}", file=sys.stderr)
        return 2
    if isinstance(error, RunStopped):  # a signal, divergence, a failed write: rank 0 knows the checkpoints
        if error.line:
            say_stop(error.line, directory, progress)
        return error.status
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C (torchrun passes it to every rank): one line, no traceback
        if master and directory is None:  # while reading the configuration or joining the ranks
            say_stop("interrupted before the run started", None, None)
        elif master:
            directory.checkpoints.wait("interrupted")  # a save in flight is the newest checkpoint
            where = "before the first step" if progress is None else f"at iter {progress.iter_num}"
            say_stop(
                f"interrupted {where}; {directory.checkpoints.resume_advice()}", directory, progress, interrupted=True
            )
        return 130
    if is_collective_timeout(error, dist_info):
        say_stop(
            f"error: rank {dist_info.rank}: a collective timed out after ddp_timeout_s={cfg.ddp_timeout_s} s "
            f"(another rank died or hangs); {directory.checkpoints.resume_advice()}",
            directory,
            progress,
        )
        return TIMED_OUT
    return None
