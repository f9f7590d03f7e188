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
  over the same range (7% steps). Values below the range round to zero. Rounding is to the nearest code. A block that decays as a
  whole is tracked exactly by its scale. Where quantization broke Adam's bound
  |m| <= sqrt(v) (a second moment rounded to zero), the update divides by |m| instead,
  so no value moves by more than the learning rate.
- `"bfloat16"`: both moments in bfloat16. The second moment changes by 0.1% a step
  (`b2 = 0.999`), below bfloat16's resolution, so rounding to nearest would freeze it;
  it is rounded stochastically instead (unbiased; the random bits come from `seed` and
  the step count). The first moment is rounded to nearest.
- `"float32"`: `optax.scale_by_adam` itself.

Each step dequantizes a leaf's moments, applies Adam's update in float32 and stores them
again, one leaf at a time, so the fused trainer (`pockjax.sparse_train`) still updates
each parameter as soon as its gradient exists and no float32 copy of all moments exists.

>>> import jax.numpy as jnp, optax
>>> from pockjax import optim
>>> opt = optim.adamw(1e-2, moments="int8")
>>> params = {"w": jnp.ones((4, 256))}
>>> state = opt.init(params)
>>> updates, state = opt.update({"w": jnp.full((4, 256), 0.5)}, state, params)
>>> round(float(updates["w"][0, 0]), 4)      # Adam's first step: -lr * sign(g)
-0.01
>>> optim.state_bytes(state), optim.state_bytes(optax.adamw(1e-2).init(params))
(2084, 8196)
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

__all__ = ["MOMENTS", "Blockwise", "LowPrecisionAdamState", "scale_by_adam", "adamw",
           "state_bytes"]

MOMENTS = ("float32", "bfloat16", "int8")
_RANGE = 24.0          # int8 codes span magnitudes 2^-24 .. 1 of the block's scale
_PIECE = 1 << 20       # values updated at a time in a large leaf (bounds the temporaries)


class Blockwise(NamedTuple):
    """A moment leaf in 8 bits: `codes` `[blocks, block]` (int8 signed, or uint8 for a
    square root) and one float32 `scale` per block. The leaf's own shape is the
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
    return Blockwise(k.astype(jnp.uint8), scale)


def _dequantize_rows(m: Blockwise, signed: bool):
    codes = m.codes.astype(jnp.int32)
    mag = _decode(jnp.abs(codes), signed) * m.scale[:, None]
    return jnp.where(codes < 0, -mag, mag) if signed else mag


def _store_int8(x, block: int, signed: bool) -> Blockwise:
    return _quantize_rows(_blocks(x, block), signed)


def _load_int8(m: Blockwise, like, signed: bool):
    value = _dequantize_rows(m, signed)
    return value.reshape(-1)[:like.size].reshape(like.shape)


def _round_stochastic(x, key):
    """float32 -> bfloat16, rounding up with probability equal to the remainder: the
    16 bits bfloat16 drops get a uniform random number added before truncation."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint32) & jnp.uint32(0xFFFF)
    kept = (bits + noise) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(kept, jnp.float32).astype(jnp.bfloat16)


def _in_pieces(fn, arrays, per: int):
    """`fn(i, *rows)` over pieces of `per` rows of `arrays` (each with the same number of
    rows): a loop that reads each piece and writes its results over it in place, so a
    large leaf's update needs temporaries of one piece, not of the whole leaf. `fn`'s
    results have the inputs' structure (row for row: the first input's rows become the
    first result's)."""
    n = jax.tree.leaves(arrays[0])[0].shape[0]
    if n <= per:
        return fn(0, *arrays)
    take = lambda tree, start, size: jax.tree.map(
        lambda x: lax.dynamic_slice_in_dim(x, start, size), tree)
    put = lambda tree, new, start: jax.tree.map(
        lambda x, y: lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), start, 0), tree, new)
    whole = n // per

    def body(i, bufs):
        return put(bufs, fn(i, *take(bufs, i * per, per)), i * per)

    bufs = lax.fori_loop(0, whole, body, tuple(arrays))
    if n % per:                              # the rows after the last whole piece
        start = whole * per
        bufs = put(bufs, fn(whole, *take(bufs, start, n - start)), start)
    return bufs


