"""PyTorch models in: a `torch.nn.Module` as a pure JAX function of a parameter pytree.

`functional(module)` goes through `torchax` (PyTorch on JAX): it returns the module's
parameters as a nested dict keyed by the module's own dotted names split on "."
(`model/layers/0/mlp/up_proj/weight`) and `apply(params, *args, **kwargs)`, a JAX
function returning arrays. Everything else in pockjax (`sparse_grad`, `sparse_train`,
schemes, `search`, `export`) takes them unchanged. Each weight carries its layout, so
`Channels(axis="in"/"out")` means input/output features for torch's `[out, in]`
`Linear`, `OIHW` convolutions and GPT-2's `[in, out]` `Conv1D`.
`load_state(module, params)` writes trained values back into the module.

Examples:
  >>> import torch, optax, jax.numpy as jnp, pockjax as pj
  >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
  >>> params, apply = pj.torch.functional(net)
  >>> params["0"]["weight"].shape                      # torch's [out, in]
  (8, 4)
  >>> scheme = pj.Scheme({"2/**": pj.Full(), "0/weight": pj.Channels(ratio=0.5, axis="in")})
  >>> scheme.resolve(params)["0"]["weight"]             # "in" is axis 1 here
  Channels(count=2, axis=1)
  >>> trainer = pj.sparse_train(lambda p, b: jnp.mean((apply(p, b) - 1.0) ** 2),
  ...                           optimizer=optax.adamw(1e-3), scheme=scheme)
  >>> state, metrics = trainer(trainer.init(params), jnp.ones((3, 4)))
  >>> names = pj.torch.load_state(net, state.params)   # trained values back into the module

Buffers (BatchNorm running statistics, rotary tables) are kept apart from the
parameters, in `apply.buffers`; `apply` reads them as constants.
`apply.stateful(params, buffers, *args)` returns `(outputs, new_buffers)` for a module
whose forward updates them (BatchNorm in train mode): carry them through the batch and
the loss's aux, as `pockjax.nnx.Trainer` does.

`import_torchax()` (torchax, imported so that it works with this torch) and
`environment()` (pockjax's torchax environment) are defined in `pockjax.torch._env`.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Mapping

import jax
import numpy as np

from pockjax._src.trees import nest

from pockjax.torch._env import environment, import_torchax
# Re-exported for the tests of the torchax import workaround.
from pockjax.torch._env import MissingOverload as _MissingOverload  # noqa: F401
from pockjax.torch._env import named_overloads_tolerated as _named_overloads_tolerated  # noqa: F401

__all__ = ["functional", "trainer", "load_state", "import_torchax", "layouts", "environment",
           "TorchFunction"]

TORCH_NOTE = ("These parameters come from a PyTorch module (pockjax.torch): weights are named "
              "'weight' (not 'kernel'), norm scales 'weight' (not 'scale'), embeddings 'weight' "
              "(not 'embedding'), with the module's own dotted names split on '.'")


# --------------------------------------------------------------------------- layouts

# Named axes of each weight, by module type: {"in": axis, "out": axis}.
_OUT_IN = {"out": 0, "in": 1}    # Linear [out, in]; ConvNd [out, in/groups, *k]
_IN_OUT = {"in": 0, "out": 1}    # Conv1D [in, out]; ConvTransposeNd [in, out/groups, *k]; Embedding


def _weight_layout(module, name: str, ndim: int):
    """The layout of `module`'s own parameter `name`, or a string saying it is unknown."""
    import torch

    if ndim < 2:
        return None  # vectors: "out" is axis 0 as for JAX
    kind = type(module).__name__
    if name == "weight":
        if isinstance(module, torch.nn.modules.conv._ConvTransposeNd):
            return _IN_OUT
        if isinstance(module, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)):
            return _OUT_IN
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            return _IN_OUT
        if kind == "Conv1D" and hasattr(module, "nf"):  # transformers' GPT-2 Conv1D
            return _IN_OUT
    if isinstance(module, torch.nn.MultiheadAttention) and name == "in_proj_weight":
        return _OUT_IN
    return f"is a parameter of a {kind} (layout unknown to pockjax.torch)"


