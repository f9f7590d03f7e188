"""Backend legalisation on jaxprs, before lowering for IREE.

- `reduce_sum(neg(x))` becomes `neg(reduce_sum(x))`. IREE 3.13's GPU code generation
  folds the negation into the reduction's combiner (a subtraction), which has no
  identity value, and fails ("Failed to get an identity value for the reduction
  operation"); LayerNorm's backward produces this pattern. The two forms are equal.
- `select_and_scatter_add` (the backward of max and min pooling) becomes strided
  slices, comparisons and pads. IREE 3.13 lowers `stablehlo.select_and_scatter` onto an
  uninitialised output and says so at compile time ("reads uninitialized values from
  an operand produced by a tensor.empty op"); the result would then depend on what
  the memory held. No wrong value was seen on llvm-cpu or lavapipe, but the rewrite
  removes the dependence (and the warning). It routes each gradient to the first
  extreme element of its window, as XLA does, so the values are the same (up to the
  order in which overlapping windows' contributions are added).

Nested `jit` calls are inlined on the way; the bodies of scan, cond, while and remat
are left as they are (the pattern there is not rewritten).
"""
from __future__ import annotations

import itertools

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax import lax

from pockjax.transforms import pushdown

__all__ = ["legalize_for_iree", "select_and_scatter_add"]


def select_and_scatter_add(source, operand, select_prim, window_dimensions, window_strides,
                           padding):
    """`lax`'s select_and_scatter_add without the select_and_scatter op: each element of
    `source` is added to the first element of its window of `operand` that `select_prim`
    (`ge` for max pooling, `le` for min pooling) prefers; padding is never chosen."""
    better = {"ge": lax.max, "le": lax.min}[select_prim.name]
    pad_cfg = [(lo, hi, 0) for lo, hi in padding]
    xp = lax.pad(operand, jnp.zeros((), operand.dtype), pad_cfg)
    valid = lax.pad(jnp.ones(operand.shape, bool), False, pad_cfg)
    out = source.shape

    def window_view(a, offset):
        limit = [o + (n - 1) * s + 1 for o, n, s in zip(offset, out, window_strides)]
        return lax.slice(a, offset, limit, window_strides)

    offsets = list(itertools.product(*[range(w) for w in window_dimensions]))
    views = [(window_view(xp, o), window_view(valid, o)) for o in offsets]
    best, seen = None, None
    for x, ok in views:
        if best is None:
            best, seen = x, ok
        else:
            best = lax.select(seen & ok, better(best, x), lax.select(ok, x, best))
            seen = seen | ok
    result = jnp.zeros(xp.shape, source.dtype)
    taken = jnp.zeros(out, bool)
    for o, (x, ok) in zip(offsets, views):
        hit = ok & (x == best) & ~taken
        taken = taken | hit
        placed = [(oi, p - (oi + (n - 1) * s + 1), s - 1)
                  for oi, p, n, s in zip(o, xp.shape, out, window_strides)]
        result = result + lax.pad(lax.select(hit, source, jnp.zeros_like(source)),
                                  jnp.zeros((), source.dtype), placed)
    lo = [p[0] for p in padding]
    return lax.slice(result, lo, [l + n for l, n in zip(lo, operand.shape)])


def _rewrite(jaxpr: jex.Jaxpr, consts, args, stats):
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}

    def override(e, ins, read):
        if e.primitive.name in ("jit", "pjit", "closed_call"):
            sub = e.params["jaxpr"]
            return _rewrite(sub.jaxpr, sub.consts, ins, stats)
        if e.primitive.name == "select_and_scatter_add" and \
                e.params["select_prim"].name in ("ge", "le"):
            stats["select_and_scatter"] = stats.get("select_and_scatter", 0) + 1
            p = e.params
            return [select_and_scatter_add(ins[0], ins[1], p["select_prim"],
                                           p["window_dimensions"], p["window_strides"],
                                           p["padding"])]
        if e.primitive.name == "reduce_sum" and isinstance(e.invars[0], jex.Var):
            src = producer.get(e.invars[0])
            if src is not None and src.primitive.name == "neg":
                stats["neg_sum"] = stats.get("neg_sum", 0) + 1
                return [lax.neg(pushdown._bind(e, [read(src.invars[0])]))]
        return None

    return pushdown.interpret(jaxpr, consts, args, override)


def legalize_for_iree(closed: jex.ClosedJaxpr) -> tuple[jex.ClosedJaxpr, dict[str, int]]:
    """`closed` rewritten for IREE, and how many rewrites of each kind were made."""
    stats: dict[str, int] = {}
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    out = jax.make_jaxpr(lambda *a: _rewrite(closed.jaxpr, closed.consts, a, stats))(*avals)
    return out, stats
