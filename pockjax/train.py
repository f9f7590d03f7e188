"""`@sparse_train`: one compiled training step with fused, in-place optimizer updates.

    @pj.sparse_train(optimizer=optax.adamw(1e-3), scheme=scheme)
    def trainer(params, batch):
        return loss

    state = trainer.init(params)
    state, metrics = trainer(state, batch)

The step is one `jax.jit` program: the forward, the sparse backward of `sparse_grad`,
and the optimizer on the trainable view. If the optax chain is per-leaf (decided by
`pockjax.optim.perleaf`), each parameter is updated right after its gradient and its
last read (`pockjax.optim.fused`); otherwise after the whole backward pass. The state
is donated, so parameters and optimizer state are updated in place.

`remat=` puts the loss under `jax.checkpoint` (activation checkpointing, see `Remat`);
`pockjax.nnx.Trainer(remat="blocks")` checkpoints each block of a module instead, and
`checkpoint_block` each block of a plain loss function.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import time
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pockjax import lowbit
from pockjax import sharding as _sharding
from pockjax._jaxpr import is_var
from pockjax._interrupt import InterruptAfter
from pockjax._report import compiled_memory, format_bytes, format_flops, tree_bytes
from pockjax.flops import count_flops
from pockjax.optim import fused, perleaf
from pockjax.scheme import Frozen, Full, Scheme, SchemeError, leaves_with_paths
from pockjax.transforms.sparse_grad import (SparseGradFn, TransformInfo, is_dynamic,
                                            resolved_decisions, trainable)

__all__ = ["TrainState", "SparseTrainer", "sparse_train", "fit", "History", "TrainReport",
           "Remat", "checkpoint_block", "NonFiniteLoss", "peak_rss_gib"]


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Step counter, full parameters, and optimizer state for the trainable view.

    A pytree (the scheme is static metadata, used by `pockjax.save`). Made by
    `SparseTrainer.init`; each step returns a new one.

    Attributes:
      step: the number of steps taken, an int32 scalar array.
      params: the full parameter pytree, frozen leaves included.
      opt_state: the optimizer's state for the trainable view (the trained leaves, and
        the kept channels of `Channels` leaves).
      scheme: the `Scheme` the state was made for, or None.
    """

    step: Any
    params: Any
    opt_state: Any
    scheme: Scheme | None = None

    def replace(self, **changes) -> "TrainState":
        """A copy with some fields changed.

        Args:
          **changes: new values by field name (`step`, `params`, `opt_state`, `scheme`).

        Returns:
          The new `TrainState`.
        """
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(TrainState, data_fields=["step", "params", "opt_state"],
                                 meta_fields=["scheme"])


def abstract_arrays(tree):
    """Shapes and dtypes of a tree's leaves, with the sharding of those that have one."""
    def one(x):
        sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
        if sharding is not None and len(sharding.device_set) > 1:
            return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=sharding)
        return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))

    return jax.tree_util.tree_map(one, tree)


# The policies of `jax.checkpoint_policies` a string may name; the others there are
# factories (`save_only_these_names("x")`, ...) whose result is passed as a function.
POLICY_NAMES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
                "checkpoint_dots", "checkpoint_dots_with_no_batch_dims", "everything_saveable")


@dataclasses.dataclass(frozen=True)
class Remat:
    """Activation checkpointing as a trainer applies it: `jax.checkpoint` with `policy`
    around `where`, so the backward pass recomputes what the policy does not save
    instead of keeping it from the forward pass.

    Users pass `remat=` as a string or a policy function (`SparseTrainer`,
    `sparse_train`, `pockjax.nnx.Trainer`) and get one of these (`Remat.of`); `report()`
    prints it.

    Attributes:
      policy: the `jax.checkpoint` policy function.
      policy_name: its name, for reports.
      where: what is checkpointed, for reports; default "the whole loss".
      in_loss: True where the loss function checkpoints itself (the NNX trainer wraps
        each block's call) and the trainer only reports it; default False.
    """

    policy: Callable
    policy_name: str
    where: str = "the whole loss"
    in_loss: bool = False

    @classmethod
    def of(cls, remat: Any, where: str = "the whole loss", in_loss: bool = False,
           arg: str = "remat") -> "Remat":
        """The `Remat` of a `remat=` argument.

        Args:
          remat: `"full"` (nothing saved: the backward recomputes everything it reads),
            a policy name of `jax.checkpoint_policies` (`"dots_saveable"`, ...), a policy
            function (`jax.checkpoint_policies.save_only_these_names("block")`), or a
            `Remat` (returned as it is).
          where: what is checkpointed, for reports; default "the whole loss".
          in_loss: whether the loss function checkpoints itself; default False.
          arg: the parameter's name in error messages; default "remat".

        Returns:
          The `Remat`.

        Raises:
          ValueError: `remat` is a string that is neither "full" nor a policy name (a
            policy factory's name gets a hint to call it).
          TypeError: `remat` is neither a string, a callable nor a `Remat`.
        """
        if isinstance(remat, Remat):
            return remat
        if isinstance(remat, str):
            name = "nothing_saveable" if remat == "full" else remat
            if name not in POLICY_NAMES:
                factories = sorted(n for n in dir(jax.checkpoint_policies)
                                   if not n.startswith("_") and n not in POLICY_NAMES)
                hint = (f"; {remat!r} takes arguments: pass its result, e.g. {arg}=jax."
                        f"checkpoint_policies.{remat}(...)" if remat in factories else "")
                raise ValueError(
                    f"{arg}={remat!r} is not a checkpoint policy; give 'full' (nothing saved), "
                    f"one of {', '.join(map(repr, POLICY_NAMES))}, or a policy function such "
                    f"as jax.checkpoint_policies.save_only_these_names('block'){hint}")
            return cls(getattr(jax.checkpoint_policies, name), name, where, in_loss)
        if callable(remat):
            return cls(remat, _policy_name(remat), where, in_loss)
        raise TypeError(f"{arg} must be None, 'full', a policy name ({', '.join(POLICY_NAMES)}) "
                        f"or a jax.checkpoint policy function, got {type(remat).__name__}")

    def __str__(self) -> str:
        inside = "a block" if self.in_loss else "it"
        saved = (f"nothing saved inside {inside}" if self.policy_name == "nothing_saveable"
                 else f"policy {self.policy_name}")
        return f"{self.where} (jax.checkpoint, {saved})"


def _policy_name(policy: Callable) -> str:
    for name in POLICY_NAMES:
        if policy is getattr(jax.checkpoint_policies, name):
            return name
    name = getattr(policy, "__qualname__", None)
    if name is None:  # a policy object, e.g. SaveOnlyTheseNames(saveable_names=...)
        return repr(policy) if len(repr(policy)) <= 80 else type(policy).__name__
    # A factory's result is its local `policy`: name the factory.
    return name.split(".<locals>")[0] + "(...)" if ".<locals>" in name else name


def checkpointed(loss_fn: Callable, remat: Remat | None) -> Callable:
    """`loss_fn` under `jax.checkpoint` with the policy of `remat` (unchanged for None,
    or when the loss checkpoints itself)."""
    if remat is None or remat.in_loss:
        return loss_fn

    @functools.wraps(loss_fn)
    def loss(*args, **kwargs):
        return checkpoint_call(loss_fn, remat.policy, *args, **kwargs)

    return loss


