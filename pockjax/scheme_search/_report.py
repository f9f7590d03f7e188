"""What the search measured and chose: a `CandidateResult` per candidate and the
`SearchReport` (its table, JSON and plot), and the scheme a set of results trains.

`pockjax.scheme_search.search` builds these; `pockjax.scheme_search` re-exports
`CandidateResult` and `SearchReport`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable

from pockjax.measure import format_bytes
from pockjax.scheme_search._candidates import Candidate
from pockjax.checkpoint import write_atomic
from pockjax.scheme import Frozen, Scheme, decision_from_json, exact_pattern


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


def scheme_of(results: Iterable[CandidateResult]) -> Scheme:
    """The scheme that trains every result's candidate, everything else Frozen."""
    rules = []
    for r in results:
        rules += [(p, d) for p, d in r.candidate().rules]
    return Scheme([(exact_pattern(p), d) for p, d in rules], default=Frozen())
