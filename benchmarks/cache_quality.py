"""The prefix cache over several epochs on real data: time to quality with and without it.

    python -m benchmarks cache_quality [--work DIR] [--quick] [--records 256]
        [--epochs 4] [--schemes paper,last:2] [--rounds 1] [--out FILE]

The quality benchmark's pretrained LLaMA and its domain task (`benchmarks/quality.py`,
which pretrains the model first where `--work` has none): the first `--records` training
records, seen `--epochs` times by `pockjax.finetune` (batch and sequence length as there,
AdamW at the rate the quality benchmark chose for the scheme on that task where it ran,
else 1e-3, warm-up and cosine decay), validation twice an epoch. For each scheme, two
rows, each its own process, alternating within each round: `--prefix-cache off` and
`--prefix-cache on`. The two runs compute the same losses (float32 cache; the table
says whether they were equal), so they differ only in time.

Reported per row: the median step time of the first epoch (which computes and keeps
the prefix's output) and of the later ones (which read it back), the run's training
time, peak RSS, the final validation loss, and the time to quality: seconds of training
until the validation loss first comes within 2% of the uncached run's final one, and
until it reaches that final loss (`quality.time_to_quality`, the run's own clock, from
its first step, compilation and evaluations included). The cache's FLOP bound is the one
`finetune` logs (`PrefixReport`: a cached step's FLOPs over an uncached one's).

Results: `--out` (default benchmarks/results/cache_quality.md) and its `.json`.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import pretrain as pretraining  # noqa: E402
from benchmarks import quality  # noqa: E402
from benchmarks.common import (ROOT, commit, peak_rss_mib, report_result, run_row,  # noqa: E402
                               versions)

SCHEMES = ("paper", "last:2")
METHOD_OF = {"paper": "pockjax paper", "last:2": "pockjax last:2"}  # the quality rows
DEFAULT_LR = 1e-3


def subset(cfg: dict, records: int, folder: Path) -> Path:
    """The first `records` records of the domain task's training split, as a file."""
    lines = Path(cfg["tasks"]["domain"]["train"]).read_text().splitlines()
    if len(lines) < records:
        raise SystemExit(f"--records {records}: the domain task has {len(lines)} training "
                         f"records")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"train-{records}.jsonl"
    path.write_text("\n".join(lines[:records]) + "\n")
    return path


def chosen_lr(cfg: dict, scheme: str) -> float:
    """The rate the quality benchmark chose for `scheme` on the domain task, else 1e-3."""
    if scheme not in METHOD_OF:
        return DEFAULT_LR
    lr = quality.chosen_lr(cfg, quality.method_named(METHOD_OF[scheme]), "domain")
    return DEFAULT_LR if math.isnan(lr) else lr


