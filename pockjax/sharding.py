"""Sparse training on JAX's SPMD engine: data-parallel and FSDP-style layouts.

`sparse_train(..., mesh=mesh)` trains on every device of a `jax.sharding.Mesh`:

    mesh = jax.make_mesh((4,), ("data",))
    trainer = pj.sparse_train(loss, optimizer=..., scheme=..., mesh=mesh,
                              data_axis="data", param_axis="data")

- the batch is split along its leading dimension over `data_axis`;
- parameters are replicated (`param_axis=None`) or sharded FSDP-style over
  `param_axis`: each one along its largest dimension that the axis divides, never
  the axis a `Channels` decision slices, so the kept slice is split the same way
  and its in-place update stays on each device (no gather of the weight); the
  step reads each weight gathered and reduces each gradient into its layout;
- optimizer state follows the trainable view's sharding;
- `param_specs` overrides the layout of any parameter (tensor parallelism, ...),
  `batch_specs` that of any batch leaf (`P()` replicates it).

How one weight is laid out (on 4 devices, as the tests run):

Examples:
  >>> import jax, pockjax as pj
  >>> from pockjax.sharding import Layout
  >>> layout = Layout(jax.make_mesh((4,), ("data",)), param_axis="data")
  >>> layout.param_spec("up/kernel", (512, 2048))             # the largest dimension
  P(None, 'data')
  >>> keep = pj.Channels(count=256, axis=1)                    # its output channels train
  >>> layout.param_spec("up/kernel", (512, 2048), keep)       # so split the input axis
  P('data',)
  >>> layout.param_spec("norm/scale", (6,))                   # 4 does not divide 6
  P()

`jax.make_mesh` gives Explicit axes by default; the step runs on the same devices
and axis names in Auto mode, which lets XLA's SPMD partitioner place the
collectives. The partitioning itself (gathers, gradient reductions) is XLA's SPMD partitioner's;
this module only decides the layouts and reads back what the compiled step does
(`collectives`).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from pockjax.scheme import Channels, Frozen, leaves_with_paths, path_str

__all__ = ["Layout", "Collective", "collectives"]

AxisName = str | tuple[str, ...] | None
ParamSpecs = Callable[[str, tuple[int, ...]], P | None] | Mapping[str, P] | None


def _axis_tuple(axis: AxisName) -> tuple[str, ...]:
    if axis is None:
        return ()
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _spec(entries) -> P:
    """A PartitionSpec without trailing `None`s: the form XLA hands back, so a
    step's outputs compare equal to its inputs and it is not compiled again."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _axis_entry(names: tuple[str, ...]):
    """A PartitionSpec entry for one array dimension split over `names`."""
    return names[0] if len(names) == 1 else names


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a training step's arrays live on `mesh` (see the module docstring).

    A mesh with axes that are not in Auto mode is replaced by one with the same devices
    and axis names in Auto mode.

    Attributes:
      mesh: the `jax.sharding.Mesh` the step runs on.
      data_axis: the mesh axis (or tuple of axes) the batch's leading dimension is
        split over (default `"data"`); None replicates the batch.
      param_axis: the mesh axis (or tuple of axes) parameters are sharded over,
        FSDP-style; None (the default) replicates them.
      param_specs: layouts of chosen parameters: `{path: PartitionSpec}` or a function
        of `(path, shape)` returning a `PartitionSpec` or None (None: the default
        layout); None (the default): none.
      batch_specs: layouts of chosen batch leaves, in the same forms (`P()` replicates
        a leaf); None (the default): none.

    Raises:
      TypeError: `mesh` is not a `jax.sharding.Mesh`.
      ValueError: `data_axis` or `param_axis` names an axis the mesh does not have.
    """

    mesh: Mesh
    data_axis: AxisName = "data"
    param_axis: AxisName = None
    param_specs: ParamSpecs = None
    batch_specs: ParamSpecs = None

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((4,), ('data',))), "
                            f"got {type(self.mesh).__name__}")
        for name, axis in (("data_axis", self.data_axis), ("param_axis", self.param_axis)):
            for a in _axis_tuple(axis):
                if a not in self.mesh.shape:
                    raise ValueError(f"{name}={axis!r} is not an axis of the mesh; its axes are "
                                     f"{tuple(self.mesh.axis_names)}")
        # The step is partitioned by XLA (GSPMD): every axis in Auto mode. The same
        # devices and names, so arrays laid out on the caller's mesh need no copy.
        if any(t != AxisType.Auto for t in self.mesh.axis_types):
            auto = Mesh(self.mesh.devices, self.mesh.axis_names,
                        axis_types=(AxisType.Auto,) * len(self.mesh.axis_names))
            object.__setattr__(self, "mesh", auto)

    # -- sizes -----------------------------------------------------------------

    def axis_size(self, axis: AxisName) -> int:
        """The number of devices along mesh axes.

        Args:
          axis: an axis name, a tuple of names, or None.

        Returns:
          The product of the axes' sizes (1 for None).
        """
        return math.prod(self.mesh.shape[a] for a in _axis_tuple(axis))

    @property
    def replicated(self) -> NamedSharding:
        """A `NamedSharding` that replicates an array on every device of the mesh."""
        return NamedSharding(self.mesh, P())

    # -- parameters ------------------------------------------------------------

    def _user_spec(self, path: str, shape: tuple[int, ...], specs=None, name="param_specs") -> P | None:
        specs = self.param_specs if specs is None and name == "param_specs" else specs
        if specs is None:
            return None
        spec = specs(path, shape) if callable(specs) else specs.get(path)
        what = "parameter" if name == "param_specs" else "batch leaf"
        if spec is not None and not isinstance(spec, P):
            raise TypeError(f"{name} gave {spec!r} for {what} '{path}'; expected a "
                            f"jax.sharding.PartitionSpec or None")
        if spec is not None and len(spec) > len(shape):
            raise ValueError(f"{name} gave {spec} for {what} '{path}' of shape {shape}: "
                             f"more entries than dimensions")
        return spec

    def param_spec(self, path: str, shape: Sequence[int], decision=None) -> P:
        """The PartitionSpec of one parameter.

        A `param_specs` layout wins; otherwise the parameter is split over `param_axis`
        along its largest dimension that the axis size divides, never the dimension a
        `Channels` decision slices, and replicated when there is none.

        Args:
          path: the parameter's "/"-joined path.
          shape: its shape.
          decision: its resolved decision; None (the default) avoids no dimension.

        Returns:
          The `PartitionSpec`, without trailing `None`s.

        Raises:
          TypeError: `param_specs` gave something other than a `PartitionSpec` or None.
          ValueError: `param_specs` gave more entries than the parameter has dimensions.
        """
        shape = tuple(int(s) for s in shape)
        user = self._user_spec(path, shape)
        if user is not None:
            return _spec(user)
        names = _axis_tuple(self.param_axis)
        n = self.axis_size(self.param_axis)
        if not names or n == 1 or not shape:
            return P()
        # Never along the axis a Channels decision slices: the kept slice then holds a
        # part of every shard, and its update stays on the devices that own it.
        avoid = decision.axis if isinstance(decision, Channels) else None
        fits = [d for d, s in enumerate(shape) if s % n == 0 and s >= n and d != avoid]
        if not fits:
            return P()
        best = max(fits, key=lambda d: (shape[d], -d))  # the largest dimension
        entries = [None] * len(shape)
        entries[best] = _axis_entry(names)
        return _spec(entries)

    def param_shardings(self, params, decisions) -> Any:
        """The sharding of every parameter (see `param_spec`).

        Args:
          params: the parameter pytree (arrays or `jax.ShapeDtypeStruct`s).
          decisions: the resolved decision of each leaf, in flattening order.

        Returns:
          A tree with the structure of `params` holding a `NamedSharding` per leaf.
        """
        named, treedef = leaves_with_paths(params)
        out = [NamedSharding(self.mesh, self.param_spec(p, np.shape(x), d))
               for (p, x), d in zip(named, decisions)]
        return jax.tree_util.tree_unflatten(treedef, out)

    def gathered(self, spec: P) -> NamedSharding:
        """`spec` with the parameter axis taken out: how the step reads a weight.

        Args:
          spec: a parameter's `PartitionSpec`.

        Returns:
          A `NamedSharding` on the mesh with `param_axis` removed from every entry.
        """
        drop = set(_axis_tuple(self.param_axis))

        def keep(entry):
            names = tuple(n for n in _axis_tuple(entry) if n not in drop)
            return _axis_entry(names) if names else None

        return NamedSharding(self.mesh, _spec(keep(e) for e in spec))

    def compiler_options(self) -> dict | None:
        """The XLA options a step on this mesh is compiled with (`jax.jit`'s
        `compiler_options`), or None for XLA's own.

        On CPU devices, two of XLA's CPU defaults undo a sharded step's memory saving:
        its concurrency-optimized scheduler gathers every weight at the start of the
        step, and its all-reduce combiner merges every gradient's reduction into one at
        the end, so every full-size gradient is alive at once. Both are turned off there
        (the memory-optimized scheduler instead); other platforms schedule and combine
        collectives against a memory limit of their own. Measured on LLaMA-2-7B's int4
        step over 4 devices (8 x 128 tokens), temporaries per device: 4.8 GiB with
        XLA's defaults, 2.4 GiB with the scheduler alone, 0.49 GiB with both changes
        and the backward pass's second gathers (`fused.regather`).
        """
        if self.mesh.devices.flat[0].platform != "cpu":
            return None
        return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
                "xla_disable_hlo_passes": "cpu-all-reduce-combiner"}

    def gathered_shardings(self, params, decisions) -> list:
        """Per leaf of `params`, in flattening order, `(its sharding, the sharding an FSDP
        step reads it in)`: its layout, and that layout with the parameter axis taken
        out (gathered; other axes of a `param_specs` layout stay split); or None where
        its layout has no `param_axis` entry (read as it is).

        Args:
          params: the parameter pytree (arrays, tracers or shapes).
          decisions: the resolved decision of each leaf, in flattening order.

        Returns:
          A list with a pair of `NamedSharding`s or None per leaf.
        """
        out = []
        for (path, x), d in zip(leaves_with_paths(params)[0], decisions):
            spec = self.param_spec(path, np.shape(x), d)
            whole = self.gathered(spec)
            out.append(None if whole.spec == spec else (NamedSharding(self.mesh, spec), whole))
        return out

    def read_gathered(self, params, decisions) -> Any:
        """`params` as an FSDP step reads them: each constrained to its
        `gathered_shardings` entry. Call inside the traced step.

        Args:
          params: the parameter pytree (traced values).
          decisions: the resolved decision of each leaf, in flattening order.

        Returns:
          A tree like `params`, each leaf constrained to its gathered sharding (or as it
            is when its layout has no `param_axis` entry).
        """
        leaves, treedef = jax.tree_util.tree_flatten(params)
        out = [x if s is None else jax.lax.with_sharding_constraint(x, s[1])
               for x, s in zip(leaves, self.gathered_shardings(params, decisions))]
        return jax.tree_util.tree_unflatten(treedef, out)

    def view_shardings(self, params, decisions) -> Any:
        """Shardings of the trainable view (`None` for frozen leaves): a kept slice is
        split like its weight, unless the slice is on the split dimension and uneven.

        Args:
          params: the parameter pytree.
          decisions: the resolved decision of each leaf, in flattening order.

        Returns:
          A tree with the structure of `params`: `None` for a Frozen leaf, a
            `NamedSharding` for a trained one.
        """
        named, treedef = leaves_with_paths(params)
        out = []
        for (p, x), d in zip(named, decisions):
            if isinstance(d, Frozen):
                out.append(None)
                continue
            spec = self.param_spec(p, np.shape(x), d)
            if isinstance(d, Channels) and d.axis < len(spec) and spec[d.axis] is not None:
                # A param_specs layout split along the sliced axis: the slice is
                # split the same way when it divides evenly, else kept whole.
                if d.count % self.axis_size(spec[d.axis]):
                    spec = _spec(None if i == d.axis else e for i, e in enumerate(spec))
            out.append(NamedSharding(self.mesh, spec))
        return jax.tree_util.tree_unflatten(treedef, out)

    def opt_state_shardings(self, optimizer, view_avals, view_shardings, opt_state_avals) -> Any:
        """Optimizer state follows the trainable view: moments are split like their
        parameter, counters and scalars are replicated.

        A state that `optax.tree_map_params` cannot map back to the parameters is
        matched by shape: a leaf with the shape of view arrays that all have one
        sharding gets that sharding; any other leaf is replicated.

        Args:
          optimizer: the optax `GradientTransformation`.
          view_avals: the trainable view's shapes (`None` for frozen leaves).
          view_shardings: the trainable view's shardings (`view_shardings`).
          opt_state_avals: the optimizer state's shapes.

        Returns:
          A tree with the structure of `opt_state_avals` holding a `NamedSharding` per
            leaf.
        """
        try:
            return optax.tree_map_params(
                optimizer, lambda _, s: s, opt_state_avals, view_shardings,
                transform_non_params=lambda _: self.replicated,
                is_leaf=lambda x: x is None)
        except Exception:
            # A state optax cannot map back to parameters: match leaves by shape.
            by_shape: dict = {}
            for a, s in zip(jax.tree_util.tree_leaves(view_avals),
                            jax.tree_util.tree_leaves(view_shardings)):
                by_shape.setdefault(tuple(a.shape), set()).add(s)
            return jax.tree_util.tree_map(
                lambda a: next(iter(by_shape[tuple(a.shape)]))
                if len(by_shape.get(tuple(a.shape), ())) == 1 else self.replicated,
                opt_state_avals)

    # -- the batch -------------------------------------------------------------

    def batch_shardings(self, batch, *, per_process: bool = False) -> Any:
        """The leading dimension of every array in the batch split over `data_axis`.

        With `per_process=True` the batch is one process's part of the global batch
        (multi-host training), which its own devices on the axis must divide.

        A `batch_specs` layout wins; a scalar leaf, or any leaf without `data_axis`, is
        replicated.

        Args:
          batch: the batch pytree (arrays or `jax.ShapeDtypeStruct`s).
          per_process: the batch is this process's part of the global batch (default
            False).

        Returns:
          A tree with the structure of `batch` holding a `NamedSharding` per leaf.

        Raises:
          ValueError: the devices on `data_axis` do not divide a leaf's leading
            dimension, or `batch_specs` gave more entries than a leaf has dimensions.
          TypeError: `batch_specs` gave something other than a `PartitionSpec` or None.
        """
        names = _axis_tuple(self.data_axis)
        n = self.axis_size(self.data_axis)
        if per_process:
            n = max(1, n // jax.process_count())
        what = "devices of this process on" if per_process else "devices of"

        def one(path, x):
            shape = np.shape(x)
            spec = self._user_spec(path_str(path), shape, self.batch_specs, "batch_specs")
            if spec is not None:
                return NamedSharding(self.mesh, _spec(spec))
            if not names or not shape:
                return self.replicated
            if shape[0] % n:
                raise ValueError(
                    f"batch leaf '{path_str(path) or '<batch>'}' has leading dimension {shape[0]}, "
                    f"which the {n} {what} mesh axis {self.data_axis!r} do not divide; use a "
                    f"batch size that is a multiple of {n}")
            return NamedSharding(self.mesh, P(_axis_entry(names)))

        return jax.tree_util.tree_map_with_path(one, batch)

    def put_batch(self, batch):
        """Place a batch on the mesh. With several processes each passes its own part
        of the global batch (`jax.make_array_from_process_local_data`).

        Args:
          batch: the batch pytree (arrays, or `jax.Array`s already on the mesh).

        Returns:
          The batch as `jax.Array`s laid out by `batch_shardings`; an array already laid
            out that way is returned as it is.

        Raises:
          ValueError: as `batch_shardings` raises.
        """
        multi = jax.process_count() > 1

        def put(x, s):
            if isinstance(x, jax.Array) and (not x.is_fully_addressable or not multi):
                return x if x.sharding == s else jax.device_put(x, s)
            if multi:
                return jax.make_array_from_process_local_data(s, np.asarray(x))
            return jax.device_put(x, s)

        local = multi and not all(isinstance(x, jax.Array) and not x.is_fully_addressable
                                  for x in jax.tree_util.tree_leaves(batch))
        return jax.tree_util.tree_map(put, batch, self.batch_shardings(batch, per_process=local))

    def describe(self) -> str:
        """A one-line description for reports.

        Returns:
          The mesh's axes and devices, the batch axis and how parameters are laid out.
        """
        axes = ", ".join(f"{a}={s}" for a, s in self.mesh.shape.items())
        params = "replicated" if not _axis_tuple(self.param_axis) else f"sharded over {self.param_axis!r}"
        return (f"mesh ({axes}) on {self.mesh.devices.size} {self.mesh.devices.flat[0].platform} "
                f"devices; batch split over {self.data_axis!r}; parameters {params}")


def place(tree, shardings):
    """`jax.device_put` that leaves `None` leaves (frozen view entries) alone."""
    return jax.tree_util.tree_map(lambda x, s: x if s is None else jax.device_put(x, s), tree,
                                  shardings, is_leaf=lambda x: x is None)


def constrain(tree, shardings):
    return jax.tree_util.tree_map(
        lambda x, s: x if s is None else jax.lax.with_sharding_constraint(x, s), tree, shardings,
        is_leaf=lambda x: x is None)


# --------------------------------------------------------------------------- collectives

_COLLECTIVE = re.compile(
    r"=\s*(?P<shape>\([^=]*?\)|[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>all-reduce|reduce-scatter|all-gather|collective-permute|all-to-all)(?:-start)?\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective operation of a compiled step: its kind and result arrays.

    `str()` of it reads like HLO: `all-reduce(f32[512,2048])`.

    Attributes:
      op: `"all-reduce"`, `"reduce-scatter"`, `"all-gather"`, `"collective-permute"` or
        `"all-to-all"` (an asynchronous `-start` form counts as its operation).
      shapes: the shape of each result array.
      dtypes: the HLO element type of each result array (`"f32"`, `"bf16"`, ...).
    """

    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the result arrays (an element type this module does not know counts
        as 4 bytes)."""
        return sum(math.prod(s) * jnp.dtype(_np_dtype(d)).itemsize
                   for s, d in zip(self.shapes, self.dtypes))

    def __str__(self) -> str:
        arrays = ", ".join(f"{d}[{','.join(map(str, s))}]" for s, d in zip(self.shapes, self.dtypes))
        return f"{self.op}({arrays})"


def _np_dtype(hlo: str) -> str:
    return {"pred": "bool", "bf16": "bfloat16", "f16": "float16", "f32": "float32",
            "f64": "float64", "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64",
            "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64"}.get(hlo, "float32")


def collectives(compiled) -> list[Collective]:
    """The collective operations in a compiled step's optimized HLO (all-reduce,
    reduce-scatter, all-gather, collective-permute, all-to-all), in program order.

    Args:
      compiled: a compiled step (`jax.stages.Compiled`, read with `as_text()`), or its
        HLO text.

    Returns:
      A list of `Collective`s.
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    out = []
    for line in re.sub(r"/\*.*?\*/", "", text).splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        arrays = _ARRAY.findall(m.group("shape"))
        shapes = tuple(tuple(int(s) for s in dims.split(",") if s) for _, dims in arrays)
        out.append(Collective(m.group("op"), shapes, tuple(d for d, _ in arrays)))
    return out
