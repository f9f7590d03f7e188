"""Push-down rules of the layout and reduction primitives.

`transpose`, `squeeze`, `rev`, `reshape`, `broadcast_in_dim`, the reductions and
`reduce_window_sum`: each maps a box of its output to one box of its operand.
Registered into `RULES` (`_rules`) on import; `pushdown` imports this module.
"""
from __future__ import annotations

import math

from jax.extend.core import primitives as P

from pockjax._src.jaxpr import bind, is_var, var_shape
from pockjax.transforms._boxes import box_shape, full_box
from pockjax.transforms._plans import Decline
from pockjax.transforms._rules import RULES, BoxRule


def _rebind_on_pulled(pull):
    """An apply rule for one-operand ops: the op re-bound on its pulled operand box."""
    def apply(ctx, eqn, i, box):
        (v, b), = pull(eqn, i, box)
        return bind(eqn, [ctx.get(v, b)])
    return apply


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
