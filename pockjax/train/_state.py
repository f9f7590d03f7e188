"""The training state and the checks made on it: `TrainState` (a pytree of step,
parameters and optimizer state), shapes-only copies of a state (`abstract_arrays`,
`with_shardings`), and the refusals of a state that mixes shapes and arrays or whose
buffers were donated already. `pockjax.train` builds on them and re-exports
`TrainState` and `abstract_arrays`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pockjax.scheme import Scheme


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Step counter, full parameters, and optimizer state for the trainable view.

    A pytree (the scheme is static metadata, used by `pockjax.save`). Made by
    `SparseTrainer.init`; each step returns a new one.

    Attributes:
      step: the number of steps taken, an int32 scalar array.
      params: the full parameter pytree, frozen leaves included.
      opt_state: the optimizer's state for the trainable view (the trained leaves, and
        the kept channels of `Channels` leaves).
      scheme: the `Scheme` the state was made for, or None.
    """

    step: Any
    params: Any
    opt_state: Any
    scheme: Scheme | None = None

    def replace(self, **changes) -> "TrainState":
        """A copy with some fields changed.

        Args:
          **changes: new values by field name (`step`, `params`, `opt_state`, `scheme`).

        Returns:
          The new `TrainState`.
        """
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(TrainState, data_fields=["step", "params", "opt_state"],
                                 meta_fields=["scheme"])


def abstract_arrays(tree):
    """Shapes and dtypes of a tree's leaves, with the sharding of those that have one."""
    def one(x):
        sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
        if sharding is not None and len(sharding.device_set) > 1:
            return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=sharding)
        return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))

    return jax.tree_util.tree_map(one, tree)


def with_shardings(avals, shardings):
    """`avals` (a tree of `jax.ShapeDtypeStruct`s) with the shardings of `shardings`."""
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), avals, shardings)


def is_abstract(tree, what: str) -> bool:
    """Whether every leaf is a `jax.ShapeDtypeStruct`; refuse a mix of shapes and arrays."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    shapes = [isinstance(x, jax.ShapeDtypeStruct) for _, x in leaves]
    if any(shapes) and not all(shapes):
        path = next(p for (p, _), s in zip(leaves, shapes) if s != shapes[0])
        raise TypeError(f"{what}{jax.tree_util.keystr(path)} is "
                        f"{'a ShapeDtypeStruct' if not shapes[0] else 'an array'} while "
                        f"{what}{jax.tree_util.keystr(leaves[0][0])} is not: give all arrays "
                        f"(to train) or all jax.ShapeDtypeStructs (to report or lower)")
    return bool(shapes) and all(shapes)


def check_not_donated(state: TrainState, donate: bool) -> None:
    """Refuse a state whose buffers an earlier step (or `init(copy=False)`) gave away,
    before XLA does with "Buffer has been deleted or donated"."""
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(x, jax.Array) and x.is_deleted():
            where = f"state{jax.tree_util.keystr(path)}"
            raise ValueError(
                f"{where} was deleted: this TrainState was already passed to a step, which "
                f"donates the state's buffers (updates them in place), so only the state it "
                f"returned is valid. Continue from `state, metrics = trainer(state, batch)`'s "
                f"new state" + ("; to keep old states usable, make the trainer with "
                                "sparse_train(..., donate=False) (one more copy of the parameters "
                                "and optimizer state per step)" if donate else
                                "; another trainer with donation consumed it"))


def distinct_buffers(tree):
    """Copy any leaf whose buffer another leaf already uses (a tied weight, a state
    leaf aliasing a parameter): donation refuses one buffer passed twice."""
    seen = set()

    def fix(x):
        if not isinstance(x, jax.Array):
            return jnp.asarray(x)
        try:
            ptr = x.unsafe_buffer_pointer()
        except Exception:  # sharded or deleted arrays: leave as they are
            return x
        if ptr in seen:
            x = jnp.array(x, copy=True)
            ptr = x.unsafe_buffer_pointer()
        seen.add(ptr)
        return x

    return jax.tree_util.tree_map(fix, tree)


def decisions_tree(params, decisions):
    """The flat per-leaf `decisions` as a tree shaped like `params`."""
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), decisions)
