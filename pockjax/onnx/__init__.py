"""ONNX models in: an `.onnx` file as a parameter pytree and a pure JAX function, by an
interpreter of the graph into `jax.numpy`.

`params, apply = pj.onnx.load("model.onnx")` reads the file (with its external
`.onnx.data`, where the tensors are kept apart). The float initializers are the
parameters, nested by their names split on "." and "/" (`fc1.weight` ->
`params["fc1"]["weight"]`; a name that is also another's prefix stays whole at the top
level); integer and boolean initializers (shapes, indices) and float scalars (the
literals of the graph's arithmetic) are constants of the function, never parameters. `apply(params, *inputs)` runs the graph's nodes in order
with ONNX's semantics (`pockjax.onnx._ops.OPS`, opsets 13 and later): shape subgraphs
(`Shape`, `Gather` on shapes, `Concat`, `Reshape`'s target) are computed with numpy while
the function is traced, so the step compiles with static shapes.

Each weight's layout comes from the nodes that read it, so `Channels(axis="in"|"out")`
means input or output features: a `Gemm`'s B (`[out, in]` with `transB=1`, else `[in,
out]`), a `MatMul`'s right operand `[in, out]`, a `Conv` weight `[out, in, *k]`, a
`Gather`'s table (an embedding, `[vocabulary, width]`). A weight read otherwise takes an
int axis.

An exported ONNX file is an inference graph: BatchNorm is folded into the convolution
before it, dropout is gone, and equal-valued initializers may have been merged into one
tensor (fresh LayerNorm scales of different layers, zero biases). A parameter read by
nodes of different layers is reported when the file is loaded (a `UserWarning` and
`apply.shared`): training it trains all its readers together, a tie the original model
did not have. Everything else in pockjax (`sparse_grad`, `sparse_train`, schemes,
`report`, `export`) takes the pair unchanged.

Examples:
  >>> import numpy as np, onnx, pockjax as pj
  >>> from onnx import helper, numpy_helper
  >>> w = numpy_helper.from_array(np.ones((3, 2), np.float32), "fc.weight")
  >>> graph = helper.make_graph(
  ...     [helper.make_node("Gemm", ["x", "fc.weight"], ["y"], transB=1)], "g",
  ...     [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 2])],
  ...     [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 3])], [w])
  >>> params, apply = pj.onnx.load(helper.make_model(graph))
  >>> apply(params, np.ones((4, 2), np.float32)).shape
  (4, 3)
  >>> pj.Scheme({"fc/weight": pj.Channels(count=1, axis="in")}).resolve(params)["fc"]["weight"]
  Channels(count=1, axis=1)
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from pockjax.onnx._ops import MULTI_OUTPUT, OPS

__all__ = ["load", "OnnxFunction", "OPS", "ONNX_NOTE"]

ONNX_NOTE = ("These parameters come from an ONNX file (pockjax.onnx): paths are the "
             "initializers' names split on '.' and '/' (e.g. 'fc1/weight'); an initializer "
             "the exporter named for its reader ('onnx::Conv_19') stays whole")

MIN_OPSET = 13


def _onnx():
    try:
        import onnx
    except ImportError as e:
        raise ImportError("pockjax.onnx needs the onnx package: pip install 'pockjax[onnx]' "
                          "(or pip install 'onnx>=1.16')") from e
    return onnx


def _attrs(node) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _nest(names: list[str]) -> dict[str, tuple[str, ...]]:
    """Each initializer's path in the params tree: its name split on "." and "/", or the
    whole name at the top level where the split collides with another's."""
    split = {n: tuple(p for p in n.replace("/", ".").split(".") if p) or (n,) for n in names}
    prefixes = {s[:i] for s in split.values() for i in range(1, len(s))}
    seen: set = set()
    out = {}
    for name, parts in split.items():
        if parts in prefixes or parts in seen or any(p in (".", "..") for p in parts):
            parts = (name,)
        seen.add(parts)
        out[name] = parts
    if len(set(out.values())) != len(out):
        raise ValueError("two ONNX initializers map to the same parameter path")
    return out


