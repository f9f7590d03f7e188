"""Split a scan where a stacked weight's layer axis is partly trained.

A `Channels(axis=0, ...)` decision on a stacked `[L, ...]` weight makes the scanned
weight `concatenate([frozen_layers, trained_layers])`. Differentiating that scan as
one loop would run the backward of every layer and compute the weight gradient of
frozen layers too. Splitting the scan at the boundaries of the concatenation gives
one scan per part whose `xs` are the parts themselves; JAX then differentiates only
the parts that depend on trained values, so frozen layers get no weight-gradient
work, and a frozen prefix of layers gets no backward at all.

The rewrite runs on the forward jaxpr, before differentiation, and is exact: the
split scans compute the same carries and outputs as the original.
"""
from __future__ import annotations

import jax
import jax.extend.core as jex
from jax import lax
from jax.extend.core import primitives as P

from pockjax._src.jaxpr import avals, inline_calls, interpret, is_var

__all__ = ["split_scans"]


def _boundaries(eqn, producers):
    """Cut points along the scanned axis given by concatenated `xs` inputs."""
    p = eqn.params
    first_x = p["num_consts"] + p["num_carry"]
    cuts = set()
    for v in eqn.invars[first_x:]:
        prod = producers.get(v) if is_var(v) else None
        if prod is not None and prod.primitive.name == "concatenate" \
                and prod.params["dimension"] == 0 and len(prod.invars) > 1:
            off = 0
            for w in prod.invars[:-1]:
                off += w.aval.shape[0]
                cuts.add(off)
    return sorted(cuts)


def split_scans(closed: jex.ClosedJaxpr) -> tuple[jex.ClosedJaxpr, int]:
    """`closed` with scans split at concatenation boundaries of their `xs`; and how many.

    A scan is split where one of its `xs` is a `concatenate` along axis 0 in the same
    jaxpr (after inlining nested `jit` and `closed_call` equations); scans inside other
    bodies are left as they are.

    Args:
      closed: the forward jaxpr.

    Returns:
      A pair: the rewritten `ClosedJaxpr` (over the same inputs, computing the same
        outputs), and the number of scans split.
    """
    # Nested calls can hide the concatenation from the scan: inline them first.
    closed = inline_calls(closed.jaxpr, closed.consts)
    jaxpr = closed.jaxpr
    producers = {v: e for e in jaxpr.eqns for v in e.outvars if is_var(v)}
    todo = {id(e): _boundaries(e, producers) for e in jaxpr.eqns if e.primitive is P.scan_p}
    todo = {k: v for k, v in todo.items() if v}
    if not todo:
        return closed, 0
    count = [0]

    def split(e, ins, read):
        if id(e) not in todo:
            return None
        count[0] += 1
        return _split_one(e, ins, todo[id(e)], producers, read)

    new = jax.make_jaxpr(lambda *a: interpret(jaxpr, closed.consts, a, split))(*avals(jaxpr.invars))
    return new, count[0]


def _split_one(eqn, ins, cuts, producers, read):
    p = eqn.params
    nconst, ncarry, length = p["num_consts"], p["num_carry"], p["length"]
    consts, carry, xs = ins[:nconst], ins[nconst:nconst + ncarry], ins[nconst + ncarry:]
    xs_vars = eqn.invars[nconst + ncarry:]
    edges = [0] + [c for c in cuts if 0 < c < length] + [length]
    pieces = list(zip(edges[:-1], edges[1:]))

    def piece_of(v, x, s, e):
        """xs[s:e], taken from the concatenated operand itself where there is one."""
        prod = producers.get(v) if is_var(v) else None
        if prod is not None and prod.primitive.name == "concatenate" and prod.params["dimension"] == 0:
            off = 0
            for w in prod.invars:
                n = w.aval.shape[0]
                if off <= s and e <= off + n:
                    return lax.slice_in_dim(read(w), s - off, e - off, axis=0)
                off += n
        return lax.slice_in_dim(x, s, e, axis=0)

    ys_parts = [None] * len(pieces)
    order = range(len(pieces) - 1, -1, -1) if p["reverse"] else range(len(pieces))
    for k in order:
        s, e = pieces[k]
        xs_k = [piece_of(v, x, s, e) for v, x in zip(xs_vars, xs)]
        outs = P.scan_p.bind(*consts, *carry, *xs_k, **{**p, "length": e - s})
        carry, ys_parts[k] = list(outs[:ncarry]), list(outs[ncarry:])
    n_ys = len(eqn.outvars) - ncarry
    ys = [lax.concatenate([ys_parts[k][j] for k in range(len(pieces))], 0) for j in range(n_ys)]
    return list(carry) + ys
