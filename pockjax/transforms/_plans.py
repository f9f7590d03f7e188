"""Plans: what a push-down rule decides for one equation.

A rule (see `_rules`) returns a plan, or a `Decline`. Each plan names the input boxes it
reads (`inputs(eqn)`) and emits the wanted boxes of the outputs during the pass's forward
re-trace (`emit(ctx, eqn, stats)`): `Narrowed` computes each box from the input boxes it
pulls, `Whole` runs the equation on whole inputs and slices, `Alias` forwards an input.
The call rules' `BodyRewrite` lives beside them in `_control_flow`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Union

from pockjax._src.jaxpr import bind, is_var, var_shape
from pockjax.transforms._boxes import full_box


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


class OnWholeInputs:
    """A plan that reads every variable input of its equation whole (`Whole`, `BodyRewrite`)."""

    def inputs(self, eqn) -> list:
        """The input boxes the plan reads.

        Args:
          eqn: the equation planned.

        Returns:
          The whole box of every variable input of `eqn`.
        """
        return [(w, full_box(var_shape(w))) for w in eqn.invars if is_var(w)]


def _rebind_whole(ctx, eqn, stats):
    return bind(eqn, [ctx.get(v, None) for v in eqn.invars])


@dataclasses.dataclass(frozen=True)
class Whole(OnWholeInputs):
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


Plan = Union[Narrowed, Whole, Alias, OnWholeInputs]
"""What a rule returns when it does not decline (the call rules' `BodyRewrite` is an
`OnWholeInputs`): each plan has `inputs(eqn)` (the input boxes it reads) and
`emit(ctx, eqn, stats)` (computes the wanted output boxes)."""
