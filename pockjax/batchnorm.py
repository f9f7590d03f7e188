"""Frozen layers' batch norms in inference mode, folded into their convolutions.

A batch norm in training mode normalises with the batch's statistics, so even when its
scale and bias are frozen it costs two reductions forward and two backward, and its
backward pass runs through the whole activation. Fine-tuning usually keeps the frozen
layers' batch norms in inference mode instead: they normalise with their running
statistics, which stay as they are, and the layer becomes a fixed per-channel affine
map `y = x * m + c` with `m = scale / sqrt(var + eps)` and `c = bias - mean * m`. That map
folds into the convolution before it, `conv(x, W) * m + c = conv(x, W * m) + c`, and its
backward pass is the convolution's.

This changes what the model computes (the statistics of frozen layers are the running
ones, and they no longer move), so the loss differs from a training-mode step by design;
it is the same function as the model with those batch norms in eval mode, folded or not.

>>> import jax.numpy as jnp, pockjax as pj
>>> from flax import nnx
>>> from pockjax.models import MobileNetV2
>>> model = MobileNetV2(10, width_mult=0.35, input_size=32, rngs=nnx.Rngs(0))
>>> scheme = pj.schemes.mobilenetv2(model, norms=True)
>>> frozen_norms_in_inference_mode(model, scheme)
['blocks/0/depthwise/bn', 'blocks/0/project/bn', 'head/bn', 'stem/bn']
"""
from __future__ import annotations

from typing import Any

from flax import nnx

from pockjax.scheme import Frozen, Scheme

__all__ = ["frozen_norms_in_inference_mode"]


def frozen_norms_in_inference_mode(model: nnx.Module, scheme: Scheme | Any, *, fold: bool = True,
                                   wrt: Any = nnx.Param) -> list[str]:
    """Put every `nnx.BatchNorm` of `model` whose parameters `scheme` all freezes into
    inference mode (`use_running_average=True`), in place; returns their paths, sorted.

    `scheme` is a `pockjax.Scheme` or anything `pockjax.nnx.Trainer` accepts as one (an
    NNX filter, `(filter, decision)` pairs). A batch norm with any trained parameter
    (scale or bias, even a few channels of it) keeps its mode. With `fold=True`, a batch
    norm that sits in a layer able to fold it (a module with a `fold_norm` attribute,
    such as `pockjax.models.mobilenetv2.ConvBN`) is folded into the convolution's kernel.
    The mode is static: `pockjax.nnx.split` keeps it in the graph definition, so a
    `Trainer` built afterwards compiles the folded step. `model.train()` undoes it.
    """
    if not isinstance(scheme, Scheme):
        from pockjax.nnx import scheme as filter_scheme

        scheme = filter_scheme(model, scheme, wrt=wrt)
    switched = []
    for path, node in nnx.graph.iter_graph(model):
        if not isinstance(node, nnx.BatchNorm):
            continue
        prefix = "/".join(map(str, path))
        names = [n for n in ("scale", "bias") if getattr(node, n, None) is not None]
        if not all(isinstance(scheme.match(f"{prefix}/{n}"), Frozen) for n in names):
            continue
        node.use_running_average = True
        parent = _module_at(model, path[:-1])
        if hasattr(parent, "fold_norm"):
            parent.fold_norm = fold
        switched.append(prefix)
    return sorted(switched)


def _module_at(model: nnx.Module, path) -> Any:
    node = model
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node
