"""Per-block activation checkpointing for `pockjax.nnx.Trainer(remat=...)`:
`remat_blocks` finds the submodules `remat` names ("blocks", or glob patterns over
module paths), and `checkpoint_blocks` gives those modules of the trainer's traced copy
a `__call__` under `jax.checkpoint` whose changed variables (batch statistics, RNG
counters) are written back. `pockjax.nnx` re-exports `remat_blocks`.
"""
from __future__ import annotations

import difflib
from typing import Callable, Sequence

import jax
from flax import nnx

from pockjax.nnx._state import module_at
from pockjax.scheme import glob_to_regex
from pockjax.remat import checkpoint_call


def _has_call(cls: type) -> bool:
    return any("__call__" in vars(k) for k in cls.__mro__ if k is not object)


def _callable_submodules(model: nnx.Module) -> dict[str, tuple]:
    """"/"-joined path -> key path of every submodule with a `__call__` (lists and the
    root excluded)."""
    return {"/".join(map(str, path)): tuple(path) for path, node in nnx.graph.iter_graph(model)
            if path and isinstance(node, nnx.Module) and _has_call(type(node))}


def _block_lists(model: nnx.Module) -> dict[str, list[tuple]]:
    """`{"layers/*": [key paths]}`: the callable modules held in lists (an index ends
    their path), outermost only (a block's own lists of layers are inside it)."""
    items = [path for path in _callable_submodules(model).values() if isinstance(path[-1], int)]
    outer = [p for p in items if not any(q != p and p[:len(q)] == q for q in items)]
    lists: dict[str, list[tuple]] = {}
    for p in sorted(outer, key=lambda p: tuple(str(k) for k in p[:-1]) + (p[-1],)):
        lists.setdefault("/".join(map(str, p[:-1] + ("*",))), []).append(p)
    return lists


def remat_blocks(model: nnx.Module, remat: str | Sequence[str]) -> tuple[list[tuple], str]:
    """The key paths of the submodules `remat` names, and a description for reports.

    `remat` is `"blocks"` (every module held in a list, outermost: LLaMA's `layers/*`,
    MobileNetV2's `blocks/*`) or glob patterns over "/"-joined module paths (`"layers/*"`,
    `["encoder/*", "decoder/*"]`; `*` stays within one path component, `**` spans). A
    pattern matching no callable submodule is a `ValueError` listing the block lists and
    submodules there are.

    Args:
      model: the module.
      remat: `"blocks"`, a glob pattern over "/"-joined module paths, or a list or tuple
        of patterns.

    Returns:
      A pair: the key paths of the chosen submodules (tuples of attribute names and
        list indices), and a description of the choice for reports.

    Raises:
      ValueError: `"blocks"` finds no list of submodules, or a pattern matches no
        callable submodule.
      TypeError: `remat` is neither a string nor a list or tuple of strings.

    Examples:
      >>> from flax import nnx; import pockjax as pj
      >>> from pockjax.models.llama import Llama, LlamaConfig
      >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
      >>> paths, where = pj.nnx.remat_blocks(model, "blocks")
      >>> paths, where
      ([('layers', 0), ('layers', 1)], 'blocks = layers/* (2 LlamaBlock)')
    """
    name = type(model).__name__
    lists = _block_lists(model)
    modules = _callable_submodules(model)

    def describe(lst):
        kinds = sorted({type(module_at(model, p)).__name__ for p in lists[lst]})
        return f"{lst} ({len(lists[lst])} {'/'.join(kinds)})"

    known = ", ".join(describe(k) for k in lists) or "none"
    if isinstance(remat, str) and remat == "blocks":
        if not lists:
            raise ValueError(
                f"remat='blocks' found no list of submodules in {name} (blocks are the "
                f"modules of an nnx.List, e.g. self.layers = nnx.List([...])); name the modules "
                f"to checkpoint with patterns over these paths: "
                f"{', '.join(sorted(modules)[:8]) or 'none'}")
        paths = [p for k in lists for p in lists[k]]
        return paths, "blocks = " + ", ".join(describe(k) for k in lists)
    patterns = [remat] if isinstance(remat, str) else \
        list(remat) if isinstance(remat, (list, tuple)) else None
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"remat must be None, 'blocks', 'full', a module path pattern or a list "
                        f"of them, got {remat!r}")
    paths: list[tuple] = []
    for pattern in patterns:
        regex = glob_to_regex(pattern)
        hits = [path for text, path in modules.items() if regex.match(text)]
        if not hits:
            near = difflib.get_close_matches(pattern, list(lists) + sorted(modules), n=3)
            raise ValueError(
                f"remat pattern {pattern!r} matches no callable submodule of {name}"
                + (f"; nearest: {', '.join(map(repr, near))}" if near else "")
                + f". Lists of blocks there: {known}; submodules e.g. "
                f"{', '.join(sorted(modules, key=lambda t: (t.count('/'), t))[:6])}. Give "
                f"remat='blocks' (every list of blocks), patterns over these paths such as "
                f"'layers/*', or 'full' (the whole loss); remat_policy= sets what a block saves"
                + (" (a policy name goes there, not in remat=)"
                   if pattern in ("full", "nothing_saveable") or hasattr(
                       jax.checkpoint_policies, pattern) else ""))
        paths += [p for p in hits if p not in paths]
    where = ", ".join(patterns)
    return paths, f"{where} ({len(paths)} module{'s' if len(paths) != 1 else ''})"


_CHECKPOINTED: dict = {}


def _checkpointed_class(cls: type, policy: Callable) -> type:
    """A subclass of `cls` whose `__call__` runs under `jax.checkpoint` (one per class
    and policy). The trainer gives it to the traced copies of the chosen blocks only."""
    key = (cls, policy)
    if key not in _CHECKPOINTED:
        call = cls.__call__

        def __call__(self, *args, **kwargs):
            return _checkpoint_module_call(self, call, policy, args, kwargs)

        _CHECKPOINTED[key] = type(cls)(cls.__name__, (cls,), {
            "__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _CHECKPOINTED[key]


def _checkpoint_module_call(module: nnx.Module, call: Callable, policy: Callable, args, kwargs):
    """`call(module, *args, **kwargs)` under `jax.checkpoint`, recomputed late: the
    module's variables and the arrays among the arguments are the inputs; variables the
    call changes (batch statistics, RNG counters) come out and are written back to
    `module`."""
    graphdef, state = nnx.split(module)
    before, state_def = jax.tree_util.tree_flatten(state)
    changed: list[int] = []

    def run(state, *args, **kwargs):
        # Read before the call: the merged module shares `state`'s variables and the
        # call writes into them.
        ins = jax.tree_util.tree_leaves(state)
        inner = nnx.merge(graphdef, state)
        out = call(inner, *args, **kwargs)
        after = jax.tree_util.tree_leaves(nnx.state(inner))
        changed[:] = [i for i, (x, y) in enumerate(zip(ins, after)) if x is not y]
        return out, [after[i] for i in changed]

    out, new = checkpoint_call(run, policy, state, *args, recompute_after_cotangent=True,
                               untied=(0,), **kwargs)
    if changed:
        leaves = list(before)
        for i, x in zip(changed, new):
            leaves[i] = x
        nnx.update(module, jax.tree_util.tree_unflatten(state_def, leaves))
    return out


def checkpoint_blocks(model: nnx.Module, paths: Sequence[tuple], policy: Callable) -> None:
    """Give the modules at `paths` of `model` (a traced copy) checkpointed calls."""
    for path in paths:
        block = module_at(model, path)
        block.__class__ = _checkpointed_class(type(block), policy)
