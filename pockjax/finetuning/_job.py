"""The fine-tuning run: `finetune` (a model folder and JSONL in, a run folder out) and
`check_positions`, which the device job's export shares with it."""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from pockjax.finetuning._base import FinetuneError, Interrupted, NonFiniteLoss
from pockjax.finetuning._formats import stored_formats
from pockjax.finetuning._model import (frozen_names, gguf_file, lm_loss, load_model,
                                       model_folder, nll_sum, partial_names, target_positions,
                                       write_final)
from pockjax.finetuning._gguf import check_save_gguf, final_gguf
from pockjax.finetuning._hosts import join
from pockjax.finetuning._lr import previous_lr, sweep_lr
from pockjax.finetuning._options import FinetuneOptions
from pockjax.finetuning._run import (FINAL, RunFolder, close_prefix_cache, fingerprint,
                                     plot_losses, run_options)
from pockjax.finetuning._spec import choose_scheme
from pockjax.finetuning._step import (choose_devices, lr_schedule, make_trainer,
                                      search_scheme, trainer_params)


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


def finetune(model, data, out, *, options: FinetuneOptions | None = None,
             **keywords) -> FinetuneResult:
    """Fine-tune the model in folder `model` on the JSONL file `data`; the run goes in
    folder `out` (see the module docstring for what it holds).

    The options are `FinetuneOptions`' fields, given as keywords or as `options` (not
    both); they are checked before anything is read.

    Args:
      model: a Hugging Face model folder (config.json, safetensors, tokenizer.json), or
        a GGUF file (`pockjax.gguf`): its frozen weights stay in the file's own blocks,
        decoded where the step uses them, and `out/final.gguf` is written beside
        `final/` (every frozen tensor the file's bytes, the trained ones in `gguf_type`;
        each tensor's digest or rounding in `final.gguf.json`).
      data: a JSONL file of `{"text"}`, `{"prompt", "completion"}` or `{"messages"}`
        records (`pockjax.data.read_jsonl`).
      out: the run's folder; must be new or empty unless it holds a run and `resume`
        or `overwrite` is given.
      options: a `FinetuneOptions` instead of the keywords.
      **keywords: the options (`FinetuneOptions`' fields), below.

    Keyword Args:
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
      lr: AdamW's peak learning rate, positive; default 1e-4. "auto": a short run at
        each rate of `LR_GRID` (1e-5 to 1e-3) from the same weights, the one with the
        lowest loss on `valid` (required) trains; run.json records the sweep
        (`lr_auto`), and a resumed run reuses its choice. Not with `search:` or
        `blockwise:` schemes.
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
      devices: the devices the step runs on: a number, "all", or "auto" (the default:
        every GPU or TPU of JAX's default backend, as many as divide `batch`; one device
        on CPU, whose devices share its cores). `batch` stays the global batch: each
        step trains on the same examples as on one device, split over the devices.
      mesh: their axes, "data=N", "fsdp=N" or both ("data=2,fsdp=4"): every axis splits
        the batch, and `fsdp` shards the parameters (frozen ones too) and the optimizer
        state over its devices; None (the default) is "data" over `devices`. The log
        says what each device holds. The prefix cache stays off on a mesh; `--lr auto`'s
        sweep and `search:` run on one device.
      coordinator, num_processes, process_id: a run over several processes (hosts):
        process 0's "HOST:PORT", their count and this one's index, the same run started
        in each (None: one process, or the processes SLURM's srun or mpirun started).
        Process 0 writes the run's folder.
      plot: draw `loss.png` at the end (matplotlib, skipped where it is not installed);
        the metrics log is written either way. Default True.
      prefix_cache: "auto" (the default: when the data is seen more than once and the
        frozen prefix is a large enough part of the step, compute it once per example and
        keep its output; `pockjax.prefix`), "on" or "off". The results are the same with
        `logits="all"` (a cached step computes every logit); a
        line in the log says whether it is on and what it saves. Values past a quarter of
        the available memory (at most 4 GiB) go to `out/prefix-cache/`, removed at the end.
      logits: where the output head runs: "targets" (the default: at the positions the
        loss counts only, when prompts and padding leave at most half of a batch's, for
        LLaMA-family models on the Flax path and without the prefix cache; K positions
        padded to an eighth, a quarter or half of the batch, so at most three step shapes
        compile) or "all" (every position). The losses agree within float32 rounding.
      save_dtype: the float type of `final/`'s trained tensors: "auto" (the default: the
        base model's, as its safetensors store it), "float32", "bfloat16" or "float16".
        The tensors the scheme never trains are the base's own bytes, and `config.json`
        keeps every field of the base's. From a GGUF file, "auto" is float32: the file's
        values exactly as the step decodes them.
      gguf_type: the type of `final.gguf`'s trained tensors, with a GGUF `model` or
        `save_gguf`: "F16" (the default), "BF16", "F32", or a block type gguf quantizes
        ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"); vectors stay F32.
      save_gguf: with a model folder of model_type llama, mistral, qwen2 or qwen3 (and
        a byte-level BPE tokenizer), also write `out/final.gguf` from `final/`
        (`pockjax.gguf.folder_gguf`): the frozen tensors quantized once to this type, the
        trained ones in `gguf_type`, the tokenizer and chat template carried. Checked
        before the first step.
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
      Interrupted: Ctrl-C or SIGTERM; the last completed step was saved, `resume=True`
        continues.
    """
    import jax

    from pockjax.data import (DataError, batch_at, batch_examples, eval_batches, pad_batch,
                              read_jsonl, steps_per_epoch)
    from pockjax.schedule import Schedule
    from pockjax.tokenizer import Tokenizer, TokenizerError
    from pockjax.train import NonFiniteLoss as StepNotFinite, fit

    o = options_from(options, keywords)
    scheme, steps, epochs, batch, seq = o.scheme, o.steps, o.epochs, o.batch, o.seq
    lr, warmup, schedule, weight_decay, seed = o.lr, o.warmup, o.schedule, o.weight_decay, o.seed
    frozen_dtype, moments, frontend, progress = o.frozen_dtype, o.moments, o.frontend, o.progress
    resume, overwrite, keep, valid = o.resume, o.overwrite, o.keep, o.valid
    eval_every, save_every, prefix_cache = o.eval_every, o.save_every, o.prefix_cache
    hosts = join(o.coordinator, o.num_processes, o.process_id)  # before any JAX work
    if hosts is not None:
        if lr == "auto" or scheme.kind == "search":
            raise FinetuneError("--lr auto and --scheme search run on one process; choose "
                                "them in a one-process run, then pass them here")
        progress = progress and hosts.writer  # one log: process 0's

    # The output folder before anything is read: a refused run leaves nothing behind.
    RunFolder.check(Path(out), resume=resume, overwrite=overwrite)
    lora = scheme.lora_rank
    if Path(model).is_dir() and Path(out).resolve().is_relative_to(Path(model).resolve()):
        raise FinetuneError(f"--out '{out}' is inside the model folder '{model}': the run "
                            f"would write into the base model; give a folder outside it")
    given, model = model, model_folder(model)   # a GGUF file: the folder made of it
    if valid is not None and Path(valid).is_file() and Path(data).is_file() \
            and os.path.samefile(valid, data):
        text = (f"--valid '{valid}' is the training file: its loss measures what the model "
                f"memorised, not held-out data")
        _say(progress, text) if progress else warnings.warn(text, stacklevel=2)
    source = gguf_file(model)
    check_save_gguf(model, source, o.save_gguf)

    def load():
        # A scheme known from the names and shapes: the frozen weights are stored in
        # frozen_dtype as they are read (the model is never whole in a wider type).
        return load_model(model, frozen_dtype=frozen_dtype, frontend=frontend, lora=lora,
                          seed=seed, scheme_of=scheme.build if scheme.known_before_loading
                          else None)

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
        return search_scheme(loaded, loss_fn, train, held, budget, batch, seq, pad, seed, lr,
                             Path(out) / "search-cache", progress,
                             lambda text: _say(progress, text))

    chosen = choose_scheme(loaded, scheme, frozen_dtype, search=search,
                           say=lambda text: _say(progress, text))
    scheduled = isinstance(chosen, Schedule)

    def weights(loaded):
        return trainer_params(loaded, chosen, frozen_dtype)

    params = weights(loaded)
    frozen = frozen_names(loaded, chosen, params)
    partial = partial_names(loaded, params)

    recorded = run_options(o, model=os.path.abspath(given), data=fingerprint(data),
                           scheme=(f"lora:{lora} " if lora else "") + chosen.to_json(),
                           total_steps=total, seq=seq)
    placement = choose_devices(o.devices, o.mesh, batch, lambda text: _say(progress, text),
                               processes=1 if hosts is None else hosts.count)
    if hosts is not None:
        _say(progress, hosts.describe())
        recorded["processes"] = hosts.count  # not checked: a run resumes on any
    recorded["mesh"] = placement.text if placement is not None else None  # not checked
    if placement is not None and prefix_cache == "on":
        raise FinetuneError(f"--prefix-cache on with --mesh {placement.text}: the prefix "
                            f"cache runs on one device; pass --prefix-cache off or --devices 1")
    if lr == "auto":
        chosen_lr = previous_lr(Path(out)) if resume else None
        if chosen_lr is None:
            def trainer_for(rate, steps):
                return make_trainer(loaded, chosen, lr=rate, warmup=min(warmup, steps // 2),
                                    total=steps, schedule=schedule, weight_decay=weight_decay,
                                    moments=moments, skip_nonfinite=True)

            chosen_lr = sweep_lr(trainer_for, params, train, held, loaded, total=total,
                                 batch=batch, seq=seq, seed=seed, pad=pad,
                                 say=lambda text: _say(progress, text))
        recorded["lr_auto"] = chosen_lr
        lr = chosen_lr["chosen"]
    if hosts is None or hosts.writer:
        run = RunFolder(Path(out), recorded, resume=resume, overwrite=overwrite)
    if hosts is not None:  # the others read the folder once process 0 has made it
        hosts.barrier("pockjax finetune: run folder")
        run = run if hosts.writer else RunFolder.reader(Path(out))

    trainer = make_trainer(loaded, chosen, lr=lr, warmup=warmup, total=total,
                           schedule=schedule, weight_decay=weight_decay, moments=moments,
                           skip_nonfinite=o.skip_nonfinite, placement=placement)
    state = trainer.init(params, copy=False)
    info = trainer.explain(state, batch_at(train, 0, batch, seq, seed=seed, pad_id=pad))
    turn = (f" (in turns of {chosen.every} steps; {len(chosen.schemes)} schemes, the first "
            f"shown)" if scheduled else "")
    _say(progress, f"scheme {scheme}: {info.trainable_params:,} of {info.total_params:,} "
                   f"parameters train{turn}; {total} steps of {batch} x {seq} tokens "
                   f"({per_epoch} per epoch)")
    stored = stored_formats(state.params)
    if stored:
        _say(progress, f"frozen weights stored as {stored}, decoded where each is used")
    if placement is not None:
        _say(progress, placement.describe(state))
    start = 0
    if resume:
        if scheduled:
            like = lambda s: trainer.init(params, copy=False, step=s)  # noqa: E731
        else:
            # A checkpoint holds every weight: the loaded ones are dropped before it is
            # read (the state in memory once), and loaded again only if none loads.
            like = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
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
            if hosts is not None:  # every process's devices read the whole batch
                b = hosts.global_batch(placement.replicated(b), b)
            s, n = batch_nll(state.params, b)
            total_nll, count = total_nll + float(s), count + float(n)
        return total_nll / count

    schedule_fn = lr_schedule(lr, warmup, total, schedule)
    saved: list[tuple[Path, float]] = []
    skips = [0]

    def plain_batch(step):
        return pad_batch(batch_examples(train, step, batch, seed=seed), batch, seq, pad)

    def with_targets(step):
        b = plain_batch(step)
        found = target_positions(b["mask"])
        return b if found is None else {**b, **found}

    def tokens_of(step):
        return sum(len(e.ids) for e in batch_examples(train, step, batch, seed=seed))

    valid_seen: list[float] = []
    valid_rose = [False]

    def record(r):
        """fit's records, with the learning rate and perplexity, to metrics.jsonl."""
        if "valid_loss" in r:
            value = r["valid_loss"]
            r = {"step": r["step"], "valid_loss": value, "valid_ppl": math.exp(min(value, 700)),
                 "seconds": r["seconds"]}
            _say(progress, f"step {r['step']}: valid loss {value:.4f} (perplexity "
                           f"{r['valid_ppl']:.2f})")
            best = min(valid_seen) if valid_seen else None
            valid_seen.append(value)
            if best is not None and value > best + 0.01 and not valid_rose[0]:
                valid_rose[0] = True  # said once a run, in the log and on stderr
                text = (f"step {r['step']}: the validation loss rose from {best:.4f} to "
                        f"{value:.4f}: the model is getting worse on held-out data; a lower "
                        f"--lr (now {lr:g}) or fewer steps may do better")
                if progress:
                    _say(progress, text)
                else:
                    warnings.warn(text, stacklevel=2)
                r["warning"] = text
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
                                                    if o.compile_cache else ""))
                if first_step:
                    line = placement.compiled_memory(trainer, *first_step)
                    _say(progress and line is not None, line)
        run.log(r)

    step_fn, cached = trainer, None
    if prefix_cache == "off":
        pass
    elif placement is not None:  # "on" was refused above
        if total > per_epoch:
            _say(progress, "prefix cache off (auto): it runs on one device, the step on a mesh")
    elif prefix_cache == "auto" and total <= per_epoch:
        _say(progress, "prefix cache off (auto): each example is seen once")
    else:
        from pockjax.prefix import PrefixCachedTrainer, PrefixCacheError

        spill = Path(out) / "prefix-cache"
        shutil.rmtree(spill, ignore_errors=True)
        cached = PrefixCachedTrainer(trainer, spill_dir=str(spill), auto=prefix_cache == "auto")
        try:
            report = cached.report(state, plain_batch(start))
        except PrefixCacheError as e:
            raise FinetuneError(f"--prefix-cache on: {e}") from None
        _say(progress, f"{report}; RAM budget {cached.budget_bytes / 2**30:.2f} GiB")
        step_fn = cached if report.on else trainer
    # With --logits targets (and a model that splits its head off) a batch also carries
    # the positions the loss counts, and the head runs at those only; not through the
    # prefix cache, whose example keys read every batch array.
    at_targets = o.logits == "targets" and loaded.hidden is not None and step_fn is trainer
    batch_of = with_targets if at_targets else plain_batch
    if hosts is not None:  # each process supplies the rows its devices hold
        local_of = batch_of

        def batch_of(step):
            b = local_of(step)
            return hosts.global_batch(trainer.layout.batch_shardings(b), b)
    if at_targets and 2 * train.targets <= len(train) * seq:
        _say(progress, f"the output head runs at the positions the loss counts ({train.targets:,} "
                       f"of the {len(train) * seq:,} padded positions; --logits all for every "
                       f"position)")

    def save(s) -> None:  # each checkpoint, and the seconds it took
        began = time.perf_counter()
        if hosts is None:
            saved.append((run.save(s, keep), time.perf_counter() - began))
            return
        whole = hosts.gather(s)  # every process takes part; process 0 writes
        path = run.save(whole, keep) if hosts.writer else run.path_of(int(whole.step))
        hosts.barrier(f"pockjax finetune: checkpoint {int(whole.step)}")
        saved.append((path, time.perf_counter() - began))

    # The first step's state and batch as shapes: the compiled step's memory per device
    # is read from them after that step (a schedule's trainer has no single step).
    first_step = (jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=x.sharding), state), batch_of(start)) if (
        placement is not None and not scheduled) else None
    try:
        with warnings.catch_warnings():  # finetune says it itself, with the checkpoint
            warnings.filterwarnings("ignore", message="fit: interrupted")
            if hosts is not None and not hosts.writer:  # process 0 says them
                warnings.filterwarnings("ignore", message="pockjax: ")
            if progress:  # pockjax's own warnings (the allocator's) as lines of the log
                shown = warnings.showwarning

                def show(message, category, filename, lineno, file=None, line=None):
                    text = str(message)
                    if text.startswith("pockjax: "):
                        return _say(True, text[len("pockjax: "):])
                    return shown(message, category, filename, lineno, file, line)
                warnings.showwarning = show
            state, history = fit(step_fn, state, batch_of, total, start=start,
                                 progress=progress, log_every=1, desc="finetune",
                                 evaluate=evaluate if held is not None else None,
                                 eval_every=eval_every, save=save, save_every=save_every,
                                 on_record=record, stop_nonfinite=True, tokens=tokens_of,
                                 compile_cache=o.compile_cache,
                                 agree_stop=hosts.agree_stop if hosts is not None else None)
    except jax.errors.JaxRuntimeError as e:  # another process stopped, or not ours
        raise (hosts and hosts.lost(e, run.checkpoints())) or e from None
    except StepNotFinite as e:
        close_prefix_cache(cached, out)
        kept = run.checkpoints()
        where = (f"the last checkpoint, {kept[-1][1]}, is from step {kept[-1][0]}"
                 if kept else "no checkpoint was written")
        raise NonFiniteLoss(e.step, e.loss, f"step {e.step}: the loss is {e.loss}; the run "
                            f"stopped and {where}. "
                            f"Lower the learning rate (--lr {lr:g}), add warm-up (--warmup), "
                            f"or pass --skip-nonfinite to skip such steps") from None
    close_prefix_cache(cached, out)
    if history.interrupted:
        by = history.stopped_by
        if history.steps > 0:
            raise Interrupted(f"stopped by {by} at step {start + history.steps} of {total}; "
                              f"saved {saved[-1][0]} in {saved[-1][1]:.1f} s; continue with "
                              f"--resume", by)
        raise Interrupted(f"stopped by {by} before the first step completed; nothing was "
                          f"saved (step {start}); run again (with --resume to continue)", by)
    valid_before = history.valid[0][2] if history.valid and history.valid[0][0] == 0 else None
    valid_after = (history.valid[-1][2] if history.valid and history.valid[-1][0] == total
                   else (evaluate(state) if held is not None else None))
    seconds = history.seconds
    final = Path(out) / FINAL
    params = state.params if hosts is None else hosts.gather(state.params)
    if hosts is None or hosts.writer:
        write_final(loaded, params, final, base=model, frozen=frozen, partial=partial,
                    save_dtype=o.save_dtype)
    if (source is not None or o.save_gguf) and (hosts is None or hosts.writer):
        final_gguf(loaded, params, Path(out), base=model, source=source, final=final,
                   frozen=frozen, gguf_type=o.gguf_type, save_gguf=o.save_gguf,
                   say=lambda text: _say(progress, text), metadata={
                       "general.pockjax.tool": "pockjax finetune",
                       "general.pockjax.scheme": str(scheme),
                       "general.pockjax.steps": int(total),
                       "general.pockjax.data_sha256": recorded["data"]})
    if o.plot and (hosts is None or hosts.writer):
        plot_losses(Path(out))
    if hosts is not None:
        hosts.barrier("pockjax finetune: final")
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


