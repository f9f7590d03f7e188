"""Export per target: compile time, vmfb and parameter sizes, step memory; for the targets
that run here, the artifact's step time against the jitted JAX step, in one run.

Runnable here: host-cpu (IREE local-task), host-vulkan and android-vulkan on this
machine's Vulkan device (Mesa's lavapipe, a CPU implementation, where there is no GPU),
android-arm64 under qemu-aarch64 (emulated: its time says nothing about a phone).

The model is the training-step benchmark's MLP (dense layers with gelu, Adam) with the
last 2 kernels trained at Channels(1/4, in). Prints a markdown table and writes
benchmarks/results/export.md.

    python benchmarks/export.py [--layers 6] [--width 1024] [--batch 256] [--steps 20]
"""
from __future__ import annotations

import argparse
import importlib.metadata
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import pockjax as pj  # noqa: E402
from pockjax.checkpoint import write_atomic  # noqa: E402

TARGETS = [("host-cpu", None), ("host-vulkan", None), ("android-arm64", None),
           ("android-vulkan", None), ("android-vulkan", "valhall"), ("jetson-cuda", None)]
ARM64_RUNTIME = os.environ.get("POCKJAX_ARM64_RUNTIME", os.path.join(ROOT, ".cache", "iree-aarch64"))


def make(layers, width, batch):
    keys = jax.random.split(jax.random.PRNGKey(0), layers + 1)
    params = {f"dense_{i}": {"kernel": jax.random.normal(keys[i], (width, width)) / np.sqrt(width),
                             "bias": jnp.zeros(width)} for i in range(layers)}
    scheme = pj.Scheme({f"dense_{i}/kernel": pj.Channels(ratio=0.25, axis="in")
                        for i in range(layers - 2, layers)})

    @pj.sparse_train(optimizer=optax.adam(1e-3), scheme=scheme)
    def trainer(p, b):
        h = b["x"]
        for i in range(layers):
            h = jax.nn.gelu(h @ p[f"dense_{i}"]["kernel"] + p[f"dense_{i}"]["bias"])
        return jnp.mean((h - b["y"]) ** 2)

    x = jax.random.normal(keys[-1], (batch, width))
    return trainer, params, {"x": x, "y": 0.1 * x}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--slow-steps", type=int, default=3,
                    help="steps for the emulated and lavapipe runs")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "export.md"))
    args = ap.parse_args(argv)
    trainer, params, batch = make(args.layers, args.width, args.batch)

    rows, dirs = [], {}
    work = tempfile.mkdtemp(prefix="pockjax-bench-")
    for target, gpu in TARGETS:
        out = os.path.join(work, f"{target}-{gpu or 'default'}")
        t0 = time.perf_counter()
        try:
            art = trainer.export(trainer.init(params), batch, target=target, out_dir=out, gpu=gpu)
        except pj.ExportError as e:
            rows.append((target, gpu, f"failed: {str(e).splitlines()[0]}", "", "", ""))
            continue
        seconds = time.perf_counter() - t0
        files, mem = art.manifest["files"], art.manifest["memory"]
        rows.append((target, gpu, f"{seconds:.1f}", f"{files['train_step.vmfb']['bytes'] / 1024:,.0f}",
                     f"{files['params.irpa']['bytes'] / 2**20:,.1f}",
                     f"{mem['peak_alloc_bytes'] / 2**20:,.1f}"))
        dirs[(target, gpu)] = out

    def timed(step, steps):
        times = []
        for i in range(steps + 2):
            t0 = time.perf_counter()
            step()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    state = trainer.init(params)
    holder = {"state": state}

    def jax_step():
        holder["state"], m = trainer(holder["state"], batch)
        jax.block_until_ready(m["loss"])

    jax_ms = timed(jax_step, args.steps)
    np_batch = {k: np.asarray(v) for k, v in batch.items()}
    runs = []
    for (target, gpu), label, open_session, steps in [
            (("host-cpu", None), "IREE local-task", lambda d: pj.runtime.load(d), args.steps),
            (("host-vulkan", None), "IREE vulkan (lavapipe)",
             lambda d: pj.runtime.load(d, device="vulkan"), args.slow_steps),
            (("android-vulkan", None), "IREE vulkan (lavapipe)",
             lambda d: pj.runtime.load(d, device="vulkan"), args.slow_steps),
            (("android-arm64", None), "iree-run-module under qemu-aarch64",
             lambda d: pj.runtime.ToolSession(d, pj.runtime.qemu_arm64(ARM64_RUNTIME)),
             args.slow_steps)]:
        if (target, gpu) not in dirs:
            continue
        try:
            sess = open_session(dirs[(target, gpu)])
            ms = timed(lambda: sess.step(np_batch), steps)
        except pj.ExportError as e:
            runs.append((target, label, f"not run: {str(e).splitlines()[0]}", "", steps))
            continue
        runs.append((target, label, f"{ms:.1f}", f"{ms / jax_ms:.2f}x", steps))
    host_ratio = next((float(r[3][:-1]) for r in runs if r[0] == "host-cpu" and r[3]), None)

    lines = [f"# Export: {args.layers} x dense {args.width}x{args.width} + gelu, batch {args.batch}, "
             "Adam, last 2 kernels Channels(1/4, in)", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores; jax {jax.__version__}, "
             f"iree-base-compiler {importlib.metadata.version('iree-base-compiler')}; "
             "median step time after 2 warm-up steps.", "",
             "| target | gpu | export s (lower + compile + write) | vmfb KiB | params.irpa MiB "
             "| step allocates MiB |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {t} | {g or '-'} | {a} | {b} | {c} | {d} |" for t, g, a, b, c, d in rows]
    lines += ["", "'step allocates': the most bytes the step allocates besides the donated state "
              "and the batch, from IREE's stream IR (the state itself is updated in place).", "",
              "| step | runs on | steps | median ms | vs JAX |", "|---|---|---:|---:|---:|",
              f"| JAX (jitted sparse_train step) | XLA CPU | {args.steps} | {jax_ms:.1f} | 1.00x |"]
    lines += [f"| {t} artifact | {label} | {n} | {ms} | {ratio} |" for t, label, ms, ratio, n in runs]
    if host_ratio is not None:
        lines += ["", f"Target: the host-cpu artifact within 1.5x of the JAX step: "
                      f"{'met' if host_ratio <= 1.5 else 'missed'} ({host_ratio:.2f}x)."]
    text = "\n".join(lines) + "\n"
    print(text)
    write_atomic(args.out, text.encode())


if __name__ == "__main__":
    main()
