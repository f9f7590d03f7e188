"""The push-down rule framework: the rule interface, the rule table and `BoxRule`.

`RULES` is the one table of the pass, keyed by primitive. The rule modules
(`_rules_elementwise`, `_rules_layout`, `_rules_slicing`, `_rules_contraction`,
`_control_flow`) register their rules into it right after defining them;
`pushdown` imports every one of them before the table is used. `Stats` counts what
the rules did; rules reach it through `Analysis`.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, NamedTuple, Sequence, Union

import jax.extend.core as jex

from pockjax._src.jaxpr import describe_source, var_shape
from pockjax.transforms._boxes import box_shape, full_box
from pockjax.transforms._plans import Decline, Narrowed, Plan, Whole


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
