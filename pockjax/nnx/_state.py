"""An `nnx.Module` as plain nested dicts, and NNX filters as a `Scheme`: `split` and
`merge` (the module's graph definition, its trained variables and the rest),
`param_paths` (the "/"-joined paths schemes see) and `scheme` (filters to exact-path
rules). `pockjax.nnx` re-exports them; its `Trainer`, `search` and
`frozen_norms_in_inference_mode` build on them, and `pockjax.nnx._remat` on `module_at`.
"""
from __future__ import annotations

from typing import Any, Sequence

from flax import nnx

from pockjax.scheme import (Decision, Frozen, Full, Scheme, SchemeError, DECISION_TYPES,
                            exact_pattern)

Filter = Any


def split(model: nnx.Module, wrt: Filter = nnx.Param) -> tuple[Any, dict, dict]:
    """`(graphdef, params, rest)`: the `wrt` variables and all others as nested dicts of arrays.

    Args:
      model: the module.
      wrt: an NNX filter of the variables that train (default `nnx.Param`).

    Returns:
      A tuple `(graphdef, params, rest)`: the module's graph definition, its `wrt`
        variables and all its other variables (batch statistics, RNG counters), each
        as a nested dict of arrays keyed by attribute names and list indices.
    """
    graphdef, params, rest = nnx.split(model, wrt, ...)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def merge(graphdef, params: dict, rest: dict) -> nnx.Module:
    """The module back from `split`'s parts (a new module; inside a trace, a traced one).

    Args:
      graphdef: the graph definition from `split`.
      params: the `wrt` variables as `split` returns them (or trained values of the
        same structure).
      rest: the other variables as `split` returns them.

    Returns:
      A new `nnx.Module`.
    """
    return nnx.merge(graphdef, params, rest)


def _variables(model: nnx.Module, wrt: Filter):
    wanted = nnx.filterlib.to_predicate(wrt)
    for path, node in nnx.graph.iter_graph(model):
        if isinstance(node, nnx.Variable) and wanted(path, node):
            yield path, node


def param_paths(model: nnx.Module, wrt: Filter = nnx.Param) -> list[str]:
    """The "/"-joined paths of the module's `wrt` variables, as schemes see them.

    Args:
      model: the module.
      wrt: an NNX filter of the variables (default `nnx.Param`).

    Returns:
      The paths, sorted (`"layers/0/attn/q_proj/kernel"`).
    """
    return sorted("/".join(map(str, p)) for p, _ in _variables(model, wrt))


def scheme(model: nnx.Module, rules: Filter | Sequence[tuple[Filter, Decision]],
           *, default: Decision = Frozen(), wrt: Filter = nnx.Param) -> Scheme:
    """A `Scheme` from NNX filters over `model`'s `wrt` variables.

    `rules` is one filter (its variables train in full) or `(filter, decision)` pairs,
    first match wins. Filters are anything `nnx` accepts: a variable type
    (`nnx.LoRAParam`), `nnx.PathContains("attn")`, `nnx.Any(...)`, `nnx.All(...)`,
    `nnx.Not(...)`, a predicate `(path, variable) -> bool`, or a string tag.

    Args:
      model: the module.
      rules: one NNX filter, whose variables train in full, or a sequence of
        `(filter, decision)` pairs; a variable takes the decision of the first filter
        that matches it.
      default: the decision of variables no filter matches (default `Frozen()`).
      wrt: an NNX filter of the variables the scheme covers (default `nnx.Param`).

    Returns:
      A `Scheme` with one exact-path rule per matched variable whose decision differs
        from `default`.

    Raises:
      SchemeError: a filter matches no `wrt` variable that an earlier filter did not
        match already.

    Examples:
      >>> from flax import nnx; import pockjax as pj
      >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      >>> pj.nnx.scheme(model, nnx.PathContains("bias"))
      Scheme({'bias': Full()}, default=Frozen())
    """
    if isinstance(rules, (list, tuple)) and rules and all(
            isinstance(r, tuple) and len(r) == 2 and isinstance(r[1], DECISION_TYPES) for r in rules):
        pairs = list(rules)
    else:
        pairs = [(rules, Full())]
    predicates = [(nnx.filterlib.to_predicate(f), d, f) for f, d in pairs]
    found = {id(f): False for _, _, f in predicates}
    out = []
    for path, var in _variables(model, wrt):
        for pred, decision, f in predicates:
            if pred(path, var):
                found[id(f)] = True
                if decision != default:
                    out.append((exact_pattern("/".join(map(str, path))), decision))
                break
    missing = [f for _, _, f in predicates if not found[id(f)]]
    if missing:
        raise SchemeError(f"NNX filter {missing[0]!r} matches no {wrt!r} variable of "
                          f"{type(model).__name__}; its parameters are e.g. "
                          f"{', '.join(param_paths(model, wrt)[:4])}")
    return Scheme(out, default=default)


def module_at(model: nnx.Module, path) -> Any:
    """The submodule (or variable) of `model` at a key path of attribute names and list
    indices."""
    node = model
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node
