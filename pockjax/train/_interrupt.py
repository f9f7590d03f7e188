"""Ctrl-C held back across a step that must not be cut in half."""
from __future__ import annotations

__all__ = ["InterruptAfter"]


class InterruptAfter:
    """Holds Ctrl-C (SIGINT) back while a step is dispatched, and delivers it after.

    A donating step deletes its input state when it runs; an interrupt between that
    and the assignment of its result would lose both. A second Ctrl-C inside the window
    interrupts at once. After the window the held signal goes to the handler that was
    installed before (Python's default raises KeyboardInterrupt). Nothing is held back
    outside the main thread (signals cannot be handled there), nor where SIGINT is
    ignored or left to the operating system (a process started in the background)."""

    def __enter__(self):
        import signal
        import threading

        self.pending = None
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            current = signal.getsignal(signal.SIGINT)
            if callable(current):
                self.previous = current
                signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame):
        if self.pending is not None:
            raise KeyboardInterrupt
        self.pending = (signum, frame)

    def __exit__(self, *exc):
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            if self.pending is not None and exc[0] is None:
                self.previous(*self.pending)
        return False
