"""Quality of sparse fine-tuning: every method from the same pretrained model, on the
same batches and token budget, on two tasks the pretraining never saw.

    python -m benchmarks quality [--preset small|medium|quick|medium-quick] [--out FILE]
        [--work DIR] [--task-dir PATH] [--methods NAME,NAME]

The model is `benchmarks/pretrain.py`'s LLaMA pretrained on the Python standard library;
the tasks (`benchmarks/quality_data.py`) are domain adaptation to numpy's sources
(held-out loss) and writing a function's body from its signature and docstring, taken
from sympy (held-out loss on the body, and exact match of the body's first line under
greedy decoding). The methods (`METHODS`, one entry a row) are PyTorch full fine-tuning
as the quality reference, peft LoRA, and pockjax's schemes through `pockjax.finetune`.

Protocol, per method and task: the learning rate is chosen on the validation split
from a sweep (`Method.rates`, one seed, `sweep_steps`), then `seeds` runs at that rate
train `steps` steps each; the table gives their mean and spread. All runs see the same
batches: pockjax's runs are `pockjax.finetune`'s (`pockjax.data.batch_at`, the seed
fixing the order), and the PyTorch runs build the same ones with `pockjax.data` (which
loads no JAX, so PyTorch's memory is measured alone), with the same masked token-mean
loss, AdamW settings and learning-rate schedule. Every final model is saved as a Hugging
Face folder and scored by one evaluator (pockjax's forward pass), so the metrics are
computed the same way for all.

Each row (a method, both tasks) runs in its own process (`benchmarks.common.run_row`):
training first, peak memory read for each run (the process's high-water mark, reset
before it starts), evaluation last. Each finished run leaves `train.json` and, for
the chosen rate, `eval.json` in its folder under `--work`; a second call skips what is
finished, so an interrupted benchmark resumes where it stopped.

Results: `--out` (default `benchmarks/results/quality.md`) and the `.json` and `.png`
beside it: per method and task the test loss (nats per token), the pretraining
corpus's held-out loss after fine-tuning (forgetting), exact match, s/step, tokens/s,
peak RSS, trained parameters, and time to quality (wall-clock until the validation
loss is within 2% of PyTorch full fine-tuning's final one); the chart plots validation
loss against wall-clock time for every method.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import pretrain as pretraining  # noqa: E402
from benchmarks import quality_data  # noqa: E402
from benchmarks.common import (ROOT, commit, peak_rss_mib, report_result, run_row,  # noqa: E402
                               versions)

TASKS = ("domain", "instruct")
# Every linear layer of a LLaMA block: LoRA's targets and the Channels rows' weights.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUALITY_MARGIN = 0.02  # time to quality: validation loss within 2% of the reference's final

# Learning-rate grids: rows that train every weight, and rows that train few parameters
# (which want larger steps). The quick preset takes the last rate of a grid.
FULL_RATES = (1e-4, 3e-4, 1e-3)
FEW_RATES = (3e-4, 1e-3, 3e-3)

PRESETS = {
    # Minutes on a 2-core CPU: a test of the pipeline, not a measurement.
    "quick": dict(pretrain="quick", steps=16, sweep_steps=16, seeds=1, rates_in_sweep=1,
                  blockwise_every=4,
                  eval_points=4, batch=8, warmup_frac=0.1, sample_pct=30,
                  caps={"train": 2000, "valid": 32, "test": 64}, eval_batch=16,
                  search=dict(steps=10, lr=1e-3, last_blocks=1, parts=("mlp/**",),
                              ratios=()),
                  time_steps=4, row_timeout=900),
    # A row (sweep, 3 seeds, scoring) takes 14-20 minutes on a 2-core Xeon (the last 2
    # blocks with int4 frozen weights 14, PockEngine's scheme with int4 20), so the 19
    # rows take 5-6 hours there, pretraining's 40 minutes apart; on an H200 a row takes
    # 1.5-4.5 minutes with ten at a time (`python -m benchmarks gpu quality`). The
    # search's candidates are the weights of the last half of the blocks, each in full
    # and at 1/4 of its input channels: the library's default (every weight, at 1/8,
    # 1/4 and 1/2 too) would take about an hour a task.
    "small": dict(pretrain="small", steps=80, sweep_steps=30, seeds=3, rates_in_sweep=3,
                  blockwise_every=4,
                  eval_points=8, batch=8, warmup_frac=0.1, sample_pct=100,
                  caps={"train": 4000, "valid": 32, "test": 128}, eval_batch=16,
                  search=dict(steps=10, lr=1e-3, last_blocks=3, parts=("**",), ratios=(0.25,)),
                  time_steps=16, row_timeout=4 * 3600),
    # The 31.6M-parameter model (`benchmarks/pretrain.py`'s medium preset), the same tasks,
    # the rows of `MEDIUM_METHODS`. Sweep runs are as long as the seeds' runs, so seed 0 at
    # the chosen rate is its sweep run; 2 seeds. The search's candidates cover the whole
    # model at the granularity of a block's attention or MLP (`whole_model_candidates`),
    # 48 candidates instead of the library default's 200-odd single weights.
    "medium": dict(pretrain="medium", steps=80, sweep_steps=80, seeds=2, rates_in_sweep=3,
                   blockwise_every=2,
                   eval_points=8, batch=8, warmup_frac=0.1, sample_pct=100,
                   caps={"train": 4000, "valid": 32, "test": 128}, eval_batch=16,
                   search=dict(steps=10, lr=1e-3, whole_model=True, ratios=(0.25,)),
                   time_steps=16, row_timeout=8 * 3600),
    # The medium preset's code path (its corpus source, packed pretraining, whole-model
    # search, method list) at the quick preset's size: a test of the pipeline.
    "medium-quick": dict(pretrain="medium-quick", steps=8, sweep_steps=8, seeds=2,
                         rates_in_sweep=1, blockwise_every=2,
                         eval_points=4, batch=8, warmup_frac=0.1, sample_pct=30,
                         caps={"train": 2000, "valid": 16, "test": 32}, eval_batch=16,
                         search=dict(steps=4, lr=1e-3, whole_model=True, ratios=(0.25,)),
                         time_steps=4, row_timeout=900),
}
PRESETS["full"] = PRESETS["small"]  # the small preset's former name


@dataclasses.dataclass(frozen=True)
class Method:
    """One row of the table: `kind` picks the runner (`RUNNERS`); `scheme` is what
    `pockjax.finetune` trains (its own strings, or "@name" for a scheme built here by
    `build_scheme`); `rank` is LoRA's; `rates` the sweep's grid; `quick` puts the row in
    the quick preset; `frontend` is finetune's (the model code that runs); `frozen` its
    `frozen_dtype` (the frozen weights' storage)."""

    name: str
    kind: str
    scheme: str = ""
    rank: int = 0
    rates: tuple[float, ...] = ()
    quick: bool = True
    frontend: str = "auto"
    frozen: str = "float32"


METHODS = [
    Method("pretrained (no fine-tuning)", "pretrained"),
    Method("torch full (AdamW)", "torch", rates=FULL_RATES),
    Method("peft LoRA r8", "peft", rank=8, rates=FEW_RATES),
    Method("peft LoRA r16", "peft", rank=16, rates=FEW_RATES, quick=False),
    Method("pockjax full", "pockjax", "full", rates=FULL_RATES),
    Method("pockjax last:1", "pockjax", "last:1", rates=FEW_RATES, quick=False),
    Method("pockjax last:2", "pockjax", "last:2", rates=FEW_RATES, quick=False),
    Method("pockjax last:4", "pockjax", "last:4", rates=FULL_RATES, quick=False),
    Method("pockjax paper", "pockjax", "paper", rates=FEW_RATES),
    # The same schemes with the output head trained too (finetune's "+head").
    Method("pockjax paper+head", "pockjax", "paper+head", rates=FEW_RATES, quick=False),
    Method("pockjax last:2+head", "pockjax", "last:2+head", rates=FEW_RATES, quick=False),
    Method("pockjax bias+norms", "pockjax", "@bias-norms", rates=FEW_RATES, quick=False),
    Method("pockjax channels in 1/4", "pockjax", "@channels-in", rates=FEW_RATES, quick=False),
    Method("pockjax channels out 1/4", "pockjax", "@channels-out", rates=FEW_RATES, quick=False),
    Method("pockjax search:LoRA-r8", "pockjax", "@search:lora-r8", rates=FEW_RATES, quick=False),
    Method("pockjax search:50%", "pockjax", "@search:50%", rates=FEW_RATES, quick=False),
    Method("pockjax LoRA r8", "pockjax", "lora:8", rank=8, rates=FEW_RATES, quick=False),
    # One block at a time, each for `every` steps, from the last block back (the preset's
    # `blockwise_every`: about 3 turns per block over a run).
    Method("pockjax blockwise", "pockjax", "@blockwise", rates=FULL_RATES, quick=False),
    # PockEngine's scheme on transformers' own LlamaForCausalLM through pockjax.torch.
    Method("pockjax.torch paper", "pockjax", "paper", rates=FEW_RATES, quick=False,
           frontend="torch"),
    # Frozen weights in 4 and 8 bits (pockjax.lowbit) against the same schemes in float32.
    Method("pockjax paper int4", "pockjax", "paper", rates=FEW_RATES, quick=False,
           frozen="int4"),
    Method("pockjax paper int8", "pockjax", "paper", rates=FEW_RATES, quick=False,
           frozen="int8"),
    Method("pockjax last:2 int4", "pockjax", "last:2", rates=FEW_RATES, quick=False,
           frozen="int4"),
]
REFERENCE = "torch full (AdamW)"
# The medium preset's rows: the references, LoRA, and pockjax's whole-block, channel,
# searched and scheduled schemes.
MEDIUM_METHODS = ("pretrained (no fine-tuning)", "torch full (AdamW)", "peft LoRA r8",
                  "peft LoRA r16", "pockjax full", "pockjax last:1", "pockjax last:2",
                  "pockjax paper", "pockjax paper+head", "pockjax search:LoRA-r8",
                  "pockjax channels in 1/4", "pockjax blockwise")


PRESET_TITLES = {"quick": "quick preset", "small": "small preset, 8.9M parameters",
                 "full": "small preset, 8.9M parameters",
                 "medium": "medium preset, 31.6M parameters",
                 "medium-quick": "medium-quick preset"}
# Each preset's results page (the .json and .png beside it).
RESULTS = {"quick": "quality_quick.md", "small": "quality.md", "medium": "quality_medium.md",
           "medium-quick": "quality_medium-quick.md"}


def preset_methods(preset: str) -> list[Method]:
    """The rows a preset runs: the quick preset's marked ones, the small preset's all,
    the medium presets' `MEDIUM_METHODS`."""
    if preset.startswith("medium"):
        return [m for m in METHODS if m.name in MEDIUM_METHODS]
    return [m for m in METHODS if m.quick or preset in ("small", "full")]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-").replace("--", "-")


def method_named(name: str) -> Method:
    for m in METHODS:
        if m.name == name or slug(m.name) == name:
            return m
    sys.exit(f"quality benchmark: no method {name!r}; the methods are: "
             + ", ".join(slug(m.name) for m in METHODS))


# --------------------------------------------------------------------------- the runs


_LOG: list[Path] = []  # the row's log file, set by row_main


def _log(text: str) -> None:
    """A progress line on stderr and in the row's `log.txt`."""
    line = f"[{time.strftime('%H:%M:%S')}] {text}"
    print(line, file=sys.stderr, flush=True)
    for path in _LOG:
        with open(path, "a") as f:
            f.write(line + "\n")


def run_dir(cfg: dict, method: Method, task: str, lr: float, seed: int, steps: int) -> Path:
    return Path(cfg["runs"]) / slug(method.name) / task / f"lr{lr:g}-seed{seed}-steps{steps}"


def eval_every(steps: int, cfg: dict) -> int | None:
    """Steps between validations: `eval_points` along the runs whose curves are plotted
    (the chosen rate's), only at the start and the end of shorter sweep runs."""
    return max(1, steps // cfg["eval_points"]) if steps == cfg["steps"] else None


def lr_at(step: int, lr: float, warmup: int, total: int) -> float:
    """`pockjax.finetune`'s cosine schedule (linear warm-up, then cosine decay to 0) at
    optimizer step `step` (0-based): what the PyTorch runs set before each step."""
    if step < warmup:
        return lr * step / warmup
    decay = max(total - warmup, 1)
    return lr * 0.5 * (1 + math.cos(math.pi * min(step - warmup, decay) / decay))


def warmup_steps(steps: int, cfg: dict) -> int:
    return int(round(cfg["warmup_frac"] * steps))


def read_metrics(path: Path) -> dict:
    """A run's `metrics.jsonl` (`pockjax.finetune`'s format, which the PyTorch runs
    write too) as step times, tokens and the validation curve (each evaluation at the
    training clock's reading when it ran, 0 before the first step)."""
    train, valid = [], []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("loss") is not None:
            train.append(r)
        if "valid_loss" in r:
            valid.append(r)
    at = {r["step"]: r["seconds"] for r in train}
    at[0] = 0.0
    curve = [[r.get("seconds", at.get(r["step"], float("nan"))), r["step"], r["valid_loss"]]
             for r in valid]
    # Step 1 holds compilation (pockjax); the median is robust to the steps that
    # include an evaluation.
    durations = [b["seconds"] - a["seconds"] for a, b in zip(train[1:], train[2:])]
    step_s = statistics.median(durations) if durations else float("nan")
    tokens = [r["tokens"] for r in train[1:]]
    nan = float("nan")
    return {"steps": len(train), "s_per_step": step_s,
            "first_step_s": train[0]["seconds"] if train else float("nan"),
            "tokens_per_s": statistics.mean(tokens) / step_s if tokens and step_s > 0 else nan,
            "tokens": sum(r["tokens"] for r in train),
            "seconds": train[-1]["seconds"] if train else 0.0,
            "final_train_loss": statistics.mean(r["loss"] for r in train[-5:]) if train else nan,
            "valid_curve": curve, "final_valid_loss": curve[-1][2] if curve else nan}


def reset_peak_rss() -> None:
    """Reset the process's high-water mark (`VmHWM`) to its current RSS (Linux 4.0+), so
    the next reading is this run's peak, not an earlier run's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def one_run(cfg: dict, method: Method, task: str, lr: float, seed: int, steps: int,
            scheme: str | None) -> dict:
    """Train one run (cached: a folder with `train.json` is read back); its summary."""
    out = run_dir(cfg, method, task, lr, seed, steps)
    done = out / "train.json"
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(out, ignore_errors=True)  # a run cut short starts again
    out.mkdir(parents=True)
    _log(f"{method.name} / {task}: lr {lr:g}, seed {seed}, {steps} steps")
    reset_peak_rss()
    try:
        extra = RUNNERS[method.kind](cfg, method, task, lr, seed, steps, out, scheme)
    except FloatingPointError as e:
        # Kept as a result: a rate that diverges loses the sweep; running it again would
        # diverge again.
        extra = {"diverged": str(e)}
    peak = peak_rss_mib()
    summary = {"method": method.name, "task": task, "lr": lr, "seed": seed, "steps": steps,
               **read_metrics(out / "metrics.jsonl"), "peak_rss_mib": peak, **extra}
    if "diverged" in summary:
        summary["final_valid_loss"] = float("nan")
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    (out / "train.json").write_text(json.dumps(summary, indent=1) + "\n")
    diverged = f"; diverged: {extra['diverged']}" if "diverged" in extra else ""
    _log(f"  valid {summary['final_valid_loss']:.4f}, {summary['s_per_step']:.3f} s/step, "
         f"peak {peak:.0f} MiB{diverged}")
    return summary


def train_pockjax(cfg, method, task, lr, seed, steps, out: Path, scheme) -> dict:
    """A run of `pockjax.finetune` with scheme `scheme` (a finetune scheme string or a
    scheme JSON file)."""
    import pockjax as pj
    from pockjax.finetuning import NonFiniteLoss

    data = cfg["tasks"][task]
    try:
        result = pj.finetune(cfg["pretrained"], data["train"], out, valid=data["valid"],
                             scheme=scheme, steps=steps, batch=cfg["batch"], seq=cfg["seq"],
                             lr=lr, warmup=warmup_steps(steps, cfg), schedule="cosine",
                             eval_every=eval_every(steps, cfg), keep=1, seed=seed,
                             overwrite=True, plot=False, progress=False,
                             frontend=method.frontend, frozen_dtype=method.frozen)
    except NonFiniteLoss as e:
        raise FloatingPointError(str(e)) from None
    import jax

    return {"trained_params": result.trainable_params, "total_params": result.total_params,
            "final": result.final, "device": jax.devices()[0].device_kind}


def train_torch(cfg, method, task, lr, seed, steps, out: Path, scheme) -> dict:
    """A PyTorch run of the pretrained folder (transformers' LlamaForCausalLM; with a
    peft LoRA of rank `method.rank` on every linear layer for kind "peft") on
    `pockjax.finetune`'s batches: `pockjax.data`'s, built by the calls finetune makes
    (`batch_examples` + `pad_batch`, which are `batch_at`). `pockjax.data` and
    `pockjax.tokenizer` load no JAX, so the process's memory is PyTorch's alone."""
    import torch
    import transformers

    from pockjax.data import batch_examples, eval_batches, pad_batch, read_jsonl
    from pockjax.tokenizer import Tokenizer

    torch.manual_seed(seed)
    # "cuda" where the runs are trained on a GPU (`python -m benchmarks gpu quality`):
    # float32 throughout, as PyTorch multiplies float32 on a GPU unless told otherwise.
    device = cfg.get("torch_device", "cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(cfg["pretrained"],
                                                              dtype=torch.float32).to(device)
    if method.kind == "peft":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=method.rank, lora_alpha=2 * method.rank, lora_dropout=0.0,
            target_modules=list(LINEARS)))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    try:  # fused AdamW runs on CPU from PyTorch 2.4
        opt, impl = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True), "fused"
    except (RuntimeError, TypeError):
        opt, impl = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True), "foreach"
    tok = Tokenizer.from_folder(cfg["pretrained"])
    pad = tok.pad_id if tok.pad_id is not None else (tok.eos_id or 0)  # as finetune pads
    seq, batch, vocab = cfg["seq"], cfg["batch"], model.config.vocab_size
    train = read_jsonl(cfg["tasks"][task]["train"], tok, seq, vocab_size=vocab)
    valid = list(eval_batches(read_jsonl(cfg["tasks"][task]["valid"], tok, seq,
                                         vocab_size=vocab), batch, seq, pad))

    def loss_of(tokens, mask, reduce=True):
        logits = model(input_ids=tokens, use_cache=False).logits
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), tokens[:, 1:].flatten(),
            reduction="none").view(mask[:, 1:].shape)
        w = mask[:, 1:]
        return (nll * w).sum() / w.sum().clamp(min=1.0) if reduce else ((nll * w).sum(), w.sum())

    def evaluate() -> float:
        total = count = 0.0
        with torch.no_grad():
            for b in valid:
                s, n = loss_of(torch.from_numpy(b["tokens"]).long().to(device),
                               torch.from_numpy(b["mask"]).to(device), False)
                total, count = total + float(s), count + float(n)
        return total / count

    every, warmup = eval_every(steps, cfg) or steps, warmup_steps(steps, cfg)
    with open(out / "metrics.jsonl", "w") as log:
        def write(record):
            log.write(json.dumps(record) + "\n")
            log.flush()

        write({"step": 0, "valid_loss": evaluate(), "seconds": 0.0})
        began = time.perf_counter()
        clock = lambda: round(time.perf_counter() - began, 3)
        for i in range(steps):
            examples = batch_examples(train, i, batch, seed=seed)
            b = pad_batch(examples, batch, seq, pad)
            rate = lr_at(i, lr, warmup, steps)
            for group in opt.param_groups:
                group["lr"] = rate
            loss = loss_of(torch.from_numpy(b["tokens"]).long().to(device),
                           torch.from_numpy(b["mask"]).to(device))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            value = loss.item()
            if not math.isfinite(value):
                raise FloatingPointError(f"step {i + 1}: the loss is {value}; lower the learning "
                                         f"rate ({lr:g})")
            write({"step": i + 1, "loss": value, "lr": rate,
                   "tokens": sum(len(e.ids) for e in examples),
                   "seconds": round(time.perf_counter() - began, 3)})
            if (i + 1) % every == 0 and i + 1 < steps:
                write({"step": i + 1, "valid_loss": evaluate(), "seconds": clock()})
        write({"step": steps, "valid_loss": evaluate(), "seconds": clock()})
    trained = sum(p.numel() for p in params)
    if method.kind == "peft":
        model = model.merge_and_unload()
    total = sum(p.numel() for p in model.parameters())
    final = out / "final"
    model.to("cpu").save_pretrained(final)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(cfg["pretrained"]) / name, final / name)
    return {"trained_params": trained, "total_params": total, "optimizer": f"AdamW ({impl})",
            "final": str(final), "device": device if device == "cpu"
            else torch.cuda.get_device_name(device)}


def train_nothing(cfg, method, task, lr, seed, steps, out: Path, scheme) -> dict:
    """The pretrained model itself, scored like the others (a run of 0 steps)."""
    (out / "metrics.jsonl").write_text("")
    return {"trained_params": 0, "total_params": None, "final": cfg["pretrained"]}


RUNNERS = {"pockjax": train_pockjax, "torch": train_torch, "peft": train_torch,
           "pretrained": train_nothing}


# --------------------------------------------------------------------------- schemes


def build_scheme(cfg: dict, spec: str, task: str) -> str:
    """What `pockjax.finetune(scheme=...)` gets for a method's `scheme`: its own strings
    as they are; "@name" a scheme JSON file built here (cached under the runs folder)."""
    if not spec.startswith("@"):
        return spec
    name = spec[1:]
    if name == "blockwise":
        return f"blockwise:{cfg['blockwise_every']}"
    if name.startswith("search:"):
        return search_scheme(cfg, name.split(":", 1)[1], task)
    path = Path(cfg["runs"]) / "schemes" / f"{name}.json"
    if path.is_file():
        return str(path)
    import pockjax as pj
    from pockjax.finetuning import load_model

    params = load_model(cfg["pretrained"]).params
    if name == "bias-norms":
        # LLaMA has no biases; its 1-D "scale"s are the RMSNorms'. bias_only keeps only
        # the names the model has.
        scheme = pj.schemes.bias_only(params, names=("bias", "scale"))
    elif name in ("channels-in", "channels-out"):
        # A quarter of the input (or output) channels of every linear layer of every block.
        scheme = pj.schemes.transformer(params, attention=LINEARS[:4], mlp=LINEARS[4:],
                                        ratio=0.25, axis=name.split("-")[1])
    else:
        raise ValueError(f"no scheme named {spec!r}; add it to build_scheme")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(scheme.to_json())
    return str(path)


def lora_budget_bytes(cfg: dict, rank: int = 8) -> int:
    """LoRA's step memory as the search measures every budget: XLA's compiled peak
    (arguments + outputs - donated + temporaries) of pockjax's step for the pretrained
    model with rank-`rank` adapters on every linear layer (`pockjax.models.lora`).
    peft's process RSS would not do: it counts PyTorch's runtime, which the search's
    compiled steps do not."""
    import jax
    import optax
    from flax import nnx

    import pockjax as pj
    from pockjax.finetuning import lm_loss
    from pockjax.models.hf import load_llama
    from pockjax.models.lora import apply_lora

    model = apply_lora(load_llama(cfg["pretrained"]), rank=rank, alpha=2.0 * rank,
                       targets=list(LINEARS), rngs=nnx.Rngs(0))
    graphdef, params, rest = pj.nnx.split(model)

    def loss(p, b):
        return lm_loss(pj.nnx.merge(graphdef, p, rest)(b["tokens"]), b["tokens"], b["mask"])

    trainer = pj.sparse_train(loss, optimizer=optax.adamw(1e-3), scheme=pj.schemes.lora())
    batch = {"tokens": jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"]), "int32"),
             "mask": jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"]), "float32")}
    traced = trainer.trace(jax.eval_shape(trainer.init, params), batch)
    return pj.compiled_memory(traced.lower().compile())["peak"]


def whole_model_candidates(params, ratios) -> list:
    """The medium preset's search candidates, over the whole model: each block's attention
    and MLP in full (`find_candidates(unit="module")`), the last half of the blocks' also
    at `ratios` of their input channels, the embedding (in full, and the rows of the first
    quarter of the vocabulary), the output head (in full and at a quarter of its input
    channels), the final norm, and the block norms of the last block, of the last half
    of the blocks and of all blocks."""
    import pockjax as pj

    names = pj.schemes.blocks(params)
    late = set(names[len(names) // 2:])
    keep_vectors = {1, max(1, len(names) // 2), len(names)}
    out = []
    for c in pj.scheme_search.find_candidates(params, ratios=ratios, unit="module"):
        block = next((b for b in names if c.group.startswith(b + "/")), None)
        if c.group == "vectors":
            if int(c.name.split()[-2]) not in keep_vectors:
                continue
        elif block is not None and not c.name.endswith(" full") and block not in late:
            continue
        out.append(c)
    return out


def full_step_bytes(factory, params, batch) -> int:
    """Full fine-tuning's compiled step memory (the search's 100%)."""
    import jax

    import pockjax as pj

    trainer = factory(pj.Scheme(default=pj.Full()))
    traced = trainer.trace(jax.eval_shape(trainer.init, params), batch)
    return pj.compiled_memory(traced.lower().compile())["peak"]


def search_scheme(cfg: dict, budget: str, task: str) -> str:
    """`pockjax.search_scheme` under `budget` ("lora-r8": LoRA r8's step memory; else a
    finetune budget such as "50%"), run once per task as `pockjax.finetune`'s
    search:BUDGET runs it (the first training batches, scored on the validation data),
    over the preset's candidates (the weights of the last `last_blocks` blocks matching
    `parts`, in full and at `ratios` of their input channels); the candidates' runs are
    cached and shared by both budgets. Returns the chosen scheme as a JSON file, which
    every learning rate and seed then trains."""
    folder = Path(cfg["runs"]) / "search" / task
    path = folder / f"{slug(budget)}.json"
    if path.is_file():
        return str(path)
    import optax

    import pockjax as pj
    from pockjax.data import batch_at, eval_batches, read_jsonl
    from pockjax.finetuning import lm_loss, load_model

    settings = cfg["search"]
    if budget == "lora-r8":
        value = lora_budget_bytes(cfg, 8)
    else:
        value = budget
    loaded = load_model(cfg["pretrained"])
    tok = pj.Tokenizer.from_folder(cfg["pretrained"])
    pad = tok.pad_id if tok.pad_id is not None else (tok.eos_id or 0)
    seq, batch = cfg["seq"], cfg["batch"]
    train = read_jsonl(cfg["tasks"][task]["train"], tok, seq, vocab_size=loaded.vocab_size)
    valid = read_jsonl(cfg["tasks"][task]["valid"], tok, seq, vocab_size=loaded.vocab_size)
    train_batches = [batch_at(train, i, batch, seq, seed=0, pad_id=pad)
                     for i in range(settings["steps"])]
    heldout = list(eval_batches(valid, batch, seq, pad))[:4]

    def loss(p, b):
        return lm_loss(loaded.apply(p, b["tokens"]), b["tokens"], b["mask"])

    def factory(scheme):
        return pj.sparse_train(loss, optimizer=optax.adamw(settings["lr"]), scheme=scheme)

    if settings.get("whole_model"):
        options = {"candidates": whole_model_candidates(loaded.params, settings["ratios"])}
    else:
        last = pj.schemes.blocks(loaded.params)[-settings["last_blocks"]:]
        options = {"include": [f"{b}/{part}" for b in last for part in settings["parts"]],
                   "ratios": settings["ratios"]}
    import jax

    if budget == "lora-r8" and value >= full_step_bytes(factory, loaded.params, train_batches[0]):
        # LoRA on every linear layer keeps every layer's activations for its adapters'
        # backward pass, so its compiled step can need as much as full fine-tuning's: a
        # budget that admits every weight. Said in the table's notes, not searched.
        full = full_step_bytes(factory, loaded.params, train_batches[0])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{slug(budget)}.info.json").write_text(json.dumps(
            {"budget": budget, "budget_bytes": value, "full_bytes": full, "chosen": ["every weight"],
             "candidates": 0, "seconds": 0.0, "admits_full": True}, indent=1) + "\n")
        path.write_text(pj.Scheme(default=pj.Full()).to_json())
        return str(path)
    t0 = time.perf_counter()
    # The backend is part of the cache's key: compiled memory differs between a GPU and
    # this CPU, so candidates measured on one are not mixed with the other's.
    scheme, report = pj.search_scheme(factory, loaded.params, (train_batches, heldout),
                                      budget=value, steps=settings["steps"],
                                      cache=str(folder / "cache"),
                                      cache_key=jax.default_backend(), progress=False,
                                      **options)
    folder.mkdir(parents=True, exist_ok=True)
    info = {"budget": budget, "budget_bytes": report.budget_bytes,
            "full_bytes": report.full_bytes, "forward_bytes": report.forward_bytes,
            "measured_bytes": report.measured_bytes, "chosen": report.chosen,
            "candidates": len(report.results), "seconds": time.perf_counter() - t0}
    (folder / f"{slug(budget)}.info.json").write_text(json.dumps(info, indent=1) + "\n")
    path.write_text(scheme.to_json())
    _log(f"search {budget} on {task}: {len(report.results)} candidates, chose "
              f"{', '.join(report.chosen)} ({info['seconds']:.0f} s)")
    return str(path)


# --------------------------------------------------------------------------- evaluation


@dataclasses.dataclass
class ExactMatchCheck:
    """What greedy decoding must produce for one example: the argmax at each position
    of `exact` equals its token, and the token predicted at `boundary[0]` starts with
    `boundary[1]` (the rest of the line and its newline: the next line begins)."""

    ids: list[int]                       # the example as read_jsonl tokenizes it
    exact: list[tuple[int, int]]         # (position whose argmax is checked, token)
    boundary: tuple[int, str]


def exact_match_check(tok, prompt: str, completion: str) -> ExactMatchCheck:
    """The check for the first non-blank line of `completion` after `prompt`, at the
    positions `pockjax.data.read_jsonl` gives them (prompt, completion, end token; the
    logits at position t predict token t + 1)."""
    head = tok.encode(prompt, add_special_tokens=True)
    ids, offsets = tok.encode_with_offsets(completion)
    _, end = quality_data.first_line_span(completion)
    exact, boundary = [], None
    for k, (a, b) in enumerate(offsets):
        if b <= end:
            exact.append((len(head) + k - 1, ids[k]))
        else:
            boundary = (len(head) + k - 1, completion[a:end + 1])
            break
    if boundary is None:  # the line runs to the end: the end token follows it
        boundary = (len(head) + len(ids) - 1, None)
    return ExactMatchCheck(head + ids + [tok.eos_id], exact, boundary)


def exact_matches(checks: list[ExactMatchCheck], argmax, tok) -> list[bool]:
    """Per example, whether greedy decoding reproduces its first line, from the argmax
    of a teacher-forced pass (`argmax[i][t]`: the most likely token after position t)."""
    hits = []
    for check, pred in zip(checks, argmax):
        ok = all(int(pred[pos]) == token for pos, token in check.exact)
        pos, text = check.boundary
        if ok:
            ok = (int(pred[pos]) == tok.eos_id if text is None else
                  tok.decode([int(pred[pos])], skip_special_tokens=False).startswith(text))
        hits.append(bool(ok))
    return hits


class Evaluator:
    """Scores a Hugging Face folder with pockjax's forward pass, the same computation
    for every method: the test split's loss (tokens the loss counts, summed over the
    split, as `pockjax.finetune`'s validation), the pretraining corpus's held-out loss,
    and for task "instruct" exact match of the body's first line.

    Exact match is read off one teacher-forced pass: greedy decoding reproduces the
    reference's tokens exactly when each is the argmax given the reference before it,
    so "the first line's tokens are each the argmax, and the argmax after them starts
    the next line" is greedy decoding's answer (for the reference's own tokenization of
    the line; a model that spelled the line with other tokens would count as a miss).
    """

    def __init__(self, cfg: dict):
        import jax
        import numpy as np
        import optax

        import pockjax as pj
        from pockjax.data import read_jsonl
        from pockjax.models.hf import load_llama

        self.cfg, self.np = cfg, np
        self.tok = pj.Tokenizer.from_folder(cfg["pretrained"])
        self.pad = self.tok.pad_id if self.tok.pad_id is not None else (self.tok.eos_id or 0)
        model = load_llama(cfg["pretrained"])
        self.graphdef, _, self.rest = pj.nnx.split(model)
        vocab, seq = model.config.vocab_size, cfg["seq"]
        self.sets = {task: read_jsonl(cfg["tasks"][task]["test"], self.tok, seq, vocab_size=vocab)
                     for task in TASKS}
        self.sets["corpus"] = read_jsonl(cfg["corpus_heldout"], self.tok, seq, vocab_size=vocab)
        self.checks = self._exact_match_checks(cfg["tasks"]["instruct"]["test"])

        def stats(params, tokens, mask):
            logits = pj.nnx.merge(self.graphdef, params, self.rest)(tokens)
            nll = optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1].astype("float32"), tokens[:, 1:])
            w = mask[:, 1:]
            return (nll * w).sum(), w.sum(), logits.argmax(-1)

        self.stats = jax.jit(stats)

    def _exact_match_checks(self, path) -> list:
        lines = Path(path).read_text().splitlines()
        examples = self.sets["instruct"].examples
        if len(examples) != len(lines):
            raise RuntimeError(f"{path}: {len(lines)} records but {len(examples)} examples; "
                               f"every example must fit the sequence length (rebuild the data)")
        checks = []
        for line, example in zip(lines, examples):
            record = json.loads(line)
            check = exact_match_check(self.tok, record["prompt"], record["completion"])
            if list(example.ids) != check.ids:
                raise RuntimeError("the evaluator tokenizes an example differently from "
                                   "pockjax.data.read_jsonl; rebuild the data")
            checks.append(check)
        return checks

    def _pass(self, params, dataset):
        """Summed loss and count over `dataset`, and the argmax of every example."""
        from pockjax.data import eval_batches

        np, b = self.np, self.cfg["eval_batch"]
        total = count = 0.0
        argmax = []
        for batch in eval_batches(dataset, b, self.cfg["seq"], self.pad):
            s, n, a = self.stats(params, batch["tokens"], batch["mask"])
            total, count = total + float(s), count + float(n)
            argmax += list(np.asarray(a))
        return total / count, argmax[:len(dataset)]

    def __call__(self, folder, task: str) -> dict:
        import pockjax as pj
        from pockjax.models.hf import load_llama

        params = pj.nnx.split(load_llama(folder))[1]
        test_loss, argmax = self._pass(params, self.sets[task])
        corpus_loss, _ = self._pass(params, self.sets["corpus"])
        out = {"test_loss": test_loss, "corpus_loss": corpus_loss}
        if task == "instruct":
            hits = exact_matches(self.checks, argmax, self.tok)
            out["exact_match"] = sum(hits) / len(hits)
            out["exact_match_n"] = len(hits)
        return out


# --------------------------------------------------------------------------- a row


def row_main(name: str, config: str) -> None:
    """One row's process: every run of the method on both tasks (the sweep, then the
    seeds at the chosen rate), then the evaluation of the chosen rate's runs."""
    cfg = json.loads(Path(config).read_text())
    method = method_named(name)
    _LOG.append(Path(cfg["runs"]) / slug(method.name) / "log.txt")
    _LOG[0].parent.mkdir(parents=True, exist_ok=True)
    finals = []
    for task in TASKS:
        if method.kind == "pretrained":
            finals.append(one_run(cfg, method, task, 0.0, 0, 0, None))
            continue
        scheme = build_scheme(cfg, method.scheme, task) if method.kind == "pockjax" else None
        rates = method.rates[-cfg["rates_in_sweep"]:]
        sweep = {lr: one_run(cfg, method, task, lr, 0, cfg["sweep_steps"],
                             scheme)["final_valid_loss"] for lr in rates}
        finite = {lr: v for lr, v in sweep.items() if math.isfinite(v)}
        if not finite:
            raise RuntimeError(f"{method.name} / {task}: every learning rate of {rates} "
                               f"diverged; add smaller ones to the method's rates")
        chosen = min(finite, key=finite.get)
        folder = Path(cfg["runs"]) / slug(method.name) / task
        (folder / "chosen.json").write_text(json.dumps(
            {"lr": chosen, "sweep": {f"{k:g}": v for k, v in sweep.items()},
             "scheme": scheme}, indent=1) + "\n")
        for seed in range(cfg["seeds"]):
            finals.append(one_run(cfg, method, task, chosen, seed, cfg["steps"], scheme))
    evaluator = None
    for i, run in enumerate(finals):
        out = run_dir(cfg, method, run["task"], run["lr"], run["seed"], run["steps"])
        if (out / "eval.json").is_file() or "diverged" in run:
            continue
        if not (Path(run["final"]) / "config.json").is_file():
            # Trained but not scored, and its model gone (a run trained elsewhere, whose
            # models stay there): trained again.
            (out / "train.json").unlink()
            scheme = json.loads((out.parent / "chosen.json").read_text())["scheme"] \
                if method.kind == "pockjax" else None
            run = finals[i] = one_run(cfg, method, run["task"], run["lr"], run["seed"],
                                      run["steps"], scheme)
        evaluator = evaluator or Evaluator(cfg)
        scores = evaluator(run["final"], run["task"])
        (out / "eval.json").write_text(json.dumps(scores, indent=1) + "\n")
    # The models are scored: only the runs' records are kept.
    for path in (Path(cfg["runs"]) / slug(method.name)).glob("*/*/final"):
        shutil.rmtree(path, ignore_errors=True)
    report_result({"row": method.name, "runs": len(finals)})


