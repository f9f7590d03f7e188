"""Depth-wise and 1x1 convolutions in the forms XLA's CPU backend runs fastest, in every
model's training step.

XLA's CPU backend runs a depth-wise convolution (a `conv_general_dilated` with one
input channel per group: MobileNet's, EfficientNet's, ConvNeXt's) as a generic grouped
convolution, 7-70x slower than the same products written as k x k shifted, strided
slices of the padded input times the filter taps, its input gradient slowest of all;
and a 1x1 convolution's weight gradient up to 12x slower than the same contraction as
one matrix product over the flattened pixels (`benchmarks/results/depthwise.md`).
pockjax's own MobileNetV2 is written in those forms; `rewrite_convolutions` gives them
to every other model: Keras's `DepthwiseConv2D` and `Conv2D(kernel_size=1)`,
torchvision's MobileNetV2 through `pockjax.torch`, an ONNX `Conv`.

`sparse_grad` (and so `sparse_train` and every trainer built on it) runs it on the
forward it differentiates. A depth-wise convolution is rewritten where it has two
spatial dimensions, `feature_group_count` equal to its input channels, one filter per
channel (no depth multiplier), no input dilation (not a transposed convolution) and at
most 7 x 7 taps, with any padding, stride, filter dilation and dimension order. A 1x1
convolution is rewritten where it is ungrouped, unpadded, not dilated and its input and
output keep the channels last (NHWC: Keras's and Flax's layout; torch's NCHW ones stay
convolutions, which would need two transposes). Both need a floating-point type; the
products of float16 and bfloat16 inputs are summed in float32, as XLA's convolution
does. Values equal the convolution's to float rounding (the sum's order differs), and
autodiff differentiates the new form. `POCKJAX_CONVOLUTIONS=xla` in the environment,
or `convolutions_kept()` around the tracing, keeps XLA's convolutions; `pockjax.export`
lowers under `convolutions_kept()`: IREE 3.13's CPU code generation fails on the
slices' weight gradients ("'vector.contract' op invalid accumulator/result vector
shape"), and IREE runs convolutions itself.
"""
from __future__ import annotations

import contextlib
import contextvars
import os

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax import lax

from pockjax._src.jaxpr import avals, interpret, var_shape

__all__ = ["rewrite_convolutions", "is_depthwise", "is_pointwise", "convolutions_kept",
           "enabled"]

_ON = contextvars.ContextVar("pockjax_rewrite_convolutions", default=True)
MAX_TAPS = 49
_FLOATS = (jnp.float32, jnp.float64, jnp.float16, jnp.bfloat16)


def enabled() -> bool:
    """Whether gradient programs traced now get their convolutions rewritten."""
    return _ON.get() and os.environ.get("POCKJAX_CONVOLUTIONS", "").strip().lower() != "xla"


@contextlib.contextmanager
def convolutions_kept():
    """Within this context, programs keep XLA's convolutions."""
    token = _ON.set(False)
    try:
        yield
    finally:
        _ON.reset(token)


def _float(eqn) -> bool:
    lhs, rhs = eqn.invars
    dtype, preferred = lhs.aval.dtype, eqn.params.get("preferred_element_type")
    return (any(dtype == t for t in _FLOATS) and rhs.aval.dtype == dtype
            and (preferred is None or preferred == dtype))


def is_pointwise(eqn) -> bool:
    """Whether `eqn` is a 1x1 convolution `rewrite_convolutions` turns into a product."""
    if eqn.primitive.name != "conv_general_dilated":
        return False
    p = eqn.params
    dn = p["dimension_numbers"]
    if len(dn.lhs_spec) != 4 or p["batch_group_count"] != 1 or p["feature_group_count"] != 1:
        return False
    kernel = var_shape(eqn.invars[1])
    if kernel[dn.rhs_spec[2]] != 1 or kernel[dn.rhs_spec[3]] != 1:
        return False
    if any(d != 1 for d in p["lhs_dilation"]) or any(x != 0 for pad in p["padding"] for x in pad):
        return False
    return dn.lhs_spec[1] == 3 and dn.out_spec[1] == 3 and _float(eqn)


def is_depthwise(eqn) -> bool:
    """Whether `eqn` is a depth-wise convolution `rewrite_convolutions` turns into slices."""
    if eqn.primitive.name != "conv_general_dilated":
        return False
    p = eqn.params
    dn = p["dimension_numbers"]
    lhs, rhs = eqn.invars
    if len(dn.lhs_spec) != 4 or p["batch_group_count"] != 1:
        return False
    if any(d != 1 for d in p["lhs_dilation"]):
        return False
    channels = var_shape(lhs)[dn.lhs_spec[1]]
    kernel = var_shape(rhs)
    if channels < 2 or p["feature_group_count"] != channels:
        return False
    if kernel[dn.rhs_spec[1]] != 1 or kernel[dn.rhs_spec[0]] != channels:
        return False
    return kernel[dn.rhs_spec[2]] * kernel[dn.rhs_spec[3]] <= MAX_TAPS and _float(eqn)


