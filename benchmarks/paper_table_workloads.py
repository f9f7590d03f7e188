"""`paper_table.py`'s workloads and rows: their sizes, models, data and losses, the
sparse scheme each trains, and the row names the runs and the report share. Imports
neither JAX nor PyTorch at the top (the PyTorch rows' processes import no JAX)."""
from __future__ import annotations

import numpy as np

WORKLOADS = ["llama", "mobilenetv2"]
FOLDED = "pockjax sparse (frozen BN folded)"
AUTO = "pockjax sparse (backend auto)"  # pj.nnx.Trainer(backend="auto"): XLA or IREE, faster
TORCH_FROZEN_EVAL = "torch frozen (frozen BN eval)"
ROWS = ["torch full", "torch frozen", TORCH_FROZEN_EVAL, "torch lora r8", "torch.compile full",
        "jax+optax full", "jax+optax multi_transform", "pockjax full", "pockjax sparse", FOLDED,
        AUTO, "pockjax sparse iree host-cpu", f"{FOLDED} iree host-cpu", "pockjax.torch full",
        "pockjax.torch sparse"]
# MobileNetV2 with the batch norms the sparse scheme freezes entirely in inference mode
# (running statistics), folded into their convolutions: a different function from the
# training-mode rows by design, compared with a plain-JAX reference of the same semantics.
FROZEN_BN_ROWS = (TORCH_FROZEN_EVAL, FOLDED, f"{FOLDED} iree host-cpu")
# pockjax on the Hugging Face LlamaForCausalLM the torch rows run, brought in through
# pockjax.torch (torchax), against the Flax LLaMA rows: the frontend's overhead.
TORCH_FRONTEND_ROWS = ("pockjax.torch full", "pockjax.torch sparse")
LR = 1e-4
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


PRESETS = {
    "llama": {"llama2-7b": dict(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32,
                                vocab=32000, seq=512, batch=1)},
    "mobilenetv2": {},
}


def sizes(workload: str, quick: bool, spec: str | None = None) -> dict:
    """The workload's sizes: the default or `--quick` ones, then `spec` (a preset name
    such as "llama2-7b", or "key=value,..." overrides)."""
    if workload == "llama":
        s = (dict(layers=4, hidden=256, intermediate=688, seq=64, batch=4) if quick else
             dict(layers=8, hidden=512, intermediate=1376, seq=128, batch=8))
        s.update(heads=8, kv_heads=8, vocab=256)
    else:
        s = dict(width=0.5, size=64, batch=8) if quick else dict(width=1.0, size=128, batch=16)
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        if item in PRESETS[workload]:
            s.update(PRESETS[workload][item])
            continue
        key, eq, value = item.partition("=")
        if not eq or key not in s:
            raise SystemExit(f"--{workload} {spec!r}: expected a preset "
                             f"({', '.join(PRESETS[workload]) or 'none'}) or key=value with keys "
                             f"{', '.join(s)}")
        s[key] = type(s[key])(float(value)) if isinstance(s[key], int) else type(s[key])(value)
    return s


def describe(workload: str, s: dict) -> str:
    if workload == "llama":
        return (f"LLaMA {s['layers']} layers, hidden {s['hidden']}, MLP {s['intermediate']}, "
                f"{s['heads']} heads ({s['kv_heads']} key/value), vocabulary {s['vocab']}; "
                f"sequence {s['seq']}, batch {s['batch']}")
    return (f"MobileNetV2 width {s['width']}, {s['size']}x{s['size']} images, 10 classes, "
            f"batch {s['batch']}, batch norm in training mode (but in the frozen-BN rows)")


def items_per_step(workload: str, s: dict) -> tuple[int, str]:
    return (s["batch"] * s["seq"], "tokens/s") if workload == "llama" else (s["batch"], "images/s")


def make_model(workload: str, s: dict):
    from flax import nnx

    from pockjax.models import Llama, MobileNetV2
    from pockjax.models.llama import LlamaConfig

    if workload == "llama":
        config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"],
                             intermediate_size=s["intermediate"], num_layers=s["layers"],
                             num_heads=s["heads"], num_kv_heads=s["kv_heads"],
                             max_position_embeddings=max(128, s["seq"]))
        return Llama(config, rngs=nnx.Rngs(0))
    return MobileNetV2(10, width_mult=s["width"], input_size=s["size"], rngs=nnx.Rngs(0))


def make_batch(workload: str, s: dict):
    """numpy data from a fixed seed: tokens [B, T], or (images NHWC, labels)."""
    rng = np.random.default_rng(0)
    if workload == "llama":
        return rng.integers(0, s["vocab"], size=(s["batch"], s["seq"])).astype(np.int32)
    x = rng.standard_normal((s["batch"], s["size"], s["size"], 3)).astype(np.float32)
    return x, rng.integers(0, 10, size=s["batch"]).astype(np.int32)


def jax_loss(workload: str):
    import jax
    import jax.numpy as jnp
    import optax

    def lm_loss(model, tokens):
        logits = model(tokens)[:, :-1]
        targets = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1])
        return -jnp.mean(jnp.sum(targets * jax.nn.log_softmax(logits), axis=-1))

    def image_loss(model, batch):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    return lm_loss if workload == "llama" else image_loss


def sparse_scheme(workload: str, model):
    import pockjax as pj

    if workload == "llama":
        return pj.schemes.transformer(model, last=max(1, model.config.num_layers // 2),
                                      extra=["lm_head/**"])
    return pj.schemes.mobilenetv2(model, norms=True)

def trained_paths(workload: str, model) -> list[str]:
    """Parameters the sparse scheme trains at all (partially trained tensors count whole)."""
    import pockjax as pj

    scheme = sparse_scheme(workload, model)
    return [p for p in pj.nnx.param_paths(model) if not isinstance(scheme.match(p), pj.Frozen)]


def torch_name(workload: str, path: str) -> str:
    """A JAX parameter path as the PyTorch model names it."""
    if workload == "mobilenetv2":
        parts = path.split("/")
        parts[-1] = {"kernel": "weight", "scale": "weight"}.get(parts[-1], parts[-1])
        return ".".join(parts)
    table = {"embed/embedding": "model.embed_tokens.weight", "norm/scale": "model.norm.weight",
             "lm_head/kernel": "lm_head.weight"}
    if path in table:
        return table[path]
    parts = path.split("/")
    if len(parts) == 5:  # layers/{i}/attn|mlp/{name}/kernel
        group = "self_attn" if parts[2] == "attn" else "mlp"
        return f"model.layers.{parts[1]}.{group}.{parts[3]}.weight"
    _, i, module, leaf = parts
    norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    if module in norms:
        return f"model.layers.{i}.{norms[module]}.weight"
    raise ValueError(f"no PyTorch name for {path!r}")
