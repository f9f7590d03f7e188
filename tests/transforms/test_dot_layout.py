"""`swap_transposed_dots`: a weight gradient's `transpose(dot_general(g, x))` written as
`dot_general(x, g)`, the same values, in what `sparse_grad` builds."""
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import lax

import pockjax as pj
from pockjax.transforms.dot_layout import swap_transposed_dots


def _prims(closed):
    return [e.primitive for e in closed.jaxpr.eqns]


def test_a_linear_layers_weight_gradient_has_no_transpose():
    x = jax.random.normal(jax.random.key(0), (4, 6, 8))
    w = jax.random.normal(jax.random.key(1), (8, 5))

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    closed = jax.make_jaxpr(jax.grad(loss))(w, x)
    assert lax.transpose_p in _prims(closed)
    swapped, count = swap_transposed_dots(closed)
    assert count == 1 and lax.transpose_p not in _prims(swapped)
    got = jax.extend.core.jaxpr_as_fun(swapped)(w, x)[0]
    np.testing.assert_allclose(got, jax.grad(loss)(w, x), rtol=1e-6, atol=1e-6)
    # What sparse_grad builds has none either, and equals jax.grad.
    g = pj.sparse_grad(loss, pj.Scheme(default=pj.Full()))(w, x)
    np.testing.assert_allclose(g, jax.grad(loss)(w, x), rtol=1e-6, atol=1e-6)
    traced = jax.make_jaxpr(pj.sparse_grad(loss, pj.Scheme(default=pj.Full())))(w, x)
    assert not any(e.primitive is lax.transpose_p and "dot_general" in str(e)
                   for e in traced.jaxpr.eqns)


def test_only_operand_swapping_transposes_of_single_use_products_change():
    a = jnp.arange(24.0).reshape(2, 3, 4)
    b = jnp.arange(40.0).reshape(2, 4, 5)

    def batched(a, b):  # [2, 3, 5] -> [2, 5, 3]: swaps the free dimensions
        return jnp.transpose(lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))), (0, 2, 1))

    def other(a, b):  # moves the batch dimension: not the swapped product
        return jnp.transpose(lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))), (1, 0, 2))

    def reused(a, b):  # the product is used twice: left alone
        p = lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))))
        return jnp.transpose(p, (0, 2, 1)), p

    for fn, want in ((batched, 1), (other, 0), (reused, 0)):
        closed = jax.make_jaxpr(fn)(a, b)
        swapped, count = swap_transposed_dots(closed)
        assert count == want, fn.__name__
        for got, ref in zip(jax.extend.core.jaxpr_as_fun(swapped)(a, b), jax.tree.leaves(fn(a, b))):
            np.testing.assert_array_equal(got, ref)


def test_programs_lowered_for_iree_keep_jaxs_form():
    """Inside `transposed_dots_kept()` (what `pockjax.export` lowers under: IREE's Vulkan
    code generation computes the swapped form wrong) the gradient program keeps JAX's
    `transpose(dot_general(g, x))`, also after the same function was traced without it;
    the two programs are cached apart and compute the same values."""
    from pockjax.transforms.dot_layout import enabled, transposed_dots_kept

    x = jax.random.normal(jax.random.key(0), (4, 6, 8))
    w = jax.random.normal(jax.random.key(1), (8, 5))
    grad = pj.sparse_grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2), pj.Scheme(default=pj.Full()))

    def transposes(program):
        return sum(e.primitive is lax.transpose_p for e in program.jaxpr.eqns)

    swapped = grad.trace(w, x)
    with transposed_dots_kept():
        assert not enabled()
        kept = grad.trace(w, x)
    assert enabled()
    assert transposes(swapped.info.jaxpr) == 0 and transposes(kept.info.jaxpr) == 1
    want = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2))(w, x)
    np.testing.assert_allclose(grad(w, x), want, rtol=1e-5, atol=1e-6)