def options_from(options: FinetuneOptions | None, keywords: dict, *, name: str = "finetune",
                 job: bool = False) -> FinetuneOptions:
    """The options of `finetune` (or of `name`, taking the `job` options only): `options`,
    or the keywords (checked by `FinetuneOptions`)."""
    if options is not None:
        if keywords:
            raise FinetuneError(f"give the options as keywords or as options=, not both "
                                f"(got options= and {', '.join(sorted(keywords))})")
        if not isinstance(options, FinetuneOptions):
            raise FinetuneError(f"options must be a pockjax.finetuning.FinetuneOptions, got "
                                f"{type(options).__name__}")
        return options
    names = FinetuneOptions.names(job=job)
    unknown = sorted(set(keywords) - set(names))
    if unknown:
        raise TypeError(f"{name}() got an unexpected keyword argument {unknown[0]!r}; its "
                        f"options are {', '.join(names)}")
    return FinetuneOptions(**keywords)


# help() and inspect.signature show the options as keywords, with defaults and types.
finetune.__signature__ = inspect.Signature(
    [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("model", "data", "out")]
    + [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                         annotation=f.type) for f in dataclasses.fields(FinetuneOptions)]
    + [inspect.Parameter("options", inspect.Parameter.KEYWORD_ONLY, default=None)],
    return_annotation="FinetuneResult")
