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

__all__ = ["InterruptAfter", "Terminated", "signal_name", "stop_on_sigterm"]


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