def _layout(readers, ndim: int):
    """A weight's named axes from the nodes that read it (`(node, input position)`)."""
    found = set()
    for node, pos in readers:
        op, attrs = node.op_type, _attrs(node)
        if op == "Gemm" and pos == 1 and ndim == 2:
            found.add(("in", 1, "out", 0) if attrs.get("transB", 0) else ("in", 0, "out", 1))
        elif op == "MatMul" and pos == 1 and ndim >= 2:
            found.add(("in", ndim - 2, "out", ndim - 1))
        elif op in ("Conv",) and pos == 1:
            found.add(("in", 1, "out", 0))
        elif op == "ConvTranspose" and pos == 1:
            found.add(("in", 0, "out", 1))
        elif op == "Gather" and pos == 0 and ndim == 2 and attrs.get("axis", 0) == 0:
            found.add(("in", 0, "out", 1))
        else:
            found.add(f"is read by an ONNX {op} node (input {pos}), whose layout pockjax.onnx "
                      f"does not name")
    if len(found) == 1:
        one = found.pop()
        return one if isinstance(one, str) else {one[0]: one[1], one[2]: one[3]}
    return f"is read by nodes with different layouts ({', '.join(sorted(map(str, found)))})"


class OnnxFunction:
    """`apply(params, *inputs)`: the ONNX graph run with `params` as its float
    initializers. One graph output comes back as an array, several as a tuple.

    Attributes:
      inputs: the graph's input names, in the order `apply` takes them.
      outputs: its output names.
      paths: initializer name -> its path in `params` ("/"-joined).
      shared: the parameters read by nodes of different layers (see the module's
        docstring), as path -> the reading nodes' names.
      opset: the default domain's opset of the file.
    """

    def __init__(self, graph, constants, paths, shared, opset):
        self.graph, self.constants = graph, constants
        self.inputs = [i.name for i in graph.input if i.name not in constants
                       and i.name not in paths]
        self.outputs = [o.name for o in graph.output]
        self.paths = {n: "/".join(p) for n, p in paths.items()}
        self._parts = paths
        self.shared, self.opset = shared, opset
        self._nodes = [(n, _attrs(n)) for n in graph.node]

    def __repr__(self) -> str:
        return (f"OnnxFunction({self.graph.name!r}, {len(self._nodes)} nodes, inputs "
                f"{self.inputs}, outputs {self.outputs})")

    def __call__(self, params, *inputs):
        if len(inputs) != len(self.inputs):
            raise TypeError(f"the ONNX graph takes {len(self.inputs)} inputs "
                            f"({', '.join(self.inputs)}), got {len(inputs)}")
        values: dict[str, Any] = dict(self.constants)
        for name, parts in self._parts.items():
            node = params
            try:
                for k in parts:
                    node = node[k]
            except (KeyError, TypeError):
                raise KeyError(f"params has no '{'/'.join(parts)}' (the ONNX initializer "
                               f"{name!r})") from None
            values[name] = node
        for name, x in zip(self.inputs, inputs):
            if np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype).kind in "OSU":
                raise NotImplementedError(f"the ONNX graph's input {name!r} holds strings, "
                                          f"which JAX arrays cannot")
            x = jnp.asarray(x)  # data, never folded as a constant
            values[name] = x.astype(jnp.int32) if x.dtype == jnp.int64 else x
        for node, attrs in self._nodes:
            args = [values[i] if i else None for i in node.input]
            while args and args[-1] is None:
                args.pop()
            op = OPS[node.op_type]
            try:
                if node.op_type in MULTI_OUTPUT:
                    out = op(attrs, *args, outputs=len(node.output))
                else:
                    out = op(attrs, *args)
            except NotImplementedError as e:
                raise NotImplementedError(f"ONNX node {node.name or node.op_type!r} "
                                          f"({node.op_type}): {e}") from None
            outs = out if isinstance(out, tuple) else (out,)
            extra = [name for name in node.output[len(outs):] if name]
            if extra:
                raise NotImplementedError(
                    f"ONNX node {node.name or node.op_type!r} ({node.op_type}): its output(s) "
                    f"{', '.join(extra)} (after the first {len(outs)}) are not computed by "
                    f"pockjax.onnx")
            for name, value in zip(node.output, outs):
                if name:
                    values[name] = value
        got = [jnp.asarray(values[o]) for o in self.outputs]
        return got[0] if len(got) == 1 else tuple(got)


