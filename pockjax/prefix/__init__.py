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

The pieces live in this package and are handed on here: `pockjax.prefix._cut`
(`find_cut`, `PrefixSplit`: where the step splits) and `pockjax.prefix._cache`
(`PrefixCache`, `example_keys`: the storage). This module runs a trainer through them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from pockjax import lowbit
from pockjax._src.home import claim
from pockjax._src.malloc import reuse_step_memory
from pockjax.prefix._cache import PrefixCache, example_keys, whole_digest
from pockjax.prefix._cut import CutValue, PrefixCacheError, PrefixSplit, find_cut
from pockjax.scheme import Frozen
from pockjax.transforms.sparse_grad import is_dynamic
from pockjax.view import resolved_decisions

__all__ = ["find_cut", "PrefixSplit", "PrefixCache", "PrefixCachedTrainer", "PrefixCacheError",
           "PrefixReport", "default_budget", "example_keys"]

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
            suffix = ScheduledTrainer(t.replace(loss_fn=_suffix(split)), self.trainer.schedule)
        else:
            suffix = t.replace(loss_fn=_suffix(split))
        cache = PrefixCache(split.values, self.budget_bytes, self.spill_dir, self.dtype)
        return split, prefix, suffix, cache

    def _report(self, split: PrefixSplit, state, batch) -> PrefixReport:
        from pockjax.flops import count_flops

        # A schedule's figures are those of the scheme `state` holds.
        trainer = self.trainer.trainer_of(state) if self._scheduled() else self.trainer
        prefix_flops = count_flops(split.prefix_jaxpr()) if split.values else 0.0
        step_flops = count_flops(trainer.trace(state, batch))
        cut = [jax.ShapeDtypeStruct((split.examples, *v.shape), v.dtype) for v in split.values]
        suffix_flops = count_flops(trainer.replace(loss_fn=_suffix(split)).trace(
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
        reuse_step_memory()
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
            whole = whole_digest(batch, n)
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

        `target`, `out_dir`, `gpu`, `extra_flags` and `progress` are those of
        `SparseTrainer.export`.

        Args:
          state: the `TrainState`.
          batch: a batch of the shape to compile for.

        Returns:
          The `pockjax.export.Artifact`.

        Raises:
          PrefixCacheError: the trainer is a `ScheduledTrainer`, or this batch shape has
            no cached step (`auto` found it not worthwhile), or as `split`.
        """
        from pockjax.export.artifact import export

        return export(self, state, batch, target=target, out_dir=out_dir, gpu=gpu,
                      extra_flags=extra_flags, progress=progress)

    def export_step(self, state, batch):
        """What `pockjax.export` compiles for this trainer: `(the suffix's trainer, the
        suffix's batch {"batch": batch, "cut": values}, the prefix function)`.

        Raises:
          PrefixCacheError: as `export`.
        """
        if self._scheduled():
            raise PrefixCacheError("a scheme schedule's steps are not exported; export "
                                   "one scheme's trainer")
        if self.split(state, batch) is None:
            raise PrefixCacheError(f"no cached step for this batch: "
                                   f"{self.report(state, batch)}")
        split, prefix, suffix, _ = self._splits[self._signature(state.params, batch)]
        cut = [np.asarray(v) for v in jax.device_get(prefix(state.params, batch))]
        return suffix, {"batch": batch, "cut": cut}, split.prefix

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

    def __enter__(self) -> "PrefixCachedTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _suffix(split: PrefixSplit):
    """The split's suffix as a trainer's loss: it reads stored (`pockjax.lowbit`) weights
    as the traced step did, so the trainer does not dequantize them around it again."""
    return lowbit.reads_stored(split.suffix_loss)


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


claim(globals())  # public names defined in the private modules above live here
