"""Checkpoints: a `TrainState` (or any pytree of arrays) as one safetensors file.

Tensors are named by their "/"-joined pytree paths ("params/blocks_0/attn/q/kernel",
"opt_state/0/mu/..."); the metadata holds the format, the step, the scheme as JSON and
a SHA-256 of the tensors (names, dtypes, shapes and bytes), checked on load, so damaged
data fails as loudly as a damaged header. Files are written to a temporary file in the
same directory and renamed into place, so a crash never leaves a half-written
checkpoint under the final name. Saving and loading hold one tensor beyond the state at a
time (`write_safetensors`), so a state can be saved and restored in the memory that
trains it.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

# JAX is imported where a JAX state is saved or loaded: the runtime writes checkpoints
# with this module's format on devices that have no JAX.
if TYPE_CHECKING:
    from pockjax.scheme import Scheme

__all__ = ["save", "load", "read", "read_metadata", "write_atomic", "write_safetensors", "write_checkpoint",
           "encode", "CheckpointError"]

FORMAT = "pockjax.checkpoint"
VERSION = "2"
# Version 1 files (no checksum) still load; their data cannot be verified.
READABLE = ("1", VERSION)
CHECKSUM = "sha256"


class CheckpointError(ValueError):
    """Raised when a checkpoint cannot be written or read, is damaged, or does not fit
    the state it is loaded into."""


def _named(tree) -> tuple[dict[str, Any], Any]:
    from pockjax.scheme import leaves_with_paths

    named, treedef = leaves_with_paths(tree)
    out: dict[str, Any] = {}
    for path, leaf in named:
        name = path or "value"
        if name in out:
            raise CheckpointError(f"two leaves share the name '{name}'; checkpoint names must be unique")
        out[name] = leaf
    return out, treedef


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same directory.

    The temporary file is flushed to disk and renamed over `path`, so `path` holds
    either its old content or all of `data`; on an error the temporary file is removed
    and the error propagates. Missing parent directories are created.

    Args:
      path: the file to write.
      data: its full content.
    """
    _write_atomic_with(path, lambda f: f.write(data))


def _write_atomic_with(path, write: Callable) -> None:
    """`write_atomic` with the content written by `write(file)`."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def checksum(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        _hash_one(h, name, np.ascontiguousarray(arrays[name]))
    return h.hexdigest()


def _hash_one(h, name: str, a: np.ndarray) -> None:
    h.update(f"{name}\0{a.dtype.name}\0{list(a.shape)}\0".encode())
    h.update(a.view(np.uint8).reshape(-1) if a.size else b"")


# numpy dtype name -> safetensors' dtype code, and back.
_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16",
                       "bfloat16": "BF16", "int64": "I64", "int32": "I32", "int16": "I16",
                       "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16",
                       "uint8": "U8", "bool": "BOOL"}
_DTYPE_NAMES = {code: name for name, code in _SAFETENSORS_DTYPES.items()}


def numpy_dtype(code: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype code ("BF16": ml_dtypes' bfloat16)."""
    name = _DTYPE_NAMES[code]
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def safetensors_header(path: str | os.PathLike) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets; the
    metadata left out) and the offset where its data starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def write_safetensors(path: str | os.PathLike,
                      tensors: Sequence[tuple[str, tuple, Any, Callable[[], Any]]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file one tensor at a time, atomically (a temporary file in
    the same directory, flushed and renamed over `path`).

    Only one tensor's bytes are in memory at a time: a model or training state far
    larger than the free memory can be written (`safetensors.numpy.save_file` first
    copies every tensor into one buffer).

    Args:
      path: the file to write.
      tensors: `(name, shape, dtype, get)` in the order they are stored; `get()` returns
        the tensor (any array-like of that shape and dtype), called once.
      metadata: the file's string metadata; default none.

    Raises:
      ValueError: a tensor's dtype has no safetensors code, or `get()` returned another
        shape or dtype than declared.
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, shape, dtype, _ in tensors:
        dtype = np.dtype(dtype)
        if dtype.name not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor '{name}' is {dtype.name}; safetensors stores "
                             f"{', '.join(_SAFETENSORS_DTYPES)}")
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype.name], "shape": [int(d) for d in shape],
                        "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned

    def write(f):
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype, get in tensors:
            a = np.asarray(get(), order="C")
            if a.shape != tuple(shape) or a.dtype != np.dtype(dtype):
                raise ValueError(f"tensor '{name}': declared {np.dtype(dtype).name}"
                                 f"{list(shape)}, got {a.dtype.name}{list(a.shape)}")
            if a.size:
                f.write(a.reshape(-1).view(np.uint8).data)
            del a

    _write_atomic_with(path, write)


