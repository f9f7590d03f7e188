"""The trainable view: the part of each parameter that trains, taken out of the
parameter tree and written back into it.

A `Full` leaf's view is the whole leaf, a `Channels` leaf's view is its kept slice, and a
`Frozen` leaf has none (`None` in a view tree). Gradients from `sparse_grad`, optimizer
state and updates all live in this view; `kept` takes it, `write_back` puts a new value
of it into the parameter (in place under `jit` with donation: a `dynamic_update_slice`
of the whole parameter). The trainer, the fused optimizer and export use these
functions, and `pockjax.trainable_view` / `pockjax.apply_sparse_updates` are the public
ones for a loop of one's own.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax

from pockjax.scheme import (Channels, Frozen, Full, Scheme, SchemeError, layouts_of,
                            leaves_with_paths)

__all__ = ["trainable_view", "apply_sparse_updates", "resolved_decisions", "ResolvedScheme",
           "trained_indices", "kept", "write_back"]


def resolved_decisions(params, scheme: Scheme | Any):
    """The decision of each leaf of `params`, in flattening order.

    Args:
      params: the parameter pytree.
      scheme: a `Scheme`, or the tree `scheme.resolve(params)` returns.

    Returns:
      A list with one `Full`, `Frozen` or `Channels` per leaf of `params`.

    Raises:
      SchemeError: `scheme` is neither a `Scheme` nor a tree of one decision per leaf
        of `params`.
    """
    if isinstance(scheme, Scheme):
        return jax.tree_util.tree_leaves(scheme.resolve(params))
    leaves = jax.tree_util.tree_leaves(scheme)
    n = len(jax.tree_util.tree_leaves(params))
    if len(leaves) != n or not all(isinstance(d, (Full, Frozen, Channels)) for d in leaves):
        raise SchemeError("expected a pockjax.Scheme or the result of scheme.resolve(params) "
                          f"({n} decisions); got {type(scheme).__name__}")
    return leaves


class ResolvedScheme:
    """A scheme resolved once per parameter structure. Called with a parameter tree it
    gives `resolved_decisions(params, scheme)`, computed the first time that structure
    (tree, shapes, dtypes, and the axis layouts registered for it) is seen and kept after. A trainer holds one
    (`SparseTrainer.decisions`) and hands it to its gradient, its report and export, so
    the scheme is matched against the parameters' paths once.

    Args:
      scheme: the `Scheme`.
    """

    def __init__(self, scheme: Scheme):
        if not isinstance(scheme, Scheme):
            raise SchemeError(f"scheme must be a pockjax.Scheme, got {type(scheme).__name__}")
        self.scheme = scheme
        self._seen: dict = {}

    def __call__(self, params) -> list:
        """The decision of each leaf of `params`, in flattening order (a new list each
        call; the resolving is done once).

        Raises:
          SchemeError: as `Scheme.resolve`.
        """
        leaves, treedef = jax.tree_util.tree_flatten(params)
        key = (treedef, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__)))
                              for x in leaves), repr(layouts_of(params)))
        if key not in self._seen:
            self._seen[key] = tuple(resolved_decisions(params, self.scheme))
        return list(self._seen[key])

    def __repr__(self) -> str:
        return f"ResolvedScheme({self.scheme!r}, {len(self._seen)} structures)"


def trained_indices(decisions) -> list[int]:
    """The positions of the leaves that train (`Full` or `Channels`), in order.

    Args:
      decisions: one decision per parameter leaf (`resolved_decisions`).

    Returns:
      The indices of the decisions that are not `Frozen`.
    """
    return [i for i, d in enumerate(decisions) if not isinstance(d, Frozen)]


def kept(x, d):
    """The trained part of parameter `x` under decision `d`: the kept slice of a
    `Channels` leaf, `x` itself for any other decision.

    Args:
      x: the parameter (an array, or a tracer).
      d: its decision.

    Returns:
      The slice along the Channels axis, or `x`.
    """
    if isinstance(d, Channels):
        axis, start, stop = d.bounds(np.shape(x))
        return lax.slice_in_dim(x, start, stop, axis=axis)
    return x


def write_back(x, d, new, start=None):
    """Parameter `x` with its trained part replaced by `new` (cast to `x`'s dtype).

    Args:
      x: the parameter.
      d: its decision (`Full` or `Channels`).
      new: the new value of `kept(x, d)`.
      start: for a Channels leaf, the start index to write at, when it must be computed
        (a traced scalar that equals the kept range's start; see
        `pockjax._src.ties.tied_start`); None (the default): the kept range's start.

    Returns:
      `new` for a Full leaf; for a Channels leaf, `x` with the slice written by
        `lax.dynamic_update_slice` (in place when `x` is donated).
    """
    new = new.astype(x.dtype)
    if isinstance(d, Channels):
        axis, first, _ = d.bounds(np.shape(x))
        idx = [0] * np.ndim(x)
        idx[axis] = first if start is None else start
        return lax.dynamic_update_slice(x, new, idx)
    return new


def trainable_view(params, scheme):
    """The trainable view of `params`: the tree `sparse_grad` returns gradients in.

    Frozen leaves are `None`, Channels leaves hold the kept slice, Full leaves are whole.

    Args:
      params: the parameter pytree.
      scheme: a `Scheme`, or the decision tree `scheme.resolve(params)` returns.

    Returns:
      A tree with the structure of `params`: `None` for each Frozen leaf, the kept
        slice of each Channels leaf, each Full leaf as it is.

    Raises:
      SchemeError: `scheme` is neither a `Scheme` nor a tree of one decision per leaf
        of `params`, or it does not resolve against `params`.
    """
    named, treedef = leaves_with_paths(params)
    decisions = resolved_decisions(params, scheme)
    view = [None if isinstance(d, Frozen) else kept(x, d)
            for (_, x), d in zip(named, decisions)]
    return jax.tree_util.tree_unflatten(treedef, view)


def apply_sparse_updates(params, updates, scheme):
    """`params` plus `updates` given in the trainable view (like `optax.apply_updates`).

    Channels leaves get the update added to their kept slice, written back with
    `lax.dynamic_update_slice` (in place when the caller jits the update and donates
    `params`); Full leaves get the whole update added; Frozen leaves are returned as
    they are. Each result keeps its parameter's dtype.

    Args:
      params: the parameter pytree.
      updates: the updates in the trainable view (`trainable_view(params, scheme)`'s
        structure): the kept slice's shape for a Channels leaf, the parameter's shape
        for a Full leaf; the entry of a Frozen leaf is ignored (`None` there).
      scheme: a `Scheme`, or the decision tree `scheme.resolve(params)` returns.

    Returns:
      The updated parameters, with the structure and dtypes of `params`.

    Raises:
      SchemeError: `updates` has a different number of leaves than `params`, a trained
        leaf's update is `None`, or an update's shape is not the kept slice's (or the
        parameter's); also when `scheme` does not resolve against `params`.
    """
    named, treedef = leaves_with_paths(params)
    decisions = resolved_decisions(params, scheme)
    upd = jax.tree_util.tree_leaves(updates, is_leaf=lambda x: x is None)
    if len(upd) != len(named):
        raise SchemeError(f"updates have {len(upd)} leaves but the parameters have {len(named)}; "
                          "pass updates in the trainable view (pockjax.trainable_view(params, scheme))")
    out = []
    for (path, x), d, u in zip(named, decisions, upd):
        if isinstance(d, Frozen):
            out.append(x)
            continue
        if u is None:
            raise SchemeError(f"parameter '{path}' trains ({d!r}) but its update is None")
        if isinstance(d, Channels):
            axis, start, stop = d.bounds(np.shape(x))
            want = tuple(stop - start if i == axis else n for i, n in enumerate(np.shape(x)))
            if tuple(np.shape(u)) != want:
                raise SchemeError(f"update for '{path}' has shape {np.shape(u)}, expected the kept "
                                  f"slice's shape {want}")
            out.append(write_back(x, d, kept(x, d) + u))
        else:
            if tuple(np.shape(u)) != tuple(np.shape(x)):
                raise SchemeError(f"update for '{path}' has shape {np.shape(u)}, expected {np.shape(x)}")
            out.append((x + u).astype(x.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)
