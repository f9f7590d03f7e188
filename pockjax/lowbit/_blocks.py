"""GGUF's block formats as a stored weight's format: `Blocks`. A GGUF file (llama.cpp's)
stores a quantized tensor as rows of fixed-size blocks, each `block_size` values in
`type_size` bytes that hold their own scales (a float16 `d`, for some types a float16
minimum, and for the K-quants packed 4- or 6-bit sub-scales). A frozen weight read from
such a file keeps those bytes: the block's float16 `d` becomes the node's `scale` (so
`at_use` can tie the weight's decoding to its use by multiplying it by exactly 1) and the
block's other bytes its `data`; `decode` gives the float32 values `gguf.quants.dequantize`
gives, bit for bit (the same operations in the same order).

Layout in a `Quantized` node of shape `shape` with input axis `axis` (the axis the blocks
run along): `data` holds each block's bytes other than `d`, `(type_size - 2)` per block,
as int8 bit patterns, along `axis` (`[blocks * bytes, out]` for an `[in, out]` kernel);
`scale` holds `d` in float16, one per block along `axis`. `split_blocks` /
`join_blocks` convert between a GGUF tensor's rows of blocks and these arrays. With
`words` (Vulkan targets), the data bytes are 32-bit words unpacked to 0..255 and `d` is
float32; the float16 fields inside the bytes are decoded with integer operations, so no
16-bit type is needed on the device.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# GGUF type name -> (values per block, bytes per block, offset of the float16 `d`).
# (ggml's `GGML_QUANT_SIZES`; the offsets are ggml's block structs'.)
BLOCK_TYPES = {
    "Q4_0": (32, 18, 0),
    "Q4_1": (32, 20, 0),
    "Q5_0": (32, 22, 0),
    "Q5_1": (32, 24, 0),
    "Q8_0": (32, 34, 0),
    "Q2_K": (256, 84, 80),
    "Q3_K": (256, 110, 108),
    "Q4_K": (256, 144, 0),
    "Q5_K": (256, 176, 0),
    "Q6_K": (256, 210, 208),
}
_BITS = {"Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5, "Q2_K": 2.625,
         "Q3_K": 3.4375, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625}


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A GGUF block type (`BLOCK_TYPES`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K ... Q6_K), the
    weight kept in the file's own bytes and decoded where it is used."""

    type: str

    def __post_init__(self):
        if self.type not in BLOCK_TYPES:
            raise ValueError(f"GGUF block type {self.type!r}: pockjax decodes "
                             f"{', '.join(BLOCK_TYPES)}")

    @property
    def name(self) -> str:
        return self.type

    @property
    def block_size(self) -> int:
        return BLOCK_TYPES[self.type][0]

    @property
    def type_size(self) -> int:
        return BLOCK_TYPES[self.type][1]

    @property
    def bits(self) -> float:
        """Bits stored per value."""
        return _BITS[self.type]


def split_blocks(raw: np.ndarray, fmt: Blocks) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF tensor's bytes `[..., blocks * type_size]` (rows of blocks along the last
    axis) as `(data [..., blocks * (type_size - 2)] int8, d [..., blocks] float16)`."""
    raw = np.ascontiguousarray(raw, np.uint8)
    size, off = fmt.type_size, BLOCK_TYPES[fmt.type][2]
    blocks = raw.reshape(raw.shape[:-1] + (raw.shape[-1] // size, size))
    d = blocks[..., off:off + 2].copy().view(np.float16)[..., 0]
    rest = np.concatenate([blocks[..., :off], blocks[..., off + 2:]], axis=-1)
    return rest.reshape(raw.shape[:-1] + (-1,)).view(np.int8), d


def join_blocks(data: np.ndarray, d: np.ndarray, fmt: Blocks) -> np.ndarray:
    """`split_blocks`' inverse: the GGUF bytes `[..., blocks * type_size]` (uint8)."""
    data = np.ascontiguousarray(data).view(np.uint8)
    off = BLOCK_TYPES[fmt.type][2]
    rest = data.reshape(data.shape[:-1] + (-1, fmt.type_size - 2))
    dd = np.ascontiguousarray(d, np.float16)[..., None].view(np.uint8)
    out = np.concatenate([rest[..., :off], dd, rest[..., off:]], axis=-1)
    return out.reshape(data.shape[:-1] + (-1,))


