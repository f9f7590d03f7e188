"""Boxes: which part of a value the push-down pass computes.

A box is a tuple of `(start, stop)` pairs, one per dimension of a value (`()` for a
scalar). The pass (`pushdown`), its plans and every rule describe the parts of values
they need and produce as boxes; these helpers build, measure and cut them.
"""
from __future__ import annotations

from typing import Sequence

from jax import lax

Box = tuple  # tuple[tuple[int, int], ...]
"""A box: a tuple of `(start, stop)` pairs, one per dimension of a value (`()` for a scalar)."""


def full_box(shape: Sequence[int]) -> Box:
    """The box covering all of a value.

    Args:
      shape: the value's shape.

    Returns:
      `(0, n)` for each dimension `n` of `shape`.
    """
    return tuple((0, int(n)) for n in shape)


def is_full(box: Box, shape: Sequence[int]) -> bool:
    """Whether `box` covers all of a value of shape `shape`.

    Args:
      box: the box.
      shape: the value's shape.

    Returns:
      True when every dimension's pair is `(0, n)`.
    """
    return all(s == 0 and e == n for (s, e), n in zip(box, shape))


def box_shape(box: Box) -> tuple[int, ...]:
    """The shape of the part of a value that `box` selects.

    Args:
      box: the box.

    Returns:
      `stop - start` for each dimension.
    """
    return tuple(e - s for s, e in box)


def slice_to_box(x, box: Box, shape: Sequence[int]):
    """The part of `x` that `box` selects.

    Args:
      x: an array or tracer.
      box: the box to take, within `shape`.
      shape: the shape of `x`.

    Returns:
      `x` itself when `box` covers all of it, else `lax.slice(x, starts, stops)`.
    """
    if is_full(box, shape):
        return x
    return lax.slice(x, [s for s, _ in box], [e for _, e in box])
