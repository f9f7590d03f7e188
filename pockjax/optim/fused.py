"""The training step's optimizer, fused into the backward pass (PockEngine's reordering).

Given the sparse gradient jaxpr `G` (parameters and batch in; loss, aux and the
trainable view's gradients out), each trainable parameter's update is placed right
after the later of two equations: the one producing its gradient and the last one
reading the parameter. The new value is made to depend on the outputs of those last
readers (a zero computed from one element of each is added to it), so no compiler can
move the in-place write of the donated parameter before a read of the old value
(IREE 3.13 does, silently), and each gradient buffer is consumed as soon as it exists.

Reads are followed through view-like equations (transpose, reshape, slice, ...): a
compiler may fuse such a view into its consumer, which then reads the parameter's
buffer itself.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax

from pockjax._src.jaxpr import as_source, bind, dependencies, interpret, is_var, producers
from pockjax.optim.perleaf import UpdatePlan
from pockjax._src.ties import tie_zero, tied_start, token
from pockjax.scheme import Channels
from pockjax.view import kept, trained_indices, write_back

__all__ = ["Placement", "place_updates", "fused_step", "global_step", "VIEWS"]

# Primitives whose output is its first input's elements moved, selected or converted:
# reading their output reads that input (here and in `pockjax.export.lowering`).
VIEWS = frozenset(
    "transpose reshape squeeze expand_dims broadcast_in_dim convert_element_type slice "
    "dynamic_slice copy copy_p reduce_precision bitcast_convert_type rev".split())
"""Names of the view-like primitives: reading one's output counts as reading its first
input (`place_updates` follows a parameter's reads through them)."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one trainable parameter's update goes: after equation `after` (-1: before
    the first), tied to the values `ties` (outputs of the parameter's last readers).

    Attributes:
      after: the index of the equation the update follows: the later of the one
        producing the gradient and the parameter's last reader; -1 before the first.
      ties: the jaxpr variables the write is ordered after: per reader of the parameter
        (or of a view of it) that no other reader depends on, its smallest output.
    """

    after: int
    ties: tuple[Any, ...]


def _size(v) -> int:
    return int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize


def place_updates(jaxpr: jex.Jaxpr, params: Sequence[Any], grads: Sequence[Any]) -> list[Placement]:
    """A `Placement` for each pair (parameter input var, gradient output atom).

    Args:
      jaxpr: the gradient jaxpr.
      params: the input variables of the trainable parameters.
      grads: the output atoms holding their gradients, in the same order.

    Returns:
      One `Placement` per parameter, in order.
    """
    producer = producers(jaxpr)

    # Vars that alias each parameter: the parameter and its views.
    owners: dict = {}
    for j, p in enumerate(params):
        owners.setdefault(p, set()).add(j)
    readers: list[list[int]] = [[] for _ in params]
    for i, e in enumerate(jaxpr.eqns):
        touched = set()
        for v in e.invars:
            if is_var(v) and v in owners:
                touched |= owners[v]
        for j in touched:
            readers[j].append(i)
        if touched and e.primitive.name in VIEWS:
            for v in e.outvars:
                if is_var(v):
                    owners.setdefault(v, set()).update(touched)

    # A reader is on the frontier unless another reader of the same parameter
    # depends on its output; tying the update to the frontier orders it after all.
    bit_of: dict[tuple[int, int], int] = {}
    for j, rs in enumerate(readers):
        for i in rs:
            bit_of[(j, i)] = len(bit_of)
    eqn_bits: dict[int, int] = {}
    for (j, i), b in bit_of.items():
        eqn_bits[i] = eqn_bits.get(i, 0) | (1 << b)
    in_mask: list[int] = []  # per equation: the readers its inputs descend from
    dependencies(jaxpr, [0] * len(jaxpr.invars), own=lambda i: eqn_bits.get(i, 0),
                 seen=lambda i, m: in_mask.append(m))

    placements = []
    for j, (p, g) in enumerate(zip(params, grads)):
        rs = readers[j]
        ties = []
        for i in rs:
            b = 1 << bit_of[(j, i)]
            if any(in_mask[k] & b for k in rs if k != i):
                continue
            outs = [v for v in jaxpr.eqns[i].outvars if is_var(v)]
            if outs:
                ties.append(min(outs, key=_size))
        g_at = producer.get(g, -1) if is_var(g) else -1
        placements.append(Placement(max([g_at, *rs]) if rs else g_at, tuple(ties)))
    return placements


def _write_back(x, d, new_view, tok=None):
    """`write_back`, at a start index tied to the reads by `tok` (barrier mode)."""
    if tok is None or not isinstance(d, Channels):
        return write_back(x, d, new_view)
    axis, start, stop = d.bounds(np.shape(x))
    return write_back(x, d, new_view, tied_start(tok, start, np.shape(x)[axis] - (stop - start)))


def _value(read, atom):
    if isinstance(atom, jex.Literal):
        return jnp.broadcast_to(jnp.asarray(atom.val, atom.aval.dtype), atom.aval.shape)
    return read(atom)


def fused_step(grad_jaxpr: jex.ClosedJaxpr, param_leaves, other_leaves, decisions,
               plan: UpdatePlan, state_leaves, n_head: int, ties: str = "data",
               reads=None, grad_shardings=None, gathered=None):
    """Run the gradient jaxpr with each parameter's update fused in; returns
    `(head outputs, new parameter leaves, new optimizer state leaves)`.

    `n_head` is the number of leading outputs of `grad_jaxpr` that are not gradients
    (loss and aux); the remaining ones are the trainable view's gradients in order.
    `ties` orders each write after the parameter's last reads:

    - "data" (the default, for XLA and IREE): a zero computed from one element of each
      reader's output is added to the new value (see `tie_zero`). IREE keeps barriers as
      real ops that hide buffer lifetimes (every transient of the backward pass then
      lives to the end of the step), and computes dynamic slice offsets on the host.
      XLA drops barriers before copy insertion, so only a data dependency tells it that
      the in-place write follows the reads: with barriers it copies every trained
      weight once per step (more temporaries, slower steps);
    - "barrier": an optimization barrier over the gradient, the parameter and the
      readers' outputs, and for partial (Channels) writes a data-dependent start index
      (see `pockjax._src.ties.token`); kept for comparison.

    On a mesh, `reads` are the values the forward and backward read in place of the
    parameters (FSDP: the gathered weights), and `grad_shardings` lays out each
    trainable gradient like its slice of the sharded parameter before the update. With
    `gathered`, the backward pass gathers each weight again where it reads it
    (`regather`), so no gathered weight stays alive from the forward pass to the
    backward.

    Args:
      grad_jaxpr: the sparse gradient program (`GradProgram.info.jaxpr`): parameter
        leaves and dynamic batch leaves in; loss, aux leaves and the trainable view's
        gradients out.
      param_leaves: every parameter leaf, frozen ones included, in flattening order.
      other_leaves: the dynamic leaves of the other inputs (the batch).
      decisions: the resolved decision of each parameter leaf.
      plan: the optimizer's `UpdatePlan` in "fused" mode (`plan_updates`).
      state_leaves: the optimizer state's leaves, flat.
      n_head: the number of leading outputs that are not gradients.
      ties: `"data"` (the default) or `"barrier"`.
      reads: the values the program reads in place of `param_leaves`; None (the
        default): `param_leaves`.
      grad_shardings: a sharding (or None) per trainable gradient; None (the default):
        no constraint.
      gathered: per parameter leaf, `(its sharding, the sharding `reads` gathered it
        to)`, or None where it is read as it is; None (the default): the backward pass
        reads `reads`.

    Returns:
      A tuple `(head outputs, new parameter leaves, new optimizer state leaves)`: the
        first `n_head` outputs, every parameter leaf (trained ones updated) and the
        state leaves, as lists.
    """
    jaxpr = grad_jaxpr.jaxpr
    train_idx = trained_indices(decisions)
    n = len(train_idx)
    m = len(state_leaves)
    param_vars = [jaxpr.invars[k] for k in train_idx]
    grad_atoms = jaxpr.outvars[n_head:]
    placements = place_updates(jaxpr, param_vars, grad_atoms)
    loop_values = _loop_values(jaxpr)
    at = _by_position(placements)

    new_params = list(param_leaves)
    new_state = list(state_leaves)
    if plan.shared is not None:
        ins = [state_leaves[i - n] for i in plan.shared_inputs]
        for j, v in zip(plan.shared_out, _call(plan.shared, ins)):
            new_state[j] = v

    def update(j, read):
        k = train_idx[j]
        d = decisions[k]
        g = _shard(_value(read, grad_atoms[j]), grad_shardings, j)
        tied = [read(v) for v in placements[j].ties]
        p, tok, zero = param_leaves[k], None, None
        if ties == "barrier":
            g, p, *tied = lax.optimization_barrier((g, p, *tied))
            tok = token(tied)
        else:
            zero = _data_tie(placements[j], read, loop_values)
        view = kept(p, d)
        leaf = plan.leaves[j]
        ins = []
        for i in leaf.inputs:
            if i < n:
                assert i == j, "a per-leaf update read another leaf's gradient"
                ins.append(g)
            elif i < n + m:
                ins.append(state_leaves[i - n])
            else:
                assert i - n - m == j, "a per-leaf update read another leaf's parameter"
                ins.append(view)
        u, *s = _call(leaf.jaxpr, ins)
        new_params[k] = _write_back(p, d, _plus(view + u, zero), tok)
        for idx, v in zip(leaf.state_out, s):
            new_state[idx] = v

    def after(i, read):
        for j in at.get(i, ()):
            update(j, read)

    outs = interpret(jaxpr, grad_jaxpr.consts,
                     [*(param_leaves if reads is None else reads), *other_leaves],
                     override=regather(jaxpr, param_leaves, gathered), after=after)
    return outs[:n_head], new_params, new_state


def regather(jaxpr, param_leaves, gathered):
    """FSDP: the `interpret` override under which the backward pass gathers each sharded
    weight again where it reads it, or None where nothing is gathered.

    Without it the forward and backward passes read one gathered copy of each weight
    (XLA merges two equal all-gathers), which then lives from its first use in the
    forward pass to its last in the backward. An equation after the loss's (the
    backward pass: JAX traces the forward pass first) reads the sharded weight plus an
    exact zero computed from another of its inputs (`tie_zero`: the cotangent; the
    previous equation's output where it has none), gathered again: a value XLA can
    neither merge with the forward pass's gather nor gather before that input exists
    (an optimization barrier would not do: XLA drops them before it merges).

    Args:
      jaxpr: the gradient jaxpr; its first output is the loss.
      param_leaves: every parameter leaf as stored (sharded), in the jaxpr's input order.
      gathered: per leaf, `(its sharding, the sharding it is read gathered to)` or None;
        or None.
    """
    if gathered is None or not is_var(jaxpr.outvars[0]):
        return None
    sharded = {v: (p, s) for v, p, s in zip(jaxpr.invars, param_leaves, gathered)
               if s is not None}
    if not sharded:
        return None
    loss_at = producers(jaxpr).get(jaxpr.outvars[0], len(jaxpr.eqns))
    index = {id(e): i for i, e in enumerate(jaxpr.eqns)}
    # Views of a weight made in the forward pass (a transpose, a reshape) that the
    # backward reads are made again from the weight gathered again.
    chains = {v: (v, ()) for v in sharded}
    previous, last = {}, None  # each equation's previous output
    for i, e in enumerate(jaxpr.eqns):
        previous[i] = last
        last = next((v for v in e.outvars if is_var(v)), last)
        if (i < loss_at and e.primitive.name in VIEWS and is_var(e.invars[0])
                and e.invars[0] in chains and not any(is_var(v) for v in e.invars[1:])):
            base, views = chains[e.invars[0]]
            chains[e.outvars[0]] = (base, (*views, e))

    def again(v, zero):
        base, views = chains[v]
        p, (own, whole) = sharded[base]
        # Tied where it is stored, then gathered: tied after the gather, the gather
        # would be the forward pass's again.
        x = lax.with_sharding_constraint(lax.with_sharding_constraint(_plus(p, zero), own), whole)
        for e in views:
            with as_source(e):
                x = bind(e, [x, *(u.val for u in e.invars[1:])])
        return x

    def override(e, ins, read):
        i = index[id(e)]
        hits = [k for k, v in enumerate(e.invars) if is_var(v) and v in chains]
        if i <= loss_at or not hits:
            return None
        others = [x for k, (v, x) in enumerate(zip(e.invars, ins))
                  if k not in hits and is_var(v)]
        tie = others[0] if others else (read(previous[i]) if previous[i] is not None else None)
        zero = None if tie is None else tie_zero([tie])
        ins = list(ins)
        for k in hits:
            ins[k] = again(e.invars[k], zero)
        outs = bind(e, ins)
        return outs if e.primitive.multiple_results else [outs]

    return override


def _shard(g, shardings, j):
    if shardings is None or shardings[j] is None:
        return g
    return lax.with_sharding_constraint(g, shardings[j])


def global_step(grad_jaxpr: jex.ClosedJaxpr, param_leaves, other_leaves, decisions,
                optimizer, state, view_def, n_head: int, ties: str = "data",
                reads=None, grad_shardings=None, skip_nonfinite: bool = False, gathered=None):
    """The optimizer after the whole backward pass (for chains that need every gradient,
    such as clip_by_global_norm). Writes are ordered after the last reads as in
    `fused_step`: `ties="barrier"` puts one barrier over every gradient and trainable
    parameter; `ties="data"` adds each parameter's data tie (on IREE a barrier over
    donated parameters makes it copy them onto themselves, which its runtime rejects).
    `reads`, `grad_shardings` and `gathered` as in `fused_step`.

    With `skip_nonfinite`, a step whose loss, outputs or any gradient holds a NaN or an
    infinity keeps every parameter and the optimizer state as they were (selected, not
    added: a -0.0 stays -0.0). Returns `(head, new_params, new_state, finite)`, `finite`
    a boolean scalar (always True without `skip_nonfinite`).

    Args:
      grad_jaxpr: the sparse gradient program, as for `fused_step`.
      param_leaves: every parameter leaf, frozen ones included, in flattening order.
      other_leaves: the dynamic leaves of the other inputs (the batch).
      decisions: the resolved decision of each parameter leaf.
      optimizer: the optax `GradientTransformation`.
      state: the optimizer state (a tree).
      view_def: the treedef of the trainable view.
      n_head: the number of leading outputs that are not gradients.
      ties: `"data"` (the default) or `"barrier"`, as for `fused_step`.
      reads: as for `fused_step` (default None: `param_leaves`).
      grad_shardings: as for `fused_step` (default None: no constraint).
      gathered: as for `fused_step` (default None).
      skip_nonfinite: keep everything as it was when an output or gradient is not
        finite (default False).

    Returns:
      A tuple `(head, new_params, new_state, finite)`: the first `n_head` outputs
        (list), every parameter leaf with trained ones updated (list), the new
        optimizer state (a tree), and whether every output and gradient is finite.
    """
    jaxpr = grad_jaxpr.jaxpr
    inputs = [*(param_leaves if reads is None else reads), *other_leaves]
    train_idx = trained_indices(decisions)
    trained = [param_leaves[k] for k in train_idx]
    zeros: list = [None] * len(train_idx)
    if ties == "barrier":
        outs = interpret(jaxpr, grad_jaxpr.consts, inputs,
                         override=regather(jaxpr, param_leaves, gathered))
        grads = [_shard(g, grad_shardings, j) for j, g in enumerate(outs[n_head:])]
        grads, trained = lax.optimization_barrier((grads, trained))
    else:
        placements = place_updates(jaxpr, [jaxpr.invars[k] for k in train_idx],
                                   jaxpr.outvars[n_head:])
        loop_values = _loop_values(jaxpr)
        at = _by_position(placements)

        def after(i, read):
            for j in at.get(i, ()):
                zeros[j] = _data_tie(placements[j], read, loop_values)

        outs = interpret(jaxpr, grad_jaxpr.consts, inputs,
                         override=regather(jaxpr, param_leaves, gathered), after=after)
        grads = [_shard(g, grad_shardings, j) for j, g in enumerate(outs[n_head:])]
    head = outs[:n_head]
    views = [kept(p, decisions[k]) for k, p in zip(train_idx, trained)]
    g_tree = jax.tree_util.tree_unflatten(view_def, grads)
    p_tree = jax.tree_util.tree_unflatten(view_def, views)
    updates, new_state = optimizer.update(g_tree, state, p_tree)
    finite = jnp.array(True)
    if skip_nonfinite:
        for x in (*head, *grads):
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
                finite = finite & jnp.all(jnp.isfinite(x))
        new_state = jax.tree_util.tree_map(lambda new, old: jnp.where(finite, new, old),
                                           new_state, state)
    new_params = list(param_leaves)
    for k, p, v, u, z in zip(train_idx, trained, views, jax.tree_util.tree_leaves(updates), zeros):
        value = _plus(v + u, z)
        if skip_nonfinite:
            value = jnp.where(finite, value, v)
        new_params[k] = _write_back(p, decisions[k], value)
    return head, new_params, new_state, finite


def _by_position(placements) -> dict[int, list[int]]:
    """Update indices by the equation they follow."""
    at: dict[int, list[int]] = {}
    for j, pl in enumerate(placements):
        at.setdefault(pl.after, []).append(j)
    return at


def _data_tie(placement: Placement, read, loop_values: set):
    """The zero that orders a write after `placement`'s last reads (see `tie_zero`)."""
    return tie_zero([read(v) for v in placement.ties],
                 barrier=any(v in loop_values for v in placement.ties))


def _plus(x, zero):
    return x if zero is None else x + zero.astype(x.dtype)


def _loop_values(jaxpr) -> set:
    """Values that go into or come out of a loop (scan, while); see `tie_zero`."""
    return {v for e in jaxpr.eqns if e.primitive.name in ("scan", "while")
            for v in [*e.invars, *e.outvars] if isinstance(v, jex.Var)}


def _call(closed: jex.ClosedJaxpr, args):
    return interpret(closed.jaxpr, closed.consts, args)