def checkpoint_call(fn: Callable, policy: Callable, *args, recompute_after_cotangent: bool = False,
                    untied: Sequence[int] = (), hoist_closure: bool = False, **kwargs):
    """`fn(*args, **kwargs)` under `jax.checkpoint(policy=policy)`. The array leaves of
    the arguments are the checkpoint's inputs; the other leaves (Python numbers, strings,
    NumPy constants) stay static, as `fn` expects them.

    `recompute_after_cotangent=True` makes the recomputation wait for the output's
    cotangent. XLA's CPU scheduler drops the optimization barriers `jax.checkpoint`
    places and runs a recomputation, which depends on the saved values only, as early as
    it can: right beside the forward pass, so every block's activations are alive at
    once again and checkpointing saves nothing (measured: 141.9 vs 145.9 MiB of
    temporaries, LLaMA 4 x 128 at sequence 512). Here the saved values are tied to the
    cotangent by data (times `1 + 0 * g[0]`, exactly 1), except the positional
    arguments numbered in `untied` (the block's weights: tying would copy them).
    Tying the block's input is enough for a policy that saves nothing inside it.

    `hoist_closure=True` makes the arrays `fn` closes over that may be differentiated
    (a block's weights captured by a lambda) inputs too, untied: a `jax.custom_vjp`
    cannot differentiate a value it closes over."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    dyn = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, jax.core.Tracer))]
    owner = [n for n, a in enumerate(args) for _ in jax.tree_util.tree_leaves(a)]
    owner += [None] * (len(leaves) - len(owner))

    def run(dyn_leaves):
        full = list(leaves)
        for i, x in zip(dyn, dyn_leaves):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(tree, full)
        return fn(*a, **k)

    inputs = [leaves[i] for i in dyn]
    plain = [owner[i] in untied for i in dyn]
    if hoist_closure:
        # The tracers `fn` closes over become inputs, as `jax.closure_convert` does, but
        # without its cache (keyed by this new closure each call, it would keep every
        # call's arguments and weights alive).
        import jax.extend as jex

        closed, out_shape = jax.make_jaxpr(run, return_shape=True)(inputs)
        traced = [i for i, c in enumerate(closed.consts) if isinstance(c, jax.core.Tracer)]
        out_tree = jax.tree_util.tree_structure(out_shape)
        n = len(inputs)

        def run(both):
            consts = list(closed.consts)
            for i, c in zip(traced, both[n:]):
                consts[i] = c
            call = jex.core.jaxpr_as_fun(jex.core.ClosedJaxpr(closed.jaxpr, consts))
            return jax.tree_util.tree_unflatten(out_tree, call(*both[:n]))

        inputs = inputs + [closed.consts[i] for i in traced]
        plain = plain + [True] * len(traced)
    checkpointed_run = jax.checkpoint(run, policy=policy)
    if not recompute_after_cotangent:
        return checkpointed_run(inputs)
    return _late(checkpointed_run, plain)(inputs)


def checkpoint_block(fn: Callable | None = None, *, policy: Any = "full",
                     weights: int | Sequence[int] = 0) -> Callable:
    """Activation checkpointing for one block of a plain loss function.

    The result is `fn` as it is in the forward pass, but its backward pass recomputes the
    block's activations from its inputs instead of keeping them, as
    `pockjax.nnx.Trainer(remat="blocks")` does for the blocks of a module. Use it bare or
    with arguments, as a decorator or a wrapper (see the examples). Values are those of
    `fn` itself.

    The recomputation waits for the block output's cotangent, tied to it by data through
    every input but the weights (see `checkpoint_call`), while the weights are used as
    they are (tying them would copy them). The tie is what makes it save memory on XLA's
    CPU backend, where a plain `jax.checkpoint` around each block saves nothing: its
    recomputation is scheduled beside the forward pass.

    Args:
      fn: the block function; None (`checkpoint_block(policy=...)`) returns a decorator.
      policy: what `remat=` takes: `"full"` (the default: nothing saved inside the
        block), a name from `jax.checkpoint_policies` (`"dots_saveable"`, ...) or a
        policy function; None returns `fn` unchanged.
      weights: the positions of the positional arguments that hold the block's weights,
        an int or a sequence of ints: 0 (the default) for the first, as in
        `block(params, h)`; `()` when the block closes over them. Weights passed by
        keyword are tied, and so copied.

    Returns:
      The checkpointed block, taking `fn`'s arguments; without `fn`, a decorator that
      makes one.

    Raises:
      TypeError: `fn` is a string (a policy passed positionally) or not callable,
        `weights` holds something other than non-negative ints, or `policy` is of
        another type; when the block is called, a `weights` position lies past its
        positional arguments.
      ValueError: `policy` names no checkpoint policy; when the block is called, no
        array input besides the weights is left to tie the recomputation to.

    Examples:
      >>> import jax, jax.numpy as jnp, pockjax as pj
      >>> @pj.checkpoint_block
      ... def block(p, h):
      ...     return h + jax.nn.relu(h @ p["up"]) @ p["down"]
      >>> def loss(params, x):
      ...     h = x
      ...     for name in ("b0", "b1"):
      ...         h = block(params[name], h)
      ...     return jnp.mean(h ** 2)
      >>> p = {"up": jnp.ones((4, 8)) / 8, "down": jnp.ones((8, 4)) / 8}
      >>> g = jax.grad(loss)({"b0": p, "b1": p}, jnp.ones((2, 4)))
      >>> g["b1"]["up"].shape
      (4, 8)
      >>> def loss2(p, x):  # weights closed over, the matmuls' outputs saved
      ...     up = pj.checkpoint_block(lambda h: jax.nn.relu(h @ p["up"]), weights=(),
      ...                              policy="dots_saveable")
      ...     return jnp.sum(up(x))
      >>> jax.grad(loss2)(p, jnp.ones((2, 4)))["up"].shape
      (4, 8)
    """
    if fn is None:
        return functools.partial(checkpoint_block, policy=policy, weights=weights)
    if isinstance(fn, str):
        raise TypeError(f"checkpoint_block takes the block function first and the policy by "
                        f"keyword: pj.checkpoint_block(block, policy={fn!r}) or "
                        f"@pj.checkpoint_block(policy={fn!r})")
    if not callable(fn):
        raise TypeError(f"checkpoint_block wraps a block function, e.g. h = pj.checkpoint_block("
                        f"block)(params, h) or @pj.checkpoint_block above its def; got "
                        f"{type(fn).__name__}")
    untied = (weights,) if isinstance(weights, int) else tuple(weights)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in untied):
        raise TypeError(f"checkpoint_block(weights={weights!r}): give the positions of the "
                        f"arguments holding the block's weights, e.g. weights=0 for "
                        f"block(params, h), or weights=() when the block closes over them")
    if policy is None:
        return fn
    spec = Remat.of(policy, where=getattr(fn, "__name__", "a block"), in_loss=True,
                    arg="policy")

    @functools.wraps(fn)
    def block(*args, **kwargs):
        if any(i >= len(args) for i in untied):
            raise TypeError(f"checkpoint_block({spec.where}, weights={weights!r}): the block "
                            f"was called with {len(args)} positional arguments; weights= "
                            f"numbers positional arguments (weights passed by keyword would "
                            f"be copied in the backward pass: pass them positionally)")
        tied = [a for n, a in enumerate(args) if n not in untied] + list(kwargs.values())
        if not any(isinstance(x, (jax.Array, jax.core.Tracer))
                   for x in jax.tree_util.tree_leaves(tied)):
            raise ValueError(
                f"checkpoint_block({spec.where}, weights={weights!r}): no array input is "
                f"left to tie the recomputation to (the block's activations), so it would be "
                f"recomputed in the forward pass and save nothing; weights= names only the "
                f"arguments holding the weights, e.g. weights=0 for block(params, h) or "
                f"weights=() for block(h) with the weights closed over")
        return checkpoint_call(fn, spec.policy, *args, recompute_after_cotangent=True,
                               untied=untied, hoist_closure=True, **kwargs)

    return block


def _late(f: Callable, untied: list[bool]) -> Callable:
    """`f` (of a list of arrays) whose backward pass starts only once the cotangent of
    its output exists; the inputs marked in `untied` are used as they are."""
    kept: list[bool] = []

    @jax.custom_vjp
    def call(inputs):
        return f(inputs)

    def fwd(inputs):
        out, vjp_fn = jax.vjp(f, inputs)
        plain = [x for x, u in zip(inputs, untied) if u]
        kept[:] = [any(r is x for x in plain) for r in jax.tree_util.tree_leaves(vjp_fn)]
        return out, vjp_fn

    def bwd(vjp_fn, g):
        leaves, tree = jax.tree_util.tree_flatten(vjp_fn)
        anchor = _anchor(g)
        if anchor is not None:
            leaves = [r if k or not _floating(r) else r * (1 + anchor).astype(r.dtype)
                      for r, k in zip(leaves, kept)]
        return jax.tree_util.tree_unflatten(tree, leaves)(g)

    call.defvjp(fwd, bwd)
    return call


def _floating(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _anchor(tree):
    """A scalar 0 computed from the first element of every floating leaf of `tree`:
    the sum of `0 * first` (with 0 for a first element that is not finite, so an inf or
    NaN there goes nowhere). XLA keeps `0 * x` for floats, so the dependency stays."""
    zeros = [0 * jnp.where(jnp.isfinite(v), v, 0) for v in (
        jax.lax.slice(x, (0,) * x.ndim, (1,) * x.ndim).reshape(()).astype(jnp.float32)
        for x in jax.tree_util.tree_leaves(tree) if _floating(x) and np.size(x))]
    return sum(zeros[1:], zeros[0]) if zeros else None


def _with_shardings(avals, shardings):
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), avals, shardings)


class SparseTrainer:
    """A compiled sparse training step; make one with `pockjax.sparse_train`.

    `trainer(state, batch)` runs one step; `init` makes the first state; `report`,
    `explain`, `lower` and `trace` inspect the step; `export` compiles it for IREE.

    Args:
      loss_fn: `loss_fn(params, batch)`, returning a scalar loss, or `(loss, aux)` with
        `has_aux`.
      optimizer: an optax `GradientTransformation`, applied to the trainable view.
      scheme: the `Scheme` saying which parameters train.
      has_aux: whether `loss_fn` returns `(loss, aux)`; default False.
      donate: donate the state to each step, so parameters and optimizer state are
        updated in place (the default); a donated state cannot be used again.
      layout: a `pockjax.sharding.Layout` for a multi-device step, or None (the
        default); `sparse_train(mesh=...)` builds it.
      remat: activation checkpointing of the loss: None (the default), or what
        `Remat.of` takes.
      skip_nonfinite: make a step whose loss or any gradient is not finite change
        nothing (see `sparse_train`); default False.
      frozen_dtype: the storage `init` gives the frozen leaves (see `sparse_train`);
        None (the default) keeps them as they are.

    Attributes:
      loss_fn: the loss function.
      optimizer: the optax transformation.
      scheme: the `Scheme`.
      has_aux: whether the loss returns aux.
      donate: whether the state is donated.
      layout: the `Layout`, or None.
      remat: the `Remat`, or None.
      skip_nonfinite: whether non-finite steps are skipped.
      frozen_dtype: the frozen leaves' storage, or None.

    Raises:
      TypeError: `optimizer` has no `init` and `update`, or `remat` is of the wrong
        type.
      SchemeError: `scheme` is not a `Scheme`.
      ValueError: `remat` is a string that names no checkpoint policy.
    """

    def __init__(self, loss_fn: Callable, optimizer: optax.GradientTransformation,
                 scheme: Scheme, has_aux: bool = False, donate: bool = True,
                 layout: _sharding.Layout | None = None, remat: Any = None,
                 skip_nonfinite: bool = False, frozen_dtype: Any = None):
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(f"optimizer must be an optax GradientTransformation (with init and "
                            f"update), got {type(optimizer).__name__}")
        if not isinstance(scheme, Scheme):
            raise SchemeError(f"scheme must be a pockjax.Scheme, got {type(scheme).__name__}")
        self.loss_fn, self.optimizer, self.scheme = loss_fn, optimizer, scheme
        self.has_aux, self.donate, self.layout = has_aux, donate, layout
        self.skip_nonfinite = bool(skip_nonfinite)
        self.remat: Remat | None = None if remat is None else Remat.of(remat)
        if frozen_dtype is not None:
            lowbit.format_of(frozen_dtype) if not isinstance(frozen_dtype, Mapping) else \
                [lowbit.format_of(f) for f in frozen_dtype.values()]  # unknown names fail here
        self.frozen_dtype = frozen_dtype
        # What the step differentiates: the loss, on quantized frozen weights where the
        # parameters hold them (dequantized at each use), checkpointed as `remat` says.
        self._loss = checkpointed(lowbit.at_use(loss_fn), self.remat)
        self._grad = SparseGradFn(self._loss, scheme, 0, has_aux, with_value=True)
        self._plans: dict = {}
        self._step_jit = jax.jit(self.step, donate_argnums=(0,) if donate else ())
        functools.update_wrapper(self, loss_fn)

    def __repr__(self) -> str:
        name = getattr(self.loss_fn, "__name__", "loss")
        mesh = f", mesh={dict(self.layout.mesh.shape)}" if self.layout is not None else ""
        remat = f", remat={self.remat.policy_name!r}" if self.remat is not None else ""
        skip = ", skip_nonfinite=True" if self.skip_nonfinite else ""
        return (f"SparseTrainer({name}, scheme={self.scheme!r}, donate={self.donate}"
                f"{remat}{skip}{mesh})")

    # -- state -----------------------------------------------------------------

    def init(self, params, *, copy: bool = True) -> TrainState:
        """The initial state: optimizer state for the trainable view only.

        Parameters given as `jax.ShapeDtypeStruct`s (e.g. from `nnx.eval_shape`) give an
        abstract state, with nothing allocated: `report()`, `lower()` and `trace()`
        accept it, so a model's memory can be read before it is loaded; stepping and
        export need arrays. With a layout, the state is placed on the mesh.

        Args:
          params: the model's parameter pytree: all arrays, or all
            `jax.ShapeDtypeStruct`s.
          copy: True (the default) copies the parameters, so donating the state in later
            steps never deletes the caller's arrays; False hands them over (saves one
            copy of the model).

        Returns:
          A `TrainState` at step 0.

        Raises:
          SchemeError: the scheme does not fit `params`.
          TypeError: `params` mixes arrays and `jax.ShapeDtypeStruct`s.
        """
        scheme, optimizer = self.scheme, self.optimizer
        scheme.resolve(params)  # scheme errors surface here, outside any trace
        init = lambda p: optimizer.init(trainable(p, scheme))
        if self.frozen_dtype is not None:
            quantize = lambda p: lowbit.quantize(p, scheme, self.frozen_dtype)
            params = (jax.eval_shape(quantize, params) if _abstract(params, "params")
                      else quantize(params))
        if _abstract(params, "params"):
            # Shapes only: for report(), lower() and export() before allocating a model.
            return TrainState(jax.ShapeDtypeStruct((), jnp.int32), params,
                              jax.eval_shape(init, params), scheme)
        if copy:
            params = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), params)
        if self.layout is None:
            opt_state = jax.jit(init)(params)
            step = jnp.zeros((), jnp.int32)
        else:
            shardings = self._shardings(params, jax.eval_shape(init, params))
            params = _sharding.place(params, shardings.params)
            opt_state = jax.jit(init, out_shardings=shardings.opt_state)(params)
            step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
        state = TrainState(step, params, opt_state, scheme)
        return _distinct_buffers(state) if self.donate else state

    def _shardings(self, params, opt_state, decisions=None) -> TrainState:
        """Where each array of the state lives on the mesh (a TrainState of shardings)."""
        layout = self.layout
        decisions = resolved_decisions(params, self.scheme) if decisions is None else decisions
        view = jax.eval_shape(lambda p: trainable(p, _decisions_tree(p, decisions)), abstract_arrays(params))
        view_shardings = layout.view_shardings(params, decisions)
        return TrainState(
            layout.replicated, layout.param_shardings(params, decisions),
            layout.opt_state_shardings(self.optimizer, view, view_shardings, abstract_arrays(opt_state)),
            self.scheme)

    # -- the step --------------------------------------------------------------

    def _plan(self, view, opt_state) -> perleaf.UpdatePlan:
        view_avals, state_avals = abstract_arrays(view), abstract_arrays(opt_state)
        key = (jax.tree_util.tree_structure(view, is_leaf=lambda x: x is None),
               tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(view_avals)),
               jax.tree_util.tree_structure(opt_state),
               tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(state_avals)))
        if key not in self._plans:
            names = [p for p, _ in leaves_with_paths(view)[0]]
            self._plans[key] = perleaf.plan_updates(self.optimizer, view_avals, state_avals,
                                                    view_avals, names)
        return self._plans[key]

    def _check_state(self, state):
        if not isinstance(state, TrainState):
            raise TypeError(f"expected a pockjax.TrainState (from trainer.init(params)), "
                            f"got {type(state).__name__}")
        if state.scheme is not None and state.scheme != self.scheme:
            raise SchemeError(f"this state was made for {state.scheme!r}, but the trainer uses "
                              f"{self.scheme!r}; make the state with this trainer's init()")

    def replace(self, **changes) -> "SparseTrainer":
        """A new trainer with some of its settings changed.

        Args:
          **changes: new values for any of `loss_fn`, `optimizer`, `scheme`, `has_aux`,
            `donate`, `layout`, `remat`, `skip_nonfinite`.

        Returns:
          A new `SparseTrainer` (compiled anew on first use).

        Raises:
          TypeError: a name in `changes` is not one of the settings.
        """
        settings = dict(loss_fn=self.loss_fn, optimizer=self.optimizer, scheme=self.scheme,
                        has_aux=self.has_aux, donate=self.donate, layout=self.layout,
                        remat=self.remat, skip_nonfinite=self.skip_nonfinite,
                        frozen_dtype=self.frozen_dtype)
        unknown = sorted(set(changes) - set(settings))
        if unknown:
            raise TypeError(f"SparseTrainer.replace() got unknown settings {unknown}; "
                            f"it takes {sorted(settings)}")
        return SparseTrainer(**{**settings, **changes})

    def step(self, state: TrainState, batch, *, placement: str | None = None,
             ties: str = "data"):
        """The training step as a function to trace (`trainer(state, batch)` runs it
        jitted, with the state donated).

        Args:
          state: the `TrainState`.
          batch: the step's batch.
          placement: None (the default) uses the update mode `update_mode` gives;
            "fused" forces the per-leaf update interleaved with the backward pass, any
            other value the single-barrier update after it (the simple alternative, for
            comparisons).
          ties: how each in-place write is ordered after the parameter's last reads:
            "data" (the default) or "barrier"; see `pockjax.optim.fused.fused_step`.

        Returns:
          `(new state, metrics)`: `metrics` has `"loss"`, `"aux"` with `has_aux`, and
          `"skipped"` (a bool) with `skip_nonfinite`.
        """
        _, info, aux_def, decisions, _ = self._grad.trace(state.params, batch)
        param_leaves = jax.tree_util.tree_leaves(state.params)
        other = [x for x in jax.tree_util.tree_leaves(([None, batch], {})) if is_dynamic(x)]
        view = trainable(state.params, _decisions_tree(state.params, decisions))
        plan = self._plan(view, state.opt_state)
        n_head = 1 + aux_def.num_leaves
        state_leaves, state_def = jax.tree_util.tree_flatten(state.opt_state)
        mesh = {}
        if self.layout is not None:
            mesh = self._mesh_reads(state.params, decisions)
        finite = None
        if (placement or self._mode(plan)[0]) == "fused":
            head, new_params, new_state = fused.fused_step(
                info.jaxpr, param_leaves, other, decisions, plan, state_leaves, n_head,
                ties=ties, **mesh)
            new_state = jax.tree_util.tree_unflatten(state_def, new_state)
        else:
            view_def = jax.tree_util.tree_structure(view)
            head, new_params, new_state, finite = fused.global_step(
                info.jaxpr, param_leaves, other, decisions, self.optimizer, state.opt_state,
                view_def, n_head, ties=ties, skip_nonfinite=self.skip_nonfinite, **mesh)
        params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state.params),
                                              new_params)
        metrics = {"loss": head[0]}
        if self.has_aux:
            metrics["aux"] = jax.tree_util.tree_unflatten(aux_def, head[1:])
        step = state.step + 1
        if self.skip_nonfinite:
            metrics["skipped"] = ~finite
            step = state.step + finite.astype(state.step.dtype)
        new = TrainState(step, params, new_state, state.scheme)
        if self.layout is not None:
            # The updated state keeps the layout it came in with (in place, no gather).
            new = _sharding.constrain(new, self._shardings(state.params, state.opt_state, decisions))
            metrics["loss"] = jax.lax.with_sharding_constraint(metrics["loss"], self.layout.replicated)
        return new, metrics

    def _mesh_reads(self, params, decisions) -> dict:
        """FSDP-style: the step reads each weight gathered over the parameter axis
        (other axes of a `param_specs` layout stay split) and reduces each gradient
        straight into the weight's own layout."""
        layout = self.layout
        reads = jax.tree_util.tree_leaves(layout.read_gathered(params, decisions))
        grad_shardings = jax.tree_util.tree_leaves(layout.view_shardings(params, decisions))
        return {"reads": reads, "grad_shardings": grad_shardings}

    def __call__(self, state: TrainState, batch):
        """One training step, compiled on first use for each batch signature.

        With `donate` the state's buffers are updated in place: only the returned state
        is valid afterwards.

        Args:
          state: the `TrainState` (from `init`, or a previous step's).
          batch: the step's batch; with a layout it is placed on the mesh first.

        Returns:
          `(new state, metrics)`: `metrics` has `"loss"`, `"aux"` with `has_aux`, and
          `"skipped"` with `skip_nonfinite`.

        Raises:
          TypeError: `state` is not a `TrainState`, or holds shapes instead of arrays.
          SchemeError: `state` was made for another scheme.
          ValueError: `state`'s buffers were already donated to an earlier step.
        """
        self._check_state(state)
        if _abstract(state, "state"):
            raise TypeError("this TrainState holds shapes (jax.ShapeDtypeStruct), not arrays: "
                            "it can be reported or lowered, not stepped or exported; make it "
                            "from the model's arrays with trainer.init(params)")
        _check_not_donated(state, self.donate)
        if self.layout is not None:
            batch = self.layout.put_batch(batch)
        return self._step_jit(state, batch)

    def shard_batch(self, batch):
        """The batch placed on the trainer's mesh (split over the data axis); with
        several processes, each passes its own part of the global batch.

        Args:
          batch: the batch pytree.

        Returns:
          The batch as arrays laid out on the mesh.

        Raises:
          ValueError: the trainer has no mesh.
        """
        if self.layout is None:
            raise ValueError("this trainer has no mesh; pass mesh= to sparse_train to shard")
        return self.layout.put_batch(batch)

    def _step_avals(self, state: TrainState, batch):
        """Abstract arguments of the step, with the mesh layout where there is one."""
        if self.layout is None:
            return abstract_arrays(state), abstract_arrays(batch)
        state_avals = _with_shardings(abstract_arrays(state), self._shardings(state.params, state.opt_state))
        batch_avals = abstract_arrays(batch)
        if not all(getattr(a, "sharding", None) for a in jax.tree_util.tree_leaves(batch_avals)):
            batch_avals = _with_shardings(batch_avals, self.layout.batch_shardings(batch))
        return state_avals, batch_avals

    def lower(self, state: TrainState, batch) -> jax.stages.Lowered:
        """The lowered step, for `.as_text()`, `.compile().memory_analysis()`, ...

        Args:
          state: a `TrainState` (arrays or shapes).
          batch: a batch (arrays or `jax.ShapeDtypeStruct`s).

        Returns:
          The `jax.stages.Lowered` step.

        Raises:
          TypeError: `state` is not a `TrainState`.
          SchemeError: `state` was made for another scheme.
        """
        self._check_state(state)
        if self.layout is not None:
            return self._step_jit.lower(*self._step_avals(state, batch))
        return self._step_jit.lower(state, batch)

    def trace(self, state: TrainState, batch) -> jax.stages.Traced:
        """The traced step, for `.jaxpr`, `.lower()`, `pockjax.count_flops(...)`.

        Args:
          state: a `TrainState` (arrays or shapes).
          batch: a batch (arrays or `jax.ShapeDtypeStruct`s).

        Returns:
          The `jax.stages.Traced` step.

        Raises:
          TypeError: `state` is not a `TrainState`.
          SchemeError: `state` was made for another scheme.
        """
        self._check_state(state)
        return self._step_jit.trace(*self._step_avals(state, batch))

    def update_mode(self, state: TrainState, batch) -> tuple[str, str]:
        """How this state's trainable view is updated, and why.

        Args:
          state: a `TrainState`.
          batch: a batch (unused: the mode depends on the optimizer and the view).

        Returns:
          `(mode, reason)`: "fused" (each leaf updated right after its gradient) or
          "global" (after the whole backward pass), and the reason in words.
        """
        view = jax.eval_shape(lambda p: trainable(p, self.scheme), abstract_arrays(state.params))
        return self._mode(self._plan(view, state.opt_state))

    def _mode(self, plan: perleaf.UpdatePlan) -> tuple[str, str]:
        if self.skip_nonfinite:
            return "global", ("skip_nonfinite: every gradient is checked before any "
                              "parameter is written")
        return plan.mode, plan.reason

    def explain(self, state: TrainState, batch) -> TransformInfo:
        """What `sparse_grad` did to this step's backward pass.

        Args:
          state: a `TrainState`.
          batch: a batch of the training shape.

        Returns:
          The `TransformInfo`: parameter counts, the rules used, fallbacks, the jaxpr.
        """
        return self._grad.explain(state.params, batch)

    def export(self, state: TrainState, batch, target: str = "host-cpu", out_dir: str = "export",
               gpu: str | None = None, extra_flags=(), progress: bool = False):
        """Compile this step for an IREE target and write the artifact directory
        (`train_step.vmfb`, `params.irpa`, `manifest.json`); see `pockjax.export`.

        Args:
          state: a `TrainState` of arrays (its values go into the artifact).
          batch: a batch of the shape to compile for.
          target: the IREE target's name (`pockjax.export.TARGETS`); default "host-cpu".
          out_dir: the artifact directory to write; default "export".
          gpu: the GPU family, for GPU targets; None for the target's default.
          extra_flags: more compiler flags (`--iree-...=value`).
          progress: name each stage on stderr as it starts; default False.

        Returns:
          The `pockjax.export.Artifact`.
        """
        from pockjax.export import export
        return export(self, state, batch, target=target, out_dir=out_dir, gpu=gpu,
                      extra_flags=extra_flags, progress=progress)

    # -- reports ---------------------------------------------------------------

    def _full_lowered(self, state: TrainState, batch) -> jax.stages.Lowered:
        return self._full_traced(state, batch).lower()

    def _full_traced(self, state: TrainState, batch) -> jax.stages.Traced:
        """The same model trained in full with plain `jax.value_and_grad` + optax (and
        the same activation checkpointing)."""
        loss_fn, optimizer, has_aux = self._loss, self.optimizer, self.has_aux

        layout = self.layout
        gather = lambda p: p
        if layout is not None:  # read gathered, as the step does
            gather = lambda p: layout.read_gathered(p, [Full()] * len(jax.tree_util.tree_leaves(p)))

        def full_step(params, opt_state, batch):
            out, g = jax.value_and_grad(lambda p, b: loss_fn(gather(p), b), has_aux=has_aux)(
                params, batch)
            updates, opt_state = optimizer.update(g, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, out

        # Full training of the float model: quantized weights at their float shape.
        params = abstract_arrays(jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32) if lowbit.is_quantized(x)
            or (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
                and self.frozen_dtype is not None) else x,
            state.params, is_leaf=lowbit.is_quantized))
        opt_state = jax.eval_shape(optimizer.init, params)
        batch_avals = abstract_arrays(batch)
        if layout is not None:  # the same layout, every parameter trained
            full = [Full()] * len(jax.tree_util.tree_leaves(params))
            param_shardings = layout.param_shardings(params, full)
            opt_state = _with_shardings(opt_state, layout.opt_state_shardings(
                optimizer, params, param_shardings, opt_state))
            params = _with_shardings(params, param_shardings)
            batch_avals = _with_shardings(batch_avals, layout.batch_shardings(batch))
        donate = (0, 1) if self.donate else ()
        return jax.jit(full_step, donate_argnums=donate).trace(params, opt_state, batch_avals)

    def report(self, state: TrainState, batch) -> "TrainReport":
        """Trainable vs total parameters, FLOPs and compiled memory of this step against
        the same model trained in full, the update mode, and what the transform did.

        Both steps are compiled (not run); an abstract state (`init` of
        `jax.ShapeDtypeStruct`s) is enough.

        Args:
          state: a `TrainState` (arrays or shapes).
          batch: a batch of the training shape.

        Returns:
          A `TrainReport`; `str()` renders it as a table.

        Raises:
          TypeError: `state` is not a `TrainState`.
          SchemeError: `state` was made for another scheme.
        """
        self._check_state(state)
        # FLOPs from the traced programs: XLA's cost_analysis() counts a loop body once.
        sparse_traced, full_traced = self.trace(state, batch), self._full_traced(state, batch)
        sparse, full = sparse_traced.lower().compile(), full_traced.lower().compile()
        mode, reason = self.update_mode(state, batch)
        info = self.explain(state, batch)
        full_state = jax.eval_shape(self.optimizer.init, abstract_arrays(state.params))
        memory, memory_full = compiled_memory(sparse), compiled_memory(full)
        breakdown = breakdown_full = None
        if self.layout is None:  # on a mesh the per-device split is the layout's
            decisions = resolved_decisions(state.params, self.scheme)
            breakdown = self._breakdown(state, batch, decisions, memory["temp"])
            everything = TrainState(state.step, state.params, full_state, None)
            breakdown_full = self._breakdown(everything, batch, [Full()] * len(decisions),
                                             memory_full["temp"])
        return TrainReport(
            trainable_params=info.trainable_params, total_params=info.total_params,
            mode=mode, mode_reason=reason,
            flops=count_flops(sparse_traced), flops_full=count_flops(full_traced),
            memory=memory, memory_full=memory_full,
            opt_state_bytes=tree_bytes(state.opt_state), opt_state_bytes_full=tree_bytes(full_state),
            transform=info,
            devices=1 if self.layout is None else self.layout.mesh.devices.size,
            layout=None if self.layout is None else self.layout.describe(),
            collectives=_sharding.collectives(sparse) if self.layout is not None else [],
            collectives_full=_sharding.collectives(full) if self.layout is not None else [],
            breakdown=breakdown, breakdown_full=breakdown_full,
            remat="none" if self.remat is None else str(self.remat))

    def _breakdown(self, state: TrainState, batch, decisions, temp: int) -> dict[str, int]:
        """The step's memory by what it holds, in bytes: the arguments by kind (exact)
        and the compiled temporaries split into the activations the backward pass reads
        (an estimate: the residuals of `jax.vjp` with respect to the trained leaves) and
        the rest."""
        leaves = jax.tree_util.tree_leaves(state.params)
        trained = [i for i, d in enumerate(decisions) if not isinstance(d, Frozen)]
        dynamic = [x for x in jax.tree_util.tree_leaves(batch) if is_dynamic(x)]
        kept = _residual_bytes(self._loss, self.has_aux, state.params, batch, trained)
        return {"frozen weights": tree_bytes([x for i, x in enumerate(leaves) if i not in set(trained)]),
                "trained weights": tree_bytes([leaves[i] for i in trained]),
                "optimizer state": tree_bytes(state.opt_state) + tree_bytes(state.step),
                "batch": tree_bytes(dynamic),
                "activations kept for backward": min(kept, temp),
                "other temporaries": max(temp - kept, 0)}


