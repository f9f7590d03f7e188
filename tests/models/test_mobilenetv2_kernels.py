"""The MobileNetV2 model's hand-written backward passes (depth-wise convolution, batch
norm) against JAX's autodiff of the reference formulas, in float64."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pockjax.models import _mobilenetv2_kernels as kernels
from pockjax.models import mobilenetv2 as M
from tests.helpers import MOBILENETV2_STAGES, assert_trees_close


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


# Compiled, and uncompiled (op by op, as a user calling the function outside jit) for one
# shape per stride: uncompiled, each case compiles every operation for its shapes.
@pytest.mark.parametrize("stride,h,w,eager", [(1, 9, 7, True), (2, 9, 9, False), (2, 8, 8, False),
                                              (2, 8, 7, True), (1, 1, 1, False), (2, 1, 2, False),
                                              (2, 2, 3, False)])
def test_depthwise_gradients_equal_the_grouped_convolution(stride, h, w, eager):
    with jax.enable_x64(True):
        x = adversarial_images((2, h, w, 5))
        kernel = jax.random.normal(jax.random.key(1), (3, 3, 5), jnp.float64)
        kernel = kernel.at[:, :, 0].set(0.0)  # a dead first channel

        def loss(f):
            return lambda x, k: jnp.sum(jnp.sin(f(x, k, stride)) * jnp.arange(5.0))

        want = jax.jit(jax.value_and_grad(loss(grouped_conv), (0, 1)))(x, kernel)
        got = jax.value_and_grad(loss(kernels.depthwise_conv), (0, 1))
        assert_trees_close(jax.jit(got)(x, kernel), want, rtol=1e-10, atol=1e-10)
        if eager:
            assert_trees_close(got(x, kernel), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("images_per_chunk", [1, 2, 3])
@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_weight_gradient_in_chunks_of_images(monkeypatch, stride, images_per_chunk):
    """Large inputs take the weight gradient over chunks of images in a loop; made to
    happen here by shrinking the chunk size (6 images: 6, 3 or 2 loop iterations)."""
    with jax.enable_x64(True):
        x = adversarial_images((6, 9, 8, 5), key=2)
        kernel = jax.random.normal(jax.random.key(3), (3, 3, 5), jnp.float64)
        kernel = kernel.at[:, :, -1].set(0.0)
        per_image = (x[0].size + kernels.depthwise_conv(x[:1], kernel, stride)[0].size) * 8
        monkeypatch.setattr(kernels, "_WEIGHT_GRAD_CHUNK_BYTES", images_per_chunk * per_image)
        monkeypatch.setattr(kernels, "_WEIGHT_GRAD_MIN_CHUNKS", 2)

        def loss(f):
            return lambda x, k: jnp.sum(jnp.tanh(f(x, k, stride)) * jnp.arange(5.0))

        want = jax.jit(jax.value_and_grad(loss(grouped_conv), (0, 1)))(x, kernel)
        grad = jax.value_and_grad(loss(kernels.depthwise_conv), (0, 1))
        assert "scan" in str(jax.make_jaxpr(grad)(x, kernel))  # the chunked path ran
        assert_trees_close(jax.jit(grad)(x, kernel), want, rtol=1e-10, atol=1e-10)


def test_chunked_depthwise_weight_gradient_keeps_a_split_batch_split(monkeypatch):
    """With the batch split over two devices and chunks of two images, the chunked
    weight gradient reads each device's own images (no all-gather, one all-reduce of the
    [9, C] sums) and equals the unchunked one; bfloat16 inputs are summed in float32
    across chunks."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    monkeypatch.setattr(kernels, "_WEIGHT_GRAD_CHUNK_BYTES", 2 * (6 * 6 * 4 * 2) * 4)
    monkeypatch.setattr(kernels, "_WEIGHT_GRAD_MIN_CHUNKS", 2)
    x = adversarial_images((8, 6, 6, 4), key=4).astype(jnp.float32)
    g = jax.random.normal(jax.random.key(5), (8, 6, 6, 4))
    split = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), PartitionSpec("data"))
    grad = jax.jit(lambda x, g: kernels._depthwise_weight_grad(x, g, 3, 1, 1))
    hlo = grad.lower(jax.device_put(x, split), jax.device_put(g, split)).compile().as_text()
    assert "all-gather" not in hlo and "all-reduce" in hlo and "while" in hlo
    monkeypatch.setattr(kernels, "_WEIGHT_GRAD_MIN_CHUNKS", 10**6)  # the unchunked reference
    want = jax.jit(lambda x, g: kernels._depthwise_weight_grad(x, g, 3, 1, 1))(x, g)
    monkeypatch.setattr(kernels, "_WEIGHT_GRAD_MIN_CHUNKS", 2)
    got = grad(jax.device_put(x, split), jax.device_put(g, split))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)
    xb, gb = x.astype(jnp.bfloat16), g.astype(jnp.bfloat16)
    low = grad(xb, gb)
    assert low.dtype == jnp.bfloat16
    with jax.enable_x64(True):  # the same bfloat16 inputs, summed exactly
        exact = np.asarray(kernels._depthwise_weight_grad(xb.astype(jnp.float64),
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
        got = jax.value_and_grad(loss(lambda *a: kernels.batch_norm(*a, 1e-5, relu6)),
                                 (0, 1, 2))(x, scale, bias)
        assert_trees_close(got, want, rtol=1e-9, atol=1e-9)


def centred_backward(epsilon, relu6, residuals, cotangents):
    """The training-mode batch norm's backward in the textbook form (numpy, float64):
    normalised x, its two sums, then the input gradient."""
    x, mean, var, scale, bias, g, g_mean, g_var = (np.asarray(a, np.float64)
                                                   for a in (*residuals, *cotangents))
    n = x.size // x.shape[-1]
    rstd = 1 / np.sqrt(var + epsilon)
    xhat = (x - mean) * rstd
    if relu6:
        y = xhat * scale + bias
        g = np.where((y > 0) & (y < 6), g, 0.0)
    g_bias, g_scale = g.sum((0, 1, 2)), (g * xhat).sum((0, 1, 2))
    g_var = np.where(var > 0, g_var, 0.0)
    gx = (scale * rstd / n) * (n * g - g_bias - xhat * g_scale) + (g_mean + 2 * g_var * (x - mean)) / n
    return gx, g_scale, g_bias


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("relu6", [True, False])
def test_batch_norm_backward_rounding_is_bounded(dtype, relu6):
    """The backward sums g * x and subtracts mean * sum(g) (no centred copy of x): its
    float32 rounding error grows with |mean| / std, and stays within a bound of that
    form (8 float32 epsilons per operand's magnitude), per element, against the
    textbook form in float64 on the same residuals. Channels at |mean| / std from 0 to
    1000, with gradients correlated with x so that a 1% error in a sum would show;
    bfloat16 and float16 are computed in float32 (float16 sums of g * x would overflow
    here), then rounded once."""
    rng = np.random.default_rng(7)
    # float16's forward squares x: 300^2 is past its largest value
    ratios = np.array([0.0, 1.0, 10.0, 100.0, 300.0, 1000.0] if dtype != "float16" else
                      [0.0, 1.0, 3.0, 10.0, 30.0, 100.0])
    x = rng.standard_normal((16, 64, 64, ratios.size)) + ratios
    x[:, ::8] = 0.0  # exact zeros
    x[..., 0] = 0.0  # a channel of zeros: variance 0
    xhat = (x - x.mean((0, 1, 2))) / (x.std((0, 1, 2)) + 1e-3)
    g = (xhat + rng.standard_normal(x.shape)) * 1e-3
    scale = np.array([1.0, 2.0, 0.5, -1.0, 0.5, 3.0])
    bias = np.array([0.0, 1.0, 2.0, 3.0, 0.1, 0.2])
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    _, residuals = kernels._batch_norm_fwd(cast(x), cast(scale), cast(bias), 1e-5, relu6)
    mean_var_cot = (jnp.asarray(rng.standard_normal(ratios.size) * 1e-3, dtype),
                    jnp.zeros(ratios.size, dtype))
    cotangents = (cast(g), *mean_var_cot)
    got = kernels._batch_norm_bwd(1e-5, relu6, residuals, cotangents)
    assert [r.dtype for r in got] == [jnp.dtype(dtype)] * 3
    want = centred_backward(1e-5, relu6, residuals, cotangents)

    eps, narrow = np.finfo(np.float32).eps, float(jnp.finfo(dtype).eps) / 2
    tiny = float(jnp.finfo(dtype).smallest_subnormal)  # rounding of the result near 0
    r = [np.asarray(a, np.float64) for a in residuals]
    xr, mean, var, scale_r = r[0], r[1], r[2], r[3]
    rstd = 1 / np.sqrt(var + 1e-5)
    gr = np.abs(np.asarray(cotangents[0], np.float64))
    size = np.abs(xr) + np.abs(mean)
    scale_bound = 8 * eps * rstd * (gr * size).sum((0, 1, 2)) + narrow * np.abs(want[1]) + tiny
    n = xr.size // xr.shape[-1]
    c1 = np.abs(scale_r * rstd / n * rstd * want[1])
    gx_bound = (8 * eps * (np.abs(scale_r * rstd) * gr + c1 * size
                           + np.abs(scale_r * rstd / n * want[2])
                           + np.abs(np.asarray(mean_var_cot[0], np.float64)) / n)
                + np.abs(scale_r * rstd / n * rstd) * scale_bound * np.abs(xr - mean)
                + narrow * np.abs(want[0]) + tiny)
    np.testing.assert_array_less(np.abs(np.asarray(got[1], np.float64) - want[1]), scale_bound + 1e-30)
    np.testing.assert_array_less(np.abs(np.asarray(got[0], np.float64) - want[0]), gx_bound + 1e-30)
    np.testing.assert_allclose(np.asarray(got[2], np.float64), want[2],
                               rtol=8 * eps * np.sqrt(n) + narrow, atol=1e-30)
    # the bound is tight enough to see a 1% error in the scale's gradient
    assert np.all(0.01 * np.abs(want[1][1:]) > scale_bound[1:])


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
        grad = jax.value_and_grad(loss(kernels.pointwise_conv), (0, 1))
        assert_trees_close(grad(x, kernel), want, rtol=1e-10, atol=1e-10)
        assert_trees_close(jax.jit(grad)(x, kernel), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("frozen_norms", [False, True])
def test_model_with_matmul_pointwise_equals_the_convolution_model(frozen_norms):
    """The whole network, 1x1 layers as products vs as convolutions (float64): logits and
    every parameter's gradient; with the frozen norms folded too."""
    with jax.enable_x64(True):
        x = adversarial_images((2, 32, 32, 3), key=6)
        grads = []
        for pointwise in ("matmul", "conv"):
            m = M.MobileNetV2(5, width_mult=0.35, input_size=32, pointwise=pointwise,
                              settings=MOBILENETV2_STAGES, rngs=nnx.Rngs(0))
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
            # Compiled: uncompiled, the whole network in float64 ran op by op for minutes.
            grads.append(jax.jit(jax.value_and_grad(loss))(params))
        assert_trees_close(grads[0], grads[1], rtol=1e-9, atol=1e-11)


def test_an_unknown_pointwise_method_is_refused():
    with pytest.raises(ValueError, match="point-wise method must be 'matmul' or 'conv'"):
        M.ConvBN(3, 4, pointwise="gemm", rngs=nnx.Rngs(0))
