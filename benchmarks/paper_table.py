"""PockEngine's headline table on this machine: per-iteration latency, memory and loss of
full fine-tuning, LoRA and sparse fine-tuning, PyTorch against JAX and pockjax, in one run.

Workloads (the same weights, data, Adam 1e-4 and steps for every row of a workload):

- `llama`: pockjax's Llama (8 layers, hidden 512, MLP 1376, 8 heads, vocabulary 256),
  random tokens, sequence 128, batch 8, next-token cross-entropy. PyTorch runs
  `transformers.LlamaForCausalLM` loaded from the same weights (`hf.save_llama`).
  Sparse: `schemes.transformer(last=num_layers // 2, extra=["lm_head/**"])`.
- `mobilenetv2`: MobileNetV2 width 1.0, 128x128 random images, 10 classes, batch 16,
  batch norm in training mode. PyTorch runs a port written below over the same weights.
  Sparse: `schemes.mobilenetv2(norms=True)`. Two more rows put the batch norms that
  scheme freezes entirely (scale and bias) in inference mode, as fine-tuning commonly
  does: `pockjax sparse (frozen BN folded)` (`pockjax.nnx.
  frozen_norms_in_inference_mode`, folded into the convolutions) and `torch frozen
  (frozen BN eval)`. Their loss differs from the training-mode rows by design; the
  folded row's first loss is checked against plain JAX with those norms in eval mode.

`--quick`: llama 4 layers, hidden 256, MLP 688, sequence 64, batch 4; mobilenetv2 width
0.5, 64x64 images, batch 8. `--llama llama2-7b` (or `layers=32,hidden=4096,...`) and
`--mobilenetv2 width=1.4,size=224` set other sizes, up to LLaMA-2-7B's shape on a
machine with the memory for it (full fine-tuning in float32 with Adam needs about
16 bytes per parameter, 108 GB for 6.7B).

Rows: PyTorch eager full, frozen (`requires_grad=False` on what the sparse scheme
freezes), LoRA r=8 (peft), torch.compile full; JAX + optax full and multi_transform
(the sparse scheme's tensors trained whole, the rest set to zero); pockjax full and
sparse (`pj.nnx.Trainer`); the sparse step exported to IREE host-cpu and run with
`pj.runtime`; pockjax full and sparse on the PyTorch rows' `LlamaForCausalLM` brought in
through `pockjax.torch` (LLaMA only), beside the Flax rows: the frontend's overhead. The JAX
rows on Flax models call `jax.clear_caches()` once the model is built, dropping the
programs JAX compiled for its initialisers, and every row returns the C heap's freed
pages to the OS after its first step. Each row runs in its own process (peak resident memory
from the OS is that row's alone) with a timeout; a row that fails says why in its cell. Prints markdown
tables and writes benchmarks/results/paper_table.md and paper_table.png.

`--rounds N` runs the rows N times in alternation (round 1: every row, then round 2, ...);
a row's step time is then the median of its rounds' medians, given with the rounds'
range, so a row is not judged by one process that met a busy moment of the machine.

    python benchmarks/paper_table.py [--quick] [--steps 10] [--warmup 3] [--rounds 1]
        [--workloads llama,mobilenetv2]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (ROOT, add_malloc_option, commit, malloc_env,  # noqa: E402
                               report_result, rss_mib, run_row as run_process, timed_steps,
                               versions)
from benchmarks.paper_table_report import PACKAGES, chart, table  # noqa: E402
from benchmarks.paper_table_workloads import (AUTO, FOLDED, FROZEN_BN_ROWS,  # noqa: E402
                                              LORA_TARGETS, LR, ROWS, TORCH_FRONTEND_ROWS,
                                              TORCH_FROZEN_EVAL, WORKLOADS, jax_loss,
                                              make_batch, make_model, sizes, sparse_scheme,
                                              torch_name, trained_paths)
from benchmarks.paper_table_workloads import describe  # noqa: E402,F401  (profile_step's)


def _path(keys) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)


# --------------------------------------------------------------------------- preparation


def prepare(workload: str, s: dict, data_dir: str) -> dict:
    """Weights for the PyTorch rows, and the JAX first-batch loss the ports must match."""
    import jax
    from flax import nnx

    import pockjax as pj

    model = make_model(workload, s)
    batch = make_batch(workload, s)
    if workload == "llama":
        from pockjax.models.hf import save_llama
        save_llama(model, os.path.join(data_dir, "hf"))
    else:
        _, params, rest = pj.nnx.split(model)
        flat = {}
        for tree in (params, rest):
            for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                flat[_path(keys)] = np.asarray(leaf)
        np.savez(os.path.join(data_dir, "mobilenetv2.npz"), **flat)
        with open(os.path.join(data_dir, "layout.json"), "w") as f:
            json.dump(mobilenetv2_layout(model), f)
    loss = nnx.jit(jax_loss(workload))(model, batch)
    trained = trained_paths(workload, model)
    with open(os.path.join(data_dir, "trained.json"), "w") as f:
        json.dump(trained, f)
    out = {"jax_first_loss": float(loss), "trained_tensors": len(trained),
           "tensors": len(pj.nnx.param_paths(model))}
    if workload == "mobilenetv2":
        # The same-semantics reference of the frozen-BN rows: flax's BatchNorm in eval
        # mode where the scheme freezes it, not folded (on a new model: the call above
        # moved this one's running statistics).
        from pockjax.nnx import frozen_norms_in_inference_mode
        model = make_model(workload, s)
        eval_norms = frozen_norms_in_inference_mode(model, sparse_scheme(workload, model),
                                                    fold=False)
        out["jax_first_loss_frozen_bn"] = float(nnx.jit(jax_loss(workload))(model, batch))
        out["frozen_bn"] = eval_norms
        with open(os.path.join(data_dir, "frozen_bn.json"), "w") as f:
            json.dump(eval_norms, f)
    return out


# --------------------------------------------------------------------------- PyTorch rows


def mobilenetv2_layout(model) -> dict:
    """The NNX MobileNetV2's convolutions as plain data, so the PyTorch rows need no JAX."""
    def conv(m):
        kh, kw, cin, cout = m.conv.kernel.shape
        groups = m.conv.feature_group_count
        return {"in": cin * groups, "out": cout, "k": kh, "stride": m.conv.strides[0],
                "groups": groups, "relu6": m.relu6}

    return {"stem": conv(model.stem), "head": conv(model.head),
            "classifier": list(model.classifier.kernel.shape),
            "blocks": [{"expand": conv(b.expand) if b.expand is not None else None,
                        "depthwise": conv(b.depthwise), "project": conv(b.project),
                        "residual": b.residual} for b in model.blocks]}


