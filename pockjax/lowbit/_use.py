"""Stored weights dequantized where they are used: `at_use` runs a loss written for
float parameters on a tree holding `Quantized` nodes, interpreting its jaxpr; each weight
is dequantized right before the operation that reads it, tied to that operation's other
input by `one_after`. A matrix product goes through `_qdot` (a custom VJP that
dequantizes the weight again in the backward pass, in pieces of at most `PIECE_BYTES` of
float weight), a lookup of whole rows dequantizes those rows only, and `reads_stored`
marks a function that reads the nodes' arrays itself.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import primitives as P

from pockjax._src.jaxpr import bind, call_body, interpret
from pockjax.lowbit._blocks import Blocks
from pockjax.lowbit._formats import Cast, Int4, Int8, dequantize_stored
from pockjax.lowbit._store import Quantized, is_quantized


class _Lazy:
    """A quantized weight inside `at_use`'s interpreter, not yet dequantized: the node's
    arrays and the unary equations (transposes, reshapes, casts) to apply after
    dequantizing it."""

    def __init__(self, leaves, aux, ops=()):
        self.leaves, self.aux, self.ops = tuple(leaves), aux, tuple(ops)

    def node(self, leaves=None):
        return jax.tree_util.tree_unflatten(self.aux, list(self.leaves if leaves is None else leaves))

    def then(self, eqn) -> "_Lazy":
        return _Lazy(self.leaves, self.aux, self.ops + (eqn,))

    def value(self, leaves, tie):
        """The float weight, computed only once `tie` exists (times exactly 1 that
        depends on one element of `tie`), with the deferred equations applied."""
        w = _materialize(self.node(leaves), tie)
        for e in self.ops:
            w = bind(e, [w])
        return w


def one_after(tie: jax.Array, dtype) -> jax.Array:
    """Exactly 1 in `dtype`, computed from one element of `tie`, so that what it
    multiplies is computed only once `tie` exists.

    This is how a weight is dequantized at its use: XLA's CPU scheduler would convert
    every stored weight at the top of the step (a conversion of a parameter depends on
    nothing else), keeping all the float copies alive at once, and it drops
    `optimization_barrier`s before scheduling; a product with this 1 ties the
    conversion to the using operation's other input by data. The element is replaced
    by 0 where it is not finite, so an inf or NaN in `tie` does not spread.

    Args:
      tie: the array the result waits for (any shape, float).
      dtype: the result's dtype.

    Returns:
      A scalar 1 of `dtype`.
    """
    first = jax.lax.slice(tie, (0,) * tie.ndim, (1,) * tie.ndim).reshape(()).astype(dtype)
    return 1 + 0 * jnp.where(jnp.isfinite(first), first, 0)


def _materialize(node, tie):
    """`node` dequantized once `tie` exists: the tie multiplies the scales (small), so the
    float weight is one fusion of the stored arrays, computed again at each use."""
    if tie is not None and isinstance(node.fmt, Cast) and not node.words:
        return node.dequantize() * one_after(tie, node.dtype)  # upcast and tied in one fusion
    if tie is not None and isinstance(node.fmt, Cast):  # its words: no scales to tie
        node = node.replace(data=node.data * one_after(tie, node.data.dtype))
    elif tie is not None:
        one = one_after(tie, jnp.float32)
        node = node.replace(scale=(node.scale.astype(jnp.float32) * one).astype(node.scale.dtype))
    return node.dequantize()


def _dot(spec, other, w):
    side, dims, precision, preferred = spec
    args = (other, w) if side == 1 else (w, other)
    return jax.lax.dot_general(*args, dims, precision=precision, preferred_element_type=preferred)


# A stored weight whose float copy would be larger than this is multiplied in pieces
# along its output axis, each dequantized once the previous piece's product exists, so at
# most one piece's float copy is alive (an output head of a 32,000-token vocabulary is
# 0.5 GiB in float32 at LLaMA-2-7B's width).
PIECE_BYTES = 256 << 20


def _whole_2d(lazy, node) -> bool:
    """Whether `node` is read as it is stored (no transpose or reshape first), has rank 2,
    no trained channels and no 32-bit words: a weight a product can take in pieces and
    a lookup row by row."""
    return (not lazy.ops and node.channels is None and not node.words
            and len(node.shape) == 2)


def _pieces(spec, lazy, leaves, other_ndim: int):
    """`(free, position, bounds)` for a product whose stored 2-D weight dequantizes to
    more than `PIECE_BYTES`: the weight's axis that is not contracted, where that axis
    sits in the product's output, and each piece's `(start, stop)` on it; None for a
    product in one piece (a small weight, one reshaped or transposed first, one with
    trained channels or in 32-bit words)."""
    node = lazy.node(leaves)
    if not _whole_2d(lazy, node):
        return None
    side, ((lc, rc), (lb, rb)), _, _ = spec
    (w_c, w_b), (o_c, o_b) = ((rc, rb), (lc, lb)) if side == 1 else ((lc, lb), (rc, rb))
    if w_b or o_b or len(w_c) != 1:
        return None
    free = 1 - w_c[0]
    if isinstance(node.fmt, (Int4, Blocks)) and free == node.axis:  # packed along that axis
        return None
    size = int(np.prod(node.shape)) * jnp.dtype(node.dtype).itemsize
    n = node.shape[free]
    count = min(-(-size // PIECE_BYTES), n)
    if count < 2:
        return None
    step = -(-n // count)
    # dot_general's output: batch axes, the left operand's free axes, the right one's.
    position = other_ndim - len(o_c) if side == 1 else 0
    return free, position, [(a, min(a + step, n)) for a in range(0, n, step)]


def _piece(node, free: int, start: int, stop: int):
    """Columns (or rows) `start:stop` of `node` along its axis `free`: each stored array
    sliced where it spans that axis."""
    n = node.shape[free]

    def cut(a):
        if a is None or a.shape[free] != n:
            return a  # a scale shared along that axis
        return jax.lax.slice_in_dim(a, start, stop, axis=free)

    shape = list(node.shape)
    shape[free] = stop - start
    return node.replace(data=cut(node.data), scale=cut(node.scale), zero=cut(node.zero),
                        shape=shape)


def _dot_in_pieces(spec, node, other, pieces):
    free, position, bounds = pieces
    outs, tie = [], other
    for a, b in bounds:
        y = _dot(spec, other, _materialize(_piece(node, free, a, b), tie))
        outs.append(y)
        tie = y  # the next piece is dequantized once this product exists
    return jax.lax.concatenate(outs, position)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _qdot(spec, lazy, other, *leaves):
    pieces = _pieces(spec, lazy, leaves, np.ndim(other))
    if pieces is not None:
        return _dot_in_pieces(spec, lazy.node(leaves), other, pieces)
    return _dot(spec, other, lazy.value(leaves, other))


def _qdot_fwd(spec, lazy, other, *leaves):
    shape = jax.ShapeDtypeStruct(other.shape, other.dtype)
    # A weight with trained channels keeps the other operand for their gradient.
    kept = other if lazy.node(leaves).channels is not None else None
    return _qdot(spec, lazy, other, *leaves), (shape, leaves, kept)


def _qdot_bwd(spec, lazy, residuals, g):
    shape, leaves, other = residuals
    pieces = _pieces(spec, lazy, leaves, len(shape.shape))
    if pieces is None:
        w = lazy.value(leaves, g)  # dequantized again, once the output's gradient exists
        (d_other,) = jax.linear_transpose(lambda o: _dot(spec, o, w), shape)(g)
    else:  # piece by piece, each once the sum of the previous pieces' gradients exists
        free, position, bounds = pieces
        node, d_other = lazy.node(leaves), None
        for a, b in bounds:
            w = _materialize(_piece(node, free, a, b), g if d_other is None else d_other)
            g_piece = jax.lax.slice_in_dim(g, a, b, axis=position)
            (d,) = jax.linear_transpose(lambda o, w=w: _dot(spec, o, w), shape)(g_piece)
            d_other = d if d_other is None else d_other + d
    grads = [np.zeros(x.shape, jax.dtypes.float0) if not jnp.issubdtype(x.dtype, jnp.inexact)
             else jnp.zeros_like(x) for x in leaves]
    if other is not None:
        grads[-1] = _master_grad(spec, lazy, leaves, other, g)
    return (d_other, *grads)


def _master_grad(spec, lazy, leaves, other, g):
    """The gradient of a weight's trained channels (`Quantized.master`, its last leaf) in
    the product `_dot(spec, other, weight)` whose output's gradient is `g`: the product
    restricted to those channels, so the frozen channels' weight gradient is never
    computed."""
    node = lazy.node(leaves)
    axis, start, count = node.channels
    master = leaves[-1]
    avals = jax.ShapeDtypeStruct(master.shape, master.dtype)

    def cut(x, d):
        return jax.lax.slice_in_dim(x, start, start + count, axis=d)

    def transpose(o, cotangent):
        product = lambda m: _dot(spec, o, m.astype(node.dtype))  # noqa: E731
        return jax.linear_transpose(product, avals)(cotangent)[0]

    if lazy.ops:  # transposes or reshapes between the weight and the product
        def through(m):
            parts = list(leaves)
            parts[-1] = m
            return _dot(spec, other, lazy.value(parts, None))
        return jax.vjp(through, master)[1](g)[0]
    side, ((lc, rc), (lb, rb)), _, _ = spec
    w_c, o_c = (rc, lc) if side == 1 else (lc, rc)
    w_b, o_b = (rb, lb) if side == 1 else (lb, rb)
    if axis in w_c:  # an input axis: the other operand's matching slice
        return transpose(cut(other, o_c[list(w_c).index(axis)]), g)
    if axis in w_b:
        k = list(w_b).index(axis)
        return transpose(cut(other, o_b[k]), cut(g, k))
    free = [d for d in range(len(node.shape)) if d not in w_c and d not in w_b]
    other_free = np.ndim(other) - len(o_c) - len(o_b)
    position = len(w_b) + (other_free if side == 1 else 0) + free.index(axis)
    return transpose(other, cut(g, position))  # output channels: the output's slice


_qdot.defvjp(_qdot_fwd, _qdot_bwd)


def _stored_rows(node, rows):
    """Rows `rows` (an integer array, in range) of the stored 2-D weight `node`, as
    floats `[*rows.shape, columns]`: only those rows are dequantized."""
    take = lambda a, i: jnp.take(a, i, axis=0, mode="clip")  # noqa: E731
    fmt, n = node.fmt, node.shape[1]
    if isinstance(fmt, Cast):
        return take(node.data, rows).astype(node.dtype)
    if isinstance(fmt, Int8):
        scale = node.scale[0] if node.axis == 0 else take(node.scale, rows)
        return (take(node.data, rows).astype(jnp.float32) *
                scale.astype(jnp.float32)).astype(node.dtype)
    if isinstance(fmt, Blocks) and node.axis == 0:  # blocks across rows: decoded whole
        return take(dequantize_stored(node, node.dtype), rows)
    if node.axis == 1:  # packed along the row: the rows' own bytes and scales
        flat = rows.reshape(-1)
        piece = node.replace(data=take(node.data, flat), scale=take(node.scale, flat),
                             zero=None if node.zero is None else take(node.zero, flat),
                             shape=(flat.shape[0], n))
        return dequantize_stored(piece, node.dtype).reshape(rows.shape + (n,))
    # int4 packed along the rows: row r is one half of byte r // 2, group r // group.
    group = node.shape[0] // node.scale.shape[0]
    packed = jax.lax.bitcast_convert_type(take(node.data, rows // 2), jnp.uint8)
    codes = jnp.where((rows % 2 == 0)[..., None], packed & 15, packed >> 4)
    offset = 8.0 if node.zero is None else take(node.zero, rows // group).astype(jnp.float32)
    scale = take(node.scale, rows // group).astype(jnp.float32)
    return ((codes.astype(jnp.float32) - offset) * scale).astype(node.dtype)


def _gather_rows(e, lazy, indices):
    """A gather of whole rows from a stored 2-D weight (an embedding lookup) computed
    from the rows' stored values, not from the whole dequantized table; None for any
    other gather."""
    node = lazy.node()
    dn = e.params["dimension_numbers"]
    if (not _whole_2d(lazy, node) or tuple(dn.collapsed_slice_dims) != (0,)
            or tuple(dn.start_index_map) != (0,) or tuple(dn.offset_dims) != (np.ndim(indices) - 1,) or dn.operand_batching_dims
            or tuple(e.params["slice_sizes"]) != (1, node.shape[1])
            or np.shape(indices)[-1:] != (1,)):
        return None
    rows = indices[..., 0]
    n = node.shape[0]
    got = _stored_rows(node, jnp.clip(rows, 0, n - 1))
    if e.params["mode"] == jax.lax.GatherScatterMode.FILL_OR_DROP:
        fill = e.params.get("fill_value")
        fill = jnp.nan if fill is None else fill
        got = jnp.where(((rows >= 0) & (rows < n))[..., None], got,
                        jnp.asarray(fill, got.dtype))
    return got


def _float_operand(ins):
    return next((x for x in ins if not isinstance(x, _Lazy) and hasattr(x, "dtype")
                 and np.ndim(x) > 0), None)


def _override(e, ins, read):
    lazy = [x for x in ins if isinstance(x, _Lazy)]
    if not lazy:
        return None
    sub = call_body(e)
    if sub is not None:  # a nested jit: evaluated inline, quantized weights passed in
        return interpret(sub.jaxpr, sub.consts, ins, _override)
    if len(ins) == 1 and len(e.outvars) == 1 and not e.primitive.multiple_results:
        return [ins[0].then(e)]  # transpose, reshape, convert...: deferred to the use
    if e.primitive is P.gather_p and isinstance(ins[0], _Lazy) and len(lazy) == 1:
        got = _gather_rows(e, ins[0], ins[1])
        if got is not None:
            return [got]
    if e.primitive is P.dot_general_p and len(lazy) == 1 and len(ins) == 2:
        side = 1 if isinstance(ins[1], _Lazy) else 0
        other = ins[1 - side]
        spec = (side, e.params["dimension_numbers"], e.params.get("precision"),
                e.params.get("preferred_element_type"))
        return [_qdot(spec, ins[side], other, *ins[side].leaves)]
    tie = _float_operand(ins)
    values = [x.value(x.leaves, tie) if isinstance(x, _Lazy) else x for x in ins]
    outs = bind(e, values)
    return outs if e.primitive.multiple_results else [outs]


def reads_stored(fun: Callable) -> Callable:
    """`fun` marked as reading `Quantized` nodes' arrays itself, so that `at_use(fun)`
    (and the trainers, which apply it) is `fun`: for a function made from a step that
    was traced through `at_use` already, e.g. the part of a step after a prefix cache.

    Args:
      fun: a function of pytrees that may hold `Quantized` nodes.

    Returns:
      A function calling `fun`, with the mark.
    """
    @functools.wraps(fun)
    def marked(*args, **kwargs):
        return fun(*args, **kwargs)

    marked.reads_stored = True
    return marked


def at_use(fun: Callable) -> Callable:
    """`fun` (written for float parameters) as a function of trees holding `Quantized`
    nodes (and narrower float leaves, which it reads as they are stored).

    Each quantized weight is dequantized at each use, tied by data to the using
    operation's other input; in a matrix product (`dot_general`, after any transposes,
    reshapes or casts of the weight) the backward pass dequantizes it again rather than
    keeping the forward pass's float copy; a weight larger than `PIECE_BYTES` as float
    is multiplied in pieces along its output axis, one piece's float copy alive at a
    time. A lookup of whole rows (an embedding) dequantizes the rows it reads only.
    Inside loops (`scan`, `while`, `cond`) a quantized weight is dequantized whole
    before the loop. Quantized weights are frozen: their arrays' gradients are zero.

    Args:
      fun: a function of pytrees of arrays (one marked by `reads_stored` is returned as
        it is).

    Returns:
      A function of the same arguments in which any float array may be a `Quantized`
      node; it returns what `fun` returns on the dequantized values.
    """
    if getattr(fun, "reads_stored", False):
        return fun

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        flat, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_quantized)
        if not any(isinstance(x, Quantized) for x in flat):
            return fun(*args, **kwargs)
        proxies = [jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, Quantized) else x
                   for x in flat]
        dynamic = [i for i, x in enumerate(proxies) if isinstance(x, (jax.Array, np.ndarray,
                                                                      jax.ShapeDtypeStruct))
                   or hasattr(x, "aval")]

        def call(*xs):
            full = list(proxies)
            for i, x in zip(dynamic, xs):
                full[i] = x
            a, k = jax.tree_util.tree_unflatten(tree, full)
            return fun(*a, **k)

        closed, out_shape = jax.make_jaxpr(call, return_shape=True)(*[proxies[i] for i in dynamic])
        ins = []
        for i in dynamic:
            x = flat[i]
            if isinstance(x, Quantized):
                leaves, aux = jax.tree_util.tree_flatten(x)
                ins.append(_Lazy(leaves, aux))
            else:
                ins.append(x)
        outs = interpret(closed.jaxpr, closed.consts, ins, _override)
        outs = [o.value(o.leaves, None) if isinstance(o, _Lazy) else o for o in outs]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return wrapped
