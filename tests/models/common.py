"""Helpers the model tests share: compiled logits and random token batches."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pockjax.models.llama import Llama

VOCAB = 128


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def forward(model: Llama, tokens) -> np.ndarray:
    """The model's logits, compiled once per model structure (eager dispatch is slow)."""
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(graphdef, state, jnp.asarray(tokens)))


def random_tokens(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, shape)
