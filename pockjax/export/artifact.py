"""Write an export artifact: train_step.vmfb, params.irpa and manifest.json, atomically."""
from __future__ import annotations

import dataclasses
import importlib.metadata as md
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pockjax.export import vulkan
from pockjax.export.lowering import Lowered, lower_step
from pockjax.export.manifest import (MANIFEST, PARAMS, SCHEMA_VERSION, SCOPE, VMFB,
                                      read_manifest, sha256)
from pockjax.export.stream import StreamReport, analyze, narrow_bindings
from pockjax.export.targets import ExportError, resolve_target
from pockjax.scheme import leaves_with_paths

__all__ = ["export", "Artifact", "MANIFEST", "VMFB", "PARAMS", "SCHEMA_VERSION", "read_manifest"]



@dataclasses.dataclass(frozen=True)
class Artifact:
    """An artifact directory `export` wrote, with its manifest.

    Attributes:
      path: the absolute path of the artifact directory.
      manifest: the contents of its `manifest.json` (target and flags, versions,
        function signatures, parameters, scheme, step memory, file hashes).
    """

    path: str
    manifest: dict

    def __repr__(self) -> str:
        return f"Artifact({self.path!r}, target={self.manifest['target']['name']!r})"


def package_version(name: str) -> str:
    """The installed version of a distribution, or 'not installed'."""
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"


def compile_module(mlir: str | bytes, target_name: str, flags: tuple[str, ...],
                   phase: tuple[str, ...] = ()) -> bytes:
    """IREE-compile `mlir` (StableHLO, or stream IR with `--compile-from=stream`); a
    failure becomes an ExportError with the target, the flags and the compiler's message."""
    try:
        import iree.compiler as ic
    except ImportError:
        raise ExportError("exporting needs the IREE compiler: pip install 'pockjax[export]' "
                          "(iree-base-compiler and iree-base-runtime)") from None
    kwargs = {} if "--compile-from=stream" in phase else {"input_type": "stablehlo"}
    try:
        return ic.compile_str(mlir, extra_args=list(flags) + list(phase), **kwargs)
    except ic.CompilerToolError as e:
        message = str(e)
        lines = [l for l in message.splitlines() if "error" in l.lower()] or message.splitlines()
        raise ExportError(f"IREE failed to compile for target {target_name!r}\n"
                          f"flags: {' '.join(flags)}\n"
                          "compiler said:\n  " + "\n  ".join(lines[:20])) from None


def check_stream(stream: bytes | str, lowered: Lowered, target: str) -> StreamReport:
    """Analyze the step's stream IR; refuse a schedule that reads a parameter after its
    in-place write, or that does not update the donated state in place."""
    text = stream.decode() if isinstance(stream, bytes) else stream
    report = analyze(text, lowered.donated)
    if report.hazards:
        raise ExportError(
            f"refusing to export for {target!r}: IREE scheduled an in-place update before a "
            "read of the old value, so the artifact would train wrong:\n  "
            + "\n  ".join(report.hazards[:20])
            + "\nThe step ties each update to its parameter's last reads, but this schedule "
              "could not be shown safe; please report the model")
    if report.not_in_place:
        raise ExportError(
            f"refusing to export for {target!r}: IREE did not update this state in place "
            f"(it would need a second copy of it on the device): "
            f"{', '.join(report.not_in_place[:10])}; please report the model")
    return report