def _residual_bytes(loss_fn, has_aux: bool, params, batch, trained: list[int]) -> int:
    """Bytes of what reverse mode keeps from the forward pass for the gradient of the
    leaves at `trained`: the residuals of `jax.vjp`, less the inputs themselves."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    batch_leaves, batch_def = jax.tree_util.tree_flatten(batch)
    dyn = [i for i, x in enumerate(batch_leaves) if is_dynamic(x)]

    def keep(t, rest, dyn_leaves):
        full = list(rest)
        for i, x in zip(trained, t):
            full[i] = x
        b = list(batch_leaves)
        for i, x in zip(dyn, dyn_leaves):
            b[i] = x
        b = jax.tree_util.tree_unflatten(batch_def, b)
        f = lambda t_: loss_fn(jax.tree_util.tree_unflatten(
            treedef, [dict(zip(trained, t_)).get(i, x) for i, x in enumerate(full)]), b)
        return jax.vjp(f, t, has_aux=has_aux)[1]

    avals = abstract_arrays
    closed = jax.make_jaxpr(keep)(avals([leaves[i] for i in trained]), avals(leaves),
                                  avals([batch_leaves[i] for i in dyn]))
    inputs = set(closed.jaxpr.invars) | set(closed.jaxpr.constvars)
    seen, total = set(), 0
    for v in closed.jaxpr.outvars:
        if is_var(v) and v not in inputs and v not in seen:
            seen.add(v)
            total += int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
    return total


def _abstract(tree, what: str) -> bool:
    """Whether every leaf is a `jax.ShapeDtypeStruct`; refuse a mix of shapes and arrays."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    shapes = [isinstance(x, jax.ShapeDtypeStruct) for _, x in leaves]
    if any(shapes) and not all(shapes):
        path = next(p for (p, _), s in zip(leaves, shapes) if s != shapes[0])
        raise TypeError(f"{what}{jax.tree_util.keystr(path)} is "
                        f"{'a ShapeDtypeStruct' if not shapes[0] else 'an array'} while "
                        f"{what}{jax.tree_util.keystr(leaves[0][0])} is not: give all arrays "
                        f"(to train) or all jax.ShapeDtypeStructs (to report or lower)")
    return bool(shapes) and all(shapes)


