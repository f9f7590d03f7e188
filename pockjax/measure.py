"""Readers and formatters for costs: compiled memory, sizes of pytrees, bytes and FLOPs
as text. `report()`, the search, the CLI, examples and benchmarks share them; the
public names are `pockjax.compiled_memory`, `pockjax.tree_bytes`, `pockjax.format_bytes`
and `pockjax.format_flops`."""
from __future__ import annotations

import numpy as np

__all__ = ["compiled_memory", "tree_bytes", "format_bytes", "format_flops"]


def compiled_memory(compiled) -> dict[str, int]:
    """XLA's memory analysis of a compiled step in bytes: `temp`, `argument`, `output`,
    `alias` (outputs written over donated arguments) and `peak` (arguments + outputs -
    aliased + temporaries).

    Args:
      compiled: a compiled program (`jax.stages.Compiled`), with `memory_analysis()`.

    Returns:
      A dict of byte counts with the keys `temp`, `argument`, `output`, `alias` and
        `peak`.
    """
    m = compiled.memory_analysis()
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("temp", "argument", "output", "alias")}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def tree_bytes(tree) -> int:
    """Bytes of the arrays (or `ShapeDtypeStruct`s) in a pytree.

    Args:
      tree: a pytree of arrays, `jax.ShapeDtypeStruct`s or scalars.

    Returns:
      The summed size in bytes of its leaves.
    """
    import jax

    return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype if hasattr(x, "dtype") else
                                                    np.result_type(x)).itemsize
               for x in jax.tree_util.tree_leaves(tree))


def format_bytes(n: float) -> str:
    """`1536` -> `'1.50 KiB'`.

    Args:
      n: a number of bytes.

    Returns:
      The size with two decimals in GiB, MiB or KiB (the largest unit not above it),
        or as a whole number of bytes below 1 KiB.
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n)} B"


def format_flops(n: float) -> str:
    """`2.5e9` -> `'2.500 GFLOP'`.

    Args:
      n: a number of floating-point operations.

    Returns:
      The count with three decimals in GFLOP, MFLOP or kFLOP (the largest unit not
        above it), or as a whole number of FLOP below 1,000.
    """
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:,.3f} {unit}"
    return f"{n:.0f} FLOP"
