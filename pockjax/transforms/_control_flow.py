"""Push-down rules of `scan`, `remat`, `cond`, `while` and the custom-derivative calls.

A box of a `scan`, `remat` or `cond` output becomes an extra output of the rewritten
body (a `BodyRewrite` plan), which `rewrite` (`_pass`) rewrites recursively; `while`
bodies are rewritten in place; `custom_jvp_call` and `custom_vjp_call` decline.
Registered into `RULES` (`_rules`) on import; `pushdown` imports this module.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.extend.core as jex
import numpy as np
from jax.extend.core import primitives as P

from pockjax._src.jaxpr import bind, consts_to_invars, is_var, var_shape
from pockjax.transforms._pass import rewrite
from pockjax.transforms._boxes import full_box
from pockjax.transforms._plans import Decline, OnWholeInputs, Whole
from pockjax.transforms._rules import RULES


# --------------------------------------------------------------------------- calls
#
# A call rule plans a `BodyRewrite`: the body is rewritten to return, for each output
# of the call, the whole value if it is needed whole and then each needed box; the
# rewritten body is bound once, so a call never runs twice.


def _same_box(eqn, i, box):
    return box


@dataclasses.dataclass(frozen=True)
class BodyRewrite(OnWholeInputs):
    """A call on whole inputs whose body returns, for output j, the boxes `body_needs[j]`
    (boxes of the body's output; `outer_box(eqn, j, box)` is that box of the call's).
    `bind(eqn, ops, body_needs, stats)` binds the call with its body rewritten; when
    every output is needed whole (`unchanged`) the call is bound as it is.

    Attributes:
      body_needs: for each output of the call, the list of boxes of the matching
        body output that the rewritten body returns.
      unchanged: True when every output is needed whole: the call is re-bound as it is.
      bind: `bind(eqn, ops, body_needs, stats)` -> the outputs of the call with its
        body rewritten (`rewrite(body, body_needs, stats)`), flat, on whole inputs
        `ops`.
      outer_box: `outer_box(eqn, j, box)` -> the box of the call's output `j` that box
        `box` of body output `j` gives; by default the same box (a scan's adds the
        stacked axis).
    """

    body_needs: list
    unchanged: bool
    bind: Callable
    outer_box: Callable = _same_box

    def emit(self, ctx, eqn, stats):
        """Bind the call (rewritten unless `unchanged`) once and store each returned box.

        Args:
          ctx: the re-trace's values (`ctx.get(var, box)`, `ctx.put(var, box, value)`).
          eqn: the call equation.
          stats: the pass's `Stats`, passed to `bind`.
        """
        ops = [ctx.get(v, None) for v in eqn.invars]
        outs = bind(eqn, ops) if self.unchanged else self.bind(eqn, ops, self.body_needs, stats)
        it = iter(outs)
        for i, (boxes, v) in enumerate(zip(self.body_needs, eqn.outvars)):
            for b in boxes:
                val = next(it)
                if is_var(v):
                    ctx.put(v, self.outer_box(eqn, i, b), val)


def _body_rewrite(eqn, wanted, body_outvars, bind_rewritten, inner_box=lambda i, b: b,
                  always_whole=(), outer_box=_same_box) -> BodyRewrite:
    """The plan of a call: per body output, the list of boxes the rewritten body returns.

    `inner_box(i, box)` is the box of body output `i` that gives box `box` of the call's
    output (None: the body computes it whole, it is sliced outside); outputs in
    `always_whole` are returned whole in any case.
    """
    result = []
    for i, (v, bv) in enumerate(zip(eqn.outvars, body_outvars)):
        boxes = {b for j, b in wanted if j == i}
        fb = full_box(var_shape(v))
        bn = [full_box(var_shape(bv))] if (i in always_whole or fb in boxes) else []
        for b in sorted(b for b in boxes if b != fb):
            ib = inner_box(i, b)
            if ib is None:  # cannot narrow inside: keep whole, slice outside
                if full_box(var_shape(bv)) not in bn:
                    bn.insert(0, full_box(var_shape(bv)))
            elif ib not in bn:
                bn.append(ib)
        result.append(bn)
    unchanged = all(bn == [full_box(var_shape(v))] for bn, v in zip(result, body_outvars))
    return BodyRewrite(result, unchanged, bind_rewritten, outer_box)


def _scan_rule(eqn, wanted, analysis):
    nc, body = eqn.params["num_carry"], eqn.params["jaxpr"].jaxpr

    def inner_box(i, b):
        if i < nc:  # a carry keeps its shape across iterations
            analysis.stats.fallback(eqn, "a carry is needed whole by the next iteration")
            return None
        analysis.stats.rule("scan")
        return tuple(b[1:])  # the stacked axis is sliced outside, if at all

    return _body_rewrite(eqn, wanted, body.outvars, _bind_scan, inner_box, always_whole=range(nc),
                         outer_box=_scan_outer_box)


def _scan_outer_box(eqn, i, b):
    return b if i < eqn.params["num_carry"] else ((0, var_shape(eqn.outvars[i])[0]),) + tuple(b)


def _bind_scan(eqn, ops, body_needs, stats):
    p = eqn.params
    new = rewrite(p["jaxpr"], body_needs, stats)
    consts = list(new.consts)
    return P.scan_p.bind(*consts, *ops, **{
        **p, "jaxpr": jex.ClosedJaxpr(consts_to_invars(new), []),
        "num_consts": p["num_consts"] + len(consts)})


RULES[P.scan_p] = _scan_rule


def _remat_rule(eqn, wanted, analysis):
    return _body_rewrite(eqn, wanted, eqn.params["jaxpr"].outvars, _bind_remat)


def _bind_remat(eqn, ops, body_needs, stats):
    p = eqn.params
    stats.rule(eqn.primitive.name)
    new = rewrite(jex.ClosedJaxpr(p["jaxpr"], []), body_needs, stats)
    # Bound directly (not through jax.checkpoint) to keep `differentiated`, which
    # stops XLA from merging the recomputation with the forward pass.
    return P.remat_p.bind(*new.consts, *ops, jaxpr=consts_to_invars(new),
                          prevent_cse=p["prevent_cse"], differentiated=p["differentiated"],
                          policy=p["policy"])


RULES[P.remat_p] = _remat_rule


def _cond_rule(eqn, wanted, analysis):
    return _body_rewrite(eqn, wanted, eqn.params["branches"][0].jaxpr.outvars, _bind_cond)


def _bind_cond(eqn, ops, body_needs, stats):
    p = eqn.params
    stats.rule(eqn.primitive.name)
    new = [rewrite(br, body_needs, stats) for br in p["branches"]]
    # Every branch takes the consts of all branches and uses its own.
    all_consts = [c for b in new for c in b.consts]
    const_avals = [jax.core.ShapedArray(np.shape(c), c.dtype) for c in all_consts]
    fixed, offset = [], 0
    for b in new:
        j = consts_to_invars(b)
        n = len(b.consts)
        fresh = [jex.Var(a) for a in const_avals]
        invars = fresh[:offset] + list(j.invars[:n]) + fresh[offset + n:] + list(j.invars[n:])
        fixed.append(jex.ClosedJaxpr(j.replace(invars=invars), []))
        offset += n
    return P.cond_p.bind(ops[0], *all_consts, *ops[1:], **{**p, "branches": tuple(fixed)})


RULES[P.cond_p] = _cond_rule


def _while_rule(eqn, wanted, analysis):
    """The loop's outputs stay whole (a carry keeps its shape); its body and condition are
    rewritten (slices inside them)."""
    return Whole(wanted, _run_while, reason="a while loop's outputs are computed whole")


def _run_while(ctx, eqn, stats):
    p = eqn.params
    ops = [ctx.get(v, None) for v in eqn.invars]
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, init = ops[:cn], ops[cn:cn + bn], ops[cn + bn:]
    new_body = rewrite(p["body_jaxpr"], None, stats)
    new_cond = rewrite(p["cond_jaxpr"], None, stats)
    bc, cc = list(new_body.consts), list(new_cond.consts)
    return P.while_p.bind(*cc, *cond_consts, *bc, *body_consts, *init, **{
        **p, "body_jaxpr": jex.ClosedJaxpr(consts_to_invars(new_body), []),
        "cond_jaxpr": jex.ClosedJaxpr(consts_to_invars(new_cond), []),
        "body_nconsts": bn + len(bc), "cond_nconsts": cn + len(cc)})


RULES[P.while_p] = _while_rule


def _custom_derivative_rule(eqn, wanted, analysis):
    return Decline("its custom derivative needs the call as it is")


RULES[P.custom_jvp_call_p] = _custom_derivative_rule
RULES[P.custom_vjp_call_p] = _custom_derivative_rule
