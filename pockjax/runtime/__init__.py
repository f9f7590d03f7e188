"""Run an exported training step with IREE's runtime, without the Python model.

    sess = pockjax.runtime.load("out/", device="local-task")
    metrics = sess.step(batch)          # {"loss": ..., "aux/...": ...}
    sess.evaluate(batch)                # loss only
    params = sess.params()              # numpy pytree, the original structure
    sess.save("ckpt.safetensors")       # the format of pockjax.save

The trainable parameters and the optimizer state stay on the device between steps:
each step takes them as donated buffers, updates them in place and hands them back for
the next step. Only the batch goes in and the metrics come out.

The parameter archive is memory-mapped, never written and never read into the heap:
the state is copied from it once into its device buffers, and the frozen weights are
used from the mapping (or from the packed copies the compiled module makes of them), so
a session holds the parameters once.

`ToolSession` (IREE's `iree-run-module`, one process per call) lives in
`pockjax.runtime._tool`; what it and `Session` share (the batch check, evaluation,
parameters as a pytree, checkpoints) in `pockjax.runtime._base`.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import os
import platform
import sys
import threading
import warnings
import weakref

import numpy as np

from pockjax._src.home import claim
from pockjax.runtime._base import BaseSession, np_dtype
from pockjax.runtime._base import named_leaves  # noqa: F401  (re-exported)
from pockjax.runtime._tool import ToolSession, qemu_arm64
from pockjax.export.manifest import PARAMS, VMFB, check_hashes, read_manifest
from pockjax.export.targets import ExportError

__all__ = ["load", "Session", "ToolSession", "qemu_arm64", "DEVICES", "IncompatibleDevice",
           "DeviceLost", "CompilingPipelines"]

DEVICES = ("local-task", "local-sync", "vulkan", "cuda")
"""The IREE devices `load` opens: `"local-task"` and `"local-sync"` run CPU artifacts
(multi-threaded and single-threaded), `"vulkan"` and `"cuda"` GPU ones."""
_CPU_DEVICES = ("local-task", "local-sync")


class IncompatibleDevice(ExportError):
    """Raised when loading a Vulkan artifact on a device that lacks what the artifact was
    compiled for (it would compute wrong)."""


class DeviceLost(ExportError):
    """Raised when the Vulkan driver loses the device during a call (VK_ERROR_DEVICE_LOST).

    Every buffer on it is gone, the session's trained state with them; the device is
    dropped, so the next `load` opens a new one.

    Args:
      message: the error message.
      during: what the session was doing (`"loading"`, `"a training step"`, ...).
      driver_message: the line of IREE's error that reports the loss.

    Attributes:
      during: what the session was doing when the device was lost.
      driver_message: the line of IREE's error that reports the loss.
    """

    def __init__(self, message: str, during: str, driver_message: str):
        super().__init__(message)
        self.during = during
        self.driver_message = driver_message


# What IREE's error text says when the driver lost the device.
_LOST = "VK_ERROR_DEVICE_LOST"
# The same loss seen from elsewhere on a Vulkan device: a fence that waited on the lost
# submission (IREE reports the loss as DATA_LOSS), and, while loading, IREE 3.13's own
# queue race on lavapipe (a parameter upload submitted before its transient buffer had
# memory). All seen in `make test` runs; the remedy is the same: a new device.
_LOST_ELSEWHERE = (("DATA_LOSS", "hal.fence.await"),)
_LOST_WHILE_LOADING = (("transient buffer has no staged Vulkan backing",),)


class CompilingPipelines(UserWarning):
    """Warned before a function's first call on a Vulkan device that runs on the CPU
    (lavapipe): the call waits while the driver compiles its pipelines. Filter this
    category to silence it."""


def _loss_line(text: str, loading: bool) -> str | None:
    """The line of an IREE error that says the Vulkan device is lost (None if none)."""
    marks = [(_LOST,), *_LOST_ELSEWHERE, *(_LOST_WHILE_LOADING if loading else ())]
    for mark in marks:
        if all(m in text for m in mark):
            line = next((ln for ln in text.splitlines() if mark[0] in ln), mark[0])
            return line.strip().rstrip(";")
    return None

# The devices sessions run on, one per URI, created here rather than through
# `iree.runtime.get_device`'s process-wide cache: a lost device must be dropped, or every
# later load in the process fails on it.
_devices: dict[str, object] = {}
_devices_lock = threading.Lock()


def _open_device(ir, uri: str):
    with _devices_lock:
        device = _devices.get(uri)
        if device is None:
            device = _devices[uri] = ir.get_device(uri, cache=False)
        return device


def _drop_device(uri: str, device) -> None:
    with _devices_lock:
        if _devices.get(uri) is device:
            del _devices[uri]


# Open sessions, closed at exit while the devices above are still held. The interpreter's
# teardown clears this module before the script that imported it, so a session left in
# the script's globals would hold the last reference to its device, and could release it
# before its buffers (see `Session.close`): a segfault at exit.
_sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()


@atexit.register
def _close_sessions() -> None:
    for session in list(_sessions):
        session.close()
    with _devices_lock:
        _devices.clear()


def _check_vulkan(path: str, manifest: dict):
    """The Vulkan device's capabilities; refuses a Vulkan artifact whose compiled-for GPU
    does not match the device: IREE's driver would run it anyway and return wrong numbers."""
    from pockjax.export import vulkan

    target = vulkan.parse_target(manifest["target"]["gpu_target"])
    caps = vulkan.device_caps()
    bad = vulkan.problems(target, caps)
    if bad:
        raise IncompatibleDevice(
            f"artifact '{path}' was compiled for the Vulkan GPU {target.arch!r}, which device "
            f"'{caps.name}' does not match:\n  - " + "\n  - ".join(bad)
            + "\nIREE would run it and silently compute wrong values. Export for target "
              "host-vulkan on the device itself, or for android-vulkan with the --gpu family "
              "of this device (vp_android_baseline_2022 needs no subgroup operations)")
    return caps


