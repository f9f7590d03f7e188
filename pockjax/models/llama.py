"""A LLaMA-family decoder in Flax NNX: RMSNorm, rotary attention with grouped-query
heads, SwiGLU MLP.

Parameter paths are those of Hugging Face's `LlamaForCausalLM` in NNX form, so schemes
can name them: `embed/embedding` [V, D], `layers/{i}/attn_norm/scale`,
`layers/{i}/attn/{q,k,v,o}_proj/kernel`, `layers/{i}/mlp_norm/scale`,
`layers/{i}/mlp/{gate,up,down}_proj/kernel`, `norm/scale` and, unless the embeddings
are tied, `lm_head/kernel` [D, V]. Kernels are `[in, out]` (HF's weights transposed);
rotary embeddings use HF's "rotate half" layout, so HF checkpoints load as they are
(see `pockjax.models.hf`).

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> from pockjax.models.llama import Llama, LlamaConfig, generate
>>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
>>> model(jnp.zeros((2, 8), jnp.int32)).shape
(2, 8, 256)
>>> generate(model, jnp.zeros((1, 3), jnp.int32), max_new_tokens=4).shape
(1, 7)
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pockjax.data import check_token_ids

__all__ = ["LlamaConfig", "Llama", "LlamaBlock", "Attention", "MLP", "RMSNorm", "Linear",
           "upcast_matmul", "narrow_matmul", "cast_frozen", "generate", "num_params"]

# Hugging Face's `initializer_range` default for LLaMA.
_INIT = nnx.initializers.normal(stddev=0.02)
# LlamaConfig.remat choices.
REMAT = (None, "block")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape of a LLaMA-family model.

    `num_kv_heads` below `num_heads` is grouped-query attention (None: one k/v head per
    query head). `head_dim` None is `hidden_size // num_heads`; after construction both
    hold their resolved values.

    `param_dtype` is the dtype parameters are created in; `dtype` the one activations
    are computed in (None: the parameters' dtypes as they promote). Mixed precision is
    `dtype=jnp.float32` with some weights stored narrower (see `Linear`): each such
    weight is upcast where it is used, and that float32 copy lives only while its
    layer runs, forward and backward. The usual split for sparse fine-tuning keeps
    frozen weights in bfloat16 and trained ones as float32 masters, whose optimizer
    state is then float32 too (`pockjax.models.llama.cast_frozen`). `narrow_matmul="native"`
    instead multiplies narrow weights as they are, rounding the activations going into
    them to the weight's dtype and accumulating in `dtype` (autocast's numerics; much
    faster where the CPU has bfloat16 matrix instructions).

    `remat="block"` recomputes each block's activations in the backward pass
    (`jax.checkpoint` around the block, nothing saved inside it) instead of keeping
    them: less memory for the trained blocks, one more forward pass through them.
    Frozen blocks ahead of every trained one are not differentiated, so they keep
    nothing either way. `pockjax.nnx.Trainer(model, ..., remat="layers/*")` does the
    same for a model built without it (and for any NNX model with a list of blocks).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_embeddings: bool = False
    param_dtype: Any = jnp.float32
    dtype: Any = None
    narrow_matmul: str = "upcast"
    remat: str | None = None

    def __post_init__(self):
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "max_position_embeddings")
        for name in sizes + ("num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is None and name in ("num_kv_heads", "head_dim"):
                continue
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"LlamaConfig: hidden_size={self.hidden_size} is not divisible by "
                    f"num_heads={self.num_heads}; choose sizes that divide or give head_dim "
                    f"explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim={self.head_dim} must be even: rotary "
                             f"embeddings rotate pairs of channels")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: num_heads={self.num_heads} is not divisible by "
                             f"num_kv_heads={self.num_kv_heads}; each k/v head serves a whole "
                             f"group of query heads")
        for name in ("rms_norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LlamaConfig.{name} must be positive, got "
                                 f"{getattr(self, name)!r}")
        try:
            dtype = jnp.dtype(self.param_dtype)
        except TypeError:
            raise ValueError(f"LlamaConfig.param_dtype={self.param_dtype!r} is not a "
                             f"dtype") from None
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"LlamaConfig.param_dtype must be a float type, got {dtype}")
        object.__setattr__(self, "param_dtype", dtype)
        if self.dtype is not None:
            try:
                dtype = jnp.dtype(self.dtype)
            except TypeError:
                raise ValueError(f"LlamaConfig.dtype={self.dtype!r} is not a dtype") from None
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"LlamaConfig.dtype (the compute dtype) must be a float "
                                 f"type or None, got {dtype}")
            object.__setattr__(self, "dtype", dtype)
        if self.narrow_matmul not in NARROW_MATMUL:
            raise ValueError(f"LlamaConfig.narrow_matmul={self.narrow_matmul!r}: choose one of "
                             f"{', '.join(map(repr, NARROW_MATMUL))}")
        if self.remat not in REMAT:
            raise ValueError(f"LlamaConfig.remat={self.remat!r}: choose one of "
                             f"{', '.join(map(repr, REMAT))}")

    @classmethod
    def llama2_7b(cls, **overrides) -> "LlamaConfig":
        """LLaMA-2-7B's shape (6,738,415,616 parameters)."""
        return cls(**{**dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                             num_layers=32, num_heads=32, max_position_embeddings=4096),
                      **overrides})

    @classmethod
    def tinyllama_1b(cls, **overrides) -> "LlamaConfig":
        """TinyLlama-1.1B's shape (1,100,048,384 parameters; grouped-query attention with
        4 key/value heads)."""
        return cls(**{**dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                             num_layers=22, num_heads=32, num_kv_heads=4,
                             max_position_embeddings=2048), **overrides})

    @classmethod
    def tiny(cls, **overrides) -> "LlamaConfig":
        """A small model for tests and examples (grouped-query attention, 2 layers)."""
        return cls(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=172,
                             num_layers=2, num_heads=4, num_kv_heads=2,
                             max_position_embeddings=512),
                      **overrides})

    @classmethod
    def from_hf(cls, config: dict, **overrides) -> "LlamaConfig":
        """The config of a Hugging Face `config.json` (as a dict); `overrides` replace
        fields afterwards (e.g. `param_dtype=jnp.bfloat16`).

        Settings this model does not implement raise `ValueError` naming them: RoPE
        scaling (a `rope_scaling` or `rope_parameters` whose type is not "default"),
        biases in attention or MLP, an activation other than SiLU, another model_type.
        Both transformers 5's `rope_parameters` and the older top-level `rope_theta` are read.
        """
        def unsupported(field, value, why):
            raise ValueError(f"Hugging Face config {field}={value!r} is not supported: {why}")

        model_type = config.get("model_type", "llama")
        if model_type != "llama":
            unsupported("model_type", model_type, "LlamaConfig reads LLaMA configs "
                        "(model_type 'llama')")
        rope_scaling = config.get("rope_scaling")
        if rope_scaling is not None and _rope_type(rope_scaling) != "default":
            unsupported("rope_scaling", config["rope_scaling"], "only unscaled rotary "
                        "embeddings are implemented")
        rope_theta = config.get("rope_theta", 10000.0)
        rope_parameters = config.get("rope_parameters")
        if rope_parameters is not None:
            if _rope_type(rope_parameters) != "default":
                unsupported("rope_parameters", rope_parameters, "only unscaled rotary "
                            "embeddings (rope_type 'default') are implemented")
            rope_theta = rope_parameters.get("rope_theta", rope_theta)
        for field in ("attention_bias", "mlp_bias"):
            if config.get(field, False):
                unsupported(field, config[field], "the projections have no biases")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            unsupported("hidden_act", act, "the MLP is SwiGLU (silu)")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in config]
        if missing:
            raise ValueError(f"Hugging Face config lacks {', '.join(missing)}; is it a "
                             f"LlamaForCausalLM config.json?")
        fields = dict(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads"),
            head_dim=config.get("head_dim"),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
        return cls(**{**fields, **overrides})

    def to_hf(self) -> dict:
        """A Hugging Face `config.json` dict for this shape (`LlamaForCausalLM`)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "dtype": self.param_dtype.name,
        }


def _rope_type(params) -> str | None:
    if not isinstance(params, dict):
        return params
    return params.get("rope_type", params.get("type"))


class RMSNorm(nnx.Module):
    """`x * rsqrt(mean(x**2) + eps) * scale`, computed in float32."""

    def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * inv_rms * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def _upcast_after(w: jax.Array, x: jax.Array) -> jax.Array:
    """`w` upcast to `x`'s dtype, computed only once `x` exists.

    XLA's CPU scheduler would convert every parameter at the top of the step (a convert
    of a parameter depends on nothing else), keeping all the float32 copies alive at
    once, and it drops `optimization_barrier`s before scheduling; so the copy is tied to
    the layer's input by data: times `1 + 0 * x[0, ..., 0]` (that element replaced by 0
    when it is not finite, so an inf or NaN there stays where it is), exactly 1, fused
    into the conversion."""
    first = jax.lax.slice(x, (0,) * x.ndim, (1,) * x.ndim).reshape(())
    return w.astype(x.dtype) * (1 + 0 * jnp.where(jnp.isfinite(first), first, 0))


def _matmul(x: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    """`x @ w` over x's last axis (`x @ w.T` when `transposed`)."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1 if transposed else 0,)), ((), ())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def upcast_matmul(x: jax.Array, w: jax.Array, transposed: bool = False) -> jax.Array:
    """`x @ w` in `x`'s dtype for a narrower stored `w` (e.g. bfloat16 weights under
    float32 activations), upcasting `w` just before the product, forward and backward.

    The backward converts `w` again, after the layer's output gradient exists, rather
    than keeping the forward's float32 copy from the forward pass to the backward; `w`'s
    own gradient is returned in `w`'s dtype (and vanishes when `w` is frozen).
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
    """`x @ w` for a narrower stored `w`, with `x` rounded to `w`'s dtype and the
    product accumulated in `x`'s dtype (autocast's numerics), forward and backward.

    No weight is converted at all. On CPUs with bfloat16 matrix instructions (AVX512-BF16,
    AMX) XLA runs these products several times faster than float32 ones; the price is
    activations rounded to bfloat16 on their way into frozen layers.
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


