"""The search's candidates: what could train, one weight (in full or a share of its
channels), the block vectors or a stacked weight's last layers at a time.

`pockjax.scheme_search.search` calls `find_candidates` unless it is given candidates;
`pockjax.scheme_search` re-exports `Candidate`, `find_candidates` and `RATIOS`.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from pockjax.scheme import Channels, Decision, Frozen, Full, Scheme, SchemeError, \
    decision_to_json, glob_to_regex, exact_pattern, layouts_of, leaves_with_paths
from pockjax.schemes import blocks, params_of

RATIOS = (1 / 8, 1 / 4, 1 / 2)


def _ratio_str(r: float) -> str:
    from fractions import Fraction

    f = Fraction(r).limit_denominator(64)
    return f"{f.numerator}/{f.denominator}"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One thing that could train: `rules` (exact paths -> decisions), in `group`
    (a search picks at most one candidate per group: one ratio per weight).

    Attributes:
      name: a readable label, unique among a search's candidates
        (`"blocks/0/mlp/kernel 1/4 in"`).
      group: the search picks at most one candidate per group; `find_candidates` uses
        the weight's path (or `"biases"` / `"vectors"` for the block vectors).
      rules: `(exact parameter path, decision)` pairs.
    """

    name: str
    group: str
    rules: tuple[tuple[str, Decision], ...]

    def scheme(self) -> Scheme:
        """The scheme that trains this candidate alone.

        Returns:
          A `Scheme` with one exact-path rule per entry of `rules`, everything else
            Frozen.
        """
        return Scheme([(exact_pattern(p), d) for p, d in self.rules], default=Frozen())

    def key(self) -> str:
        """The candidate's cache key.

        Returns:
          Its rules as JSON (paths and decisions, keys sorted), independent of `name`.
        """
        return json.dumps([[p, decision_to_json(d)] for p, d in self.rules], sort_keys=True)


def _module_of(path: str, block_list: list[str]) -> str | None:
    """The block module holding `path` (`layers/3/attn` for `layers/3/attn/q_proj/kernel`),
    or None outside the blocks or for a weight directly in a block."""
    for b in block_list:
        if path.startswith(b + "/"):
            rest = path[len(b) + 1:].split("/")
            return f"{b}/{rest[0]}" if len(rest) > 2 else None
    return None


def _block_of(path: str, block_list: list[str]) -> int | None:
    for i, b in enumerate(block_list):
        if path.startswith(b + "/"):
            return i
    return None


UNITS = ("weight", "module")


