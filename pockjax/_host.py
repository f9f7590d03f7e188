"""Host memory: hand the C heap's freed pages back to the operating system."""
from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None (not Linux, or a C library without it, e.g. musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_heap() -> None:
    """`malloc_trim(0)` where the C library is glibc; a no-op elsewhere.

    XLA's compiler frees most of what it allocates once a program is compiled, but
    glibc keeps the freed pages resident: the MobileNetV2 step (1.0, 128^2, batch 16)
    left 330 MiB of them after compiling, so the training process held 1.09 GiB where
    0.77 GiB was in use. Returning them takes tens of milliseconds (24 ms for 260 MB)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
