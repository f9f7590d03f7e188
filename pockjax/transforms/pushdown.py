"""Slice push-down: compute only the part of each value that is used.

A *box* is a tuple of `(start, stop)` pairs, one per dimension of a value. The pass
walks a jaxpr backwards and records, for every variable, the boxes its consumers
need (a `slice` needs a box of its operand; a `dot_general` whose output is needed
in a box needs boxes of its operands; most other uses need the whole value). It then
re-traces the jaxpr forwards computing, for every needed box, just that part of the
value. Equations nobody needs are dropped on the way (dead-code elimination).

Rules live in one table keyed by primitive, `RULES`: a rule
`rule(eqn, wanted, analysis)` takes the `(output index, box)` pairs wanted of `eqn`
and returns a plan saying which boxes of its inputs it reads and how it emits them
(`Narrowed`, `Whole`, `Alias`, `BodyRewrite`), or `Decline(reason)` when it cannot do
better than computing the outputs whole. Most rules are a `BoxRule`: `pull(eqn, i, box)`
gives the (variable, box) pairs that box `box` of output `i` needs, `apply(ctx, eqn, i, box)`
emits that computation, and `widen` may grow a box it cannot compute into one it can
(a conv computes all rows of its kept channels); the needed box is sliced from it.
A primitive without a rule takes the default, `compute_whole` (compute all of it, then
slice). A decline, or the default, on an equation of which only part is used is counted
in `Stats.fallbacks` with its reason. A rule that raises is a bug: the error surfaces.

To add a rule, write `pull` and `apply` for one box of one output and call
`register(primitive, pull, apply)` (`BoxRule` says what `slicing` and `widen` add); a
rule that needs more than per-box pieces (one that aliases an input or rewrites a body)
is any `Rule`, stored with `RULES[primitive] = rule`.

Every equation the pass emits (re-bound, narrowed, or a slice of it) carries the source
info of the equation it comes from, so messages of this and later passes name the
user's line (`as_source`).

Higher-order primitives recurse: a box of a `scan`, `remat` or `cond` output becomes
an extra output of the rewritten body; `jit` and `closed_call` are inlined before the
walk (`inline_calls`); `while` bodies are rewritten in place; `custom_jvp_call` and
`custom_vjp_call` (which only remain on the primal path of a gradient jaxpr) decline:
their custom derivative needs the call as it is.

This module holds the pass (`rewrite`) and re-exports the pieces it is built from, each
in a module of its own: boxes (`_boxes`), plans (`_plans`), the rule interface and the
table (`_rules`), and the rules by primitive family (`_rules_elementwise`,
`_rules_layout`, `_rules_slicing`, `_rules_contraction`, `_control_flow`), all of which
are imported here, so the table is complete before the pass first reads it.
"""
from __future__ import annotations

import collections
import importlib
from typing import Sequence

import jax
import jax.extend.core as jex

from pockjax._src.home import claim
from pockjax._src.jaxpr import as_source, avals, inline_calls, is_var, var_shape
from pockjax.transforms._boxes import Box, box_shape, full_box, is_full, slice_to_box
from pockjax.transforms._control_flow import BodyRewrite
from pockjax.transforms._plans import Alias, Decline, Narrowed, Plan, Whole
from pockjax.transforms._rules import (RULES, Analysis, BoxRule, Rule, Stats, compute_whole,
                                       register)
from pockjax.transforms._rules_elementwise import ELEMENTWISE

__all__ = ["Box", "full_box", "is_full", "box_shape", "slice_to_box", "Stats", "Decline",
           "Narrowed", "Whole", "Alias", "Plan", "Analysis", "Rule", "compute_whole", "BoxRule",
           "RULES", "register", "ELEMENTWISE", "rewrite", "BodyRewrite", "count_eqns"]

# The modules whose rules fill `RULES`: each registers its rules when it is imported.
_RULE_MODULES = tuple(importlib.import_module(f"pockjax.transforms.{name}") for name in (
    "_rules_elementwise", "_rules_layout", "_rules_slicing", "_rules_contraction", "_control_flow"))


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


claim(globals())  # public names defined in the private modules above live here