def timing_main(name: str, config: str) -> None:
    """One row's timing process: `time_steps` steps on the domain task at the rate the
    sweep chose, seed 0, with validation only before the first step and after the last.
    The table's speed columns come from these runs, made one after another on an
    otherwise idle machine once every training run is done, so the quality runs may
    share the machine with other work without changing a speed figure."""
    cfg = json.loads(Path(config).read_text())
    method = method_named(name)
    _LOG.append(Path(cfg["runs"]) / slug(method.name) / "log.txt")
    chosen = json.loads((Path(cfg["runs"]) / slug(method.name) / "domain" / "chosen.json")
                        .read_text())
    run = one_run(cfg, method, "domain", chosen["lr"], 0, cfg["time_steps"], chosen["scheme"])
    shutil.rmtree(run_dir(cfg, method, "domain", chosen["lr"], 0, cfg["time_steps"]) / "final",
                  ignore_errors=True)
    report_result({"row": method.name, "s_per_step": run["s_per_step"]})


# --------------------------------------------------------------------------- the table


def _mean_sd(values) -> tuple[float, float]:
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def time_to_quality(curve, target: float, timing: dict | None = None) -> float | None:
    """Seconds until the validation loss first reaches `target`, or None: with `timing`
    (the row's timing run), its first step (compilation included) plus its median step
    time for each later step; without, the run's own clock (evaluations included)."""
    for seconds, step, loss in curve:
        if loss <= target:
            if timing is None:
                return seconds
            return 0.0 if step == 0 else timing["first_step_s"] + (step - 1) * timing["s_per_step"]
    return None


