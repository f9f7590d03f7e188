"""`load_model`'s models that run through `pockjax.torch`: a transformers causal LM as
parameters and a pure function (`torch_model`), with peft's LoRA adapters for `--scheme
lora:R` (`peft_lora`)."""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path

from pockjax.finetuning._base import FinetuneError


def peft_lora(module, rank: int, seed: int):
    """`module` with peft's LoRA adapters (rank `rank`, alpha 2 x rank, no dropout) on
    every linear layer (`torch.nn.Linear`, and GPT-2's `Conv1D`) but the output head,
    `A` drawn from torch's generator seeded with `seed`. A mixture of experts' router
    and stacked experts are parameters, not linear layers: they stay frozen."""
    import peft
    import torch
    from transformers.pytorch_utils import Conv1D   # GPT-2's linear layers, [in, out]

    head = module.get_output_embeddings()
    linear = {name: isinstance(m, Conv1D) for name, m in module.named_modules()
              if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head}
    if not linear:
        raise FinetuneError(f"--scheme lora:{rank}: this model has no linear layer besides "
                            f"its output head to put adapters on")
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                             target_modules=sorted(linear), fan_in_fan_out=any(linear.values()))
    try:
        with warnings.catch_warnings():  # peft calls a transformers API deprecated in v5
            warnings.filterwarnings("ignore", category=FutureWarning)
            return peft.get_peft_model(module, config)
    except ValueError as e:
        raise FinetuneError(f"--scheme lora:{rank}: peft cannot put LoRA on this model "
                            f"({str(e).splitlines()[0][:200]})") from None


def peft_checkpoint_name(path: str) -> str | None:
    """The base folder's name of a peft-wrapped model's parameter path; None for an
    adapter."""
    if "/lora_A/" in path or "/lora_B/" in path:
        return None
    return path.removeprefix("base_model/model/").replace("/base_layer/", "/").replace("/", ".")


def torch_model(folder: Path, model_type, families, frozen_dtype: str,
                lora: int | None, seed: int, make_loaded):
    supported = ", ".join(families)
    try:
        import torch
        import transformers
    except ImportError:
        raise FinetuneError(f"'{folder}' is a {model_type!r} model; pockjax's own models load "
                            f"{supported}, and other architectures run through pockjax.torch, "
                            f"which needs torch and transformers: pip install "
                            f"'pockjax[torch]'") from None
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
    if lora is not None:
        module = peft_lora(module, lora, seed)
    params, fn = pj_torch.functional(module, output=lambda out: out.logits)

    def apply(p, tokens):
        return fn(p, tokens, use_cache=False)

    def save(p, out):
        pj_torch.load_state(module, p)
        out = Path(out)
        if lora is not None:  # the adapters merged into a copy of the base's layers
            import copy
            copy.deepcopy(module).merge_and_unload().save_pretrained(out)
        else:
            module.save_pretrained(out)
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, out / name)

    cfg = module.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 0)
    loaded = make_loaded("torch", params, apply, int(cfg.vocab_size), int(layers), save,
                         f"{model_type} (pockjax.torch), {layers} layers"
                         + (f", peft LoRA r{lora} on every linear layer" if lora else ""),
                         checkpoint_name=peft_checkpoint_name if lora is not None
                         else lambda path: path.replace("/", "."))
    if lora is not None:
        loaded.lora = {"rank": lora, "scale": 2.0, "peft": True}
    return loaded