def _zeros(p, fmt: str, block: int, signed: bool):
    if fmt == "bfloat16":
        return jnp.zeros(jnp.shape(p), jnp.bfloat16)
    return _store_int8(jnp.zeros(jnp.shape(p), jnp.float32), block, signed)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                  moments: str = "int8", block: int = 256,
                  seed: int = 0) -> optax.GradientTransformation:
    """Adam's scaling (`optax.scale_by_adam`) with its moments stored in `moments`.

    Args:
      b1, b2, eps: as in `optax.scale_by_adam`.
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

    def piece(g, m, v, c1, c2, key):
        """Adam on rows of a leaf: `g` `[r, b]`, its moments' rows (bfloat16 `[r, b]` or
        `Blockwise`); the update's rows and the new moments' rows."""
        if fmt == "int8":
            m_old, v_old = _dequantize_rows(m, True), jnp.square(_dequantize_rows(v, False))
        else:
            m_old, v_old = m.astype(jnp.float32), v.astype(jnp.float32)
        m32 = b1 * m_old + (1 - b1) * g
        v32 = b2 * v_old + (1 - b2) * jnp.square(g)
        m_hat = m32 / c1
        root = jnp.sqrt(v32 / c2)
        if fmt == "int8":
            root = jnp.maximum(root, jnp.abs(m_hat))
            new_m, new_v = _quantize_rows(m32, True), _quantize_rows(jnp.sqrt(v32), False)
        else:
            new_m, new_v = m32.astype(jnp.bfloat16), _round_stochastic(v32, key)
        return m_hat / (root + eps), new_m, new_v

    def leaf(g, m, v, c1, c2, key):
        b = max(1, min(block, g.size))
        if g.size % b:                      # a partial last block: padded, in one piece
            rows = _blocks(g, b)
            if fmt == "bfloat16":
                m, v = (jnp.pad(x.reshape(-1), (0, rows.size - g.size)).reshape(rows.shape)
                        for x in (m, v))
            u, m, v = piece(rows, m, v, c1, c2, key)
            if fmt == "bfloat16":
                m, v = (x.reshape(-1)[:g.size].reshape(g.shape) for x in (m, v))
            return u.reshape(-1)[:g.size].reshape(g.shape), m, v
        shape = g.shape
        g = g.astype(jnp.float32).reshape(-1, b)
        if fmt == "bfloat16":
            m, v = m.reshape(-1, b), v.reshape(-1, b)
        u, m, v = _in_pieces(lambda i, *rows: piece(*rows, c1, c2, jax.random.fold_in(key, i)),
                             (g, m, v), max(1, _PIECE // b))
        if fmt == "bfloat16":
            m, v = m.reshape(shape), v.reshape(shape)
        return u.reshape(shape), m, v

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        leaves, treedef = jax.tree.flatten(updates)
        mus = treedef.flatten_up_to(state.mu)
        nus = treedef.flatten_up_to(state.nu)
        key = jax.random.fold_in(jax.random.PRNGKey(seed), count)
        c1 = (1 - b1 ** count).astype(jnp.float32)
        c2 = (1 - b2 ** count).astype(jnp.float32)
        out, new_mu, new_nu = [], [], []
        for i, (g, m, v) in enumerate(zip(leaves, mus, nus)):
            u, m, v = leaf(g, m, v, c1, c2, jax.random.fold_in(key, i))
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
      b1, b2, eps, weight_decay, mask: as in `optax.adamw`.
      moments, block, seed: as in `scale_by_adam`.

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
