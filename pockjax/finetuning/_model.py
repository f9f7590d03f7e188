"""The model of a Hugging Face folder as the fine-tuning job uses it: loaded as parameters
and a pure function of them, its language-model loss, and written back as a folder.

`pockjax.finetuning.finetune` calls `load_model` (a LLaMA-family folder as the Flax
`Llama` of `pockjax.models.llama`, any other causal LM through `pockjax.torch`), trains
on `lm_loss` and writes the result with `write_final`; `pockjax.finetuning` re-exports
`load_model` and `lm_loss`.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from pockjax.finetuning._base import FRONTENDS, LORA_TARGETS, FinetuneError
from pockjax.finetuning._loss import (lm_loss, lm_loss_at, nll_sum,  # noqa: F401  (handed on)
                                      target_positions)
from pockjax.checkpoint import numpy_dtype, safetensors_header



@dataclasses.dataclass
class LoadedModel:
    """A model folder's model as parameters and a pure function of them.

    Attributes:
      kind: "flax" (`pockjax.models.llama`) or "torch" (`pockjax.torch`).
      params: the parameter pytree.
      apply: `apply(params, tokens [B, L]) -> logits [B, L, V]`.
      vocab_size: the model's vocabulary size.
      num_layers: its number of blocks.
      save: `save(params, folder)` writes a Hugging Face model folder (with the
        tokenizer files).
      description: a one-line description for logs.
      note: why a model of a Flax family runs through `pockjax.torch` ("" otherwise).
      scheme: the scheme the weights were stored for, when `load_model(scheme_of=...)`
        stored the frozen ones in `frozen_dtype` while reading them; else None.
    """

    kind: str                      # "flax" (pockjax.models.llama) or "torch"
    params: Any
    apply: Callable                # apply(params, tokens [B, L]) -> logits [B, L, V]
    vocab_size: int
    num_layers: int
    save: Callable                 # save(params, folder): a Hugging Face model folder
    description: str
    scheme: Any = None             # set when the frozen weights were stored while read
    note: str = ""                 # why a LLaMA-family model runs through pockjax.torch
    # checkpoint_name(parameter path) -> the tensor's name in the folder (None: not one)
    checkpoint_name: Callable | None = None
    # the parameter paths whose checkpoint tensor is the transpose ([out, in] kernels)
    checkpoint_transposed: frozenset = frozenset()
    # LoRA's adapters ({"rank", "scale"}): the written kernels are the merged ones
    lora: dict | None = None
    # hidden(params, tokens [B, L]) -> [B, L, D] and logits_of(params, h [..., D]) ->
    # [..., V], apply's two halves (Flax LLaMA): the loss computes the logits it counts
    hidden: Callable | None = None
    logits_of: Callable | None = None


def shapes_of(params):
    """`params` as `jax.ShapeDtypeStruct`s, a stored (quantized) weight as the float
    weight it stands for: the tree a scheme's rules are matched against."""
    import jax
    import numpy as np

    from pockjax import lowbit

    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(tuple(x.shape), "float32") if lowbit.is_quantized(x)
        else jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", "float32")),
        params, is_leaf=lowbit.is_quantized)


def frozen_names(loaded: LoadedModel, scheme, params) -> set[str]:
    """The checkpoint names of the tensors `scheme` (a `Scheme`, or a `Schedule`: frozen
    in every turn) never trains, so `final/` can hold the base's own bytes for them."""
    import jax

    from pockjax.scheme import Frozen, leaves_with_paths

    if loaded.checkpoint_name is None:
        return set()
    params = shapes_of(params)
    schemes = getattr(scheme, "schemes", None) or (scheme,)
    paths = [p for p, _ in leaves_with_paths(params)[0]]
    # LoRA: a kernel with adapters is written merged, so not as the base holds it (peft's
    # layers keep the base's tensors under `base_layer`).
    adapted = {p.rsplit("/", 1)[0] for p in paths if p.endswith("/lora_a")} | \
        {p.split("/lora_A/")[0] + "/base_layer" for p in paths if "/lora_A/" in p}
    frozen = {p for p in paths if p.rsplit("/", 1)[0] not in adapted}
    for one in schemes:
        decisions = jax.tree_util.tree_leaves(one.resolve(params, allow_empty=True),
                                              is_leaf=lambda d: d is not None
                                              and not isinstance(d, dict))
        frozen &= {p for p, d in zip(paths, decisions) if isinstance(d, Frozen)}
    return {n for n in map(loaded.checkpoint_name, frozen) if n is not None}


