"""The low-bit formats and their arithmetic: `Cast`, `Int8`, `Int4` (`FORMATS`,
`format_of`), the codes and scales each stores (`int8_codes`, `int4_codes`) and the float
weight they give back (`dequantize_stored`), and the 32-bit words a Vulkan target reads
them in (`to_words`, `bf16_to_words`). Works on arrays and on any object with a
`Quantized` node's fields; the node itself is `pockjax.lowbit._store`'s.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pockjax.lowbit._blocks import Blocks, decode


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


def format_of(spec) -> Cast | Int8 | Int4 | Blocks | None:
    """A format from its name (`FORMATS`; `"int4:128"` sets the group), a format value
    (a `Blocks` too: a GGUF file's own blocks, which only a GGUF reader makes), or None /
    "float32" (no format: the leaf stays as it is).

    Raises:
      QuantizeError: an unknown name.
    """
    if spec is None or isinstance(spec, (Cast, Int8, Int4, Blocks)):
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


# Each format's arithmetic is one compiled computation, so quantizing a weight allocates
# its codes and scales, not a float32 copy per operation.
@functools.partial(jax.jit, static_argnums=(1, 2))
def int8_codes(w, axis: int, scale_dtype):
    """`w`'s `Int8` arrays: its values as int8 and one scale per slice along `axis`."""
    x = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0).astype(scale_dtype)
    data = jnp.clip(jnp.round(x / scale.astype(jnp.float32)), -127, 127).astype(jnp.int8)
    return data, scale


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def int4_codes(w, axis: int, group: int, zero_point: bool, scale_dtype):
    """`w`'s `Int4` arrays: its 4-bit codes, two per byte along `axis` (int8 bit patterns),
    a scale per `group` values along `axis` and, with `zero_point`, a zero point per group
    (else None)."""
    x = w.astype(jnp.float32)
    n = w.shape[axis]
    grouped = _split_axis(x, axis, n // group, group)           # [..., n/g, g, ...]
    if zero_point:
        lo = jnp.min(grouped, axis=axis + 1, keepdims=True)
        hi = jnp.max(grouped, axis=axis + 1, keepdims=True)
        # The zero point is an int8: a group all on one side of 0 has it outside 0..15
        # (its 16 levels span the group, not 0 as well). The scale is widened only
        # where -lo / scale would not fit in an int8 (a group far from 0 for its width).
        span = jnp.maximum((hi - lo) / 15.0, jnp.abs(lo) / 126.0)
        scale = jnp.where(span > 0, span, 1.0).astype(scale_dtype)
        s32 = scale.astype(jnp.float32)
        zero = jnp.clip(jnp.round(-lo / s32), -128, 127)
        levels = jnp.clip(jnp.round(grouped / s32) + zero, 0, 15)
        zero = zero.astype(jnp.int8)
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


def _split_axis(x, axis: int, outer: int, inner: int):
    return x.reshape(x.shape[:axis] + (outer, inner) + x.shape[axis + 1:])


def dequantize_stored(q, dtype) -> jax.Array:
    """The float weight of `q`'s stored arrays (without its master)."""
    if isinstance(q.fmt, Cast):
        return (bf16_from_words(q.data, q.shape) if q.words else q.data).astype(dtype)
    # From 32-bit words, each byte is unpacked into an int32 (0..255): no array narrower
    # than 32 bits exists in the step, even between kernels.
    data = from_words(q.data, q.data_shape) if q.words else q.data
    zero = from_words(q.zero, q.scale.shape) if q.words and q.zero is not None else q.zero
    if q.words and zero is not None:  # the byte's two's-complement value
        zero = zero - jnp.where(zero >= 128, 256, 0)
    if isinstance(q.fmt, Blocks):
        return decode(data, q.scale, q.fmt, q.axis, q.shape, words_bytes=q.words).astype(dtype)
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


def to_words(a) -> np.ndarray:
    """The bytes of int8 array `a` (row-major, zero-padded to a multiple of 4) as int32
    words, byte k of each word its bits 8k to 8k + 7."""
    b = np.asarray(a).astype(np.int8).reshape(-1).view(np.uint8).astype(np.uint32)
    b = np.concatenate([b, np.zeros((-b.size) % 4, np.uint32)]).reshape(-1, 4)
    return np.bitwise_or.reduce(b << _SHIFTS, axis=1).view(np.int32)


def bf16_to_words(a) -> np.ndarray:
    """bfloat16 array `a` (row-major, zero-padded to an even size) as int32 words, value
    2k in bits 0-15 of word k and value 2k + 1 in bits 16-31."""
    u = np.asarray(a).reshape(-1).view(np.uint16).astype(np.uint32)
    u = np.concatenate([u, np.zeros(u.size % 2, np.uint32)]).reshape(-1, 2)
    return (u[:, 0] | (u[:, 1] << 16)).view(np.int32)


def bf16_from_words(w, shape) -> jax.Array:
    """The float32 values of the bfloat16 pairs `bf16_to_words` packed, in `shape`: a
    bfloat16 is the top half of a float32, so each is a shift or a mask and a bitcast."""
    n = math.prod(shape)
    low = jax.lax.bitcast_convert_type(w << 16, jnp.float32)
    high = jax.lax.bitcast_convert_type(w & jnp.int32(-65536), jnp.float32)
    return jnp.stack([low, high], axis=1).reshape(-1)[:n].reshape(shape)


def from_words(w, shape) -> jax.Array:
    """The bytes `to_words` packed, each as an int32 from 0 to 255, in `shape`: 32-bit
    loads, shifts and masks only."""
    n = math.prod(shape)
    b = (w[:, None] >> jnp.asarray(_SHIFTS.astype(np.int32))) & 255
    return b.reshape(-1)[:n].reshape(shape)
