"""The fine-tuning job's GGUF side: the Flax model of a GGUF file with its frozen weights
in the file's own blocks (`gguf_model`, which `load_model` calls for a folder
`pockjax.gguf.model_folder` made), and `final.gguf` written from the trained parameters
(`write_final_gguf`)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from pockjax.finetuning._base import FinetuneError
from pockjax.gguf._read import source_of as gguf_file


def _at(params: dict, path: str):
    node = params
    for k in path.split("/"):
        node = node[int(k) if k.isdigit() and int(k) in node else k]
    return node


def lora_merged(params: dict, scale: float, to_float) -> Callable:
    """`(path, leaf) -> float32 array`: a kernel with LoRA adapters beside it (`lora_a`,
    `lora_b` under the same parent in `params`) folded in, `to_float(kernel) + scale *
    a @ b`; any other leaf `to_float(leaf)` (its stored value decoded)."""
    def merged(path: str, leaf):
        parent = path.rsplit("/", 1)[0]
        if path.endswith("/kernel"):
            node = _at(params, parent)
            if "lora_a" in node:
                return to_float(leaf) + (node["lora_a"] @ node["lora_b"]) * scale
        return to_float(leaf)
    return merged


def _lora_values(config, rank: int, seed: int) -> dict:
    """The adapters `apply_lora` puts on `load_model`'s float32 model with `--scheme
    lora:R` and `seed` (the same draws, so a run from the file equals the run from its
    float32 folder), computed without the base weights: `{path: array}`."""
    import jax
    from flax import nnx

    from pockjax import nnx as pj_nnx
    from pockjax.finetuning._base import LORA_TARGETS
    from pockjax.models.llama import Llama
    from pockjax.models.lora import apply_lora
    from pockjax.scheme import leaves_with_paths

    def adapters():
        model = Llama(config, rngs=nnx.Rngs(0))   # its weights are dead code under jit
        apply_lora(model, rank=rank, alpha=2.0 * rank, targets=LORA_TARGETS,
                   rngs=nnx.Rngs(seed))
        leaves = leaves_with_paths(pj_nnx.split(model)[1])[0]
        return {p: x for p, x in leaves if p.endswith(("/lora_a", "/lora_b"))}

    return jax.jit(adapters)()


def gguf_model(folder: Path, frozen_dtype: str, lora, scheme_of, loaded_model,
               seed: int = 0):
    """`load_model`'s Flax model of a GGUF file: frozen weights in the file's own blocks
    (`pockjax.gguf`), trained ones decoded to float32, and with `lora` (a rank) LoRA
    adapters on every linear layer over the file's blocks (QLoRA on the file as it is
    stored); `loaded_model(graphdef, params, rest, config, save, scheme)` makes the
    `LoadedModel`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from pockjax import lowbit
    from pockjax import nnx as pj_nnx
    from pockjax.finetuning._formats import decisions_by_path
    from pockjax.finetuning._base import LORA_TARGETS
    from pockjax.gguf import GgufError
    from pockjax.gguf._load import load_llama_gguf
    from pockjax.models.hf import read_config, save_llama_params
    from pockjax.models.llama import Llama, LlamaConfig
    from pockjax.models.lora import apply_lora

    source = gguf_file(folder)
    if frozen_dtype != "float32":
        raise FinetuneError(f"--frozen-dtype {frozen_dtype}: '{source.name}' keeps its frozen "
                            f"weights in the file's own blocks; leave --frozen-dtype at float32")
    config = LlamaConfig.from_hf(read_config(folder), dtype=jnp.float32)

    def build():
        model = Llama(config, rngs=nnx.Rngs(0))
        if lora is not None:
            apply_lora(model, rank=lora, alpha=2.0 * lora, targets=LORA_TARGETS,
                       rngs=nnx.Rngs(seed))
        return model

    try:
        abstract = nnx.eval_shape(build)
    except ValueError as e:
        raise FinetuneError(f"--scheme lora:{lora}: {e}") from None
    decide = lambda path: None  # noqa: E731  (every weight trains, as float32)
    scheme = None
    if scheme_of is not None:
        shapes = pj_nnx.split(abstract)[1]
        scheme = scheme_of(shapes, config.num_layers)
        decide = decisions_by_path(scheme, shapes).get
    try:
        graphdef, params, rest, config = load_llama_gguf(folder, decide, abstract=abstract)
    except GgufError as e:
        raise FinetuneError(str(e)) from None
    if lora is not None:
        for path, value in _lora_values(config, lora, seed).items():
            parent, key = path.rsplit("/", 1)
            _at(params, parent)[key] = value

    # final/ holds the file's values exactly: float32, decoded tensor by tensor (LoRA's
    # kernels merged).
    to_float = jax.jit(lambda q: lowbit.dequantize(q, jnp.float32) if lowbit.is_quantized(q)
                       else q)

    def save(p, out):
        convert = (lora_merged(p, 2.0, to_float) if lora is not None else
                   lambda _, x: to_float(x) if lowbit.is_quantized(x) else x)
        save_llama_params(p, config, out, tokenizer=folder, convert=convert)

    loaded = loaded_model(graphdef, params, rest, config, save, scheme)
    if lora is not None:  # the written kernels are the merged ones
        loaded.lora = {"rank": lora, "scale": 2.0}
    return loaded


def write_final_gguf(loaded, params, out: Path, *, base, frozen, gguf_type: str,
                     metadata: dict) -> dict:
    """`final.gguf` for a model read from a GGUF file (`base`, its `model_folder`): the
    file's own bytes for each tensor in `frozen` (checkpoint names), the others from
    `params` in `gguf_type` (LoRA's kernels merged), every metadata key of the file and
    `metadata` (the training). Returns `pockjax.gguf.write_gguf`'s report."""
    import jax
    import numpy as np

    from pockjax import lowbit
    from pockjax.gguf import write_gguf
    from pockjax.gguf._read import hf_to_gguf_names, unpermute_rows
    from pockjax.models.hf import read_config
    from pockjax.scheme import path_str

    source = gguf_file(base)
    config = read_config(base)
    decoded = lambda x: lowbit.dequantize(x, np.float32)  # noqa: E731
    value_of = (lora_merged(params, loaded.lora["scale"], decoded) if loaded.lora
                else lambda _, x: decoded(x))
    names = {}
    for key, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=lowbit.is_quantized)[0]:
        path = path_str(key)
        name = loaded.checkpoint_name(path) if loaded.checkpoint_name else None
        if name is not None and name not in frozen:
            names[path] = (name, leaf)
    mapped = hf_to_gguf_names(source, config, [n for n, _ in names.values()])
    trained = {}
    for path, (name, leaf) in names.items():
        values = np.asarray(jax.device_get(value_of(path, leaf)))
        if path in loaded.checkpoint_transposed:
            values = values.T
        if name.endswith(("q_proj.weight", "k_proj.weight")):   # back in llama.cpp's order
            heads = config["num_attention_heads"] if "q_proj" in name else \
                config.get("num_key_value_heads", config["num_attention_heads"])
            values = values[np.argsort(unpermute_rows(values.shape[0], heads))]
        trained[mapped[name]] = values
    return write_gguf(source, out, trained, save_type=gguf_type, metadata=metadata)


def check_save_gguf(folder: Path, source, save_gguf: str | None) -> None:
    """Before training: `--save-gguf` only for a model folder, and one `folder_gguf` can
    write (family, settings, tokenizer)."""
    if save_gguf is None:
        return
    if source is not None:
        raise FinetuneError(f"--save-gguf {save_gguf}: the model is the GGUF file "
                            f"'{source}', so final.gguf is written anyway, its frozen tensors "
                            f"the file's own bytes; leave --save-gguf out")
    from pockjax.gguf._convert import check_folder
    from pockjax.gguf._read import GgufError

    try:
        check_folder(folder)
    except GgufError as e:
        raise FinetuneError(f"--save-gguf {save_gguf}: {e}") from None


def final_gguf(loaded, params, out: Path, *, base, source, final: Path, frozen,
               gguf_type: str, save_gguf: str | None, metadata: dict, say: Callable) -> None:
    """`out/final.gguf` and its report `final.gguf.json` (each tensor's digest or
    rounding): from `source`, the GGUF file the model was read from (`write_final_gguf`),
    or where that is None from `final/` (`--save-gguf`: the frozen tensors quantized once
    to `save_gguf`)."""
    from pockjax.gguf._write import write_report

    written = out / "final.gguf"
    if source is not None:
        report = write_final_gguf(loaded, params, written, base=base, frozen=frozen,
                                  gguf_type=gguf_type,
                                  metadata={**metadata, "general.pockjax.base_file": source.name})
        kept = [n for n, (how, _) in report.items() if how == "kept"]
        said = f"{len(kept)} tensors the base file's own bytes"
    else:
        from pockjax.checkpoint import safetensors_header
        from pockjax.gguf._convert import folder_gguf

        names = [n for f in sorted(final.glob("*.safetensors"))
                 for n in safetensors_header(f)[0]]
        report = folder_gguf(final, written, frozen_type=save_gguf,
                             trained=[n for n in names if n not in frozen],
                             trained_type=gguf_type,
                             metadata={**metadata, "general.pockjax.base_folder": Path(base).name})
        kept = [n for n, (how, _) in report.items() if how == "frozen"]
        said = f"{len(kept)} frozen tensors in {save_gguf}"
    say(f"{written}: {said}, {len(report) - len(kept)} trained in {gguf_type} (each "
        f"tensor's digest or rounding in final.gguf.json)")
    write_report(written, report)