def check_storage(stream: bytes | str, gpu: vulkan.GpuTarget, target: str,
                  lowered: Lowered | None = None) -> None:
    """Refuse arrays of 8- or 16-bit values in memory on a GPU target without that storage
    width: IREE emulates it with 32-bit words, and the emulated accesses compute wrong
    values (on lavapipe: i1/i8/i16/f16 inputs and constants, and an int8 scalar input).
    Scalar predicates passed between kernels (e.g. `clip_by_global_norm`'s) compute
    right either way and are allowed."""
    text = stream.decode() if isinstance(stream, bytes) else stream
    found = narrow_bindings(text)
    if lowered is not None:
        for slot in lowered.state + lowered.batch:
            bits = jnp.dtype(slot.dtype).itemsize * 8 if slot.dtype != "bool" else 8
            if bits < 32:
                found[f"{slot.dtype} ('{slot.name}')"] = bits
    missing = {t: bits for t, bits in found.items() if f"b{bits}" not in gpu.storage}
    if missing:
        types = ", ".join(sorted(missing))
        raise ExportError(
            f"refusing to export for {target!r} ({gpu.arch}): the step keeps {types} "
            f"arrays in memory, and this GPU target has no "
            f"{'/'.join(sorted({f'{b}-bit' for b in missing.values()}))} storage "
            f"(storage = {'|'.join(sorted(gpu.storage))}); IREE's emulation of it computes wrong "
            "values. Keep boolean and narrow tensors inside the computation (build a causal "
            "mask from jnp.arange rather than a numpy constant; pass masks and labels as "
            "float32/int32), or compile for a GPU that has the storage (gpu='valhall', "
            "'adreno', or target 'host-vulkan')")


def _write_params(path: str, lowered: Lowered) -> None:
    import iree.runtime as ir

    index = ir.ParameterIndex()
    for slot in lowered.state:
        raw = np.ascontiguousarray(lowered.values[slot.name]).reshape(-1).view(np.uint8)
        index.add_buffer(slot.name, raw)
    index.create_archive_file(path)


class _Progress:
    """Lines on stderr saying which stage `export` is in, after the seconds so far (a
    large step compiles for minutes)."""

    def __init__(self, on: bool):
        self.on = on
        self.started = time.perf_counter()

    def __call__(self, what: str) -> None:
        if self.on:
            print(f"[export {time.perf_counter() - self.started:6.1f} s] {what}",
                  file=sys.stderr, flush=True)


def _tied_if_smaller(trainer, state, batch, tgt, flags, lowered, stream, report, say,
                     prefix=None):
    """The step with each matmul's read of a trained weight tied to its other operand
    (`pockjax.export.lowering.tie_weight_reads`) when its stream plan allocates less than
    the untied one's, else the untied step: `(lowered, stream, report, tied)`.

    With data tiling IREE 3.13 packs the trained weights into its tile layout at the
    step's start, and all packed copies live together; tied, each pack runs beside its
    matmul (TinyLlama-1.1B's shape, last 6 blocks: 2,117 -> 291 MB per step). Where
    nothing is packed the tie's add is a copy of its own (6 x 1024 MLP without data
    tiling: 15 -> 20 MiB), and on small models the extra dispatches can outweigh the
    packs (a 2-block toy LLaMA: 484 -> 547 kB), so the compiled plans decide. A tied
    plan that is not hazard-free and in place is not taken."""
    say("lowering the step again with each trained weight's reads tied to its matmuls")
    tied = lower_step(trainer, state, batch, backend=tgt.backend, tie_weights=True,
                      prefix=prefix)
    if tied.mlir == lowered.mlir:
        return lowered, stream, report, False
    say("compiling that step to stream IR (kept if it allocates less)")
    tied_stream = compile_module(tied.mlir, tgt.name, flags, ("--compile-to=stream",))
    tied_report = analyze(tied_stream.decode(), tied.donated)
    if (tied_report.hazards or tied_report.not_in_place
            or tied_report.peak_alloc_bytes >= report.peak_alloc_bytes):
        return lowered, stream, report, False
    return tied, tied_stream, tied_report, True


