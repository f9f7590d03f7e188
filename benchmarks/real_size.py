"""Fine-tuning at real LLaMA sizes on this machine: TinyLlama-1.1B's shape and
LLaMA-2-7B's, PyTorch against JAX and pockjax, each row in its own process under a
memory guard.

Random weights (uniform, std 0.02; norm scales 1), random tokens, batch 1, sequence
128, AdamW 1e-4 (weight decay 0.01) in every row. Rows:

- `torch full fused-adamw`, `torch full adamw`: `transformers.LlamaForCausalLM` in
  float32, every parameter trained, `torch.optim.AdamW(fused=True)` (the strongest
  PyTorch optimizer on CPU) or the default one.
- `torch lora r8 q+v`: peft LoRA r=8 on q_proj and v_proj of a float32 model;
  `torch lora r8 q+v bf16`: the same on a bfloat16 model (adapters float32).
- `torch qlora r8 q+v nf4`: QLoRA, the 4-bit peer: `transformers` loads the model with
  `BitsAndBytesConfig(load_in_4bit=True, nf4, bfloat16 compute)` (`bitsandbytes` on the
  CPU; `pip install 'pockjax[qlora]'`) from a bfloat16 folder of the same random weights
  (written once by `benchmarks/lowbit_load.py`), peft LoRA r=8 on q_proj and v_proj.
- `jax+optax last-k`: `jax.value_and_grad` with respect to the last k blocks only
  (the rest closed over), optax AdamW on them: plain JAX on the same trained tensors.
  `jax+optax full f32`: the same construction with every parameter trained, the plain
  JAX counterpart of `pockjax full f32`.
- `pockjax sparse last-k f32`: `pockjax.sparse_train` with `schemes.last_blocks(k)`.
- `pockjax sparse last-k bf16-frozen upcast` / `bf16-matmul`: the same with every frozen
  weight stored in bfloat16 and the trained ones as float32 masters
  (`LlamaConfig(dtype=float32)` + `cast_frozen`); frozen weights are upcast per use
  (`pockjax.lowbit`'s bfloat16 nodes, float32 arithmetic) or multiplied in bfloat16
  with float32 accumulation (plain bfloat16 arrays and `narrow_matmul="native"`,
  autocast's numerics); `... bf16-matmul remat`
  also recomputes each trained block's activations in the backward pass
  (`LlamaConfig(remat="blocks")`).
- `pockjax paper last-2 bf16-frozen ...`: PockEngine's transformer scheme (attention and
  the first MLP linears of the last 2 blocks) with bfloat16 frozen weights.
- `pockjax paper last-2 int4-frozen`, `... int8-frozen`, `pockjax sparse last-k
  int4-frozen`: frozen weights in 4 or 8 bits (`pockjax.lowbit`: int4 with a bfloat16
  scale per 64 inputs, int8 with a scale per output channel), each quantized as it is
  made and dequantized where it is used; trained weights and the arithmetic in float32.
- `... int8-moments`, `... bf16-moments`: the same with AdamW's moments stored in int8
  (block-wise) or bfloat16 (`pockjax.optim.adamw(moments=)`), float32 masters kept.
- `pockjax full f32`: every parameter, pockjax's fused step.
- `pockjax sparse last-k iree host-cpu`: the `pockjax sparse last-k f32` step exported
  with `pj.export(..., target="host-cpu")` and run by `pockjax.runtime` (IREE
  local-task) in a second process that imports no JAX: one guarded process exports
  (its time and peak RSS are recorded, and from the manifest the stream plan's
  allocation per step and whether the weight reads were tied), the next loads the
  artifact and trains. Its peak RSS is the second process's; it also records the RSS
  after loading, split into file-backed pages (the mapped `params.irpa`) and anonymous
  memory. Its losses should continue the JAX row's (same weights, same tokens). The
  results file sets it beside that row; benchmarks/results/real_size_iree.md takes it
  apart (profile, flags).
- `pockjax sparse last-k bf16-frozen upcast iree host-cpu`, `pockjax paper last-2
  bf16-frozen upcast iree host-cpu`: the same for those two upcast steps (frozen
  weights stored in bfloat16); the second is the 7B-shape artifact.

Models are built directly in their storage dtypes, one parameter at a time under
`jax.jit` (no float32 copy of the whole model), and handed to the trainer without a
copy (`init(params, copy=False)`). A JAX row compiles its step from shapes first;
when the compiled step's arguments and temporaries exceed the memory limit the row
stops there ("does not fit (compiled)"). The parent polls each row's resident memory
(`VmRSS`) and kills a row that passes `--limit-gib` (default 21), recording where it
was ("does not fit: 21.3 GiB at step 2"), so no row takes the machine down. A JAX row
also records its own `VmRSS` and high-water mark as each stage begins (compile, weights,
optimizer state, each step), which the results file turns into a table of where its
memory goes.

Every row's process runs with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` unless
`--malloc default` is given: XLA allocates the step's buffers afresh each step, and
without transparent huge pages their 4 KiB pages fault in one by one (see the NOTES).

Results accumulate in benchmarks/results/real_size.json (one entry per preset and
row, so presets and rows can be run separately) and are written out as
benchmarks/results/real_size.md and real_size.png.

    python -m benchmarks real_size --llama tinyllama-1.1b [--rows ...] [--steps 3 --warmup 1]
    python -m benchmarks real_size --llama llama2-7b --rows "pockjax paper last-2 bf16-frozen bf16-matmul"
    python -m benchmarks real_size --llama smoke        # seconds: a tiny model, every row
    python -m benchmarks real_size --compiled           # compiled memory only, both shapes
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (ROOT, add_malloc_option, commit, malloc_env,  # noqa: E402
                               proc_status_kib, report_result, rss_mib, trim_heap, versions)
from benchmarks.paper_table import PACKAGES, _timed, chart, jax_loss, make_batch  # noqa: E402

LR, WEIGHT_DECAY = 1e-4, 0.01
GIB = 2**30

PRESETS = {
    "smoke": dict(layers=4, hidden=256, intermediate=688, heads=8, kv_heads=2, vocab=1024,
                  seq=32, batch=1, last=2),
    # The quality benchmark's small model and batch (the profile of its step, edge_speed's).
    "quality-small": dict(layers=6, hidden=256, intermediate=688, heads=4, kv_heads=4,
                          vocab=8192, seq=256, batch=8, last=1),
    "tinyllama-1.1b": dict(layers=22, hidden=2048, intermediate=5632, heads=32, kv_heads=4,
                           vocab=32000, seq=128, batch=1, last=6),
    "llama2-7b": dict(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32,
                      vocab=32000, seq=128, batch=1, last=6),
}
ROWS = ["pockjax sparse last-k f32", "pockjax sparse last-k bf16-frozen upcast",
        "pockjax sparse last-k bf16-frozen bf16-matmul", "torch full fused-adamw",
        "torch lora r8 q+v", "jax+optax last-k", "pockjax paper last-2 bf16-frozen bf16-matmul",
        "pockjax paper last-2 bf16-frozen upcast", "torch lora r8 q+v bf16", "torch full adamw",
        "pockjax full f32", "jax+optax full f32", "pockjax sparse last-k iree host-cpu",
        "pockjax sparse last-k bf16-frozen bf16-matmul remat",
        "pockjax sparse last-k bf16-frozen upcast iree host-cpu",
        "pockjax paper last-2 bf16-frozen upcast iree host-cpu",
        "pockjax paper last-2 int4-frozen", "pockjax paper last-2 int8-frozen",
        "pockjax sparse last-k int4-frozen", "pockjax paper last-2 int4-frozen int8-moments",
        "pockjax paper last-2 int4-frozen bf16-moments", "torch qlora r8 q+v nf4",
        "pockjax sparse last-k int4-frozen int8-moments"]
# Each IREE row and the JAX row whose step it exports.
IREE_ROWS = {"pockjax sparse last-k iree host-cpu": "pockjax sparse last-k f32",
             "pockjax sparse last-k bf16-frozen upcast iree host-cpu":
                 "pockjax sparse last-k bf16-frozen upcast",
             "pockjax paper last-2 bf16-frozen upcast iree host-cpu":
                 "pockjax paper last-2 bf16-frozen upcast"}
RESULTS = os.path.join(ROOT, "benchmarks", "results", "real_size")


def label(row: str, s: dict) -> str:
    return row.replace("last-k", f"last-{s['last']}")


def describe(name: str, s: dict) -> str:
    return (f"{name}: {s['layers']} layers, hidden {s['hidden']}, MLP {s['intermediate']}, "
            f"{s['heads']} heads ({s['kv_heads']} key/value), vocabulary {s['vocab']}; "
            f"sequence {s['seq']}, batch {s['batch']}; sparse rows train the last "
            f"{s['last']} blocks")


# (stage, VmRSS GiB, VmHWM GiB) as each stage of this row process began: the high-water
# mark read at a stage's start is the peak of everything before it.
STAGES: list[tuple[str, float, float]] = []


def _vm() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in GiB."""
    kib = proc_status_kib("VmRSS", "VmHWM")
    return kib.get("VmRSS", 0) / 2**20, kib.get("VmHWM", 0) / 2**20


