"""The trainer: `SparseTrainer`, one compiled step (forward, sparse backward, fused
in-place updates); `pockjax.train._build`'s `sparse_train` makes one."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pockjax import lowbit
from pockjax import sharding as _sharding
from pockjax._src.malloc import reuse_step_memory
from pockjax.remat import Remat, checkpointed
from pockjax.train._state import (TrainState, abstract_arrays, check_not_donated, decisions_tree,
                            distinct_buffers, is_abstract, with_shardings)
from pockjax.train._report import TrainReport, build_report, full_training_traced
from pockjax.optim import fused, perleaf
from pockjax.scheme import Scheme, SchemeError, leaves_with_paths
from pockjax.transforms.sparse_grad import SparseGradFn, TransformInfo, is_dynamic
from pockjax.view import ResolvedScheme, trainable_view

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
        # The scheme's decision per parameter leaf, resolved once per parameter structure
        # and handed to the gradient, the report and export.
        self.decisions = ResolvedScheme(scheme)
        # What the step differentiates: the loss, on quantized frozen weights where the
        # parameters hold them (dequantized at each use), checkpointed as `remat` says.
        self._loss = checkpointed(lowbit.at_use(loss_fn), self.remat)
        self._grad = SparseGradFn(self._loss, scheme, 0, has_aux, with_value=True,
                                  resolved=self.decisions)
        self._plans: dict = {}
        self._step_jit = jax.jit(self.step, donate_argnums=(0,) if donate else (),
                                 compiler_options=self.layout and self.layout.compiler_options())
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
        self.decisions(params)  # scheme errors surface here, outside any trace
        init = lambda p: optimizer.init(self._view(p))
        if self.frozen_dtype is not None:
            quantize = lambda p: lowbit.quantize(p, scheme, self.frozen_dtype)
            params = (jax.eval_shape(quantize, params) if is_abstract(params, "params")
                      else quantize(params))
        if is_abstract(params, "params"):
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
        return distinct_buffers(state) if self.donate else state

    def _shardings(self, params, opt_state, decisions=None) -> TrainState:
        """Where each array of the state lives on the mesh (a TrainState of shardings)."""
        layout = self.layout
        decisions = self.decisions(params) if decisions is None else decisions
        view = jax.eval_shape(lambda p: trainable_view(p, decisions_tree(p, decisions)), abstract_arrays(params))
        view_shardings = layout.view_shardings(params, decisions)
        return TrainState(
            layout.replicated, layout.param_shardings(params, decisions),
            layout.opt_state_shardings(self.optimizer, view, view_shardings, abstract_arrays(opt_state)),
            self.scheme)

    def _view(self, params):
        """The trainable view of `params` under the resolved scheme."""
        return trainable_view(params, decisions_tree(params, self.decisions(params)))

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

    def step(self, state: TrainState, batch):
        """The training step as a function to trace (`trainer(state, batch)` runs it
        jitted, with the state donated).

        Args:
          state: the `TrainState`.
          batch: the step's batch.

        Returns:
          `(new state, metrics)`: `metrics` has `"loss"`, `"aux"` with `has_aux`, and
          `"skipped"` (a bool) with `skip_nonfinite`.
        """
        return self._traced_step(state, batch)

    def step_variant(self, state: TrainState, batch, *, placement: str | None = None,
                     ties: str = "data"):
        """`step` with its update placed or ordered another way, traced (call it inside
        `jax.jit`): export lowers the step through it, and measures the in-place step
        against the other placements; the tests check each.

        Args:
          state: the `TrainState`.
          batch: the step's batch.
          placement: None (the default) uses the update mode `update_mode` gives; "fused"
            forces the per-leaf update interleaved with the backward pass, any other value
            the single update after the whole backward pass.
          ties: how each in-place write is ordered after the parameter's last reads: "data"
            (the default) or "barrier" (an optimization barrier; see
            `pockjax.optim.fused.fused_step`).

        Returns:
          `(new state, metrics)`, as `step`.
        """
        return self._traced_step(state, batch, placement, ties)

    def _traced_step(self, state: TrainState, batch, placement: str | None = None,
                     ties: str = "data"):
        # `step`, and the alternatives export's memory comparison and the tests build
        # (`step_variant`): `placement` None uses the mode `update_mode` gives, "fused"
        # forces the per-leaf update interleaved with the backward pass, any other value
        # the single update after it; `ties` "data" or "barrier" orders each in-place
        # write after the parameter's last reads (`pockjax.optim.fused.fused_step`).
        _, info, aux_def, decisions, _ = self._grad.trace(state.params, batch)
        param_leaves = jax.tree_util.tree_leaves(state.params)
        other = [x for x in jax.tree_util.tree_leaves(([None, batch], {})) if is_dynamic(x)]
        view = trainable_view(state.params, decisions_tree(state.params, decisions))
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
        (other axes of a `param_specs` layout stay split), the backward pass gathering
        it again (`fused.regather`), and reduces each gradient straight into the
        weight's own layout."""
        layout = self.layout
        reads = jax.tree_util.tree_leaves(layout.read_gathered(params, decisions))
        grad_shardings = jax.tree_util.tree_leaves(layout.view_shardings(params, decisions))
        return {"reads": reads, "grad_shardings": grad_shardings,
                "gathered": layout.gathered_shardings(params, decisions)}

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
        if is_abstract(state, "state"):
            raise TypeError("this TrainState holds shapes (jax.ShapeDtypeStruct), not arrays: "
                            "it can be reported or lowered, not stepped or exported; make it "
                            "from the model's arrays with trainer.init(params)")
        check_not_donated(state, self.donate)
        reuse_step_memory(1 if self.layout is None else self.layout.mesh.devices.size)
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
        state_avals = with_shardings(abstract_arrays(state), self._shardings(state.params, state.opt_state))
        batch_avals = abstract_arrays(batch)
        if not all(getattr(a, "sharding", None) for a in jax.tree_util.tree_leaves(batch_avals)):
            batch_avals = with_shardings(batch_avals, self.layout.batch_shardings(batch))
        return state_avals, batch_avals

    def lower(self, state: TrainState, batch) -> jax.stages.Lowered:
        """The lowered step, for `.as_text()`, `.compile().memory_analysis()`, ...: the
        step `trace` gives, lowered (on one device, a state of arrays is lowered as it
        is). It takes the arguments `trace` takes and raises what `trace` raises.

        Returns:
          The `jax.stages.Lowered` step.
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
        view = jax.eval_shape(self._view, abstract_arrays(state.params))
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
        info = self._grad.explain(state.params, batch)
        stored = jax.tree_util.tree_leaves(state.params, is_leaf=lowbit.is_quantized)
        if any(lowbit.is_quantized(x) for x in stored):
            # A quantized weight counts its values, not its stored bytes and scales.
            info = dataclasses.replace(info, total_params=sum(
                int(np.prod(x.shape)) for x in stored))
        return info

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

    def export_step(self, state: TrainState, batch):
        """What `pockjax.export` compiles for this trainer: `(self, batch, None)`, its
        own step on the batch as given, with no prefix function (a
        `PrefixCachedTrainer` gives its suffix and prefix)."""
        return self, batch, None

    # -- reports ---------------------------------------------------------------

    def _full_lowered(self, state: TrainState, batch) -> jax.stages.Lowered:
        return self._full_traced(state, batch).lower()

    def _full_traced(self, state: TrainState, batch) -> jax.stages.Traced:
        """The same model trained in full (see `full_training_traced`)."""
        return full_training_traced(self._loss, self.optimizer, state.params, batch,
                                    has_aux=self.has_aux, layout=self.layout,
                                    frozen_dtype=self.frozen_dtype, donate=self.donate)

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
        return build_report(self, state, batch)
