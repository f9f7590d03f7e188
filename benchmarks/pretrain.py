"""Pretrain the quality benchmark's model: pockjax's LLaMA on the Python standard library.

`python -m benchmarks pretrain [--quick] [--work DIR]` builds the corpus and its
tokenizer (`benchmarks/quality_data.py`: a byte-level BPE trained on the pretraining
files), saves a randomly initialised `pockjax.models.llama.Llama` as a Hugging Face
folder, and trains all of it with `pockjax.finetune(scheme="full")` on the corpus's
`{"text"}` records. `finetune` gives the rest: checkpoints every `save_every` steps, a
resumed run that continues bit for bit where the last one stopped, validation on the
held-out standard-library files, a progress bar.

Everything is cached under `--work` in folders named by a hash of the settings, so a
second call returns at once and an interrupted one resumes (Ctrl-C is safe):

    <work>/corpus-<hash>/   tokenizer/, train.jsonl, heldout.jsonl, manifest.json
    <work>/pretrain-<hash>/ init/ (random weights), run/ (finetune's run folder),
                            model/ (the pretrained Hugging Face folder + pretrain.json)

The full preset (6 blocks, width 256, vocabulary 8192, sequence 256; 1300 steps of
8 x 256 tokens, about 0.85 passes over the 3.1M-token corpus) is sized for 30-40 minutes
(1.7 s a step measured alone on a 2.50 GHz Xeon's 2 cores: about 37 minutes) on an idle
2-core CPU; `--quick` (2 blocks, width 64) for about a minute, for tests. Where a GPU
is lent, `python -m benchmarks gpu quality` trains the same preset there from this
machine's corpus, with the quality benchmark's runs (`benchmarks/gpu.py`).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import quality_data  # noqa: E402
from benchmarks.common import ROOT  # noqa: E402

# Model, corpus and training sizes. `steps` x `batch` x `seq` is the token budget; the
# packed presets (`packed=True`, `train_packed`) train for `seconds` of steps instead,
# their step count fixed once the first steps are timed.
PRESETS = {
    "quick": dict(layers=2, hidden=64, heads=2, intermediate=176, vocab=1024, seq=128,
                  batch=8, steps=150, lr=3e-3, warmup=15, sample_pct=15, heldout_cap=32,
                  eval_every=100, save_every=100),
    "small": dict(layers=6, hidden=256, heads=4, intermediate=688, vocab=8192, seq=256,
                  batch=8, steps=1300, lr=1e-3, warmup=65, sample_pct=100, heldout_cap=128,
                  eval_every=100, save_every=100),
    # 31.6M parameters, the output head 9.96% of them (LLaMA-2-7B's is 2%, the small
    # preset's 23.5%); the standard library and every installed package's sources but
    # the tasks'. Trained on a GPU with bfloat16 matmuls (float32 weights and AdamW),
    # stored rounded to bfloat16 (so it travels in 60 MiB; fine-tuning reads it in
    # float32).
    "medium": dict(layers=14, hidden=384, heads=6, intermediate=1056, vocab=8192, seq=256,
                   batch=64, seconds=140.0, lr=1.5e-3, warmup=200, sample_pct=100,
                   heldout_cap=256, source="packages", packed=True, matmul="bfloat16",
                   weight_decay=0.1, store="bfloat16"),
    # The medium preset's code path at test size: a sample of the packages corpus.
    "medium-quick": dict(layers=2, hidden=64, heads=2, intermediate=176, vocab=512, seq=64,
                         batch=8, steps=40, lr=3e-3, warmup=5, sample_pct=1, heldout_cap=16,
                         source="packages", packed=True, weight_decay=0.1, store="bfloat16"),
}
PRESETS["full"] = PRESETS["small"]  # the small preset's former name
CORPUS_KEYS = ("vocab", "seq", "sample_pct", "heldout_cap")
DEFAULT_WORK = os.path.join(ROOT, ".cache", "quality")


def settings_hash(settings) -> str:
    """A short name for `settings` (JSON-able), for cache folders."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


