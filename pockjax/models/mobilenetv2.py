"""MobileNetV2 (Sandler et al., 2018) in Flax NNX, laid out as torchvision builds it.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> from pockjax.models.mobilenetv2 import MobileNetV2
>>> model = MobileNetV2(10, width_mult=0.35, input_size=32, rngs=nnx.Rngs(0))
>>> model(jnp.zeros((2, 32, 32, 3))).shape
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

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["MobileNetV2", "ConvBN", "DepthwiseConv", "InvertedResidual", "INVERTED_RESIDUAL_SETTINGS",
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
    """
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


def blocks_with_expansion() -> tuple[int, ...]:
    """Indices of the blocks that have an `expand` (first point-wise) conv, i.e. t > 1.

    The same for every width and input size.

    >>> blocks_with_expansion()[:3]
    (1, 2, 3)
    """
    expands = [t != 1 for t, _, n, _ in INVERTED_RESIDUAL_SETTINGS for _ in range(n)]
    return tuple(i for i, e in enumerate(expands) if e)


def _strides(input_size: int) -> tuple[int, list[int]]:
    """The stem's stride and each stage's first stride for `input_size`.

    Starting from the standard total stride 32, the earliest stride-2 layers (the stem,
    then the stages in order) become stride 1 until `input_size // total_stride >= 4`.
    """
    strides = [2] + [s for _, _, _, s in INVERTED_RESIDUAL_SETTINGS]
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
    2 cores), and the shifted form lowers to plain elementwise kernels for IREE too.
    `method="conv"` uses `lax.conv_general_dilated` instead.
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
        k, s = self.kernel_size, self.strides[0]
        w = self.kernel[...]
        pad = (k - 1) // 2
        if self.method == "conv":
            return jax.lax.conv_general_dilated(
                x, w.astype(x.dtype), self.strides, ((pad, pad), (pad, pad)),
                dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=x.shape[-1])
        n, h, wd, c = x.shape
        xp = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
        ho, wo = (h + 2 * pad - k) // s + 1, (wd + 2 * pad - k) // s + 1
        out = None
        for i in range(k):
            for j in range(k):
                window = jax.lax.slice(xp, (0, i, j, 0),
                                       (n, i + (ho - 1) * s + 1, j + (wo - 1) * s + 1, c),
                                       (1, s, s, 1))
                term = window * w[i, j, 0].astype(x.dtype)
                out = term if out is None else out + term
        return out


class ConvBN(nnx.Module):
    """A bias-free convolution, batch norm and optionally ReLU6.

    3x3 convolutions pad by one on each side (as torchvision does, so a stride-2 layer
    keeps the top-left pixel); 1x1 convolutions do not pad. A depth-wise one
    (`groups == in_features == out_features`) is a `DepthwiseConv`.
    """

    def __init__(self, in_features: int, out_features: int, kernel_size: int = 1, *,
                 stride: int = 1, groups: int = 1, relu6: bool = True,
                 depthwise: str = "shifts", rngs: nnx.Rngs):
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
        self.relu6 = relu6

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.bn(self.conv(x))
        return jax.nn.relu6(y) if self.relu6 else y


class InvertedResidual(nnx.Module):
    """Point-wise expansion (absent when t = 1), depth-wise 3x3, linear point-wise projection;
    a residual connection when the stride is 1 and the channel count is unchanged."""

    def __init__(self, in_features: int, out_features: int, *, stride: int, expansion: int,
                 depthwise: str = "shifts", rngs: nnx.Rngs):
        hidden = int(round(in_features * expansion))
        self.expand = ConvBN(in_features, hidden, rngs=rngs) if expansion != 1 else None
        self.depthwise = ConvBN(hidden, hidden, 3, stride=stride, groups=hidden,
                                depthwise=depthwise, rngs=rngs)
        self.project = ConvBN(hidden, out_features, relu6=False, rngs=rngs)
        self.residual = stride == 1 and in_features == out_features

    def __call__(self, x: jax.Array) -> jax.Array:
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
    "shifts" (the default, fast on XLA's CPU backend) or "conv".

    Inputs of any other shape raise a `ValueError` naming the expected and found shapes.
    Under `nnx.eval_shape` construction allocates nothing (shapes, parameter counts).
    """

    def __init__(self, num_classes: int = 1000, *, width_mult: float = 1.0, input_size: int = 224,
                 in_channels: int = 3, dropout: float = 0.0, depthwise: str = "shifts",
                 rngs: nnx.Rngs):
        if input_size < _MIN_FEATURE_SIZE:
            raise ValueError(f"MobileNetV2 needs input_size >= {_MIN_FEATURE_SIZE}, "
                             f"got {input_size}")
        if width_mult <= 0:
            raise ValueError(f"MobileNetV2 needs width_mult > 0, got {width_mult}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"MobileNetV2 needs 0 <= dropout < 1, got {dropout}")
        self.num_classes, self.width_mult = num_classes, width_mult
        self.input_size, self.in_channels = input_size, in_channels

        stem_stride, stage_strides = _strides(input_size)
        channels = make_divisible(_STEM_CHANNELS * width_mult)
        self.stem = ConvBN(in_channels, channels, 3, stride=stem_stride, rngs=rngs)
        blocks = []
        for (t, c, n, _), stride in zip(INVERTED_RESIDUAL_SETTINGS, stage_strides):
            out = make_divisible(c * width_mult)
            for i in range(n):
                blocks.append(InvertedResidual(channels, out, stride=stride if i == 0 else 1,
                                               expansion=t, depthwise=depthwise, rngs=rngs))
                channels = out
        self.blocks = nnx.List(blocks)
        self.last_channels = make_divisible(_LAST_CHANNELS * max(1.0, width_mult))
        self.head = ConvBN(channels, self.last_channels, rngs=rngs)
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
        """The last feature map, `[N, h, w, last_channels]`, before pooling."""
        self._check(x)
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def __call__(self, x: jax.Array) -> jax.Array:
        pooled = jnp.mean(self.features(x), axis=(1, 2))
        return self.classifier(self.dropout(pooled))

    @staticmethod
    def blocks_with_expansion() -> tuple[int, ...]:
        """See the module-level `blocks_with_expansion`."""
        return blocks_with_expansion()

