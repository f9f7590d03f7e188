"""An export target for `pockjax export`: a small MLP with a sparse scheme and Adam.

    pockjax export examples/export_mlp.py:make --target host-cpu --out out/mlp
    pockjax inspect out/mlp
    pockjax run out/mlp --steps 5

`make()` returns (trainer, initial state, example batch); the batch fixes the shapes
the artifact is compiled for.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pockjax as pj

WIDTH, LAYERS, BATCH = 64, 3, 16

SCHEME = pj.Scheme({
    f"dense_{LAYERS - 1}/**": pj.Full(),
    f"dense_{LAYERS - 2}/kernel": pj.Channels(ratio=0.25, axis="in"),
}, default=pj.Frozen())


def forward(params, x):
    for i in range(LAYERS):
        x = x @ params[f"dense_{i}"]["kernel"] + params[f"dense_{i}"]["bias"]
        x = jax.nn.gelu(x) if i < LAYERS - 1 else x
    return x


@pj.sparse_train(optimizer=optax.adam(1e-2), scheme=SCHEME)
def trainer(params, batch):
    return jnp.mean((forward(params, batch["x"]) - batch["y"]) ** 2)


def make():
    keys = jax.random.split(jax.random.PRNGKey(0), LAYERS + 1)
    params = {f"dense_{i}": {"kernel": jax.random.normal(keys[i], (WIDTH, WIDTH)) / np.sqrt(WIDTH),
                             "bias": jnp.zeros(WIDTH)} for i in range(LAYERS)}
    x = jax.random.normal(keys[-1], (BATCH, WIDTH))
    batch = {"x": x, "y": jnp.tanh(x)}
    return trainer, trainer.init(params), batch
