"""What `SparseTrainer.report` measures and how it shows it: the same model trained in
full to compare with (`full_training_traced`), the step's memory split by what it holds
(`memory_breakdown`, with an estimate of the activations the backward pass keeps) and
`TrainReport`, the table `str()` renders. `pockjax.train` fills them in and re-exports
`TrainReport`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pockjax import lowbit
from pockjax import sharding as _sharding
from pockjax._src.jaxpr import is_var
from pockjax.train._state import TrainState, abstract_arrays, with_shardings
from pockjax.flops import count_flops
from pockjax.measure import compiled_memory, format_bytes, format_flops, tree_bytes
from pockjax.scheme import Full
from pockjax.transforms.sparse_grad import TransformInfo, is_dynamic
from pockjax.view import trained_indices


def memory_breakdown(loss_fn, has_aux: bool, state, batch, decisions,
                     temp: int) -> dict[str, int]:
    """The step's memory by what it holds, in bytes: the arguments by kind (exact)
    and the compiled temporaries split into the activations the backward pass reads
    (an estimate: the residuals of `jax.vjp` with respect to the trained leaves) and
    the rest.

    Args:
      loss_fn: the loss the step differentiates, `loss_fn(params, batch)`.
      has_aux: whether it returns `(loss, aux)`.
      state: the step's `TrainState` (arrays or shapes).
      batch: a batch of the training shape.
      decisions: the resolved decision of each parameter leaf.
      temp: the compiled step's temporary bytes.

    Returns:
      Bytes by kind, in the order `TrainReport` shows them.
    """
    leaves = jax.tree_util.tree_leaves(state.params)
    trained = trained_indices(decisions)
    dynamic = [x for x in jax.tree_util.tree_leaves(batch) if is_dynamic(x)]
    kept = residual_bytes(loss_fn, has_aux, state.params, batch, trained)
    return {"frozen weights": tree_bytes([x for i, x in enumerate(leaves) if i not in set(trained)]),
            "trained weights": tree_bytes([leaves[i] for i in trained]),
            "optimizer state": tree_bytes(state.opt_state) + tree_bytes(state.step),
            "batch": tree_bytes(dynamic),
            "activations kept for backward": min(kept, temp),
            "other temporaries": max(temp - kept, 0)}


def residual_bytes(loss_fn, has_aux: bool, params, batch, trained: list[int]) -> int:
    """Bytes of what reverse mode keeps from the forward pass for the gradient of the
    leaves at `trained`: the residuals of `jax.vjp`, less the inputs themselves."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    batch_leaves, batch_def = jax.tree_util.tree_flatten(batch)
    dyn = [i for i, x in enumerate(batch_leaves) if is_dynamic(x)]

    def keep(t, rest, dyn_leaves):
        full = list(rest)
        for i, x in zip(trained, t):
            full[i] = x
        b = list(batch_leaves)
        for i, x in zip(dyn, dyn_leaves):
            b[i] = x
        b = jax.tree_util.tree_unflatten(batch_def, b)
        f = lambda t_: loss_fn(jax.tree_util.tree_unflatten(
            treedef, [dict(zip(trained, t_)).get(i, x) for i, x in enumerate(full)]), b)
        return jax.vjp(f, t, has_aux=has_aux)[1]

    avals = abstract_arrays
    closed = jax.make_jaxpr(keep)(avals([leaves[i] for i in trained]), avals(leaves),
                                  avals([batch_leaves[i] for i in dyn]))
    inputs = set(closed.jaxpr.invars) | set(closed.jaxpr.constvars)
    seen, total = set(), 0
    for v in closed.jaxpr.outvars:
        if is_var(v) and v not in inputs and v not in seen:
            seen.add(v)
            total += int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
    return total


