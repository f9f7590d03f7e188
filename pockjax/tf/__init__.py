"""TensorFlow models in: a SavedModel, a `tf.Module` or a `tf.function` as a parameter
pytree and a pure JAX function, converted by tf2jax.

`params, apply = pj.tf.load(model, *example_inputs)` traces `model` with the example
inputs (their shapes and dtypes are the function's) and converts the graph to JAX.
TensorFlow is needed for that conversion only: the step, `sparse_grad`, `sparse_train`,
`report` and `export` then run on JAX alone. The trainable variables are the
parameters, nested by their TensorFlow names split on "/" (`dense/kernel` ->
`params["dense"]["kernel"]`; a name that is also a prefix of another's stays whole at
the top level). The other variables (BatchNorm's moving statistics, counters) are the
function's state: `apply.state` holds them, `apply(params, *inputs)` runs with them as
constants, and `apply.stateful(params, state, *inputs)` returns `(outputs, new_state)`
with the values the function assigned (`moving_mean.assign(...)`).

Each weight's layout comes from the operations that read it in the traced graph, so
`Channels(axis="in"|"out")` means input or output features: a `MatMul`'s right operand
(`[in, out]`, or `[out, in]` with `transpose_b`), a `Conv2D`/`Conv3D` filter (`[*k,
in, out]`), a `DepthwiseConv2dNative` filter (`[h, w, channels, multiplier]`: both
names mean the channels), a transposed convolution's filter (`[*k, out, in]`) and a
gathered table (an embedding, `[vocabulary, width]`). A weight read inside a nested
function (a SavedModel's restored layers) takes an int axis.

Keras models are better served by `pockjax.keras`, which runs them on Keras's JAX
backend and writes the trained values back; importing this module chooses that backend
(`KERAS_BACKEND=jax`) unless another one is set, as `pockjax.keras` does, since
TensorFlow imports Keras. `pip install 'pockjax[tf]'` brings
TensorFlow and tf2jax.

Examples:
  >>> import numpy as np, pockjax as pj
  >>> import tensorflow as tf
  >>> class Net(tf.Module):
  ...     def __init__(self):
  ...         self.w = tf.Variable(np.ones((4, 2), np.float32), name="fc/kernel")
  ...     @tf.function
  ...     def __call__(self, x):
  ...         return tf.matmul(x, self.w)
  >>> params, apply = pj.tf.load(Net(), np.zeros((3, 4), np.float32))
  >>> apply(params, np.ones((3, 4), np.float32)).tolist()
  [[4.0, 4.0], [4.0, 4.0], [4.0, 4.0]]
  >>> pj.Scheme({"fc/kernel": pj.Channels(count=1, axis="out")}).resolve(params)["fc"]["kernel"]
  Channels(count=1, axis=1)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from pockjax._src.trees import leaves_at, nest

__all__ = ["load", "TfFunction", "TF_NOTE"]

TF_NOTE = ("These parameters come from TensorFlow (pockjax.tf): paths are the variables' "
           "names split on '/' (e.g. 'dense/kernel')")


os.environ.setdefault("KERAS_BACKEND", "jax")  # as pockjax.keras: TensorFlow imports Keras


def _tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter
    try:
        import tensorflow as tf
        import tf2jax
    except ImportError as e:
        raise ImportError("pockjax.tf needs TensorFlow and tf2jax to convert a model: pip "
                          "install 'pockjax[tf]' (or pip install tensorflow tf2jax)") from e
    return tf, tf2jax


# ---------------------------------------------------------------------------- layouts


def _uses(tensor, seen=None):
    """`(op, input position)` of every operation reading `tensor`, through `Identity` and
    `Cast`."""
    seen = set() if seen is None else seen
    for op in tensor.consumers():
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type in ("Identity", "Cast"):
            yield from _uses(op.outputs[0], seen)
        else:
            yield from ((op, i) for i, t in enumerate(op.inputs) if t is tensor)


def _attr(op, name, default=None):
    return op.get_attr(name) if name in op.node_def.attr else default


def _layout_of(op, pos: int, ndim: int):
    kind = op.type
    if kind == "MatMul" and pos == 1 and ndim == 2:
        return ("in", 1, "out", 0) if _attr(op, "transpose_b") else ("in", 0, "out", 1)
    if kind.startswith("BatchMatMul") and pos == 1:
        return (("in", ndim - 1, "out", ndim - 2) if _attr(op, "adj_y")
                else ("in", ndim - 2, "out", ndim - 1))
    if kind in ("Conv2D", "Conv3D") and pos == 1 and _attr(op, "data_format", b"") in (
            b"NHWC", b"NDHWC", b"NCHW", b"NCDHW"):
        return ("in", ndim - 2, "out", ndim - 1)
    if kind == "DepthwiseConv2dNative" and pos == 1:
        return ("in", 2, "out", 2)
    if kind in ("Conv2DBackpropInput", "Conv3DBackpropInputV2") and pos == 1:
        return ("in", ndim - 1, "out", ndim - 2)
    if kind in ("ResourceGather", "GatherV2") and pos == 0 and ndim == 2:
        return ("in", 0, "out", 1)
    return f"is read by a TensorFlow {kind} operation (input {pos}), whose layout pockjax.tf " \
           f"does not name"


def _layouts(concrete, names: dict[int, str], shapes: dict[str, tuple]) -> dict[str, Any]:
    """`{tf2jax name: layout}` from the traced graph's readers of each variable."""
    ext_of = {internal.name: ext for ext, internal in concrete.graph.captures}
    found: dict[str, set] = {}
    for op in concrete.graph.get_operations():
        if op.type not in ("ReadVariableOp", "ResourceGather"):
            continue
        name = names.get(id(ext_of.get(op.inputs[0].name)))
        if name is None or len(shapes[name]) < 2:
            continue
        ndim = len(shapes[name])
        readers = [(op, 0)] if op.type == "ResourceGather" else list(_uses(op.outputs[0]))
        found.setdefault(name, set()).update(_layout_of(o, i, ndim) for o, i in readers)
    out: dict[str, Any] = {}
    for name, shape in shapes.items():
        if len(shape) < 2:
            continue
        seen = found.get(name)
        if not seen:
            out[name] = ("is not read in the traced graph itself (a nested or restored "
                         "function reads it), so pockjax.tf does not name its axes")
        elif len(seen) == 1:
            one = next(iter(seen))
            out[name] = one if isinstance(one, str) else {one[0]: one[1], one[2]: one[3]}
        else:
            out[name] = (f"is read by operations with different layouts "
                         f"({', '.join(sorted(map(str, seen)))})")
    return out


