"""Choosing what to train: contribution analysis and a memory-budgeted scheme search.

PockEngine, following tiny-training (NeurIPS 2022), measures what each part of the
model contributes on the task and picks the best set that fits a memory budget:

1. **Candidates** (`find_candidates`): per weight, Full and Channels at ratios 1/8, 1/4,
   1/2 (input channels by default: only their slice of the input activation is saved
   for the weight gradient); the vectors (biases, else norm scales) of the last k
   blocks; for a stacked weight (a leading layer axis, as under `lax.scan`), its
   last k layers.
2. **Contribution analysis.** From the same starting point, each candidate alone
   trains for `steps` steps on the same batches. Its contribution is the drop in the
   held-out loss. The step is compiled once per candidate and the compiled executable
   runs every step. That compilation also gives the candidate's cost: its step's
   compiled peak memory (arguments + outputs - donated + temporaries); its FLOPs are
   counted on the traced step (`pockjax.flops`: loops times their trip count, which
   XLA's cost analysis leaves out). Both hold for any model, so no per-layer formula
   is needed.
   Results are cached on disk, so an interrupted analysis resumes.
3. **Search.** Maximise the summed contribution with the memory each candidate adds
   to the forward pass, summed, within the budget (and a FLOP budget if given). This
   is a multiple-choice knapsack: solved by trying every set when there are at most
   100,000, else by dynamic programming over the budget in 2,000 steps with each cost
   rounded up. Then the chosen scheme is compiled
   and its real memory checked:
   - over the budget: the member adding least per byte goes, until it fits;
   - the sum over-counts memory that candidates share (the backward pass between
     two layers), so the knapsack is solved again with its capacity scaled by the
     over-count measured (up to `calibrate` rounds), keeping the best set that fits;
   - then the best remaining candidates are tried, each compiled, while they fit.

    scheme, report = pj.search(lambda s: pj.sparse_train(loss, optimizer=opt, scheme=s),
                               params, (train_batches, heldout_batches), budget="40%")
    print(report); report.plot("search.png"); open("scheme.json", "w").write(scheme.to_json())

`budget` is a fraction of full fine-tuning's step memory ("40%") or a size
("2GiB", "512MiB", or a number of bytes).
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import time
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pockjax.checkpoint import write_atomic
from pockjax.flops import count_flops
from pockjax.scheme import Channels, Decision, Frozen, Full, Scheme, SchemeError, \
    decision_from_json, decision_to_json, glob_to_regex, exact_pattern, layouts_of, leaves_with_paths
from pockjax.schemes import blocks, params_of
from pockjax._report import compiled_memory, format_bytes, tree_bytes
from pockjax.train import SparseTrainer, abstract_arrays

__all__ = ["Candidate", "CandidateResult", "SearchReport", "find_candidates", "search",
           "parse_budget"]

RATIOS = (1 / 8, 1 / 4, 1 / 2)
_GRID = 2000  # knapsack resolution: steps of budget / _GRID


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


def _block_of(path: str, block_list: list[str]) -> int | None:
    for i, b in enumerate(block_list):
        if path.startswith(b + "/"):
            return i
    return None


def find_candidates(params, *, ratios: Sequence[float] = RATIOS, axis: str | int = "in",
               include: Sequence[str] | None = None, exclude: Sequence[str] = (),
               vectors: Sequence[str] = ("bias",), stacked: Sequence[str] = (),
               block_name: str | None = None) -> list[Candidate]:
    """The search's candidates for `params`: a pytree, or a model whose type has a
    converter (`pockjax.schemes.register_params_of`; `pockjax.nnx` registers `nnx.Module`).

    - every floating weight (2 or more dimensions) matching `include` (globs; all by
      default) and not `exclude`: Full, and Channels at each of `ratios` along `axis`
      (ratios that round to the whole axis, or to the count of a smaller ratio, are
      dropped as duplicates); with a named `axis`, a weight whose named axes are
      unknown (rank 3 or above 5 without a registered layout, or a layout string) gets
      Full only;
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

    Returns:
      The list of `Candidate`s.

    Raises:
      SchemeError: a ratio is not in (0, 1), a `stacked` parameter has fewer than 2
        dimensions, or no candidate was found.
    """
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
    out: list[Candidate] = []
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
        out.append(Candidate(f"{path} full", path, ((path, Full()),)))
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
            out.append(Candidate(f"{path} {_ratio_str(ratio)} {axis}", path,
                                 ((path, Channels(count=d.count, axis=d.axis)),)))

    vec = [(p, x) for p, x in named if np.ndim(x) == 1 and wanted(p)
           and not any(r.match(p) for r in stk)]
    named_vec = [(p, x) for p, x in vec if p.rsplit("/", 1)[-1] in tuple(vectors)]
    vec = named_vec or vec
    try:
        block_list = blocks(params, block_name)
    except SchemeError:
        block_list = []
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


# --------------------------------------------------------------------------- budget


_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_budget(budget, full_bytes: int) -> int:
    """Bytes for a budget: "40%" of `full_bytes`, "2GiB", "512MB", or an int of bytes.

    Args:
      budget: a percentage string (`"40%"`), a size string with a unit (B, kB, MB, GB,
        KiB, MiB or GiB, case and spaces ignored; no unit: bytes), or an int of bytes.
      full_bytes: what 100% is: full fine-tuning's step memory.

    Returns:
      The budget in bytes, an int.

    Raises:
      ValueError: `budget` is a bool or a float (ambiguous), cannot be read, or has an
        unknown unit.
    """
    if isinstance(budget, bool):
        raise ValueError(f"budget must be a percentage such as '40%' or a size such as '2GiB', "
                         f"got {budget!r}")
    if isinstance(budget, (int, np.integer)):
        return int(budget)
    if isinstance(budget, float):
        raise ValueError(f"budget {budget!r} is ambiguous; write '{budget * 100:g}%' for a fraction "
                         f"of full fine-tuning's step memory or an int of bytes")
    text = str(budget).strip().lower().replace(" ", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)(%|[kmg]?i?b)?", text)
    if not m:
        raise ValueError(f"cannot read budget {budget!r}; use a percentage of full fine-tuning's "
                         f"step memory ('40%') or a size ('2GiB', '512MiB', '3e8B')")
    value, unit = float(m.group(1)), m.group(2) or "b"
    if unit == "%":
        return int(value / 100 * full_bytes)
    if unit not in _UNITS:
        raise ValueError(f"unknown unit in budget {budget!r}; use B, kB, MB, GB, KiB, MiB or GiB")
    return int(value * _UNITS[unit])


# --------------------------------------------------------------------------- results


@dataclasses.dataclass
class CandidateResult:
    """What one candidate's run measured.

    Attributes:
      name: the candidate's name.
      group: the candidate's group.
      rules: the candidate's `[path, decision JSON]` pairs.
      loss: the mean held-out loss after the run.
      contribution: the held-out loss before the run minus `loss` (minus infinity when
        the loss is not finite).
      peak_bytes: the compiled peak memory of the candidate's step.
      added_bytes: `peak_bytes` minus the forward pass's compiled peak (at least 0).
      flops: the FLOPs of the candidate's step (`pockjax.count_flops`).
      seconds: the run's wall time, compilation included.
      opt_state_bytes: of the step's memory, the optimizer state of the trainable view;
        None in results cached without it.
    """

    name: str
    group: str
    rules: list  # [(path, decision JSON)]
    loss: float            # held-out loss after the run
    contribution: float    # baseline held-out loss - loss
    peak_bytes: int        # compiled peak memory of its step
    added_bytes: int       # peak_bytes - the forward pass's peak
    flops: float
    seconds: float
    opt_state_bytes: int | None = None  # of that: its trainable view's optimizer state

    def candidate(self) -> Candidate:
        """The candidate this result measured.

        Returns:
          A `Candidate` with this result's name, group and rules (decisions read back
            from JSON).
        """
        return Candidate(self.name, self.group,
                         tuple((p, decision_from_json(d)) for p, d in self.rules))


@dataclasses.dataclass
class SearchReport:
    """Contributions and costs of every candidate, and how the search chose.

    `str()` of it is a table of the candidates, best first, the chosen marked `*`, and a
    summary of the budget and the chosen set.

    Attributes:
      results: every candidate's `CandidateResult`.
      baseline_loss: the mean held-out loss of the starting parameters.
      forward_bytes: the compiled peak memory of the forward pass alone.
      full_bytes: the compiled peak memory of a full fine-tuning step.
      full_flops: the FLOPs of a full fine-tuning step.
      budget_bytes: the memory budget in bytes.
      flop_budget: the FLOP budget, or None.
      chosen: the names of the chosen candidates.
      predicted_bytes: the memory the knapsack predicted for the chosen set (the
        forward pass plus the summed added bytes).
      measured_bytes: the compiled peak memory of the chosen scheme's step.
      measured_flops: the FLOPs of the chosen scheme's step.
      log: the search's steps, one line each.
      scheme: the chosen `Scheme`.
      steps: the training steps each candidate ran.
      min_contribution: the noise floor: candidates whose contribution is not above it
        were left out.
    """

    results: list[CandidateResult]
    baseline_loss: float
    forward_bytes: int
    full_bytes: int
    full_flops: float
    budget_bytes: int
    flop_budget: float | None
    chosen: list[str]
    predicted_bytes: int
    measured_bytes: int
    measured_flops: float
    log: list[str]
    scheme: Scheme
    steps: int
    min_contribution: float = 0.0

    def as_dict(self) -> dict:
        """The report as plain data (for JSON).

        Returns:
          A dict of the fields, `scheme` as its JSON object.
        """
        d = dataclasses.asdict(self)
        d["scheme"] = json.loads(self.scheme.to_json())
        return d

    def save(self, path: str) -> None:
        """Write `as_dict()` as JSON to `path` (atomically: a reader never sees half a file).

        Args:
          path: the file to write.
        """
        write_atomic(path, json.dumps(self.as_dict(), indent=1).encode())

    def __str__(self) -> str:
        chosen = set(self.chosen)
        rows = sorted(self.results, key=lambda r: -r.contribution)
        width = max(len(r.name) for r in rows)
        lines = [f"contribution analysis: {len(rows)} candidates, {self.steps} steps each; "
                 f"held-out loss before {self.baseline_loss:.4f}",
                 f"{'':2}{'candidate'.ljust(width)}  {'Δloss':>9}  {'adds':>11}  {'opt state':>11}  "
                 f"{'step peak':>11}  {'GFLOP':>8}"]
        for r in rows:
            mark = "* " if r.name in chosen else "  "
            lines.append(f"{mark}{r.name.ljust(width)}  {r.contribution:9.4f}  "
                         f"{format_bytes(r.added_bytes):>11}  {_bytes_or_dash(r.opt_state_bytes):>11}  "
                         f"{format_bytes(r.peak_bytes):>11}  "
                         f"{r.flops / 1e9:8.3f}")
        pct = lambda b: f"{100 * b / self.full_bytes:.1f}% of full"
        lines += ["",
                  f"forward pass {format_bytes(self.forward_bytes)}; full fine-tuning step "
                  f"{format_bytes(self.full_bytes)}, {self.full_flops / 1e9:.3f} GFLOP",
                  f"budget {format_bytes(self.budget_bytes)} ({pct(self.budget_bytes)})"
                  + (f", {self.flop_budget / 1e9:.3f} GFLOP" if self.flop_budget else ""),
                  f"chosen (*): {len(self.chosen)} candidates, predicted "
                  f"{format_bytes(self.predicted_bytes)}, compiled {format_bytes(self.measured_bytes)} "
                  f"({pct(self.measured_bytes)}), {self.measured_flops / 1e9:.3f} GFLOP",
                  f"candidates improving the loss by less than {self.min_contribution:.3g} are "
                  f"left out as noise",
                  *[f"  {line}" for line in self.log]]
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Contribution against added memory, the chosen candidates highlighted (PNG).

        Args:
          path: the PNG file to write.

        Raises:
          ImportError: matplotlib is not installed.
        """
        try:
            import matplotlib
        except ImportError:
            raise ImportError("SearchReport.plot needs matplotlib: pip install matplotlib "
                              "(or pockjax[examples])") from None

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        chosen = set(self.chosen)
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
        for sel, color, label in ((False, "#9aa5b1", "candidate"), (True, "#d1495b", "chosen")):
            pts = [(r.added_bytes / 2**20, r.contribution) for r in self.results
                   if (r.name in chosen) == sel]
            if pts:
                ax.scatter(*zip(*pts), s=18, color=color, label=label, zorder=2 + sel)
        ax.axvline((self.budget_bytes - self.forward_bytes) / 2**20, color="#333", ls="--", lw=1,
                   label="budget - forward pass")
        ax.set_xlabel("memory added to the forward pass (MiB, compiled)")
        ax.set_ylabel("held-out loss improvement")
        ax.set_title(f"{len(self.results)} candidates, {self.steps} steps each")
        ax.grid(alpha=0.3)
        ax.legend(frameon=False)
        fig.tight_layout()
        tmp = f"{path}.tmp.png"
        fig.savefig(tmp)
        plt.close(fig)
        os.replace(tmp, path)


