"""ONNX operators as `jax.numpy` (or numpy) functions, by ONNX's specification (opsets 13
and later).

Each operator takes the node's attributes and its inputs and returns its outputs. Inputs
that are numpy arrays (initializers kept as constants, `Shape`'s result, `Constant`s)
are computed with numpy when every input is one: shape arithmetic is folded while the
graph is traced, so `Reshape`, `Expand`, `Slice` and friends see static values under
`jit`. An input that is missing (an empty name) is None.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def _static(*xs) -> bool:
    return all(x is None or isinstance(x, (np.ndarray, np.generic)) for x in xs)


def _xp(*xs):
    return np if _static(*xs) else jnp


def _ints(x) -> list[int]:
    """A shape-like input as Python ints (it must be static)."""
    if not _static(x):
        raise NotImplementedError("a shape, axis or index input that is computed from the "
                                  "data (not from shapes and constants) cannot be traced")
    return [int(v) for v in np.asarray(x).reshape(-1)]


def _axis(a, ndim):
    return a + ndim if a < 0 else a


def _elementwise(fn):
    return lambda attrs, *xs: fn(_xp(*xs), *xs)


def _div(xp, a, b):
    """ONNX's Div: integers divide truncating toward zero (C's `/`, not Python's `//`)."""
    dtype = np.asarray(a).dtype if xp is np else a.dtype
    if not np.issubdtype(dtype, np.integer):
        return a / b
    q = a // b
    return q + ((a % b != 0) & ((a < 0) != (b < 0))).astype(q.dtype)


CAST_TYPES = frozenset("bool int8 uint8 int16 uint16 int32 uint32 int64 uint64 float16 bfloat16 "
                       "float32 float64".split())
"""The types `Cast` and `CastLike` convert to: ONNX's rounding and saturation into its
8-, 4- and 2-bit floats and 4- and 2-bit integers are not numpy's, so those are refused."""


def _cast_type(to):
    """The numpy dtype of ONNX type `to` (an int, or a dtype already), one of
    `CAST_TYPES`."""
    from onnx import helper

    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(to) if isinstance(to, int) else to)
    if dtype.name not in CAST_TYPES:
        raise NotImplementedError(f"a cast to {dtype.name} (pockjax.onnx casts to "
                                  f"{', '.join(sorted(CAST_TYPES))})")
    return dtype


# --------------------------------------------------------------------------- math


def _gemm(attrs, a, b, c=None):
    xp = _xp(a, b, c)
    if attrs.get("transA", 0):
        a = a.T
    if attrs.get("transB", 0):
        b = b.T
    out = attrs.get("alpha", 1.0) * (a @ b)
    if c is not None:
        out = out + attrs.get("beta", 1.0) * c
    return xp.asarray(out)


def _conv(attrs, x, w, b=None):
    nd = x.ndim - 2
    strides = attrs.get("strides", [1] * nd)
    dil = attrs.get("dilations", [1] * nd)
    groups = attrs.get("group", 1)
    pads = attrs.get("pads", [0] * (2 * nd))
    auto = attrs.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        padding = auto.replace("_UPPER", "").replace("_LOWER", "")
        if auto == "SAME_LOWER":
            padding = "SAME_LOWER"
    elif auto == "VALID":
        padding = "VALID"
    else:
        padding = [(pads[i], pads[i + nd]) for i in range(nd)]
    spatial = "".join("DHW"[3 - nd:])
    dn = jax.lax.conv_dimension_numbers(x.shape, w.shape, (f"NC{spatial}", f"OI{spatial}",
                                                           f"NC{spatial}"))
    out = jax.lax.conv_general_dilated(jnp.asarray(x), jnp.asarray(w), strides, padding,
                                       rhs_dilation=dil, dimension_numbers=dn,
                                       feature_group_count=groups)
    if b is not None:
        out = out + jnp.reshape(b, (1, -1) + (1,) * nd)
    return out