def stage(text: str) -> None:
    """Where the row is, for the parent's "does not fit ... at <stage>"; records this
    process's memory as the stage begins (`STAGES`)."""
    STAGES.append((text, *_vm()))
    print(f"STAGE {text}", flush=True)


# --------------------------------------------------------------------------- JAX rows


def llama_config(s: dict, **overrides):
    from pockjax.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"],
                       intermediate_size=s["intermediate"], num_layers=s["layers"],
                       num_heads=s["heads"], num_kv_heads=s["kv_heads"],
                       max_position_embeddings=max(128, s["seq"]), **overrides)


def _uniform(seed, shape, dtype, std):
    """Counter-based uniform noise with standard deviation `std`, made in `dtype`.

    A murmur3 finaliser over the element index: one fused elementwise loop, about
    50x faster on this CPU than `jax.random.normal`, which matters at 6.7B weights."""
    import jax
    import jax.numpy as jnp

    x = jax.lax.iota(jnp.uint32, int(np.prod(shape))) * jnp.uint32(0x9E3779B1) + seed
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    x = x ^ (x >> 16)
    u = (x >> 8).astype(jnp.float32) * (1.0 / 2**24) - 0.5
    return (u * (std * 12 ** 0.5)).astype(dtype).reshape(shape)


def build_params(s: dict, scheme_fn, frozen_dtype=None, compute_dtype=None,
                 narrow: str = "upcast", remat=None, low_bit: str | None = None):
    """`(graphdef, abstract params, scheme)`, and a function making the arrays: each
    leaf made in its storage dtype by its own jitted call, so no float32 copy of the
    model ever exists. With `frozen_dtype`, frozen leaves are stored in it and the
    model computes in `compute_dtype` (float32). With `low_bit` ("int8", "int4"), each
    frozen weight is quantized as soon as it is made (`pockjax.lowbit`): the abstract
    params hold `Quantized` nodes and no float copy of the frozen model exists."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import pockjax as pj
    from pockjax.models.llama import Llama, cast_frozen

    config = llama_config(s, dtype=compute_dtype, narrow_matmul=narrow, remat=remat)
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, params, _ = pj.nnx.split(abstract)
    scheme = scheme_fn(params)
    if frozen_dtype is not None:  # pockjax.lowbit nodes; plain arrays for native products
        params = cast_frozen(params, scheme, frozen_dtype, native=narrow == "native")
    make = jax.jit(_uniform, static_argnums=(1, 2, 3))
    ones = jax.jit(jnp.ones, static_argnums=(0, 1))
    floats = params
    frozen = [isinstance(d, pj.Frozen) for d in jax.tree.leaves(
        scheme.resolve(params), is_leaf=lambda d: isinstance(d, (pj.Full, pj.Frozen, pj.Channels)))]
    if low_bit is not None:
        from pockjax import lowbit
        params = jax.eval_shape(lambda p: lowbit.quantize(p, scheme, low_bit), floats)
        chooser = lowbit.formats_by_path(low_bit)
        quantize = jax.jit(lowbit.quantize_leaf, static_argnums=1)

    def arrays():
        leaves, treedef = jax.tree_util.tree_flatten_with_path(floats)
        out = []
        for i, (path, x) in enumerate(leaves):
            if x.ndim == 1:  # norm scales
                out.append(ones(x.shape, x.dtype))
                continue
            w = make(jnp.uint32(i * 7919 + 1), x.shape, x.dtype, 0.02)
            fmt = chooser(pj.scheme.path_str(path)) if low_bit is not None and frozen[i] else None
            out.append(w if fmt is None else quantize(w, fmt))
            del w
        return jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, out))

    return graphdef, params, scheme, arrays


def _nbytes(tree) -> int:
    import jax

    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _fits(compiled, args, limit_gib: float) -> dict:
    """The compiled step's memory; raises `DoesNotFit` above the limit."""
    import pockjax as pj

    m = pj.compiled_memory(compiled)
    out = {"compiled_peak_gib": m["peak"] / GIB, "temp_gib": m["temp"] / GIB,
           "args_gib": m["argument"] / GIB}
    need = m["peak"] / GIB + rss_mib() / 1024
    if need > limit_gib:
        report_result({**out, "error": f"does not fit (compiled): the step needs "
                                       f"{m['peak'] / GIB:.1f} GiB (arguments "
                                       f"{m['argument'] / GIB:.1f} + temporaries "
                                       f"{m['temp'] / GIB:.1f}) beside {rss_mib() / 1024:.1f} "
                                       f"GiB of runtime, over the {limit_gib:g} GiB limit"})
        sys.exit(0)
    return out