def row(args) -> dict:
    """One run of `pockjax.finetune`; its metrics."""
    import pockjax as pj

    cfg = json.loads(Path(args.config).read_text())
    out = Path(args.run_dir)
    lr = chosen_lr(cfg, args.scheme)
    per_epoch = args.records // cfg["batch"]
    steps = per_epoch * args.epochs
    said = io.StringIO()
    quality.reset_peak_rss()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(said):  # finetune's log lines (the cache's says its bound)
        result = pj.finetune(cfg["pretrained"], args.train, out, valid=cfg["tasks"]["domain"]["valid"],
                             scheme=args.scheme, steps=steps, batch=cfg["batch"], seq=cfg["seq"],
                             lr=lr, warmup=quality.warmup_steps(steps, cfg), schedule="cosine",
                             eval_every=max(1, per_epoch // 2), keep=1, seed=0, overwrite=True,
                             plot=False, progress=True, prefix_cache=args.cache)
    wall = time.perf_counter() - t0
    metrics = quality.read_metrics(out / "metrics.jsonl")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("loss") is not None]
    seconds = [r["seconds"] for r in train]
    durations = [b - a for a, b in zip(seconds, seconds[1:])]  # step k+1's duration
    first = durations[:per_epoch - 1]  # the first epoch after its first (compiling) step
    later = durations[per_epoch - 1:]
    cache_line = next((line.split("prefix cache", 1)[1].strip() for line in
                       said.getvalue().splitlines() if "prefix cache" in line), "")
    return {"scheme": args.scheme, "cache": args.cache, "lr": lr, "steps": steps,
            "per_epoch": per_epoch, "epochs": args.epochs,
            "epoch1_s_per_step": statistics.median(first) if first else None,
            "later_s_per_step": statistics.median(later) if later else None,
            "first_step_s": seconds[0] if seconds else None,
            "train_seconds": seconds[-1] if seconds else None, "wall_s": wall,
            "losses": [r["loss"] for r in train], "valid_curve": metrics["valid_curve"],
            "final_valid_loss": metrics["final_valid_loss"], "peak_rss_mib": peak_rss_mib(),
            "trained_params": result.trainable_params, "cache_line": cache_line}


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def write(store: dict, out: Path) -> None:
    rows = store["rows"]
    lines = ["# The prefix cache over several epochs: time to quality", "",
             f"`python -m benchmarks cache_quality --records {store['records']} --epochs "
             f"{store['epochs']} --schemes {','.join(store['schemes'])}` at commit "
             f"{store['commit']}, {store['when']}; {store['versions']}.", "",
             f"{store['cpu']}. The quality benchmark's pretrained model "
             f"({store['model']}) fine-tuned on the first {store['records']} records of its "
             f"domain task (numpy's sources), {store['epochs']} epochs of "
             f"{store['per_epoch']} steps (batch {store['batch']}, {store['seq']} tokens); "
             "validation twice an epoch. Each row its own process, the two rows of a scheme "
             "alternating. Times are the run's clock from its first step (its compilation and "
             "the evaluations included; both rows of a scheme evaluate alike).", "",
             "| scheme | prefix cache | lr | epoch 1 s/step | later epochs s/step | training s "
             "| to within 2% of final | to final loss | peak RSS MiB | final valid loss |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('scheme')} | {r.get('cache')} | {r['error']} |||||||| |")
            continue
        lines.append(
            f"| {r['scheme']} | {r['cache']} | {r['lr']:g} | {r['epoch1_s_per_step']:.3f} | "
            f"{r['later_s_per_step']:.3f} | {r['train_seconds']:.1f} | "
            f"{_fmt_s(r.get('to_margin_s'))} | {_fmt_s(r.get('to_final_s'))} | "
            f"{r['peak_rss_mib']:.0f} | {r['final_valid_loss']:.4f} |")
    lines += ["", "Per scheme (medians over rounds; ratio = uncached / cached):", ""]
    for s in store["schemes"]:
        summary = store["summary"].get(s)
        if not summary:
            continue
        lines.append(
            f"- {s}: later epochs' step {summary['later_ratio']}; time to within 2% of the "
            f"final validation loss {summary['margin_ratio']}, to the final loss "
            f"{summary['final_ratio']} (the issue's target: 2x); losses equal with and without "
            f"the cache: {summary['equal']}. finetune's log: \"prefix cache "
            f"{summary['cache_line']}\".")
    from pockjax.checkpoint import write_atomic

    write_atomic(out, ("\n".join(lines) + "\n").encode())
    write_atomic(out.with_suffix(".json"), (json.dumps(store, indent=1) + "\n").encode())


def _model_text(pre: dict) -> str:
    s = pre["settings"]
    return (f"{pre['parameters'] / 1e6:.1f}M-parameter LLaMA, {s['layers']} blocks, width "
            f"{s['hidden']}, vocabulary {s['vocab']}")


def _fmt_s(v) -> str:
    return "-" if v is None else f"{v:.1f} s"


