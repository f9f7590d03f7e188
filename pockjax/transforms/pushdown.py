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
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Callable, NamedTuple, Sequence, Union

import jax
import jax.extend.core as jex
import numpy as np
from jax import lax
from jax.extend.core import primitives as P

from pockjax._jaxpr import (as_source, avals, bind, consts_to_invars, describe_source,
                             inline_calls, is_var, var_shape)

Box = tuple  # tuple[tuple[int, int], ...]
"""A box: a tuple of `(start, stop)` pairs, one per dimension of a value (`()` for a scalar)."""


# --------------------------------------------------------------------------- boxes


def full_box(shape: Sequence[int]) -> Box:
    """The box covering all of a value.

    Args:
      shape: the value's shape.

    Returns:
      `(0, n)` for each dimension `n` of `shape`.
    """
    return tuple((0, int(n)) for n in shape)


def is_full(box: Box, shape: Sequence[int]) -> bool:
    """Whether `box` covers all of a value of shape `shape`.

    Args:
      box: the box.
      shape: the value's shape.

    Returns:
      True when every dimension's pair is `(0, n)`.
    """
    return all(s == 0 and e == n for (s, e), n in zip(box, shape))


def box_shape(box: Box) -> tuple[int, ...]:
    """The shape of the part of a value that `box` selects.

    Args:
      box: the box.

    Returns:
      `stop - start` for each dimension.
    """
    return tuple(e - s for s, e in box)


def slice_to_box(x, box: Box, shape: Sequence[int]):
    """The part of `x` that `box` selects.

    Args:
      x: an array or tracer.
      box: the box to take, within `shape`.
      shape: the shape of `x`.

    Returns:
      `x` itself when `box` covers all of it, else `lax.slice(x, starts, stops)`.
    """
    if is_full(box, shape):
        return x
    return lax.slice(x, [s for s, _ in box], [e for _, e in box])


def _whole_inputs(eqn) -> list:
    return [(w, full_box(var_shape(w))) for w in eqn.invars if is_var(w)]


def _partial_only(eqn, wanted) -> bool:
    """Only parts of the outputs are wanted: computing them whole wastes work."""
    full = [box == full_box(var_shape(eqn.outvars[i])) for i, box in wanted]
    return bool(full) and not any(full)


# --------------------------------------------------------------------------- stats


@dataclasses.dataclass
class Stats:
    """What the pass did: rules applied and fallbacks per primitive (with a source line
    and the reason of the first one), equations in and out.

    `rewrite` counts into the `Stats` it is given; rules reach it as `analysis.stats`.

    Attributes:
      rules: primitive name -> number of output boxes a rule narrowed (and of call
        bodies rewritten).
      fallbacks: primitive name -> number of equations computed whole although only
        part of their outputs is used.
      fallback_sources: primitive name -> the user's source line of its first fallback.
      fallback_reasons: primitive name -> the reason of its first fallback.
      eqns_in: equations before the pass; set by the caller (`count_eqns`).
      eqns_out: equations after the pass; set by the caller (`count_eqns`).
    """

    rules: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fallback_sources: dict = dataclasses.field(default_factory=dict)
    fallback_reasons: dict = dataclasses.field(default_factory=dict)
    eqns_in: int = 0
    eqns_out: int = 0

    def rule(self, name: str):
        """Count one box narrowed by a rule.

        Args:
          name: the primitive's name.
        """
        self.rules[name] += 1

    def fallback(self, eqn, reason: str = "no push-down rule"):
        """Count one equation computed whole although only part of it is used.

        The first fallback of each primitive also records its source line and reason.

        Args:
          eqn: the equation.
          reason: why no rule narrowed it.
        """
        name = eqn.primitive.name
        self.fallbacks[name] += 1
        self.fallback_sources.setdefault(name, describe_source(eqn))
        self.fallback_reasons.setdefault(name, reason)


# --------------------------------------------------------------------------- plans
#
# What a rule decides for one equation. Each plan names the input boxes it reads
# (`inputs`) and emits the wanted boxes of the outputs during the forward re-trace.


class Decline(NamedTuple):
    """A rule's answer when it cannot narrow: the equation runs whole and the wanted
    boxes are sliced from its outputs (a fallback, with `reason`, if only part is used).

    A `BoxRule`'s `pull` returns one for a box it cannot compute on its own.

    Attributes:
      reason: why the rule cannot narrow, shown in `Stats.fallback_reasons` and the
        `TransformInfo` report.
    """

    reason: str


@dataclasses.dataclass(frozen=True)
class Narrowed:
    """Each wanted box of an output computed by `apply` from the input boxes it pulls.

    Attributes:
      pulled: `(output index, box)` -> the `(input var, box)` pairs that box needs.
      apply: `apply(ctx, eqn, i, box)` -> the value of box `box` of output `i`.
    """

    pulled: dict  # (output index, box) -> [(input var, box)]
    apply: Callable  # (ctx, eqn, i, box) -> the value of box `box` of output `i`

    def inputs(self, eqn) -> list:
        """The input boxes the plan reads.

        Args:
          eqn: the equation planned.

        Returns:
          Every `(input var, box)` pair of `pulled`.
        """
        return [need for needs in self.pulled.values() for need in needs]

    def emit(self, ctx, eqn, stats):
        """Compute each box of `pulled` with `apply` and store it in `ctx`.

        Args:
          ctx: the re-trace's values: `ctx.get(var, box)` reads, `ctx.put(var, box,
            value)` stores.
          eqn: the equation planned.
          stats: the pass's `Stats`.
        """
        for i, box in self.pulled:
            ctx.put(eqn.outvars[i], box, self.apply(ctx, eqn, i, box))


