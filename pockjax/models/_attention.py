"""Grouped-query attention whose backward pass recomputes the attention probabilities.

Differentiated as written, `softmax(q k^T) v` keeps three `[batch, heads, T, S]` tensors
of every layer from the forward pass to the backward one (the scores, their shifted
exponentials and the probabilities): at SmolLM2-135M's shape (30 layers, 9 heads, 4 x 256
tokens) 0.8 GiB of a full step's 2.4 GiB of temporaries. `attention` keeps only what the
projections' gradients keep anyway (the queries, keys, values and the output) and one
log-sum-exp per row, and computes the probabilities again in the backward pass from
those: one more `q k^T` product per layer, against `T x S` memory per head.

The forward pass is `jax.nn.softmax`'s, operation for operation, so a model's outputs do
not change; gradients agree with differentiating the plain expression up to float
rounding (tested against `jax.grad` of it).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pockjax._src.ties import tie_zero

__all__ = ["attention", "swiglu"]

_LOWEST = jnp.finfo(jnp.float32).min


def _scores(q, k, keep, scale):
    """Masked float32 scores `[B, kv, group, T, S]` of queries `q` `[B, T, kv, group, hd]`
    over keys `k` `[B, S, kv, hd]`; `keep` `[T, S]` is 1 where a query reads a key."""
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) * scale
    return jnp.where(keep > 0, scores, _LOWEST)


def _combine(probs, v):
    return jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, keep, scale):
    return _combine(jax.nn.softmax(_scores(q, k, keep, scale), axis=-1), v)


def _forward(q, k, v, keep, scale):
    scores = _scores(q, k, keep, scale)
    # jax.nn.softmax's own steps, so the output equals the undifferentiated call's.
    top = jnp.max(scores, axis=-1, keepdims=True)
    shifted = jnp.exp(scores - top)
    total = jnp.sum(shifted, axis=-1, keepdims=True)
    out = _combine(shifted / total, v)
    return out, (q, k, v, keep, out, top + jnp.log(total))


def _backward(scale, saved, d_out):
    q, k, v, keep, out, log_total = saved
    # The keys tied to the cotangent (plus an exact -0.0 from one of its elements):
    # otherwise XLA merges the recomputed scores with the forward pass's, or moves the
    # recomputation there, and the probabilities stay alive again.
    k = k + tie_zero([d_out]).astype(k.dtype)
    probs = jnp.exp(_scores(q, k, keep, scale) - log_total)  # 0 where masked
    d_v = jnp.einsum("bkgqs,bqkgd->bskd", probs.astype(v.dtype), d_out)
    # Accumulated in float32: the difference below cancels, and a bfloat16 product
    # would leave its rounding in it.
    d_probs = jnp.einsum("bqkgd,bskd->bkgqs", d_out, v, preferred_element_type=jnp.float32)
    # softmax's backward: probs * (d_probs - sum(probs * d_probs)), where that sum is
    # the row's sum(d_out * out) over the head dimension.
    row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    row = jnp.transpose(row, (0, 2, 3, 1))[..., None]  # [B, kv, group, T, 1]
    d_scores = (probs * (d_probs - row) * scale).astype(q.dtype)
    d_q = jnp.einsum("bkgqs,bskd->bqkgd", d_scores, k)
    d_k = jnp.einsum("bkgqs,bqkgd->bskd", d_scores, q)
    return d_q, d_k.astype(k.dtype), d_v.astype(v.dtype), jnp.zeros_like(keep)


_attention.defvjp(_forward, _backward)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
              scale: float) -> jax.Array:
    """`softmax(q k^T * scale, masked) v` per head group, differentiated by recomputing
    the probabilities (see the module's docstring).

    Args:
      q: queries, `[B, T, kv_heads, group, head_dim]` (query head `h` is group
        `h % group` of key/value head `h // group`).
      k: keys, `[B, S, kv_heads, head_dim]`.
      v: values, `[B, S, kv_heads, head_dim]`.
      mask: `[T, S]` booleans, which keys each query reads; every row reads at least one.
      scale: the scores' factor, usually `head_dim ** -0.5`.

    Returns:
      `[B, T, kv_heads, group, head_dim]`, in `v`'s dtype.
    """
    # A float mask: a boolean tensor kept from the forward pass to the backward one is
    # stored as 8-bit, which Vulkan targets without 8-bit storage read wrongly.
    return _attention(q, k, v, mask.astype(jnp.float32), float(scale))


@jax.custom_vjp
def _swiglu(gate, up):
    return jax.nn.silu(gate) * up


def _swiglu_forward(gate, up):
    return jax.nn.silu(gate) * up, (gate, up)


def _swiglu_backward(saved, d_out):
    gate, up = saved
    # Tied to the cotangent so that XLA neither merges this sigmoid with the forward
    # pass's nor computes it there (which would keep it alive as before).
    gate = gate + tie_zero([d_out]).astype(gate.dtype)
    sig = jax.nn.sigmoid(gate)
    d_up = d_out * (gate * sig)
    d_gate = d_out * up * sig * (1 + gate * (1 - sig))
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


_swiglu.defvjp(_swiglu_forward, _swiglu_backward)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """`silu(gate) * up`, differentiated from `gate` and `up` alone: the backward pass
    computes the sigmoid again instead of keeping `silu(gate)` from the forward pass
    (one `[tokens, intermediate]` tensor per layer)."""
    return _swiglu(gate, up)
