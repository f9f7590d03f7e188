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

This module holds the run itself (`finetune`) and the reading of `--scheme`
(`scheme_from_spec`); the folder's model, its loss and writing it back are in
`pockjax.finetuning._model`, the output folder in `pockjax.finetuning._run`, the command lines
`pockjax finetune` / `pockjax generate` in `pockjax.finetuning._cli`, the errors in
`pockjax.finetuning._base`. Their public names are re-exported here.
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from pockjax._src.home import claim
from pockjax.finetuning._base import SCHEDULES, FinetuneError, Interrupted, NonFiniteLoss
from pockjax.finetuning._model import (SAVE_DTYPES, frozen_names, lm_loss, load_model, low_bit,
                                     nll_sum, partial_names, shapes_of, stored_by_lowbit,
                                     write_final)
from pockjax.finetuning._run import FINAL, RunFolder, close_prefix_cache, fingerprint, \
    options_of, plot_losses

# The job's other parts, reachable here as before: `pockjax.cli` runs the command lines
# through this module.
from pockjax.finetuning._base import FRONTENDS  # noqa: F401
from pockjax.finetuning._cli import (add_arguments, add_generate_arguments,  # noqa: F401
                                   generate_main, generate_text, main)
from pockjax.finetuning._model import LORA_TARGETS, LoadedModel  # noqa: F401
from pockjax.finetuning._run import CHECKPOINTS, METRICS, RUN  # noqa: F401

__all__ = ["finetune", "FinetuneError", "NonFiniteLoss", "Interrupted", "FinetuneResult",
           "load_model", "lm_loss", "scheme_from_spec", "SCHEMES", "SCHEDULES"]

SCHEMES = ("paper", "paper:K", "full", "last:N", "blockwise:K", "blockwise:K:N", "lora:R",
           "search:BUDGET", "FILE.json", "paper[:K]+head", "last:N+head")
