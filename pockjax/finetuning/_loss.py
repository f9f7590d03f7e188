"""The language-model losses the fine-tuning job trains on and evaluates: `lm_loss` over
every position's logits, `lm_loss_at` over the logits of the positions the loss counts
(`target_positions`), and `nll_sum` for held-out data. `pockjax.finetuning._model`
hands them on.
"""
from __future__ import annotations


def lm_loss(logits, tokens, mask):
    """Mean next-token cross-entropy over the positions `mask` marks: `logits[:, t]`
    predicts `tokens[:, t + 1]`, counted with weight `mask[:, t + 1]`.

    Args:
      logits: `[B, L, V]` logits (computed in float32).
      tokens: `[B, L]` integer token ids.
      mask: `[B, L]` weights (bool or float); 0 leaves a position out.

    Returns:
      The weighted sum of the negative log-likelihoods divided by the total weight (at
      least 1), a float32 scalar.
    """
    return _mean(*_next_token_nll(logits, tokens, mask))


def target_positions(mask) -> dict | None:
    """The positions of a batch whose next token the loss counts, for `lm_loss_at`:
    `{"targets": [K] int32, "target_weights": [K] float32}`, flat indices `b * L + t` of
    the positions `t` with `mask[b, t + 1] != 0` and those weights, padded with index 0
    and weight 0 to K, the smallest of `B * L / 8`, `/ 4`, `/ 2` that holds them (three
    batch shapes at most, each compiled once). None when more than half the positions
    count (a text without prompts or padding): then every logit is computed.

    Args:
      mask: `[B, L]` weights (numpy), as `pad_batch` gives.

    Returns:
      The two arrays to add to the batch, or None.
    """
    import numpy as np

    mask = np.asarray(mask)
    b, length = mask.shape
    weights = np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], axis=1)
    flat = np.flatnonzero(weights.reshape(-1) != 0)
    for share in (8, 4, 2):
        k = -(-b * length // share)
        if flat.size <= k:
            break
    else:
        return None
    targets = np.zeros(k, np.int32)
    targets[:flat.size] = flat
    w = np.zeros(k, np.float32)
    w[:flat.size] = weights.reshape(-1)[flat]
    return {"targets": targets, "target_weights": w}


def lm_loss_at(loaded, params, batch):
    """`lm_loss` of `loaded`'s model computing the logits at `batch["targets"]` only
    (`target_positions`): the hidden states of every position, then the head at the K
    counted ones. Equal to `lm_loss` within float32 rounding (the sums run in another
    order).

    Args:
      loaded: a `LoadedModel` with `hidden` and `logits_of`.
      params: its parameters.
      batch: `tokens`, `targets` and `target_weights`.

    Returns:
      The weighted mean negative log-likelihood, a float32 scalar.
    """
    import jax.numpy as jnp
    import optax

    import jax.numpy as jnp

    tokens = batch["tokens"]
    h = loaded.hidden(params, tokens)
    b, length, width = h.shape
    at = batch["targets"]
    logits = loaded.logits_of(params, jnp.take(h.reshape(b * length, width), at, axis=0)[None])
    labels = jnp.take(_next_labels(tokens).reshape(-1), at, axis=0)
    return _mean(*_weighted_nll(logits[0], labels, batch["target_weights"]))


def nll_sum(logits, tokens, mask):
    """The summed negative log-likelihood of `lm_loss` and its total weight, to average
    over many batches."""
    import jax.numpy as jnp

    nll, w = _next_token_nll(logits, tokens, mask)
    return jnp.sum(nll), jnp.sum(w)


def _next_token_nll(logits, tokens, mask):
    """Weighted per-position negative log-likelihoods [B, L] and their weights: the
    labels shift left by one and the last position gets weight 0. Shifting the labels,
    not slicing `logits[:, :-1]`, keeps XLA from copying the [B, L, vocab] logits
    forward and padding their gradient backward (on CPU a third of the head's cost)."""
    import jax.numpy as jnp

    w = jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1)
    return _weighted_nll(logits, _next_labels(tokens), w)


def _next_labels(tokens):
    """Each position's next token, `tokens[:, t + 1]` (the last wraps to the first and is
    given weight 0)."""
    import jax.numpy as jnp

    return jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)


def _weighted_nll(logits, labels, w):
    """The negative log-likelihoods of `labels` under `logits` (float32) times the
    weights `w`, zero where `w` is, and the weights as float32."""
    import jax.numpy as jnp
    import optax

    w = w.astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return jnp.where(w != 0, nll * w, 0.0), w


def _mean(nll, w):
    """The weighted mean: summed weighted values over the total weight (at least 1)."""
    import jax.numpy as jnp

    return jnp.sum(nll) / jnp.maximum(jnp.sum(w), 1.0)
