"""Which parts of a model train: `Scheme` and its decisions `Full`, `Frozen`, `Channels`.

A scheme is an ordered list of glob patterns over "/"-joined parameter paths; the
first pattern that matches a parameter decides what happens to it, and parameters
that no pattern matches get the default decision.

Examples:
  >>> import jax.numpy as jnp, pockjax as pj
  >>> params = {"dense": {"kernel": jnp.zeros((8, 4)), "bias": jnp.zeros(4)}}
  >>> scheme = pj.Scheme({"**/bias": pj.Full(), "dense/kernel": pj.Channels(count=2, axis="in")})
  >>> scheme.resolve(params)["dense"]["kernel"]
  Channels(count=2, axis=0)
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from typing import Any, Mapping, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Scheme",
    "SchemeError",
    "Full",
    "Frozen",
    "Channels",
    "Decision",
    "path_str",
    "leaves_with_paths",
    "register_layouts",
    "layouts_of",
    "register_stored_parts",
]


class SchemeError(ValueError):
    """Raised when a scheme, decision or schedule is malformed or does not fit the
    parameters it is applied to; the message names the pattern or parameter path."""


# --------------------------------------------------------------------------- decisions


@dataclasses.dataclass(frozen=True)
class Full:
    """Decision: the whole tensor trains."""

    def __repr__(self) -> str:
        return "Full()"


@dataclasses.dataclass(frozen=True)
class Frozen:
    """Decision: the tensor does not train and gets no gradient work."""

    def __repr__(self) -> str:
        return "Frozen()"


_AXIS_NAMES = {"in": -2, "out": -1}


@dataclasses.dataclass(frozen=True)
class Channels:
    """Decision: a contiguous range of channels along one axis trains; the rest is frozen.

    Give exactly one of `ratio` or `count`. A rank-3 weight needs an int axis: its
    layout cannot be told from its shape (a 1-D conv `[width, in, out]`, a
    `DenseGeneral` kernel `[in, heads, head_dim]`, a stacked `[layers, in, out]`).
    `resolve` turns the decision into its resolved form for one leaf: a `count` and a
    non-negative int `axis`.

    Args:
      ratio: the fraction of the axis's channels that trains, in (0, 1], rounded up to
        whole channels (at least one); None when `count` is given.
      count: the number of channels that trains, a positive int; None when `ratio` is
        given.
      axis: "out" (the default) or "in": the output/input-feature axis of a dense
        kernel `[in, out]` or a 2-D/3-D conv kernel HWIO/DHWIO, i.e. axis -1 / -2 ("out"
        is axis 0 of a vector); or an int axis. A leaf whose layout is registered with
        `register_layouts` reads "in"/"out" from there.
      last: keep the last channels of the axis instead of the first (default False).

    Attributes:
      ratio: the fraction given, or None.
      count: the channel count given (or resolved), or None.
      axis: "in", "out" or an int (a non-negative int once resolved).
      last: whether the kept range is at the end of the axis.

    Raises:
      SchemeError: both or neither of `ratio` and `count` are given, `ratio` is not in
        (0, 1], `count` is not a positive int, or `axis` is not "in", "out" or an int.
    """

    ratio: float | None = None
    count: int | None = None
    axis: Union[str, int] = "out"
    last: bool = False

    def __post_init__(self):
        if (self.ratio is None) == (self.count is None):
            raise SchemeError(
                f"Channels needs exactly one of ratio= or count= (got ratio={self.ratio!r}, "
                f"count={self.count!r}); e.g. Channels(ratio=0.25) or Channels(count=64)")
        if self.ratio is not None:
            if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) \
                    or not 0.0 < float(self.ratio) <= 1.0:
                raise SchemeError(
                    f"Channels ratio must be in (0, 1], got {self.ratio!r}; use a fraction such as 0.125")
        if self.count is not None:
            if isinstance(self.count, bool) or not isinstance(self.count, (int, np.integer)) \
                    or self.count < 1:
                raise SchemeError(f"Channels count must be a positive int, got {self.count!r}")
        if isinstance(self.axis, str):
            if self.axis not in _AXIS_NAMES:
                raise SchemeError(f"Channels axis must be 'in', 'out' or an int, got {self.axis!r}")
        elif isinstance(self.axis, bool) or not isinstance(self.axis, (int, np.integer)):
            raise SchemeError(f"Channels axis must be 'in', 'out' or an int, got {self.axis!r}")

    def __repr__(self) -> str:
        parts = [f"ratio={self.ratio!r}" if self.ratio is not None else f"count={self.count!r}",
                 f"axis={self.axis!r}"]
        if self.last:
            parts.append("last=True")
        return f"Channels({', '.join(parts)})"

    def bounds(self, shape: Sequence[int]) -> tuple[int, int, int]:
        """`(axis, start, stop)` of the kept range for a leaf of this shape.

        Only for the resolved form (`count` set, `axis` a non-negative int), as
        `resolve` returns it.

        Args:
          shape: the leaf's shape.

        Returns:
          The axis and the kept range's start and stop indices along it.
        """
        assert self.count is not None and isinstance(self.axis, int) and self.axis >= 0
        n = shape[self.axis]
        return (self.axis, n - self.count, n) if self.last else (self.axis, 0, self.count)

    def resolve(self, path: str, shape: tuple[int, ...], layout=None) -> "Channels":
        """This decision for the leaf `path` of `shape`: an int axis and a count (a named
        axis read through the leaf's `layout`, see `register_layouts`).

        Args:
          path: the leaf's "/"-joined path, for error messages.
          shape: the leaf's shape.
          layout: the leaf's registered layout (`{"in": axis, "out": axis}`, or a string
            saying why its axes are unknown), or None (the default) for JAX's layout.

        Returns:
          A `Channels` with `count` (from `ratio`, rounded up) and a non-negative int
          `axis`; `ratio` is None.

        Raises:
          SchemeError: the leaf is a scalar; a named axis does not apply (a rank-3 or
            rank > 5 leaf, a vector's "in", a layout string); an int axis is out of range;
            or `count` is larger than the axis.
        """
        ndim = len(shape)
        if ndim == 0:
            raise SchemeError(f"parameter '{path}' is a scalar; Channels needs an axis to slice. "
                              f"Use Full() or Frozen() for it")
        if isinstance(self.axis, str) and layout is not None:
            # The leaf's own layout (see register_layouts), e.g. torch's [out, in] Linear.
            if isinstance(layout, str):
                raise SchemeError(
                    f"parameter '{path}' has shape {shape} and {layout}, so Channels(axis="
                    f"'{self.axis}') has no known meaning for it; give the axis as an int")
            axis = layout[self.axis]
        elif isinstance(self.axis, str):
            axis = _AXIS_NAMES[self.axis]
            if ndim == 3 or ndim > 5:
                guess = ndim + axis
                raise SchemeError(
                    f"parameter '{path}' has shape {shape} (rank {ndim}); Channels(axis="
                    f"'{self.axis}') names an axis of a dense [in, out] or conv HWIO kernel, and "
                    f"this weight's layout cannot be told from its shape (a 1-D conv [width, in, "
                    f"out], a DenseGeneral [in, heads, head_dim], stacked layers [layers, in, "
                    f"out]). Give the axis as an int, e.g. Channels(..., axis={guess}) for "
                    f"axis {axis} of this shape")
            if ndim < -axis:
                raise SchemeError(
                    f"parameter '{path}' has shape {shape}, which has no '{self.axis}' axis "
                    f"('in'/'out' are axes -2/-1 of a kernel); use axis=0 or axis='out' for a vector")
        else:
            axis = int(self.axis)
            if not -ndim <= axis < ndim:
                raise SchemeError(f"parameter '{path}' has shape {shape} (rank {ndim}); Channels axis "
                                  f"{axis} is out of range, valid axes are {-ndim}..{ndim - 1}")
        axis %= ndim
        n = shape[axis]
        if self.count is not None:
            if self.count > n:
                raise SchemeError(f"parameter '{path}' has {n} channels on axis {axis} (shape {shape}); "
                                  f"Channels count={self.count} is larger. Use count<={n} or a ratio")
            count = int(self.count)
        else:
            count = max(1, math.ceil(float(self.ratio) * n - 1e-9))
        return Channels(count=count, axis=axis, last=self.last)


Decision = Union[Full, Frozen, Channels]
"""What a scheme decides for one parameter: `Full`, `Frozen` or `Channels`."""
DECISION_TYPES = (Full, Frozen, Channels)


def decision_to_json(d: Decision) -> dict:
    if isinstance(d, Full):
        return {"kind": "full"}
    if isinstance(d, Frozen):
        return {"kind": "frozen"}
    out = {"kind": "channels", "axis": d.axis, "last": d.last}
    out.update({"ratio": d.ratio} if d.ratio is not None else {"count": d.count})
    return out


def decision_from_json(obj: Any) -> Decision:
    if not isinstance(obj, dict) or "kind" not in obj:
        raise SchemeError(f"expected a decision object like {{'kind': 'full'}}, got {obj!r}")
    kind = obj["kind"]
    if kind == "full":
        return Full()
    if kind == "frozen":
        return Frozen()
    if kind == "channels":
        return Channels(ratio=obj.get("ratio"), count=obj.get("count"),
                        axis=obj.get("axis", "out"), last=bool(obj.get("last", False)))
    raise SchemeError(f"unknown decision kind {kind!r}; expected 'full', 'frozen' or 'channels'")


# --------------------------------------------------------------------------- paths


def _key_str(k) -> str:
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return str(k)


# The last component of each array's path in a stored weight (`weight/@data`) ->
# (the part a `Channels` decision trains, the call that stores weights so): filled by
# the module defining such a node when it is imported (`pockjax.lowbit`).
_STORED_PARTS: dict[str, tuple[str | None, str]] = {}


def register_stored_parts(parts: Sequence[str], *, trained: str | None, made_by: str) -> None:
    """Make `Scheme.resolve` match each array of a pytree node that stores one weight
    (`pockjax.lowbit.Quantized`: `weight/@data`, `weight/@scale`...) by the weight's
    own path. The module defining the node calls it when it is imported.

    Args:
      parts: the keys, each the last component of an array's path (`"@data"`).
      trained: the key holding the channels a `Channels` decision trains (the other
        parts stay frozen), or None (a stored weight can only be frozen).
      made_by: the call that stores weights so, named in the error for one that trains.
    """
    _STORED_PARTS.update(dict.fromkeys(parts, (trained, made_by)))


def _stored_owner(path: str) -> tuple[str, tuple[str | None, str] | None]:
    """`(the weight's path, its registered storage)` for an array of a stored weight,
    `(path, None)` for any other."""
    owner, sep, part = path.rpartition("/")
    return (owner, _STORED_PARTS[part]) if sep and part in _STORED_PARTS else (path, None)


def path_str(path: Sequence[Any]) -> str:
    """The "/"-joined form of a `jax.tree_util` key path.

    Args:
      path: a key path, as `jax.tree_util.tree_flatten_with_path` gives it.

    Returns:
      Its dict keys, sequence indices and attribute names joined by "/"
      (`"blocks_0/attn/q/kernel"`).
    """
    return "/".join(_key_str(k) for k in path)


def leaves_with_paths(tree) -> tuple[list[tuple[str, Any]], Any]:
    """The leaves of `tree` with their "/"-joined paths.

    Args:
      tree: any pytree.

    Returns:
      `([(path, leaf), ...], treedef)`: the leaves in flattening order, each with its
      `path_str`, and the tree's structure.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(path_str(p), leaf) for p, leaf in flat], treedef


# --------------------------------------------------------------------------- layouts

# Per-leaf layouts of parameter trees whose named axes differ from JAX's (a dense kernel
# [in, out], a conv HWIO): keyed by the tree's structure, so every tree of that
# structure (the trainer's updated params, a traced copy, a checkpoint loaded back)
# finds them. A layout is {"in": axis, "out": axis}, or a string saying why the leaf's
# axes are unknown (a named axis on it is then an error).
_LAYOUTS: dict = {}


def register_layouts(params, layouts: Mapping[str, Any], note: str = "") -> None:
    """Declare the named axes of `params`' leaves by path (`{"in": 1, "out": 0}` for a
    torch Linear weight).

    The entry is keyed by the tree's structure, so every tree of the same structure
    (the trainer's updated parameters, a checkpoint loaded back) finds it. Trees
    without an entry keep JAX's layout ("in"/"out" = axes -2/-1). A later call for the
    same structure replaces the entry.

    Args:
      params: a parameter pytree; only its structure is used.
      layouts: path -> `{"in": axis, "out": axis}`, or a string saying why that leaf's
        axes are unknown (a named `Channels` axis on it is then an error).
      note: text added to errors about patterns that match nothing (e.g. how this
        framework names its weights); default none.
    """
    _LAYOUTS[jax.tree_util.tree_structure(params)] = (dict(layouts), note)


def layouts_of(params) -> tuple[dict, str]:
    """The layouts registered for `params`' structure (see `register_layouts`).

    Where the whole structure has no entry and `params` is a mapping, the entries of
    its top-level values are combined, their paths prefixed with the key (a torch
    model's parameters as `{"model": params, ...}`).

    Args:
      params: a parameter pytree.

    Returns:
      `(layouts by path, note)`; `({}, "")` when nothing is registered.
    """
    found = _LAYOUTS.get(jax.tree_util.tree_structure(params))
    if found is not None:
        return found
    if not isinstance(params, Mapping) or not _LAYOUTS:
        return {}, ""
    layouts, notes = {}, []
    for key, sub in params.items():
        inner = _LAYOUTS.get(jax.tree_util.tree_structure(sub))
        if inner is not None:
            layouts.update({f"{key}/{p}": v for p, v in inner[0].items()})
            notes.append(inner[1])
    return layouts, notes[0] if notes else ""


# --------------------------------------------------------------------------- globs


def exact_pattern(path: str) -> str:
    """A glob that matches exactly `path` (its `*`, `?` and `[` escaped)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in path)


def glob_to_regex(pattern: str) -> re.Pattern:
    """Shell-style glob over "/"-joined paths: `*` and `?` stay in one component, `**` spans."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**", i):
            before_ok = i == 0 or pattern[i - 1] == "/"
            after = pattern[i + 2:i + 3]
            if before_ok and after == "/":          # "**/": zero or more whole components
                out.append(r"(?:[^/]+/)*")
                i += 3
                continue
            if before_ok and after == "" and i > 0:  # trailing "/**": drop the "/" already emitted
                out[-1] = r"(?:/.*)?"
                i += 2
                continue
            out.append(r".*")
            i += 2
        elif c == "*":
            out.append(r"[^/]*")
            i += 1
        elif c == "?":
            out.append(r"[^/]")
            i += 1
        elif c == "[":
            j = pattern.find("]", i + 2)
            if j < 0:
                raise SchemeError(f"pattern {pattern!r} has an unclosed '['")
            body = pattern[i + 1:j]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z")


