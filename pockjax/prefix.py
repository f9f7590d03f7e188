"""The frozen prefix of a training step, computed once per example and cached.

With the last blocks of a model trained, most of a step is the forward pass of the
frozen blocks below them, and it gives the same values for the same example in every
epoch. `find_cut` finds, in the loss function's jaxpr, the values that depend only on
the batch and on frozen parameters and that the trained part reads: the *cut* (for a
LLaMA with its last k blocks trained, the residual stream entering block k). It splits
the step in two:

- the prefix, `(params, batch) -> cut values`, evaluated for examples not seen before;
- the suffix, a loss function of `(params, {"batch": batch, "cut": values})` that
  gives the same loss and gradients as the whole one, trained by the same
  `SparseTrainer` settings.

`PrefixCachedTrainer` runs a trainer's steps through the split, keeping each example's
cut values (keyed by the caller's example ids, or a hash of the example's contents) in
RAM under a byte budget and in memory-mapped files past it:

    cached = pj.PrefixCachedTrainer(trainer, budget_bytes=2**30)
    for epoch in range(3):
        for ids in batches:
            state, metrics = cached(state, batch_of(ids), keys=ids)

Only values with the batch's example axis first are cached, and only when computing
them for one example reads no other example: the first batch of each shape is checked
(example 0 replaced by example 1 must leave the other rows' cut values unchanged), and
values computed from whole-batch inputs (a batch-wide count, a random key) are
recomputed by the suffix instead. Batch inputs without the example axis (a model's
batch statistics) are part of every key. The cache belongs to one model's frozen
weights: a new model, scheme or data set needs a new `PrefixCachedTrainer`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
from typing import Any, Callable, Sequence

import jax
import numpy as np

from pockjax._jaxpr import as_source, avals, bind, describe_source, inline_calls, is_var
from pockjax.scheme import Frozen, Scheme
from pockjax.transforms.sparse_grad import is_dynamic, resolved_decisions

__all__ = ["find_cut", "PrefixSplit", "PrefixCache", "PrefixCachedTrainer", "PrefixCacheError",
           "PrefixReport", "default_budget", "example_keys"]

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

        def flat(*args):
            ps, bs = args[:len(p_leaves)], list(self._static)
            for j, i in enumerate(self._dyn):
                bs[i] = args[len(p_leaves) + j]
            out = loss_fn(jax.tree_util.tree_unflatten(self._p_def, list(ps)),
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


# --------------------------------------------------------------------------- storage


class PrefixCache:
    """Cut values per example key: in RAM up to `budget_bytes`, then in memory-mapped
    files under `spill_dir`. `len(cache)` is the number of keys held, `key in cache`
    whether one is.

    Args:
      values: the `CutValue`s each key holds one row of (`PrefixSplit.values`).
      budget_bytes: RAM for rows; default 1 GiB.
      spill_dir: the folder for rows past the budget; None (the default) makes a
        temporary folder when first needed, removed by `close()`.
      dtype: "float32" (the default: values kept as they are) or "bfloat16" (floating
        values wider than 2 bytes stored in bfloat16: half the bytes; the suffix then
        sees rounded inputs, so results differ from the uncached run).
      chunk: rows per memory-mapped file; default 256.

    Attributes:
      values: the `CutValue`s, as a list.
      row_bytes: stored bytes per key.
      budget_bytes: the RAM budget.
      hits: lookups found in the cache (counted by `PrefixCachedTrainer`).
      misses: lookups computed and added (counted by `PrefixCachedTrainer`).

    Raises:
      ValueError: `dtype` is not "float32" or "bfloat16".
    """

    def __init__(self, values: Sequence[CutValue], budget_bytes: int = 2**30,
                 spill_dir: str | None = None, dtype: str = "float32", chunk: int = 256):
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        import ml_dtypes

        self.values = list(values)
        narrow = lambda d: np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" and \
            np.issubdtype(d, np.floating) and np.dtype(d).itemsize > 2 else np.dtype(d)
        self._stored = [narrow(v.dtype) for v in self.values]
        self.row_bytes = sum(int(np.prod(v.shape, dtype=np.int64)) * d.itemsize
                             for v, d in zip(self.values, self._stored))
        self.budget_bytes = int(budget_bytes)
        self._ram: dict = {}
        self._disk: dict = {}
        self._chunks: list[list[np.memmap]] = []
        self._chunk = chunk
        self._spill_dir, self._own_dir = spill_dir, spill_dir is None
        self.hits = self.misses = 0

    def __len__(self) -> int:
        """The number of keys held, in RAM and on disk."""
        return len(self._ram) + len(self._disk)

    @property
    def ram_bytes(self) -> int:
        """Bytes of rows held in RAM."""
        return len(self._ram) * self.row_bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of rows written to the spill files."""
        return len(self._disk) * self.row_bytes

    def __contains__(self, key) -> bool:
        """Whether `key` has a row."""
        return key in self._ram or key in self._disk

    def put(self, key, rows: Sequence[np.ndarray]) -> None:
        """Store one example's rows under `key`, in RAM while the budget allows, else in
        the spill files. A key already held is left as it is.

        Args:
          key: a hashable example key.
          rows: one array per cut value, without the example axis (cast to the stored
            dtype).
        """
        rows = [np.asarray(r).astype(d, copy=False) for r, d in zip(rows, self._stored)]
        if key in self:
            return
        if (len(self._ram) + 1) * self.row_bytes <= self.budget_bytes:
            self._ram[key] = [r.copy() for r in rows]
            return
        n = len(self._disk)
        c, r = divmod(n, self._chunk)
        if c == len(self._chunks):
            self._chunks.append(self._new_chunk(c))
        for m, row in zip(self._chunks[c], rows):
            m[r] = row
        self._disk[key] = (c, r)

    def _new_chunk(self, c: int) -> list[np.memmap]:
        if self._spill_dir is None:
            self._spill_dir = tempfile.mkdtemp(prefix="pockjax-prefix-")
        os.makedirs(self._spill_dir, exist_ok=True)
        return [np.memmap(os.path.join(self._spill_dir, f"chunk{c}-value{i}.bin"), dtype=d,
                          mode="w+", shape=(self._chunk, *v.shape))
                for i, (v, d) in enumerate(zip(self.values, self._stored))]

    def get(self, keys: Sequence) -> list[np.ndarray]:
        """The stacked rows of `keys`, in the values' own dtypes.

        Args:
          keys: example keys, all present in the cache.

        Returns:
          One array per cut value, `[len(keys), *shape]`.
        """
        rows = []
        for k in keys:
            if k in self._ram:
                rows.append(self._ram[k])
            else:
                c, r = self._disk[k]
                rows.append([m[r] for m in self._chunks[c]])
        return [np.stack([row[i] for row in rows]).astype(v.dtype, copy=False)
                for i, v in enumerate(self.values)]

    def close(self) -> None:
        """Drop every row and remove the spill files this cache made."""
        self._ram.clear()
        self._disk.clear()
        self._chunks.clear()
        if self._own_dir and self._spill_dir is not None:
            shutil.rmtree(self._spill_dir, ignore_errors=True)
            self._spill_dir = None