def _bytes_or_dash(n) -> str:
    return "-" if n is None else format_bytes(n)


# --------------------------------------------------------------------------- measuring


def _peak(compiled) -> int:
    return compiled_memory(compiled)["peak"]


# Bump when a cached cost changes meaning, so old caches are not reused
# (2: FLOPs counted on the jaxpr, loops included, instead of XLA's cost analysis).
_COSTS_VERSION = 2


def _fingerprint(params, train, heldout, steps, key) -> str:
    h = hashlib.sha256()
    h.update(repr((steps, key, _COSTS_VERSION)).encode())
    for tree in (params, train[:steps], heldout):
        for x in jax.tree_util.tree_leaves(tree):
            a = np.asarray(x)
            h.update(repr((a.shape, str(a.dtype))).encode())
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


class _Cache:
    def __init__(self, directory: str | None, fingerprint: str):
        self.path = None if directory is None else os.path.join(directory, f"contributions-{fingerprint}.json")
        self.entries: dict[str, dict] = {}
        if self.path and os.path.exists(self.path):
            try:
                with open(self.path) as f:
                    self.entries = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"search cache '{self.path}' cannot be read ({e}); delete it to "
                                 f"start the analysis afresh") from None

    def get(self, key: str):
        return self.entries.get(key)

    def put(self, key: str, value: dict) -> None:
        self.entries[key] = value
        if self.path:
            write_atomic(self.path, json.dumps(self.entries).encode())