def find_candidates(params, *, ratios: Sequence[float] = RATIOS, axis: str | int = "in",
               include: Sequence[str] | None = None, exclude: Sequence[str] = (),
               vectors: Sequence[str] = ("bias",), stacked: Sequence[str] = (),
               block_name: str | None = None, unit: str = "weight") -> list[Candidate]:
    """The search's candidates for `params`: a pytree, or a model whose type has a
    converter (`pockjax.schemes.register_params_of`; `pockjax.nnx` registers `nnx.Module`).
    By default they cover the whole model: every block's weights and vectors, and outside
    the blocks the embedding (whose "in" axis is the vocabulary: Channels train the rows
    of the first tokens), the output head and the final norm.

    - every floating weight (2 or more dimensions) matching `include` (globs; all by
      default) and not `exclude`: Full, and Channels at each of `ratios` along `axis`
      (ratios that round to the whole axis, or to the count of a smaller ratio, are
      dropped as duplicates); with a named `axis`, a weight whose named axes are
      unknown (rank 3 or above 5 without a registered layout, or a layout string) gets
      Full only. With `unit="module"` the weights of one module of a block (a block's
      child: `layers/3/attn`, `layers/3/mlp`) are one candidate, in full or each at the
      ratio (about a third as many candidates for a transformer, so a third of the
      compilations); weights outside the blocks stay candidates of their own;
    - the 1-D parameters named in `vectors` (biases) of the last k blocks, k = 1..K,
      as one group; a model without biases uses all its 1-D parameters (norm scales).
      Vectors outside the blocks (a head's bias) are candidates of their own;
    - each weight matching `stacked` (globs) has a leading layer axis: its last k
      layers, k = 1..L, train (`Channels(count=k, axis=0, last=True)`).

    Args:
      params: the parameters (a pytree) or a model with a registered converter.
      ratios: the Channels ratios, each in (0, 1); default `RATIOS` (1/8, 1/4, 1/2).
      axis: the axis the Channels candidates slice: `"in"` (the default), `"out"` or
        an int.
      include: globs over parameter paths that may train; None (the default): all.
      exclude: globs over parameter paths that never train (default none).
      vectors: last path components of the 1-D parameters the block-vector candidates
        take (default `("bias",)`); when none matches, every 1-D parameter.
      stacked: globs of weights with a leading layer axis (default none).
      block_name: the blocks' container for `pockjax.schemes.blocks` (`"layers"`,
        `"blocks"`); None (the default) picks the one with the most blocks. Without
        blocks every vector is a candidate of its own.
      unit: `"weight"` (the default: one candidate per weight and ratio) or `"module"`
        (one per block module and ratio, see above).

    Returns:
      The list of `Candidate`s.

    Raises:
      SchemeError: a ratio is not in (0, 1), a `stacked` parameter has fewer than 2
        dimensions, `unit` is unknown, or no candidate was found.
    """
    if unit not in UNITS:
        raise SchemeError(f"unit must be one of {', '.join(map(repr, UNITS))}, got {unit!r}")
    params = params_of(params)
    named = [(p, x) for p, x in leaves_with_paths(params)[0]
             if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    inc = [glob_to_regex(g) for g in include] if include is not None else None
    exc = [glob_to_regex(g) for g in exclude]
    stk = [glob_to_regex(g) for g in stacked]
    for ratio in ratios:
        if not 0 < ratio < 1:
            raise SchemeError(f"ratios must be in (0, 1) (Full is always a candidate), got {ratio!r}")

    def wanted(p):
        return (inc is None or any(r.match(p) for r in inc)) and not any(r.match(p) for r in exc)

    layouts = layouts_of(params)[0]
    try:
        block_list = blocks(params, block_name)
    except SchemeError:
        block_list = []
    out: list[Candidate] = []
    modules: dict[str, list[Candidate]] = {}  # unit="module": a module's weights' candidates
    for path, x in named:
        shape = tuple(np.shape(x))
        if not wanted(path):
            continue
        if any(r.match(path) for r in stk):
            if len(shape) < 2:
                raise SchemeError(f"stacked parameter '{path}' has shape {shape}; a stacked "
                                  f"weight has a leading layer axis and at least 2 dimensions")
            for k in range(1, shape[0] + 1):
                d = Full() if k == shape[0] else Channels(count=k, axis=0, last=True)
                out.append(Candidate(f"{path} last {k}/{shape[0]} layers", path, ((path, d),)))
            continue
        if len(shape) < 2:
            continue
        module = _module_of(path, block_list) if unit == "module" else None
        if module is not None:
            modules.setdefault(module, [])
            target = modules[module]
        else:
            target = out
        target.append(Candidate(f"{path} full", path, ((path, Full()),)))
        seen = set()
        # A named axis means nothing on a rank-3 weight (see Channels): Full only there.
        # A leaf with a registered layout (torch's [out, in]) names its axes itself.
        layout = layouts.get(path)
        named_ok = len(shape) in (2, 4, 5) if layout is None else not isinstance(layout, str)
        for ratio in sorted(ratios) if isinstance(axis, int) or named_ok else ():
            d = Channels(ratio=ratio, axis=axis).resolve(path, shape, layout)
            if d.count == shape[d.axis] or d.count in seen:
                continue
            seen.add(d.count)
            target.append(Candidate(f"{path} {_ratio_str(ratio)} {axis}", path,
                                    ((path, Channels(count=d.count, axis=d.axis)),)))
    for module, cands in modules.items():
        # One candidate per label ("full", "1/4 in"): every weight of the module that has it.
        by_label: dict[str, list] = {}
        for c in cands:
            by_label.setdefault(c.name.split(" ", 1)[1], []).extend(c.rules)
        for label, rules in by_label.items():
            out.append(Candidate(f"{module} {label}", module, tuple(rules)))

    vec = [(p, x) for p, x in named if np.ndim(x) == 1 and wanted(p)
           and not any(r.match(p) for r in stk)]
    named_vec = [(p, x) for p, x in vec if p.rsplit("/", 1)[-1] in tuple(vectors)]
    vec = named_vec or vec
    in_blocks: dict[int, list[str]] = {}
    for p, _ in vec:
        b = _block_of(p, block_list)
        if b is None:
            out.append(Candidate(f"{p} full", p, ((p, Full()),)))
        else:
            in_blocks.setdefault(b, []).append(p)
    if in_blocks:
        order = sorted(in_blocks)
        what = "biases" if named_vec else "vectors"
        for k in range(1, len(order) + 1):
            paths = [p for b in order[-k:] for p in in_blocks[b]]
            out.append(Candidate(f"{what} of the last {k} blocks", what,
                                 tuple((p, Full()) for p in paths)))
    if not out:
        raise SchemeError("no candidates: no floating parameter matches "
                          f"include={list(include) if include is not None else None}, "
                          f"exclude={list(exclude)}; parameters are e.g. "
                          + ", ".join(repr(p) for p, _ in leaves_with_paths(params)[0][:4]))
    return out