def collect(cfg: dict, methods) -> list[dict]:
    """Every row's records from the runs folder: per method and task, the chosen rate,
    the sweep, the seeds' train and eval records and their summary."""
    rows = []
    for method in methods:
        for task in TASKS:
            folder = Path(cfg["runs"]) / slug(method.name) / task
            row = {"method": method.name, "task": task, "kind": method.kind,
                   "scheme": method.scheme}
            if method.kind == "pretrained":
                lr, sweep, seeds, steps = 0.0, {}, 1, 0
            else:
                chosen = folder / "chosen.json"
                if not chosen.is_file():
                    rows.append({**row, "error": "not run"})
                    continue
                info = json.loads(chosen.read_text())
                lr, sweep, seeds, steps = info["lr"], info["sweep"], cfg["seeds"], cfg["steps"]
            runs, error = [], None
            for seed in range(seeds):
                out = run_dir(cfg, method, task, lr, seed, steps)
                train = out / "train.json"
                if train.is_file() and "diverged" in json.loads(train.read_text()):
                    error = f"seed {seed} diverged at lr {lr:g}"
                elif not (out / "eval.json").is_file():
                    error = "not finished"
                if error:
                    break
                runs.append({**json.loads(train.read_text()),
                             **json.loads((out / "eval.json").read_text())})
            if error:
                rows.append({**row, "error": error})
                continue
            row.update(lr=lr, sweep=sweep, runs=runs)
            if method.kind != "pretrained" and cfg.get("time_steps"):
                # Speed is measured once a method, on the domain task (both tasks' batches
                # are padded to the same shape).
                timing = run_dir(cfg, method, "domain", chosen_lr(cfg, method, "domain"), 0,
                                 cfg["time_steps"]) / "train.json"
                if timing.is_file():
                    row["timing"] = json.loads(timing.read_text())
            rows.append(row)
    return rows


