"""Frozen weights stored in 8 or 4 bits (or bfloat16), dequantized where they are used.

`quantize(params, scheme, "int4")` stores the leaves a scheme freezes in a low-bit
format: each becomes a `Quantized` node (the packed integers and their scales). A loss
written for float parameters runs on such a tree through `at_use(loss)`: inside it every
quantized weight is dequantized right before the operation that reads it, tied by data to
that operation's other input (so XLA's scheduler cannot hoist all dequantizations to the
top of the step, where every float copy would be alive at once), and a matrix product
dequantizes the weight again in the backward pass instead of keeping the float copy from
the forward pass. At no point is a float copy of the whole model alive.

Formats (`FORMATS`, or a `Int8` / `Int4` / `Cast` value):

- `"bfloat16"`, `"float16"`: the weight cast, upcast at each use (`Cast`; the node's
  `data` is the narrow weight, with no scales).
- `"int8"`: symmetric, one scale per output channel: the weight's values along its input
  axis (JAX's `[in, out]` kernels: axis -2) share a scale (`Int8`).
- `"int4"`: symmetric, one scale per group of consecutive values along the input axis
  (the largest even divisor of the axis's size up to `group`, 64), scales in bfloat16,
  two values packed per byte (`Int4`; `Int4(zero_point=True)` adds a zero point per
  group).

Leaves of rank < 2 (biases, norms) and leaves that train keep their dtype. A leaf that
trains in part (`pockjax.Channels`) is stored in its format with its trained channels as
a float32 master (`Quantized.master`), which the step trains.

>>> import jax.numpy as jnp, pockjax as pj
>>> from pockjax import lowbit
>>> params = {"w": jnp.linspace(-1, 1, 64 * 8).reshape(64, 8), "b": jnp.zeros(8)}
>>> q = lowbit.quantize(params, pj.Scheme({"b": pj.Full()}), "int4")
>>> q["w"]
Quantized(int4, shape=(64, 8), group=64)
>>> loss = lowbit.at_use(lambda p, x: jnp.sum((x @ p["w"] + p["b"]) ** 2))
>>> float(loss(q, jnp.ones((2, 64)))) > 0
True
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import primitives as P

from pockjax._src.jaxpr import bind, call_body, interpret

__all__ = ["Cast", "Int8", "Int4", "FORMATS", "Quantized", "QuantizeError", "format_of",
           "formats_by_path", "quantize", "quantize_leaf", "store_leaf", "dequantize",
           "at_use", "reads_stored", "one_after", "is_quantized", "stored_bytes",
           "in_words"]


class QuantizeError(ValueError):
    """A format that does not apply to a leaf, or an unknown format name."""


@dataclasses.dataclass(frozen=True)
class Cast:
    """A float format narrower than the computation (`dtype`: bfloat16 or float16)."""

    dtype: Any = jnp.bfloat16

    @property
    def name(self) -> str:
        return jnp.dtype(self.dtype).name


@dataclasses.dataclass(frozen=True)
class Int8:
    """Symmetric 8-bit integers with one `scale_dtype` scale per output channel (the
    values along the input axis share it)."""

    scale_dtype: Any = jnp.float32
    name = "int8"


@dataclasses.dataclass(frozen=True)
class Int4:
    """4-bit integers, two per byte, with a `scale_dtype` scale per `group` consecutive
    values along the input axis (and, with `zero_point=True`, a zero point per group)."""

    group: int = 64
    zero_point: bool = False
    scale_dtype: Any = jnp.bfloat16
    name = "int4"


FORMATS = {"bfloat16": Cast(jnp.bfloat16), "float16": Cast(jnp.float16), "int8": Int8(),
           "int4": Int4()}


def format_of(spec) -> Cast | Int8 | Int4 | None:
    """A format from its name (`FORMATS`; `"int4:128"` sets the group), a format value,
    or None / "float32" (no format: the leaf stays as it is).

    Raises:
      QuantizeError: an unknown name.
    """
    if spec is None or isinstance(spec, (Cast, Int8, Int4)):
        return spec
    if isinstance(spec, str):
        name, _, group = spec.partition(":")
        if name == "float32" and not group:
            return None
        if name == "int4" and group:
            if not group.isdigit() or int(group) < 2 or int(group) % 2:
                raise QuantizeError(f"format {spec!r}: the group is an even number of values, "
                                    f"e.g. 'int4:64'")
            return Int4(group=int(group))
        if name in FORMATS and not group:
            return FORMATS[name]
    raise QuantizeError(f"unknown format {spec!r}: choose one of float32, "
                        f"{', '.join(FORMATS)} (or 'int4:GROUP'), or a lowbit.Int8/Int4/Cast")


@jax.tree_util.register_pytree_with_keys_class
class Quantized:
    """A weight stored in a low-bit format: `data` (int8: the values, or for int4 the bit
    patterns of bytes holding two 4-bit values each; for a `Cast` format the weight in
    its narrow dtype, with no scales), `scale` and, for `Int4(zero_point=True)`, `zero`;
    `shape` and `dtype` are the float weight's (the dtype it is computed in), `axis` its
    input axis. A pytree node: its arrays are the leaves (paths `weight/@data`,
    `weight/@scale`, `weight/@zero`), so it goes through `jit`, checkpoints and the
    trainer's state like any parameters. With `words` (made by `in_words`), `data` and
    `zero` hold their bytes as int32 words of 4 and the scales are float32.

    A weight part of which trains (a `pockjax.Channels` decision) also holds `master`
    (`weight/@master`): the trained channels at full precision, `channels` =
    `(axis, start, count)` saying where they sit. They replace the stored values of
    those channels wherever the weight is read, so the trained slice is never rounded
    to the low-bit format; the scheme trains `@master` and freezes the rest.
    """

    def __init__(self, data, scale, zero=None, *, fmt, shape, dtype, axis, words=False,
                 master=None, channels=None):
        self.data, self.scale, self.zero = data, scale, zero
        self.fmt, self.shape, self.dtype, self.axis = fmt, tuple(shape), jnp.dtype(dtype), axis
        self.words = words  # data and zero as int32 words of 4 bytes each (`in_words`)
        self.master = master
        self.channels = None if channels is None else tuple(int(c) for c in channels)

    def _keys(self) -> tuple[str, ...]:
        # A Cast format stores the weight itself (`data`): no scales.
        return (("@data",) + (() if isinstance(self.fmt, Cast) else ("@scale",))
                + (("@zero",) if self.zero is not None else ())
                + (("@master",) if self.channels is not None else ()))

    def _children(self):
        fields = {"@data": self.data, "@scale": self.scale, "@zero": self.zero,
                  "@master": self.master}
        return tuple(fields[k] for k in self._keys())

    def _aux(self):
        return (self.fmt, self.shape, self.dtype, self.axis, self.zero is not None,
                self.channels, self.words)

    def tree_flatten_with_keys(self):
        return ([(jax.tree_util.GetAttrKey(k), c) for k, c in zip(self._keys(), self._children())],
                self._aux())

    def tree_flatten(self):
        return self._children(), self._aux()

    @classmethod
    def tree_unflatten(cls, aux, children):
        fmt, shape, dtype, axis, has_zero, channels, words = aux
        children = list(children)
        data = children.pop(0)
        scale = None if isinstance(fmt, Cast) else children.pop(0)
        zero = children.pop(0) if has_zero else None
        master = children.pop(0) if channels is not None else None
        return cls(data, scale, zero, fmt=fmt, shape=shape, dtype=dtype, axis=axis,
                   words=words, master=master, channels=channels)

    def replace(self, **changes) -> "Quantized":
        """A copy with some arrays changed (`data`, `scale`, `zero`, `master`; `shape`
        for a piece of the weight)."""
        fields = dict(data=self.data, scale=self.scale, zero=self.zero, master=self.master,
                      shape=self.shape)
        fields.update(changes)
        return Quantized(fields["data"], fields["scale"], fields["zero"], fmt=self.fmt,
                         shape=tuple(fields["shape"]), dtype=self.dtype, axis=self.axis,
                         words=self.words, master=fields["master"], channels=self.channels)

    @property
    def data_shape(self) -> tuple[int, ...]:
        """The shape of the stored bytes (int4: two values a byte along the input axis)."""
        if not isinstance(self.fmt, Int4):
            return self.shape
        return self.shape[:self.axis] + (self.shape[self.axis] // 2,) + self.shape[self.axis + 1:]

    @property
    def nbytes(self) -> int:
        """Bytes stored (data, scales, zero points and a trained slice's master)."""
        return sum(int(np.prod(c.shape)) * jnp.dtype(c.dtype).itemsize for c in self._children())

    def dequantize(self, dtype=None) -> jax.Array:
        """The float weight (in `dtype`, default the weight's own)."""
        return dequantize(self, dtype)

    def __repr__(self) -> str:
        group = f", group={self.fmt.group}" if isinstance(self.fmt, Int4) else ""
        trained = ""
        if self.channels is not None:
            axis, start, count = self.channels
            trained = f", trained=axis {axis} [{start}:{start + count}]"
        return f"Quantized({self.fmt.name}, shape={self.shape}{group}{trained})"


def is_quantized(x) -> bool:
    """Whether `x` is a `Quantized` node (for `jax.tree` functions' `is_leaf=`)."""
    return isinstance(x, Quantized)


def stored_bytes(params) -> int:
    """Bytes `params` takes as stored (`Quantized` nodes at their packed size)."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(params))


# --------------------------------------------------------------------------- formats

def quantize_leaf(w, fmt, *, axis: int = -2, path: str = "weight", dtype=None, channels=None):
    """`w` (a float array of rank >= 2) stored in `fmt` (a format or its name).

    Args:
      w: the weight.
      fmt: a format or its name (`format_of`); None or "float32" returns `w` as it is.
      axis: `w`'s input axis (-2 for JAX's `[in, out]` kernels, 1 for a torch Linear's
        `[out, in]`).
      path: the weight's name, for errors.
      dtype: the float dtype it dequantizes to (default `w`'s).
      channels: for a weight part of which trains, its resolved `pockjax.Channels`
        decision (`Scheme.resolve`) or `(axis, start, count)`: those channels are kept
        as a float32 master (`Quantized.master`) and the rest is stored in `fmt`.

    Returns:
      A `Quantized` node.

    Raises:
      QuantizeError: `w` is not floating or has rank < 2, its input axis does not split
        into `Int4` groups, or `channels` does not fit `w` (named by `path`).
    """
    fmt = format_of(fmt)
    w = jnp.asarray(w)
    if fmt is None:
        return w
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise QuantizeError(f"'{path}' is {w.dtype}; only floating weights are quantized")
    if channels is not None:
        q = quantize_leaf(w, fmt, axis=axis, path=path, dtype=dtype)
        where = _channel_range(channels, w.shape, path)
        ch_axis, start, count = where
        master = jax.lax.slice_in_dim(w, start, start + count, axis=ch_axis)
        master = master.astype(jnp.promote_types(w.dtype, jnp.float32))
        return Quantized(q.data, q.scale, q.zero, fmt=q.fmt, shape=q.shape, dtype=q.dtype,
                         axis=q.axis, master=master, channels=where)
    if w.ndim < 2:
        raise QuantizeError(f"'{path}' has shape {w.shape}: {fmt.name} needs a weight of rank "
                            f">= 2 (an input axis and output channels); keep vectors as they are")
    axis %= w.ndim
    out_dtype = w.dtype if dtype is None else jnp.dtype(dtype)
    if isinstance(fmt, Cast):
        return Quantized(w.astype(fmt.dtype), None, fmt=fmt, shape=w.shape, dtype=out_dtype,
                         axis=axis)
    if isinstance(fmt, Int8):
        data, scale = _int8_codes(w, axis, fmt.scale_dtype)
        return Quantized(data, scale, fmt=fmt, shape=w.shape, dtype=out_dtype, axis=axis)
    n = w.shape[axis]
    # The largest even group of at most `fmt.group` values that divides the input axis.
    group = next((g for g in range(min(fmt.group, n), 1, -1) if n % g == 0 and g % 2 == 0), 0)
    if not group:
        raise QuantizeError(f"'{path}' has {n} values on its input axis {axis} (shape {w.shape}): "
                            f"int4 packs pairs of values along it, so it needs an even size; "
                            f"use 'int8' for this leaf")
    data, scale, zero = _int4_codes(w, axis, group, fmt.zero_point, fmt.scale_dtype)
    return Quantized(data, scale, zero, fmt=fmt, shape=w.shape, dtype=out_dtype, axis=axis)


# Each format's arithmetic is one compiled computation, so quantizing a weight allocates
# its codes and scales, not a float32 copy per operation.
@functools.partial(jax.jit, static_argnums=(1, 2))
def _int8_codes(w, axis: int, scale_dtype):
    x = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0).astype(scale_dtype)
    data = jnp.clip(jnp.round(x / scale.astype(jnp.float32)), -127, 127).astype(jnp.int8)
    return data, scale


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _int4_codes(w, axis: int, group: int, zero_point: bool, scale_dtype):
    x = w.astype(jnp.float32)
    n = w.shape[axis]
    grouped = _split_axis(x, axis, n // group, group)           # [..., n/g, g, ...]
    if zero_point:
        lo = jnp.min(grouped, axis=axis + 1, keepdims=True)
        hi = jnp.max(grouped, axis=axis + 1, keepdims=True)
        scale = jnp.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(scale_dtype)
        s32 = scale.astype(jnp.float32)
        zero = jnp.clip(jnp.round(-lo / s32), 0, 15).astype(jnp.int8)
        levels = jnp.clip(jnp.round(grouped / s32) + zero, 0, 15)
    else:
        amax = jnp.max(jnp.abs(grouped), axis=axis + 1, keepdims=True)
        scale = jnp.where(amax > 0, amax / 7.0, 1.0).astype(scale_dtype)
        zero = None
        levels = jnp.clip(jnp.round(grouped / scale.astype(jnp.float32)), -8, 7) + 8
    levels = levels.astype(jnp.uint8).reshape(w.shape)
    pairs = _split_axis(levels, axis, n // 2, 2)
    low = jax.lax.index_in_dim(pairs, 0, axis + 1, keepdims=False)
    high = jax.lax.index_in_dim(pairs, 1, axis + 1, keepdims=False)
    # Stored as int8 bit patterns: IREE takes signless 8-bit globals, not unsigned ones.
    data = jax.lax.bitcast_convert_type((low | (high << 4)).astype(jnp.uint8), jnp.int8)
    scale = jnp.squeeze(scale, axis + 1)
    zero = None if zero is None else jnp.squeeze(zero, axis + 1)
    return data, scale, zero


def _channel_range(channels, shape, path: str) -> tuple[int, int, int]:
    """`(axis, start, count)` of a resolved `Channels` decision or such a tuple."""
    if isinstance(channels, tuple):
        axis, start, count = channels
    else:
        axis, count = channels.axis, channels.count
        if not isinstance(axis, int) or count is None:
            raise QuantizeError(f"'{path}': {channels!r} is not resolved; pass the decision "
                                f"Scheme.resolve gives for this weight")
        start = shape[axis] - count if channels.last else 0
    axis %= len(shape)
    if not (0 <= start and 0 < count and start + count <= shape[axis]):
        raise QuantizeError(f"'{path}' has {shape[axis]} channels on axis {axis} (shape "
                            f"{shape}); channels {start}:{start + count} do not fit")
    return axis, int(start), int(count)


def _split_axis(x, axis: int, outer: int, inner: int):
    return x.reshape(x.shape[:axis] + (outer, inner) + x.shape[axis + 1:])


def dequantize(q, dtype=None) -> jax.Array:
    """The float weight a `Quantized` node stores (in `dtype`, default its own), its
    trained channels (`master`) in place; a plain array is returned as it is (cast to
    `dtype` when given)."""
    if not isinstance(q, Quantized):
        return q if dtype is None else jnp.asarray(q).astype(dtype)
    dtype = q.dtype if dtype is None else jnp.dtype(dtype)
    w = _dequantize_stored(q, dtype)
    if q.channels is None:
        return w
    axis, start, count = q.channels
    n = q.shape[axis]
    parts = [jax.lax.slice_in_dim(w, 0, start, axis=axis)] if start else []
    parts.append(q.master.astype(dtype))
    if start + count < n:
        parts.append(jax.lax.slice_in_dim(w, start + count, n, axis=axis))
    return jax.lax.concatenate(parts, axis) if len(parts) > 1 else parts[0]


def _dequantize_stored(q, dtype) -> jax.Array:
    """The float weight of `q`'s stored arrays (without its master)."""
    if isinstance(q.fmt, Cast):
        return (_bf16_from_words(q.data, q.shape) if q.words else q.data).astype(dtype)
    # From 32-bit words, each byte is unpacked into an int32 (0..255): no array narrower
    # than 32 bits exists in the step, even between kernels.
    data = _from_words(q.data, q.data_shape) if q.words else q.data
    zero = _from_words(q.zero, q.scale.shape) if q.words and q.zero is not None else q.zero
    if isinstance(q.fmt, Int8):
        if q.words:  # the byte's two's-complement value
            data = data - jnp.where(data >= 128, 256, 0)
        return (data.astype(jnp.float32) * q.scale.astype(jnp.float32)).astype(dtype)
    axis, n = q.axis, q.shape[q.axis]
    groups = q.scale.shape[axis]
    # Scaled before the two halves of each byte are interleaved, so XLA computes the
    # float weight in one fusion (the interleave its root), not through float copies.
    packed = data if q.words else jax.lax.bitcast_convert_type(data, jnp.uint8)
    pairs = _split_axis(packed, axis, groups, n // groups // 2)        # [.., G, g/2, ..]
    scale = jnp.expand_dims(q.scale.astype(jnp.float32), axis + 1)
    offset = 8.0 if zero is None else jnp.expand_dims(zero.astype(jnp.float32), axis + 1)
    low = ((pairs & 15).astype(jnp.float32) - offset) * scale
    high = ((pairs >> 4).astype(jnp.float32) - offset) * scale
    return jnp.stack([low, high], axis=axis + 2).reshape(q.shape).astype(dtype)


_SHIFTS = np.array([0, 8, 16, 24], np.uint32)


def _to_words(a) -> np.ndarray:
    """The bytes of int8 array `a` (row-major, zero-padded to a multiple of 4) as int32
    words, byte k of each word its bits 8k to 8k + 7."""
    b = np.asarray(a).astype(np.int8).reshape(-1).view(np.uint8).astype(np.uint32)
    b = np.concatenate([b, np.zeros((-b.size) % 4, np.uint32)]).reshape(-1, 4)
    return np.bitwise_or.reduce(b << _SHIFTS, axis=1).view(np.int32)


def _bf16_to_words(a) -> np.ndarray:
    """bfloat16 array `a` (row-major, zero-padded to an even size) as int32 words, value
    2k in bits 0-15 of word k and value 2k + 1 in bits 16-31."""
    u = np.asarray(a).reshape(-1).view(np.uint16).astype(np.uint32)
    u = np.concatenate([u, np.zeros(u.size % 2, np.uint32)]).reshape(-1, 2)
    return (u[:, 0] | (u[:, 1] << 16)).view(np.int32)


def _bf16_from_words(w, shape) -> jax.Array:
    """The float32 values of the bfloat16 pairs `_bf16_to_words` packed, in `shape`: a
    bfloat16 is the top half of a float32, so each is a shift or a mask and a bitcast."""
    n = math.prod(shape)
    low = jax.lax.bitcast_convert_type(w << 16, jnp.float32)
    high = jax.lax.bitcast_convert_type(w & jnp.int32(-65536), jnp.float32)
    return jnp.stack([low, high], axis=1).reshape(-1)[:n].reshape(shape)


def _from_words(w, shape) -> jax.Array:
    """The bytes `_to_words` packed, each as an int32 from 0 to 255, in `shape`: 32-bit
    loads, shifts and masks only."""
    n = math.prod(shape)
    b = (w[:, None] >> jnp.asarray(_SHIFTS.astype(np.int32))) & 255
    return b.reshape(-1)[:n].reshape(shape)


def in_words(tree):
    """`tree` with each `Quantized` node stored for GPUs whose buffers hold only 32-bit
    values (Vulkan's baseline profiles; IREE's SPIR-V code cannot load bfloat16): its
    bytes (values, zero points) as int32 words of 4, or a bfloat16 weight's values as
    int32 words of 2, unpacked with shifts where the weight is used, and its scales as
    float32. The weights it dequantizes to are equal,
    bit for bit. `pockjax.export` does this for Vulkan targets; other leaves are
    returned as they are.

    Args:
      tree: a pytree that may hold `Quantized` nodes (concrete arrays).

    Returns:
      The same tree, its `Quantized` nodes with `words` set: bfloat16 weights two values
      a word (unpacked with a shift or a mask each); float16 ones as they are (Vulkan
      targets do not take them).
    """
    def convert(q):
        if not isinstance(q, Quantized) or q.words:
            return q
        if isinstance(q.fmt, Cast):
            if jnp.dtype(q.fmt.dtype) != jnp.bfloat16:
                return q
            data = None if q.data is None else jnp.asarray(_bf16_to_words(q.data))
            children = [data] + ([q.master] if q.channels is not None else [])
            return Quantized.tree_unflatten(q._aux()[:-1] + (True,), children)
        # A node whose arrays are None (an optimizer state's mask of a frozen weight)
        # changes only its structure, which must match the parameters'.
        words = lambda a: None if a is None else jnp.asarray(_to_words(a))  # noqa: E731
        children = [words(q.data), None if q.scale is None else jnp.asarray(q.scale, jnp.float32)]
        children += [words(q.zero)] if q.zero is not None else []
        children += [q.master] if q.channels is not None else []
        return Quantized.tree_unflatten(q._aux()[:-1] + (True,), children)

    return jax.tree_util.tree_map(convert, tree, is_leaf=is_quantized)


def formats_by_path(formats) -> Callable[[str], Any]:
    """`path -> format or None` for `formats`: one format for every path, or a dict of
    path patterns (a scheme's globs, first match wins) to formats.

    Raises:
      QuantizeError: an unknown format name.
    """
    from pockjax.scheme import Frozen, Scheme

    if isinstance(formats, Mapping):
        rules = Scheme({pattern: Frozen() for pattern in formats}, default=Frozen())
        chosen = [format_of(f) for f in formats.values()]
        return lambda path: next((f for f, rx in zip(chosen, rules._regex) if rx.match(path)),
                                 None)
    single = format_of(formats)
    return lambda path: single


def quantize(params, scheme=None, formats: Any = "int8", *, layouts: Mapping | None = None,
             dtype=None):
    """`params` with the leaves `scheme` freezes stored in low precision.

    Args:
      params: a pytree of float arrays (a model's parameters).
      scheme: a `pockjax.Scheme` (or Schedule's scheme); its frozen leaves are stored in
        `formats`, the others stay as they are. None: every leaf of rank >= 2.
      formats: a format (a name in `FORMATS`, `"int4:GROUP"`, or a `Cast` / `Int8` /
        `Int4`), or a dict of path patterns (the scheme's globs, first match wins) to
        formats; a leaf no pattern matches, or matched to None / "float32", stays.
      layouts: `{path: {"in": axis, "out": axis}}` for leaves whose input axis is not -2
        (default: the layouts registered for `params`, e.g. by `pockjax.torch`).
      dtype: the float dtype a quantized weight is dequantized to inside the step
        (default: the leaf's own; float32 for a model stored in bfloat16 but computed in
        float32).

    Returns:
      The same tree with each chosen leaf replaced by a `Quantized` node. A leaf the
      scheme trains in part (`Channels`) becomes a node holding its trained channels as
      a float32 master (`quantize_leaf`'s `channels`). Vectors (rank < 2) stay as they
      are.

    Raises:
      QuantizeError: a format does not fit a leaf (see `quantize_leaf`), an unknown
        format name, or `params` holds `Quantized` nodes already.
    """
    from pockjax.scheme import Frozen, layouts_of, leaves_with_paths, path_str

    stored = [path_str(p) for p, x in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=is_quantized)[0] if is_quantized(x)]
    if stored:
        raise QuantizeError(f"{stored[0]!r} is stored already ({len(stored)} weights are): "
                            f"quantize the float weights (`dequantize` gives them back)")
    named, treedef = leaves_with_paths(params)
    if scheme is None:
        decisions = [Frozen()] * len(named)
    else:
        decisions = jax.tree_util.tree_leaves(scheme.resolve(params),
                                              is_leaf=lambda d: d is not None and not isinstance(d, dict))
    chooser = formats_by_path(formats)
    known = layouts_of(params)[0] if layouts is None else dict(layouts)
    out = []
    for (path, leaf), d in zip(named, decisions):
        layout = known.get(path)
        axis = layout["in"] if isinstance(layout, Mapping) else -2
        out.append(store_leaf(leaf, d, chooser(path), axis=axis, path=path, dtype=dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def store_leaf(leaf, decision, fmt, *, axis: int = -2, path: str = "weight", dtype=None):
    """One leaf as `quantize` stores it, given its resolved scheme decision: a frozen
    floating leaf of rank >= 2 in `fmt`; one that trains in part (`Channels`) in `fmt`
    with its trained channels as a float32 master; anything else (a leaf that trains, a
    vector, `fmt` None) as it is. Loaders that read a model tensor by tensor store each
    weight with it.

    Args:
      leaf: the array.
      decision: its `Full`, `Frozen` or resolved `Channels` decision (`Scheme.resolve`).
      fmt: the format chosen for its path, or None.
      axis: its input axis.
      path: its name, for errors.
      dtype: the float dtype it dequantizes to (default its own).

    Returns:
      A `Quantized` node, or `leaf`.

    Raises:
      QuantizeError: the format does not fit the leaf (see `quantize_leaf`).
    """
    from pockjax.scheme import Channels, Frozen

    part = isinstance(decision, Channels)
    fmt = format_of(fmt) if isinstance(decision, Frozen) or part else None
    if fmt is None or np.ndim(leaf) < 2 or not jnp.issubdtype(jnp.asarray(leaf).dtype,
                                                              jnp.floating):
        return leaf
    return quantize_leaf(leaf, fmt, axis=axis, path=path, dtype=dtype,
                         channels=decision if part else None)


# --------------------------------------------------------------------------- at use

class _Lazy:
    """A quantized weight inside `at_use`'s interpreter, not yet dequantized: the node's
    arrays and the unary equations (transposes, reshapes, casts) to apply after
    dequantizing it."""

    def __init__(self, leaves, aux, ops=()):
        self.leaves, self.aux, self.ops = tuple(leaves), aux, tuple(ops)

    def node(self, leaves=None):
        return jax.tree_util.tree_unflatten(self.aux, list(self.leaves if leaves is None else leaves))

    def then(self, eqn) -> "_Lazy":
        return _Lazy(self.leaves, self.aux, self.ops + (eqn,))

    def value(self, leaves, tie):
        """The float weight, computed only once `tie` exists (times exactly 1 that
        depends on one element of `tie`), with the deferred equations applied."""
        w = _materialize(self.node(leaves), tie)
        for e in self.ops:
            w = bind(e, [w])
        return w


def one_after(tie: jax.Array, dtype) -> jax.Array:
    """Exactly 1 in `dtype`, computed from one element of `tie`, so that what it
    multiplies is computed only once `tie` exists.

    This is how a weight is dequantized at its use: XLA's CPU scheduler would convert
    every stored weight at the top of the step (a conversion of a parameter depends on
    nothing else), keeping all the float copies alive at once, and it drops
    `optimization_barrier`s before scheduling; a product with this 1 ties the
    conversion to the using operation's other input by data. The element is replaced
    by 0 where it is not finite, so an inf or NaN in `tie` does not spread.

    Args:
      tie: the array the result waits for (any shape, float).
      dtype: the result's dtype.

    Returns:
      A scalar 1 of `dtype`.
    """
    first = jax.lax.slice(tie, (0,) * tie.ndim, (1,) * tie.ndim).reshape(()).astype(dtype)
    return 1 + 0 * jnp.where(jnp.isfinite(first), first, 0)


def _materialize(node, tie):
    """`node` dequantized once `tie` exists: the tie multiplies the scales (small), so the
    float weight is one fusion of the stored arrays, computed again at each use."""
    if tie is not None and isinstance(node.fmt, Cast) and not node.words:
        return node.dequantize() * one_after(tie, node.dtype)  # upcast and tied in one fusion
    if tie is not None and isinstance(node.fmt, Cast):  # its words: no scales to tie
        node = node.replace(data=node.data * one_after(tie, node.data.dtype))
    elif tie is not None:
        one = one_after(tie, jnp.float32)
        node = node.replace(scale=(node.scale.astype(jnp.float32) * one).astype(node.scale.dtype))
    return node.dequantize()


def _dot(spec, other, w):
    side, dims, precision, preferred = spec
    args = (other, w) if side == 1 else (w, other)
    return jax.lax.dot_general(*args, dims, precision=precision, preferred_element_type=preferred)


# A stored weight whose float copy would be larger than this is multiplied in pieces
# along its output axis, each dequantized once the previous piece's product exists, so at
# most one piece's float copy is alive (an output head of a 32,000-token vocabulary is
# 0.5 GiB in float32 at LLaMA-2-7B's width).
PIECE_BYTES = 256 << 20


def _whole_2d(lazy, node) -> bool:
    """Whether `node` is read as it is stored (no transpose or reshape first), has rank 2,
    no trained channels and no 32-bit words: a weight a product can take in pieces and
    a lookup row by row."""
    return (not lazy.ops and node.channels is None and not node.words
            and len(node.shape) == 2)


def _pieces(spec, lazy, leaves, other_ndim: int):
    """`(free, position, bounds)` for a product whose stored 2-D weight dequantizes to
    more than `PIECE_BYTES`: the weight's axis that is not contracted, where that axis
    sits in the product's output, and each piece's `(start, stop)` on it; None for a
    product in one piece (a small weight, one reshaped or transposed first, one with
    trained channels or in 32-bit words)."""
    node = lazy.node(leaves)
    if not _whole_2d(lazy, node):
        return None
    side, ((lc, rc), (lb, rb)), _, _ = spec
    (w_c, w_b), (o_c, o_b) = ((rc, rb), (lc, lb)) if side == 1 else ((lc, lb), (rc, rb))
    if w_b or o_b or len(w_c) != 1:
        return None
    free = 1 - w_c[0]
    if isinstance(node.fmt, Int4) and free == node.axis:  # packed along that axis
        return None
    size = int(np.prod(node.shape)) * jnp.dtype(node.dtype).itemsize
    n = node.shape[free]
    count = min(-(-size // PIECE_BYTES), n)
    if count < 2:
        return None
    step = -(-n // count)
    # dot_general's output: batch axes, the left operand's free axes, the right one's.
    position = other_ndim - len(o_c) if side == 1 else 0
    return free, position, [(a, min(a + step, n)) for a in range(0, n, step)]


def _piece(node, free: int, start: int, stop: int):
    """Columns (or rows) `start:stop` of `node` along its axis `free`: each stored array
    sliced where it spans that axis."""
    n = node.shape[free]

    def cut(a):
        if a is None or a.shape[free] != n:
            return a  # a scale shared along that axis
        return jax.lax.slice_in_dim(a, start, stop, axis=free)

    shape = list(node.shape)
    shape[free] = stop - start
    return node.replace(data=cut(node.data), scale=cut(node.scale), zero=cut(node.zero),
                        shape=shape)


def _dot_in_pieces(spec, node, other, pieces):
    free, position, bounds = pieces
    outs, tie = [], other
    for a, b in bounds:
        y = _dot(spec, other, _materialize(_piece(node, free, a, b), tie))
        outs.append(y)
        tie = y  # the next piece is dequantized once this product exists
    return jax.lax.concatenate(outs, position)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _qdot(spec, lazy, other, *leaves):
    pieces = _pieces(spec, lazy, leaves, np.ndim(other))
    if pieces is not None:
        return _dot_in_pieces(spec, lazy.node(leaves), other, pieces)
    return _dot(spec, other, lazy.value(leaves, other))


def _qdot_fwd(spec, lazy, other, *leaves):
    shape = jax.ShapeDtypeStruct(other.shape, other.dtype)
    # A weight with trained channels keeps the other operand for their gradient.
    kept = other if lazy.node(leaves).channels is not None else None
    return _qdot(spec, lazy, other, *leaves), (shape, leaves, kept)


def _qdot_bwd(spec, lazy, residuals, g):
    shape, leaves, other = residuals
    pieces = _pieces(spec, lazy, leaves, len(shape.shape))
    if pieces is None:
        w = lazy.value(leaves, g)  # dequantized again, once the output's gradient exists
        (d_other,) = jax.linear_transpose(lambda o: _dot(spec, o, w), shape)(g)
    else:  # piece by piece, each once the sum of the previous pieces' gradients exists
        free, position, bounds = pieces
        node, d_other = lazy.node(leaves), None
        for a, b in bounds:
            w = _materialize(_piece(node, free, a, b), g if d_other is None else d_other)
            g_piece = jax.lax.slice_in_dim(g, a, b, axis=position)
            (d,) = jax.linear_transpose(lambda o, w=w: _dot(spec, o, w), shape)(g_piece)
            d_other = d if d_other is None else d_other + d
    grads = [np.zeros(x.shape, jax.dtypes.float0) if not jnp.issubdtype(x.dtype, jnp.inexact)
             else jnp.zeros_like(x) for x in leaves]
    if other is not None:
        grads[-1] = _master_grad(spec, lazy, leaves, other, g)
    return (d_other, *grads)


def _master_grad(spec, lazy, leaves, other, g):
    """The gradient of a weight's trained channels (`Quantized.master`, its last leaf) in
    the product `_dot(spec, other, weight)` whose output's gradient is `g`: the product
    restricted to those channels, so the frozen channels' weight gradient is never
    computed."""
    node = lazy.node(leaves)
    axis, start, count = node.channels
    master = leaves[-1]
    avals = jax.ShapeDtypeStruct(master.shape, master.dtype)

    def cut(x, d):
        return jax.lax.slice_in_dim(x, start, start + count, axis=d)

    def transpose(o, cotangent):
        product = lambda m: _dot(spec, o, m.astype(node.dtype))  # noqa: E731
        return jax.linear_transpose(product, avals)(cotangent)[0]

    if lazy.ops:  # transposes or reshapes between the weight and the product
        def through(m):
            parts = list(leaves)
            parts[-1] = m
            return _dot(spec, other, lazy.value(parts, None))
        return jax.vjp(through, master)[1](g)[0]
    side, ((lc, rc), (lb, rb)), _, _ = spec
    w_c, o_c = (rc, lc) if side == 1 else (lc, rc)
    w_b, o_b = (rb, lb) if side == 1 else (lb, rb)
    if axis in w_c:  # an input axis: the other operand's matching slice
        return transpose(cut(other, o_c[list(w_c).index(axis)]), g)
    if axis in w_b:
        k = list(w_b).index(axis)
        return transpose(cut(other, o_b[k]), cut(g, k))
    free = [d for d in range(len(node.shape)) if d not in w_c and d not in w_b]
    other_free = np.ndim(other) - len(o_c) - len(o_b)
    position = len(w_b) + (other_free if side == 1 else 0) + free.index(axis)
    return transpose(other, cut(g, position))  # output channels: the output's slice


_qdot.defvjp(_qdot_fwd, _qdot_bwd)


def _stored_rows(node, rows):
    """Rows `rows` (an integer array, in range) of the stored 2-D weight `node`, as
    floats `[*rows.shape, columns]`: only those rows are dequantized."""
    take = lambda a, i: jnp.take(a, i, axis=0, mode="clip")  # noqa: E731
    fmt, n = node.fmt, node.shape[1]
    if isinstance(fmt, Cast):
        return take(node.data, rows).astype(node.dtype)
    if isinstance(fmt, Int8):
        scale = node.scale[0] if node.axis == 0 else take(node.scale, rows)
        return (take(node.data, rows).astype(jnp.float32) *
                scale.astype(jnp.float32)).astype(node.dtype)
    if node.axis == 1:  # int4 packed along the row: the rows' own bytes and scales
        flat = rows.reshape(-1)
        piece = node.replace(data=take(node.data, flat), scale=take(node.scale, flat),
                             zero=None if node.zero is None else take(node.zero, flat),
                             shape=(flat.shape[0], n))
        return _dequantize_stored(piece, node.dtype).reshape(rows.shape + (n,))
    # int4 packed along the rows: row r is one half of byte r // 2, group r // group.
    group = node.shape[0] // node.scale.shape[0]
    packed = jax.lax.bitcast_convert_type(take(node.data, rows // 2), jnp.uint8)
    codes = jnp.where((rows % 2 == 0)[..., None], packed & 15, packed >> 4)
    offset = 8.0 if node.zero is None else take(node.zero, rows // group).astype(jnp.float32)
    scale = take(node.scale, rows // group).astype(jnp.float32)
    return ((codes.astype(jnp.float32) - offset) * scale).astype(node.dtype)


def _gather_rows(e, lazy, indices):
    """A gather of whole rows from a stored 2-D weight (an embedding lookup) computed
    from the rows' stored values, not from the whole dequantized table; None for any
    other gather."""
    node = lazy.node()
    dn = e.params["dimension_numbers"]
    if (not _whole_2d(lazy, node) or tuple(dn.collapsed_slice_dims) != (0,)
            or tuple(dn.start_index_map) != (0,) or tuple(dn.offset_dims) != (np.ndim(indices) - 1,) or dn.operand_batching_dims
            or tuple(e.params["slice_sizes"]) != (1, node.shape[1])
            or np.shape(indices)[-1:] != (1,)):
        return None
    rows = indices[..., 0]
    n = node.shape[0]
    got = _stored_rows(node, jnp.clip(rows, 0, n - 1))
    if e.params["mode"] == jax.lax.GatherScatterMode.FILL_OR_DROP:
        fill = e.params.get("fill_value")
        fill = jnp.nan if fill is None else fill
        got = jnp.where(((rows >= 0) & (rows < n))[..., None], got,
                        jnp.asarray(fill, got.dtype))
    return got


def _float_operand(ins):
    return next((x for x in ins if not isinstance(x, _Lazy) and hasattr(x, "dtype")
                 and np.ndim(x) > 0), None)


def _override(e, ins, read):
    lazy = [x for x in ins if isinstance(x, _Lazy)]
    if not lazy:
        return None
    sub = call_body(e)
    if sub is not None:  # a nested jit: evaluated inline, quantized weights passed in
        return interpret(sub.jaxpr, sub.consts, ins, _override)
    if len(ins) == 1 and len(e.outvars) == 1 and not e.primitive.multiple_results:
        return [ins[0].then(e)]  # transpose, reshape, convert...: deferred to the use
    if e.primitive is P.gather_p and isinstance(ins[0], _Lazy) and len(lazy) == 1:
        got = _gather_rows(e, ins[0], ins[1])
        if got is not None:
            return [got]
    if e.primitive is P.dot_general_p and len(lazy) == 1 and len(ins) == 2:
        side = 1 if isinstance(ins[1], _Lazy) else 0
        other = ins[1 - side]
        spec = (side, e.params["dimension_numbers"], e.params.get("precision"),
                e.params.get("preferred_element_type"))
        return [_qdot(spec, ins[side], other, *ins[side].leaves)]
    tie = _float_operand(ins)
    values = [x.value(x.leaves, tie) if isinstance(x, _Lazy) else x for x in ins]
    outs = bind(e, values)
    return outs if e.primitive.multiple_results else [outs]


def reads_stored(fun: Callable) -> Callable:
    """`fun` marked as reading `Quantized` nodes' arrays itself, so that `at_use(fun)`
    (and the trainers, which apply it) is `fun`: for a function made from a step that
    was traced through `at_use` already, e.g. the part of a step after a prefix cache.

    Args:
      fun: a function of pytrees that may hold `Quantized` nodes.

    Returns:
      A function calling `fun`, with the mark.
    """
    @functools.wraps(fun)
    def marked(*args, **kwargs):
        return fun(*args, **kwargs)

    marked.reads_stored = True
    return marked


def at_use(fun: Callable) -> Callable:
    """`fun` (written for float parameters) as a function of trees holding `Quantized`
    nodes (and narrower float leaves, which it reads as they are stored).

    Each quantized weight is dequantized at each use, tied by data to the using
    operation's other input; in a matrix product (`dot_general`, after any transposes,
    reshapes or casts of the weight) the backward pass dequantizes it again rather than
    keeping the forward pass's float copy; a weight larger than `PIECE_BYTES` as float
    is multiplied in pieces along its output axis, one piece's float copy alive at a
    time. A lookup of whole rows (an embedding) dequantizes the rows it reads only.
    Inside loops (`scan`, `while`, `cond`) a quantized weight is dequantized whole
    before the loop. Quantized weights are frozen: their arrays' gradients are zero.

    Args:
      fun: a function of pytrees of arrays (one marked by `reads_stored` is returned as
        it is).

    Returns:
      A function of the same arguments in which any float array may be a `Quantized`
      node; it returns what `fun` returns on the dequantized values.
    """
    if getattr(fun, "reads_stored", False):
        return fun

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        flat, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_quantized)
        if not any(isinstance(x, Quantized) for x in flat):
            return fun(*args, **kwargs)
        proxies = [jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, Quantized) else x
                   for x in flat]
        dynamic = [i for i, x in enumerate(proxies) if isinstance(x, (jax.Array, np.ndarray,
                                                                      jax.ShapeDtypeStruct))
                   or hasattr(x, "aval")]

        def call(*xs):
            full = list(proxies)
            for i, x in zip(dynamic, xs):
                full[i] = x
            a, k = jax.tree_util.tree_unflatten(tree, full)
            return fun(*a, **k)

        closed, out_shape = jax.make_jaxpr(call, return_shape=True)(*[proxies[i] for i in dynamic])
        ins = []
        for i in dynamic:
            x = flat[i]
            if isinstance(x, Quantized):
                leaves, aux = jax.tree_util.tree_flatten(x)
                ins.append(_Lazy(leaves, aux))
            else:
                ins.append(x)
        outs = interpret(closed.jaxpr, closed.consts, ins, _override)
        outs = [o.value(o.leaves, None) if isinstance(o, _Lazy) else o for o in outs]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return wrapped