def torch_mobilenetv2(layout: dict, flat: dict):
    """MobileNetV2 as a torch nn.Module with `layout` and `flat`'s (NNX) weights."""
    import torch
    from torch import nn

    class ConvBN(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv = nn.Conv2d(c["in"], c["out"], c["k"], stride=c["stride"],
                                  padding=(c["k"] - 1) // 2, groups=c["groups"], bias=False)
            self.bn = nn.BatchNorm2d(c["out"], eps=1e-5, momentum=0.1)
            self.relu6 = c["relu6"]

        def forward(self, x):
            y = self.bn(self.conv(x))
            return nn.functional.relu6(y) if self.relu6 else y

    class Block(nn.Module):
        def __init__(self, src):
            super().__init__()
            self.expand = ConvBN(src["expand"]) if src["expand"] is not None else None
            self.depthwise, self.project = ConvBN(src["depthwise"]), ConvBN(src["project"])
            self.residual = src["residual"]

        def forward(self, x):
            y = self.expand(x) if self.expand is not None else x
            y = self.project(self.depthwise(y))
            return x + y if self.residual else y

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = ConvBN(layout["stem"])
            self.blocks = nn.ModuleList([Block(b) for b in layout["blocks"]])
            self.head = ConvBN(layout["head"])
            self.classifier = nn.Linear(*layout["classifier"])

        def forward(self, x):  # NHWC in, as the JAX model takes it
            h = self.stem(x.permute(0, 3, 1, 2))
            for block in self.blocks:
                h = block(h)
            return self.classifier(self.head(h).mean(dim=(2, 3)))

    net = Net()
    names = dict(net.named_parameters()) | dict(net.named_buffers())
    for path, value in flat.items():
        if path.endswith("/mean") or path.endswith("/var"):
            name = path.rsplit("/", 1)[0].replace("/", ".") + (
                ".running_mean" if path.endswith("/mean") else ".running_var")
        else:
            name = torch_name("mobilenetv2", path)
            if value.ndim == 4:
                value = value.transpose(3, 2, 0, 1)  # HWIO -> OIHW
            elif value.ndim == 2:
                value = value.T
        with torch.no_grad():
            names[name].copy_(torch.from_numpy(np.ascontiguousarray(value)))
    return net.train()


def run_torch(workload: str, row: str, s: dict, args) -> dict:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    if workload == "llama":
        import transformers  # noqa: F401  (counted in the baseline, as JAX's imports are)
    if row == "torch lora r8":
        import peft  # noqa: F401
    rss_imports = rss_mib()
    batch = make_batch(workload, s)
    with open(os.path.join(args.data, "trained.json")) as f:
        trained = {torch_name(workload, p) for p in json.load(f)}
    if workload == "llama":
        from transformers import LlamaForCausalLM
        net = LlamaForCausalLM.from_pretrained(os.path.join(args.data, "hf"),
                                               torch_dtype=torch.float32)
        net.train()
        tokens = torch.from_numpy(batch).long()

        def loss_fn(net):
            logits = net(input_ids=tokens).logits[:, :-1]
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   tokens[:, 1:].reshape(-1))
    else:
        flat = dict(np.load(os.path.join(args.data, "mobilenetv2.npz")))
        with open(os.path.join(args.data, "layout.json")) as f:
            net = torch_mobilenetv2(json.load(f), flat)
        x, y = torch.from_numpy(batch[0]), torch.from_numpy(batch[1]).long()

        def loss_fn(net):
            return F.cross_entropy(net(x), y)

    names = {n for n, _ in net.named_parameters()}
    if row == TORCH_FROZEN_EVAL:
        with open(os.path.join(args.data, "frozen_bn.json")) as f:
            for path in json.load(f):
                net.get_submodule(path.replace("/", ".")).eval()
    if row in ("torch frozen", TORCH_FROZEN_EVAL):
        missing = trained - names
        if missing:
            raise RuntimeError(f"scheme paths with no torch parameter: {sorted(missing)[:4]}")
        for n, p in net.named_parameters():
            p.requires_grad_(n in trained)
    elif row == "torch lora r8":
        from peft import LoraConfig, get_peft_model
        targets = (LORA_TARGETS if workload == "llama" else
                   r".*\.(expand|project)\.conv|head\.conv")  # the 1x1 convs
        net = get_peft_model(net, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=targets))
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=LR)
    forward = torch.compile(loss_fn) if row == "torch.compile full" else loss_fn

    def step():
        opt.zero_grad(set_to_none=True)
        loss = forward(net)
        loss.backward()
        opt.step()
        return float(loss.detach())

    losses, times = timed_steps(step, args.steps, args.warmup)
    return {"losses": losses, "times": times, "rss_imports_mib": rss_imports,
            "trained_params": sum(p.numel() for p in params)}