def full_training_traced(loss_fn, optimizer, params, batch, *, has_aux: bool, layout,
                         frozen_dtype, donate: bool) -> jax.stages.Traced:
    """The same model trained in full with plain `jax.value_and_grad` + optax (and
    the same activation checkpointing): the column `TrainReport` compares a step with.

    Args:
      loss_fn: the loss the step differentiates (checkpointed as the step's is).
      optimizer: the optax transformation, here applied to every parameter.
      params: the step's parameters (arrays or shapes); quantized leaves, and floating
        ones where `frozen_dtype` is set, count at their float32 shape.
      batch: a batch of the training shape.
      has_aux: whether `loss_fn` returns `(loss, aux)`.
      layout: the step's `pockjax.sharding.Layout`, or None on one device.
      frozen_dtype: the trainer's `frozen_dtype`, or None.
      donate: whether the step donates its state.

    Returns:
      The traced full-training step.
    """
    gather = lambda p: p
    if layout is not None:  # read gathered, as the step does
        gather = lambda p: layout.read_gathered(p, [Full()] * len(jax.tree_util.tree_leaves(p)))

    def full_step(params, opt_state, batch):
        out, g = jax.value_and_grad(lambda p, b: loss_fn(gather(p), b), has_aux=has_aux)(
            params, batch)
        updates, opt_state = optimizer.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    # Full training of the float model: quantized weights at their float shape.
    params = abstract_arrays(jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32) if lowbit.is_quantized(x)
        or (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
            and frozen_dtype is not None) else x,
        params, is_leaf=lowbit.is_quantized))
    opt_state = jax.eval_shape(optimizer.init, params)
    batch_avals = abstract_arrays(batch)
    if layout is not None:  # the same layout, every parameter trained
        full = [Full()] * len(jax.tree_util.tree_leaves(params))
        param_shardings = layout.param_shardings(params, full)
        opt_state = with_shardings(opt_state, layout.opt_state_shardings(
            optimizer, params, param_shardings, opt_state))
        params = with_shardings(params, param_shardings)
        batch_avals = with_shardings(batch_avals, layout.batch_shardings(batch))
    donate_argnums = (0, 1) if donate else ()
    return jax.jit(full_step, donate_argnums=donate_argnums).trace(params, opt_state, batch_avals)


