"""The prefix cache at LLaMA shapes on this CPU: a later epoch's step through
`pockjax.prefix.PrefixCachedTrainer` against the uncached step, side by side.

    python -m benchmarks prefix_cache [--llama tinyllama-1.1b] [--schemes last-k,paper]
        [--frozen-dtype float32|bfloat16] [--steps 3] [--rounds 2] [--out FILE]

Rows: for each scheme, `uncached` (the `sparse_train` step) and `cached` (the same
trainer through the prefix cache), each in its own process, alternating within each
round. A row builds the model as `benchmarks/real_size.py` does (random weights made
leaf by leaf; `--frozen-dtype bfloat16` stores the frozen weights in bfloat16 and
multiplies in bfloat16 with float32 accumulation), makes `steps` + 1 distinct batches of
random tokens (batch 1, sequence 128) and trains on each once (the first epoch; its
first step compiles and is left out) and on the same batches again (a later epoch: the
cached row reads the prefix's output back). Reported per row: the median step time of
each epoch, tokens/s, peak RSS and the losses (cached and uncached must agree: on this
CPU they are equal); and the FLOP bound `PrefixReport` computes from the traced
programs: a cached step's FLOPs over the uncached step's.

Results: `--out` (default benchmarks/results/prefix_cache_<preset>.md) and its `.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (ROOT, commit, peak_rss_mib, report_result, run_row,  # noqa: E402
                               versions)

SCHEMES = ("last-k", "paper")


def build(preset: str, scheme_name: str, frozen_dtype: str, batches: int):
    """`(trainer, state, batches)`: `benchmarks/real_size.py`'s model at `preset` (random
    weights made leaf by leaf), the "paper" (last 2 blocks) or "last-k" scheme, frozen
    weights in `frozen_dtype` (bfloat16: bfloat16 matmuls, float32 accumulation), AdamW,
    and `batches` distinct batches of random tokens."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import pockjax as pj
    from benchmarks import real_size
    from benchmarks.paper_table import jax_loss, make_batch

    s = real_size.PRESETS[preset]
    scheme_fn = ((lambda p: pj.schemes.transformer(p, last=2)) if scheme_name == "paper"
                 else (lambda p: pj.schemes.last_blocks(p, s["last"])))
    bf16 = frozen_dtype == "bfloat16"
    graphdef, _, scheme, arrays = real_size.build_params(
        s, scheme_fn, jnp.bfloat16 if bf16 else None, jnp.float32 if bf16 else None,
        narrow="native" if bf16 else "upcast")
    lm_loss = jax_loss("llama")
    trainer = pj.sparse_train(lambda p, t: lm_loss(nnx.merge(graphdef, p), t),
                              optimizer=optax.adamw(real_size.LR,
                                                    weight_decay=real_size.WEIGHT_DECAY),
                              scheme=scheme)
    first = make_batch("llama", s)
    return (trainer, trainer.init(arrays(), copy=False),
            [jnp.asarray(np.roll(first, k, axis=1)) for k in range(batches)])


