"""Backend legalisation on jaxprs, before lowering for an export target.

`reduce_sum(neg(x))` becomes `neg(reduce_sum(x))`. IREE 3.13's GPU code generation
folds the negation into the reduction's combiner (a subtraction), which has no
identity value, and fails ("Failed to get an identity value for the reduction
operation"); LayerNorm's backward produces this pattern. The two forms are equal.

Nested `jit` calls are inlined on the way; the bodies of scan, cond, while and remat
are left as they are (the pattern there is not rewritten).
"""
from __future__ import annotations

import jax
import jax.extend.core as jex
from jax import lax

from pockjax.transforms import pushdown

__all__ = ["legalize_for_gpu"]


def _rewrite(jaxpr: jex.Jaxpr, consts, args, stats):
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}

    def override(e, ins, read):
        if e.primitive.name in ("jit", "pjit", "closed_call"):
            sub = e.params["jaxpr"]
            return _rewrite(sub.jaxpr, sub.consts, ins, stats)
        if e.primitive.name == "reduce_sum" and isinstance(e.invars[0], jex.Var):
            src = producer.get(e.invars[0])
            if src is not None and src.primitive.name == "neg":
                stats["neg_sum"] = stats.get("neg_sum", 0) + 1
                return [lax.neg(pushdown._bind(e, [read(src.invars[0])]))]
        return None

    return pushdown.interpret(jaxpr, consts, args, override)


def legalize_for_gpu(closed: jex.ClosedJaxpr) -> tuple[jex.ClosedJaxpr, dict[str, int]]:
    """`closed` rewritten for IREE's GPU backends, and how many rewrites were made."""
    stats: dict[str, int] = {}
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    out = jax.make_jaxpr(lambda *a: _rewrite(closed.jaxpr, closed.consts, a, stats))(*avals)
    return out, stats
