"""Keras models in: a Keras 3 model as a pure JAX function of a parameter pytree, trained
sparsely and written back.

Keras 3 runs on JAX (its `jax` backend), and a model saved under any backend loads there
unchanged (`keras.saving.load_model("model.keras")`, or a Keras 2 `.h5` where Keras
reads it). `functional(model)` returns the trainable variables as a nested dict keyed by
their Keras paths split on "/" (`conv1/kernel`, `bn1/gamma`,
`encoder/attention/query/kernel`) and `apply(params, *inputs)`, a pure function over
`model.stateless_call`. The non-trainable variables (BatchNorm's moving statistics,
dropout's seed state) are the model's other state: `apply.state` holds them and
`apply.stateful(params, state, *inputs)` returns `(outputs, new_state)`. Each kernel's
layout is registered, so `Channels(axis="in"/"out")` means input/output features for
Dense `[in, out]`, convolutions (HWIO), transposed convolutions (HW out in), depthwise
convolutions (the channel axis) and EinsumDense and MultiHeadAttention kernels (read
from their equations: `(d_model, heads, head_dim)` has "out" = heads).

`Trainer(model, loss, optimizer=..., scheme=...)` trains on `(x, y)` batches as Keras's
`fit` takes them, with a Keras loss (or any `loss(y_true, y_pred)`), carrying the
model's other state from step to step as `pockjax.nnx.Trainer` does; `update(model)`
writes the trained values back, and `model.save("tuned.keras")` saves a file that Keras
loads under any backend.

Importing this module before Keras chooses the JAX backend (`KERAS_BACKEND=jax`) unless
another one is set.

Examples:
  >>> import optax, numpy as np, pockjax as pj
  >>> import keras
  >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="up"),
  ...                           keras.layers.Dense(2, name="head")], name="net")
  >>> params, apply = pj.keras.functional(model)
  >>> {k: sorted(v) for k, v in params["net"].items()}
  {'up': ['bias', 'kernel'], 'head': ['bias', 'kernel']}
  >>> trainer = pj.keras.Trainer(model, keras.losses.MeanSquaredError(),
  ...                            optimizer=optax.sgd(0.1),
  ...                            scheme=pj.Scheme({"net/head/**": pj.Full()}))
  >>> metrics = trainer((np.ones((3, 4), "float32"), np.zeros((3, 2), "float32")))
  >>> trainer.update(model)           # the trained values back into the Keras model
"""
from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before Keras is imported, unless set

from pockjax._src.home import claim  # noqa: E402
from pockjax.keras._function import (KERAS_NOTE, KerasFunction, functional,  # noqa: E402,F401
                                     layouts, load_state)
from pockjax.keras._trainer import Trainer  # noqa: E402

__all__ = ["functional", "layouts", "load_state", "Trainer", "KerasFunction"]

claim(globals())  # public names defined in the package's modules live here
