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

This module holds the stages (`INVERTED_RESIDUAL_SETTINGS`, `make_divisible`,
`blocks_with_expansion`) and the model; the layers (`_mobilenetv2_layers`) and their
kernels (`_mobilenetv2_kernels`) live in private modules whose public names it re-exports.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# Re-exported: the kernels are public names of this module.
from pockjax._src.home import claim
from pockjax.models._mobilenetv2_kernels import (batch_norm, batch_statistics,  # noqa: F401
                                                 depthwise_conv, normalized, pointwise_conv)
from pockjax.models._mobilenetv2_layers import ConvBN, DepthwiseConv, InvertedResidual

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

# torchvision's initialisation of the classifier: N(0, 0.01).
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



claim(globals())  # public names defined in the private modules above live here
