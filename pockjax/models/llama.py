"""A LLaMA-family decoder in Flax NNX: RMSNorm, rotary attention with grouped-query
heads, SwiGLU MLP; with a key/value cache for decoding (`Llama.decode`, `generate`).

The families that share this shape (`SUPPORTED_FAMILIES`, `LlamaConfig.model_type`):
LLaMA (with its optional `attention_bias` and `mlp_bias`), Mistral (a sliding-window
causal mask) and Qwen2 (biases on the q/k/v projections).

Parameter paths are those of Hugging Face's `LlamaForCausalLM` in NNX form, so schemes
can name them: `embed/embedding` [V, D], `layers/{i}/attn_norm/scale`,
`layers/{i}/attn/{q,k,v,o}_proj/kernel`, `layers/{i}/mlp_norm/scale`,
`layers/{i}/mlp/{gate,up,down}_proj/kernel`, `norm/scale` and, unless the embeddings
are tied, `lm_head/kernel` [D, V]; a projection with a bias has it at `.../bias` [out].
Kernels are `[in, out]` (HF's weights transposed); rotary embeddings use HF's "rotate
half" layout, so HF checkpoints load as they are (see `pockjax.models.hf`).

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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pockjax.data import check_token_ids

__all__ = ["LlamaConfig", "Llama", "LlamaBlock", "Attention", "MLP", "RMSNorm", "Linear",
           "KVCache", "upcast_matmul", "narrow_matmul", "cast_frozen", "generate", "num_params",
           "SUPPORTED_FAMILIES"]

# Hugging Face's `initializer_range` default for LLaMA.
_INIT = nnx.initializers.normal(stddev=0.02)
# LlamaConfig.remat choices.
REMAT = (None, "block")


@dataclasses.dataclass(frozen=True)
class _Family:
    """A Hugging Face model_type this module implements: the class `to_hf` names (so
    `AutoModelForCausalLM` builds it), the `LlamaConfig` fields its architecture fixes
    (Hugging Face's class has no switch for them), and how the family's own config
    fields are read (`read(config, unsupported) -> LlamaConfig fields`, where
    `unsupported(field, value, why)` raises) and written (`write(llama_config) -> dict`)."""
    architecture: str
    fixed: dict
    read: Any
    write: Any


# transformers' sliding_window for Mistral and Qwen2 when a config.json has none.
_HF_WINDOW = 4096


def _llama_from_hf(config, unsupported) -> dict:
    return dict(attention_bias=bool(config.get("attention_bias", False)),
                mlp_bias=bool(config.get("mlp_bias", False)))


def _llama_to_hf(c: LlamaConfig) -> dict:
    return {"attention_bias": c.attention_bias, "mlp_bias": c.mlp_bias}


def _mistral_from_hf(config, unsupported) -> dict:
    return dict(sliding_window=config.get("sliding_window", _HF_WINDOW))


def _mistral_to_hf(c: LlamaConfig) -> dict:
    return {"sliding_window": c.sliding_window}


def _qwen2_from_hf(config, unsupported) -> dict:
    # transformers' Qwen2 gives a layer a window only when use_sliding_window is on, a
    # window is set and the layer's type (given, or from max_window_layers) says so.
    window = config.get("sliding_window", _HF_WINDOW) if config.get("use_sliding_window") else None
    layers = config["num_hidden_layers"]
    types = config.get("layer_types") or [
        "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention"
        for i in range(layers)]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if window is not None and sliding:
        unsupported("use_sliding_window", True, f"layers {sliding} of this Qwen2 model use "
                    f"sliding-window attention, which the Flax LLaMA implements for Mistral "
                    f"only (released Qwen2 and Qwen2.5 checkpoints set use_sliding_window "
                    f"false); load this one through pockjax.torch")
    return dict(qkv_bias=True)


def _qwen2_to_hf(c: LlamaConfig) -> dict:
    return {"use_sliding_window": False, "sliding_window": None,
            "max_window_layers": c.num_layers}


_FAMILIES = {
    "llama": _Family("LlamaForCausalLM", {"qkv_bias": False, "sliding_window": None},
                     _llama_from_hf, _llama_to_hf),
    "mistral": _Family("MistralForCausalLM", {"attention_bias": False, "qkv_bias": False,
                                              "mlp_bias": False},
                       _mistral_from_hf, _mistral_to_hf),
    "qwen2": _Family("Qwen2ForCausalLM", {"attention_bias": False, "qkv_bias": True,
                                          "mlp_bias": False, "sliding_window": None},
                     _qwen2_from_hf, _qwen2_to_hf),
}
# The Hugging Face model_types that load as a `Llama`.
SUPPORTED_FAMILIES = tuple(_FAMILIES)
"""The Hugging Face `model_type`s that load as a `Llama`: `llama`, `mistral`, `qwen2`."""
_OTHER_ARCHITECTURES = ("other architectures load through pockjax.torch "
                        "(pockjax.torch.functional on the transformers model)")


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

    `model_type` is the Hugging Face family (`SUPPORTED_FAMILIES`) the model is saved
    as; it fixes what that family's class cannot vary. `attention_bias` puts biases on
    all four attention projections (LLaMA's option), `qkv_bias` on q, k and v only
    (Qwen2; None: True for qwen2, else False), `mlp_bias` on the three MLP projections.
    `sliding_window` (Mistral) lets each position attend to itself and the
    `sliding_window - 1` positions before it, as Hugging Face's Mistral does; None
    attends to every earlier position.

    Attributes:
      vocab_size: the number of token ids.
      hidden_size: the width of the residual stream.
      intermediate_size: the width of the MLP's hidden layer.
      num_layers: the number of blocks.
      num_heads: the number of query heads.
      num_kv_heads: the number of key/value heads, dividing `num_heads`; None (resolved
        at construction): `num_heads`.
      head_dim: the width of one head, even; None (resolved at construction):
        `hidden_size // num_heads`.
      rms_norm_eps: the epsilon of every RMSNorm (default 1e-5).
      rope_theta: the rotary embeddings' base (default 10000).
      max_position_embeddings: the longest sequence the model takes (default 2048).
      tie_embeddings: use the embedding table as the output projection (no
        `lm_head`).
      param_dtype: the float dtype parameters are created in (default float32).
      dtype: the float dtype activations are computed in; None: the parameters'
        dtypes as they promote.
      narrow_matmul: how a weight stored narrower than `dtype` multiplies: `"upcast"`
        (default, `upcast_matmul`) or `"native"` (`narrow_matmul`).
      remat: `"block"` recomputes each block in the backward pass; None (default)
        keeps the activations.
      model_type: the Hugging Face family, one of `SUPPORTED_FAMILIES` (default
        `"llama"`).
      attention_bias: biases on all four attention projections (llama only).
      qkv_bias: biases on the q, k and v projections; None (resolved at
        construction): True for qwen2, else False.
      mlp_bias: biases on the three MLP projections (llama only).
      sliding_window: the attention window of each position, itself included
        (mistral only); None: every earlier position.

    Raises:
      ValueError: a size that is not a positive integer, `hidden_size` not divisible
        by `num_heads` (without `head_dim`), an odd `head_dim`, `num_heads` not
        divisible by `num_kv_heads`, a non-positive `rms_norm_eps` or `rope_theta`, a
        `param_dtype` or `dtype` that is not a float type, an unknown `narrow_matmul`,
        `remat` or `model_type`, a bias flag that is not a bool, a `sliding_window`
        that is not a positive integer, or a setting the family's Hugging Face class
        cannot hold.
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
    model_type: str = "llama"
    attention_bias: bool = False
    qkv_bias: bool | None = None
    mlp_bias: bool = False
    sliding_window: int | None = None

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
        self._check_family()

    def _check_family(self):
        family = _FAMILIES.get(self.model_type)
        if family is None:
            raise ValueError(f"LlamaConfig.model_type={self.model_type!r}: this model "
                             f"implements {', '.join(SUPPORTED_FAMILIES)}; "
                             f"{_OTHER_ARCHITECTURES}")
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", family.fixed.get("qkv_bias", False))
        for name in ("attention_bias", "qkv_bias", "mlp_bias"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"LlamaConfig.{name} must be True or False, got "
                                 f"{getattr(self, name)!r}")
        window = self.sliding_window
        if window is not None and (not isinstance(window, (int, np.integer))
                                   or isinstance(window, bool) or window <= 0):
            raise ValueError(f"LlamaConfig.sliding_window must be a positive integer or None, "
                             f"got {window!r}")
        for name, want in family.fixed.items():
            if getattr(self, name) != want:
                raise ValueError(
                    f"LlamaConfig(model_type={self.model_type!r}) has {name}={want!r}, "
                    f"got {name}={getattr(self, name)!r}: Hugging Face's "
                    f"{family.architecture} cannot hold another value; choose the "
                    f"model_type whose architecture has it "
                    f"(llama: attention_bias, mlp_bias; mistral: sliding_window; "
                    f"qwen2: qkv_bias)")

    @property
    def biased(self) -> frozenset[str]:
        """The names of the projections that have a bias (`q_proj`, ..., `down_proj`)."""
        names = set()
        if self.attention_bias or self.qkv_bias:
            names |= {"q_proj", "k_proj", "v_proj"}
        if self.attention_bias:
            names.add("o_proj")
        if self.mlp_bias:
            names |= {"gate_proj", "up_proj", "down_proj"}
        return frozenset(names)

    @classmethod
    def llama2_7b(cls, **overrides) -> "LlamaConfig":
        """LLaMA-2-7B's shape (6,738,415,616 parameters).

        Args:
          **overrides: fields that replace the shape's (e.g. `num_layers=4`).

        Returns:
          The `LlamaConfig`.
        """
        return cls(**{**dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                             num_layers=32, num_heads=32, max_position_embeddings=4096),
                      **overrides})

    @classmethod
    def tinyllama_1b(cls, **overrides) -> "LlamaConfig":
        """TinyLlama-1.1B's shape (1,100,048,384 parameters; grouped-query attention with
        4 key/value heads).

        Args:
          **overrides: fields that replace the shape's (e.g. `num_layers=4`).

        Returns:
          The `LlamaConfig`.
        """
        return cls(**{**dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                             num_layers=22, num_heads=32, num_kv_heads=4,
                             max_position_embeddings=2048), **overrides})

    @classmethod
    def tiny(cls, **overrides) -> "LlamaConfig":
        """A small model for tests and examples (grouped-query attention, 2 layers).

        Args:
          **overrides: fields that replace the shape's (e.g. `dtype=jnp.float32`).

        Returns:
          The `LlamaConfig`.
        """
        return cls(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=172,
                             num_layers=2, num_heads=4, num_kv_heads=2,
                             max_position_embeddings=512),
                      **overrides})

    @classmethod
    def from_hf(cls, config: dict, **overrides) -> "LlamaConfig":
        """The config of a Hugging Face `config.json` of one of `SUPPORTED_FAMILIES`.

        Both transformers 5's `rope_parameters` and the older top-level `rope_theta`
        are read. LLaMA's `attention_bias` and `mlp_bias`, Mistral's `sliding_window`
        and Qwen2's q/k/v biases carry over; so does `model_type`, so `to_hf` writes
        the same family back.

        Args:
          config: the parsed `config.json`.
          **overrides: fields replaced afterwards (e.g. `param_dtype=jnp.bfloat16`).

        Returns:
          The `LlamaConfig`.

        Raises:
          ValueError: a setting this model does not implement, named with its value: a
            model_type outside `SUPPORTED_FAMILIES` (other architectures load through
            `pockjax.torch`), RoPE scaling (a `rope_scaling` or `rope_parameters` whose
            type is not "default"), an activation other than SiLU, Qwen2 layers with
            sliding-window attention; or a config without the model's sizes.
        """
        def unsupported(field, value, why):
            raise ValueError(f"Hugging Face config {field}={value!r} is not supported: {why}")

        model_type = config.get("model_type", "llama")
        if model_type not in _FAMILIES:
            unsupported("model_type", model_type, f"the Flax LLaMA (pockjax.models.llama) "
                        f"reads the families {', '.join(SUPPORTED_FAMILIES)}; "
                        f"{_OTHER_ARCHITECTURES}")
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
        act = config.get("hidden_act", "silu")
        if act != "silu":
            unsupported("hidden_act", act, "the MLP is SwiGLU (silu)")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in config]
        if missing:
            raise ValueError(f"Hugging Face config lacks {', '.join(missing)}; is it the "
                             f"config.json of a causal language model?")
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
            model_type=model_type,
            **_FAMILIES[model_type].read(config, unsupported),
        )
        return cls(**{**fields, **overrides})

    def to_hf(self) -> dict:
        """A Hugging Face `config.json` dict for this model.

        It names the family's `model_type` and class (`LlamaForCausalLM`,
        `MistralForCausalLM` or `Qwen2ForCausalLM`), so
        `transformers.AutoModelForCausalLM` builds the same model.

        Returns:
          The config as a JSON-serialisable dict.
        """
        return {
            "architectures": [_FAMILIES[self.model_type].architecture],
            "model_type": self.model_type,
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
            **_FAMILIES[self.model_type].write(self),
            "dtype": self.param_dtype.name,
        }


def _rope_type(params) -> str | None:
    if not isinstance(params, dict):
        return params
    return params.get("rope_type", params.get("type"))


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
    layers.

    Args:
      x: the activations; the product contracts their last axis.
      w: the weight, `[in, out]` (`[out, in]` when `transposed`).
      transposed: compute `x @ w.T` instead.

    Returns:
      The product, in `x`'s dtype.
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
        y = _project(x, self.kernel[...], self.dtype, narrow=self.narrow)
        if self.bias is None:
            return y
        # An explicit broadcast: sparse_grad narrows `broadcast_in_dim`, not the
        # size-1 broadcasting inside `add`.
        return y + jnp.broadcast_to(self.bias[...].astype(y.dtype), y.shape)


def _linear(d_in: int, d_out: int, config: LlamaConfig, rngs: nnx.Rngs,
            bias: bool = False) -> Linear:
    return Linear(d_in, d_out, use_bias=bias, param_dtype=config.param_dtype,
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
        self.q_proj = _linear(d, config.num_heads * hd, config, rngs, "q_proj" in biased)
        self.k_proj = _linear(d, config.num_kv_heads * hd, config, rngs, "k_proj" in biased)
        self.v_proj = _linear(d, config.num_kv_heads * hd, config, rngs, "v_proj" in biased)
        self.o_proj = _linear(config.num_heads * hd, d, config, rngs, "o_proj" in biased)

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
        q = q.reshape(b, t, kv, group, hd)
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) * hd ** -0.5
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
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
        self.gate_proj = _linear(d, f, config, rngs, bias)
        self.up_proj = _linear(d, f, config, rngs, bias)
        self.down_proj = _linear(f, d, config, rngs, bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        """The MLP of `x`.

        Args:
          x: hidden states, `[..., hidden_size]`.

        Returns:
          The output, `[..., hidden_size]`.
        """
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


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
        """`__call__` reading and extending the key/value cache (see `Attention.decode`).

        Args:
          x: the hidden states, `[B, T, D]`.
          cos: the rotary table's cosines for the T positions, `[T, head_dim]`.
          sin: its sines, `[T, head_dim]`.
          mask: `[T, cache length]` booleans: which cache entries each query reads.
          cache: the key/value cache.
          layer: this block's index in the cache.
          position: the position of `x`'s first token.

        Returns:
          `(hidden states [B, T, D], cache)`, the cache holding the new keys and values.
        """
        attended, cache = self.attn.decode(self.attn_norm(x), cos, sin, mask, cache, layer,
                                           position)
        x = x + attended
        return x + self.mlp(self.mlp_norm(x)), cache


class Llama(nnx.Module):
    """A LLaMA-family causal language model: `model(tokens [B, T]) -> logits [B, T, V]`
    (float32), each position attending to itself and the ones before it (the last
    `sliding_window` of them when the config has one).

    `decode` runs the same model over a key/value cache (`init_cache`), a few tokens at
    a time: `generate` prefills the prompt in one call and then decodes one token per step.

    Args:
      config: the model's shape and family.
      rngs: the random streams the parameters are initialised from.
    """

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
        """The logits of every position of `tokens`.

        Args:
          tokens: integer ids, `[B, T]`, T at most `max_position_embeddings`.

        Returns:
          The logits, `[B, T, vocab_size]` float32.

        Raises:
          ValueError: `tokens` are not `[batch, length]`, are longer than
            `max_position_embeddings`, or hold ids outside the vocabulary (checked when
            concrete).
          TypeError: `tokens` are not integers.
        """
        self._check_tokens(tokens, "Llama")
        length = tokens.shape[1]
        cfg = self.config
        if length > cfg.max_position_embeddings:
            raise ValueError(f"Llama: {length} tokens exceed max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        cos, sin = rope_tables(length, cfg.head_dim, cfg.rope_theta)
        # Computed, not a constant: a stored boolean tensor is wrong on GPU targets
        # without 8-bit storage (see pockjax.export), and this fuses into the softmax.
        positions = jnp.arange(length)
        mask = self._mask(positions, positions)
        h = self._embed(tokens)
        for layer in self.layers:
            h = _remat_block(layer, h, cos, sin, mask) if cfg.remat == "block" else \
                layer(h, cos, sin, mask)
        return self._head(h)

    def init_cache(self, batch: int, length: int) -> KVCache:
        """An empty key/value cache for `batch` sequences of up to `length` tokens.

        Its dtype is `config.dtype`, or else the widest parameter dtype (what the keys
        and values are computed in).

        Args:
          batch: the number of sequences decoded together.
          length: the most positions a sequence can reach (prompt and new tokens).

        Returns:
          A `KVCache` of zeros, each array [layers, batch, length, kv_heads, head_dim].

        Raises:
          ValueError: `length` exceeds `max_position_embeddings`.
        """
        cfg = self.config
        if length > cfg.max_position_embeddings:
            raise ValueError(f"Llama.init_cache: length {length} exceeds "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        dtype = cfg.dtype or jnp.result_type(
            *(x.dtype for x in jax.tree.leaves(nnx.state(self, nnx.Param))))
        shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def decode(self, tokens: jax.Array, cache: KVCache,
               position: int | jax.Array) -> tuple[jax.Array, KVCache]:
        """The logits of `tokens`, the continuation of sequences whose first `position`
        tokens are in `cache`: the same values as `model(whole sequences)` gives at those
        positions, up to rounding.

        Args:
          tokens: integer ids [B, T] for positions `position`..`position + T - 1`.
          cache: the keys and values of positions before `position` (`init_cache`,
            then what earlier calls returned).
          position: where `tokens` start; an int or a traced int32 scalar (jit-friendly:
            one compiled program serves every position).

        Returns:
          `(logits [B, T, V] float32, cache)`, the cache extended with `tokens`' keys
          and values.

        Raises:
          ValueError: `tokens` are not [batch, length], hold ids outside the vocabulary
            (checked when concrete), or do not fit the cache (its batch, or positions
            past its length).
          TypeError: `tokens` are not integers.
        """
        self._check_tokens(tokens, "Llama.decode")
        h, cache = self._decode_hidden(tokens, cache, position)
        return self._head(h), cache

    def _decode_hidden(self, tokens, cache: KVCache, position):
        """The final hidden states [B, T, D] of `decode` (before the norm and head)."""
        cfg = self.config
        batch, t = tokens.shape
        length = cache.k.shape[2]
        if cache.k.shape[:2] != (cfg.num_layers, batch):
            raise ValueError(f"Llama.decode: the cache holds {cache.k.shape[1]} sequences of "
                             f"{cache.k.shape[0]} layers; tokens are {batch} sequences for "
                             f"{cfg.num_layers} layers; make it with "
                             f"model.init_cache({batch}, length)")
        if not isinstance(position, jax.core.Tracer) and int(position) + t > length:
            raise ValueError(f"Llama.decode: tokens at positions {int(position)}.."
                             f"{int(position) + t - 1} do not fit a cache of length {length}; "
                             f"make it with model.init_cache({batch}, length) for a longer length")
        position = jnp.asarray(position, jnp.int32)
        cos, sin = rope_tables(length, cfg.head_dim, cfg.rope_theta)
        cos = jax.lax.dynamic_slice_in_dim(jnp.asarray(cos), position, t)
        sin = jax.lax.dynamic_slice_in_dim(jnp.asarray(sin), position, t)
        mask = self._mask(position + jnp.arange(t, dtype=jnp.int32),
                          jnp.arange(length, dtype=jnp.int32))
        h = self._embed(tokens)
        for i, layer in enumerate(self.layers):
            h, cache = layer.decode(h, cos, sin, mask, cache, i, position)
        return h, cache

    def _check_tokens(self, tokens, where: str):
        if tokens.ndim != 2:
            raise ValueError(f"{where} takes tokens [batch, length], got shape {tokens.shape}")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"{where} takes integer token ids, got {tokens.dtype}"
                            f"{list(tokens.shape)}; convert them with .astype(jnp.int32)")
        if not isinstance(tokens, jax.core.Tracer):
            check_token_ids(tokens, self.config.vocab_size)

    def _mask(self, queries: jax.Array, keys: jax.Array) -> jax.Array:
        """[len(queries), len(keys)]: which key positions each query position reads."""
        mask = queries[:, None] >= keys[None, :]
        window = self.config.sliding_window
        # Without a window, or with one no sequence here can exceed, the plain causal
        # mask: the same program as a model without the setting.
        if window is not None and window < keys.shape[0]:
            mask = mask & (queries[:, None] - keys[None, :] < window)
        return mask

    def _embed(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        # The looked-up rows only are cast (nnx.Embed would cast the whole table first).
        # Inside a compiled step ids cannot be checked: one outside the vocabulary reads
        # a row of NaN (a negative one would wrap around), so the loss shows it.
        valid = (tokens >= 0) & (tokens < cfg.vocab_size)
        h = jnp.take(self.embed.embedding[...], jnp.where(valid, tokens, 0), axis=0)
        h = jnp.where(valid[..., None], h, jnp.nan)
        return h if cfg.dtype is None else h.astype(cfg.dtype)

    def _head(self, h: jax.Array) -> jax.Array:
        cfg = self.config
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
    """The number of parameters of `Llama(config)`, counted without allocating them.

    Args:
      config: the model's shape.

    Returns:
      The number of parameter values.
    """
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def generate(model: Llama, prompt: jax.Array, max_new_tokens: int, *,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             stop_token: int | None = None) -> jax.Array:
    """`prompt` followed by `max_new_tokens` tokens decoded with a key/value cache.

    The prompt is run in one call (`Llama.decode`), then one token per step inside a
    compiled loop. The whole generation is one program, compiled once per model
    structure, batch, prompt length, `max_new_tokens`, `stop_token` and greedy-or-not;
    a second call with the same shapes reuses it (time that one for tokens/s).
    The sequences of a batch share one prompt length (pad them to equal length yourself;
    no attention mask is applied).

    Args:
      model: the `Llama`.
      prompt: integer ids [B, T0], T0 >= 1.
      max_new_tokens: how many tokens to add (0 returns the prompt).
      temperature: 0 for greedy decoding (the argmax); above 0, tokens are sampled from
        `softmax(logits / temperature)`.
      top_p: sampling keeps the smallest set of most likely tokens whose probability
        reaches `top_p` (nucleus sampling); 1 keeps all. Ignored when greedy.
      seed: the sampling seed; the same seed gives the same tokens. Ignored when greedy.
      stop_token: once a sequence emits it, the rest of that sequence is `stop_token`,
        and decoding ends early when every sequence has.

    Returns:
      Tokens [B, T0 + max_new_tokens], the prompt first.

    Raises:
      ValueError: a prompt that is not integer ids [B, T0 >= 1] or holds ids outside
        the vocabulary, a negative `max_new_tokens`, a total length past
        `max_position_embeddings`, a `temperature` below 0 or not finite, a `top_p`
        outside (0, 1], a `stop_token` outside the vocabulary, or a `seed` that is not
        an integer.

    Examples:
      >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
      >>> generate(model, jnp.zeros((2, 3), jnp.int32), 5, temperature=0.8, top_p=0.9).shape
      (2, 8)
    """
    prompt = jnp.asarray(prompt)
    vocab = model.config.vocab_size
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"generate takes integer tokens [batch, length], got "
                         f"{prompt.dtype}{list(prompt.shape)}")
    if prompt.shape[1] == 0:
        raise ValueError("generate needs a prompt of at least one token")
    check_token_ids(prompt, vocab, where=" in the prompt")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0 and an integer, got {max_new_tokens!r}")
    total = prompt.shape[1] + max_new_tokens
    if total > model.config.max_position_embeddings:
        raise ValueError(f"generate: prompt ({prompt.shape[1]}) + max_new_tokens "
                         f"({max_new_tokens}) exceed max_position_embeddings="
                         f"{model.config.max_position_embeddings}")
    if not (isinstance(temperature, (int, float, np.number)) and math.isfinite(temperature)
            and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got "
                         f"{temperature!r}")
    if not (isinstance(top_p, (int, float, np.number)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {top_p!r}")
    if stop_token is not None and not (isinstance(stop_token, (int, np.integer))
                                       and 0 <= stop_token < vocab):
        raise ValueError(f"stop_token={stop_token!r} is not a token id of the vocabulary "
                         f"[0, {vocab})")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if max_new_tokens == 0:
        return prompt
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, prompt, jax.random.key(seed),
                     jnp.float32(temperature), jnp.float32(top_p),
                     max_new_tokens=int(max_new_tokens),
                     stop_token=None if stop_token is None else int(stop_token),
                     sample=temperature > 0)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "stop_token",
                                             "sample"))
def _generate(graphdef, state, prompt, key, temperature, top_p, *, max_new_tokens,
              stop_token, sample):
    model = nnx.merge(graphdef, state)
    batch, start = prompt.shape
    fill = 0 if stop_token is None else stop_token
    # The tail starts as stop tokens, so stopping early leaves what running on would.
    buffer = jnp.concatenate([prompt, jnp.full((batch, max_new_tokens), fill, prompt.dtype)],
                             axis=1)

    def emit(i, hidden, buffer, done):
        """Choose new token `i` from the last position's hidden state and write it."""
        logits = model._head(hidden[:, -1:])[:, 0]
        if sample:
            token = _sample(logits, jax.random.fold_in(key, i), temperature, top_p)
        else:
            token = jnp.argmax(logits, axis=-1)
        token = token.astype(buffer.dtype)
        if stop_token is not None:
            token = jnp.where(done, stop_token, token)
            done = done | (token == stop_token)
        return token, jax.lax.dynamic_update_index_in_dim(buffer, token, start + i, 1), done

    cache = model.init_cache(batch, start + max_new_tokens)
    hidden, cache = model._decode_hidden(prompt, cache, 0)
    token, buffer, done = emit(0, hidden, buffer, jnp.zeros((batch,), bool))

    def more(carry):
        i, _, _, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def step(carry):
        i, token, buffer, done, cache = carry
        hidden, cache = model._decode_hidden(token[:, None], cache, start + i - 1)
        token, buffer, done = emit(i, hidden, buffer, done)
        return i + 1, token, buffer, done, cache

    _, _, buffer, _, _ = jax.lax.while_loop(more, step, (1, token, buffer, done, cache))
    return buffer


