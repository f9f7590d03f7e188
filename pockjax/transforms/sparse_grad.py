"""`sparse_grad`: gradients for the trainable part of the parameters only.

How it works, in three steps on jaxprs:

1. Reparametrise. Each `Channels` leaf `W` becomes `concatenate([t, f])` along its
   axis, where only the kept slice `t` is differentiated; `Frozen` leaves are plain
   inputs. Scans over a stacked weight whose layer axis is split this way are split
   into one scan per part, so frozen layers are not differentiated (`scan_split`).
2. Differentiate with `jax.value_and_grad` with respect to the kept slices only. JAX
   leaves frozen tensors out of the backward pass; the gradient of a kept slice is a
   slice of the full weight gradient.
3. Push those slices up the backward graph (`pushdown`), so the weight gradient is
   computed for the kept channels only; dead code disappears on the way, and the
   forward `concatenate(slice(W), slice(W))` folds back into `W`.

The steps are plain functions in `_kept_grad`; this module holds the public functions,
the trainable view of the parameters and `SparseGradFn`, which traces the steps once
per argument signature and reports what they did (`TransformInfo`).
"""
from __future__ import annotations

import dataclasses
import functools
import linecache
import os
import traceback
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from pockjax import lowbit
from pockjax.scheme import Channels, Frozen, Full, Scheme, SchemeError, leaves_with_paths
from pockjax.view import (ResolvedScheme, apply_sparse_updates,  # noqa: F401
                          resolved_decisions, trainable_view)
from pockjax.transforms import convolutions, dot_layout
from pockjax.transforms._kept_grad import kept_value_and_grad, make_jaxpr_with_aux, push_down

__all__ = ["sparse_grad", "sparse_value_and_grad", "trainable_view", "apply_sparse_updates",
           "TransformInfo", "TracedValueError"]


# --------------------------------------------------------------------------- the transform


@dataclasses.dataclass
class TransformInfo:
    """What `sparse_grad` did to one traced gradient, for reports.

    `str()` of it is a readable summary; `as_dict()` gives the fields as plain data.

    Attributes:
      jaxpr: the rewritten gradient program: it takes the differentiated leaves and
        then the array leaves of the other arguments, and returns the loss, the aux
        leaves and the gradient of each trained leaf.
      trainable_params: number of trained elements (whole Full leaves, the kept
        slices of Channels leaves).
      total_params: number of elements of all differentiated leaves.
      frozen: paths of the Frozen leaves.
      channels: path of each Channels leaf -> its resolved `Channels` decision.
      full: paths of the Full leaves.
      rules: primitive name -> number of boxes the push-down rules narrowed.
      fallbacks: primitive name -> number of equations computed whole and then
        sliced although only part of their output is used.
      fallback_sources: primitive name -> the user's source line of its first
        fallback.
      eqns_before: equations (sub-jaxprs included) before push-down.
      eqns_after: equations (sub-jaxprs included) after push-down and dead-code
        elimination.
      scans_split: number of scans split at a frozen/trained layer boundary.
      fallback_reasons: primitive name -> why its first fallback could not narrow.
    """

    jaxpr: jex.ClosedJaxpr
    trainable_params: int
    total_params: int
    frozen: list[str]
    channels: dict[str, Channels]
    full: list[str]
    rules: dict[str, int]
    fallbacks: dict[str, int]
    fallback_sources: dict[str, str]
    eqns_before: int
    eqns_after: int
    scans_split: int
    fallback_reasons: dict[str, str] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        """Everything but the jaxpr, as plain data.

        Returns:
          A dict of the fields except `jaxpr`, with each `Channels` decision as its
            `repr`.
        """
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "jaxpr"}
        d["channels"] = {k: repr(v) for k, v in self.channels.items()}
        return d

    def __str__(self) -> str:
        lines = [
            f"trainable parameters: {self.trainable_params:,} of {self.total_params:,} "
            f"({100.0 * self.trainable_params / max(self.total_params, 1):.2f}%)",
            f"leaves: {len(self.full)} full, {len(self.channels)} channels, {len(self.frozen)} frozen",
            f"equations: {self.eqns_before} before push-down, {self.eqns_after} after",
            f"scans split at a frozen/trained layer boundary: {self.scans_split}",
            "slice rules applied: " + (", ".join(f"{k} x{v}" for k, v in sorted(self.rules.items()))
                                       or "none"),
            "fallbacks (computed whole, then sliced): " + (
                ", ".join(f"{k} x{v} (e.g. {self.fallback_sources.get(k, '?')}"
                          + (f": {self.fallback_reasons[k]}" if k in self.fallback_reasons else "")
                          + ")" for k, v in sorted(self.fallbacks.items())) or "none"),
        ]
        return "\n".join(lines)