def write_checkpoint(path, getters: dict[str, Callable[[], np.ndarray]],
                     metadata: dict[str, str]) -> None:
    """A checkpoint file in `save`'s format from one getter per tensor, one tensor in
    memory at a time: a pass to hash, a pass to write.

    Args:
      path: the file to write (atomically).
      getters: tensor name -> a function returning it (called twice).
      metadata: metadata beside the format's own keys (`format`, `version`, `sha256`),
        which it may not set.

    Raises:
      CheckpointError: a `metadata` key is one the format sets.
    """
    h, shapes = hashlib.sha256(), {}
    for name in sorted(getters):
        a = np.asarray(getters[name]())
        shapes[name] = (a.shape, a.dtype)
        _hash_one(h, name, np.ascontiguousarray(a))  # as `checksum` (a scalar hashed as [1])
        del a
    meta = _merged({"format": FORMAT, "version": VERSION, CHECKSUM: h.hexdigest()}, metadata)
    write_safetensors(path, [(n, *shapes[n], getters[n]) for n in sorted(getters)], meta)


def encode(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """A checkpoint file's bytes: `arrays` in safetensors with the format's metadata
    (format, version, checksum) added to `metadata`.

    Args:
      arrays: tensor name -> array (copied to C order).
      metadata: extra metadata; values are stored as strings.

    Returns:
      The safetensors file's bytes.

    Raises:
      CheckpointError: a key of `metadata` is one the format reserves (`format`,
        `version`, `sha256`).
    """
    from safetensors.numpy import save as st_save

    arrays = {k: np.array(v, order="C") for k, v in arrays.items()}
    meta = _merged({"format": FORMAT, "version": VERSION, CHECKSUM: checksum(arrays)}, metadata)
    return st_save(arrays, metadata=meta)


def _merged(meta: dict[str, str], extra: dict | None) -> dict[str, str]:
    for k, v in (extra or {}).items():
        if k in meta:
            raise CheckpointError(f"metadata key '{k}' is reserved by the checkpoint format")
        meta[str(k)] = str(v)
    return meta


def save(path: str | os.PathLike, state, *, scheme: Scheme | None = None,
         metadata: dict[str, str] | None = None) -> None:
    """Save `state` (a `TrainState` or any pytree of arrays) to a safetensors file.

    The file is written atomically (`write_atomic`). Its metadata holds `state.step`
    where the state has one, and the scheme as JSON.

    Args:
      path: the file to write.
      state: a `TrainState` or any pytree of arrays; each leaf is stored under its
        "/"-joined path.
      scheme: the scheme to record; None (the default) takes `state.scheme` where
        there is one.
      metadata: extra metadata, stored as strings beside the format's own keys;
        default none.

    Raises:
      CheckpointError: two leaves share a path, or a `metadata` key is one the format
        sets (`format`, `version`, `sha256`, and `step` or `scheme` where they are
        saved).
    """
    import jax

    scheme = scheme if scheme is not None else getattr(state, "scheme", None)
    tensors, _ = _named(state)
    meta = {}
    step = getattr(state, "step", None)
    if step is not None:
        meta["step"] = str(int(np.asarray(step)))
    if scheme is not None:
        meta["scheme"] = scheme.to_json()
    write_checkpoint(path, {k: (lambda v=v: np.asarray(jax.device_get(v)))
                            for k, v in tensors.items()}, _merged(meta, metadata))


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The metadata of a checkpoint, read without loading its tensors.

    Args:
      path: the checkpoint file.

    Returns:
      The metadata as a dict of strings: format, version, checksum, step and scheme
      where saved, and the user's keys.

    Raises:
      CheckpointError: the file does not exist or is not a readable safetensors file.
    """
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), framework="numpy") as f:
            return dict(f.metadata() or {})
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint '{path}' does not exist") from None
    except Exception as e:  # safetensors raises its own error type for bad headers
        raise CheckpointError(f"checkpoint '{path}' is not a readable safetensors file "
                              f"(truncated or corrupt?): {e}") from None


def _checkpoint_metadata(path: str) -> dict[str, str]:
    """The metadata of a pockjax checkpoint this pockjax reads, else CheckpointError."""
    meta = read_metadata(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"'{path}' is a safetensors file but not a pockjax checkpoint "
                              f"(metadata format={meta.get('format')!r})")
    if meta.get("version") not in READABLE:
        raise CheckpointError(f"'{path}' has checkpoint version {meta.get('version')!r}; this "
                              f"pockjax reads versions {', '.join(READABLE)}")
    return meta


def _placed(array: np.ndarray, leaf):
    """A tensor read from a file, as a JAX array where `leaf` lives: on the devices of
    its sharding where it spans several (a state on a mesh), else on the default one."""
    import jax
    import jax.numpy as jnp

    sharding = getattr(leaf, "sharding", None)
    if sharding is not None and len(sharding.device_set) > 1:
        # each process places the pieces its own devices hold (several hosts too)
        return jax.make_array_from_callback(array.shape, sharding, lambda i: array[i])
    return jnp.asarray(array)


def load(path: str | os.PathLike, like):
    """Load a checkpoint into the structure of `like` (a state of the same model).

    Every tensor is read and checked before anything is returned: the checksum (for
    version-2 files), then the names, shapes and dtypes against `like`, and the scheme
    where both the file and `like` have one.

    Args:
      path: the checkpoint file.
      like: a state (or pytree) of the same model; only its structure, shapes, dtypes,
        scheme and shardings are used: a leaf whose sharding spans several devices (a
        state on a mesh, or a `jax.ShapeDtypeStruct` with `sharding=`) is loaded onto
        them, whatever the layout the checkpoint was saved from.

    Returns:
      A pytree of `like`'s structure holding the file's tensors as JAX arrays.

    Raises:
      CheckpointError: the file is missing, not a pockjax checkpoint, of a version this
        pockjax does not read, truncated or corrupt, or fails its checksum; or it does
        not fit `like` (the message lists the differences: missing or extra names,
        shapes, dtypes, the scheme).
    """
    import jax
    import jax.numpy as jnp
    from safetensors import safe_open

    from pockjax.scheme import Scheme

    path = os.fspath(path)
    meta = _checkpoint_metadata(path)
    want, treedef = _named(like)
    try:  # names, shapes and dtypes from the header: nothing read yet
        with safe_open(path, framework="numpy") as f:
            header = {}
            for k in f.keys():
                sl = f.get_slice(k)
                header[k] = (tuple(sl.get_shape()), sl.get_dtype())
    except Exception as e:
        raise CheckpointError(f"checkpoint '{path}' could not be read (truncated or corrupt?): "
                              f"{e}") from None

    problems = []
    for name in want:
        if name not in header:
            problems.append(f"missing in file: '{name}'")
    for name in header:
        if name not in want:
            problems.append(f"not in the state: '{name}'")
    for name, leaf in want.items():
        if name in header:
            shape, code = header[name]
            dtype = jnp.dtype(jnp.result_type(leaf))
            stored = _DTYPE_NAMES.get(code, code)
            if shape != tuple(np.shape(leaf)) or stored != dtype.name:
                problems.append(f"'{name}': file has {stored}{list(shape)}, "
                                f"state has {dtype}{list(np.shape(leaf))}")
    like_scheme = getattr(like, "scheme", None)
    if "scheme" in meta and like_scheme is not None:
        file_scheme = Scheme.from_json(meta["scheme"])
        if file_scheme != like_scheme:
            problems.append(f"scheme differs: file has {file_scheme!r}, state has {like_scheme!r}")
    if problems:
        shown = "\n  ".join(problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        raise CheckpointError(f"checkpoint '{path}' does not fit the given state "
                              f"({len(problems)} differences):\n  {shown}{more}")

    # One tensor at a time, in the checksum's order: read (the file mapped only while it
    # is copied out), hashed, moved into a JAX array; nothing is returned unless the
    # checksum matches.
    h, have = hashlib.sha256(), {}
    try:
        for name in sorted(header):
            with safe_open(path, framework="numpy") as f:
                a = f.get_tensor(name)
            _hash_one(h, name, np.ascontiguousarray(a))
            have[name] = _placed(a, want[name])
            del a
    except Exception as e:
        raise CheckpointError(f"checkpoint '{path}' could not be read (truncated or corrupt?): "
                              f"{e}") from None
    if meta["version"] != "1" and h.hexdigest() != meta.get(CHECKSUM):
        raise CheckpointError(f"checkpoint '{path}' is damaged: its tensors do not match the "
                              f"checksum stored when it was saved (a disk or copy error); load "
                              f"an earlier checkpoint or the original file")
    return jax.tree_util.tree_unflatten(treedef, [have[name] for name in want])


def read(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A checkpoint's tensors by name, as numpy arrays, and its metadata, without JAX
    (the runtime's resume reads its checkpoints with it). The checksum is checked
    before anything is returned.

    Args:
      path: the checkpoint file.

    Returns:
      `(tensors, metadata)`.

    Raises:
      CheckpointError: the file is missing, not a pockjax checkpoint, of a version this
        pockjax does not read, truncated or corrupt, or fails its checksum.
    """
    path = os.fspath(path)
    meta = _checkpoint_metadata(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            data = f.read()
        tensors = {}
        for name, t in header.items():
            dtype = numpy_dtype(t["dtype"])
            a, b = t["data_offsets"]
            if b > len(data):
                raise ValueError(f"tensor '{name}' runs past the end of the file")
            tensors[name] = np.frombuffer(data, dtype, count=(b - a) // dtype.itemsize,
                                          offset=a).reshape(t["shape"])
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise CheckpointError(f"checkpoint '{path}' could not be read (truncated or corrupt?): "
                              f"{e}") from None
    h = hashlib.sha256()
    for name in sorted(tensors):
        _hash_one(h, name, np.ascontiguousarray(tensors[name]))
    if meta["version"] != "1" and h.hexdigest() != meta.get(CHECKSUM):
        raise CheckpointError(f"checkpoint '{path}' is damaged: its tensors do not match the "
                              f"checksum stored when it was saved (a disk or copy error); load "
                              f"an earlier checkpoint or the original file")
    return tensors, meta