def _f16(b, at: int):
    """The float16 stored little-endian in bytes `at`, `at + 1` of the last axis of the
    int32 byte values `b` (0..255), as float32, with integer operations only."""
    h = b[..., at] | (b[..., at + 1] << 8)
    sign = (h >> 15) << 31
    exp = (h >> 10) & 31
    mant = h & 1023
    normal = jax.lax.bitcast_convert_type(sign | ((exp + 112) << 23) | (mant << 13), jnp.float32)
    special = jax.lax.bitcast_convert_type(sign | (255 << 23) | (mant << 13), jnp.float32)
    tiny = mant.astype(jnp.float32) * jnp.float32(2.0 ** -24)   # subnormal: exact
    tiny = jnp.where(sign != 0, -tiny, tiny)
    return jnp.where(exp == 0, tiny, jnp.where(exp == 31, special, normal))[..., None]


def _nibbles(qs, groups: int, width: int):
    """Bytes `qs [..., groups * width]` as their low nibbles then high nibbles per group
    of `width` bytes: `[..., groups, 2 * width]` (ggml's order)."""
    q = qs.reshape(qs.shape[:-1] + (groups, 1, width)) >> jnp.array([0, 4]).reshape(2, 1)
    return (q & 15).reshape(qs.shape[:-1] + (groups, 2 * width))


def _bits(b, count: int):
    """Bit k of the little-endian bytes `b [..., count // 8]`, k < count: `[..., count]`."""
    bit = b[..., :, None] >> jnp.arange(8)
    return (bit & 1).reshape(b.shape[:-1] + (count,))


def _scale_min_k4(s):
    """The 6-bit sub-scales and minimums of Q4_K / Q5_K (12 bytes -> 8 and 8)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = jnp.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


def _f32(x):
    return x.astype(jnp.float32)


# Each decoder takes `b` (int32 byte values 0..255 of a block without its `d`: `[N, R]`)
# and `d` (float32 `[N, 1]`) and returns float32 `[N, block_size]`, with gguf's
# operations in gguf's order. `R` indices are shifted where `d` came first.
def _q4_0(b, d):
    return d * _f32(_nibbles(b, 1, 16).reshape(b.shape[0], 32) - 8)


def _q4_1(b, d):
    m = _f16(b, 0)
    return _exact_sum(d * _f32(_nibbles(b[:, 2:], 1, 16).reshape(b.shape[0], 32)), m)


def _q5_0(b, d):
    qh = _bits(b[:, 0:4], 32)
    ql = _nibbles(b[:, 4:], 1, 16).reshape(b.shape[0], 32)
    return d * _f32((ql | (qh << 4)) - 16)


def _q5_1(b, d):
    m = _f16(b, 0)
    qh = _bits(b[:, 2:6], 32)
    ql = _nibbles(b[:, 6:], 1, 16).reshape(b.shape[0], 32)
    return _exact_sum(d * _f32(ql | (qh << 4)), m)


def _q8_0(b, d):
    return _f32(b - jnp.where(b >= 128, 256, 0)) * d


def _q2_k(b, d):
    n = b.shape[0]
    scales, qs, dmin = b[:, 0:16], b[:, 16:80], _f16(b, 80)
    dl = (d * _f32(scales & 15)).reshape(n, 16, 1)
    ml = (dmin * _f32(scales >> 4)).reshape(n, 16, 1)
    q = (qs.reshape(n, 2, 1, 32) >> jnp.array([0, 2, 4, 6]).reshape(4, 1)) & 3
    return _exact_sum(dl * _f32(q.reshape(n, 16, 16)), -ml).reshape(n, 256)


def _q3_k(b, d):
    n = b.shape[0]
    hmask, qs, scales = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    low = (scales[:, 0:8].reshape(n, 1, 8) >> jnp.array([0, 4]).reshape(2, 1)).reshape(n, 16)
    high = (scales[:, 8:12].reshape(n, 1, 4) >> jnp.array([0, 2, 4, 6]).reshape(4, 1))
    sc = (low & 15) | ((high.reshape(n, 16) & 3) << 4)
    dl = (d * _f32(sc - 32)).reshape(n, 16, 1)
    ql = (qs.reshape(n, 2, 1, 32) >> jnp.array([0, 2, 4, 6]).reshape(4, 1)).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, 1, 1, 32) >> jnp.arange(8).reshape(8, 1)).reshape(n, 16, 16) & 1
    q = ql - ((qh ^ 1) << 2)
    return (dl * _f32(q)).reshape(n, 256)


def _k4_scales(b, d):
    """Q4_K's and Q5_K's eight sub-blocks' scales and minimums, `[n, 8, 1]` each."""
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 2:14])
    return (d * _f32(sc)).reshape(n, 8, 1), (_f16(b, 0) * _f32(mn)).reshape(n, 8, 1)


