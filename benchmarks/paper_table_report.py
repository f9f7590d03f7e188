"""`paper_table.py`'s results page: a workload's table, its checks against the targets,
and the chart."""
from __future__ import annotations

import io
import statistics

import numpy as np

from benchmarks.paper_table_workloads import (AUTO, FOLDED, FROZEN_BN_ROWS,
                                              TORCH_FRONTEND_ROWS, TORCH_FROZEN_EVAL, describe,
                                              items_per_step)

PACKAGES = ("pockjax", "jax", "jaxlib", "flax", "optax", "torch", "transformers", "peft",
            "iree-base-compiler", "iree-base-runtime")


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def step_ms(r: dict) -> float:
    """A row's step time, ms: the median of its rounds' medians (`merge_rounds`), or of
    its steps for a single round."""
    if "round_ms" in r:
        return statistics.median(r["round_ms"])
    return statistics.median(r["times"]) * 1e3


def spread_ms(r: dict) -> tuple[float, float]:
    """The rounds' range of medians, or the steps' min and max for a single round."""
    if "round_ms" in r:
        return min(r["round_ms"]), max(r["round_ms"])
    t = np.asarray(r["times"]) * 1e3
    return float(t.min()), float(t.max())


def table(workload: str, s: dict, prep: dict, results: dict, rows: list[str], args) -> list[str]:
    n, unit = items_per_step(workload, s)
    ok = lambda r: r in results and "error" not in results[r]
    med = lambda r: step_ms(results[r])
    rounds = max((len(results[r].get("round_ms", ())) for r in rows if ok(r)), default=0)
    ref = med("torch full") if ok("torch full") else None
    spread = "rounds' range" if rounds > 1 else "min-max"
    lines = [f"## {workload}: {describe(workload, s)}", "",
             f"Sparse scheme: {prep['trained_tensors']} of {prep['tensors']} parameter tensors "
             f"train. JAX first-batch loss {prep['jax_first_loss']:.6f}.", "",
             f"| row | median ms | {spread} ms | {unit} | speed vs torch full | trained params "
             f"| GFLOP | XLA temp MiB | RSS after imports MiB | peak RSS MiB "
             f"| loss step 1 -> {args.warmup + args.steps} |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        r = results[row]
        if "error" in r:
            lines.append(f"| {row} | {_cell('failed: ' + r['error'])} |" + " |" * 9)
            continue
        lo, hi = spread_ms(r)
        cells = [row, f"{med(row):.1f}", f"{lo:.1f}-{hi:.1f}",
                 f"{n / (med(row) / 1e3):,.0f}", f"{ref / med(row):.2f}x" if ref else "-",
                 f"{r['trained_params']:,}" if "trained_params" in r else "-",
                 f"{r['gflop']:.2f}" if "gflop" in r else "-",
                 f"{r['temp_mib']:.1f}" if "temp_mib" in r else "-",
                 f"{r['rss_imports_mib']:.0f}" if "rss_imports_mib" in r else "-",
                 f"{r['rss_peak_mib']:.0f}",
                 f"{r['losses'][0]:.5f} -> {r['losses'][-1]:.5f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for row in rows:
        if ok(row) and row.startswith("torch"):
            first = results[row]["losses"][0]
            want = prep["jax_first_loss_frozen_bn" if row in FROZEN_BN_ROWS else "jax_first_loss"]
            rel = abs(first - want) / abs(want)
            lines.append(f"- port check, {row}: first-batch loss {first:.6f} vs JAX "
                         f"{want:.6f} (relative difference {rel:.1e})"
                         + ("; this process imported JAX" if results[row].get("imports_jax")
                            else ""))
    for row in rows:
        if not ok(row) or row.startswith("torch") or row in TORCH_FRONTEND_ROWS:
            continue
        frozen_bn = row in FROZEN_BN_ROWS
        want = prep["jax_first_loss_frozen_bn" if frozen_bn else "jax_first_loss"]
        first = results[row]["losses"][0]
        rel = abs(first - want) / abs(want)
        lines.append(f"- same-loss check, {row}: first-batch loss {first:.6f} vs plain JAX "
                     f"{want:.6f}" + (" (flax eval-mode batch norm, not folded, in the "
                                      f"{len(prep['frozen_bn'])} frozen ones)" if frozen_bn else "")
                     + f": relative difference {rel:.1e} -> {'ok' if rel <= 1e-5 else 'DIFFERS'}")
    if any(ok(r) for r in FROZEN_BN_ROWS):
        lines.append(f"- the frozen-BN rows put {', '.join(prep['frozen_bn'])} (every batch norm "
                     "whose scale and bias the scheme freezes) in inference mode: running "
                     "statistics, not updated; their loss differs from the training-mode rows "
                     "by design")
    for mine, flax in (("pockjax.torch sparse", "pockjax sparse"),
                       ("pockjax.torch full", "pockjax full")):
        if ok(mine) and ok(flax):
            lines.append(f"- frontend overhead, {mine} (HF LlamaForCausalLM through torchax) vs "
                         f"{flax} (Flax LLaMA): {med(mine) / med(flax):.2f}x the step time, "
                         f"first loss {results[mine]['losses'][0]:.6f} vs "
                         f"{results[flax]['losses'][0]:.6f}")
    if ok(AUTO) and "backend" in results[AUTO]:
        lines.append(f"- {AUTO}: {results[AUTO]['backend']} (the measurement and the IREE "
                     "export are in the warm-up steps)")
    for row in ("pockjax sparse iree host-cpu", f"{FOLDED} iree host-cpu"):
        if ok(row):
            lines.append(f"- {row}: IREE export and compilation took "
                         f"{results[row]['export_s']:.1f} s")
    lines += ["", "Targets:", ""] + targets(workload, results, med, ok) + [""]
    return lines


def targets(workload: str, results: dict, med, ok) -> list[str]:
    out = []

    def check(name, a, b, want, fmt):
        if not (ok(a) and ok(b)):
            out.append(f"- {name}: not measured ({a} or {b} failed)")
            return
        value, held = fmt(a, b)
        out.append(f"- {name}: {value} (target {want}) -> {'holds' if held else 'MISSED'}")

    if workload == "mobilenetv2":  # issue #19's targets
        ratio = lambda a, b: (f"{med(b) / med(a):.2f}x", med(b) / med(a))
        for a, b, want in (("pockjax sparse", "torch full", 1.5),
                           ("pockjax sparse", "torch frozen", 1.15),
                           (FOLDED, "torch full", 1.5),
                           (FOLDED, TORCH_FROZEN_EVAL, 1.15),
                           ("pockjax full", "torch full", 1.0),
                           ("pockjax full", "jax+optax full", 1.0)):
            check(f"{a} vs {b}, speed", a, b, f">= {want}x",
                  lambda a, b, want=want: (ratio(a, b)[0], ratio(a, b)[1] >= want))
        for a in ("pockjax sparse", FOLDED):
            check(f"{a} vs torch full, peak RSS", a, "torch full", "< 1",
                  lambda a, b: (f"{results[a]['rss_peak_mib'] / results[b]['rss_peak_mib']:.2f}",
                                results[a]["rss_peak_mib"] < results[b]["rss_peak_mib"]))
        return out
    speed = 4.4
    check("pockjax sparse vs torch full, speed", "pockjax sparse", "torch full", f">= {speed}x",
          lambda a, b: (f"{med(b) / med(a):.2f}x", med(b) / med(a) >= speed))
    check("pockjax sparse vs torch lora r8, speed", "pockjax sparse", "torch lora r8", "> 1x",
          lambda a, b: (f"{med(b) / med(a):.2f}x", med(b) / med(a) > 1))
    check("pockjax sparse vs torch lora r8, final loss", "pockjax sparse", "torch lora r8",
          "<= LoRA's", lambda a, b: (f"{results[a]['losses'][-1]:.5f} vs "
                                     f"{results[b]['losses'][-1]:.5f}",
                                     results[a]["losses"][-1] <= results[b]["losses"][-1]))
    check("pockjax sparse vs torch full, peak RSS", "pockjax sparse", "torch full", "<= 0.5",
          lambda a, b: (f"{results[a]['rss_peak_mib'] / results[b]['rss_peak_mib']:.2f}",
                        results[a]["rss_peak_mib"] <= 0.5 * results[b]["rss_peak_mib"]))
    check("pockjax full vs jax+optax full, speed", "pockjax full", "jax+optax full", ">= 1x",
          lambda a, b: (f"{med(b) / med(a):.2f}x", med(b) / med(a) >= 1.0))
    return out


def chart(all_results: dict, rows: list[str], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(all_results)
    fig, axes = plt.subplots(len(workloads), 2, figsize=(13, 4.2 * len(workloads)), squeeze=False)
    for i, w in enumerate(workloads):
        res = all_results[w]
        names = [r for r in rows if r in res]
        good = ["error" not in res[r] for r in names]
        lat = [step_ms(res[r]) if g else 0 for r, g in zip(names, good)]
        mem = [res[r]["rss_peak_mib"] if g else 0 for r, g in zip(names, good)]
        colors = ["tab:orange" if r.startswith("torch") else "tab:green" if r.startswith(
            "pockjax") else "tab:blue" for r in names]
        for ax, values, label in ((axes[i][0], lat, "median step latency (ms)"),
                                  (axes[i][1], mem, "peak RSS (MiB)")):
            ax.barh(names, values, color=colors)
            for y, (v, g) in enumerate(zip(values, good)):
                ax.text(v, y, f" {v:.0f}" if g else " failed", va="center", fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel(label)
            ax.set_title(f"{w}: {label}")
    fig.tight_layout()
    from pockjax.checkpoint import write_atomic
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buf.getvalue())
