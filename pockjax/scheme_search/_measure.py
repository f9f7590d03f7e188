"""Contribution analysis: the search's reference points (the forward pass alone, full
fine-tuning and the budget in bytes), each candidate's run, and the on-disk cache of
those runs.

`pockjax.scheme_search.search` calls `references`, then `measure` over the candidates;
`pockjax.scheme_search._choose` compiles sets with `compiled_peak` against the `References`.
`pockjax.scheme_search` re-exports `parse_budget`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import time
from typing import Callable

import jax
import numpy as np

from pockjax.measure import compiled_memory, format_bytes, tree_bytes
from pockjax.scheme_search._candidates import Candidate
from pockjax.scheme_search._report import CandidateResult
from pockjax.checkpoint import write_atomic
from pockjax.flops import count_flops
from pockjax.scheme import Full, Scheme, decision_to_json
from pockjax.train import SparseTrainer, abstract_arrays

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


def _budget_range_hint(low: int, high: int) -> str:
    return f"'{math.ceil(100 * low / high)}%' to '{math.floor(100 * (high - 1) / high)}%'"


def compiled_peak(compiled) -> int:
    """The peak memory of a compiled step (`pockjax.compiled_memory`), in bytes."""
    return compiled_memory(compiled)["peak"]


# Bump when a cached cost changes meaning, so old caches are not reused
# (2: FLOPs counted on the jaxpr, loops included, instead of XLA's cost analysis).
_COSTS_VERSION = 2


def cache_fingerprint(params, train, heldout, steps, key) -> str:
    """The cache file's key: the parameters, the batches used, `steps`, `key` and the
    meaning of the cached costs."""
    h = hashlib.sha256()
    h.update(repr((steps, key, _COSTS_VERSION)).encode())
    for tree in (params, train[:steps], heldout):
        for x in jax.tree_util.tree_leaves(tree):
            a = np.asarray(x)
            h.update(repr((a.shape, str(a.dtype))).encode())
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


class ResultCache:
    """The candidates' results on disk, one JSON file per fingerprint, rewritten
    atomically after each; `directory=None` keeps them in memory only."""

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


@dataclasses.dataclass
class References:
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


def references(trainer_factory, params, batch0, budget) -> References:
    """The forward pass's and full fine-tuning's compiled costs and the budget in bytes;
    a budget outside the two is an error that names the range."""
    probe = trainer_factory(Scheme(default=Full()))
    if not isinstance(probe, SparseTrainer):
        raise TypeError(f"trainer_factory must return a pockjax SparseTrainer (from "
                        f"pockjax.sparse_train), got {type(probe).__name__}")
    loss_fn = probe.loss_fn
    evaluate = jax.jit(lambda p, b: _loss_value(loss_fn(p, b)))
    forward = evaluate.lower(abstract_arrays(params), abstract_arrays(batch0)).compile()
    forward_bytes = compiled_peak(forward)
    full_traced = probe.trace(jax.eval_shape(probe.init, params), batch0)
    full_bytes, full_flops = compiled_peak(full_traced.lower().compile()), count_flops(full_traced)
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
    return References(trainer_factory, evaluate, forward_bytes, full_bytes, full_flops, budget_bytes)


def measure(ref: References, cands, params, train, heldout, baseline, store,
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


def _run_candidate(ref: References, c: Candidate, params, train, heldout, baseline) -> dict:
    start = time.perf_counter()
    trainer = ref.trainer_factory(c.scheme())
    state = trainer.init(params)
    traced = trainer.trace(state, train[0])
    compiled = traced.lower().compile()  # once; every step runs it
    for batch in train:
        state, _ = compiled(state, batch)
    loss = ref.heldout_loss(state.params, heldout)
    peak = compiled_peak(compiled)
    return {"loss": loss, "contribution": baseline - loss if np.isfinite(loss) else -math.inf,
            "peak_bytes": peak, "added_bytes": max(peak - ref.forward_bytes, 0),
            "flops": count_flops(traced), "seconds": time.perf_counter() - start,
            "opt_state_bytes": tree_bytes(state.opt_state)}
