"""Fine-tuning at real LLaMA sizes on this machine: TinyLlama-1.1B's shape and
LLaMA-2-7B's, PyTorch against JAX and pockjax, each row in its own process under a
memory guard.

Random weights (uniform, std 0.02; norm scales 1), random tokens, batch 1, sequence
128, AdamW 1e-4 (weight decay 0.01) in every row. Rows:

- `torch full fused-adamw`, `torch full adamw`: `transformers.LlamaForCausalLM` in
  float32, every parameter trained, `torch.optim.AdamW(fused=True)` (the strongest
  PyTorch optimizer on CPU) or the default one.
- `torch lora r8 q+v`: peft LoRA r=8 on q_proj and v_proj of a float32 model;
  `torch lora r8 q+v bf16`: the same on a bfloat16 model (adapters float32).
- `torch qlora r8 q+v nf4`: QLoRA, the 4-bit peer: `transformers` loads the model with
  `BitsAndBytesConfig(load_in_4bit=True, nf4, bfloat16 compute)` (`bitsandbytes` on the
  CPU; `pip install 'pockjax[qlora]'`) from a bfloat16 folder of the same random weights
  (written once by `benchmarks/lowbit_load.py`), peft LoRA r=8 on q_proj and v_proj.
- `jax+optax last-k`: `jax.value_and_grad` with respect to the last k blocks only
  (the rest closed over), optax AdamW on them: plain JAX on the same trained tensors.
  `jax+optax full f32`: the same construction with every parameter trained, the plain
  JAX counterpart of `pockjax full f32`.
- `pockjax sparse last-k f32`: `pockjax.sparse_train` with `schemes.last_blocks(k)`.
- `pockjax sparse last-k bf16-frozen upcast` / `bf16-matmul`: the same with every frozen
  weight stored in bfloat16 and the trained ones as float32 masters
  (`LlamaConfig(dtype=float32)` + `cast_frozen`); frozen weights are upcast per use
  (`pockjax.lowbit`'s bfloat16 nodes, float32 arithmetic) or multiplied in bfloat16
  with float32 accumulation (plain bfloat16 arrays and `narrow_matmul="native"`,
  autocast's numerics); `... bf16-matmul remat`
  also recomputes each trained block's activations in the backward pass
  (`LlamaConfig(remat="blocks")`).
- `pockjax paper last-2 bf16-frozen ...`: PockEngine's transformer scheme (attention and
  the first MLP linears of the last 2 blocks) with bfloat16 frozen weights.
- `pockjax paper last-2 int4-frozen`, `... int8-frozen`, `pockjax sparse last-k
  int4-frozen`: frozen weights in 4 or 8 bits (`pockjax.lowbit`: int4 with a bfloat16
  scale per 64 inputs, int8 with a scale per output channel), each quantized as it is
  made and dequantized where it is used; trained weights and the arithmetic in float32.
- `... int8-moments`, `... bf16-moments`: the same with AdamW's moments stored in int8
  (block-wise) or bfloat16 (`pockjax.optim.adamw(moments=)`), float32 masters kept.
- `pockjax full f32`: every parameter, pockjax's fused step.
- `pockjax sparse last-k iree host-cpu`: the `pockjax sparse last-k f32` step exported
  with `pj.export(..., target="host-cpu")` and run by `pockjax.runtime` (IREE
  local-task) in a second process that imports no JAX: one guarded process exports
  (its time and peak RSS are recorded, and from the manifest the stream plan's
  allocation per step and whether the weight reads were tied), the next loads the
  artifact and trains. Its peak RSS is the second process's; it also records the RSS
  after loading, split into file-backed pages (the mapped `params.irpa`) and anonymous
  memory. Its losses should continue the JAX row's (same weights, same tokens). The
  results file sets it beside that row; benchmarks/results/real_size_iree.md takes it
  apart (profile, flags).
- `pockjax sparse last-k bf16-frozen upcast iree host-cpu`, `pockjax paper last-2
  bf16-frozen upcast iree host-cpu`: the same for those two upcast steps (frozen
  weights stored in bfloat16); the second is the 7B-shape artifact.

Models are built directly in their storage dtypes, one parameter at a time under
`jax.jit` (no float32 copy of the whole model), and handed to the trainer without a
copy (`init(params, copy=False)`). A JAX row compiles its step from shapes first;
when the compiled step's arguments and temporaries exceed the memory limit the row
stops there ("does not fit (compiled)"). The parent polls each row's resident memory
(`VmRSS`) and kills a row that passes `--limit-gib` (default 21), recording where it
was ("does not fit: 21.3 GiB at step 2"), so no row takes the machine down. A JAX row
also records its own `VmRSS` and high-water mark as each stage begins (compile, weights,
optimizer state, each step), which the results file turns into a table of where its
memory goes.

Every row's process runs with the allocator a user gets (`--malloc pockjax`: each
step's memory reused from the last); `--malloc hugepages` adds glibc's huge-page
tunable and `--malloc system` keeps JAX's and glibc's own settings, where XLA's step
buffers are mapped afresh each step and fault in one 4 KiB page at a time.

Results accumulate in benchmarks/results/real_size.json (one entry per preset and
row, so presets and rows can be run separately) and are written out as
benchmarks/results/real_size.md and real_size.png.

    python -m benchmarks real_size --llama tinyllama-1.1b [--rows ...] [--steps 3 --warmup 1]
    python -m benchmarks real_size --llama llama2-7b --rows "pockjax paper last-2 bf16-frozen bf16-matmul"
    python -m benchmarks real_size --llama smoke        # seconds: a tiny model, every row
    python -m benchmarks real_size --compiled           # compiled memory only, both shapes
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import ROOT, add_malloc_option, malloc_env, report_result  # noqa: E402
from benchmarks.real_size_models import IREE_ROWS, PRESETS, ROWS  # noqa: E402
from benchmarks.real_size_report import write  # noqa: E402
from benchmarks.real_size_rows import (compiled_memory_rows, iree_export, iree_run,  # noqa: E402
                                       run_jax, run_torch)
# Imported from here by the tests and the other benchmarks (`_uniform` is the tests' name).
from benchmarks.real_size_models import (  # noqa: E402,F401
    LR, WEIGHT_DECAY, build_params, describe, label, llama_config, scheme_for, torch_config,
    torch_step, uniform_noise as _uniform)
from benchmarks.real_size_report import iree_table, stages_table  # noqa: E402,F401
from benchmarks.real_size_rows import jax_row  # noqa: E402,F401

RESULTS = os.path.join(ROOT, "benchmarks", "results", "real_size")


def _machine_cpu() -> tuple[float, float, float]:
    """(wall s, CPU-s busy on the whole machine, CPU-s of this process's finished
    children), to tell how much of the machine other jobs took while a row ran."""
    import resource

    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter(), busy, kids.ru_utime + kids.ru_stime


def _others_share(before, after) -> float:
    """The share of the machine's CPU time that other jobs used between two readings."""
    wall = after[0] - before[0]
    others = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, others) / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0