def _rebind_whole(ctx, eqn, stats):
    return bind(eqn, [ctx.get(v, None) for v in eqn.invars])


@dataclasses.dataclass(frozen=True)
class Whole:
    """The equation runs on whole inputs (`run`, by default re-bound as it is); the wanted
    boxes are sliced from its outputs. `reason` says why no rule narrowed it.

    Attributes:
      wanted: the `(output index, box)` pairs wanted of the equation.
      run: `run(ctx, eqn, stats)` -> the equation's outputs (a list for a primitive
        with multiple results), computed from whole inputs; by default the
        equation re-bound on them.
      reason: why no rule narrowed the equation; a plan with a reason on an equation
        of which only part is used counts as a fallback. None: not a fallback (the
        outputs are needed whole anyway).
    """

    wanted: tuple  # ((output index, box), ...)
    run: Callable = _rebind_whole  # (ctx, eqn, stats) -> outputs
    reason: str | None = None

    def inputs(self, eqn) -> list:
        """The input boxes the plan reads.

        Args:
          eqn: the equation planned.

        Returns:
          The whole box of every variable input of `eqn`.
        """
        return _whole_inputs(eqn)

    def emit(self, ctx, eqn, stats):
        """Run the equation with `run`, store its whole outputs and slice the wanted boxes.

        Args:
          ctx: the re-trace's values (`ctx.get(var, box)`, `ctx.put(var, box, value)`).
          eqn: the equation planned.
          stats: the pass's `Stats`, passed to `run`.
        """
        outs = self.run(ctx, eqn, stats)
        outs = outs if eqn.primitive.multiple_results else [outs]
        for v, o in zip(eqn.outvars, outs):
            if is_var(v):
                ctx.put(v, full_box(var_shape(v)), o)
        for i, box in self.wanted:  # slice right away, so the whole value can die early
            ctx.get(eqn.outvars[i], box)


@dataclasses.dataclass(frozen=True)
class Alias:
    """The equation's only output is `source` itself (a concatenation of all its slices).

    Attributes:
      source: the variable the output equals, of the same shape.
    """

    source: Any

    def inputs(self, eqn) -> list:
        """The input boxes the plan reads.

        Args:
          eqn: the equation planned.

        Returns:
          The whole box of `source`.
        """
        return [(self.source, full_box(var_shape(self.source)))]

    def emit(self, ctx, eqn, stats):
        """Store the value of `source` as the equation's output.

        Args:
          ctx: the re-trace's values (`ctx.get(var, box)`, `ctx.put(var, box, value)`).
          eqn: the equation planned.
          stats: the pass's `Stats` (unused).
        """
        ctx.put(eqn.outvars[0], full_box(var_shape(eqn.outvars[0])), ctx.get(self.source))


Plan = Union[Narrowed, Whole, Alias, "BodyRewrite"]
"""What a rule returns when it does not decline: each plan has `inputs(eqn)` (the input
boxes it reads) and `emit(ctx, eqn, stats)` (computes the wanted output boxes)."""


# --------------------------------------------------------------------------- rule table


class Analysis(NamedTuple):
    """What rules may consult besides the equation: its jaxpr's producers, the stats.

    Attributes:
      producers: each variable of the jaxpr being rewritten -> the equation defining
        it (inputs and constants have none).
      stats: the pass's `Stats`.
    """

    producers: dict  # var -> the equation defining it
    stats: Stats


Rule = Callable[[jex.JaxprEqn, tuple, Analysis], Union[Plan, Decline]]
"""`rule(eqn, wanted, analysis)` -> a `Plan` or a `Decline`; `wanted` is a tuple of the
`(output index, box)` pairs the equation's consumers need."""


def compute_whole(eqn, wanted, analysis) -> Whole:
    """The default rule: compute the outputs whole, then slice the wanted boxes.

    Args:
      eqn: the equation.
      wanted: the `(output index, box)` pairs wanted of it.
      analysis: the `Analysis` (unused).

    Returns:
      `Whole(wanted)` with the reason "no push-down rule".
    """
    return Whole(wanted, reason="no push-down rule")


def _merged(wanted):
    """The wanted boxes, with those of an output that together hold at least as many
    elements as their bounding box replaced by that box (computed once, each wanted box
    sliced from it)."""
    by_output: dict[int, list] = collections.defaultdict(list)
    for i, box in wanted:
        by_output[i].append(box)
    out = []
    for i, boxes in by_output.items():
        hull = tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes))
                     for d in range(len(boxes[0])))
        if len(boxes) > 1 and sum(math.prod(box_shape(b)) for b in boxes) >= \
                math.prod(box_shape(hull)):
            out.append((i, hull))
        else:
            out += [(i, b) for b in boxes]
    return out