def layouts(module) -> dict[str, Any]:
    """`{path: layout}` of the module's parameters ("/"-joined, deduplicated as
    `named_parameters()` does); `{"in": 1, "out": 0}` for a Linear weight.

    Args:
      module: a `torch.nn.Module`.

    Returns:
      A dict from each parameter path with 2 or more dimensions to its layout:
        `{"in": axis, "out": axis}` for the weights of `Linear`, convolutions,
        transposed convolutions, embeddings, GPT-2's `Conv1D` and
        `MultiheadAttention.in_proj_weight`, else a string saying the layout is
        unknown. Vectors are left out (their "out" is axis 0, as in JAX).
    """
    out = {}
    seen = set()
    for mname, m in module.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            path = "/".join(filter(None, [*mname.split("."), pname]))
            layout = _weight_layout(m, pname, p.ndim)
            if layout is not None:
                out[path] = layout
    return out


# --------------------------------------------------------------------------- trees


def _nest(flat: Mapping[str, Any]) -> dict:
    return nest((name.split("."), value) for name, value in flat.items())


def _flatten(tree, sep: str = ".") -> dict:
    named, _ = jax.tree_util.tree_flatten_with_path(tree)
    from pockjax.scheme import path_str

    return {path_str(p).replace("/", sep): x for p, x in named}


# --------------------------------------------------------------------------- the function


class TorchFunction:
    """`apply(params, *args, **kwargs)`: the module's forward as a JAX function returning
    arrays. `buffers` are the module's buffers (constants to `apply`);
    `stateful(params, buffers, *args, **kwargs)` returns `(outputs, new_buffers)`.

    `functional` makes one; the module runs in its current train/eval mode.

    Args:
      module: the `torch.nn.Module`.
      buffers: the module's buffers as a nested dict of JAX arrays.
      output: a function picking arrays from what the forward returns, or None.
      env: the torchax environment the forward runs in (`environment()`).

    Attributes:
      module: the `torch.nn.Module`.
      buffers: the module's buffers, a nested dict of JAX arrays keyed like the
        parameters.
      output: the function picking arrays from the forward's result, or None.
    """

    def __init__(self, module, buffers: dict, output: Callable | None, env):
        self.module, self.buffers, self.output, self._env = module, buffers, output, env
        self.__name__ = type(module).__name__

    def __repr__(self) -> str:
        return f"pockjax.torch.functional({type(self.module).__name__})"

    def __call__(self, params, *args, **kwargs):
        """Run the module's forward with `params` and the stored `buffers`.

        Args:
          params: the parameters, a nested dict as `functional` returns.
          *args: the forward's positional arguments (JAX or NumPy arrays, or other
            Python values).
          **kwargs: the forward's keyword arguments.

        Returns:
          The forward's result (after `output`) with tensors as JAX arrays.

        Raises:
          TypeError: an argument is a `torch.Tensor`, or the result holds something
            other than arrays.
          NotImplementedError: torchax cannot run one of the module's ops.
          RuntimeError: the forward mixes a CPU torch tensor with the model's tensors.
        """
        return self._run(params, self.buffers, args, kwargs)[0]

    def stateful(self, params, buffers, *args, **kwargs):
        """Run the module's forward with `params` and `buffers`, returning the new buffers.

        Args:
          params: the parameters, a nested dict as `functional` returns.
          buffers: the buffers, a nested dict like `self.buffers`.
          *args: the forward's positional arguments.
          **kwargs: the forward's keyword arguments.

        Returns:
          A pair `(outputs, new_buffers)`: the forward's result as for `__call__`, and
            the buffers after the forward (those a train-mode BatchNorm updates
            changed); `buffers` itself when the module has none.

        Raises:
          TypeError: an argument is a `torch.Tensor`, or the result holds something
            other than arrays.
          NotImplementedError: torchax cannot run one of the module's ops.
          RuntimeError: the forward mixes a CPU torch tensor with the model's tensors.
        """
        return self._run(params, buffers, args, kwargs)

    def _run(self, params, buffers, args, kwargs):
        import torch

        env = self._env
        _check_no_torch_inputs(args, kwargs, self.module)
        flat_p, flat_b = _flatten(params), _flatten(buffers)
        # Under jit numpy inputs arrive as tracers; eagerly they must become JAX arrays the
        # same way, or torch receives a numpy array where it expects a tensor.
        p_t, b_t, args_t, kwargs_t = env.j2t_iso(_numpy_to_jax((flat_p, flat_b, args, kwargs)))
        stack: list[str] = []
        with _module_stack(self.module, stack), _no_mha_fastpath(), env:
            try:
                res = torch.func.functional_call(self.module, {**p_t, **b_t}, tuple(args_t),
                                                 kwargs_t, tie_weights=True, strict=False)
                if self.output is not None:
                    res = self.output(res)
            except Exception as e:
                if _is_mixed_math(e):
                    raise _cpu_tensor_error(e, self.module, stack) from e
                raise _op_error(e, self.module, stack) from e
        out, new_b = env.t2j_iso((res, b_t))
        _check_arrays(out, self.module, self.output)
        return out, _nest(new_b) if flat_b else buffers