def export(trainer, state, batch, target: str = "host-cpu", out_dir: str = "export",
           gpu: str | None = None, extra_flags=(), progress: bool = False) -> Artifact:
    """Compile the training step for `target` and write the artifact directory.

    The directory holds `train_step.vmfb`, `params.irpa` and `manifest.json`. The
    step is lowered to StableHLO, compiled to IREE's stream IR, checked there (every
    donated state update in place, no read after an in-place write; on Vulkan targets,
    the storage widths the GPU target has), then compiled to the module. On the CPU
    targets the step with each trained weight's matmul reads tied to their other operand
    is compiled too and kept when its plan allocates less.

    The trainer says what is compiled (`trainer.export_step(state, batch)`): a
    `SparseTrainer` its step; a `pockjax.prefix.PrefixCachedTrainer` the cached step's
    suffix, with a `prefix` function in the artifact computing a batch's cut values.

    The directory is built under a temporary name next to `out_dir` and renamed into
    place, so a failed or interrupted export leaves no half artifact (and keeps an
    older one). With `progress`, each stage is named on stderr as it starts, with the
    seconds so far (`pockjax export` does this).

    Args:
      trainer: a `SparseTrainer` or a `PrefixCachedTrainer` (any trainer with
        `export_step`).
      state: its `TrainState`, made of arrays: the parameters' and optimizer state's
        initial values go into the artifact.
      batch: an example batch; its shapes and dtypes are the ones compiled for.
      target: a name in `TARGETS` (default `"host-cpu"`).
      out_dir: the artifact directory, replaced if it exists.
      gpu: the GPU family for a GPU target (e.g. `"valhall"`, `"sm_87"`); None: the
        target's default.
      extra_flags: further compiler flags, each starting with `--`.
      progress: name each stage on stderr as it starts.

    Returns:
      The `Artifact`: its directory and manifest.

    Raises:
      ExportError: an unknown target or GPU family, a malformed flag, a state made of
        `jax.ShapeDtypeStruct`s, a batch with a dynamic shape, a dtype that cannot be
        exported, no IREE compiler installed, a compiler failure, a schedule that is not
        safe or not in place, narrow storage a Vulkan target lacks, no Vulkan device
        (`host-vulkan`), or an `out_dir` that exists and is not a directory.
    """
    tgt, flags = resolve_target(target, gpu, tuple(extra_flags))
    if not hasattr(trainer, "export_step"):
        raise ExportError(f"pockjax.export takes a SparseTrainer (pockjax.sparse_train) or a "
                          f"PrefixCachedTrainer, got {type(trainer).__name__}; a scheme "
                          f"schedule's steps are exported one scheme at a time")
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(state)):
        raise ExportError("this TrainState holds shapes (jax.ShapeDtypeStruct), not arrays; an "
                          "artifact carries the parameters' values, so export needs a state made "
                          "from arrays (trainer.init(params)); report() and lower() take shapes")
    # What is compiled: the trainer's step, or a prefix cache's suffix and prefix (split
    # on the state as given, before any storage change below).
    trainer, batch, prefix = trainer.export_step(state, batch)
    if tgt.backend == "vulkan":
        # Low-bit weights as 32-bit words and float32 scales: IREE's SPIR-V code loads
        # neither bfloat16 nor 8-bit values on GPUs without 8-bit storage.
        from pockjax import lowbit

        state = lowbit.in_words(state)
    started = time.perf_counter()
    say = _Progress(progress)
    say("lowering the training step to StableHLO")
    lowered = lower_step(trainer, state, batch, backend=tgt.backend, prefix=prefix)
    mlir, device = lowered.mlir, None
    if tgt.local_device:
        say("reading the local Vulkan device's capabilities")
        caps = vulkan.device_caps()
        device = {"name": caps.name, "target": vulkan.local_target_attr(caps)}
        mlir = mlir.replace("module @pockjax_train {", "module @pockjax_train attributes "
                            f"{{hal.device.targets = [{device['target']}]}} {{", 1)
    # Stop at stream IR, check the in-place updates there, then finish from it.
    say(f"compiling for {target} to IREE's stream IR, to check the in-place updates")
    stream = compile_module(mlir, target, flags, ("--compile-to=stream",))
    report = check_stream(stream, lowered, target)
    tied = False
    if tgt.backend == "local":
        lowered, stream, report, tied = _tied_if_smaller(trainer, state, batch, tgt, flags,
                                                         lowered, stream, report, say, prefix)
    gpu_target = None
    if tgt.backend == "vulkan":
        parsed = vulkan.parse_target(stream.decode())
        check_storage(stream, parsed, target, lowered)
        gpu_target = parsed.text
    say(f"compiling the module for {target}: the longest stage (seconds for a small "
        "MLP, a minute or more for a LLaMA)")
    vmfb = compile_module(stream, target, flags, ("--compile-from=stream",))
    compile_s = time.perf_counter() - started

    out_dir = os.path.abspath(os.fspath(out_dir))
    say(f"writing the artifact to {out_dir}")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-export-", dir=parent)
    try:
        with open(os.path.join(tmp, VMFB), "wb") as f:
            f.write(vmfb)
        _write_params(os.path.join(tmp, PARAMS), lowered)
        mode, reason = trainer.update_mode(state, batch)
        manifest: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "target": {"name": tgt.name, "backend": tgt.backend, "driver": tgt.driver,
                       "gpu": (gpu or tgt.default_gpu) if tgt.gpu_flag else None,
                       "flags": list(flags),
                       # The GPU the SPIR-V was compiled for (checked when loading), and
                       # for host-vulkan the device it was built from.
                       "gpu_target": gpu_target, "device": device},
            "versions": {"pockjax": package_version("pockjax"), "jax": package_version("jax"),
                         "iree-base-compiler": package_version("iree-base-compiler")},
            "parameter_scope": SCOPE,
            # train_step(state..., batch...) -> (state'..., outputs...), state donated;
            # eval(state..., batch...) -> loss; init() / frozen() -> their outputs.
            "functions": {
                "train_step": {"state": [s.name for s in lowered.mutable],
                               "inputs": [dataclasses.asdict(s) for s in lowered.batch],
                               "outputs": lowered.outputs},
                "eval": {"state": [s.name for s in lowered.mutable if s.role == "trainable"],
                         "inputs": [dataclasses.asdict(s) for s in lowered.batch],
                         "outputs": ["loss"]},
                "init": {"outputs": [s.name for s in lowered.mutable]},
                "frozen": {"outputs": [s.name for s in lowered.frozen]},
                # prefix(batch...) -> cut values, where the step is a prefix cache's
                # suffix: its batch is {"batch": ..., "cut": [...]}.
                **({"prefix": {"inputs": [dataclasses.asdict(s) for s in lowered.prefix_inputs],
                               "outputs": lowered.prefix_outputs}}
                   if lowered.prefix_outputs else {}),
            },
            "parameters": [dataclasses.asdict(s) for s in lowered.state],
            "params_tree": _tree_paths(state),
            "scheme": json.loads(trainer.scheme.to_json()),
            "update_mode": mode,
            "compile_seconds": round(compile_s, 3),
            # From the stream IR: bytes of the donated state and batch, the most bytes
            # the step allocates besides them, and device submissions per step.
            "memory": {"input_bytes": report.input_bytes,
                       "peak_alloc_bytes": report.peak_alloc_bytes,
                       "submissions": report.submissions,
                       "tied_weight_reads": tied},
            "files": {name: {"sha256": sha256(os.path.join(tmp, name)),
                             "bytes": os.path.getsize(os.path.join(tmp, name))}
                      for name in (VMFB, PARAMS)},
        }
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say("done")
    return Artifact(out_dir, manifest)


def _tree_paths(state) -> dict:
    """Checkpoint names of every TrainState leaf, in flattening order, so a runtime
    session can rebuild `pj.save`'s format without the Python model."""
    return {"params": [p for p, _ in leaves_with_paths(state.params)[0]],
            "opt_state": [p for p, _ in leaves_with_paths(state.opt_state)[0]]}


def _replace_dir(tmp: str, out_dir: str) -> None:
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise ExportError(f"output path '{out_dir}' exists and is not a directory")
        old = tempfile.mkdtemp(prefix=".old-export-", dir=os.path.dirname(out_dir))
        os.rmdir(old)
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)
