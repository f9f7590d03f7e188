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
- `Blocks("Q4_1")` ...: a GGUF file's own block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
  Q2_K to Q6_K), kept as the file stores them and decoded bit for bit as `gguf`'s
  dequantize decodes them. They are read from a file (`pockjax.gguf`), not made here.

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

The pieces live in this package and their public names are handed on here:
`pockjax.lowbit._formats` (the formats and their codes), `pockjax.lowbit._blocks` (GGUF's
block formats), `pockjax.lowbit._store`
(`Quantized`, `quantize` and the other functions of stored trees) and
`pockjax.lowbit._use` (`at_use`: the dequantization at each use).
"""
from __future__ import annotations

from pockjax._src.home import claim
from pockjax.lowbit._blocks import Blocks
from pockjax.lowbit._formats import FORMATS, Cast, Int4, Int8, QuantizeError, format_of
from pockjax.lowbit._store import (Quantized, dequantize, formats_by_path, in_words,
                                   is_quantized, quantize, quantize_leaf, store_frozen_leaf,
                                   store_leaf, stored_bytes)
# PIECE_BYTES: the float copy's size above which `at_use` multiplies a weight in pieces.
from pockjax.lowbit._use import PIECE_BYTES, at_use, one_after, reads_stored  # noqa: F401

__all__ = ["Cast", "Int8", "Int4", "Blocks", "FORMATS", "Quantized", "QuantizeError", "format_of",
           "formats_by_path", "quantize", "quantize_leaf", "store_leaf", "store_frozen_leaf",
           "dequantize", "at_use", "reads_stored", "one_after", "is_quantized", "stored_bytes",
           "in_words"]

claim(globals())