def _per_example(x, examples: int) -> bool:
    return is_dynamic(x) and np.ndim(x) >= 1 and np.shape(x)[0] == examples


def _whole_digest(batch, examples: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for x in jax.tree_util.tree_leaves(batch):
        if is_dynamic(x) and not _per_example(x, examples):
            x = np.asarray(x)
            h.update(str((x.shape, x.dtype)).encode() + x.tobytes())
    return h.digest()


def example_keys(batch, examples: int) -> list[bytes]:
    """A content hash per example: the example's rows of every batch array with the
    example axis first, and every other batch leaf whole.

    Args:
      batch: the batch pytree.
      examples: the example count (the leading axis length that marks a per-example
        array).

    Returns:
      `examples` 16-byte BLAKE2b digests, in example order.
    """
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(batch) if is_dynamic(x)]
    whole = hashlib.blake2b(digest_size=16)
    for x in leaves:
        if not (x.ndim >= 1 and x.shape[0] == examples):
            whole.update(str((x.shape, x.dtype)).encode() + x.tobytes())
    keys = []
    for i in range(examples):
        h = whole.copy()
        for x in leaves:
            if x.ndim >= 1 and x.shape[0] == examples:
                h.update(str((x.shape[1:], x.dtype)).encode() + np.ascontiguousarray(x[i]).tobytes())
        keys.append(h.digest())
    return keys


