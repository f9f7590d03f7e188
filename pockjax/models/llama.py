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

This module assembles the model (`Llama`, `num_params`) from private ones, whose public
names it re-exports: the configuration and families (`_llama_config`), the layers
(`_llama_layers`), the mixed-precision products and `cast_frozen` (`_llama_precision`)
and cached decoding (`_llama_generate`).

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

import math

import jax
import jax.numpy as jnp
from flax import nnx

from pockjax._src.home import claim
from pockjax.data import check_token_ids
# `REMAT`, `NARROW_MATMUL` and `apply_rope` are only re-exported: names of this module.
from pockjax.models._llama_config import REMAT, SUPPORTED_FAMILIES, LlamaConfig  # noqa: F401
from pockjax.models._llama_generate import generate
from pockjax.models import _llama_rope as _rope
from pockjax.models._llama_layers import (HF_INIT, MLP, Attention, KVCache, Linear,  # noqa: F401
                                          LlamaBlock, RMSNorm, apply_rope, make_linear,
                                          rope_tables)
from pockjax.models._llama_precision import (NARROW_MATMUL, cast_frozen,  # noqa: F401
                                             narrow_matmul, project, upcast_matmul)

__all__ = ["LlamaConfig", "Llama", "LlamaBlock", "Attention", "MLP", "RMSNorm", "Linear",
           "KVCache", "upcast_matmul", "narrow_matmul", "cast_frozen", "generate", "num_params",
           "SUPPORTED_FAMILIES"]


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
                               param_dtype=config.param_dtype, embedding_init=HF_INIT, rngs=rngs)
        self.layers = nnx.List([LlamaBlock(config, rngs=rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                            param_dtype=config.param_dtype)
        if not config.tie_embeddings:
            self.lm_head = make_linear(config.hidden_size, config.vocab_size, config, rngs)

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
        return self.logits(self.hidden(tokens))

    def hidden(self, tokens: jax.Array) -> jax.Array:
        """The last block's output at every position of `tokens`, before the final norm:
        `model(tokens) == model.logits(model.hidden(tokens))`. A loss that counts a few
        positions computes the logits of those only.

        Args:
          tokens: integer ids, `[B, T]`, as for a call.

        Returns:
          The hidden states, `[B, T, hidden_size]`.

        Raises:
          ValueError, TypeError: as a call.
        """
        self._check_tokens(tokens, "Llama")
        length = tokens.shape[1]
        cfg = self.config
        if length > cfg.max_position_embeddings and not _rope.is_dynamic(cfg.rope_scaling):
            raise ValueError(f"Llama: {length} tokens exceed max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        cos, sin = rope_tables(length, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                               cfg.max_position_embeddings)
        # Computed, not a constant: a stored boolean tensor is wrong on GPU targets
        # without 8-bit storage (see pockjax.export), and this fuses into the softmax.
        positions = jnp.arange(length)
        mask = self._mask(positions, positions)
        h = self._embed(tokens)
        for layer in self.layers:
            h = _remat_block(layer, h, cos, sin, mask) if cfg.remat == "blocks" else \
                layer(h, cos, sin, mask)
        return h

    def logits(self, h: jax.Array) -> jax.Array:
        """The final norm and the output head over hidden states `h` (`hidden`'s).

        Args:
          h: hidden states, `[..., hidden_size]`.

        Returns:
          The logits, `[..., vocab_size]` float32.
        """
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
          ValueError: `length` exceeds `max_position_embeddings` (a `dynamic` rotary
            scaling has no such limit).
        """
        cfg = self.config
        if length > cfg.max_position_embeddings and not _rope.is_dynamic(cfg.rope_scaling):
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
        cos, sin = _rope.rope_tables_at(position, t, length, cfg.head_dim, cfg.rope_theta,
                                        cfg.rope_scaling, cfg.max_position_embeddings)
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
        logits = (project(h, self.embed.embedding[...], cfg.dtype, transposed=True,
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
    once the block output's cotangent exists (see `pockjax.remat.checkpoint_call`; with
    plain `jax.checkpoint` XLA's CPU scheduler moved the recomputation next to the
    forward pass, and nothing was saved). The same mechanism as
    `pockjax.nnx.Trainer(remat="layers/*")`."""
    from pockjax.remat import checkpoint_call

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


# The examples of the public names defined in the modules above, run by
# `doctest.testmod` of this module with its names in scope (tests/test_docs.py).
__test__ = {"generate": generate, "cast_frozen": cast_frozen}


claim(globals())  # public names defined in the private modules above live here