def row(args) -> dict:
    import jax

    import pockjax as pj
    from pockjax.prefix import PrefixCachedTrainer

    trainer, state, batches = build(args.llama, args.scheme, args.frozen_dtype, args.steps + 1)
    scheme = trainer.scheme
    state = [state]
    step_fn, out = trainer, {}
    report = PrefixCachedTrainer(trainer).report(state[0], batches[0])
    out.update(prefix_share=report.share, bound=report.bound, cut_bytes=report.bytes_per_example,
               step_gflop=report.step_flops / 1e9, suffix_gflop=report.suffix_flops / 1e9,
               trained_params=sum(int(np.prod(x.shape)) for x in
                                  jax.tree_util.tree_leaves(pj.trainable_view(state[0].params, scheme))))
    if args.cached:
        step_fn = PrefixCachedTrainer(trainer, budget_bytes=2**30)

    def step(b):
        t = time.perf_counter()
        state[0], m = step_fn(state[0], b)
        loss = float(m["loss"])
        return loss, time.perf_counter() - t

    losses, first_epoch, later = [], [], []
    for b in batches:
        loss, t = step(b)
        losses.append(loss)
        first_epoch.append(t)
    for b in batches:
        loss, t = step(b)
        losses.append(loss)
        later.append(t)
    return {**out, "losses": losses, "first_epoch_s": first_epoch[1:], "later_epoch_s": later,
            "compile_step_s": first_epoch[0], "rss_peak_mib": peak_rss_mib()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama", default="tinyllama-1.1b",
                    choices=("smoke", "tinyllama-1.1b", "llama2-7b"))
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--frozen-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--steps", type=int, default=3, help="timed steps per epoch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out")
    ap.add_argument("--row", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scheme", help=argparse.SUPPRESS)
    ap.add_argument("--cached", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.row:
        report_result(row(args))
        return
    schemes = [x for x in args.schemes.split(",") if x]
    unknown = sorted(set(schemes) - set(SCHEMES))
    if unknown:
        sys.exit(f"--schemes: unknown {unknown}; choose from {', '.join(SCHEMES)}")
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"prefix_cache_{args.llama}.md")
    results: dict = {}
    for r in range(args.rounds):
        for scheme in schemes:
            for cached in ((False, True) if r % 2 == 0 else (True, False)):
                name = f"{scheme} {'cached' if cached else 'uncached'}"
                cmd = [os.path.abspath(__file__), "--row", "--llama", args.llama, "--scheme",
                       scheme, "--frozen-dtype", args.frozen_dtype, "--steps", str(args.steps)]
                res = run_row(cmd + (["--cached"] if cached else []), args.timeout)
                results.setdefault(name, []).append(res)
                print(f"round {r + 1} {name}: " + (res.get("error") or
                      f"first epoch {statistics.median(res['first_epoch_s']):.2f} s/step, later "
                      f"{statistics.median(res['later_epoch_s']):.2f}, peak "
                      f"{res['rss_peak_mib'] / 1024:.2f} GiB"), file=sys.stderr, flush=True)
    write(out, args, schemes, results)


def _med(runs, key):
    vals = [statistics.median(r[key]) for r in runs if "error" not in r]
    return statistics.median(vals) if vals else float("nan")


def write(out: str, args, schemes, results) -> None:
    import platform

    from benchmarks import real_size

    s = real_size.PRESETS[args.llama]
    lines = [f"# The prefix cache at {args.llama}'s shape", "",
             f"`python -m benchmarks prefix_cache --llama {args.llama} --frozen-dtype "
             f"{args.frozen_dtype} --steps {args.steps} --rounds {args.rounds}` (commit "
             f"{commit()}); {platform.processor() or platform.machine()}, {os.cpu_count()} "
             f"cores; {versions(['jax', 'flax', 'optax'])}.", "",
             real_size.describe(args.llama, s).split("; sparse rows")[0] +
             f"; `last-k` trains the last {s['last']} blocks, `paper` is PockEngine's scheme "
             f"on the last 2; frozen weights in {args.frozen_dtype}. Medians over rounds of "
             f"each row's median step; each row its own process. Tokens/s: sequence x batch "
             f"tokens over the step time.", "",
             "| scheme | trained params | cut bytes/example | FLOP bound (cached/uncached) | "
             "uncached s/step | cached: first epoch s/step | cached: later epochs s/step | "
             "later/uncached | later epochs vs first (tokens/s) | peak RSS GiB uncached / "
             "cached | losses equal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for scheme in schemes:
        un, ca = results.get(f"{scheme} uncached", []), results.get(f"{scheme} cached", [])
        ok = [r for r in un + ca if "error" not in r]
        if not ok:
            errs = "; ".join(r["error"] for r in un + ca if "error" in r)
            lines.append(f"| {scheme} | failed: {errs} |" + " |" * 9)
            continue
        ref = ok[0]
        u = _med(un, "later_epoch_s")
        c1, c2 = _med(ca, "first_epoch_s"), _med(ca, "later_epoch_s")
        peak = lambda runs: max((r["rss_peak_mib"] for r in runs if "error" not in r),
                                default=float("nan")) / 1024
        same = all(r["losses"] == ok[0]["losses"] for r in ok)
        lines.append(f"| {scheme} | {ref['trained_params']:,} | {ref['cut_bytes']:,} | "
                     f"{ref['bound']:.2f} | {u:.2f} | {c1:.2f} | {c2:.2f} | {c2 / u:.2f} | "
                     f"{c1 / c2:.2f}x | {peak(un):.2f} / {peak(ca):.2f} | "
                     f"{'yes' if same else 'no'} |")
    text = "\n".join(lines) + "\n"
    with open(out, "w") as f:
        f.write(text)
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
