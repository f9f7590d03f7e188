"""How close the real-size sparse LLaMA step comes to this machine's float32 matmul peak.

The peak is measured here: a jitted `[n, n] @ [n, n]` float32 product (2 n^3 FLOPs),
median of `--repeats` runs, for n = 1024, 2048 and 4096; the largest rate is the peak.
The step's FLOPs come from `SparseTrainer.report()` on TinyLlama-1.1B's shape (shapes
only, nothing allocated; float32, sequence 128, batch 1, AdamW, the last 6 blocks
trained (not the head): the `pockjax sparse last-k f32` row of `benchmarks/real_size.py`), and its
time from that row in `benchmarks/results/real_size.json` (`--step-seconds` overrides).
Writes benchmarks/results/matmul_peak.md. Its products are plain jitted functions, not
pockjax steps, so glibc maps outputs of 32 MiB or more afresh each time and their 4 KiB
pages fault in one by one unless the tunable below asks for huge pages.

    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/matmul_peak.py
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import DEFAULT_MALLOC, ROOT, commit, malloc_setting, versions  # noqa: E402

ROW = "pockjax sparse last-k f32"


def matmul_rates(repeats: int) -> dict[int, float]:
    import jax
    import jax.numpy as jnp

    rates = {}
    for n in (1024, 2048, 4096):
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
        f = jax.jit(jnp.matmul)
        jax.block_until_ready(f(a, b))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(f(a, b))
            times.append(time.perf_counter() - t)
        rates[n] = 2 * n ** 3 / statistics.median(times) / 1e9
        print(f"{n}x{n} @ {n}x{n}: {rates[n]:.1f} GFLOP/s", file=sys.stderr, flush=True)
    return rates


def step_gflop() -> float:
    """The sparse row's step FLOPs per `report()`, built as `real_size.py` builds it,
    from shapes only."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import pockjax as pj
    from benchmarks.paper_table import jax_loss, make_batch
    from benchmarks.real_size import LR, PRESETS, WEIGHT_DECAY, build_params, scheme_for
    from pockjax.train import TrainState

    s = PRESETS["tinyllama-1.1b"]
    graphdef, abstract, scheme, _ = build_params(s, scheme_for(ROW, s))
    lm_loss = jax_loss("llama")

    def loss(params, tokens):
        return lm_loss(nnx.merge(graphdef, params), tokens)

    opt = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    trainer = pj.sparse_train(loss, optimizer=opt, scheme=scheme)
    state = TrainState(jax.ShapeDtypeStruct((), jnp.int32), abstract,
                       jax.eval_shape(opt.init, pj.trainable_view(abstract, scheme)), scheme)
    tokens = jnp.asarray(make_batch("llama", s))
    return trainer.report(state, tokens).flops / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--step-seconds", type=float,
                    help=f"the step's median seconds (default: the '{ROW}' row of "
                         "benchmarks/results/real_size.json)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "matmul_peak.md"))
    args = ap.parse_args(argv)
    source = "given with --step-seconds"
    seconds = args.step_seconds
    if seconds is None:
        path = os.path.join(ROOT, "benchmarks", "results", "real_size.json")
        try:
            run = json.load(open(path))["tinyllama-1.1b"]
            row = dict(run["rows"][ROW], run=run.get("when", "run time unknown"))
            row["median_s"] = statistics.median(row["times"])
        except (OSError, KeyError, TypeError, ValueError, statistics.StatisticsError) as e:
            sys.exit(f"no measured '{ROW}' row in {path} ({e!r}); run `python -m benchmarks "
                     "real_size --llama tinyllama-1.1b` first or pass --step-seconds")
        seconds = row["median_s"]
        source = (f"`{ROW}` in benchmarks/results/real_size.json (run {row['run']}, "
                  f"allocator {row.get('malloc', DEFAULT_MALLOC)})")
    rates = matmul_rates(args.repeats)
    peak = max(rates.values())
    gflop = step_gflop()
    achieved = gflop / seconds
    lines = ["# The sparse LLaMA step against this machine's matmul peak", "",
             f"{os.cpu_count()} cores. {versions(('jax', 'jaxlib', 'flax', 'optax'))}. Commit "
             f"{commit()}. `python benchmarks/matmul_peak.py`, run "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, allocator "
             f"{malloc_setting(os.environ)}.", "",
             "| float32 product | GFLOP/s (median of %d) |" % args.repeats, "|---|---:|"]
    lines += [f"| {n} x {n} @ {n} x {n} | {r:.1f} |" for n, r in rates.items()]
    lines += ["", f"TinyLlama-1.1B's shape, last 6 blocks, float32, sequence 128: "
              f"{gflop:.1f} GFLOP per step (`report()`), {seconds:.2f} s per step ({source}): "
              f"**{achieved:.1f} GFLOP/s, {100 * achieved / peak:.0f}% of the {peak:.1f} GFLOP/s "
              f"peak** (target: at least 70%).", ""]
    text = "\n".join(lines)
    print(text)
    from pockjax.checkpoint import write_atomic
    write_atomic(args.out, text.encode())


if __name__ == "__main__":
    main()
