"""AdamW's moments stored in float32, bfloat16 and int8 (`pockjax.optim.adamw(moments=)`):
the same fine-tuning runs side by side; held-out quality and the optimizer state's bytes.

    python -m benchmarks moments [--steps 300] [--seeds 0,1,2] [--tasks code,instruct]
        [--schemes full,paper] [--out FILE]

The model is the tiny LLaMA shipped with the examples (`examples/checkpoints/tiny-llama`:
4 blocks, width 128, ASCII bytes as tokens), pretrained on generated English sentences.
Two fine-tuning tasks, both held out from that pretraining:

- `code`: domain adaptation to Python. Lines of this interpreter's standard-library
  packages `json`, `email`, `logging`, `http`, `xml`, `urllib`, `importlib` (ASCII, 8 to
  79 characters), split by file: a file's SHA-256 of its path relative to the standard
  library puts it in train (80%), valid (10%) or test (10%). Metric: test loss (nats per
  token).
- `instruct`: `examples/tiny_lm.py`'s instructions (reverse the words, state a fact, add
  two numbers), with held-out prompts. Metrics: held-out loss on the answers, and exact
  match of greedy answers to 200 held-out prompts.

Every row trains the same checkpoint, on the same batches (seeded), at the same learning
rate (1e-3, constant, no weight decay: one rate for every row, since only the storage of
the optimizer's state differs), with `pj.sparse_train`. Each (task, scheme, moments)
is its own process; the seeds run in it one after the other. Reported: mean and spread
over seeds of the metrics, and the optimizer state's bytes (`pj.optim.state_bytes`).
Step times are not reported: the rows differ in storage, not in work, and this benchmark
does not run on an idle machine.

Results: `--out` (default benchmarks/results/moments.md) and its `.json`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import sysconfig

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import ROOT, commit, report_result, run_row, versions  # noqa: E402

MOMENTS = ("float32", "bfloat16", "int8")
PACKAGES = ("json", "email", "logging", "http", "xml", "urllib", "importlib")
LR, BATCH = 1e-3, 16


def code_lines() -> dict[str, list[str]]:
    """The `code` task's lines by split (train / valid / test), split by file."""
    stdlib = sysconfig.get_paths()["stdlib"]
    out = {"train": [], "valid": [], "test": []}
    for package in PACKAGES:
        for folder, _, files in sorted(os.walk(os.path.join(stdlib, package))):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, stdlib)
                h = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 10
                split = "test" if h == 0 else "valid" if h == 1 else "train"
                with open(path, encoding="utf-8", errors="replace") as f:
                    for line in f:
                        line = line.rstrip()
                        if 8 <= len(line.strip()) and len(line) < 80 and line.isascii():
                            out[split].append(line)
    return out


def task_data(task: str):
    """`(train (tokens, mask), test (tokens, mask), test pairs or None)`."""
    from examples import tiny_lm as data

    if task == "code":
        lines = code_lines()
        return (data.pack_lines(lines["train"], data.LENGTH),
                data.pack_lines(lines["test"][:2048], data.LENGTH), None)
    train, held = data.split_heldout(data.instructions(20_000))
    return (data.pack_pairs(train, data.LENGTH), data.pack_pairs(held[:1024], data.LENGTH),
            held[:200])