def scheme_for(row: str, s: dict):
    import pockjax as pj

    if row.startswith(("pockjax full", "jax+optax full")):
        return lambda p: pj.Scheme(default=pj.Full())
    if "paper last-2" in row:
        return lambda p: pj.schemes.transformer(p, last=2)
    return lambda p: pj.schemes.last_blocks(p, s["last"])


def run_jax(row: str, s: dict, args) -> dict:
    import jax  # noqa: F401  (counted in the baseline, as the other rows' imports are)
    import optax  # noqa: F401

    import pockjax  # noqa: F401

    rss_imports = rss_mib()
    step, _, info = jax_row(row, s, args.limit_gib)
    losses, times = _timed(_staged(step), args.steps, args.warmup)
    stage("end")
    return {"losses": losses, "times": times, "rss_imports_mib": rss_imports,
            "stages": STAGES, **info}


def jax_row(row: str, s: dict, limit_gib: float):
    """A JAX row's step on freshly made weights: `(step, compiled, info)`. `step()` runs
    one step and returns its loss (synchronised); `info` holds the trained parameter
    count and the compiled step's memory. Exits (reporting why) when the compiled step
    does not fit under `limit_gib`."""
    import jax
    import jax.numpy as jnp
    import optax

    import pockjax as pj
    from pockjax.train import TrainState

    lm_loss = jax_loss("llama")
    bf16 = "bf16-frozen" in row
    low_bit = next((b for b in ("int8", "int4") if f"{b}-frozen" in row), None)
    if low_bit is not None and "bf16-embed" in row:  # the gathered table in bfloat16
        low_bit = {"embed/**": "bfloat16", "**": low_bit}
    stage("init")
    graphdef, abstract, scheme, arrays = build_params(
        s, scheme_for(row, s), jnp.bfloat16 if bf16 else None, jnp.float32 if bf16 else None,
        narrow="native" if "bf16-matmul" in row else "upcast",
        remat="blocks" if row.endswith(" remat") else None, low_bit=low_bit)
    moments = next((m for m in ("int8", "bf16") if f"{m}-moments" in row), None)
    opt = (pj.optim.adamw(LR, weight_decay=WEIGHT_DECAY,
                          moments={"bf16": "bfloat16"}.get(moments, moments))
           if moments else optax.adamw(LR, weight_decay=WEIGHT_DECAY))
    tokens = jnp.asarray(make_batch("llama", s))
    trained_params = sum(int(np.prod(x.shape)) for x in
                         jax.tree.leaves(pj.trainable_view(abstract, scheme)))

    from flax import nnx
    if row.startswith("pockjax"):
        def loss(params, tokens):
            return lm_loss(nnx.merge(graphdef, params), tokens)

        trainer = pj.sparse_train(loss, optimizer=opt, scheme=scheme)
        shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), abstract,
                            jax.eval_shape(opt.init, pj.trainable_view(abstract, scheme)), scheme)
        stage("compile")
        compiled = trainer.lower(shapes, tokens).compile()
        memory = _fits(compiled, shapes, limit_gib)
        trim_heap()
        stage("weights")
        params = arrays()
        stage("optimizer state")
        state = [trainer.init(params, copy=False)]
        del params

        def step():
            state[0], metrics = compiled(state[0], tokens)
            return float(jax.block_until_ready(metrics["loss"]))
    else:  # jax+optax: value_and_grad with respect to the trained leaves only
        decisions = scheme.resolve(abstract)
        mask = jax.tree.map(lambda d: not isinstance(d, pj.Frozen), decisions)
        split = lambda p: (jax.tree.map(lambda x, m: x if m else None, p, mask),
                           jax.tree.map(lambda x, m: None if m else x, p, mask))
        join = lambda t, f: jax.tree.map(lambda a, b: a if b is None else b, t, f,
                                         is_leaf=lambda x: x is None)

        def train_step(state, tokens):
            trained, frozen, opt_state = state
            value, grads = jax.value_and_grad(
                lambda t: lm_loss(nnx.merge(graphdef, join(t, frozen)), tokens))(trained)
            updates, opt_state = opt.update(grads, opt_state, trained)
            return (optax.apply_updates(trained, updates), frozen, opt_state), value

        t_shapes, f_shapes = split(abstract)
        shapes = (t_shapes, f_shapes, jax.eval_shape(opt.init, t_shapes))
        stage("compile")
        compiled = jax.jit(train_step, donate_argnums=0).lower(shapes, tokens).compile()
        memory = _fits(compiled, shapes, limit_gib)
        trim_heap()
        stage("weights")
        trained, frozen = split(arrays())
        stage("optimizer state")
        state = [(trained, frozen, jax.jit(opt.init)(trained))]
        del trained, frozen

        def step():
            state[0], value = compiled(state[0], tokens)
            return float(jax.block_until_ready(value))

    return step, compiled, {"trained_params": trained_params, **memory}


def _staged(step):
    count = [0]

    def staged():
        count[0] += 1
        stage(f"step {count[0]}")
        return step()

    return staged


# --------------------------------------------------------------------------- IREE row


def _rss_split() -> dict:
    """This process's resident memory now, in GiB: all of it, file-backed pages (mapped
    files such as `params.irpa`, shared with the page cache) and anonymous memory."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssFile", "RssAnon"):
                out[{"VmRSS": "total", "RssFile": "file", "RssAnon": "anon"}[key]] = \
                    int(line.split()[1]) / 2**20
    return out


def iree_export(row: str, s: dict, args) -> dict:
    """An IREE row's first process: the trainer of its JAX row (`IREE_ROWS`), with the
    same weights, exported for host-cpu into `args.iree_dir`."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import pockjax as pj

    lm_loss = jax_loss("llama")
    stage("init")
    bf16 = "bf16-frozen" in IREE_ROWS[row]
    graphdef, abstract, scheme, arrays = build_params(
        s, scheme_for(row, s), jnp.bfloat16 if bf16 else None, jnp.float32 if bf16 else None)
    trainer = pj.sparse_train(lambda p, t: lm_loss(nnx.merge(graphdef, p), t),
                              optimizer=optax.adamw(LR, weight_decay=WEIGHT_DECAY), scheme=scheme)
    state = trainer.init(arrays(), copy=False)
    stage("export")
    t0 = time.perf_counter()
    art = pj.export(trainer, state, jnp.asarray(make_batch("llama", s)), target="host-cpu",
                    out_dir=args.iree_dir)
    export_s = time.perf_counter() - t0
    memory = art.manifest["memory"]
    return {"export_s": export_s, "flags": art.manifest["target"]["flags"],
            "tied_weight_reads": memory["tied_weight_reads"],
            "step_alloc_bytes": memory["peak_alloc_bytes"],
            "archive_gib": art.manifest["files"]["params.irpa"]["bytes"] / GIB,
            "trained_params": sum(int(np.prod(x.shape)) for x in
                                  jax.tree.leaves(pj.trainable_view(abstract, scheme)))}


