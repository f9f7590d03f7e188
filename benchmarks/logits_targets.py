"""`pockjax finetune --logits targets` against `--logits all` on prompt/completion data.

    python -m benchmarks logits_targets [--rounds 2] [--steps 14] [--schemes full,paper,last:1]
        [--model FOLDER] [--data FILE] [--out FILE]

Both rows run `pj.finetune` on the same model folder and data, with the same scheme,
batch 8 x 256 tokens, AdamW 1e-4, the prefix cache off; `targets` computes the output
head's logits at the positions the loss counts only (the completions), `all` at every
position. Without `--model` and `--data` the model is `finetune_speed`'s folder at the
quality benchmark's small shape (a LLaMA of 6 blocks, width 256, MLP 682, vocabulary
8192 from a BPE trained on the standard library; random weights), and the data is
prompt/completion pairs made from the standard library's functions: the signature and
docstring as the prompt, the body as the completion. Each row runs in its own process,
the rows in alternation over `--rounds`; a row's time is the median of its steps after
the third (from `metrics.jsonl`; a new batch shape's first step compiles, and the
median passes over those), and the table gives the median over rounds with their range.
Writes `benchmarks/results/logits_targets.md`.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import ROOT, commit, report_result, run_row, versions  # noqa: E402


def make_data(path: Path, limit: int = 3000) -> Path:
    """`{"prompt", "completion"}` records from the standard library's documented
    functions: the prompt is the signature and docstring, the completion the body."""
    records = []
    for file in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        source = file.read_text(errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or ast.get_docstring(node) is None:
                continue
            doc_end = node.body[0].end_lineno
            if len(node.body) < 2 or node.end_lineno - node.lineno > 40:
                continue
            prompt = "\n".join(lines[node.lineno - 1:doc_end]) + "\n"
            completion = "\n".join(lines[doc_end:node.end_lineno]) + "\n"
            records.append({"prompt": prompt, "completion": completion})
            if len(records) >= limit:
                break
        if len(records) >= limit:
            break
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def child(args) -> None:
    import pockjax as pj

    out = Path(tempfile.mkdtemp(prefix="logits-targets-")) / "run"
    pj.finetune(args.model, args.data, out, scheme=args.scheme, steps=args.steps, batch=8,
                seq=256, lr=1e-4, logits=args.logits, prefix_cache="off", plot=False,
                progress=False, compile_cache=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    seconds = [r["seconds"] for r in steps]
    times = [b - a for a, b in zip(seconds[3:], seconds[4:])]
    report_result({"s_per_step": statistics.median(times), "losses": [r["loss"] for r in steps]})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--schemes", default="full,paper,last:1")
    ap.add_argument("--model")
    ap.add_argument("--data")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "logits_targets.md"))
    ap.add_argument("--scheme", help=argparse.SUPPRESS)
    ap.add_argument("--logits", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from benchmarks.edge_speed import cpu_model
    if args.logits:
        child(args)
        return 0
    work = Path(tempfile.mkdtemp(prefix="logits-targets-"))
    if args.model is None:
        from benchmarks.finetune_speed import make_folder
        args.model = str(make_folder(work / "model", 6, 256, 8192, 256, 10))
    if args.data is None:
        args.data = str(make_data(work / "completions.jsonl"))
    schemes = [s for s in args.schemes.split(",") if s]
    results: dict = {}
    for k in range(args.rounds):
        for scheme in schemes:
            for logits in ("all", "targets"):
                r = run_row([os.path.abspath(__file__), "--model", args.model, "--data",
                             args.data, "--scheme", scheme, "--logits", logits, "--steps",
                             str(args.steps)], timeout=900)
                results.setdefault((scheme, logits), []).append(r)
                print(f"round {k + 1} {scheme} {logits}: "
                      f"{r.get('error') or round(r['s_per_step'], 3)}", file=sys.stderr,
                      flush=True)
    lines = ["# The output head at the counted positions only: `--logits targets` against "
             "`all`", "",
             f"Run at commit {commit()}; {cpu_model()}, "
             f"{os.cpu_count()} cores; {versions(('jax', 'jaxlib', 'flax', 'optax'))}. "
             f"`python -m benchmarks logits_targets --rounds {args.rounds} --steps "
             f"{args.steps} --schemes {args.schemes}` (see its docstring for the method).", "",
             "| scheme | `--logits all` s/step | `--logits targets` s/step | speed-up | "
             "final train loss, all / targets |", "|---|---:|---:|---:|---|"]
    for scheme in schemes:
        cells = []
        for logits in ("all", "targets"):
            got = results[(scheme, logits)]
            bad = [r["error"] for r in got if "error" in r]
            if bad:
                cells.append(None)
                continue
            t = [r["s_per_step"] for r in got]
            cells.append((statistics.median(t), min(t), max(t), got[0]["losses"][-1]))
        if None in cells:
            lines.append(f"| {scheme} | failed | failed | - | - |")
            continue
        (a, alo, ahi, aloss), (b, blo, bhi, bloss) = cells
        lines.append(f"| {scheme} | {a:.3f} ({alo:.3f}-{ahi:.3f}) | {b:.3f} ({blo:.3f}-{bhi:.3f})"
                     f" | {a / b:.2f}x | {aloss:.4f} / {bloss:.4f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    from pockjax.checkpoint import write_atomic
    write_atomic(args.out, text.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