def _check_not_donated(state: TrainState, donate: bool) -> None:
    """Refuse a state whose buffers an earlier step (or `init(copy=False)`) gave away,
    before XLA does with "Buffer has been deleted or donated"."""
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(x, jax.Array) and x.is_deleted():
            where = f"state{jax.tree_util.keystr(path)}"
            raise ValueError(
                f"{where} was deleted: this TrainState was already passed to a step, which "
                f"donates the state's buffers (updates them in place), so only the state it "
                f"returned is valid. Continue from `state, metrics = trainer(state, batch)`'s "
                f"new state" + ("; to keep old states usable, make the trainer with "
                                "sparse_train(..., donate=False) (one more copy of the parameters "
                                "and optimizer state per step)" if donate else
                                "; another trainer with donation consumed it"))


def _distinct_buffers(tree):
    """Copy any leaf whose buffer another leaf already uses (a tied weight, a state
    leaf aliasing a parameter): donation refuses one buffer passed twice."""
    seen = set()

    def fix(x):
        if not isinstance(x, jax.Array):
            return jnp.asarray(x)
        try:
            ptr = x.unsafe_buffer_pointer()
        except Exception:  # sharded or deleted arrays: leave as they are
            return x
        if ptr in seen:
            x = jnp.array(x, copy=True)
            ptr = x.unsafe_buffer_pointer()
        seen.add(ptr)
        return x

    return jax.tree_util.tree_map(fix, tree)