# ---------------------------------------------------------------------------- trees


def _paths(names: list[str]) -> dict[str, tuple[str, ...]]:
    """Each variable's path: its name split on "/", or the whole name at the top level
    where the split is a prefix of another's or collides."""
    split = {n: tuple(p for p in n.split("/") if p) or (n,) for n in names}
    prefixes = {parts[:i] for parts in split.values() for i in range(1, len(parts))}
    out, seen = {}, set()
    for name, parts in split.items():
        if parts in prefixes or parts in seen:
            parts = (name,)
        seen.add(parts)
        out[name] = parts
    return out


def _nest(paths: dict[str, tuple[str, ...]], values: dict[str, Any]) -> dict:
    return nest((paths[name], value) for name, value in values.items())


def _flat(tree, paths: dict[str, tuple[str, ...]], what: str) -> dict[str, Any]:
    want = {"/".join(p): n for n, p in paths.items()}
    named = leaves_at(tree, want, what, "TensorFlow function")
    return {want[p]: named[p] for p in want}


# ---------------------------------------------------------------------------- function


class TfFunction:
    """`apply(params, *inputs, rng=None)`: the converted TensorFlow function as a pure JAX
    function of its trainable variables, its other variables (`state`) as constants.
    `stateful(params, state, *inputs, rng=None)` returns `(outputs, new_state)`: the
    state after the function's assignments. `rng` is a `jax.random` key for graphs with
    random operations (dropout)."""

    def __init__(self, fn, param_paths, state_paths, state: dict):
        self.fn, self.param_paths, self.state_paths, self.state = (
            fn, param_paths, state_paths, state)

    def __repr__(self) -> str:
        return (f"TfFunction({len(self.param_paths)} trainable variables, "
                f"{len(self.state_paths)} others)")

    def __call__(self, params, *inputs, rng=None):
        return self.stateful(params, self.state, *inputs, rng=rng)[0]

    def stateful(self, params, state, *inputs, rng=None):
        """`(outputs, new_state)`: the forward, and the other variables after it."""
        values = {**_flat(params, self.param_paths, "parameters"),
                  **(_flat(state, self.state_paths, "state") if self.state_paths else {})}
        kwargs = {} if rng is None else {"rng": rng}
        outputs, after = self.fn(values, *inputs, **kwargs)
        new = {n: jnp.asarray(after[n]) for n in self.state_paths}
        return outputs, _nest(self.state_paths, new)


