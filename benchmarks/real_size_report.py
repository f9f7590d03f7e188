"""`real_size.py`'s results page: the compiled-memory table, each preset's table of
rows with its targets and notes, where the JAX rows' memory goes, the IREE rows beside
the JAX steps they were exported from, and the chart."""
from __future__ import annotations

import os
import platform
import statistics

import numpy as np

from benchmarks.common import commit, versions
from benchmarks.paper_table_report import PACKAGES, chart
from benchmarks.real_size_models import (GIB, IREE_ROWS, LR, PRESETS, ROWS, WEIGHT_DECAY,
                                         describe, label)


# --------------------------------------------------------------------------- compiled only

# The same step compiled before frozen weights were upcast per use (commit 1fbf42a: XLA
# converted every bfloat16 weight to float32 at the top of the step).
BEFORE = {("tinyllama-1.1b", "last-6", "bf16-frozen upcast"): (4.51, 3.01),
          ("llama2-7b", "last-6", "bf16-frozen upcast"): (23.86, 20.55),
          ("llama2-7b", "paper last-2", "bf16-frozen upcast"): (15.48, 23.74)}


def compiled_table(rows: list[dict]) -> list[str]:
    lines = ["## The compiled step's memory at both shapes (from shapes only)", "",
             "XLA's `memory_analysis()` of pockjax's sparse step, sequence 128, batch 1: "
             "arguments (weights, optimizer state) and temporaries. `before` is the same "
             "step at commit 1fbf42a, when XLA converted every bfloat16 weight to float32 "
             "at the top of the step and kept the copies.", "",
             "| shape | scheme | precision | arguments GiB | temporaries GiB | total GiB "
             "| before: arguments + temporaries |", "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        before = BEFORE.get((r["preset"], r["scheme"], r["variant"]))
        lines.append(f"| {r['preset']} | {r['scheme']} | {r['variant']} | {r['args_gib']:.2f} "
                     f"| {r['temp_gib']:.2f} | {r['args_gib'] + r['temp_gib']:.2f} | "
                     + (f"{before[0]:.2f} + {before[1]:.2f} = {sum(before):.2f}" if before
                        else "") + " |")
    return lines + [""]


# --------------------------------------------------------------------------- report


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def table(name: str, s: dict, results: dict) -> list[str]:
    ok = lambda r: r in results and "error" not in results[r]
    med = lambda r: statistics.median(results[r]["times"])
    ref = "torch full fused-adamw"
    tokens = s["batch"] * s["seq"]
    lines = [f"## {describe(name, s)}", "",
             "| row | trained params | s/step (median) | min-max s | tokens/s | vs torch full "
             "fused | peak RSS GiB | compiled step GiB (args + temp) | loss first -> last |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in ROWS:
        if row not in results:
            continue
        r = results[row]
        if "error" in r:
            extra = f" (polled peak {r['rss_polled_gib']:.1f} GiB)" if r.get(
                "rss_polled_gib") and "does not fit:" not in r["error"] else ""
            compiled = (f"{r['compiled_peak_gib']:.1f} ({r['args_gib']:.1f} + "
                        f"{r['temp_gib']:.1f})" if "compiled_peak_gib" in r else "-")
            lines.append(f"| {label(row, s)} | | {_cell(r['error'] + extra)} | | | | | "
                         f"{compiled} | |")
            continue
        t = np.asarray(r["times"])
        cells = [label(row, s), f"{r['trained_params']:,}", f"{med(row):.2f}",
                 f"{t.min():.2f}-{t.max():.2f}", f"{tokens / med(row):.1f}",
                 f"{med(ref) / med(row):.2f}x" if ok(ref) else "-",
                 f"{r['rss_peak_mib'] / 1024:.2f}",
                 f"{r['compiled_peak_gib']:.2f} ({r['args_gib']:.2f} + {r['temp_gib']:.2f})"
                 if "compiled_peak_gib" in r else "-",
                 f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Targets:", ""] + targets(s, results, ok, med) + [""]
    lines += [f"{text}\n" for text in NOTES.get(name, ())]
    lines += stages_table(s, {r: results[r] for r in ROWS if ok(r) and "stages" in results[r]})
    for row in IREE_ROWS:
        if ok(row):
            lines += iree_table(name, s, row, results)
    return lines


# Measurements beside the rows (one process per run, same machine, quiet), written out
# under the targets of their preset.
NOTES = {"tinyllama-1.1b": [
    "The rows run on 2026-11-28 at 10:03 UTC ran one after another on an Intel Xeon with 2 "
    "cores, AVX-512 and AVX512-BF16; compare them with each other. Against PyTorch LoRA r8 on "
    "q, v of the bfloat16 model (2.89 GiB, 1.15 s/step), int4 frozen weights with AdamW's "
    "moments in int8 train the last 6 blocks (264M parameters, 235x LoRA's) in 2.88 GiB at "
    "3.69 s/step (3.2x slower); with float32 moments they need 4.24 GiB.",
    "The machine of these rows (from 2026-11-25) is an AMD EPYC with 2 cores, AVX-512 and "
    "AVX512-BF16; the runs up to 2026-11-24 were on an AVX2 machine. Here XLA's 2048^2 float32 "
    "product runs at 482 GFLOP/s (`matmul_peak.md`) and PyTorch's (MKL 2024.2, the CPU "
    "wheel's) at 223, a 2048x128 @ 128x5632 product at 166: the ratios against the torch "
    "rows are larger here than they were there (sparse last-6 f32 2.56 s against torch full "
    "fused 5.45 s, 2.13x; LoRA q,v 2.00 s). Against plain JAX on the same trained tensors "
    "(`jax+optax last-6`), which uses the same kernels, the sparse step is the fairer peer.",
    "Huge pages (`--malloc hugepages`, the default from 2026-11-25 08:55 UTC; rows before "
    "ran with glibc's default allocator): XLA maps the step's temporaries afresh every step "
    "and, with 4 KiB pages, they fault in one by one. f32 last-6 in alternating processes, 1 "
    "warm-up + 5 steps: glibc's default 1.51 and 1.41 s/step, huge pages 1.28 and 1.27, the "
    "same 6.67 GiB peak. The weight gradient of a gate or up projection ([128, 2048] x "
    "[128, 5632] -> [2048, 5632], 44 MiB) jitted alone: 17.4 ms (170 GFLOP/s) with 4 KiB "
    "pages, 12.3 ms with huge pages; the cliff is at glibc's largest mmap threshold "
    "(32 MiB): [2048, 3072] 3.5 and 3.6 ms, [2048, 4096] 13.1 and 6.0 ms. Every row of the "
    "08:55 run was faster than at 06:56, torch too (torch full fused 7.45 -> 6.07 s, LoRA q,v "
    "3.52 -> 3.33), the IREE runtime most (1.83 -> 1.47 s); peak RSS moved by at most "
    "0.05 GiB. From 09:30 step times varied more (CPU steal 0.3%, no compaction stalls): "
    "five later pairs with huge pages, JAX f32 1.44/1.36/1.38/1.38/1.52 s and IREE "
    "1.42/2.18/2.12/2.15/1.51 (IREE's steps alternating between about 1.45 and 2.1 s in one "
    "run); with glibc's default, JAX 1.58/1.47 and IREE 1.95/1.96. So the 70% of peak "
    "(1.24 s) and IREE's 1.19x held in the 08:55 run, not in the later ones. The table "
    "above (11:30, after the IREE export's tied weight packs) ran in quieter minutes: JAX "
    "f32 1.30 s (67% of the 486.1 GFLOP/s peak measured just after), IREE 1.38 s.",
    "Ties by data instead of optimization barriers (commit 9cfb9c1), A/B in alternating "
    "processes on this machine (glibc's default allocator), 3 rounds of 1 warm-up + 6 "
    "steps, medians: f32 last-6 "
    "1.339/1.394/1.394 -> 1.300/1.344/1.309 s, temporaries 288.1 -> 252.6 MiB, VmHWM 6.73 -> "
    "6.67 GiB, the same losses; bf16-matmul 1.179/1.183 -> 1.118/1.105 s, 5.19 -> 5.13 GiB. "
    "XLA's region-analysis copy insertion, which can be set for one executable "
    "(`jax.jit(..., compiler_options={'xla_cpu_copy_insertion_use_region_analysis': True})`), "
    "removes the same copies under barriers (1.29-1.34 s) and adds nothing on top of the "
    "data ties (1.27-1.32 s); multi-output fusion cannot be set per executable.",
    "IREE host-cpu, trained weights packed when their matmuls run (the export's "
    "`tie_weight_reads`, 2026-11-25): before, IREE packed every trained weight for the "
    "forward and the backward at the step's start, and all packed copies lived together "
    "(2.12 GB allocated per step). In alternating processes with the previous commit "
    "(0861896), 1 warm-up + 5 steps, huge pages, 11:22-11:25 UTC: 1.41 and 1.41 s/step, "
    "peak 8.11 and 8.11 GiB before; 1.42 and 1.43 s/step, peak 6.40 and 6.40 GiB after; "
    "the same six losses to the bit; the JAX step in the same minutes 1.29 s, 6.67 GiB. "
    "A pair run at 11:29: JAX 1.36 s, IREE 1.37 s (1.01x), 6.67 and 6.40 GiB. "
    "real_size_iree.md has the stream plan.",
    "The upcast bf16 step against the f32 step, rows alternating (f32 then upcast, three "
    "pairs, 1 warm-up + 5 steps, huge pages, 12:13-12:15 UTC): f32 1.40/1.40/1.40 s, upcast "
    "1.61/1.44/1.48 s (1.15x, 1.03x, 1.06x); in the full runs 1.33x (11:30) and 1.27x "
    "(08:55). One [128, 2048] @ [2048, 5632] product jitted alone: f32 7.3 ms, bf16 weights "
    "upcast 10.6 ms, upcast in 256-1408-column or 256-512-row chunks 10.3-11.3 ms, a "
    "mixed-dtype dot_general 10.6 ms, bf16 x bf16 with f32 accumulation 4.3 ms.",
    "IREE host-cpu on this machine, 8 blocks at TinyLlama-1.1B's widths (last 6 trained), "
    "one process, glibc's default allocator, medians of 5 steps: default matmul tiles "
    "1.637 s/step, "
    "`--iree-llvmcpu-matmul-tile-bytes` 1 MiB 1.441, 4 MiB (the target's) 1.457, 16 MiB 1.465, "
    "against 0.938 s for the JAX step: IREE is 1.55x behind XLA here whatever the tiles.",
    "Earlier machine (AVX2), 2026-11-24, before the data ties: pockjax full f32 against "
    "jax+optax full f32 over 8 timed steps, the rows alternating: pockjax 5.48 and 5.36 s/step, "
    "jax+optax 5.02 and 5.23 (0.95x), the same losses and compiled memory (13.51 GiB): level "
    "to a few percent.",
    "Earlier machine, 2026-11-24, before the data ties: the bf16-matmul row's peak was "
    "0.41-0.44 GiB above XLA's 4.79 GiB step (5.20 and 5.23 GiB): JAX after import 0.16 GiB "
    "(mostly libjax_common.so's code), its CPU client and the abstract model 0.06, the "
    "compiled executable 0.035 and compilation's leftovers 0.04, allocating weights and "
    "optimizer state 0.02 (no transient copy), then in the step XLA's temporaries, 0.07 of "
    "runtime buffers outside its memory analysis and 0.01-0.03 of allocator creep. Tried and "
    "not adopted: JAX's caches freed after compiling -0.007 GiB; malloc_trim before the steps "
    "-0.02; one malloc arena -0.016; a fixed mmap threshold -0.03 with steps 10-15% slower; "
    "`LlamaConfig(remat=\"block\")` 5.13 GiB at 2.07 s/step (5.09 with the two allocator "
    "settings)."]}


def stages_table(s: dict, results: dict) -> list[str]:
    """Where a JAX row's resident memory comes from, stage by stage (its `stages`, as
    `real_size_rows.stage` recorded them)."""
    if not results:
        return []
    lines = ["### Where the JAX rows' memory goes", "",
             "The row process's resident memory (VmRSS) as each stage begins, and its high-water "
             "mark (VmHWM) after the first step and at the end, GiB. The step is compiled from "
             "shapes before any weight exists, then the compiler's freed heap is handed back; "
             "`runtime` is what the process holds beyond the weights and optimizer state when "
             "the first step starts (JAX, the compiled executable, allocator slack), `in-step` "
             "the peak's excess over the resident state (XLA's temporaries plus the runtime's "
             "own buffers).", "",
             "| row | after imports | compiling (peak) | compiled | + weights | + optimizer state "
             "| peak after step 1 | peak | peak during | runtime | in-step | compiled step "
             "(args + temp) |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for row, r in results.items():
        at = {name: (rss, hwm) for name, rss, hwm in r["stages"]}
        if not all(k in at for k in ("weights", "optimizer state", "step 1", "step 2", "end")):
            continue
        state, peak = at["step 1"][0], at["end"][1]
        # the peak happened in the stage before the first one that began at it
        names = [name for name, _, _ in r["stages"]]
        during = names[max(0, next(i for i, (_, _, hwm) in enumerate(r["stages"])
                                   if hwm >= peak) - 1)]
        in_step = f"{peak - state:.2f}" if during.startswith("step") else "-"
        lines.append(
            f"| {label(row, s)} | {r['rss_imports_mib'] / 1024:.2f} | {at['weights'][1]:.2f} | "
            f"{at['weights'][0]:.2f} | {at['optimizer state'][0]:.2f} | {state:.2f} | "
            f"{at['step 2'][1]:.2f} | {peak:.2f} | {during} | {state - r['args_gib']:.2f} | "
            f"{in_step} | {r['compiled_peak_gib']:.2f} ({r['args_gib']:.2f} + "
            f"{r['temp_gib']:.2f}) |")
    return lines + [""]


# The IREE row before this round (commit a79edb5): the runtime copied `init()`'s state
# through numpy into second device buffers and kept every page of the mapped archive it
# had read, and the host-cpu target used IREE's default matmul tiles. Measured on the
# same artifact with `pockjax.runtime` (1 warm-up + 3 steps, one process each) at
# 2026-11-24 04:00 UTC, a minute after the rows above, with the machine otherwise idle.
IREE_BEFORE = {"tinyllama-1.1b": {"text": (
    "Before (commit a79edb5): 3.81 s/step (7.5 CPU-s), RSS after loading 11.98 GiB (5.84 "
    "file-backed + 6.13 anonymous), peak RSS 14.97 GiB, the same losses. The runtime of "
    "this commit with IREE's default matmul tiles: 4.03 s/step, peak 8.27 GiB; with "
    "`--iree-llvmcpu-matmul-tile-bytes=4194304` as well (the flags of the row above), in the "
    "same minutes: 3.10 s/step (6.0 CPU-s), peak 8.13 GiB. real_size_iree.md has the dispatch "
    "profile and the flags tried.")}}


def _plan_text(r: dict) -> str:
    """The compiled stream plan's per-step allocation, where the row recorded it."""
    from pockjax import format_bytes

    if r.get("step_alloc_bytes") is None:
        return ""
    how = ("its trained weights' matmul reads tied (`tie_weight_reads`)"
           if r["tied_weight_reads"] else "the untied step (the export's choice)")
    return (f" The step allocates {format_bytes(r['step_alloc_bytes'])} beside its state (stream "
            f"plan), {how}.")


def iree_table(name: str, s: dict, row: str, results: dict) -> list[str]:
    """The IREE row beside the JAX step it was exported from."""
    r, jax_row = results[row], IREE_ROWS[row]
    j = results.get(jax_row) if jax_row in results and "error" not in results[jax_row] else None
    med = lambda x: statistics.median(x["times"])
    gib = lambda x: x["rss_peak_mib"] / 1024
    load = r["rss_load_gib"]
    lines = [f"### {label(row, s)} beside {label(jax_row, s)}", "",
             f"Exported in {r['export_s']:.0f} s (that process's peak RSS "
             f"{r['export_rss_peak_mib'] / 1024:.2f} GiB, the JAX state included); "
             f"`params.irpa` {r['archive_gib']:.2f} GiB; compiler flags "
             f"`{' '.join(r['flags'])}`.{_plan_text(r)} The runtime process imports "
             f"{'JAX too' if r.get('imports_jax') else 'no JAX'}; it loads the artifact in "
             f"{r['load_s']:.1f} s (hashing the archive included).", "",
             "| | JAX (XLA) step | IREE host-cpu step | IREE / JAX |", "|---|---:|---:|---:|"]
    for what, value in (("s/step (median)", med), ("peak RSS GiB", gib)):
        lines.append(f"| {what} | {value(j):.2f} | {value(r):.2f} | {value(r) / value(j):.2f}x |"
                     if j else f"| {what} | - | {value(r):.2f} | - |")
    lines.append(f"| RSS after loading GiB (file-backed + anonymous) | - | {load['total']:.2f} "
                 f"({load['file']:.2f} + {load['anon']:.2f}) | |")
    end = r["rss_end_gib"]
    lines.append(f"| RSS after the last step GiB (file-backed + anonymous) | - | "
                 f"{end['total']:.2f} ({end['file']:.2f} + {end['anon']:.2f}) | |")
    if j:
        n = min(len(j["losses"]), len(r["losses"]))
        diff = max(abs(a - b) for a, b in zip(j["losses"][:n], r["losses"][:n]))
        lines.append(f"| losses | {' '.join(f'{x:.4f}' for x in j['losses'])} | "
                     f"{' '.join(f'{x:.4f}' for x in r['losses'])} | max diff {diff:.1e} |")
    if j and "others_cpu" in j and "others_cpu" in r:
        lines += ["", f"Other jobs on the machine used {100 * j['others_cpu']:.0f}% of its CPU "
                      f"time while the JAX row ran and {100 * r['others_cpu']:.0f}% during the "
                      f"IREE row (both slow down when they do)."]
    before = IREE_BEFORE.get(name) if row == "pockjax sparse last-k iree host-cpu" else None
    if before:
        lines += ["", before["text"]]
    return lines + [""]


def targets(s: dict, results: dict, ok, med) -> list[str]:
    out = []
    sparse = "pockjax sparse last-k f32"
    lows = ["pockjax sparse last-k bf16-frozen upcast",
            "pockjax sparse last-k bf16-frozen bf16-matmul",
            "pockjax sparse last-k bf16-frozen bf16-matmul remat"]

    def check(what, a, b, want, value, held):
        if not (ok(a) and ok(b)):
            return
        out.append(f"- {what}: {value(a, b)} (target {want}) -> "
                   f"{'holds' if held(a, b) else 'MISSED'}")

    speed = lambda a, b: f"{med(b) / med(a):.2f}x"
    for mine in (sparse, *lows):
        check(f"{label(mine, s)} vs torch full fused-adamw, speed", mine,
              "torch full fused-adamw", ">= 3x", speed, lambda a, b: med(b) / med(a) >= 3)
        check(f"{label(mine, s)} vs torch lora r8 q+v, speed", mine, "torch lora r8 q+v",
              ">= 1.3x", speed, lambda a, b: med(b) / med(a) >= 1.3)
    rss = lambda r: results[r]["rss_peak_mib"] / 1024
    for low in lows:
        check(f"{label(low, s)} vs torch lora r8 q+v, peak RSS", low, "torch lora r8 q+v",
              "<= LoRA's", lambda a, b: f"{rss(a):.2f} vs {rss(b):.2f} GiB",
              lambda a, b: rss(a) <= rss(b))
        check(f"{label(low, s)} step vs the float32 step", low, sparse, "<= 1.15x",
              lambda a, b: f"{med(a) / med(b):.2f}x", lambda a, b: med(a) / med(b) <= 1.15)
    for iree, source in IREE_ROWS.items():
        check(f"{label(iree, s)} vs {label(source, s)}, speed", iree, source, "<= 1.3x",
              lambda a, b: f"{med(a) / med(b):.2f}x", lambda a, b: med(a) / med(b) <= 1.3)
        check(f"{label(iree, s)} vs {label(source, s)}, peak RSS", iree, source, "<= 1.2x",
              lambda a, b: f"{rss(a):.2f} vs {rss(b):.2f} GiB = {rss(a) / rss(b):.2f}x",
              lambda a, b: rss(a) / rss(b) <= 1.2)
        if "bf16-frozen" in iree:
            check(f"{label(iree, s)} vs torch lora r8 q+v, peak RSS", iree, "torch lora r8 q+v",
                  "<= LoRA's", lambda a, b: f"{rss(a):.2f} vs {rss(b):.2f} GiB",
                  lambda a, b: rss(a) <= rss(b))
    check("pockjax full f32 vs jax+optax full f32, speed", "pockjax full f32",
          "jax+optax full f32", ">= 1x", speed, lambda a, b: med(b) / med(a) >= 1)
    for paper in ROWS:
        if paper.startswith("pockjax paper") and ok(paper) and s["layers"] == 32:
            out.append(f"- {paper} at LLaMA-2-7B's shape: peak RSS {rss(paper):.2f} GiB "
                       f"(target under 22 GiB) -> {'holds' if rss(paper) < 22 else 'MISSED'}")
    return out or ["- (not enough rows measured)"]


def write(store: dict, args) -> None:
    from pockjax.checkpoint import write_atomic

    lines = ["# Fine-tuning LLaMA at real sizes on this machine", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, "
             f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.0f} GiB, "
             f"{platform.platform()}. {versions(PACKAGES)}. Commit {commit()}.", "",
             f"AdamW {LR:g} (weight decay {WEIGHT_DECAY:g}), random weights and tokens, each "
             f"row in its own process: warm-up steps (compilation included), then timed "
             f"steps, median. Peak RSS is the row process's high-water mark (`VmHWM`; rows "
             f"run before 2026-11-24 12:00 UTC read `ru_maxrss`, which also counts the "
             f"starting process's resident memory); after its first step a row hands freed "
             f"heap back to the OS; the compiled step "
             f"is XLA's `memory_analysis()` (arguments + temporaries). A row stopped by the "
             f"memory guard ({args.limit_gib:g} GiB) says where. A row's allocator setting "
             f"is given beside its run time (`--malloc`, default huge pages: the step's "
             f"buffers are mapped afresh every step, and with 4 KiB pages they fault in one "
             f"by one); rows without one ran with glibc's default. Produced by "
             f"`python -m benchmarks real_size`; see the script's docstring for the rows.", ""]
    if store.get("compiled"):
        lines += compiled_table(store["compiled"])
    for name in PRESETS:
        if name in store and name != "smoke" or (name == "smoke" and args.llama == "smoke"):
            entry = store.get(name)
            if entry:
                runs: dict[str, list[str]] = {}
                for row in ROWS:
                    if row in entry["rows"]:
                        r = entry["rows"][row]
                        key = r.get("when", entry["when"])
                        key += f" ({r['malloc']})" if "malloc" in r else ""
                        runs.setdefault(key, []).append(label(row, entry["sizes"]))
                order = sorted(runs, key=lambda w: w.removeprefix("up to "))
                when = (next(iter(runs), entry["when"]) if len(runs) <= 1 else
                        "; ".join(f"{w}: {', '.join(runs[w])}" for w in order))
                lines += [f"Run: {when}; {entry['warmup']} warm-up + {entry['steps']} "
                          f"timed steps per row.", ""]
                lines += table(name, entry["sizes"], entry["rows"])
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out
    write_atomic(out, text.encode())
    charted = {n: {label(r, e["sizes"]): v for r, v in e["rows"].items()}
               for n, e in store.items()
               if n in PRESETS and (n != "smoke" or args.llama == "smoke")}
    rows = list(dict.fromkeys(label(r, store[n]["sizes"]) for n in charted for r in ROWS))
    for res in charted.values():  # the chart shows what ran; errors read "failed"
        for r, v in res.items():
            v.setdefault("rss_peak_mib", v.get("rss_polled_gib", 0) * 1024)
    if charted:
        chart(charted, [r for r in rows if any(r in res for res in charted.values())],
              os.path.splitext(out)[0] + ".png")