def corpus_settings(preset: str, exclude=()) -> dict:
    """`quality_data.build_corpus`'s keyword arguments for `preset` (`exclude`: packages
    the "packages" source leaves out besides the tasks')."""
    settings = PRESETS[preset]
    out = {k: settings[k] for k in CORPUS_KEYS}
    if settings.get("source", "stdlib") != "stdlib":
        out.update(source=settings["source"], exclude=tuple(sorted(exclude)))
    return out


def folders(work, preset: str, exclude=()) -> dict[str, Path]:
    """Where a preset's corpus and model live under `work` (see the module docstring)."""
    settings = PRESETS[preset]
    corpus = {**corpus_settings(preset, exclude), "format": quality_data.FORMAT}
    if "exclude" in corpus:
        corpus["exclude"] = list(corpus["exclude"])
    work = Path(work)
    model_key = {**settings, **corpus, "python": sys.version.split()[0]}
    pre = work / f"pretrain-{settings_hash(model_key)}"
    return {"corpus": work / f"corpus-{settings_hash(corpus)}", "init": pre / "init",
            "run": pre / "run", "model": pre / "model"}


def save_init(init: Path, corpus_folder: Path, corpus: dict, settings: dict) -> None:
    """A randomly initialised `pockjax.models.llama.Llama` of `settings` (seed 0) as a
    Hugging Face folder `init`, with the corpus's tokenizer."""
    from flax import nnx

    from pockjax.models.hf import save_llama
    from pockjax.models.llama import Llama, LlamaConfig

    config = LlamaConfig(vocab_size=corpus["vocab_size"], hidden_size=settings["hidden"],
                         intermediate_size=settings["intermediate"],
                         num_layers=settings["layers"], num_heads=settings["heads"],
                         max_position_embeddings=settings["seq"])
    save_llama(Llama(config, rngs=nnx.Rngs(0)), init, tokenizer=Path(corpus_folder) / "tokenizer")


def train(init, corpus_folder, run, settings: dict, *, steps: int | None = None, **kwargs):
    """`pockjax.finetune` of every weight of `init` on the corpus's `train.jsonl`,
    validated on `heldout.jsonl`, with `settings`' schedule; `kwargs` go to finetune."""
    import pockjax as pj

    corpus_folder = Path(corpus_folder)
    return pj.finetune(init, corpus_folder / "train.jsonl", run,
                       valid=corpus_folder / "heldout.jsonl", scheme="full",
                       steps=steps or settings["steps"], batch=settings["batch"],
                       seq=settings["seq"], lr=settings["lr"], warmup=settings["warmup"],
                       schedule="cosine", eval_every=settings["eval_every"], **kwargs)


def packed_examples(path, tokenizer, seq: int):
    """The `{"text"}` records of `path` as `pockjax.data.read_jsonl` makes them (the
    tokenizer's special tokens, the end token after, cut to `seq`), padded into
    `(tokens [N, seq] int32, mask [N, seq] float32)` arrays; tokenized in one batch
    (the tokenizer's threads), for a corpus of many records."""
    import numpy as np

    texts = [json.loads(line)["text"] for line in Path(path).read_text(encoding="utf-8")
             .splitlines() if line.strip()]
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else (tokenizer.eos_id or 0)
    tokens = np.full((len(texts), seq), pad, np.int32)
    mask = np.zeros((len(texts), seq), np.float32)
    for i, enc in enumerate(tokenizer.backend.encode_batch(texts, add_special_tokens=True)):
        ids = (list(enc.ids) + eos)[:seq]
        tokens[i, :len(ids)] = ids
        mask[i, :len(ids)] = 1.0
    return tokens, mask


@dataclasses.dataclass
class PackedResult:
    """What `train_packed` did (`pretrain_record` reads it as finetune's result)."""

    final: str
    out: str
    steps: int
    seconds: float
    valid_loss_before: float
    valid_loss: float
    train_loss: float
    tokens_per_second: float
    total_params: int
    tokens: int
    valid_loss_unrounded: float | None = None
    start_step: int = 0


