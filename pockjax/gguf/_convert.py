"""A Hugging Face model folder written as a GGUF file: for a model that did not come as
one (a safetensors base), so that its fine-tuned version runs in llama.cpp, Ollama and
LM Studio.

`folder_gguf(folder, out)` writes the LLaMA family (`model_type` llama or mistral, which
llama.cpp calls `llama`; qwen2, qwen3) with a byte-level BPE tokenizer (GPT-2's,
SmolLM's, Llama 3's, Qwen's) or a SentencePiece-style one (BPE with byte fallback:
Llama 2's, Mistral 7B v0.1's, TinyLlama's): the hyperparameters from `config.json` (Llama 3.1's RoPE
scaling as the `rope_freqs.weight` llama.cpp reads), the tokenizer's tokens, types and
merges (or scores), its special tokens and chat template (gguf's `SpecialVocab`), and every tensor
under gguf's own name for it, a llama's q and k rows in llama.cpp's order. The frozen tensors
are quantized once to one type, the trained ones written in another. Anything else is
refused by name.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pockjax.gguf._read import GgufError, unpermute_rows

ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
"""`config.json`'s `model_type` -> the GGUF architecture it is written as."""

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
"""Qwen2's and Qwen3's pre-tokenizer (llama.cpp's `qwen2`): Llama 3's with single
digits."""

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
"""Llama 3's pre-tokenizer: the regular expression of its `Split` (llama.cpp's
`llama-bpe`)."""

FROZEN_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16", "F32")
"""The types the frozen tensors of a model folder can be quantized to once."""


def _pre_tokenizer(tokenizer: dict, path: Path) -> str:
    """llama.cpp's name (`tokenizer.ggml.pre`) for the tokenizer's pre-tokenizer: the
    splitting rules llama.cpp must apply to tokenize as the tokenizer does."""
    pre = tokenizer.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [(p.get("type"), p.get("individual_digits"), p.get("use_regex"),
              p.get("add_prefix_space")) for p in parts]
    if kinds == [("ByteLevel", None, True, False)]:
        return "gpt-2"
    if kinds == [("Digits", True, None, None), ("ByteLevel", None, True, False)]:
        return "smollm"
    if kinds == [("Split", None, None, None), ("ByteLevel", None, False, False)]:
        split = parts[0].get("pattern", {}).get("Regex")
        if split in (LLAMA3_SPLIT, QWEN2_SPLIT):
            return "llama-bpe" if split == LLAMA3_SPLIT else "qwen2"
    raise GgufError(f"'{path}': its pre-tokenizer ({json.dumps(pre)[:200]}) is not one pockjax "
                    f"can name for llama.cpp (GPT-2's ByteLevel, SmolLM's Digits + ByteLevel, "
                    f"Llama 3's or Qwen2's Split + ByteLevel); write the GGUF file with "
                    f"llama.cpp's convert_hf_to_gguf.py")


def _space_prefix(tokenizer: dict, path: Path) -> bool:
    """Whether a SentencePiece-style tokenizer puts "▁" before a text (llama.cpp's
    `add_space_prefix`): Llama 2's normalizer (Prepend "▁", then spaces as "▁"), or
    spaces as "▁" alone. A Metaspace pre-tokenizer is refused: it leaves out the "▁"
    before a text that starts with a space, which llama.cpp cannot (measured: 547 of
    600 lines of Python source tokenized differently)."""
    norm, pre = tokenizer.get("normalizer") or {}, tokenizer.get("pre_tokenizer") or {}
    steps = (norm.get("normalizers", []) if norm.get("type") == "Sequence"
             else [norm] if norm else [])
    kinds = [(s.get("type"), s.get("prepend"), s.get("content"),
              (s.get("pattern") or {}).get("String")) for s in steps]
    if not pre and kinds in ([("Prepend", "▁", None, None), ("Replace", None, "▁", " ")],
                             [("Replace", None, "▁", " ")]):
        return len(kinds) == 2
    raise GgufError(f"'{path}': a SentencePiece-style tokenizer with normalizer "
                    f"{json.dumps(norm)[:160]} and pre-tokenizer {json.dumps(pre)[:160]}, "
                    f"which llama.cpp does not reproduce (pockjax writes Llama 2's Prepend + "
                    f"Replace normalizer); write the GGUF file with llama.cpp's "
                    f"convert_hf_to_gguf.py")


def _merge_scores(model: dict, tokens: dict) -> dict:
    """Each token's score for llama.cpp's SentencePiece tokenizer, which merges the
    adjacent pair whose joined token scores highest: minus the rank of the first merge
    that makes it, so that it merges in the tokenizer's merge order (gguf's
    `LlamaHfVocab` gives every token -1000, which merges left to right instead)."""
    ids = {text: i for i, text in tokens.items()}
    scores: dict = {}
    for rank, merge in enumerate(model.get("merges", [])):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        i = ids.get(left + right)
        if i is not None and i not in scores:
            scores[i] = -float(rank)
    return scores


