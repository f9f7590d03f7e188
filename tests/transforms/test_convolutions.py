"""`pockjax.transforms.convolutions`: depth-wise convolutions as shifted slices and 1x1
ones as products inside `sparse_grad`, against XLA's convolution and dense `jax.grad`,
for every padding, stride, dilation and dimension order; other convolutions left alone."""
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pockjax as pj
from pockjax.transforms.convolutions import (convolutions_kept, is_depthwise, is_pointwise,
                                            rewrite_convolutions)
from tests.helpers import assert_matches_dense

CASES = [  # (layout, kernel, stride, padding, dilation)
    ("NHWC", (3, 3), (1, 1), "SAME", (1, 1)),
    ("NHWC", (3, 3), (2, 2), "VALID", (1, 1)),
    ("NHWC", (3, 3), (2, 2), ((0, 1), (0, 1)), (1, 1)),  # Keras's MobileNetV2 stride 2
    ("NCHW", (3, 3), (2, 2), ((1, 1), (1, 1)), (1, 1)),  # torch's
    ("NCHW", (5, 5), (1, 2), ((2, 2), (3, 1)), (1, 1)),
    ("NHWC", (3, 3), (1, 1), ((2, 2), (2, 2)), (2, 2)),   # dilated
    ("NHWC", (7, 7), (1, 1), "SAME", (1, 1)),             # ConvNeXt's
    ("NCHW", (3, 1), (1, 1), ((1, 1), (0, 0)), (1, 1)),   # a separable half
]


def _conv(layout, kernel, stride, padding, dilation, channels=6):
    dn = ("NHWC", "HWIO", "NHWC") if layout == "NHWC" else ("NCHW", "OIHW", "NCHW")

    def f(x, w):
        return lax.conv_general_dilated(x, w, stride, padding, rhs_dilation=dilation,
                                        dimension_numbers=dn, feature_group_count=channels)
    rng = np.random.default_rng(0)
    xs = (2, 9, 8, channels) if layout == "NHWC" else (2, channels, 9, 8)
    ws = (*kernel, 1, channels) if layout == "NHWC" else (channels, 1, *kernel)
    x = rng.normal(size=xs).astype(np.float32)
    x[0, 0] = 0.0  # exact zeros on the first row
    return f, x, rng.normal(size=ws).astype(np.float32)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-s{c[2]}-{c[3]}-d{c[4]}" for c in CASES])
