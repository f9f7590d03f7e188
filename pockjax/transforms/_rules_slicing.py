"""Push-down rules of the slicing, joining and scattering primitives.

`slice`, `split` and `unstack` also run for the whole output (they need only part of
their input); `stack`, `concatenate` (which folds `concatenate(x[a:b], x[b:c], ...)`
back into `x`), `pad`, `dynamic_slice`, `dynamic_update_slice` and `scatter-add`
narrow as other box rules do. Registered into `RULES` (`_rules`) on import; `pushdown`
imports this module.
"""
from __future__ import annotations

from jax import lax
from jax.extend.core import primitives as P

from pockjax._src.jaxpr import bind, is_var, var_shape
from pockjax.transforms._boxes import box_shape, full_box
from pockjax.transforms._plans import Alias, Decline
from pockjax.transforms._rules import RULES, BoxRule


def _pulled_itself(pull):
    """An apply rule for slicing ops: the pulled operand box is the result."""
    def apply(ctx, eqn, i, box):
        (v, b), = pull(eqn, i, box)
        return ctx.get(v, b)
    return apply


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
