"""Ctrl-C held back across a step that must not be cut in half."""
from __future__ import annotations

__all__ = ["InterruptAfter"]


class InterruptAfter:
    """Holds Ctrl-C (SIGINT) back while a step is dispatched, and raises it after.

    A donating step deletes its input state when it runs; an interrupt between that
    and the assignment of its result would lose both. A second Ctrl-C inside the window
    interrupts at once. Outside the main thread signals cannot be handled, and nothing
    is held back."""

    def __enter__(self):
        import signal
        import threading

        self.pending = False
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame):
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def __exit__(self, *exc):
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        if self.pending and exc[0] is None:
            raise KeyboardInterrupt
        return False
