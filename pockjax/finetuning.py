"""Fine-tune a Hugging Face model folder on a JSONL file: `pockjax finetune` and
`pockjax.finetune`.

The run is made of the library's parts: the folder's model (a LLaMA-family model in
`pockjax.models.llama`, any other causal LM through `pockjax.torch`), its tokenizer
(`pockjax.tokenizer`), the data (`pockjax.data`), a scheme, and one compiled
`sparse_train` step, run by `pockjax.fit`, which around the step evaluates, logs,
checkpoints and guards:

- the training batches are a function of the step number and the seed alone
  (`pockjax.data.batch_at`), so a checkpoint's step is its whole data position, and a
  resumed run's parameters equal an uninterrupted run's bit for bit;
- checkpoints (`pockjax.save`: parameters, optimizer state, step, checksummed) are
  written atomically every `save_every` steps, on Ctrl-C and at the end; the last
  `keep` are kept;
- each step's loss is read while the next step runs; a non-finite one stops the run
  (`NonFiniteLoss`) before anything after it is saved, or, with `skip_nonfinite`, the
  step is skipped (`sparse_train(skip_nonfinite=True)`) and counted.

The output folder holds `run.json` (the options), `checkpoints/`, `metrics.jsonl`,
`loss.png` and `final/`, a Hugging Face model folder with the tokenizer files.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = ["finetune", "FinetuneError", "NonFiniteLoss", "Interrupted", "FinetuneResult",
           "load_model", "lm_loss", "scheme_from_spec", "SCHEMES", "SCHEDULES"]

SCHEMES = ("paper", "paper:K", "full", "last:N", "blockwise:K", "blockwise:K:N", "lora:R",
           "search:BUDGET", "FILE.json")
"""The forms of `finetune(scheme=...)` (`--scheme`), as `scheme_from_spec` reads them."""
FRONTENDS = ("auto", "flax", "torch")
# LoRA's targets for `--scheme lora:R`: every linear layer of a LLaMA block.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCHEDULES = ("cosine", "linear", "constant")
"""The learning-rate decays `finetune(schedule=...)` (`--schedule`) takes."""
RUN = "run.json"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
FINAL = "final"
# Options that change what a run computes: a resumed run must have the same ones.
_RESULT_OPTIONS = ("model", "data", "scheme", "total_steps", "batch", "seq", "lr", "warmup",
                   "schedule", "seed", "frozen_dtype", "skip_nonfinite", "weight_decay",
                   "frontend")


class FinetuneError(RuntimeError):
    """Raised when a fine-tuning run cannot start or go on; the message says why and what
    to do."""


class NonFiniteLoss(FinetuneError):
    """Raised when the loss becomes NaN or infinite; the last good checkpoint is left as
    it was."""


class Interrupted(FinetuneError):
    """Raised when Ctrl-C stops the run; a checkpoint of the last completed step was
    written (where a step completed)."""


# --------------------------------------------------------------------------- the model


@dataclasses.dataclass
class LoadedModel:
    """A model folder's model as parameters and a pure function of them.

    Attributes:
      kind: "flax" (`pockjax.models.llama`) or "torch" (`pockjax.torch`).
      params: the parameter pytree.
      apply: `apply(params, tokens [B, L]) -> logits [B, L, V]`.
      vocab_size: the model's vocabulary size.
      num_layers: its number of blocks.
      save: `save(params, folder)` writes a Hugging Face model folder (with the
        tokenizer files).
      description: a one-line description for logs.
    """

    kind: str                      # "flax" (pockjax.models.llama) or "torch"
    params: Any
    apply: Callable                # apply(params, tokens [B, L]) -> logits [B, L, V]
    vocab_size: int
    num_layers: int
    save: Callable                 # save(params, folder): a Hugging Face model folder
    description: str


def load_model(folder, *, frozen_dtype: str = "float32", frontend: str = "auto",
               lora: int | None = None, seed: int = 0) -> LoadedModel:
    """The model of a Hugging Face folder: LLaMA-family configs (`model_type` in
    `pockjax.models.hf.SUPPORTED_FAMILIES`) as the Flax `Llama`, any other causal LM
    through `pockjax.torch` (needs torch and transformers).

    Args:
      folder: a folder with `config.json` and `model.safetensors` (or shards).
      frozen_dtype: "float32", or "bfloat16" to keep the weights in bfloat16 (computed
        in float32); `finetune` then casts the trained ones back to float32 masters. An
        integer format ("int8", "int4", "int4:GROUP") loads as bfloat16 (Flax models)
        and `finetune` quantizes the frozen weights (`pockjax.lowbit`).
      frontend: "auto" (as above), "flax" (LLaMA families only) or "torch" (any causal
        LM transformers builds, LLaMA's too, through `pockjax.torch`).
      lora: a rank: LoRA adapters (`pockjax.models.lora`, alpha = 2 x rank, `a` drawn
        from `seed`) on every linear layer of the blocks (Flax models only); `save`
        writes the weights with the adapters merged. None (the default): no adapters.
      seed: the seed of the LoRA adapters' initialisation; default 0.

    Returns:
      A `LoadedModel`.

    Raises:
      FinetuneError: the folder is not a model folder; `frozen_dtype` or `frontend` is
        not one of its values; "flax" is asked for a family it does not load; `lora`
        is given for a model that runs through `pockjax.torch`; "bfloat16" is asked
        for a model through `pockjax.torch`; torch or transformers is missing, or
        transformers cannot build the model.
    """
    from pockjax.models import hf

    from pockjax.checkpoint import CheckpointError

    folder = Path(folder)
    try:
        config = hf.read_config(folder)
    except CheckpointError as e:
        raise FinetuneError(f"{e}; --model takes the folder a model was downloaded or "
                            f"saved to") from None
    model_type = config.get("model_type")
    families = hf.SUPPORTED_FAMILIES
    _check_frozen_dtype(frozen_dtype)
    if frontend not in FRONTENDS:
        raise FinetuneError(f"--frontend {frontend!r}: choose one of {', '.join(FRONTENDS)}")
    if frontend == "flax" and model_type not in families:
        raise FinetuneError(f"--frontend flax: '{folder}' is a {model_type!r} model and "
                            f"pockjax's Flax models load {', '.join(families)}; use "
                            f"--frontend torch (or auto)")
    if model_type in families and frontend != "torch":
        return _flax_model(folder, frozen_dtype, lora, seed)
    if lora is not None:
        raise FinetuneError(f"--scheme lora:{lora} is implemented for pockjax's Flax models "
                            f"({', '.join(families)}); this model runs through pockjax.torch")
    return _torch_model(folder, model_type, families, frozen_dtype)


def _check_frozen_dtype(frozen_dtype: str) -> None:
    from pockjax import lowbit

    try:
        lowbit.format_of(frozen_dtype)
    except lowbit.QuantizeError:
        raise FinetuneError(f"--frozen-dtype {frozen_dtype!r}: choose float32, bfloat16, int8 "
                            f"or int4 (int4:GROUP sets the group, e.g. int4:32)") from None


def _low_bit(frozen_dtype: str) -> bool:
    """Whether frozen weights are stored as integers (pockjax.lowbit), not a float type."""
    return frozen_dtype.startswith("int")


def _flax_model(folder: Path, frozen_dtype: str, lora: int | None = None,
                seed: int = 0) -> LoadedModel:
    import jax.numpy as jnp

    from pockjax import nnx as pj_nnx
    from pockjax.checkpoint import CheckpointError
    from pockjax.models.hf import load_llama, save_llama

    try:
        model = load_llama(folder, dtype=None if frozen_dtype == "float32" else jnp.bfloat16,
                           compute_dtype=None if frozen_dtype == "float32" else jnp.float32)
    except CheckpointError as e:
        raise FinetuneError(str(e)) from None
    if lora is not None:
        from flax import nnx

        from pockjax.models.lora import apply_lora, merge_lora
        try:
            apply_lora(model, rank=lora, alpha=2.0 * lora, targets=LORA_TARGETS,
                       rngs=nnx.Rngs(seed))
        except ValueError as e:
            raise FinetuneError(f"--scheme lora:{lora}: {e}") from None
    graphdef, params, rest = pj_nnx.split(model)

    def apply(p, tokens):
        return pj_nnx.merge(graphdef, p, rest)(tokens)

    def save(p, out):
        module = pj_nnx.merge(graphdef, p, rest)
        save_llama(merge_lora(module) if lora is not None else module, out, tokenizer=folder)

    c = model.config
    return LoadedModel("flax", params, apply, c.vocab_size, c.num_layers, save,
                       f"{getattr(c, 'model_type', 'llama')} (pockjax.models.llama), "
                       f"{c.num_layers} layers, width {c.hidden_size}")


def _torch_model(folder: Path, model_type, families, frozen_dtype: str) -> LoadedModel:
    supported = ", ".join(families)
    try:
        import torch
        import transformers
    except ImportError:
        raise FinetuneError(f"'{folder}' is a {model_type!r} model; pockjax's own models load "
                            f"{supported}, and other architectures run through pockjax.torch, "
                            f"which needs torch and transformers: pip install "
                            f"'pockjax[torch]'") from None
    if frozen_dtype != "float32" and not _low_bit(frozen_dtype):
        raise FinetuneError(f"--frozen-dtype {frozen_dtype} is implemented for the "
                            f"{supported} families; '{folder}' is a {model_type!r} model "
                            f"(through pockjax.torch): use float32")
    from pockjax import torch as pj_torch
    from pockjax.models.hf import TOKENIZER_FILES

    try:
        module = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except (ValueError, KeyError, OSError) as e:
        raise FinetuneError(f"'{folder}': transformers cannot build a causal language model "
                            f"from it ({str(e).splitlines()[0][:200]}); pockjax loads "
                            f"{supported} itself and other causal LMs that transformers "
                            f"knows through pockjax.torch") from None
    module.eval()  # no dropout: steps are reproducible
    params, fn = pj_torch.functional(module, output=lambda out: out.logits)

    def apply(p, tokens):
        return fn(p, tokens, use_cache=False)

    def save(p, out):
        pj_torch.load_state(module, p)
        out = Path(out)
        module.save_pretrained(out)
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, out / name)

    cfg = module.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 0)
    return LoadedModel("torch", params, apply, int(cfg.vocab_size), int(layers), save,
                       f"{model_type} (pockjax.torch), {layers} layers")


def lm_loss(logits, tokens, mask):
    """Mean next-token cross-entropy over the positions `mask` marks: `logits[:, t]`
    predicts `tokens[:, t + 1]`, counted with weight `mask[:, t + 1]`.

    Args:
      logits: `[B, L, V]` logits (computed in float32).
      tokens: `[B, L]` integer token ids.
      mask: `[B, L]` weights (bool or float); 0 leaves a position out.

    Returns:
      The weighted sum of the negative log-likelihoods divided by the total weight (at
      least 1), a float32 scalar.
    """
    import jax.numpy as jnp

    nll, w = _next_token_nll(logits, tokens, mask)
    return jnp.sum(nll) / jnp.maximum(jnp.sum(w), 1.0)


def _nll_sum(logits, tokens, mask):
    import jax.numpy as jnp

    nll, w = _next_token_nll(logits, tokens, mask)
    return jnp.sum(nll), jnp.sum(w)


def _next_token_nll(logits, tokens, mask):
    """Weighted per-position negative log-likelihoods [B, L] and their weights: the
    labels shift left by one and the last position gets weight 0. Shifting the labels,
    not slicing `logits[:, :-1]`, keeps XLA from copying the [B, L, vocab] logits
    forward and padding their gradient backward (on CPU a third of the head's cost)."""
    import jax.numpy as jnp
    import optax

    labels = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    w = jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1).astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return jnp.where(w != 0, nll * w, 0.0), w


# --------------------------------------------------------------------------- schemes


def scheme_from_spec(spec: str, params, num_layers: int, *, search: Callable | None = None):
    """The scheme `finetune(scheme=spec)` trains, for a model's `params` with `num_layers`
    blocks.

    Args:
      spec: "full"; "paper" (`pockjax.schemes.transformer` on the last
        `max(1, num_layers // 2)` blocks) or "paper:K" (on the last K); "last:N" (the
        last N blocks in full); "lora:R" (the LoRA adapters, which the model must
        already have: `load_model(lora=R)`); "blockwise:K" / "blockwise:K:N" (the
        schedule `pockjax.schemes.blockwise`: the blocks, N at a time, each trained for
        K steps in turn from the last); "search:BUDGET" (calls `search(budget)`); or a
        path ending in ".json" to a scheme written by `Scheme.to_json`.
      params: the model's parameter pytree.
      num_layers: the model's number of blocks.
      search: `search(budget) -> Scheme`, for "search:BUDGET"; None (the default)
        refuses that form.

    Returns:
      A `Scheme`, or a `pockjax.schedule.Schedule` for "blockwise:...".

    Raises:
      FinetuneError: the spec is none of the forms, a count in it is not a positive
        whole number, a JSON file is missing, "search:" comes without `search`, or the
        scheme does not fit `params` (the message names the spec).
    """
    import pockjax as pj

    spec = str(spec)
    try:
        if spec == "full":
            return pj.Scheme(default=pj.Full())
        if spec == "paper" or spec.startswith("paper:"):
            last = max(1, num_layers // 2) if spec == "paper" else _count(spec, "paper:K")
            return pj.schemes.transformer(params, last=last)
        if spec.startswith("last:"):
            return pj.schemes.last_blocks(params, _count(spec, "last:N"))
        if spec.startswith("lora:"):
            # The adapters are the model's (load_model(lora=R)); the scheme trains them.
            _count(spec, "lora:R")
            return pj.schemes.lora()
        if spec.startswith("blockwise:"):
            parts = spec.split(":")
            if len(parts) not in (2, 3):
                raise FinetuneError(f"--scheme {spec!r}: blockwise:K or blockwise:K:N (K steps "
                                    f"a turn, N blocks a turn)")
            every = _count(":".join(parts[:2]), "blockwise:K")
            group = _count("blockwise:" + parts[2], "blockwise:K:N") if len(parts) == 3 else 1
            return pj.schemes.blockwise(params, every=every, group=group)
        if spec.startswith("search:"):
            if search is None:
                raise FinetuneError("search schemes need the data: use finetune()")
            return search(spec.split(":", 1)[1])
        if spec.endswith(".json"):
            path = Path(spec)
            if not path.is_file():
                raise FinetuneError(f"--scheme {spec}: no such file")
            scheme = pj.Scheme.from_json(path.read_text())
            scheme.resolve(params)
            return scheme
    except pj.SchemeError as e:
        raise FinetuneError(f"--scheme {spec}: {e}") from None
    raise FinetuneError(f"--scheme {spec!r}: choose one of {', '.join(SCHEMES)} (paper: "
                        f"PockEngine's transformer scheme on the last half of the blocks)")


def _count(spec: str, form: str) -> int:
    try:
        k = int(spec.split(":", 1)[1])
    except ValueError:
        k = 0
    if k <= 0:
        raise FinetuneError(f"--scheme {spec!r}: {form} takes a positive whole number")
    return k


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass
class FinetuneResult:
    """What a `finetune` run did: its folder, steps, losses and speed.

    Attributes:
      out: the run's folder.
      final: the Hugging Face folder of the fine-tuned model (`out/final`).
      steps: the run's total step count.
      start_step: the step it resumed from (0 for a new run).
      train_loss: the mean loss of the last (up to) 10 steps run in this call; NaN
        when none ran.
      valid_loss_before: the validation loss before training, or None (no `valid`
        data, or a resumed run).
      valid_loss: the validation loss at the end, or None without `valid` data.
      seconds: training seconds in this call.
      tokens_per_second: tokens of the examples trained on (padding not counted) per
        second in this call.
      skipped: steps skipped for a non-finite loss or gradient (`skip_nonfinite`).
      trainable_params: parameters the scheme trains (the first scheme's for a
        schedule).
      total_params: all parameters of the model.
    """

    out: str
    final: str                      # the Hugging Face folder of the fine-tuned model
    steps: int
    start_step: int                 # > 0 when resumed
    train_loss: float               # mean over the last (up to) 10 steps run here
    valid_loss_before: float | None
    valid_loss: float | None
    seconds: float
    tokens_per_second: float
    skipped: int
    trainable_params: int
    total_params: int


def _options_of(**kw) -> dict:
    return {k: kw[k] for k in _RESULT_OPTIONS}


def _fingerprint(path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


class _Run:
    """The output folder: run.json, checkpoints, metrics."""

    def __init__(self, out: Path, options: dict, *, resume: bool, overwrite: bool):
        self.out = out
        run_file = out / RUN
        if out.exists() and not out.is_dir():
            raise FinetuneError(f"--out '{out}' is a file; give a folder")
        if out.is_dir() and any(out.iterdir()):
            if not run_file.is_file():
                raise FinetuneError(f"--out '{out}' is not empty and holds no pockjax run; "
                                    f"give a new or empty folder")
            if overwrite:
                for name in (RUN, CHECKPOINTS, METRICS, FINAL, "loss.png"):
                    p = out / name
                    shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
            elif resume:
                self._check_same(json.loads(run_file.read_text()), options)
            else:
                raise FinetuneError(f"--out '{out}' holds another run ({RUN}); pass --resume "
                                    f"to continue it or --overwrite to start again")
        elif resume:
            print(f"pockjax finetune: nothing to resume in '{out}'; starting a new run",
                  file=sys.stderr)
        out.mkdir(parents=True, exist_ok=True)
        (out / CHECKPOINTS).mkdir(exist_ok=True)
        for tmp in (out / CHECKPOINTS).glob(".tmp-*"):  # a write that a kill cut short
            tmp.unlink(missing_ok=True)
        from pockjax.checkpoint import write_atomic
        write_atomic(run_file, (json.dumps(options, indent=2) + "\n").encode())

    @staticmethod
    def _check_same(before: dict, now: dict) -> None:
        for k in _RESULT_OPTIONS:
            if before.get(k, "auto" if k == "frontend" else None) != now.get(k):
                raise FinetuneError(f"cannot resume: this run used {k}={before.get(k)!r}, now "
                                    f"{k}={now.get(k)!r}; resume with the same options, or "
                                    f"pass --overwrite to start again")

    def checkpoints(self) -> list[tuple[int, Path]]:
        found = []
        for p in (self.out / CHECKPOINTS).glob("step-*.safetensors"):
            try:
                found.append((int(p.stem.split("-")[1]), p))
            except ValueError:
                continue
        return sorted(found)

    def save(self, state, keep: int) -> Path:
        import pockjax as pj

        step = int(state.step)
        path = self.out / CHECKPOINTS / f"step-{step:08d}.safetensors"
        pj.save(path, state)
        for _, old in self.checkpoints()[:-keep]:
            old.unlink(missing_ok=True)
        return path

    def restore(self, like):
        """The newest checkpoint that loads, or None; a damaged newer one is named.
        `like` is a state, or a function of the checkpoint's step giving one."""
        import pockjax as pj

        for step, path in reversed(self.checkpoints()):
            try:
                return pj.load(path, like=like(step) if callable(like) else like), path
            except pj.CheckpointError as e:
                print(f"pockjax finetune: skipping checkpoint {path.name}: {e}", file=sys.stderr)
        return None, None

    def log(self, record: dict) -> None:
        with open(self.out / METRICS, "a") as f:
            f.write(json.dumps(record) + "\n")

    def trim_log(self, step: int) -> None:
        """Drop records after `step` (a resumed run logs those steps again)."""
        path = self.out / METRICS
        if not path.is_file():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except ValueError:  # a line a kill cut short
                continue
        from pockjax.checkpoint import write_atomic
        write_atomic(path, ("\n".join(kept) + "\n" if kept else "").encode())


def _schedule(lr: float, warmup: int, total: int, kind: str):
    import optax

    if kind not in SCHEDULES:
        raise FinetuneError(f"--schedule {kind!r}: choose one of {', '.join(SCHEDULES)}")
    decay = max(total - warmup, 1)
    after = {"cosine": optax.cosine_decay_schedule(lr, decay),
             "linear": optax.linear_schedule(lr, 0.0, decay),
             "constant": optax.constant_schedule(lr)}[kind]
    if warmup <= 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


def _say(progress: bool, text: str) -> None:
    if progress:
        from tqdm.auto import tqdm
        tqdm.write(f"pockjax finetune: {text}", file=sys.stderr)


def finetune(model, data, out, *, valid=None, scheme: str = "paper", steps: int | None = None,
             epochs: float | None = None, batch: int = 4, seq: int = 512, lr: float = 1e-4,
             warmup: int = 0, schedule: str = "cosine", weight_decay: float = 0.0,
             eval_every: int | None = None, save_every: int | None = None, keep: int = 3,
             resume: bool = False, overwrite: bool = False, seed: int = 0,
             frozen_dtype: str = "float32", skip_nonfinite: bool = False,
             frontend: str = "auto", plot: bool = True, prefix_cache: str = "auto",
             progress: bool = True) -> FinetuneResult:
    """Fine-tune the model in folder `model` on the JSONL file `data`; the run goes in
    folder `out` (see the module docstring for what it holds).

    Args:
      model: a Hugging Face model folder (config.json, safetensors, tokenizer.json).
      data: a JSONL file of `{"text"}`, `{"prompt", "completion"}` or `{"messages"}`
        records (`pockjax.data.read_jsonl`).
      out: the run's folder; must be new or empty unless it holds a run and `resume`
        or `overwrite` is given.
      valid: a JSONL file of held-out records, evaluated (loss and perplexity) every
        `eval_every` steps, before the first step of a run that starts at step 0, and at
        the end; None (the default) for no evaluation.
      scheme: "paper" (PockEngine's transformer scheme on the last half of the blocks),
        "paper:K" (on the last K), "full", "last:N" (the last N blocks in full),
        "blockwise:K" / "blockwise:K:N" (the blocks take turns, N at a time, K steps
        each: `pockjax.schemes.blockwise`), "lora:R" (LoRA of rank R on every linear
        layer of the blocks, merged into the weights in `final/`), "search:BUDGET"
        (`pockjax.search` under a budget such as "40%" or "4GiB"), or a scheme JSON file
        (`Scheme.to_json`). Default "paper"; see `scheme_from_spec`.
      steps: the run's total training steps, a positive whole number; give this or
        `epochs`, not both.
      epochs: passes over the data instead of `steps` (a positive number, rounded up to
        whole steps); with neither, 1 epoch.
      batch: examples per step; default 4.
      seq: tokens per example, at least 2 (longer examples are cut); default 512.
      lr: AdamW's peak learning rate, positive; default 1e-4.
      warmup: linear warm-up steps from 0 to `lr`; default 0.
      schedule: the decay after the warm-up: "cosine" (the default, to 0 at the last
        step), "linear" (to 0 at the last step) or "constant".
      weight_decay: AdamW's weight decay; default 0.
      eval_every: steps between evaluations of `valid`; None (the default): before the
        first step and at the end only.
      save_every: steps between checkpoints; None (the default): at the end (and on
        Ctrl-C) only.
      keep: how many checkpoints are kept, the newest; default 3.
      resume: continue the run in `out` from its newest checkpoint that loads; the
        options that change what the run computes must be the same. With nothing to
        resume, a new run starts.
      overwrite: start again in `out`, deleting its run; not together with `resume`.
      seed: the data order's seed (and the LoRA adapters' initialisation); default 0.
      frozen_dtype: the storage of the frozen weights: "float32" (the default),
        "bfloat16" (LLaMA families through the Flax frontend), or "int8" / "int4" /
        "int4:GROUP" (`pockjax.lowbit`, any model); not with "lora:R" or "blockwise"
        schemes.
      frontend: "auto" (the default), "flax" or "torch": which model code runs
        (`load_model`).
      skip_nonfinite: skip a step whose loss or gradient is not finite (counted) instead
        of stopping; default False.
      plot: draw `loss.png` at the end (matplotlib, skipped where it is not installed);
        the metrics log is written either way. Default True.
      prefix_cache: "auto" (the default: when the data is seen more than once and the
        frozen prefix is a large enough part of the step, compute it once per example and
        keep its output; `pockjax.prefix`), "on" or "off". The results are the same; a
        line in the log says whether it is on and what it saves. Values past a quarter of
        the available memory (at most 4 GiB) go to `out/prefix-cache/`, removed at the end.
      progress: a progress bar and log lines on stderr; default True.

    Returns:
      A `FinetuneResult`.

    Raises:
      FinetuneError: bad options, data, model or output folder (the message names it).
      NonFiniteLoss: the loss became NaN or infinite (the last good checkpoint stays).
      Interrupted: Ctrl-C; the last completed step was saved, `resume=True` continues.
    """
    import jax
    import optax

    import pockjax as pj
    from pockjax.data import (DataError, batch_at, batch_examples, eval_batches, pad_batch,
                              read_jsonl, steps_per_epoch)
    from pockjax.schedule import Schedule
    from pockjax.tokenizer import Tokenizer, TokenizerError
    from pockjax.train import NonFiniteLoss as StepNotFinite, fit

    if steps is not None and epochs is not None:
        raise FinetuneError("give --steps or --epochs, not both")
    for name, value in (("batch", batch), ("seq", seq), ("keep", keep)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise FinetuneError(f"--{name} must be a positive whole number, got {value!r}")
    if seq < 2:
        raise FinetuneError(f"--seq must be at least 2 (a token and the one it predicts), "
                            f"got {seq}")
    for name, value in (("steps", steps), ("eval-every", eval_every), ("save-every", save_every)):
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise FinetuneError(f"--{name} must be a positive whole number, got {value!r}")
    if epochs is not None and not epochs > 0:
        raise FinetuneError(f"--epochs must be positive, got {epochs!r}")
    if not lr > 0 or warmup < 0:
        raise FinetuneError(f"--lr must be positive and --warmup >= 0, got {lr!r}, {warmup!r}")
    if resume and overwrite:
        raise FinetuneError("give --resume or --overwrite, not both")
    if prefix_cache not in ("auto", "on", "off"):
        raise FinetuneError(f"--prefix-cache must be auto, on or off, got {prefix_cache!r}")

    lora = _count(str(scheme), "lora:R") if str(scheme).startswith("lora:") else None
    if lora is not None and frozen_dtype != "float32":
        raise FinetuneError(f"--scheme {scheme} with --frozen-dtype {frozen_dtype} is not "
                            f"implemented; use --frozen-dtype float32")
    loaded = load_model(model, frozen_dtype=frozen_dtype, frontend=frontend, lora=lora,
                        seed=seed)
    try:
        tokenizer = Tokenizer.from_folder(model)
    except TokenizerError as e:
        raise FinetuneError(str(e)) from None
    try:
        train = read_jsonl(data, tokenizer, seq, vocab_size=loaded.vocab_size)
        held = None if valid is None else read_jsonl(valid, tokenizer, seq,
                                                     vocab_size=loaded.vocab_size)
    except (DataError, TokenizerError) as e:
        raise FinetuneError(str(e)) from None
    except ValueError as e:  # a token id outside the model's vocabulary (the message says)
        raise FinetuneError(str(e)) from None
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else (tokenizer.eos_id or 0)
    per_epoch = steps_per_epoch(len(train), batch)
    total = int(steps) if steps is not None else max(1, math.ceil((epochs or 1) * per_epoch))
    for line in [f"model {model}: {loaded.description}", train.describe(),
                 *([held.describe()] if held is not None else [])]:
        _say(progress, line)

    def loss_fn(p, b):
        return lm_loss(loaded.apply(p, b["tokens"]), b["tokens"], b["mask"])

    def search(budget):
        return _search_scheme(loaded, loss_fn, train, held, budget, batch, seq, pad, seed, lr,
                              Path(out) / "search-cache", progress)

    chosen = scheme_from_spec(scheme, loaded.params, loaded.num_layers, search=search)
    scheduled = isinstance(chosen, Schedule)
    params = loaded.params
    if scheduled and frozen_dtype != "float32":
        raise FinetuneError(f"--scheme {scheme} changes which weights train, so every weight "
                            f"needs its float32 value: use --frozen-dtype float32")
    if frozen_dtype != "float32" and loaded.kind == "flax":
        from pockjax.models.llama import cast_frozen
        params = cast_frozen(params, chosen)
    if _low_bit(frozen_dtype):
        import jax.numpy as jnp

        from pockjax import lowbit
        try:  # trained leaves stay float32; the step computes the frozen ones in float32
            params = lowbit.quantize(params, chosen, frozen_dtype, dtype=jnp.float32)
        except lowbit.QuantizeError as e:
            raise FinetuneError(f"--frozen-dtype {frozen_dtype}: {e}") from None

    options = _options_of(model=os.path.abspath(model), data=_fingerprint(data),
                          scheme=(f"lora:{lora} " if lora else "") + chosen.to_json(),
                          total_steps=total, batch=batch, seq=seq,
                          lr=lr, warmup=warmup, schedule=schedule, seed=seed,
                          frozen_dtype=frozen_dtype, skip_nonfinite=skip_nonfinite,
                          weight_decay=weight_decay, frontend=frontend)
    run = _Run(Path(out), options, resume=resume, overwrite=overwrite)

    optimizer = optax.adamw(_schedule(lr, warmup, total, schedule), weight_decay=weight_decay)
    trainer = pj.sparse_train(loss_fn, optimizer=optimizer, scheme=chosen,
                              skip_nonfinite=skip_nonfinite)
    state = trainer.init(params, copy=False)
    info = trainer.explain(state, batch_at(train, 0, batch, seq, seed=seed, pad_id=pad))
    turn = (f" (in turns of {chosen.every} steps; {len(chosen.schemes)} schemes, the first "
            f"shown)" if scheduled else "")
    _say(progress, f"scheme {scheme}: {info.trainable_params:,} of {info.total_params:,} "
                   f"parameters train{turn}; {total} steps of {batch} x {seq} tokens "
                   f"({per_epoch} per epoch)")
    start = 0
    if resume:
        like = ((lambda s: trainer.init(params, copy=False, step=s)) if scheduled else state)
        restored, path = run.restore(like)
        if restored is not None:
            state, start = restored, int(restored.step)
            _say(progress, f"resumed from {path.name} (step {start} of {total})")
        run.trim_log(start)

    nll_sum = jax.jit(lambda p, b: _nll_sum(loaded.apply(p, b["tokens"]), b["tokens"], b["mask"]))

    def evaluate(state) -> float | None:
        if held is None:
            return None
        total_nll = count = 0.0
        for b in eval_batches(held, batch, seq, pad):
            s, n = nll_sum(state.params, b)
            total_nll, count = total_nll + float(s), count + float(n)
        return total_nll / count

    schedule_fn = _schedule(lr, warmup, total, schedule)
    saved: list[Path] = []
    skips = [0]

    def batch_of(step):
        return pad_batch(batch_examples(train, step, batch, seed=seed), batch, seq, pad)

    def tokens_of(step):
        return sum(len(e.ids) for e in batch_examples(train, step, batch, seed=seed))

    def record(r):
        """fit's records, with the learning rate and perplexity, to metrics.jsonl."""
        if "valid_loss" in r:
            value = r["valid_loss"]
            r = {"step": r["step"], "valid_loss": value, "valid_ppl": math.exp(min(value, 700)),
                 "seconds": r["seconds"]}
            _say(progress, f"step {r['step']}: valid loss {value:.4f} (perplexity "
                           f"{r['valid_ppl']:.2f})")
        elif r.get("skipped"):
            skips[0] += 1
            _say(progress, f"step {r['step']}: the loss is not finite; step skipped "
                           f"({skips[0]} so far)")
        else:
            r = {"step": r["step"], "loss": r["loss"], "lr": float(schedule_fn(r["step"] - 1)),
                 "tokens": r["tokens"], "seconds": r["seconds"]}
        run.log(r)

    step_fn, cached = trainer, None
    if prefix_cache == "off":
        pass
    elif prefix_cache == "auto" and total <= per_epoch:
        _say(progress, "prefix cache off (auto): each example is seen once")
    else:
        from pockjax.prefix import PrefixCachedTrainer, PrefixCacheError

        spill = Path(out) / "prefix-cache"
        shutil.rmtree(spill, ignore_errors=True)
        cached = PrefixCachedTrainer(trainer, spill_dir=str(spill), auto=prefix_cache == "auto")
        try:
            report = cached.report(state, batch_of(start))
        except PrefixCacheError as e:
            raise FinetuneError(f"--prefix-cache on: {e}") from None
        _say(progress, f"{report}; RAM budget {cached.budget_bytes / 2**30:.2f} GiB")
        step_fn = cached if report.on else trainer

    try:
        with warnings.catch_warnings():  # finetune says it itself, with the checkpoint
            warnings.filterwarnings("ignore", message="fit: interrupted")
            state, history = fit(step_fn, state, batch_of, total, start=start,
                                 progress=progress, log_every=1, desc="finetune",
                                 evaluate=evaluate if held is not None else None,
                                 eval_every=eval_every, save=lambda s: saved.append(
                                     run.save(s, keep)), save_every=save_every,
                                 on_record=record, stop_nonfinite=True, tokens=tokens_of)
    except StepNotFinite as e:
        _close(cached, out)
        kept = run.checkpoints()
        where = (f"the last checkpoint, {kept[-1][1]}, is from step {kept[-1][0]}"
                 if kept else "no checkpoint was written")
        raise NonFiniteLoss(f"step {e.step}: the loss is {e.loss}; the run stopped and {where}. "
                            f"Lower the learning rate (--lr {lr:g}), add warm-up (--warmup), "
                            f"or pass --skip-nonfinite to skip such steps") from None
    _close(cached, out)
    if history.interrupted:
        if history.steps > 0:
            raise Interrupted(f"interrupted at step {start + history.steps} of {total}; saved "
                              f"{saved[-1]}; continue with --resume")
        raise Interrupted(f"interrupted before the first step completed; nothing was saved "
                          f"(step {start}); run again (with --resume to continue)")
    valid_before = history.valid[0][2] if history.valid and history.valid[0][0] == 0 else None
    valid_after = (history.valid[-1][2] if history.valid and history.valid[-1][0] == total
                   else (evaluate(state) if held is not None else None))
    seconds = history.seconds
    final = Path(out) / FINAL
    _write_final(loaded, state.params, final, frozen_dtype)
    if plot:
        _plot(Path(out))
    result = FinetuneResult(
        out=str(out), final=str(final), steps=total, start_step=start,
        train_loss=float(np.mean(history.loss[-10:])) if len(history.loss) else float("nan"),
        valid_loss_before=valid_before, valid_loss=valid_after, seconds=seconds,
        tokens_per_second=history.tokens / seconds if seconds > 0 else float("nan"),
        skipped=history.skipped, trainable_params=info.trainable_params,
        total_params=info.total_params)
    _say(progress, f"done: {total - start} steps in {seconds:.1f} s "
                   f"({result.tokens_per_second:,.0f} tokens/s), model in {final}")
    return result


def _close(cached, out) -> None:
    """Drop the prefix cache and its spill folder."""
    if cached is not None:
        cached.close()
        shutil.rmtree(Path(out) / "prefix-cache", ignore_errors=True)


def _write_final(loaded: LoadedModel, params, final: Path, frozen_dtype: str) -> None:
    """The Hugging Face folder, written beside and renamed into place (a crash leaves the
    previous one or none, never half of one)."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if _low_bit(frozen_dtype):
        # Frozen weights dequantized to bfloat16 (what they hold); trained ones as trained.
        import jax
        import jax.numpy as jnp

        from pockjax import lowbit
        params = jax.tree_util.tree_map(
            lambda x: lowbit.dequantize(x, jnp.bfloat16) if lowbit.is_quantized(x) else x,
            params, is_leaf=lowbit.is_quantized)
    loaded.save(params, tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def _plot(out: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return  # the plot is optional (matplotlib is in the examples extra)
    train, valid = [], []
    for line in (out / METRICS).read_text().splitlines():
        r = json.loads(line)
        if r.get("loss") is not None:
            train.append((r["step"], r["loss"]))
        if "valid_loss" in r:
            valid.append((r["step"], r["valid_loss"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)


def _search_scheme(loaded, loss_fn, train, held, budget, batch, seq, pad, seed, lr, cache,
                   progress):
    """`pockjax.search` over the model's candidates under `budget`, on the first batches
    of the training data (scored on the validation data, or on training batches the
    search does not train on)."""
    import optax

    import pockjax as pj
    from pockjax.data import batch_at, eval_batches

    steps = 10
    train_batches = [batch_at(train, i, batch, seq, seed=seed, pad_id=pad) for i in range(steps)]
    heldout = (list(eval_batches(held, batch, seq, pad))[:4] if held is not None else
               [batch_at(train, steps + i, batch, seq, seed=seed, pad_id=pad) for i in range(2)])

    def factory(scheme):
        return pj.sparse_train(loss_fn, optimizer=optax.adamw(lr), scheme=scheme)

    try:
        scheme, report = pj.search(factory, loaded.params, (train_batches, heldout),
                                   budget=budget, steps=steps, cache=str(cache),
                                   progress=progress)
    except ValueError as e:
        raise FinetuneError(f"--scheme search:{budget}: {e}") from None
    _say(progress, f"search under {budget}: trains {', '.join(report.chosen)}")
    return scheme


# --------------------------------------------------------------------------- command line


def add_arguments(p) -> None:
    """`pockjax finetune`'s options (the same as `finetune`'s arguments)."""
    p.add_argument("--model", required=True, help="a Hugging Face model folder (config.json, "
                   "model.safetensors, tokenizer.json)")
    p.add_argument("--data", required=True, help='a JSONL file: {"text"}, {"prompt", '
                   '"completion"} or {"messages": [{"role", "content"}, ...]} per line')
    p.add_argument("--valid", help="held-out JSONL, evaluated every --eval-every steps")
    p.add_argument("--out", required=True, help="the run's folder (checkpoints, metrics.jsonl, "
                   "loss.png, final/)")
    p.add_argument("--scheme", default="paper", help="paper (PockEngine's transformer scheme, "
                   "last half of the blocks) | paper:K | full | last:N | blockwise:K[:N] (the "
                   "blocks, N at a time, each trained K steps in turn) | lora:R (LoRA of rank "
                   "R on every linear layer, merged at the end) | search:BUDGET "
                   "(e.g. search:40%% or search:4GiB) | FILE.json (default: paper)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, help="training steps")
    g.add_argument("--epochs", type=float, help="passes over the data (default 1)")
    p.add_argument("--batch", type=int, default=4, help="examples per step (default 4)")
    p.add_argument("--seq", type=int, default=512, help="tokens per example; longer ones are "
                   "cut (default 512)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--warmup", type=int, default=0, help="linear warm-up steps (default 0)")
    p.add_argument("--schedule", default="cosine", choices=SCHEDULES,
                   help="decay after the warm-up (default cosine)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--eval-every", type=int, help="steps between evaluations (default: at the "
                   "start and the end)")
    p.add_argument("--save-every", type=int, help="steps between checkpoints (default: at the "
                   "end, and on Ctrl-C)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (default 3)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--overwrite", action="store_true", help="start again in --out")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order")
    p.add_argument("--frozen-dtype", default="float32", metavar="FORMAT",
                   help="storage of the frozen weights: float32, bfloat16 (LLaMA families), "
                        "int8 (a scale per output channel) or int4 (a scale per group of 64 "
                        "inputs; int4:GROUP sets the group), dequantized where each is used "
                        "(pockjax.lowbit); the fine-tuned model is written with frozen "
                        "weights in bfloat16 and trained ones in float32")
    p.add_argument("--frontend", default="auto", choices=FRONTENDS, help="the model code: "
                   "auto (pockjax's Flax LLaMA for LLaMA families, pockjax.torch for other "
                   "causal LMs), flax, or torch (transformers' own module for any family)")
    p.add_argument("--skip-nonfinite", action="store_true", help="skip a step whose loss or "
                   "gradient is not finite instead of stopping")
    p.add_argument("--prefix-cache", default="auto", choices=("auto", "on", "off"),
                   help="compute the frozen prefix once per example when the data repeats "
                        "(auto: when it saves enough; same results either way)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="do not draw loss.png "
                   "(matplotlib) at the end; metrics.jsonl is written either way")


def main(args) -> int:
    """Run `pockjax finetune` from parsed `args`; the exit status."""
    try:
        result = finetune(args.model, args.data, args.out, valid=args.valid, scheme=args.scheme,
                          steps=args.steps, epochs=args.epochs, batch=args.batch, seq=args.seq,
                          lr=args.lr, warmup=args.warmup, schedule=args.schedule,
                          weight_decay=args.weight_decay, eval_every=args.eval_every,
                          save_every=args.save_every, keep=args.keep, resume=args.resume,
                          overwrite=args.overwrite, seed=args.seed,
                          frozen_dtype=args.frozen_dtype, skip_nonfinite=args.skip_nonfinite,
                          frontend=args.frontend, plot=args.plot,
                          prefix_cache=args.prefix_cache)
    except Interrupted as e:
        print(f"pockjax finetune: {e}", file=sys.stderr)
        return 130
    except FinetuneError as e:
        print(f"pockjax finetune: {e}", file=sys.stderr)
        return 1
    before = (f"{result.valid_loss_before:.4f} -> " if result.valid_loss_before is not None
              else "")
    valid = (f", validation loss {before}{result.valid_loss:.4f}" if result.valid_loss is not None
             else "")
    print(f"fine-tuned model: {result.final} (train loss {result.train_loss:.4f}{valid})")
    return 0


def add_generate_arguments(p) -> None:
    p.add_argument("--model", required=True, help="a Hugging Face model folder (e.g. a "
                   "finetune run's final/)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 for greedy decoding (default), else sampling at this temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in "
                   "the model's chat template")


def generate_main(args) -> int:
    """Run `pockjax generate` from parsed `args`: the continuation on stdout, the speed on
    stderr; the exit status."""
    try:
        text, new_tokens, seconds = generate_text(
            args.model, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
            top_p=args.top_p, seed=args.seed, chat=args.chat)
    except (FinetuneError, ValueError) as e:
        print(f"pockjax generate: {e}", file=sys.stderr)
        return 1
    print(text)
    print(f"pockjax generate: {new_tokens} tokens in {seconds:.2f} s "
          f"({new_tokens / max(seconds, 1e-9):.1f} tokens/s, after compiling)", file=sys.stderr)
    return 0


def generate_text(folder, prompt: str, *, max_tokens: int = 64, temperature: float = 0.0,
                  top_p: float = 1.0, seed: int = 0, chat: bool = False):
    """`(text, new tokens, seconds)`: the model in `folder` continuing `prompt` (decoded,
    without the prompt). LLaMA families decode with `pockjax.models.llama.generate` (a
    key/value cache); other architectures with transformers' own `generate`."""
    import time

    from pockjax.tokenizer import Tokenizer, TokenizerError

    loaded_kind = _kind(folder)
    try:
        tok = Tokenizer.from_folder(folder)
        text = (tok.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True) if chat else prompt)
        ids = tok.encode(text, add_special_tokens=not chat)
    except TokenizerError as e:
        raise FinetuneError(str(e)) from None
    if not ids:
        raise FinetuneError("the prompt is empty after tokenizing; give some text")
    if max_tokens < 1:
        raise FinetuneError(f"--max-tokens must be at least 1, got {max_tokens}")
    if loaded_kind == "flax":
        import jax
        import jax.numpy as jnp

        from pockjax.models.hf import load_llama
        from pockjax.models.llama import generate

        model = load_llama(folder)
        prompt_ids = jnp.asarray([ids], jnp.int32)
        run = lambda: generate(model, prompt_ids, max_tokens, temperature=temperature,
                               top_p=top_p, seed=seed, stop_token=tok.eos_id)
        jax.block_until_ready(run())  # compile once, then time
        t0 = time.perf_counter()
        out = np.asarray(jax.block_until_ready(run()))[0, len(ids):]
        seconds = time.perf_counter() - t0
    else:
        import torch
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        torch.manual_seed(seed)
        sample = dict(do_sample=True, temperature=temperature, top_p=top_p) \
            if temperature > 0 else dict(do_sample=False)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens,
                                 eos_token_id=tok.eos_id, pad_token_id=tok.pad_id or tok.eos_id,
                                 **sample)[0, len(ids):].numpy()
        seconds = time.perf_counter() - t0
    if tok.eos_id is not None and tok.eos_id in out.tolist():
        out = out[:out.tolist().index(tok.eos_id)]
    return tok.decode(out.tolist()), len(out), seconds


def _kind(folder) -> str:
    from pockjax.models import hf

    from pockjax.checkpoint import CheckpointError

    try:
        config = hf.read_config(folder)
    except CheckpointError as e:
        raise FinetuneError(str(e)) from None
    return "flax" if config.get("model_type") in hf.SUPPORTED_FAMILIES else "torch"
