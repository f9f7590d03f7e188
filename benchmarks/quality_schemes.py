"""The quality benchmark's schemes built for `pockjax.finetune`: bias and norms, a
quarter of every linear layer's channels, and the searched ones (`pockjax.search_scheme`
under LoRA r8's step memory or a share of full fine-tuning's)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.quality_methods import LINEARS, slug
from benchmarks.quality_runs import log_progress


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
    log_progress(f"search {budget} on {task}: {len(report.results)} candidates, chose "
                 f"{', '.join(report.chosen)} ({info['seconds']:.0f} s)")
    return str(path)