def chosen_lr(cfg: dict, method: Method, task: str) -> float:
    """The learning rate the sweep chose for `method` on `task`, or NaN before it ran."""
    chosen = Path(cfg["runs"]) / slug(method.name) / task / "chosen.json"
    return json.loads(chosen.read_text())["lr"] if chosen.is_file() else float("nan")


def summarize(rows: list[dict]) -> None:
    """Means and spreads over seeds, forgetting and time to quality, in place."""
    base = {r["task"]: r for r in rows if r["kind"] == "pretrained" and "runs" in r}
    ref = {r["task"]: r for r in rows if r["method"] == REFERENCE and "runs" in r}
    for r in rows:
        if "runs" not in r:
            continue
        runs = r["runs"]
        s = {}
        s["test_loss"], s["test_loss_sd"] = _mean_sd([x["test_loss"] for x in runs])
        s["corpus_loss"], s["corpus_loss_sd"] = _mean_sd([x["corpus_loss"] for x in runs])
        if r["task"] in base:
            s["forgetting"] = s["corpus_loss"] - base[r["task"]]["runs"][0]["corpus_loss"]
            if r["task"] in ref:
                # Learning as a share of the reference's: its test-loss drop from the
                # pretrained model's, per seed, over the reference's mean drop.
                start = base[r["task"]]["runs"][0]["test_loss"]
                full = start - statistics.mean(x["test_loss"] for x in ref[r["task"]]["runs"])
                if full > 0:
                    s["gain_share"], s["gain_share_sd"] = _mean_sd(
                        [(start - x["test_loss"]) / full for x in runs])
        if r["task"] == "instruct":
            s["exact_match"], s["exact_match_sd"] = _mean_sd([x["exact_match"] for x in runs])
        if r["kind"] != "pretrained":
            s["valid_loss"], _ = _mean_sd([x["final_valid_loss"] for x in runs])
            timing = r.get("timing")
            speed = [timing] if timing else runs
            s["timed"] = "timing run" if timing else "training runs"
            s["s_per_step"] = statistics.median(x["s_per_step"] for x in speed)
            # This task's tokens per step (padding not counted) at that step time.
            s["tokens_per_s"] = (statistics.mean(x["tokens"] / max(x["steps"], 1) for x in runs)
                                 / s["s_per_step"])
            # The timing run's: the training runs may have run on a GPU, whose process
            # memory says nothing of this machine's.
            s["peak_rss_mib"] = max(x["peak_rss_mib"] for x in speed)
            s["trained_params"] = runs[0]["trained_params"]
            if r["task"] in ref:
                target = (1 + QUALITY_MARGIN) * statistics.mean(
                    x["final_valid_loss"] for x in ref[r["task"]]["runs"])
                times = [time_to_quality(x["valid_curve"], target, timing) for x in runs]
                reached = [t for t in times if t is not None]
                s["quality_target"] = target
                # The pretrained model may already be within the margin (a task it
                # nearly knows, or a short run): then the column says nothing.
                s["target_met_at_start"] = runs[0]["valid_curve"][0][2] <= target
                s["time_to_quality_s"] = statistics.median(reached) if reached else None
                s["reached"] = f"{len(reached)}/{len(times)}"
        r["summary"] = s


