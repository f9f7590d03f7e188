"""Which parts of a model train: `Scheme` and its decisions `Full`, `Frozen`, `Channels`.

A scheme is an ordered list of glob patterns over "/"-joined parameter paths; the
first pattern that matches a parameter decides what happens to it, and parameters
that no pattern matches get the default decision.

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
]


class SchemeError(ValueError):
    """A scheme does not fit the parameters it is applied to."""


# --------------------------------------------------------------------------- decisions


@dataclasses.dataclass(frozen=True)
class Full:
    """The whole tensor trains."""

    def __repr__(self) -> str:
        return "Full()"


@dataclasses.dataclass(frozen=True)
class Frozen:
    """The tensor does not train and gets no gradient work."""

    def __repr__(self) -> str:
        return "Frozen()"


_AXIS_NAMES = {"in": -2, "out": -1}


@dataclasses.dataclass(frozen=True)
class Channels:
    """A contiguous range of channels along one axis trains; the rest is frozen.

    Give exactly one of `ratio` (fraction in (0, 1], rounded up to whole channels) or
    `count`. `axis` is "in" or "out" (the input/output-feature axis of a dense kernel
    `[in, out]` or a 2-D/3-D conv kernel HWIO/DHWIO, i.e. axis -2 / -1; "out" is axis 0
    of a vector) or an int. A rank-3 weight needs an int axis: its layout cannot be
    told from its shape (a 1-D conv `[width, in, out]`, a `DenseGeneral` kernel
    `[in, heads, head_dim]`, a stacked `[layers, in, out]`). The kept range is the
    first channels, or the last ones with `last=True`.
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
        """`(axis, start, stop)` of the kept range for a leaf of this shape (resolved form)."""
        assert self.count is not None and isinstance(self.axis, int) and self.axis >= 0
        n = shape[self.axis]
        return (self.axis, n - self.count, n) if self.last else (self.axis, 0, self.count)

    def resolve(self, path: str, shape: tuple[int, ...], layout=None) -> "Channels":
        """This decision for the leaf `path` of `shape`: an int axis and a count (a named
        axis read through the leaf's `layout`, see `register_layouts`)."""
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


_QUANTIZED_PART = re.compile(r"/@(data|scale|zero)$")


def path_str(path: Sequence[Any]) -> str:
    """"/"-joined form of a `jax.tree_util` key path: dict keys, indices, attribute names."""
    return "/".join(_key_str(k) for k in path)


def leaves_with_paths(tree) -> tuple[list[tuple[str, Any]], Any]:
    """`[(path, leaf)]` in flattening order, and the treedef."""
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
    torch Linear weight). Trees without an entry keep JAX's layout ("in"/"out" = axes
    -2/-1). `note` is added to errors about patterns that match nothing (e.g. how this
    framework names its weights)."""
    _LAYOUTS[jax.tree_util.tree_structure(params)] = (dict(layouts), note)


def layouts_of(params) -> tuple[dict, str]:
    """`(layouts by path, note)` registered for `params`' structure, or for a dict's
    top-level entries (a torch model's parameters as `{"model": params, ...}`)."""
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

    >>> scheme = Scheme({"**/bias": Full(), "head/**": Full()}, default=Frozen())
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
        """The decision for one path (unresolved: ratios and named axes as written)."""
        for rx, (_, decision) in zip(self._regex, self.rules):
            if rx.match(path):
                return decision
        return self.default

    def resolve(self, params, *, allow_empty: bool = False):
        """The pytree of decisions for `params`, with Channels resolved to counts and int axes.

        Raises `SchemeError` for a pattern that matches no parameter, Channels that do
        not fit a leaf, a non-floating leaf that would train, or a scheme that trains
        nothing (unless `allow_empty=True`).
        """
        named, treedef = leaves_with_paths(params)
        if not named:
            raise SchemeError("the parameters have no array leaves; nothing to train")
        # A weight stored quantized (pockjax.lowbit.Quantized) has several arrays,
        # `weight/@data`, `weight/@scale`: the scheme matches the weight's own path.
        stored = [_QUANTIZED_PART.sub("", p) for p, _ in named]
        paths = list(dict.fromkeys(stored))
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
        for (path, leaf), owner in zip(named, stored):
            d = self.match(owner)
            shape = tuple(np.shape(leaf))
            if owner != path:
                if not isinstance(d, Frozen):
                    raise SchemeError(f"parameter '{owner}' is stored quantized and cannot train "
                                      f"({d!r}); quantize only the leaves the scheme freezes "
                                      f"(pockjax.lowbit.quantize(params, scheme, ...))")
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
        obj = {"version": 1,
               "rules": [{"pattern": p, "decision": decision_to_json(d)} for p, d in self.rules],
               "default": decision_to_json(self.default)}
        return json.dumps(obj, **dumps_kwargs)

    @classmethod
    def from_json(cls, text: str) -> "Scheme":
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
