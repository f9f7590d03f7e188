"""Mixed precision for the LLaMA-family decoder: products with weights stored narrower
than the compute dtype (`upcast_matmul`, which upcasts each weight at its use only;
`narrow_matmul`, which multiplies it as it is, autocast's numerics), the `project` the
layers call, and `cast_frozen`, the parameter layout that stores frozen weights narrow
(as `pockjax.lowbit` nodes, upcast at each use by the library; plain narrow arrays for
the native products).
`pockjax.models.llama` re-exports the public names; `LlamaConfig.narrow_matmul` picks an
entry of `NARROW_MATMUL`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pockjax import lowbit


def _upcast_after(w: jax.Array, x: jax.Array) -> jax.Array:
    """`w` upcast to `x`'s dtype, computed only once `x` exists (`lowbit.one_after`: the
    tie that keeps XLA from converting every weight at the top of the step)."""
    return w.astype(x.dtype) * lowbit.one_after(x, x.dtype)


def _matmul(x: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    """`x @ w` over x's last axis (`x @ w.T` when `transposed`)."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1 if transposed else 0,)), ((), ())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def upcast_matmul(x: jax.Array, w: jax.Array, transposed: bool = False) -> jax.Array:
    """`x @ w` in `x`'s dtype for a narrower stored `w`, upcast just before the product.

    For e.g. bfloat16 weights under float32 activations, forward and backward. The
    backward converts `w` again, after the layer's output gradient exists, rather than
    keeping the forward's float32 copy from the forward pass to the backward; `w`'s own
    gradient is returned in `w`'s dtype (and vanishes when `w` is frozen).

    Args:
      x: the activations; the product contracts their last axis.
      w: the weight, `[in, out]` (`[out, in]` when `transposed`).
      transposed: compute `x @ w.T` instead.

    Returns:
      The product, in `x`'s dtype.
    """
    return _matmul(x, _upcast_after(w, x), transposed)


def _upcast_matmul_fwd(x, w, transposed):
    return upcast_matmul(x, w, transposed), (x, w)


def _upcast_matmul_bwd(transposed, residuals, g):
    x, w = residuals
    w_up = _upcast_after(w, g)
    dx = jax.lax.dot_general(g, w_up, (((g.ndim - 1,), (0 if transposed else 1,)), ((), ())))
    lead = tuple(range(x.ndim - 1))
    dw = (jax.lax.dot_general(g, x, ((lead, lead), ((), ()))) if transposed else
          jax.lax.dot_general(x, g, ((lead, lead), ((), ()))))
    return dx.astype(x.dtype), dw.astype(w.dtype)