# What an IREE row's export process reports (`iree_export`) that its result keeps.
EXPORT_KEYS = ("trained_params", "flags", "archive_gib", "export_s", "tied_weight_reads",
               "step_alloc_bytes")


def run_iree_row(row: str, args) -> dict:
    """Export in one guarded process, train in another; the artifact is deleted after."""
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="real-size-iree-")
    cmd = [os.path.abspath(__file__), "--llama", args.llama, "--row", row,
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--limit-gib", str(args.limit_gib), "--iree-dir", os.path.join(tmp, "artifact")]
    try:
        exported = guarded(cmd + ["--phase", "export"], args.limit_gib, args.timeout, args.env)
        if "error" in exported:
            return {**exported, "error": f"export: {exported['error']}"}
        ran = guarded(cmd + ["--phase", "run"], args.limit_gib, args.timeout, args.env)
        return {**ran, **{k: exported[k] for k in EXPORT_KEYS},
                "export_rss_peak_mib": exported["rss_peak_mib"],
                "export_wall_s": exported["wall_s"]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- the guard


def _rss_gib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def guarded(cmd: list[str], limit_gib: float, timeout: float, env: dict | None = None) -> dict:
    """Run a row process (environment `env`, default this one's); kill it above
    `limit_gib` resident or after `timeout` s.

    Returns its `report_result` dict (plus `wall_s` and the polled `rss_polled_gib`),
    or `{"error": ...}` saying where it was when it was stopped or failed."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE, env=env,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    where, result, errors = ["start"], [None], []

    def read_stdout():
        for line in proc.stdout:
            if line.startswith("STAGE "):
                where[0] = line[6:].strip()
            elif line.startswith("RESULT "):
                result[0] = json.loads(line[7:])

    def read_stderr():
        for line in proc.stderr:
            errors.append(line.rstrip())
            del errors[:-40]

    readers = [threading.Thread(target=f, daemon=True) for f in (read_stdout, read_stderr)]
    for r in readers:
        r.start()
    peak, stopped = 0.0, None
    while proc.poll() is None:
        rss = _rss_gib(proc.pid)
        peak = max(peak, rss)
        if rss > limit_gib:
            stopped = f"does not fit: {rss:.1f} GiB at {where[0]}"
        elif time.perf_counter() - t0 > timeout:
            stopped = f"timed out after {timeout:.0f} s at {where[0]}"
        if stopped:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.2)
    for r in readers:
        r.join(timeout=5)
    wall = time.perf_counter() - t0
    if stopped:
        return {"error": stopped, "rss_polled_gib": peak, "wall_s": wall}
    if result[0] is not None:
        return {**result[0], "wall_s": wall, "rss_polled_gib": peak}
    lines = [l for l in errors if l.strip()]
    tail = ([l for l in lines if "Error" in l or "error" in l] or lines or ["no output"])[-1]
    return {"error": f"exit {proc.returncode} at {where[0]}: {tail.strip()[:240]}",
            "rss_polled_gib": peak, "wall_s": wall}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama", default="tinyllama-1.1b", choices=list(PRESETS))
    ap.add_argument("--rows", default=",".join(ROWS),
                    help="comma-separated subset of: " + ", ".join(ROWS))
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps (compilation)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per row")
    ap.add_argument("--limit-gib", type=float, default=21.0,
                    help="kill a row whose resident memory passes this")
    ap.add_argument("--out", default=RESULTS + ".md")
    ap.add_argument("--fresh", action="store_true", help="forget earlier rows of this preset")
    add_malloc_option(ap)
    ap.add_argument("--compiled", action="store_true",
                    help="only compile the pockjax steps of both shapes from shapes (no "
                         "weights allocated) and record their memory")
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--phase", choices=("export", "run"), help=argparse.SUPPRESS)
    ap.add_argument("--iree-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    s = PRESETS[args.llama]
    args.env, malloc = malloc_env(args.malloc)
    if args.row:
        if args.row in IREE_ROWS:
            run = iree_export if args.phase == "export" else iree_run
        else:
            run = run_torch if args.row.startswith("torch") else run_jax
        result = run(args.row, s, args)
        report_result(result)
        return

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {ROWS}")
    store_path = os.path.splitext(args.out)[0] + ".json"
    store = {}
    if os.path.exists(store_path):
        with open(store_path) as f:
            store = json.load(f)
    from pockjax.checkpoint import write_atomic
    if args.compiled:
        store["compiled"] = compiled_memory_rows()
        write_atomic(store_path, (json.dumps(store, indent=1) + "\n").encode())
        return write(store, args)
    entry = store.get(args.llama) if not args.fresh else None
    if not entry or (entry["steps"], entry["warmup"]) != (args.steps, args.warmup):
        entry = {"rows": {}}
    for r in entry["rows"].values():  # rows kept from earlier runs keep their own time
        r.setdefault("when", f"up to {entry.get('when', 'an earlier run')}")
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    entry.update(sizes=s, steps=args.steps, warmup=args.warmup, when=now)
    store[args.llama] = entry
    for row in rows:
        print(f"[{args.llama}] {row} ...", file=sys.stderr, flush=True, end=" ")
        before = _machine_cpu()
        if row in IREE_ROWS:
            r = run_iree_row(row, args)
        else:
            cmd = [os.path.abspath(__file__), "--llama", args.llama, "--row", row,
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--limit-gib", str(args.limit_gib)]
            r = guarded(cmd, args.limit_gib, args.timeout, args.env)
        r["when"], r["others_cpu"], r["malloc"] = now, _others_share(before, _machine_cpu()), malloc
        entry["rows"][row] = r
        print(r.get("error") or f"{statistics.median(r['times']):.2f} s/step, peak "
              f"{r['rss_peak_mib'] / 1024:.2f} GiB, {r['wall_s']:.0f} s",
              file=sys.stderr, flush=True)
        write_atomic(store_path, (json.dumps(store, indent=1) + "\n").encode())
    write(store, args)


if __name__ == "__main__":
    main()
