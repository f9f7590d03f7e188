"""Hugging Face checkpoints of the LLaMA-shaped families (`SUPPORTED_FAMILIES`: llama,
mistral, qwen2): `load_llama` reads a `save_pretrained` directory (`config.json` and
`model.safetensors`, or a sharded `model.safetensors.index.json`) into a `Llama`;
`save_llama` writes one back in the same layout and family. Other architectures load
through `pockjax.torch`.

HF stores linear weights as `[out, in]`; `Llama`'s kernels are `[in, out]`, so they are
transposed on the way. Rotary embeddings already use HF's layout, so q/k weights are
not permuted. Nothing but safetensors is needed (no torch).

>>> from pockjax.models.hf import load_llama
>>> model = load_llama("path/to/Llama-2-7b-hf", dtype="bfloat16")   # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open

from pockjax import nnx as pj_nnx
from pockjax.checkpoint import CheckpointError, write_atomic, write_safetensors
from pockjax.models.llama import SUPPORTED_FAMILIES, Llama, LlamaConfig

__all__ = ["load_llama", "load_llama_params", "llama_shapes", "save_llama", "save_llama_params",
           "checkpoint_tensors", "TOKENIZER_FILES",
           "SUPPORTED_FAMILIES"]

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


@dataclasses.dataclass(frozen=True)
class _Tensor:
    path: tuple  # the parameter's path in `Llama`
    hf_shape: tuple[int, ...]
    transposed: bool


def _hf_names(config: LlamaConfig) -> dict[str, _Tensor]:
    """HF tensor name -> where it goes in `Llama(config)` and its shape in the checkpoint."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    names = {"model.embed_tokens.weight": _Tensor(("embed", "embedding"), (v, d), False),
             "model.norm.weight": _Tensor(("norm", "scale"), (d,), False)}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", ("layers", i)
        linears = {"self_attn.q_proj": (("attn", "q_proj"), (q, d)),
                   "self_attn.k_proj": (("attn", "k_proj"), (kv, d)),
                   "self_attn.v_proj": (("attn", "v_proj"), (kv, d)),
                   "self_attn.o_proj": (("attn", "o_proj"), (d, q)),
                   "mlp.gate_proj": (("mlp", "gate_proj"), (f, d)),
                   "mlp.up_proj": (("mlp", "up_proj"), (f, d)),
                   "mlp.down_proj": (("mlp", "down_proj"), (d, f))}
        for name, (path, shape) in linears.items():
            names[f"{hf}.{name}.weight"] = _Tensor(ours + path + ("kernel",), shape, True)
            if path[-1] in config.biased:
                names[f"{hf}.{name}.bias"] = _Tensor(ours + path + ("bias",), shape[:1], False)
        names[f"{hf}.input_layernorm.weight"] = _Tensor(ours + ("attn_norm", "scale"), (d,), False)
        names[f"{hf}.post_attention_layernorm.weight"] = _Tensor(
            ours + ("mlp_norm", "scale"), (d,), False)
    if not config.tie_embeddings:
        names["lm_head.weight"] = _Tensor(("lm_head", "kernel"), (v, d), True)
    return names


def checkpoint_names(config: LlamaConfig, *, transposed: bool = False):
    """Parameter path ("/"-joined, as `pockjax.scheme.leaves_with_paths` names it) -> the
    tensor's name in a Hugging Face checkpoint of `config`; with `transposed`, also the
    set of paths whose tensor the file holds transposed (the kernels: `[out, in]`)."""
    names = {"/".join(map(str, t.path)): name for name, t in _hf_names(config).items()}
    if not transposed:
        return names
    return names, frozenset("/".join(map(str, t.path)) for t in _hf_names(config).values()
                            if t.transposed)


