"""Legalisation for IREE keeps every value: neg-sum and select-and-scatter rewrites."""
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pockjax.transforms.legalize import legalize_for_iree


def _legalized(f, *args):
    closed = jax.make_jaxpr(f)(*args)
    fixed, stats = legalize_for_iree(closed)
    return fixed, stats, jex.jaxpr_as_fun(fixed)(*args)


def test_neg_sum_becomes_neg_of_sum():
    def f(x):
        return jnp.sum(-(x - jnp.mean(x, -1, keepdims=True)), axis=-1)

    x = jnp.arange(12.0).reshape(3, 4) ** 2
    fixed, stats, out = _legalized(f, x)
    assert stats == {"neg_sum": 1}
    producers = {v: e.primitive.name for e in fixed.jaxpr.eqns for v in e.outvars}
    assert not any(e.primitive.name == "reduce_sum" and producers.get(e.invars[0]) == "neg"
                   for e in fixed.jaxpr.eqns)
    np.testing.assert_array_equal(out[0], f(x))


@pytest.mark.parametrize("window,strides,padding,reducer,init", [
    ((1, 2, 2, 1), (1, 2, 2, 1), "VALID", lax.max, -jnp.inf),   # plain 2x2 max pool
    ((1, 3, 3, 1), (1, 2, 2, 1), "SAME", lax.max, -jnp.inf),    # overlapping, padded
    ((1, 3, 2, 1), (1, 1, 2, 1), ((0, 0), (1, 1), (0, 1), (0, 0)), lax.max, -jnp.inf),
    ((1, 2, 2, 1), (1, 1, 1, 1), "VALID", lax.min, jnp.inf),    # min pooling
])
def test_pooling_gradients_are_unchanged(window, strides, padding, reducer, init):
    def f(x, w):
        pooled = lax.reduce_window(x, init, reducer, window, strides, padding)
        return jnp.sum(pooled * w)

    rng = np.random.default_rng(0)
    # Few distinct values, so windows have ties: the first extreme element must win.
    x = jnp.asarray(rng.integers(0, 3, (2, 7, 6, 3)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(jax.eval_shape(
        lambda x: lax.reduce_window(x, init, reducer, window, strides, padding), x).shape),
        jnp.float32)
    grad = jax.grad(f)
    fixed, stats, out = _legalized(grad, x, w)
    assert stats == {"select_and_scatter": 1}
    assert "select_and_scatter_add" not in str(fixed)
    # Overlapping windows add their contributions in another order (rounding only); a
    # wrongly chosen element would be off by a whole gradient value.
    np.testing.assert_allclose(out[0], grad(x, w), rtol=1e-6, atol=1e-6)