upcast_matmul.defvjp(_upcast_matmul_fwd, _upcast_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def narrow_matmul(x: jax.Array, w: jax.Array, transposed: bool = False) -> jax.Array:
    """`x @ w` for a narrower stored `w`, with `x` rounded to `w`'s dtype.

    The product is accumulated in `x`'s dtype (autocast's numerics); the backward rounds
    the output gradient to `w`'s dtype too, accumulates the input gradient in the
    gradient's dtype and the weight gradient in float32, and returns the weight
    gradient in `w`'s dtype. No weight is converted at all. On CPUs with bfloat16 matrix
    instructions (AVX512-BF16, AMX) XLA runs these products several times faster than
    float32 ones; the price is activations rounded to bfloat16 on their way into frozen
    layers. Arguments and result as `upcast_matmul`'s.
    """
    return _narrow_dot(x.astype(w.dtype), w, (x.ndim - 1,), (1 if transposed else 0,), x.dtype)


def _narrow_dot(a, b, ca, cb, out_dtype):
    return jax.lax.dot_general(a, b.astype(a.dtype), ((ca, cb), ((), ())),
                               preferred_element_type=out_dtype)


def _narrow_matmul_fwd(x, w, transposed):
    low = x.astype(w.dtype)
    y = _narrow_dot(low, w, (x.ndim - 1,), (1 if transposed else 0,), x.dtype)
    return y, (low, w)


def _narrow_matmul_bwd(transposed, residuals, g):
    low, w = residuals
    g_low = g.astype(w.dtype)
    dx = _narrow_dot(g_low, w, (g.ndim - 1,), (0 if transposed else 1,), g.dtype)
    lead = tuple(range(low.ndim - 1))
    dw = (_narrow_dot(g_low, low, lead, lead, jnp.float32) if transposed else
          _narrow_dot(low, g_low, lead, lead, jnp.float32))
    return dx, dw.astype(w.dtype)


narrow_matmul.defvjp(_narrow_matmul_fwd, _narrow_matmul_bwd)

# LlamaConfig.narrow_matmul choices: how a weight stored narrower than `dtype` multiplies.
NARROW_MATMUL = {"upcast": upcast_matmul, "native": narrow_matmul}


def _narrower(a, b) -> bool:
    return jnp.finfo(a).bits < jnp.finfo(b).bits


def project(x: jax.Array, w: jax.Array, dtype, transposed: bool = False,
            narrow: str = "upcast") -> jax.Array:
    """`x @ w` (or `x @ w.T`) computed in `dtype` (None: x's and w's promoted dtype); a
    narrower `w` goes through `NARROW_MATMUL[narrow]`."""
    dtype = jnp.result_type(x, w) if dtype is None else dtype
    x = x.astype(dtype)
    if _narrower(w.dtype, dtype):
        return NARROW_MATMUL[narrow](x, w, transposed)
    return _matmul(x, w.astype(dtype), transposed)


def cast_frozen(params, scheme, dtype=jnp.bfloat16, trained_dtype=jnp.float32, *,
                native: bool = False):
    """`params` with the leaves `scheme` freezes stored in `dtype` and the rest in
    `trained_dtype`.

    This is the mixed-precision layout for sparse fine-tuning (use it with a
    `LlamaConfig(dtype=jnp.float32)` model). Frozen weights are `pockjax.lowbit` nodes
    in the `Cast(dtype)` format: the step (`sparse_train`, `nnx.Trainer`, or a loss
    wrapped in `lowbit.at_use`) upcasts each at its use, again in the backward pass,
    and never holds a float32 copy of the frozen model. A weight trained in part
    (`Channels`) keeps its trained channels as a float32 master (`lowbit.quantize`).
    Frozen vectors (norm scales) are plain `dtype` arrays, read as they are. Trained
    leaves stay `trained_dtype` masters, so the optimizer state `SparseTrainer.init`
    makes for them is float32 too. Works on arrays and on `jax.ShapeDtypeStruct`s (to
    lower or size a step without allocating it).

    Args:
      params: the parameter pytree.
      scheme: the `Scheme` that says which leaves are frozen.
      dtype: the dtype of frozen leaves (default bfloat16).
      trained_dtype: the dtype of trained leaves (default float32).
      native: store frozen weights as plain `dtype` arrays instead (as they are when
        `dtype` is not narrower than `trained_dtype`), for a model that
        multiplies them as they are (`LlamaConfig(narrow_matmul="native")`, whose
        products round activations to `dtype`); such a model also runs without
        `lowbit.at_use`.

    Returns:
      A pytree of the same structure, each frozen weight a `lowbit.Quantized` node (a
      plain array with `native`); leaves already of the wanted dtype are returned as
      they are.

    Examples:
      >>> import pockjax as pj
      >>> model = Llama(LlamaConfig.tiny(dtype=jnp.float32), rngs=nnx.Rngs(0))
      >>> _, params, _ = pj.nnx.split(model)
      >>> layers = cast_frozen(params, pj.schemes.last_blocks(params, 1))["layers"]
      >>> layers[0]["mlp"]["up_proj"]["kernel"]
      Quantized(bfloat16, shape=(64, 172))
      >>> layers[0]["mlp"]["up_proj"]["kernel"].data.dtype, layers[1]["mlp"]["up_proj"]["kernel"].dtype
      (dtype(bfloat16), dtype('float32'))
    """

    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
        return jax.eval_shape(functools.partial(cast_frozen, scheme=scheme, dtype=dtype,
                                                trained_dtype=trained_dtype, native=native),
                              params)
    decisions = scheme.resolve(params)
    stored = not native and _narrower(dtype, trained_dtype)
    fmt = lowbit.Cast(jnp.dtype(dtype)) if stored else None

    return jax.tree.map(lambda x, d: lowbit.store_frozen_leaf(
        x, d, fmt, narrow=dtype, trained_dtype=trained_dtype), params, decisions)