class Session(BaseSession):
    """A loaded artifact on one IREE device; see `pockjax.runtime.load`.

    The trainable parameters and optimizer state stay on the device between calls:
    `step` updates them in place, `params` and `save` copy them back.
    `close()` (or leaving a `with` block) frees its device memory at once; otherwise
    that happens when the session is garbage or at interpreter exit.

    Args:
      path: the artifact directory.
      device: one of `DEVICES` that runs the artifact's target: `"local-task"` or
        `"local-sync"` for a CPU target, `"vulkan"` or `"cuda"` for a GPU one.

    Raises:
      ExportError: `device` is unknown, cannot run this artifact's target or is not
        available here; an android-arm64 artifact on a machine that is not aarch64;
        a missing or damaged artifact file; IREE cannot load the artifact.
      IncompatibleDevice: a Vulkan artifact compiled for a GPU the device does not
        match.
      DeviceLost: the Vulkan driver lost the device while loading.
    """

    _closed = False

    def __init__(self, path: str, device: str):
        import iree.runtime as ir

        self.path = os.fspath(path)
        _sessions.add(self)
        self.manifest = read_manifest(self.path, hashes=False)  # hashed below, meanwhile
        backend = self.manifest["target"]["backend"]
        if device not in DEVICES:
            raise ExportError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
        wanted = {"local": _CPU_DEVICES, "vulkan": ("vulkan",), "cuda": ("cuda",)}[backend]
        if device not in wanted:
            raise ExportError(f"artifact '{self.path}' was compiled for target "
                              f"{self.manifest['target']['name']!r} ({backend}); it runs on "
                              f"device {' or '.join(wanted)}, not {device!r}")
        self.device_name = device
        self._ir = ir
        try:
            self.device = _open_device(ir, device)
        except Exception as e:
            raise ExportError(f"IREE device {device!r} is not available here: {e}") from None
        # The functions not called yet: on a CPU Vulkan device each one's first call waits
        # for the driver to compile its pipelines.
        self._uncalled = {"train_step", "eval", "prefix"}
        self._vulkan_caps = _check_vulkan(self.path, self.manifest) if backend == "vulkan" else None
        target = self.manifest["target"]["name"]
        if target == "android-arm64" and platform.machine().lower() not in ("aarch64", "arm64"):
            raise ExportError(f"artifact '{self.path}' is for android-arm64 (aarch64 code) and "
                              f"this machine is {platform.machine()}; run it on the device with "
                              "iree-run-module, or here under QEMU: pockjax.runtime.ToolSession("
                              "path, pockjax.runtime.qemu_arm64(dir)) or `pockjax run DIR "
                              "--qemu-arm64 DIR`")
        # The compiled module is hashed first: its initialisers run when IREE loads it.
        # On a CPU device the parameter archive is hashed on a second thread while IREE
        # maps and loads it (hashlib releases the GIL): at TinyLlama-1.1B's size that
        # hides seconds of reading. A damaged archive is reported before any error its
        # damage caused. Other devices hash everything first: a busy thread beside a
        # Vulkan load makes lavapipe's device loss likelier (docs/export.md, "Vulkan on
        # lavapipe: device loss").
        if device not in _CPU_DEVICES:
            check_hashes(self.path, self.manifest)
            self._open(ir, target, device)
            return
        check_hashes(self.path, self.manifest, names=[VMFB])
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            hashed = pool.submit(check_hashes, self.path, self.manifest,
                                 [n for n in self.manifest.get("files", {}) if n != VMFB])
            try:
                self._open(ir, target, device)
            except BaseException:
                hashed.result()
                raise
            hashed.result()

    def _open(self, ir, target: str, device: str) -> None:
        """Map the parameter archive, load the modules and read the initial state."""
        self.instance = ir.VmInstance()
        # The archive is memory-mapped (read-only, private). On a CPU device IREE imports
        # each parameter from the mapping without a copy: the frozen weights are
        # file-backed pages the kernel can share and drop, not a copy in the heap.
        archive = os.path.join(self.path, PARAMS)
        self._index = ir.ParameterIndex()
        try:
            self._index.load(archive, mmap=True)
        except (RuntimeError, ValueError, OSError) as e:
            raise ExportError(f"cannot read the parameter archive '{archive}': {e}; export "
                              "the artifact again (pockjax export ... --out DIR)") from None
        provider = self._index.create_provider(scope=self.manifest["parameter_scope"])
        with open(os.path.join(self.path, VMFB), "rb") as f:
            vmfb = f.read()
        self._modules = [ir.create_hal_module(self.instance, self.device),
                         ir.create_io_parameters_module(self.instance, provider),
                         ir.VmModule.copy_buffer(self.instance, vmfb)]
        with self._lost_device("loading"):
            try:
                self.context = ir.VmContext(self.instance, modules=self._modules)
            except RuntimeError as e:
                raise ExportError(f"IREE could not load artifact '{self.path}' (target "
                                  f"{target!r}) on device {device!r}: {e}") from None
        main = self._modules[-1]
        fns = self.manifest["functions"]
        self._fn = {name: ir.FunctionInvoker(self.context, self.device, main.lookup_function(name))
                    for name in fns}
        self._state_names = fns["train_step"]["state"]
        # Every page of the mapping read so far is one the step does not read again:
        # with data tiling (host-cpu) the initializer packed the frozen matmul weights
        # into buffers of its own. Hand them back; the kernel reads a page from the file
        # again if the step touches it (unpacked weights, the embedding rows a batch
        # gathers).
        _release(view for _, view in self._views())
        with self._lost_device("loading"):
            self._state = self._initial_state()

    def __repr__(self) -> str:
        closed = ", closed" if self._closed else ""
        return f"Session({self.path!r}, device={self.device_name!r}{closed})"

    def close(self) -> None:
        """Release the session's buffers, functions and modules, then its device.

        The order matters: an IREE buffer does not keep its device alive, and
        `iree.runtime.DeviceArray` lets go of its device before its buffer, so a state
        array holding the last reference to the device destroys the device and then
        frees its buffer into it (a segfault, typically at interpreter exit). Everything
        that holds buffers goes first, while `self.device` still holds the device.
        Closing twice does nothing."""
        for name in ("_state", "_fn", "context", "_modules", "instance", "_index", "device"):
            self.__dict__.pop(name, None)
        self._closed = True

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _first_call(self, function: str, stacklevel: int = 3) -> None:
        """Say before `function`'s first call on a CPU Vulkan device that it will be slow:
        lavapipe compiles each pipeline with LLVM when it is first used, which for a
        small LLaMA's step means minutes with nothing else to show for it. `stacklevel`
        points the warning at the user's call (3: the caller of this method's caller)."""
        if function not in self._uncalled:
            return
        self._uncalled.discard(function)
        caps = self._vulkan_caps
        if caps is not None and caps.on_cpu:
            what = "training step" if function == "train_step" else "evaluation"
            warnings.warn(
                f"the first {what} of '{self.path}' compiles its pipelines: Vulkan device "
                f"'{caps.name}' runs on the CPU, and its driver compiles each pipeline to "
                "machine code on first use (seconds for a small model, minutes for a small "
                "LLaMA); later calls reuse them. For speed on this machine export for "
                "host-cpu, or run on a GPU's Vulkan driver", CompilingPipelines, stacklevel=stacklevel)

    def _check_open(self) -> None:
        if self._closed:
            raise ExportError(f"the session of artifact '{self.path}' is closed and its device "
                              "memory freed; load the artifact again (pockjax.runtime.load)")

    @contextlib.contextmanager
    def _lost_device(self, what: str):
        """Turn the driver's device loss during `what` into `DeviceLost` and drop the
        device. Mesa's lavapipe (Debian 12's 22.3) loses it at random under IREE 3.13:
        IREE's queue threads can signal its wakeup semaphore out of order, and lavapipe's
        emulated timeline semaphores declare the device lost when a value does not
        increase (docs/export.md, "Vulkan on lavapipe: device loss")."""
        try:
            yield
        except RuntimeError as e:  # IREE's errors, and pockjax's ExportErrors wrapping them
            line = (_loss_line(str(e), loading=what == "loading")
                    if self.device_name not in _CPU_DEVICES else None)
            if line is None:
                raise
            _drop_device(self.device_name, self.device)
            raise DeviceLost(
                f"the {self.device_name!r} device was lost during {what} of artifact "
                f"'{self.path}' ({line}). Its buffers are gone, the trained state with "
                "them. Load the artifact again (pockjax.runtime.load opens a new device) and "
                "continue from the last checkpoint you saved (Session.save).",
                during=what, driver_message=line) from None

    def _host(self, array) -> np.ndarray:
        """A numpy copy of a device array.

        `DeviceArray.to_host` copies device-only memory into a numpy array it imports
        into the device; Vulkan drivers refuse imports that are not page-aligned
        (minImportedHostPointerAlignment). So copy through a mapped staging buffer.
        """
        if self.device_name in _CPU_DEVICES:
            return np.array(array.to_host())
        ir = self._ir
        buffer = array._buffer_view.get_buffer()
        staging = self.device.allocator.allocate_buffer(
            memory_type=int(ir.MemoryType.HOST_LOCAL | ir.MemoryType.DEVICE_VISIBLE),
            allowed_usage=int(ir.BufferUsage.TRANSFER_TARGET | ir.BufferUsage.MAPPING_SCOPED),
            allocation_size=buffer.byte_length())
        sem = self.device.create_semaphore(0)
        self.device.queue_copy(buffer, staging, wait_semaphores=ir.HalFence.create_at(sem, 0),
                               signal_semaphores=ir.HalFence.create_at(sem, 1))
        ir.HalFence.create_at(sem, 1).wait()
        return np.array(staging.map().asarray(array.shape, array.dtype))

    # -- calls -------------------------------------------------------------------

    def step(self, batch) -> dict[str, np.ndarray]:
        """One training step on the device; returns the metrics as numpy values.

        Args:
          batch: one batch with the inputs, shapes and dtypes the artifact was
            exported for (a pytree of arrays, as given to the Python trainer).

        Returns:
          The step's outputs by name: `"loss"` and any `"aux/<path>"`.

        Raises:
          ExportError: the session is closed, or the batch's inputs, shapes or dtypes
            are not the artifact's.
          DeviceLost: the Vulkan driver lost the device (the trained state is lost).
        """
        self._check_open()
        args = self._batch_args(batch)
        self._first_call("train_step")
        with self._lost_device("a training step"):
            outs = _as_list(self._fn["train_step"](*self._state, *args))
            n = len(self._state)
            self._state = list(outs[:n])
            names = self.manifest["functions"]["train_step"]["outputs"]
            return {name: self._host(o) for name, o in zip(names, outs[n:])}

    def prefix(self, batch) -> list[np.ndarray]:
        """A prefix cache's artifact: the cut values of `batch`, to keep per example and
        pass to `step` as `{"batch": batch, "cut": values}`.

        Args:
          batch: the original batch, without `"cut"`.

        Returns:
          The cut values, one numpy array each.

        Raises:
          ExportError: the session is closed, the artifact has no prefix function (it
            is not a prefix cache's export), or the batch does not match it.
          DeviceLost: the Vulkan driver lost the device.
        """
        self._check_open()
        args = self._prefix_inputs(batch)
        self._first_call("prefix")
        with self._lost_device("the prefix"):
            return [self._host(o) for o in _as_list(self._fn["prefix"](*args))]

    def _evaluate(self, batch) -> np.ndarray:
        self._check_open()
        args = self._batch_args(batch)
        self._first_call("eval", stacklevel=4)  # called by BaseSession.evaluate
        with self._lost_device("an evaluation"):
            out = self._fn["eval"](*(self._state[i] for i in self._eval_indices()), *args)
            return self._host(_as_list(out)[0])

    def _state_value(self, i):
        self._check_open()
        with self._lost_device("reading the state"):
            return self._host(self._state[i])

    def _views(self) -> list[tuple[str, memoryview]]:
        """`(name, bytes)` of every parameter, as views of the mapped archive."""
        return [(key, e.file_view) for key, e in self._index.items() if e.is_file]

    def _archive_arrays(self, names) -> list[np.ndarray] | None:
        """Read-only numpy views of the mapped archive for these parameters (no copy),
        or None if one is not stored as mapped bytes."""
        spec = {p["name"]: p for p in self.manifest["parameters"]}
        views = dict(self._views())
        if not all(n in views for n in names):
            return None
        return [np.frombuffer(views[n], dtype=np_dtype(spec[n]["dtype"]))
                .reshape(spec[n]["shape"]) for n in names]

    def _initial_state(self) -> list:
        """The state's device buffers, filled from the archive one tensor at a time.

        The step updates them in place; the archive itself is mapped read-only and never
        written. Each tensor is copied straight from its mapped pages, which are handed
        back at once, so loading holds the state once plus one tensor's pages (`init()`
        would return the whole initial state in new buffers after reading every page of
        it: the state twice at the peak, half of it as file pages)."""
        arrays = self._archive_arrays(self._state_names)
        if arrays is None:
            return _as_list(self._fn["init"]())
        state = []
        for x in arrays:
            state.append(self._ir.asdevicearray(self.device, x))
            _release([x])
        return state

    def restore(self, path: str) -> None:
        """Replace the trained state (parameters, optimizer state, step count) with a
        checkpoint `save` wrote: a run resumed exactly where that checkpoint was taken.

        Args:
          path: the checkpoint file.

        Raises:
          CheckpointError: the file is missing, damaged (its checksum), or does not fit
            this artifact's state (names, shapes, dtypes, scheme).
          ExportError: the session is closed.
        """
        self._check_open()
        values = self._checked_state(path)
        with self._lost_device("restoring the state"):
            # np.array, not ascontiguousarray: a 0-d tensor (the step count) stays 0-d.
            self._state = [self._ir.asdevicearray(self.device, np.array(x, order="C"))
                           for x in values]

    def _frozen_getters(self):
        """One frozen weight at a time, copied from the mapped archive and its pages
        handed back; the base class's (all through `frozen()`) where one is not stored
        as mapped bytes."""
        self._check_open()
        names = self.manifest["functions"]["frozen"]["outputs"]
        if self._archive_arrays(names) is None:
            return super()._frozen_getters()

        def one(name):
            (x,) = self._archive_arrays([name])
            out = x.copy()
            _release([x])
            return out

        return {name: (lambda n=name: one(n)) for name in names}

    def _frozen_values(self):
        """The frozen weights, copied from the mapped archive (they never change), not
        through `frozen()`, which would first copy every one into a device buffer."""
        names = self.manifest["functions"]["frozen"]["outputs"]
        arrays = self._archive_arrays(names)
        if arrays is None:
            with self._lost_device("reading the frozen weights"):
                return [self._host(x) for x in _as_list(self._fn["frozen"]())]
        out = [x.copy() for x in arrays]
        _release(arrays)
        return out


