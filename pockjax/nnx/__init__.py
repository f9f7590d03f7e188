"""Flax NNX adapter: train an `nnx.Module` with `sparse_train`.

A module is split into its graph definition, the state that trains (`nnx.Param` by
default) as a plain nested dict, and the rest (batch statistics, RNG counters) as
another. Parameter paths are the module's attribute path joined with "/", e.g.
`layers/0/attn/q_proj/kernel`, the same paths `Scheme` globs see.

`pockjax.schemes` and `pockjax.scheme_search` work on parameter trees and import no
Flax; importing this module registers `split(model)[1]` as the parameters of an
`nnx.Module` (`pockjax.schemes.register_params_of`), so `pj.schemes.transformer(model)`
and `pj.scheme_search.find_candidates(model)` take a module.

Examples:
  >>> import optax, jax.numpy as jnp, pockjax as pj
  >>> from flax import nnx
  >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  >>> trainer = pj.nnx.Trainer(model, lambda m, b: jnp.mean(m(b) ** 2), optimizer=optax.sgd(0.1),
  ...                          scheme=nnx.PathContains("bias"))
  >>> metrics = trainer(jnp.ones((4, 3)))
  >>> trainer.update(model)          # the trained values back into the module

`Trainer(..., remat="blocks")` checkpoints each block (each module held in a list such
as LLaMA's `layers` or MobileNetV2's `blocks`; or name them, `remat="layers/*"`): the
backward pass recomputes a block's activations from its input instead of keeping them.

`split`, `merge`, `param_paths` and `scheme` are defined in `pockjax.nnx._state`,
`remat_blocks` in `pockjax.nnx._remat`; this module holds the `Trainer`, `search_scheme` and
`frozen_norms_in_inference_mode`.
"""
from __future__ import annotations

import dataclasses
import itertools
import warnings
from typing import Any, Callable, Iterable, Sequence

from flax import nnx
from jax.sharding import PartitionSpec as P

from pockjax._src.home import claim
from pockjax._src.trees import keep_if
from pockjax import scheme_search, schemes
from pockjax.nnx._remat import checkpoint_blocks, remat_blocks
from pockjax.nnx._state import Filter, merge, module_at, param_paths, scheme, split
from pockjax.scheme import Frozen, Full, Scheme, SchemeError
from pockjax.sharding import Layout
from pockjax.train import History, Remat, SparseTrainer, TrainState, fit

__all__ = ["split", "merge", "param_paths", "scheme", "Trainer", "search_scheme",
           "frozen_norms_in_inference_mode", "remat_blocks"]

# Examples of the functions defined in the modules above, run with this module's own
# (tests/test_docs.py: doctest.testmod(pockjax.nnx)).
__test__ = {"scheme": scheme, "remat_blocks": remat_blocks}

schemes.register_params_of(nnx.Module, lambda model: split(model)[1])

# The argument `scheme` of `Trainer` and `frozen_norms_in_inference_mode` hides the
# function there.
_filter_scheme = scheme


def _module_loss(graphdef, loss_fn: Callable, *, has_aux: bool, has_rest: bool, wrt: Filter,
                 remat_paths: Sequence[tuple] = (), remat: Remat | None = None):
    """`loss_fn(model, batch)` as a function of the parameter dict: `(params, batch)`.
    A module with other state takes `{"batch": ..., "model_state": ...}` and returns
    `(loss, {"aux": ..., "model_state": ...})`, so that state is carried step to step.
    The modules at `remat_paths` run under `jax.checkpoint` with `remat`'s policy."""
    others = nnx.Not(wrt)

    def pure(params, batch):
        m = nnx.merge(graphdef, params, batch["model_state"]) if has_rest else \
            nnx.merge(graphdef, params)
        if remat_paths:
            checkpoint_blocks(m, remat_paths, remat.policy)
        out = loss_fn(m, batch["batch"] if has_rest else batch)
        if not has_rest:
            return out
        loss, aux = out if has_aux else (out, None)
        return loss, {"aux": aux, "model_state": nnx.to_pure_dict(nnx.state(m, others))}

    pure.__name__ = getattr(loss_fn, "__name__", "loss")
    return pure