def _loss_value(out):
    return out[0] if isinstance(out, tuple) else out


def search(trainer_factory: Callable[[Scheme], SparseTrainer], params, data, budget="40%", *,
           steps: int = 20, candidates: Sequence[Candidate] | None = None,
           flop_budget: float | None = None, cache: str | None = None, cache_key: str = "",
           progress: bool = True, calibrate: int = 4, max_fill: int = 6,
           min_contribution: float = 0.02,
           **candidate_options) -> tuple[Scheme, SearchReport]:
    """Contribution analysis and the budgeted search (see the module docstring).

    `trainer_factory(scheme)` makes the trainer (`pockjax.sparse_train(...)`) for a
    scheme; `params` is the starting point; `data` is `(train_batches, heldout_batches)`:
    every candidate trains on `train_batches[:steps]` and is scored by its mean loss
    on `heldout_batches`. `candidates` overrides the candidate list; other keyword
    arguments go to `find_candidates()`. With `cache` (a directory) each candidate's
    result is saved as it finishes and reused by a later call on the same parameters,
    data, steps and `cache_key` (change it when you change the optimizer).
    Candidates that improve the held-out loss by no more than `min_contribution` times
    the best candidate's improvement are treated as noise and left out. `calibrate`
    caps the knapsack rounds (each compiles its set once), and the fill stops after
    `max_fill` candidates that did not fit.

    The steps, each a function below: `_references` (forward pass, full fine-tuning,
    the budget), `_measure` (every candidate's run), `_solve` (the knapsack, calibrated
    against compiled sets, each `_repair`ed to fit), `_fill` (room left).

    Args:
      trainer_factory: `trainer_factory(scheme)` -> a `SparseTrainer` for that scheme.
      params: the starting parameters (every candidate trains from them).
      data: `(train_batches, heldout_batches)`, or a dict with `"train"` and
        `"heldout"`; at least `steps` training batches and one held-out batch.
      budget: the memory budget: a percentage of full fine-tuning's step memory
        (`"40%"`, the default), a size (`"2GiB"`) or an int of bytes (see
        `parse_budget`); it must lie between the forward pass's memory and full
        fine-tuning's.
      steps: training steps per candidate (default 20).
      candidates: the candidates to choose from; None (the default):
        `find_candidates(params, **candidate_options)`.
      flop_budget: the most FLOPs the chosen step may take; None (the default): no
        limit.
      cache: a directory for the per-candidate results; None (the default): no cache.
      cache_key: a string that is part of the cache's key (default empty).
      progress: show a progress bar (default True).
      calibrate: the most knapsack rounds (default 4).
      max_fill: the fill stops after this many candidates that did not fit (default 6).
      min_contribution: the noise floor as a fraction of the best contribution
        (default 0.02).
      **candidate_options: keyword arguments for `find_candidates` (not together with
        `candidates`).

    Returns:
      A pair: the chosen `Scheme` (exact parameter paths, everything else Frozen) and
        the `SearchReport`.

    Raises:
      TypeError: both `candidates` and `candidate_options` are given, `data` is not two
        sequences of batches, or `trainer_factory` does not return a `SparseTrainer`.
      SchemeError: candidate names repeat (or `find_candidates` finds none).
      ValueError: `steps` is below 1 or above the number of training batches, there are
        no held-out batches, the budget is not between the forward pass's and full
        fine-tuning's memory, no candidate fits the memory or FLOP budget, no candidate
        improves the held-out loss, or no set fits the budget once compiled.
    """
    train, heldout = _split_data(data, steps)
    if candidates is not None and candidate_options:
        raise TypeError(f"give candidates= or options for find_candidates "
                        f"({sorted(candidate_options)}), not both")
    cands = list(candidates) if candidates is not None else find_candidates(params, **candidate_options)
    names = [c.name for c in cands]
    if len(set(names)) != len(names):
        raise SchemeError("candidate names must be unique; got duplicates "
                          f"{sorted({n for n in names if names.count(n) > 1})}")
    ref = _references(trainer_factory, params, train[0], budget)
    baseline = ref.heldout_loss(params, heldout)
    store = _Cache(cache, _fingerprint(params, train, heldout, steps, cache_key))
    results = _measure(ref, cands, params, train, heldout, baseline, store, progress)
    useful, floor = _useful(ref, results, steps, flop_budget, min_contribution)
    state = _Search(ref, params, train[0], flop_budget, useful)
    selection = _solve(state, calibrate) or _Selection([], ref.forward_bytes, 0.0, ref.forward_bytes)
    selection = _fill(state, selection, max_fill)
    if not selection.chosen:
        raise ValueError(f"no candidate set fits the budget {format_bytes(ref.budget_bytes)} when "
                         f"compiled; give a budget between {format_bytes(min(r.peak_bytes for r in results))} "
                         f"and {format_bytes(ref.full_bytes)}")
    scheme = _scheme_of(selection.chosen)
    report = SearchReport(results=results, baseline_loss=baseline, forward_bytes=ref.forward_bytes,
                          full_bytes=ref.full_bytes, full_flops=ref.full_flops,
                          budget_bytes=ref.budget_bytes, flop_budget=flop_budget,
                          chosen=[r.name for r in selection.chosen],
                          predicted_bytes=selection.predicted, measured_bytes=selection.measured,
                          measured_flops=selection.flops, log=state.log, scheme=scheme,
                          steps=steps, min_contribution=floor)
    return scheme, report


