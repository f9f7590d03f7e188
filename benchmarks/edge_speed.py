"""The small-model training step on this CPU: pockjax's schemes beside PyTorch and peft.

    python -m benchmarks edge_speed [--rounds 2] [--steps 10] [--rows NAME,NAME]
        [--size layers=6,hidden=256,...] [--out FILE]

The model is the quality benchmark's small preset's shape (a LLaMA of 6 blocks, width
256, MLP 688, 4 heads, vocabulary 8192; `--size` changes it), float32, one batch of 8 x
256 random tokens, AdamW (1e-4). Every row starts from the same weights (a pockjax
`Llama` saved as a Hugging Face folder, which the PyTorch rows load), so the first
step's loss agrees across frameworks. The rows:

- `torch full`: transformers' `LlamaForCausalLM`, fused AdamW, every weight;
- `peft LoRA r8`: peft LoRA of rank 8 (alpha 16) on every linear layer of the blocks;
- `jax+optax full`: `jax.jit(jax.value_and_grad)` and `optax.adamw` over pockjax's
  `Llama` (the plain-JAX reference);
- `pockjax full`, `pockjax paper` (PockEngine's scheme on the last half of the blocks),
  `pockjax last:2+head`, `pockjax last:1`, `pockjax LoRA r8`: `pockjax.sparse_train`
  with the scheme `pockjax finetune --scheme` names (LoRA: `pockjax.models.lora` on
  every linear layer).

Each row runs in its own process, the rows one after another, `--rounds` times in
alternation; a row's time is the median of its steps 3 to 10 (the first two hold
compilation and allocation), and the table gives the median over rounds with the
rounds' range. Each pockjax row also gets its FLOPs (`pockjax.count_flops` of the
compiled step's program) and the time they would take at this machine's float32 matmul
peak (the fastest of ten jitted 2048^3 products, measured in the parent process before
each round, the best round's): the row's bound. Every row's process runs with the
allocator a user gets (`--malloc pockjax`: each step's memory reused from the last;
`hugepages` adds glibc's huge-page tunable, `system` keeps JAX's and glibc's own
settings), and each row counts its minor page faults per step. Writes
`benchmarks/results/edge_speed.md` and `.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (DEFAULT_MALLOC, ROOT, add_malloc_option, commit,  # noqa: E402
                               malloc_env, report_result, run_row, versions)

SIZE = dict(layers=6, hidden=256, intermediate=688, heads=4, vocab=8192, seq=256, batch=8)
ROWS = ["torch full", "peft LoRA r8", "jax+optax full", "pockjax full", "pockjax paper",
        "pockjax last:2+head", "pockjax last:1", "pockjax LoRA r8"]
REFERENCE = "torch full"
LR = 1e-4
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WARMUP = 2


def parse_size(spec: str | None) -> dict:
    s = dict(SIZE)
    for item in filter(None, (spec or "").split(",")):
        key, _, value = item.partition("=")
        if key not in s:
            sys.exit(f"edge_speed: --size {item!r}: keys are {', '.join(s)}")
        s[key] = int(value)
    return s


def save_model(s: dict, folder: str) -> None:
    """The shared starting point: a pockjax `Llama` of size `s` (seed 0) as a Hugging
    Face folder."""
    from flax import nnx

    from pockjax.models.hf import save_llama
    from pockjax.models.llama import Llama, LlamaConfig

    config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"],
                         intermediate_size=s["intermediate"], num_layers=s["layers"],
                         num_heads=s["heads"], max_position_embeddings=s["seq"])
    save_llama(Llama(config, rngs=nnx.Rngs(0)), folder)


def tokens(s: dict):
    import numpy as np

    return np.random.default_rng(0).integers(0, s["vocab"], (s["batch"], s["seq"]),
                                             dtype=np.int32)


def torch_row(row: str, s: dict, folder: str) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if row.startswith("peft"):
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16,
                                                           lora_dropout=0.0,
                                                           target_modules=list(LINEARS)))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True)
    batch = torch.from_numpy(tokens(s)).long()

    def step():
        logits = model(input_ids=batch, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return {"step": step, "trained_params": sum(p.numel() for p in params),
            "framework": f"torch {torch.__version__}"}


def jax_row(row: str, s: dict, folder: str) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import pockjax as pj
    from pockjax.finetuning import lm_loss, scheme_from_spec
    from pockjax.models.hf import load_llama

    model = load_llama(folder)
    if row == "pockjax LoRA r8":
        from pockjax.models.lora import apply_lora

        apply_lora(model, rank=8, alpha=16.0, targets=LINEARS, rngs=nnx.Rngs(0))
    graphdef, params, rest = pj.nnx.split(model)
    batch = {"tokens": jnp.asarray(tokens(s)), "mask": jnp.ones((s["batch"], s["seq"]))}

    def loss(p, b):
        return lm_loss(pj.nnx.merge(graphdef, p, rest)(b["tokens"]), b["tokens"], b["mask"])

    opt = optax.adamw(LR, weight_decay=0.0)
    if row == "jax+optax full":
        def plain(p, o, b):
            value, grads = jax.value_and_grad(loss)(p, b)
            updates, o = opt.update(grads, o, p)
            return optax.apply_updates(p, updates), o, value

        train_step = jax.jit(plain, donate_argnums=(0, 1))
        state = [params, opt.init(params)]
        flops = pj.count_flops(train_step.trace(*state, batch))

        def step():
            state[0], state[1], value = train_step(state[0], state[1], batch)
            return float(value)

        return {"step": step, "flops": flops,
                "trained_params": sum(x.size for x in jax.tree.leaves(params)),
                "framework": f"jax {jax.__version__}"}
    spec = {"pockjax full": "full", "pockjax paper": "paper", "pockjax last:2+head": "last:2+head",
            "pockjax last:1": "last:1", "pockjax LoRA r8": "lora:8"}[row]
    scheme = scheme_from_spec(spec, params, s["layers"])
    trainer = pj.sparse_train(loss, optimizer=opt, scheme=scheme)
    state = [trainer.init(params)]
    flops = pj.count_flops(trainer.trace(state[0], batch))
    trained = trainer.explain(state[0], batch).trainable_params

    def step():
        state[0], metrics = trainer(state[0], batch)
        return float(metrics["loss"])

    return {"step": step, "flops": flops, "trained_params": trained,
            "framework": f"jax {jax.__version__}"}


def child(row: str, s: dict, folder: str, steps: int) -> None:
    built = (torch_row if row.startswith(("torch", "peft")) else jax_row)(row, s, folder)
    step = built.pop("step")
    import resource

    losses, times, faults = [], [], []
    for _ in range(WARMUP + steps):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    report_result({"row": row, "losses": losses, "times": times,
                   "s_per_step": statistics.median(times[WARMUP:]),
                   "faults_per_step": statistics.median(faults[WARMUP:]), **built})


def matmul_peak(repeats: int = 10) -> float:
    """This machine's float32 matmul rate, GFLOP/s: a jitted 2048^3 product, the fastest
    of `repeats` (a peak, which the machine's slow phases would pull down in a median)."""
    import jax
    import jax.numpy as jnp

    n = 2048
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    jax.block_until_ready(f(a, a))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, a))
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / min(times) / 1e9


