"""`sparse_train`, which makes a `SparseTrainer` (or a `ScheduledTrainer` for a scheme
schedule) from a loss, and `step_variant`."""
from __future__ import annotations

from typing import Any, Callable

import jax
import optax

from pockjax import sharding as _sharding
from pockjax.scheme import Full, Scheme
from pockjax.train._state import TrainState
from pockjax.train._trainer import SparseTrainer


def sparse_train(fun: Callable | None = None, *, optimizer: optax.GradientTransformation | None = None,
                 scheme: Any = None, has_aux: bool = False, donate: bool = True,
                 mesh: jax.sharding.Mesh | None = None, data_axis="data", param_axis=None,
                 param_specs=None, batch_specs=None, remat: Any = None,
                 skip_nonfinite: bool = False, frozen_dtype: Any = None):
    """Turn `loss(params, batch)` into a `SparseTrainer`.

    `scheme` defaults to training everything (`Scheme(default=Full())`); a
    `pockjax.schedule.Schedule` (`pj.schemes.schedule`, `pj.schemes.blockwise`) gives a
    `ScheduledTrainer`, whose schemes take turns. Use as
    `@sparse_train(optimizer=..., scheme=...)` or `sparse_train(loss, optimizer=...)`.

    With `mesh` the step runs on all its devices (`pockjax.sharding`): the batch is
    split over `data_axis`, parameters are replicated or, with `param_axis`, sharded
    FSDP-style; `param_specs` (a `{path: PartitionSpec}` dict or a function of
    `(path, shape)` returning one or None) sets the layout of chosen parameters and
    `batch_specs` that of chosen batch leaves.

    `remat` checkpoints the loss (`jax.checkpoint`): the backward pass recomputes the
    activations the policy does not save instead of keeping them from the forward pass,
    for longer sequences in less memory at the cost of recomputation. `"full"` saves
    nothing; a name from `jax.checkpoint_policies` (`"dots_saveable"`, ...) or a policy
    function chooses what is saved. Per block in a plain function: wrap each block in
    `checkpoint_block` (`h = pj.checkpoint_block(block)(params["b3"], h)`), which saves
    memory on XLA's CPU backend too, where a checkpoint over the whole loss does not.
    Frozen blocks ahead of every trained one are never differentiated and keep nothing
    either way. The full-training column of `report()` is checkpointed the same way.

    `skip_nonfinite=True` makes a step whose loss, outputs or any gradient is not finite
    (a NaN in one batch element) change nothing: parameters, optimizer state and the
    step count stay as they were, and `metrics["skipped"]` is True. Every gradient is
    then checked before the first write, so updates run after the backward pass
    (`report()`'s update mode "global") instead of interleaved with it.

    >>> import jax.numpy as jnp, optax, pockjax as pj
    >>> @pj.sparse_train(optimizer=optax.sgd(0.1))
    ... def trainer(p, batch):
    ...     return jnp.mean((batch @ p["w"]) ** 2)
    >>> state = trainer.init({"w": jnp.ones((3, 2))})
    >>> state, metrics = trainer(state, jnp.ones((4, 3)))
    >>> int(state.step)
    1

    Args:
      fun: the loss function `fun(params, batch)`; None (decorator use with arguments)
        returns a decorator.
      optimizer: an optax `GradientTransformation` (required).
      scheme: a `Scheme`, or a `pockjax.schedule.Schedule`; None (the default) trains
        every parameter.
      has_aux: whether the loss returns `(loss, aux)`; default False.
      donate: update the state in place (the default); False keeps old states usable
        at the cost of one more copy of the parameters and optimizer state per step.
      mesh: a `jax.sharding.Mesh` to run the step on; None (the default) for one device.
      data_axis: the mesh axis (or axes) the batch is split over; default "data".
      param_axis: the mesh axis (or axes) parameters are sharded over, FSDP-style;
        None (the default) replicates them.
      param_specs: the layout of chosen parameters: a `{path: PartitionSpec}` dict or a
        function of `(path, shape)` returning one or None; needs `mesh`.
      batch_specs: the same for chosen batch leaves; needs `mesh`.
      remat: activation checkpointing of the loss: None (the default), `"full"`, a
        policy name from `jax.checkpoint_policies` or a policy function.
      skip_nonfinite: skip steps whose loss, outputs or gradients are not finite (see
        above); default False.
      frozen_dtype: store the leaves `scheme` freezes in low precision: `init` quantizes
        them (`pockjax.lowbit.quantize`) to "int8" (a scale per output channel),
        "int4" / "int4:GROUP" (a scale per group of inputs, two values a byte),
        "bfloat16" or "float16", or per leaf with a dict of path patterns to formats.
        The step dequantizes each where it is used and again in the backward pass, so
        no float copy of the frozen model is alive. None (the default): as given.
        Parameters already holding `lowbit.Quantized` leaves train either way.

    Returns:
      A `SparseTrainer` (a `ScheduledTrainer` for a schedule); without `fun`, a
      decorator that makes one.

    Raises:
      TypeError: no `optimizer`; `param_axis`, `param_specs` or `batch_specs` without
        `mesh`; `frozen_dtype` with a schedule; or (when the loss is given) it is not
        callable, or `SparseTrainer` refuses the settings.
      SchemeError: `scheme` is neither a `Scheme` nor a `Schedule`.
      ValueError: `remat` names no checkpoint policy, or `data_axis` or `param_axis`
        is not an axis of `mesh`.
    """
    if optimizer is None:
        raise TypeError("sparse_train needs an optimizer: @pockjax.sparse_train(optimizer=optax.adam(1e-3), "
                        "scheme=...)")
    scheme = Scheme(default=Full()) if scheme is None else scheme
    layout = None
    if mesh is not None:
        layout = _sharding.Layout(mesh, data_axis=data_axis, param_axis=param_axis,
                                  param_specs=param_specs, batch_specs=batch_specs)
    elif param_axis is not None or param_specs is not None or batch_specs is not None:
        raise TypeError("param_axis, param_specs and batch_specs need a mesh: sparse_train(..., mesh=jax.make_mesh("
                        "(4,), ('data',)), param_axis='data')")

    from pockjax.schedule import Schedule, ScheduledTrainer

    schedule = scheme if isinstance(scheme, Schedule) else None

    def wrap(f):
        if not callable(f):
            raise TypeError(f"sparse_train decorates a loss function, got {type(f).__name__}")
        if schedule is not None and frozen_dtype is not None:
            raise TypeError("frozen_dtype= with a schedule: the schedule's schemes train "
                            "different weights in turn, so each needs its float value; "
                            "store frozen weights in low precision with a single scheme")
        trainer = SparseTrainer(f, optimizer, schedule.schemes[0] if schedule else scheme,
                                has_aux=has_aux, donate=donate, layout=layout, remat=remat,
                                skip_nonfinite=skip_nonfinite, frozen_dtype=frozen_dtype)
        return ScheduledTrainer(trainer, schedule) if schedule else trainer

    return wrap if fun is None else wrap(fun)


def step_variant(trainer: SparseTrainer, state: TrainState, batch, *,
                 placement: str | None = None, ties: str = "data"):
    """`trainer.step_variant(state, batch, placement=, ties=)`: see
    `SparseTrainer.step_variant`."""
    return trainer.step_variant(state, batch, placement=placement, ties=ties)
