"""`real_size.py`'s shapes, rows and models: the presets, the row names, the LLaMA of a
shape built leaf by leaf in its storage dtypes, the scheme each row trains, and the
PyTorch rows' model and step. Imports neither JAX nor PyTorch at the top (the IREE
rows' runtime process imports no JAX)."""
from __future__ import annotations

import numpy as np

LR, WEIGHT_DECAY = 1e-4, 0.01
GIB = 2**30

PRESETS = {
    "smoke": dict(layers=4, hidden=256, intermediate=688, heads=8, kv_heads=2, vocab=1024,
                  seq=32, batch=1, last=2),
    # The quality benchmark's small model and batch (the profile of its step, edge_speed's).
    "quality-small": dict(layers=6, hidden=256, intermediate=688, heads=4, kv_heads=4,
                          vocab=8192, seq=256, batch=8, last=1),
    "tinyllama-1.1b": dict(layers=22, hidden=2048, intermediate=5632, heads=32, kv_heads=4,
                           vocab=32000, seq=128, batch=1, last=6),
    "llama2-7b": dict(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32,
                      vocab=32000, seq=128, batch=1, last=6),
}
ROWS = ["pockjax sparse last-k f32", "pockjax sparse last-k bf16-frozen upcast",
        "pockjax sparse last-k bf16-frozen bf16-matmul", "torch full fused-adamw",
        "torch lora r8 q+v", "jax+optax last-k", "pockjax paper last-2 bf16-frozen bf16-matmul",
        "pockjax paper last-2 bf16-frozen upcast", "torch lora r8 q+v bf16", "torch full adamw",
        "pockjax full f32", "jax+optax full f32", "pockjax sparse last-k iree host-cpu",
        "pockjax sparse last-k bf16-frozen bf16-matmul remat",
        "pockjax sparse last-k bf16-frozen upcast iree host-cpu",
        "pockjax paper last-2 bf16-frozen upcast iree host-cpu",
        "pockjax paper last-2 int4-frozen", "pockjax paper last-2 int8-frozen",
        "pockjax sparse last-k int4-frozen", "pockjax paper last-2 int4-frozen int8-moments",
        "pockjax paper last-2 int4-frozen bf16-moments", "torch qlora r8 q+v nf4",
        "pockjax sparse last-k int4-frozen int8-moments"]
# Each IREE row and the JAX row whose step it exports.
IREE_ROWS = {"pockjax sparse last-k iree host-cpu": "pockjax sparse last-k f32",
             "pockjax sparse last-k bf16-frozen upcast iree host-cpu":
                 "pockjax sparse last-k bf16-frozen upcast",
             "pockjax paper last-2 bf16-frozen upcast iree host-cpu":
                 "pockjax paper last-2 bf16-frozen upcast"}


def label(row: str, s: dict) -> str:
    return row.replace("last-k", f"last-{s['last']}")


def describe(name: str, s: dict) -> str:
    return (f"{name}: {s['layers']} layers, hidden {s['hidden']}, MLP {s['intermediate']}, "
            f"{s['heads']} heads ({s['kv_heads']} key/value), vocabulary {s['vocab']}; "
            f"sequence {s['seq']}, batch {s['batch']}; sparse rows train the last "
            f"{s['last']} blocks")


def llama_config(s: dict, **overrides):
    from pockjax.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"],
                       intermediate_size=s["intermediate"], num_layers=s["layers"],
                       num_heads=s["heads"], num_kv_heads=s["kv_heads"],
                       max_position_embeddings=max(128, s["seq"]), **overrides)


def uniform_noise(seed, shape, dtype, std):
    """Counter-based uniform noise with standard deviation `std`, made in `dtype`.

    A murmur3 finaliser over the element index: one fused elementwise loop, about
    50x faster on this CPU than `jax.random.normal`, which matters at 6.7B weights."""
    import jax
    import jax.numpy as jnp

    x = jax.lax.iota(jnp.uint32, int(np.prod(shape))) * jnp.uint32(0x9E3779B1) + seed
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    x = x ^ (x >> 16)
    u = (x >> 8).astype(jnp.float32) * (1.0 / 2**24) - 0.5
    return (u * (std * 12 ** 0.5)).astype(dtype).reshape(shape)


def build_params(s: dict, scheme_fn, frozen_dtype=None, compute_dtype=None,
                 narrow: str = "upcast", remat=None, low_bit: str | None = None):
    """`(graphdef, abstract params, scheme)`, and a function making the arrays: each
    leaf made in its storage dtype by its own jitted call, so no float32 copy of the
    model ever exists. With `frozen_dtype`, frozen leaves are stored in it and the
    model computes in `compute_dtype` (float32). With `low_bit` ("int8", "int4"), each
    frozen weight is quantized as soon as it is made (`pockjax.lowbit`): the abstract
    params hold `Quantized` nodes and no float copy of the frozen model exists."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import pockjax as pj
    from pockjax.models.llama import Llama, cast_frozen

    config = llama_config(s, dtype=compute_dtype, narrow_matmul=narrow, remat=remat)
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, params, _ = pj.nnx.split(abstract)
    scheme = scheme_fn(params)
    if frozen_dtype is not None:  # pockjax.lowbit nodes; plain arrays for native products
        params = cast_frozen(params, scheme, frozen_dtype, native=narrow == "native")
    make = jax.jit(uniform_noise, static_argnums=(1, 2, 3))
    ones = jax.jit(jnp.ones, static_argnums=(0, 1))
    floats = params
    frozen = [isinstance(d, pj.Frozen) for d in jax.tree.leaves(
        scheme.resolve(params), is_leaf=lambda d: isinstance(d, (pj.Full, pj.Frozen, pj.Channels)))]
    if low_bit is not None:
        from pockjax import lowbit
        params = jax.eval_shape(lambda p: lowbit.quantize(p, scheme, low_bit), floats)
        chooser = lowbit.formats_by_path(low_bit)
        quantize = jax.jit(lowbit.quantize_leaf, static_argnums=1)

    def arrays():
        leaves, treedef = jax.tree_util.tree_flatten_with_path(floats)
        out = []
        for i, (path, x) in enumerate(leaves):
            if x.ndim == 1:  # norm scales
                out.append(ones(x.shape, x.dtype))
                continue
            w = make(jnp.uint32(i * 7919 + 1), x.shape, x.dtype, 0.02)
            fmt = chooser(pj.scheme.path_str(path)) if low_bit is not None and frozen[i] else None
            out.append(w if fmt is None else quantize(w, fmt))
            del w
        return jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, out))

    return graphdef, params, scheme, arrays


def scheme_for(row: str, s: dict):
    import pockjax as pj

    if row.startswith(("pockjax full", "jax+optax full")):
        return lambda p: pj.Scheme(default=pj.Full())
    if "paper last-2" in row:
        return lambda p: pj.schemes.transformer(p, last=2)
    return lambda p: pj.schemes.last_blocks(p, s["last"])


def torch_config(s: dict):
    """transformers' `LlamaConfig` of shape `s` (the PyTorch rows' model)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], max_position_embeddings=max(128, s["seq"]),
        rms_norm_eps=1e-5, tie_word_embeddings=False)


def torch_step(net, opt, tokens):
    """One PyTorch training step on `tokens` (next-token cross-entropy), as a function
    returning the loss as a float (which waits for the step)."""
    import torch.nn.functional as F

    def step():
        opt.zero_grad(set_to_none=True)
        logits = net(input_ids=tokens).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step