def fine_tune(task: str, seed: int, steps: int, make_trainer, at_use=lambda f: f):
    """One run of the shipped checkpoint on `task`'s batches (seeded):
    `make_trainer(loss, params) -> (trainer, scheme)`, `steps` steps; the test loss
    evaluated through `at_use(loss)`. Returns `(state, params, graphdef, rest, scheme,
    last metrics, test loss, test pairs)`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import pockjax as pj
    from examples import tiny_lm as data
    from pockjax.models.hf import load_llama

    (tokens, mask), (test_t, test_m), pairs = task_data(task)
    graphdef, params, rest = pj.nnx.split(load_llama(data.SHIPPED))
    loss = lambda p, b: data.lm_loss(nnx.merge(graphdef, p, rest), b)  # noqa: E731
    trainer, scheme = make_trainer(loss, params)
    state = trainer.init(params)
    batches = data.batches(tokens, mask, BATCH, seed=seed)
    for _ in range(steps):
        state, metrics = trainer(state, next(batches))
    eval_loss = jax.jit(at_use(loss))
    nll, count = 0.0, 0.0
    for i in range(0, len(test_t), 256):
        b = (jnp.asarray(test_t[i:i + 256]), jnp.asarray(test_m[i:i + 256]))
        w = float(np.sum(test_m[i:i + 256][:, 1:]))
        nll, count = nll + float(eval_loss(state.params, b)) * w, count + w
    return state, params, graphdef, rest, scheme, metrics, nll / count, pairs


def row(args) -> dict:
    import jax
    from flax import nnx

    import pockjax as pj
    from examples import tiny_lm as data

    out = {"task": args.task, "scheme": args.scheme, "moments": args.moments, "runs": []}
    for seed in [int(s) for s in args.seeds.split(",")]:
        def make(loss, params, seed=seed):
            scheme = (pj.Scheme(default=pj.Full()) if args.scheme == "full"
                      else pj.schemes.transformer(params, last=2))
            return pj.sparse_train(loss, scheme=scheme, optimizer=pj.optim.adamw(
                LR, weight_decay=0.0, moments=args.moments, seed=seed)), scheme

        state, _, graphdef, rest, _, metrics, test_loss, pairs = fine_tune(
            args.task, seed, args.steps, make)
        run = {"seed": seed, "test_loss": test_loss, "train_loss_last": float(metrics["loss"]),
               "state_bytes": pj.optim.state_bytes(state.opt_state),
               "trained_params": int(sum(x.size for x in jax.tree.leaves(
                   pj.trainable_view(state.params, state.scheme))))}
        if pairs is not None:
            run["exact_match"] = data.exact_match(nnx.merge(graphdef, state.params, rest),
                                                  pairs)[0]
        out["runs"].append(run)
        print(f"{args.task} {args.scheme} {args.moments} seed {seed}: {run}", file=sys.stderr,
              flush=True)
    return out


def summary(rows: list[dict]) -> list[str]:
    lines = ["| task | scheme | moments | test loss (mean ± sd) | exact match | vs float32 | "
             "optimizer state |", "|---|---|---|---:|---:|---:|---:|"]
    base = {(r["task"], r["scheme"]): statistics.mean(x["test_loss"] for x in r["runs"])
            for r in rows if "runs" in r and r["moments"] == "float32"}
    for r in rows:
        if "runs" not in r:
            lines.append(f"| {r.get('task')} | {r.get('scheme')} | {r.get('moments')} | "
                         f"{r['error']} | | | |")
            continue
        losses = [x["test_loss"] for x in r["runs"]]
        mean, sd = statistics.mean(losses), statistics.stdev(losses) if len(losses) > 1 else 0.0
        em = ([x["exact_match"] for x in r["runs"] if "exact_match" in x])
        em_s = f"{100 * statistics.mean(em):.1f}%" if em else "-"
        ref = base.get((r["task"], r["scheme"]))
        rel = f"{100 * (mean / ref - 1):+.2f}%" if ref else "-"
        lines.append(f"| {r['task']} | {r['scheme']} | {r['moments']} | {mean:.4f} ± {sd:.4f} "
                     f"| {em_s} | {rel} | {r['runs'][0]['state_bytes'] / 2**10:,.0f} KiB |")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--tasks", default="code,instruct")
    ap.add_argument("--schemes", default="full,paper")
    ap.add_argument("--moments", default=",".join(MOMENTS))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "moments.md"))
    ap.add_argument("--row", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--task", help=argparse.SUPPRESS)
    ap.add_argument("--scheme", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.row:
        report_result(row(args))
        return
    rows = []
    for task in args.tasks.split(","):
        for scheme in args.schemes.split(","):
            for moments in args.moments.split(","):
                cmd = ["-m", "benchmarks.moments", "--row", "--task", task, "--scheme", scheme,
                       "--moments", moments, "--steps", str(args.steps), "--seeds", args.seeds]
                result = run_row(cmd, timeout=3600)
                result.setdefault("task", task), result.setdefault("scheme", scheme)
                result.setdefault("moments", moments)
                rows.append(result)
                print(summary(rows)[-1], flush=True)
    lines = code_lines()
    head = [
        "# AdamW's moments in float32, bfloat16 and int8",
        "",
        f"`python -m benchmarks moments --steps {args.steps} --seeds {args.seeds}` at commit "
        f"{commit()}; {versions(['jax', 'optax', 'flax'])}; Python {sys.version.split()[0]}.",
        f"Code task: {len(lines['train']):,} train and {len(lines['test']):,} test lines "
        f"(first 2,048 evaluated) from the standard library's {', '.join(PACKAGES)}.",
        f"{args.steps} steps of batch {BATCH}, AdamW {LR} constant, no weight decay; "
        "the optimizer state counts the two moments and the step count (the trained weights "
        "are float32 in every row and not counted).",
        "",
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(head + summary(rows)) + "\n")
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({"steps": args.steps, "seeds": args.seeds, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