def load_model(folder, *, frozen_dtype: str = "float32", frontend: str = "auto",
               lora: int | None = None, seed: int = 0,
               scheme_of: Callable | None = None) -> LoadedModel:
    """The model of a Hugging Face folder: LLaMA-family configs (`model_type` in
    `pockjax.models.hf.SUPPORTED_FAMILIES`) as the Flax `Llama`, any other causal LM
    through `pockjax.torch` (needs torch and transformers).

    Args:
      folder: a folder with `config.json` and `model.safetensors` (or shards).
      frozen_dtype: "float32", or "bfloat16" to keep a Flax model's weights in bfloat16
        (computed in float32); `finetune` then casts the trained ones back to float32
        masters. An integer format ("int8", "int4", "int4:GROUP") loads as bfloat16
        (Flax models) and `finetune` quantizes the frozen weights (`pockjax.lowbit`). A
        model through `pockjax.torch` loads in float32 and `finetune` stores its frozen
        weights in any of these formats with `pockjax.lowbit`.
      frontend: "auto" (as above), "flax" (LLaMA families only) or "torch" (any causal
        LM transformers builds, LLaMA's too, through `pockjax.torch`).
      lora: a rank: LoRA adapters (`pockjax.models.lora`, alpha = 2 x rank, `a` drawn
        from `seed`) on every linear layer of the blocks (Flax models only); `save`
        writes the weights with the adapters merged. None (the default): no adapters.
      seed: the seed of the LoRA adapters' initialisation; default 0.
      scheme_of: `scheme_of(params, num_layers) -> Scheme`, called on the parameters'
        shapes before any weight is read. Given with a `frozen_dtype` other than
        float32 for a Flax model without `lora`, each weight is stored as it is read:
        the leaves the scheme freezes in `frozen_dtype` (quantized tensor by tensor,
        `pockjax.lowbit.store_leaf`), the trained ones as float32 from the file's
        values, so the model is never held whole in a wider type; the returned
        model's `scheme` is that scheme. Otherwise unused (`scheme` None: the weights
        are as described above and `finetune` stores the frozen ones afterwards).

    Returns:
      A `LoadedModel`.

    Raises:
      FinetuneError: the folder is not a model folder; `frozen_dtype` or `frontend` is
        not one of its values; "flax" is asked for a family it does not load; `lora`
        is given for a model that runs through `pockjax.torch`; torch or transformers
        is missing, or
        transformers cannot build the model.
    """
    from pockjax.models import hf

    folder = model_folder(folder)
    _check_frozen_dtype(frozen_dtype)
    kind, config, note = frontend_of(folder, frontend)
    model_type = config.get("model_type")
    families = hf.SUPPORTED_FAMILIES
    if gguf_file(folder) is not None:
        if kind != "flax":
            raise FinetuneError(f"'{gguf_file(folder).name}' is a {model_type!r} model: pockjax "
                                f"reads GGUF files of the families its Flax LLaMA runs "
                                f"({', '.join(hf.SUPPORTED_FAMILIES)}, with --frontend auto or "
                                f"flax); convert other families to a model folder")
        from pockjax.finetuning._gguf import gguf_model
        return gguf_model(folder, frozen_dtype, lora, scheme_of, flax_loaded, seed)
    if kind == "flax":
        if scheme_of is not None and frozen_dtype != "float32" and lora is None:
            return _flax_model_stored(folder, frozen_dtype, scheme_of)
        return _flax_model(folder, frozen_dtype, lora, seed)
    from pockjax.finetuning._torch_model import torch_model
    loaded = torch_model(folder, model_type, families, frozen_dtype, lora, seed, LoadedModel)
    loaded.note = note
    return loaded


