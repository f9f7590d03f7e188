"""The MobileNetV2 model's hand-written backward passes (depth-wise convolution, batch
norm) against JAX's autodiff of the reference formulas, in float64."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pockjax.models import mobilenetv2 as M
from tests.helpers import assert_trees_close


def grouped_conv(x, w, stride):
    return jax.lax.conv_general_dilated(
        x, w[:, :, None, :], (stride, stride), ((1, 1), (1, 1)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=x.shape[-1],
        precision="highest")


def adversarial_images(shape, key=0):
    """Random values with exact zeros, a zero first channel and a large last channel."""
    x = np.array(jax.random.normal(jax.random.key(key), shape), np.float64)
    x[..., 0] = 0.0
    x[..., -1] *= 1e3
    x[:, ::3, ::2] = 0.0
    return jnp.asarray(x)


@pytest.mark.parametrize("stride,h,w", [(1, 9, 7), (2, 9, 9), (2, 8, 8), (2, 8, 7), (1, 1, 1),
                                        (2, 1, 2), (2, 2, 3)])
def test_depthwise_gradients_equal_the_grouped_convolution(stride, h, w):
    with jax.enable_x64(True):
        x = adversarial_images((2, h, w, 5))
        kernel = jax.random.normal(jax.random.key(1), (3, 3, 5), jnp.float64)
        kernel = kernel.at[:, :, 0].set(0.0)  # a dead first channel

        def loss(f):
            return lambda x, k: jnp.sum(jnp.sin(f(x, k, stride)) * jnp.arange(5.0))

        want = jax.value_and_grad(loss(grouped_conv), (0, 1))(x, kernel)
        got = jax.value_and_grad(loss(M.depthwise_conv), (0, 1))(x, kernel)
        got_jit = jax.jit(jax.value_and_grad(loss(M.depthwise_conv), (0, 1)))(x, kernel)
        assert_trees_close(got, want, rtol=1e-10, atol=1e-10)
        assert_trees_close(got_jit, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("images_per_chunk", [1, 2, 3])
@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_weight_gradient_in_chunks_of_images(monkeypatch, stride, images_per_chunk):
    """Large inputs take the weight gradient over chunks of images in a loop; made to
    happen here by shrinking the chunk size (6 images: 6, 3 or 2 loop iterations)."""
    with jax.enable_x64(True):
        x = adversarial_images((6, 9, 8, 5), key=2)
        kernel = jax.random.normal(jax.random.key(3), (3, 3, 5), jnp.float64)
        kernel = kernel.at[:, :, -1].set(0.0)
        per_image = (x[0].size + M.depthwise_conv(x[:1], kernel, stride)[0].size) * 8
        monkeypatch.setattr(M, "_WEIGHT_GRAD_CHUNK_BYTES", images_per_chunk * per_image)
        monkeypatch.setattr(M, "_WEIGHT_GRAD_MIN_CHUNKS", 2)

        def loss(f):
            return lambda x, k: jnp.sum(jnp.tanh(f(x, k, stride)) * jnp.arange(5.0))

        want = jax.value_and_grad(loss(grouped_conv), (0, 1))(x, kernel)
        grad = jax.value_and_grad(loss(M.depthwise_conv), (0, 1))
        assert "scan" in str(jax.make_jaxpr(grad)(x, kernel))  # the chunked path ran
        assert_trees_close(jax.jit(grad)(x, kernel), want, rtol=1e-10, atol=1e-10)


def test_chunked_depthwise_weight_gradient_keeps_a_split_batch_split(monkeypatch):
    """With the batch split over two devices and chunks of two images, the chunked
    weight gradient reads each device's own images (no all-gather, one all-reduce of the
    [9, C] sums) and equals the unchunked one; bfloat16 inputs are summed in float32
    across chunks."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    monkeypatch.setattr(M, "_WEIGHT_GRAD_CHUNK_BYTES", 2 * (6 * 6 * 4 * 2) * 4)
    monkeypatch.setattr(M, "_WEIGHT_GRAD_MIN_CHUNKS", 2)
    x = adversarial_images((8, 6, 6, 4), key=4).astype(jnp.float32)
    g = jax.random.normal(jax.random.key(5), (8, 6, 6, 4))
    split = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), PartitionSpec("data"))
    grad = jax.jit(lambda x, g: M._depthwise_weight_grad(x, g, 3, 1, 1))
    hlo = grad.lower(jax.device_put(x, split), jax.device_put(g, split)).compile().as_text()
    assert "all-gather" not in hlo and "all-reduce" in hlo and "while" in hlo
    monkeypatch.setattr(M, "_WEIGHT_GRAD_MIN_CHUNKS", 10**6)  # the unchunked reference
    want = jax.jit(lambda x, g: M._depthwise_weight_grad(x, g, 3, 1, 1))(x, g)
    monkeypatch.setattr(M, "_WEIGHT_GRAD_MIN_CHUNKS", 2)
    got = grad(jax.device_put(x, split), jax.device_put(g, split))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)
    xb, gb = x.astype(jnp.bfloat16), g.astype(jnp.bfloat16)
    low = grad(xb, gb)
    assert low.dtype == jnp.bfloat16
    with jax.enable_x64(True):  # the same bfloat16 inputs, summed exactly
        exact = np.asarray(M._depthwise_weight_grad(xb.astype(jnp.float64),
                                                    gb.astype(jnp.float64), 3, 1, 1))
    # one bfloat16 rounding of each product and of the result, none per chunk
    np.testing.assert_allclose(np.asarray(low, np.float64), exact, rtol=2e-2,
                               atol=1e-2 * float(np.max(np.abs(exact))))


