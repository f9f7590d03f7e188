"""GGUF files (llama.cpp's format, as Ollama and LM Studio keep models) in and out.

`pockjax finetune` and `generate` take a `.gguf` file where they take a model folder: `model_folder(path)` gives the folder they read (the file's config,
tokenizer and chat template, as transformers' GGUF loader reads them), and the loader
reads the file's tensors as stored: frozen weights keep the file's blocks
(`pockjax.lowbit.Blocks`, decoded where the step uses them, bit for bit as `gguf`'s
dequantize), trained ones are decoded to float32. `write_gguf` writes the fine-tuned
model back: every frozen tensor the source file's bytes, every metadata key carried.
`folder_gguf` writes a LLaMA-family model folder (a safetensors base) as a GGUF file,
its frozen tensors quantized once.

Needs the `gguf` extra (`pip install 'pockjax[gguf]'`: gguf and transformers). Imports no
JAX (the block formats' decoding is `pockjax.lowbit.Blocks`'s).

The pieces: `pockjax.gguf._read` (the file, its folder, its tensors),
`pockjax.gguf._load` (the model's parameters), `pockjax.gguf._write` (the file out) and
`pockjax.gguf._convert` (a model folder out as a GGUF file).
"""
from __future__ import annotations

from pockjax._src.home import claim
from pockjax.gguf._convert import FROZEN_TYPES, folder_gguf
from pockjax.gguf._read import GgufError, is_gguf, model_folder, read_tensors, source_of
from pockjax.gguf._write import SAVE_TYPES, tensor_digest, write_gguf

__all__ = ["GgufError", "is_gguf", "model_folder", "source_of", "read_tensors", "write_gguf",
           "tensor_digest", "SAVE_TYPES", "folder_gguf", "FROZEN_TYPES"]

claim(globals())
