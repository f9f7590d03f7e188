"""Ready-made schemes."""
from __future__ import annotations

from typing import Sequence

from pockjax.scheme import Frozen, Full, Scheme

__all__ = ["bias_only"]


def bias_only(names: Sequence[str] = ("bias",)) -> Scheme:
    """Train only biases (BitFit): every parameter whose last path component is in `names`.

    >>> bias_only().match("blocks_0/mlp/bias")
    Full()
    """
    return Scheme({f"**/{n}": Full() for n in names}, default=Frozen())
