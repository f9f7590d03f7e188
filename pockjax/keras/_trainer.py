"""`pockjax.keras.Trainer`: a Keras model trained by `sparse_train` on `(x, y)` batches,
its non-trainable state carried from step to step."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pockjax._src.trees import keep_if

from pockjax.keras._function import functional, load_state
from pockjax.scheme import Full, Scheme
from pockjax.train import History, TrainState, fit, sparse_train


def _unpack(batch):
    """`(x, y, sample_weight or None)` from a Keras-style batch."""
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        return batch[0], batch[1], batch[2] if len(batch) == 3 else None
    raise TypeError(f"a pockjax.keras.Trainer batch is (x, y) or (x, y, sample_weight), as "
                    f"Keras's fit takes it; got {type(batch).__name__}"
                    + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))


class Trainer:
    """A Keras model trained by `pockjax.sparse_train`, one call per `(x, y)` batch.

    `loss` is a Keras loss (`keras.losses.SparseCategoricalCrossentropy(from_logits=True)`,
    `"mse"`-style names are not taken) or any `loss(y_true, y_pred[, sample_weight])`;
    a per-example result is averaged. The forward runs with `training=True`: BatchNorm
    uses the batch's statistics and updates its moving ones, dropout draws from the
    model's seed state; both are the model's other state (`model_state`), carried from
    step to step (and kept as they were by a skipped step). `scheme` is a
    `pockjax.Scheme` over the Keras paths (`conv1/kernel`, `head/**`); None trains every
    variable. `update(model)` writes the trained values and state back into the model.

    `mesh`, `data_axis`, `param_axis` and `param_specs` train on several devices, as in
    `pockjax.sparse_train` (the model's other state replicated); `frozen_dtype` stores
    the frozen variables in fewer bits and `skip_nonfinite` skips a non-finite step, as
    there.

    Args:
      model: a built Keras model on the JAX backend.
      loss: `loss(y_true, y_pred)` (or with `sample_weight`), e.g. a Keras loss object.
      optimizer: an optax `GradientTransformation`.
      scheme: a `pockjax.Scheme`; None (the default) trains every trainable variable.
      donate: update the state in place (default True).
      mesh: a `jax.sharding.Mesh`, as in `pockjax.sparse_train`; None (the default)
        for one device.
      data_axis: the mesh axis the batch is split over (default "data").
      param_axis: the mesh axis parameters are sharded over; None replicates them.
      param_specs: the layout of chosen parameters, as in `pockjax.sparse_train`.
      skip_nonfinite: skip steps whose loss or gradients are not finite (default False).
      frozen_dtype: as in `pockjax.sparse_train` (default None: as stored).

    Raises:
      ImportError, RuntimeError, TypeError, ValueError: as `pockjax.keras.functional`.
      TypeError: `loss` is not callable (a Keras loss given by name).
    """

    def __init__(self, model, loss: Callable, *, optimizer, scheme=None, donate: bool = True,
                 mesh=None, data_axis="data", param_axis=None, param_specs=None,
                 skip_nonfinite: bool = False, frozen_dtype: Any = None):
        if not callable(loss):
            raise TypeError(f"loss must be a function loss(y_true, y_pred) or a Keras loss "
                            f"object, e.g. keras.losses.get({loss!r}); got {loss!r}")
        params, self.apply = functional(model)
        self.model_state = self.apply.state
        has_state = bool(self.apply.state_paths)
        apply = self.apply

        def keras_loss(p, b):
            batch, state = (b["batch"], b["model_state"]) if has_state else (b, {})
            x, y, w = _unpack(batch)
            y_pred, new = apply.stateful(p, state, x, training=True)
            value = loss(y, y_pred) if w is None else loss(y, y_pred, w)
            value = jnp.mean(jnp.asarray(value, jnp.float32))
            return (value, {"model_state": new}) if has_state else value

        keras_loss.__name__ = f"keras_{model.name}"
        on_mesh = {}
        if mesh is not None:
            on_mesh = dict(mesh=mesh, data_axis=data_axis, param_axis=param_axis,
                           param_specs=param_specs,
                           batch_specs=lambda path, shape: P() if path.startswith(
                               "model_state/") else None)
        elif param_axis is not None or param_specs is not None:
            raise TypeError("param_axis and param_specs need a mesh: Trainer(..., "
                            "mesh=jax.make_mesh((4,), ('data',)), param_axis='data')")
        self.has_state = has_state
        self.sparse = sparse_train(keras_loss, optimizer=optimizer,
                                   scheme=Scheme(default=Full()) if scheme is None else scheme,
                                   has_aux=has_state, donate=donate,
                                   skip_nonfinite=skip_nonfinite, frozen_dtype=frozen_dtype,
                                   **on_mesh)
        self.state: TrainState = self.sparse.init(params, copy=False)

    @property
    def scheme(self) -> Scheme:
        """The `Scheme` the trainer applies."""
        return self.sparse.scheme

    def step_batch(self, batch):
        """`batch` as `self.sparse` takes it: with the model's other state under
        `"model_state"` where it has any.

        Args:
          batch: `(x, y)` or `(x, y, sample_weight)`.

        Returns:
          `{"batch": batch, "model_state": ...}`, or `batch` itself for a model without
            other state.
        """
        _unpack(batch)
        return {"batch": tuple(batch), "model_state": self.model_state} if self.has_state \
            else tuple(batch)

    def __call__(self, batch) -> dict:
        """One step on `batch`; the trainer's state and the model's other state advance.

        Args:
          batch: `(x, y)` or `(x, y, sample_weight)`.

        Returns:
          The metrics: `"loss"`, and `"skipped"` with `skip_nonfinite`.
        """
        self.state, metrics = self.sparse(self.state, self.step_batch(batch))
        if self.has_state:
            new = metrics.pop("aux")["model_state"]
            self.model_state = (keep_if(metrics["skipped"], self.model_state, new)
                                if "skipped" in metrics else new)
        return metrics

    def fit(self, batches: Iterable, steps: int | None = None, **kwargs) -> History:
        """`pockjax.fit` over `batches` (progress bar, losses, Ctrl-C and SIGTERM saved);
        the state advances.

        Args:
          batches: an iterable of `(x, y)` batches, or a function of the (0-based) step
            giving its batch (then `steps` is needed).
          steps: the step count to reach; None (the default): until the batches run out.
          **kwargs: other arguments of `pockjax.fit`; a callback that gets the state
            (`evaluate`, `save`) receives `(TrainState, model_state)`.

        Returns:
          The run's `History`.
        """
        def step(carry, batch):
            self.state, self.model_state = carry
            metrics = self(batch)
            return (self.state, self.model_state), metrics

        (self.state, self.model_state), history = fit(step, (self.state, self.model_state),
                                                      batches, steps, **kwargs)
        return history

    def params(self) -> dict:
        """The current trainable values, keyed as `pockjax.keras.functional` keys them."""
        return self.state.params

    def update(self, model) -> None:
        """Write the trained values and the model's other state into `model` (the Keras
        model trained, or one of the same structure)."""
        from pockjax import lowbit

        load_state(model, lowbit.dequantize(self.state.params), self.model_state)

    def report(self, batch):
        """`SparseTrainer.report` for this step (FLOPs and memory against full training)."""
        return self.sparse.report(self.state, self.step_batch(batch))

    def explain(self, batch):
        """What `sparse_grad` did to this step's backward pass (`TransformInfo`)."""
        return self.sparse.explain(self.state, self.step_batch(batch))

    def lower(self, batch) -> jax.stages.Lowered:
        """The lowered step, for `.as_text()`, `.compile().memory_analysis()`, ..."""
        return self.sparse.lower(self.state, self.step_batch(batch))

    def export(self, batch, target: str = "host-cpu", out_dir: str = "export", **kwargs):
        """Export the step (`pockjax.export`): the batch's inputs `batch/0` (x) and
        `batch/1` (y), and for a model with other state `model_state/...` in and
        `aux/model_state/...` out.

        Args:
          batch: a batch of the shape the artifact is compiled for.
          target: an export target name (default "host-cpu").
          out_dir: the artifact directory (default "export").
          **kwargs: other arguments of `SparseTrainer.export`.

        Returns:
          The `pockjax.export.Artifact` written.
        """
        return self.sparse.export(self.state, self.step_batch(batch), target=target,
                                  out_dir=out_dir, **kwargs)
