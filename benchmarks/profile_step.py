"""Where a training step's time goes: XLA CPU operations, from a JAX profiler trace.

Profiles the compiled steps of `paper_table.py`'s rows that run on XLA (pockjax sparse,
pockjax full, JAX + optax full) on one of its workloads, in one process: a few
warm-up steps, then `--steps` steps under `jax.profiler.trace`. Each operation the
XLA CPU runtime executes is an event named after its HLO instruction. Events are
summed per instruction and grouped by what the instruction computes, read from the
compiled HLO:

- "depthwise conv": a convolution with feature groups;
- "conv": any other convolution;
- "matmul": a dot;
- "elementwise/reduce", "copy/transpose", "other".

For each row, the table gives milliseconds per step per group, its share of the summed
operation time, and the median wall time of a step. It also lists the slowest
instructions. The output is written to
`benchmarks/results/profile_WORKLOAD.md`.

    python -m benchmarks profile [--workload mobilenetv2] [--quick] [--steps 5]
        [--rows "pockjax sparse,jax+optax full"]
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import ROOT, commit, versions  # noqa: E402
from benchmarks.paper_table import (describe, jax_step, make_batch, make_model,  # noqa: E402
                                    sizes)

ROWS = ["pockjax sparse", "pockjax full", "jax+optax full"]
# also accepted: the sparse step with the frozen batch norms folded (paper_table's row)
EXTRA_ROWS = ["pockjax sparse (frozen BN folded)"]
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def hlo_groups(text: str) -> dict[str, str]:
    """Instruction name -> group, for the instructions of a compiled HLO module."""
    computations: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0]:
            current = m.group(1)
            computations[current] = []
        elif current is not None:
            computations[current].append(line)

    def classify(lines: list[str], depth: int = 0) -> str | None:
        found = None
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            op = m.group(2)
            if op == "convolution":
                groups = re.search(r"feature_group_count=(\d+)", line)
                return "depthwise conv" if groups and int(groups.group(1)) > 1 else "conv"
            if op == "dot":
                found = "matmul"
            called = re.search(r"calls=%?([\w.\-]+)", line)
            if called and depth < 3 and called.group(1) in computations:
                inner = classify(computations[called.group(1)], depth + 1)
                if inner in ("depthwise conv", "conv"):
                    return inner
                found = found or inner
        return found

    out = {}
    for lines in computations.values():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name, op = m.groups()
            group = classify([line])
            if group is None:
                if op in ("copy", "transpose") or "copy" in name or "transpose" in name:
                    group = "copy/transpose"
                elif op in ("fusion", "reduce", "add", "multiply", "select", "broadcast",
                            "maximum", "exponential", "divide", "subtract"):
                    group = "elementwise/reduce"
                else:
                    group = "other"
            out[name] = group
    return out


def trace_ops(step, steps: int, directory: str) -> tuple[dict[str, float], float]:
    """Microseconds per instruction (summed over `steps`) and the median step time (s)."""
    import jax

    times = []
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    path = glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    totals: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("ph") == "X":
            totals[e["name"]] += float(e.get("dur", 0.0))
    return totals, statistics.median(times)


GROUPS = ["depthwise conv", "conv", "matmul", "elementwise/reduce", "copy/transpose", "other"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="mobilenetv2", choices=["llama", "mobilenetv2"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", help="size overrides, as paper_table's --llama / --mobilenetv2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--top", type=int, default=8, help="slowest instructions listed per row")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS + EXTRA_ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {ROWS + EXTRA_ROWS}")
    s = sizes(args.workload, args.quick, args.size)
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"profile_{args.workload}.md")

    results = {}
    for row in rows:
        print(f"[{row}] compiling and profiling ...", file=sys.stderr, flush=True)
        import jax
        import jax.numpy as jnp

        batch = jax.tree.map(jnp.asarray, make_batch(args.workload, s))
        step, compiled, _, _ = jax_step(args.workload, row, make_model(args.workload, s), batch)
        compiled = compiled()
        for _ in range(args.warmup):
            step()
        groups = hlo_groups(compiled.as_text())
        with tempfile.TemporaryDirectory(prefix="pockjax-profile-") as d:
            totals, wall = trace_ops(step, args.steps, d)
        ops = {k: v for k, v in totals.items() if k in groups}
        results[row] = (ops, groups, wall)

    lines = [f"# Where the step's time goes: {describe(args.workload, s)}", "",
             f"XLA CPU, {os.cpu_count()} cores. {versions(('jax', 'jaxlib', 'flax', 'optax'))}. "
             f"Commit {commit()}. {args.steps} profiled steps after {args.warmup} warm-up steps; "
             f"ms per step from `jax.profiler` events, one per executed HLO instruction.", "",
             "| group | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
    for g in GROUPS + ["all operations", "wall time (median)"]:
        cells = []
        for row in rows:
            ops, groups, wall = results[row]
            per_step = lambda us: us / args.steps / 1e3
            total = per_step(sum(ops.values()))
            if g == "wall time (median)":
                cells.append(f"{wall * 1e3:.1f} ms")
            elif g == "all operations":
                cells.append(f"{total:.1f} ms")
            else:
                ms = per_step(sum(v for k, v in ops.items() if groups[k] == g))
                cells.append(f"{ms:.1f} ms ({100 * ms / max(total, 1e-9):.0f}%)")
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines += ["", "Shares are of the summed operation time. XLA runs independent operations "
              "at the same time on the cores, so the sum can exceed the wall time; where it is "
              "below, the rest is dispatch and waiting."]
    for row in rows:
        ops, groups, _ = results[row]
        lines += ["", f"Slowest instructions, {row}:", ""]
        for name, us in sorted(ops.items(), key=lambda kv: -kv[1])[:args.top]:
            lines.append(f"- `{name}` ({groups[name]}): {us / args.steps / 1e3:.2f} ms")
    text = "\n".join(lines) + "\n"
    print(text)
    from pockjax.checkpoint import write_atomic

    write_atomic(out, text.encode())
    print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