@dataclasses.dataclass
class _References:
    """The search's reference points: the forward pass alone and full fine-tuning, and
    the budget in bytes."""

    trainer_factory: Callable[[Scheme], SparseTrainer]
    evaluate: Callable  # jitted (params, batch) -> loss
    forward_bytes: int
    full_bytes: int
    full_flops: float
    budget_bytes: int

    def heldout_loss(self, params, heldout) -> float:
        return float(np.mean([float(self.evaluate(params, b)) for b in heldout]))


def _references(trainer_factory, params, batch0, budget) -> _References:
    probe = trainer_factory(Scheme(default=Full()))
    if not isinstance(probe, SparseTrainer):
        raise TypeError(f"trainer_factory must return a pockjax SparseTrainer (from "
                        f"pockjax.sparse_train), got {type(probe).__name__}")
    loss_fn = probe.loss_fn
    evaluate = jax.jit(lambda p, b: _loss_value(loss_fn(p, b)))
    forward = evaluate.lower(abstract_arrays(params), abstract_arrays(batch0)).compile()
    forward_bytes = _peak(forward)
    full_traced = probe.trace(jax.eval_shape(probe.init, params), batch0)
    full_bytes, full_flops = _peak(full_traced.lower().compile()), count_flops(full_traced)
    budget_bytes = parse_budget(budget, full_bytes)
    if budget_bytes >= full_bytes:
        raise ValueError(f"budget {format_bytes(budget_bytes)} is at least full fine-tuning's step "
                         f"memory ({format_bytes(full_bytes)}): train everything "
                         f"(Scheme(default=Full())) or give a budget between the forward pass's "
                         f"{format_bytes(forward_bytes)} and {format_bytes(full_bytes)}")
    if budget_bytes <= forward_bytes:
        raise ValueError(f"budget {format_bytes(budget_bytes)} does not exceed the forward pass "
                         f"alone ({format_bytes(forward_bytes)}), so no training step fits; give a "
                         f"budget between {format_bytes(forward_bytes)} and full fine-tuning's "
                         f"{format_bytes(full_bytes)} ({_budget_range_hint(forward_bytes, full_bytes)})")
    return _References(trainer_factory, evaluate, forward_bytes, full_bytes, full_flops, budget_bytes)


