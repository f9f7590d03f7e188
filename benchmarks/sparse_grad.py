"""Gradient cost side by side, in one run: dense `jax.grad`, `jax.grad` + optax masking of
the same scheme (what JAX users do today), and `pockjax.sparse_grad`.

Prints a markdown table (FLOPs and temporary/output memory from XLA's analyses, median and
spread of wall time over repeated runs) and writes it to benchmarks/results/sparse_grad.md.

    python benchmarks/sparse_grad.py [--repeats 20] [--layers 6] [--width 1024] [--batch 256]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pockjax as pj  # noqa: E402


def make_mlp(layers, width, batch):
    keys = jax.random.split(jax.random.PRNGKey(0), layers + 1)
    params = {f"dense_{i}": {"kernel": jax.random.normal(keys[i], (width, width)) / np.sqrt(width),
                             "bias": jnp.zeros(width)} for i in range(layers)}
    x = jax.random.normal(keys[-1], (batch, width))

    def loss(p, x):
        for i in range(layers):
            x = jax.nn.gelu(x @ p[f"dense_{i}"]["kernel"] + p[f"dense_{i}"]["bias"])
        return jnp.mean(x ** 2)
    return loss, params, x


def masked_grad(loss, scheme, params):
    """jax.grad, then optax zeroes frozen leaves and masks channels (the usual recipe)."""
    decisions = scheme.resolve(params)
    labels = jax.tree_util.tree_map(lambda d: "frozen" if isinstance(d, pj.Frozen) else "train", decisions)
    masker = optax.multi_transform({"train": optax.identity(), "frozen": optax.set_to_zero()}, labels)
    state = masker.init(params)

    def channel_mask(x, d):
        if not isinstance(d, pj.Channels):
            return jnp.ones((), x.dtype)
        axis, s, e = d.bounds(x.shape)
        idx = jnp.arange(x.shape[axis])
        shape = [1] * x.ndim
        shape[axis] = -1
        return ((idx >= s) & (idx < e)).reshape(shape).astype(x.dtype)

    def fn(p, x):
        g = jax.grad(loss)(p, x)
        g, _ = masker.update(g, state, p)
        return jax.tree_util.tree_map(lambda gi, pi, d: gi * channel_mask(pi, d), g, p, decisions)
    return fn


def measure(fn, params, x, repeats):
    compiled = jax.jit(fn).lower(params, x).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    jax.block_until_ready(compiled(params, x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, x))
        times.append(time.perf_counter() - t0)
    return {"gflop": cost["flops"] / 1e9, "temp_mib": mem.temp_size_in_bytes / 2 ** 20,
            "out_mib": mem.output_size_in_bytes / 2 ** 20, "median_ms": 1e3 * statistics.median(times),
            "spread_ms": 1e3 * (np.percentile(times, 90) - np.percentile(times, 10))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sparse_grad.md"))
    args = ap.parse_args(argv)
    loss, params, x = make_mlp(args.layers, args.width, args.batch)
    last2 = {f"dense_{i}/kernel": pj.Channels(ratio=0.25, axis="in") for i in range(args.layers - 2, args.layers)}
    schemes = {
        "Channels(1/8, in) on every kernel": pj.Scheme({"**/kernel": pj.Channels(ratio=1 / 8, axis="in")}),
        "Channels(1/8, out) on every kernel": pj.Scheme({"**/kernel": pj.Channels(ratio=1 / 8, axis="out")}),
        "last 2 kernels, Channels(1/4, in)": pj.Scheme(last2),
    }
    rows = []
    dense = measure(jax.grad(loss), params, x, args.repeats)
    rows.append(("all trainable", "jax.grad", dense))
    for name, scheme in schemes.items():
        rows.append((name, "jax.grad + optax mask", measure(masked_grad(loss, scheme, params), params, x, args.repeats)))
        rows.append((name, "pockjax.sparse_grad", measure(pj.sparse_grad(loss, scheme), params, x, args.repeats)))

    lines = [f"# sparse_grad benchmark: {args.layers} x dense {args.width}x{args.width} + gelu, batch {args.batch}",
             "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; "
             f"jax {jax.__version__}, optax {optax.__version__}, pockjax {pj.__version__}; "
             f"{args.repeats} timed runs per row after one warm-up.",
             "",
             "| scheme | method | GFLOP | temp MiB | output MiB | median ms | p90-p10 ms | time vs jax.grad |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for scheme, method, r in rows:
        lines.append(f"| {scheme} | {method} | {r['gflop']:.2f} | {r['temp_mib']:.1f} | {r['out_mib']:.1f} | "
                     f"{r['median_ms']:.1f} | {r['spread_ms']:.1f} | {dense['median_ms'] / r['median_ms']:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(args.out), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