def load(model) -> tuple[dict, OnnxFunction]:
    """`(params, apply)` for an ONNX model.

    Args:
      model: a path to an `.onnx` file (its external data read from beside it), or an
        `onnx.ModelProto`.

    Returns:
      A pair `(params, apply)`: the float initializers as a nested dict of JAX arrays
        (their layouts registered, see the module's docstring), and the `OnnxFunction`.

    Raises:
      ImportError: the onnx package is missing.
      FileNotFoundError: `model` is a path that does not exist.
      ValueError: the file is not an ONNX model, its opset is below 13, or it has no
        float initializers to train.
      NotImplementedError: the graph uses operators `pockjax.onnx` does not run (all of
        them listed, with the nodes), or another domain's.
    """
    onnx = _onnx()
    from onnx import numpy_helper

    from pockjax.scheme import register_layouts

    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.is_file():
            raise FileNotFoundError(f"no ONNX file at '{path}'")
        try:
            model = onnx.load(str(path))
        except Exception as e:
            raise ValueError(f"'{path}' is not an ONNX model that onnx can read: {e}") from None
    if not isinstance(model, onnx.ModelProto):
        raise TypeError(f"pockjax.onnx.load takes a path or an onnx.ModelProto, got "
                        f"{type(model).__name__}")
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                default=0)
    if opset < MIN_OPSET:
        raise ValueError(f"the ONNX model's opset is {opset}; pockjax.onnx runs opset "
                         f"{MIN_OPSET} and later: convert it with "
                         f"onnx.version_converter.convert_version(model, {MIN_OPSET})")
    graph = model.graph
    missing: dict[str, list[str]] = {}
    for node in graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in OPS:
            key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            missing.setdefault(key, []).append(node.name or "?")
    if missing:
        listed = "; ".join(f"{op} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                           for op, names in sorted(missing.items()))
        raise NotImplementedError(f"the ONNX graph uses operators pockjax.onnx does not run: "
                                  f"{listed}. pockjax.onnx.OPS lists those it runs; add one "
                                  f"as OPS['Name'] = lambda attrs, *inputs: ...")
    floats, constants = {}, {}
    for init in graph.initializer:
        array = numpy_helper.to_array(init)
        if np.issubdtype(array.dtype, np.floating) and array.ndim > 0:
            floats[init.name] = array
        else:
            constants[init.name] = array
    if not floats:
        raise ValueError("the ONNX model has no float initializers: nothing to train")
    readers: dict[str, list] = {}
    for node in graph.node:
        for pos, name in enumerate(node.input):
            if name in floats:
                readers.setdefault(name, []).append((node, pos))
    parts = _nest(list(floats))
    params: dict = {}
    layouts = {}
    for name, array in floats.items():
        node = params
        for k in parts[name][:-1]:
            node = node.setdefault(k, {})
        node[parts[name][-1]] = jnp.asarray(array)
        if array.ndim >= 2:
            layouts["/".join(parts[name])] = _layout(readers.get(name, []), array.ndim)
    shared = {}
    for name, rs in readers.items():
        # A torch export names a node by its module ("/h.0/ln_1/LayerNormalization"):
        # readers in different modules; others ("node_layer_norm_1"): different nodes.
        scopes = {(n.name or "?").rsplit("/", 1)[0] for n, _ in rs}
        if len(rs) > 1 and len(scopes) > 1:
            shared["/".join(parts[name])] = [n.name for n, _ in rs]
    if shared:
        shown = "; ".join(f"'{p}' by {', '.join(n[:3])}" for p, n in list(shared.items())[:5])
        warnings.warn(f"pockjax.onnx: {len(shared)} parameter(s) are read by nodes of "
                      f"different layers ({shown}): the exporter may have merged equal-valued "
                      f"tensors, and each trains as one tensor for all its readers (a tie); "
                      f"apply.shared lists them", UserWarning, stacklevel=2)
    register_layouts(params, layouts, ONNX_NOTE)
    return params, OnnxFunction(graph, constants, parts, shared, opset)
