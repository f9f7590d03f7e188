"""A short sparse fine-tune with `pockjax.sparse_grad`.

A small MLP is fit to a random teacher. Only the last layer's bias and a quarter of the
input channels of the last two kernels train. Each step's gradient is checked against
dense `jax.grad` sliced the same way, and the FLOPs of both are printed.

    python examples/sparse_grad_mlp.py
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pockjax as pj

WIDTH, LAYERS, BATCH, STEPS = 256, 4, 64, 60


def init(key):
    keys = jax.random.split(key, LAYERS)
    return {f"dense_{i}": {"kernel": jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH),
                           "bias": jnp.zeros(WIDTH)} for i, k in enumerate(keys)}


def forward(params, x):
    for i in range(LAYERS):
        x = x @ params[f"dense_{i}"]["kernel"] + params[f"dense_{i}"]["bias"]
        x = jax.nn.gelu(x) if i < LAYERS - 1 else x
    return x


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((forward(params, x) - y) ** 2)


def main():
    params = init(jax.random.PRNGKey(0))
    teacher = init(jax.random.PRNGKey(1))
    scheme = pj.Scheme({
        f"dense_{LAYERS - 1}/bias": pj.Full(),
        f"dense_{LAYERS - 2}/kernel": pj.Channels(ratio=0.25, axis="in"),
        f"dense_{LAYERS - 1}/kernel": pj.Channels(ratio=0.25, axis="in"),
    })
    grad_fn = pj.sparse_value_and_grad(loss_fn, scheme)
    opt = optax.adam(3e-3)
    opt_state = opt.init(pj.trainable_view(params, scheme))

    @jax.jit
    def step(params, opt_state, batch):
        loss, g = grad_fn(params, batch)
        updates, opt_state = opt.update(g, opt_state)
        return pj.apply_sparse_updates(params, updates, scheme), opt_state, loss

    key = jax.random.PRNGKey(2)
    x0 = jax.random.normal(key, (BATCH, WIDTH))
    batch0 = (x0, forward(teacher, x0))
    info = grad_fn.explain(params, batch0)
    print(info)
    dense = jax.jit(jax.grad(loss_fn)).lower(params, batch0).compile().cost_analysis()
    sparse = jax.jit(grad_fn).lower(params, batch0).compile().cost_analysis()
    first = lambda c: (c[0] if isinstance(c, list) else c)["flops"]
    print(f"gradient GFLOP: dense jax.grad {first(dense) / 1e9:.3f}, sparse_grad {first(sparse) / 1e9:.3f} "
          f"({first(sparse) / first(dense):.2f}x)")

    want = pj.trainable_view(jax.grad(loss_fn)(params, batch0), scheme)
    got = grad_fn(params, batch0)[1]
    err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12))
              for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
    print(f"max relative difference to sliced jax.grad: {err:.2e}")
    assert err < 1e-5, "sparse gradient does not match dense jax.grad"

    for i in range(STEPS):
        key, sub = jax.random.split(key)
        x = jax.random.normal(sub, (BATCH, WIDTH))
        params, opt_state, loss = step(params, opt_state, (x, forward(teacher, x)))
        if i % 10 == 0 or i == STEPS - 1:
            print(f"step {i:3d}  loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