def _check_no_torch_inputs(args, kwargs, module) -> None:
    import torch

    named, _ = jax.tree_util.tree_flatten_with_path((args, kwargs))
    for path, x in named:
        if isinstance(x, torch.Tensor):
            where = ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(path[1:])
            raise TypeError(
                f"pockjax.torch.functional({type(module).__name__}) takes JAX or numpy arrays, "
                f"but {where} is a torch.Tensor; pass x.numpy() (or jnp.asarray(x.numpy()))")


def _numpy_to_jax(tree):
    import jax.numpy as jnp

    def convert(x):
        # Strings and objects stay as they are, as torch would take them.
        numeric = isinstance(x, (np.ndarray, np.generic)) and x.dtype.kind not in "OSU"
        return jnp.asarray(x) if numeric else x

    return jax.tree_util.tree_map(convert, tree)


def _running(module, stack: list[str]) -> str:
    where = stack[-1] if stack else ""
    sub = module.get_submodule(where) if where else module
    return f"'{where}' ({type(sub).__name__})" if where else f"the top module ({type(module).__name__})"


def _is_mixed_math(e: Exception) -> bool:
    # torchax 0.0.13 signals a plain torch tensor among its own with a bare assert in
    # `Environment.t2j_iso`; its message is the only mark it leaves.
    return (isinstance(e, AssertionError)
            and "mixed math between XLATensor and torch.Tensor" in str(e))


def _cpu_tensor_error(e: Exception, module, stack: list[str]) -> Exception:
    line = _user_line(e.__traceback__)
    at = f" at {line}" if line else ""
    return RuntimeError(
        f"{_running(module, stack)} mixed a CPU torch tensor with the model's tensors{at}: a "
        f"tensor created in forward without device= (or kept as a plain attribute rather than "
        f"a registered buffer) is on the CPU, not on the model's device (pockjax.torch runs "
        f"the model on JAX). Create it on the input's device, e.g. "
        f"torch.arange(n, device=x.device) or torch.zeros(shape, device=x.device, "
        f"dtype=x.dtype), or register it in __init__ with self.register_buffer(name, tensor); "
        f"torch rejects the same code on a GPU")


def _user_line(tb) -> str:
    """`file:line (function: code)` of the innermost traceback frame outside torch, torchax, JAX,
    pockjax and the standard library: where the module made the CPU tensor meet the others."""
    import linecache
    import sysconfig

    import torch
    import torchax

    skip = tuple(os.path.dirname(m.__file__) + os.sep
                 for m in (torch, torchax, jax, np, __import__("pockjax")))
    skip += (sysconfig.get_paths()["stdlib"] + os.sep,)
    found = ""
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(skip) and not code.co_filename.startswith("<"):
            text = linecache.getline(code.co_filename, tb.tb_lineno).strip()
            found = f"{code.co_filename}:{tb.tb_lineno} ({code.co_name}: {text})"
        tb = tb.tb_next
    return found