def model_folder(model) -> Path:
    """The folder a model is read from: `model` itself, or for a GGUF file the folder
    `pockjax.gguf.model_folder` makes of it (its config, tokenizer and chat template).

    Raises:
      FinetuneError: a GGUF file that cannot be read (the message says why).
    """
    model = Path(model)
    if model.is_file():  # a model folder is a folder; a file is read as GGUF
        from pockjax import gguf

        try:
            return gguf.model_folder(model)
        except gguf.GgufError as e:
            raise FinetuneError(f"--model: {e}") from None
    return model


def gguf_file(folder) -> Path | None:
    """The GGUF file a model folder stands for (`model_folder`), or None."""
    from pockjax.gguf._read import source_of

    return source_of(folder)


def position_limit(config: dict) -> int | None:
    """The most positions a model of this `config.json` takes (`max_position_embeddings`,
    GPT-2's `n_positions`); None where there is no limit (none given, or rotary
    embeddings with `dynamic` scaling, which stretch to any length)."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "dynamic":
        return None
    limit = config.get("max_position_embeddings") or config.get("n_positions")
    return limit if isinstance(limit, int) and limit >= 2 else None


def frontend_of(folder, frontend: str = "auto") -> tuple[str, dict, str]:
    """Which model code runs the model in `folder`: `(kind, config, note)`, kind "flax"
    (pockjax's LLaMA: the families of `SUPPORTED_FAMILIES` with every setting it
    computes exactly) or "torch" (`pockjax.torch` on the transformers model); `note` says
    why a model of a Flax family runs through torch under "auto" ("" otherwise).
    `finetune`, `generate` and `export` all choose by it.

    Raises:
      FinetuneError: the folder has no readable config.json; `frontend` is unknown;
        "flax" is asked for a model the Flax LLaMA cannot run (the message says why).
    """
    from pockjax.checkpoint import CheckpointError
    from pockjax.models import hf
    from pockjax.models.llama import LlamaConfig

    folder = Path(folder)
    if frontend not in FRONTENDS:
        raise FinetuneError(f"--frontend {frontend!r}: choose one of {', '.join(FRONTENDS)}")
    try:
        config = hf.read_config(folder)
    except CheckpointError as e:
        raise FinetuneError(f"{e}; --model takes the folder a model was downloaded or "
                            f"saved to, or a GGUF file") from None
    model_type = config.get("model_type")
    families = hf.SUPPORTED_FAMILIES
    if frontend == "torch":
        return "torch", config, ""
    if model_type not in families:
        if frontend == "flax":
            raise FinetuneError(f"--frontend flax: '{folder}' is a {model_type!r} model and "
                                f"pockjax's Flax models load {', '.join(families)}; use "
                                f"--frontend torch (or auto)")
        return "torch", config, ""
    try:
        LlamaConfig.from_hf(config)
    except ValueError as e:
        why = str(e).removeprefix("Hugging Face config ")
        if frontend == "flax":
            raise FinetuneError(f"--frontend flax: '{folder}': {why}; use --frontend torch "
                                f"(or auto)") from None
        return "torch", config, f"runs through pockjax.torch: pockjax's LLaMA cannot run it ({why})"
    return "flax", config, ""


def _check_frozen_dtype(frozen_dtype: str) -> None:
    from pockjax import lowbit

    try:
        lowbit.format_of(frozen_dtype)
    except lowbit.QuantizeError as e:
        why = str(e) if ":" in frozen_dtype else ""   # a group: lowbit says what it takes
        raise FinetuneError(f"--frozen-dtype {frozen_dtype!r}: choose float32, bfloat16, int8 "
                            f"or int4 (int4:GROUP sets the group, e.g. int4:32)"
                            + (f"; {why}" if why else "")) from None


def low_bit(frozen_dtype: str) -> bool:
    """Whether frozen weights are stored as integers (pockjax.lowbit), not a float type."""
    return frozen_dtype.startswith("int")


def written_dtype(q):
    """The dtype a stored weight (`lowbit.Quantized`) is written back in: bfloat16 (what
    a frozen weight holds), float32 for one with trained channels (written as trained)."""
    import jax.numpy as jnp

    return jnp.bfloat16 if q.channels is None else jnp.float32


def stored_by_lowbit(frozen_dtype: str, loaded: "LoadedModel") -> bool:
    """Whether `finetune` stores the loaded model's frozen weights with `pockjax.lowbit`
    after loading: integer formats, and any narrow format for a `pockjax.torch` model
    (pockjax's Flax LLaMA, loaded in bfloat16, is stored by `cast_frozen`, which uses
    `pockjax.lowbit` too); not for a model already stored while it was read
    (`loaded.scheme`)."""
    return loaded.scheme is None and (low_bit(frozen_dtype) or (
        frozen_dtype != "float32" and loaded.kind == "torch"))


def _flax_model(folder: Path, frozen_dtype: str, lora: int | None = None,
                seed: int = 0) -> LoadedModel:
    import jax.numpy as jnp

    from pockjax import nnx as pj_nnx
    from pockjax.checkpoint import CheckpointError
    from pockjax.models.hf import load_llama, save_llama

    try:
        model = load_llama(folder, dtype=None if frozen_dtype == "float32" else jnp.bfloat16,
                           compute_dtype=None if frozen_dtype == "float32" else jnp.float32)
    except CheckpointError as e:
        raise FinetuneError(str(e)) from None
    if lora is not None:
        from flax import nnx

        from pockjax.models.lora import apply_lora, merge_lora
        try:
            apply_lora(model, rank=lora, alpha=2.0 * lora, targets=LORA_TARGETS,
                       rngs=nnx.Rngs(seed))
        except ValueError as e:
            raise FinetuneError(f"--scheme lora:{lora}: {e}") from None
    graphdef, params, rest = pj_nnx.split(model)

    def save(p, out):
        module = pj_nnx.merge(graphdef, p, rest)
        save_llama(merge_lora(module) if lora is not None else module, out, tokenizer=folder)

    loaded = flax_loaded(graphdef, params, rest, model.config, save)
    if lora is not None:  # the written kernels are the merged ones
        loaded.lora = {"rank": lora, "scale": 2.0}
    return loaded


def flax_loaded(graphdef, params, rest, c, save, scheme=None) -> LoadedModel:
    """The `LoadedModel` of pockjax's Flax LLaMA split as `pj.nnx.split` gives it (`c` its
    `LlamaConfig`, `save` its writer, `scheme` the one its weights were stored for)."""
    from pockjax import nnx as pj_nnx
    from pockjax.models.hf import checkpoint_names

    def apply(p, tokens):
        return pj_nnx.merge(graphdef, p, rest)(tokens)

    def hidden(p, tokens):
        return pj_nnx.merge(graphdef, p, rest).hidden(tokens)

    def logits_of(p, h):
        return pj_nnx.merge(graphdef, p, rest).logits(h)

    names, transposed = checkpoint_names(c, transposed=True)
    return LoadedModel("flax", params, apply, c.vocab_size, c.num_layers, save,
                       f"{getattr(c, 'model_type', 'llama')} (pockjax.models.llama), "
                       f"{c.num_layers} layers, width {c.hidden_size}", scheme,
                       checkpoint_name=names.get, checkpoint_transposed=transposed,
                       hidden=hidden, logits_of=logits_of)


def _flax_model_stored(folder: Path, frozen_dtype: str, scheme_of: Callable) -> LoadedModel:
    """`load_model`'s Flax model with each weight stored as it is read (`scheme_of`)."""
    import jax
    import jax.numpy as jnp

    from pockjax import lowbit
    from pockjax.checkpoint import CheckpointError
    from pockjax.finetuning._formats import decisions_by_path
    from pockjax.models.hf import llama_shapes, load_llama_params, save_llama_params

    fmt = lowbit.format_of(frozen_dtype)
    from pockjax.finetuning._formats import frozen_formats

    fmt_of = lowbit.formats_by_path(frozen_formats(frozen_dtype))
    # Frozen vectors (norms): a plain array in this dtype.
    narrow = fmt.dtype if isinstance(fmt, lowbit.Cast) else jnp.bfloat16
    kw = dict(dtype=narrow, compute_dtype=jnp.float32)
    try:
        shapes, config = llama_shapes(folder, **kw)
    except CheckpointError as e:
        raise FinetuneError(str(e)) from None
    scheme = scheme_of(shapes, config.num_layers)
    decided = decisions_by_path(scheme, shapes)

    def convert(path, array):
        try:  # as cast_frozen stores it (a weight trained in part: codes + float32 master)
            return lowbit.store_frozen_leaf(array, decided[path], fmt_of(path), narrow=narrow,
                                            path=path)
        except lowbit.QuantizeError as e:
            raise FinetuneError(f"--frozen-dtype {frozen_dtype}: {e}") from None

    try:
        graphdef, params, rest, config = load_llama_params(folder, convert, **kw)
    except CheckpointError as e:
        raise FinetuneError(str(e)) from None

    # One compiled computation a weight: its values, no float32 intermediates.
    to_written = jax.jit(lambda q: lowbit.dequantize(q, written_dtype(q)))

    def save(p, out):  # frozen weights dequantized tensor by tensor
        save_llama_params(p, config, out, tokenizer=folder, convert=lambda _, x: (
            to_written(x) if lowbit.is_quantized(x) else x))

    return flax_loaded(graphdef, params, rest, config, save, scheme)


