"""The gradient program of `sparse_grad`, step by step, as plain functions on jaxprs.

`kept_value_and_grad` splits each differentiated leaf into its kept slice and its
frozen part (`split_kept`), traces the user's function once on the leaves rebuilt from
them, splits the scans of that forward at frozen/trained layer boundaries
(`scan_split`) and differentiates it with respect to the kept slices only; `push_down`
then narrows the backward pass (`pushdown`) and removes dead code. `SparseGradFn`
(in `sparse_grad`) traces them with `make_jaxpr_with_aux` and reports what they did.
"""
from __future__ import annotations

import functools

import jax
import jax.extend.core as jex
import numpy as np
from jax import lax
from jax.interpreters import partial_eval as pe

from pockjax.scheme import Frozen, Full
from pockjax.transforms import convolutions, dot_layout, pushdown, scan_split


def make_jaxpr_with_aux(f, *args):
    """`jax.make_jaxpr(f)(*args)` for an `f` that returns `(outputs, aux)`.

    Returns the closed jaxpr of the leaves of `outputs`, their treedef, and `aux`: a
    Python value `f` computed while it was traced, which a traced function cannot return.
    """
    found = []  # (treedef, aux) of the one trace

    def flat(*flat_args):
        outs, aux = f(*jax.tree_util.tree_unflatten(in_def, flat_args))
        leaves, out_def = jax.tree_util.tree_flatten(outs)
        found.append((out_def, aux))
        return leaves

    flat_args, in_def = jax.tree_util.tree_flatten(args)
    closed = jax.make_jaxpr(flat)(*flat_args)
    (out_def, aux), = found
    return closed, out_def, aux


def split_kept(leaves, decisions):
    """`(t, frozen_parts)`: `t` the differentiated parts (the kept slice of each Channels
    leaf, each Full leaf whole); per leaf its frozen part (the rest of a Channels leaf,
    a Frozen leaf whole, None for a Full leaf)."""
    t, frozen_parts = [], []
    for x, d in zip(leaves, decisions):
        if isinstance(d, Frozen):
            frozen_parts.append(x)
        elif isinstance(d, Full):
            t.append(x)
            frozen_parts.append(None)
        else:
            axis, start, stop = d.bounds(np.shape(x))
            n = np.shape(x)[axis]
            t.append(lax.slice_in_dim(x, start, stop, axis=axis))
            frozen_parts.append(lax.slice_in_dim(x, 0, start, axis=axis) if d.last
                                else lax.slice_in_dim(x, stop, n, axis=axis))
    return t, frozen_parts


def _rebuild(decisions, t, frozen_parts):
    """Full leaves from kept slices `t` and the frozen parts."""
    out, it = [], iter(t)
    for d, fpart in zip(decisions, frozen_parts):
        if isinstance(d, Frozen):
            out.append(fpart)
        elif isinstance(d, Full):
            out.append(next(it))
        else:
            kept = next(it)
            pieces = [fpart, kept] if d.last else [kept, fpart]
            out.append(lax.concatenate(pieces, d.axis))
    return out


def _forward(call, decisions, t, frozen_parts, dyn):
    """The user's function on the leaves rebuilt from their parts, and no aux."""
    return call(_rebuild(decisions, t, frozen_parts), dyn), None


def _run_split(split_closed, out_def, frozen_leaves, t):
    """The forward (with its scans split) on the kept slices `t`, as the user's output tree."""
    outs = jex.jaxpr_as_fun(split_closed)(*t, *frozen_leaves)
    return jax.tree_util.tree_unflatten(out_def, outs)


def kept_value_and_grad(call, decisions, has_aux, leaves, dyn):
    """The loss, the aux leaves and the gradient of each kept slice, flat, and `(the aux
    treedef, the number of scans split)`; `call(leaves, dyn)` runs the user's function."""
    t, frozen_parts = split_kept(leaves, decisions)
    # The forward, traced once, with scans split where a stacked weight's layer
    # axis is partly trained; then differentiated with respect to `t` only.
    fwd_closed, fwd_tree, _ = make_jaxpr_with_aux(functools.partial(_forward, call, decisions),
                                                   t, frozen_parts, dyn)
    split_closed, n_split = scan_split.split_scans(fwd_closed)
    split_closed, _ = convolutions.rewrite_convolutions(split_closed)  # XLA CPU's fast forms
    n_t = len(jax.tree_util.tree_leaves(t))
    forward_flat = functools.partial(_run_split, split_closed, fwd_tree,
                                     jax.tree_util.tree_leaves((frozen_parts, dyn)))
    if has_aux:
        (value, aux), g = jax.value_and_grad(forward_flat, has_aux=True)(list(t))
    else:
        value, g = jax.value_and_grad(forward_flat)(list(t))
        aux = None
    aux_leaves, aux_def = jax.tree_util.tree_flatten(aux)
    assert len(g) == n_t
    return [value, *aux_leaves, *g], (aux_def, n_split)


def push_down(closed, swap_dots: bool = True):
    """`closed` with the kept slices pushed up the backward graph and dead code removed
    (and with `swap_dots`, its weight gradients in the layout XLA's CPU backend multiplies
    fastest: `dot_layout`), and the pass's `Stats`."""
    stats = pushdown.Stats()
    stats.eqns_in = pushdown.count_eqns(closed.jaxpr)
    rewritten = pushdown.rewrite(closed, None, stats)
    dced, _ = pe.dce_jaxpr(rewritten.jaxpr, [True] * len(rewritten.jaxpr.outvars),
                           instantiate=True)
    # dce_jaxpr drops unused inputs; keep the signature so callers pass every leaf.
    dced = dced.replace(invars=rewritten.jaxpr.invars) if len(dced.invars) != len(
        rewritten.jaxpr.invars) else dced
    final = jex.ClosedJaxpr(dced, rewritten.consts)
    # Weight gradients in the layout the backend multiplies fastest (dot_layout).
    if swap_dots:
        final, _ = dot_layout.swap_transposed_dots(final)
    stats.eqns_out = pushdown.count_eqns(final.jaxpr)
    return final, stats
