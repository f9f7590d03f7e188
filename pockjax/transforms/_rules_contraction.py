"""Push-down rules of the contractions: `dot_general` and `conv_general_dilated`.

A box of the output needs the matching boxes of both operands, contracted dimensions
whole; a conv narrows batch and feature channels (whole groups), not spatial dims.
Registered into `RULES` (`_rules`) on import; `pushdown` imports this module.
"""
from __future__ import annotations

from jax.extend.core import primitives as P

from pockjax._src.jaxpr import bind, is_var, var_shape
from pockjax.transforms._boxes import full_box
from pockjax.transforms._plans import Decline
from pockjax.transforms._rules import RULES, BoxRule


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