# --------------------------------------------------------------------------- JAX rows


def _memory(compiled) -> dict:
    """XLA's temp memory and FLOPs for a compiled step."""
    out = {}
    m = compiled.memory_analysis()
    if m is not None:
        out["temp_mib"] = m.temp_size_in_bytes / 2**20
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    if cost and "flops" in cost:
        out["gflop"] = float(cost["flops"]) / 1e9
    return out


def jax_step(workload: str, row: str, model, batch):
    """A JAX row's step on `model` (consumed): `(step, compiled, trainer, trained_params)`.

    `step()` runs one step and returns its loss as a float (synchronised); `compiled()`
    gives the step's executable (the pockjax rows compile it only when asked);
    `trainer` is the `pj.nnx.Trainer` of the pockjax rows (None for JAX + optax)."""
    import jax
    import optax
    from flax import nnx

    import pockjax as pj

    loss_fn = jax_loss(workload)
    opt = optax.adam(LR)
    trained = set(trained_paths(workload, model))
    if row.startswith("pockjax"):
        scheme = pj.Scheme(default=pj.Full()) if row == "pockjax full" else \
            sparse_scheme(workload, model)
        if row == FOLDED:
            from pockjax.nnx import frozen_norms_in_inference_mode
            frozen_norms_in_inference_mode(model, scheme, fold=True)
        trainer = pj.nnx.Trainer(model, loss_fn, optimizer=opt, scheme=scheme,
                                 backend="auto" if row == AUTO else "xla")

        def step():
            return float(jax.block_until_ready(trainer(batch)["loss"]))

        return step, lambda: trainer.lower(batch).compile(), trainer, \
            trainer.explain(batch).trainable_params

    graphdef, params, rest = pj.nnx.split(model)
    if row == "jax+optax full":
        tx = opt
    else:
        labels = jax.tree_util.tree_map_with_path(
            lambda keys, _: "train" if _path(keys) in trained else "frozen", params)
        tx = optax.multi_transform({"train": opt, "frozen": optax.set_to_zero()}, labels)

    def pure(params, rest, batch):
        m = pj.nnx.merge(graphdef, params, rest) if rest else nnx.merge(graphdef, params)
        loss = loss_fn(m, batch)
        return loss, (pj.nnx.split(m)[2] if rest else rest)

    def train_step(state, batch):
        params, rest, opt_state = state
        (loss, rest), grads = jax.value_and_grad(pure, has_aux=True)(params, rest, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), rest, opt_state), loss

    state = [(params, rest, tx.init(params))]
    compiled = jax.jit(train_step, donate_argnums=0).lower(state[0], batch).compile()
    trained_params = sum(int(np.prod(np.shape(x))) for keys, x in
                         jax.tree_util.tree_flatten_with_path(params)[0]
                         if row == "jax+optax full" or _path(keys) in trained)

    def step():
        state[0], loss = compiled(state[0], batch)
        return float(jax.block_until_ready(loss))

    return step, lambda: compiled, None, trained_params