def _project(x: jax.Array, w: jax.Array, dtype, transposed: bool = False,
             narrow: str = "upcast") -> jax.Array:
    """`x @ w` (or `x @ w.T`) computed in `dtype` (None: x's and w's promoted dtype); a
    narrower `w` goes through `NARROW_MATMUL[narrow]`."""
    dtype = jnp.result_type(x, w) if dtype is None else dtype
    x = x.astype(dtype)
    if _narrower(w.dtype, dtype):
        return NARROW_MATMUL[narrow](x, w, transposed)
    return _matmul(x, w.astype(dtype), transposed)


class Linear(nnx.Linear):
    """A bias-free `nnx.Linear` computed in `dtype`; a kernel stored narrower than that
    is upcast at its use only (`upcast_matmul`, never as a whole-model copy) or, with
    `narrow="native"`, multiplied as it is (`narrow_matmul`)."""

    def __init__(self, *args, narrow: str = "upcast", **kwargs):
        if kwargs.get("use_bias"):
            raise ValueError("pockjax.models.llama.Linear has no bias (LLaMA's projections have "
                             "none); use nnx.Linear for a layer with one")
        for name in ("precision", "dot_general", "dot_general_cls", "preferred_element_type"):
            if kwargs.get(name) is not None:
                raise ValueError(f"pockjax.models.llama.Linear does not take {name}=; it computes "
                                 f"in `dtype` with upcast_matmul/narrow_matmul")
        super().__init__(*args, **{"use_bias": False, **kwargs})
        self.narrow = narrow

    def __call__(self, x: jax.Array) -> jax.Array:
        return _project(x, self.kernel[...], self.dtype, narrow=self.narrow)


