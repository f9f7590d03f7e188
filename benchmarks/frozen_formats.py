"""Frozen weights stored in bfloat16, int8 and int4 (`sparse_train(frozen_dtype=)`): the
same fine-tuning runs side by side; held-out quality and the frozen weights' bytes.

    python -m benchmarks frozen_formats [--steps 300] [--seeds 0,1,2] [--tasks code]
        [--schemes paper,last:2] [--formats float32,bfloat16,int8,int4] [--out FILE]

Schemes: `paper` (PockEngine's transformer scheme on the last 2 blocks), `last:N` (the
last N blocks in full), `channels:N` (the paper's weights on the last N blocks, a quarter
of each one's output channels: each such weight is stored in the format with its
trained channels as a float32 master).

The model, tasks, data order, learning rate and evaluation are `benchmarks/moments.py`'s
(the tiny LLaMA shipped with the examples, pretrained on generated English; the `code`
task is standard-library Python held out from it, split by file; `instruct` its
instructions). The trained weights and AdamW's state are float32 in every row; only the
frozen weights' storage differs, quantized once from the pretrained float32 values
(`pockjax.lowbit`: int8 with a float32 scale per output channel, int4 with a bfloat16
scale per 64 inputs) and dequantized where each is used. Each (task, scheme, format) is
its own process; the seeds run in it one after the other. Reported: mean and spread over
seeds of the test loss, the change against the bfloat16 row paired by seed, and the
stored bytes of the frozen weights (`pockjax.lowbit.stored_bytes`).

Results: `--out` (default benchmarks/results/frozen_formats.md) and its `.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import commit, report_result, ROOT, run_row, versions  # noqa: E402
from benchmarks.moments import BATCH, LR, PACKAGES, code_lines, fine_tune  # noqa: E402

FORMATS = ("float32", "bfloat16", "int8", "int4")
BASE = "bfloat16"  # what the quality target compares against


def scheme_of(name: str, params):
    import pockjax as pj

    if name == "paper":
        return pj.schemes.transformer(params, last=2)
    if name.startswith("last:"):
        return pj.schemes.last_blocks(params, int(name.split(":")[1]))
    if name.startswith("channels:"):  # the paper's weights, a quarter of their channels
        return pj.schemes.transformer(params, last=int(name.split(":")[1]), ratio=0.25)
    raise SystemExit(f"--schemes: paper, last:N or channels:N, got {name!r}")


def row(args) -> dict:
    import jax
    import optax

    import pockjax as pj
    from pockjax import lowbit

    out = {"task": args.task, "scheme": args.scheme, "format": args.format, "runs": []}
    for seed in [int(s) for s in args.seeds.split(",")]:
        def make(loss, params):
            scheme = scheme_of(args.scheme, params)
            return pj.sparse_train(loss, scheme=scheme,
                                   optimizer=optax.adamw(LR, weight_decay=0.0),
                                   frozen_dtype=None if args.format == "float32"
                                   else args.format), scheme

        # Quantized weights dequantized where the evaluation uses them, as in training.
        state, params, _, _, scheme, metrics, test_loss, _ = fine_tune(
            args.task, seed, args.steps, make, at_use=lowbit.at_use)
        trained = int(sum(x.size for x in jax.tree.leaves(pj.trainable_view(params, scheme))))
        run = {"seed": seed, "test_loss": test_loss, "train_loss_last": float(metrics["loss"]),
               # the trained leaves are float32: the rest is the frozen weights' storage
               "frozen_bytes": lowbit.stored_bytes(state.params) - 4 * trained,
               "trained_params": trained}
        out["runs"].append(run)
        print(f"{args.task} {args.scheme} {args.format} seed {seed}: {run}", file=sys.stderr,
              flush=True)
    return out


def summary(rows: list[dict]) -> list[str]:
    lines = ["| task | scheme | frozen weights | test loss (mean ± sd) | vs bfloat16 (mean) | "
             "vs bfloat16, paired by seed | frozen bytes |", "|---|---|---|---:|---:|---|---:|"]
    base = {(r["task"], r["scheme"]): [x["test_loss"] for x in r["runs"]]
            for r in rows if "runs" in r and r["format"] == BASE}
    for r in rows:
        if "runs" not in r:
            lines.append(f"| {r.get('task')} | {r.get('scheme')} | {r.get('format')} | "
                         f"{r['error']} | | | |")
            continue
        losses = [x["test_loss"] for x in r["runs"]]
        mean, sd = statistics.mean(losses), statistics.stdev(losses) if len(losses) > 1 else 0.0
        ref = base.get((r["task"], r["scheme"]))
        rel = f"{100 * (mean / statistics.mean(ref) - 1):+.2f}%" if ref else "-"
        paired = (", ".join(f"{100 * (a / b - 1):+.2f}%" for a, b in zip(losses, ref))
                  if ref else "-")
        lines.append(f"| {r['task']} | {r['scheme']} | {r['format']} | {mean:.4f} ± {sd:.4f} | "
                     f"{rel} | {paired} | {r['runs'][0]['frozen_bytes'] / 2**10:,.0f} KiB |")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--tasks", default="code")
    ap.add_argument("--schemes", default="paper,last:2")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "frozen_formats.md"))
    ap.add_argument("--row", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--task", help=argparse.SUPPRESS)
    ap.add_argument("--scheme", help=argparse.SUPPRESS)
    ap.add_argument("--format", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.row:
        report_result(row(args))
        return
    rows = []
    for task in args.tasks.split(","):
        for scheme in args.schemes.split(","):
            for fmt in args.formats.split(","):
                cmd = ["-m", "benchmarks.frozen_formats", "--row", "--task", task, "--scheme",
                       scheme, "--format", fmt, "--steps", str(args.steps), "--seeds", args.seeds]
                result = run_row(cmd, timeout=3600)
                result.setdefault("task", task), result.setdefault("scheme", scheme)
                result.setdefault("format", fmt)
                rows.append(result)
                print(summary(rows)[-1], flush=True)
    lines = code_lines()
    head = [
        "# Frozen weights in float32, bfloat16, int8 and int4: quality after fine-tuning",
        "",
        f"`python -m benchmarks frozen_formats --steps {args.steps} --seeds {args.seeds} "
        f"--tasks {args.tasks} --schemes {args.schemes}` at commit {commit()}; "
        f"{versions(['jax', 'optax', 'flax'])}; Python {sys.version.split()[0]}.",
        f"Code task: {len(lines['train']):,} train and {len(lines['test']):,} test lines "
        f"(first 2,048 evaluated) from the standard library's {', '.join(PACKAGES)}.",
        f"{args.steps} steps of batch {BATCH}, AdamW {LR} constant, no weight decay; "
        "trained weights and AdamW's state in float32 in every row.",
        "",
    ]
    from pockjax.checkpoint import write_atomic

    write_atomic(args.out, ("\n".join(head + summary(rows)) + "\n").encode())
    write_atomic(os.path.splitext(args.out)[0] + ".json",
                 (json.dumps({"steps": args.steps, "seeds": args.seeds, "rows": rows},
                             indent=1) + "\n").encode())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
