"""Backend legalisation on jaxprs, before lowering for IREE.

- `reduce_sum(neg(x))` becomes `neg(reduce_sum(x))`. IREE 3.13's GPU code generation
  folds the negation into the reduction's combiner (a subtraction), which has no
  identity value, and fails ("Failed to get an identity value for the reduction
  operation"); LayerNorm's backward produces this pattern. The two forms are equal.
- `select_and_scatter_add` (the backward of max and min pooling) becomes strided
  slices, comparisons and pads. IREE 3.13 lowers `stablehlo.select_and_scatter` onto an
  uninitialised output and says so at compile time ("reads uninitialized values from
  an operand produced by a tensor.empty op"); the result would then depend on what
  the memory held. The rewrite removes that dependence (and the warning). It routes
  each gradient to the first extreme element of its window, as XLA does, so the values
  are the same (up to the order in which overlapping windows' contributions are added).
- A `gather` with batching dimensions (`operand_batching_dims`, which `jnp.take_along_axis`
  emits, so optax's `softmax_cross_entropy_with_integer_labels` has one) takes the
  batch positions as explicit index columns instead: an iota per batching dimension,
  appended to the indices, with those operand dimensions collapsed (XLA's
  `BatchedGatherScatterNormalizer` does the same). IREE 3.13's CUDA code generation fails
  on the batched form fused with another operand into a reduction over an odd multiple
  of 32 elements, e.g. the batch mean of `logsumexp(logits) - logits[i, label[i]]` over 32
  examples ("'func.func' op failed to distribute": an `iree_vector_ext.to_simd` of the
  batch index that reads the label is left undistributed). The two gathers read the same
  elements, and the iota columns are always in bounds, so values, out-of-bounds fills and
  clamping are the same.
- A `scatter_add` with batching dimensions (the gradient of such a gather) takes them as
  index columns the same way (`unbatched_scatter_add`). IREE 3.13 refuses the batched
  form where a batch dimension has size 1 ("'iree_linalg_ext.scatter' op expected indices
  to be equal to batch rank or batch rank + 1"): a language model's loss at batch 1.
  Where its windows are single elements, it becomes a scatter of scalars (every operand
  dimension indexed, the window dimensions at 0), the form IREE takes.
- `slice(broadcast_in_dim(x))` of booleans becomes `broadcast_in_dim(slice(x))`. Slice
  push-down slices masks in the sparse backward (e.g. a causal mask broadcast over the
  heads, when attention projections train some channels); IREE then keeps the whole
  broadcast mask in memory as bytes, which GPU targets without 8-bit storage
  (`vp_android_baseline_2022`) refuse (see `pockjax.export`). The two forms are equal.

- A convolution with batch groups (the kernel gradient of a depth-wise or other grouped
  convolution) becomes a depth-wise convolution with one group per batch group and
  input feature, summed over the features (`batch_groups_as_feature_groups`). IREE 3.13
  on Vulkan computes a grouped convolution wrong where a group reads more than one
  feature: a depth-wise kernel's gradient over a batch of 2 came back with one tap per
  channel and the others zero (lavapipe), where XLA and host-cpu agree.

These rewrites apply to every backend. One applies to `backend="vulkan"` only:

- A reduction (`reduce_sum`, `reduce_max`, `reduce_min`) over leading axes that keeps the
  last one, e.g. batch norm's statistics over N, H and W of an NHWC tensor, is followed
  by an optimization barrier, so IREE compiles it as a kernel of its own. Fused with an
  elementwise consumer of its broadcast result (`x - sum(x, 0) / n`), IREE 3.13's SPIR-V
  reduction code generation with subgroup operations fails for some shapes ("failed to
  legalize operation 'arith.constant'" on a `vector<32xf32>`; 256 x 56 with subgroups of
  8, as on lavapipe, and 256 x 16 for `valhall`). The barrier is the identity.

Nested `jit` calls and the primal bodies of `custom_vjp` / `custom_jvp` functions are
inlined on the way; the bodies of scan, cond, while and remat are left as they are (the
pattern there is not rewritten).
"""
from __future__ import annotations

