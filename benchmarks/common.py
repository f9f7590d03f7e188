"""What the benchmark scripts share: memory readings, the one-process-per-row protocol,
and the machine description. Imports neither JAX nor PyTorch (rows import one of them)."""
from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def proc_status_kib(*keys: str) -> dict[str, int]:
    """These fields of `/proc/self/status` (`VmRSS`, `VmHWM`, ...) in KiB; the ones
    missing (or all, off Linux) are left out."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in keys:
                    out[key] = int(line.split()[1])
    except OSError:
        pass
    return out


def rss_mib() -> float:
    """This process's resident memory now."""
    return proc_status_kib("VmRSS").get("VmRSS", float("nan")) / 1024


def peak_rss_mib() -> float:
    """This process's peak resident memory, from the OS: `VmHWM` on Linux. Not
    `ru_maxrss`, which a process started by fork and exec inherits from its parent: a
    row using 13 MiB reported the 814 MiB of the process that started it."""
    hwm = proc_status_kib("VmHWM").get("VmHWM")
    if hwm is not None:
        return hwm / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def trim_heap() -> None:
    """Hand the C heap's freed pages back to the OS (glibc's `malloc_trim`; a no-op
    elsewhere). XLA's compiler frees most of what it allocates, but glibc keeps those
    pages resident. The library does not call it (docs/training.md, "The process's own memory")."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def timed_steps(step, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    """`warmup + steps` calls of `step()`: every step's loss and the timed steps' seconds.
    `step()` returns the loss as a float (synchronised); warm-up includes compilation.
    After the first step, every row hands the C heap's freed pages back to the OS."""
    losses, times = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = step()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
        losses.append(loss)
        if i == 0:
            trim_heap()
    return losses, times


def report_result(result: dict) -> None:
    """A row process's answer to `run_row` (on stdout)."""
    result["rss_peak_mib"] = peak_rss_mib()
    print("RESULT " + json.dumps(result), flush=True)


def run_row(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    """Run one row in its own process (with environment `env`, or this one's); its
    `report_result` dict plus `wall_s`, or `{"error": reason}` (a timeout, or the last
    error line of a failed process)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT "):]), "wall_s": wall}
    lines = [l for l in (proc.stderr or proc.stdout).strip().splitlines() if l.strip()]
    errors = [l for l in lines if "Error" in l or "error" in l]
    tail = (errors or lines or ["no output"])[-1].strip()
    return {"error": f"exit {proc.returncode}: {tail[:240]}"}


def versions(names) -> str:
    import importlib.metadata as md

    out = []
    for name in names:
        try:
            out.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            out.append(f"{name} (not installed)")
    return ", ".join(out)


def commit() -> str:
    """The checkout's commit, with "+ uncommitted changes" when its files differ from it."""
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" + uncommitted changes" if dirty else "")


DEFAULT_MALLOC = "glibc's default"
MALLOC_MODES = ("pockjax", "hugepages", "system")


def malloc_setting(env) -> str:
    """How a process with environment `env` sets its allocator (pockjax's reuse of each
    step's memory, glibc's tunables), and the kernel's transparent huge page mode."""
    from pockjax._src.malloc import thp_mode

    own = env.get("POCKJAX_MALLOC", "").strip().lower() == "system"
    parts = ["`POCKJAX_MALLOC=system` (JAX's and glibc's own settings)" if own else
             "pockjax's reuse of each step's memory (the default)"]
    if env.get("GLIBC_TUNABLES"):
        parts.append(f"`GLIBC_TUNABLES={env['GLIBC_TUNABLES']}`")
    return ", ".join(parts) + f", transparent huge pages `{thp_mode() or 'unknown'}`"


def malloc_env(mode: str) -> tuple[dict, str]:
    """The row processes' environment for the allocator, and its description: 'pockjax'
    (what a user gets: each CPU step's scratch memory reused from the last step, see
    pockjax/_src/malloc.py), 'hugepages' (the same, and glibc's huge-page tunable) or
    'system' (`POCKJAX_MALLOC=system`: JAX's and glibc's own settings, each step's large
    buffers mapped afresh and faulted in one 4 KiB page at a time)."""
    if mode not in MALLOC_MODES:
        raise ValueError(f"malloc mode {mode!r}: one of {', '.join(MALLOC_MODES)}")
    env = dict(os.environ)
    env.pop("POCKJAX_MALLOC", None)
    tunables = [t for t in env.pop("GLIBC_TUNABLES", "").split(":")
                if t and not t.startswith("glibc.malloc.hugetlb=")]
    if mode == "hugepages":
        tunables.append("glibc.malloc.hugetlb=1")
    if mode == "system":
        env["POCKJAX_MALLOC"] = "system"
    if tunables:
        env["GLIBC_TUNABLES"] = ":".join(tunables)
    return env, malloc_setting(env)


def add_malloc_option(ap) -> None:
    """`--malloc pockjax|hugepages|system` on a benchmark's argument parser (see
    `malloc_env`)."""
    ap.add_argument("--malloc", choices=MALLOC_MODES, default="pockjax",
                    help="the allocator in every row's process: 'pockjax' (the default: what a "
                         "user gets, each step's memory reused), 'hugepages' (and "
                         "GLIBC_TUNABLES=glibc.malloc.hugetlb=1), 'system' "
                         "(POCKJAX_MALLOC=system: JAX's and glibc's own settings)")