def _measure(ref: _References, cands, params, train, heldout, baseline, store,
             progress: bool) -> list[CandidateResult]:
    """Contribution analysis: each candidate's run, from the cache where it has one."""
    from tqdm.auto import tqdm

    results: list[CandidateResult] = []
    bar = tqdm(cands, disable=not progress, unit="cand", desc="contribution", dynamic_ncols=True)
    for c in bar:
        bar.set_postfix_str(c.name[-40:])
        hit = store.get(c.key())
        if hit is None:
            hit = _run_candidate(ref, c, params, train, heldout, baseline)
            store.put(c.key(), hit)
        results.append(CandidateResult(name=c.name, group=c.group,
                                       rules=[[p, decision_to_json(d)] for p, d in c.rules], **hit))
    bar.close()
    return results


def _useful(ref: _References, results, steps, flop_budget, min_contribution):
    """The candidates worth choosing from (above the noise floor) and that floor; errors
    when no candidate fits the budgets or none improved the loss."""
    fits = [r for r in results if r.peak_bytes <= ref.budget_bytes]
    if not fits:
        smallest = min(results, key=lambda r: r.peak_bytes)
        raise ValueError(f"budget {format_bytes(ref.budget_bytes)} is below every candidate's step: the "
                         f"smallest is {format_bytes(smallest.peak_bytes)} ('{smallest.name}'); give "
                         f"a budget between {format_bytes(smallest.peak_bytes)} and full fine-tuning's "
                         f"{format_bytes(ref.full_bytes)}")
    if flop_budget is not None and not any(r.flops <= flop_budget for r in fits):
        least = min(fits, key=lambda r: r.flops)
        raise ValueError(f"FLOP budget {flop_budget / 1e9:.4g} GFLOP is below every candidate's "
                         f"step that fits the memory budget: the least is {least.flops / 1e9:.4g} "
                         f"GFLOP ('{least.name}'); full fine-tuning takes {ref.full_flops / 1e9:.4g}")
    best = max(r.contribution for r in results)
    if not best > 0:
        raise ValueError(f"no candidate improved the held-out loss in {steps} steps (best change "
                         f"{best:+.3g}); use more steps, a larger learning rate or other candidates")
    floor = min_contribution * best
    return [r for r in results if r.contribution > floor], floor