def flax_batch_norm(x, scale, bias, relu6):
    """What nnx.BatchNorm computes in training mode (its own functions), then ReLU6:
    `(y, batch mean, batch var)`."""
    from flax.nnx.nn import normalization as flax_norm

    mean, var = flax_norm._compute_stats(x, (0, 1, 2), dtype=None)
    y = flax_norm._normalize(x, mean, var, scale, bias, (0, 1, 2), (3,), None, 1e-5)
    return (jax.nn.relu6(y) if relu6 else y), mean, var


@pytest.mark.parametrize("relu6", [True, False])
def test_batch_norm_equals_flax_values_and_gradients(relu6):
    with jax.enable_x64(True):
        x = adversarial_images((4, 5, 3, 6), key=2)
        x = x.at[..., 2].set(1.5)  # a constant channel: variance exactly 0, clipped
        scale = jnp.asarray([1.0, 2.0, 0.0, -1.0, 0.5, 3.0])
        bias = jnp.asarray([0.0, -50.0, 1.0, 7.0, 0.1, 0.2])  # a dead ReLU, a saturated one
        weights = jax.random.normal(jax.random.key(3), (3,))

        def loss(f):
            def fn(x, scale, bias):
                y, mean, var = f(x, scale, bias)
                return (weights[0] * jnp.sum(jnp.sin(y)) + weights[1] * jnp.sum(mean ** 2)
                        + weights[2] * jnp.sum(jnp.cos(var)))
            return fn

        want = jax.value_and_grad(loss(lambda *a: flax_batch_norm(*a, relu6)), (0, 1, 2))(
            x, scale, bias)
        got = jax.value_and_grad(loss(lambda *a: M.batch_norm(*a, 1e-5, relu6)), (0, 1, 2))(
            x, scale, bias)
        assert_trees_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("offset", [0.0, 3.0, 30.0, 300.0])
def test_float32_batch_norm_gradient_is_as_accurate_as_flax_autodiff(offset):
    """The backward sums g * x and subtracts mean * sum(g) instead of summing
    g * (x - mean): in float32, with channel means up to 600 standard deviations from 0,
    its gradients stay as close to the float64 ones as autodiff of flax's float32
    formula (whose variance E[x^2] - E[x]^2 cancels first)."""
    rng = np.random.default_rng(5)
    with jax.enable_x64(True):
        x = (rng.standard_normal((8, 16, 16, 6)) * [1.0, 2.0, 0.5, 1.0, 1.0, 1.0]
             + offset * np.array([1.0, -1.0, 2.0, 0.0, 0.5, 1.0]))
        x[:, ::4] = offset  # rows of one value
        scale = np.array([1.0, 2.0, 0.5, -1.0, 0.5, 3.0])
        bias = np.array([0.0, 1.0, 2.0, 3.0, -20.0, 0.2])  # a dead ReLU channel
        weights = rng.standard_normal(x.shape)

        def grads(f, dtype):
            def loss(x, scale, bias):
                return jnp.sum(jnp.asarray(weights, dtype) * f(x, scale, bias)[0])
            return jax.grad(loss, (0, 1, 2))(*(jnp.asarray(a, dtype) for a in (x, scale, bias)))

        def errors(got):
            return [float(np.linalg.norm(np.float64(g) - w) / (np.linalg.norm(w) + 1e-30))
                    for g, w in zip(got, want)]

        flax_f = functools.partial(flax_batch_norm, relu6=True)
        want = grads(flax_f, jnp.float64)
        ours = errors(grads(lambda *a: M.batch_norm(*a, 1e-5, True), jnp.float32))
        flax_f32 = errors(grads(flax_f, jnp.float32))
    for name, got, bound in zip(("x", "scale", "bias"), ours, flax_f32):
        assert got <= 1.5 * bound + 1e-6, (name, got, bound)