def _fmt(mean, sd, digits=4, seeds=1) -> str:
    if mean is None or not math.isfinite(mean):
        return "-"
    return f"{mean:.{digits}f} ± {sd:.{digits}f}" if seeds > 1 else f"{mean:.{digits}f}"


def markdown(rows, meta) -> str:
    p, cfg = meta["preset"], meta["config"]
    pre = meta["pretrain"]
    packages = pre["corpus"]["settings"].get("source") == "packages"
    corpus = (f"the standard library and every installed package's sources except "
              f"{', '.join(pre['corpus']['settings']['exclude'])} under "
              if packages else "the standard library of ")
    head = pre["settings"]["hidden"] * pre["corpus"]["vocab_size"]
    lines = [
        f"# Fine-tuning quality: pockjax's schemes against PyTorch and peft "
        f"({PRESET_TITLES.get(p, p + ' preset')})", "",
        f"Run {meta['date']}, commit {meta['commit']}. {meta['cpu']}, {meta['cores']} cores; "
        f"{meta['versions']}.", "",
        f"**Model**: pockjax's LLaMA, {pre['settings']['layers']} blocks, width "
        f"{pre['settings']['hidden']}, vocabulary {pre['corpus']['vocab_size']} "
        f"({pre['parameters']:,} parameters, the output head {head / pre['parameters']:.1%} of "
        f"them), pretrained by `python -m benchmarks pretrain --preset "
        f"{ {'full': 'small'}.get(pre['preset'], pre['preset'])}` for "
        f"{pre['steps']:,} steps of "
        f"{pre['settings']['batch']} x {pre['settings']['seq']} tokens "
        + (f"({pre['tokens_per_parameter']:.1f} tokens a parameter, {pre['passes']:.2f} passes) "
           if "tokens_per_parameter" in pre else "")
        + f"on {corpus}{pre['corpus']['interpreter']} "
        f"({pre['corpus']['pretraining_files']['files']:,} files, "
        f"{pre['corpus']['tokens']['train_files']:,} tokens, file list sha256 "
        f"`{pre['corpus']['pretraining_files']['list_sha256'][:16]}`)"
        + (f", on {pre['trained_on']['device']} (JAX {pre['trained_on']['jax']}"
           + (f", {pre['settings']['matmul']} matmuls" if pre["settings"].get("matmul") else "")
           + ")" if "trained_on" in pre else "")
        + f"; its held-out loss {pre['heldout_loss']:.4f}"
        + (f" (weights rounded to bfloat16 after training; {pre['heldout_loss_unrounded']:.4f} "
           f"before)" if pre.get("heldout_loss_unrounded") else "") + ".",
        f"**Tasks** (held out from pretraining, split by file): *domain*, the sources of "
        f"{meta['tasks']['domain']['source']} {meta['tasks']['domain']['version']} "
        f"(test: {meta['tasks']['domain']['records']['test']} records of up to {cfg['seq']} "
        f"tokens); *instruct*, signature + docstring -> body of "
        f"{meta['tasks']['instruct']['source']} {meta['tasks']['instruct']['version']}'s "
        f"functions (loss on the body only; test: {meta['tasks']['instruct']['records']['test']} "
        f"functions).",
        f"**Protocol**: each method and task: learning rate chosen on the validation split "
        f"({cfg['rates_in_sweep']} rates, seed 0, {cfg['sweep_steps']} steps), then "
        f"{cfg['seeds']} seed(s) x {cfg['steps']} steps of {cfg['batch']} x {cfg['seq']} "
        f"tokens at that rate, AdamW, cosine schedule with {int(cfg['warmup_frac'] * 100)}% "
        f"warm-up; the same batches for every method. Mean ± sample standard deviation over "
        f"seeds." + (f" The training runs ran on: {meta['trained_on']}; the speed and memory "
                     f"columns are this machine's timing runs."
                     if meta.get("trained_on") else ""), "",
        "Columns: *test loss* on the task's test split (nats/token); *share of full FT's "
        f"gain*: the test loss's drop from the pretrained model's over {REFERENCE}'s (mean "
        "over seeds; the learning axis of the figure); *corpus loss*: the "
        "pretraining corpus's held-out files after fine-tuning, and its change from the "
        "pretrained model's (forgetting); *exact match*: the body's first line under greedy "
        "decoding; *s/step*: the median of the steps after the first (pockjax's first step "
        "compiles) in the row's timing run"
        + (f" ({cfg['time_steps']} steps on the domain task at the chosen rate, seed 0, one "
           "process per row, after all training, on an otherwise idle machine)"
           if cfg.get("time_steps") else "s (the training runs themselves)")
        + "; *tokens/s*: this task's tokens per step (padding not counted) at that step "
        "time; *peak RSS*: the process's high-water mark during the timing run (the "
        "training runs' where there is none), runtime included; *time to quality*: the "
        "median over seeds of the time "
        f"until the validation loss is within {QUALITY_MARGIN:.0%} of {REFERENCE}'s final "
        "one, counted as the timing run's first step (compilation included) plus its "
        "median step time for every further step (validation not counted), \"never\" "
        "otherwise; \"at start\" where the pretrained model is already within it.", ""]
    for task in TASKS:
        em = task == "instruct"
        lines += [f"## Task: {task}", "",
                  "| method | lr | test loss | share of full FT's gain | "
                  "corpus loss (forgetting) | "
                  + ("exact match | " if em else "")
                  + "s/step | tokens/s | peak RSS MiB | trained params | time to quality |",
                  "|---|---:|---:|---:|---:|" + ("---:|" if em else "") + "---:|---:|---:|---:|---:|"]
        for r in (r for r in rows if r["task"] == task):
            if "runs" not in r:
                lines.append(f"| {r['method']} | {r['error']} |" + " |" * (8 + em))
                continue
            s, n = r["summary"], len(r["runs"])
            forget = (f" ({s['forgetting']:+.4f})" if "forgetting" in s else "")
            share = ("-" if r["kind"] == "pretrained" or "gain_share" not in s else
                     _fmt(100 * s["gain_share"], 100 * s["gain_share_sd"], 0, n) + "%")
            cells = [r["method"], f"{r['lr']:g}" if r["lr"] else "-",
                     _fmt(s["test_loss"], s["test_loss_sd"], 4, n), share,
                     _fmt(s["corpus_loss"], s["corpus_loss_sd"], 4, n) + forget]
            if em:
                cells.append(_fmt(100 * s["exact_match"], 100 * s["exact_match_sd"], 1, n) + "%")
            if r["kind"] == "pretrained":
                cells += ["-", "-", "-", "0", "-"]
            else:
                ttq = s.get("time_to_quality_s")
                when = "never" if ttq is None else f"{ttq:.1f} s"
                if "quality_target" not in s:
                    when = "- (no reference row)"
                elif s["target_met_at_start"]:
                    when = "at start"
                elif ttq is not None and s["reached"] != f"{n}/{n}":
                    when += f" ({s['reached']} seeds)"
                cells += [f"{s['s_per_step']:.3f}", f"{s['tokens_per_s']:,.0f}",
                          f"{s['peak_rss_mib']:.0f}", f"{s['trained_params']:,}", when]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    notes = meta.get("notes", [])
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


