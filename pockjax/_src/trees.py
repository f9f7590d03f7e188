"""Nested-dict parameter trees, shared by the frontends (`pockjax.keras`, `pockjax.tf`,
`pockjax.torch`) and the trainers."""
from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp


def nest(items: Iterable[tuple[tuple, Any]]) -> dict:
    """A nested dict from `(path parts, value)` pairs: `(("a", "b"), 1)` -> `{"a": {"b": 1}}`."""
    out: dict = {}
    for parts, value in items:
        *parents, leaf = parts
        node = out
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = value
    return out


def leaves_at(tree, paths: Iterable[str], what: str, owner: str) -> dict[str, Any]:
    """`{path: leaf}` of `tree` (a nested dict, or a flat dict of "/"-joined paths) for
    exactly `paths`.

    Raises:
      KeyError: `tree` lacks one of `paths` or has another (`what` and `owner` name the
        tree and the model in the message).
    """
    from pockjax.scheme import leaves_with_paths

    paths = list(paths)
    named = dict(leaves_with_paths(tree)[0]) if tree else {}
    missing = [p for p in paths if p not in named]
    extra = [p for p in named if p not in set(paths)]
    if missing or extra:
        raise KeyError(f"the {what} do not fit the {owner}: missing {missing[:5]}, not in "
                       f"the {owner.split()[-1]} {extra[:5]}")
    return {p: named[p] for p in paths}


@jax.jit
def keep_if(skipped, old, new):
    """`old` where `skipped` (a scalar bool), else `new`: a skipped step keeps its state."""
    return jax.tree.map(lambda o, n: jnp.where(skipped, o, n), old, new)
