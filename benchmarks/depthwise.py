"""Depth-wise 3x3 convolutions, 1x1 convolutions and batch norm on XLA's CPU backend:
which formulation is fastest, per direction.

Depth-wise formulations (NHWC input, one 3x3 filter per channel, padding 1):

- `shifts autodiff`: 9 shifted, strided slices times a per-channel weight, summed,
  differentiated by JAX (the slices transpose into zero-filled pads);
- `shifts custom vjp`: the same forward with `pockjax.models.mobilenetv2.depthwise_conv`'s
  hand-written backward (input gradient as shifted slices of the output gradient, by
  output phase when strided; weight gradient as 9 reductions, over chunks of images in
  a loop when the arrays are large) — what the model runs;
- `conv NHWC`: `lax.conv_general_dilated` with `feature_group_count = C`;
- `conv NCHW`: the same on NCHW data (the transposes are outside the timed function).

Point-wise (1x1, stride 1) formulations: `conv` (`lax.conv_general_dilated`), `product`
(`pockjax.models.mobilenetv2.pointwise_conv`: `[N*H*W, I] @ [I, O]`, what the model runs)
and `dot_general` (contracting the channel axis of the NHWC array in place).

Directions: forward, input gradient (VJP with respect to the input only), weight
gradient (VJP with respect to the kernel only). Batch norm (training mode, with ReLU6):
flax's `nnx.BatchNorm` differentiated by JAX against the model's `batch_norm` (closed-form
backward), forward and forward + backward. Shapes are MobileNetV2's at the paper
table's two sizes. Functions are timed interleaved, median of `--repeats`, in one
process. Writes benchmarks/results/depthwise.md.

    python benchmarks/depthwise.py [--repeats 9]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import ROOT, commit, versions  # noqa: E402

# (batch, height, width, channels, stride): MobileNetV2 width 0.5 at 64x64 (batch 8) and
# width 1.0 at 128x128 (batch 16)
SHAPES = [(8, 64, 64, 48, 2), (8, 32, 32, 72, 1), (8, 8, 8, 288, 1),
          (16, 64, 64, 96, 2), (16, 32, 32, 144, 1), (16, 8, 8, 576, 1)]


def formulations():
    import jax
    from jax import lax

    from pockjax.models import mobilenetv2 as M

    def conv_nhwc(x, w, s):
        return lax.conv_general_dilated(x, w[:, :, None, :], (s, s), ((1, 1), (1, 1)),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        feature_group_count=x.shape[-1])

    def conv_nchw(x, w, s):
        return lax.conv_general_dilated(x, w.transpose(2, 0, 1)[:, None], (s, s),
                                        ((1, 1), (1, 1)),
                                        dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                        feature_group_count=x.shape[1])

    return {"shifts autodiff": (M.depthwise_conv.fun, False), "shifts custom vjp": (M.depthwise_conv, False),
            "conv NHWC": (conv_nhwc, False), "conv NCHW": (conv_nchw, True)}, jax


def timed(fns: dict, repeats: int) -> dict:
    import jax

    for f, args in fns.values():
        jax.block_until_ready(f(*args))
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, (f, args) in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def directions(name: str, f, x, w, g) -> dict:
    """`{(name, "fwd" | "dx" | "dw"): (jitted function, args)}` for `f(x, w)`: forward,
    input gradient and weight gradient (VJPs with output gradient `g`)."""
    import jax

    return {(name, "fwd"): (jax.jit(f), (x, w)),
            (name, "dx"): (jax.jit(lambda a, b, g: jax.vjp(lambda a: f(a, b), a)[1](g)[0]),
                           (x, w, g)),
            (name, "dw"): (jax.jit(lambda a, b, g: jax.vjp(lambda b: f(a, b), b)[1](g)[0]),
                           (x, w, g))}


def depthwise_rows(repeats: int) -> list[str]:
    import jax.numpy as jnp

    forms, jax = formulations()
    lines = ["| shape N,H,W,C stride | formulation | forward ms | input grad ms | weight grad ms |",
             "|---|---|---:|---:|---:|"]
    for n, h, wd, c, s in SHAPES:
        x = jax.random.normal(jax.random.key(0), (n, h, wd, c))
        w = jax.random.normal(jax.random.key(1), (3, 3, c))
        fns = {}
        for name, (f, nchw) in forms.items():
            xi = x.transpose(0, 3, 1, 2) if nchw else x
            y = jax.eval_shape(lambda a, b, f=f: f(a, b, s), xi, w)
            g = jnp.ones(y.shape, y.dtype)
            fns.update(directions(name, lambda a, b, f=f: f(a, b, s), xi, w, g))
        t = timed(fns, repeats)
        for name in forms:
            lines.append(f"| {n},{h},{wd},{c} s{s} | {name} | {t[(name, 'fwd')]:.2f} | "
                         f"{t[(name, 'dx')]:.2f} | {t[(name, 'dw')]:.2f} |")
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


# (batch, height, width, in channels, out channels): MobileNetV2 width 1.0 at 128x128
# (batch 16): expansions of blocks 1, 2, 6 and 13, a projection of block 12
POINTWISE = [(16, 64, 64, 16, 96), (16, 32, 32, 24, 144), (16, 16, 16, 32, 192),
             (16, 8, 8, 64, 384), (16, 8, 8, 576, 96)]


def pointwise_rows(repeats: int) -> list[str]:
    import jax
    from jax import lax

    from pockjax.models import mobilenetv2 as M

    forms = {
        "conv": lambda x, k: lax.conv_general_dilated(
            x, k, (1, 1), ((0, 0), (0, 0)), dimension_numbers=("NHWC", "HWIO", "NHWC")),
        "product": M.pointwise_conv,
        "dot_general": lambda x, k: lax.dot_general(x, k[0, 0], (((3,), (0,)), ((), ()))),
    }
    lines = ["| shape N,H,W,I -> O | 1x1 formulation | forward ms | input grad ms | "
             "weight grad ms |", "|---|---|---:|---:|---:|"]
    for n, h, wd, ci, co in POINTWISE:
        x = jax.random.normal(jax.random.key(0), (n, h, wd, ci))
        k = jax.random.normal(jax.random.key(1), (1, 1, ci, co))
        g = jax.random.normal(jax.random.key(2), (n, h, wd, co))
        fns = {}
        for name, f in forms.items():
            fns.update(directions(name, f, x, k, g))
        t = timed(fns, repeats)
        for name in forms:
            lines.append(f"| {n},{h},{wd},{ci} -> {co} | {name} | {t[(name, 'fwd')]:.2f} | "
                         f"{t[(name, 'dx')]:.2f} | {t[(name, 'dw')]:.2f} |")
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


def batchnorm_rows(repeats: int) -> list[str]:
    import jax
    import jax.numpy as jnp

    from pockjax.models import mobilenetv2 as M

    def flax_bn(x, scale, bias):
        mean, var = M.batch_statistics(x)
        return M.normalized(x, mean, var, scale, bias, 1e-5, True)[0], mean, var

    forms = {"flax formula, autodiff": flax_bn,
             "closed-form backward": lambda x, s, b: M.batch_norm(x, s, b, 1e-5, True)}
    lines = ["| shape N,H,W,C | batch norm + ReLU6 | forward ms | forward + backward ms |",
             "|---|---|---:|---:|"]
    for n, h, wd, c, _ in SHAPES:
        x = jax.random.normal(jax.random.key(0), (n, h, wd, c))
        scale, bias = jnp.ones((c,)), jnp.zeros((c,))
        fns = {}
        for name, f in forms.items():
            fns[(name, "fwd")] = (jax.jit(lambda x, s, b, f=f: f(x, s, b)[0]), (x, scale, bias))
            fns[(name, "bwd")] = (jax.jit(jax.grad(lambda x, s, b, f=f: jnp.sum(
                jnp.sin(f(x, s, b)[0])), (0, 1, 2))), (x, scale, bias))
        t = timed(fns, repeats)
        for name in forms:
            lines.append(f"| {n},{h},{wd},{c} | {name} | {t[(name, 'fwd')]:.2f} | "
                         f"{t[(name, 'bwd')]:.2f} |")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "depthwise.md"))
    args = ap.parse_args(argv)
    lines = ["# Depth-wise and 1x1 convolution and batch norm formulations on XLA CPU", "",
             f"{os.cpu_count()} cores. {versions(('jax', 'jaxlib', 'flax'))}. Commit {commit()}. "
             f"Median of {args.repeats} interleaved runs per function, one process "
             "(`python benchmarks/depthwise.py`).", ""]
    lines += (depthwise_rows(args.repeats) + [""] + pointwise_rows(args.repeats) + [""]
              + batchnorm_rows(args.repeats) + [""])
    text = "\n".join(lines)
    print(text)
    from pockjax.checkpoint import write_atomic
    write_atomic(args.out, text.encode())


if __name__ == "__main__":
    main()
