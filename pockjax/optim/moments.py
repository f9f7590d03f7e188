"""AdamW with its two moments stored in 8 or 16 bits: an optax transformation.

Once the frozen weights are stored in 4 or 8 bits (`pockjax.lowbit`), the trained part
dominates memory: a float32 master and AdamW's two float32 moments are 12 bytes a trained
value. `adamw(..., moments="int8")` keeps the float32 master (the parameters themselves)
and stores the moments in 2 bytes a value; `moments="bfloat16"` in 4.

- `"int8"`: block-wise, like 8-bit optimizers: each moment leaf is flattened and cut into
  blocks of `block` values (256), each with a float32 scale (its largest magnitude). Codes
  are logarithmic, so small moments keep their relative precision: the first moment as a
  sign and a 7-bit code over magnitudes from 2^-24 to 1 of the block's scale (a step of
  14% between codes), the second moment as the square root of its value, an 8-bit code
  over the same range (7% steps). Rounding is to the nearest code; values below the
  range round to zero. A block that decays as a whole is tracked exactly by its scale.
  Where quantization broke Adam's bound |m| <= sqrt(v) (a second moment rounded to
  zero), the update divides by |m| instead, so no value moves by more than the learning
  rate.
- `"bfloat16"`: both moments in bfloat16. The second moment changes by 0.1% a step
  (`b2 = 0.999`), below bfloat16's resolution, so rounding to nearest would freeze it;
  it is rounded stochastically instead (unbiased; the random bits hash `seed`, the step
  count, the leaf and the value's index). The first moment is rounded to nearest.
- `"float32"`: `optax.scale_by_adam` itself.

Each leaf's moments are dequantized, moved by the gradient in float32 and stored again
(int8: written over the old codes 2^20 values at a time); the update is then computed
from the moments as stored, elementwise, so XLA computes it where the parameter is
written and no float32 copy of a leaf's moments or update is kept. The chain stays
per-leaf: the fused trainer (`pockjax.sparse_train`) still updates each parameter as soon
as its gradient exists. At LLaMA-2-7B's shape (PockEngine's scheme, 314M trained values)
the int8 step's temporaries equal the float32 step's.

>>> import jax.numpy as jnp, optax
>>> from pockjax import optim
>>> opt = optim.adamw(1e-2, moments="int8")
>>> params = {"w": jnp.ones((4, 256))}
>>> state = opt.init(params)
>>> updates, state = opt.update({"w": jnp.full((4, 256), 0.5)}, state, params)
>>> round(float(updates["w"].ravel()[0]), 4)   # Adam's first step: -lr * sign(g)
-0.01
>>> optim.state_bytes(state), optim.state_bytes(optax.adamw(1e-2).init(params))
(2084, 8196)
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

__all__ = ["MOMENTS", "Blockwise", "LowPrecisionAdamState", "scale_by_adam", "adamw",
           "state_bytes"]

MOMENTS = ("float32", "bfloat16", "int8")
_RANGE = 24.0          # int8 codes span magnitudes 2^-24 .. 1 of the block's scale
_PIECE = 1 << 20       # values updated at a time in a large leaf (bounds the temporaries)


class Blockwise(NamedTuple):
    """A moment leaf in 8 bits: `codes` `[blocks, block]` (int8: signed codes, or for a
    square root the bit patterns of unsigned ones) and one float32 `scale` per block. The leaf's own shape is the
    gradient's; the padding of the last block is zeros."""

    codes: jax.Array
    scale: jax.Array


class LowPrecisionAdamState(NamedTuple):
    """`scale_by_adam`'s state: the step `count` and the moments `mu`, `nu` (trees like
    the parameters, with `Blockwise` or bfloat16 leaves)."""

    count: jax.Array
    mu: Any
    nu: Any


def _check(moments, block) -> str:
    if moments not in MOMENTS:
        raise ValueError(f"moments={moments!r} is not a moment format; use one of "
                         f"{', '.join(map(repr, MOMENTS))}")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block={block!r}: expected a positive number of values per scale "
                         f"(e.g. 256)")
    return moments


def _levels(signed: bool) -> int:
    return 127 if signed else 255


def _encode(rel, signed: bool):
    """Magnitudes `rel` in [0, 1] to codes 0..K: code k >= 1 is 2^(-R (K - k) / (K - 1)),
    code 0 is zero; nearest code in the logarithm, nearest in value below code 1."""
    k_max = _levels(signed)
    per_octave = (k_max - 1) / _RANGE
    safe = jnp.maximum(rel, jnp.finfo(jnp.float32).tiny)
    k = jnp.clip(jnp.round(k_max + per_octave * jnp.log2(safe)), 1, k_max)
    k = jnp.where(rel < 0.5 * 2.0 ** -_RANGE, 0, k)
    return k


def _decode(k, signed: bool):
    k_max = _levels(signed)
    k = k.astype(jnp.float32)
    return jnp.where(k == 0, 0.0, jnp.exp2((k - k_max) * (_RANGE / (k_max - 1))))


