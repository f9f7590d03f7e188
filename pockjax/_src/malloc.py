"""Each training step's scratch memory reused from the last step, not mapped afresh.

XLA's CPU runtime takes a step's scratch memory with one `malloc` (hundreds of MiB for a
small LLaMA's step). glibc serves a request that large with a fresh `mmap` and gives it
back with `munmap` when the step ends, so every step faults the whole buffer in again, one
4 KiB page at a time.
pockjax changes two settings inside the process, with no environment variable:

- `import pockjax` turns off JAX's asynchronous dispatch on CPU
  (`jax_cpu_enable_async_dispatch`) where JAX's backends have not started yet
  (`prepare_dispatch`; where JAX is not loaded yet, as soon as it is). A step on one
  CPU device then runs on the thread that calls it. That matters because in any other
  thread glibc's arena is made of 64 MiB heaps, and a larger request is mapped afresh
  whatever the settings.
- The first step run on CPU sets glibc's `M_MMAP_MAX` to 0 and `M_TRIM_THRESHOLD` to its
  largest value (`reuse_step_memory`): large blocks come from the heap and stay in it
  when freed, so the next step's scratch memory is the same pages, already mapped.

The results are the same (allocation does not change arithmetic), and so is the peak
memory; what changes is that the heap keeps its largest size until the process ends
instead of shrinking between steps. A step no longer overlaps
the Python loop's own work (reading back the loss, the next batch) with its
computation; the measurements are in docs/results.md.

`POCKJAX_MALLOC=system` keeps JAX's and glibc's own settings (for the dispatch, so does
turning the flag back on with `jax.config.update` after importing pockjax). Where a step
still runs on JAX's dispatch threads (JAX's backends started before pockjax was
imported, the flag turned back on, or a step over several devices), the first such step
says so once, with the way out: import pockjax first, or start Python with
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, which makes glibc's fresh mappings come in 2 MiB
pages. Neither setting exists outside Linux's glibc, where nothing changes.

This module imports nothing beyond the standard library: `import pockjax` calls it, and
the device runtime imports pockjax without JAX.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import warnings

__all__ = ["FLAG", "choice", "prepare_dispatch", "reuse_step_memory", "thp_mode"]

FLAG = "jax_cpu_enable_async_dispatch"  # JAX reads no environment variable for it
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h
_state = {"steps": None}  # what reuse_step_memory did


def choice(environ=None) -> str:
    """`POCKJAX_MALLOC` in `environ` (default `os.environ`): 'reuse' (unset, the default)
    or 'system'.

    Raises:
      ValueError: it is set to something else; the message names the two.
    """
    env = os.environ if environ is None else environ
    value = env.get("POCKJAX_MALLOC", "").strip().lower()
    if value in ("", "reuse"):
        return "reuse"
    if value == "system":
        return "system"
    raise ValueError(f"POCKJAX_MALLOC={env['POCKJAX_MALLOC']!r}: set it to 'system' to keep "
                     f"JAX's and glibc's own memory settings, or 'reuse' (the same as leaving "
                     f"it unset) to reuse each training step's memory")


def _glibc() -> bool:
    """Whether this process runs on Linux's glibc (where `mallopt` takes these settings)."""
    try:
        name = os.confstr("CS_GNU_LIBC_VERSION").partition(" ")[0]
    except (AttributeError, ValueError, OSError):
        return False
    return sys.platform.startswith("linux") and name == "glibc"


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


def _turn_off() -> bool:
    """`jax_cpu_enable_async_dispatch` set False where JAX's backends have not started."""
    try:
        from jax._src import xla_bridge
        from jax._src.config import config
        if xla_bridge.backends_are_initialized():
            return False
        config.update(FLAG, False)
    except Exception:  # another JAX than the one this was written against: leave it
        return False
    return True


class _WhenJaxLoads(importlib.abc.MetaPathFinder):
    """Sets the flag right after JAX defines it (the module below), for a program that
    imports pockjax before JAX: JAX reads no environment variable for this flag."""

    MODULE = "jax._src.xla_bridge"

    def find_spec(self, name, path, target=None):
        if name != self.MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _turn_off()

        spec.loader.exec_module = exec_module
        return spec


def prepare_dispatch(environ=None) -> str | None:
    """Turn off JAX's asynchronous dispatch on CPU, where it is still ours to choose:
    where JAX is loaded but its backends have not started, through `jax.config`; before
    JAX is loaded, the same as soon as it is. Nothing changes where `POCKJAX_MALLOC` (in
    `environ`, default `os.environ`) is 'system' or not understood (its error comes with
    the first step), or the backends already run.

    Returns:
      'config' (set), 'import' (to be set when JAX loads), or None.
    """
    env = os.environ if environ is None else environ
    try:
        if choice(env) == "system" or not _glibc():
            return None
    except ValueError:
        return None
    if _WhenJaxLoads.MODULE not in sys.modules:
        if not any(isinstance(f, _WhenJaxLoads) for f in sys.meta_path):
            sys.meta_path.insert(0, _WhenJaxLoads())
        return "import"
    return "config" if _turn_off() else None


def _mallopt(param: int, value: int) -> None:
    import ctypes
    try:
        ctypes.CDLL(None).mallopt(param, value)
    except (OSError, AttributeError):  # no mallopt in this C library: nothing to set
        pass


def reuse_step_memory(devices: int = 1) -> str | None:
    """Called before each step a trainer runs (the work is done once per process): on CPU,
    keep large blocks in glibc's heap so each step's scratch memory is the last step's.

    Args:
      devices: how many devices the step runs on (several: JAX runs it on its own
        threads, whose memory this cannot keep).

    Returns:
      'reuse' (glibc's settings changed now), 'warned' (the step runs on JAX's threads:
      said now, once a process), or None (nothing to do: already done, not on CPU, not
      glibc, or `POCKJAX_MALLOC=system`).

    Raises:
      ValueError: `POCKJAX_MALLOC` holds something other than 'system' or 'reuse'.
    """
    if _state["steps"] in ("reuse", "none"):
        return None
    mode = choice()
    import jax

    if mode == "system" or not _glibc() or jax.default_backend() != "cpu":
        _state["steps"] = "none"
        return None
    if devices == 1 and not jax.config.read(FLAG):
        _mallopt(_M_MMAP_MAX, 0)
        _mallopt(_M_TRIM_THRESHOLD, -1)  # read as size_t: the largest threshold, never trim
        _state["steps"] = "reuse"
        return "reuse"
    if _state["steps"] == "warned" or "glibc.malloc.hugetlb" in os.environ.get(
            "GLIBC_TUNABLES", ""):
        return None
    _state["steps"] = "warned"
    if devices > 1:
        why, way = (f"the step runs on {devices} devices, which JAX runs on its own threads",
                    "Start Python")
    else:
        why, way = ("JAX's CPU backend started before pockjax was imported (or "
                    f"{FLAG} was turned back on), so the step runs on JAX's dispatch thread",
                    "Import pockjax before running anything with JAX, or start Python")
    warnings.warn(f"pockjax: {why}, where glibc maps the step's scratch memory afresh every "
                  f"step (a small LLaMA's step up to 1.5x slower). {way} with "
                  f"GLIBC_TUNABLES=glibc.malloc.hugetlb=1 for huge pages (POCKJAX_MALLOC=system "
                  f"silences this)", RuntimeWarning, stacklevel=3)
    return "warned"
