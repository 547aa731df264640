"""The signals that stop a run, as train.py's command line takes them over for the life of its process: which stop
it at the next step boundary with a checkpoint, which interrupt it at once, and what a second and a third do.
marsgpt/run_dir.py acts on them at each step boundary; marsgpt/checkpointer.py defers an interrupt inside a save.
"""

import contextlib
import os
import signal
import sys
import threading


class StopSignals:
    """The signals that end a run, as train.py's command line takes them over for the life of the process.

    SIGTERM (a scheduler's preemption or time limit, `kill`, torchrun passing one on), SIGUSR1 (what
    scripts/slurm_mars_small.sbatch asks SLURM for before the time limit) and SIGHUP (the terminal of the ssh
    session the run was started from went away) end the run at the next step boundary with a checkpoint. The
    handler only records the first one; the loop acts on it. After a SIGHUP the terminal cannot take output any
    more (a write to it fails with EIO): stdout and stderr, where they were that terminal, go to /dev/null.

    SIGINT (Ctrl-C) stops the run where it is (a KeyboardInterrupt: a step that hangs stops too), except inside a
    save (deferred_interrupt): the save is handed to the writer first, so the checkpoint of the step just finished
    is the one the way out waits for. A second stop signal of any kind is answered with a line and does not stop
    the process while it finishes; a third quits at once, losing the checkpoint in flight (as Ctrl-\\, SIGQUIT,
    does). `speaks`: this process says so (rank 0; the others stay quiet).

    A SIGHUP or SIGINT the process was started ignoring stays ignored: `nohup` asks that the run survive the
    terminal, and a shell script's background job (`&`) that its Ctrl-C not reach it.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
    QUIT_AT = 3  # the stop signal that quits at once

    def __init__(self):
        self.received = 0  # the first stop signal (not SIGINT): the loop stops at the next step boundary
        self.interrupted = False  # a SIGINT arrived
        self.count = 0  # stop signals and SIGINTs so far
        self.speaks = True
        self.saving = None  # inside a save: the iteration being saved (deferred_interrupt)
        self._pending = False  # a SIGINT that arrived inside a save, raised once the save is handed over
        self._previous = {}
        self._terminal = []  # the standard streams' descriptors that are a terminal

    def install(self):
        """Take the signals over (train.py's command line does; a RunDir built elsewhere leaves them alone);
        returns self."""
        if threading.current_thread() is not threading.main_thread():  # Python sets handlers from there only
            return self
        handlers = {s: self._record for s in self.SIGNALS} | {signal.SIGINT: self._interrupt}
        for s, handler in handlers.items():
            if s in (signal.SIGHUP, signal.SIGINT) and signal.getsignal(s) is signal.SIG_IGN:
                continue
            self._previous[s] = signal.signal(s, handler)
        self._terminal = [fd for fd in (1, 2) if os.isatty(fd)]
        return self

    def _record(self, signum, frame):
        if signum == signal.SIGHUP:
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in self._terminal:
                os.dup2(devnull, fd)
            os.close(devnull)
        if self._again(signum):
            return
        self.received = self.received or signum

    def _interrupt(self, signum, frame):
        if self._again(signum) or self.interrupted:
            return
        self.interrupted = True
        if self.saving is not None:
            self._pending = True
            self._say(f"interrupted: handing the checkpoint of iter {self.saving} to the disk first")
            return
        raise KeyboardInterrupt

    def _again(self, signum):
        """Count a stop signal; True when it is not the first (it was answered, or the process quits now)."""
        self.count += 1
        name = signal.Signals(signum).name
        if self.count >= self.QUIT_AT:
            self._say(f"{name} a third time: quitting at once; a checkpoint in flight is lost")
            os._exit(128 + signum)
        if self.count == 1:
            return False
        self._say(
            f"{name} again: still finishing (a checkpoint in flight reaches the disk first); a third signal "
            "(or Ctrl-\\) quits at once, losing it"
        )
        return True

    def _say(self, line):
        if self.speaks:  # os.write: a handler may run inside another print, which print cannot reenter
            with contextlib.suppress(OSError):
                os.write(2, (line + "\n").encode())

    @contextlib.contextmanager
    def deferred_interrupt(self, iteration):
        """A save of `iteration` that a Ctrl-C does not cut short: an interrupt arriving inside is raised when the
        block ends (the state handed to the writer, which the way out waits for)."""
        self.saving = iteration
        try:
            yield
        finally:
            self.saving = None
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt

    def restore(self):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def ignore_from_now(self):
        """The process is about to exit: the signals taken over are ignored from now on. Python's teardown puts
        back the default handler (which kills) in place of any Python one, so a second SIGTERM that arrived during
        it ended a run that had stopped cleanly with status 143; an ignored signal stays ignored through it."""
        for s in self._previous:
            signal.signal(s, signal.SIG_IGN)


def say(line, to_terminal=False):
    """A line about a stop, on stderr, never raising: where stderr is a pipe whose reader is gone, on the terminal
    instead, and with `to_terminal` (after a Ctrl-C) on the terminal as well when stderr is not it -- the same Ctrl-C
    ends a pipe's reader (`2>&1 | tee log`), which takes the line with it unread."""
    try:
        print(line, file=sys.stderr, flush=True)
        written = True
    except OSError:  # the pipe is closed already
        written = False
    if written and not to_terminal:
        return
    with contextlib.suppress(OSError, ValueError):
        if not written or not sys.stderr.isatty():
            with open("/dev/tty", "w") as terminal:  # ENXIO where the process has no terminal
                terminal.write(line + "\n")
