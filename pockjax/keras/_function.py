"""`functional` (a Keras model as params + a pure function), its layouts, and
`load_state` (the values back into the model)."""
from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pockjax._src.trees import leaves_at, nest

KERAS_NOTE = ("These parameters come from a Keras model (pockjax.keras): paths are the "
              "variables' Keras paths, layer name / variable name ('dense_1/kernel', "
              "'bn1/gamma'; in a Sequential model its name comes first, "
              "'sequential/dense/kernel')")


def _keras():
    """Keras, checked to run on JAX."""
    try:
        import keras
    except ImportError as e:
        raise ImportError("pockjax.keras needs Keras 3: pip install 'pockjax[keras]' (or "
                          "pip install 'keras>=3.8')") from e
    if not hasattr(keras, "config") or keras.config.backend() != "jax":
        backend = keras.config.backend() if hasattr(keras, "config") else keras.__version__
        raise RuntimeError(f"pockjax.keras needs Keras 3 on its JAX backend; Keras here runs on "
                           f"{backend!r}. Set KERAS_BACKEND=jax before Keras is imported (or "
                           f"import pockjax.keras first); a model saved under any backend "
                           f"loads unchanged")
    return keras


# --------------------------------------------------------------------------- layouts

def _einsum_layout(equation: str, ndim: int):
    """The named axes of an EinsumDense kernel from its equation ("abc,cde->abde": "in"
    is the kernel's first contracted axis, "out" its first axis in the output)."""
    m = re.fullmatch(r"\s*([\w.]+)\s*,\s*(\w+)\s*->\s*([\w.]+)\s*", equation)
    if not m or len(m.group(2)) != ndim:
        return f"is an EinsumDense kernel with equation {equation!r} (layout unknown)"
    x, kernel, out = m.groups()
    ins = [i for i, c in enumerate(kernel) if c in x and c not in out]
    outs = [i for i, c in enumerate(kernel) if c in out]
    if not ins or not outs:
        return f"is an EinsumDense kernel with equation {equation!r} (layout unknown)"
    return {"in": ins[0], "out": outs[0]}


def _layout(layer, name: str, ndim: int):
    """The layout of `layer`'s own variable `name`: a dict, None for a vector, or a
    string saying it is unknown."""
    keras = _keras()
    layers = keras.layers
    if ndim < 2:
        return None
    if name == "kernel":
        if isinstance(layer, (layers.DepthwiseConv1D, layers.DepthwiseConv2D)):
            return {"in": ndim - 2, "out": ndim - 2}  # (*window, channels, multiplier)
        if isinstance(layer, (layers.Conv1DTranspose, layers.Conv2DTranspose,
                              layers.Conv3DTranspose)):
            return {"in": ndim - 1, "out": ndim - 2}  # (*window, out, in)
        if isinstance(layer, layers.EinsumDense):
            return _einsum_layout(layer.equation, ndim)
        if isinstance(layer, (layers.Dense, layers.Conv1D, layers.Conv2D, layers.Conv3D)):
            return {"in": ndim - 2, "out": ndim - 1}  # [in, out], (*window, in, out)
    if name == "embeddings" and isinstance(layer, layers.Embedding):
        return {"in": 0, "out": 1}  # [vocabulary, width]: "in" the tokens, "out" features
    if isinstance(layer, (layers.SeparableConv1D, layers.SeparableConv2D)):
        if name == "depthwise_kernel":
            return {"in": ndim - 2, "out": ndim - 2}
        if name == "pointwise_kernel":
            return {"in": ndim - 2, "out": ndim - 1}
    return f"is a variable of a {type(layer).__name__} (layout unknown to pockjax.keras)"


def _variables(model, trainable: bool) -> list:
    return list(model.trainable_variables if trainable else model.non_trainable_variables)


def _layers(model) -> list:
    """The model and every layer inside it, outer before inner."""
    try:
        return list(model._flatten_layers(include_self=True, recursive=True))
    except AttributeError:  # a Keras without the walk: the model's own layers
        return [model, *getattr(model, "layers", [])]


def _owners(model) -> dict[int, tuple[Any, str]]:
    """Each variable's innermost layer and its own name there, by the variable's id.
    Keras lists a layer before the layers inside it, and a layer's variables include
    theirs: the last layer to list a variable owns it."""
    out = {}
    for layer in _layers(model):
        for v in layer.weights:
            out[id(v)] = (layer, v.name)
    return out


def _seed_paths(model) -> dict[int, str]:
    """The path of each seed generator's state, by the state's id: its layer's path and
    `seed_generator_state` (`_<i>` after it where the layer has several). Keras's own
    path names the generator by a process-wide counter (`seed_generator_1/...` in the
    second model built in a process), which would differ between two models of the
    same structure."""
    out = {}
    for layer in _layers(model):
        generators = [g for g in getattr(layer, "_seed_generators", [])
                      if getattr(g, "state", None) is not None]
        base = getattr(layer, "path", None) or layer.name
        for i, g in enumerate(generators):
            out[id(g.state)] = (f"{base}/seed_generator_state" if len(generators) == 1
                                else f"{base}/seed_generator_state_{i}")
    return out


def _paths(variables, model) -> list[str]:
    seeds = _seed_paths(model)
    paths = [seeds.get(id(v), v.path) for v in variables]
    seen: dict[str, int] = {}
    for p in paths:
        seen[p] = seen.get(p, 0) + 1
    twice = sorted(p for p, n in seen.items() if n > 1)
    if twice:
        raise ValueError(f"the Keras model has several variables at the path(s) "
                         f"{', '.join(twice)}: Keras leaves out a nested model's name, so "
                         f"two layers named alike in different sub-models collide; give the "
                         f"layers unique names")
    return paths