def iree_run(row: str, s: dict, args) -> dict:
    """An IREE row's second process: load the artifact with `pockjax.runtime` (no JAX
    imported) and train on the JAX row's tokens."""
    from pockjax import runtime

    rss_imports = rss_mib()
    stage("load")
    t0 = time.perf_counter()
    sess = runtime.load(args.iree_dir, device="local-task")
    load_s = time.perf_counter() - t0
    loaded = _rss_split()
    tokens = make_batch("llama", s)

    def step():
        return float(sess.step(tokens)["loss"])

    losses, times = _timed(_staged(step), args.steps, args.warmup)
    return {"losses": losses, "times": times, "load_s": load_s, "rss_load_gib": loaded,
            "rss_end_gib": _rss_split(), "rss_imports_mib": rss_imports,
            "imports_jax": "jax" in sys.modules}


def _machine_cpu() -> tuple[float, float, float]:
    """(wall s, CPU-s busy on the whole machine, CPU-s of this process's finished
    children), to tell how much of the machine other jobs took while a row ran."""
    import resource

    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter(), busy, kids.ru_utime + kids.ru_stime


def _others_share(before, after) -> float:
    """The share of the machine's CPU time that other jobs used between two readings."""
    wall = after[0] - before[0]
    others = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, others) / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0


# What an IREE row's export process reports (`iree_export`) that its result keeps.
EXPORT_KEYS = ("trained_params", "flags", "archive_gib", "export_s", "tied_weight_reads",
               "step_alloc_bytes")