def _op_error(e: Exception, module, stack: list[str]) -> Exception:
    name = _running(module, stack)
    kind = type(e).__name__
    if kind == "OperatorNotFound" or isinstance(e, NotImplementedError):
        return NotImplementedError(
            f"torchax cannot run an op of {name}: {kind}: {e}. Replace that module with one "
            f"torchax supports, or give the op a definition in pockjax's torchax environment: "
            f"pockjax.torch.environment().override_op_definition(torch.ops.aten.<op>.default, fn)")
    return type(e)(f"{e} (while running {name} under torchax)") if _reraisable(e) else e


def _reraisable(e: Exception) -> bool:
    try:
        type(e)("x")
        return True
    except Exception:
        return False


@contextlib.contextmanager
def _module_stack(module, stack: list[str]):
    """Which submodule is running (for errors): hooks present only during the call."""
    handles = []
    for name, m in module.named_modules():
        def pre(_m, _args, name=name):
            stack.append(name)

        def post(_m, _args, _out, name=name):
            if stack and stack[-1] == name:
                stack.pop()

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _no_mha_fastpath():
    # torchax cannot run MultiheadAttention's sparse fast path; torchax turns it off at
    # import for the whole process, pockjax only while its own calls run.
    import torch

    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def _check_arrays(out, module, output) -> None:
    leaves = jax.tree_util.tree_leaves(out)
    bad = [x for x in leaves if not isinstance(x, (jax.Array, np.ndarray, np.generic))]
    if bad or not leaves:
        what = type(bad[0]).__name__ if bad else type(out).__name__
        raise TypeError(
            f"{type(module).__name__}.forward returned {type(out).__name__} holding a "
            f"{what}; pockjax needs arrays (or tuples/dicts of arrays). Pick them with "
            f"pockjax.torch.functional(model, output=lambda out: out.logits) (and use_cache=False "
            f"for a Hugging Face model)")


def functional(module, *, output: Callable | None = None) -> tuple[dict, TorchFunction]:
    """`(params, apply)` for a `torch.nn.Module`.

    `params` is a nested dict of the module's parameters (tied weights once, under
    their first name) as JAX arrays, keyed by the dotted names split on "."; the
    layout of each weight is registered so named Channels axes mean features.
    `apply(params, *args, **kwargs)` runs the module's forward (in its current
    train/eval mode) and returns arrays; `output` picks arrays from what the forward
    returns (`lambda out: out.logits` for a Hugging Face model). Buffers are in
    `apply.buffers`. Dropout under torchax draws from torchax's generator, not
    torch's: use `module.eval()` or dropout 0 to compare with torch.

    Args:
      module: a `torch.nn.Module` with parameters.
      output: a function picking arrays from what the forward returns; None (the
        default): the forward returns arrays (or tuples and dicts of them) itself.

    Returns:
      A pair `(params, apply)`: the parameters as a nested dict of JAX arrays, and the
        `TorchFunction` running the forward.

    Raises:
      ImportError: PyTorch or torchax is missing or does not import.
      TypeError: `module` is not a `torch.nn.Module`.
      ValueError: `module` has no parameters.
    """
    import torch

    from pockjax.scheme import register_layouts

    import_torchax()
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"pockjax.torch.functional needs a torch.nn.Module, got "
                        f"{type(module).__name__}")
    env = environment()
    named_p = dict(module.named_parameters())
    named_b = dict(module.named_buffers())
    if not named_p:
        raise ValueError(f"{type(module).__name__} has no parameters to train")
    with torch.no_grad():
        params = _nest(env.t2j_copy({k: v.detach() for k, v in named_p.items()}))
        buffers = _nest(env.t2j_copy({k: v.detach() for k, v in named_b.items()}))
    register_layouts(params, layouts(module), TORCH_NOTE)
    return params, TorchFunction(module, buffers, output, env)