@dataclasses.dataclass
class TrainReport:
    """What `trainer.report()` measured; `str()` renders it as a table.

    Each figure is given for this step and for the same model trained in full
    (`..._full`). Memory dicts hold XLA's memory analysis in bytes: `temp`, `argument`,
    `output`, `alias` (outputs written over donated arguments) and `peak`.

    Attributes:
      trainable_params: parameters the scheme trains.
      total_params: all parameters.
      mode: the update mode, "fused" or "global".
      mode_reason: why, in words.
      flops: FLOPs of this step.
      flops_full: FLOPs of the full-training step.
      memory: this step's compiled memory, per device on a mesh.
      memory_full: the full-training step's.
      opt_state_bytes: bytes of this step's optimizer state.
      opt_state_bytes_full: bytes of full training's optimizer state.
      transform: the `TransformInfo` of the sparse backward pass.
      devices: devices the step runs on.
      layout: the mesh layout in words, or None on one device.
      collectives: the collective operations of this step (on a mesh).
      collectives_full: those of the full-training step.
      breakdown: this step's memory by what it holds (weights, optimizer state,
        batch, activations kept for the backward pass as an estimate, other
        temporaries), or None on a mesh.
      breakdown_full: the same for full training.
      remat: the activation checkpointing in words ("none" without).
      backend: what runs the step ("xla"; `pockjax.backend.Runner` sets its choice).
    """

    trainable_params: int
    total_params: int
    mode: str
    mode_reason: str
    flops: float
    flops_full: float
    memory: dict[str, int]
    memory_full: dict[str, int]
    opt_state_bytes: int
    opt_state_bytes_full: int
    transform: TransformInfo
    devices: int = 1
    layout: str | None = None
    collectives: list = dataclasses.field(default_factory=list)
    collectives_full: list = dataclasses.field(default_factory=list)
    breakdown: dict[str, int] | None = None
    breakdown_full: dict[str, int] | None = None
    remat: str = "none"
    backend: str = "xla"  # what runs the step; `pockjax.backend.Runner` fills in its choice

    def as_dict(self) -> dict:
        """The report as plain data (for JSON).

        Returns:
          A dict of the fields; `transform` as its own `as_dict()`, collectives as
          dicts of `op`, `shapes`, `dtypes` and `bytes`.
        """
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["memory"], d["memory_full"] = dict(self.memory), dict(self.memory_full)
        d["transform"] = self.transform.as_dict()
        for k in ("collectives", "collectives_full"):
            d[k] = [{"op": c.op, "shapes": [list(x) for x in c.shapes], "dtypes": list(c.dtypes),
                     "bytes": c.nbytes} for c in getattr(self, k)]
        return d

    def collective_bytes(self, full: bool = False) -> dict[str, int]:
        """Bytes each kind of collective moves per step (per device, result sizes).

        Args:
          full: report the full-training step's collectives instead of this step's;
            default False.

        Returns:
          Operation name -> bytes.
        """
        out: dict[str, int] = {}
        for c in (self.collectives_full if full else self.collectives):
            out[c.op] = out.get(c.op, 0) + c.nbytes
        return out

    def __str__(self) -> str:
        ratio = lambda a, b: f"{a / b:.2f}x" if b else "-"
        rows = [("", "this step", "full training", "ratio"),
                ("parameters trained", f"{self.trainable_params:,}", f"{self.total_params:,}",
                 f"{100 * self.trainable_params / max(self.total_params, 1):.2f}%"),
                ("FLOPs", format_flops(self.flops), format_flops(self.flops_full),
                 ratio(self.flops, self.flops_full)),
                ("optimizer state", format_bytes(self.opt_state_bytes), format_bytes(self.opt_state_bytes_full),
                 ratio(self.opt_state_bytes, self.opt_state_bytes_full))]
        per = " per device" if self.devices > 1 else ""
        for k, label in (("temp", "temporary memory"), ("argument", "arguments"),
                         ("output", "outputs"), ("alias", "donated (aliased)"),
                         ("peak", "peak estimate")):
            rows.append((label + per, format_bytes(self.memory[k]), format_bytes(self.memory_full[k]),
                         ratio(self.memory[k], self.memory_full[k])))
        if self.breakdown is not None:
            rows.append(("memory by what it holds:", "", "", ""))
            for k, n in self.breakdown.items():
                label = "  " + k + (" (estimate)" if k == "activations kept for backward" else "")
                rows.append((label, format_bytes(n), format_bytes(self.breakdown_full[k]),
                             ratio(n, self.breakdown_full[k])))
        if self.layout is not None:
            ops, ops_full = self.collective_bytes(), self.collective_bytes(full=True)
            for op in sorted(set(ops) | set(ops_full)):
                n = sum(c.op == op for c in self.collectives)
                n_full = sum(c.op == op for c in self.collectives_full)
                rows.append((f"{op} ({n} vs {n_full} ops)", format_bytes(ops.get(op, 0)),
                             format_bytes(ops_full.get(op, 0)),
                             ratio(ops.get(op, 0), ops_full.get(op, 0))))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        fmt = lambda r: "  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in
                                                              zip(r[1:], widths[1:])])
        lines = [fmt(r) for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        # The transform's own summary, less its first line (the parameter count above).
        if self.layout is not None:
            lines += ["", f"layout: {self.layout}"]
        lines += ["", f"update mode: {self.mode} ({self.mode_reason})",
                  f"activation checkpointing: {self.remat}", f"backend: {self.backend}",
                  *str(self.transform).splitlines()[1:]]
        return "\n".join(lines)


def build_report(trainer, state, batch) -> "TrainReport":
    """`SparseTrainer.report` (the state already checked): both steps compiled, not run."""
    # FLOPs from the traced programs: XLA's cost_analysis() counts a loop body once.
    sparse_traced, full_traced = trainer.trace(state, batch), trainer._full_traced(state, batch)
    sparse, full = sparse_traced.lower().compile(), full_traced.lower().compile()
    mode, reason = trainer.update_mode(state, batch)
    info = trainer.explain(state, batch)
    full_state = jax.eval_shape(trainer.optimizer.init, abstract_arrays(state.params))
    memory, memory_full = compiled_memory(sparse), compiled_memory(full)
    breakdown = breakdown_full = None
    if trainer.layout is None:  # on a mesh the per-device split is the layout's
        decisions = trainer.decisions(state.params)
        breakdown = memory_breakdown(trainer._loss, trainer.has_aux, state, batch, decisions,
                                     memory["temp"])
        everything = TrainState(state.step, state.params, full_state, None)
        breakdown_full = memory_breakdown(trainer._loss, trainer.has_aux, everything, batch,
                                          [Full()] * len(decisions), memory_full["temp"])
    return TrainReport(
        trainable_params=info.trainable_params, total_params=info.total_params,
        mode=mode, mode_reason=reason,
        flops=count_flops(sparse_traced), flops_full=count_flops(full_traced),
        memory=memory, memory_full=memory_full,
        opt_state_bytes=tree_bytes(state.opt_state), opt_state_bytes_full=tree_bytes(full_state),
        transform=info,
        devices=1 if trainer.layout is None else trainer.layout.mesh.devices.size,
        layout=None if trainer.layout is None else trainer.layout.describe(),
        collectives=_sharding.collectives(sparse) if trainer.layout is not None else [],
        collectives_full=_sharding.collectives(full) if trainer.layout is not None else [],
        breakdown=breakdown, breakdown_full=breakdown_full,
        remat="none" if trainer.remat is None else str(trainer.remat))
