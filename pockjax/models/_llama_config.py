"""The configuration of the LLaMA-family decoder (`pockjax.models.llama`): `LlamaConfig`,
its presets and checks, and the table of Hugging Face families (`SUPPORTED_FAMILIES`:
which `LlamaConfig` fields each family's class fixes, and how its `config.json` fields
are read and written). `pockjax.models.llama` re-exports the public names; the layers,
the model and `pockjax.models.hf` read these configs, and nothing here builds a model.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from pockjax.models import _llama_rope as _rope
from pockjax.models._llama_precision import NARROW_MATMUL

# LlamaConfig.remat choices: "blocks", the word `pockjax.nnx.Trainer(remat=...)` uses for
# the same thing ("block" is read as "blocks").
REMAT = (None, "blocks", "block")


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

    `remat="blocks"` recomputes each block's activations in the backward pass
    (`jax.checkpoint` around the block, nothing saved inside it) instead of keeping
    them: less memory for the trained blocks, one more forward pass through them.
    Frozen blocks ahead of every trained one are not differentiated, so they keep
    nothing either way. `pockjax.nnx.Trainer(model, ..., remat="blocks")` does the
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
      rope_scaling: the rotary embeddings' scaling (`linear`, `dynamic`, `yarn` or
        `llama3`, with Hugging Face's parameters: a dict or sorted `(key, value)`
        pairs, held as the latter); None (default): unscaled. With `dynamic`, sequences
        may run past `max_position_embeddings`, the frequencies stretching to them.
      max_position_embeddings: the longest sequence the model takes (default 2048).
      tie_embeddings: use the embedding table as the output projection (no
        `lm_head`).
      param_dtype: the float dtype parameters are created in (default float32).
      dtype: the float dtype activations are computed in; None: the parameters'
        dtypes as they promote.
      narrow_matmul: how a weight stored narrower than `dtype` multiplies: `"upcast"`
        (default, `upcast_matmul`) or `"native"` (`narrow_matmul`).
      remat: `"blocks"` (or `"block"`) recomputes each block in the backward pass;
        None (default) keeps the activations.
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
    rope_scaling: Any = None
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
        object.__setattr__(self, "rope_scaling", _rope.freeze(self.rope_scaling))
        _rope.check(self.rope_scaling)
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
        if self.remat == "block":
            object.__setattr__(self, "remat", "blocks")
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
        """LLaMA-2-7B's shape (6,738,415,616 parameters), `overrides` replacing any of its
        fields (e.g. `num_layers=4`)."""
        return cls._preset(overrides, vocab_size=32000, hidden_size=4096,
                           intermediate_size=11008, num_layers=32, num_heads=32,
                           max_position_embeddings=4096)

    @classmethod
    def tinyllama_1b(cls, **overrides) -> "LlamaConfig":
        """TinyLlama-1.1B's shape (1,100,048,384 parameters; grouped-query attention with
        4 key/value heads), `overrides` replacing any of its fields (e.g. `num_layers=4`)."""
        return cls._preset(overrides, vocab_size=32000, hidden_size=2048,
                           intermediate_size=5632, num_layers=22, num_heads=32, num_kv_heads=4,
                           max_position_embeddings=2048)

    @classmethod
    def tiny(cls, **overrides) -> "LlamaConfig":
        """A small model for tests and examples (grouped-query attention, 2 layers),
        `overrides` replacing any of its fields (e.g. `dtype=jnp.float32`)."""
        return cls._preset(overrides, vocab_size=256, hidden_size=64, intermediate_size=172,
                           num_layers=2, num_heads=4, num_kv_heads=2,
                           max_position_embeddings=512)

    @classmethod
    def _preset(cls, overrides: dict, **shape) -> "LlamaConfig":
        """A preset's `shape` with the caller's `overrides` replacing its fields (checked
        together, as one `LlamaConfig`)."""
        return cls(**{**shape, **overrides})

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
            `pockjax.torch`), a RoPE scaling other than `linear`, `dynamic`, `yarn` and
            `llama3` (or a partial rotary factor), an activation other than SiLU, Qwen2 layers with
            sliding-window attention; or a config without the model's sizes.
        """
        def unsupported(field, value, why):
            raise ValueError(f"Hugging Face config {field}={value!r} is not supported: {why}")

        model_type = config.get("model_type", "llama")
        if model_type not in _FAMILIES:
            unsupported("model_type", model_type, f"the Flax LLaMA (pockjax.models.llama) "
                        f"reads the families {', '.join(SUPPORTED_FAMILIES)}; "
                        f"{_OTHER_ARCHITECTURES}")
        # transformers reads the older `rope_scaling` before `rope_parameters`.
        field = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
        rope = config.get(field) or {}
        rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0)) \
            if isinstance(rope, dict) else config.get("rope_theta", 10000.0)
        if config.get("partial_rotary_factor", 1.0) != 1.0:
            unsupported("partial_rotary_factor", config["partial_rotary_factor"],
                        "pockjax's LLaMA rotates every channel of a head")
        rope_scaling = _rope.scaling_of(rope, config, unsupported, field)
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
            rope_scaling=rope_scaling,
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
            "rope_parameters": _rope.to_hf(self.rope_scaling, self.rope_theta),
            "rope_scaling": None if self.rope_scaling is None else
            _rope.to_hf(self.rope_scaling, self.rope_theta),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_embeddings,
            **_FAMILIES[self.model_type].write(self),
            "dtype": self.param_dtype.name,
        }