# The figure's method groups, one colour each (a marker per method within a group).
GROUPS = {"PyTorch": "#222222", "LoRA": "#d62728", "pockjax whole blocks": "#1f77b4",
          "pockjax channels": "#2ca02c", "pockjax searched": "#9467bd",
          "pockjax schedule": "#ff7f0e", "pockjax low-bit frozen": "#8c564b"}
MARKERS = "osD^vPX*<>"


def group_of(method: str) -> str:
    """The figure's group of a method (by its row in `METHODS`)."""
    m = method_named(method)
    if m.kind == "torch":
        return "PyTorch"
    if m.kind == "peft" or m.scheme.startswith("lora:"):
        return "LoRA"
    if m.frozen != "float32":
        return "pockjax low-bit frozen"
    if m.scheme.startswith("@search"):
        return "pockjax searched"
    if m.scheme == "@blockwise":
        return "pockjax schedule"
    if m.scheme.startswith("@channels"):
        return "pockjax channels"
    return "pockjax whole blocks"


def styles(rows) -> dict[str, tuple[str, str]]:
    """`{method: (colour, marker)}` for the methods of `rows`, in their order."""
    out, used = {}, {}
    for r in rows:
        if r["kind"] == "pretrained" or r["method"] in out:
            continue
        g = group_of(r["method"])
        out[r["method"]] = (GROUPS[g], MARKERS[used.get(g, 0) % len(MARKERS)])
        used[g] = used.get(g, 0) + 1
    return out


