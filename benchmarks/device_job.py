"""The device job against `pockjax finetune`: the same model folder, scheme, data and
steps, trained by JAX and by the host-cpu artifact of `pockjax export --model` through
`pockjax run` (IREE's runtime, no JAX in the process).

    python -m benchmarks device_job [--llama tinyllama-1.1b] [--scheme paper:2]
        [--frozen-dtype int4] [--steps 6] [--out FILE]

The model is a `real_size.py` shape with random weights written as a bfloat16 folder
(`lowbit_load.write_folder`, kept under `.cache/lowbit-load/`) with a byte-level BPE
tokenizer; the data are text records of random words, one batch of 1 x 128 tokens a
step. Each row runs in its own process: `finetune` (JAX), the export (not timed: it runs
once on the desktop), and `pockjax run` on the artifact. Reported: s/step (median of
the steps after the first), tokens/s, the process's peak RSS, and the last loss of
each (the two must agree). Writes `benchmarks/results/device_job_<preset>.md` and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import commit, report_result, run_row, versions  # noqa: E402
from benchmarks.common import ROOT as _ROOT  # noqa: E402

ROOT = Path(_ROOT)

SEQ, BATCH = 128, 1


def make_inputs(preset: str, work: Path) -> tuple[Path, Path]:
    """The model folder (with a tokenizer) and the JSONL data."""
    import numpy as np

    from benchmarks.lowbit_load import write_folder
    from benchmarks.quality_data import train_tokenizer, write_tokenizer

    folder = write_folder(preset, ROOT / ".cache" / "lowbit-load" / preset)
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(300)]
    texts = [" ".join(rng.choice(words, 200)) for _ in range(64)]
    if not (folder / "tokenizer.json").is_file():
        write_tokenizer(train_tokenizer(texts, 1024), folder, SEQ)
    data = work / "train.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return folder, data


def _step_times(metrics: Path) -> list[float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if r.get("loss") is not None]
    return [b["seconds"] - a["seconds"] for a, b in zip(steps, steps[1:])], steps[-1]["loss"]


def child(row: str, args) -> None:
    work, folder, data = Path(args.work), Path(args.folder), Path(args.data)
    if row == "jax finetune":
        import pockjax as pj

        out = work / "ft"
        pj.finetune(folder, data, out, scheme=args.scheme, frozen_dtype=args.frozen_dtype,
                    steps=args.steps, batch=BATCH, seq=SEQ, lr=1e-4, overwrite=True,
                    plot=False, progress=False, compile_cache=False)
    elif row == "export":
        from pockjax.finetuning._job_export import export_job

        t0 = time.perf_counter()
        export_job(folder, "host-cpu", work / "art", steps=args.steps, scheme=args.scheme,
                   frozen_dtype=args.frozen_dtype, batch=BATCH, seq=SEQ, lr=1e-4,
                   progress=False)
        report_result({"row": row, "seconds": time.perf_counter() - t0})
        return
    else:
        from pockjax.finetuning._job_run import run_job

        out = work / "run"
        run_job(work / "art", data, out, overwrite=True, progress=False)
        assert "jax" not in sys.modules, "the device run imported JAX"
    times, last = _step_times(out / "metrics.jsonl")
    median = statistics.median(times)
    report_result({"row": row, "s_per_step": median, "tokens_per_s": BATCH * SEQ / median,
                   "last_loss": last, "times": times})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama", default="tinyllama-1.1b")
    ap.add_argument("--scheme", default="paper:2")
    ap.add_argument("--frozen-dtype", default="int4")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--work", default=str(ROOT / ".cache" / "device-job"))
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args)
        return 0
    work = Path(args.work)
    folder, data = make_inputs(args.llama, work)
    results = {}
    for row in ("jax finetune", "export", "device run"):
        cmd = ["-m", "benchmarks.device_job", "--child", row, "--work", str(work), "--folder",
               str(folder), "--data", str(data), "--scheme", args.scheme, "--frozen-dtype",
               args.frozen_dtype, "--steps", str(args.steps)]
        results[row] = run_row(cmd, timeout=7200)
        print(f"device_job: {row}: {json.dumps(results[row])[:300]}", file=sys.stderr,
              flush=True)
    from benchmarks.quality import cpu_model

    jax_row, dev = results["jax finetune"], results["device run"]
    lines = [f"# The device job against `pockjax finetune`: {args.llama}, {args.frozen_dtype} "
             f"frozen weights, scheme {args.scheme}", "",
             f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit()}. "
             f"{cpu_model()}, {os.cpu_count()} cores; Python {platform.python_version()}, "
             + versions(("jax", "jaxlib", "iree-base-runtime", "iree-base-compiler")) + ". "
             f"`python -m benchmarks device_job --llama {args.llama}` (see its docstring): "
             f"random bfloat16 weights, {args.steps} steps of {BATCH} x {SEQ} tokens, each "
             f"row in its own process; s/step is the median of the steps after the first.", "",
             "| row | s/step | tokens/s | peak RSS GiB | last loss |", "|---|---:|---:|---:|---:|"]
    for row in ("jax finetune", "device run"):
        r = results[row]
        if "error" in r:
            lines.append(f"| {row} | {r['error']} | | | |")
            continue
        lines.append(f"| {row} | {r['s_per_step']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['rss_peak_mib'] / 1024:.2f} | {r['last_loss']:.5f} |")
    if "error" not in jax_row and "error" not in dev:
        lines += ["", f"Device run against JAX: tokens/s {dev['tokens_per_s'] / jax_row['tokens_per_s']:.2f}x "
                  f"(target >= 0.8x), peak RSS {dev['rss_peak_mib'] / jax_row['rss_peak_mib']:.2f}x "
                  f"(target <= 1.1x). The export took {results['export'].get('seconds', float('nan')):.0f} s "
                  f"(peak RSS {results['export'].get('rss_peak_mib', float('nan')) / 1024:.2f} GiB), "
                  f"once, on the desktop."]
    text = "\n".join(lines) + "\n"
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"device_job_{args.llama}.md")
    from pockjax.checkpoint import write_atomic

    write_atomic(out, text.encode())
    write_atomic(out.with_suffix(".json"), (json.dumps(results, indent=1) + "\n").encode())
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