def _release(buffers) -> None:
    """Drop this process's resident pages of these views of the mapped archive
    (`madvise(MADV_DONTNEED)`, Linux). The mapping is read-only and file-backed, so this
    frees no data: a page touched again is read back from the file."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    MADV_DONTNEED = 4
    for buffer in buffers:
        x = np.frombuffer(buffer, np.uint8) if isinstance(buffer, memoryview) else buffer
        if x.nbytes == 0:
            continue
        start = x.ctypes.data
        lo, hi = start - start % page, -(-(start + x.nbytes) // page) * page
        madvise(lo, hi - lo, MADV_DONTNEED)  # advisory: a failure only leaves pages resident

def _as_list(outs) -> list:
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def load(path: str, device: str = "local-task") -> Session:
    """Load an exported artifact directory onto an IREE device.

    The artifact's files are checked against the manifest's sizes and hashes. If the
    driver loses the device while loading (nothing is trained yet), the artifact is
    loaded once more on a new device, with a warning; a second loss raises
    `DeviceLost`.

    Args:
      path: the artifact directory (`pockjax.export` wrote it).
      device: one of `DEVICES` that runs the artifact's target (default
        `"local-task"`, for CPU artifacts).

    Returns:
      The `Session`, with the initial state on the device.

    Raises:
      ExportError: see `Session`: an unknown or unavailable device, an artifact for
        another target, a missing or damaged file.
      IncompatibleDevice: a Vulkan artifact compiled for a GPU the device does not
        match.
      DeviceLost: the device was lost twice while loading.
    """
    try:
        return Session(path, device)
    except DeviceLost as e:
        warnings.warn(f"the {device!r} device was lost while loading '{path}' "
                      f"({e.driver_message}); loading it again on a new device",
                      RuntimeWarning, stacklevel=2)
    # Outside the handler: the failed session, referenced from the traceback, is freed.
    return Session(path, device)


claim(globals())  # public names defined in the private modules above live here