def _q4_k(b, d):
    n = b.shape[0]
    dl, dm = _k4_scales(b, d)
    q = _nibbles(b[:, 14:], 4, 32).reshape(n, 8, 32)
    return _exact_sum(dl * _f32(q), -dm).reshape(n, 256)


def _q5_k(b, d):
    n = b.shape[0]
    dl, dm = _k4_scales(b, d)
    qh = (b[:, 14:46].reshape(n, 1, 32) >> jnp.arange(8).reshape(8, 1)) & 1
    ql = _nibbles(b[:, 46:], 4, 32).reshape(n, 8, 32)
    return _exact_sum(dl * _f32(ql | (qh << 4)), -dm).reshape(n, 256)


def _q6_k(b, d):
    n = b.shape[0]
    ql, qh, scales = b[:, 0:128], b[:, 128:192], b[:, 192:208]
    dl = (d * _f32(scales - jnp.where(scales >= 128, 256, 0))).reshape(n, 16, 1)
    low = (_nibbles(ql, 2, 64)).reshape(n, 2, 2, 64)           # [n, half, nibble, 64]
    low = low.reshape(n, 8, 32)
    high = (qh.reshape(n, 2, 1, 32) >> jnp.array([0, 2, 4, 6]).reshape(4, 1)) & 3
    q = (low | (high.reshape(n, 8, 32) << 4)) - 32
    return (dl * _f32(q.reshape(n, 16, 16))).reshape(n, 256)


def _exact_sum(x, y):
    """`x + y` with `x` rounded to float32 first, as numpy (gguf's dequantize) rounds the
    product before the sum: a backend that contracts the two into one multiply-add
    rounds once. (XLA's CPU backend does not contract them; the tests check the decoding
    bit for bit on each backend they run.)"""
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=23) + y


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
             "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def decode(data, d, fmt: Blocks, axis: int, shape, *, words_bytes: bool = False):
    """The float32 weight of shape `shape` stored as `Blocks` along `axis`: `data` the
    blocks' bytes without `d` (int8 bit patterns, or with `words_bytes` int32 values
    0..255), `d` the blocks' scales."""
    size, rest = fmt.block_size, fmt.type_size - 2
    b = jnp.moveaxis(data, axis, -1)
    b = (b if words_bytes else jax.lax.bitcast_convert_type(b, jnp.uint8)).astype(jnp.int32)
    lead = b.shape[:-1]
    blocks = b.shape[-1] // rest
    b = b.reshape((-1, rest))
    dd = jnp.moveaxis(d, axis, -1).astype(jnp.float32).reshape(-1, 1)
    values = _DECODERS[fmt.type](b, dd)
    out = values.reshape(lead + (blocks * size,))
    return jnp.moveaxis(out, -1, axis).reshape(shape)
