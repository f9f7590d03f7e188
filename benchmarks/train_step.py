"""Training-step speed and memory side by side, in one run: pockjax, JAX + optax, PyTorch.

The model is an MLP of 6 dense 1024x1024 layers with gelu (batch 256, mean squared
error, Adam 1e-3), with the same weights and data for every row. Rows:

- pockjax full fine-tuning, and pockjax sparse: the kernels of the last 2 layers with
  Channels(ratio=1/4, axis="in"), everything else frozen;
- JAX + optax full, and `optax.multi_transform` training those 2 kernels whole with
  the rest set to zero (what JAX users do today);
- PyTorch eager full, and the same 2 kernels trained whole with `requires_grad=False`
  on the rest.

Each row runs in its own process, so peak resident memory (from the OS) belongs to
that row alone. Prints a markdown table and writes benchmarks/results/train_step.md.

    python benchmarks/train_step.py [--steps 30] [--warmup 5] [--layers 6] [--width 1024] [--batch 256]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (ROOT, commit, report_result, rss_mib,  # noqa: E402
                               run_row as run_process, versions)
from pockjax.checkpoint import write_atomic  # noqa: E402

PACKAGES = ("pockjax", "jax", "optax", "torch")
ROWS = ["pockjax full", "pockjax sparse", "jax+optax full", "jax+optax multi_transform",
        "torch full", "torch frozen"]
LR = 1e-3


def make_data(layers, width, batch):
    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
               for _ in range(layers)]
    biases = [np.zeros(width, np.float32) for _ in range(layers)]
    x = rng.standard_normal((batch, width)).astype(np.float32)
    y = (0.1 * rng.standard_normal((batch, width))).astype(np.float32)
    return weights, biases, x, y


def _timed(step, state, batch, steps, warmup, sync):
    losses, times = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, loss = step(state, batch)
        sync(state, loss)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return losses, times


def run_jax(row, args):
    import jax
    import jax.numpy as jnp
    import optax

    import pockjax as pj

    weights, biases, x, y = make_data(args.layers, args.width, args.batch)
    params = {f"dense_{i}": {"kernel": jnp.asarray(w), "bias": jnp.asarray(b)}
              for i, (w, b) in enumerate(zip(weights, biases))}
    batch = (jnp.asarray(x), jnp.asarray(y))
    last2 = [f"dense_{i}/kernel" for i in range(args.layers - 2, args.layers)]

    def loss(p, batch):
        h = batch[0]
        for i in range(args.layers):
            h = jax.nn.gelu(h @ p[f"dense_{i}"]["kernel"] + p[f"dense_{i}"]["bias"])
        return jnp.mean((h - batch[1]) ** 2)

    opt = optax.adam(LR)
    memory = {}
    if row.startswith("pockjax"):
        scheme = (pj.Scheme(default=pj.Full()) if row == "pockjax full" else
                  pj.Scheme({k: pj.Channels(ratio=0.25, axis="in") for k in last2}))
        trainer = pj.sparse_train(loss, optimizer=opt, scheme=scheme)
        state = trainer.init(params, copy=False)
        compiled = trainer.lower(state, batch).compile()

        def step(state, batch):
            state, metrics = compiled(state, batch)
            return state, metrics["loss"]
    else:
        if row == "jax+optax full":
            tx = opt
        else:
            labels = {k: {n: ("train" if f"{k}/{n}" in last2 else "frozen") for n in v}
                      for k, v in params.items()}
            tx = optax.multi_transform({"train": opt, "frozen": optax.set_to_zero()}, labels)

        def plain(state, batch):
            params, opt_state = state
            value, g = jax.value_and_grad(loss)(params, batch)
            updates, opt_state = tx.update(g, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), value

        state = (params, tx.init(params))
        compiled = jax.jit(plain, donate_argnums=0).lower(state, batch).compile()
        step = compiled
    m = compiled.memory_analysis()
    memory = {"temp_mib": m.temp_size_in_bytes / 2**20,
              "compiled_peak_mib": (m.argument_size_in_bytes + m.output_size_in_bytes
                                    - m.alias_size_in_bytes + m.temp_size_in_bytes) / 2**20}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    rss_before = rss_mib()
    losses, times = _timed(step, state, batch, args.steps, args.warmup,
                           lambda s, l: jax.block_until_ready((s, l)))
    return {"losses": losses, "times": times, "rss_setup_mib": rss_before,
            "gflop": float(cost["flops"]) / 1e9, **memory}


def run_torch(row, args):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(os.cpu_count() or 1)
    weights, biases, x, y = make_data(args.layers, args.width, args.batch)
    ws = [torch.nn.Parameter(torch.from_numpy(w.copy())) for w in weights]
    bs = [torch.nn.Parameter(torch.from_numpy(b.copy())) for b in biases]
    if row == "torch frozen":
        for i in range(args.layers):
            bs[i].requires_grad_(False)
            if i < args.layers - 2:
                ws[i].requires_grad_(False)
    trained = [p for p in ws + bs if p.requires_grad]
    opt = torch.optim.Adam(trained, lr=LR)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def step(state, batch):
        opt.zero_grad(set_to_none=True)
        h = batch[0]
        for w, b in zip(ws, bs):
            h = F.gelu(h @ w + b, approximate="tanh")
        loss = torch.mean((h - batch[1]) ** 2)
        loss.backward()
        opt.step()
        return state, loss.detach()

    rss_before = rss_mib()
    losses, times = _timed(step, None, (xt, yt), args.steps, args.warmup, lambda s, l: None)
    return {"losses": losses, "times": times, "rss_setup_mib": rss_before}


def child(row, args):
    report_result(run_torch(row, args) if row.startswith("torch") else run_jax(row, args))


def run_row(row, args):
    return run_process([os.path.abspath(__file__), "--row", row, "--steps", str(args.steps),
                        "--warmup", str(args.warmup), "--layers", str(args.layers),
                        "--width", str(args.width), "--batch", str(args.batch)], args.timeout)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per row")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of: " + ", ".join(ROWS))
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "train_step.md"))
    args = ap.parse_args(argv)
    if args.row:
        return child(args.row, args)

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {ROWS}")
    results = {}
    for row in rows:
        print(f"running {row} ...", file=sys.stderr, flush=True)
        results[row] = run_row(row, args)

    ok = lambda r: r in results and "error" not in results[r]
    med = lambda r: statistics.median(results[r]["times"]) * 1e3
    ref = "torch full" if ok("torch full") else None
    lines = [f"# Training step: {args.layers} x dense {args.width}x{args.width} + gelu, batch {args.batch}, Adam",
             "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; {versions(PACKAGES)}; "
             f"commit {commit()}. Each row in its own process: {args.warmup} warm-up steps, then "
             f"{args.steps} timed steps (median, and p90-p10 spread). Sparse rows train the kernels of "
             f"the last 2 layers: pockjax with Channels(1/4, in), the others whole.",
             "",
             "| row | median ms | p90-p10 ms | samples/s | speed vs torch full | GFLOP | XLA temp MiB "
             "| XLA peak MiB | RSS after setup MiB | peak RSS MiB | loss first -> last |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        r = results[row]
        if "error" in r:
            lines.append(f"| {row} | failed: {r['error']} |" + " |" * 10)
            continue
        t = np.asarray(r["times"]) * 1e3
        opt = lambda k, f="{:.1f}": f.format(r[k]) if k in r else "-"
        cells = [row, f"{med(row):.1f}", f"{np.percentile(t, 90) - np.percentile(t, 10):.1f}",
                 f"{args.batch / (med(row) / 1e3):,.0f}",
                 f"{med(ref) / med(row):.2f}x" if ref else "-",
                 opt("gflop", "{:.2f}"), opt("temp_mib"), opt("compiled_peak_mib"),
                 f"{r['rss_setup_mib']:.0f}", f"{r['rss_peak_mib']:.0f}",
                 f"{r['losses'][0]:.5f} -> {r['losses'][-1]:.5f}"]
        lines.append("| " + " | ".join(cells) + " |")

    def ratio(a, b):
        return med(b) / med(a) if ok(a) and ok(b) else float("nan")

    lines += ["",
              "Targets (speed-up = time of the other row / time of pockjax sparse):",
              "",
              f"- vs torch full fine-tuning: {ratio('pockjax sparse', 'torch full'):.2f}x (target >= 2x)",
              f"- vs jax+optax multi_transform (2 kernels whole): "
              f"{ratio('pockjax sparse', 'jax+optax multi_transform'):.2f}x (target >= 1.15x)",
              f"- vs torch frozen (2 kernels whole): {ratio('pockjax sparse', 'torch frozen'):.2f}x "
              f"(target >= 1.15x)",
              f"- pockjax full vs jax+optax full: {ratio('pockjax full', 'jax+optax full'):.2f}x "
              f"(>= 1 means no overhead)"]
    text = "\n".join(lines) + "\n"
    print(text)
    write_atomic(args.out, text.encode())


if __name__ == "__main__":
    main()