def _callable(model, tf, signature):
    """The function to convert, from a SavedModel path, a module or a function."""
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not (path / "saved_model.pb").is_file():
            raise FileNotFoundError(f"{path}: not a SavedModel directory (no saved_model.pb); "
                                    f"pockjax.tf.load takes a SavedModel directory, a "
                                    f"tf.Module or a tf.function (Keras files: "
                                    f"pockjax.keras)")
        model = tf.saved_model.load(str(path))
        if signature is None and hasattr(model, "__call__") and callable(
                getattr(model, "__call__", None)) and hasattr(model.__call__,
                                                             "concrete_functions"):
            return model.__call__, model
        sigs = dict(getattr(model, "signatures", {}) or {})
        name = signature or "serving_default"
        if name not in sigs:
            raise KeyError(f"{path}: no signature {name!r}; it has {sorted(sigs) or 'none'}")
        sig = sigs[name]
        names = sorted(sig.structured_input_signature[1])

        def call(*args):
            out = sig(**dict(zip(names, args)))
            return out[next(iter(out))] if isinstance(out, dict) and len(out) == 1 else out
        return call, model
    if signature is not None:
        raise ValueError("signature= names a SavedModel's signature; give a path with it")
    call = getattr(model, "__call__", None)
    if not hasattr(model, "get_concrete_function") and hasattr(call, "get_concrete_function"):
        return call, model       # a module's tf.function itself (a wrapper would nest it)
    if callable(model):
        return model, model
    raise TypeError(f"pockjax.tf.load takes a SavedModel directory, a tf.Module with a "
                    f"__call__, or a tf.function; got {type(model).__name__}")


def load(model, *example_inputs, signature: str | None = None) -> tuple[dict, TfFunction]:
    """`(params, apply)` for a TensorFlow model, converted to JAX by tf2jax.

    Args:
      model: a SavedModel directory (its restored `__call__`, or the signature named by
        `signature`), a `tf.Module` with a `tf.function` `__call__`, or a
        `tf.function` (a method bound to a module's variables).
      *example_inputs: arrays with the shapes and dtypes the function is called with;
        the converted function keeps them.
      signature: a SavedModel's signature to convert (called with its inputs in the
        order of their sorted names); default: its `__call__`, else `serving_default`.

    Returns:
      `(params, apply)`: the trainable variables (nested by name, layouts registered)
        and the `TfFunction`, whose `state` holds the other variables.

    Raises:
      ImportError: TensorFlow or tf2jax is not installed.
      FileNotFoundError: the path is not a SavedModel.
      KeyError: the SavedModel has no such signature.
      TypeError: `model` is none of the above.
      ValueError: no example inputs, the function has no trainable variable, or tf2jax
        cannot convert it (the operation is named).
    """
    tf, tf2jax = _tf()
    from pockjax.scheme import register_layouts

    if not example_inputs:
        raise ValueError("pockjax.tf.load needs example inputs (arrays of the shapes and "
                         "dtypes the function takes), e.g. load(model, np.zeros((8, 224, "
                         "224, 3), np.float32))")
    fn, owner = _callable(model, tf, signature)
    if not hasattr(fn, "get_concrete_function"):
        fn = tf.function(fn)
    try:
        converted, values = tf2jax.convert(fn, *example_inputs)
        concrete = fn.get_concrete_function(*[tf.TensorSpec(np.shape(x), tf.as_dtype(
            np.asarray(x).dtype)) for x in example_inputs])
    except (ValueError, TypeError, NotImplementedError, KeyError) as e:
        raise ValueError(f"tf2jax could not convert this TensorFlow function: {e}") from e
    trainable = {n: jnp.asarray(np.asarray(v)) for n, v in values.items()
                 if getattr(v, "trainable", False)}
    others = {n: jnp.asarray(np.asarray(v)) for n, v in values.items() if n not in trainable}
    if not trainable:
        raise ValueError("the TensorFlow function has no trainable variable (every "
                         "tf.Variable it reads has trainable=False)")
    paths = _paths(list(values))
    param_paths = {n: paths[n] for n in trainable}
    state_paths = {n: paths[n] for n in others}
    by_handle = {}
    for v in concrete.variables:
        name = v.name[:-2] if v.name.endswith(":0") else v.name
        if name in values:
            by_handle[id(v.handle)] = name
    layouts = _layouts(concrete, by_handle, {n: tuple(np.shape(v)) for n, v in values.items()})
    params = _nest(param_paths, trainable)
    register_layouts(params, {"/".join(paths[n]): l for n, l in layouts.items()
                              if n in trainable}, TF_NOTE)
    apply = TfFunction(converted, param_paths, state_paths, _nest(state_paths, others))
    apply.source = owner  # keeps a restored SavedModel's objects alive
    return params, apply
