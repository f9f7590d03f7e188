"""Backend switching for host training: the step runs on XLA (JAX's CPU backend) or on
IREE's CPU backend in this process, or `"auto"` measures both once and keeps the faster.

    runner = pockjax.backend.Runner(trainer, state, batch, backend="auto")
    print(runner.choice)        # xla: 182.0 ms/step (iree host-cpu 410.3 ms/step), ...
    for batch in batches:
        metrics = runner.step(batch)
    state = runner.state        # a TrainState, whichever backend ran

The two backends compute the same step (the artifact is the exported step; its losses
follow JAX's to float32 rounding, ~1e-6 relative) but not bit for bit, so the backend
is fixed once measured. Measuring does not advance the training: XLA's timed steps
run on a copy of the state, IREE's on a session that is loaded again afterwards.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

__all__ = ["BACKENDS", "BackendChoice", "Runner"]

BACKENDS = ("auto", "xla", "iree")
"""The values `backend=` accepts (`Runner`, `pockjax.nnx.Trainer`)."""


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """Which backend runs the step, and what was measured to choose it.

    `ms_per_step` holds the median step time of each backend measured (both under
    `"auto"`, none when the backend was named); `export_s` is the IREE export and
    compilation time when IREE was built.

    `str()` of it is one line for reports.

    Attributes:
      backend: the backend that runs the step, `"xla"` or `"iree"`.
      requested: the `backend=` asked for: `"auto"`, `"xla"` or `"iree"`.
      ms_per_step: backend -> its median step time in milliseconds; empty unless
        `"auto"` measured both.
      steps: the timed steps per backend.
      export_s: seconds the IREE export and compilation took, or None when IREE was
        not built.
    """

    backend: str
    requested: str
    ms_per_step: dict[str, float]
    steps: int
    export_s: float | None = None

    def __str__(self) -> str:
        if not self.ms_per_step:
            return f"{self.backend} (as asked)"
        ran = self.ms_per_step[self.backend]
        other = ", ".join(f"{_label(b)} {ms:.1f} ms/step" for b, ms in self.ms_per_step.items()
                          if b != self.backend)
        return (f"{self.backend}: {ran:.1f} ms/step ({other}), chosen by backend="
                f"{self.requested!r}, median of {self.steps} steps on the first batch")


def _label(backend: str) -> str:
    return "iree host-cpu" if backend == "iree" else backend


def _median_ms(step, steps: int) -> float:
    step()  # compile / first-run costs
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _copy(state):
    return state.replace(step=jnp.array(state.step), params=jax.tree.map(jnp.array, state.params),
                         opt_state=jax.tree.map(jnp.array, state.opt_state))


class Runner:
    """Host training of `trainer` (a `SparseTrainer`) from `state` on one backend.

    `batch` is a batch of the shape training uses (the artifact is compiled for it and
    the measurement runs on it). `backend`: `"xla"`, `"iree"` (IREE's `local-task` CPU
    device through an exported host-cpu artifact, built in `workdir`, a temporary
    directory by default) or `"auto"`: both, `steps` timed steps each after one untimed
    step, and the faster one runs. The choice is in `runner.choice` and in `report()`.

    The constructor does the export and the measuring; neither advances `state`.

    Args:
      trainer: the `SparseTrainer` (on one device).
      state: the `TrainState` training starts from.
      batch: a batch of the shape training uses.
      backend: `"auto"` (the default), `"xla"` or `"iree"`.
      steps: timed steps per backend under `"auto"` (default 3, at least 1).
      workdir: where the IREE artifact is written; None (the default): a temporary
        directory.
      progress: print what it is doing to stderr (default True).

    Raises:
      ValueError: `backend` is unknown, `steps` is below 1, or the trainer has a mesh
        and `backend` is not `"xla"`.
      TypeError: `trainer` is not a `SparseTrainer`.
    """

    def __init__(self, trainer, state, batch, *, backend: str = "auto", steps: int = 3,
                 workdir: str | None = None, progress: bool = True):
        from pockjax.train import SparseTrainer

        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got "
                             f"{backend!r}")
        if not isinstance(trainer, SparseTrainer):
            raise TypeError(f"Runner takes a pockjax.SparseTrainer, got {type(trainer).__name__}; "
                            "for an nnx module use pockjax.nnx.Trainer(..., backend=...)")
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        if backend != "xla" and trainer.layout is not None:
            raise ValueError(f"backend={backend!r}: IREE runs one device; a trainer with a mesh "
                             "runs on XLA only (backend='xla')")
        self.trainer, self._state, self._batch = trainer, state, batch
        self._workdir = workdir
        self._session = None
        say = (lambda msg: print(f"pockjax.backend: {msg}", file=sys.stderr, flush=True)) \
            if progress else (lambda msg: None)
        measured, export_s = {}, None
        if backend in ("iree", "auto"):
            say("exporting the step for IREE host-cpu ...")
            t = time.perf_counter()
            self._export()
            export_s = time.perf_counter() - t
            say(f"exported and compiled in {export_s:.1f} s")
        if backend == "auto":
            copy = [_copy(state)]

            def xla_step():
                copy[0], metrics = trainer(copy[0], batch)
                jax.block_until_ready(metrics)
            measured["xla"] = _median_ms(xla_step, steps)
            session = self._load()
            measured["iree"] = _median_ms(lambda: session.step(batch), steps)
            del session, copy
            say(f"xla {measured['xla']:.1f} ms/step, iree host-cpu {measured['iree']:.1f} ms/step")
        chosen = backend if backend != "auto" else min(measured, key=measured.get)
        self.choice = BackendChoice(chosen, backend, measured, steps, export_s)
        if chosen == "iree":
            self._session = self._load()  # from the exported (initial) state
            self._outputs = self._output_structure()

    # -- IREE --------------------------------------------------------------------

    def _export(self):
        from pockjax.export import export

        if self._workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="pockjax-backend-")
            self._workdir = self._tmp.name
        self._artifact = os.path.join(self._workdir, "host-cpu")
        export(self.trainer, self._state, self._batch, target="host-cpu", out_dir=self._artifact)

    def _load(self):
        from pockjax import runtime

        return runtime.load(self._artifact, device="local-task")

    def _output_structure(self):
        """The metrics' tree structure and leaf names, as the artifact names its outputs
        (jax key paths: `loss`, `aux/...`, any pytree as the aux)."""
        from pockjax.scheme import leaves_with_paths

        shapes = jax.eval_shape(lambda s, b: self.trainer.step(s, b)[1], self._state, self._batch)
        leaves, treedef = leaves_with_paths(shapes)
        return treedef, [n for n, _ in leaves]

    # -- training ----------------------------------------------------------------

    @property
    def backend(self) -> str:
        """The backend that runs the step: `"xla"` or `"iree"`."""
        return self.choice.backend

    def step(self, batch) -> dict:
        """One training step on the chosen backend; the metrics (`{"loss": ...}`).

        Args:
          batch: a batch of the shape the runner was built with.

        Returns:
          The step's metrics, with the structure the trainer's step returns on either
            backend.
        """
        if self._session is None:
            self._state, metrics = self.trainer(self._state, batch)
            return metrics
        out = self._session.step(batch)
        treedef, names = self._outputs
        return jax.tree_util.tree_unflatten(treedef, [out[n] for n in names])

    @property
    def state(self):
        """The current `TrainState` (read back from the IREE session when it runs there)."""
        if self._session is None:
            return self._state
        from pockjax.checkpoint import load

        with tempfile.TemporaryDirectory(prefix="pockjax-backend-") as d:
            path = os.path.join(d, "state.safetensors")
            self._session.save(path)
            return load(path, self._state)

    def report(self, batch=None):
        """`SparseTrainer.report` of the step, with the backend that runs it.

        Args:
          batch: the batch to report on; None (the default): the batch the runner was
            built with.

        Returns:
          The `TrainReport`, its `backend` field set to `str(self.choice)`.
        """
        report = self.trainer.report(self.state, self._batch if batch is None else batch)
        return dataclasses.replace(report, backend=str(self.choice))
