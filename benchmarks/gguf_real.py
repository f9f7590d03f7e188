"""A real pretrained model from its GGUF file: SmolLM2-135M-Instruct (Q4_1 blocks, a Q8_0
embedding) fine-tuned by `pockjax finetune` from the file as it is stored, against the same
run from the float32 folder transformers makes of the file, and from that folder with
pockjax's own int4 frozen weights.

`python -m benchmarks gguf_real [--steps 60] [--seeds 0,1,2] [--rows gguf,float32,int4]`
`python -m benchmarks gguf_real --formats`: the frozen formats' held-out loss at step 0.

The task nobody here wrote: complete a Python function's body from its signature and
docstring, in the model's chat template, on functions of installed packages: training on
some packages, the held-out loss on others (`TRAIN_PACKAGES`, `TEST_PACKAGES`). Each row
runs in its own process; its peak resident memory, seconds per step and held-out loss
before and after are reported in `benchmarks/results/gguf_real.md`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, commit, report_result, run_row, versions
from benchmarks.quality import cpu_model
from benchmarks.quality_data import functions, package_root, python_files, read_source
from benchmarks.quality_real import SMOLLM2, float32_folder

TRAIN_PACKAGES = ("jinja2", "markdown", "click", "pygments")
TEST_PACKAGES = ("packaging", "babel")
ROWS = {"gguf": "the Q4_1 file as stored", "float32": "the float32 folder",
        "int4": "the float32 folder, --frozen-dtype int4"}


def examples(packages, cap: int, max_chars: int = 900) -> list[dict]:
    """Chat examples: the user gives a function's signature and docstring, the assistant
    answers with its body; the shortest first up to `cap`, in a fixed order."""
    out = []
    for name in packages:
        root = package_root(name)
        for rel in python_files(root):
            for prompt, completion in functions(read_source(root, rel)):
                if len(prompt) + len(completion) > max_chars:
                    continue
                out.append({"messages": [
                    {"role": "user", "content": "Complete this Python function:\n" + prompt},
                    {"role": "assistant", "content": completion.strip("\n")}]})
    out.sort(key=lambda r: (len(json.dumps(r)), json.dumps(r)))
    step = max(1, len(out) // cap)
    return out[::step][:cap]


def make_data(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    train, test = folder / "train.jsonl", folder / "test.jsonl"
    for path, rows in ((train, examples(TRAIN_PACKAGES, 800)),
                       (test, examples(TEST_PACKAGES, 64))):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return train, test


def row(args) -> None:
    import pockjax as pj

    model = SMOLLM2 if args.row == "gguf" else str(Path(args.out) / "smollm2-float32")
    out = Path(args.out) / f"run-{args.row}-{args.seed}"
    t0 = time.perf_counter()
    result = pj.finetune(model, str(Path(args.out) / "data" / "train.jsonl"), str(out),
                         valid=str(Path(args.out) / "data" / "test.jsonl"), steps=args.steps,
                         batch=args.batch, seq=args.seq, lr=args.lr, seed=args.seed,
                         frozen_dtype="int4" if args.row == "int4" else "float32",
                         overwrite=True, progress=False, plot=False)
    report_result({"row": args.row, "seed": args.seed, "s_per_step": result.seconds / result.steps,
                   "test_before": result.valid_loss_before, "test_after": result.valid_loss,
                   "trainable": result.trainable_params, "total": result.total_params,
                   "job_s": time.perf_counter() - t0})


# Frozen formats at step 0: the paper scheme's frozen weights of the float32 folder stored
# in each, the held-out loss before any training (`--formats`).
E = "embed/embedding"
FORMATS = {
    "int4, the embedding int4 (groups of 64 along the vocabulary)": {E: "int4", "**": "int4"},
    "int4, the embedding float32": {E: None, "**": "int4"},
    "int4, the embedding int8 (`--frozen-dtype int4`'s default)": {E: "int8", "**": "int4"},
    "int4:32, the embedding int4": {E: "int4:32", "**": "int4:32"},
    "int4:32, the embedding int8": {E: "int8", "**": "int4:32"},
    "int8": "int8",
    "only the embedding int4 (groups along the vocabulary)": {E: "int4"},
    "only the embedding int4 (groups along each token's row)": "rows",
}


def formats(args) -> None:
    """The held-out loss of the float32 folder with the paper scheme's frozen weights in
    each of `FORMATS`, before training, on the test split's first 64 examples."""
    import jax
    import numpy as np

    from pockjax import lowbit
    from pockjax.data import batch_at, read_jsonl
    from pockjax.finetuning._model import lm_loss, load_model
    from pockjax.finetuning._spec import SchemeSpec
    from pockjax.tokenizer import Tokenizer

    folder = str(Path(args.out) / "smollm2-float32")
    loaded = load_model(folder)
    tok = Tokenizer.from_folder(folder)
    data = read_jsonl(str(Path(args.out) / "data" / "test.jsonl"), tok, args.seq,
                      vocab_size=loaded.vocab_size)
    batches = [batch_at(data, i, 8, args.seq, seed=0, pad_id=tok.eos_id) for i in range(8)]
    scheme = SchemeSpec.parse("paper").build(loaded.params, loaded.num_layers)
    loss = jax.jit(lowbit.at_use(lambda p, b: lm_loss(loaded.apply(p, b["tokens"]),
                                                      b["tokens"], b["mask"])))

    def held(params):
        return float(np.mean([float(loss(params, b)) for b in batches]))

    base = held(loaded.params)
    rows = [("float32", base)]
    zp = lowbit.Int4(zero_point=True)
    for name, fmt in {**FORMATS, "int4 with zero points, the embedding int8": {E: "int8", "**": zp},
                      "int4 with zero points, the embedding too": {E: zp, "**": zp}}.items():
        if fmt == "rows":
            q = lowbit.quantize(loaded.params, scheme, {E: "int4"}, layouts={E: {"in": 1, "out": 0}})
        else:
            q = lowbit.quantize(loaded.params, scheme, fmt)
        rows.append((name, held(q)))
        print(f"{name}: {rows[-1][1]:.4f}", file=sys.stderr, flush=True)
    lines = ["| frozen weights of `paper` | held-out loss at step 0 | against float32 |",
             "|---|---:|---:|"]
    lines += [f"| {name} | {value:.4f} | {value - base:+.4f} |" for name, value in rows]
    head = ["# SmolLM2-135M-Instruct: frozen formats at step 0", "",
            f"`python -m benchmarks gguf_real --formats`: the float32 folder made from the "
            f"Q4_1 file, the frozen weights of `--scheme paper` stored in each format "
            f"(`pockjax.lowbit`), the held-out loss of 64 examples of the test packages "
            f"({', '.join(TEST_PACKAGES)}) before any training. The output head is tied to "
            f"the embedding. Python {platform.python_version()}; commit {commit()}.", ""]
    tail = ["", "`lowbit.Int4(zero_point=True)` (16 levels over each group's own range, an "
            "int8 zero point): per tensor its root-mean-square error is 17% below symmetric "
            "int4's on these weights, yet the loss is 0.19 nats worse. These weights are "
            "already Q4_1 values (16 levels per block of 32 inputs), and a second 16-level "
            "grid over groups of 64 leaves each group's mean error about twice symmetric "
            "int4's (on Gaussian weights the two are equal, and the zero-point format's error "
            "is lower). Before the zero point could leave 0..15 (commit 4935103), a group all "
            "on one side of 0 was clipped, and the format cost 3.3 to 4.3 nats on this model."]
    out = Path(args.results).with_name("gguf_real_formats.md")
    out.write_text("\n".join(head + lines + tail) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "gguf_real"))
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "gguf_real.md"))
    ap.add_argument("--formats", action="store_true", help="print the frozen formats' "
                    "held-out loss at step 0 (the float32 folder, the paper scheme) instead")
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.row:
        return row(args)
    out = Path(args.out)
    train, test = make_data(out / "data")
    float32_folder(out / "smollm2-float32")
    if args.formats:
        return formats(args)
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in args.rows.split(","):
            r = run_row(["-m", "benchmarks", "gguf_real", "--row", name, "--seed", str(seed),
                         "--out", str(out), "--steps", str(args.steps), "--batch",
                         str(args.batch), "--seq", str(args.seq), "--lr", str(args.lr)],
                        timeout=3600)
            r.setdefault("row", name)
            r.setdefault("seed", seed)
            print(json.dumps(r), file=sys.stderr, flush=True)
            results.append(r)
    write_report(args, results, train, test)