def _auto_pads(attrs, spatial, kernel, strides) -> list[int]:
    """A pool's `pads` (begins, then ends), from `auto_pad` where it is set: SAME_UPPER
    and SAME_LOWER pad to `ceil(size / stride)` outputs, the odd cell at the end or the
    beginning; VALID pads nothing."""
    auto = attrs.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    nd = len(spatial)
    if auto == "VALID":
        return [0] * (2 * nd)
    if auto not in ("SAME_UPPER", "SAME_LOWER"):
        return list(attrs.get("pads", [0] * (2 * nd)))
    begins, ends = [], []
    for size, k, s in zip(spatial, kernel, strides):
        total = max((-(-size // s) - 1) * s + k - size, 0)
        small, big = total // 2, total - total // 2
        begins.append(small if auto == "SAME_UPPER" else big)
        ends.append(big if auto == "SAME_UPPER" else small)
    return begins + ends


def _pool(kind):
    def pool(attrs, x):
        nd = x.ndim - 2
        k = attrs["kernel_shape"]
        strides = attrs.get("strides", [1] * nd)
        dil = attrs.get("dilations", [1] * nd)
        pads = _auto_pads(attrs, x.shape[2:], k, strides)
        begin, end = pads[:nd], list(pads[nd:])
        extra = [0] * nd  # ceil_mode: a last window that starts inside the input or its pads
        for i, size in enumerate(x.shape[2:]):
            span = size + begin[i] + end[i] - ((k[i] - 1) * dil[i] + 1)
            if attrs.get("ceil_mode", 0) and span % strides[i]:
                out = -(-span // strides[i]) + 1
                if (out - 1) * strides[i] >= size + begin[i]:
                    out -= 1
                extra[i] = max((out - 1) * strides[i] - span, 0)
        window, steps, dilation = (1, 1, *k), (1, 1, *strides), (1, 1, *dil)
        padding = ((0, 0), (0, 0), *[(begin[i], end[i] + extra[i]) for i in range(nd)])
        if kind == "MaxPool":
            return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, window, steps, padding,
                                         window_dilation=dilation)
        total = jax.lax.reduce_window(x, 0.0, jax.lax.add, window, steps, padding,
                                      window_dilation=dilation)
        if not any(pads) and not any(extra):
            return total / math.prod(k)
        # The cells each window averages: the input's, and with count_include_pad its
        # explicit pads' too; never the cells ceil_mode adds.
        if attrs.get("count_include_pad", 0):
            ones = jnp.ones((1, 1) + tuple(s + b + e for s, b, e in zip(x.shape[2:], begin, end)),
                            x.dtype)
            spread = ((0, 0), (0, 0), *[(0, e) for e in extra])
        else:
            ones, spread = jnp.ones((1, 1) + x.shape[2:], x.dtype), padding
        count = jax.lax.reduce_window(ones, 0.0, jax.lax.add, window, steps, spread,
                                      window_dilation=dilation)
        return total / count
    return pool


def _batch_norm(attrs, x, scale, bias, mean, var):
    if attrs.get("training_mode", 0):
        raise NotImplementedError("BatchNormalization in training mode (an exported "
                                  "inference graph uses its running statistics)")
    shape = (1, -1) + (1,) * (x.ndim - 2)
    r = lambda v: jnp.reshape(v, shape)  # noqa: E731
    return (x - r(mean)) * jax.lax.rsqrt(r(var) + attrs.get("epsilon", 1e-5)) * r(scale) + r(bias)


def _layer_norm(attrs, x, scale, bias=None, outputs=1):
    axis = _axis(attrs.get("axis", -1), x.ndim)
    axes = tuple(range(axis, x.ndim))
    mean = jnp.mean(x, axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axes, keepdims=True)
    inv = jax.lax.rsqrt(var + attrs.get("epsilon", 1e-5))
    out = (x - mean) * inv * scale
    out = out if bias is None else out + bias
    return (out, mean, inv)[:outputs] if outputs > 1 else out


def _softmax(fn):
    def op(attrs, x):
        return fn(x, axis=attrs.get("axis", -1))
    return op


def _reduce(name):
    def op(attrs, x, axes=None):
        xp = _xp(x)
        if axes is None:
            axes = attrs.get("axes")
        else:
            axes = _ints(axes)
        if not axes:
            if attrs.get("noop_with_empty_axes", 0):
                return x
            axes = list(range(x.ndim))
        keep = bool(attrs.get("keepdims", 1))
        fn = {"ReduceMean": xp.mean, "ReduceSum": xp.sum, "ReduceMax": xp.max,
              "ReduceMin": xp.min, "ReduceProd": xp.prod}[name]
        if name == "ReduceSumSquare":
            return xp.sum(x * x, axis=tuple(axes), keepdims=keep)
        if name in ("ReduceMax", "ReduceMin") and math.prod(np.shape(x)) == 0:
            # The empty set's max and min: the dtype's lowest and highest values.
            dtype = np.dtype(x.dtype)
            if dtype.kind == "f":
                low, high = -np.inf, np.inf
            elif dtype.kind == "b":
                low, high = False, True
            else:
                low, high = np.iinfo(dtype).min, np.iinfo(dtype).max
            return fn(x, axis=tuple(axes), keepdims=keep,
                      initial=low if name == "ReduceMax" else high)
        return fn(x, axis=tuple(axes), keepdims=keep)
    return op


def _gelu(attrs, x):
    approx = attrs.get("approximate", b"none")
    approx = approx.decode() if isinstance(approx, bytes) else approx
    return jax.nn.gelu(x, approximate=approx == "tanh")


def _clip(attrs, x, lo=None, hi=None):
    xp = _xp(x, lo, hi)
    lo = attrs.get("min") if lo is None else lo
    hi = attrs.get("max") if hi is None else hi
    if lo is not None:
        x = xp.maximum(x, lo)
    if hi is not None:
        x = xp.minimum(x, hi)
    return x


# --------------------------------------------------------------------------- shapes


def _reshape(attrs, x, shape):
    shape = _ints(shape)
    if not attrs.get("allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return _xp(x).reshape(x, shape)


def _flatten(attrs, x):
    axis = _axis(attrs.get("axis", 1), x.ndim)
    return _xp(x).reshape(x, (math.prod(x.shape[:axis]), -1))


def _transpose(attrs, x):
    perm = attrs.get("perm") or list(range(x.ndim))[::-1]
    return _xp(x).transpose(x, perm)


def _squeeze(attrs, x, axes=None):
    axes = attrs.get("axes") if axes is None else _ints(axes)
    if axes is None:
        return _xp(x).squeeze(x)
    return _xp(x).squeeze(x, tuple(_axis(a, x.ndim) for a in axes))


def _unsqueeze(attrs, x, axes=None):
    axes = attrs.get("axes") if axes is None else _ints(axes)
    n = x.ndim + len(axes)
    out = x
    for a in sorted(_axis(a, n) for a in axes):
        out = _xp(x).expand_dims(out, a)
    return out


def _concat(attrs, *xs):
    return _xp(*xs).concatenate([x for x in xs if x is not None], axis=attrs["axis"])


def _split(attrs, x, split=None, *, outputs: int):
    axis = _axis(attrs.get("axis", 0), x.ndim)
    sizes = attrs.get("split") if split is None else _ints(split)
    if sizes is None:
        n = attrs.get("num_outputs", outputs)
        each = -(-x.shape[axis] // n)
        sizes = [min(each, x.shape[axis] - i * each) for i in range(n)]
    cuts = np.cumsum(sizes)[:-1].tolist()
    return tuple(_xp(x).split(x, cuts, axis=axis))


def _slice(attrs, x, starts, ends, axes=None, steps=None):
    starts, ends = _ints(starts), _ints(ends)
    axes = list(range(len(starts))) if axes is None else _ints(axes)
    steps = [1] * len(starts) if steps is None else _ints(steps)
    index = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = _axis(a, x.ndim)
        n = x.shape[a]
        s, e = max(min(s, n), -n - 1), max(min(e, n), -n - 1)
        index[a] = slice(s, None if st < 0 and e < -n else e, st)
    return x[tuple(index)]


def _gather(attrs, x, idx):
    axis = _axis(attrs.get("axis", 0), x.ndim)
    xp = _xp(x, idx)
    idx = xp.where(idx < 0, idx + x.shape[axis], idx) if xp is np else jnp.where(
        idx < 0, idx + x.shape[axis], idx)
    return xp.take(x, idx, axis=axis)


def _shape(attrs, x):
    shape = np.array(np.shape(x), np.int64)
    start, end = attrs.get("start", 0), attrs.get("end")
    return shape[start:end]


def _expand(attrs, x, shape):
    shape = _ints(shape)
    out = np.broadcast_shapes(tuple(np.shape(x)), tuple(shape))
    return _xp(x).broadcast_to(x, out)


def _constant_of_shape(attrs, shape):
    from onnx import numpy_helper

    value = attrs.get("value")
    fill = numpy_helper.to_array(value).reshape(-1)[0] if value is not None else np.float32(0)
    return np.full(_ints(shape), fill, dtype=np.asarray(fill).dtype)


def _constant(attrs):
    from onnx import numpy_helper

    if "value" in attrs:
        return numpy_helper.to_array(attrs["value"])
    for key, dtype in (("value_float", np.float32), ("value_int", np.int64)):
        if key in attrs:
            return np.array(attrs[key], dtype)
    for key, dtype in (("value_floats", np.float32), ("value_ints", np.int64)):
        if key in attrs:
            return np.array(attrs[key], dtype)
    raise NotImplementedError("Constant without a tensor, float or int value")


def _range(attrs, start, limit, delta):
    return np.arange(np.asarray(start), np.asarray(limit), np.asarray(delta))


def _trilu(attrs, x, k=None):
    k = 0 if k is None else _ints(k)[0]
    xp = _xp(x)
    return xp.triu(x, k) if attrs.get("upper", 1) else xp.tril(x, k)


def _where(attrs, c, a, b):
    return _xp(c, a, b).where(c, a, b)


def _cast(attrs, x):
    return _xp(x).asarray(x).astype(_cast_type(attrs["to"]))


def _einsum(attrs, *xs):
    eq = attrs["equation"]
    return jnp.einsum(eq.decode() if isinstance(eq, bytes) else eq, *xs)


def _variadic(name):
    def op(attrs, *xs):
        xp = _xp(*xs)
        fn = {"Max": xp.maximum, "Min": xp.minimum, "Sum": xp.add}[name]
        out = xs[0]
        for x in xs[1:]:
            out = fn(out, x)
        return out
    return op


def _dropout(attrs, x, ratio=None, training=None):
    if training is not None and bool(np.asarray(training)):
        raise NotImplementedError("Dropout in training mode")
    return x


OPS = {
    "Add": _elementwise(lambda xp, a, b: xp.add(a, b)),
    "Sub": _elementwise(lambda xp, a, b: xp.subtract(a, b)),
    "Mul": _elementwise(lambda xp, a, b: xp.multiply(a, b)),
    "Div": _elementwise(_div),
    "Pow": _elementwise(lambda xp, a, b: xp.power(a, b)),
    "Sqrt": _elementwise(lambda xp, x: xp.sqrt(x)),
    "Reciprocal": _elementwise(lambda xp, x: 1 / x),
    "Neg": _elementwise(lambda xp, x: -x),
    "Abs": _elementwise(lambda xp, x: xp.abs(x)),
    "Exp": _elementwise(lambda xp, x: xp.exp(x)),
    "Log": _elementwise(lambda xp, x: xp.log(x)),
    "Tanh": _elementwise(lambda xp, x: xp.tanh(x)),
    "Sin": _elementwise(lambda xp, x: xp.sin(x)),
    "Cos": _elementwise(lambda xp, x: xp.cos(x)),
    "Erf": lambda attrs, x: jax.scipy.special.erf(x),
    "Sigmoid": lambda attrs, x: jax.nn.sigmoid(x),
    "Relu": lambda attrs, x: jax.nn.relu(x),
    "LeakyRelu": lambda attrs, x: jax.nn.leaky_relu(x, attrs.get("alpha", 0.01)),
    "HardSigmoid": lambda attrs, x: jnp.clip(attrs.get("alpha", 0.2) * x
                                             + attrs.get("beta", 0.5), 0, 1),
    "HardSwish": lambda attrs, x: x * jnp.clip(x / 6 + 0.5, 0, 1),
    "Softplus": lambda attrs, x: jax.nn.softplus(x),
    "Gelu": _gelu,
    "Clip": _clip,
    "MatMul": _elementwise(lambda xp, a, b: xp.matmul(a, b)),
    "Gemm": _gemm,
    "Einsum": _einsum,
    "Conv": _conv,
    "MaxPool": _pool("MaxPool"),
    "AveragePool": _pool("AveragePool"),
    "GlobalAveragePool": lambda attrs, x: jnp.mean(x, tuple(range(2, x.ndim)), keepdims=True),
    "GlobalMaxPool": lambda attrs, x: jnp.max(x, tuple(range(2, x.ndim)), keepdims=True),
    "BatchNormalization": _batch_norm,
    "LayerNormalization": _layer_norm,
    "Softmax": _softmax(jax.nn.softmax),
    "LogSoftmax": _softmax(jax.nn.log_softmax),
    "ReduceMean": _reduce("ReduceMean"),
    "ReduceSum": _reduce("ReduceSum"),
    "ReduceMax": _reduce("ReduceMax"),
    "ReduceMin": _reduce("ReduceMin"),
    "ReduceProd": _reduce("ReduceProd"),
    "Max": _variadic("Max"),
    "Min": _variadic("Min"),
    "Sum": _variadic("Sum"),
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Transpose": _transpose,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Concat": _concat,
    "Split": _split,
    "Slice": _slice,
    "Gather": _gather,
    "Shape": _shape,
    "Size": lambda attrs, x: np.array(np.size(x), np.int64),
    "Expand": _expand,
    "ConstantOfShape": _constant_of_shape,
    "Constant": _constant,
    "Range": _range,
    "Trilu": _trilu,
    "Where": _where,
    "Cast": _cast,
    "CastLike": lambda attrs, x, like: _xp(x).asarray(x).astype(_cast_type(
        np.asarray(like).dtype if _static(like) else like.dtype)),
    "Identity": lambda attrs, x: x,
    "Dropout": _dropout,
    "Equal": _elementwise(lambda xp, a, b: xp.equal(a, b)),
    "Less": _elementwise(lambda xp, a, b: xp.less(a, b)),
    "LessOrEqual": _elementwise(lambda xp, a, b: xp.less_equal(a, b)),
    "Greater": _elementwise(lambda xp, a, b: xp.greater(a, b)),
    "GreaterOrEqual": _elementwise(lambda xp, a, b: xp.greater_equal(a, b)),
    "Not": _elementwise(lambda xp, x: xp.logical_not(x)),
    "And": _elementwise(lambda xp, a, b: xp.logical_and(a, b)),
    "Or": _elementwise(lambda xp, a, b: xp.logical_or(a, b)),
    "IsNaN": _elementwise(lambda xp, x: xp.isnan(x)),
}
"""The operators `pockjax.onnx` runs, by ONNX op type (the default domain)."""

MULTI_OUTPUT = {"Split", "LayerNormalization"}
"""Operators whose output count is the node's."""