def train_packed(init, corpus_folder, out, settings: dict, *, seconds: float | None = None,
                 steps: int | None = None, progress: bool = True) -> PackedResult:
    """Pretraining for a large corpus on a GPU: every weight of `init` trained by
    `pockjax.sparse_train` on the corpus's records, all of them on the device, a batch
    gathered there each step; AdamW (`settings["weight_decay"]` on matrices only, b2
    0.95), gradients clipped to norm 1, linear warm-up then cosine decay to a tenth of
    `settings["lr"]`; matmuls at `settings["matmul"]` precision (e.g. "bfloat16": float32
    weights multiplied in bfloat16 with float32 accumulation).

    Runs `steps` steps, or as many as fit in `seconds` of training: the warm-up's steps
    are timed and the decay sized from them (the warm-up part of the schedule is the same
    for any length, so the step compiled for the decay takes over the state). Held-out
    loss on `heldout.jsonl` before and after; `out/metrics.jsonl` has the training loss
    every 50 steps; `out/final` the model (with `settings["store"] == "bfloat16"`, its
    weights rounded to bfloat16, and the held-out loss measured after the rounding)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import pockjax as pj
    from pockjax.data import eval_batches, read_jsonl
    from pockjax.finetuning import lm_loss, nll_sum
    from pockjax.models.hf import load_llama, save_llama

    if (seconds is None) == (steps is None):
        raise ValueError("give train_packed seconds or steps, one of them")
    corpus_folder, out = Path(corpus_folder), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = pj.Tokenizer.from_folder(init)
    seq, batch, warmup = settings["seq"], settings["batch"], settings["warmup"]
    t0 = time.perf_counter()
    tokens, mask = packed_examples(corpus_folder / "train.jsonl", tok, seq)
    held = read_jsonl(corpus_folder / "heldout.jsonl", tok, seq)
    pad = tok.pad_id if tok.pad_id is not None else (tok.eos_id or 0)
    held_batches = list(eval_batches(held, 32, seq, pad))
    say = (lambda text: print(f"pretrain: {text}", file=sys.stderr, flush=True)) if progress \
        else (lambda text: None)
    say(f"{len(tokens):,} records, {int(mask.sum()):,} tokens, read in "
        f"{time.perf_counter() - t0:.0f} s")

    model = load_llama(init)
    graphdef, params, rest = pj.nnx.split(model)
    total_params = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    precision = settings.get("matmul")

    def loss(p, b):
        with jax.default_matmul_precision(precision):
            return lm_loss(pj.nnx.merge(graphdef, p, rest)(b["tokens"]), b["tokens"], b["mask"])

    @jax.jit
    def batch_nll(p, b):
        return nll_sum(pj.nnx.merge(graphdef, p, rest)(b["tokens"]), b["tokens"], b["mask"])

    def heldout(p) -> float:
        sums = [batch_nll(p, b) for b in held_batches]
        return float(sum(s for s, _ in sums) / sum(n for _, n in sums))

    def trainer_for(total: int):
        peak = settings["lr"]
        schedule = optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total, warmup + 1),
                                                      end_value=peak / 10)
        decay = lambda p: jax.tree.map(lambda x: jnp.ndim(x) >= 2, p)  # noqa: E731
        opt = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(schedule, b1=0.9, b2=0.95,
                                      weight_decay=settings.get("weight_decay", 0.0), mask=decay))
        return pj.sparse_train(loss, optimizer=opt, scheme=pj.Scheme(default=pj.Full())), schedule

    before = heldout(params)
    say(f"{total_params:,} parameters; held-out loss {before:.4f} before training")
    dev_tokens, dev_mask = jax.device_put(tokens), jax.device_put(mask)
    n = len(tokens)
    rng = np.random.default_rng(0)
    order = jnp.asarray(rng.permutation(n))
    epoch, cursor = 0, 0

    def next_batch():
        nonlocal order, epoch, cursor
        if cursor + batch > n:
            epoch, cursor = epoch + 1, 0
            order = jnp.asarray(np.random.default_rng([0, epoch]).permutation(n))
        idx = order[cursor:cursor + batch]
        cursor += batch
        return {"tokens": dev_tokens[idx], "mask": dev_mask[idx]}

    planned = steps if steps is not None else warmup + 10**9  # the warm-up's schedule
    trainer, schedule = trainer_for(planned)
    state = trainer.init(params, copy=False)
    params = model = None
    log = open(out / "metrics.jsonl", "w")
    losses: list = []
    step, began, timed_from = 0, time.perf_counter(), None
    decided = steps is not None
    while step < planned:
        state, m = trainer(state, next_batch())
        losses.append(m["loss"])
        step += 1
        if step == 1:
            float(losses[0])  # compiled and run: the timing starts after it
            timed_from = (step, time.perf_counter())
            compile_seconds = timed_from[1] - began
        if not decided and step == warmup:
            float(losses[-1])
            per_step = (time.perf_counter() - timed_from[1]) / (step - timed_from[0])
            # The decay's step compiles too (about as long as the first did).
            left = seconds - (time.perf_counter() - began) - compile_seconds
            planned = max(warmup + 1, warmup + int(left / per_step * 0.97))
            trainer, schedule = trainer_for(planned)
            decided = True
            say(f"{per_step * 1e3:.1f} ms a step after compiling: {planned:,} steps "
                f"({planned * batch * seq:,} token slots) in the {seconds:.0f} s")
        if step % 50 == 0 or step == planned:
            values = [float(x) for x in jax.device_get(losses[-50:])]
            if not all(map(np.isfinite, values)):
                raise FloatingPointError(f"pretraining: the loss is not finite at step {step}")
            record = {"step": step, "loss": float(np.mean(values)),
                      "lr": float(schedule(step - 1)), "epoch": epoch,
                      "seconds": round(time.perf_counter() - began, 3)}
            log.write(json.dumps(record) + "\n")
            log.flush()
            if step % 500 == 0 or step == planned:
                say(f"step {step:,}/{planned:,}: loss {record['loss']:.4f}, epoch {epoch}, "
                    f"{record['seconds']:.0f} s")
    train_seconds = time.perf_counter() - began
    train_loss = float(np.mean([float(x) for x in jax.device_get(losses[-50:])]))
    params = state.params
    after_unrounded = None
    if settings.get("store") == "bfloat16":
        after_unrounded = heldout(params)
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), params)
    after = heldout(params)
    log.write(json.dumps({"step": step, "valid_loss": after,
                          "seconds": round(train_seconds, 3)}) + "\n")
    log.close()
    final = out / "final"
    save_llama(pj.nnx.merge(graphdef, params, rest), final, tokenizer=corpus_folder / "tokenizer")
    targets = int(mask.sum())
    say(f"{step:,} steps in {train_seconds:.0f} s; held-out loss {before:.4f} -> {after:.4f}")
    return PackedResult(final=str(final), out=str(out), steps=step, seconds=train_seconds,
                        valid_loss_before=before, valid_loss=after, train_loss=train_loss,
                        tokens_per_second=step * batch * seq / train_seconds,
                        total_params=total_params, tokens=targets,
                        valid_loss_unrounded=after_unrounded)


def pretrain_record(preset: str, corpus: dict, result, **extra) -> dict:
    """The model folder's `pretrain.json`: settings, corpus manifest and `result`'s
    figures (`extra` too, such as the device it trained on)."""
    settings = PRESETS[preset]
    tokens = result.steps * settings["batch"] * settings["seq"]
    if isinstance(result, PackedResult):  # padding left out: the tokens the loss counted
        packed = {"passes": result.steps * settings["batch"] / corpus["tokens"]["train_records"],
                  "heldout_loss_unrounded": result.valid_loss_unrounded,
                  "tokens_per_parameter": tokens / result.total_params}
        extra = {**packed, **extra}
    return {"preset": preset, "settings": settings, "corpus": corpus,
            "steps": result.steps, "resumed_from_step": result.start_step,
            "tokens": tokens,
            "heldout_loss_before": result.valid_loss_before, "heldout_loss": result.valid_loss,
            "train_loss": result.train_loss, "seconds_this_session": result.seconds,
            "tokens_per_second": result.tokens_per_second,
            "parameters": result.total_params, **extra}


def build_corpus(work, preset: str, exclude=(), *, progress: bool = True) -> dict:
    """The corpus of `preset` under `work` (made if needed): its manifest."""
    where = folders(work, preset, exclude)
    if progress and not (where["corpus"] / "manifest.json").is_file():
        print(f"pretrain: building the corpus in {where['corpus']}", file=sys.stderr, flush=True)
    return quality_data.build_corpus(where["corpus"], **corpus_settings(preset, exclude))


def on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def pretrain(work, preset: str, *, exclude=(), progress: bool = True) -> Path:
    """The pretrained model folder of `preset`, made (or resumed) if needed. A packed
    preset with a time budget (`seconds`) is trained on a GPU only."""
    settings = PRESETS[preset]
    where = folders(work, preset, exclude)
    done = where["model"] / "pretrain.json"
    if done.is_file():
        return where["model"]
    t0 = time.perf_counter()
    corpus = build_corpus(work, preset, exclude, progress=progress)
    data_seconds = time.perf_counter() - t0
    if progress:
        tokens = corpus["tokens"]
        print(f"pretrain: corpus {corpus['pretraining_files']['files']} files, "
              f"{tokens['train_files']:,} tokens ({tokens['train_records']} records), held out "
              f"{corpus['heldout_files']['files']} files; BPE vocabulary {corpus['vocab_size']} "
              f"({data_seconds:.0f} s)", file=sys.stderr, flush=True)

    if not (where["init"] / "config.json").is_file():
        save_init(where["init"], where["corpus"], corpus, settings)
    extra = {}
    if settings.get("packed"):
        if "seconds" in settings and not on_gpu():
            sys.exit(f"pretrain: the {preset} preset is pretrained on a GPU ("
                     f"{settings['seconds']:.0f} s there with bfloat16 matmuls; days on a "
                     f"2-core CPU): run `python -m benchmarks gpu prepare --quality {preset}` "
                     f"here and `gpu quality` on the GPU machine, then `gpu adopt-quality`")
        shutil.rmtree(where["run"], ignore_errors=True)
        result = train_packed(where["init"], where["corpus"], where["run"], settings,
                              seconds=settings.get("seconds"), steps=settings.get("steps"),
                              progress=progress)
        import jax
        extra["trained_on"] = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                               "python": sys.version.split()[0]}
    else:
        result = train(where["init"], where["corpus"], where["run"], settings,
                       save_every=settings["save_every"], keep=2, resume=True, progress=progress)
    tmp = where["model"].with_name("model.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(result.final, tmp)
    if settings.get("packed"):
        shutil.copy(Path(result.out) / "metrics.jsonl", tmp / "pretrain_metrics.jsonl")
    record = pretrain_record(preset, corpus, result, **extra)
    (tmp / "pretrain.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(where["model"], ignore_errors=True)
    os.replace(tmp, where["model"])
    if progress:
        print(f"pretrain: {result.total_params:,} parameters, held-out loss "
              f"{result.valid_loss:.4f} after {result.steps} steps; model in {where['model']}",
              file=sys.stderr, flush=True)
    return where["model"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=[p for p in PRESETS if p != "full"], default="small",
                    help="small (the default: 6 blocks, width 256, on the standard library), "
                         "medium (14 blocks, width 384, on every installed package; a GPU), "
                         "quick or medium-quick (for tests)")
    ap.add_argument("--quick", action="store_true", help="the same as --preset quick")
    ap.add_argument("--exclude", default="",
                    help="comma-separated packages the packages corpus leaves out besides "
                         "numpy and sympy (a --task-dir package)")
    ap.add_argument("--work", default=DEFAULT_WORK,
                    help=f"cache folder for the corpus and the model (default {DEFAULT_WORK})")
    args = ap.parse_args(argv)
    exclude = tuple(x for x in args.exclude.split(",") if x)
    print(pretrain(args.work, "quick" if args.quick else args.preset, exclude=exclude))


if __name__ == "__main__":
    main()
