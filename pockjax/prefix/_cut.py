"""Where a training step splits at its frozen prefix: `find_cut` traces the loss
function and finds the *cut*, the values that depend only on the batch's examples and on
frozen parameters and that the trained part reads; `PrefixSplit` holds the split and
runs its two halves (`prefix`, `suffix_loss`). `pockjax.prefix.PrefixCachedTrainer`
caches the cut values it computes; the public names are re-exported from
`pockjax.prefix`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from pockjax import lowbit
from pockjax._src.jaxpr import as_source, avals, bind, describe_source, inline_calls, is_var
from pockjax.scheme import Frozen, Scheme
from pockjax.transforms.sparse_grad import is_dynamic
from pockjax.view import resolved_decisions

# What a value depends on, as bits: examples of the batch, other batch inputs (read
# whole by every example), trained parameters.
_EXAMPLE, _WHOLE, _TRAINED = 1, 2, 4


class PrefixCacheError(ValueError):
    """Raised when a step cannot be split at a frozen prefix, or a cut value would mix
    examples of the batch."""


@dataclasses.dataclass(frozen=True)
class CutValue:
    """One cached value of the cut.

    Attributes:
      shape: its shape per example (without the example axis).
      dtype: its dtype.
      source: the user's source line that computes it.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    source: str

    @property
    def nbytes(self) -> int:
        """Bytes per example."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class PrefixSplit:
    """A loss function split at its cut for one batch signature (see `find_cut`).

    The loss is traced for the batch's shapes, and again with one more example to tell
    which values carry the example axis. The cut is the set of values the trained part
    reads that depend on per-example batch inputs and frozen parameters only.
    Values the suffix can recompute in a few cheap equations from the rest of the cut
    are left out of it.

    Args:
      loss_fn: `loss_fn(params, batch)`, returning the loss (and aux with `has_aux`).
      params: the parameter pytree (arrays or `jax.ShapeDtypeStruct`s).
      batch: a batch of the signature to split for; its first batch array with an
        axis gives the example count.
      scheme: a `Scheme`, or decisions already resolved for `params`
        (`Scheme.resolve`), saying which leaves train.
      has_aux: whether `loss_fn` returns `(loss, aux)`.

    Attributes:
      examples: the batch's example count.
      jaxpr: the traced loss function (calls inlined).
      consts: the jaxpr's constants.
      has_aux: as given.
      cut_vars: the jaxpr variables of the cut, in computation order.
      values: a `CutValue` per cut variable.

    Raises:
      PrefixCacheError: the batch has no arrays, no batch array has an example axis,
        or no parameter trains.
      SchemeError: `scheme` does not fit `params`.
    """

    def __init__(self, loss_fn, params, batch, scheme, has_aux: bool):
        p_leaves, self._p_def = jax.tree_util.tree_flatten(params)
        b_leaves, self._b_def = jax.tree_util.tree_flatten(batch)
        self._static = list(b_leaves)
        self._dyn = [i for i, x in enumerate(b_leaves) if is_dynamic(x)]
        if not self._dyn:
            raise PrefixCacheError("the batch has no arrays: nothing to cache per example")
        shaped = [b_leaves[i] for i in self._dyn if np.ndim(b_leaves[i]) >= 1]
        if not shaped:
            raise PrefixCacheError("no batch array has an example axis (all are scalars)")
        self.examples = int(np.shape(shaped[0])[0])
        out_def = []

        stored = lowbit.at_use(loss_fn)  # weights stored in low precision: read at each use

        def flat(*args):
            ps, bs = args[:len(p_leaves)], list(self._static)
            for j, i in enumerate(self._dyn):
                bs[i] = args[len(p_leaves) + j]
            out = stored(jax.tree_util.tree_unflatten(self._p_def, list(ps)),
                          jax.tree_util.tree_unflatten(self._b_def, bs))
            leaves, tree = jax.tree_util.tree_flatten(out)
            out_def.append(tree)
            return leaves

        n = self.examples
        per_example = [np.ndim(b_leaves[i]) >= 1 and np.shape(b_leaves[i])[0] == n
                       for i in self._dyn]

        def trace(examples):
            shapes = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in p_leaves]
            for i, each in zip(self._dyn, per_example):
                shape = np.shape(b_leaves[i])
                shape = (examples, *shape[1:]) if each else shape
                shapes.append(jax.ShapeDtypeStruct(shape, b_leaves[i].dtype))
            closed = jax.make_jaxpr(flat)(*shapes)
            return inline_calls(closed.jaxpr, closed.consts)

        closed = trace(n)
        self._out_def = out_def[0]
        self.jaxpr, self.consts = closed.jaxpr, closed.consts
        # The same function traced for one example more: a value is per example only if
        # its first axis grows with the batch (not a weight that happens to have n rows).
        try:
            self._other = trace(n + 1).jaxpr
        except Exception:  # a loss written for one batch size: nothing is known per example
            self._other = None
        self.has_aux = has_aux
        decisions = resolved_decisions(params, scheme)
        masks = [0 if isinstance(d, Frozen) else _TRAINED for d in decisions]
        masks += [_EXAMPLE if each else _WHOLE for each in per_example]
        self._find(masks)

    def _grows(self, eqn_index: int, out_index: int) -> bool:
        """Whether an equation's output has the example axis first in both traces."""
        other = self._other
        if other is None or len(other.eqns) != len(self.jaxpr.eqns):
            return False
        e, f = self.jaxpr.eqns[eqn_index], other.eqns[eqn_index]
        if e.primitive is not f.primitive or len(e.outvars) != len(f.outvars):
            return False
        a, b = tuple(e.outvars[out_index].aval.shape), tuple(f.outvars[out_index].aval.shape)
        return a[:1] == (self.examples,) and b == (self.examples + 1, *a[1:])

    # -- the cut -----------------------------------------------------------------

    def _find(self, in_masks):
        jaxpr = self.jaxpr
        mask = dict(zip(jaxpr.invars, in_masks))
        read = lambda v: mask.get(v, 0) if is_var(v) else 0
        producer = {}
        readers_trained: set = set()
        for i, e in enumerate(jaxpr.eqns):
            m = 0
            for v in e.invars:
                m |= read(v)
            for v in e.outvars:
                if is_var(v):
                    mask[v], producer[v] = m, i
            if m & _TRAINED:
                readers_trained.update(v for v in e.invars if is_var(v))
        if not any(m & _TRAINED for m in in_masks):
            raise PrefixCacheError("no parameter trains: there is no suffix to split off")
        inputs = set(jaxpr.invars)
        batchy = lambda v: is_var(v) and v not in inputs and read(v) & (_EXAMPLE | _WHOLE) \
            and not read(v) & _TRAINED
        frontier = [v for v in readers_trained if batchy(v)]
        frontier += [v for v in jaxpr.outvars if batchy(v)]
        cut, seen = [], set()
        while frontier:
            v = frontier.pop()
            if v in seen:
                continue
            seen.add(v)
            i = producer[v]
            if read(v) & _EXAMPLE and self._grows(i, jaxpr.eqns[i].outvars.index(v)):
                cut.append(v)
            else:  # recomputed by the suffix from what its producer reads
                frontier += [u for u in jaxpr.eqns[producer[v]].invars if batchy(u)]
        cut = self._recompute_cheap(cut, producer, read)
        cut.sort(key=lambda v: producer[v])
        self.cut_vars = cut
        self.values = [CutValue(tuple(v.aval.shape[1:]), np.dtype(v.aval.dtype),
                                describe_source(jaxpr.eqns[producer[v]])) for v in cut]
        self._prefix_eqns = _needed(jaxpr, cut, stop=inputs)
        self._suffix_eqns = _needed(jaxpr, list(jaxpr.outvars), stop=inputs | set(cut))

    def _recompute_cheap(self, cut, producer, read) -> list:
        """Leave out of the cut each value the suffix can compute from the rest of it
        in a few cheap equations (elementwise work, reductions over an example's own
        axes): a norm's normalised input beside the residual stream it comes from, a
        mask's slice beside the batch. Fewer bytes per example to store and read."""
        eqns, inputs = self.jaxpr.eqns, set(self.jaxpr.invars)
        kept = set(cut)
        for v in sorted(cut, key=lambda v: -producer[v]):
            path, todo, ok = set(), [v], True
            while todo and ok:
                u = todo.pop()
                if not is_var(u) or u in inputs or (u in kept and u is not v) or \
                        not read(u) & (_EXAMPLE | _WHOLE):
                    continue  # available to the suffix, or computed from weights alone
                i = producer[u]
                if i in path:
                    continue
                path.add(i)
                e = eqns[i]
                ok = len(path) <= _CHEAP_EQNS and e.primitive.name not in _COSTLY and \
                    not any(_has_jaxpr(x) for x in e.params.values())
                todo += list(e.invars)
            if ok:
                kept.discard(v)
        return [v for v in cut if v in kept]

    @property
    def bytes_per_example(self) -> int:
        """Bytes of cut values per example (0 for an empty cut)."""
        return sum(v.nbytes for v in self.values)

    def _run(self, eqns, env, targets):
        read = lambda v: v.val if not is_var(v) else env[v]
        for i in eqns:
            e = self.jaxpr.eqns[i]
            with as_source(e):
                outs = bind(e, [read(v) for v in e.invars])
            outs = outs if e.primitive.multiple_results else [outs]
            for v, o in zip(e.outvars, outs):
                if is_var(v):
                    env[v] = o
        return [read(v) for v in targets]

    def _inputs(self, params, batch) -> dict:
        p_leaves = jax.tree_util.tree_leaves(params)
        b_leaves = jax.tree_util.tree_leaves(batch)
        args = list(self.consts) + list(p_leaves) + [b_leaves[i] for i in self._dyn]
        return dict(zip(list(self.jaxpr.constvars) + list(self.jaxpr.invars), args))

    def prefix(self, params, batch) -> list:
        """The cut values of `batch`.

        Args:
          params: the parameters (same structure as at the split).
          batch: a batch of the split's signature.

        Returns:
          A list of arrays in `cut_vars` order, each with the example axis first.
        """
        return self._run(self._prefix_eqns, self._inputs(params, batch), self.cut_vars)

    def suffix_loss(self, params, sbatch):
        """The loss function's output from the batch and its cut values: the same loss
        (and aux) as `loss_fn(params, batch)`, without computing the prefix.

        Args:
          params: the parameters.
          sbatch: `{"batch": batch, "cut": values}`, `values` as `prefix` returns them.

        Returns:
          What `loss_fn` returns.
        """
        env = self._inputs(params, sbatch["batch"])
        env.update(zip(self.cut_vars, sbatch["cut"]))
        outs = self._run(self._suffix_eqns, env, self.jaxpr.outvars)
        return jax.tree_util.tree_unflatten(self._out_def, outs)

    def prefix_jaxpr(self):
        """The prefix as a closed jaxpr.

        Returns:
          A closed jaxpr (as `jax.make_jaxpr` gives it) over the parameter leaves
          followed by the batch's array leaves, giving the cut values.
        """
        n = len(self.jaxpr.invars)
        return jax.make_jaxpr(lambda *a: self._run(
            self._prefix_eqns, dict(zip(list(self.jaxpr.constvars) + list(self.jaxpr.invars),
                                        list(self.consts) + list(a))), self.cut_vars))(
            *avals(self.jaxpr.invars[:n]))

    def describe(self) -> str:
        """The cut in words: its values, their dtypes and shapes, bytes per example and
        the source line of each.

        Returns:
          The multi-line description.
        """
        lines = [f"cut: {len(self.values)} value(s), {self.bytes_per_example:,} bytes per "
                 f"example (batch of {self.examples})"]
        lines += [f"  {v.dtype}{list(v.shape)} from {v.source}" for v in self.values]
        return "\n".join(lines)


