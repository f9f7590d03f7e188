"""Push-down rules of the elementwise primitives.

One `BoxRule` serves them all: a box of the output needs the same box of each operand.
Registered into `RULES` (`_rules`) on import; `pushdown` imports this module.
"""
from __future__ import annotations

from jax.extend.core import primitives as P

from pockjax._src.jaxpr import bind, is_var, var_shape
from pockjax.transforms._plans import Decline
from pockjax.transforms._rules import RULES, BoxRule


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