def cpu_model() -> str:
    from benchmarks.quality import cpu_model as model

    return model()


def markdown(s: dict, results: dict, peak: float, meta: dict) -> str:
    ref = statistics.median(results[REFERENCE]["medians"]) if results.get(REFERENCE, {}).get(
        "medians") else None
    lines = [
        "# The small-model training step: pockjax beside PyTorch and peft", "",
        f"Run {meta['date']}, commit {meta['commit']}. {meta['cpu']}, {meta['cores']} cores; "
        f"{meta['versions']}. `python -m benchmarks edge_speed` (see its docstring for the "
        f"method): a LLaMA of {s['layers']} blocks, width {s['hidden']}, MLP "
        f"{s['intermediate']}, {s['heads']} heads, vocabulary {s['vocab']}"
        + (" (the quality benchmark's small model)" if s == SIZE else "")
        + f", float32, batch {s['batch']} x {s['seq']} tokens, AdamW; "
        f"each row in its own process, {meta['rounds']} rounds in alternation, the median "
        f"of steps 3-{WARMUP + meta['steps']} per round. The matmul peak measured here: "
        f"{peak:.0f} GFLOP/s (float32, 2048^3, the fastest of 10 products, best of the "
        f"rounds: {', '.join(f'{p:.0f}' for p in meta.get('peaks_gflops', [peak]))}). "
        f"Allocator, every row: "
        f"{meta.get('malloc', DEFAULT_MALLOC)}; *faults/step*: the process's minor page "
        f"faults in a timed step (median).", "",
        f"| row | trained params | s/step (median, rounds' range) | vs {REFERENCE} | "
        f"GFLOP/step | bound at peak, s | s/step over bound | faults/step | first loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row, r in results.items():
        if "error" in r:
            lines.append(f"| {row} | {r['error']} | | | | | | | |")
            continue
        med = statistics.median(r["medians"])
        rng = f"{min(r['medians']):.3f}-{max(r['medians']):.3f}"
        ratio = f"{med / ref:.2f}x" if ref else "-"
        faults = f"{r['faults_per_step']:,.0f}" if "faults_per_step" in r else "-"
        if r.get("flops"):
            bound = r["flops"] / (peak * 1e9)
            flop_cells = [f"{r['flops'] / 1e9:.1f}", f"{bound:.3f}", f"{med / bound:.2f}x"]
        else:
            flop_cells = ["-", "-", "-"]
        lines.append(f"| {row} | {r['trained_params']:,} | {med:.3f} ({rng}) | {ratio} | "
                     + " | ".join(flop_cells) + f" | {faults} | {r['losses'][0]:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="timed steps after the first two")
    ap.add_argument("--size", help="e.g. layers=4,hidden=128 (default: the quality "
                                   "benchmark's small model)")
    add_malloc_option(ap)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "edge_speed.md"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    s = parse_size(args.size)
    if args.child:
        child(args.child, s, args.folder, args.steps)
        return 0
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        sys.exit(f"edge_speed: no row {unknown[0]!r}; the rows are {', '.join(ROWS)}")
    env, malloc = malloc_env(args.malloc)
    results = {row: {"medians": []} for row in rows}
    with tempfile.TemporaryDirectory() as folder:
        save_model(s, folder)
        peaks = []
        for rnd in range(args.rounds):
            peaks.append(matmul_peak())  # each round: the best of them is the peak
            for row in rows:
                out = run_row(["-m", "benchmarks.edge_speed", "--child", row, "--folder", folder,
                               "--steps", str(args.steps)] +
                              (["--size", args.size] if args.size else []), timeout=3600,
                              env=env)
                if "error" in out:
                    results[row] = {"error": out["error"]}
                    print(f"edge_speed: {row}: {out['error']}", file=sys.stderr, flush=True)
                    continue
                if "error" in results[row]:
                    continue
                medians = results[row]["medians"] + [out["s_per_step"]]
                results[row] = {**out, "medians": medians}
                print(f"edge_speed: round {rnd + 1}: {row}: {out['s_per_step']:.3f} s/step",
                      file=sys.stderr, flush=True)
    peak = max(peaks)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(),
            "cpu": cpu_model(), "cores": os.cpu_count(), "rounds": args.rounds,
            "steps": args.steps, "size": s, "peak_gflops": peak, "peaks_gflops": peaks,
            "malloc": malloc,
            "versions": f"Python {platform.python_version()}, " + versions(
                ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "peft"))}
    text = markdown(s, results, peak, meta)
    from pockjax.checkpoint import write_atomic

    write_atomic(args.out, text.encode())
    write_atomic(os.path.splitext(args.out)[0] + ".json",
                 (json.dumps({"meta": meta, "rows": results}, indent=1) + "\n").encode())
    print(text)
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