def run_iree_row(row: str, args) -> dict:
    """Export in one guarded process, train in another; the artifact is deleted after."""
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="real-size-iree-")
    cmd = [os.path.abspath(__file__), "--llama", args.llama, "--row", row,
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--limit-gib", str(args.limit_gib), "--iree-dir", os.path.join(tmp, "artifact")]
    try:
        exported = guarded(cmd + ["--phase", "export"], args.limit_gib, args.timeout, args.env)
        if "error" in exported:
            return {**exported, "error": f"export: {exported['error']}"}
        ran = guarded(cmd + ["--phase", "run"], args.limit_gib, args.timeout, args.env)
        return {**ran, **{k: exported[k] for k in EXPORT_KEYS},
                "export_rss_peak_mib": exported["rss_peak_mib"],
                "export_wall_s": exported["wall_s"]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- PyTorch rows


def run_torch(row: str, s: dict, args) -> dict:
    import peft  # noqa: F401  (imports counted in the baseline, as JAX's are)
    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    rss_imports = rss_mib()
    stage("init")
    config = torch_config(s)
    dtype = torch.bfloat16 if row.endswith("bf16") else torch.float32
    if "qlora" in row:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise SystemExit("bitsandbytes is not installed: pip install 'pockjax[qlora]'")
        from benchmarks import lowbit_load
        name = next(n for n, v in PRESETS.items() if v is s)
        folder = lowbit_load.write_folder(name, Path(ROOT) / ".cache" / "lowbit-load" / name)
        net = transformers.AutoModelForCausalLM.from_pretrained(
            folder, device_map="cpu", quantization_config=transformers.BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4",
                bnb_4bit_compute_dtype=torch.bfloat16))
    else:
        net = transformers.LlamaForCausalLM._from_config(config, torch_dtype=dtype)
    net.train()
    if "lora" in row:
        from peft import LoraConfig, get_peft_model
        net = get_peft_model(net, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj"]))
    params = [p for p in net.parameters() if p.requires_grad]
    fused = "fused" in row or "lora" in row
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=fused)
    tokens = torch.from_numpy(make_batch("llama", s)).long()
    losses, times = _timed(_staged(torch_step(net, opt, tokens)), args.steps, args.warmup)
    return {"losses": losses, "times": times, "rss_imports_mib": rss_imports,
            "trained_params": sum(p.numel() for p in params)}


def torch_config(s: dict):
    """transformers' `LlamaConfig` of shape `s` (the PyTorch rows' model)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], max_position_embeddings=max(128, s["seq"]),
        rms_norm_eps=1e-5, tie_word_embeddings=False)


def torch_step(net, opt, tokens):
    """One PyTorch training step on `tokens` (next-token cross-entropy), as a function
    returning the loss as a float (which waits for the step)."""
    import torch.nn.functional as F

    def step():
        opt.zero_grad(set_to_none=True)
        logits = net(input_ids=tokens).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


# --------------------------------------------------------------------------- the guard


def _rss_gib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def guarded(cmd: list[str], limit_gib: float, timeout: float, env: dict | None = None) -> dict:
    """Run a row process (environment `env`, default this one's); kill it above
    `limit_gib` resident or after `timeout` s.

    Returns its `report_result` dict (plus `wall_s` and the polled `rss_polled_gib`),
    or `{"error": ...}` saying where it was when it was stopped or failed."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE, env=env,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    where, result, errors = ["start"], [None], []

    def read_stdout():
        for line in proc.stdout:
            if line.startswith("STAGE "):
                where[0] = line[6:].strip()
            elif line.startswith("RESULT "):
                result[0] = json.loads(line[7:])

    def read_stderr():
        for line in proc.stderr:
            errors.append(line.rstrip())
            del errors[:-40]

    readers = [threading.Thread(target=f, daemon=True) for f in (read_stdout, read_stderr)]
    for r in readers:
        r.start()
    peak, stopped = 0.0, None
    while proc.poll() is None:
        rss = _rss_gib(proc.pid)
        peak = max(peak, rss)
        if rss > limit_gib:
            stopped = f"does not fit: {rss:.1f} GiB at {where[0]}"
        elif time.perf_counter() - t0 > timeout:
            stopped = f"timed out after {timeout:.0f} s at {where[0]}"
        if stopped:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.2)
    for r in readers:
        r.join(timeout=5)
    wall = time.perf_counter() - t0
    if stopped:
        return {"error": stopped, "rss_polled_gib": peak, "wall_s": wall}
    if result[0] is not None:
        return {**result[0], "wall_s": wall, "rss_polled_gib": peak}
    lines = [l for l in errors if l.strip()]
    tail = ([l for l in lines if "Error" in l or "error" in l] or lines or ["no output"])[-1]
    return {"error": f"exit {proc.returncode} at {where[0]}: {tail.strip()[:240]}",
            "rss_polled_gib": peak, "wall_s": wall}


# --------------------------------------------------------------------------- compiled only

VARIANTS = [("float32", None, "upcast"), ("bf16-frozen upcast", "bfloat16", "upcast"),
            ("bf16-frozen bf16-matmul", "bfloat16", "native")]
# The same step compiled before frozen weights were upcast per use (commit 1fbf42a: XLA
# converted every bfloat16 weight to float32 at the top of the step).
BEFORE = {("tinyllama-1.1b", "last-6", "bf16-frozen upcast"): (4.51, 3.01),
          ("llama2-7b", "last-6", "bf16-frozen upcast"): (23.86, 20.55),
          ("llama2-7b", "paper last-2", "bf16-frozen upcast"): (15.48, 23.74)}


def compiled_memory_rows() -> list[dict]:
    """XLA's memory for each preset, scheme and precision, compiled from shapes only (no
    weight is allocated, so LLaMA-2-7B's step is sized on any machine)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import pockjax as pj
    from pockjax.train import TrainState

    lm_loss, opt = jax_loss("llama"), optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    out = []
    for name in ("tinyllama-1.1b", "llama2-7b"):
        s = PRESETS[name]
        for scheme_name, row in ((f"last-{s['last']}", "pockjax sparse last-k"),
                                 ("paper last-2", "pockjax paper last-2")):
            for variant, frozen, narrow in VARIANTS:
                graphdef, abstract, scheme, _ = build_params(
                    s, scheme_for(row, s), frozen and jnp.dtype(frozen),
                    jnp.float32 if frozen else None, narrow=narrow)
                trainer = pj.sparse_train(lambda p, t, g=graphdef: lm_loss(nnx.merge(g, p), t),
                                          optimizer=opt, scheme=scheme)
                shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), abstract,
                                    jax.eval_shape(opt.init, pj.trainable_view(abstract, scheme)),
                                    scheme)
                tokens = jax.ShapeDtypeStruct((s["batch"], s["seq"]), jnp.int32)
                m = pj.compiled_memory(trainer.lower(shapes, tokens).compile())
                out.append({"preset": name, "scheme": scheme_name, "variant": variant,
                            "args_gib": m["argument"] / GIB, "temp_gib": m["temp"] / GIB})
                print(f"[compiled] {name} {scheme_name} {variant}: arguments "
                      f"{m['argument'] / GIB:.2f} GiB, temporaries {m['temp'] / GIB:.2f} GiB",
                      file=sys.stderr, flush=True)
    return out


def compiled_table(rows: list[dict]) -> list[str]:
    lines = ["## The compiled step's memory at both shapes (from shapes only)", "",
             "XLA's `memory_analysis()` of pockjax's sparse step, sequence 128, batch 1: "
             "arguments (weights, optimizer state) and temporaries. `before` is the same "
             "step at commit 1fbf42a, when XLA converted every bfloat16 weight to float32 "
             "at the top of the step and kept the copies.", "",
             "| shape | scheme | precision | arguments GiB | temporaries GiB | total GiB "
             "| before: arguments + temporaries |", "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        before = BEFORE.get((r["preset"], r["scheme"], r["variant"]))
        lines.append(f"| {r['preset']} | {r['scheme']} | {r['variant']} | {r['args_gib']:.2f} "
                     f"| {r['temp_gib']:.2f} | {r['args_gib'] + r['temp_gib']:.2f} | "
                     + (f"{before[0]:.2f} + {before[1]:.2f} = {sum(before):.2f}" if before
                        else "") + " |")
    return lines + [""]


# --------------------------------------------------------------------------- report


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def table(name: str, s: dict, results: dict) -> list[str]:
    ok = lambda r: r in results and "error" not in results[r]
    med = lambda r: statistics.median(results[r]["times"])
    ref = "torch full fused-adamw"
    tokens = s["batch"] * s["seq"]
    lines = [f"## {describe(name, s)}", "",
             "| row | trained params | s/step (median) | min-max s | tokens/s | vs torch full "
             "fused | peak RSS GiB | compiled step GiB (args + temp) | loss first -> last |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in ROWS:
        if row not in results:
            continue
        r = results[row]
        if "error" in r:
            extra = f" (polled peak {r['rss_polled_gib']:.1f} GiB)" if r.get(
                "rss_polled_gib") and "does not fit:" not in r["error"] else ""
            compiled = (f"{r['compiled_peak_gib']:.1f} ({r['args_gib']:.1f} + "
                        f"{r['temp_gib']:.1f})" if "compiled_peak_gib" in r else "-")
            lines.append(f"| {label(row, s)} | | {_cell(r['error'] + extra)} | | | | | "
                         f"{compiled} | |")
            continue
        t = np.asarray(r["times"])
        cells = [label(row, s), f"{r['trained_params']:,}", f"{med(row):.2f}",
                 f"{t.min():.2f}-{t.max():.2f}", f"{tokens / med(row):.1f}",
                 f"{med(ref) / med(row):.2f}x" if ok(ref) else "-",
                 f"{r['rss_peak_mib'] / 1024:.2f}",
                 f"{r['compiled_peak_gib']:.2f} ({r['args_gib']:.2f} + {r['temp_gib']:.2f})"
                 if "compiled_peak_gib" in r else "-",
                 f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Targets:", ""] + targets(s, results, ok, med) + [""]
    lines += [f"{text}\n" for text in NOTES.get(name, ())]
    lines += stages_table(s, {r: results[r] for r in ROWS if ok(r) and "stages" in results[r]})
    for row in IREE_ROWS:
        if ok(row):
            lines += iree_table(name, s, row, results)
    return lines


# Measurements beside the rows (one process per run, same machine, quiet), written out
# under the targets of their preset.
NOTES = {"tinyllama-1.1b": [
    "The rows run on 2026-11-28 at 10:03 UTC ran one after another on an Intel Xeon with 2 "
    "cores, AVX-512 and AVX512-BF16; compare them with each other. Against PyTorch LoRA r8 on "
    "q, v of the bfloat16 model (2.89 GiB, 1.15 s/step), int4 frozen weights with AdamW's "
    "moments in int8 train the last 6 blocks (264M parameters, 235x LoRA's) in 2.88 GiB at "
    "3.69 s/step (3.2x slower); with float32 moments they need 4.24 GiB.",
    "The machine of these rows (from 2026-11-25) is an AMD EPYC with 2 cores, AVX-512 and "
    "AVX512-BF16; the runs up to 2026-11-24 were on an AVX2 machine. Here XLA's 2048^2 float32 "
    "product runs at 482 GFLOP/s (`matmul_peak.md`) and PyTorch's (MKL 2024.2, the CPU "
    "wheel's) at 223, a 2048x128 @ 128x5632 product at 166: the ratios against the torch "
    "rows are larger here than they were there (sparse last-6 f32 2.56 s against torch full "
    "fused 5.45 s, 2.13x; LoRA q,v 2.00 s). Against plain JAX on the same trained tensors "
    "(`jax+optax last-6`), which uses the same kernels, the sparse step is the fairer peer.",
    "Huge pages (`--malloc hugepages`, the default from 2026-11-25 08:55 UTC; rows before "
    "ran with glibc's default allocator): XLA maps the step's temporaries afresh every step "
    "and, with 4 KiB pages, they fault in one by one. f32 last-6 in alternating processes, 1 "
    "warm-up + 5 steps: glibc's default 1.51 and 1.41 s/step, huge pages 1.28 and 1.27, the "
    "same 6.67 GiB peak. The weight gradient of a gate or up projection ([128, 2048] x "
    "[128, 5632] -> [2048, 5632], 44 MiB) jitted alone: 17.4 ms (170 GFLOP/s) with 4 KiB "
    "pages, 12.3 ms with huge pages; the cliff is at glibc's largest mmap threshold "
    "(32 MiB): [2048, 3072] 3.5 and 3.6 ms, [2048, 4096] 13.1 and 6.0 ms. Every row of the "
    "08:55 run was faster than at 06:56, torch too (torch full fused 7.45 -> 6.07 s, LoRA q,v "
    "3.52 -> 3.33), the IREE runtime most (1.83 -> 1.47 s); peak RSS moved by at most "
    "0.05 GiB. From 09:30 step times varied more (CPU steal 0.3%, no compaction stalls): "
    "five later pairs with huge pages, JAX f32 1.44/1.36/1.38/1.38/1.52 s and IREE "
    "1.42/2.18/2.12/2.15/1.51 (IREE's steps alternating between about 1.45 and 2.1 s in one "
    "run); with glibc's default, JAX 1.58/1.47 and IREE 1.95/1.96. So the 70% of peak "
    "(1.24 s) and IREE's 1.19x held in the 08:55 run, not in the later ones. The table "
    "above (11:30, after the IREE export's tied weight packs) ran in quieter minutes: JAX "
    "f32 1.30 s (67% of the 486.1 GFLOP/s peak measured just after), IREE 1.38 s.",
    "Ties by data instead of optimization barriers (commit 9cfb9c1), A/B in alternating "
    "processes on this machine (glibc's default allocator), 3 rounds of 1 warm-up + 6 "
    "steps, medians: f32 last-6 "
    "1.339/1.394/1.394 -> 1.300/1.344/1.309 s, temporaries 288.1 -> 252.6 MiB, VmHWM 6.73 -> "
    "6.67 GiB, the same losses; bf16-matmul 1.179/1.183 -> 1.118/1.105 s, 5.19 -> 5.13 GiB. "
    "XLA's region-analysis copy insertion, which can be set for one executable "
    "(`jax.jit(..., compiler_options={'xla_cpu_copy_insertion_use_region_analysis': True})`), "
    "removes the same copies under barriers (1.29-1.34 s) and adds nothing on top of the "
    "data ties (1.27-1.32 s); multi-output fusion cannot be set per executable.",
    "IREE host-cpu, trained weights packed when their matmuls run (the export's "
    "`tie_weight_reads`, 2026-11-25): before, IREE packed every trained weight for the "
    "forward and the backward at the step's start, and all packed copies lived together "
    "(2.12 GB allocated per step). In alternating processes with the previous commit "
    "(0861896), 1 warm-up + 5 steps, huge pages, 11:22-11:25 UTC: 1.41 and 1.41 s/step, "
    "peak 8.11 and 8.11 GiB before; 1.42 and 1.43 s/step, peak 6.40 and 6.40 GiB after; "
    "the same six losses to the bit; the JAX step in the same minutes 1.29 s, 6.67 GiB. "
    "A pair run at 11:29: JAX 1.36 s, IREE 1.37 s (1.01x), 6.67 and 6.40 GiB. "
    "real_size_iree.md has the stream plan.",
    "The upcast bf16 step against the f32 step, rows alternating (f32 then upcast, three "
    "pairs, 1 warm-up + 5 steps, huge pages, 12:13-12:15 UTC): f32 1.40/1.40/1.40 s, upcast "
    "1.61/1.44/1.48 s (1.15x, 1.03x, 1.06x); in the full runs 1.33x (11:30) and 1.27x "
    "(08:55). One [128, 2048] @ [2048, 5632] product jitted alone: f32 7.3 ms, bf16 weights "
    "upcast 10.6 ms, upcast in 256-1408-column or 256-512-row chunks 10.3-11.3 ms, a "
    "mixed-dtype dot_general 10.6 ms, bf16 x bf16 with f32 accumulation 4.3 ms.",
    "IREE host-cpu on this machine, 8 blocks at TinyLlama-1.1B's widths (last 6 trained), "
    "one process, glibc's default allocator, medians of 5 steps: default matmul tiles "
    "1.637 s/step, "
    "`--iree-llvmcpu-matmul-tile-bytes` 1 MiB 1.441, 4 MiB (the target's) 1.457, 16 MiB 1.465, "
    "against 0.938 s for the JAX step: IREE is 1.55x behind XLA here whatever the tiles.",
    "Earlier machine (AVX2), 2026-11-24, before the data ties: pockjax full f32 against "
    "jax+optax full f32 over 8 timed steps, the rows alternating: pockjax 5.48 and 5.36 s/step, "
    "jax+optax 5.02 and 5.23 (0.95x), the same losses and compiled memory (13.51 GiB): level "
    "to a few percent.",
    "Earlier machine, 2026-11-24, before the data ties: the bf16-matmul row's peak was "
    "0.41-0.44 GiB above XLA's 4.79 GiB step (5.20 and 5.23 GiB): JAX after import 0.16 GiB "
    "(mostly libjax_common.so's code), its CPU client and the abstract model 0.06, the "
    "compiled executable 0.035 and compilation's leftovers 0.04, allocating weights and "
    "optimizer state 0.02 (no transient copy), then in the step XLA's temporaries, 0.07 of "
    "runtime buffers outside its memory analysis and 0.01-0.03 of allocator creep. Tried and "
    "not adopted: JAX's caches freed after compiling -0.007 GiB; malloc_trim before the steps "
    "-0.02; one malloc arena -0.016; a fixed mmap threshold -0.03 with steps 10-15% slower; "
    "`LlamaConfig(remat=\"block\")` 5.13 GiB at 2.07 s/step (5.09 with the two allocator "
    "settings)."]}


def stages_table(s: dict, results: dict) -> list[str]:
    """Where a JAX row's resident memory comes from, stage by stage (`STAGES`)."""
    if not results:
        return []
    lines = ["### Where the JAX rows' memory goes", "",
             "The row process's resident memory (VmRSS) as each stage begins, and its high-water "
             "mark (VmHWM) after the first step and at the end, GiB. The step is compiled from "
             "shapes before any weight exists, then the compiler's freed heap is handed back; "
             "`runtime` is what the process holds beyond the weights and optimizer state when "
             "the first step starts (JAX, the compiled executable, allocator slack), `in-step` "
             "the peak's excess over the resident state (XLA's temporaries plus the runtime's "
             "own buffers).", "",
             "| row | after imports | compiling (peak) | compiled | + weights | + optimizer state "
             "| peak after step 1 | peak | peak during | runtime | in-step | compiled step "
             "(args + temp) |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for row, r in results.items():
        at = {name: (rss, hwm) for name, rss, hwm in r["stages"]}
        if not all(k in at for k in ("weights", "optimizer state", "step 1", "step 2", "end")):
            continue
        state, peak = at["step 1"][0], at["end"][1]
        # the peak happened in the stage before the first one that began at it
        names = [name for name, _, _ in r["stages"]]
        during = names[max(0, next(i for i, (_, _, hwm) in enumerate(r["stages"])
                                   if hwm >= peak) - 1)]
        in_step = f"{peak - state:.2f}" if during.startswith("step") else "-"
        lines.append(
            f"| {label(row, s)} | {r['rss_imports_mib'] / 1024:.2f} | {at['weights'][1]:.2f} | "
            f"{at['weights'][0]:.2f} | {at['optimizer state'][0]:.2f} | {state:.2f} | "
            f"{at['step 2'][1]:.2f} | {peak:.2f} | {during} | {state - r['args_gib']:.2f} | "
            f"{in_step} | {r['compiled_peak_gib']:.2f} ({r['args_gib']:.2f} + "
            f"{r['temp_gib']:.2f}) |")
    return lines + [""]


# The IREE row before this round (commit a79edb5): the runtime copied `init()`'s state
# through numpy into second device buffers and kept every page of the mapped archive it
# had read, and the host-cpu target used IREE's default matmul tiles. Measured on the
# same artifact with `pockjax.runtime` (1 warm-up + 3 steps, one process each) at
# 2026-11-24 04:00 UTC, a minute after the rows above, with the machine otherwise idle.
IREE_BEFORE = {"tinyllama-1.1b": {"text": (
    "Before (commit a79edb5): 3.81 s/step (7.5 CPU-s), RSS after loading 11.98 GiB (5.84 "
    "file-backed + 6.13 anonymous), peak RSS 14.97 GiB, the same losses. The runtime of "
    "this commit with IREE's default matmul tiles: 4.03 s/step, peak 8.27 GiB; with "
    "`--iree-llvmcpu-matmul-tile-bytes=4194304` as well (the flags of the row above), in the "
    "same minutes: 3.10 s/step (6.0 CPU-s), peak 8.13 GiB. real_size_iree.md has the dispatch "
    "profile and the flags tried.")}}


def _plan_text(r: dict) -> str:
    """The compiled stream plan's per-step allocation, where the row recorded it."""
    from pockjax import format_bytes

    if r.get("step_alloc_bytes") is None:
        return ""
    how = ("its trained weights' matmul reads tied (`tie_weight_reads`)"
           if r["tied_weight_reads"] else "the untied step (the export's choice)")
    return (f" The step allocates {format_bytes(r['step_alloc_bytes'])} beside its state (stream "
            f"plan), {how}.")


def iree_table(name: str, s: dict, row: str, results: dict) -> list[str]:
    """The IREE row beside the JAX step it was exported from."""
    r, jax_row = results[row], IREE_ROWS[row]
    j = results.get(jax_row) if jax_row in results and "error" not in results[jax_row] else None
    med = lambda x: statistics.median(x["times"])
    gib = lambda x: x["rss_peak_mib"] / 1024
    load = r["rss_load_gib"]
    lines = [f"### {label(row, s)} beside {label(jax_row, s)}", "",
             f"Exported in {r['export_s']:.0f} s (that process's peak RSS "
             f"{r['export_rss_peak_mib'] / 1024:.2f} GiB, the JAX state included); "
             f"`params.irpa` {r['archive_gib']:.2f} GiB; compiler flags "
             f"`{' '.join(r['flags'])}`.{_plan_text(r)} The runtime process imports "
             f"{'JAX too' if r.get('imports_jax') else 'no JAX'}; it loads the artifact in "
             f"{r['load_s']:.1f} s (hashing the archive included).", "",
             "| | JAX (XLA) step | IREE host-cpu step | IREE / JAX |", "|---|---:|---:|---:|"]
    for what, value in (("s/step (median)", med), ("peak RSS GiB", gib)):
        lines.append(f"| {what} | {value(j):.2f} | {value(r):.2f} | {value(r) / value(j):.2f}x |"
                     if j else f"| {what} | - | {value(r):.2f} | - |")
    lines.append(f"| RSS after loading GiB (file-backed + anonymous) | - | {load['total']:.2f} "
                 f"({load['file']:.2f} + {load['anon']:.2f}) | |")
    end = r["rss_end_gib"]
    lines.append(f"| RSS after the last step GiB (file-backed + anonymous) | - | "
                 f"{end['total']:.2f} ({end['file']:.2f} + {end['anon']:.2f}) | |")
    if j:
        n = min(len(j["losses"]), len(r["losses"]))
        diff = max(abs(a - b) for a, b in zip(j["losses"][:n], r["losses"][:n]))
        lines.append(f"| losses | {' '.join(f'{x:.4f}' for x in j['losses'])} | "
                     f"{' '.join(f'{x:.4f}' for x in r['losses'])} | max diff {diff:.1e} |")
    if j and "others_cpu" in j and "others_cpu" in r:
        lines += ["", f"Other jobs on the machine used {100 * j['others_cpu']:.0f}% of its CPU "
                      f"time while the JAX row ran and {100 * r['others_cpu']:.0f}% during the "
                      f"IREE row (both slow down when they do)."]
    before = IREE_BEFORE.get(name) if row == "pockjax sparse last-k iree host-cpu" else None
    if before:
        lines += ["", before["text"]]
    return lines + [""]


def targets(s: dict, results: dict, ok, med) -> list[str]:
    out = []
    sparse = "pockjax sparse last-k f32"
    lows = ["pockjax sparse last-k bf16-frozen upcast",
            "pockjax sparse last-k bf16-frozen bf16-matmul",
            "pockjax sparse last-k bf16-frozen bf16-matmul remat"]

    def check(what, a, b, want, value, held):
        if not (ok(a) and ok(b)):
            return
        out.append(f"- {what}: {value(a, b)} (target {want}) -> "
                   f"{'holds' if held(a, b) else 'MISSED'}")

    speed = lambda a, b: f"{med(b) / med(a):.2f}x"
    for mine in (sparse, *lows):
        check(f"{label(mine, s)} vs torch full fused-adamw, speed", mine,
              "torch full fused-adamw", ">= 3x", speed, lambda a, b: med(b) / med(a) >= 3)
        check(f"{label(mine, s)} vs torch lora r8 q+v, speed", mine, "torch lora r8 q+v",
              ">= 1.3x", speed, lambda a, b: med(b) / med(a) >= 1.3)
    rss = lambda r: results[r]["rss_peak_mib"] / 1024
    for low in lows:
        check(f"{label(low, s)} vs torch lora r8 q+v, peak RSS", low, "torch lora r8 q+v",
              "<= LoRA's", lambda a, b: f"{rss(a):.2f} vs {rss(b):.2f} GiB",
              lambda a, b: rss(a) <= rss(b))
        check(f"{label(low, s)} step vs the float32 step", low, sparse, "<= 1.15x",
              lambda a, b: f"{med(a) / med(b):.2f}x", lambda a, b: med(a) / med(b) <= 1.15)
    for iree, source in IREE_ROWS.items():
        check(f"{label(iree, s)} vs {label(source, s)}, speed", iree, source, "<= 1.3x",
              lambda a, b: f"{med(a) / med(b):.2f}x", lambda a, b: med(a) / med(b) <= 1.3)
        check(f"{label(iree, s)} vs {label(source, s)}, peak RSS", iree, source, "<= 1.2x",
              lambda a, b: f"{rss(a):.2f} vs {rss(b):.2f} GiB = {rss(a) / rss(b):.2f}x",
              lambda a, b: rss(a) / rss(b) <= 1.2)
        if "bf16-frozen" in iree:
            check(f"{label(iree, s)} vs torch lora r8 q+v, peak RSS", iree, "torch lora r8 q+v",
                  "<= LoRA's", lambda a, b: f"{rss(a):.2f} vs {rss(b):.2f} GiB",
                  lambda a, b: rss(a) <= rss(b))
    check("pockjax full f32 vs jax+optax full f32, speed", "pockjax full f32",
          "jax+optax full f32", ">= 1x", speed, lambda a, b: med(b) / med(a) >= 1)
    for paper in ROWS:
        if paper.startswith("pockjax paper") and ok(paper) and s["layers"] == 32:
            out.append(f"- {paper} at LLaMA-2-7B's shape: peak RSS {rss(paper):.2f} GiB "
                       f"(target under 22 GiB) -> {'holds' if rss(paper) < 22 else 'MISSED'}")
    return out or ["- (not enough rows measured)"]


def write(store: dict, args) -> None:
    from pockjax.checkpoint import write_atomic

    lines = ["# Fine-tuning LLaMA at real sizes on this machine", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, "
             f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.0f} GiB, "
             f"{platform.platform()}. {versions(PACKAGES)}. Commit {commit()}.", "",
             f"AdamW {LR:g} (weight decay {WEIGHT_DECAY:g}), random weights and tokens, each "
             f"row in its own process: warm-up steps (compilation included), then timed "
             f"steps, median. Peak RSS is the row process's high-water mark (`VmHWM`; rows "
             f"run before 2026-11-24 12:00 UTC read `ru_maxrss`, which also counts the "
             f"starting process's resident memory); after its first step a row hands freed "
             f"heap back to the OS; the compiled step "
             f"is XLA's `memory_analysis()` (arguments + temporaries). A row stopped by the "
             f"memory guard ({args.limit_gib:g} GiB) says where. A row's allocator setting "
             f"is given beside its run time (`--malloc`, default huge pages: the step's "
             f"buffers are mapped afresh every step, and with 4 KiB pages they fault in one "
             f"by one); rows without one ran with glibc's default. Produced by "
             f"`python -m benchmarks real_size`; see the script's docstring for the rows.", ""]
    if store.get("compiled"):
        lines += compiled_table(store["compiled"])
    for name in PRESETS:
        if name in store and name != "smoke" or (name == "smoke" and args.llama == "smoke"):
            entry = store.get(name)
            if entry:
                runs: dict[str, list[str]] = {}
                for row in ROWS:
                    if row in entry["rows"]:
                        r = entry["rows"][row]
                        key = r.get("when", entry["when"])
                        key += f" ({r['malloc']})" if "malloc" in r else ""
                        runs.setdefault(key, []).append(label(row, entry["sizes"]))
                order = sorted(runs, key=lambda w: w.removeprefix("up to "))
                when = (next(iter(runs), entry["when"]) if len(runs) <= 1 else
                        "; ".join(f"{w}: {', '.join(runs[w])}" for w in order))
                lines += [f"Run: {when}; {entry['warmup']} warm-up + {entry['steps']} "
                          f"timed steps per row.", ""]
                lines += table(name, entry["sizes"], entry["rows"])
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out
    write_atomic(out, text.encode())
    charted = {n: {label(r, e["sizes"]): v for r, v in e["rows"].items()}
               for n, e in store.items()
               if n in PRESETS and (n != "smoke" or args.llama == "smoke")}
    rows = list(dict.fromkeys(label(r, store[n]["sizes"]) for n in charted for r in ROWS))
    for res in charted.values():  # the chart shows what ran; errors read "failed"
        for r, v in res.items():
            v.setdefault("rss_peak_mib", v.get("rss_polled_gib", 0) * 1024)
    if charted:
        chart(charted, [r for r in rows if any(r in res for res in charted.values())],
              os.path.splitext(out)[0] + ".png")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama", default="tinyllama-1.1b", choices=list(PRESETS))
    ap.add_argument("--rows", default=",".join(ROWS),
                    help="comma-separated subset of: " + ", ".join(ROWS))
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps (compilation)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per row")
    ap.add_argument("--limit-gib", type=float, default=21.0,
                    help="kill a row whose resident memory passes this")
    ap.add_argument("--out", default=RESULTS + ".md")
    ap.add_argument("--fresh", action="store_true", help="forget earlier rows of this preset")
    add_malloc_option(ap)
    ap.add_argument("--compiled", action="store_true",
                    help="only compile the pockjax steps of both shapes from shapes (no "
                         "weights allocated) and record their memory")
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--phase", choices=("export", "run"), help=argparse.SUPPRESS)
    ap.add_argument("--iree-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    s = PRESETS[args.llama]
    args.env, malloc = malloc_env(args.malloc)
    if args.row:
        if args.row in IREE_ROWS:
            run = iree_export if args.phase == "export" else iree_run
        else:
            run = run_torch if args.row.startswith("torch") else run_jax
        result = run(args.row, s, args)
        report_result(result)
        return

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {ROWS}")
    store_path = os.path.splitext(args.out)[0] + ".json"
    store = {}
    if os.path.exists(store_path):
        with open(store_path) as f:
            store = json.load(f)
    from pockjax.checkpoint import write_atomic
    if args.compiled:
        store["compiled"] = compiled_memory_rows()
        write_atomic(store_path, (json.dumps(store, indent=1) + "\n").encode())
        return write(store, args)
    entry = store.get(args.llama) if not args.fresh else None
    if not entry or (entry["steps"], entry["warmup"]) != (args.steps, args.warmup):
        entry = {"rows": {}}
    for r in entry["rows"].values():  # rows kept from earlier runs keep their own time
        r.setdefault("when", f"up to {entry.get('when', 'an earlier run')}")
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    entry.update(sizes=s, steps=args.steps, warmup=args.warmup, when=now)
    store[args.llama] = entry
    for row in rows:
        print(f"[{args.llama}] {row} ...", file=sys.stderr, flush=True, end=" ")
        before = _machine_cpu()
        if row in IREE_ROWS:
            r = run_iree_row(row, args)
        else:
            cmd = [os.path.abspath(__file__), "--llama", args.llama, "--row", row,
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--limit-gib", str(args.limit_gib)]
            r = guarded(cmd, args.limit_gib, args.timeout, args.env)
        r["when"], r["others_cpu"], r["malloc"] = now, _others_share(before, _machine_cpu()), malloc
        entry["rows"][row] = r
        print(r.get("error") or f"{statistics.median(r['times']):.2f} s/step, peak "
              f"{r['rss_peak_mib'] / 1024:.2f} GiB, {r['wall_s']:.0f} s",
              file=sys.stderr, flush=True)
        write_atomic(store_path, (json.dumps(store, indent=1) + "\n").encode())
    write(store, args)


if __name__ == "__main__":
    main()
