"""Activation checkpointing at TinyLlama-1.1B's shape, read from shapes only.

`pj.nnx.Trainer(..., remat=None | "blocks")` on an abstract (`nnx.eval_shape`) Llama of
TinyLlama-1.1B's shape in float32, batch 1, AdamW, the last 6 blocks trained
(`schemes.last_blocks(params, 6)`), for several sequence lengths: each row is one
`report()` (compiled temporaries, the estimate of the activations kept for the backward
pass, the compiled peak, FLOPs per step, and full training's peak). Nothing is allocated
beyond the compiler's own memory. Writes benchmarks/results/remat_table.md.

    python -m benchmarks remat_table [--llama tinyllama-1.1b] [--seqs 128,1024,2048] [--last 6]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import ROOT, commit, rss_mib, versions  # noqa: E402

KEPT = "activations kept for backward"


def _gflop(flops: float) -> str:
    g = flops / 1e9
    return f"{g:,.0f}" if g >= 100 else f"{g:.3g}"


def report(preset: str, seq: int, remat, last: int):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import pockjax as pj
    from benchmarks.paper_table import jax_loss
    from benchmarks.real_size import LR, PRESETS, WEIGHT_DECAY, llama_config
    from pockjax.models.llama import Llama

    s = dict(PRESETS[preset], seq=seq)
    model = nnx.eval_shape(lambda: Llama(llama_config(s), rngs=nnx.Rngs(0)))
    _, params, _ = pj.nnx.split(model)
    trainer = pj.nnx.Trainer(model, jax_loss("llama"),
                             optimizer=optax.adamw(LR, weight_decay=WEIGHT_DECAY),
                             scheme=pj.schemes.last_blocks(params, last), remat=remat)
    return trainer.report(jax.ShapeDtypeStruct((1, seq), jnp.int32))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from benchmarks.real_size import PRESETS

    ap.add_argument("--llama", default="tinyllama-1.1b", choices=list(PRESETS))
    ap.add_argument("--seqs", default="128,1024,2048")
    ap.add_argument("--last", type=int, help="trained blocks (default: the preset's)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "remat_table.md"))
    args = ap.parse_args(argv)
    last = args.last or PRESETS[args.llama]["last"]
    from pockjax import format_bytes
    from pockjax.checkpoint import write_atomic

    rows = ["| sequence | remat | temporaries | activations kept (estimate) | peak | GFLOP/step "
            "| full training peak |", "|---:|---|---:|---:|---:|---:|---:|"]
    start = time.time()
    for seq in (int(x) for x in args.seqs.split(",")):
        for remat in (None, "blocks"):
            r = report(args.llama, seq, remat, last)
            name = "none" if remat is None else f'`"{remat}"`'
            rows.append(f"| {seq} | {name} "
                        f"| {format_bytes(r.memory['temp'])} "
                        f"| {format_bytes(r.breakdown[KEPT])} "
                        f"| {format_bytes(r.memory['peak'])} | {_gflop(r.flops)} "
                        f"| {format_bytes(r.memory_full['peak'])} |")
            print(rows[-1], flush=True)
    text = "\n".join([
        f"# Activation checkpointing at {args.llama}'s shape (from shapes only)", "",
        f"{versions(('pockjax', 'jax', 'flax', 'optax'))}. Commit {commit()}. "
        f"`python -m benchmarks remat_table`, run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{time.time() - start:.0f} s, resident memory at the end {rss_mib() / 1024:.2f} GiB.", "",
        f"float32, batch 1, AdamW, the last {last} blocks trained; each row is "
        "`pj.nnx.Trainer(..., remat=...).report()` on an `nnx.eval_shape` model. The kept "
        "activations are an estimate (the residuals of `jax.vjp` with respect to the trained "
        "leaves), shown capped at the compiled temporaries.", "", *rows, ""])
    write_atomic(args.out, text.encode())
    print(text)


if __name__ == "__main__":
    main()
