"""`ToolSession`: an exported artifact run by IREE's `iree-run-module` tool, one
process per call, where no Python runs the artifact (a phone over `adb shell`, or here
under `qemu-aarch64`, whose command `qemu_arm64` builds). `pockjax.runtime` re-exports
both; like it, this module needs numpy only, not JAX.
"""
from __future__ import annotations

import os

import numpy as np

from pockjax.runtime._base import BaseSession
from pockjax.export.manifest import PARAMS, VMFB, read_manifest
from pockjax.export.targets import ExportError


class ToolSession(BaseSession):
    """An artifact run by IREE's `iree-run-module` tool, one process per call.

    This is how an artifact runs where no Python is: on a phone over `adb shell`, or
    here under `qemu-aarch64` with the aarch64 build of the tool (see `qemu_arm64`).
    The state lives in `.npy` files in `workdir` between calls: `train_step` reads the
    current state and writes the next one. Constructing the session checks the
    artifact's files and runs its `init` function once.

    Args:
      path: the artifact directory.
      command: the tool and anything that must precede it (an emulator and its
        options), as a list of words or one string naming the tool.
      device: the tool's `--device` (default `"local-task"`).
      workdir: the directory for the state and batch files, created if missing;
        None: a new temporary directory.

    Raises:
      ExportError: a missing or damaged artifact file, a tool that cannot be started,
        or a call that fails (its command line and the end of its output are shown).
    """

    def __init__(self, path: str, command=("iree-run-module",), device: str = "local-task",
                 workdir: str | None = None):
        import tempfile

        self.path = os.fspath(path)
        self.manifest = read_manifest(self.path)
        self.command = [str(c) for c in ([command] if isinstance(command, str) else command)]
        self.device_name = device
        self.workdir = workdir or tempfile.mkdtemp(prefix="pockjax-run-")
        os.makedirs(self.workdir, exist_ok=True)
        fns = self.manifest["functions"]
        self._state_names = fns["train_step"]["state"]
        self._state_files = self._call("init", [], len(self._state_names), "state0")

    def __repr__(self) -> str:
        return f"ToolSession({self.path!r}, command={self.command!r})"

    def _call(self, function: str, inputs: list[str], n_out: int, tag: str) -> list[str]:
        import subprocess

        outs = [os.path.join(self.workdir, f"{tag}_{i}.npy") for i in range(n_out)]
        cmd = [*self.command, f"--device={self.device_name}",
               f"--module={os.path.join(self.path, VMFB)}",
               f"--parameters={self.manifest['parameter_scope']}={os.path.join(self.path, PARAMS)}",
               f"--function={function}", *[f"--input=@{f}" for f in inputs],
               *[f"--output=@{f}" for f in outs]]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise ExportError(f"cannot start {self.command[0]!r}: {e}") from None
        if done.returncode != 0:
            tail = "\n  ".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            raise ExportError(f"{function} failed (exit {done.returncode}):\n  {' '.join(cmd)}\n"
                              f"  {tail}")
        return outs

    def _write_batch(self, batch) -> list[str]:
        files = []
        for i, x in enumerate(self._batch_args(batch)):
            files.append(os.path.join(self.workdir, f"batch_{i}.npy"))
            np.save(files[-1], x)
        return files

    def step(self, batch) -> dict[str, np.ndarray]:
        """One training step in a new process; returns the metrics.

        Args:
          batch: one batch with the inputs, shapes and dtypes the artifact was
            exported for.

        Returns:
          The step's outputs by name: `"loss"` and any `"aux/<path>"`.

        Raises:
          ExportError: the batch does not match the artifact, or the tool failed.
        """
        fn = self.manifest["functions"]["train_step"]
        # Read one set of state files, write the other.
        tag = "state1" if self._state_files[0].endswith("state0_0.npy") else "state0"
        outs = self._call("train_step", self._state_files + self._write_batch(batch),
                          len(self._state_names) + len(fn["outputs"]), tag)
        self._state_files = outs[:len(self._state_names)]
        return {name: np.load(f) for name, f in zip(fn["outputs"], outs[len(self._state_names):])}

    def prefix(self, batch) -> list[np.ndarray]:
        """The cut values of `batch` (see `Session.prefix`), in a new process.

        Args:
          batch: the original batch, without `"cut"`.

        Returns:
          The cut values, one numpy array each.

        Raises:
          ExportError: the artifact has no prefix function, the batch does not match
            it, or the tool failed.
        """
        files = []
        for i, x in enumerate(self._prefix_inputs(batch)):
            files.append(os.path.join(self.workdir, f"prefix_in_{i}.npy"))
            np.save(files[-1], x)
        n = len(self.manifest["functions"]["prefix"]["outputs"])
        return [np.load(f) for f in self._call("prefix", files, n, "prefix")]

    def _evaluate(self, batch) -> np.ndarray:
        state = [self._state_files[i] for i in self._eval_indices()]
        out, = self._call("eval", state + self._write_batch(batch), 1, "eval")
        return np.load(out)

    def restore(self, path: str) -> None:
        """Replace the trained state with a checkpoint `save` wrote (see
        `Session.restore`): written as the state files the next call reads.

        Raises:
          CheckpointError: the file is missing, damaged, or does not fit the artifact.
        """
        files = []
        for i, x in enumerate(self._checked_state(path)):
            files.append(os.path.join(self.workdir, f"state0_{i}.npy"))
            np.save(files[-1], np.array(x, order="C"))
        self._state_files = files

    def _state_value(self, i):
        return np.load(self._state_files[i])

    def _frozen_values(self):
        n = len(self.manifest["functions"]["frozen"]["outputs"])
        return [np.load(f) for f in self._call("frozen", [], n, "frozen")]


def qemu_arm64(runtime_dir: str, sysroot: str = "/usr/aarch64-linux-gnu") -> list[str]:
    """The command that runs the aarch64 `iree-run-module` under `qemu-aarch64`.

    `runtime_dir` is the unpacked aarch64 wheel of `iree-base-runtime` (same version as
    the compiler), e.g. from `make arm64-runtime`; `sysroot` holds the aarch64 C and C++
    libraries (Debian: libc6-arm64-cross, libstdc++6-arm64-cross). IREE's CPU kernels are
    self-contained ELF files, so an artifact for the Android triple runs on this glibc
    build of the tool.

    Args:
      runtime_dir: the unpacked aarch64 `iree-base-runtime` wheel.
      sysroot: the aarch64 sysroot for `qemu-aarch64 -L` (default Debian's
        cross-compilation one).

    Returns:
      The command as a list of words, for `ToolSession(path, command)`.

    Raises:
      ExportError: `runtime_dir` has no `iree/_runtime_libs/iree-run-module`, or
        `sysroot` is not a directory.
    """
    tool = os.path.join(runtime_dir, "iree", "_runtime_libs", "iree-run-module")
    if not os.path.isfile(tool):
        raise ExportError(f"no aarch64 iree-run-module under '{runtime_dir}' (expected {tool}); "
                          "unpack the manylinux aarch64 wheel of iree-base-runtime there "
                          "(make arm64-runtime)")
    if not os.path.isdir(sysroot):
        raise ExportError(f"aarch64 sysroot '{sysroot}' is missing; install "
                          "libc6-arm64-cross and libstdc++6-arm64-cross")
    libs = os.path.join(runtime_dir, "iree_base_runtime.libs")
    return ["qemu-aarch64", "-L", sysroot, "-E", f"LD_LIBRARY_PATH={libs}", tool]