def _linear(d_in: int, d_out: int, config: LlamaConfig, rngs: nnx.Rngs) -> Linear:
    return Linear(d_in, d_out, use_bias=False, param_dtype=config.param_dtype,
                  dtype=config.dtype, narrow=config.narrow_matmul, kernel_init=_INIT, rngs=rngs)


def rope_tables(length: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """`cos`, `sin` [length, head_dim] for positions 0..length-1 in HF's layout: both
    halves of a head hold the same frequencies."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2).astype(np.float32) / head_dim))
    angles = np.arange(length, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles), np.sin(angles)


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


class Attention(nnx.Module):
    """Causal self-attention with rotary embeddings and grouped-query heads."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.q_proj = _linear(d, config.num_heads * hd, config, rngs)
        self.k_proj = _linear(d, config.num_kv_heads * hd, config, rngs)
        self.v_proj = _linear(d, config.num_kv_heads * hd, config, rngs)
        self.o_proj = _linear(config.num_heads * hd, d, config, rngs)

    def __call__(self, x: jax.Array, cos, sin, mask) -> jax.Array:
        b, t, _ = x.shape
        kv, hd = self.num_kv_heads, self.head_dim
        group = self.num_heads // kv
        q = apply_rope(self.q_proj(x).reshape(b, t, kv * group, hd), cos, sin)
        k = apply_rope(self.k_proj(x).reshape(b, t, kv, hd), cos, sin)
        v = self.v_proj(x).reshape(b, t, kv, hd)
        # Query head h reads k/v head h // group: the same as repeating each k/v head
        # `group` times (HF's repeat_kv), without materialising the copies.
        q = q.reshape(b, t, kv, group, hd)
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) * hd ** -0.5
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
        return self.o_proj(out.reshape(b, t, kv * group * hd))


