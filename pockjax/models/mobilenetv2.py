"""MobileNetV2 (Sandler et al., 2018) in Flax NNX, laid out as torchvision builds it.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> from pockjax.models.mobilenetv2 import MobileNetV2
>>> model = MobileNetV2(10, width_mult=0.35, input_size=32, rngs=nnx.Rngs(0))
>>> logits = nnx.jit(lambda m, x: m(x))(model, jnp.zeros((2, 32, 32, 3)))
>>> logits.shape
(2, 10)

Inputs are NHWC float32. Parameter paths, as schemes glob them:

    stem/conv/kernel, stem/bn/{scale,bias}                    (batch stats stem/bn/{mean,var})
    blocks/{i}/expand/conv/kernel, blocks/{i}/expand/bn/...   (blocks with expansion t > 1)
    blocks/{i}/depthwise/conv/kernel, blocks/{i}/depthwise/bn/...
    blocks/{i}/project/conv/kernel, blocks/{i}/project/bn/...
    head/conv/kernel, head/bn/...
    classifier/kernel, classifier/bias

Conv kernels are HWIO and have no bias; every conv is followed by a `BatchNorm`
(running = 0.9 * running + 0.1 * batch statistic, epsilon 1e-5; the batch variance is
the biased one, divided by n, as flax computes it, where torch's running variance uses
the unbiased one). A new model is in training mode: batch norm normalises with the
batch's statistics and updates the running ones. `model.eval()` switches to the running
statistics, `model.train()` back. `pockjax.nnx.split` keeps the mode in the graph
definition and returns the running statistics as the "rest" state.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["MobileNetV2", "ConvBN", "DepthwiseConv", "InvertedResidual", "INVERTED_RESIDUAL_SETTINGS",
           "depthwise_conv", "batch_norm", "batch_statistics", "normalized",
           "blocks_with_expansion", "make_divisible"]

# (expansion t, output channels c, repeats n, stride s of the first repeat)
INVERTED_RESIDUAL_SETTINGS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
"""MobileNetV2's stages as rows `(expansion t, output channels c, repeats n, stride s of
the first repeat)`: the paper's 17 blocks."""

_STEM_CHANNELS = 32
_LAST_CHANNELS = 1280
_MIN_FEATURE_SIZE = 4
_BN_MOMENTUM = 0.9
_BN_EPSILON = 1e-5

# torchvision's initialisation: Kaiming normal (fan out) convs, N(0, 0.01) classifier.
_conv_init = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")
_classifier_init = nnx.initializers.normal(0.01)


def make_divisible(value: float, divisor: int = 8) -> int:
    """`value` rounded to a multiple of `divisor`, never more than 10% below it.

    torchvision's `_make_divisible`, which sets every channel count of the model.

    Args:
      value: the channel count to round (e.g. `32 * width_mult`).
      divisor: the multiple to round to (default 8).

    Returns:
      The nearest multiple of `divisor` (at least `divisor`), one step higher when that
      is below 90% of `value`.
    """
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


def blocks_with_expansion(settings=INVERTED_RESIDUAL_SETTINGS) -> tuple[int, ...]:
    """Indices of the blocks that have an `expand` (first point-wise) conv, i.e. t > 1,
    for the stages `settings` (see `MobileNetV2`).

    The same for every width and input size.

    Args:
      settings: the stages as rows `(t, c, n, s)` (default
        `INVERTED_RESIDUAL_SETTINGS`).

    Returns:
      The indices of those blocks, counting every repeat of every stage.

    Examples:
      >>> blocks_with_expansion()[:3]
      (1, 2, 3)
    """
    expands = [t != 1 for t, _, n, _ in settings for _ in range(n)]
    return tuple(i for i, e in enumerate(expands) if e)


def _check_settings(settings) -> tuple[tuple[int, int, int, int], ...]:
    try:
        rows = tuple(tuple(int(v) for v in row) for row in settings)
    except (TypeError, ValueError):
        rows = None
    if not rows or any(len(r) != 4 or r[0] < 1 or r[1] < 1 or r[2] < 1 or r[3] not in (1, 2)
                       for r in rows):
        raise ValueError("MobileNetV2 needs settings as rows (expansion t >= 1, channels c >= 1, "
                         f"repeats n >= 1, stride s in (1, 2)), got {settings!r}")
    return rows


def _strides(input_size: int, settings=INVERTED_RESIDUAL_SETTINGS) -> tuple[int, list[int]]:
    """The stem's stride and each stage's first stride for `input_size`.

    Starting from the standard total stride (32 for the standard stages), the earliest
    stride-2 layers (the stem, then the stages in order) become stride 1 until
    `input_size // total_stride >= 4`.
    """
    strides = [2] + [s for _, _, _, s in settings]
    total = 1
    for s in strides:
        total *= s
    for i, s in enumerate(strides):
        if input_size // total >= _MIN_FEATURE_SIZE:
            break
        if s == 2:
            strides[i] = 1
            total //= 2
    return strides[0], strides[1:]


class DepthwiseConv(nnx.Module):
    """A bias-free depth-wise convolution (one k x k filter per channel, HWIO kernel
    `[k, k, 1, C]`, padded by (k - 1) // 2), computed as k * k shifted, strided slices
    of the input times a per-channel weight, summed.

    The result is the grouped convolution's (to float32 rounding). XLA's CPU backend runs
    grouped convolutions slowly: forward and backward of a 3x3 layer on 8 x 32 x 32 x 96
    took 41 ms as a convolution and 1.9 ms as shifted slices (29 vs 0.5 ms at stride 2,
    2 cores), and the shifted form lowers to plain elementwise kernels for IREE too. The
    backward pass is hand-written (see `depthwise_conv`). `method="conv"` uses
    `lax.conv_general_dilated` instead.

    Args:
      channels: the number of channels (input and output).
      kernel_size: the filter size k (default 3).
      stride: the stride along height and width (default 1).
      method: `"shifts"` (default) or `"conv"`.
      rngs: the random streams the kernel is initialised from.

    Raises:
      ValueError: `method` is neither `"shifts"` nor `"conv"`.
    """

    def __init__(self, channels: int, kernel_size: int = 3, *, stride: int = 1,
                 method: str = "shifts", rngs: nnx.Rngs):
        if method not in ("shifts", "conv"):
            raise ValueError(f"depth-wise method must be 'shifts' or 'conv', got {method!r}")
        self.kernel = nnx.Param(_conv_init(rngs.params(), (kernel_size, kernel_size, 1, channels),
                                           jnp.float32))
        self.strides = (stride, stride)
        self.kernel_size, self.method = kernel_size, method
        # nnx.Conv's description of the same layer, for code that reads it.
        self.in_features = self.out_features = self.feature_group_count = channels
        pad = (kernel_size - 1) // 2
        self.padding = ((pad, pad), (pad, pad))

    def __call__(self, x: jax.Array) -> jax.Array:
        """The convolution of `x`.

        Args:
          x: NHWC input with `channels` channels.

        Returns:
          The NHWC output, in `x`'s dtype.
        """
        return self.apply(x, self.kernel[...])

    def apply(self, x: jax.Array, kernel: jax.Array) -> jax.Array:
        """The layer with `kernel` (HWIO `[k, k, 1, C]`) in place of its own (a folded one).

        Args:
          x: NHWC input.
          kernel: the kernel to use, HWIO `[k, k, 1, C]`; cast to `x`'s dtype.

        Returns:
          The NHWC output.
        """
        s = self.strides[0]
        if self.method == "conv":
            pad = (self.kernel_size - 1) // 2
            return jax.lax.conv_general_dilated(
                x, kernel.astype(x.dtype), self.strides, ((pad, pad), (pad, pad)),
                dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=x.shape[-1])
        return depthwise_conv(x, kernel[:, :, 0].astype(x.dtype), s)


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


class ConvBN(nnx.Module):
    """A bias-free convolution, batch norm and optionally ReLU6.

    In training mode the batch norm (with the ReLU6) runs as `batch_norm`, flax's
    forward with a closed-form backward; in inference mode it is `nnx.BatchNorm`'s, or,
    with `fold_norm` (see `pockjax.nnx.frozen_norms_in_inference_mode`), folded
    into the kernel: `conv(x, W * m) + c` for the affine map `x * m + c` it computes.

    3x3 convolutions pad by one on each side (as torchvision does, so a stride-2 layer
    keeps the top-left pixel); 1x1 convolutions do not pad, and with `pointwise="matmul"`
    (the default) a 1x1, stride-1 one runs as a matrix product (`pointwise_conv`). A
    depth-wise one (`groups == in_features == out_features`) is a `DepthwiseConv`.

    Args:
      in_features: the input channels.
      out_features: the output channels.
      kernel_size: the filter size (default 1); padded by `(kernel_size - 1) // 2`.
      stride: the stride along height and width (default 1).
      groups: the convolution's feature groups (default 1); equal to both channel
        counts, the layer is depth-wise.
      relu6: apply ReLU6 after the batch norm (default True).
      depthwise: how a depth-wise convolution runs: `"shifts"` (default) or `"conv"`
        (see `DepthwiseConv`).
      pointwise: how a 1x1, stride-1 convolution runs: `"matmul"` (default) or
        `"conv"`.
      rngs: the random streams the kernel is initialised from.

    Raises:
      ValueError: `pointwise` is neither `"matmul"` nor `"conv"`, or (for a depth-wise
        layer) `depthwise` is neither `"shifts"` nor `"conv"`.
    """

    def __init__(self, in_features: int, out_features: int, kernel_size: int = 1, *,
                 stride: int = 1, groups: int = 1, relu6: bool = True,
                 depthwise: str = "shifts", pointwise: str = "matmul", rngs: nnx.Rngs):
        if pointwise not in ("matmul", "conv"):
            raise ValueError(f"point-wise method must be 'matmul' or 'conv', got {pointwise!r}")
        pad = (kernel_size - 1) // 2
        if groups > 1 and groups == in_features == out_features:
            self.conv = DepthwiseConv(in_features, kernel_size, stride=stride, method=depthwise,
                                      rngs=rngs)
        else:
            self.conv = nnx.Conv(in_features, out_features, (kernel_size, kernel_size),
                                 strides=(stride, stride), padding=((pad, pad), (pad, pad)),
                                 feature_group_count=groups, use_bias=False,
                                 kernel_init=_conv_init, rngs=rngs)
        self.bn = nnx.BatchNorm(out_features, momentum=_BN_MOMENTUM, epsilon=_BN_EPSILON,
                                rngs=rngs)
        self.relu6, self.pointwise = relu6, pointwise
        # In inference mode the batch norm is the affine map x * m + (bias - mean * m),
        # m = scale / sqrt(var + eps): with `fold_norm` it is folded into the kernel.
        self.fold_norm = False

    def _conv(self, x: jax.Array, kernel: jax.Array) -> jax.Array:
        """The convolution with `kernel` (its own, or a folded one)."""
        conv = self.conv
        if isinstance(conv, DepthwiseConv):
            return conv.apply(x, kernel)
        dtype = jnp.result_type(x, kernel)  # as nnx.Conv promotes
        x, kernel = x.astype(dtype), kernel.astype(dtype)
        if self.pointwise == "matmul" and conv.kernel_size == (1, 1) and conv.strides == (1, 1) \
                and conv.feature_group_count == 1:
            return pointwise_conv(x, kernel)
        return jax.lax.conv_general_dilated(
            x, kernel, conv.strides, conv.padding, dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=conv.feature_group_count)

    def _folded(self, x: jax.Array) -> jax.Array:
        """conv(x, W) * m + c as conv(x, W * m) + c (m, c per output channel)."""
        bn = self.bn
        m = jax.lax.rsqrt(bn.var[...] + bn.epsilon) * bn.scale[...]
        shift = bn.bias[...] - bn.mean[...] * m
        return self._conv(x, self.conv.kernel[...] * m) + shift

    def __call__(self, x: jax.Array) -> jax.Array:
        """The convolution, batch norm and (with `relu6`) ReLU6 of `x`.

        In training mode this also updates the batch norm's running statistics.

        Args:
          x: NHWC input with `in_features` channels.

        Returns:
          The NHWC output with `out_features` channels.
        """
        bn = self.bn
        if bn.use_running_average:
            y = self._folded(x) if self.fold_norm else bn(self._conv(x, self.conv.kernel[...]))
            return jax.nn.relu6(y) if self.relu6 else y
        y, mean, var = batch_norm(self._conv(x, self.conv.kernel[...]), bn.scale[...], bn.bias[...],
                                  bn.epsilon, self.relu6)
        # flax's update of the running statistics (nnx.BatchNorm in training mode), kept in
        # their own dtype (float64 activations over float32 statistics would write float64
        # into them: JAX warns that this will become an error)
        for stat, new in ((bn.mean, mean), (bn.var, var)):
            old = stat[...]
            stat[...] = jax.lax.stop_gradient(
                bn.momentum * old + (1 - bn.momentum) * new).astype(old.dtype)
        return y


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


class InvertedResidual(nnx.Module):
    """Point-wise expansion (absent when t = 1), depth-wise 3x3, linear point-wise projection;
    a residual connection when the stride is 1 and the channel count is unchanged.

    Args:
      in_features: the input channels.
      out_features: the output channels.
      stride: the depth-wise convolution's stride.
      expansion: the expansion t: the hidden width is `round(in_features * t)`.
      depthwise: how the depth-wise convolution runs: `"shifts"` (default) or `"conv"`.
      pointwise: how the 1x1 convolutions run: `"matmul"` (default) or `"conv"`.
      rngs: the random streams the layers are initialised from.
    """

    def __init__(self, in_features: int, out_features: int, *, stride: int, expansion: int,
                 depthwise: str = "shifts", pointwise: str = "matmul", rngs: nnx.Rngs):
        hidden = int(round(in_features * expansion))
        self.expand = (ConvBN(in_features, hidden, pointwise=pointwise, rngs=rngs)
                       if expansion != 1 else None)
        self.depthwise = ConvBN(hidden, hidden, 3, stride=stride, groups=hidden,
                                depthwise=depthwise, rngs=rngs)
        self.project = ConvBN(hidden, out_features, relu6=False, pointwise=pointwise, rngs=rngs)
        self.residual = stride == 1 and in_features == out_features

    def __call__(self, x: jax.Array) -> jax.Array:
        """The block applied to NHWC `x`.

        Args:
          x: NHWC input with `in_features` channels.

        Returns:
          The NHWC output with `out_features` channels.
        """
        y = self.expand(x) if self.expand is not None else x
        y = self.project(self.depthwise(y))
        return x + y if self.residual else y


class MobileNetV2(nnx.Module):
    """MobileNetV2: logits `[N, num_classes]` from NHWC images `[N, size, size, in_channels]`.

    `width_mult` scales every layer's channels (rounded to multiples of 8; the last conv
    never drops below 1280). `input_size` fixes the expected image size and, for small
    images, the strides: starting from the standard total stride 32, the earliest
    stride-2 layers (the stem first, then the stages in order) become stride 1 until
    `input_size // total_stride >= 4`, so the last feature map is at least 4x4. Input
    sizes of 128 and more keep the standard strides; 32 runs the stem and the 24-channel
    stage at stride 1 (total stride 8, a 4x4 feature map). `dropout` > 0 adds dropout
    before the classifier in training mode (it then draws from `rngs`' "dropout" stream).
    `depthwise` picks how the depth-wise convolutions run (see `DepthwiseConv`):
    "shifts" (the default, fast on XLA's CPU backend) or "conv"; `pointwise` how the 1x1
    convolutions do: "matmul" (the default, see `pointwise_conv`) or "conv". `settings`
    lists the stages as rows (expansion t, output channels c, repeats n, first stride s);
    the default is the paper's 17 blocks (`INVERTED_RESIDUAL_SETTINGS`), and fewer rows
    give a shallower network of the same block kinds.

    Inputs of any other shape raise a `ValueError` naming the expected and found shapes.
    Under `nnx.eval_shape` construction allocates nothing (shapes, parameter counts).

    Args:
      num_classes: the number of logits (default 1000).
      width_mult: the channel multiplier, above 0 (default 1.0).
      input_size: the height and width of the images, at least 4 (default 224).
      in_channels: the channels of the images (default 3).
      dropout: the dropout rate before the classifier, in [0, 1) (default 0).
      depthwise: `"shifts"` (default) or `"conv"`.
      pointwise: `"matmul"` (default) or `"conv"`.
      settings: the stages as rows `(t, c, n, s)` (default
        `INVERTED_RESIDUAL_SETTINGS`).
      rngs: the random streams the parameters (and dropout) draw from.

    Raises:
      ValueError: `input_size` below 4, `width_mult` not above 0, `dropout` outside
        [0, 1), `settings` that are not rows of `t >= 1, c >= 1, n >= 1, s in (1, 2)`,
        or an unknown `depthwise` or `pointwise` method.
    """

    def __init__(self, num_classes: int = 1000, *, width_mult: float = 1.0, input_size: int = 224,
                 in_channels: int = 3, dropout: float = 0.0, depthwise: str = "shifts",
                 pointwise: str = "matmul", settings=INVERTED_RESIDUAL_SETTINGS,
                 rngs: nnx.Rngs):
        if input_size < _MIN_FEATURE_SIZE:
            raise ValueError(f"MobileNetV2 needs input_size >= {_MIN_FEATURE_SIZE}, "
                             f"got {input_size}")
        if width_mult <= 0:
            raise ValueError(f"MobileNetV2 needs width_mult > 0, got {width_mult}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"MobileNetV2 needs 0 <= dropout < 1, got {dropout}")
        self.settings = _check_settings(settings)
        self.num_classes, self.width_mult = num_classes, width_mult
        self.input_size, self.in_channels = input_size, in_channels

        stem_stride, stage_strides = _strides(input_size, self.settings)
        channels = make_divisible(_STEM_CHANNELS * width_mult)
        self.stem = ConvBN(in_channels, channels, 3, stride=stem_stride, rngs=rngs)
        blocks = []
        for (t, c, n, _), stride in zip(self.settings, stage_strides):
            out = make_divisible(c * width_mult)
            for i in range(n):
                blocks.append(InvertedResidual(channels, out, stride=stride if i == 0 else 1,
                                               expansion=t, depthwise=depthwise,
                                               pointwise=pointwise, rngs=rngs))
                channels = out
        self.blocks = nnx.List(blocks)
        self.last_channels = make_divisible(_LAST_CHANNELS * max(1.0, width_mult))
        self.head = ConvBN(channels, self.last_channels, pointwise=pointwise, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs if dropout > 0 else None)
        self.classifier = nnx.Linear(self.last_channels, num_classes, kernel_init=_classifier_init,
                                     bias_init=nnx.initializers.zeros_init(), rngs=rngs)

    @property
    def total_stride(self) -> int:
        """Input size over the last feature map's size (32, or less for small inputs)."""
        stride = self.stem.conv.strides[0]
        for block in self.blocks:
            stride *= block.depthwise.conv.strides[0]
        return stride

    def _check(self, x: jax.Array) -> None:
        expected = (self.input_size, self.input_size, self.in_channels)
        if jnp.ndim(x) == 4 and tuple(x.shape[1:]) == expected:
            return
        hint = ""
        if jnp.ndim(x) == 4 and tuple(x.shape[1:]) == (self.in_channels, self.input_size,
                                                         self.input_size):
            hint = "; the input looks NCHW: transpose it with x.transpose(0, 2, 3, 1)"
        elif jnp.ndim(x) == 3 and tuple(x.shape) == expected:
            hint = "; for a single image add the batch axis: x[None]"
        elif jnp.ndim(x) == 4 and x.shape[1:3] != expected[:2]:
            hint = (f"; build the model with input_size={x.shape[1]} for other image sizes"
                    if x.shape[1] == x.shape[2] else "")
        raise ValueError(
            f"MobileNetV2 expects NHWC inputs of shape [N, {expected[0]}, {expected[1]}, "
            f"{expected[2]}] (input_size={self.input_size}, in_channels={self.in_channels}), "
            f"found {tuple(jnp.shape(x))}{hint}")

    def features(self, x: jax.Array) -> jax.Array:
        """The last feature map, `[N, h, w, last_channels]`, before pooling.

        Args:
          x: NHWC images, `[N, input_size, input_size, in_channels]`.

        Returns:
          The feature map, `h = w = input_size / total_stride` (rounded up).

        Raises:
          ValueError: `x` is not of that shape.
        """
        self._check(x)
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def __call__(self, x: jax.Array) -> jax.Array:
        """The logits of a batch of images.

        Args:
          x: NHWC images, `[N, input_size, input_size, in_channels]`.

        Returns:
          The logits, `[N, num_classes]`.

        Raises:
          ValueError: `x` is not of that shape.
        """
        pooled = jnp.mean(self.features(x), axis=(1, 2))
        return self.classifier(self.dropout(pooled))

    @staticmethod
    def blocks_with_expansion() -> tuple[int, ...]:
        """The module-level `blocks_with_expansion` for the standard stages.

        Returns:
          The indices of the blocks with an `expand` conv in the standard
          `INVERTED_RESIDUAL_SETTINGS` (not this model's `settings`).
        """
        return blocks_with_expansion()