def checkpoint_tensors(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a Hugging Face checkpoint of `config` holds: name -> shape (as the
    file stores it: linear weights `[out, in]`), in `save_llama`'s order.

    Args:
      config: a `LlamaConfig`.

    Returns:
      A dict of tensor names to shapes.
    """
    return {name: t.hf_shape for name, t in _hf_names(config).items()}


def _node(tree: dict, keys) -> dict:
    for key in keys:
        tree = tree[key]
    return tree


def _ignored(name: str, config: LlamaConfig) -> bool:
    # Buffers older checkpoints saved; a tied model's copy of the embedding, which HF
    # also ignores when tying.
    return name.endswith(".rotary_emb.inv_freq") or (
        config.tie_embeddings and name == "lm_head.weight")


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: one file, or the shards its index names."""
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"'{index}' is not a safetensors index (a JSON object with "
                                  f"a 'weight_map'): {e}") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise CheckpointError(f"'{index}' names shards that are not in '{directory}': "
                                  f"{', '.join(missing)}")
        return [directory / s for s in shards]
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    bins = sorted(p.name for p in directory.glob("*.bin"))
    hint = (f"; it has {', '.join(bins)}, but PyTorch .bin files are not read: re-save with "
            f"save_pretrained(..., safe_serialization=True)" if bins else "")
    raise CheckpointError(f"'{directory}' has neither {WEIGHTS} nor {INDEX}{hint}")


def weight_files(directory: str | os.PathLike) -> list[Path]:
    """The safetensors files of a Hugging Face model folder: `model.safetensors`, or the
    shards its index names.

    Raises:
      CheckpointError: the folder has neither, or its index names missing shards.
    """
    return _weight_files(Path(directory))


def _headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """name -> (file, shape, dtype) for every tensor of the files, without reading data."""
    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for file in files:
        try:
            with safe_open(os.fspath(file), framework="numpy") as f:
                for name in f.keys():
                    if name in found:
                        raise CheckpointError(f"tensor '{name}' is in both '{found[name][0]}' "
                                              f"and '{file}'")
                    s = f.get_slice(name)
                    found[name] = (file, tuple(s.get_shape()), s.get_dtype())
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error type for bad headers
            raise CheckpointError(f"'{file}' is not a readable safetensors file "
                                  f"(truncated or corrupt?): {e}") from None
    return found


def _problems(expected: dict[str, _Tensor], found: dict, config: LlamaConfig) -> list[str]:
    problems = []
    for name, t in expected.items():
        if name not in found:
            problems.append(f"missing tensor '{name}' (expected shape {list(t.hf_shape)})")
    for name, (file, shape, dtype) in found.items():
        if name not in expected and not _ignored(name, config):
            problems.append(f"unexpected tensor '{name}' {list(shape)} in {file.name}")
    for name, t in expected.items():
        if name in found:
            file, shape, dtype = found[name]
            if shape != t.hf_shape:
                problems.append(f"'{name}': expected shape {list(t.hf_shape)}, found "
                                f"{list(shape)} in {file.name}")
            elif dtype not in _FLOAT_DTYPES:
                problems.append(f"'{name}': dtype {dtype} in {file.name} is not a float type "
                                f"(quantized checkpoints are not read)")
    return problems


