"""Data ties: ordering a write after reads by a data dependency instead of a barrier.

An in-place update of a donated parameter must come after the parameter's last reads.
XLA drops optimization barriers before deciding whether a donated buffer must be
copied, so a barrier does not tell it the write follows the reads; a value computed from
the reads that leaves the written value unchanged does. `tie_zero` is that value (an
exact zero from one element of each read), `token` and `tied_start` make a partial
write's start index depend on the reads. The fused optimizer (`pockjax.optim.fused`),
per-block checkpointing (`pockjax.train.checkpoint_block`) and export's tied matmuls
(`pockjax.export.lowering`) use them.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["tie_zero", "token", "tied_start"]


def tie_zero(ties, barrier: bool = False):
    """A scalar 0 that depends on one element of each of `ties` (None if none).

    With `barrier` the elements pass through an optimization barrier, which keeps IREE
    from fusing their extraction into the update: when a reader's output also goes into or
    comes out of a loop (scan, while), that fusion makes IREE 3.13's stream partitioning
    fail ("circular dependency"; e.g. for the layer before a scanned stack). The
    barrier is on scalars, but it splits the step into more submissions, which allocate
    more memory, so it is used only there.
    Finite values are clipped to [-1, 1] and multiplied by 0, NaN and infinities
    map to 0 first (a complex element contributes its real part), so the zero is exact
    whatever the readers produced. It is always -0.0: `x + -0.0` is `x` bit for bit,
    a -0.0 in `x` included (`x + +0.0` would turn that into +0.0). A float
    multiplication by zero cannot be folded (it is not 0 for NaN or infinity), so the
    dependency reaches the program.

    Args:
      ties: the arrays to depend on (the last readers' outputs); empty ones are skipped.
      barrier: pass the elements through an optimization barrier (default False).

    Returns:
      A float32 scalar -0.0, or None when `ties` has no non-empty array.
    """
    elems = [jnp.ravel(t)[0] for t in ties if np.size(t)]
    if not elems:
        return None
    total = jnp.float32(0)
    for e in lax.optimization_barrier(elems) if barrier else elems:
        e = jnp.real(e) if jnp.iscomplexobj(e) else e
        e = jnp.nan_to_num(e.astype(jnp.float32), nan=0.0, posinf=0.0, neginf=0.0)
        total = total + jnp.clip(e, -1, 1)
    return -(jnp.abs(total) * 0.0)


def token(ties):
    """A boolean scalar computed from the last readers' outputs (None if there are none).

    Its value never matters: it picks between two start indices of the in-place slice
    update that clip to the same slice (`tied_start`), which makes the write
    data-dependent on the reads. XLA drops optimization barriers before its copy insertion, and without a
    data dependency it copies the donated parameter twice (measured: 33.8 -> 17.6 MiB
    temporaries on a 6x1024 MLP with Channels(1/8) kernels). Whole-tensor updates are
    elementwise and need no token; adding one there costs memory instead.
    """
    preds = [jnp.ravel(t)[0] == 0 for t in ties if np.size(t)]
    if not preds:
        return None
    tok = preds[0]
    for p in preds[1:]:
        tok = tok | p
    return tok


def tied_start(tok, start: int, last: int):
    """`start` (the kept range's first index, `0 <= start <= last`), computed from `tok`.

    The token picks between `start` and an index just outside `[0, last]` on
    `start`'s side, and the result is clipped back into `[0, last]`: both choices give
    `start`, but the write now depends on the reads (see `token`). The clip is explicit
    because `lax.dynamic_update_slice` wraps a negative start from the end (like
    Python indexing) before clamping: a start of `-1` writes the *last* channels.
    """
    if start == 0:
        outside = -1
    elif start == last:
        outside = last + 1
    else:  # a range strictly inside the axis has no outside index that clips to it
        return start
    return jnp.clip(jnp.where(tok, outside, start), 0, last)
