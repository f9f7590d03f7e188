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

This module hands on the pass (`rewrite`, in `_pass`) and the pieces it is built from,
each in a module of its own: boxes (`_boxes`), plans (`_plans`), the rule interface and
the table (`_rules`), and the rules by primitive family (`_rules_elementwise`,
`_rules_layout`, `_rules_slicing`, `_rules_contraction`, `_control_flow`), all of which
are imported here, so the table is complete before the pass first reads it.
"""
from pockjax._src.home import claim
from pockjax.transforms._boxes import Box, box_shape, full_box, is_full, slice_to_box
from pockjax.transforms._control_flow import BodyRewrite
from pockjax.transforms._pass import count_eqns, rewrite
from pockjax.transforms._plans import Alias, Decline, Narrowed, Plan, Whole
from pockjax.transforms._rules import (RULES, Analysis, BoxRule, Rule, Stats, compute_whole,
                                       register)
from pockjax.transforms._rules_elementwise import ELEMENTWISE
from pockjax.transforms import (_control_flow, _rules_contraction, _rules_elementwise,
                                _rules_layout, _rules_slicing)

# The modules whose rules fill `RULES`: each registers its rules when it is imported.
_RULE_MODULES = (_rules_elementwise, _rules_layout, _rules_slicing, _rules_contraction,
                 _control_flow)

__all__ = ["Box", "full_box", "is_full", "box_shape", "slice_to_box", "Stats", "Decline",
           "Narrowed", "Whole", "Alias", "Plan", "Analysis", "Rule", "compute_whole", "BoxRule",
           "RULES", "register", "ELEMENTWISE", "rewrite", "BodyRewrite", "count_eqns"]

claim(globals())  # public names defined in the private modules above live here
