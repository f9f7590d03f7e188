"""What every way of running an exported artifact shares (`BaseSession`): the batch
checked against the manifest's signature, evaluation, the parameters as a numpy pytree
and checkpoints in `pockjax.save`'s format. `pockjax.runtime.Session` (IREE's Python
runtime) and `pockjax.runtime.ToolSession` (`iree-run-module`, one process per call)
subclass it; like `pockjax.runtime`, this module needs numpy only, not JAX.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping

import numpy as np

from pockjax.export.targets import ExportError


def np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def named_leaves(tree, prefix: str = "") -> list[tuple[str, object]]:
    """`[(path, leaf)]` of a batch in JAX's flattening order and with its path names
    (dicts by sorted key, lists and tuples by index, named tuples by field; None is
    empty), without JAX: the runtime runs where JAX is not installed.

    Args:
      tree: the batch: nested dicts, lists, tuples and named tuples of arrays.
      prefix: the path the tree's own leaves are named under (`"a/b"`); empty at the
        root, where a single leaf is named `""`.

    Returns:
      `(path, leaf)` pairs, paths joined with `/`.
    """
    join = (lambda k: f"{prefix}/{k}") if prefix else str
    if tree is None:
        return []
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in named_leaves(tree[k], join(k))]
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return [x for k in tree._fields for x in named_leaves(getattr(tree, k), join(k))]
    if isinstance(tree, (list, tuple)):
        return [x for i, v in enumerate(tree) for x in named_leaves(v, join(i))]
    return [(prefix, tree)]


def _unflatten(paths: list[str], values: dict[str, np.ndarray]):
    """Nested dicts (lists where every key is an index) from '/'-joined paths."""
    root: dict = {}
    for path in paths:
        node = root
        parts = path.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = values[path]

    def listify(node):
        if not isinstance(node, dict):
            return node
        node = {k: listify(v) for k, v in node.items()}
        if node and all(k.isdigit() for k in node) and sorted(map(int, node)) == list(range(len(node))):
            return [node[str(i)] for i in range(len(node))]
        return node

    return listify(root)


class _Lazy(Mapping):
    """A read-only mapping whose values are read when looked up (`param_values(lazy=
    True)`)."""

    def __init__(self, getters: dict[str, Callable[[], np.ndarray]]):
        self._getters = getters

    def __getitem__(self, key: str) -> np.ndarray:
        return self._getters[key]()

    def __contains__(self, key) -> bool:  # without reading the tensor
        return key in self._getters

    def __iter__(self):
        return iter(self._getters)

    def __len__(self) -> int:
        return len(self._getters)


class BaseSession:
    """What every way of running an artifact shares: the batch check, evaluation,
    parameters as a pytree and checkpoints. Subclasses set `manifest` and `_state_names`
    and provide `_state_value(i)` (state tensor `i` on the host), `_frozen_values()` and
    `_evaluate(batch)` (the loss, for `evaluate`)."""

    manifest: dict
    _state_names: list[str]

    def _state_value(self, i: int) -> np.ndarray:
        raise NotImplementedError

    def _frozen_values(self) -> list[np.ndarray]:
        raise NotImplementedError

    def _evaluate(self, batch) -> np.ndarray:
        raise NotImplementedError

    def _eval_indices(self) -> list[int]:
        """The positions in the state of `eval`'s state arguments."""
        return [self._state_names.index(n) for n in self.manifest["functions"]["eval"]["state"]]

    def _frozen_getters(self) -> dict[str, Callable[[], np.ndarray]]:
        """One function per frozen weight, by name, returning it on the host. This one
        reads them all at the first call (`_frozen_values`) and keeps them; a session
        that can read one weight alone overrides it."""
        names = self.manifest["functions"]["frozen"]["outputs"]
        cache: list = []

        def one(i: int) -> np.ndarray:
            if not cache:
                cache.append(self._frozen_values())
            return cache[0][i]

        return {name: (lambda i=i: one(i)) for i, name in enumerate(names)}

    def _getters(self) -> dict[str, Callable[[], np.ndarray]]:
        """One function per state tensor and frozen weight, by name, each reading that
        tensor to the host when called: a caller that writes them one by one holds one
        at a time."""
        getters = {name: (lambda i=i: self._state_value(i))
                   for i, name in enumerate(self._state_names)}
        if self.manifest["functions"]["frozen"]["outputs"]:
            getters.update(self._frozen_getters())
        return getters

    def _values(self) -> dict[str, np.ndarray]:
        """Every state tensor and frozen weight by name, on the host."""
        return {name: get() for name, get in self._getters().items()}

    # -- batches -----------------------------------------------------------------

    def _batch_args(self, batch, function: str = "train_step") -> list[np.ndarray]:
        named = named_leaves(batch)
        got = {(p or "batch"): x for p, x in named}
        inputs = self.manifest["functions"][function]["inputs"]
        expected = ", ".join(f"{s['name']}: {s['dtype']}{list(s['shape'])}" for s in inputs)
        names = [s["name"] for s in inputs]
        if sorted(got) != sorted(names):
            raise ExportError(f"batch has inputs {sorted(got)}, the artifact expects {names} "
                              f"({expected})")
        args = []
        for s in inputs:
            x = np.asarray(got[s["name"]])
            want = np_dtype(s["dtype"])
            if tuple(x.shape) != tuple(s["shape"]):
                raise ExportError(f"batch input '{s['name']}' is {x.dtype}{list(x.shape)}, the "
                                  f"artifact expects {s['dtype']}{list(s['shape'])} (signature: "
                                  f"{expected}); export again for another shape")
            if x.dtype != want:
                raise ExportError(f"batch input '{s['name']}' is {x.dtype}{list(x.shape)}, the "
                                  f"artifact expects {s['dtype']}{list(s['shape'])} (signature: "
                                  f"{expected}); cast it with "
                                  f"np.asarray(x).astype(np.{np.dtype(want).name}) (numpy makes "
                                  f"int64/float64 arrays by default)")
            args.append(np.ascontiguousarray(x).reshape(x.shape))  # 0-d stays 0-d
        return args

    def _prefix_inputs(self, batch) -> list[np.ndarray]:
        if "prefix" not in self.manifest["functions"]:
            raise ExportError(f"artifact '{self.path}' has no prefix function: it is not a "
                              "prefix cache's export (pockjax.prefix.PrefixCachedTrainer.export)")
        return self._batch_args(batch, "prefix")

    def evaluate(self, batch) -> np.ndarray:
        """The loss on `batch` with the current parameters (no update): on the device
        (`Session`), or in a new process (`ToolSession`).

        Args:
          batch: one batch with the inputs, shapes and dtypes the artifact was
            exported for.

        Returns:
          The loss as a 0-d numpy array.

        Raises:
          ExportError: a `Session` is closed, the batch does not match the artifact, or
            a `ToolSession`'s tool failed.
          DeviceLost: a `Session`'s Vulkan driver lost the device.
        """
        return self._evaluate(batch)

    def param_values(self, lazy: bool = False) -> Mapping[str, np.ndarray]:
        """The current parameters by "/"-joined path (trained and frozen, a low-bit
        weight's parts as `weight/@data`, `weight/@master`...), as numpy arrays.

        Args:
          lazy: return a read-only mapping that reads each tensor from the device when
            it is looked up, so that a caller going through them one by one (writing a
            model folder) holds one tensor on the host at a time, not the model.

        Returns:
          A dict from path to array (with `lazy`, a mapping with the same keys).
        """
        getters = {k[len("params/"):]: g for k, g in self._getters().items()
                   if k.startswith("params/")}
        return _Lazy(getters) if lazy else {k: g() for k, g in getters.items()}

    def params(self):
        """The current parameters as a numpy pytree with the original paths.

        Returns:
          Nested dicts (lists where every key is an index) of numpy arrays, trained
          and frozen parameters together.
        """
        return _unflatten(self.manifest["params_tree"]["params"], self.param_values())

    @property
    def step_count(self) -> int:
        """The number of training steps the state has taken (the state's `step`)."""
        return int(self._state_value(self._state_names.index("step")))

    def _checked_state(self, path: str) -> list[np.ndarray]:
        """A checkpoint's state tensors in the state's order, checked against the
        artifact's names, shapes and dtypes (and its scheme)."""
        from pockjax.checkpoint import CheckpointError, read

        tensors, meta = read(path)
        scheme = meta.get("scheme")
        if scheme is not None and json.loads(scheme) != self.manifest["scheme"]:
            raise CheckpointError(f"checkpoint '{path}' was saved by an artifact with another "
                                  f"scheme than '{self.path}''s; resume with the artifact "
                                  f"that wrote it")
        problems, out = [], []
        for i, name in enumerate(self._state_names):
            if name not in tensors:
                problems.append(f"missing '{name}'")
                continue
            x, want = tensors[name], self._state_value_spec(i)
            if tuple(x.shape) != tuple(want[0]) or x.dtype != want[1]:
                problems.append(f"'{name}': file has {x.dtype}{list(x.shape)}, the artifact's "
                                f"state has {want[1]}{list(want[0])}")
            out.append(x)
        if problems:
            raise CheckpointError(f"checkpoint '{path}' does not fit artifact '{self.path}': "
                                  + "; ".join(problems[:8]))
        return out

    def _state_value_spec(self, i: int):
        """`(shape, numpy dtype)` of state tensor `i`, from the manifest."""
        name = self._state_names[i]
        for s in self.manifest["parameters"]:
            if s["name"] == name:
                return tuple(s["shape"]), np.dtype(np_dtype(s["dtype"]))
        value = self._state_value(i)
        return value.shape, value.dtype

    def save(self, path: str) -> None:
        """Write a checkpoint in `pockjax.save`'s format (loadable with `pockjax.load`).

        The checkpoint holds every parameter, the optimizer state and the step count,
        with the scheme in its metadata; it is written to a temporary file and renamed
        into place.

        Args:
          path: the checkpoint file to write (`.safetensors`).
        """
        from pockjax.checkpoint import write_checkpoint

        # One tensor on the host at a time (the getters are called once to hash, once
        # to write): the state and the frozen weights are never all copied at once.
        write_checkpoint(path, self._getters(),
                         {"step": str(self.step_count),
                          "scheme": json.dumps(self.manifest["scheme"])})