class TracedValueError(TypeError):
    """Raised when the differentiated function asks for the concrete value of a traced
    array: a Python `if` on it, `int(x)`, `np.asarray(x)`. JAX's own error is its
    `__cause__`."""


# What each of JAX's concretization errors means the user's code did.
_CONCRETIZATION = (
    (jax.errors.TracerBoolConversionError,
     "branches in Python on a traced value (`if`, `while`, `and`/`or` or `bool()` on an array)"),
    (jax.errors.TracerIntegerConversionError,
     "uses a traced value as a Python index (`range(x)`, `a_list[x]`, `operator.index(x)`)"),
    (jax.errors.TracerArrayConversionError,
     "converts a traced value to a NumPy array (`np.asarray(x)` or a NumPy function on it)"),
    (jax.errors.ConcretizationTypeError,
     "needs the concrete value of a traced array (`float(x)`, `int(x)`, or a shape, size or "
     "loop bound computed from an array)"),
)
_JAX_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, np))


def _user_frame(err: BaseException):
    """The innermost frame of `err`'s traceback outside JAX and NumPy: where the user's code
    asked for the value."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith(_JAX_DIRS)]
    return frames[-1] if frames else None


def _traced_value_error(err: BaseException, fun) -> TracedValueError:
    what = next(text for kind, text in _CONCRETIZATION if isinstance(err, kind))
    name = getattr(fun, "__qualname__", None) or getattr(fun, "__name__", None) or repr(fun)
    frame = _user_frame(err)
    where = ""
    if frame is not None:
        line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        where = f" at {frame.filename}:{frame.lineno} (in {frame.name})" + (f":\n    {line}" if line else "")
    return TracedValueError(
        f"the loss function `{name}` {what}{where}\n"
        "sparse_grad traces the function once for every value of its array arguments (as "
        "jax.grad and jax.jit do), so a Python decision cannot depend on an array's value. To "
        "decide on data, compute both sides and pick with jnp.where(cond, a, b), or use "
        "jax.lax.cond / jax.lax.while_loop; for a setting that is not data (a flag, a size, a "
        "step count), pass it as a Python value, not an array: non-array arguments of a "
        "sparse_grad function are static (under jax.jit, also name the argument in "
        f"static_argnums). (JAX's {type(err).__name__} is chained above.)")


def is_dynamic(x) -> bool:
    """Whether a non-differentiated argument leaf is traced as an array (else it is static).

    A `jax.ShapeDtypeStruct` stands for an array: tracing (`explain`, `trace`) needs
    shapes only.

    Args:
      x: a leaf of the arguments that are not differentiated.

    Returns:
      True for a JAX or NumPy array, a NumPy scalar, a `jax.ShapeDtypeStruct` or a
        tracer; False otherwise (the leaf is then static, part of the cache key).
    """
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, jax.core.Tracer))


class GradProgram(NamedTuple):
    """What the transform built for one argument signature, for the trainer and export.

    Attributes:
      runner: the jitted gradient program; it takes the differentiated leaves and then
        the dynamic leaves of the other arguments, and returns the loss, the aux
        leaves and the trained leaves' gradients, flat.
      info: its `TransformInfo`, with the rewritten jaxpr.
      aux_def: the treedef of the aux output (of `None` without `has_aux`).
      decisions: the resolved decision of each differentiated leaf.
      diff_def: the treedef of the differentiated arguments.
    """

    runner: Callable
    info: "TransformInfo"
    aux_def: Any
    decisions: list
    diff_def: Any


class SparseGradFn:
    """`sparse_grad` / `sparse_value_and_grad` of a function: call it like `jax.grad`'s
    result; `trace(*args)` gives the `GradProgram` for those arguments (cached).

    Non-array leaves of the arguments that are not differentiated are static: each new
    value traces the function again, and they must be hashable.

    Args:
      fun: the function to differentiate.
      scheme: the `Scheme` saying what trains.
      argnums: the position of the differentiated argument, or a tuple of positions
        (the gradient is then a tuple, and scheme paths start with the argument's
        index in that tuple: `0/...`).
      has_aux: whether `fun` returns `(value, aux)`.
      with_value: return the value with the gradient (`sparse_value_and_grad`).
      resolved: the `pockjax.view.ResolvedScheme` of `scheme` to use (a trainer shares
        its own); None (the default) makes one.

    Raises:
      SchemeError: `scheme` is not a `Scheme`.
      TypeError: `argnums` is not an int or a tuple of ints.
    """

    def __init__(self, fun, scheme, argnums, has_aux, with_value, resolved=None):
        if not isinstance(scheme, Scheme):
            raise SchemeError(f"scheme must be a pockjax.Scheme, got {type(scheme).__name__}")
        # The scheme resolved once per parameter structure (a trainer shares its own).
        self._resolved = ResolvedScheme(scheme) if resolved is None else resolved
        if isinstance(argnums, (list, tuple)):
            argnums = tuple(int(a) for a in argnums)
        elif not isinstance(argnums, (int, np.integer)):
            raise TypeError(f"argnums must be an int or a tuple of ints, got {argnums!r}")
        self.fun, self.scheme, self.argnums = fun, scheme, argnums
        # Frozen weights stored by pockjax.lowbit are dequantized at each use.
        self._on_stored = lowbit.at_use(fun)
        self.has_aux, self.with_value = has_aux, with_value
        self._cache: dict = {}
        functools.update_wrapper(self, fun)

    # -- tracing ---------------------------------------------------------------

    def _split_args(self, args, kwargs):
        nums = self.argnums if isinstance(self.argnums, tuple) else (self.argnums,)
        for a in nums:
            if not -len(args) <= a < len(args):
                raise TypeError(f"argnums={self.argnums} but the function was called with "
                                f"{len(args)} positional arguments")
        nums = tuple(a % len(args) for a in nums)
        diff = tuple(args[a] for a in nums) if isinstance(self.argnums, tuple) else args[nums[0]]
        rest = [None if i in nums else x for i, x in enumerate(args)]
        return nums, diff, rest

    def trace(self, *args, **kwargs) -> GradProgram:
        """The gradient program for arguments like these (traced once per signature).

        A signature is the differentiated leaves' structure, shapes and dtypes, the
        other arguments' structure, the shapes and dtypes of their array leaves and the
        values of their static leaves.

        Args:
          *args: positional arguments as for a call.
          **kwargs: keyword arguments as for a call.

        Returns:
          The `GradProgram` for this signature.

        Raises:
          TypeError: an `argnums` position is out of range for `args`, or a static
            argument is not hashable.
          TracedValueError: `fun` asks for the concrete value of a traced array.
        """
        nums, diff, rest = self._split_args(args, kwargs)
        named, diff_def = leaves_with_paths(diff)
        decisions = self._resolved(diff)
        other_leaves, other_def = jax.tree_util.tree_flatten((rest, kwargs))
        dyn_mask = [is_dynamic(x) for x in other_leaves]
        static = tuple(None if m else x for x, m in zip(other_leaves, dyn_mask))
        avals = tuple((tuple(np.shape(x)), str(jnp.result_type(x))) for _, x in named)
        dyn_avals = tuple((tuple(np.shape(x)), str(jnp.result_type(x)))
                          for x, m in zip(other_leaves, dyn_mask) if m)
        try:
            key = (diff_def, tuple(decisions), avals, other_def, tuple(dyn_mask), static, dyn_avals,
                   dot_layout.enabled(), convolutions.enabled())
            hash(key)
        except TypeError:
            raise TypeError("non-array arguments of a sparse_grad function must be hashable "
                            "(they are treated as static, like jax.jit's static arguments)") from None
        if key in self._cache:
            return self._cache[key]
        entry = self._trace(nums, named, diff_def, decisions, other_leaves, other_def, dyn_mask)
        self._cache[key] = entry
        return entry

    def _trace(self, nums, named, diff_def, decisions, other_leaves, other_def, dyn_mask):
        call = functools.partial(self._call, nums, diff_def, other_leaves, other_def, dyn_mask)
        grad = functools.partial(kept_value_and_grad, call, decisions, self.has_aux)
        leaves = [x for _, x in named]
        dyn = [x for x, m in zip(other_leaves, dyn_mask) if m]
        closed, _, (aux_def, n_split) = make_jaxpr_with_aux(grad, leaves, dyn)
        final, stats = push_down(closed, swap_dots=dot_layout.enabled())
        info = _transform_info(final, stats, named, decisions, n_split)
        return GradProgram(jax.jit(jex.jaxpr_as_fun(final)), info, aux_def, decisions, diff_def)

    def _call(self, nums, diff_def, other_leaves, other_def, dyn_mask, leaves, dyn):
        """`fun` on the differentiated leaves `leaves` and the dynamic leaves `dyn` of the
        other arguments; JAX's concretization errors become a `TracedValueError`."""
        dyn_it = iter(dyn)
        others = [next(dyn_it) if m else x for x, m in zip(other_leaves, dyn_mask)]
        rest, kwargs = jax.tree_util.tree_unflatten(other_def, others)
        diff = jax.tree_util.tree_unflatten(diff_def, leaves)
        args = list(rest)
        if isinstance(self.argnums, tuple):
            for a, sub in zip(nums, diff):
                args[a] = sub
        else:
            args[nums[0]] = diff
        try:
            return self._on_stored(*args, **kwargs)
        except tuple(kind for kind, _ in _CONCRETIZATION) as err:
            raise _traced_value_error(err, self.fun) from err

    # -- calling ---------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        runner, info, aux_def, decisions, diff_def = self.trace(*args, **kwargs)
        nums, diff, rest = self._split_args(args, kwargs)
        leaves = jax.tree_util.tree_leaves(diff)
        other_leaves = jax.tree_util.tree_leaves((rest, kwargs))
        dyn = [x for x in other_leaves if is_dynamic(x)]
        outs = runner(*leaves, *dyn)
        value, outs = outs[0], outs[1:]
        n_aux = aux_def.num_leaves
        aux = jax.tree_util.tree_unflatten(aux_def, outs[:n_aux])
        g_it = iter(outs[n_aux:])
        grads = jax.tree_util.tree_unflatten(
            diff_def, [None if isinstance(d, Frozen) else next(g_it) for d in decisions])
        if not self.with_value:
            return (grads, aux) if self.has_aux else grads
        return ((value, aux), grads) if self.has_aux else (value, grads)

    def explain(self, *args, **kwargs) -> TransformInfo:
        """What the transform did for these arguments (rules, fallbacks, the jaxpr).

        Args:
          *args: positional arguments as for a call (arrays or `jax.ShapeDtypeStruct`s).
          **kwargs: keyword arguments as for a call.

        Returns:
          The `TransformInfo` of the gradient program for this signature.
        """
        return self.trace(*args, **kwargs).info


