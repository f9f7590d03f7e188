"""The layers of the LLaMA-family decoder (`pockjax.models.llama.Llama` stacks them):
`RMSNorm`, the `Linear` projection (narrow kernels multiplied through
`pockjax.models._llama_precision`), rotary embeddings, grouped-query `Attention` with
its key/value `KVCache`, the SwiGLU `MLP` and the pre-norm `LlamaBlock`.
`pockjax.models.llama` re-exports the public names.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pockjax.models import _llama_rope as _rope
from flax import nnx

from pockjax.models._attention import attention, swiglu
from pockjax.models._llama_config import LlamaConfig
from pockjax.models._llama_precision import project

# Hugging Face's `initializer_range` default for LLaMA.
HF_INIT = nnx.initializers.normal(stddev=0.02)


class RMSNorm(nnx.Module):
    """RMS normalisation: `x * rsqrt(mean(x**2) + eps) * scale`, computed in float32.

    Args:
      dim: the size of the normalised (last) axis.
      eps: added to the mean square before the square root.
      param_dtype: the dtype of `scale`, initialised to ones (default float32).
    """

    def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalise `x` over its last axis.

        Args:
          x: an array whose last axis has size `dim`.

        Returns:
          The normalised array, in `x`'s dtype.
        """
        x32 = x.astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * inv_rms * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class Linear(nnx.Linear):
    """An `nnx.Linear` computed in `dtype`, with narrower kernels multiplied at their use.

    The layer is bias-free unless `use_bias=True`. A kernel stored narrower than `dtype`
    is upcast at its use only (`upcast_matmul`, never as a whole-model copy) or, with
    `narrow="native"`, multiplied as it is (`narrow_matmul`). The bias, a vector, is
    cast to the product's dtype and added.

    Args:
      *args: `nnx.Linear`'s positional arguments (`in_features`, `out_features`).
      narrow: `"upcast"` (default) or `"native"`, as `LlamaConfig.narrow_matmul`.
      **kwargs: `nnx.Linear`'s keyword arguments (`use_bias`, `dtype`, `param_dtype`,
        `kernel_init`, `rngs`, ...); `use_bias` defaults to False.

    Raises:
      ValueError: `precision`, `dot_general`, `dot_general_cls` or
        `preferred_element_type` is given.
    """

    def __init__(self, *args, narrow: str = "upcast", **kwargs):
        for name in ("precision", "dot_general", "dot_general_cls", "preferred_element_type"):
            if kwargs.get(name) is not None:
                raise ValueError(f"pockjax.models.llama.Linear does not take {name}=; it computes "
                                 f"in `dtype` with upcast_matmul/narrow_matmul")
        super().__init__(*args, **{"use_bias": False, **kwargs})
        self.narrow = narrow

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x @ kernel (+ bias)` in the layer's `dtype`.

        Args:
          x: inputs, `[..., in_features]`.

        Returns:
          The outputs, `[..., out_features]`, in `dtype` (None: `x`'s and the kernel's
          promoted dtype).
        """
        y = project(x, self.kernel[...], self.dtype, narrow=self.narrow)
        if self.bias is None:
            return y
        # An explicit broadcast: sparse_grad narrows `broadcast_in_dim`, not the
        # size-1 broadcasting inside `add`.
        return y + jnp.broadcast_to(self.bias[...].astype(y.dtype), y.shape)


def make_linear(d_in: int, d_out: int, config: LlamaConfig, rngs: nnx.Rngs,
                bias: bool = False) -> Linear:
    """A `Linear` of `config`'s dtypes and `narrow_matmul`, initialised as Hugging Face's."""
    return Linear(d_in, d_out, use_bias=bias, param_dtype=config.param_dtype,
                  dtype=config.dtype, narrow=config.narrow_matmul, kernel_init=HF_INIT, rngs=rngs)


def rope_tables(length: int, head_dim: int, theta: float, scaling=None,
                max_positions: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`cos`, `sin` [length, head_dim] for positions 0..length-1 in HF's layout: both
    halves of a head hold the same frequencies; `scaling` (`LlamaConfig.rope_scaling`)
    for a model of `max_positions` positions (`pockjax.models._llama_rope`)."""
    return _rope.rope_tables(length, head_dim, theta, scaling, max_positions)


def apply_rope(x: jax.Array, cos, sin) -> jax.Array:
    """Rotary embedding of `x` [B, T, heads, head_dim], HF's `x * cos + rotate_half(x) * sin`:
    channel `j` of the first half pairs with channel `j` of the second."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    # Explicit broadcasts rather than size-1 broadcasting inside `mul`: sparse_grad
    # narrows `broadcast_in_dim` and same-shape products, not the implicit form.
    cos = jnp.broadcast_to(jnp.asarray(cos, x.dtype)[:, None, :], x.shape)
    sin = jnp.broadcast_to(jnp.asarray(sin, x.dtype)[:, None, :], x.shape)
    return x * cos + rotated * sin


class KVCache(NamedTuple):
    """The keys and values `Llama.decode` has computed.

    Made by `Llama.init_cache`. Position `p` of a sequence holds the key/value of its
    token `p`. Positions not yet decoded hold zeros, which the causal mask hides.

    Attributes:
      k: the keys, `[layers, batch, length, kv_heads, head_dim]`.
      v: the values, of the same shape.
    """
    k: jax.Array
    v: jax.Array


class Attention(nnx.Module):
    """Causal self-attention with rotary embeddings and grouped-query heads.

    Args:
      config: the model's shape (heads, head size, biases, dtypes).
      rngs: the random streams the projections are initialised from.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        biased = config.biased
        self.q_proj = make_linear(d, config.num_heads * hd, config, rngs, "q_proj" in biased)
        self.k_proj = make_linear(d, config.num_kv_heads * hd, config, rngs, "k_proj" in biased)
        self.v_proj = make_linear(d, config.num_kv_heads * hd, config, rngs, "v_proj" in biased)
        self.o_proj = make_linear(config.num_heads * hd, d, config, rngs, "o_proj" in biased)

    def __call__(self, x: jax.Array, cos, sin, mask) -> jax.Array:
        """Attention of `x` over itself.

        Args:
          x: the normalised hidden states, `[B, T, D]`.
          cos: the rotary table's cosines for the T positions, `[T, head_dim]`.
          sin: its sines, `[T, head_dim]`.
          mask: `[T, T]` booleans: which positions each query reads.

        Returns:
          The attention output after `o_proj`, `[B, T, D]`.
        """
        return self._attend(*self._qkv(x, cos, sin), mask)

    def decode(self, x: jax.Array, cos, sin, mask, cache: KVCache, layer: int,
               position) -> tuple[jax.Array, KVCache]:
        """`__call__` for `x` `[B, T, D]` at positions `position`..`position + T - 1`.

        Their keys and values are written into `cache` (layer `layer`) and the queries
        attend over the whole cache.

        Args:
          x: the normalised hidden states, `[B, T, D]`.
          cos: the rotary table's cosines for the T positions, `[T, head_dim]`.
          sin: its sines, `[T, head_dim]`.
          mask: `[T, cache length]` booleans: which cache entries each query reads.
          cache: the key/value cache.
          layer: this layer's index in the cache.
          position: the position of `x`'s first token.

        Returns:
          `(output [B, T, D], cache)`, the cache holding the new keys and values.
        """
        q, k, v = self._qkv(x, cos, sin)
        at = (layer, 0, position, 0, 0)
        cache = KVCache(jax.lax.dynamic_update_slice(cache.k, k[None].astype(cache.k.dtype), at),
                        jax.lax.dynamic_update_slice(cache.v, v[None].astype(cache.v.dtype), at))
        return self._attend(q, cache.k[layer], cache.v[layer], mask), cache

    def _qkv(self, x, cos, sin):
        b, t, _ = x.shape
        kv, hd = self.num_kv_heads, self.head_dim
        q = apply_rope(self.q_proj(x).reshape(b, t, self.num_heads, hd), cos, sin)
        k = apply_rope(self.k_proj(x).reshape(b, t, kv, hd), cos, sin)
        v = self.v_proj(x).reshape(b, t, kv, hd)
        return q, k, v

    def _attend(self, q, k, v, mask):
        """Attention of queries `q` [B, T, heads, hd] over keys and values [B, S, kv, hd],
        `mask` [T, S]."""
        b, t = q.shape[:2]
        kv, hd = self.num_kv_heads, self.head_dim
        group = self.num_heads // kv
        # Query head h reads k/v head h // group: the same as repeating each k/v head
        # `group` times (HF's repeat_kv), without materialising the copies.
        # The backward pass recomputes the probabilities instead of keeping them
        # (pockjax.models._attention).
        out = attention(q.reshape(b, t, kv, group, hd), k, v, mask, hd ** -0.5)
        return self.o_proj(out.reshape(b, t, kv * group * hd))


class MLP(nnx.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`.

    Args:
      config: the model's shape (`hidden_size`, `intermediate_size`, `mlp_bias`,
        dtypes).
      rngs: the random streams the projections are initialised from.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = make_linear(d, f, config, rngs, bias)
        self.up_proj = make_linear(d, f, config, rngs, bias)
        self.down_proj = make_linear(f, d, config, rngs, bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        """The MLP of `x`.

        Args:
          x: hidden states, `[..., hidden_size]`.

        Returns:
          The output, `[..., hidden_size]`.
        """
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class LlamaBlock(nnx.Module):
    """Pre-norm residual block: attention, then MLP.

    Args:
      config: the model's shape.
      rngs: the random streams the block's layers are initialised from.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        norm = functools.partial(RMSNorm, config.hidden_size, eps=config.rms_norm_eps,
                                 param_dtype=config.param_dtype)
        self.attn_norm = norm()
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x: jax.Array, cos, sin, mask) -> jax.Array:
        """The block applied to `x`.

        Args:
          x: the hidden states, `[B, T, D]`.
          cos: the rotary table's cosines for the T positions, `[T, head_dim]`.
          sin: its sines, `[T, head_dim]`.
          mask: `[T, T]` booleans: which positions each query reads.

        Returns:
          The new hidden states, `[B, T, D]`.
        """
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))

    def decode(self, x: jax.Array, cos, sin, mask, cache: KVCache, layer: int,
               position) -> tuple[jax.Array, KVCache]:
        """`__call__` reading and extending the key/value cache: the arguments of
        `Attention.decode`, with `x` the block's input hidden states `[B, T, D]` (not
        normalised) and `layer` this block's index in the cache.

        Returns:
          `(hidden states [B, T, D], cache)`, the cache holding the new keys and values.
        """
        attended, cache = self.attn.decode(self.attn_norm(x), cos, sin, mask, cache, layer,
                                           position)
        x = x + attended
        return x + self.mlp(self.mlp_norm(x)), cache