def layouts(model) -> dict[str, Any]:
    """`{path: layout}` of the model's trainable variables with 2 or more dimensions
    (`{"in": 2, "out": 2}` for a depthwise kernel, `{"in": 1, "out": 2}` for a Conv1D
    kernel), or a string saying the layout is unknown.

    Args:
      model: a Keras model (built).

    Returns:
      The layouts by "/"-joined Keras path; vectors are left out (their "out" is
        axis 0, as in JAX).
    """
    owners = _owners(model)
    variables = _variables(model, True)
    out = {}
    for path, v in zip(_paths(variables, model), variables):
        layer, name = owners.get(id(v), (None, v.name))
        layout = _layout(layer, name, len(v.shape)) if layer is not None else (
            "is a variable whose layer pockjax.keras did not find")
        if layout is not None:
            out[path] = layout
    return out


# --------------------------------------------------------------------------- trees


def _nest(paths: list[str], values: list) -> dict:
    return nest((p.split("/"), v) for p, v in zip(paths, values))


def _flat(tree, paths: list[str], what: str) -> list:
    """The leaves of `tree` (a nested dict, or a flat dict of "/"-joined paths) in the
    order of `paths`."""
    return list(leaves_at(tree, paths, what, "Keras model").values())


class KerasFunction:
    """`apply(params, *inputs, training=False, **kwargs)`: the Keras model's forward as a
    pure JAX function of its trainable values, with its other state (`state`) as
    constants. `stateful(params, state, *inputs, training=True)` returns `(outputs,
    new_state)` for a forward that updates that state (BatchNorm in training, dropout's
    seed)."""

    def __init__(self, model, paths: list[str], state_paths: list[str], state: dict):
        self.model, self.paths, self.state_paths, self.state = model, paths, state_paths, state

    def __repr__(self) -> str:
        return (f"KerasFunction({self.model.name!r}, {len(self.paths)} trainable variables, "
                f"{len(self.state_paths)} others)")

    def __call__(self, params, *inputs, training: bool = False, **kwargs):
        return self.stateful(params, self.state, *inputs, training=training, **kwargs)[0]

    def stateful(self, params, state, *inputs, training: bool = True, **kwargs):
        """`(outputs, new_state)`: the forward with `training` (True by default), and the
        model's other state after it."""
        trainable = _flat(params, self.paths, "parameters")
        others = _flat(state, self.state_paths, "model state") if self.state_paths else []
        x = inputs[0] if len(inputs) == 1 else list(inputs)
        outputs, new = self.model.stateless_call(trainable, others, x, training=training,
                                                 **kwargs)
        return outputs, _nest(self.state_paths, list(new))


def functional(model) -> tuple[dict, KerasFunction]:
    """`(params, apply)` for a Keras 3 model on the JAX backend.

    `params` holds the trainable variables' values (copies) as a nested dict keyed by
    their Keras paths split on "/"; their layouts are registered (`layouts`) so named
    `Channels` axes mean features. `apply` runs `model.stateless_call`; the
    non-trainable variables are in `apply.state`.

    Args:
      model: a built `keras.Model` (or layer), e.g. from `keras.saving.load_model`.

    Returns:
      A pair `(params, apply)`.

    Raises:
      ImportError: Keras 3 is not installed.
      RuntimeError: Keras runs on another backend.
      TypeError: `model` is not a Keras layer or model.
      ValueError: the model is not built, has no trainable variables, or two variables
        share a path.
    """
    keras = _keras()
    from pockjax.scheme import register_layouts

    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"pockjax.keras.functional needs a Keras model, got "
                        f"{type(model).__name__}")
    if not model.built:
        raise ValueError(f"the Keras model {model.name!r} is not built: call it on a batch, "
                         f"or give it a keras.Input, before pockjax.keras.functional")
    variables = _variables(model, True)
    if not variables:
        raise ValueError(f"the Keras model {model.name!r} has no trainable variables")
    others = _variables(model, False)
    paths, state_paths = _paths(variables, model), _paths(others, model)
    params = _nest(paths, [jnp.array(v.value, copy=True) for v in variables])
    state = _nest(state_paths, [jnp.array(v.value, copy=True) for v in others])
    register_layouts(params, layouts(model), KERAS_NOTE)
    return params, KerasFunction(model, paths, state_paths, state)


def load_state(model, params, state=None) -> list[str]:
    """Write trained values (and the model's other state) into the Keras model's
    variables; returns the paths written.

    Args:
      model: the Keras model the values came from (or one of the same structure).
      params: the trainable values, as `functional` gives them (a trainer's
        `state.params`), nested or flat by "/"-joined path.
      state: the non-trainable values (`Trainer.model_state`, `apply.state`), or None to
        leave them.

    Returns:
      The paths written.

    Raises:
      KeyError: a path the model does not have, or one of its paths missing.
      ValueError: a value's shape differs from its variable's.
    """
    written = []
    for trainable, values in ((True, params), (False, state)):
        if values is None:
            continue
        variables = _variables(model, trainable)
        paths = _paths(variables, model)
        for path, v, value in zip(paths, variables, _flat(values, paths, "values")):
            arr = np.asarray(jax.device_get(value))
            if tuple(arr.shape) != tuple(v.shape):
                raise ValueError(f"{path}: shape {tuple(arr.shape)} does not fit the Keras "
                                 f"variable's {tuple(v.shape)}")
            v.assign(arr.astype(v.dtype))
            written.append(path)
    return written

