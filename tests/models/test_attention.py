"""The LLaMA layers' recomputing backward passes (`pockjax.models._attention`): values
and gradients against `jax.grad` of a plain formulation written here (key/value heads
repeated as Hugging Face's `repeat_kv` does, a `-inf` mask), on masks whose first row
reads one key, sliding windows, queries shorter than the keys, exact zeros and
saturating inputs; and the compiled gradient of a long sequence holding less memory
than the plain formulation's (the recomputation is not merged back into the forward
pass)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pockjax.models._attention import attention, swiglu


def plain_attention(q, k, v, mask, scale):
    """[B, T, kv, group, hd] queries over [B, S, kv, hd] keys and values, written the
    other way round from pockjax's: every query head with its own copy of its key/value
    head, then one softmax per head."""
    b, t, kv, group, hd = q.shape
    heads = q.reshape(b, t, kv * group, hd)
    keys = jnp.repeat(k, group, axis=2)
    values = jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", heads, keys) * scale
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    out = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), values)
    return out.reshape(b, t, kv, group, hd)


def causal(t, s, window=None):
    """[t, s]: query i (at position s - t + i) reads keys up to its own position."""
    queries = np.arange(s - t, s)[:, None]
    keys = np.arange(s)[None, :]
    mask = queries >= keys
    if window is not None:
        mask &= queries - keys < window
    return jnp.asarray(mask)


CASES = {
    "grouped": dict(b=2, t=7, s=7, kv=2, group=3, hd=8, window=None),
    "one head per key head": dict(b=1, t=9, s=9, kv=4, group=1, hd=4, window=None),
    "sliding window": dict(b=2, t=8, s=8, kv=1, group=2, hd=8, window=3),
    "queries after a prefix": dict(b=2, t=3, s=10, kv=2, group=2, hd=4, window=None),
}


def inputs(case, seed=0):
    rng = np.random.default_rng(seed)
    c = CASES[case]
    q = rng.normal(size=(c["b"], c["t"], c["kv"], c["group"], c["hd"])).astype(np.float32)
    k = rng.normal(size=(c["b"], c["s"], c["kv"], c["hd"])).astype(np.float32)
    v = rng.normal(size=(c["b"], c["s"], c["kv"], c["hd"])).astype(np.float32)
    q[0, 0] = 0.0         # a query of exact zeros: uniform over what it reads
    v[:, -1] = 0.0        # the last key's values exactly zero
    k[-1, :, 0] *= 20.0   # saturated scores in the last example's first key head
    cotangent = rng.normal(size=q.shape).astype(np.float32)
    cotangent[:, -1] = 0.0  # no gradient from the last query
    return (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
            causal(c["t"], c["s"], c["window"]), jnp.asarray(cotangent))


@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_values_and_gradients_equal_the_plain_formulation(case):
    q, k, v, mask, cotangent = inputs(case)
    scale = q.shape[-1] ** -0.5

    def grads(f):
        def loss(q, k, v):
            return jnp.sum(f(q, k, v, mask, scale) * cotangent)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    (value, got), (expected_value, expected) = grads(attention), grads(plain_attention)
    np.testing.assert_allclose(jax.jit(attention, static_argnums=4)(q, k, v, mask, scale),
                               plain_attention(q, k, v, mask, scale), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(value, expected_value, rtol=1e-5, atol=1e-5)
    for name, g, e in zip("qkv", got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")
    # The last query's cotangent is zero: so is its query's gradient, exactly.
    assert not np.any(np.asarray(got[0])[:, -1])


def test_attention_in_bfloat16_is_as_close_to_float32_as_plain_bfloat16():
    """In bfloat16 the gradients differ from float32's by rounding; the recomputing
    backward pass must not add to it beyond half again what differentiating the plain
    formulation in bfloat16 gives (a softmax gradient cancels: rounding in either term
    of its difference shows)."""
    q, k, v, mask, cotangent = inputs("grouped", seed=1)
    scale = q.shape[-1] ** -0.5
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]

    def grads(f, args):
        def loss(q, k, v):
            return jnp.sum(f(q, k, v, mask, scale).astype(jnp.float32) * cotangent)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)

    got = grads(attention, low)
    plain = grads(plain_attention, low)
    exact = grads(plain_attention, [x.astype(jnp.float32) for x in low])
    for name, g, p, e in zip("qkv", got, plain, exact):
        assert g.dtype == jnp.bfloat16, name
        error = np.abs(np.asarray(g, np.float32) - e).max()
        assert error <= 1.5 * np.abs(np.asarray(p, np.float32) - e).max(), name


def test_swiglu_equals_silu_times_up_with_its_gradients():
    rng = np.random.default_rng(2)
    gate = rng.normal(scale=4.0, size=(3, 5, 16)).astype(np.float32)
    gate[0, 0, :4] = [0.0, -0.0, 40.0, -40.0]  # zeros and saturated sigmoids
    up = rng.normal(size=gate.shape).astype(np.float32)
    up[1] = 0.0
    cotangent = rng.normal(size=gate.shape).astype(np.float32)
    gate, up, cotangent = map(jnp.asarray, (gate, up, cotangent))

    def plain(g, u):
        return g * jax.nn.sigmoid(g) * u

    np.testing.assert_array_equal(jax.jit(swiglu)(gate, up), jax.jit(
        lambda g, u: jax.nn.silu(g) * u)(gate, up))
    got = jax.jit(jax.grad(lambda g, u: jnp.sum(swiglu(g, u) * cotangent), (0, 1)))(gate, up)
    expected = jax.jit(jax.grad(lambda g, u: jnp.sum(plain(g, u) * cotangent), (0, 1)))(gate,
                                                                                     up)
    for name, g, e in zip(("gate", "up"), got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=f"d{name}")


def test_the_recomputation_is_not_merged_back_into_the_forward_pass():
    """XLA would keep the probabilities if it merged the backward pass's scores with the
    forward pass's (or computed them there): the compiled gradient of a long sequence
    must hold less than the plain formulation's, by most of one [T, T] tensor per
    head."""
    b, t, kv, group, hd = 1, 256, 2, 2, 8
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(b, t, kv, group, hd)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, kv, hd)), jnp.float32)
    mask = causal(t, t)

    def temp(f):
        def loss(q, k, v):  # two layers, so one's probabilities outlive its forward pass
            h = f(q, k, v, mask, 0.3)
            return jnp.sum(f(h * 0.5, k, v, mask, 0.3) ** 2)
        compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, k).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one_tensor = b * kv * group * t * t * 4
    assert temp(attention) < temp(plain_attention) - one_tensor
