"""The quality benchmark's training runs: one run of a method on a task at a learning
rate and seed (pockjax's through `pockjax.finetune`, PyTorch's and peft's on the same
batches), cached in its folder, and the records it leaves."""
from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import peak_rss_mib
from benchmarks.quality_methods import LINEARS, Method, slug


_LOG: list[Path] = []  # the row's log file (`log_to`)


def log_to(path: Path) -> None:
    """Write `log_progress`'s lines to `path` too (the row's `log.txt`)."""
    _LOG.append(path)


def log_progress(text: str) -> None:
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
    log_progress(f"{method.name} / {task}: lr {lr:g}, seed {seed}, {steps} steps")
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
    log_progress(f"  valid {summary['final_valid_loss']:.4f}, {summary['s_per_step']:.3f} s/step, "
         f"peak {peak:.0f} MiB{diverged}")
    return summary


def train_pockjax(cfg, method, task, lr, seed, steps, out: Path, scheme) -> dict:
    """A run of `pockjax.finetune` with scheme `scheme` (a finetune scheme string or a
    scheme JSON file)."""
    import pockjax as pj
    from pockjax.finetuning import NonFiniteLoss

    data = cfg["tasks"][task]
    try:
        # frozen "gguf": the model is the GGUF file the pretrained folder was made from,
        # its frozen weights kept in the file's blocks.
        model = cfg["gguf"] if method.frozen == "gguf" else cfg["pretrained"]
        result = pj.finetune(model, data["train"], out, valid=data["valid"],
                             scheme=scheme, steps=steps, batch=cfg["batch"], seq=cfg["seq"],
                             lr="auto" if method.auto else lr, warmup=warmup_steps(steps, cfg), schedule="cosine",
                             eval_every=eval_every(steps, cfg), keep=1, seed=seed,
                             overwrite=True, plot=False, progress=False,
                             frontend=method.frontend,
                             frozen_dtype="float32" if method.frozen == "gguf" else method.frozen)
    except NonFiniteLoss as e:
        raise FloatingPointError(str(e)) from None
    import jax

    out_info = {"trained_params": result.trainable_params,
                "total_params": result.total_params, "final": result.final,
                "device": jax.devices()[0].device_kind}
    if method.auto:  # the rate finetune chose, and its sweep
        out_info["lr_auto"] = json.loads((out / "run.json").read_text())["lr_auto"]
    return out_info


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