@dataclasses.dataclass(frozen=True)
class BoxRule:
    """A rule from per-box pieces: `pull(eqn, i, box)` -> [(var, box)] | Decline,
    `apply(ctx, eqn, i, box)` -> value. A `slicing` rule also runs for the whole output
    (slice-like primitives need only part of their input). `widen(eqn, i, box)` gives a
    larger box `pull` takes, for a box it declines; `box` is then sliced from it (a conv
    narrows channels, not spatial dims). Boxes of one output that together hold at least
    as many elements as their bounding box are computed once as that box (see `_merged`),
    unless the rule cannot pull it.

    `register` builds one per primitive; a `BoxRule` is itself a `Rule`.

    Attributes:
      pull: `pull(eqn, i, box)` -> the `(input var, box)` pairs that box `box` of
        output `i` needs (literal inputs are not listed), or `Decline(reason)`.
        Returning None raises `TypeError`.
      apply: `apply(ctx, eqn, i, box)` -> the value of box `box` of output `i`,
        computed from the pulled boxes, which `ctx.get(var, box)` returns
        (`ctx.get(literal)` gives a literal's value).
      slicing: True for a slice-like primitive: the rule runs even when an output
        is wanted whole, and the wanted boxes are not merged. False (the default):
        an output wanted whole is computed by re-binding the equation.
      widen: `widen(eqn, i, box)` -> a larger box that `pull` takes, tried when
        `pull` declines `box`; a widened box that is the whole output is not used
        (the decline stands). None (the default): no widening.
    """

    pull: Callable
    apply: Callable
    slicing: bool = False
    widen: Callable | None = None

    def __call__(self, eqn, wanted, analysis) -> Narrowed | Whole | Decline:
        """The plan for `eqn`.

        Args:
          eqn: the equation.
          wanted: the `(output index, box)` pairs wanted of it.
          analysis: the `Analysis` (unused by box rules).

        Returns:
          `Decline` when the equation has effects or `pull` declines a box; `Whole`
            (not a fallback) when a non-slicing rule has an output wanted whole, or
            merging the wanted boxes of an output gives all of it; else `Narrowed`.

        Raises:
          TypeError: `pull` returned None.
        """
        if eqn.effects:
            return Decline("the equation has effects")
        if not self.slicing and any(box == full_box(var_shape(eqn.outvars[i])) for i, box in wanted):
            return Whole(wanted)  # needed whole anyway: narrowing saves nothing
        merged = wanted
        if not self.slicing:
            # e.g. the 9 shifted windows of a padded image: computed box by box they
            # would redo most elements several times, each box an op of its own
            merged = _merged(wanted)
            if any(box == full_box(var_shape(eqn.outvars[i])) for i, box in merged):
                return Whole(wanted)
        pulled = self._pull_all(eqn, merged)
        if isinstance(pulled, Decline) and merged != wanted:
            # a bounding box the operand cannot give (a reshape's box across rows): the
            # boxes one by one, as wanted
            pulled = self._pull_all(eqn, wanted)
        if isinstance(pulled, Decline):
            return pulled
        return Narrowed(pulled, self.apply)

    def _pull_all(self, eqn, wanted) -> dict | Decline:
        pulled = {}
        for i, box in wanted:
            needs = self._pull(eqn, i, box)
            if isinstance(needs, Decline) and self.widen is not None:
                wide = self.widen(eqn, i, box)
                if wide != full_box(var_shape(eqn.outvars[i])):
                    box, needs = wide, self._pull(eqn, i, wide)  # `box` is sliced from it
            if isinstance(needs, Decline):
                return needs
            pulled[(i, box)] = needs
        return pulled

    def _pull(self, eqn, i, box):
        needs = self.pull(eqn, i, box)
        if needs is None:
            raise TypeError(f"the push-down rule of '{eqn.primitive}' returned None for box {box}; "
                            "a rule that cannot narrow returns Decline(reason)")
        return needs


RULES: dict[jex.Primitive, Rule] = {}
"""The push-down rule table: a `jax.extend.core.Primitive` -> its `Rule`. `register`
adds a `BoxRule`; `RULES[p] = rule` adds any other rule. A primitive without an entry
takes `compute_whole`."""


def register(primitives: jex.Primitive | Sequence[jex.Primitive], pull: Callable, apply: Callable,
             slicing: bool = False, widen: Callable | None = None):
    """Register a per-box push-down rule (a `BoxRule`) for primitives, e.g.
    `register(jax.lax.tanh_p, pull, apply)`; `RULES[p] = rule` registers any other rule.

    A rule already in `RULES` for one of the primitives is replaced.

    Args:
      primitives: a `jax.extend.core.Primitive`, or a sequence of them.
      pull: `pull(eqn, i, box)` -> the `(input var, box)` pairs that box `box` of
        output `i` needs, or `Decline(reason)` (see `BoxRule`).
      apply: `apply(ctx, eqn, i, box)` -> the value of that box, from the pulled
        boxes (`ctx.get(var, box)`).
      slicing: True for a slice-like primitive, whose rule also runs when an output
        is wanted whole (default False).
      widen: `widen(eqn, i, box)` -> a larger box `pull` takes when it declines `box`
        (default None: no widening).

    Raises:
      TypeError: an element of `primitives` is not a `Primitive` (a name string, for
        example).
    """
    for p in [primitives] if isinstance(primitives, jex.Primitive) else primitives:
        if not isinstance(p, jex.Primitive):
            raise TypeError(f"register takes jax Primitive objects (e.g. jax.lax.tanh_p), got {p!r}; "
                            "rules are keyed by primitive, not by name")
        RULES[p] = BoxRule(pull, apply, slicing, widen)


def _rebind_on_pulled(pull):
    """An apply rule for one-operand ops: the op re-bound on its pulled operand box."""
    def apply(ctx, eqn, i, box):
        (v, b), = pull(eqn, i, box)
        return bind(eqn, [ctx.get(v, b)])
    return apply


