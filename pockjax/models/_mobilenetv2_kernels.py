"""The compute kernels of MobileNetV2's layers (`pockjax.models.mobilenetv2`), each faster
on XLA's CPU backend than the plain formulation and with the same values: the depth-wise
convolution as shifted slices with a hand-written backward (`depthwise_conv`), the 1x1
convolution as one matrix product (`pointwise_conv`), and training-mode batch norm with
its closed-form backward (`batch_norm`). The layers of `_mobilenetv2_layers` call them;
`pockjax.models.mobilenetv2` re-exports the public names, and benchmarks/depthwise.py
times each against the alternatives.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _window(xp: jax.Array, i: int, j: int, stride: int, out_h: int, out_w: int) -> jax.Array:
    """xp[:, i::stride, j::stride, :], out_h x out_w of it: what tap (i, j) reads."""
    n, _, _, c = xp.shape
    return jax.lax.slice(xp, (0, i, j, 0),
                         (n, i + (out_h - 1) * stride + 1, j + (out_w - 1) * stride + 1, c),
                         (1, stride, stride, 1))


def _shifted_sum(xp: jax.Array, w: jax.Array, stride: int, out_h: int, out_w: int) -> jax.Array:
    """sum over (i, j) of xp[:, i::stride, j::stride, :] (out_h x out_w of it) * w[i, j]."""
    k = w.shape[0]
    out = None
    for i in range(k):
        for j in range(k):
            term = _window(xp, i, j, stride, out_h, out_w) * w[i, j]
            out = term if out is None else out + term
    return out


def _depthwise_out(x: jax.Array, k: int, stride: int) -> tuple[int, int, int]:
    pad = (k - 1) // 2
    return pad, (x.shape[1] + 2 * pad - k) // stride + 1, (x.shape[2] + 2 * pad - k) // stride + 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def depthwise_conv(x: jax.Array, w: jax.Array, stride: int) -> jax.Array:
    """Depth-wise 3x3 (or k x k) convolution of NHWC `x` with `w` `[k, k, C]` as shifted slices.

    Its gradients are written by hand: autodiff transposes each of the k * k slices into
    a padded, zero-filled copy of the input and sums them (XLA's slice/select fusions,
    the slowest operations of the step). Here the input gradient is a shifted-slice sum
    over the output gradient with the kernel flipped, split by output phase when strided
    (no zero-filled dilation), and the weight gradient is k * k products reduced over
    batch and space. Same values as autodiff to float32 rounding
    (benchmarks/depthwise.py measures each formulation).

    Args:
      x: NHWC input, `[N, H, W, C]`.
      w: the per-channel filters, `[k, k, C]`; the input is padded by `(k - 1) // 2`.
      stride: the stride along height and width.

    Returns:
      The NHWC output, `[N, H', W', C]`.
    """
    pad, out_h, out_w = _depthwise_out(x, w.shape[0], stride)
    xp = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    return _shifted_sum(xp, w, stride, out_h, out_w)


def _depthwise_fwd(x, w, stride):
    return depthwise_conv(x, w, stride), (x, w)


def _phase_taps(size: int, k: int, stride: int) -> list[list[tuple[int, int]]]:
    """For each output phase r of the input gradient along one axis (positions
    stride * q + r), the (tap i, offset d) pairs: x[stride * q + r] reached out[q + d]
    through w[i]."""
    pad = (k - 1) // 2
    return [[(i, (r + pad - i) // stride) for i in range(k) if (r + pad - i) % stride == 0]
            for r in range(min(stride, size))]


def _depthwise_bwd(stride, residuals, g):
    x, w = residuals
    k = w.shape[0]
    pad, out_h, out_w = _depthwise_out(x, k, stride)
    n, h, wd, c = x.shape
    # Input gradient by phases: x[s * q + r] gets out[q + d] * w[i] for the taps i of phase
    # r, so each of the s * s phases is a shifted-slice sum over g itself (no zero-filled
    # dilation), and together they cost k * k products per output position, as forward.
    rows, cols = _phase_taps(h, k, stride), _phase_taps(wd, k, stride)
    hq, wq = -(-h // stride), -(-wd // stride)
    offsets = [d for taps in rows + cols for _, d in taps]
    low = max(0, -min(offsets))
    high_h = max(0, hq + max(offsets) - out_h)
    high_w = max(0, wq + max(offsets) - out_w)
    gp = jnp.pad(g, ((0, 0), (low, high_h), (low, high_w), (0, 0)))
    phases = []
    for row_taps in rows:
        line = []
        for col_taps in cols:
            out = None
            for i, di in row_taps:
                for j, dj in col_taps:
                    term = jax.lax.slice(gp, (0, low + di, low + dj, 0),
                                         (n, low + di + hq, low + dj + wq, c)) * w[i, j]
                    out = term if out is None else out + term
            line.append(out if out is not None else jnp.zeros((n, hq, wq, c), g.dtype))
        phases.append(line)
    if stride == 1:
        gx = phases[0][0]
    else:  # interleave: [n, hq, s, wq, s, c] -> [n, hq * s, wq * s, c], cropped
        full = [line + [jnp.zeros_like(line[0])] * (stride - len(line)) for line in phases]
        full += [[jnp.zeros_like(phases[0][0])] * stride] * (stride - len(full))
        gx = jnp.stack([jnp.stack(line, axis=3) for line in full], axis=2)
        gx = gx.reshape(n, hq * stride, wq * stride, c)[:, :h, :wd]
    return gx, _depthwise_weight_grad(x, g, k, stride, pad).reshape(w.shape)


# Bytes of input and output gradient per chunk of images in the weight gradient: about
# one core's L2 cache here, so the k * k reductions re-read the chunk from cache.
_WEIGHT_GRAD_CHUNK_BYTES = 4 << 20
_WEIGHT_GRAD_MIN_CHUNKS = 4


def _depthwise_weight_grad(x, g, k: int, stride: int, pad: int) -> jax.Array:
    """`[k * k, C]`: for each tap, the product of the shifted input with `g` summed over
    batch and space. XLA computes each of the k * k sums as its own pass over both
    arrays; when they are larger than the cache, the sums run over chunks of images in a
    loop, so that the passes after the first read the chunk from the cache
    (2-2.7x faster on the large layers of MobileNetV2 at 128x128, batch 16;
    `benchmarks/depthwise.py`). Iteration i takes images i, i + m, i + 2m, ... (m
    iterations), so a batch split over D devices stays split when a chunk's image count
    is a multiple of D (no gather; one sum across devices at the end), as with 2 images
    of 128x128 on 2 devices. The chunks' sums are added in float32 at least. `sparse_grad`
    does not narrow the loop: a kernel trained by `Channels` gets its whole gradient
    there, then sliced."""
    n = x.shape[0]
    per_image = (x[0].size + g[0].size) * x.dtype.itemsize
    chunk = max([d for d in range(1, n + 1)
                 if n % d == 0 and d * per_image <= _WEIGHT_GRAD_CHUNK_BYTES], default=1)
    dtype = jnp.result_type(x, g)

    def sums(x, g, acc_dtype=None):
        out_h, out_w = g.shape[1:3]
        xp = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
        return jnp.stack([jnp.sum(_window(xp, i, j, stride, out_h, out_w) * g, axis=(0, 1, 2),
                                  dtype=acc_dtype) for i in range(k) for j in range(k)])

    steps = n // chunk
    if steps < _WEIGHT_GRAD_MIN_CHUNKS:  # small enough: the loop would not pay
        return sums(x, g)
    acc_dtype = jnp.promote_types(dtype, jnp.float32)
    xs, gs = (a.reshape(chunk, steps, *a.shape[1:]) for a in (x, g))
    take = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, 1, keepdims=False)
    body = lambda i, acc: acc + sums(take(xs, i), take(gs, i), acc_dtype)
    total = jax.lax.fori_loop(0, steps, body, jnp.zeros((k * k, x.shape[-1]), acc_dtype))
    return total.astype(dtype)


depthwise_conv.defvjp(_depthwise_fwd, _depthwise_bwd)


def pointwise_conv(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """A 1x1, stride-1 convolution of NHWC `x` with HWIO `kernel` `[1, 1, I, O]` as one
    `[N*H*W, I] @ [I, O]` matrix product.

    Same values as the convolution to float32 rounding. Autodiff of the product gives
    two more plain matrix products, where XLA's CPU backend computes a 1x1 convolution's
    weight gradient as a convolution with an H x W window: forward and both gradients
    of 16 x 64 x 64 x 16 -> 96 took 52 ms as a convolution and 4.7 ms as a product
    (2 cores; `benchmarks/depthwise.py`). A `dot_general` contracting the last axis in
    place, without the reshape, took 38 ms.

    Args:
      x: NHWC input, `[N, H, W, I]`.
      kernel: HWIO kernel, `[1, 1, I, O]`.

    Returns:
      The NHWC output, `[N, H, W, O]`.
    """
    n, h, w, c = x.shape
    return (x.reshape(n * h * w, c) @ kernel.reshape(c, kernel.shape[-1])).reshape(n, h, w, -1)


def batch_statistics(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """flax's: mean and biased variance over all axes but the last, E[x^2] - E[x]^2 clipped at 0.

    Args:
      x: the activations, channels last.

    Returns:
      `(mean, var)`, each of shape `[C]`.
    """
    axes = tuple(range(x.ndim - 1))
    mean, mean2 = jnp.mean(x, axes), jnp.mean(x * x, axes)
    return mean, jnp.maximum(0.0, mean2 - mean * mean)


def normalized(x, mean, var, scale, bias, epsilon, relu6):
    """`(ReLU6 of y if relu6 else y, y)` for `y` = `x` normalised with `mean` and `var`.

    Args:
      x: the activations, channels last.
      mean: the per-channel mean.
      var: the per-channel variance.
      scale: the per-channel scale applied after normalising.
      bias: the per-channel bias added after scaling.
      epsilon: added to `var` before the square root.
      relu6: apply ReLU6 to the first output.

    Returns:
      `(out, y)`: the output and the affine result before the ReLU6.
    """
    y = (x - mean) * (jax.lax.rsqrt(var + epsilon) * scale) + bias
    return (jax.nn.relu6(y) if relu6 else y), y


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def batch_norm(x, scale, bias, epsilon: float, relu6: bool):
    """Training-mode batch norm (and ReLU6) over the last axis: `(y, batch mean, batch var)`,
    as `nnx.BatchNorm` computes them.

    The backward pass is the closed form (two per-channel sums of the output gradient,
    then one elementwise pass), where autodiff of flax's formula differentiates the mean,
    E[x^2], the clipping and the normalisation one by one.

    Args:
      x: the activations, channels last.
      scale: the per-channel scale.
      bias: the per-channel bias.
      epsilon: added to the variance before the square root.
      relu6: apply ReLU6 to the output.

    Returns:
      `(y, mean, var)`: the output, and the batch mean and biased variance per
      channel.
    """
    mean, var = batch_statistics(x)
    return normalized(x, mean, var, scale, bias, epsilon, relu6)[0], mean, var


def _batch_norm_fwd(x, scale, bias, epsilon, relu6):
    mean, var = batch_statistics(x)
    out, _ = normalized(x, mean, var, scale, bias, epsilon, relu6)
    return (out, mean, var), (x, mean, var, scale, bias)


def _batch_norm_bwd(epsilon, relu6, residuals, cotangents):
    dtypes = [r.dtype for r in residuals]
    # bfloat16 and float16 are computed in float32: sum(g * x) below can overflow float16
    # where the centred sum would not, and lose all bfloat16 digits at |mean| / std = 10.
    acc = jnp.promote_types(residuals[0].dtype, jnp.float32)
    x, mean, var, scale, bias = (r.astype(acc) for r in residuals)
    g, g_mean, g_var = (c.astype(acc) for c in cotangents)
    axes = tuple(range(x.ndim - 1))
    n = x.size // x.shape[-1]
    rstd = jax.lax.rsqrt(var + epsilon)
    a = scale * rstd  # y = x * a + shift
    shift = bias - mean * a
    if relu6:
        y = x * a + shift
        g = jnp.where((y > 0) & (y < 6), g, 0.0)
    g_bias = jnp.sum(g, axes)
    # sum(g * xhat) = rstd * (sum(g * x) - mean * sum(g)). Written with `x - mean`, XLA's
    # CPU backend wrote the centred copy of x to memory for the per-channel sum (its
    # library reductions take no broadcast operand), once per batch norm: the sparse
    # MobileNetV2 step (1.0, 128^2, batch 16) took 154 ms with the copy, 118.5 ms
    # without. The difference cancels: its rounding error grows linearly with
    # |mean| / std (1e-4 relative at 300 in float32), where the forward's variance
    # E[x^2] - E[x]^2 (flax's formula) loses digits with its square. On a channel of one
    # value other than 0, where the exact sum is 0, this leaves rounding noise.
    g_scale = rstd * (jnp.sum(g * x, axes) - mean * g_bias)
    # gx = (a / n) * (n * g - g_bias - xhat * g_scale), plus the statistics' own
    # cotangents (zero unless something differentiates them; the variance is clipped at
    # 0, where its gradient is 0) (g_mean + 2 * g_var * (x - mean)) / n, written as
    # a * g + c1 * x + c0 with per-channel c1, c0: one elementwise pass over x and g.
    g_var = jnp.where(var > 0, g_var, 0.0)
    c1 = 2 * g_var / n - (a / n) * rstd * g_scale
    c0 = g_mean / n - (a / n) * g_bias - c1 * mean
    gx = a * g + c1 * x + c0
    return gx.astype(dtypes[0]), g_scale.astype(dtypes[3]), g_bias.astype(dtypes[4])


batch_norm.defvjp(_batch_norm_fwd, _batch_norm_bwd)