# A cut value the suffix recomputes instead of reading: at most this many equations,
# none of them a matrix product, convolution or nested program.
_CHEAP_EQNS = 32
_COSTLY = {"dot_general", "conv_general_dilated", "ragged_dot_general"}


def _has_jaxpr(x) -> bool:
    return hasattr(x, "eqns") or hasattr(x, "jaxpr") or (
        isinstance(x, (tuple, list)) and any(_has_jaxpr(y) for y in x))


def _needed(jaxpr, targets, stop) -> list[int]:
    """The equations (in order) that `targets` need, not looking past `stop`."""
    want = {v for v in targets if is_var(v) and v not in stop}
    out = []
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        e = jaxpr.eqns[i]
        if any(is_var(v) and v in want for v in e.outvars):
            out.append(i)
            want.update(v for v in e.invars if is_var(v) and v not in stop)
    return out[::-1]


def find_cut(loss_fn: Callable, params, batch, scheme: Scheme, *, has_aux: bool = False) -> PrefixSplit:
    """Split `loss_fn(params, batch)` at its frozen prefix for this batch's shapes.

    A split whose cut is empty (the trained part reads the batch directly) is valid and
    saves nothing (`bytes_per_example == 0`, no prefix equations).

    Args:
      loss_fn: `loss_fn(params, batch)`.
      params: the parameter pytree.
      batch: a batch of the shapes to split for.
      scheme: the `Scheme` (or resolved decisions) saying which parameters train.
      has_aux: whether `loss_fn` returns `(loss, aux)`; default False.

    Returns:
      The `PrefixSplit`.

    Raises:
      PrefixCacheError: nothing trains, or the batch has no arrays or none with an
        example axis.
    """
    return PrefixSplit(loss_fn, params, batch, scheme, has_aux)