class Trainer:
    """An `nnx.Module` trained by `sparse_train`, one call per step.

    `loss_fn(model, batch)` returns the loss, or `(loss, aux)` with `has_aux=True`. The
    trainer keeps the `TrainState` (step, parameters, optimizer state) and the module's
    other state: batch statistics a training-mode `BatchNorm` updates are carried from
    step to step. `scheme` is a `pockjax.Scheme`, an NNX filter (its parameters train)
    or `(filter, decision)` pairs (see `scheme`); None trains every parameter.
    `update(model)` writes the trained values back into a module, `model()` builds a new one.
    `mesh`, `data_axis`, `param_axis` and `param_specs` train on several devices, as in
    `pockjax.sparse_train`; the module's other state is replicated.

    `copy=True` (the default) copies the parameters, so the module stays usable while the
    trainer updates its own copy in place. `copy=False` hands the module's parameter
    arrays to the trainer without a second copy of the model (what a 1B-7B model on one
    device needs): the first step donates them, so the module's parameters are gone until
    `trainer.update(model)` writes the trained ones back.

    `frozen_norms="running"` puts the batch norms whose parameters the scheme freezes
    into inference mode, folded into their convolutions where the model can (see
    `frozen_norms_in_inference_mode`): the usual fine-tuning semantics, and a cheaper
    step than `"batch"` (the default: batch norms as the model has them). The modes are
    set on `model` itself and stay (`model.train()` undoes them).

    `remat` is activation checkpointing, per block: the backward pass recomputes each
    chosen block's activations from the block's input instead of keeping them from the
    forward pass (longer sequences in less memory, for one more forward pass through the
    trained blocks). `remat="blocks"` takes every module held in a list, outermost
    (LLaMA's `layers/*`, MobileNetV2's `blocks/*`, any `nnx.List` of blocks); glob
    patterns over module paths name them instead (`"layers/*"`, `["layers/1[0-9]"]`, see
    `remat_blocks`); `"full"` checkpoints the whole loss. `remat_policy` is what a
    checkpointed block still saves: None saves nothing inside it, or a name from
    `jax.checkpoint_policies` (`"dots_saveable"`, ...) or a policy function. Frozen blocks
    ahead of every trained one are never differentiated, so they keep nothing with or
    without remat and are not recomputed. `report()` names the setting. The module is not
    changed: the trainer checkpoints the calls of its own traced copy.

    `skip_nonfinite=True`: a step whose loss or any gradient is not finite changes
    nothing, the module's batch statistics included (see `pockjax.sparse_train`).

    `backend="iree"` runs the step on IREE's CPU backend in this process (an exported
    host-cpu artifact, built on the first step); `"auto"` builds it, times a few steps on
    each backend on the first batch (without advancing the training; XLA's on a copy of
    the state) and keeps the faster (`pockjax.backend.Runner`). `trainer.choice` and
    `report()` say what was measured and chosen. On IREE, `state` is read back from the
    session when asked for.

    Args:
      model: the `nnx.Module` to train; its parameters are copied (or handed over with
        `copy=False`) into the trainer's state.
      loss_fn: `loss_fn(model, batch)` -> the loss, or `(loss, aux)` with `has_aux`.
      optimizer: an optax `GradientTransformation`.
      scheme: a `pockjax.Scheme`, an NNX filter, or `(filter, decision)` pairs (see
        `scheme`); None (the default) trains every `wrt` variable.
      wrt: an NNX filter of the variables that can train (default `nnx.Param`); all
        other variables are the module's other state.
      has_aux: whether `loss_fn` returns `(loss, aux)` (default False).
      donate: donate the state to each step, so the new state reuses its buffers
        (default True).
      copy: copy the parameters into the trainer (default True); False hands over the
        module's arrays, which the first step donates (with `donate`).
      frozen_norms: `"batch"` (the default) or `"running"`.
      mesh: a `jax.sharding.Mesh` to train on all its devices; None (the default): one
        device.
      data_axis: the mesh axis the batch is split over (default `"data"`).
      param_axis: the mesh axis parameters are sharded over, FSDP-style; None (the
        default): replicated. Needs `mesh`.
      param_specs: per-parameter layouts, `{path: PartitionSpec}` or a function of
        `(path, shape)` returning one or None. Needs `mesh`.
      remat: None (the default: no checkpointing), `"blocks"`, `"full"`, or module path
        patterns (a string or a list of them).
      remat_policy: what a checkpointed block saves: None (nothing), a name from
        `jax.checkpoint_policies`, or a policy function. Needs `remat`.
      backend: `"xla"` (the default), `"iree"` or `"auto"`.
      skip_nonfinite: skip steps whose loss or any gradient is not finite (default
        False).

    Raises:
      ValueError: `backend` is unknown, or not `"xla"` with a `mesh`; `frozen_norms`
        is neither `"batch"` nor `"running"`; `remat_policy` is given without `remat`;
        or a `remat` pattern matches no callable submodule.
      TypeError: `model` is not an `nnx.Module`, `param_axis` or `param_specs` is given
        without a `mesh`, or `remat` has the wrong type.
      SchemeError: the module has no `wrt` variables, or a filter of `scheme` matches
        none.
    """

    def __init__(self, model: nnx.Module, loss_fn: Callable, *, optimizer, scheme=None,
                 wrt: Filter = nnx.Param, has_aux: bool = False, donate: bool = True,
                 copy: bool = True, frozen_norms: str = "batch", mesh=None, data_axis="data",
                 param_axis=None, param_specs=None, remat=None, remat_policy=None,
                 backend: str = "xla", skip_nonfinite: bool = False):
        from pockjax.backend import BACKENDS

        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got "
                             f"{backend!r}")
        if backend != "xla" and mesh is not None:
            raise ValueError(f"backend={backend!r}: IREE runs one device; a trainer with a mesh "
                             "runs on XLA only (backend='xla')")
        if not isinstance(model, nnx.Module):
            raise TypeError(f"pockjax.nnx.Trainer needs an nnx.Module, got {type(model).__name__}; "
                            "for Linen or plain functions use pockjax.sparse_train")
        if frozen_norms not in ("batch", "running"):
            raise ValueError(f"frozen_norms must be 'batch' (batch norms as the model has them) "
                             f"or 'running' (frozen ones in inference mode, folded), got {frozen_norms!r}")
        self.graphdef, params, self.rest = split(model, wrt)
        if not params:
            raise SchemeError(f"{type(model).__name__} has no {wrt!r} variables to train")
        if scheme is None:
            scheme = Scheme(default=Full())
        elif not isinstance(scheme, Scheme):
            scheme = _filter_scheme(model, scheme, wrt=wrt)
        if frozen_norms == "running" and frozen_norms_in_inference_mode(model, scheme, wrt=wrt):
            self.graphdef, params, self.rest = split(model, wrt)  # the new modes, in the graphdef
        self.wrt, self.has_aux, self.loss_fn = wrt, has_aux, loss_fn
        remat_paths, remat_spec = [], None
        if remat is None:
            if remat_policy is not None:
                raise ValueError(f"remat_policy={remat_policy!r} needs remat=: say which calls "
                                 f"to checkpoint, e.g. remat='blocks' or remat='layers/*'")
        elif isinstance(remat, str) and remat == "full":
            remat_spec = Remat.of("full" if remat_policy is None else remat_policy)
        else:
            remat_paths, where = remat_blocks(model, remat)
            remat_spec = Remat.of("full" if remat_policy is None else remat_policy,
                                  where=where, in_loss=True)
        self.remat_paths = remat_paths
        pure = _module_loss(self.graphdef, loss_fn, has_aux=has_aux, has_rest=bool(self.rest),
                            wrt=wrt, remat_paths=remat_paths, remat=remat_spec)
        layout = None
        if mesh is not None:  # the module's other state (batch statistics) is replicated
            layout = Layout(mesh, data_axis=data_axis, param_axis=param_axis,
                            param_specs=param_specs,
                            batch_specs=lambda path, shape: P() if path.startswith("model_state/")
                            else None)
        elif param_axis is not None or param_specs is not None:
            raise TypeError("param_axis and param_specs need a mesh: Trainer(..., mesh=jax.make_mesh("
                            "(4,), ('data',)), param_axis='data')")
        self.sparse = SparseTrainer(pure, optimizer, scheme, has_aux=has_aux or bool(self.rest),
                                    donate=donate, layout=layout, remat=remat_spec,
                                    skip_nonfinite=skip_nonfinite)
        self._state: TrainState = self.sparse.init(params, copy=copy)
        self.backend, self._runner, self._read_back = backend, None, None
        self.choice = None  # a pockjax.backend.BackendChoice after the first step

    @property
    def scheme(self) -> Scheme:
        """The `Scheme` the trainer applies (a filter given to the constructor, converted)."""
        return self.sparse.scheme

    def step_batch(self, batch):
        """`batch` as `self.sparse` (the `SparseTrainer`) takes it: with the module's other
        state (batch statistics) under `"model_state"` when it has any.

        Args:
          batch: a batch as `loss_fn` takes it.

        Returns:
          `{"batch": batch, "model_state": ...}` for a module with other state, else
            `batch` itself.
        """
        return {"batch": batch, "model_state": self.rest} if self.rest else batch

    def _metrics(self, metrics):
        if self.rest:
            inner = metrics.pop("aux")
            # A skipped step keeps the module's other state too (batch statistics).
            self.rest = (keep_if(metrics["skipped"], self.rest, inner["model_state"])
                         if "skipped" in metrics else inner["model_state"])
            if self.has_aux:
                metrics["aux"] = inner["aux"]
        return metrics

    @property
    def state(self) -> TrainState:
        """The `TrainState` (step, parameters, optimizer state); read back from IREE's
        session when the step runs there (once per step at most).

        Assigning a `TrainState` replaces the trainer's state; when the step runs on
        IREE, assigning any other state raises `ValueError`."""
        if self._runner is None:
            return self._state
        if self._read_back is None:
            self._read_back = self._runner.state
        return self._read_back

    @state.setter
    def state(self, value: TrainState) -> None:
        if self._runner is not None and value is not self._read_back:
            raise ValueError("this trainer's step runs on IREE (backend chosen: "
                             f"{self._runner.backend}); its state cannot be replaced. Build a "
                             "new trainer, or use backend='xla', to start from another state")
        if self._runner is None:
            self._state = value

    def _start_backend(self, batch) -> None:
        """On the first step with backend 'iree' or 'auto': build the IREE artifact and,
        for 'auto', measure both (`pockjax.backend.Runner`)."""
        from pockjax.backend import Runner

        runner = Runner(self.sparse, self._state, self.step_batch(batch), backend=self.backend)
        self.choice = runner.choice
        if runner.backend == "iree":
            self._runner = runner

    def __call__(self, batch) -> dict:
        """One step; `{"loss": ..., "aux": ...}`. The trainer's state advances in place.

        On the first call with `backend="iree"` or `"auto"`, the IREE artifact is built
        (and, for `"auto"`, both backends are timed) before the step.

        Args:
          batch: a batch as `loss_fn` takes it.

        Returns:
          The metrics: `"loss"`, `"aux"` with `has_aux`, and `"skipped"` with
            `skip_nonfinite`.
        """
        if self.backend != "xla" and self.choice is None:
            self._start_backend(batch)
        if self._runner is not None:
            self._read_back = None
            return self._metrics(self._runner.step(self.step_batch(batch)))
        self._state, metrics = self.sparse(self._state, self.step_batch(batch))
        return self._metrics(metrics)

    def fit(self, batches: Iterable, steps: int | None = None, **kwargs) -> History:
        """`pockjax.fit` over `batches` (progress bar, losses); the state advances.

        Args:
          batches: an iterable of batches as `loss_fn` takes them, or a function of the
            (0-based) step giving its batch (then `steps` is needed).
          steps: the step count to reach; None (the default): until the batches run out.
          **kwargs: other arguments of `pockjax.fit` (`progress`, `log_every`,
            `evaluate`, `save`, ...). A callback that gets the state (`evaluate`,
            `save`) receives `(TrainState, other module state)`, with None in place of
            the `TrainState` when the step runs on IREE.

        Returns:
          The run's `History`.
        """
        if self.backend != "xla" and self.choice is None:
            # export and measure before fit's clock starts (History.seconds is training)
            batches = iter(batches)
            first = next(batches, None)
            if first is not None:
                self._start_backend(first)
                batches = itertools.chain([first], batches)

        # The carry holds the XLA state so that fit's timing waits for the last step; an
        # IREE step is synchronous and its state is read back only when asked for.
        def step(carry, batch):
            self.rest = carry[1]
            metrics = self(batch)
            return (self._state if self._runner is None else None, self.rest), metrics

        (_, self.rest), history = fit(step, (self._state, self.rest), batches, steps, **kwargs)
        return history

    def params(self) -> dict:
        """The current parameters as a nested dict.

        Returns:
          `state.params`: the `wrt` variables, keyed as `split` keys them.
        """
        return self.state.params

    def model(self) -> nnx.Module:
        """A new module with the trained parameters and state.

        Returns:
          A new `nnx.Module` built from the graph definition, the current parameters
            and the module's other state.
        """
        return nnx.merge(self.graphdef, self.state.params, self.rest) if self.rest else \
            nnx.merge(self.graphdef, self.state.params)

    def update(self, model: nnx.Module) -> None:
        """Write the trained parameters and state into `model` (the module trained).

        Args:
          model: the module to update in place: the one the trainer was built from, or
            one of the same structure.
        """
        nnx.update(model, self.state.params, *([self.rest] if self.rest else []))

    def report(self, batch):
        """`SparseTrainer.report` for this step: FLOPs and memory against full training,
        and the backend that runs it.

        Args:
          batch: a batch as `loss_fn` takes it (arrays or `jax.ShapeDtypeStruct`s).

        Returns:
          The `TrainReport`, its `backend` set to the backend choice once one is made.
        """
        report = self.sparse.report(self.state, self.step_batch(batch))
        return report if self.choice is None else dataclasses.replace(report,
                                                                       backend=str(self.choice))

    def explain(self, batch):
        """What `sparse_grad` did to this step's backward pass.

        Args:
          batch: a batch as `loss_fn` takes it.

        Returns:
          The `TransformInfo` (rules, fallbacks, the rewritten jaxpr).
        """
        return self.sparse.explain(self.state, self.step_batch(batch))

    def lower(self, batch):
        """The lowered step, for `.as_text()`, `.compile().memory_analysis()`, ...

        Args:
          batch: a batch as `loss_fn` takes it (arrays or `jax.ShapeDtypeStruct`s).

        Returns:
          A `jax.stages.Lowered`.
        """
        return self.sparse.lower(self.state, self.step_batch(batch))

    def export(self, batch, target: str = "host-cpu", out_dir: str = "export", **kwargs):
        """Export the step (see `pockjax.export`). A module with other state (batch
        statistics) takes it as batch inputs `model_state/...` and returns it as outputs
        `aux/model_state/...`.

        Args:
          batch: a batch of the shape the artifact is compiled for.
          target: an export target name (default `"host-cpu"`; see
            `pockjax.export.TARGETS`).
          out_dir: the artifact directory to write (default `"export"`).
          **kwargs: other arguments of `SparseTrainer.export` (`gpu`, `extra_flags`,
            `progress`).

        Returns:
          The `pockjax.export.Artifact` written.
        """
        return self.sparse.export(self.state, self.step_batch(batch), target=target,
                                  out_dir=out_dir, **kwargs)


