"""Trees of stored weights: the `Quantized` pytree node, `quantize` (a tree, by a
scheme's decisions), `store_leaf` / `quantize_leaf` (one weight), `dequantize`, `in_words`
(the node's arrays as 32-bit words) and byte counts. The formats' arithmetic is
`pockjax.lowbit._formats`'s.

The node's arrays sit at `weight/@data`, `weight/@scale`, `weight/@zero` and
`weight/@master`; this module registers those keys with `pockjax.scheme`
(`register_stored_parts`), so a scheme matches them by the weight's own path.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from pockjax.lowbit._blocks import Blocks
from pockjax.lowbit._formats import (Cast, Int4, Int8, QuantizeError, bf16_to_words,
                                     dequantize_stored, format_of, int4_codes, int8_codes,
                                     to_words)
from pockjax.scheme import (Channels, Frozen, Scheme, layouts_of, leaves_with_paths, path_str,
                            register_stored_parts)


@jax.tree_util.register_pytree_with_keys_class
class Quantized:
    """A weight stored in a low-bit format: `data` (int8: the values, or for int4 the bit
    patterns of bytes holding two 4-bit values each; for a `Cast` format the weight in
    its narrow dtype, with no scales), `scale` and, for `Int4(zero_point=True)`, `zero`;
    `shape` and `dtype` are the float weight's (the dtype it is computed in), `axis` its
    input axis. A pytree node: its arrays are the leaves (paths `weight/@data`,
    `weight/@scale`, `weight/@zero`), so it goes through `jit`, checkpoints and the
    trainer's state like any parameters. With `words` (made by `in_words`), `data` and
    `zero` hold their bytes as int32 words of 4 and the scales are float32.

    A weight part of which trains (a `pockjax.Channels` decision) also holds `master`
    (`weight/@master`): the trained channels at full precision, `channels` =
    `(axis, start, count)` saying where they sit. They replace the stored values of
    those channels wherever the weight is read, so the trained slice is never rounded
    to the low-bit format; the scheme trains `@master` and freezes the rest.
    """

    def __init__(self, data, scale, zero=None, *, fmt, shape, dtype, axis, words=False,
                 master=None, channels=None):
        self.data, self.scale, self.zero = data, scale, zero
        self.fmt, self.shape, self.dtype, self.axis = fmt, tuple(shape), jnp.dtype(dtype), axis
        self.words = words  # data and zero as int32 words of 4 bytes each (`in_words`)
        self.master = master
        self.channels = None if channels is None else tuple(int(c) for c in channels)

    def _keys(self) -> tuple[str, ...]:
        # A Cast format stores the weight itself (`data`): no scales.
        return (("@data",) + (() if isinstance(self.fmt, Cast) else ("@scale",))
                + (("@zero",) if self.zero is not None else ())
                + (("@master",) if self.channels is not None else ()))

    def _children(self):
        fields = {"@data": self.data, "@scale": self.scale, "@zero": self.zero,
                  "@master": self.master}
        return tuple(fields[k] for k in self._keys())

    def _aux(self):
        return (self.fmt, self.shape, self.dtype, self.axis, self.zero is not None,
                self.channels, self.words)

    def tree_flatten_with_keys(self):
        return ([(jax.tree_util.GetAttrKey(k), c) for k, c in zip(self._keys(), self._children())],
                self._aux())

    def tree_flatten(self):
        return self._children(), self._aux()

    @classmethod
    def tree_unflatten(cls, aux, children):
        fmt, shape, dtype, axis, has_zero, channels, words = aux
        children = list(children)
        data = children.pop(0)
        scale = None if isinstance(fmt, Cast) else children.pop(0)
        zero = children.pop(0) if has_zero else None
        master = children.pop(0) if channels is not None else None
        return cls(data, scale, zero, fmt=fmt, shape=shape, dtype=dtype, axis=axis,
                   words=words, master=master, channels=channels)

    def replace(self, **changes) -> "Quantized":
        """A copy with some arrays changed (`data`, `scale`, `zero`, `master`; `shape`
        for a piece of the weight)."""
        fields = dict(data=self.data, scale=self.scale, zero=self.zero, master=self.master,
                      shape=self.shape)
        fields.update(changes)
        return Quantized(fields["data"], fields["scale"], fields["zero"], fmt=self.fmt,
                         shape=tuple(fields["shape"]), dtype=self.dtype, axis=self.axis,
                         words=self.words, master=fields["master"], channels=self.channels)

    @property
    def data_shape(self) -> tuple[int, ...]:
        """The shape of the stored bytes (int4: two values a byte along the input axis;
        GGUF blocks: each block's bytes other than its scale along it)."""
        if isinstance(self.fmt, Blocks):
            n = self.shape[self.axis] // self.fmt.block_size * (self.fmt.type_size - 2)
            return self.shape[:self.axis] + (n,) + self.shape[self.axis + 1:]
        if not isinstance(self.fmt, Int4):
            return self.shape
        return self.shape[:self.axis] + (self.shape[self.axis] // 2,) + self.shape[self.axis + 1:]

    @property
    def nbytes(self) -> int:
        """Bytes stored (data, scales, zero points and a trained slice's master)."""
        return sum(int(np.prod(c.shape)) * jnp.dtype(c.dtype).itemsize for c in self._children())

    def dequantize(self, dtype=None) -> jax.Array:
        """The float weight (in `dtype`, default the weight's own)."""
        return dequantize(self, dtype)

    def __repr__(self) -> str:
        group = f", group={self.fmt.group}" if isinstance(self.fmt, Int4) else ""
        trained = ""
        if self.channels is not None:
            axis, start, count = self.channels
            trained = f", trained=axis {axis} [{start}:{start + count}]"
        return f"Quantized({self.fmt.name}, shape={self.shape}{group}{trained})"


# A scheme matches the node's arrays by the weight's own path; `@master` holds the
# channels a `Channels` decision trains.
register_stored_parts(("@data", "@scale", "@zero", "@master"), trained="@master",
                      made_by="pockjax.lowbit.quantize(params, scheme, ...)")


def is_quantized(x) -> bool:
    """Whether `x` is a `Quantized` node (for `jax.tree` functions' `is_leaf=`)."""
    return isinstance(x, Quantized)


def stored_bytes(params) -> int:
    """Bytes `params` takes as stored (`Quantized` nodes at their packed size)."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(params))


def quantize_leaf(w, fmt, *, axis: int = -2, path: str = "weight", dtype=None, channels=None):
    """`w` (a float array of rank >= 2) stored in `fmt` (a format or its name).

    Args:
      w: the weight.
      fmt: a format or its name (`format_of`); None or "float32" returns `w` as it is.
      axis: `w`'s input axis (-2 for JAX's `[in, out]` kernels, 1 for a torch Linear's
        `[out, in]`).
      path: the weight's name, for errors.
      dtype: the float dtype it dequantizes to (default `w`'s).
      channels: for a weight part of which trains, its resolved `pockjax.Channels`
        decision (`Scheme.resolve`) or `(axis, start, count)`: those channels are kept
        as a float32 master (`Quantized.master`) and the rest is stored in `fmt`.

    Returns:
      A `Quantized` node.

    Raises:
      QuantizeError: `w` is not floating or has rank < 2, its input axis does not split
        into `Int4` groups, or `channels` does not fit `w` (named by `path`).
    """
    fmt = format_of(fmt)
    w = jnp.asarray(w)
    if fmt is None:
        return w
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise QuantizeError(f"'{path}' is {w.dtype}; only floating weights are quantized")
    if channels is not None:
        q = quantize_leaf(w, fmt, axis=axis, path=path, dtype=dtype)
        where = _channel_range(channels, w.shape, path)
        ch_axis, start, count = where
        master = jax.lax.slice_in_dim(w, start, start + count, axis=ch_axis)
        master = master.astype(jnp.promote_types(w.dtype, jnp.float32))
        return Quantized(q.data, q.scale, q.zero, fmt=q.fmt, shape=q.shape, dtype=q.dtype,
                         axis=q.axis, master=master, channels=where)
    if isinstance(fmt, Blocks):
        raise QuantizeError(f"'{path}': {fmt.name} is a GGUF file's own block format, kept "
                            f"as read (pockjax.gguf); choose int8, int4 or a float format "
                            f"to quantize a float weight")
    if w.ndim < 2:
        raise QuantizeError(f"'{path}' has shape {w.shape}: {fmt.name} needs a weight of rank "
                            f">= 2 (an input axis and output channels); keep vectors as they are")
    axis %= w.ndim
    out_dtype = w.dtype if dtype is None else jnp.dtype(dtype)
    if isinstance(fmt, Cast):
        return Quantized(w.astype(fmt.dtype), None, fmt=fmt, shape=w.shape, dtype=out_dtype,
                         axis=axis)
    if isinstance(fmt, Int8):
        data, scale = int8_codes(w, axis, fmt.scale_dtype)
        return Quantized(data, scale, fmt=fmt, shape=w.shape, dtype=out_dtype, axis=axis)
    n = w.shape[axis]
    # The largest even group of at most `fmt.group` values that divides the input axis.
    group = next((g for g in range(min(fmt.group, n), 1, -1) if n % g == 0 and g % 2 == 0), 0)
    if not group:
        raise QuantizeError(f"'{path}' has {n} values on its input axis {axis} (shape {w.shape}): "
                            f"int4 packs pairs of values along it, so it needs an even size; "
                            f"use 'int8' for this leaf")
    data, scale, zero = int4_codes(w, axis, group, fmt.zero_point, fmt.scale_dtype)
    return Quantized(data, scale, zero, fmt=fmt, shape=w.shape, dtype=out_dtype, axis=axis)


def _channel_range(channels, shape, path: str) -> tuple[int, int, int]:
    """`(axis, start, count)` of a resolved `Channels` decision or such a tuple."""
    if isinstance(channels, tuple):
        axis, start, count = channels
    else:
        axis, count = channels.axis, channels.count
        if not isinstance(axis, int) or count is None:
            raise QuantizeError(f"'{path}': {channels!r} is not resolved; pass the decision "
                                f"Scheme.resolve gives for this weight")
        start = shape[axis] - count if channels.last else 0
    axis %= len(shape)
    if not (0 <= start and 0 < count and start + count <= shape[axis]):
        raise QuantizeError(f"'{path}' has {shape[axis]} channels on axis {axis} (shape "
                            f"{shape}); channels {start}:{start + count} do not fit")
    return axis, int(start), int(count)


def dequantize(q, dtype=None) -> jax.Array:
    """The float weight a `Quantized` node stores (in `dtype`, default its own), its
    trained channels (`master`) in place; a plain array is returned as it is (cast to
    `dtype` when given)."""
    if not isinstance(q, Quantized):
        return q if dtype is None else jnp.asarray(q).astype(dtype)
    dtype = q.dtype if dtype is None else jnp.dtype(dtype)
    w = dequantize_stored(q, dtype)
    if q.channels is None:
        return w
    axis, start, count = q.channels
    n = q.shape[axis]
    parts = [jax.lax.slice_in_dim(w, 0, start, axis=axis)] if start else []
    parts.append(q.master.astype(dtype))
    if start + count < n:
        parts.append(jax.lax.slice_in_dim(w, start + count, n, axis=axis))
    return jax.lax.concatenate(parts, axis) if len(parts) > 1 else parts[0]


def in_words(tree):
    """`tree` with each `Quantized` node stored for GPUs whose buffers hold only 32-bit
    values (Vulkan's baseline profiles; IREE's SPIR-V code cannot load bfloat16): its
    bytes (values, zero points) as int32 words of 4, or a bfloat16 weight's values as
    int32 words of 2, unpacked with shifts where the weight is used, and its scales as
    float32. The weights it dequantizes to are equal,
    bit for bit. `pockjax.export` does this for Vulkan targets; other leaves are
    returned as they are.

    Args:
      tree: a pytree that may hold `Quantized` nodes (concrete arrays).

    Returns:
      The same tree, its `Quantized` nodes with `words` set: bfloat16 weights two values
      a word (unpacked with a shift or a mask each); float16 ones as they are (Vulkan
      targets do not take them).
    """
    def convert(q):
        if not isinstance(q, Quantized) or q.words:
            return q
        if isinstance(q.fmt, Cast):
            if jnp.dtype(q.fmt.dtype) != jnp.bfloat16:
                return q
            data = None if q.data is None else jnp.asarray(bf16_to_words(q.data))
            children = [data] + ([q.master] if q.channels is not None else [])
            return Quantized.tree_unflatten(q._aux()[:-1] + (True,), children)
        # A node whose arrays are None (an optimizer state's mask of a frozen weight)
        # changes only its structure, which must match the parameters'.
        words = lambda a: None if a is None else jnp.asarray(to_words(a))  # noqa: E731
        children = [words(q.data), None if q.scale is None else jnp.asarray(q.scale, jnp.float32)]
        children += [words(q.zero)] if q.zero is not None else []
        children += [q.master] if q.channels is not None else []
        return Quantized.tree_unflatten(q._aux()[:-1] + (True,), children)

    return jax.tree_util.tree_map(convert, tree, is_leaf=is_quantized)


def formats_by_path(formats) -> Callable[[str], Any]:
    """`path -> format or None` for `formats`: one format for every path, or a dict of
    path patterns (a scheme's globs, first match wins) to formats.

    Raises:
      QuantizeError: an unknown format name.
    """
    if isinstance(formats, Mapping):
        rules = Scheme({pattern: Frozen() for pattern in formats}, default=Frozen())
        chosen = [format_of(f) for f in formats.values()]
        return lambda path: next((f for f, rx in zip(chosen, rules._regex) if rx.match(path)),
                                 None)
    single = format_of(formats)
    return lambda path: single


def quantize(params, scheme=None, formats: Any = "int8", *, layouts: Mapping | None = None,
             dtype=None):
    """`params` with the leaves `scheme` freezes stored in low precision.

    Args:
      params: a pytree of float arrays (a model's parameters).
      scheme: a `pockjax.Scheme` (or Schedule's scheme); its frozen leaves are stored in
        `formats`, the others stay as they are. None: every leaf of rank >= 2.
      formats: a format (a name in `FORMATS`, `"int4:GROUP"`, or a `Cast` / `Int8` /
        `Int4`), or a dict of path patterns (the scheme's globs, first match wins) to
        formats; a leaf no pattern matches, or matched to None / "float32", stays.
      layouts: `{path: {"in": axis, "out": axis}}` for leaves whose input axis is not -2
        (default: the layouts registered for `params`, e.g. by `pockjax.torch`).
      dtype: the float dtype a quantized weight is dequantized to inside the step
        (default: the leaf's own; float32 for a model stored in bfloat16 but computed in
        float32).

    Returns:
      The same tree with each chosen leaf replaced by a `Quantized` node. A leaf the
      scheme trains in part (`Channels`) becomes a node holding its trained channels as
      a float32 master (`quantize_leaf`'s `channels`). Vectors (rank < 2) stay as they
      are.

    Raises:
      QuantizeError: a format does not fit a leaf (see `quantize_leaf`), an unknown
        format name, or `params` holds `Quantized` nodes already.
    """
    stored = [path_str(p) for p, x in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=is_quantized)[0] if is_quantized(x)]
    if stored:
        raise QuantizeError(f"{stored[0]!r} is stored already ({len(stored)} weights are): "
                            f"quantize the float weights (`dequantize` gives them back)")
    named, treedef = leaves_with_paths(params)
    if scheme is None:
        decisions = [Frozen()] * len(named)
    else:
        decisions = jax.tree_util.tree_leaves(scheme.resolve(params),
                                              is_leaf=lambda d: d is not None and not isinstance(d, dict))
    chooser = formats_by_path(formats)
    known = layouts_of(params)[0] if layouts is None else dict(layouts)
    out = []
    for (path, leaf), d in zip(named, decisions):
        layout = known.get(path)
        axis = layout["in"] if isinstance(layout, Mapping) else -2
        out.append(store_leaf(leaf, d, chooser(path), axis=axis, path=path, dtype=dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def store_leaf(leaf, decision, fmt, *, axis: int = -2, path: str = "weight", dtype=None):
    """One leaf as `quantize` stores it, given its resolved scheme decision: a frozen
    floating leaf of rank >= 2 in `fmt`; one that trains in part (`Channels`) in `fmt`
    with its trained channels as a float32 master; anything else (a leaf that trains, a
    vector, `fmt` None) as it is. Loaders that read a model tensor by tensor store each
    weight with it.

    Args:
      leaf: the array.
      decision: its `Full`, `Frozen` or resolved `Channels` decision (`Scheme.resolve`).
      fmt: the format chosen for its path, or None.
      axis: its input axis.
      path: its name, for errors.
      dtype: the float dtype it dequantizes to (default its own).

    Returns:
      A `Quantized` node, or `leaf`.

    Raises:
      QuantizeError: the format does not fit the leaf (see `quantize_leaf`).
    """
    part = isinstance(decision, Channels)
    fmt = format_of(fmt) if isinstance(decision, Frozen) or part else None
    if fmt is None or np.ndim(leaf) < 2 or not jnp.issubdtype(jnp.asarray(leaf).dtype,
                                                              jnp.floating):
        return leaf
    return quantize_leaf(leaf, fmt, axis=axis, path=path, dtype=dtype,
                         channels=decision if part else None)


def store_frozen_leaf(leaf, decision, fmt, *, narrow, trained_dtype=jnp.float32,
                      path: str = "weight"):
    """One leaf as a mixed-precision fine-tuning step holds it: a frozen weight (or one
    trained in part) as `store_leaf` stores it in `fmt`; any other frozen leaf (a norm's
    vector) a plain `narrow` array; a trained leaf a `trained_dtype` master. Loaders
    that read a model tensor by tensor and `cast_frozen` on a whole tree store each
    leaf with it.

    Args:
      leaf: the array (or `jax.ShapeDtypeStruct` under `jax.eval_shape`).
      decision: its resolved decision (`Full`, `Frozen` or `Channels`).
      fmt: the stored weights' format, or None to keep frozen weights as `narrow` arrays.
      narrow: the dtype of frozen leaves that are not stored in `fmt`.
      trained_dtype: the dtype of trained leaves, and of what a stored weight dequantizes
        to (default float32).
      path: its name, for errors.

    Returns:
      A `Quantized` node, or the leaf in `narrow` or `trained_dtype` (as it is where it
      has that dtype already).

    Raises:
      QuantizeError: the format does not fit the leaf (see `quantize_leaf`).
    """
    stored = store_leaf(leaf, decision, fmt, path=path, dtype=trained_dtype)
    if is_quantized(stored):
        return stored
    want = jnp.dtype(narrow if isinstance(decision, Frozen) else trained_dtype)
    return leaf if leaf.dtype == want else leaf.astype(want)