def _pulled_itself(pull):
    """An apply rule for slicing ops: the pulled operand box is the result."""
    def apply(ctx, eqn, i, box):
        (v, b), = pull(eqn, i, box)
        return ctx.get(v, b)
    return apply


# -- elementwise ---------------------------------------------------------------

ELEMENTWISE = tuple(getattr(P, f"{name}_p") for name in (
    "neg sign floor ceil round is_finite exp exp2 log log1p expm1 tanh logistic sin cos tan "
    "asin acos atan sinh cosh asinh acosh atanh sqrt rsqrt cbrt abs erf erfc erf_inv lgamma "
    "digamma square integer_pow convert_element_type reduce_precision copy real imag conj not "
    "add sub mul div rem pow max min atan2 nextafter and or xor eq ne lt le gt ge add_jaxvals "
    "select_n clamp stop_gradient").split())
"""The elementwise primitives, which share one `BoxRule`: a box of the output needs the
same box of each operand (a scalar operand whole, a size-1 broadcast dimension whole)."""


def _elementwise_operand_box(v, out_shape, box):
    """The box of operand `v` that box `box` of an elementwise output needs, or None.

    An operand is a scalar, has the output's shape, or has size 1 where it broadcasts
    (lax binary ops take rank-preserving size-1 operands, e.g. `w / w.std(0, keepdims=True)`):
    such a dim keeps its whole (0, 1) box, the others take the output's.
    """
    shape = var_shape(v)
    if shape == ():
        return ()
    if len(shape) != len(out_shape) or any(n not in (1, m) for n, m in zip(shape, out_shape)):
        return None
    return tuple(b if n == m else (0, 1) for b, n, m in zip(box, shape, out_shape))


def _elementwise_pull(eqn, i, box):
    out_shape = var_shape(eqn.outvars[0])
    needs = []
    for v in eqn.invars:
        if not is_var(v):
            continue
        b = _elementwise_operand_box(v, out_shape, box)
        if b is None:
            return Decline(f"operand of shape {var_shape(v)} does not broadcast to {out_shape}")
        needs.append((v, b))
    return needs


def _elementwise_apply(ctx, eqn, i, box):
    out_shape = var_shape(eqn.outvars[0])
    return bind(eqn, [ctx.get(v, _elementwise_operand_box(v, out_shape, box)) if is_var(v)
                       else ctx.get(v) for v in eqn.invars])


for _p in ELEMENTWISE:
    RULES[_p] = BoxRule(_elementwise_pull, _elementwise_apply)


# -- layout ----------------------------------------------------------------------


def _transpose_pull(eqn, i, box):
    perm = eqn.params["permutation"]
    opbox = [None] * len(perm)
    for d, p in enumerate(perm):
        opbox[p] = box[d]
    return [(eqn.invars[0], tuple(opbox))]


RULES[P.transpose_p] = BoxRule(_transpose_pull, _rebind_on_pulled(_transpose_pull))


def _squeeze_pull(eqn, i, box):
    dims = set(d % len(var_shape(eqn.invars[0])) for d in eqn.params["dimensions"])
    it = iter(box)
    opbox = tuple((0, 1) if d in dims else next(it) for d in range(len(var_shape(eqn.invars[0]))))
    return [(eqn.invars[0], opbox)]


RULES[P.squeeze_p] = BoxRule(_squeeze_pull, _rebind_on_pulled(_squeeze_pull))


def _rev_pull(eqn, i, box):
    dims = set(eqn.params["dimensions"])
    return [(eqn.invars[0], tuple((n - e, n - s) if d in dims else (s, e)
                                  for d, ((s, e), n) in enumerate(zip(box, var_shape(eqn.invars[0])))))]


RULES[P.rev_p] = BoxRule(_rev_pull, _rebind_on_pulled(_rev_pull))


