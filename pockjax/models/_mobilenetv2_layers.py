"""The layers of MobileNetV2 (`pockjax.models.mobilenetv2.MobileNetV2` stacks them): the
depth-wise convolution (`DepthwiseConv`), a convolution with its batch norm and ReLU6
(`ConvBN`, computed through the kernels of `_mobilenetv2_kernels`) and the inverted
residual block (`InvertedResidual`). `pockjax.models.mobilenetv2` re-exports them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pockjax.models._mobilenetv2_kernels import batch_norm, depthwise_conv, pointwise_conv

_BN_MOMENTUM = 0.9
_BN_EPSILON = 1e-5

# torchvision's initialisation of the convs: Kaiming normal (fan out).
_conv_init = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")


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