def trainer(module, loss_fn: Callable, *, optimizer, scheme=None, output: Callable | None = None,
            has_aux: bool = False, donate: bool = True):
    """`(trainer, state)`: `pockjax.sparse_train` over `module`'s parameters, with
    `loss_fn(apply, params, batch)` (`apply` from `functional(module, output=output)`).
    `scheme=None` trains every parameter. This is what `pockjax export` builds from a
    `{"model", "loss_fn", "optimizer", "scheme", "batch"}` dict.

    For a Hugging Face causal LM:

        trainer, state = pj.torch.trainer(
            model, lambda apply, p, b: lm_loss(apply(p, b["ids"], use_cache=False), b["ids"]),
            optimizer=optax.adamw(1e-3), scheme=scheme, output=lambda out: out.logits)

    Args:
      module: a `torch.nn.Module` with parameters.
      loss_fn: `loss_fn(apply, params, batch)` -> the loss, or `(loss, aux)` with
        `has_aux`.
      optimizer: an optax `GradientTransformation`.
      scheme: a `pockjax.Scheme`; None (the default) trains every parameter.
      output: a function picking arrays from what the forward returns (see
        `functional`); None (the default): none.
      has_aux: whether `loss_fn` returns `(loss, aux)` (default False).
      donate: donate the state to each step (default True).

    Returns:
      A pair `(trainer, state)`: the `SparseTrainer` and its initial `TrainState`, made
        from the module's parameters without a copy (`init(params, copy=False)`).

    Raises:
      ImportError: PyTorch or torchax is missing or does not import.
      TypeError: `module` is not a `torch.nn.Module`.
      ValueError: `module` has no parameters.
    """
    from pockjax.scheme import Full, Scheme
    from pockjax.train import sparse_train

    params, apply = functional(module, output=output)

    def loss(p, batch):
        return loss_fn(apply, p, batch)

    loss.__name__ = getattr(loss_fn, "__name__", "loss")
    scheme = Scheme(default=Full()) if scheme is None else scheme
    t = sparse_train(loss, optimizer=optimizer, scheme=scheme, has_aux=has_aux, donate=donate)
    return t, t.init(params, copy=False)


# --------------------------------------------------------------------------- back into torch


def load_state(module, params, *, strict: bool = True) -> list[str]:
    """Write `params` (and/or buffers) into `module`'s tensors in place, keeping each
    tensor's dtype and device; returns the names written.

    `params` is a nested dict as `functional` gives (a trainer's `state.params`, an
    exported artifact's `session.params()`, `apply.buffers`) or a flat dict with "/"-
    or "."-joined names. With `strict`, a name the module does not have raises
    `KeyError`; without it, such names are skipped. A shape that differs raises
    `ValueError` either way. Tied weights are written once and stay tied.

    Args:
      module: the `torch.nn.Module` to write into.
      params: the values: a nested dict, or a flat dict of "/"- or "."-joined names;
        JAX or NumPy arrays or torch tensors.
      strict: raise on a name the module does not have (default True); False skips it.

    Returns:
      The dotted names written, in the order of `params`.

    Raises:
      KeyError: with `strict`, a name is neither a parameter nor a buffer of `module`.
      ValueError: a value's shape differs from its tensor's.
    """
    import torch

    flat = {k.replace("/", "."): v for k, v in (_flatten(params) if not _is_flat(params)
                                               else dict(params)).items()}
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(dict(module.named_buffers(remove_duplicate=False)))
    written = []
    for name, value in flat.items():
        if name not in tensors:
            if strict:
                near = __import__("difflib").get_close_matches(name, list(tensors), n=3)
                raise KeyError(f"{type(module).__name__} has no parameter or buffer {name!r}; "
                               f"nearest: {near}")
            continue
        t = tensors[name]
        arr = np.asarray(jax.device_get(value)) if not isinstance(value, torch.Tensor) else value
        if tuple(arr.shape) != tuple(t.shape):
            raise ValueError(f"{name}: shape {tuple(arr.shape)} does not fit the module's "
                             f"{tuple(t.shape)}")
        src = arr if isinstance(arr, torch.Tensor) else _to_torch(arr)
        with torch.no_grad():
            t.copy_(src.to(dtype=t.dtype, device=t.device))
        written.append(name)
    return written


def _is_flat(tree) -> bool:
    return isinstance(tree, Mapping) and all(not isinstance(v, Mapping) for v in tree.values())


def _to_torch(arr: np.ndarray):
    import torch

    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(arr, copy=True))
