"""Decoding with a key/value cache: `Llama.decode` against the full forward pass,
`generate` against uncached greedy decoding and transformers' `generate`, and top-p
sampling's distribution and reproducibility."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from pockjax.models.hf import load_llama
from pockjax.models._llama_generate import _generate, _sample
from pockjax.models.llama import Llama, LlamaConfig, generate
from tests.models.common import VOCAB, forward, random_tokens
from tests.models.test_families import hf_family_model

MODELS = {
    "llama": dict(),
    "mistral": dict(model_type="mistral", sliding_window=6),  # shorter than the sequences
    "qwen2": dict(model_type="qwen2"),
}


def decoder(name: str) -> Llama:
    """A small model with weights (biases too) large enough for varied greedy output."""
    model = Llama(LlamaConfig.tiny(vocab_size=VOCAB, **MODELS[name]), rngs=nnx.Rngs(7))
    graphdef, state = nnx.split(model)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(state))))
    state = jax.tree.map(lambda x: x * 10 if x.ndim == 2 else
                         x + 0.5 * jax.random.normal(next(keys), x.shape), state)
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def llama() -> Llama:
    return decoder("llama")


@functools.partial(jax.jit, static_argnums=(0, 3))
def uncached_greedy(graphdef, state, prompt, new):
    """Greedy decoding by the whole forward pass over a fixed buffer at every step."""
    start = prompt.shape[1]
    buffer = jnp.pad(prompt, ((0, 0), (0, new)))

    def step(t, buffer):
        logits = nnx.merge(graphdef, state)(buffer)
        token = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, t - 1, axis=1, keepdims=False),
                           axis=-1).astype(buffer.dtype)
        return jax.lax.dynamic_update_index_in_dim(buffer, token, t, axis=1)

    return jax.lax.fori_loop(start, start + new, step, buffer)


@pytest.mark.parametrize("name", list(MODELS))
def test_cached_greedy_equals_full_forward_decoding(name):
    model = decoder(name)
    prompt = jnp.asarray(random_tokens((2, 5), seed=4), jnp.int32)
    out = np.asarray(generate(model, prompt, 20))
    graphdef, state = nnx.split(model)
    np.testing.assert_array_equal(out, uncached_greedy(graphdef, state, prompt, 20))
    assert len(np.unique(out[:, 5:])) > 5


@pytest.mark.parametrize("name", ["qwen2", "mistral"])
def test_greedy_equals_transformers_generate(name, tmp_path):
    hf = hf_family_model(name, seed=2)
    hf.save_pretrained(tmp_path)
    model = load_llama(tmp_path)
    prompt = random_tokens((2, 5), seed=8)
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompt), attention_mask=torch.ones(2, 5, dtype=torch.long),
                           max_new_tokens=20, min_new_tokens=20, do_sample=False,
                           eos_token_id=None, pad_token_id=0).numpy()
    got = np.asarray(generate(model, jnp.asarray(prompt, jnp.int32), 20))
    assert want.shape == got.shape == (2, 25)
    np.testing.assert_array_equal(got, want)


@functools.partial(jax.jit, static_argnums=0)
def decode(graphdef, state, tokens, cache, position):
    return nnx.merge(graphdef, state).decode(tokens, cache, position)


def test_decode_in_pieces_equals_the_forward_pass(llama):
    tokens = jnp.asarray(random_tokens((2, 12), seed=9), jnp.int32)
    cache = llama.init_cache(2, 16)
    assert cache.k.shape == (2, 2, 16, 2, 16) and cache.k.dtype == jnp.float32
    graphdef, state = nnx.split(llama)
    pieces = []
    position = 0
    for size in (5, 1, 1, 5):
        logits, cache = decode(graphdef, state, tokens[:, position:position + size], cache,
                               position)
        pieces.append(logits)
        position += size
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), forward(llama, tokens),
                               rtol=1e-5, atol=1e-4)


def test_decode_refuses_what_does_not_fit(llama):
    cache = llama.init_cache(2, 8)
    with pytest.raises(ValueError, match=r"positions 6\.\.8 do not fit a cache of length 8; "
                                         r"make it with model\.init_cache\(2, length\)"):
        llama.decode(jnp.zeros((2, 3), jnp.int32), cache, 6)
    with pytest.raises(ValueError, match=r"the cache holds 2 sequences .* tokens are 3 "
                                         r"sequences"):
        llama.decode(jnp.zeros((3, 1), jnp.int32), cache, 0)
    with pytest.raises(ValueError, match="length 600 exceeds max_position_embeddings=512"):
        llama.init_cache(1, 600)
    with pytest.raises(ValueError, match=r"token id 200 at position \[0, 0\]"):
        llama.decode(jnp.full((2, 1), 200, jnp.int32), cache, 0)


def test_tiny_top_p_is_greedy(llama):
    prompt = jnp.asarray(random_tokens((2, 5), seed=4), jnp.int32)
    greedy = np.asarray(generate(llama, prompt, 12))
    # One compiled program for both temperatures (they are traced, not static).
    for temperature in (0.7, 3.0):
        np.testing.assert_array_equal(
            generate(llama, prompt, 12, temperature=temperature, top_p=1e-6, seed=3), greedy)


def test_sampling_is_reproducible_from_its_seed(llama):
    prompt = jnp.asarray(random_tokens((2, 5), seed=4), jnp.int32)
    sample = functools.partial(generate, llama, prompt, 12, temperature=1.5, top_p=0.95)
    a, b, c = (np.asarray(sample(seed=s)) for s in (1, 1, 2))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    np.testing.assert_array_equal(a[:, :5], prompt)
    assert (a != np.asarray(generate(llama, prompt, 12))).any()  # not greedy


def test_top_p_samples_the_renormalised_nucleus():
    """Probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two (0.5 comes before
    the second, 0.8 before the third), sampled 5:3; temperature 2 flattens them to
    p**(1/2), renormalised."""
    p = np.array([0.15, 0.5, 0.05, 0.3])
    logits = jnp.asarray(np.log(np.tile(p, (20000, 1))), jnp.float32)

    def frequencies(temperature, top_p):
        tokens = np.asarray(_sample(logits, jax.random.key(0), jnp.float32(temperature),
                                    jnp.float32(top_p)))
        return np.bincount(tokens, minlength=4) / len(tokens)

    np.testing.assert_allclose(frequencies(1.0, 0.7), [0, 0.625, 0, 0.375], atol=0.015)
    np.testing.assert_allclose(frequencies(1.0, 1.0), p, atol=0.015)
    flat = np.sqrt(p) / np.sqrt(p).sum()
    np.testing.assert_allclose(frequencies(2.0, 1.0), flat, atol=0.015)


def test_generate_compiles_once_per_shape(llama):
    prompt = jnp.asarray(random_tokens((2, 5), seed=4), jnp.int32)
    generate(llama, prompt, 12, temperature=1.0, seed=0)
    compiled = _generate._cache_size()
    generate(llama, prompt, 12, temperature=0.5, top_p=0.9, seed=5)
    generate(llama, prompt + 1, 12, temperature=2.0, seed=7)
    assert _generate._cache_size() == compiled


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.5), r"temperature must be a finite number >= 0 \(0: greedy\), got -0.5"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature="hot"), "temperature must be a finite number"),
    (dict(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\] \(1 keeps every token\), "
                                       r"got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(stop_token=VOCAB), rf"stop_token={VOCAB} is not a token id of the vocabulary "
                             rf"\[0, {VOCAB}\)"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be >= 0 and an integer, got 2.5"),
])
def test_generate_validates_its_arguments(llama, kwargs, match):
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(llama, jnp.zeros((1, 2), jnp.int32), **kwargs)


def test_docstring_examples_run():
    import doctest

    import pockjax.models.llama as module

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and not result.failed
