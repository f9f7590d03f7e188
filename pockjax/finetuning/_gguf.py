"""The fine-tuning job's GGUF side: the Flax model of a GGUF file with its frozen weights
in the file's own blocks (`gguf_model`, which `load_model` calls for a folder
`pockjax.gguf.model_folder` made), and `final.gguf` written from the trained parameters
(`write_final_gguf`)."""
from __future__ import annotations

from pathlib import Path

from pockjax.finetuning._base import FinetuneError
from pockjax.gguf._read import source_of as gguf_file


def gguf_model(folder: Path, frozen_dtype: str, lora, scheme_of, loaded_model):
    """`load_model`'s Flax model of a GGUF file: frozen weights in the file's own blocks
    (`pockjax.gguf`), trained ones decoded to float32; `loaded_model(graphdef, params,
    rest, config, save, scheme)` makes the `LoadedModel`."""
    import jax
    import jax.numpy as jnp

    from pockjax import lowbit
    from pockjax.gguf import GgufError
    from pockjax.gguf._load import load_llama_gguf
    from pockjax.models.hf import save_llama_params
    from pockjax.finetuning._formats import decisions_by_path

    source = gguf_file(folder)
    if frozen_dtype != "float32":
        raise FinetuneError(f"--frozen-dtype {frozen_dtype}: '{source.name}' keeps its frozen "
                            f"weights in the file's own blocks; leave --frozen-dtype at float32")
    if lora is not None:
        raise FinetuneError(f"--scheme lora:{lora} on a GGUF file is not implemented; choose "
                            f"paper, last:N, full, a scheme file, or convert the file to a "
                            f"model folder")
    decide = lambda path: None  # noqa: E731  (every weight trains, as float32)
    scheme = None
    if scheme_of is not None:
        from pockjax.models.hf import read_config
        from pockjax.models.llama import Llama, LlamaConfig
        from flax import nnx
        from pockjax import nnx as pj_nnx

        config = LlamaConfig.from_hf(read_config(folder), dtype=jnp.float32)
        abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
        _, shapes, _ = pj_nnx.split(abstract)
        scheme = scheme_of(shapes, config.num_layers)
        decide = decisions_by_path(scheme, shapes).get
    try:
        graphdef, params, rest, config = load_llama_gguf(folder, decide)
    except GgufError as e:
        raise FinetuneError(str(e)) from None

    # final/ holds the file's values exactly: float32, decoded tensor by tensor.
    to_float = jax.jit(lambda q: lowbit.dequantize(q, jnp.float32))

    def save(p, out):
        save_llama_params(p, config, out, tokenizer=folder, convert=lambda _, x: (
            to_float(x) if lowbit.is_quantized(x) else x))

    return loaded_model(graphdef, params, rest, config, save, scheme)


def write_final_gguf(loaded, params, out: Path, *, base, frozen, gguf_type: str,
                     metadata: dict) -> dict:
    """`final.gguf` for a model read from a GGUF file (`base`, its `model_folder`): the
    file's own bytes for each tensor in `frozen` (checkpoint names), the others from
    `params` in `gguf_type`, every metadata key of the file and `metadata` (the
    training). Returns `pockjax.gguf.write_gguf`'s report."""
    import jax
    import numpy as np

    from pockjax import lowbit
    from pockjax.gguf import write_gguf
    from pockjax.gguf._read import hf_to_gguf_names, unpermute_rows
    from pockjax.models.hf import read_config
    from pockjax.scheme import path_str

    source = gguf_file(base)
    config = read_config(base)
    names = {}
    for key, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=lowbit.is_quantized)[0]:
        path = path_str(key)
        name = loaded.checkpoint_name(path) if loaded.checkpoint_name else None
        if name is not None and name not in frozen:
            names[path] = (name, leaf)
    mapped = hf_to_gguf_names(source, config, [n for n, _ in names.values()])
    trained = {}
    for path, (name, leaf) in names.items():
        values = np.asarray(jax.device_get(lowbit.dequantize(leaf, np.float32)))
        if path in loaded.checkpoint_transposed:
            values = values.T
        if name.endswith(("q_proj.weight", "k_proj.weight")):   # back in llama.cpp's order
            heads = config["num_attention_heads"] if "q_proj" in name else \
                config.get("num_key_value_heads", config["num_attention_heads"])
            values = values[np.argsort(unpermute_rows(values.shape[0], heads))]
        trained[mapped[name]] = values
    return write_gguf(source, out, trained, save_type=gguf_type, metadata=metadata)