def run_jax(workload: str, row: str, s: dict, args) -> dict:
    import jax
    import jax.numpy as jnp

    rss_imports = rss_mib()
    batch = jax.tree.map(jnp.asarray, make_batch(workload, s))
    iree = row.endswith("iree host-cpu")
    model = make_model(workload, s)
    # Building a Flax model eagerly compiles every initialiser on its own, and JAX keeps
    # those programs: 165 MiB of MobileNetV2 1.0's (docs/training.md, "The process's own memory").
    jax.clear_caches()
    step, compiled, trainer, trained_params = jax_step(
        workload, row.removesuffix(" iree host-cpu"), model, batch)
    extra = {"trained_params": trained_params, "rss_imports_mib": rss_imports}
    if iree:
        return {**extra, **run_iree(workload, trainer, batch, args)}
    losses, times = timed_steps(step, args.steps, args.warmup)
    if trainer is not None and trainer.choice is not None:
        extra["backend"] = str(trainer.choice)
    return {"losses": losses, "times": times, **extra, **_memory(compiled())}


def run_pockjax_torch(workload: str, row: str, s: dict, args) -> dict:
    """pockjax on the torch rows' `LlamaForCausalLM` (same weights), through pockjax.torch."""
    import jax
    import jax.numpy as jnp
    import optax
    import torch
    from transformers import LlamaForCausalLM

    import pockjax as pj

    torch.set_num_threads(os.cpu_count() or 1)
    rss_imports = rss_mib()
    net = LlamaForCausalLM.from_pretrained(os.path.join(args.data, "hf"),
                                           torch_dtype=torch.float32).eval()
    params, apply = pj.torch.functional(net, output=lambda out: out.logits)
    tokens = jnp.asarray(make_batch(workload, s))

    def lm_loss(p, tokens):
        logits = apply(p, tokens, use_cache=False)[:, :-1]
        targets = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1])
        return -jnp.mean(jnp.sum(targets * jax.nn.log_softmax(logits), axis=-1))

    # The same scheme as "pockjax sparse", on torch's names (q_proj/weight, lm_head/weight).
    scheme = pj.Scheme(default=pj.Full()) if row.endswith("full") else pj.schemes.transformer(
        params, last=max(1, s["layers"] // 2), extra=["lm_head/**"])
    trainer = pj.sparse_train(lm_loss, optimizer=optax.adam(LR), scheme=scheme)
    state = [trainer.init(params, copy=False)]

    def step():
        state[0], metrics = trainer(state[0], tokens)
        return float(jax.block_until_ready(metrics["loss"]))

    losses, times = timed_steps(step, args.steps, args.warmup)
    trained = sum(int(np.prod(np.shape(x))) for x in
                  jax.tree_util.tree_leaves(pj.trainable_view(state[0].params, scheme)))
    return {"losses": losses, "times": times, "trained_params": trained,
            "rss_imports_mib": rss_imports, **_memory(trainer.lower(state[0], tokens).compile())}


def run_iree(workload: str, trainer, batch, args) -> dict:
    import jax

    import pockjax as pj

    out = tempfile.mkdtemp(prefix="paper-table-iree-")
    try:
        t0 = time.perf_counter()
        art = trainer.export(batch, target="host-cpu", out_dir=os.path.join(out, "step"))
        export_s = time.perf_counter() - t0
        sess = pj.runtime.load(art.path, device="local-task")
        numpy_batch = jax.tree.map(np.asarray, batch)
        if not trainer.rest:
            def step():
                return float(sess.step(numpy_batch)["loss"])
        else:
            flat = pj.scheme.leaves_with_paths(trainer.rest)[0]
            treedef = jax.tree_util.tree_structure(trainer.rest)
            stats = [jax.tree.map(np.asarray, trainer.rest)]

            def step():
                got = sess.step({"batch": numpy_batch, "model_state": stats[0]})
                stats[0] = jax.tree_util.tree_unflatten(
                    treedef, [got[f"aux/model_state/{p}"] for p, _ in flat])
                return float(got["loss"])

        losses, times = timed_steps(step, args.steps, args.warmup)
        return {"losses": losses, "times": times, "export_s": export_s}
    finally:
        shutil.rmtree(out, ignore_errors=True)


# --------------------------------------------------------------------------- driver


def child(args) -> None:
    s = sizes(args.workload, args.quick, getattr(args, args.workload))
    run = (run_torch if args.row.startswith("torch") else
           run_pockjax_torch if args.row in TORCH_FRONTEND_ROWS else run_jax)
    result = run(args.workload, args.row, s, args)
    result["imports_jax"] = "jax" in sys.modules
    report_result(result)


def merge_rounds(rounds: list[dict]) -> dict:
    """One row's result over its rounds: the first round's (losses, memory, FLOPs), with
    `round_ms` the median step of each round, or the first failure's error."""
    failed = [r for r in rounds if "error" in r]
    if failed:
        return failed[0]
    merged = dict(rounds[0])
    if len(rounds) > 1:
        merged["round_ms"] = [statistics.median(r["times"]) * 1e3 for r in rounds]
        merged["rss_peak_mib"] = max(r["rss_peak_mib"] for r in rounds)
    return merged


def run_row(workload: str, row: str, args) -> dict:
    cmd = [os.path.abspath(__file__), "--workload", workload, "--row", row,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--data", args.data]
    for w in WORKLOADS:
        if getattr(args, w):
            cmd += [f"--{w}", getattr(args, w)]
    return run_process(cmd + (["--quick"] if args.quick else []), args.timeout,
                       env=getattr(args, "env", None))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller models (a few minutes)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps (compilation)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per row")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every row, in alternation; "
                    "a row's time is the median of its rounds' medians")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--llama", metavar="SPEC", help="LLaMA sizes: a preset (llama2-7b: 32 layers, "
                    "hidden 4096, MLP 11008, 32 heads, vocabulary 32000, sequence 512, batch 1) "
                    "and/or key=value overrides of layers, hidden, intermediate, heads, kv_heads, "
                    "vocab, seq, batch")
    ap.add_argument("--mobilenetv2", metavar="SPEC", help="MobileNetV2 sizes: key=value overrides "
                    "of width, size, batch")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of: " +
                    ", ".join(ROWS))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "paper_table.md"))
    add_malloc_option(ap)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.row:
        return child(args)

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for name, got, known in (("workloads", workloads, WORKLOADS), ("rows", rows, ROWS)):
        if [x for x in got if x not in known]:
            ap.error(f"unknown {name} {[x for x in got if x not in known]}; choose from {known}")
    command = "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv or sys.argv[1:]))
    args.env, malloc = malloc_env(args.malloc)
    started = time.perf_counter()
    lines = ["# PockEngine's table on this machine: full, LoRA and sparse fine-tuning", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}. "
             f"{versions(PACKAGES)}. Commit {commit()}. Command: `{command}`.", "",
             f"Adam {LR:g}, the same weights and batch every step. Each row in its own process: "
             f"{args.warmup} warm-up steps (compilation included), then {args.steps} timed "
             f"steps; " + (f"the rows run {args.rounds} times in alternation, and a row's time "
                           f"is the median of its rounds' medians, with the rounds' range. "
                           if args.rounds > 1 else "median and min-max. ") + f"Peak RSS is the row process's high-water mark (`VmHWM`); XLA temp is "
             f"the compiled step's `memory_analysis().temp_size_in_bytes`. The rows on Flax models "
             f"call `jax.clear_caches()` after building the model (JAX otherwise keeps the "
             f"programs it compiled for the initialisers), and every row returns the C heap's "
             f"freed pages to the OS (`malloc_trim`) after its first step. `torch frozen` and "
             f"`jax+optax multi_transform` train the tensors the sparse scheme trains, whole. "
             f"Allocator, every row: {malloc}.", ""]
    all_results = {}
    for w in workloads:
        s = sizes(w, args.quick, getattr(args, w))
        data = tempfile.mkdtemp(prefix=f"paper-table-{w}-")
        try:
            args.data = data
            print(f"[{w}] preparing weights ...", file=sys.stderr, flush=True)
            prep = prepare(w, s, data)
            rounds: dict = {row: [] for row in rows}
            for k in range(args.rounds):
                for row in rows:
                    if row in TORCH_FRONTEND_ROWS and w != "llama":
                        rounds[row] = [{"error": "LLaMA only (the Hugging Face module)"}]
                        continue
                    if row in FROZEN_BN_ROWS and w != "mobilenetv2":
                        rounds[row] = [{"error": "MobileNetV2 only (batch norms)"}]
                        continue
                    tag = f" (round {k + 1}/{args.rounds})" if args.rounds > 1 else ""
                    print(f"[{w}] {row}{tag} ...", file=sys.stderr, flush=True, end=" ")
                    r = run_row(w, row, args)
                    rounds[row].append(r)
                    print(r.get("error") or f"{statistics.median(r['times']) * 1e3:.1f} ms, "
                          f"{r['wall_s']:.0f} s", file=sys.stderr, flush=True)
            results = {row: merge_rounds(got) for row, got in rounds.items()}
        finally:
            shutil.rmtree(data, ignore_errors=True)
        all_results[w] = results
        lines += table(w, s, prep, results, rows, args)
    lines.append(f"Whole run: {time.perf_counter() - started:.0f} s.")
    text = "\n".join(lines) + "\n"
    print(text)
    from pockjax.checkpoint import write_atomic  # not at the top: PyTorch rows import no JAX
    write_atomic(args.out, text.encode())
    chart(all_results, rows, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
