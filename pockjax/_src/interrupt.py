"""Ctrl-C and SIGTERM: a training loop's two ways of being stopped, both ending in a
saved checkpoint, and neither allowed to cut a step in half.

Schedulers (SLURM, Kubernetes, spot instances) stop a job with SIGTERM and kill it a
grace period later. Inside `stop_on_sigterm`, SIGTERM raises `Terminated`, a
`KeyboardInterrupt`, so every loop that saves on Ctrl-C saves on SIGTERM too.

Standard library only: the device runtime's loop (`pockjax run`) uses it without JAX.
"""
from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["InterruptAfter", "Terminated", "noted_signals", "signal_name", "stop_on_sigterm"]


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (a scheduler stopping the job): handled as Ctrl-C is."""


def signal_name(error: BaseException) -> str:
    """'SIGTERM' for `Terminated`, 'Ctrl-C' for any other `KeyboardInterrupt`."""
    return "SIGTERM" if isinstance(error, Terminated) else "Ctrl-C"


def _terminate(signum, frame):
    raise Terminated


@contextlib.contextmanager
def stop_on_sigterm():
    """Within the block, SIGTERM raises `Terminated`. Where another handler is already
    installed (the user's own), or outside the main thread (signals cannot be handled
    there), or where SIGTERM is ignored, nothing changes; the handler before is put back
    after."""
    installed = (threading.current_thread() is threading.main_thread()
                 and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    if installed:
        signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


class InterruptAfter:
    """Holds Ctrl-C (SIGINT) and SIGTERM back while a step is dispatched, and delivers
    them after.

    A donating step deletes its input state when it runs; an interrupt between that
    and the assignment of its result would lose both. A second signal inside the window
    interrupts at once. After the window the held signal goes to the handler that was
    installed before (Python's default raises KeyboardInterrupt; `stop_on_sigterm`'s
    raises `Terminated`). Nothing is held back outside the main thread (signals cannot be
    handled there), nor for a signal that is ignored or left to the operating system (a
    process started in the background; SIGTERM outside `stop_on_sigterm`)."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.pending = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self._SIGNALS:
                current = signal.getsignal(sig)
                if callable(current):
                    self.previous[sig] = current
                    signal.signal(sig, self._hold)
        return self

    def _hold(self, signum, frame):
        if self.pending is not None:
            self.previous[signum](signum, frame)  # a second signal: at once
            raise KeyboardInterrupt
        self.pending = (signum, frame)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.pending is not None and exc[0] is None:
            signum, frame = self.pending
            self.previous[signum](signum, frame)
        return False


class _Noted:
    """The stop a signal asked for: 0 none, 1 Ctrl-C, 2 SIGTERM (`noted_signals`)."""

    def __init__(self):
        self.code = 0

    def note(self, signum, frame):
        code = 2 if signum == signal.SIGTERM else 1
        if self.code:  # a second signal: at once, as `InterruptAfter` does
            raise self.error(code)
        self.code = code

    def error(self, code: int) -> KeyboardInterrupt:
        """The exception a stop of kind `code` (1 or 2) raises."""
        return Terminated() if code == 2 else KeyboardInterrupt()


@contextlib.contextmanager
def noted_signals():
    """Within the block, Ctrl-C and SIGTERM only note that a stop was asked for (the
    yielded object's `code`); the loop decides when to stop. A run over several processes
    uses it: each process's signal comes at its own moment, and every process must stop
    after the same step (a collective step cannot run in some of them). A second signal
    raises at once. Outside the main thread nothing changes; the handlers before are put
    back after."""
    noted = _Noted()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) not in (signal.SIG_IGN, None):
                previous[sig] = signal.signal(sig, noted.note)
    try:
        yield noted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