def test_training_mode_updates_running_statistics_as_flax():
    layer = M.ConvBN(3, 4, rngs=nnx.Rngs(0))
    x = adversarial_images((2, 5, 5, 3)).astype(jnp.float32)
    bn = nnx.BatchNorm(4, momentum=0.9, epsilon=1e-5, rngs=nnx.Rngs(0))
    bn.mean[...], bn.var[...] = layer.bn.mean[...] + 0.3, layer.bn.var[...] * 2
    layer.bn.mean[...], layer.bn.var[...] = bn.mean[...], bn.var[...]
    want = jax.nn.relu6(bn(layer.conv(x)))
    got = layer(x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(layer.bn.mean[...], bn.mean[...], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(layer.bn.var[...], bn.var[...], rtol=1e-6, atol=1e-7)


def test_pointwise_matmul_equals_the_convolution_values_and_gradients():
    with jax.enable_x64(True):
        x = adversarial_images((3, 5, 4, 6), key=4)
        kernel = jax.random.normal(jax.random.key(5), (1, 1, 6, 7), jnp.float64)
        kernel = kernel.at[:, :, :, 0].set(0.0).at[:, :, 1, :].set(0.0)  # dead out / in

        def conv(x, k):
            return jax.lax.conv_general_dilated(x, k, (1, 1), ((0, 0), (0, 0)),
                                                dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                                precision="highest")

        def loss(f):
            return lambda x, k: jnp.sum(jnp.sin(f(x, k)) * jnp.arange(7.0))

        want = jax.value_and_grad(loss(conv), (0, 1))(x, kernel)
        assert_trees_close(jax.value_and_grad(loss(M.pointwise_conv), (0, 1))(x, kernel), want,
                           rtol=1e-10, atol=1e-10)
        assert_trees_close(jax.jit(jax.value_and_grad(loss(M.pointwise_conv), (0, 1)))(x, kernel),
                           want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("frozen_norms", [False, True])
def test_model_with_matmul_pointwise_equals_the_convolution_model(frozen_norms):
    """The whole network, 1x1 layers as products vs as convolutions (float64): logits and
    every parameter's gradient; with the frozen norms folded too."""
    with jax.enable_x64(True):
        x = adversarial_images((2, 32, 32, 3), key=6)
        grads = []
        for pointwise in ("matmul", "conv"):
            m = M.MobileNetV2(5, width_mult=0.35, input_size=32, pointwise=pointwise,
                              rngs=nnx.Rngs(0))
            if frozen_norms:
                for _, node in nnx.graph.iter_graph(m):
                    if isinstance(node, M.ConvBN):
                        node.bn.use_running_average, node.fold_norm = True, True
            graphdef, params, rest = nnx.split(m, nnx.Param, ...)
            params = jax.tree.map(lambda a: a.astype(jnp.float64), params)
            rest = jax.tree.map(lambda a: a.astype(jnp.float64), rest)

            def loss(params):
                logits = nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest))(x)
                return jnp.sum(jnp.sin(logits))
            grads.append(jax.value_and_grad(loss)(params))
        assert_trees_close(grads[0], grads[1], rtol=1e-9, atol=1e-11)


def test_an_unknown_pointwise_method_is_refused():
    with pytest.raises(ValueError, match="point-wise method must be 'matmul' or 'conv'"):
        M.ConvBN(3, 4, pointwise="gemm", rngs=nnx.Rngs(0))
