"""marsgpt/stop_signals.py on its own: what the first, second and third stop signal do, a Ctrl-C inside a save, and a
signal the process was started ignoring. Through the command line: tests/test_train_faults.py."""

import os
import signal
import time

import pytest

from marsgpt.stop_signals import StopSignals


def test_stop_signals_are_recorded_and_the_previous_handlers_restored():
    signals = StopSignals()
    before = signal.getsignal(signal.SIGTERM)
    signals.install()
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not signals.received and time.monotonic() < deadline:
        time.sleep(0.01)
    assert signals.received == signal.SIGUSR1  # the first one counts
    signals.restore()
    assert signal.getsignal(signal.SIGTERM) == before


def test_ctrl_c_interrupts_once_a_second_is_answered_and_a_hang_up_the_process_ignores_stays_ignored(capfd):
    """SIGINT raises KeyboardInterrupt once; a second is answered with a line and does not stop the process while it
    finishes (torchrun passes a Ctrl-C on again while the run waits for its checkpoint in flight; a third quits at
    once: tests/test_train_faults.py); a SIGHUP ignored at start (nohup) is left ignored."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts the process
    signals = StopSignals().install()
    try:
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # answered
        assert not signals.received and signals.interrupted and signals.count == 2
        assert "SIGINT again: still finishing" in capfd.readouterr().err
    finally:
        signals.restore()
        signal.signal(signal.SIGHUP, previous)


def test_a_ctrl_c_inside_a_save_is_raised_once_the_save_is_handed_over(capfd):
    signals = StopSignals().install()
    handed_over = False
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals.deferred_interrupt(8):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.01)  # the handler has run: it did not raise here
                handed_over = True
        assert handed_over
        assert capfd.readouterr().err == "interrupted: handing the checkpoint of iter 8 to the disk first\n"
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