SAVE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# safetensors' dtype codes of the float types a model folder holds.
_CODES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def partial_names(loaded: LoadedModel, params) -> dict[str, tuple[int, int, int]]:
    """Checkpoint name -> `(axis, start, count)` in the file's layout of each stored
    (low-bit) weight that trains some of its channels: `finish_final` writes the base's
    values outside them, never the low-bit rounding."""
    import jax

    from pockjax import lowbit
    from pockjax.scheme import path_str

    if loaded.checkpoint_name is None:
        return {}
    out = {}
    for key, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=lowbit.is_quantized)[0]:
        if not lowbit.is_quantized(leaf) or leaf.channels is None:
            continue
        path = path_str(key)
        name = loaded.checkpoint_name(path)
        if name is None:
            continue
        axis, start, count = leaf.channels
        if path in loaded.checkpoint_transposed:
            axis = len(leaf.shape) - 1 - axis
        out[name] = (axis, start, count)
    return out


def write_final(loaded: LoadedModel, params, final: Path, *, base=None, frozen=(),
                partial=None, save_dtype: str = "auto") -> None:
    """The Hugging Face folder, written beside and renamed into place (a crash leaves the
    previous one or none, never half of one). With `base` (the folder the model came
    from), `finish_final` then makes it the base's: its config's fields kept, `frozen`
    tensors (checkpoint names) copied from the base byte for byte, the others written
    in `save_dtype` ("auto": the base's dtype); the weights in `partial` (`partial_names`)
    get the base's values outside their trained channels."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if loaded.scheme is None:
        # Frozen weights dequantized to bfloat16 (what they hold); trained ones as trained.
        # (A model stored while read is written tensor by tensor: its own `save`.)
        import jax

        from pockjax import lowbit
        params = jax.tree_util.tree_map(
            lambda x: lowbit.dequantize(x, written_dtype(x)) if lowbit.is_quantized(x) else x,
            params, is_leaf=lowbit.is_quantized)
    loaded.save(params, tmp)
    if base is not None and gguf_file(base) is None:
        finish_final(Path(base), tmp, frozen, save_dtype, partial or {})
    elif base is not None and save_dtype not in ("auto", "float32"):
        finish_final(tmp, tmp, (), save_dtype)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def _tensor_files(folder: Path) -> list[Path]:
    from pockjax.models.hf import weight_files

    return weight_files(folder)


def base_dtype(folder: Path) -> str:
    """The float dtype most of a model folder's tensor bytes are stored in."""
    sizes: dict[str, int] = {}
    for file in _tensor_files(folder):
        header, _ = safetensors_header(file)
        for t in header.values():
            if t["dtype"] in _CODES:
                a, b = t["data_offsets"]
                sizes[_CODES[t["dtype"]]] = sizes.get(_CODES[t["dtype"]], 0) + b - a
    return max(sizes, key=sizes.get) if sizes else "float32"


