"""The one table of export targets: it drives `export`, the CLI's choices and the docs."""
from __future__ import annotations

import dataclasses

__all__ = ["Target", "TARGETS", "resolve_target", "ExportError"]


class ExportError(RuntimeError):
    """Raised when an artifact cannot be made, read or run: a bad target, input, device or
    artifact, or a compiler or runtime failure."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One export target: the IREE device it compiles for and the exact compiler flags.

    The entries of `TARGETS` are the targets `export`, `pockjax export --target` and the
    docs offer; `resolve_target` turns one into its full list of flags.

    Attributes:
      name: the name `export(target=...)` and `--target` take (`"host-cpu"`, ...).
      description: one line for `pockjax targets`.
      backend: the IREE HAL target device: `"local"`, `"vulkan"` or `"cuda"`.
      driver: the default runtime device for `pockjax.runtime.load` (`"local-task"`,
        `"vulkan"`, `"cuda"`).
      flags: the compiler flags, before a GPU family and extra flags.
      gpu_flag: the flag that names a GPU family (`--iree-vulkan-target`,
        `--iree-cuda-target`), or None where the target takes none.
      default_gpu: the GPU family used when `gpu` is not given; None without `gpu_flag`.
      gpus: the families offered by name (IREE accepts more).
      runs_here: whether this machine can run the artifact (CPU, lavapipe, QEMU).
      local_device: whether the target is compiled for the local Vulkan device's
        capabilities, read when exporting.
    """

    name: str
    description: str
    backend: str            # IREE HAL target device
    driver: str             # default runtime device for `pockjax.runtime.load`
    flags: tuple[str, ...]  # compiler flags
    gpu_flag: str | None = None        # flag that names a GPU family, if any
    default_gpu: str | None = None
    gpus: tuple[str, ...] = ()         # families offered by name (IREE accepts more)
    runs_here: bool = True             # can this machine run it (CPU, lavapipe, QEMU)?
    local_device: bool = False         # compiled for the local Vulkan device's capabilities


# Data tiling (packing matmul operands into the CPU's preferred tiles) makes matmuls
# ~2.7x faster on IREE 3.13; the global-optimization path is the one that compiles
# every training step (`--iree-opt-data-tiling` fails on some weight-gradient dispatches
# with "operations with large vector sizes").
_CPU = ("--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
        "--iree-global-opt-data-tiling=true")

# Data-tiled matmul tiles of 4 MiB of operands (IREE's default is smaller): at
# TinyLlama-1.1B's shape (2048x5632 weights, 128 tokens) the step needs 27% less CPU
# time (8.4 -> 6.1 CPU-s on 2 x86 cores, same losses to the bit); at hidden 512 it is
# ~10% slower. It only changes how the work is tiled, so it is safe on any CPU. Kept to
# host-cpu: phone cores have far smaller caches.
_HOST_CPU_TILES = "--iree-llvmcpu-matmul-tile-bytes=4194304"

TARGETS: dict[str, Target] = {t.name: t for t in [
    Target("host-cpu", "this machine's CPU (IREE llvm-cpu, local-task runtime)", "local",
           "local-task", _CPU + ("--iree-llvmcpu-target-cpu=host", _HOST_CPU_TILES)),
    Target("android-arm64", "Android ARM64 CPU (runs here under qemu-aarch64)", "local",
           "local-task", _CPU + ("--iree-llvmcpu-target-triple=aarch64-linux-android34",
                                 "--iree-llvmcpu-target-cpu-features=+v8.2a,+neon,+dotprod,+i8mm,+fullfp16")),
    Target("host-vulkan", "this machine's Vulkan GPU, compiled for its real capabilities "
           "(subgroup size, fp16/int8, 8/16-bit storage, dot product)", "vulkan", "vulkan",
           ("--iree-hal-target-device=vulkan",), local_device=True),
    Target("android-vulkan", "Android GPU through Vulkan (SPIR-V)", "vulkan", "vulkan",
           ("--iree-hal-target-device=vulkan",), gpu_flag="--iree-vulkan-target",
           default_gpu="vp_android_baseline_2022", gpus=("vp_android_baseline_2022", "valhall",
                                                         "adreno")),
    Target("jetson-cuda", "NVIDIA Jetson Orin through CUDA (sm_87)", "cuda", "cuda",
           ("--iree-hal-target-device=cuda",), gpu_flag="--iree-cuda-target", default_gpu="sm_87",
           gpus=("sm_87", "sm_72"), runs_here=False),
]}
"""Every export target by name: the one table behind `export`, the CLI's `--target`
choices and the docs."""


def resolve_target(name: str, gpu: str | None = None,
                   extra_flags: tuple[str, ...] | list[str] = ()) -> tuple[Target, tuple[str, ...]]:
    """The target and its exact compiler flags (with the GPU family and extra flags).

    Args:
      name: a key of `TARGETS`.
      gpu: the GPU family for a target with a `gpu_flag` (e.g. `"valhall"`, `"sm_72"`);
        None: the target's `default_gpu`.
      extra_flags: compiler flags appended after the target's own, each of the form
        `--flag` or `--flag=value`.

    Returns:
      `(target, flags)`: the `Target` and the tuple of flags to pass to the compiler.

    Raises:
      ExportError: `name` is not a target; `gpu` is given for a target without GPU
        families; an extra flag is not a string starting with `--`.
    """
    if name not in TARGETS:
        raise ExportError(f"unknown target {name!r}; choose one of: {', '.join(TARGETS)} "
                          "(`pockjax targets` lists them with their flags)")
    t = TARGETS[name]
    flags = list(t.flags)
    if gpu is not None and t.gpu_flag is None:
        raise ExportError(f"target {name!r} takes no GPU family (got gpu={gpu!r}); GPU families "
                          f"apply to: {', '.join(n for n, x in TARGETS.items() if x.gpu_flag)}")
    if t.gpu_flag:
        flags.append(f"{t.gpu_flag}={gpu or t.default_gpu}")
    for f in extra_flags:
        if not isinstance(f, str) or not f.startswith("--"):
            raise ExportError(f"extra compiler flags must look like '--iree-...=value', got {f!r}")
        flags.append(f)
    return t, tuple(flags)
