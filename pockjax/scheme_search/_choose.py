"""Choosing the set: the multiple-choice knapsack over the candidates' summed costs,
calibrated against the compiled memory of the sets it picks, repaired to fit the budget
and filled with the room left.

`pockjax.scheme_search.search` calls `worth_choosing`, then `solve` and `fill` over a
`SearchState`; `pockjax.scheme_search` re-exports `knapsack` as `_knapsack` for the tests.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import numpy as np

from pockjax.measure import format_bytes
from pockjax.scheme_search._measure import References, compiled_peak
from pockjax.scheme_search._report import CandidateResult, scheme_of
from pockjax.flops import count_flops
from pockjax.scheme import Scheme

_GRID = 2000  # knapsack resolution: steps of budget / _GRID
_EXHAUSTIVE = 100_000  # sets; up to this many, every one is tried


def worth_choosing(ref: References, results, steps, flop_budget, min_contribution):
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
class Selection:
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
class SearchState:
    """What the choosing steps share: the budgets, the candidates to choose from, the
    log, and every set compiled so far (each set compiles once)."""

    ref: References
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
                traced = _trace_scheme(self.ref.trainer_factory, scheme_of(chosen), self.params,
                                       self.batch0)
                self.compiled[key] = (compiled_peak(traced.lower().compile()), count_flops(traced))
        return self.compiled[key]

    def within(self, measured: int, flops: float) -> bool:
        return measured <= self.ref.budget_bytes and (self.flop_budget is None
                                                      or flops <= self.flop_budget)


def solve(state: SearchState, calibrate: int) -> Selection | None:
    """The knapsack over summed costs, each answer compiled and repaired, the best kept.
    Summed costs over-count the backward pass that candidates share, so the knapsack is
    solved again with its capacity scaled by the over-count the compiler showed."""
    capacity = state.ref.budget_bytes - state.ref.forward_bytes
    best: Selection | None = None
    scale, seen = 1.0, set()
    for _ in range(max(calibrate, 1)):
        chosen = knapsack(state.useful, int(capacity * scale), state.flop_budget)
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


def _repair(state: SearchState, chosen: list[CandidateResult], predicted: int) -> Selection:
    """Over the budget, drop the member that adds least per byte, until the set fits."""
    measured, flops = state.cost(chosen)
    while chosen and not state.within(measured, flops):
        worst = min(chosen, key=lambda r: r.contribution / max(r.added_bytes, 1))
        chosen = [r for r in chosen if r is not worst]
        measured, flops = state.cost(chosen)
        state.log.append(f"  over budget: dropped '{worst.name}' -> {format_bytes(measured)}")
    return Selection(chosen, measured, flops, predicted)


def fill(state: SearchState, sel: Selection, max_fill: int) -> Selection:
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
            sel = Selection(sel.chosen + [r], m, f, sel.predicted)
            state.log.append(f"room left: added '{r.name}' -> {format_bytes(m)}")
        else:
            rejected += 1
    return sel


def _trace_scheme(trainer_factory, scheme: Scheme, params, batch) -> jax.stages.Traced:
    trainer = trainer_factory(scheme)
    state = jax.eval_shape(trainer.init, params)
    return trainer.trace(state, batch)


def knapsack(results: list[CandidateResult], capacity: int, flop_budget: float | None):
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