def _transform_info(final, stats, named, decisions, n_split) -> TransformInfo:
    """The report of one traced gradient: `final` its jaxpr, `named` the `(path, leaf)`
    pairs of the differentiated leaves."""
    total = sum(int(np.prod(np.shape(x))) for _, x in named)
    n_train = 0
    for (_, x), d in zip(named, decisions):
        if isinstance(d, Full):
            n_train += int(np.prod(np.shape(x)))
        elif isinstance(d, Channels):
            axis, s, e = d.bounds(np.shape(x))
            n_train += int(np.prod(np.shape(x))) // np.shape(x)[axis] * (e - s)
    return TransformInfo(
        jaxpr=final, trainable_params=n_train, total_params=total,
        frozen=[p for (p, _), d in zip(named, decisions) if isinstance(d, Frozen)],
        channels={p: d for (p, _), d in zip(named, decisions) if isinstance(d, Channels)},
        full=[p for (p, _), d in zip(named, decisions) if isinstance(d, Full)],
        rules=dict(stats.rules), fallbacks=dict(stats.fallbacks),
        fallback_sources=dict(stats.fallback_sources),
        fallback_reasons=dict(stats.fallback_reasons),
        eqns_before=stats.eqns_in, eqns_after=stats.eqns_out, scans_split=n_split)