def _as_out(eqn, y):
    """An NHWC result `y` in the convolution's output order and type."""
    out = eqn.params["dimension_numbers"].out_spec
    place = {out[0]: 0, out[2]: 1, out[3]: 2, out[1]: 3}
    return jnp.transpose(y, [place[d] for d in range(4)]).astype(eqn.outvars[0].aval.dtype)


def _shifted(eqn, x, w):
    """The depth-wise convolution `eqn` of `x` by `w` as a sum of strided slices."""
    p = eqn.params
    lhs, rhs, _ = p["dimension_numbers"]
    xs = jnp.transpose(x, (lhs[0], lhs[2], lhs[3], lhs[1]))          # N H W C
    ws = jnp.transpose(w, (rhs[2], rhs[3], rhs[1], rhs[0]))[:, :, 0]  # kh kw C
    low = x.dtype in (jnp.float16, jnp.bfloat16)
    if low:
        xs, ws = xs.astype(jnp.float32), ws.astype(jnp.float32)
    (ph0, ph1), (pw0, pw1) = p["padding"]
    (sh, sw), (dh, dw) = p["window_strides"], p["rhs_dilation"]
    kh, kw = ws.shape[:2]
    if kh == kw and sh == sw and (dh, dw) == (1, 1) and (ph0, ph1, pw0, pw1) == (
            (kh - 1) // 2,) * 4:
        # pockjax's MobileNetV2 kernel: the same slices, with a hand-written backward
        # whose weight gradient is about 2x autodiff's (benchmarks/results/depthwise.md)
        from pockjax.models.mobilenetv2 import depthwise_conv

        return _as_out(eqn, depthwise_conv(xs, ws, sh))
    xp = lax.pad(xs, jnp.zeros((), xs.dtype), ((0, 0, 0), (ph0, ph1, 0), (pw0, pw1, 0),
                                               (0, 0, 0)))
    n, hp, wp, c = xp.shape
    oh, ow = (hp - (kh - 1) * dh - 1) // sh + 1, (wp - (kw - 1) * dw - 1) // sw + 1
    y = None
    for i in range(kh):
        for j in range(kw):
            window = lax.slice(xp, (0, i * dh, j * dw, 0),
                               (n, i * dh + (oh - 1) * sh + 1, j * dw + (ow - 1) * sw + 1, c),
                               (1, sh, sw, 1))
            term = window * ws[i, j]
            y = term if y is None else y + term
    return _as_out(eqn, y)


def _product(eqn, x, w):
    """The NHWC 1x1 convolution `eqn` of `x` by `w` as one matrix product."""
    p = eqn.params
    rhs = p["dimension_numbers"].rhs_spec
    sh, sw = p["window_strides"]
    if (sh, sw) != (1, 1):
        n, h, wd, c = x.shape
        x = lax.slice(x, (0, 0, 0, 0), (n, h, wd, c), (1, sh, sw, 1))
    w2 = jnp.transpose(w, (rhs[2], rhs[3], rhs[1], rhs[0])).reshape(w.shape[rhs[1]],
                                                                     w.shape[rhs[0]])
    low = x.dtype in (jnp.float16, jnp.bfloat16)
    y = jnp.dot(x.reshape(-1, x.shape[3]), w2,
                preferred_element_type=jnp.float32 if low else None)
    return _as_out(eqn, y.reshape(*x.shape[:3], w2.shape[1]))


def _override(eqn, ins, read):
    if is_depthwise(eqn):
        y = _shifted(eqn, *ins)
    elif is_pointwise(eqn):
        y = _product(eqn, *ins)
    else:
        return None
    return [y] if tuple(y.shape) == var_shape(eqn.outvars[0]) else None


def rewrite_convolutions(closed: jex.ClosedJaxpr) -> tuple[jex.ClosedJaxpr, int]:
    """`closed` with its top-level depth-wise convolutions computed as shifted slices and
    its 1x1 ones as products (see the module's docstring), and how many were
    rewritten; bodies of other equations (`scan`, `custom_vjp`) are left as they are.

    Args:
      closed: a jaxpr, e.g. the forward `sparse_grad` differentiates (nested `jit`
        calls inlined).

    Returns:
      A pair: the `ClosedJaxpr` over the same inputs computing the same outputs, and
        the number of convolutions rewritten (0: `closed` itself).
    """
    count = sum(is_depthwise(e) or is_pointwise(e) for e in closed.jaxpr.eqns)
    if not count or not enabled():
        return closed, 0
    jaxpr, consts = closed.jaxpr, closed.consts
    new = jax.make_jaxpr(lambda *a: interpret(jaxpr, consts, a, _override))(*avals(jaxpr.invars))
    return new, count