# --------------------------------------------------------------------------- scheme


class Scheme:
    """Ordered glob rules from parameter paths to decisions; the first match wins.

    Patterns are shell-style globs over "/"-joined parameter paths: `*` and `?` stay
    within one path component, `**` spans several, `[...]` is a character class.
    Schemes compare equal (and hash equal) when their rules and default are equal.

    >>> scheme = Scheme({"**/bias": Full(), "head/**": Full()}, default=Frozen())

    Args:
      rules: `{pattern: decision}` or a sequence of `(pattern, decision)` pairs, in
        priority order; default none.
      default: the decision for parameters no pattern matches; default `Frozen()`.

    Attributes:
      rules: the `(pattern, decision)` pairs, as a tuple.
      default: the decision for unmatched parameters.

    Raises:
      SchemeError: a rule is not a `(pattern, decision)` pair, a pattern is not a
        non-empty string, or a decision (or `default`) is not `Full`, `Frozen` or
        `Channels`.
    """

    def __init__(self, rules: Mapping[str, Decision] | Sequence[tuple[str, Decision]] = (),
                 default: Decision = Frozen()):
        items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise SchemeError(f"a scheme rule must be (pattern, decision), got {item!r}")
            pattern, decision = item
            if not isinstance(pattern, str) or not pattern:
                raise SchemeError(f"a scheme pattern must be a non-empty string, got {pattern!r}")
            if not isinstance(decision, DECISION_TYPES):
                raise SchemeError(f"pattern {pattern!r} maps to {decision!r}; expected "
                                  f"pockjax.Full(), pockjax.Frozen() or pockjax.Channels(...)")
        if not isinstance(default, DECISION_TYPES):
            raise SchemeError(f"default must be Full(), Frozen() or Channels(...), got {default!r}")
        self.rules: tuple[tuple[str, Decision], ...] = tuple(items)
        self.default = default
        self._regex = tuple(glob_to_regex(p) for p, _ in self.rules)

    def __repr__(self) -> str:
        body = ", ".join(f"{p!r}: {d!r}" for p, d in self.rules)
        return f"Scheme({{{body}}}, default={self.default!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Scheme) and (self.rules, self.default) == (other.rules, other.default)

    def __hash__(self) -> int:
        return hash((self.rules, self.default))

    def match(self, path: str) -> Decision:
        """The decision for one path (unresolved: ratios and named axes as written).

        Args:
          path: a "/"-joined parameter path.

        Returns:
          The decision of the first pattern that matches `path`, else `default`.
        """
        for rx, (_, decision) in zip(self._regex, self.rules):
            if rx.match(path):
                return decision
        return self.default

    def resolve(self, params, *, allow_empty: bool = False):
        """The pytree of decisions for `params`, with Channels resolved to counts and int axes.

        A `Channels` decision that keeps every channel of its axis resolves to `Full()`.

        Args:
          params: the model's parameter pytree (arrays or `jax.ShapeDtypeStruct`s).
          allow_empty: accept a scheme under which every parameter is frozen (default
            False: that raises).

        Returns:
          A pytree of `params`' structure with a `Full`, `Frozen` or resolved `Channels`
          at each leaf.

        Raises:
          SchemeError: `params` has no leaves, a pattern matches no parameter (the
            message lists the nearest paths), a `Channels` decision does not fit its
            leaf, a non-floating leaf would train, or nothing trains (unless
            `allow_empty=True`).
        """
        named, treedef = leaves_with_paths(params)
        if not named:
            raise SchemeError("the parameters have no array leaves; nothing to train")
        # A stored weight (pockjax.lowbit.Quantized) has several arrays, `weight/@data`,
        # `weight/@scale`: the scheme matches the weight's own path.
        owners = [_stored_owner(p) for p, _ in named]
        stored_parts = {p for p, _ in named}
        paths = list(dict.fromkeys(owner for owner, _ in owners))
        layouts, note = layouts_of(params)
        for (pattern, _), rx in zip(self.rules, self._regex):
            if not any(rx.match(p) for p in paths):
                near = difflib.get_close_matches(pattern, paths, n=3, cutoff=0.0)
                raise SchemeError(
                    f"pattern {pattern!r} matched no parameter; nearest: "
                    + ", ".join(repr(p) for p in near)
                    + ". Paths are '/'-joined keys; '*' stays within one component, '**' spans several"
                    + (f". {note}" if note else ""))
        decisions = []
        for (path, leaf), (owner, storage) in zip(named, owners):
            d = self.match(owner)
            shape = tuple(np.shape(leaf))
            if storage is not None:
                # A weight that trains in part holds its trained channels as `@master`.
                trained, made_by = storage
                master = trained and f"{owner}/{trained}"
                if isinstance(d, Channels) and path == master:
                    decisions.append(Full())
                    continue
                if isinstance(d, Channels) and master in stored_parts:
                    decisions.append(Frozen())
                    continue
                if not isinstance(d, Frozen):
                    raise SchemeError(f"parameter '{owner}' is stored quantized and cannot train "
                                      f"({d!r}); quantize only the leaves the scheme freezes"
                                      f"{' or trains in part (Channels)' if trained else ''} "
                                      f"({made_by})")
                decisions.append(d)
                continue
            if not isinstance(d, Frozen):
                dtype = jnp.dtype(leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype)
                # jnp.issubdtype knows bfloat16 and the float8 types are floating.
                if not jnp.issubdtype(dtype, jnp.floating):
                    raise SchemeError(f"parameter '{path}' has dtype {dtype} and cannot train ({d!r}); "
                                      f"only floating-point parameters train. Mark it Frozen()")
            if isinstance(d, Channels):
                d = d.resolve(path, shape, layouts.get(path))
                if d.count == shape[d.axis]:
                    d = Full()
            decisions.append(d)
        if not allow_empty and all(isinstance(d, Frozen) for d in decisions):
            raise SchemeError(f"the scheme trains nothing: all {len(paths)} parameters are Frozen "
                              f"(e.g. '{paths[0]}'). Add a rule such as {{'**': pockjax.Full()}}")
        return jax.tree_util.tree_unflatten(treedef, decisions)

    # ----------------------------------------------------------------------- JSON

    def to_json(self, **dumps_kwargs) -> str:
        """The scheme as JSON text (version 1), which `from_json` reads back.

        Args:
          **dumps_kwargs: passed to `json.dumps` (e.g. `indent=2`).

        Returns:
          A JSON object with `version`, `rules` (`pattern` and `decision` each) and
          `default`.
        """
        obj = {"version": 1,
               "rules": [{"pattern": p, "decision": decision_to_json(d)} for p, d in self.rules],
               "default": decision_to_json(self.default)}
        return json.dumps(obj, **dumps_kwargs)

    @classmethod
    def from_json(cls, text: str) -> "Scheme":
        """The scheme written by `to_json`.

        Args:
          text: the JSON text.

        Returns:
          The `Scheme`; a missing `default` reads as `Frozen()`.

        Raises:
          SchemeError: the text is not JSON, not a version-1 scheme object, or holds a
            malformed rule or decision.
        """
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise SchemeError(f"scheme JSON does not parse: {e}") from None
        if not isinstance(obj, dict) or obj.get("version") != 1 or "rules" not in obj:
            raise SchemeError("scheme JSON must be an object with 'version': 1, 'rules' and 'default' "
                              "(as written by Scheme.to_json())")
        rules = []
        for r in obj["rules"]:
            if not isinstance(r, dict) or "pattern" not in r or "decision" not in r:
                raise SchemeError(f"scheme JSON rule must have 'pattern' and 'decision', got {r!r}")
            rules.append((r["pattern"], decision_from_json(r["decision"])))
        return cls(rules, default=decision_from_json(obj.get("default", {"kind": "frozen"})))