def sparse_grad(fun: Callable, scheme: Scheme, argnums: int | Sequence[int] = 0,
                has_aux: bool = False) -> Callable:
    """Like `jax.grad`, but only for what `scheme` trains, and without the frozen work.

    The gradient has the parameters' tree structure: Frozen leaves are `None`, Channels
    leaves hold the kept slice only, Full leaves are whole. It equals `jax.grad(fun)`
    sliced the same way (see `trainable`). Frozen weights stored by `pockjax.lowbit`
    (`Quantized` nodes) are dequantized at each use (`lowbit.at_use`), so `fun` is
    written for float parameters. Works inside and outside `jax.jit`; the
    returned function has `.explain(*args)` describing the rewrite and `.trace(*args)`
    giving the gradient program. Non-array leaves of the other arguments are static
    (each new value traces again) and must be hashable.

    Args:
      fun: the function to differentiate; it returns a scalar, or `(scalar, aux)`
        with `has_aux=True`.
      scheme: the `Scheme` saying which parameters train.
      argnums: the position of the parameters among `fun`'s positional arguments
        (default 0), or a tuple of positions: the gradient is then a tuple with one
        tree per position, and scheme paths start with the index in that tuple
        (`0/...`, `1/...`).
      has_aux: whether `fun` returns `(value, aux)`; the gradient function then
        returns `(gradient, aux)`.

    Returns:
      A function with `fun`'s signature returning the gradient in the trainable view
        (`(gradient, aux)` with `has_aux`).

    Raises:
      SchemeError: `scheme` is not a `Scheme`.
      TypeError: `argnums` is not an int or a tuple of ints. When called, the returned
        function raises `TypeError` for an `argnums` position out of range, an
        unhashable static argument or a non-scalar value, and `TracedValueError`
        when `fun` asks for the concrete value of a traced array.

    Examples:
      >>> import jax.numpy as jnp, pockjax as pj
      >>> loss = lambda p, x: jnp.sum((x @ p["w"]) ** 2)
      >>> g = pj.sparse_grad(loss, pj.Scheme({"w": pj.Channels(count=1, axis="out")}))
      >>> g({"w": jnp.ones((3, 4))}, jnp.ones((2, 3)))["w"].shape
      (3, 1)
    """
    return SparseGradFn(fun, scheme, argnums, has_aux, with_value=False)


def sparse_value_and_grad(fun: Callable, scheme: Scheme, argnums: int | Sequence[int] = 0,
                          has_aux: bool = False) -> Callable:
    """Like `jax.value_and_grad`, with the gradient of `sparse_grad`.

    Args:
      fun: the function to differentiate; it returns a scalar, or `(scalar, aux)`
        with `has_aux=True`.
      scheme: the `Scheme` saying which parameters train.
      argnums: the position of the parameters among `fun`'s positional arguments
        (default 0), or a tuple of positions (see `sparse_grad`).
      has_aux: whether `fun` returns `(value, aux)`.

    Returns:
      A function with `fun`'s signature returning `(value, gradient)`, or
        `((value, aux), gradient)` with `has_aux`; the gradient is in the trainable
        view as for `sparse_grad`.

    Raises:
      SchemeError: `scheme` is not a `Scheme`.
      TypeError: `argnums` is not an int or a tuple of ints (and, from the returned
        function, as for `sparse_grad`).
    """
    return SparseGradFn(fun, scheme, argnums, has_aux, with_value=True)
