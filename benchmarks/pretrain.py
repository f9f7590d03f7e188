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

# Model, corpus and training sizes. `steps` x `batch` x `seq` is the token budget.
PRESETS = {
    "quick": dict(layers=2, hidden=64, heads=2, intermediate=176, vocab=1024, seq=128,
                  batch=8, steps=150, lr=3e-3, warmup=15, sample_pct=15, heldout_cap=32,
                  eval_every=100, save_every=100),
    "full": dict(layers=6, hidden=256, heads=4, intermediate=688, vocab=8192, seq=256,
                 batch=8, steps=1300, lr=1e-3, warmup=65, sample_pct=100, heldout_cap=128,
                 eval_every=100, save_every=100),
}
CORPUS_KEYS = ("vocab", "seq", "sample_pct", "heldout_cap")
DEFAULT_WORK = os.path.join(ROOT, ".cache", "quality")


def settings_hash(settings) -> str:
    """A short name for `settings` (JSON-able), for cache folders."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


def folders(work, preset: str) -> dict[str, Path]:
    """Where a preset's corpus and model live under `work` (see the module docstring)."""
    settings = PRESETS[preset]
    corpus = {**{k: settings[k] for k in CORPUS_KEYS}, "format": quality_data.FORMAT}
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


def pretrain_record(preset: str, corpus: dict, result, **extra) -> dict:
    """The model folder's `pretrain.json`: settings, corpus manifest and `result`'s
    figures (`extra` too, such as the device it trained on)."""
    settings = PRESETS[preset]
    return {"preset": preset, "settings": settings, "corpus": corpus,
            "steps": result.steps, "resumed_from_step": result.start_step,
            "tokens": result.steps * settings["batch"] * settings["seq"],
            "heldout_loss_before": result.valid_loss_before, "heldout_loss": result.valid_loss,
            "train_loss": result.train_loss, "seconds_this_session": result.seconds,
            "tokens_per_second": result.tokens_per_second,
            "parameters": result.total_params, **extra}


def pretrain(work, preset: str, *, progress: bool = True) -> Path:
    """The pretrained model folder of `preset`, made (or resumed) if needed."""
    settings = PRESETS[preset]
    where = folders(work, preset)
    done = where["model"] / "pretrain.json"
    if done.is_file():
        return where["model"]
    t0 = time.perf_counter()
    corpus = quality_data.build_corpus(where["corpus"], vocab=settings["vocab"],
                                       seq=settings["seq"], sample_pct=settings["sample_pct"],
                                       heldout_cap=settings["heldout_cap"])
    data_seconds = time.perf_counter() - t0
    if progress:
        tokens = corpus["tokens"]
        print(f"pretrain: corpus {corpus['pretraining_files']['files']} files, "
              f"{tokens['train_files']:,} tokens ({tokens['train_records']} records), held out "
              f"{corpus['heldout_files']['files']} files; BPE vocabulary {corpus['vocab_size']} "
              f"({data_seconds:.0f} s)", file=sys.stderr, flush=True)

    if not (where["init"] / "config.json").is_file():
        save_init(where["init"], where["corpus"], corpus, settings)
    result = train(where["init"], where["corpus"], where["run"], settings,
                   save_every=settings["save_every"], keep=2, resume=True, progress=progress)
    tmp = where["model"].with_name("model.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(result.final, tmp)
    record = pretrain_record(preset, corpus, result)
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
    ap.add_argument("--quick", action="store_true",
                    help="the small preset (2 blocks, width 64; for tests)")
    ap.add_argument("--work", default=DEFAULT_WORK,
                    help=f"cache folder for the corpus and the model (default {DEFAULT_WORK})")
    args = ap.parse_args(argv)
    print(pretrain(args.work, "quick" if args.quick else "full"))


if __name__ == "__main__":
    main()
