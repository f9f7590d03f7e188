"""Host memory: hand the C heap's freed pages back to the operating system."""
from __future__ import annotations

import ctypes
import sys

_trim = None


def release_freed_heap() -> None:
    """`malloc_trim(0)` where the C library is glibc (Linux); a no-op elsewhere.

    XLA's compiler frees most of what it allocates once a program is compiled, but
    glibc keeps the freed pages resident: the MobileNetV2 step (1.0, 128^2, batch 16)
    left 330 MiB of them after compiling, so the training process held 1.09 GiB where
    0.77 GiB was in use. Returning them takes a few milliseconds."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(None).malloc_trim if sys.platform.startswith("linux") else False
        except (OSError, AttributeError):  # not glibc (musl, ...)
            _trim = False
    if _trim:
        _trim(0)
