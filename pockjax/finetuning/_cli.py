"""The command lines `pockjax finetune` and `pockjax generate`: their options, and the
functions that run them from parsed arguments.

`pockjax.cli` builds its subcommands with `add_arguments` (`FinetuneOptions`' flags) /
`add_generate_arguments` and runs them with `main` (`pockjax.finetuning.finetune`) and
`generate_main` (`generate_text`); `pockjax.finetuning` hands these names on.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from pockjax.finetuning._base import FRONTENDS, FinetuneError, Interrupted, ProcessLost
from pockjax.finetuning._options import FinetuneOptions


def add_arguments(p) -> None:
    """`pockjax finetune`'s options: its three folders and `FinetuneOptions`' fields."""
    p.add_argument("--model", required=True, help="a Hugging Face model folder (config.json, "
                   "model.safetensors, tokenizer.json) or a GGUF file (its frozen weights stay "
                   "in the file's blocks; final.gguf is written beside final/)")
    p.add_argument("--data", required=True, help='a JSONL file: {"text"}, {"prompt", '
                   '"completion"} or {"messages": [{"role", "content"}, ...]} per line')
    p.add_argument("--out", required=True, help="the run's folder (checkpoints, metrics.jsonl, "
                   "loss.png, final/)")
    FinetuneOptions.add_arguments(p)


def main(args) -> int:
    """Run `pockjax finetune` from parsed `args`; the exit status."""
    from pockjax.finetuning._job import finetune

    try:
        result = finetune(args.model, args.data, args.out,
                          options=FinetuneOptions.from_args(args))
    except Interrupted as e:
        print(f"pockjax finetune: {e}", file=sys.stderr)
        return e.exit_status
    except ProcessLost as e:  # out at once: JAX's shutdown barrier would wait, then abort
        print(f"pockjax finetune: {e}", file=sys.stderr, flush=True)
        os._exit(1)
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
                   "finetune run's final/) or a GGUF file")
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

    from pockjax.finetuning._model import frontend_of, gguf_file, model_folder, position_limit
    from pockjax.tokenizer import Tokenizer, TokenizerError

    if max_tokens < 1:
        raise FinetuneError(f"--max-tokens must be at least 1, got {max_tokens}")
    folder = model_folder(folder)  # a GGUF file: the folder made of it
    loaded_kind, config, note = frontend_of(folder, frontend)
    if gguf_file(folder) is not None and loaded_kind != "flax":
        raise FinetuneError(f"'{gguf_file(folder).name}' is a {config.get('model_type')!r} "
                            f"model: pockjax reads GGUF files of the families its Flax LLaMA "
                            f"runs (--frontend auto or flax)")
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

        if gguf_file(folder) is not None:  # the file's weights decoded to float32
            from pockjax import nnx as pj_nnx
            from pockjax.gguf._load import load_llama_gguf

            model = pj_nnx.merge(*load_llama_gguf(folder, lambda path: None)[:3])
        else:
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