def _decisions_tree(params, decisions):
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), decisions)


@dataclasses.dataclass
class TrainReport:
    """What `trainer.report()` measured; `str()` renders it as a table.

    Each figure is given for this step and for the same model trained in full
    (`..._full`). Memory dicts hold XLA's memory analysis in bytes: `temp`, `argument`,
    `output`, `alias` (outputs written over donated arguments) and `peak`.

    Attributes:
      trainable_params: parameters the scheme trains.
      total_params: all parameters.
      mode: the update mode, "fused" or "global".
      mode_reason: why, in words.
      flops: FLOPs of this step.
      flops_full: FLOPs of the full-training step.
      memory: this step's compiled memory, per device on a mesh.
      memory_full: the full-training step's.
      opt_state_bytes: bytes of this step's optimizer state.
      opt_state_bytes_full: bytes of full training's optimizer state.
      transform: the `TransformInfo` of the sparse backward pass.
      devices: devices the step runs on.
      layout: the mesh layout in words, or None on one device.
      collectives: the collective operations of this step (on a mesh).
      collectives_full: those of the full-training step.
      breakdown: this step's memory by what it holds (weights, optimizer state,
        batch, activations kept for the backward pass as an estimate, other
        temporaries), or None on a mesh.
      breakdown_full: the same for full training.
      remat: the activation checkpointing in words ("none" without).
      backend: what runs the step ("xla"; `pockjax.backend.Runner` sets its choice).
    """

    trainable_params: int
    total_params: int
    mode: str
    mode_reason: str
    flops: float
    flops_full: float
    memory: dict[str, int]
    memory_full: dict[str, int]
    opt_state_bytes: int
    opt_state_bytes_full: int
    transform: TransformInfo
    devices: int = 1
    layout: str | None = None
    collectives: list = dataclasses.field(default_factory=list)
    collectives_full: list = dataclasses.field(default_factory=list)
    breakdown: dict[str, int] | None = None
    breakdown_full: dict[str, int] | None = None
    remat: str = "none"
    backend: str = "xla"  # what runs the step; `pockjax.backend.Runner` fills in its choice

    def as_dict(self) -> dict:
        """The report as plain data (for JSON).

        Returns:
          A dict of the fields; `transform` as its own `as_dict()`, collectives as
          dicts of `op`, `shapes`, `dtypes` and `bytes`.
        """
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["memory"], d["memory_full"] = dict(self.memory), dict(self.memory_full)
        d["transform"] = self.transform.as_dict()
        for k in ("collectives", "collectives_full"):
            d[k] = [{"op": c.op, "shapes": [list(x) for x in c.shapes], "dtypes": list(c.dtypes),
                     "bytes": c.nbytes} for c in getattr(self, k)]
        return d

    def collective_bytes(self, full: bool = False) -> dict[str, int]:
        """Bytes each kind of collective moves per step (per device, result sizes).

        Args:
          full: report the full-training step's collectives instead of this step's;
            default False.

        Returns:
          Operation name -> bytes.
        """
        out: dict[str, int] = {}
        for c in (self.collectives_full if full else self.collectives):
            out[c.op] = out.get(c.op, 0) + c.nbytes
        return out

    def __str__(self) -> str:
        ratio = lambda a, b: f"{a / b:.2f}x" if b else "-"
        rows = [("", "this step", "full training", "ratio"),
                ("parameters trained", f"{self.trainable_params:,}", f"{self.total_params:,}",
                 f"{100 * self.trainable_params / max(self.total_params, 1):.2f}%"),
                ("FLOPs", format_flops(self.flops), format_flops(self.flops_full),
                 ratio(self.flops, self.flops_full)),
                ("optimizer state", format_bytes(self.opt_state_bytes), format_bytes(self.opt_state_bytes_full),
                 ratio(self.opt_state_bytes, self.opt_state_bytes_full))]
        per = " per device" if self.devices > 1 else ""
        for k, label in (("temp", "temporary memory"), ("argument", "arguments"),
                         ("output", "outputs"), ("alias", "donated (aliased)"),
                         ("peak", "peak estimate")):
            rows.append((label + per, format_bytes(self.memory[k]), format_bytes(self.memory_full[k]),
                         ratio(self.memory[k], self.memory_full[k])))
        if self.breakdown is not None:
            rows.append(("memory by what it holds:", "", "", ""))
            for k, n in self.breakdown.items():
                label = "  " + k + (" (estimate)" if k == "activations kept for backward" else "")
                rows.append((label, format_bytes(n), format_bytes(self.breakdown_full[k]),
                             ratio(n, self.breakdown_full[k])))
        if self.layout is not None:
            ops, ops_full = self.collective_bytes(), self.collective_bytes(full=True)
            for op in sorted(set(ops) | set(ops_full)):
                n = sum(c.op == op for c in self.collectives)
                n_full = sum(c.op == op for c in self.collectives_full)
                rows.append((f"{op} ({n} vs {n_full} ops)", format_bytes(ops.get(op, 0)),
                             format_bytes(ops_full.get(op, 0)),
                             ratio(ops.get(op, 0), ops_full.get(op, 0))))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        fmt = lambda r: "  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in
                                                              zip(r[1:], widths[1:])])
        lines = [fmt(r) for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        # The transform's own summary, less its first line (the parameter count above).
        if self.layout is not None:
            lines += ["", f"layout: {self.layout}"]
        lines += ["", f"update mode: {self.mode} ({self.mode_reason})",
                  f"activation checkpointing: {self.remat}", f"backend: {self.backend}",
                  *str(self.transform).splitlines()[1:]]
        return "\n".join(lines)


def sparse_train(fun: Callable | None = None, *, optimizer: optax.GradientTransformation | None = None,
                 scheme: Any = None, has_aux: bool = False, donate: bool = True,
                 mesh: jax.sharding.Mesh | None = None, data_axis="data", param_axis=None,
                 param_specs=None, batch_specs=None, remat: Any = None,
                 skip_nonfinite: bool = False, frozen_dtype: Any = None):
    """Turn `loss(params, batch)` into a `SparseTrainer`.

    `scheme` defaults to training everything (`Scheme(default=Full())`); a
    `pockjax.schedule.Schedule` (`pj.schemes.schedule`, `pj.schemes.blockwise`) gives a
    `ScheduledTrainer`, whose schemes take turns. Use as
    `@sparse_train(optimizer=..., scheme=...)` or `sparse_train(loss, optimizer=...)`.

    With `mesh` the step runs on all its devices (`pockjax.sharding`): the batch is
    split over `data_axis`, parameters are replicated or, with `param_axis`, sharded
    FSDP-style; `param_specs` (a `{path: PartitionSpec}` dict or a function of
    `(path, shape)` returning one or None) sets the layout of chosen parameters and
    `batch_specs` that of chosen batch leaves.

    `remat` checkpoints the loss (`jax.checkpoint`): the backward pass recomputes the
    activations the policy does not save instead of keeping them from the forward pass,
    for longer sequences in less memory at the cost of recomputation. `"full"` saves
    nothing; a name from `jax.checkpoint_policies` (`"dots_saveable"`, ...) or a policy
    function chooses what is saved. Per block in a plain function: wrap each block in
    `checkpoint_block` (`h = pj.checkpoint_block(block)(params["b3"], h)`), which saves
    memory on XLA's CPU backend too, where a checkpoint over the whole loss does not.
    Frozen blocks ahead of every trained one are never differentiated and keep nothing
    either way. The full-training column of `report()` is checkpointed the same way.

    `skip_nonfinite=True` makes a step whose loss, outputs or any gradient is not finite
    (a NaN in one batch element) change nothing: parameters, optimizer state and the
    step count stay as they were, and `metrics["skipped"]` is True. Every gradient is
    then checked before the first write, so updates run after the backward pass
    (`report()`'s update mode "global") instead of interleaved with it.

    >>> import jax.numpy as jnp, optax, pockjax as pj
    >>> @pj.sparse_train(optimizer=optax.sgd(0.1))
    ... def trainer(p, batch):
    ...     return jnp.mean((batch @ p["w"]) ** 2)
    >>> state = trainer.init({"w": jnp.ones((3, 2))})
    >>> state, metrics = trainer(state, jnp.ones((4, 3)))
    >>> int(state.step)
    1

    Args:
      fun: the loss function `fun(params, batch)`; None (decorator use with arguments)
        returns a decorator.
      optimizer: an optax `GradientTransformation` (required).
      scheme: a `Scheme`, or a `pockjax.schedule.Schedule`; None (the default) trains
        every parameter.
      has_aux: whether the loss returns `(loss, aux)`; default False.
      donate: update the state in place (the default); False keeps old states usable
        at the cost of one more copy of the parameters and optimizer state per step.
      mesh: a `jax.sharding.Mesh` to run the step on; None (the default) for one device.
      data_axis: the mesh axis (or axes) the batch is split over; default "data".
      param_axis: the mesh axis (or axes) parameters are sharded over, FSDP-style;
        None (the default) replicates them.
      param_specs: the layout of chosen parameters: a `{path: PartitionSpec}` dict or a
        function of `(path, shape)` returning one or None; needs `mesh`.
      batch_specs: the same for chosen batch leaves; needs `mesh`.
      remat: activation checkpointing of the loss: None (the default), `"full"`, a
        policy name from `jax.checkpoint_policies` or a policy function.
      skip_nonfinite: skip steps whose loss, outputs or gradients are not finite (see
        above); default False.
      frozen_dtype: store the leaves `scheme` freezes in low precision: `init` quantizes
        them (`pockjax.lowbit.quantize`) to "int8" (a scale per output channel),
        "int4" / "int4:GROUP" (a scale per group of inputs, two values a byte),
        "bfloat16" or "float16", or per leaf with a dict of path patterns to formats.
        The step dequantizes each where it is used and again in the backward pass, so
        no float copy of the frozen model is alive. None (the default): as given.
        Parameters already holding `lowbit.Quantized` leaves train either way.

    Returns:
      A `SparseTrainer` (a `ScheduledTrainer` for a schedule); without `fun`, a
      decorator that makes one.

    Raises:
      TypeError: no `optimizer`; `param_axis`, `param_specs` or `batch_specs` without
        `mesh`; `frozen_dtype` with a schedule; or (when the loss is given) it is not
        callable, or `SparseTrainer` refuses the settings.
      SchemeError: `scheme` is neither a `Scheme` nor a `Schedule`.
      ValueError: `remat` names no checkpoint policy, or `data_axis` or `param_axis`
        is not an axis of `mesh`.
    """
    if optimizer is None:
        raise TypeError("sparse_train needs an optimizer: @pockjax.sparse_train(optimizer=optax.adam(1e-3), "
                        "scheme=...)")
    scheme = Scheme(default=Full()) if scheme is None else scheme
    layout = None
    if mesh is not None:
        layout = _sharding.Layout(mesh, data_axis=data_axis, param_axis=param_axis,
                                  param_specs=param_specs, batch_specs=batch_specs)
    elif param_axis is not None or param_specs is not None or batch_specs is not None:
        raise TypeError("param_axis, param_specs and batch_specs need a mesh: sparse_train(..., mesh=jax.make_mesh("
                        "(4,), ('data',)), param_axis='data')")

    from pockjax.schedule import Schedule, ScheduledTrainer

    schedule = scheme if isinstance(scheme, Schedule) else None

    def wrap(f):
        if not callable(f):
            raise TypeError(f"sparse_train decorates a loss function, got {type(f).__name__}")
        if schedule is not None and frozen_dtype is not None:
            raise TypeError("frozen_dtype= with a schedule: the schedule's schemes train "
                            "different weights in turn, so each needs its float value; "
                            "store frozen weights in low precision with a single scheme")
        trainer = SparseTrainer(f, optimizer, schedule.schemes[0] if schedule else scheme,
                                has_aux=has_aux, donate=donate, layout=layout, remat=remat,
                                skip_nonfinite=skip_nonfinite, frozen_dtype=frozen_dtype)
        return ScheduledTrainer(trainer, schedule) if schedule else trainer

    return wrap if fun is None else wrap(fun)


# --------------------------------------------------------------------------- fit


@dataclasses.dataclass
class History:
    """What a `fit` run did.

    Attributes:
      loss: the losses of its steps as float32 (skipped steps left out).
      seconds: training seconds, from the first step's start.
      steps: steps run in this call.
      interrupted: whether Ctrl-C stopped it (the state returned is the one after the
        last completed step).
      valid: the evaluations, as `(step, seconds, value)`.
      skipped: steps skipped for a non-finite loss or gradient.
      tokens: the tokens counted (with `fit(tokens=...)`).
    """

    loss: np.ndarray
    seconds: float
    steps: int
    interrupted: bool = False
    valid: list = dataclasses.field(default_factory=list)
    skipped: int = 0
    tokens: int = 0

    @property
    def steps_per_second(self) -> float:
        """Steps per training second (NaN where no time passed)."""
        return self.steps / self.seconds if self.seconds > 0 else float("nan")


class NonFiniteLoss(FloatingPointError):
    """Raised by `fit(..., stop_nonfinite=True)` when a step's loss is NaN or infinite.
    Nothing after the step before it was saved.

    Args:
      step: the step (1-based).
      loss: its loss.

    Attributes:
      step: the step (1-based).
      loss: its loss.
    """

    def __init__(self, step: int, loss: float):
        super().__init__(f"step {step}: the loss is {loss}")
        self.step, self.loss = step, loss


def _deleted(tree) -> bool:
    return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree_util.tree_leaves(tree))