def _tokenizer(writer, folder: Path, vocab_size: int) -> None:
    """The tokenizer's keys: model and pre-tokenizer, tokens (padded to `vocab_size`),
    their types (added special tokens CONTROL, other added ones USER_DEFINED), merges
    (byte-level BPE) or scores (SentencePiece-style BPE with byte fallback, Llama 2's),
    special token ids, the BOS flag and the chat template."""
    import gguf

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise GgufError(f"'{folder}' has no tokenizer.json: a GGUF file carries its tokenizer")
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    model = tokenizer.get("model", {})
    decoder = (tokenizer.get("decoder") or {}).get("type")
    spm = model.get("type") == "BPE" and model.get("byte_fallback") and decoder == "Sequence"
    if not spm and (model.get("type") != "BPE" or model.get("byte_fallback")
                    or decoder != "ByteLevel"):
        raise GgufError(f"'{path}': a {model.get('type')} tokenizer with decoder {decoder}; "
                        f"pockjax writes byte-level BPE tokenizers (GPT-2's, SmolLM's, "
                        f"Llama 3's) and SentencePiece-style BPE with byte fallback (Llama "
                        f"2's) only. Write the GGUF file with llama.cpp's "
                        f"convert_hf_to_gguf.py")
    prefix = _space_prefix(tokenizer, path) if spm else False
    pre = "default" if spm else _pre_tokenizer(tokenizer, path)
    tokens = {i: t for t, i in model["vocab"].items()}
    types = {i: gguf.TokenType.NORMAL for i in tokens}
    if spm:
        for i, text in tokens.items():
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                types[i] = gguf.TokenType.BYTE
    for added in tokenizer.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = (gguf.TokenType.CONTROL if added.get("special")
                              else gguf.TokenType.USER_DEFINED)
    if spm and model.get("unk_token") in model["vocab"]:
        types[model["vocab"][model["unk_token"]]] = gguf.TokenType.UNKNOWN
    n = max(vocab_size, max(tokens) + 1)
    if n != vocab_size:
        raise GgufError(f"'{path}' holds token id {max(tokens)}; config.json's vocab_size is "
                        f"{vocab_size}")
    listed = [tokens.get(i, f"[PAD{i}]") for i in range(n)]
    special = gguf.SpecialVocab(folder, load_merges=not spm, n_vocab=n)
    if "bos" not in special.add_special_token:  # as the tokenizer's post-processor does
        template = (tokenizer.get("post_processor") or {}).get("single") or [{}]
        writer.add_add_bos_token("SpecialToken" in template[0])
    writer.add_tokenizer_model("llama" if spm else "gpt2")
    writer.add_add_space_prefix(prefix)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(listed)
    if spm:
        scores = _merge_scores(model, tokens)
        writer.add_token_scores([scores.get(i, 0.0) for i in range(n)])
    writer.add_token_types([int(types.get(i, gguf.TokenType.UNUSED)) for i in range(n)])
    special.add_to_gguf(writer, quiet=True)


def _rope(config: dict) -> tuple[str, dict]:
    """The RoPE settings' field and value: transformers 5 keeps them in
    `rope_parameters`, older configs in `rope_theta` and `rope_scaling` (read first where
    set, as transformers does)."""
    field = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    return field, config.get(field) or {}


