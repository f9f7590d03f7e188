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

    scheme, report = pj.search_scheme(lambda s: pj.sparse_train(loss, optimizer=opt, scheme=s),
                               params, (train_batches, heldout_batches), budget="40%")
    print(report); report.plot("search.png"); open("scheme.json", "w").write(scheme.to_json())

`budget` is a fraction of full fine-tuning's step memory ("40%") or a size
("2GiB", "512MiB", or a number of bytes).

This module holds `search`, which runs the steps; each step has its own module:
`pockjax.scheme_search._candidates` (1), `pockjax.scheme_search._measure` (2, and `parse_budget`),
`pockjax.scheme_search._choose` (3) and `pockjax.scheme_search._report` (`CandidateResult`,
`SearchReport`). Their public names are re-exported here.
"""
from __future__ import annotations

import warnings

from typing import Callable, Sequence

from pockjax._src.home import claim
from pockjax.measure import format_bytes
from pockjax.scheme_search._candidates import Candidate, find_candidates
from pockjax.scheme_search._choose import SearchState, Selection, fill, solve, worth_choosing
from pockjax.scheme_search._measure import ResultCache, cache_fingerprint, measure, parse_budget, \
    references
from pockjax.scheme_search._report import CandidateResult, SearchReport, scheme_of
from pockjax.scheme import Scheme, SchemeError
from pockjax.train import SparseTrainer

# `RATIOS` (the candidates' channel ratios) and `_knapsack` for the tests.
from pockjax.scheme_search._candidates import RATIOS  # noqa: F401
from pockjax.scheme_search._choose import knapsack as _knapsack  # noqa: F401

__all__ = ["Candidate", "CandidateResult", "SearchReport", "find_candidates", "search_scheme",
           "parse_budget"]


def search_scheme(trainer_factory: Callable[[Scheme], SparseTrainer], params, data, budget="40%", *,
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

    The steps, each a function of `pockjax.scheme_search._measure` or `pockjax.scheme_search._choose`:
    `references` (forward pass, full fine-tuning, the budget), `measure` (every
    candidate's run), `worth_choosing` (the noise floor), `solve` (the knapsack,
    calibrated against compiled sets, each repaired to fit), `fill` (room left).

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
    ref = references(trainer_factory, params, train[0], budget)
    baseline = ref.heldout_loss(params, heldout)
    store = ResultCache(cache, cache_fingerprint(params, train, heldout, steps, cache_key))
    results = measure(ref, cands, params, train, heldout, baseline, store, progress)
    useful, floor = worth_choosing(ref, results, steps, flop_budget, min_contribution)
    state = SearchState(ref, params, train[0], flop_budget, useful)
    selection = solve(state, calibrate) or Selection([], ref.forward_bytes, 0.0, ref.forward_bytes)
    selection = fill(state, selection, max_fill)
    if not selection.chosen:
        raise ValueError(f"no candidate set fits the budget {format_bytes(ref.budget_bytes)} when "
                         f"compiled; give a budget between {format_bytes(min(r.peak_bytes for r in results))} "
                         f"and {format_bytes(ref.full_bytes)}")
    scheme = scheme_of(selection.chosen)
    report = SearchReport(results=results, baseline_loss=baseline, forward_bytes=ref.forward_bytes,
                          full_bytes=ref.full_bytes, full_flops=ref.full_flops,
                          budget_bytes=ref.budget_bytes, flop_budget=flop_budget,
                          chosen=[r.name for r in selection.chosen],
                          predicted_bytes=selection.predicted, measured_bytes=selection.measured,
                          measured_flops=selection.flops, log=state.log, scheme=scheme,
                          steps=steps, min_contribution=floor)
    return scheme, report


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


def search(*args, **kwargs):
    """Deprecated: renamed `search_scheme` (same arguments)."""
    warnings.warn("pockjax.scheme_search.search is renamed search_scheme (same arguments); the "
                  "old name will be removed", DeprecationWarning, stacklevel=2)
    return search_scheme(*args, **kwargs)


claim(globals())  # public names defined in the private modules above live here