def peak_rss_gib() -> float:
    """The process's peak resident memory so far.

    Returns:
      GiB, from Linux's VmHWM, else `ru_maxrss` (read as KiB).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def fit(trainer: SparseTrainer, state: TrainState, batches: Iterable | Callable, steps: int | None = None,
        *, progress: bool = True, log_every: int = 10, desc: str = "train", start: int = 0,
        evaluate: Callable | None = None, eval_every: int | None = None,
        save: Callable | None = None, save_every: int | None = None,
        on_record: Callable[[dict], None] | None = None, stop_nonfinite: bool = False,
        tokens: Callable[[int], int] | None = None,
        prefix_cache: bool | str | int = False) -> tuple[TrainState, History]:
    """Run `trainer` (a `SparseTrainer`, or any `step(state, batch) -> (state, metrics)`)
    from step `start` to step `steps`, or until the batches run out.

    Each step's loss is read back while the next step runs, so the loop adds no wait to
    the compiled step. A progress bar (unless `progress=False`) shows the loss, tokens/s
    (with `tokens`), peak memory and the time left. Ctrl-C stops the run after the step
    in flight: `save` gets the state after the last completed step, and it is returned
    with `History.interrupted` set (the state passed in was donated to the first step, so
    this return value is the run's only state).

    A warning is issued when the batches run out before `steps`, and when Ctrl-C
    stops the run.

    Args:
      trainer: the step: a `SparseTrainer`, or any `step(state, batch) -> (state,
        metrics)` whose metrics have `"loss"`.
      state: the state it starts from.
      batches: an iterable of batches, or a function of the (0-based) step giving its
        batch (then `steps` is needed; a resumed run continues the data where it
        stopped).
      steps: the step count to reach, >= 0; None (the default): until the batches run
        out.
      progress: show the progress bar (the default).
      log_every: the bar's refresh interval in steps; default 10.
      desc: the bar's label; default "train".
      start: the step count `state` has reached (a resumed run); default 0.
      evaluate: `evaluate(state) -> float` (a held-out loss), run before the first step
        when `start` is 0, every `eval_every` steps and after the last.
      eval_every: steps between evaluations; None (the default): before the first and
        after the last step only.
      save: `save(state)`, run every `save_every` steps, after the last and on Ctrl-C,
        each time after the losses up to that step were read (and found finite).
      save_every: steps between saves; None (the default): after the last step (and
        on Ctrl-C) only.
      on_record: gets a dict per step (`step`, `loss`, `seconds` since the first step,
        `tokens`), per skipped step (`step`, `skipped`: True, `loss`: None: the step's
        metrics said `skipped`, see `sparse_train(skip_nonfinite=True)`) and per
        evaluation (`step`, `valid_loss`, `seconds`).
      stop_nonfinite: raise `NonFiniteLoss` at the first NaN or infinite loss, before
        anything after the step before it is saved.
      tokens: `tokens(step)`, the tokens in the (0-based) step's batch, for tokens/s.
      prefix_cache: for data seen more than once: compute the frozen prefix of the step
        once per example and keep its output (`pockjax.prefix.PrefixCachedTrainer`,
        examples named by a hash of their contents; the same results as without it).
        True, an int (the RAM budget in bytes), "auto" (only where the prefix is a
        large enough part of the step) or False (the default). The cache is dropped
        when fit returns.

    Returns:
      `(state, History)`: the state after the last completed step and what the run did.

    Raises:
      ValueError: `steps` is negative, `prefix_cache` is not one of its values, or
        `batches` is a function and `steps` is None.
      NonFiniteLoss: with `stop_nonfinite`, a step's loss is NaN or infinite.
    """
    from tqdm.auto import tqdm

    if steps is not None and steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    cached = None
    if prefix_cache is not False and prefix_cache is not None:
        from pockjax.prefix import PrefixCachedTrainer

        budget = (prefix_cache if isinstance(prefix_cache, int) and not
                  isinstance(prefix_cache, bool) else None)
        if not (prefix_cache is True or prefix_cache == "auto" or
                (budget is not None and budget >= 0)):
            raise ValueError(f"prefix_cache must be True, False, 'auto' or a byte budget (an "
                             f"int >= 0), got {prefix_cache!r}")
        trainer = cached = PrefixCachedTrainer(trainer, budget_bytes=budget,
                                               auto=prefix_cache == "auto")
    if callable(batches) and not hasattr(batches, "__iter__"):
        if steps is None:
            raise ValueError("batches given as a function of the step need steps= (the step "
                             "count to reach)")
        get = batches
        it = (get(i) for i in range(start, steps))
        total = steps
    else:
        total = steps if steps is not None else (start + len(batches) if hasattr(batches, "__len__")
                                                 else None)
        it = iter(batches) if steps is None else itertools.islice(iter(batches), max(steps - start, 0))
    losses: list[float] = []
    valid: list[tuple[int, float, float]] = []
    unread: list[tuple[int, Any, int]] = []
    skipped = tokens_done = 0
    interrupted = False
    step = start
    emit = on_record or (lambda record: None)
    bar = tqdm(total=total, initial=start, disable=not progress, unit="step", desc=desc,
               dynamic_ncols=True)
    began = None

    def clock() -> float:
        return 0.0 if began is None else round(time.perf_counter() - began, 3)

    def read(entry) -> None:
        """A finished step's loss: recorded, or a stop on a non-finite one."""
        nonlocal skipped
        at, metrics, ntok = entry
        loss = float(metrics["loss"])
        if hasattr(metrics, "get") and bool(metrics.get("skipped", False)):
            skipped += 1
            emit({"step": at, "skipped": True, "loss": None})
            return
        if stop_nonfinite and not np.isfinite(loss):
            raise NonFiniteLoss(at, loss)
        losses.append(loss)
        record = {"step": at, "loss": loss, "seconds": clock()}
        if ntok is not None:
            record["tokens"] = ntok
        emit(record)
        if (at - start) % max(log_every, 1) == 0 or at == total:
            rate = f", {tokens_done / max(clock(), 1e-9):,.0f} tok/s" if tokens else ""
            bar.set_postfix_str(f"loss {loss:.4g}{rate}, peak {peak_rss_gib():.2f} GiB",
                                refresh=False)

    def read_all() -> None:
        while unread:
            read(unread.pop(0))

    def evaluation(state, at) -> None:
        value = float(evaluate(state))
        valid.append((at, clock(), value))
        emit({"step": at, "valid_loss": value, "seconds": clock()})

    try:
        if evaluate is not None and start == 0:
            evaluation(state, 0)
        began = time.perf_counter()
        for batch in it:
            ntok = tokens(step) if tokens is not None else None
            with InterruptAfter():
                state, metrics = trainer(state, batch)
                step += 1
                unread.append((step, metrics, ntok))
            while len(unread) > 1:
                read(unread.pop(0))
            tokens_done += ntok or 0
            bar.update(1)
            last = step == total
            if save is not None and ((save_every and step % save_every == 0) or last):
                read_all()
                save(state)
            if evaluate is not None and eval_every and step % eval_every == 0 and not last:
                read_all()
                evaluation(state, step)
        read_all()
        jax.block_until_ready(state)
    except KeyboardInterrupt:
        if _deleted(state):  # a second Ctrl-C inside a step: its input is gone
            raise
        interrupted = True
        bar.close()
        read_all()
        jax.block_until_ready(state)
        if save is not None and step > start:
            save(state)
    finally:
        bar.close()
        if cached is not None:
            cached.close()
    seconds = time.perf_counter() - began if began is not None else 0.0
    if interrupted:
        warnings.warn(f"fit: interrupted (Ctrl-C) after {step - start} steps; returning the "
                      f"state after step {step}", stacklevel=2)
    else:
        if total is not None and step < total:
            warnings.warn(f"fit: the batches ran out after {step - start} of {total - start} "
                          f"steps", stacklevel=2)
        if evaluate is not None and step > start:
            evaluation(state, step)
    return state, History(np.asarray(losses, dtype=np.float32), seconds, step - start,
                          interrupted, valid, skipped, tokens_done)
