"""Decoding with a key/value cache for the LLaMA-family decoder: `generate` checks its
arguments and runs `_generate`, one compiled program that prefills the prompt
(`Llama._decode_hidden`) and then adds one token per step in a `while_loop`, greedy or
sampled from the top-`top_p` nucleus (`_sample`). `pockjax.models.llama` re-exports
`generate`.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pockjax.data import check_token_ids


def generate(model, prompt: jax.Array, max_new_tokens: int, *,
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
    from pockjax.models._llama_rope import is_dynamic
    if total > model.config.max_position_embeddings and not is_dynamic(model.config.rope_scaling):
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
