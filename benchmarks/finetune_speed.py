"""`pockjax finetune`'s loop, from Python and from the command, against the bare
`sparse_train` step it runs, side by side.

The rows train the same model folder (a LLaMA with random weights, saved by
transformers) on the same batches of real text (the Python standard library's
sources, tokenized by a byte-level BPE trained on them here), with the same scheme,
optimizer and batch shape. The bare row prebuilds its batches and calls the trainer in
a plain loop, reading nothing back until the last step (the step's own pace); the
finetune rows are `pj.finetune` and the `pockjax finetune` command (started as a user
starts it) with their evaluation off and one checkpoint at the end, and their step times
come from their metrics logs. Each row runs in its own process; steps after the warm-up
are timed.

    python -m benchmarks finetune_speed [--steps 40] [--warmup 5] [--layers 4] [--hidden 256]
        [--vocab 4096] [--seq 128] [--batch 4] [--scheme last:2]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import ROOT, commit, report_result, run_row, versions  # noqa: E402
from benchmarks.quality import cpu_model  # noqa: E402

ROWS = ("bare sparse_train step", "pockjax finetune", "pockjax finetune command")


def _step_records(out: Path) -> list[dict]:
    """A finetune run's step records (its `metrics.jsonl` lines with a loss)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r]


def make_folder(folder: Path, layers: int, hidden: int, vocab: int, seq: int, docs: int) -> Path:
    """A LLaMA model folder with a BPE tokenizer trained on the standard library's
    sources, and `data.jsonl` of `{"text"}` records cut from the same sources."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    texts = [f.read_text(errors="replace") for f in files[:200]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>")
    config = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=hidden, intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        max_position_embeddings=max(seq, 128))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    # Records of about `seq` tokens (4 characters a token is near this BPE's rate).
    chunk = 4 * seq
    records = [{"text": t[i:i + chunk]} for t in texts for i in range(0, len(t), chunk)
               if len(t[i:i + chunk]) > chunk // 2][:docs]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def row(name: str, folder: Path, args) -> None:
    import jax
    import optax

    import pockjax as pj

    if name.startswith("pockjax finetune"):
        out = Path(tempfile.mkdtemp(prefix="finetune-speed-")) / "run"
        options = {"scheme": args.scheme, "steps": args.warmup + args.steps, "batch": args.batch,
                   "seq": args.seq, "lr": 1e-4, "schedule": "constant"}
        if name == "pockjax finetune":
            loss = pj.finetune(folder, folder / "data.jsonl", out, **options,
                               progress=False).train_loss
            peak = None
        else:  # the `pockjax` command, as a user starts it, in its own process
            command = [sys.executable, "-c", "import sys; from pockjax.cli import main; "
                       "sys.exit(main())", "finetune", "--model", str(folder),
                       "--data", str(folder / "data.jsonl"), "--out", str(out), "--no-plot",
                       *[f"--{k}={v}" for k, v in options.items()]]
            subprocess.run(command, check=True, capture_output=True, text=True)
            loss = statistics.fmean(r["loss"] for r in _step_records(out)[-10:])
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        records, w = _step_records(out), args.warmup
        seconds = [r["seconds"] for r in records]
        times = [b - a for a, b in zip(seconds[w - 1:], seconds[w:])]
        report_result({"row": name, "step_s": statistics.median(times),
                       "total_s": seconds[-1] - seconds[w - 1],
                       "tokens": sum(r["tokens"] for r in records[w:]), "final_loss": loss,
                       "first_s": seconds[0], "compile_s": records[0].get("compile_seconds"),
                       **({"command_rss_peak_mib": peak} if peak else {})})
        return
    from pockjax.data import batch_examples, pad_batch, read_jsonl
    from pockjax.finetuning import load_model, lm_loss, scheme_from_spec
    from pockjax.tokenizer import Tokenizer

    loaded = load_model(folder)
    tok = Tokenizer.from_folder(folder)
    data = read_jsonl(folder / "data.jsonl", tok, args.seq, vocab_size=loaded.vocab_size)
    pad = tok.pad_id if tok.pad_id is not None else tok.eos_id
    steps = args.warmup + args.steps
    examples = [batch_examples(data, s, args.batch, seed=0) for s in range(steps)]
    batches = [pad_batch(e, args.batch, args.seq, pad) for e in examples]
    scheme = scheme_from_spec(args.scheme, loaded.params, loaded.num_layers)

    def loss(p, b):
        return lm_loss(loaded.apply(p, b["tokens"]), b["tokens"], b["mask"])

    trainer = pj.sparse_train(loss, optimizer=optax.adamw(1e-4), scheme=scheme)
    state = trainer.init(loaded.params, copy=False)
    losses = []
    t_start = None
    for i, b in enumerate(batches):  # nothing read back until the end: the step's own pace
        if i == args.warmup:
            jax.block_until_ready(state)
            t_start = time.perf_counter()
        state, m = trainer(state, b)
        losses.append(m["loss"])
    jax.block_until_ready(state)
    total = time.perf_counter() - t_start
    losses = [float(x) for x in losses]
    report_result({"row": name, "step_s": total / args.steps, "total_s": total,
                   "tokens": sum(sum(len(x.ids) for x in e) for e in examples[args.warmup:]),
                   "final_loss": float(sum(losses[-10:]) / len(losses[-10:]))})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--scheme", default="last:2")
    ap.add_argument("--rounds", type=int, default=2, help="each row runs this many times, "
                    "alternating")
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "finetune_speed.md"))
    args = ap.parse_args()
    if args.row:
        return row(args.row, Path(args.folder), args)
    folder = make_folder(Path(tempfile.mkdtemp(prefix="finetune-speed-")) / "model",
                         args.layers, args.hidden, args.vocab, args.seq,
                         docs=args.batch * (args.steps + args.warmup))
    common = [f"--{k}={getattr(args, k)}" for k in ("steps", "warmup", "seq", "batch", "scheme")]
    results = {name: [] for name in ROWS}
    # A compilation cache of this run's own: the first finetune row compiles the step, the
    # later ones (a second run of the same shapes) find it there.
    env = {**os.environ, "POCKJAX_CACHE_DIR": tempfile.mkdtemp(prefix="finetune-speed-cache-")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    for r in range(args.rounds):
        for name in ROWS:
            res = run_row(["-m", "benchmarks.finetune_speed", "--row", name, "--folder",
                           str(folder), *common], timeout=1800, env=env)
            print(name, res, flush=True)
            results[name].append(res)
    lines = [f"# `pockjax finetune` vs the bare step ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
             "", f"Commit {commit()}; {cpu_model()}, "
                 f"{os.cpu_count()} cores; {versions(('jax', 'jaxlib', 'transformers'))}.",
             f"LLaMA {args.layers} layers, width {args.hidden}, vocabulary {args.vocab} "
             f"(random weights), scheme {args.scheme}, batch {args.batch} x {args.seq} tokens "
             f"of standard-library source; {args.warmup} warm-up + {args.steps} timed steps; "
             f"each row in its own process, rows alternating, {args.rounds} rounds.", "",
             "*first step*: the run's first step, tracing, compiling (or reading the "
             "compilation cache) and running it, and in brackets the tracing and compiling "
             "alone; the first finetune row compiles, later rows find the step in the cache.",
             "", "| row | round | s/step | tokens/s | first step s (compiling) | first step / "
             "s/step | peak RSS MiB | train loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ROWS:
        for i, res in enumerate(results[name]):
            if "error" in res:
                lines.append(f"| {name} | {i + 1} | {res['error']} | | | | | |")
                continue
            peak = res.get("command_rss_peak_mib", res["rss_peak_mib"])
            first = (f"{res['first_s']:.2f} ({res['compile_s']:.2f}) | "
                     f"{res['first_s'] / res['step_s']:.1f}x" if "first_s" in res else "- | -")
            lines.append(f"| {name} | {i + 1} | {res['step_s']:.4f} | "
                         f"{res['tokens'] / res['total_s']:,.0f} | {first} | {peak:.0f} | "
                         f"{res['final_loss']:.4f} |")
    ok = [all("error" not in r for r in results[n]) for n in ROWS]
    if all(ok):
        tps = {n: statistics.median(r["tokens"] / r["total_s"] for r in results[n]) for n in ROWS}
        bare = tps["bare sparse_train step"]
        lines += ["", f"tokens/s over the bare step's (medians over rounds): `pj.finetune` "
                      f"{tps['pockjax finetune'] / bare:.3f}, the `pockjax finetune` command "
                      f"{tps['pockjax finetune command'] / bare:.3f}"]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
