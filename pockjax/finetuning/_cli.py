"""The command lines `pockjax finetune` and `pockjax generate`: their options, and the
functions that run them from parsed arguments.

`pockjax.cli` builds its subcommands with `add_arguments` / `add_generate_arguments` and
runs them with `main` (`pockjax.finetuning.finetune`) and `generate_main`
(`generate_text`); `pockjax.finetuning` re-exports these names for it.
"""
from __future__ import annotations

import sys

import numpy as np

from pockjax.finetuning._base import FRONTENDS, SCHEDULES, FinetuneError, Interrupted
from pockjax.finetuning._model import SAVE_DTYPES


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
                   "last half of the blocks) | paper:K | full | last:N | paper[:K]+head, last:N+head "
                   "(the output head trains too) | blockwise:K[:N] (the "
                   "blocks, N at a time, each trained K steps in turn) | lora:R (LoRA of rank "
                   "R on every linear layer, merged at the end) | search:BUDGET "
                   "(e.g. search:40%% or search:4GiB) | FILE.json (default: paper)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, help="training steps")
    g.add_argument("--epochs", type=float, help="passes over the data (default 1)")
    p.add_argument("--batch", type=int, default=4, help="examples per step (default 4)")
    p.add_argument("--seq", type=int, default=None, help="tokens per example; longer ones are "
                   "cut (default 512, or the model's max_position_embeddings where fewer)")
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
                        "(pockjax.lowbit); the fine-tuned model holds the base's own "
                        "frozen tensors either way")
    p.add_argument("--moments", default="float32", choices=("float32", "bfloat16", "int8"),
                   help="storage of AdamW's two moments: float32 (8 bytes a trained value), "
                        "bfloat16 (4) or int8 (2, block-wise; pockjax.optim.adamw); the "
                        "trained weights stay float32")
    p.add_argument("--frontend", default="auto", choices=FRONTENDS, help="the model code: "
                   "auto (pockjax's Flax LLaMA for LLaMA families, pockjax.torch for other "
                   "causal LMs), flax, or torch (transformers' own module for any family)")
    p.add_argument("--skip-nonfinite", action="store_true", help="skip a step whose loss or "
                   "gradient is not finite instead of stopping")
    p.add_argument("--prefix-cache", default="auto", choices=("auto", "on", "off"),
                   help="compute the frozen prefix once per example when the data repeats "
                        "(auto: when it saves enough; same results either way)")
    p.add_argument("--save-dtype", default="auto", choices=SAVE_DTYPES,
                   help="the float type of final/'s trained tensors (default auto: the base "
                        "model's); the tensors the scheme freezes are the base's own bytes")
    p.add_argument("--no-cache", dest="compile_cache", action="store_false",
                   help="do not use JAX's persistent compilation cache (default: on, in "
                        "~/.cache/pockjax/jax, so a second run of the same shapes starts "
                        "without compiling)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="do not draw loss.png "
                   "(matplotlib) at the end; metrics.jsonl is written either way")


def main(args) -> int:
    """Run `pockjax finetune` from parsed `args`; the exit status."""
    # Imported here: pockjax.finetuning imports this module (it re-exports its names).
    from pockjax.finetuning import finetune

    try:
        result = finetune(args.model, args.data, args.out, valid=args.valid, scheme=args.scheme,
                          steps=args.steps, epochs=args.epochs, batch=args.batch, seq=args.seq,
                          lr=args.lr, warmup=args.warmup, schedule=args.schedule,
                          weight_decay=args.weight_decay, eval_every=args.eval_every,
                          save_every=args.save_every, keep=args.keep, resume=args.resume,
                          overwrite=args.overwrite, seed=args.seed,
                          frozen_dtype=args.frozen_dtype, moments=args.moments,
                          skip_nonfinite=args.skip_nonfinite,
                          frontend=args.frontend, plot=args.plot,
                          prefix_cache=args.prefix_cache, save_dtype=args.save_dtype,
                          compile_cache=args.compile_cache)
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
    """`pockjax generate`'s options (the same as `generate_text`'s arguments)."""
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
    p.add_argument("--frontend", default="auto", choices=FRONTENDS, help="the model code, as "
                   "finetune's: auto (pockjax's LLaMA for the families it runs exactly, "
                   "pockjax.torch's transformers model otherwise), flax or torch")


def generate_main(args) -> int:
    """Run `pockjax generate` from parsed `args`: the continuation on stdout, the speed on
    stderr; the exit status."""
    try:
        text, new_tokens, seconds = generate_text(
            args.model, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
            top_p=args.top_p, seed=args.seed, chat=args.chat, frontend=args.frontend)
    except (FinetuneError, ValueError) as e:
        print(f"pockjax generate: {e}", file=sys.stderr)
        return 1
    print(text)
    print(f"pockjax generate: {new_tokens} tokens in {seconds:.2f} s "
          f"({new_tokens / max(seconds, 1e-9):.1f} tokens/s, after compiling)", file=sys.stderr)
    return 0


def generate_text(folder, prompt: str, *, max_tokens: int = 64, temperature: float = 0.0,
                  top_p: float = 1.0, seed: int = 0, chat: bool = False,
                  frontend: str = "auto"):
    """`(text, new tokens, seconds)`: the model in `folder` continuing `prompt` (decoded,
    without the prompt). The model code is chosen as `finetune` chooses it
    (`pockjax.finetuning._model.frontend_of`): pockjax's LLaMA decodes with
    `pockjax.models.llama.generate` (a key/value cache), other models with transformers'
    own `generate`; the same position limit holds on both."""
    import time

    from pockjax.finetuning._model import frontend_of, position_limit
    from pockjax.tokenizer import Tokenizer, TokenizerError

    if max_tokens < 1:
        raise FinetuneError(f"--max-tokens must be at least 1, got {max_tokens}")
    loaded_kind, config, note = frontend_of(folder, frontend)
    if note:
        print(f"pockjax generate: {note}", file=sys.stderr)
    try:
        tok = Tokenizer.from_folder(folder)
        if chat and not tok.chat_template:
            raise FinetuneError(f"--chat: the tokenizer in '{folder}' has no chat template "
                                f"(no chat_template in tokenizer_config.json, no "
                                f"chat_template.jinja); drop --chat to continue the prompt "
                                f"as plain text")
        text = (tok.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True) if chat else prompt)
        ids = tok.encode(text, add_special_tokens=not chat)
    except TokenizerError as e:
        raise FinetuneError(str(e)) from None
    if not ids:
        raise FinetuneError("the prompt is empty after tokenizing; give some text")
    limit = position_limit(config)
    if limit is not None and len(ids) + max_tokens > limit:
        raise FinetuneError(f"the prompt ({len(ids)} tokens) and --max-tokens {max_tokens} "
                            f"exceed the {limit} positions the model in '{folder}' takes "
                            f"(max_position_embeddings in its config.json); pass --max-tokens "
                            f"{max(limit - len(ids), 0)} or less")
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