import itertools

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import primitives as P

from pockjax._src.jaxpr import bind, call_body, interpret

__all__ = ["legalize_for_iree", "select_and_scatter_add", "unbatched_gather",
           "unbatched_scatter_add", "batch_groups_as_feature_groups"]


def select_and_scatter_add(source, operand, select_prim, window_dimensions, window_strides,
                           padding):
    """`lax`'s select_and_scatter_add without the select_and_scatter op: each element of
    `source` is added to the first element of its window of `operand` that `select_prim`
    (`ge` for max pooling, `le` for min pooling) prefers; padding is never chosen.

    Args:
      source: the values to scatter, one per window (the pooled output's cotangent).
      operand: the pooled input.
      select_prim: `lax.ge_p` (max pooling) or `lax.le_p` (min pooling).
      window_dimensions: the window size per dimension.
      window_strides: the window stride per dimension.
      padding: `(low, high)` padding of `operand` per dimension.

    Returns:
      An array of `operand`'s shape and `source`'s dtype: each element the sum of the
        `source` elements whose window selected it.
    """
    better = {"ge": lax.max, "le": lax.min}[select_prim.name]
    pad_cfg = [(lo, hi, 0) for lo, hi in padding]
    xp = lax.pad(operand, jnp.zeros((), operand.dtype), pad_cfg)
    valid = lax.pad(jnp.ones(operand.shape, bool), False, pad_cfg)
    out = source.shape

    def window_view(a, offset):
        limit = [o + (n - 1) * s + 1 for o, n, s in zip(offset, out, window_strides)]
        return lax.slice(a, offset, limit, window_strides)

    offsets = list(itertools.product(*[range(w) for w in window_dimensions]))
    views = [(window_view(xp, o), window_view(valid, o)) for o in offsets]
    best, seen = None, None
    for x, ok in views:
        if best is None:
            best, seen = x, ok
        else:
            best = lax.select(seen & ok, better(best, x), lax.select(ok, x, best))
            seen = seen | ok
    result = jnp.zeros(xp.shape, source.dtype)
    taken = jnp.zeros(out, bool)
    for o, (x, ok) in zip(offsets, views):
        hit = ok & (x == best) & ~taken
        taken = taken | hit
        placed = [(oi, p - (oi + (n - 1) * s + 1), s - 1)
                  for oi, p, n, s in zip(o, xp.shape, out, window_strides)]
        result = result + lax.pad(lax.select(hit, source, jnp.zeros_like(source)),
                                  jnp.zeros((), source.dtype), placed)
    lo = [p[0] for p in padding]
    return lax.slice(result, lo, [l + n for l, n in zip(lo, operand.shape)])


_MODES = lax.GatherScatterMode


def _default_fill(dtype):
    """`lax.gather`'s fill value for `mode="fill"` when none is given."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.nan
    if jnp.issubdtype(dtype, jnp.signedinteger):
        return jnp.iinfo(dtype).min
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        return jnp.iinfo(dtype).max
    return True


def _batch_columns(indices, operand_shape, operand_batching_dims, indices_batching_dims):
    """`(indices, columns)`: the indices (widened to int32 where their type cannot hold
    the largest batch position) and one iota column per pair of batching dimensions,
    each the position along the indices' batching dimension."""
    batch_shape = indices.shape[:-1]
    largest = max(operand_shape[d] for d in operand_batching_dims) - 1
    if jnp.iinfo(indices.dtype).max < largest:
        indices = indices.astype(jnp.int32)
    return indices, [lax.broadcasted_iota(indices.dtype, (*batch_shape, 1), d)
                     for d in indices_batching_dims]


