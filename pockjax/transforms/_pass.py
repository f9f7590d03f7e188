"""The slice push-down pass itself (`rewrite`): the backward walk that records the boxes
each variable's consumers need, then the forward re-trace that computes just those.
It reads the rule table `RULES`; `pockjax.transforms.pushdown` imports every rule
module, so the table is complete when the pass runs. The call rules (`_control_flow`)
rewrite bodies through `rewrite` here.
"""
from __future__ import annotations

import collections
from typing import Sequence

import jax
import jax.extend.core as jex

from pockjax._src.jaxpr import as_source, avals, inline_calls, is_var, var_shape
from pockjax.transforms._boxes import Box, box_shape, full_box, slice_to_box
from pockjax.transforms._plans import Decline, Narrowed, Whole
from pockjax.transforms._rules import RULES, Analysis, Stats, compute_whole


# --------------------------------------------------------------------------- the pass


class _Ctx:
    """Values of (variable, box) pairs during the forward re-trace."""

    def __init__(self):
        self.env: dict = collections.defaultdict(dict)  # var -> {box: value}

    def get(self, v, box=None):
        if isinstance(v, jex.Literal):
            return v.val
        shape = var_shape(v)
        box = full_box(shape) if box is None else tuple(box)
        have = self.env[v]
        if box in have:
            return have[box]
        for b, val in have.items():  # slice from a stored box that contains this one
            if all(s0 <= s and e <= e0 for (s0, e0), (s, e) in zip(b, box)):
                rel = tuple((s - s0, e - s0) for (s0, _), (s, e) in zip(b, box))
                have[box] = slice_to_box(val, rel, box_shape(b))
                return have[box]
        raise AssertionError(f"pockjax internal error: {v} box {box} was not computed")

    def put(self, v, box, val):
        self.env[v][tuple(box)] = val


def _partial_only(eqn, wanted) -> bool:
    """Only parts of the outputs are wanted: computing them whole wastes work."""
    full = [box == full_box(var_shape(eqn.outvars[i])) for i, box in wanted]
    return bool(full) and not any(full)


def _analyse(jaxpr, out_needs, stats):
    """Backward pass: the boxes needed of every variable, and each equation's plan.

    Each equation's rule (`compute_whole` if its primitive has none) sees the boxes its
    consumers want of its outputs and plans how to produce them; a decline becomes a
    `Whole` plan. An equation nobody needs, without effects, is dropped.
    """
    needs: dict = collections.defaultdict(set)
    for v, boxes in zip(jaxpr.outvars, out_needs):
        if is_var(v):
            needs[v].update(tuple(b) for b in boxes)
    analysis = Analysis({v: e for e in jaxpr.eqns for v in e.outvars if is_var(v)}, stats)
    plans = {}  # id(eqn) -> Plan
    for eqn in reversed(jaxpr.eqns):
        wanted = tuple((i, box) for i, v in enumerate(eqn.outvars) if is_var(v) for box in needs.get(v, ()))
        if not wanted and not eqn.effects:
            continue  # dead
        plan = RULES.get(eqn.primitive, compute_whole)(eqn, wanted, analysis)
        if isinstance(plan, Decline):
            plan = Whole(wanted, reason=plan.reason)
        if isinstance(plan, Whole) and plan.reason is not None and _partial_only(eqn, wanted):
            stats.fallback(eqn, plan.reason)  # only part is used, but no rule could narrow it
        if isinstance(plan, Narrowed):
            for i, box in plan.pulled:
                if box != full_box(var_shape(eqn.outvars[i])):
                    stats.rule(eqn.primitive.name)
        for w, b in plan.inputs(eqn):
            needs[w].add(tuple(b))
        plans[id(eqn)] = plan
    return plans


def _eval(jaxpr, consts, args, out_needs, stats):
    """Forward re-trace computing only the needed boxes; values per outvar per box."""
    plans = _analyse(jaxpr, out_needs, stats)
    ctx = _Ctx()
    for v, x in zip(list(jaxpr.constvars) + list(jaxpr.invars), list(consts) + list(args)):
        if is_var(v):
            ctx.put(v, full_box(var_shape(v)), x)
    for eqn in jaxpr.eqns:
        if id(eqn) in plans:
            with as_source(eqn):  # what is emitted for `eqn` keeps the user's line
                plans[id(eqn)].emit(ctx, eqn, stats)
    return [[ctx.get(v, b) if is_var(v) else v.val for b in boxes]
            for v, boxes in zip(jaxpr.outvars, out_needs)]


def rewrite(closed: jex.ClosedJaxpr, out_needs: Sequence[Sequence[Box]] | None = None,
            stats: Stats | None = None) -> jex.ClosedJaxpr:
    """Re-trace `closed` computing, for output j, the boxes `out_needs[j]` (in order).

    The result takes the original inputs and returns the needed boxes of each output
    flattened in order. With `out_needs=None` every output is needed whole. Nested `jit`
    and `closed_call` equations are inlined first.

    Args:
      closed: the jaxpr to rewrite.
      out_needs: for each output of `closed`, the list of boxes needed of it; None
        (the default): each output whole.
      stats: the `Stats` to count rules and fallbacks into; None (the default): a
        fresh one, not returned.

    Returns:
      A `ClosedJaxpr` over the inputs of `closed` that returns, output by output, each
        needed box in order.
    """
    stats = stats if stats is not None else Stats()
    jaxpr, consts = closed.jaxpr, closed.consts
    if out_needs is None:
        out_needs = [[full_box(var_shape(v))] if is_var(v) else [()] for v in jaxpr.outvars]
    out_needs = [[tuple(b) for b in boxes] for boxes in out_needs]

    def fn(*args):
        inner = inline_calls(jaxpr, consts)
        outs = _eval(inner.jaxpr, inner.consts, args, out_needs, stats)
        return [o for per_var in outs for o in per_var]

    if jaxpr.invars:
        return jax.make_jaxpr(fn)(*avals(jaxpr.invars))
    return jax.make_jaxpr(fn)()


def count_eqns(jaxpr) -> int:
    """Equations in a jaxpr, counting those inside sub-jaxprs.

    Args:
      jaxpr: a `Jaxpr` (the `.jaxpr` of a `ClosedJaxpr`).

    Returns:
      The number of equations, each sub-jaxpr's counted in full once per equation
        that holds it.
    """
    n = 0
    for e in jaxpr.eqns:
        n += 1
        for sub in jex.jaxprs_in_params(e.params):
            n += count_eqns(sub)
    return n