def frontier(points) -> list[tuple[float, float]]:
    """The learning-forgetting frontier of `(forgetting, learning)` points: those no
    other point beats on both (forgets no more and learns at least as much), by
    forgetting."""
    best, out = -math.inf, []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if y > best:
            out.append((x, y))
            best = y
    return out


def plot(rows, path: Path, title: str = "") -> None:
    """The results figure, one column a task. Top: the learning-forgetting plane (the
    rise of the pretraining corpus's held-out loss against the share of full fine-tuning's
    test-loss gain; each method's mean over seeds with their standard deviation as
    error bars; the dashed line is the frontier). Bottom: validation loss against
    training seconds (as time to quality counts them; seed 0), with the time-to-quality
    target. One colour per group of methods (`GROUPS`), one marker per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    style = styles(rows)
    fig, axes = plt.subplots(2, len(TASKS), figsize=(6.2 * len(TASKS) + 3.2, 10),
                             squeeze=False)
    for col, task in enumerate(TASKS):
        plane, curves = axes[0][col], axes[1][col]
        points, target = [], None
        for r in rows:
            if r["task"] != task or "runs" not in r or r["kind"] == "pretrained":
                continue
            colour, marker = style[r["method"]]
            s = r["summary"]
            if "gain_share" in s and "forgetting" in s:
                plane.errorbar(s["forgetting"], s["gain_share"], xerr=s["corpus_loss_sd"],
                               yerr=s["gain_share_sd"], fmt=marker, color=colour, ms=7,
                               mfc=colour if r["kind"] in ("torch", "peft") else "white",
                               mew=1.5, elinewidth=0.8, capsize=2)
                points.append((s["forgetting"], s["gain_share"]))
            curve, timing = r["runs"][0]["valid_curve"], r.get("timing")
            at = ([0.0 if c[1] == 0 else timing["first_step_s"] + (c[1] - 1) * timing["s_per_step"]
                   for c in curve] if timing else [c[0] for c in curve])
            curves.plot(at, [c[2] for c in curve], marker=marker, ms=4, lw=1, color=colour,
                        ls="--" if r["kind"] in ("torch", "peft") else "-",
                        mfc=colour if r["kind"] in ("torch", "peft") else "white")
            target = s.get("quality_target")
        if points:
            line = frontier(points + [(0.0, 0.0)])
            plane.plot(*zip(*line), "k--", lw=0.8, zorder=0)
            plane.plot([0], [0], "k+", ms=10)
            plane.annotate("pretrained", (0, 0), textcoords="offset points", xytext=(4, 4),
                           fontsize=8)
        plane.set_title(f"task: {task}: learning against forgetting")
        plane.set_xlabel("forgetting: rise of the pretraining corpus's held-out loss (nats)")
        plane.set_ylabel("learning: share of full fine-tuning's test-loss gain")
        plane.grid(alpha=0.3)
        if target:
            curves.axhline(target, color="#555", lw=0.8, ls=":")
        curves.set_title(f"task: {task}: validation loss against time (this CPU)")
        curves.set_xlabel("training seconds (first step's compilation included)")
        curves.set_ylabel("validation loss (nats/token)")
        curves.grid(alpha=0.3)
    handles = [Line2D([], [], color=c, marker=m, ls="none", ms=7,
                      mfc=c if method_named(name).kind in ("torch", "peft") else "white",
                      mew=1.5, label=name) for name, (c, m) in style.items()]
    handles.append(Line2D([], [], color="k", ls="--", lw=0.8, label="frontier"))
    handles.append(Line2D([], [], color="#555", ls=":", lw=0.8,
                          label=f"within {QUALITY_MARGIN:.0%} of {REFERENCE}'s final loss"))
    fig.legend(handles=handles, loc="center right", fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1 - 3.0 / (6.2 * len(TASKS) + 3.2), 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------- main


def corpus_exclude(task_dir: str | None) -> tuple[str, ...]:
    """The installed package a `--task-dir` is (or lies in), which a "packages" corpus
    must leave out too; () otherwise."""
    if not task_dir:
        return ()
    path = Path(task_dir).resolve()
    for root in quality_data.site_packages():
        root = root.resolve()
        if path != root and root in path.parents:
            return (path.relative_to(root).parts[0].removesuffix(".py"),)
    return ()


def prepare_runs(work: Path, preset: str, task_dir: str | None = None):
    """The tasks and the runs' configuration of `preset` under `work`: `(cfg, tasks
    manifest, config.json path)`. It needs the pretraining corpus and its tokenizer
    (`benchmarks/pretrain.py` builds them first), not the pretrained weights, so the
    runs can be trained where the model is pretrained (`python -m benchmarks gpu
    quality`): the runs' folder is named by a hash of `cfg`, whose paths are under
    `work`, so the same `work` on both machines names the same folder."""
    settings = PRESETS[preset]
    pre_settings = pretraining.PRESETS[settings["pretrain"]]
    seq = pre_settings["seq"]
    exclude = corpus_exclude(task_dir)
    where = pretraining.folders(work, settings["pretrain"], exclude)
    corpus = pretraining.build_corpus(work, settings["pretrain"], exclude)
    task_key = [settings["caps"], settings["sample_pct"], seq, str(task_dir),
                corpus["pretraining_files"]["content_sha256"]]
    task_folder = work / f"tasks-{pretraining.settings_hash(task_key)}"
    tasks = quality_data.build_tasks(task_folder, where["corpus"] / "tokenizer", seq=seq,
                                     caps=settings["caps"], task_dir=task_dir,
                                     sample_pct=settings["sample_pct"])
    cfg = {k: v for k, v in settings.items()
           if k not in ("caps", "row_timeout", "sample_pct", "time_steps")}
    cfg.update(seq=seq, pretrained=str(where["model"]),
               corpus_heldout=str(where["corpus"] / "heldout.jsonl"),
               tasks={t: {s: str(task_folder / t / f"{s}.jsonl") for s in quality_data.SPLITS}
                      for t in TASKS})
    runs = work / f"runs-{pretraining.settings_hash([cfg, tasks['settings']])}"
    cfg["runs"] = str(runs)
    cfg["time_steps"] = settings["time_steps"]  # not in the hash: timing runs are separate
    runs.mkdir(parents=True, exist_ok=True)
    config = runs / "config.json"
    config.write_text(json.dumps(cfg, indent=1) + "\n")
    return cfg, tasks, config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Rows run in their own processes; finished runs are cached under --work and "
               "skipped when the command is run again.")
    ap.add_argument("--preset", choices=[p for p in PRESETS if p != "full"], default="small",
                    help="small (the default: 8.9M parameters on the standard library), "
                         "medium (31.6M on every installed package's sources; its "
                         "pretraining needs a GPU, see benchmarks/gpu.py), quick and "
                         "medium-quick (tiny models: tests of the pipeline)")
    ap.add_argument("--quick", action="store_true",
                    help="the same as --preset quick: a tiny model, 1 seed, 1 learning rate, "
                         f"{PRESETS['quick']['steps']} steps, the rows marked quick (minutes)")
    ap.add_argument("--out", help="the Markdown table; the .json and .png go beside it "
                                  "(default benchmarks/results/quality.md, quality_medium.md "
                                  "or quality_<preset>.md)")
    ap.add_argument("--work", default=pretraining.DEFAULT_WORK,
                    help="cache folder: data, the pretrained model, every run "
                         f"(default {pretraining.DEFAULT_WORK})")
    ap.add_argument("--task-dir", help="a folder of Python files to use as the domain task "
                                       "instead of numpy's sources")
    ap.add_argument("--methods", help="comma-separated method names (as in the table, or "
                                      "their slugs such as pockjax-last-1) to run; default all "
                                      "of the preset's")
    ap.add_argument("--no-timing", action="store_true",
                    help="train and score the rows only; a later call without it times "
                         "them (the training may then share the machine with other work)")
    ap.add_argument("--replot", action="store_true",
                    help="only write the table and the figure again from the .json beside "
                         "--out (a finished run's), with this version's columns and figure")
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--timing", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.row:
        (timing_main if args.timing else row_main)(args.row, args.config)
        return 0

    if args.task_dir:
        quality_data.check_task_dir(args.task_dir)
    preset = "quick" if args.quick else args.preset
    settings = PRESETS[preset]
    out = Path(args.out or os.path.join(ROOT, "benchmarks", "results", RESULTS[preset]))
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.replot:
        return replot(out)
    work = Path(args.work).resolve()
    methods = preset_methods(preset)
    if args.methods:
        methods = [method_named(n.strip()) for n in args.methods.split(",")]
        if not any(m.kind == "pretrained" for m in methods):
            methods.insert(0, METHODS[0])
    t_start = time.perf_counter()

    # 1. The pretrained model (its own process: JAX stays out of this one).
    exclude = corpus_exclude(args.task_dir)
    made = subprocess.run([sys.executable, "-m", "benchmarks.pretrain", "--preset",
                           settings["pretrain"], "--work", str(work), "--exclude",
                           ",".join(exclude)], cwd=ROOT)
    if made.returncode:
        sys.exit(f"quality benchmark: pretraining the {settings['pretrain']} model failed "
                 f"(above)")
    where = pretraining.folders(work, settings["pretrain"], exclude)
    pre = json.loads((where["model"] / "pretrain.json").read_text())

    # 2. The tasks and the runs' folder.
    cfg, tasks, config = prepare_runs(work, preset, args.task_dir)
    runs = Path(cfg["runs"])
    print(f"quality: runs in {runs}", file=sys.stderr, flush=True)

    # 3. Every row in its own process.
    errors = {}
    for method in methods:
        t0 = time.perf_counter()
        log = runs / slug(method.name) / "log.txt"
        print(f"quality: {method.name} (progress in {log})", file=sys.stderr, flush=True)
        result = run_row(["-m", "benchmarks.quality", "--row", method.name, "--config",
                          str(config)], timeout=settings["row_timeout"])
        if "error" in result:
            errors[method.name] = result["error"]
        print(f"quality: {method.name}: {result.get('error') or 'done'} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    # 4. Speed: each row again for `time_steps` steps, one process each, after all the
    # training (run the benchmark on an idle machine for this part).
    for method in methods if settings["time_steps"] and not args.no_timing else []:
        if method.kind == "pretrained" or method.name in errors:
            continue
        t0 = time.perf_counter()
        result = run_row(["-m", "benchmarks.quality", "--row", method.name, "--timing",
                          "--config", str(config)], timeout=settings["row_timeout"])
        if "error" in result:
            errors[method.name] = f"timing: {result['error']}"
            said = result["error"]
        else:
            said = f"{result['s_per_step']:.3f} s/step"
        print(f"quality: timing {method.name}: {said} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)

    # 5. The table, the data and the chart.
    rows = collect(cfg, methods)
    summarize(rows)
    for r in rows:
        if r["method"] in errors:
            r["error"] = errors[r["method"]]
            r.pop("runs", None)
    meta = {"preset": preset, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": commit(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "versions": f"Python {platform.python_version()}, " + versions(
                ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "peft", "tokenizers",
                 "numpy", "sympy")),
            "config": cfg, "pretrain": pre, "tasks": {t: tasks[t] for t in TASKS},
            "seconds": time.perf_counter() - t_start, "notes": notes(cfg, rows),
            "trained_on": trained_on(rows)}
    write_results(out, rows, meta)
    print(out.read_text())
    print(f"quality: {time.perf_counter() - t_start:.0f} s; wrote {out} and its .json, .png",
          file=sys.stderr)
    return 1 if errors else 0


def write_results(out: Path, rows, meta) -> None:
    """The table, its data and its figure: `out` and the .json and .png beside it."""
    from pockjax.checkpoint import write_atomic

    write_atomic(out, markdown(rows, meta).encode())
    write_atomic(out.with_suffix(".json"),
                 (json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n").encode())
    title = PRESET_TITLES.get(meta["preset"], meta["preset"])
    plot(rows, out.with_suffix(".png"), f"Fine-tuning quality, {title}")


def replot(out: Path) -> int:
    """`--replot`: the table and figure of a finished run, from its .json."""
    data = out.with_suffix(".json")
    if not data.is_file():
        sys.exit(f"quality benchmark: --replot needs {data}, a finished run's data")
    saved = json.loads(data.read_text())
    rows = [r for r in saved["rows"]]
    summarize([r for r in rows if "runs" in r])
    write_results(out, rows, saved["meta"])
    print(f"quality: wrote {out} and its .png from {data}", file=sys.stderr)
    return 0


def trained_on(rows) -> str:
    """Where the training runs ran, when any ran elsewhere than this machine's CPU
    (`python -m benchmarks gpu quality`): "" otherwise. Each device is named with the
    rows that ran on it (all others: "the other rows")."""
    where: dict[str, list] = {}
    for r in rows:
        for run in r.get("runs", []):
            if run.get("device"):
                names = where.setdefault(run["device"], [])
                if r["method"] not in names:
                    names.append(r["method"])
    if set(where) <= {"cpu"}:
        return ""
    most = max(where, key=lambda d: len(where[d]))
    said = [f"{'this machine' if d == 'cpu' else d}: {', '.join(names)}"
            for d, names in where.items() if d != most]
    name = "this machine" if most == "cpu" else most
    return "; ".join([f"{name}: {'the other rows' if said else 'every row'}"] + said)


def notes(cfg: dict, rows) -> list[str]:
    """What the table's rows need said: the optimizer PyTorch used, the searches."""
    out = []
    impl = {r["runs"][0].get("optimizer") for r in rows
            if "runs" in r and r["kind"] in ("torch", "peft")}
    if impl - {None}:
        out.append(f"PyTorch rows: torch.optim {', '.join(sorted(impl - {None}))}; peft LoRA "
                   f"with alpha = 2 x rank on {', '.join(LINEARS)} (lm_head frozen), merged "
                   f"into the weights before scoring.")
    for info in sorted(Path(cfg["runs"]).glob("search/*/*.info.json")):
        i = json.loads(info.read_text())
        if i.get("admits_full"):
            out.append(f"search {i['budget']} on task {info.parent.name}: LoRA r8's compiled "
                       f"step ({i['budget_bytes'] / 2**20:.1f} MiB) is no smaller than full "
                       f"fine-tuning's ({i['full_bytes'] / 2**20:.1f} MiB), so the budget "
                       f"admits every weight: the row trains them all.")
            continue
        out.append(f"search {i['budget']} on task {info.parent.name}: budget "
                   f"{i['budget_bytes'] / 2**20:.1f} MiB of compiled step memory (full "
                   f"fine-tuning {i['full_bytes'] / 2**20:.1f} MiB), {i['candidates']} "
                   f"candidates, {i['seconds']:.0f} s (not in the time to quality); trains "
                   f"{', '.join(i['chosen'])}.")
    return out


if __name__ == "__main__":
    sys.exit(main())