# --------------------------------------------------------------------------- the trainer


# "auto" turns the cache on when the prefix's forward pass is at least this share of the
# step's FLOPs and costs at least this many FLOPs per byte of cut values read back.
AUTO_MIN_SHARE = 0.1
AUTO_MIN_FLOPS_PER_BYTE = 16.0


def default_budget() -> int:
    """RAM for cut values when none is given: a quarter of the memory available now, at
    most 4 GiB (rows past it go to disk).

    Returns:
      The budget in bytes, from `/proc/meminfo`'s MemAvailable; 1 GiB where that cannot
      be read.
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return min(4 * 2**30, int(line.split()[1]) * 1024 // 4)
    except OSError:
        pass
    return 2**30


@dataclasses.dataclass(frozen=True)
class PrefixReport:
    """What caching the prefix saves for one batch signature; `str()` says it in a line.

    Attributes:
      values: the cut's `CutValue`s (empty where the step was not split).
      examples: the batch's example count.
      prefix_flops: FLOPs of the prefix's forward pass, whole batch.
      step_flops: FLOPs of the uncached training step.
      suffix_flops: FLOPs of the cached training step (the suffix's).
      on: whether steps of this signature use the cache.
      why: the reason for `on` ("asked for", "auto", or why the cache is off).
    """

    values: tuple[CutValue, ...]
    examples: int
    prefix_flops: float      # the prefix's forward pass, whole batch
    step_flops: float        # the uncached training step
    suffix_flops: float      # the cached training step (the suffix's)
    on: bool
    why: str

    @property
    def bytes_per_example(self) -> int:
        """Bytes of cut values per example."""
        return sum(v.nbytes for v in self.values)

    @property
    def share(self) -> float:
        """The prefix's share of the uncached step's FLOPs: what a cached step saves."""
        return self.prefix_flops / self.step_flops if self.step_flops else 0.0

    @property
    def bound(self) -> float:
        """A cached step's FLOPs over the uncached step's: the best speed-up's inverse."""
        return self.suffix_flops / self.step_flops if self.step_flops else 1.0

    def __str__(self) -> str:
        if not self.values:
            return f"prefix cache {'on' if self.on else 'off'} ({self.why})"
        cut = ", ".join(f"{v.dtype}{list(v.shape)}" for v in self.values)
        return (f"prefix cache {'on' if self.on else 'off'} ({self.why}): the cut is {cut}, "
                f"{self.bytes_per_example:,} bytes per example; the frozen prefix's forward "
                f"pass is {self.share:.0%} of the step's FLOPs, a cached step does "
                f"{self.bound:.0%} of them ({self.suffix_flops / 1e9:.3g} of "
                f"{self.step_flops / 1e9:.3g} GFLOP per batch)")


class PrefixCachedTrainer:
    """`trainer`'s steps with the frozen prefix computed once per example (see the
    module docstring). The state is the trainer's own (`trainer.init(params)`): cached
    and uncached steps can be mixed on it.

    Args:
      trainer: a `pockjax.SparseTrainer`, or a `ScheduledTrainer` (from `sparse_train`
        with a schedule: the cut then lies below every parameter any of its schemes
        trains).
      budget_bytes: RAM for cut values; None (the default) uses `default_budget()`.
        Rows past it are written to memory-mapped files in `spill_dir`.
      spill_dir: the folder for rows past the budget; None (the default): a temporary
        folder, removed by `close()`.
      dtype: "float32" (the default; exact: the same results as the uncached step) or
        "bfloat16" (half the bytes; results move by the rounding of the cut values).
      check: probe the first batch of each shape for values that mix examples; default
        True.
      auto: per batch shape, cache only where `report` finds it worthwhile (the prefix
        at least `AUTO_MIN_SHARE` of the step's FLOPs, `AUTO_MIN_FLOPS_PER_BYTE` per
        byte of cut values) and the step can be split; otherwise run `trainer` as is.
        Without `auto` (the default), a step that cannot be split raises.

    Attributes:
      trainer: the wrapped trainer.
      budget_bytes: the RAM budget of each batch signature's cache.
      reports: batch signature -> its `PrefixReport`.

    Raises:
      TypeError: `trainer` is not a `SparseTrainer` or `ScheduledTrainer`.
      ValueError: `dtype` is not "float32" or "bfloat16".
    """

    def __init__(self, trainer, *, budget_bytes: int | None = None, spill_dir: str | None = None,
                 dtype: str = "float32", check: bool = True, auto: bool = False):
        from pockjax.schedule import ScheduledTrainer
        from pockjax.train import SparseTrainer

        if not isinstance(trainer, (SparseTrainer, ScheduledTrainer)):
            raise TypeError(f"the prefix cache needs a pockjax.SparseTrainer or "
                            f"ScheduledTrainer (from sparse_train), got {type(trainer).__name__}")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        self.trainer = trainer
        self.budget_bytes = default_budget() if budget_bytes is None else int(budget_bytes)
        self.spill_dir, self.dtype, self.check, self.auto = spill_dir, dtype, check, auto
        self._splits: dict = {}
        self.reports: dict = {}

    def _signature(self, params, batch):
        leaves, tree = jax.tree_util.tree_flatten((params, batch))
        return tree, tuple((np.shape(x), np.dtype(x.dtype)) if is_dynamic(x) else ("static", x)
                           for x in leaves)

    def split(self, state, batch) -> tuple[PrefixSplit, Any, PrefixCache] | None:
        """The split of this batch's signature, made (and reported) on first use.

        Args:
          state: the `TrainState`.
          batch: a batch of the signature.

        Returns:
          `(split, suffix trainer, cache)`: the `PrefixSplit`, the trainer of its
          suffix loss and the signature's `PrefixCache`; None where `auto` runs the
          trainer as is.

        Raises:
          PrefixCacheError: without `auto`, the step cannot be split or (with `check`)
            a cut value mixes examples. Without `auto`, other errors from tracing the
            loss propagate as they are.
        """
        key = self._signature(state.params, batch)
        if key not in self._splits:
            self._splits[key] = self._make(state, batch, key)
        entry = self._splits[key]
        return None if entry is None else entry[:1] + entry[2:]

    def _scheduled(self) -> bool:
        from pockjax.schedule import ScheduledTrainer
        return isinstance(self.trainer, ScheduledTrainer)

    def _decisions(self, params):
        """What trains, for the cut: the trainer's scheme, or for a schedule every leaf
        that any of its schemes trains (the cache then holds below the lowest of them)."""
        if not self._scheduled():
            return self.trainer.scheme
        from pockjax.scheme import Full

        each = [resolved_decisions(params, s) for s in self.trainer.schedule.schemes]
        union = [Full() if any(not isinstance(d[i], Frozen) for d in each) else Frozen()
                 for i in range(len(each[0]))]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), union)

    def _make(self, state, batch, key):
        t = self.trainer.base if self._scheduled() else self.trainer
        try:
            split = find_cut(t.loss_fn, state.params, batch, self._decisions(state.params),
                             has_aux=t.has_aux)
            prefix = jax.jit(split.prefix)
            if self.check and split.values and split.examples > 1:
                _check_per_example(split, prefix, state.params, batch)
        except Exception as e:  # noqa: BLE001 - auto falls back to the uncached step
            if not self.auto:
                raise
            why = str(e) if isinstance(e, PrefixCacheError) else \
                f"the step could not be split ({type(e).__name__}: {str(e)[:300]})"
            self.reports[key] = PrefixReport((), 0, 0.0, 0.0, 0.0, False, why)
            return None
        report = self._report(split, state, batch)
        self.reports[key] = report
        if not report.on:
            return None
        if self._scheduled():
            from pockjax.schedule import ScheduledTrainer
            suffix = ScheduledTrainer(t.replace(loss_fn=split.suffix_loss), self.trainer.schedule)
        else:
            suffix = t.replace(loss_fn=split.suffix_loss)
        cache = PrefixCache(split.values, self.budget_bytes, self.spill_dir, self.dtype)
        return split, prefix, suffix, cache

    def _report(self, split: PrefixSplit, state, batch) -> PrefixReport:
        from pockjax.flops import count_flops

        # A schedule's figures are those of the scheme `state` holds.
        trainer = self.trainer.trainer_of(state) if self._scheduled() else self.trainer
        prefix_flops = count_flops(split.prefix_jaxpr()) if split.values else 0.0
        step_flops = count_flops(trainer.trace(state, batch))
        cut = [jax.ShapeDtypeStruct((split.examples, *v.shape), v.dtype) for v in split.values]
        suffix_flops = count_flops(trainer.replace(loss_fn=split.suffix_loss).trace(
            state, {"batch": batch, "cut": cut}))
        share = prefix_flops / step_flops if step_flops else 0.0
        per_byte = prefix_flops / max(split.examples * split.bytes_per_example, 1)
        if not self.auto:
            on, why = True, "asked for"
        elif not split.values:
            on, why = False, "no frozen prefix: the trained part reads the batch itself"
        elif share < AUTO_MIN_SHARE:
            on, why = False, f"the prefix is under {AUTO_MIN_SHARE:.0%} of the step"
        elif per_byte < AUTO_MIN_FLOPS_PER_BYTE:
            on, why = False, (f"{per_byte:.1f} FLOPs per cached byte: reading the values "
                              f"back costs about what computing them does")
        else:
            on, why = True, "auto"
        return PrefixReport(tuple(split.values), split.examples, prefix_flops, step_flops,
                            suffix_flops, on, why)

    def report(self, state, batch) -> PrefixReport:
        """Whether this batch shape's steps use the cache, its cut and what it saves.

        Args:
          state: the `TrainState`.
          batch: a batch of the shape.

        Returns:
          The signature's `PrefixReport` (of the scheme `state` holds, for a schedule).

        Raises:
          PrefixCacheError: as `split`.
        """
        self.split(state, batch)
        return self.reports[self._signature(state.params, batch)]

    def __call__(self, state, batch, keys: Sequence | None = None):
        """One training step, through the cache where this batch shape uses it.

        Examples whose keys are not in the cache get their cut values computed by the
        prefix and stored; the suffix's step then runs on the cached values. Where the
        shape does not use the cache (`auto`), the trainer's own step runs.

        Args:
          state: the `TrainState` (the trainer's own: `trainer.init(params)`).
          batch: the step's batch.
          keys: one hashable name per example; the batch's other inputs (arrays without
            the example axis) are added to each. None (the default): `example_keys`, a
            hash of each example's contents.

        Returns:
          `(new state, metrics)`, as the trainer's step returns them.

        Raises:
          ValueError: `keys` does not hold one key per example.
          PrefixCacheError: as `split`.
        """
        entry = self._splits.get(self._signature(state.params, batch), False)
        if entry is False:
            self.split(state, batch)
            entry = self._splits[self._signature(state.params, batch)]
        if entry is None:
            return self.trainer(state, batch)
        split, prefix, suffix, cache = entry
        n = split.examples
        if keys is None:
            keys = example_keys(batch, n)
        elif len(keys) != n:
            raise ValueError(f"keys: expected one per example ({n}), got {len(keys)}")
        else:  # the batch's other inputs (a model's batch statistics) are part of the key
            whole = _whole_digest(batch, n)
            keys = [(k, whole) for k in keys]
        if split.values:
            missing = [i for i, k in enumerate(keys) if k not in cache]
            if missing:
                values = jax.device_get(prefix(state.params, batch))
                for i in missing:
                    cache.put(keys[i], [v[i] for v in values])
                cache.misses += len(missing)
            cache.hits += n - len(missing)
            cut = cache.get(keys)
        else:
            cut = []
        return suffix(state, {"batch": batch, "cut": cut})

    def export(self, state, batch, target: str = "host-cpu", out_dir: str = "export",
               gpu: str | None = None, extra_flags=(), progress: bool = False):
        """The cached step compiled for an IREE target (`pockjax.export`): the artifact's
        `train_step` is the suffix, its batch `{"batch": batch, "cut": values}`, and its
        `prefix` function gives a batch's cut values. On the device, a session's
        `prefix(batch)` runs for examples not seen before and `step(...)` for all:

            values = cache.get(key) or sess.prefix(batch)
            sess.step({"batch": batch, "cut": values})

        Args:
          state: the `TrainState`.
          batch: a batch of the shape to compile for.
          target: the IREE target's name (`pockjax.export.TARGETS`); default "host-cpu".
          out_dir: the artifact directory to write; default "export".
          gpu: the GPU family, for GPU targets; None for the target's default.
          extra_flags: more compiler flags (`--iree-...=value`).
          progress: name each stage on stderr as it starts; default False.

        Returns:
          The `pockjax.export.Artifact`.

        Raises:
          PrefixCacheError: the trainer is a `ScheduledTrainer`, or this batch shape has
            no cached step (`auto` found it not worthwhile), or as `split`.
        """
        from pockjax.export.artifact import export

        if self._scheduled():
            raise PrefixCacheError("a scheme schedule's steps are not exported; export "
                                   "one scheme's trainer")
        if self.split(state, batch) is None:
            raise PrefixCacheError(f"no cached step for this batch: "
                                   f"{self.report(state, batch)}")
        split, prefix, suffix, _ = self._splits[self._signature(state.params, batch)]
        cut = [np.asarray(v) for v in jax.device_get(prefix(state.params, batch))]
        return export(suffix, state, {"batch": batch, "cut": cut}, target=target,
                      out_dir=out_dir, gpu=gpu, extra_flags=extra_flags, progress=progress,
                      prefix=split.prefix)

    def caches(self) -> list[PrefixCache]:
        """The caches of the batch signatures that use one.

        Returns:
          A list of `PrefixCache`s.
        """
        return [e[3] for e in self._splits.values() if e is not None]

    def close(self) -> None:
        """Drop the cached values and remove their spill files."""
        for cache in self.caches():
            cache.close()
        self._splits.clear()


