"""Memory per device of a sharded step at LLaMA-2's 7B, 13B and 70B shapes, compiled
from shapes only.

Each row compiles one training step (`jax.jit(...).lower(...).compile()`; no weight is
allocated) on `--xla_force_host_platform_device_count` host devices and reads XLA's
memory analysis, which is per device: the arguments (each device's share of the
parameters, the optimizer state and the batch) and the temporaries. The step is the
one `pockjax finetune --mesh fsdp=N --frozen-dtype int4 --scheme paper:2` builds:
PockEngine's transformer scheme (attention and the first MLP linears of the last 2
blocks) trained in float32 with AdamW, every other weight frozen in 4 bits
(`pockjax.lowbit`, a bfloat16 scale per 64 inputs), the parameters and optimizer state
sharded over `fsdp` (`finetune`'s own `choose_devices` and `sparse_train` keywords),
the batch split over the same devices. Random-weight shapes: LLaMA-2's published
configurations (vocabulary 32,000); global batch 8 x 512 tokens, a cross-entropy loss
over every position.

XLA's CPU compiler sizes the step here; a GPU's compiler fuses and schedules on its own
terms, so the figures say how the step scales with devices, not a GPU's exact bytes.
Each shape runs in its own process. Writes benchmarks/results/sharded_memory.md and
.json.

    python -m benchmarks sharded_memory [--llama llama2-7b,llama2-13b,llama2-70b]
                                        [--devices 1,2,4,8] [--batch 8] [--seq 512]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import ROOT, commit, report_result, run_row, versions  # noqa: E402

GIB = 2**30
# LLaMA-2's configurations (Touvron et al. 2023, Table 1 and the released config files).
SHAPES = {
    "llama2-7b": dict(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32,
                      vocab=32000),
    "llama2-13b": dict(layers=40, hidden=5120, intermediate=13824, heads=40, kv_heads=40,
                       vocab=32000),
    "llama2-70b": dict(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8,
                       vocab=32000),
    # Seconds: the tests' run of the benchmark.
    "smoke": dict(layers=4, hidden=512, intermediate=1376, heads=8, kv_heads=4, vocab=1024),
}
DEFAULT = ("llama2-7b", "llama2-13b", "llama2-70b")
FITS = (24, 80)  # GiB: a 24 GiB GPU, an 80 GiB one


def measure(name: str, devices: list[int], batch: int, seq: int) -> list[dict]:
    """Each device count's compiled memory per device (in this process)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import pockjax as pj
    from benchmarks.real_size_models import build_params, scheme_for
    from pockjax.finetuning import choose_devices
    from pockjax.train import TrainState

    s = dict(SHAPES[name], seq=seq, batch=batch, last=2)
    graphdef, abstract, scheme, _ = build_params(s, scheme_for("pockjax paper last-2", s),
                                                 low_bit="int4")
    opt = optax.adamw(1e-4, weight_decay=0.01)

    def loss(p, tokens):
        logits = nnx.merge(graphdef, p)(tokens)[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), abstract,
                        jax.eval_shape(opt.init, pj.trainable_view(abstract, scheme)), scheme)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    rows = []
    for n in devices:
        t0 = time.perf_counter()
        placement = choose_devices(None, f"fsdp={n}", batch, print) if n > 1 else None
        keywords = {} if placement is None else dict(placement.sparse_train_keywords(),
                                                     batch_specs=None)
        trainer = pj.sparse_train(loss, optimizer=opt, scheme=scheme, **keywords)
        m = pj.compiled_memory(trainer.lower(shapes, tokens).compile())
        fresh = max(m["output"] - m["alias"], 0)
        rows.append({"model": name, "devices": n, "args_gib": m["argument"] / GIB,
                     "temp_gib": m["temp"] / GIB,
                     "total_gib": (m["argument"] + m["temp"] + fresh) / GIB,
                     "compile_s": time.perf_counter() - t0})
        print(f"[sharded_memory] {name} over {n}: {rows[-1]['total_gib']:.2f} GiB per device "
              f"({rows[-1]['compile_s']:.0f} s)", file=sys.stderr, flush=True)
    return rows


def write(rows: list[dict], args, wall: float) -> str:
    lines = [f"# A sharded step's memory per device at LLaMA-2's shapes (compiled, not run)",
             "", f"{versions(['pockjax', 'jax', 'jaxlib', 'flax', 'optax'])}. Commit {commit()}. "
             f"`python -m benchmarks sharded_memory`, run "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {wall:.0f} s.", "",
             f"The step of `pockjax finetune --mesh fsdp=N --frozen-dtype int4 --scheme "
             f"paper:2`: PockEngine's transformer scheme (the attention and first MLP "
             f"linears of the last 2 blocks trained in float32, AdamW; every other weight "
             f"in 4 bits), global batch {args.batch} x {args.seq} tokens, compiled by XLA's "
             f"CPU compiler on "
             f"forced host devices (method: the benchmark's docstring). Per device: the "
             f"arguments (its share of the weights, the optimizer state and the batch) and "
             f"the step's temporaries.", "",
             "| model | devices | arguments | temporaries | total per device | fits 24 GiB | "
             "fits 80 GiB |", "|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r.get('devices', '')} | {r['error']} | | | | |")
            continue
        fits = ["yes" if r["total_gib"] <= g else "no" for g in FITS]
        lines.append(f"| {r['model']} | {r['devices']} | {r['args_gib']:.2f} GiB | "
                     f"{r['temp_gib']:.2f} GiB | {r['total_gib']:.2f} GiB | {fits[0]} | "
                     f"{fits[1]} |")
    lines += ["", "The fewest devices whose memory per device fits:", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        ok = [r for r in rows if r["model"] == model and "error" not in r]
        for g in FITS:
            fit = [r["devices"] for r in ok if r["total_gib"] <= g]
            tried = max((r["devices"] for r in ok), default=0)
            lines.append(f"- {model}, {g} GiB: " + (f"{min(fit)}" if fit else
                                                     f"more than {tried} (the most tried)"))
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama", default=",".join(DEFAULT))
    ap.add_argument("--devices", default="1,2,4,8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "sharded_memory.md"))
    args = ap.parse_args(argv)
    devices = [int(n) for n in args.devices.split(",")]
    if args.child:
        report_result({"rows": measure(args.child, devices, args.batch, args.seq)})
        return
    names = args.llama.split(",")
    for name in names:
        if name not in SHAPES:
            ap.error(f"--llama {name}: one of {', '.join(SHAPES)}")
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                                       f" --xla_force_host_platform_device_count={max(devices)}")}
    t0, rows = time.perf_counter(), []
    for name in names:
        out = run_row(["-m", "benchmarks.sharded_memory", "--child", name, "--devices",
                       args.devices, "--batch", str(args.batch), "--seq", str(args.seq)],
                      timeout=3600, env=env)
        rows += out.get("rows", [{"model": name, "error": out.get("error", "no rows")}])
    text = write(rows, args, time.perf_counter() - t0)
    with open(args.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