def _sample(logits: jax.Array, key, temperature, top_p) -> jax.Array:
    """A token per row of `logits` [B, V] from `softmax(logits / temperature)` restricted
    to the top-`top_p` nucleus: the most likely tokens, in order, while the probability
    before them is below `top_p` (so the most likely one always stays)."""
    logits = logits / temperature

    def nucleus(logits):
        # Stable: among equal logits the lowest id ranks first, as argmax picks it.
        order = jnp.argsort(-logits, axis=-1, stable=True)
        ranked = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        choice = jax.random.categorical(key, jnp.where(before < top_p, ranked, -jnp.inf),
                                        axis=-1)
        return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]

    def everything(logits):
        return jax.random.categorical(key, logits, axis=-1)

    # The sort is most of a small model's step: skipped when nothing is cut.
    return jax.lax.cond(top_p < 1, nucleus, everything, logits)


def cast_frozen(params, scheme, dtype=jnp.bfloat16, trained_dtype=jnp.float32):
    """`params` with the leaves `scheme` freezes in `dtype` and the rest in `trained_dtype`.

    This is the mixed-precision layout for sparse fine-tuning (use it with a
    `LlamaConfig(dtype=jnp.float32)` model). Trained leaves stay float32 masters, so the
    optimizer state `SparseTrainer.init` makes for them is float32 too. Works on arrays
    and on `jax.ShapeDtypeStruct`s (to lower or size a step without allocating it).

    Args:
      params: the parameter pytree.
      scheme: the `Scheme` that says which leaves are frozen.
      dtype: the dtype of frozen leaves (default bfloat16).
      trained_dtype: the dtype of trained leaves (default float32).

    Returns:
      A pytree of the same structure; leaves already of the wanted dtype are returned
      as they are.

    Examples:
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
