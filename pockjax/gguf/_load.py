"""A GGUF file's LLaMA-family model as `pockjax.models.llama.Llama`'s parameters, each
frozen weight kept in the file's own bytes.

`load_llama_gguf(folder, decide)` reads the file behind `model_folder`'s folder tensor by
tensor: a weight `decide` freezes stays as the file stores it (a `pockjax.lowbit.Blocks`
node for the block types, decoded where the step uses it; a `Cast` node for F16 and BF16;
float32 as it is), a weight that trains is decoded to float32, and one that trains some
channels (`pockjax.Channels`) keeps the file's blocks with those channels as a float32
master. The q and k projections' rows are put back in Hugging Face's order (llama.cpp's
converter interleaves each head's rotary halves): a row of blocks moves whole, so the
bytes stay the file's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pockjax.gguf._read import (GgufError, float_values, hf_to_gguf_names, read_tensors,
                                source_of, unpermute_rows)
from pockjax.lowbit import Cast, Quantized
from pockjax.lowbit._blocks import BLOCK_TYPES, Blocks, split_blocks
from pockjax.scheme import Channels, Frozen


def stored_leaf(t, decision, *, transposed: bool, rows=None):
    """The parameter leaf for GGUF tensor `t` under `decision` (`Full`, `Frozen`, a
    resolved `Channels`, or None: trained): frozen in the file's own format, trained as
    float32 values, trained in part as the file's blocks with a float32 master."""
    frozen = isinstance(decision, Frozen)
    part = isinstance(decision, Channels)
    if not (frozen or part) or len(t.shape) < 2:
        values = float_values(t, rows)
        return jnp.asarray(values.T if transposed else values)
    # The weight as stored, in the model's layout ([in, out] kernels: blocks along axis 0).
    shape = t.shape[::-1] if transposed else t.shape
    axis = 0 if transposed else len(shape) - 1
    if t.type in BLOCK_TYPES:
        fmt = Blocks(t.type)
        raw = t.raw if rows is None else t.raw[rows]
        data, d = split_blocks(raw, fmt)
        if transposed:
            data, d = data.T, d.T
        node = Quantized(jnp.asarray(data), jnp.asarray(d), fmt=fmt, shape=shape,
                         dtype=jnp.float32, axis=axis)
    elif t.type in ("F16", "BF16"):
        narrow = np.float16 if t.type == "F16" else ml_dtypes.bfloat16
        w = t.raw.view(narrow).reshape(t.shape)
        w = w if rows is None else w[rows]
        node = Quantized(jnp.asarray(w.T if transposed else w), None,
                         fmt=Cast(jnp.dtype(narrow)), shape=shape, dtype=jnp.float32,
                         axis=axis)
    else:  # F32: the values as they are (a weight trained in part trains them in place)
        values = float_values(t, rows)
        return jnp.asarray(values.T if transposed else values)
    if not part:
        return node
    ch_axis, count = decision.axis % len(shape), decision.count
    start = shape[ch_axis] - count if decision.last else 0
    full = float_values(t, rows)
    full = full.T if transposed else full
    master = jax.lax.slice_in_dim(jnp.asarray(full), start, start + count, axis=ch_axis)
    return Quantized(node.data, node.scale, fmt=node.fmt, shape=shape, dtype=jnp.float32,
                     axis=axis, master=master.astype(jnp.float32),
                     channels=(ch_axis, start, count))


def load_llama_gguf(folder, decide, abstract=None):
    """`(graphdef, params, rest, config)` of the LLaMA-family model of a GGUF model
    folder (`model_folder`), each tensor stored by `stored_leaf` under `decide(path)`
    (the scheme's decision for the parameter path, or None for every leaf trained).
    `abstract`: the model's structure (`nnx.eval_shape` of it, e.g. with LoRA adapters,
    which stay abstract here); default the plain `Llama` of the folder's config.

    Raises:
      GgufError: the file lacks a tensor the config needs, or one has another shape.
    """
    from flax import nnx

    from pockjax import nnx as pj_nnx
    from pockjax.models.hf import checkpoint_names, read_config
    from pockjax.models.llama import Llama, LlamaConfig

    source = source_of(folder)
    config = LlamaConfig.from_hf(read_config(folder), dtype=jnp.float32)
    names, transposed = checkpoint_names(config, transposed=True)
    import gguf

    reader = gguf.GGUFReader(str(source))
    tensors = read_tensors(source, reader)
    mapped = hf_to_gguf_names(source, read_config(folder), names.values(), reader)
    del reader
    if abstract is None:
        abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, params, rest = pj_nnx.split(abstract)
    for path, name in names.items():
        gname = mapped[name]
        if gname not in tensors:
            raise GgufError(f"'{source}' has no tensor '{gname}' ({name}); its "
                            f"config needs it")
        t = tensors[gname]
        rows = None
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            rows = unpermute_rows(t.shape[0], config.num_heads if "q_proj" in name
                                  else config.num_kv_heads)
        keys = path.split("/")
        node = params
        for k in keys[:-1]:
            node = node[int(k) if k.isdigit() and int(k) in node else k]
        want = t.shape[::-1] if path in transposed else t.shape
        leaf = stored_leaf(t, decide(path), transposed=path in transposed, rows=rows)
        if tuple(leaf.shape) != tuple(node[keys[-1]].shape) or tuple(want) != tuple(leaf.shape):
            raise GgufError(f"'{source}': tensor '{gname}' has shape {list(t.shape)}; "
                            f"the config needs {list(node[keys[-1]].shape)} for '{path}'")
        node[keys[-1]] = leaf
    return graphdef, params, rest, config