def _blocks(x, block: int):
    flat = x.reshape(-1).astype(jnp.float32)
    b = max(1, min(block, flat.size))
    n = -(-flat.size // b)
    return jnp.pad(flat, (0, n * b - flat.size)).reshape(n, b)


def _quantize_rows(rows, signed: bool) -> Blockwise:
    scale = jnp.max(jnp.abs(rows), axis=1)
    rel = jnp.abs(rows) / jnp.where(scale > 0, scale, 1.0)[:, None]
    k = _encode(rel, signed)
    if signed:
        return Blockwise(jnp.where(rows < 0, -k, k).astype(jnp.int8), scale)
    # Unsigned codes kept as int8 bit patterns: IREE takes signless 8-bit globals only.
    return Blockwise(lax.bitcast_convert_type(k.astype(jnp.uint8), jnp.int8), scale)


def _dequantize_rows(m: Blockwise, signed: bool):
    codes = (m.codes if signed else lax.bitcast_convert_type(m.codes, jnp.uint8)).astype(jnp.int32)
    mag = _decode(jnp.abs(codes), signed) * m.scale[:, None]
    return jnp.where(codes < 0, -mag, mag) if signed else mag


def _store_int8(x, block: int, signed: bool) -> Blockwise:
    return _quantize_rows(_blocks(x, block), signed)


def _load_int8(m: Blockwise, like, signed: bool):
    value = _dequantize_rows(m, signed)
    return value.reshape(-1)[:like.size].reshape(like.shape)


def _mix(x):
    """A 32-bit integer hash (MurmurHash3's finalizer): each output bit depends on every
    input bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _round_stochastic(x, key):
    """float32 -> bfloat16, rounding up with probability equal to the remainder: the
    16 bits bfloat16 drops get a uniform random number added before truncation. The
    random numbers hash each value's index with `key` (a uint32 scalar): cheaper than a
    `jax.random` generator, and as uniform in their low 16 bits for this use."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    index = lax.iota(jnp.uint32, x.size).reshape(x.shape)
    noise = _mix(index ^ _mix(jnp.asarray(key, jnp.uint32))) & jnp.uint32(0xFFFF)
    kept = (bits + noise) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(kept, jnp.float32).astype(jnp.bfloat16)


def _key(*words):
    """A uint32 from small integers (seed, step, leaf), each word hashed in."""
    k = jnp.uint32(0x9E3779B9)
    for w in words:
        k = _mix(k ^ jnp.asarray(w).astype(jnp.uint32))
    return k


def _in_pieces(fn, arrays, per: int):
    """`fn(*rows)` over pieces of about `per` rows of `arrays` (each with the same number
    of rows), one piece after the other: `fn` returns new rows for `arrays[1:]` (arrays
    or `Blockwise` nodes), written over them in place (a `fori_loop` carrying only
    those; `arrays[0]` is read from outside it). A large leaf's moments then need
    temporaries of one piece. Without a divisor of the row count near `per`, one piece."""
    n = jax.tree.leaves(arrays[0])[0].shape[0]
    if n <= per:
        return fn(*arrays)
    pieces = next(k for k in range(-(-n // per), n + 1) if n % k == 0)
    if n // pieces < per // 8:              # no divisor near: one piece (more memory)
        return fn(*arrays)
    size = n // pieces
    first, rest = arrays[0], tuple(arrays[1:])
    cut = lambda tree, i: jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, i * size, size), tree)

    def body(i, bufs):
        new = fn(cut(first, i), *cut(bufs, i))
        return jax.tree.map(lambda o, x: lax.dynamic_update_slice_in_dim(o, x, i * size, 0),
                            bufs, tuple(new))

    return lax.fori_loop(0, pieces, body, rest)


def _zeros(p, fmt: str, block: int, signed: bool):
    if fmt == "bfloat16":
        return jnp.zeros(jnp.shape(p), jnp.bfloat16)
    # What `_store_int8` makes of zeros (code 0, scale 0), built directly: quantizing a
    # constant makes XLA fold the whole computation at compile time (seconds a leaf).
    size = int(np.prod(jnp.shape(p)))
    b = max(1, min(block, size))
    n = -(-size // b)
    return Blockwise(jnp.zeros((n, b), jnp.int8), jnp.zeros((n,), jnp.float32))


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                  moments: str = "int8", block: int = 256,
                  seed: int = 0) -> optax.GradientTransformation:
    """Adam's scaling (`optax.scale_by_adam`) with its moments stored in `moments`.

    Args:
      b1: the first moment's decay, as in `optax.scale_by_adam`.
      b2: the second moment's decay.
      eps: added to the square root of the second moment.
      moments: `"int8"` (2 bytes a value), `"bfloat16"` (4) or `"float32"` (8:
        `optax.scale_by_adam` itself). See the module's docstring for the formats.
      block: values per float32 scale for `"int8"` (256).
      seed: the seed of the stochastic rounding for `"bfloat16"`.

    Returns:
      An optax `GradientTransformation`; its state is a `LowPrecisionAdamState` (or
      optax's own state for `"float32"`).

    Raises:
      ValueError: an unknown `moments` or a `block` that is not a positive integer.
    """
    fmt = _check(moments, block)
    if fmt == "float32":
        return optax.scale_by_adam(b1, b2, eps)

    def init(params):
        zeros = lambda signed: jax.tree.map(lambda p: _zeros(p, fmt, block, signed), params)
        return LowPrecisionAdamState(jnp.zeros([], jnp.int32), zeros(True), zeros(False))

    def new_moments(g, m, v, key):
        """The moments after gradient `g`, as stored (bfloat16: the whole leaf; int8: rows
        `[r, b]` of blocks and their `Blockwise` moments)."""
        if fmt == "int8":
            m_old, v_old = _dequantize_rows(m, True), jnp.square(_dequantize_rows(v, False))
        else:
            m_old, v_old = m.astype(jnp.float32), v.astype(jnp.float32)
        m32 = b1 * m_old + (1 - b1) * g
        v32 = b2 * v_old + (1 - b2) * jnp.square(g)
        if fmt == "int8":
            return _quantize_rows(m32, True), _quantize_rows(jnp.sqrt(v32), False)
        return m32.astype(jnp.bfloat16), _round_stochastic(v32, key)

    def scaled(m, v, c1, c2):
        """Adam's update from the moments as stored: elementwise, so XLA computes it
        where the parameter is updated, with no float32 copy of the moments."""
        if fmt == "int8":
            m_hat = _dequantize_rows(m, True) / c1
            root = jnp.maximum(_dequantize_rows(v, False) / jnp.sqrt(c2), jnp.abs(m_hat))
        else:
            m_hat = m.astype(jnp.float32) / c1
            root = jnp.sqrt(v.astype(jnp.float32) / c2)
        return m_hat / (root + eps)

    def leaf(g, m, v, c1, c2, key):
        if fmt == "bfloat16":
            m, v = new_moments(g.astype(jnp.float32), m, v, key)
            return scaled(m, v, c1, c2), m, v
        b = max(1, min(block, g.size))
        rows = _blocks(g, b)                # a partial last block is padded with zeros
        if g.size % b == 0:                 # a large leaf: its blocks a piece at a time
            m, v = _in_pieces(lambda *r: new_moments(*r, None), (rows, m, v),
                              max(1, _PIECE // b))
        else:
            m, v = new_moments(rows, m, v, None)
        return scaled(m, v, c1, c2).reshape(-1)[:g.size].reshape(g.shape), m, v

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        leaves, treedef = jax.tree.flatten(updates)
        mus = treedef.flatten_up_to(state.mu)
        nus = treedef.flatten_up_to(state.nu)
        c1 = (1 - b1 ** count).astype(jnp.float32)
        c2 = (1 - b2 ** count).astype(jnp.float32)
        out, new_mu, new_nu = [], [], []
        for i, (g, m, v) in enumerate(zip(leaves, mus, nus)):
            u, m, v = leaf(g, m, v, c1, c2, _key(seed, count, i))
            out.append(u.astype(g.dtype))
            new_mu.append(m)
            new_nu.append(v)
        return (treedef.unflatten(out),
                LowPrecisionAdamState(count, treedef.unflatten(new_mu), treedef.unflatten(new_nu)))

    return optax.GradientTransformation(init, update)


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-4, mask=None, *, moments: str = "int8", block: int = 256,
          seed: int = 0) -> optax.GradientTransformation:
    """`optax.adamw` with its moments stored in `moments` (the float32 master is kept).

    Args:
      learning_rate: a float or an optax schedule.
      b1: the first moment's decay, as in `optax.adamw`.
      b2: the second moment's decay.
      eps: added to the square root of the second moment.
      weight_decay: the decoupled weight decay's rate.
      mask: which leaves decay, as in `optax.adamw`.
      moments: `"int8"`, `"bfloat16"` or `"float32"` (see `scale_by_adam`).
      block: values per float32 scale for `"int8"`.
      seed: the seed of the stochastic rounding for `"bfloat16"`.

    Returns:
      The optax chain `scale_by_adam`, decoupled weight decay, learning rate; with
      `moments="float32"` it computes what `optax.adamw` computes.

    Raises:
      ValueError: an unknown `moments` or a `block` that is not a positive integer.
    """
    return optax.chain(scale_by_adam(b1, b2, eps, moments=moments, block=block, seed=seed),
                       optax.add_decayed_weights(weight_decay, mask),
                       optax.scale_by_learning_rate(learning_rate))


def state_bytes(state) -> int:
    """Bytes of every array in an optimizer state (or any tree)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(state)
               if hasattr(x, "dtype"))