class MLP(nnx.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(d, f, config, rngs)
        self.up_proj = _linear(d, f, config, rngs)
        self.down_proj = _linear(f, d, config, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nnx.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        norm = functools.partial(RMSNorm, config.hidden_size, eps=config.rms_norm_eps,
                                 param_dtype=config.param_dtype)
        self.attn_norm = norm()
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x: jax.Array, cos, sin, mask) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    """A LLaMA-family causal language model: `model(tokens [B, T]) -> logits [B, T, V]`
    (float32), each position attending to itself and the ones before it."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.hidden_size,
                               param_dtype=config.param_dtype, embedding_init=_INIT, rngs=rngs)
        self.layers = nnx.List([LlamaBlock(config, rngs=rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                            param_dtype=config.param_dtype)
        if not config.tie_embeddings:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, config, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if tokens.ndim != 2:
            raise ValueError(f"Llama takes tokens [batch, length], got shape {tokens.shape}")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"Llama takes integer token ids, got {tokens.dtype}"
                            f"{list(tokens.shape)}; convert them with .astype(jnp.int32)")
        if not isinstance(tokens, jax.core.Tracer):
            check_token_ids(tokens, self.config.vocab_size)
        length = tokens.shape[1]
        cfg = self.config
        if length > cfg.max_position_embeddings:
            raise ValueError(f"Llama: {length} tokens exceed max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        cos, sin = rope_tables(length, cfg.head_dim, cfg.rope_theta)
        # Computed, not a constant: a stored boolean tensor is wrong on GPU targets
        # without 8-bit storage (see pockjax.export), and this fuses into the softmax.
        positions = jnp.arange(length)
        mask = positions[:, None] >= positions[None, :]
        # The looked-up rows only are cast (nnx.Embed would cast the whole table first).
        # Inside a compiled step ids cannot be checked: one outside the vocabulary reads
        # a row of NaN (a negative one would wrap around), so the loss shows it.
        valid = (tokens >= 0) & (tokens < cfg.vocab_size)
        h = jnp.take(self.embed.embedding[...], jnp.where(valid, tokens, 0), axis=0)
        h = jnp.where(valid[..., None], h, jnp.nan)
        if cfg.dtype is not None:
            h = h.astype(cfg.dtype)
        for layer in self.layers:
            h = _remat_block(layer, h, cos, sin, mask) if cfg.remat == "block" else \
                layer(h, cos, sin, mask)
        h = self.norm(h)
        logits = (_project(h, self.embed.embedding[...], cfg.dtype, transposed=True,
                           narrow=cfg.narrow_matmul)
                  if cfg.tie_embeddings else self.lm_head(h))
        return _unfused(logits.astype(jnp.float32))


def _unfused(logits: jax.Array) -> jax.Array:
    """`logits` (float32) unchanged, as a value XLA's CPU compiler will not fuse into the
    head's product.

    Without it, the loss's reductions over the vocabulary (log-softmax's max) are fused
    into the head's YNNPACK dot, which then runs about 2.5 times slower: TinyLlama's head,
    [127, 2048] @ [2048, 32000] in float32, 186 ms against 74 ms for the dot and its
    reduction apart; 321 ms in the sparse training step, 2.70 -> 2.43 s per step
    (benchmarks/results/profile_llama_1.1b.md). `reduce_precision` to float32's own 8
    exponent and 23 mantissa bits is the identity (NaN, infinities and subnormals
    included) and XLA keeps it; `lax.optimization_barrier` is dropped before fusion.
    """
    return jax.lax.reduce_precision(logits, exponent_bits=8, mantissa_bits=23)


def _remat_block(layer: LlamaBlock, h, cos, sin, mask):
    """`layer(h, ...)` under `jax.checkpoint`, saving nothing inside the block: the
    backward pass recomputes the block from its input (and its weights' upcasts with it),
    once the block output's cotangent exists (see `pockjax.train.checkpoint_call`; with
    plain `jax.checkpoint` XLA's CPU scheduler moved the recomputation next to the
    forward pass, and nothing was saved). The same mechanism as
    `pockjax.nnx.Trainer(remat="layers/*")`."""
    from pockjax.train import checkpoint_call

    graphdef, state = nnx.split(layer)

    def run(state, h, mask):
        return nnx.merge(graphdef, state)(h, cos, sin, mask)

    return checkpoint_call(run, jax.checkpoint_policies.nothing_saveable, state, h, mask,
                           recompute_after_cotangent=True, untied=(0,))


def num_params(config: LlamaConfig) -> int:
    """The number of parameters of `Llama(config)`, counted without allocating them."""
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def generate(model: Llama, prompt: jax.Array, max_new_tokens: int, *,
             stop_token: int | None = None) -> jax.Array:
    """Greedy decoding: `prompt` [B, T0] followed by `max_new_tokens` argmax tokens.

    Each step runs the whole forward pass over a fixed buffer of T0 + max_new_tokens
    tokens (no KV cache; causality makes the not-yet-written tail harmless), so the
    loop compiles once. After a sequence emits `stop_token`, the rest of it is
    `stop_token`.
    """
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"generate takes integer tokens [batch, length], got "
                         f"{prompt.dtype}{list(prompt.shape)}")
    if prompt.shape[1] == 0:
        raise ValueError("generate needs a prompt of at least one token")
    check_token_ids(prompt, model.config.vocab_size, where=" in the prompt")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    total = prompt.shape[1] + max_new_tokens
    if total > model.config.max_position_embeddings:
        raise ValueError(f"generate: prompt ({prompt.shape[1]}) + max_new_tokens "
                         f"({max_new_tokens}) exceed max_position_embeddings="
                         f"{model.config.max_position_embeddings}")
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, prompt, int(max_new_tokens), stop_token)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _generate(graphdef, state, prompt, max_new_tokens, stop_token):
    batch, start = prompt.shape
    buffer = jnp.pad(prompt, ((0, 0), (0, max_new_tokens)))
    done = jnp.zeros((batch,), bool)

    def step(t, carry):
        buffer, done = carry
        logits = nnx.merge(graphdef, state)(buffer)
        token = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, t - 1, axis=1, keepdims=False),
                           axis=-1).astype(buffer.dtype)
        if stop_token is not None:
            token = jnp.where(done, stop_token, token)
            done = done | (token == stop_token)
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, token, t, axis=1)
        return buffer, done

    buffer, _ = jax.lax.fori_loop(start, start + max_new_tokens, step, (buffer, done))
    return buffer


def cast_frozen(params, scheme, dtype=jnp.bfloat16, trained_dtype=jnp.float32):
    """`params` with the leaves `scheme` freezes stored in `dtype` and the rest in
    `trained_dtype`: the mixed-precision layout for sparse fine-tuning (use it with a
    `LlamaConfig(dtype=jnp.float32)` model). Trained leaves stay float32 masters, so the
    optimizer state `SparseTrainer.init` makes for them is float32 too. Works on arrays
    and on `jax.ShapeDtypeStruct`s (to lower or size a step without allocating it).

    >>> import pockjax as pj
    >>> model = Llama(LlamaConfig.tiny(dtype=jnp.float32), rngs=nnx.Rngs(0))
    >>> _, params, _ = pj.nnx.split(model)
    >>> layers = cast_frozen(params, pj.schemes.last_blocks(params, 1))["layers"]
    >>> layers[0]["mlp"]["up_proj"]["kernel"].dtype, layers[1]["mlp"]["up_proj"]["kernel"].dtype
    (dtype(bfloat16), dtype('float32'))
    """
    from pockjax.scheme import Frozen

    decisions = scheme.resolve(params)

    def cast(x, decision):
        want = jnp.dtype(dtype if isinstance(decision, Frozen) else trained_dtype)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, want)
        return x if x.dtype == want else x.astype(want)

    return jax.tree.map(cast, params, decisions)