@dataclasses.dataclass
class _Selection:
    """A candidate set with its compiled peak memory and FLOPs, and the memory the
    knapsack predicted for it (the forward pass plus the summed added bytes)."""

    chosen: list[CandidateResult]
    measured: int
    flops: float
    predicted: int

    @property
    def value(self) -> float:
        return sum(r.contribution for r in self.chosen)


@dataclasses.dataclass
class _Search:
    """What the choosing steps share: the budgets, the candidates to choose from, the
    log, and every set compiled so far (each set compiles once)."""

    ref: _References
    params: object
    batch0: object
    flop_budget: float | None
    useful: list[CandidateResult]
    log: list[str] = dataclasses.field(default_factory=list)
    compiled: dict = dataclasses.field(default_factory=dict)

    def cost(self, chosen: list[CandidateResult]) -> tuple[int, float]:
        """The set's compiled step peak memory and FLOPs."""
        key = frozenset(r.name for r in chosen)
        if key not in self.compiled:
            if not chosen:
                self.compiled[key] = (self.ref.forward_bytes, 0.0)
            else:
                traced = _trace_scheme(self.ref.trainer_factory, _scheme_of(chosen), self.params,
                                       self.batch0)
                self.compiled[key] = (_peak(traced.lower().compile()), count_flops(traced))
        return self.compiled[key]

    def within(self, measured: int, flops: float) -> bool:
        return measured <= self.ref.budget_bytes and (self.flop_budget is None
                                                      or flops <= self.flop_budget)