def summarize(store: dict) -> None:
    """Time to quality per row, against the uncached runs' final validation loss."""
    rows = [r for r in store["rows"] if "error" not in r]
    store["summary"] = {}
    for s in store["schemes"]:
        off = [r for r in rows if r["scheme"] == s and r["cache"] == "off"]
        on = [r for r in rows if r["scheme"] == s and r["cache"] == "on"]
        if not off:
            continue
        final = statistics.median(r["final_valid_loss"] for r in off)
        for r in off + on:
            curve = [(seconds, step, loss) for seconds, step, loss in r["valid_curve"] if step > 0]
            r["to_margin_s"] = quality.time_to_quality(curve, final * (1 + quality.QUALITY_MARGIN))
            r["to_final_s"] = quality.time_to_quality(curve, final)
        if not on:
            continue

        def med(key, group):
            values = [r[key] for r in group if r.get(key) is not None]
            return statistics.median(values) if values else None

        store["summary"][s] = {
            "later_ratio": _ratio(med("later_s_per_step", off), med("later_s_per_step", on)),
            "margin_ratio": _ratio(med("to_margin_s", off), med("to_margin_s", on)),
            "final_ratio": _ratio(med("to_final_s", off), med("to_final_s", on)),
            "equal": all(a["losses"] == b["losses"] for a in off for b in on),
            "cache_line": next((r["cache_line"] for r in on if r["cache_line"]), "")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=pretraining.DEFAULT_WORK,
                    help=f"the quality benchmark's folder (default {pretraining.DEFAULT_WORK})")
    ap.add_argument("--quick", action="store_true",
                    help="the quality benchmark's quick preset (a tiny model): a test of the "
                         "pipeline, not a measurement")
    ap.add_argument("--records", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "cache_quality.md"))
    ap.add_argument("--row", action="store_true", help=argparse.SUPPRESS)
    for name in ("config", "train", "run-dir", "scheme", "cache"):
        ap.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.row:
        report_result(row(args))
        return
    if args.epochs < 2:
        ap.error("--epochs must be at least 2: the cache serves the epochs after the first")
    preset = "quick" if args.quick else "full"
    work = Path(args.work).resolve()
    flag = ["--quick"] if args.quick else []
    subprocess.run([sys.executable, "-m", "benchmarks.pretrain", *flag, "--work", str(work)],
                   check=True, cwd=ROOT)
    cfg, _, config = quality.prepare_runs(work, preset)
    folder = Path(cfg["runs"]) / "cache-quality"
    train = subset(cfg, args.records, folder)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    rows = []
    for _ in range(args.rounds):
        for scheme in schemes:
            for cache in ("off", "on"):
                run = folder / f"{scheme.replace(':', '-')}-{cache}"
                print(f"cache_quality: {scheme}, prefix cache {cache} ...", file=sys.stderr,
                      flush=True, end=" ")
                r = run_row(["-m", "benchmarks.cache_quality", "--row", "--config", str(config),
                             "--train", str(train), "--run-dir", str(run), "--scheme", scheme,
                             "--cache", cache, "--records", str(args.records), "--epochs",
                             str(args.epochs)], timeout=3 * 3600)
                r.setdefault("scheme", scheme)
                r.setdefault("cache", cache)
                print(r.get("error") or f"{r['train_seconds']:.1f} s, valid "
                      f"{r['final_valid_loss']:.4f}", file=sys.stderr, flush=True)
                rows.append(r)
    pre = json.loads((Path(cfg["pretrained"]) / "pretrain.json").read_text())
    store = {"records": args.records, "epochs": args.epochs, "schemes": schemes,
             "per_epoch": args.records // cfg["batch"], "batch": cfg["batch"], "seq": cfg["seq"],
             "commit": commit(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "versions": versions(["jax", "flax", "optax"]), "cpu": f"{quality.cpu_model()}, {os.cpu_count()} cores",
             "model": _model_text(pre), "rows": rows}
    summarize(store)
    write(store, Path(args.out))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