def unbatched_gather(operand, indices, dimension_numbers: lax.GatherDimensionNumbers,
                     slice_sizes, *, mode=_MODES.FILL_OR_DROP, fill_value=None,
                     unique_indices: bool = False):
    """`lax.gather` with batching dimensions, computed by a gather without them: for each
    pair of batching dimensions, the position along the indices' dimension becomes one
    more index column (an iota) into the operand's dimension, which is collapsed.

    `mode="fill"` is done here as `lax` lowers it (a bounds mask of the given index
    columns, a gather, a select), but with the mask as elementwise comparisons joined by
    `&`: the iota columns need no check, and a reduction over the index vector would be a
    kernel of its own that leaves a boolean array in memory, which GPU targets without
    8-bit storage refuse (see `pockjax.export`). Indices of a type too narrow for the
    largest batch position are widened to int32.

    Args:
      operand: the array gathered from.
      indices: the start indices, with the index vector in the last dimension.
      dimension_numbers: the gather's `lax.GatherDimensionNumbers`, with
        `operand_batching_dims` and `start_indices_batching_dims`.
      slice_sizes: the slice size per operand dimension.
      mode: a `lax.GatherScatterMode` or its name, as for `lax.gather`; default
        `FILL_OR_DROP`.
      fill_value: the value of out-of-bounds slices under `FILL_OR_DROP`; None (the
        default): `lax.gather`'s default for the dtype (NaN for inexact types, the
        minimum of a signed integer type, the maximum of an unsigned one, True).
      unique_indices: passed to `lax.gather`.

    Returns:
      What `lax.gather(operand, indices, dimension_numbers, slice_sizes, ...)` returns.
    """
    dn, mode = dimension_numbers, _MODES.from_any(mode)
    batch_shape = indices.shape[:-1]  # JAX keeps the index vector in the last dimension
    indices, columns = _batch_columns(indices, operand.shape, dn.operand_batching_dims,
                                      dn.start_indices_batching_dims)
    flat = lax.GatherDimensionNumbers(
        offset_dims=dn.offset_dims,
        collapsed_slice_dims=tuple(sorted(dn.collapsed_slice_dims + dn.operand_batching_dims)),
        start_index_map=dn.start_index_map + dn.operand_batching_dims,
        operand_batching_dims=(), start_indices_batching_dims=())
    out = lax.gather(operand, lax.concatenate([indices, *columns], len(batch_shape)), flat,
                     slice_sizes, unique_indices=unique_indices,
                     mode=_MODES.PROMISE_IN_BOUNDS if mode == _MODES.FILL_OR_DROP else mode)
    if mode != _MODES.FILL_OR_DROP:
        return out
    ok = None
    for k, d in enumerate(dn.start_index_map):
        # Compared as lax does it, in the widest enabled integer type.
        i = lax.convert_element_type(lax.index_in_dim(indices, k, -1, keepdims=False),
                                     jax.dtypes.canonicalize_dtype(np.int64))
        inside = (i >= 0) & (i <= operand.shape[d] - slice_sizes[d])
        ok = inside if ok is None else ok & inside
    if ok is None:  # no index columns of its own: every slice is in bounds
        return out
    batch_dims = [d for d in range(out.ndim) if d not in dn.offset_dims]
    fill = _default_fill(out.dtype) if fill_value is None else fill_value
    return lax.select(lax.broadcast_in_dim(ok, out.shape, batch_dims), out,
                      lax.full_like(out, fill))