def finish_final(base: Path, final: Path, frozen, save_dtype: str = "auto",
                 partial: dict | None = None) -> None:
    """Make the written folder `final` the base model's, fine-tuned: `config.json` keeps
    every field of the base's that training did not change (token ids, initializer
    range, generation settings); the tensors named in `frozen` are the base's own bytes
    (never a dequantized or re-rounded copy); every other float tensor is stored in
    `save_dtype` ("auto": the base's dtype, `base_dtype`); a weight in `partial`
    (`{name: (axis, start, count)}`) takes its trained channels from the written folder
    and the rest from the base."""
    import json

    import numpy as np

    from pockjax.checkpoint import write_atomic, write_safetensors
    from pockjax.models.hf import CONFIG, INDEX

    dtype = base_dtype(base) if save_dtype == "auto" else save_dtype
    target = numpy_dtype({v: k for k, v in _CODES.items()}[dtype])
    base_tensors = {}
    for file in _tensor_files(base):
        header, start = safetensors_header(file)
        for name, t in header.items():
            base_tensors[name] = (file, t, start)

    def raw(file, t, start):
        a, b = t["data_offsets"]
        with open(file, "rb") as f:
            f.seek(start + a)
            return f.read(b - a)

    def array(file, t, start):
        return np.frombuffer(raw(file, t, start), numpy_dtype(t["dtype"])).reshape(t["shape"])

    sizes = {}
    for file in _tensor_files(final):
        header, start = safetensors_header(file)
        entries = []
        for name, t in header.items():
            src = base_tensors.get(name)
            if name in frozen and src is not None and src[1]["shape"] == t["shape"]:
                entries.append((name, tuple(t["shape"]), numpy_dtype(src[1]["dtype"]),
                                lambda s=src: array(*s)))
            elif name in (partial or {}) and src is not None and src[1]["shape"] == t["shape"]:
                def merged(s=src, f=file, tt=t, st=start, where=partial[name]):
                    axis, begin, count = where
                    out = np.array(array(*s), dtype=np.float32)
                    index = [slice(None)] * out.ndim
                    index[axis] = slice(begin, begin + count)
                    out[tuple(index)] = array(f, tt, st)[tuple(index)]
                    return out.astype(target)
                entries.append((name, tuple(t["shape"]), target, merged))
            elif t["dtype"] in _CODES:
                entries.append((name, tuple(t["shape"]), target,
                                lambda f=file, tt=t, st=start: array(f, tt, st).astype(target)))
            else:  # integers and the like, as written
                entries.append((name, tuple(t["shape"]), numpy_dtype(t["dtype"]),
                                lambda f=file, tt=t, st=start: array(f, tt, st)))
        write_safetensors(file, entries, {"format": "pt"})
        sizes[file.name] = sum(int(np.prod(e[1], dtype=np.int64)) * e[2].itemsize
                               for e in entries)
    index = final / INDEX
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = sum(sizes.values())
        write_atomic(index, (json.dumps(data, indent=2) + "\n").encode())
    written = json.loads((final / CONFIG).read_text())
    kept = json.loads((base / CONFIG).read_text())
    merged = {**kept, **{k: v for k, v in written.items() if v is not None or k not in kept}}
    for key in ("dtype", "torch_dtype"):
        if key in merged or key == "dtype":
            merged[key] = dtype
    write_atomic(final / CONFIG, (json.dumps(merged, indent=2) + "\n").encode())