def _check_per_example(split: PrefixSplit, prefix, params, batch) -> None:
    """Each example's cut values must not read other examples. Two probes of the first
    batch: example 0 replaced by example 1 must leave the rows of examples 1.. as they
    were (catches batch statistics: sums and means over examples), and the examples
    rotated by one must rotate the rows (catches values read from a neighbour)."""
    n = split.examples
    each = lambda f: jax.tree_util.tree_map(
        lambda x: f(np.asarray(x)) if is_dynamic(x) and np.ndim(x) >= 1 and np.shape(x)[0] == n
        else x, batch)
    base = jax.device_get(prefix(params, batch))
    replaced = jax.device_get(prefix(params, each(lambda x: np.concatenate([x[1:2], x[1:]]))))
    rotated = jax.device_get(prefix(params, each(lambda x: np.roll(x, 1, axis=0))))
    for value, x, y, z in zip(split.values, base, replaced, rotated):
        x, y, z = np.asarray(x, np.float64), np.asarray(y, np.float64), np.asarray(z, np.float64)
        scale = 1e-5 * (np.max(np.abs(x)) if x.size else 0.0) + 1e-30
        if np.max(np.abs(x[1:] - y[1:]), initial=0.0) > scale or \
                np.max(np.abs(np.roll(x, 1, axis=0) - z), initial=0.0) > scale:
            raise PrefixCacheError(
                f"the value computed at {value.source} ({value.dtype}{list(value.shape)} per "
                "example) depends on other examples of the batch (batch statistics, or "
                "values read across examples), so it cannot be cached per example. Use "
                "batch norm in inference mode below the trained layers, or train without "
                "the prefix cache")