def test_values_and_gradients_equal_xlas_convolution(case):
    f, x, w = _conv(*case)
    closed = jax.make_jaxpr(f)(x, w)
    new, count = rewrite_convolutions(closed)
    assert count == 1 and not any(e.primitive.name == "conv_general_dilated"
                                  for e in new.jaxpr.eqns)
    g = jnp.asarray(np.random.default_rng(1).normal(size=f(x, w).shape), jnp.float32)

    def loss(run, a, b):
        return jnp.sum(run(a, b) * g)
    run = lambda a, b: jex.jaxpr_as_fun(new)(a, b)[0]  # noqa: E731
    np.testing.assert_allclose(run(x, w), f(x, w), rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.grad(lambda a, b: loss(run, a, b), (0, 1))(x, w),
                         jax.grad(lambda a, b: loss(f, a, b), (0, 1))(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("stride", [1, 2])
def test_a_1x1_convolution_is_a_product(stride):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 7, 6, 5)).astype(np.float32)
    x[:, :, 0] = 0.0
    w = rng.normal(size=(1, 1, 5, 9)).astype(np.float32)

    def f(a, b):
        return lax.conv_general_dilated(a, b, (stride, stride), "VALID",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    new, count = rewrite_convolutions(jax.make_jaxpr(f)(x, w))
    assert count == 1 and "dot_general" in str(new) and "conv" not in str(new)
    run = lambda a, b: jex.jaxpr_as_fun(new)(a, b)[0]  # noqa: E731
    np.testing.assert_allclose(run(x, w), f(x, w), rtol=1e-5, atol=1e-5)
    g = np.random.default_rng(6).normal(size=f(x, w).shape).astype(np.float32)
    for got, want in zip(jax.grad(lambda a, b: jnp.sum(run(a, b) * g), (0, 1))(x, w),
                         jax.grad(lambda a, b: jnp.sum(f(a, b) * g), (0, 1))(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_low_precision_sums_in_float32():
    f, x, w = _conv("NHWC", (3, 3), (1, 1), "SAME", (1, 1), channels=16)
    x, w = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    new, count = rewrite_convolutions(jax.make_jaxpr(f)(x, w))
    got = jex.jaxpr_as_fun(new)(x, w)[0]
    assert count == 1 and got.dtype == jnp.bfloat16
    want = f(x.astype(jnp.float32), w.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)


def test_other_convolutions_are_left_alone():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 8, 8, 4)).astype(np.float32)
    dn = ("NHWC", "HWIO", "NHWC")
    others = [
        (lambda a, b: lax.conv_general_dilated(a, b, (1, 1), "SAME", dimension_numbers=dn),
         (3, 3, 4, 4)),                                   # dense
        (lambda a, b: lax.conv_general_dilated(a, b, (1, 1), "SAME", dimension_numbers=dn,
                                               feature_group_count=2), (3, 3, 2, 4)),  # grouped
        (lambda a, b: lax.conv_general_dilated(a, b, (1, 1), "SAME", dimension_numbers=dn,
                                               feature_group_count=4), (3, 3, 1, 8)),  # multiplier 2
        (lambda a, b: lax.conv_general_dilated(a, b, (1, 1), ((1, 1), (1, 1)), lhs_dilation=(2, 2),
                                               dimension_numbers=dn, feature_group_count=4),
         (3, 3, 1, 4)),                                   # transposed
        (lambda a, b: lax.conv_general_dilated(a, b, (1, 1), ((1, 0), (0, 0)),
                                               dimension_numbers=dn), (1, 1, 4, 4)),  # 1x1 padded
    ]
    for f, ws in others:
        closed = jax.make_jaxpr(f)(x, rng.normal(size=ws).astype(np.float32))
        assert not any(is_depthwise(e) or is_pointwise(e) for e in closed.jaxpr.eqns)
        assert rewrite_convolutions(closed) == (closed, 0)
    nchw = lambda a, b: lax.conv_general_dilated(a, b, (1, 1), "VALID")  # noqa: E731
    closed = jax.make_jaxpr(nchw)(x.transpose(0, 3, 1, 2), rng.normal(size=(4, 4, 1, 1)))
    assert rewrite_convolutions(closed) == (closed, 0)   # a 1x1 in torch's layout


def test_sparse_grad_uses_it_and_matches_jax_grad_or_keeps_the_convolution():
    f, x, w = _conv("NCHW", (3, 3), (2, 2), ((1, 1), (1, 1)), (1, 1))
    params = {"dw": w, "head": np.random.default_rng(2).normal(size=(6, 3)).astype(np.float32)}

    def loss(p, b):
        h = jax.nn.relu(f(b, p["dw"])).mean((2, 3))
        return jnp.mean((h @ p["head"]) ** 2)
    scheme = pj.Scheme({"dw": pj.Channels(count=2, axis=0), "head": pj.Full()})
    assert_matches_dense(loss, scheme, params, x, rtol=1e-5, atol=1e-6)
    grad = pj.sparse_grad(loss, scheme)
    assert "conv_general_dilated" not in str(jax.make_jaxpr(lambda p, b: grad(p, b))(params, x))
    with convolutions_kept():  # the same function traced again, not its cached program
        kept = str(jax.make_jaxpr(lambda p, b: grad(p, b))(params, x))
    assert "conv_general_dilated" in kept


def test_an_export_after_training_keeps_the_convolutions():
    """The artifact's step is traced under `convolutions_kept()` even when the trainer
    already ran (and cached) the rewritten step."""
    import optax

    from pockjax.export.lowering import lower_step

    f, x, w = _conv("NHWC", (3, 3), (1, 1), "SAME", (1, 1))

    def loss(p, b):
        return jnp.mean(jax.nn.relu(f(b, p["dw"])) ** 2)
    trainer = pj.sparse_train(loss, optimizer=optax.sgd(0.1), scheme=pj.Scheme({"dw": pj.Full()}))
    state = trainer.init({"dw": w})
    state, _ = trainer(state, x)
    state, _ = trainer(state, x)
    assert "convolution" in lower_step(trainer, state, x).mlir