def read_config(path: str | os.PathLike) -> dict:
    """The `config.json` of a Hugging Face model folder, as a dict.

    Args:
      path: the model folder.

    Returns:
      The parsed config.

    Raises:
      CheckpointError: `path` is not a directory, has no `config.json`, or it is not JSON.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"'{directory}' is not a directory; a Hugging Face model "
                              f"folder holds config.json and model.safetensors")
    config_file = directory / CONFIG
    if not config_file.is_file():
        raise CheckpointError(f"'{config_file}' does not exist; a Hugging Face model "
                              f"folder has the model's config.json beside its weights")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as e:
        raise CheckpointError(f"'{config_file}' is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"'{config_file}' holds a JSON {type(config).__name__}, "
                              f"not the object of a model config")
    return config


def _checked(path, dtype, compute_dtype, overrides):
    """`(config, expected, found)` for a checkpoint directory: its `LlamaConfig`, the
    tensors that config needs and the tensors the files hold, every name and shape
    checked (nothing read)."""
    directory = Path(path)
    config_file = directory / CONFIG
    hf_config = read_config(directory)
    try:
        config = LlamaConfig.from_hf(hf_config,
                                     **({} if dtype is None else {"param_dtype": dtype}),
                                     **({} if compute_dtype is None else {"dtype": compute_dtype}),
                                     **overrides)
    except ValueError as e:
        raise CheckpointError(f"'{config_file}': {e}") from None

    expected = _hf_names(config)
    found = _headers(_weight_files(directory))
    problems = _problems(expected, found, config)
    if problems:
        shown = "\n  ".join(problems)
        raise CheckpointError(f"checkpoint '{directory}' does not fit its config "
                              f"({len(problems)} problems):\n  {shown}")
    return config, expected, found


def _fill(values: dict, expected: dict, found: dict, convert) -> None:
    """Read every tensor of `expected` from its file into the pure dict `values`, one
    at a time, as `convert(path, array)` makes it (`array` in the model's layout, in
    the file's dtype). Each file is opened (memory-mapped) for one tensor at a time, so
    the pages read stay in this process's resident memory only while their tensor is
    copied out, not until the whole shard is read."""
    for name, t in expected.items():
        with safe_open(os.fspath(found[name][0]), framework="flax") as f:
            array = f.get_tensor(name)
        array = array.T if t.transposed else array
        _node(values, t.path[:-1])[t.path[-1]] = convert("/".join(str(k) for k in t.path),
                                                         array)
        del array


def load_llama(path: str | os.PathLike, *, dtype=None, compute_dtype=None,
               **overrides) -> Llama:
    """A `Llama` from a Hugging Face checkpoint directory of one of `SUPPORTED_FAMILIES`.

    Every name and shape is checked before any weight is read. The model is built
    abstractly and filled tensor by tensor, so its weights exist once.

    Args:
      path: the directory (`config.json` and `model.safetensors` or shards with their
        index), e.g. what `save_pretrained` wrote.
      dtype: what the weights are cast to; None: the config's `param_dtype` (float32).
        bf16 and f16 checkpoints load either way.
      compute_dtype: `LlamaConfig.dtype` (float32 with bfloat16 weights: mixed
        precision, see `cast_frozen`).
      **overrides: other `LlamaConfig` fields (`narrow_matmul`, `remat`).

    Returns:
      The `Llama`, its `config.model_type` the checkpoint's family.

    Raises:
      CheckpointError: a missing or unreadable file; a config this model does not
        implement (a model_type outside `SUPPORTED_FAMILIES`, whose architectures load
        through `pockjax.torch`, or a setting named in `LlamaConfig.from_hf`); a
        checkpoint that does not fit its config, listing all missing, unexpected and
        misshapen tensors.
    """
    config, expected, found = _checked(path, dtype, compute_dtype, overrides)
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    values = nnx.to_pure_dict(state)
    _fill(values, expected, found, lambda _, a: a.astype(config.param_dtype))
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def llama_shapes(path: str | os.PathLike, *, dtype=None, compute_dtype=None,
                 **overrides) -> tuple[dict, LlamaConfig]:
    """`(params, config)`: the parameters `load_llama` would give (as `pj.nnx.split`
    returns them) as `jax.ShapeDtypeStruct`s, and the model's config, from the
    directory's config and headers alone (no weight is read). Arguments and errors as
    `load_llama`'s."""
    config, _, _ = _checked(path, dtype, compute_dtype, overrides)
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    _, params, _ = pj_nnx.split(abstract)
    return params, config


def load_llama_params(path: str | os.PathLike, convert, *, dtype=None, compute_dtype=None,
                      **overrides) -> tuple[Any, dict, dict, LlamaConfig]:
    """A Hugging Face checkpoint's `Llama` as `pj.nnx.split` gives it, each weight stored
    as `convert` makes it while the files are read: a frozen weight can be quantized
    (`pockjax.lowbit.quantize_leaf`) or cast as it arrives, so the model is never held
    whole in a wider type.

    Args:
      path: the checkpoint directory, as for `load_llama`.
      convert: `convert(path, array) -> leaf`, called once per tensor in file order;
        `path` is the leaf's "/"-joined path in the parameters (as
        `pockjax.scheme.leaves_with_paths` names it), `array` the tensor in the
        model's layout (`[in, out]` kernels) and the file's dtype. The leaf it returns
        may be any pytree node the model's step accepts (a `Quantized` node, an array
        of any float dtype).
      dtype: as for `load_llama`: the config's `param_dtype` (what `convert` is
        expected to give frozen weights).
      compute_dtype: as for `load_llama`.
      **overrides: as for `load_llama`.

    Returns:
      `(graphdef, params, rest, config)`: `pj.nnx.merge(graphdef, params, rest)` builds
      the module once `params` hold arrays it can run (dequantized ones).

    Raises:
      CheckpointError: as `load_llama`.
    """
    config, expected, found = _checked(path, dtype, compute_dtype, overrides)
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, params, rest = pj_nnx.split(abstract)
    _fill(params, expected, found, convert)
    return graphdef, params, rest, config


# What a Hugging Face model folder keeps beside its weights for its tokenizer (and the
# generation defaults that go with it); `save_llama(tokenizer=folder)` copies them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")
"""The tokenizer files (and generation defaults) of a Hugging Face model folder that
`save_llama(tokenizer=folder)` copies."""


def save_llama(model: Llama, path: str | os.PathLike, *, tokenizer=None,
               max_shard_bytes: int = 2 << 30) -> None:
    """Write `model` as a Hugging Face checkpoint directory: `config.json` and
    `model.safetensors`, each written to a temporary file and renamed into place (a
    sharded checkpoint's index in the directory is removed, so the new file is read).
    A model larger than `max_shard_bytes` is written as shards
    (`model-00001-of-0000N.safetensors`) and their index, as transformers writes them;
    only one shard's tensors are held in host memory at a time.
    The config names the model's family (`config.model_type`) and its class, so
    `transformers.AutoModelForCausalLM.from_pretrained(path)` and `load_llama` read it.

    Args:
      model: the `Llama` to save.
      path: the output directory (created if needed).
      tokenizer: where the tokenizer comes from, so the folder is complete for
        `transformers.AutoTokenizer`: a model folder (usually the one the model was
        loaded from) whose tokenizer files (`TOKENIZER_FILES`) are copied, or a
        `tokenizers.Tokenizer`, saved as `tokenizer.json`. None writes no tokenizer.
      max_shard_bytes: the most tensor bytes per file (default 2 GiB; a tensor larger
        than that gets a file of its own); a larger model is written as shards with an
        index.

    Raises:
      TypeError: `model` is not a `Llama`.
      CheckpointError: the model has parameters a LLaMA checkpoint has no place for, or
        `tokenizer` is not a directory or is a folder without tokenizer files.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"save_llama saves a pockjax Llama, got {type(model).__name__}")
    config = model.config
    ours = {"/".join(map(str, t.path)) for t in _hf_names(config).values()}
    extra = [p for p in pj_nnx.param_paths(model) if p not in ours]
    if extra:
        raise CheckpointError(f"the model has parameters a Hugging Face LLaMA checkpoint has no "
                              f"place for: {', '.join(extra[:6])}"
                              f"{' ...' if len(extra) > 6 else ''}; fold adapters into the "
                              f"weights first (pockjax.models.lora.merge_lora)")
    save_llama_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)), config, path,
                      tokenizer=tokenizer, max_shard_bytes=max_shard_bytes)


def save_llama_params(params: dict, config: LlamaConfig, path: str | os.PathLike, *,
                      tokenizer=None, max_shard_bytes: int = 2 << 30, convert=None) -> None:
    """`save_llama` for a `Llama`'s parameters (as `pj.nnx.split` gives them) and config,
    each tensor passed through `convert(path, leaf) -> array` as its shard is written:
    a model whose frozen weights are stored quantized is written without ever holding
    it whole in a float type (`finetune` passes `pockjax.lowbit.dequantize`).

    Args:
      params: the parameters, nested dicts keyed as the model's; leaves may be any
        value `convert` turns into an array.
      config: the model's `LlamaConfig`.
      path: the output directory, as for `save_llama`.
      tokenizer: as for `save_llama`.
      max_shard_bytes: as for `save_llama`.
      convert: `convert(path, leaf) -> array`, `path` the leaf's "/"-joined path;
        None: the leaves are written as they are.

    Raises:
      CheckpointError: as `save_llama`.
    """
    tokenizer_files = _tokenizer_files(tokenizer)
    names = _hf_names(config)
    if convert is None:
        convert = lambda _, leaf: leaf  # noqa: E731
    shards: list[list[str]] = [[]]
    size = 0
    stored: dict[str, tuple] = {}  # name -> (shape in the file, dtype)
    for name, t in names.items():
        out = jax.eval_shape(lambda x: convert("/".join(map(str, t.path)), x),
                             _node(params, t.path))
        stored[name] = (tuple(out.shape[::-1]) if t.transposed else tuple(out.shape),
                        np.dtype(out.dtype))
        nbytes = int(np.prod(out.shape)) * np.dtype(out.dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    try:  # the shards an earlier sharded save left here, removed once the new files are in
        old = set(json.loads((directory / INDEX).read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        old = set()
    files = ([WEIGHTS] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    def get(t):  # one tensor, converted and in the file's layout, when it is written
        value = np.asarray(jax.device_get(convert("/".join(map(str, t.path)),
                                                  _node(params, t.path))))
        return value.T if t.transposed else value

    total = 0
    for file, shard in zip(files, shards):
        write_safetensors(directory / file,
                          [(n, *stored[n], lambda t=names[n]: get(t)) for n in shard],
                          {"format": "pt"})  # "pt": what transformers expects
        total += sum(int(np.prod(stored[n][0])) * stored[n][1].itemsize for n in shard)
    if len(shards) == 1:
        (directory / INDEX).unlink(missing_ok=True)
    else:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, shard in zip(files, shards) for n in shard}}
        write_atomic(directory / INDEX, (json.dumps(index, indent=2) + "\n").encode())
        (directory / WEIGHTS).unlink(missing_ok=True)
    for stale in old - set(files):
        if "/" not in stale and stale.endswith(".safetensors"):
            (directory / stale).unlink(missing_ok=True)
    write_atomic(directory / CONFIG, (json.dumps(config.to_hf(), indent=2) + "\n").encode())
    for name, data in tokenizer_files.items():
        write_atomic(directory / name, data)


def _tokenizer_files(tokenizer) -> dict[str, bytes]:
    """File name -> bytes of the tokenizer files `save_llama(tokenizer=...)` writes."""
    if tokenizer is None:
        return {}
    if hasattr(tokenizer, "to_str"):  # a tokenizers.Tokenizer
        return {"tokenizer.json": tokenizer.to_str().encode()}
    folder = Path(tokenizer)
    if not folder.is_dir():
        raise CheckpointError(f"tokenizer='{folder}' is not a directory; pass the model folder "
                              f"whose tokenizer files to copy, or a tokenizers.Tokenizer")
    files = {name: (folder / name).read_bytes() for name in TOKENIZER_FILES
             if (folder / name).is_file()}
    if not set(files) - {"generation_config.json"}:
        raise CheckpointError(f"tokenizer='{folder}' holds no tokenizer files (looked for "
                              f"{', '.join(TOKENIZER_FILES[:3])}, ...); pass the folder the "
                              f"model was downloaded to")
    return files