"""The forms of `finetune(scheme=...)` (`--scheme`), as `scheme_from_spec` reads them."""


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
        path ending in ".json" to a scheme written by `Scheme.to_json`. "paper",
        "paper:K" and "last:N" take a "+head" suffix: the output head (`lm_head`) trains
        too, in full.
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
    if spec.endswith("+head"):
        base = spec[:-len("+head")]
        if not (base == "paper" or base.startswith(("paper:", "last:"))):
            raise FinetuneError(f"--scheme {spec!r}: +head follows paper, paper:K or last:N "
                                f"(e.g. last:2+head)")
        scheme = scheme_from_spec(base, params, num_layers)
        head = output_head(params)
        if head is None:
            raise FinetuneError(f"--scheme {spec}: the model has no output head (lm_head) and "
                                f"no embedding it could be tied to: use {base}, or a scheme "
                                f"file that names the weights to train")
        return pj.Scheme([(head[0], pj.Full())] + list(scheme.rules), default=scheme.default)
    try:
        if spec == "full":
            return pj.Scheme(default=pj.Full())
        if spec == "paper" or spec.startswith("paper:"):
            last = max(1, num_layers // 2) if spec == "paper" else spec_number(spec, "paper:K")
            return pj.schemes.transformer(params, last=last)
        if spec.startswith("last:"):
            return pj.schemes.last_blocks(params, spec_number(spec, "last:N"))
        if spec.startswith("lora:"):
            # The adapters are the model's (load_model(lora=R)); the scheme trains them.
            spec_number(spec, "lora:R")
            return pj.schemes.lora()
        if spec.startswith("blockwise:"):
            parts = spec.split(":")
            if len(parts) not in (2, 3):
                raise FinetuneError(f"--scheme {spec!r}: blockwise:K or blockwise:K:N (K steps "
                                    f"a turn, N blocks a turn)")
            every = spec_number(":".join(parts[:2]), "blockwise:K")
            group = spec_number("blockwise:" + parts[2], "blockwise:K:N") if len(parts) == 3 else 1
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


# A tied output head's weight: the embedding table (Flax LLaMA, LLaMA-style, GPT-2,
# GPT-NeoX, Bloom and Falcon names).
_EMBEDDINGS = ("embed/embedding", "embed_tokens/weight", "wte/weight", "embed_in/weight",
               "word_embeddings/weight")


def output_head(params) -> tuple[str, bool] | None:
    """`(glob, tied)` of the model's output head: its own module (`lm_head/**`,
    GPT-NeoX's `embed_out/**`), or, for a model whose head is tied to its embedding, the
    embedding table (`tied` True: training it changes the input embeddings too, which
    is what the tied model computes with). None if neither is found."""
    import pockjax as pj

    paths = pj.schemes.param_paths(params)
    for name in pj.schemes.HEADS:
        if any(p.startswith(name + "/") for p in paths):
            return f"{name}/**", False
    for p in paths:
        if any(p == e or p.endswith("/" + e) for e in _EMBEDDINGS):
            return p, True
    return None


def spec_number(spec: str, form: str) -> int:
    """The positive whole number after the colon of a scheme `spec` ("last:2" -> 2);
    `form` names the expected form in the error."""
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


def choose_scheme(loaded, spec: str, frozen_dtype: str, *, search: Callable | None = None,
                  say: Callable[[str], None] = lambda text: None):
    """The scheme (or schedule) `finetune` trains for `--scheme spec` on a loaded model:
    the one its weights were stored for, else `scheme_from_spec`'s; `say` gets the notes
    (a tied head that `+head` trains, block weights no role names)."""
    import pockjax as pj
    from pockjax.schedule import Schedule

    stored = loaded.scheme is not None  # the frozen weights already in frozen_dtype
    chosen = (loaded.scheme if stored else
              scheme_from_spec(spec, loaded.params, loaded.num_layers, search=search))
    if str(spec).endswith("+head"):
        head = output_head(shapes_of(loaded.params))
        if head is not None and head[1]:
            say(f"+head: the output head is tied to the embedding ({head[0]}): the shared "
                f"table trains, so the input embeddings change too, as the tied model uses "
                f"them")
    if str(spec).startswith("paper"):
        unnamed = pj.schemes.unnamed_weights(shapes_of(loaded.params))
        if unnamed:
            say(f"--scheme {spec}: {len(unnamed)} weights of the blocks have names no role of "
                f"pockjax.schemes.FAMILY_NAMES has and stay frozen: "
                f"{', '.join(unnamed[:6])}{' ...' if len(unnamed) > 6 else ''}")
    if isinstance(chosen, Schedule) and frozen_dtype != "float32":
        raise FinetuneError(f"--scheme {spec} changes which weights train, so every weight "
                            f"needs its float32 value: use --frozen-dtype float32")
    return chosen


def trainer_params(loaded, chosen, frozen_dtype: str):
    """The loaded model's parameters as `finetune`'s trainer takes them: trained leaves
    float32, frozen ones stored in `frozen_dtype` (bfloat16 `lowbit` nodes, or the
    integer formats) where the loading did not store them already."""
    params = loaded.params
    if frozen_dtype != "float32" and loaded.kind == "flax" and loaded.scheme is None:
        from pockjax.models.llama import cast_frozen
        # Trained leaves float32; frozen ones bfloat16 (Cast nodes), or plain bfloat16
        # arrays that lowbit.quantize stores in the integer format below.
        params = cast_frozen(params, chosen, native=low_bit(frozen_dtype))
    if stored_by_lowbit(frozen_dtype, loaded):
        import jax.numpy as jnp

        from pockjax import lowbit
        try:  # trained leaves stay float32; the step computes the frozen ones in float32
            params = lowbit.quantize(params, chosen, frozen_dtype, dtype=jnp.float32)
        except lowbit.QuantizeError as e:
            raise FinetuneError(f"--frozen-dtype {frozen_dtype}: {e}") from None
    return params


def make_trainer(loaded, chosen, *, lr: float, warmup: int, total: int, schedule: str,
                 weight_decay: float, moments: str, skip_nonfinite: bool = False):
    """`finetune`'s training step for a loaded model and scheme: `lm_loss` of the model,
    AdamW with the learning-rate schedule over `total` steps, `pockjax.sparse_train`."""
    import pockjax as pj

    def loss_fn(p, b):
        return lm_loss(loaded.apply(p, b["tokens"]), b["tokens"], b["mask"])

    optimizer = pj.optim.adamw(_schedule(lr, warmup, total, schedule),
                               weight_decay=weight_decay, moments=moments)
    return pj.sparse_train(loss_fn, optimizer=optimizer, scheme=chosen,
                           skip_nonfinite=skip_nonfinite)


def _say(progress: bool, text: str) -> None:
    if progress:
        from tqdm.auto import tqdm
        tqdm.write(f"pockjax finetune: {text}", file=sys.stderr)


def check_positions(model, seq: int | None) -> int:
    """`--seq` (None: 512, or fewer where the model takes fewer), checked against the
    positions the model was built for (its config's `max_position_embeddings`, GPT-2's
    `n_positions`)."""
    from pockjax.finetuning._model import position_limit
    from pockjax.models.hf import read_config

    limit = position_limit(read_config(model))
    if seq is None:
        return 512 if limit is None else min(512, limit)
    if limit is not None and seq > limit:
        raise FinetuneError(f"--seq {seq}: the model in '{model}' takes at most {limit} "
                            f"positions (max_position_embeddings in its config.json); pass "
                            f"--seq {limit} or less")
    return seq


def finetune(model, data, out, *, valid=None, scheme: str = "paper", steps: int | None = None,
             epochs: float | None = None, batch: int = 4, seq: int | None = None,
             lr: float = 1e-4,
             warmup: int = 0, schedule: str = "cosine", weight_decay: float = 0.0,
             eval_every: int | None = None, save_every: int | None = None, keep: int = 3,
             resume: bool = False, overwrite: bool = False, seed: int = 0,
             frozen_dtype: str = "float32", moments: str = "float32",
             skip_nonfinite: bool = False, frontend: str = "auto", plot: bool = True, prefix_cache: str = "auto",
             save_dtype: str = "auto", compile_cache: bool = True,
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
        any of these three with "+head" (the output head trains too, in full),
        "blockwise:K" / "blockwise:K:N" (the blocks take turns, N at a time, K steps
        each: `pockjax.schemes.blockwise`), "lora:R" (LoRA of rank R on every linear
        layer of the blocks, merged into the weights in `final/`), "search:BUDGET"
        (`pockjax.search_scheme` under a budget such as "40%" or "4GiB"), or a scheme JSON file
        (`Scheme.to_json`). Default "paper"; see `scheme_from_spec`.
      steps: the run's total training steps, a positive whole number; give this or
        `epochs`, not both.
      epochs: passes over the data instead of `steps` (a positive number, rounded up to
        whole steps); with neither, 1 epoch.
      batch: examples per step; default 4.
      seq: tokens per example, at least 2 (longer examples are cut), at most the
        model's positions (`max_position_embeddings`); default 512, or the model's
        positions where fewer.
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
        "bfloat16", or "int8" / "int4" / "int4:GROUP" (`pockjax.lowbit`); not with
        "lora:R" or "blockwise" schemes.
      moments: the storage of AdamW's two moments: "float32" (the default), "bfloat16"
        or "int8" (`pockjax.optim.adamw`; the trained weights stay float32).
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
      save_dtype: the float type of `final/`'s trained tensors: "auto" (the default: the
        base model's, as its safetensors store it), "float32", "bfloat16" or "float16".
        The tensors the scheme never trains are the base's own bytes, and `config.json`
        keeps every field of the base's.
      compile_cache: use JAX's persistent compilation cache (a folder under the user's
        cache directory, `pockjax.train.compile_cache_dir`), so a second run of the same
        shapes starts without compiling; default True. The first step's compilation
        seconds are in `metrics.jsonl` (`compile_seconds`) either way.
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
        if name == "seq" and value is None:
            continue
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise FinetuneError(f"--{name} must be a positive whole number, got {value!r}")
    if seq is not None and seq < 2:
        raise FinetuneError(f"--seq must be at least 2 (a token and the one it predicts), "
                            f"got {seq}")
    for name, value in (("steps", steps), ("eval-every", eval_every), ("save-every", save_every)):
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise FinetuneError(f"--{name} must be a positive whole number, got {value!r}")
    if epochs is not None and not epochs > 0:
        raise FinetuneError(f"--epochs must be positive, got {epochs!r}")
    if not (lr > 0 and math.isfinite(lr)) or warmup < 0:
        raise FinetuneError(f"--lr must be a positive finite number and --warmup >= 0, got "
                            f"{lr!r}, {warmup!r}")
    if not (weight_decay >= 0 and math.isfinite(weight_decay)):
        raise FinetuneError(f"--weight-decay must be a finite number >= 0, got {weight_decay!r}")
    if resume and overwrite:
        raise FinetuneError("give --resume or --overwrite, not both")
    if save_dtype not in SAVE_DTYPES:
        raise FinetuneError(f"--save-dtype must be one of {', '.join(SAVE_DTYPES)}, got "
                            f"{save_dtype!r}")
    if prefix_cache not in ("auto", "on", "off"):
        raise FinetuneError(f"--prefix-cache must be auto, on or off, got {prefix_cache!r}")
    if moments not in pj.optim.moments.MOMENTS:
        raise FinetuneError(f"--moments must be one of {', '.join(pj.optim.moments.MOMENTS)}, "
                            f"got {moments!r}")

    # The output folder before anything is read: a refused run leaves nothing behind.
    RunFolder.check(Path(out), resume=resume, overwrite=overwrite)
    lora = spec_number(str(scheme), "lora:R") if str(scheme).startswith("lora:") else None
    if lora is not None and frozen_dtype != "float32":
        raise FinetuneError(f"--scheme {scheme} with --frozen-dtype {frozen_dtype} is not "
                            f"implemented; use --frozen-dtype float32")
    # A scheme that needs no weights to choose: the frozen weights are stored in
    # frozen_dtype as they are read (the model is never whole in a wider type).
    known = not str(scheme).startswith(("search:", "blockwise:"))

    def load():
        return load_model(model, frozen_dtype=frozen_dtype, frontend=frontend, lora=lora,
                          seed=seed, scheme_of=(lambda shapes, layers: scheme_from_spec(
                              scheme, shapes, layers)) if known else None)

    loaded = load()
    seq = check_positions(model, seq)
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
    note = f" ({loaded.note})" if loaded.note else ""
    for line in [f"model {model}: {loaded.description}{note}", train.describe(),
                 *([held.describe()] if held is not None else [])]:
        _say(progress, line)

    def loss_fn(p, b):
        return lm_loss(loaded.apply(p, b["tokens"]), b["tokens"], b["mask"])

    def search(budget):
        return _search_scheme(loaded, loss_fn, train, held, budget, batch, seq, pad, seed, lr,
                              Path(out) / "search-cache", progress)

    chosen = choose_scheme(loaded, scheme, frozen_dtype, search=search,
                           say=lambda text: _say(progress, text))
    scheduled = isinstance(chosen, Schedule)

    def weights(loaded):
        return trainer_params(loaded, chosen, frozen_dtype)

    params = weights(loaded)
    frozen = frozen_names(loaded, chosen, params)
    partial = partial_names(loaded, params)

    options = options_of(model=os.path.abspath(model), data=fingerprint(data),
                          scheme=(f"lora:{lora} " if lora else "") + chosen.to_json(),
                          total_steps=total, batch=batch, seq=seq,
                          lr=lr, warmup=warmup, schedule=schedule, seed=seed,
                          frozen_dtype=frozen_dtype, skip_nonfinite=skip_nonfinite,
                          weight_decay=weight_decay, frontend=frontend, moments=moments)
    run = RunFolder(Path(out), options, resume=resume, overwrite=overwrite)

    trainer = make_trainer(loaded, chosen, lr=lr, warmup=warmup, total=total,
                           schedule=schedule, weight_decay=weight_decay, moments=moments,
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
        if scheduled:
            like = lambda s: trainer.init(params, copy=False, step=s)  # noqa: E731
        else:
            # A checkpoint holds every weight: the loaded ones are dropped before it is
            # read (the state in memory once), and loaded again only if none loads.
            like = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                          state)
            if run.checkpoints():
                state = params = loaded.params = None
        restored, path = run.restore(like)
        if restored is not None:
            state, start = restored, int(restored.step)
            params = loaded.params = like = None
            _say(progress, f"resumed from {path.name} (step {start} of {total})")
        elif state is None:
            loaded = load()
            params = weights(loaded)
            state = trainer.init(params, copy=False)
        run.trim_log(start)

    from pockjax import lowbit

    # The state's frozen weights may be stored in low precision: dequantized where used.
    batch_nll = jax.jit(lowbit.at_use(lambda p, b: nll_sum(loaded.apply(p, b["tokens"]),
                                                           b["tokens"], b["mask"])))

    def evaluate(state) -> float | None:
        if held is None:
            return None
        total_nll = count = 0.0
        for b in eval_batches(held, batch, seq, pad):
            s, n = batch_nll(state.params, b)
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
            first = r.get("compile_seconds")
            r = {"step": r["step"], "loss": r["loss"], "lr": float(schedule_fn(r["step"] - 1)),
                 "tokens": r["tokens"], "seconds": r["seconds"]}
            if first is not None:
                r["compile_seconds"] = first
                _say(progress, f"step {r['step']}: {r['seconds']:.1f} s, of which compiling "
                               f"{first:.1f} s" + (" (the compilation cache was on)"
                                                    if compile_cache else ""))
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
                                 on_record=record, stop_nonfinite=True, tokens=tokens_of,
                                 compile_cache=compile_cache)
    except StepNotFinite as e:
        close_prefix_cache(cached, out)
        kept = run.checkpoints()
        where = (f"the last checkpoint, {kept[-1][1]}, is from step {kept[-1][0]}"
                 if kept else "no checkpoint was written")
        raise NonFiniteLoss(f"step {e.step}: the loss is {e.loss}; the run stopped and {where}. "
                            f"Lower the learning rate (--lr {lr:g}), add warm-up (--warmup), "
                            f"or pass --skip-nonfinite to skip such steps") from None
    close_prefix_cache(cached, out)
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
    write_final(loaded, state.params, final, base=model, frozen=frozen, partial=partial,
                save_dtype=save_dtype)
    if plot:
        plot_losses(Path(out))
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


def _search_scheme(loaded, loss_fn, train, held, budget, batch, seq, pad, seed, lr, cache,
                   progress):
    """`pockjax.search_scheme` over the model's candidates under `budget`, on the first batches
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
        scheme, report = pj.search_scheme(factory, loaded.params, (train_batches, heldout),
                                   budget=budget, steps=steps, cache=str(cache),
                                   progress=progress)
    except ValueError as e:
        raise FinetuneError(f"--scheme search:{budget}: {e}") from None
    _say(progress, f"search under {budget}: trains {', '.join(report.chosen)}")
    return scheme


claim(globals())  # public names defined in the private modules above live here