def unbatched_scatter_add(operand, indices, updates, dimension_numbers:
                          lax.ScatterDimensionNumbers, *, mode=_MODES.FILL_OR_DROP,
                          indices_are_sorted: bool = False, unique_indices: bool = False):
    """`lax.scatter_add` with batching dimensions, computed by a scatter-add without them
    (the transpose of `unbatched_gather`): for each pair of batching dimensions, the
    position along the indices' dimension becomes one more index column (an iota) into
    the operand's dimension, which becomes an inserted window dimension. The iota
    columns are always in bounds, so out-of-bounds updates are dropped (or clipped) as
    before. Indices of a type too narrow for the largest batch position are widened to
    int32.

    Args:
      operand: the array added into.
      indices: the scatter indices, with the index vector in the last dimension.
      updates: the values added.
      dimension_numbers: the scatter's `lax.ScatterDimensionNumbers`, with
        `operand_batching_dims` and `scatter_indices_batching_dims`.
      mode: a `lax.GatherScatterMode`, as for `lax.scatter_add`.
      indices_are_sorted: passed to `lax.scatter_add`.
      unique_indices: passed to `lax.scatter_add`.

    Returns:
      What `lax.scatter_add(operand, indices, updates, dimension_numbers, ...)` returns.
    """
    dn = dimension_numbers
    batch_shape = indices.shape[:-1]
    indices, columns = _batch_columns(indices, operand.shape, dn.operand_batching_dims,
                                      dn.scatter_indices_batching_dims)
    flat = lax.ScatterDimensionNumbers(
        update_window_dims=dn.update_window_dims,
        inserted_window_dims=tuple(sorted(dn.inserted_window_dims + dn.operand_batching_dims)),
        scatter_dims_to_operand_dims=dn.scatter_dims_to_operand_dims + dn.operand_batching_dims,
        operand_batching_dims=(), scatter_indices_batching_dims=())
    indices = lax.concatenate([indices, *columns], len(batch_shape))
    if all(updates.shape[u] == 1 for u in flat.update_window_dims):
        # Windows of one element (a batch of 1 leaves one of size 1): a scatter of
        # scalars, the form IREE 3.13 takes, with the window dimensions indexed at 0.
        n = int(np.prod(batch_shape, dtype=np.int64))
        flat_idx = lax.reshape(indices, (n, indices.shape[-1]))
        where = {d: k for k, d in enumerate(flat.scatter_dims_to_operand_dims)}
        cols = [lax.slice_in_dim(flat_idx, where[d], where[d] + 1, axis=1) if d in where
                else jnp.zeros((n, 1), flat_idx.dtype) for d in range(operand.ndim)]
        scalar = lax.ScatterDimensionNumbers(
            update_window_dims=(), inserted_window_dims=tuple(range(operand.ndim)),
            scatter_dims_to_operand_dims=tuple(range(operand.ndim)),
            operand_batching_dims=(), scatter_indices_batching_dims=())
        return lax.scatter_add(operand, lax.concatenate(cols, 1), lax.reshape(updates, (n,)),
                               scalar, indices_are_sorted=indices_are_sorted,
                               unique_indices=unique_indices, mode=mode)
    return lax.scatter_add(operand, indices, updates, flat, indices_are_sorted=indices_are_sorted,
                           unique_indices=unique_indices, mode=mode)


# --------------------------------------------------------------------------- the pass
#
# One rule per primitive: `rule(ctx, eqn, ins)` returns the equation's outputs, or None
# to keep the equation as it is.


class _Context:
    def __init__(self, backend, stats, producer, read):
        self.backend, self.stats, self.producer, self.read = backend, stats, producer, read

    def made(self, kind: str) -> None:
        self.stats[kind] = self.stats.get(kind, 0) + 1

    def produced_by(self, var, name: str):
        """The equation that produced `var` if it is a `name` equation, else None."""
        e = self.producer.get(var) if isinstance(var, jex.Var) else None
        return e if e is not None and e.primitive.name == name else None


_RULES = {}


def _select_and_scatter_add(ctx, e, ins):
    p = e.params
    if p["select_prim"].name not in ("ge", "le"):
        return None
    ctx.made("select_and_scatter")
    return [select_and_scatter_add(ins[0], ins[1], p["select_prim"], p["window_dimensions"],
                                   p["window_strides"], p["padding"])]


_RULES[lax.select_and_scatter_add_p] = _select_and_scatter_add


