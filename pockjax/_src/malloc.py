"""glibc's malloc for training steps: transparent huge pages for large buffers.

XLA's CPU runtime takes each step's scratch memory with one `malloc` (hundreds of MiB
for a small LLaMA's step). glibc serves a request that large with a fresh `mmap` and
gives it back with `munmap` when the step ends, so every step faults the whole buffer
in again, one 4 KiB page at a time. glibc's `glibc.malloc.hugetlb=1` tunable makes
malloc advise transparent huge pages for its mappings, and the same buffer comes in
2 MiB pages. The results are the same (allocation does not change arithmetic), and so
is the peak memory; the first step can take longer where the kernel compacts memory to
find huge pages. The measurements are in docs/results.md ("The small model's step
against PyTorch and peft").

glibc reads its tunables when a process starts, so the `pockjax` command sets the
tunable in its environment and starts itself again before any work. A program that
trains through the Python API gets the same by starting Python with
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`. `POCKJAX_MALLOC=system` keeps the system's
settings (`hugepages`, or unset, is the default). Where the tunable does not exist (not
Linux, not glibc 2.35 or later) or transparent huge pages are off (`never`), nothing
changes.

This module imports nothing beyond the standard library: the command line calls it
before loading JAX.
"""
from __future__ import annotations

import os
import sys

__all__ = ["TUNABLE", "restart_tuned", "thp_mode", "tuned_environ"]

TUNABLE = "glibc.malloc.hugetlb=1"
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
_RESTARTED = "POCKJAX_MALLOC_RESTARTED"


def _glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the running glibc, or None where the C library is another."""
    try:
        name, _, version = os.confstr("CS_GNU_LIBC_VERSION").partition(" ")
    except (AttributeError, ValueError, OSError):
        return None
    if name != "glibc":
        return None
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def thp_mode(path: str = _THP) -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`), or None
    where it cannot be read."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def tuned_environ(environ=None) -> dict | None:
    """`environ` (default `os.environ`) with `TUNABLE` added to `GLIBC_TUNABLES`, or None
    where it does not apply: `POCKJAX_MALLOC=system`, a hugetlb tunable already set, not
    glibc 2.35 or later on Linux, or transparent huge pages off.

    Raises:
      ValueError: `POCKJAX_MALLOC` is set to something other than `system` or
        `hugepages`; the message names the two.
    """
    env = dict(os.environ if environ is None else environ)
    choice = env.get("POCKJAX_MALLOC", "").strip().lower()
    if choice == "system":
        return None
    if choice not in ("", "hugepages"):
        raise ValueError(f"POCKJAX_MALLOC={env['POCKJAX_MALLOC']!r}: set it to 'system' to "
                         f"keep the system's malloc settings, or 'hugepages' (the same as "
                         f"leaving it unset) for glibc's huge pages")
    current = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in current:
        return None
    if not sys.platform.startswith("linux") or (_glibc_version() or (0, 0)) < (2, 35):
        return None
    if thp_mode() in (None, "never"):
        return None
    env["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}" if current else TUNABLE
    return env


def restart_tuned() -> None:
    """Start this process again, the same command line, with `tuned_environ()`; return
    where it does not apply (including in the process so started, whose environment
    has the tunable) or the command line is not known. A bad `POCKJAX_MALLOC` stops the
    command with its message."""
    try:
        env = tuned_environ()
    except ValueError as e:
        raise SystemExit(f"pockjax: {e}") from None
    argv = getattr(sys, "orig_argv", None)
    if env is None or not argv or not sys.executable or os.environ.get(_RESTARTED):
        return
    env[_RESTARTED] = "1"  # once, even where the tunable does not reach the new process
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError:  # not startable again here: run as started
        return