def search_scheme(model: nnx.Module, loss_fn: Callable, *, optimizer, data, budget="40%",
                  has_aux: bool = False, wrt: Filter = nnx.Param, **kwargs):
    """`pockjax.search_scheme` for an NNX module: which of its parameters to train under a
    memory budget. `loss_fn(model, batch)` and `data = (train_batches, heldout_batches)`
    as for `Trainer`; other keyword arguments go to `pockjax.search_scheme`. Returns the
    `Scheme` (exact parameter paths; `Trainer(..., scheme=scheme)` takes it) and the
    `SearchReport`. The module is not changed: every candidate trains a copy.

    Args:
      model: the module.
      loss_fn: `loss_fn(model, batch)` -> the loss, or `(loss, aux)` with `has_aux`.
      optimizer: an optax `GradientTransformation`.
      data: `(train_batches, heldout_batches)`, or a dict with `"train"` and
        `"heldout"`.
      budget: the memory budget (default `"40%"`; see `pockjax.scheme_search.parse_budget`).
      has_aux: whether `loss_fn` returns `(loss, aux)` (default False).
      wrt: an NNX filter of the variables that can train (default `nnx.Param`).
      **kwargs: other arguments of `pockjax.search_scheme` (`steps`, `candidates`, `cache`, ...,
        and `find_candidates` options).

    Returns:
      A pair: the chosen `Scheme` and the `SearchReport`.

    Raises:
      TypeError: `model` is not an `nnx.Module` (and as `pockjax.search_scheme` raises).
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"pockjax.nnx.search_scheme needs an nnx.Module, got {type(model).__name__}; "
                        "for parameter trees use pockjax.search_scheme")
    graphdef, params, rest = split(model, wrt)
    pure = _module_loss(graphdef, loss_fn, has_aux=has_aux, has_rest=bool(rest), wrt=wrt)
    with_state = lambda b: {"batch": b, "model_state": rest} if rest else b
    train, heldout = data if not isinstance(data, dict) else (data["train"], data["heldout"])
    steps = kwargs.get("steps", 20)
    train = [with_state(b) for b, _ in zip(train, range(steps))]
    heldout = [with_state(b) for b in heldout]
    return scheme_search.search_scheme(
        lambda s: SparseTrainer(pure, optimizer, s, has_aux=has_aux or bool(rest)),
        params, (train, heldout), budget, **kwargs)


def search(*args, **kwargs):
    """Deprecated: renamed `search_scheme` (same arguments)."""
    warnings.warn("pockjax.nnx.search is renamed search_scheme (same arguments); the old name "
                  "will be removed", DeprecationWarning, stacklevel=2)
    return search_scheme(*args, **kwargs)


def frozen_norms_in_inference_mode(model: nnx.Module, scheme: Scheme | Any, *, fold: bool = True,
                                   wrt: Filter = nnx.Param) -> list[str]:
    """Put every `nnx.BatchNorm` of `model` whose parameters `scheme` all freezes into
    inference mode (`use_running_average=True`), in place; returns their paths, sorted.

    `scheme` is a `pockjax.Scheme` or anything `pockjax.nnx.Trainer` accepts as one (an
    NNX filter, `(filter, decision)` pairs). A batch norm with any trained parameter
    (scale or bias, even a few channels of it) keeps its mode. With `fold=True`, a batch
    norm that sits in a layer able to fold it (a module with a `fold_norm` attribute,
    such as `pockjax.models.mobilenetv2.ConvBN`) is folded into the convolution's kernel.
    The mode is static: `pockjax.nnx.split` keeps it in the graph definition, so a
    `Trainer` built afterwards compiles the folded step (`Trainer(...,
    frozen_norms="running")` does this for you). `model.train()` undoes it.

    Why: a batch norm in training mode normalises with the batch's statistics, so even when its
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

    Args:
      model: the module, changed in place.
      scheme: a `pockjax.Scheme`, an NNX filter or `(filter, decision)` pairs.
      fold: fold each switched batch norm into the convolution of a layer that has a
        `fold_norm` attribute (default True).
      wrt: an NNX filter of the variables `scheme` covers (default `nnx.Param`).

    Returns:
      The "/"-joined paths of the batch norms switched to inference mode, sorted.

    Raises:
      SchemeError: a filter of `scheme` matches no `wrt` variable.

    Examples:
      >>> import jax.numpy as jnp, pockjax as pj
      >>> from flax import nnx
      >>> from pockjax.models import MobileNetV2
      >>> model = MobileNetV2(10, width_mult=0.35, input_size=32, rngs=nnx.Rngs(0))
      >>> scheme = pj.schemes.mobilenetv2(model, norms=True)
      >>> pj.nnx.frozen_norms_in_inference_mode(model, scheme)
      ['blocks/0/depthwise/bn', 'blocks/0/project/bn', 'head/bn', 'stem/bn']
    """
    if not isinstance(scheme, Scheme):
        scheme = _filter_scheme(model, scheme, wrt=wrt)
    switched = []
    for path, node in nnx.graph.iter_graph(model):
        if not isinstance(node, nnx.BatchNorm):
            continue
        prefix = "/".join(map(str, path))
        names = [n for n in ("scale", "bias") if getattr(node, n, None) is not None]
        if not all(isinstance(scheme.match(f"{prefix}/{n}"), Frozen) for n in names):
            continue
        node.use_running_average = True
        parent = module_at(model, path[:-1])
        if hasattr(parent, "fold_norm"):
            parent.fold_norm = fold
        switched.append(prefix)
    return sorted(switched)


claim(globals())  # public names defined in the private modules above live here