def _gather(ctx, e, ins):
    p = e.params
    if not p["dimension_numbers"].operand_batching_dims or p["mode"] not in (
            _MODES.CLIP, _MODES.FILL_OR_DROP, _MODES.PROMISE_IN_BOUNDS):
        return None
    ctx.made("batched_gather")
    return [unbatched_gather(ins[0], ins[1], p["dimension_numbers"], p["slice_sizes"],
                             mode=p["mode"], fill_value=p["fill_value"],
                             unique_indices=p["unique_indices"])]


_RULES[lax.gather_p] = _gather


def _scatter_add(ctx, e, ins):
    """A batched `scatter_add` (the gradient of a batched gather: optax's integer-label
    cross-entropy) without its batching dimensions. IREE 3.13 refuses the batched form
    where a batch dimension has size 1 ("'iree_linalg_ext.scatter' op expected indices
    to be equal to batch rank or batch rank + 1": a language model's loss at batch 1)."""
    p = e.params
    if not p["dimension_numbers"].operand_batching_dims:
        return None
    ctx.made("batched_scatter_add")
    return [unbatched_scatter_add(ins[0], ins[1], ins[2], p["dimension_numbers"],
                                  mode=p["mode"], indices_are_sorted=p["indices_are_sorted"],
                                  unique_indices=p["unique_indices"])]


_RULES[lax.scatter_add_p] = _scatter_add


def _slice(ctx, e, ins):
    """`slice(broadcast_in_dim(x))` of booleans as `broadcast_in_dim(slice(x))`."""
    src = ctx.produced_by(e.invars[0], "broadcast_in_dim")
    if src is None or e.outvars[0].aval.dtype != jnp.bool_ or src.params.get("sharding"):
        return None
    x, dims, p = ctx.read(src.invars[0]), src.params["broadcast_dimensions"], e.params
    strides = p["strides"] or (1,) * len(p["start_indices"])
    # A dimension of size 1 is stretched by the broadcast: keep it whole.
    keep = lambda j, d, v, one: one if x.shape[j] == 1 else v[d]
    ctx.made("slice_of_broadcast")
    return [lax.broadcast_in_dim(
        lax.slice(x, [keep(j, d, p["start_indices"], 0) for j, d in enumerate(dims)],
                  [keep(j, d, p["limit_indices"], 1) for j, d in enumerate(dims)],
                  [keep(j, d, strides, 1) for j, d in enumerate(dims)]),
        e.outvars[0].aval.shape, dims)]


_RULES[lax.slice_p] = _slice


def _reduction(ctx, e, ins):
    out = None
    if e.primitive is lax.reduce_sum_p:
        src = ctx.produced_by(e.invars[0], "neg")
        if src is not None:
            ctx.made("neg_sum")
            out = lax.neg(bind(e, [ctx.read(src.invars[0])]))
    axes, ndim = e.params["axes"], len(e.invars[0].aval.shape)
    if ctx.backend == "vulkan" and ndim >= 2 and axes and ndim - 1 not in axes \
            and e.outvars[0].aval.shape:
        # Kept out of its consumers' kernel (see the module docstring).
        ctx.made("leading_axes_reduction")
        out = bind(e, ins) if out is None else out
        return [lax.optimization_barrier(out)]
    return None if out is None else [out]


for _p in (lax.reduce_sum_p, lax.reduce_max_p, lax.reduce_min_p):
    _RULES[_p] = _reduction

