"""One row of `real_size.py` in its own process: the JAX rows (pockjax's and plain
JAX + optax's), the IREE rows' export and runtime processes, the PyTorch rows, and the
pockjax steps' memory compiled from shapes only. Each row says where it is as it goes
(`stage`), for the parent's memory guard."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (ROOT, proc_status_kib, report_result, rss_mib, timed_steps,
                               trim_heap)
from benchmarks.paper_table_workloads import jax_loss, make_batch
from benchmarks.real_size_models import (GIB, IREE_ROWS, LR, PRESETS, WEIGHT_DECAY,
                                         build_params, scheme_for, torch_config, torch_step)

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


def run_jax(row: str, s: dict, args) -> dict:
    import jax  # noqa: F401  (counted in the baseline, as the other rows' imports are)
    import optax  # noqa: F401

    import pockjax  # noqa: F401

    rss_imports = rss_mib()
    step, _, info = jax_row(row, s, args.limit_gib)
    losses, times = timed_steps(_staged(step), args.steps, args.warmup)
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

    losses, times = timed_steps(_staged(step), args.steps, args.warmup)
    return {"losses": losses, "times": times, "load_s": load_s, "rss_load_gib": loaded,
            "rss_end_gib": _rss_split(), "rss_imports_mib": rss_imports,
            "imports_jax": "jax" in sys.modules}


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
    losses, times = timed_steps(_staged(torch_step(net, opt, tokens)), args.steps, args.warmup)
    return {"losses": losses, "times": times, "rss_imports_mib": rss_imports,
            "trained_params": sum(p.numel() for p in params)}


# --------------------------------------------------------------------------- compiled only

VARIANTS = [("float32", None, "upcast"), ("bf16-frozen upcast", "bfloat16", "upcast"),
            ("bf16-frozen bf16-matmul", "bfloat16", "native")]


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