def _llama3_factors(config: dict) -> np.ndarray | None:
    """Llama 3.1's RoPE scaling as llama.cpp holds it (`rope_freqs.weight`): each
    frequency's divisor, transformers' scaled inverse frequencies against the plain ones;
    None for a model without it."""
    _, rope = _rope(config)
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    heads = int(config["num_attention_heads"])
    dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    theta = float(rope.get("rope_theta", config.get("rope_theta", 1e4)))
    factor, old = float(rope["factor"]), float(rope["original_max_position_embeddings"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    scaled = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return (inv / scaled).astype(np.float32)


def _hyperparameters(writer, config: dict, path: Path) -> None:
    """The architecture's keys from `config.json`; settings GGUF's llama cannot hold are
    refused."""
    field, rope = _rope(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    for key, value, plain in ((field, kind if kind != "llama3" else "default", "default"),
                              ("attention_bias", config.get("attention_bias", False), False),
                              ("mlp_bias", config.get("mlp_bias", False), False),
                              ("use_sliding_window", config.get("use_sliding_window", False),
                               False)):
        if value != plain:
            raise GgufError(f"'{path}': {key} {json.dumps(config[key])}; pockjax writes "
                            f"LLaMA models without it. Write the GGUF file with llama.cpp's "
                            f"convert_hf_to_gguf.py")
    heads = int(config["num_attention_heads"])
    width = int(config["hidden_size"])
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(width)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 1e4))))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    head_dim = int(config.get("head_dim") or width // heads)
    writer.add_rope_dimension_count(head_dim)
    if head_dim * heads != width:  # Qwen3's heads are not the width split
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(int(config["vocab_size"]))


def _tensors(folder: Path) -> dict:
    """The folder's tensors by name (every `*.safetensors` file), mapped, not read."""
    from pockjax.checkpoint import numpy_dtype, safetensors_header

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        header, start = safetensors_header(path)
        data = np.memmap(path, np.uint8, mode="r", offset=start)
        for name, t in header.items():
            a, b = t["data_offsets"]
            out[name] = data[a:b].view(numpy_dtype(t["dtype"])).reshape(t["shape"])
    if not out:
        raise GgufError(f"'{folder}' holds no .safetensors file")
    return out


def check_folder(folder) -> dict:
    """`folder`'s config where `folder_gguf` can write it (its family, settings and
    tokenizer checked, no tensor read: a run checks before it trains).

    Raises:
      GgufError: what the writer does not hold, named.
    """
    import gguf

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    family = config.get("model_type")
    if family not in ARCHITECTURES:
        raise GgufError(f"'{folder}': model_type {family!r}; pockjax writes GGUF files of "
                        f"{', '.join(ARCHITECTURES)} models. Write the GGUF file with "
                        f"llama.cpp's convert_hf_to_gguf.py")
    probe = gguf.GGUFWriter(None, ARCHITECTURES[family])  # keys only: nothing is written
    _hyperparameters(probe, config, folder / "config.json")
    _tokenizer(probe, folder, int(config["vocab_size"]))
    return config


def folder_gguf(folder, out, *, frozen_type: str = "Q8_0", trained=(),
                trained_type: str = "F16", metadata: dict | None = None) -> dict:
    """Write Hugging Face model folder `folder` as GGUF file `out`.

    Args:
      folder: a LLaMA-family folder (config.json, model.safetensors, tokenizer.json).
      out: the file to write (replaced atomically).
      frozen_type: the type of every tensor not in `trained` (quantized once): one of
        `FROZEN_TYPES`. Vectors (norms) stay F32; a tensor whose rows no block of the type
        divides is written in F16.
      trained: the Hugging Face names of the tensors written in `trained_type`.
      trained_type: their type (F16 by default, or any of `FROZEN_TYPES`).
      metadata: more keys (strings or numbers), e.g. the training in `general.*` keys.

    Returns:
      `{gguf name: ("frozen" | "trained", "TYPE, largest rounding E")}`.

    Raises:
      GgufError: a family, tokenizer or setting the writer does not hold (named), or an
        unknown type.
    """
    import gguf

    from pockjax.gguf._write import add_metadata, encoded, finish

    folder, out = Path(folder), Path(out)
    for kind in (frozen_type, trained_type):
        if kind not in FROZEN_TYPES:
            raise GgufError(f"GGUF type {kind!r}: choose one of {', '.join(FROZEN_TYPES)}")
    config = check_folder(folder)
    arch = ARCHITECTURES[config["model_type"]]
    blocks = int(config["num_hidden_layers"])
    table = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], blocks)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_name(folder.resolve().name)
    _hyperparameters(writer, config, folder / "config.json")
    _tokenizer(writer, folder, int(config["vocab_size"]))
    add_metadata(writer, metadata or {})
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    tensors = _tensors(folder)
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    trained = set(trained)
    report = {}
    for name, value in tensors.items():
        mapped = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise GgufError(f"'{folder}': gguf has no name for tensor '{name}' of a {arch} model")
        values = np.asarray(value, np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp's llama interleaves each head's rotary halves (Qwen's rotate halves
            # as transformers does)
            n = heads if "q_proj" in name else kv_heads
            values = values[np.argsort(unpermute_rows(values.shape[0], n))]
        how = "trained" if name in trained else "frozen"
        data, qtype, error = encoded(np.ascontiguousarray(values),
                                     trained_type if how == "trained" else frozen_type)
        writer.add_tensor(mapped, data, raw_shape=data.shape, raw_dtype=qtype)
        report[mapped] = (how, f"{qtype.name}, largest rounding {error:.3g}")
    factors = _llama3_factors(config)
    if factors is not None:  # llama.cpp divides each RoPE frequency by these
        writer.add_tensor("rope_freqs.weight", factors)
        report["rope_freqs.weight"] = ("frozen", "F32, Llama 3's RoPE scaling")
    finish(writer, tmp, out)
    return report