def _reshape_groups(in_shape, out_shape):
    """Pairs of (in dims, out dims) ranges with equal products: how a row-major reshape
    regroups dimensions."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) and j < len(out_shape):
        i0, j0 = i, j
        pi, po = in_shape[i], out_shape[j]
        while pi != po:
            if pi < po:
                i += 1
                pi *= in_shape[i]
            else:
                j += 1
                po *= out_shape[j]
        i, j = i + 1, j + 1
        groups.append([range(i0, i), range(j0, j)])
    if groups:  # trailing size-1 dims join the last group
        groups[-1][0] = range(groups[-1][0].start, len(in_shape))
        groups[-1][1] = range(groups[-1][1].start, len(out_shape))
    return groups


def _box_to_flat(box, dims):
    """The flat [a, b) range a box covers, if it is contiguous in row-major order."""
    partial = [k for k, ((s, e), n) in enumerate(zip(box, dims)) if (s, e) != (0, n)]
    if not partial:
        return 0, math.prod(dims)
    k = partial[0]
    if any(box[m][1] - box[m][0] != 1 for m in partial[1:]) or any(
            box[m] != (0, dims[m]) for m in range(k + 1, len(dims))):
        return None
    if any(box[m][1] - box[m][0] != 1 for m in range(k)):
        return None
    stride = math.prod(dims[k + 1:])
    base = sum(box[m][0] * math.prod(dims[m + 1:]) for m in range(k))
    return base + box[k][0] * stride, base + box[k][1] * stride


def _flat_to_box(a, b, dims):
    """A box covering exactly the flat range [a, b) of row-major `dims`, if there is one."""
    for k in range(len(dims)):
        stride = math.prod(dims[k + 1:])
        if a % stride or b % stride:
            continue
        q0, q1 = a // stride, b // stride
        if q0 // dims[k] != (q1 - 1) // dims[k]:
            continue
        box, rest = [], q0 // dims[k]
        for m in range(k - 1, -1, -1):
            box.insert(0, (rest % dims[m], rest % dims[m] + 1))
            rest //= dims[m]
        box.append((q0 % dims[k], q0 % dims[k] + (q1 - q0)))
        box += [(0, n) for n in dims[k + 1:]]
        return tuple(box)
    return None


def _reshape_pull(eqn, i, box):
    if eqn.params.get("dimensions") is not None:
        return Decline("a reshape with `dimensions` transposes first")
    in_shape, out_shape = var_shape(eqn.invars[0]), var_shape(eqn.outvars[0])
    if 0 in in_shape:
        return Decline("a reshape of an empty array")
    opbox = []
    for ins, outs in _reshape_groups(in_shape, out_shape):
        flat = _box_to_flat([box[d] for d in outs], [out_shape[d] for d in outs])
        sub = None if flat is None else _flat_to_box(*flat, [in_shape[d] for d in ins])
        if sub is None:
            return Decline(f"box {box} is not one box of the reshape's operand")
        opbox += list(sub)
    return [(eqn.invars[0], tuple(opbox))]


def _reshape_apply(ctx, eqn, i, box):
    (v, b), = _reshape_pull(eqn, i, box)
    return bind(eqn, [ctx.get(v, b)], new_sizes=box_shape(box))


def _reshape_widen(eqn, i, box):
    """The box with each dimension group it cuts into a non-box of the operand made whole
    (e.g. a spatial window of `[N*H*W, C] -> [N, H, W, C]` takes all of N, H, W and keeps
    the channels narrowed)."""
    in_shape, out_shape = var_shape(eqn.invars[0]), var_shape(eqn.outvars[0])
    wide = list(box)
    for ins, outs in _reshape_groups(in_shape, out_shape):
        flat = _box_to_flat([box[d] for d in outs], [out_shape[d] for d in outs])
        if flat is None or _flat_to_box(*flat, [in_shape[d] for d in ins]) is None:
            for d in outs:
                wide[d] = (0, out_shape[d])
    return tuple(wide)


RULES[P.reshape_p] = BoxRule(_reshape_pull, _reshape_apply, widen=_reshape_widen)


def _broadcast_pull(eqn, i, box):
    v = eqn.invars[0]
    if not is_var(v):
        return []
    out_shape = var_shape(eqn.outvars[0])
    opbox = []
    for j, od in enumerate(eqn.params["broadcast_dimensions"]):
        n = var_shape(v)[j]
        opbox.append((0, 1) if n == 1 and out_shape[od] != 1 else box[od])
    return [(v, tuple(opbox))] + [(w, full_box(var_shape(w))) for w in eqn.invars[1:] if is_var(w)]


def _broadcast_apply(ctx, eqn, i, box):
    needs = _broadcast_pull(eqn, i, box)
    v = eqn.invars[0]
    x = ctx.get(v, needs[0][1]) if needs else v.val
    return bind(eqn, [x] + [ctx.get(w, None) for w in eqn.invars[1:]], shape=box_shape(box))


RULES[P.broadcast_in_dim_p] = BoxRule(_broadcast_pull, _broadcast_apply)


def _reduce_pull(eqn, i, box):
    v = eqn.invars[0]
    axes = set(eqn.params["axes"])
    it = iter(box)
    opbox = tuple((0, n) if d in axes else next(it) for d, n in enumerate(var_shape(v)))
    return [(v, opbox)]


for _p in (P.reduce_sum_p, P.reduce_max_p, P.reduce_min_p, P.reduce_prod_p, P.argmax_p, P.argmin_p):
    RULES[_p] = BoxRule(_reduce_pull, _rebind_on_pulled(_reduce_pull))


def _reduce_window_pull(eqn, i, box):
    """Dims whose window is the identity (size 1, stride 1, no padding or dilation) pass
    their box straight through (e.g. channels under an average pool); others stay whole."""
    p, x = eqn.params, eqn.invars[0]
    out_shape = var_shape(eqn.outvars[0])
    opbox = []
    for d, (b, n) in enumerate(zip(box, var_shape(x))):
        identity = (p["window_dimensions"][d], p["window_strides"][d], tuple(p["padding"][d]),
                    p["base_dilation"][d], p["window_dilation"][d]) == (1, 1, (0, 0), 1, 1)
        if identity:
            opbox.append(b)
        elif b == (0, out_shape[d]):
            opbox.append((0, n))
        else:
            return Decline(f"dim {d} is narrowed and has a window")
    return [(x, tuple(opbox))]


RULES[P.reduce_window_sum_p] = BoxRule(_reduce_window_pull, _rebind_on_pulled(_reduce_window_pull))


# -- slicing (these also run for the whole output: they need only part of their input)


def _slice_pull(eqn, i, box):
    """Output element j of a dim is operand element start + j * stride: a box (s, e)
    needs operand elements start + s * stride ... start + (e - 1) * stride.

    A strided dim the box spans whole takes all of the operand's dim instead: that saves
    at most stride - 1 elements, while a partial box there would stop rules above that
    need the dim whole (a conv's spatial dims) and would split one producer into
    overlapping boxes (`x[0::2]` and `x[1::2]` of the same `x`).

    An empty box needs an empty operand box; `start + s * stride` can lie past the
    operand's end there (`associative_scan` takes `x[2::2]` of a length-2 axis), so it is
    clamped to the operand.
    """
    starts, out_shape, in_shape = eqn.params["start_indices"], var_shape(eqn.outvars[0]), var_shape(eqn.invars[0])
    strides = eqn.params["strides"] or (1,) * len(box)
    opbox = []
    for a, k, (s, e), m, n in zip(starts, strides, box, out_shape, in_shape):
        lo = a + s * k
        if k != 1 and (s, e) == (0, m):
            opbox.append((0, n))
        elif e > s:
            opbox.append((lo, lo + (e - s - 1) * k + 1))
        else:
            opbox.append((min(lo, n), min(lo, n)))
    return [(eqn.invars[0], tuple(opbox))]


def _slice_apply(ctx, eqn, i, box):
    (v, b), = _slice_pull(eqn, i, box)
    x = ctx.get(v, b)
    starts = eqn.params["start_indices"]
    strides = eqn.params["strides"]
    if strides is None or all(k == 1 for k in strides):
        return x
    rel = [a + s * k - lo if e > s else 0 for a, k, (s, e), (lo, _) in zip(starts, strides, box, b)]
    return lax.slice(x, rel, [r + (e - s - 1) * k + 1 if e > s else r
                              for r, k, (s, e) in zip(rel, strides, box)], strides)


RULES[P.slice_p] = BoxRule(_slice_pull, _slice_apply, slicing=True)


def _split_pull(eqn, i, box):
    axis = eqn.params["axis"]
    off = sum(eqn.params["sizes"][:i])
    opbox = list(box)
    opbox[axis] = (box[axis][0] + off, box[axis][1] + off)
    return [(eqn.invars[0], tuple(opbox))]


RULES[lax.split_p] = BoxRule(_split_pull, _pulled_itself(_split_pull), slicing=True)


def _unstack_pull(eqn, i, box):
    axis = eqn.params["axis"]
    opbox = list(box)
    opbox.insert(axis, (i, i + 1))
    return [(eqn.invars[0], tuple(opbox))]


def _unstack_apply(ctx, eqn, i, box):
    (v, b), = _unstack_pull(eqn, i, box)
    return lax.squeeze(ctx.get(v, b), (eqn.params["axis"],))


RULES[lax.unstack_p] = BoxRule(_unstack_pull, _unstack_apply, slicing=True)


def _stack_pull(eqn, i, box):
    axis = eqn.params["axis"]
    s, e = box[axis]
    inner = box[:axis] + box[axis + 1:]
    return [(v, inner) for v in eqn.invars[s:e] if is_var(v)]


def _stack_apply(ctx, eqn, i, box):
    axis = eqn.params["axis"]
    s, e = box[axis]
    inner = box[:axis] + box[axis + 1:]
    parts = [ctx.get(v, inner) for v in eqn.invars[s:e]]
    return lax.concatenate([lax.expand_dims(p, (axis,)) for p in parts], axis) \
        if len(parts) > 1 else lax.expand_dims(parts[0], (axis,))


RULES[lax.stack_p] = BoxRule(_stack_pull, _stack_apply)


def _concat_pieces(eqn, box):
    dim = eqn.params["dimension"]
    s, e = box[dim]
    pieces, off = [], 0
    for v in eqn.invars:
        n = var_shape(v)[dim]
        lo, hi = max(s, off), min(e, off + n)
        if lo < hi:
            b = list(box)
            b[dim] = (lo - off, hi - off)
            pieces.append((v, tuple(b)))
        off += n
    return pieces


def _concat_pull(eqn, i, box):
    return [(v, b) for v, b in _concat_pieces(eqn, box) if is_var(v)]


def _concat_apply(ctx, eqn, i, box):
    parts = [ctx.get(v, b) for v, b in _concat_pieces(eqn, box)]
    return parts[0] if len(parts) == 1 else lax.concatenate(parts, eqn.params["dimension"])


def _folded_concat(eqn, producers):
    """`x` if this is `concatenate(x[a:b], x[b:c], ...)` covering all of `x`, else None."""
    dim = eqn.params["dimension"]
    src, pos = None, 0
    for v in eqn.invars:
        e = producers.get(v) if is_var(v) else None
        if e is None or e.primitive is not P.slice_p or any(s != 1 for s in e.params["strides"] or ()):
            return None
        x = e.invars[0]
        if not is_var(x) or (src is not None and x is not src) or var_shape(x) != var_shape(eqn.outvars[0]):
            return None
        src = x
        starts, limits = e.params["start_indices"], e.params["limit_indices"]
        for d, (s, l, n) in enumerate(zip(starts, limits, var_shape(x))):
            if d == dim:
                if s != pos:
                    return None
                pos = l
            elif (s, l) != (0, n):
                return None
    return src if src is not None and pos == var_shape(src)[dim] else None


_concat_narrowed = BoxRule(_concat_pull, _concat_apply)


def _concat_rule(eqn, wanted, analysis):
    """`concatenate(x[a:b], x[b:c], ...)` covering all of `x` is `x`; others narrow."""
    src = _folded_concat(eqn, analysis.producers)
    return Alias(src) if src is not None else _concat_narrowed(eqn, wanted, analysis)


RULES[P.concatenate_p] = _concat_rule


def _pad_ranges(eqn, box):
    """Per dim, the operand range [j0, j1) a box of the pad's output reads and that box's
    (low, high, interior) padding around it; None when the box holds padding only.

    Operand element j sits at output lo + j * (interior + 1) (lo may be negative: a crop).
    """
    ranges = []
    for (s, e), (lo, _, interior), n in zip(box, eqn.params["padding_config"], var_shape(eqn.invars[0])):
        r = interior + 1
        j0 = max(-((lo - s) // r), 0)  # the first j with lo + j * r >= s
        j1 = min((e - 1 - lo) // r + 1, n)  # one past the last j with lo + j * r < e
        if j0 >= j1:
            return None
        new_lo = lo + j0 * r - s
        ranges.append(((j0, j1), (new_lo, (e - 1) - (lo + (j1 - 1) * r), interior)))
    return ranges


def _pad_pull(eqn, i, box):
    x, pv = eqn.invars
    needs = [(pv, ())] if is_var(pv) else []
    ranges = _pad_ranges(eqn, box)
    if ranges is not None and is_var(x):
        needs.insert(0, (x, tuple(r for r, _ in ranges)))
    return needs


def _pad_apply(ctx, eqn, i, box):
    x, pv = eqn.invars
    pad_value = ctx.get(pv, ())
    ranges = _pad_ranges(eqn, box)
    if ranges is None:
        return lax.broadcast_in_dim(pad_value, box_shape(box), ())
    return lax.pad(ctx.get(x, tuple(r for r, _ in ranges)), pad_value, [c for _, c in ranges])


RULES[P.pad_p] = BoxRule(_pad_pull, _pad_apply)


def _dynamic_slice_pull(eqn, i, box):
    x, *idx = eqn.invars
    sizes = eqn.params["slice_sizes"]
    opbox = []
    for (s, e), size, n in zip(box, sizes, var_shape(x)):
        if (s, e) != (0, size):
            if size != n:  # only dims the slice spans whole can be narrowed
                return Decline(f"dim {len(opbox)} is narrowed and not taken whole by the slice")
        opbox.append((s, e) if size == n else (0, n))
    return [(x, tuple(opbox))] + [(v, ()) for v in idx if is_var(v)]


def _dynamic_slice_apply(ctx, eqn, i, box):
    x, *idx = eqn.invars
    sizes = eqn.params["slice_sizes"]
    (_, opbox), *_ = _dynamic_slice_pull(eqn, i, box)
    new_sizes = tuple(e - s if size == n else size
                      for (s, e), size, n in zip(box, sizes, var_shape(x)))
    return bind(eqn, [ctx.get(x, opbox)] + [ctx.get(v, ()) for v in idx], slice_sizes=new_sizes)


RULES[P.dynamic_slice_p] = BoxRule(_dynamic_slice_pull, _dynamic_slice_apply)


def _dus_pull(eqn, i, box):
    x, upd, *idx = eqn.invars
    for (s, e), n, u in zip(box, var_shape(x), var_shape(upd)):
        if (s, e) != (0, n) and u != n:
            return Decline("a narrowed dim is not spanned whole by the update")
    needs = [(x, box)] if is_var(x) else []
    needs += [(upd, _dus_update_box(eqn, box))] if is_var(upd) else []
    return needs + [(v, ()) for v in idx if is_var(v)]


def _dus_update_box(eqn, box):
    """The update's box: narrowed only where the update spans the whole axis."""
    x, upd = eqn.invars[:2]
    return tuple(b if u == n else (0, u) for b, n, u in zip(box, var_shape(x), var_shape(upd)))


def _dus_apply(ctx, eqn, i, box):
    x, upd, *idx = eqn.invars
    return bind(eqn, [ctx.get(x, box), ctx.get(upd, _dus_update_box(eqn, box))]
                 + [ctx.get(v, ()) for v in idx])


RULES[P.dynamic_update_slice_p] = BoxRule(_dus_pull, _dus_apply)


def _scatter_boxes(eqn, box):
    """(operand box, updates box) for a box of a scatter's output, or None.

    A dim of the operand that no index addresses and whose update window spans it whole
    (the columns of an embedding table under the gradient of a lookup) is elementwise
    between operand, updates and output: its box passes to both. Others stay whole.
    """
    operand, _, updates = eqn.invars
    dn = eqn.params["dimension_numbers"]
    oshape, ushape = var_shape(operand), var_shape(updates)
    window = [d for d in range(len(oshape))
              if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    ubox = list(full_box(ushape))
    for d, (b, n) in enumerate(zip(box, oshape)):
        if b == (0, n):
            continue
        if d not in window or d in dn.scatter_dims_to_operand_dims:
            return None
        ud = dn.update_window_dims[window.index(d)]
        if ushape[ud] != n:
            return None
        ubox[ud] = b
    return tuple(box), tuple(ubox)


def _scatter_pull(eqn, i, box):
    boxes = _scatter_boxes(eqn, box)
    if boxes is None:
        return Decline("a narrowed dim is indexed, or not spanned whole by the update window")
    if not is_var(eqn.invars[0]):
        return Decline("the operand is a literal")
    operand, indices, updates = eqn.invars
    needs = [(operand, boxes[0])] + ([(indices, full_box(var_shape(indices)))] if is_var(indices) else [])
    return needs + ([(updates, boxes[1])] if is_var(updates) else [])


def _scatter_apply(ctx, eqn, i, box):
    obox, ubox = _scatter_boxes(eqn, box)
    operand, indices, updates = eqn.invars
    return bind(eqn, [ctx.get(operand, obox), ctx.get(indices),
                       ctx.get(updates, ubox) if is_var(updates) else ctx.get(updates)])


RULES[P.scatter_add_p] = BoxRule(_scatter_pull, _scatter_apply)


# -- contractions ----------------------------------------------------------------


def _dot_boxes(eqn, box):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    nb = len(lb)
    lfree = [d for d in range(len(var_shape(lhs))) if d not in lc and d not in lb]
    rfree = [d for d in range(len(var_shape(rhs))) if d not in rc and d not in rb]

    def operand_box(shape, contract, batch, free, offset):
        b = []
        for d, n in enumerate(shape):
            if d in contract:
                b.append((0, n))
            elif d in batch:
                b.append(box[list(batch).index(d)])
            else:
                b.append(box[offset + free.index(d)])
        return tuple(b)

    return (operand_box(var_shape(lhs), lc, lb, lfree, nb),
            operand_box(var_shape(rhs), rc, rb, rfree, nb + len(lfree)))


def _dot_pull(eqn, i, box):
    lb, rb = _dot_boxes(eqn, box)
    return [(v, b) for v, b in zip(eqn.invars, (lb, rb)) if is_var(v)]


def _dot_apply(ctx, eqn, i, box):
    lb, rb = _dot_boxes(eqn, box)
    return bind(eqn, [ctx.get(eqn.invars[0], lb), ctx.get(eqn.invars[1], rb)])


RULES[P.dot_general_p] = BoxRule(_dot_pull, _dot_apply)


def _conv_plan(eqn, box):
    """Operand boxes and group counts for a box of a conv output, or None."""
    lhs, rhs = eqn.invars
    dn = eqn.params["dimension_numbers"]
    lspec, rspec, ospec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    out_shape = var_shape(eqn.outvars[0])
    for d in ospec[2:]:
        if box[d] != (0, out_shape[d]):
            return None
    G, B = eqn.params["feature_group_count"], eqn.params["batch_group_count"]
    lbox, rbox = list(full_box(var_shape(lhs))), list(full_box(var_shape(rhs)))
    bs, be = box[ospec[0]]
    fs, fe = box[ospec[1]]
    O = out_shape[ospec[1]]
    if (bs, be) != (0, out_shape[ospec[0]]):
        if B != 1:
            return None
        lbox[lspec[0]] = (bs, be)
    if (fs, fe) != (0, O):
        groups = max(G, B)
        gsize = O // groups
        if groups > 1 and (fs % gsize or fe % gsize):
            return None  # only whole groups can be kept
        rbox[rspec[0]] = (fs, fe)
        g0, g1 = fs // gsize, fe // gsize
        if G > 1:
            cg = var_shape(lhs)[lspec[1]] // G
            lbox[lspec[1]] = (g0 * cg, g1 * cg)
            G = g1 - g0
        elif B > 1:
            ng = var_shape(lhs)[lspec[0]] // B
            lbox[lspec[0]] = (g0 * ng, g1 * ng)
            B = g1 - g0
    return tuple(lbox), tuple(rbox), G, B


def _conv_pull(eqn, i, box):
    plan = _conv_plan(eqn, box)
    if plan is None:
        return Decline("a spatial dim is narrowed, or the batch under batch groups, or part of a group")
    lbox, rbox, _, _ = plan
    return [(v, b) for v, b in zip(eqn.invars, (lbox, rbox)) if is_var(v)]


def _conv_apply(ctx, eqn, i, box):
    lbox, rbox, G, B = _conv_plan(eqn, box)
    return bind(eqn, [ctx.get(eqn.invars[0], lbox), ctx.get(eqn.invars[1], rbox)],
                 feature_group_count=G, batch_group_count=B)


def _conv_widen(eqn, i, box):
    """The box grown to what `_conv_plan` takes: spatial dims whole, the batch whole under
    batch groups, the features out to whole groups."""
    out_shape = var_shape(eqn.outvars[0])
    ospec = eqn.params["dimension_numbers"].out_spec
    G, B = eqn.params["feature_group_count"], eqn.params["batch_group_count"]
    wide = list(box)
    for d in ospec[2:]:
        wide[d] = (0, out_shape[d])
    if B != 1:
        wide[ospec[0]] = (0, out_shape[ospec[0]])
    if max(G, B) > 1:
        gsize = out_shape[ospec[1]] // max(G, B)
        fs, fe = box[ospec[1]]
        wide[ospec[1]] = (fs // gsize * gsize, -(-fe // gsize) * gsize)
    return tuple(wide)


RULES[P.conv_general_dilated_p] = BoxRule(_conv_pull, _conv_apply, widen=_conv_widen)


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


# --------------------------------------------------------------------------- calls
#
# A call rule plans a `BodyRewrite`: the body is rewritten to return, for each output
# of the call, the whole value if it is needed whole and then each needed box; the
# rewritten body is bound once, so a call never runs twice.


def _same_box(eqn, i, box):
    return box


@dataclasses.dataclass(frozen=True)
class BodyRewrite:
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

    def inputs(self, eqn) -> list:
        """The input boxes the plan reads.

        Args:
          eqn: the call equation.

        Returns:
          The whole box of every variable input of `eqn`.
        """
        return _whole_inputs(eqn)

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