def _solve(state: _Search, calibrate: int) -> _Selection | None:
    """The knapsack over summed costs, each answer compiled and repaired, the best kept.
    Summed costs over-count the backward pass that candidates share, so the knapsack is
    solved again with its capacity scaled by the over-count the compiler showed."""
    capacity = state.ref.budget_bytes - state.ref.forward_bytes
    best: _Selection | None = None
    scale, seen = 1.0, set()
    for _ in range(max(calibrate, 1)):
        chosen = _knapsack(state.useful, int(capacity * scale), state.flop_budget)
        key = frozenset(r.name for r in chosen)
        if not chosen or key in seen:
            break
        seen.add(key)
        summed = sum(r.added_bytes for r in chosen)
        measured, _ = state.cost(chosen)
        state.log.append(f"knapsack (capacity x{scale:.2f}): {len(chosen)} candidates, summed "
                         f"{format_bytes(state.ref.forward_bytes + summed)}, compiled "
                         f"{format_bytes(measured)}")
        repaired = _repair(state, chosen, state.ref.forward_bytes + summed)
        if repaired.chosen and (best is None or repaired.value > best.value):
            best = repaired
        real = measured - state.ref.forward_bytes
        if real <= 0:
            break
        new_scale = summed / real
        if abs(new_scale - scale) < 0.05 * scale:
            break
        scale = new_scale
    return best


def _repair(state: _Search, chosen: list[CandidateResult], predicted: int) -> _Selection:
    """Over the budget, drop the member that adds least per byte, until the set fits."""
    measured, flops = state.cost(chosen)
    while chosen and not state.within(measured, flops):
        worst = min(chosen, key=lambda r: r.contribution / max(r.added_bytes, 1))
        chosen = [r for r in chosen if r is not worst]
        measured, flops = state.cost(chosen)
        state.log.append(f"  over budget: dropped '{worst.name}' -> {format_bytes(measured)}")
    return _Selection(chosen, measured, flops, predicted)


def _fill(state: _Search, sel: _Selection, max_fill: int) -> _Selection:
    """Try the best remaining candidates, each compiled, while they fit; stop after
    `max_fill` that did not."""
    rejected = 0
    for r in sorted(state.useful, key=lambda r: -r.contribution):
        if rejected >= max_fill:
            break
        if r.group in {x.group for x in sel.chosen} or r.peak_bytes > state.ref.budget_bytes:
            continue
        m, f = state.cost(sel.chosen + [r])
        if state.within(m, f):
            sel = _Selection(sel.chosen + [r], m, f, sel.predicted)
            state.log.append(f"room left: added '{r.name}' -> {format_bytes(m)}")
        else:
            rejected += 1
    return sel


def _budget_range_hint(low: int, high: int) -> str:
    return f"'{math.ceil(100 * low / high)}%' to '{math.floor(100 * (high - 1) / high)}%'"


def _split_data(data, steps: int):
    if isinstance(data, dict):
        data = (data.get("train"), data.get("heldout"))
    if not (isinstance(data, (tuple, list)) and len(data) == 2):
        raise TypeError("data must be (train_batches, heldout_batches): two sequences of batches")
    train, heldout = list(data[0]) if not isinstance(data[0], list) else data[0], list(data[1])
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if len(train) < steps:
        raise ValueError(f"data has {len(train)} training batches but steps={steps}; give at least "
                         f"{steps} (every candidate trains on the same first {steps})")
    if not heldout:
        raise ValueError("data has no held-out batches; contributions are measured on them")
    return train, heldout