def batch_groups_as_feature_groups(lhs, rhs, params: dict):
    """A `conv_general_dilated` with `batch_group_count` B (and one feature group) as an
    equal depth-wise convolution: one group per (batch group, input feature) pair, each
    reading one feature, then the sum over the features. The lhs's batch dimension (B
    groups of b, group-major) becomes b examples whose B x F features are the groups'
    features side by side; kernel group (g, f) holds what the output features of batch
    group g read of feature f. The kernel gradient of a grouped (depth-wise)
    convolution is such a convolution.

    Args:
      lhs: the convolution's input.
      rhs: its kernel.
      params: the equation's parameters (`conv_general_dilated_p`'s).

    Returns:
      The convolution's output, equal to the batch-grouped one's up to the order of
        the sum over the input features.
    """
    dn, groups = params["dimension_numbers"], params["batch_group_count"]
    x = jnp.transpose(lhs, dn.lhs_spec)  # [batch, features, spatial...]
    batch, features = x.shape[:2]
    x = x.reshape(groups, batch // groups, features, *x.shape[2:])
    x = jnp.swapaxes(x, 0, 1).reshape(batch // groups, groups * features, *x.shape[3:])
    k = jnp.transpose(rhs, dn.rhs_spec)  # [out, features, window...]
    per_group = k.shape[0] // groups
    k = k.reshape(groups, per_group, features, *k.shape[2:])
    k = jnp.swapaxes(k, 1, 2).reshape(groups * features * per_group, 1, *k.shape[3:])
    canonical = tuple(range(x.ndim))
    y = lax.conv_general_dilated_p.bind(
        x, k, **{**params, "feature_group_count": groups * features, "batch_group_count": 1,
                 "dimension_numbers": lax.ConvDimensionNumbers(canonical, canonical,
                                                               canonical)})
    y = y.reshape(y.shape[0], groups, features, per_group, *y.shape[2:]).sum(axis=2)
    y = y.reshape(y.shape[0], groups * per_group, *y.shape[3:])
    return jnp.transpose(y, tuple(np.argsort(dn.out_spec)))


def _conv(ctx, e, ins):
    """A batch-grouped convolution as a feature-grouped one (see the module docstring)."""
    p = e.params
    if p["batch_group_count"] == 1 or p["feature_group_count"] != 1:
        return None
    ctx.made("batch_grouped_conv")
    return [batch_groups_as_feature_groups(ins[0], ins[1], p)]


_RULES[lax.conv_general_dilated_p] = _conv

_CUSTOM_CALLS = (P.custom_vjp_call_p, P.custom_jvp_call_p)


def _rewrite(jaxpr: jex.Jaxpr, consts, args, stats, backend):
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}

    def override(e, ins, read):
        sub = call_body(e)
        if sub is None and e.primitive in _CUSTOM_CALLS:
            # The step is final (nothing differentiates it again), so a custom-derivative
            # function is its primal body: rewritten like any other code.
            sub = e.params["call_jaxpr"]
        if sub is not None:
            return _rewrite(sub.jaxpr, sub.consts, ins, stats, backend)
        rule = _RULES.get(e.primitive)
        return None if rule is None else rule(_Context(backend, stats, producer, read), e, ins)

    return interpret(jaxpr, consts, args, override)


def legalize_for_iree(closed: jex.ClosedJaxpr, backend: str | None = None
                      ) -> tuple[jex.ClosedJaxpr, dict[str, int]]:
    """`closed` rewritten for IREE, and how many rewrites of each kind were made.

    `backend` is the IREE HAL device the module is compiled for (`"local"`, `"vulkan"`,
    `"cuda"`; see `pockjax.export.TARGETS`): the rewrites for one backend only apply to
    it; None makes the rewrites every backend gets.

    Args:
      closed: the jaxpr to rewrite (a training step or any other program).
      backend: the IREE HAL device, or None (the default) for the rewrites every
        backend gets.

    Returns:
      A pair: the rewritten `ClosedJaxpr` (same inputs and outputs), and a dict from
        the kind of rewrite (`"neg_sum"`, `"select_and_scatter"`, `"batched_gather"`,
        `"slice_of_broadcast"`, `"batch_grouped_conv"`, `"leading_axes_reduction"`) to
        how many were made;
        kinds with none made are absent.
    """
    stats: dict[str, int] = {}
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    out = jax.make_jaxpr(
        lambda *a: _rewrite(closed.jaxpr, closed.consts, a, stats, backend))(*avals)
    return out, stats
