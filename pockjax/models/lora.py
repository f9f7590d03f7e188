"""LoRA (Hu et al. 2021) as a baseline: low-rank adapters beside frozen linear layers.

`apply_lora` replaces the chosen `nnx.Linear` layers of a module with `LoRALinear`,
which keeps the original `kernel` (and `bias`) under the same path and adds
`lora_a` [in, rank] and `lora_b` [rank, out] (`nnx.LoRAParam`, zero-initialised `b`,
so the model's function is unchanged at the start). Train them with
`pockjax.schemes.lora()` or the filter `nnx.LoRAParam`; `merge_lora` folds them back.

>>> from flax import nnx; import pockjax as pj
>>> from pockjax.models.lora import apply_lora
>>> model = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
>>> pj.nnx.param_paths(apply_lora(model, rank=2, targets=["layers/0"], rngs=nnx.Rngs(1)))
['layers/0/bias', 'layers/0/kernel', 'layers/0/lora_a', 'layers/0/lora_b']
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from pockjax.models._llama_precision import project
from pockjax.scheme import glob_to_regex

__all__ = ["LoRALinear", "apply_lora", "merge_lora"]


class LoRALinear(nnx.Module):
    """A linear layer with a low-rank adapter beside its kernel.

    `y = x @ kernel + bias + (alpha / rank) * (x @ lora_a) @ lora_b`.

    `kernel` and `bias` are `base`'s values (`nnx.Param`); `lora_a` [in, rank] is
    drawn uniformly from `[-1/sqrt(in), 1/sqrt(in)]` and `lora_b` [rank, out] is zero
    (both `nnx.LoRAParam`), so the layer starts as `base`.

    Args:
      base: the `nnx.Linear` to adapt.
      rank: the adapter's rank.
      alpha: the adapter's scale numerator: its output is multiplied by
        `alpha / rank`.
      rngs: the random streams `lora_a` is drawn from (`rngs.params()`).
    """

    def __init__(self, base: nnx.Linear, rank: int, alpha: float, *, rngs: nnx.Rngs):
        in_features, out_features = base.kernel.shape
        self.kernel = nnx.Param(base.kernel[...])
        self.bias = nnx.Param(base.bias[...]) if base.bias is not None else None
        dtype = self.kernel.dtype
        # A as in the reference implementation (Kaiming-uniform, a = sqrt(5)), B zero.
        bound = 1.0 / jnp.sqrt(in_features)
        self.lora_a = nnx.LoRAParam(jax.random.uniform(rngs.params(), (in_features, rank), dtype,
                                                       -bound, bound))
        self.lora_b = nnx.LoRAParam(jnp.zeros((rank, out_features), dtype))
        self.scale = alpha / rank

    def __call__(self, x):
        """The layer applied to `x`.

        Args:
          x: inputs, `[..., in]`.

        Returns:
          The outputs, `[..., out]`.
        """
        # `project` (the base layer's own product: a plain contraction of x's last axis;
        # `@` on [B, T, in] traces a broadcasting matmul whose weight gradients XLA's CPU
        # backend computes slower) with the scale on the rank-sized intermediate.
        y = project(x, self.kernel[...], None) + project(
            project(x, self.lora_a[...], None) * self.scale, self.lora_b[...], None)
        return y + self.bias[...] if self.bias is not None else y


def _linear_layers(model: nnx.Module, targets: Sequence[str], kind):
    """`(parent, key, layer, path)` for every `kind` layer whose path or last name matches."""
    regexes = [glob_to_regex(t) for t in targets]
    found = []
    for path, node in nnx.graph.iter_graph(model):
        if not isinstance(node, kind) or not path:
            continue
        joined = "/".join(map(str, path))
        if str(path[-1]) in targets or any(r.match(joined) for r in regexes):
            found.append((path, node))
    out = []
    for path, node in found:
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        out.append((parent, path[-1], node, "/".join(map(str, path))))
    return out


def _replace(parent, key, new):
    if isinstance(key, int):
        parent[key] = new
    else:
        setattr(parent, key, new)


def apply_lora(model: nnx.Module, *, rank: int = 8, alpha: float = 16.0,
               targets: Sequence[str] = ("q_proj", "v_proj"), rngs: nnx.Rngs) -> nnx.Module:
    """Put LoRA adapters on the chosen `nnx.Linear` layers of `model`, in place.

    A layer is chosen when its attribute name is in `targets` or its "/"-joined path
    matches one of them as a glob (`"layers/*/mlp/up_proj"`). Each becomes a
    `LoRALinear` under the same path.

    Args:
      model: the module to change.
      rank: the adapters' rank, a positive int no larger than any chosen layer's
        input or output size (default 8).
      alpha: the adapters' scale numerator: outputs are scaled by `alpha / rank`
        (default 16).
      targets: attribute names or path globs (default `("q_proj", "v_proj")`).
      rngs: the random streams the adapters' `lora_a` are drawn from.

    Returns:
      `model` itself.

    Raises:
      ValueError: `rank` is not a positive int or exceeds a chosen layer's size, or no
        `nnx.Linear` matches `targets` (the message lists the linear layers).
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be a positive int, got {rank!r}")
    layers = _linear_layers(model, list(targets), nnx.Linear)
    if not layers:
        names = sorted({"/".join(map(str, p)) for p, n in nnx.graph.iter_graph(model)
                        if isinstance(n, nnx.Linear)})
        raise ValueError(f"no nnx.Linear layer matches LoRA targets {list(targets)}; "
                         f"the linear layers are: {', '.join(names[:8]) or 'none'}")
    for parent, key, layer, path in layers:
        in_features, out_features = layer.kernel.shape
        if rank > min(in_features, out_features):
            raise ValueError(f"LoRA rank {rank} is larger than layer '{path}' "
                             f"({in_features} -> {out_features})")
        _replace(parent, key, LoRALinear(layer, rank, alpha, rngs=rngs))
    return model


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Fold every `LoRALinear` back into a plain `nnx.Linear`, in place.

    The new kernel is `kernel + (alpha / rank) * lora_a @ lora_b`; the bias is kept.

    Args:
      model: the module holding `LoRALinear` layers (from `apply_lora`).

    Returns:
      `model` itself, each adapter folded into its layer's kernel.
    """
    for parent, key, layer, _ in _linear_layers(model, ["**"], LoRALinear):
        kernel = layer.kernel[...] + layer.lora_a[...] @ layer.lora_b[...] * layer.scale
        linear = nnx.Linear(*kernel.shape, use_bias=layer.bias is not None,
                            param_dtype=kernel.dtype, rngs=nnx.Rngs(0))
        linear.kernel[...] = kernel
        if layer.bias is not None:
            linear.bias[...] = layer.bias[...]
        _replace(parent, key, linear)
    return model