def write_report(args, results, train, test) -> None:
    lines = [
        "# SmolLM2-135M-Instruct from its GGUF file",
        "",
        f"`python -m benchmarks gguf_real --steps {args.steps} --seeds {args.seeds}`: "
        f"`pockjax finetune` with the default scheme (`paper`), batch {args.batch} x "
        f"{args.seq}, AdamW at {args.lr}, each row in its own process. Task: complete a "
        f"function's body from its signature and docstring, in the model's chat template; "
        f"{sum(1 for _ in open(train))} training examples from {', '.join(TRAIN_PACKAGES)}, "
        f"the held-out loss on {sum(1 for _ in open(test))} from "
        f"{', '.join(TEST_PACKAGES)}.",
        "",
        f"CPU: {cpu_model()}, {os.cpu_count()} cores; "
        f"{versions(['jax', 'gguf', 'transformers'])}; Python {platform.python_version()}; "
        f"commit {commit()}.",
        "",
        "| row | seed | peak RSS MiB | s/step | held-out loss before | after |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {ROWS[r['row']]} | {r['seed']} | {r['error']} | | | |")
            continue
        lines.append(f"| {ROWS[r['row']]} | {r['seed']} | {r['rss_peak_mib']:.0f} | "
                     f"{r['s_per_step']:.2f} | {r['test_before']:.4f} | {r['test_after']:.4f} |")
    Path(args.results).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