def _scheme_of(results: Iterable[CandidateResult]) -> Scheme:
    rules = []
    for r in results:
        rules += [(p, d) for p, d in r.candidate().rules]
    return Scheme([(exact_pattern(p), d) for p, d in rules], default=Frozen())


def _trace_scheme(trainer_factory, scheme: Scheme, params, batch) -> jax.stages.Traced:
    trainer = trainer_factory(scheme)
    state = jax.eval_shape(trainer.init, params)
    return trainer.trace(state, batch)


def _run_candidate(ref: _References, c: Candidate, params, train, heldout, baseline) -> dict:
    start = time.perf_counter()
    trainer = ref.trainer_factory(c.scheme())
    state = trainer.init(params)
    traced = trainer.trace(state, train[0])
    compiled = traced.lower().compile()  # once; every step runs it
    for batch in train:
        state, _ = compiled(state, batch)
    loss = ref.heldout_loss(state.params, heldout)
    peak = _peak(compiled)
    return {"loss": loss, "contribution": baseline - loss if np.isfinite(loss) else -math.inf,
            "peak_bytes": peak, "added_bytes": max(peak - ref.forward_bytes, 0),
            "flops": count_flops(traced), "seconds": time.perf_counter() - start,
            "opt_state_bytes": tree_bytes(state.opt_state)}


_EXHAUSTIVE = 100_000  # sets; up to this many, every one is tried


def _knapsack(results: list[CandidateResult], capacity: int, flop_budget: float | None):
    """The best set, at most one per group, with summed added bytes <= capacity (and
    summed FLOPs <= flop_budget). Exact: every set when there are few, else dynamic
    programming on a grid of the budget with costs rounded up (never over, but a set
    within a grid step of the limit can be missed)."""
    groups: dict[str, list[CandidateResult]] = {}
    for r in results:
        if r.contribution > 0 and r.added_bytes <= capacity and (
                flop_budget is None or r.flops <= flop_budget):
            groups.setdefault(r.group, []).append(r)
    if not groups or capacity <= 0:
        return []
    if math.prod(len(o) + 1 for o in groups.values()) <= _EXHAUSTIVE:
        best, best_set = 0.0, []
        for combo in itertools.product(*[[None, *o] for o in groups.values()]):
            chosen = [r for r in combo if r is not None]
            if sum(r.added_bytes for r in chosen) > capacity:
                continue
            if flop_budget is not None and sum(r.flops for r in chosen) > flop_budget:
                continue
            value = sum(r.contribution for r in chosen)
            if value > best:
                best, best_set = value, chosen
        return best_set
    unit = capacity / _GRID
    cost = lambda r: min(_GRID + 1, math.ceil(r.added_bytes / unit - 1e-9))
    nf = 200 if flop_budget else 0
    fcost = (lambda r: min(nf + 1, math.ceil(r.flops / (flop_budget / nf) - 1e-9))) if nf else None
    shape = (_GRID + 1,) if not nf else (_GRID + 1, nf + 1)
    value = np.zeros(shape)
    choices = []
    for g, opts in groups.items():
        new, pick = value.copy(), np.full(shape, -1, np.int32)
        for i, r in enumerate(opts):
            c = cost(r)
            if c > _GRID:
                continue
            if nf:
                fc = fcost(r)
                if fc > nf:
                    continue
                cand = np.full(shape, -np.inf)
                cand[c:, fc:] = value[:_GRID + 1 - c, :nf + 1 - fc] + r.contribution
            else:
                cand = np.full(shape, -np.inf)
                cand[c:] = value[:_GRID + 1 - c] + r.contribution
            better = cand > new
            new = np.where(better, cand, new)
            pick = np.where(better, i, pick)
        choices.append((g, opts, pick))
        value = new
    # Walk back from the full capacity.
    idx = (_GRID,) if not nf else (_GRID, nf)
    chosen = []
    for g, opts, pick in reversed(choices):
        i = int(pick[idx])
        if i >= 0:
            r = opts[i]
            chosen.append(r)
            idx = (idx[0] - cost(r),) if not nf else (idx[0] - cost(r), idx[1] - fcost(r))
    return chosen[::-1]
